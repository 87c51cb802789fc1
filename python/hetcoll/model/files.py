"""The small files a user names (a cluster description, a run's measured expert loads, a model's
config): only a regular file is read, and only up to a bound, so that a device (``/dev/zero``), a
FIFO without a writer or a huge file ends in an error naming it instead of a hang or a process
out of memory."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def read_small_file(path: str | Path, what: str, limit: int, *, too_long: str = "") -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them; ``ValueError``
    naming ``path`` and ``what`` it should be (``"a cluster file is a TOML file"``) where it
    cannot be read, is no regular file, or is longer (``too_long``: what to do then).

    >>> read_small_file("/dev/zero", "a cluster file is a TOML file", 1024)
    Traceback (most recent call last):
    ...
    ValueError: /dev/zero: not a regular file (a cluster file is a TOML file)
    """
    p = Path(path)
    try:
        # Non-blocking, so that a FIFO without a writer does not hang the open; then only a
        # regular file is read, and at most limit + 1 bytes of it (not /dev/zero for ever).
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError(f"{p}: not a regular file ({what})")
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read(limit + 1)
        finally:
            os.close(fd)
    except OSError as e:
        raise ValueError(f"{p}: cannot read it ({what}): {e.strerror}") from None
    if len(data) > limit:
        raise ValueError(f"{p}: longer than {limit:,} bytes ({what}){too_long}")
    return data
