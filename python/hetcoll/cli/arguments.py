"""How the ``hetcoll`` command meets bad input: argument types that refuse a bad flag while the
command line is parsed, and a parser whose errors are one line on stderr and exit status 2; and
how it meets failed output: a write that fails is one line and exit status 1, JSON is strict.

Every subcommand's parser is a :class:`Parser` (``add_subparsers`` makes its children of the
parent's class), so argparse's own errors (a missing flag, an unknown choice) and the types'
errors read alike: ``hetcoll plan: error: argument --batch: must be an integer >= 1, got '0'``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from hetcoll.errors import shown
from hetcoll.model.terms import MAX_SAMPLES

# The largest batch or split the command accepts: the performance model's.
MAX_UNITS = MAX_SAMPLES


#: The formats a plot is written in (``--plot``'s extension; matplotlib with Pillow writes each).
PLOT_FORMATS = ("png", "svg", "pdf", "eps", "ps", "jpg", "jpeg", "tif", "tiff")


class CommandFailed(Exception):
    """A command that could not finish for a reason it states (a write that failed): one line
    on stderr and exit status 1, not 2 (the command line was good)."""


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr (no usage block), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def integer(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``[minimum, maximum]``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # also the digits past int()'s limit (4,300)
            raise argparse.ArgumentTypeError(f"expected an integer, got {shown(text)}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {shown(text)}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {shown(text)}")
        return value

    return parse


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {shown(text)}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {shown(text)}")
    return value


def floats(text: str) -> list[float]:
    """An argparse ``type``: comma-separated numbers (their range is the library's to check)."""
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {shown(text)}"
        ) from None


def ints(text: str) -> list[int]:
    """An argparse ``type``: comma-separated integers."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {shown(text)}"
        ) from None


def nonempty_path(text: str) -> str:
    """An argparse ``type``: a path, not empty (``''`` would read as "not given", or as the
    working directory)."""
    if not text:
        raise argparse.ArgumentTypeError("empty path")
    return text


def writable_file(text: str) -> str:
    """An argparse ``type``: a file path the command can create or overwrite, checked before
    any work starts (a plot or plan written after a minute of work should not fail then). A
    write can still fail (a full disk): the command catches that and says so."""
    nonempty_path(text)
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{shown(text)} is a directory, expected a file path")
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(
            f"cannot write {shown(text)}: no directory {shown(parent)}"
        )
    if not os.access(parent, os.W_OK) or (os.path.exists(text) and not os.access(text, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {shown(text)}: permission denied")
    return text


def plot_file(text: str) -> str:
    """An argparse ``type``: a :func:`writable_file` whose extension names a format matplotlib
    writes (without one, matplotlib would add ``.png`` and write another file than the one
    named)."""
    nonempty_path(text)
    extension = os.path.splitext(text)[1].lower().removeprefix(".")
    if extension not in PLOT_FORMATS:
        raise argparse.ArgumentTypeError(
            f"expected a file name ending in .{', .'.join(PLOT_FORMATS)}, got {shown(text)}"
        )
    return writable_file(text)


def write_failed(option: str, file: str, e: OSError) -> CommandFailed:
    """The one-line failure of writing ``file``, named by ``option``."""
    return CommandFailed(f"{option}: cannot write {shown(file)}: {e.strerror or e}")


class StdoutFailed(Exception):
    """Writing to stdout failed (a full disk, an I/O error): the :class:`GuardedStdout`'s
    ``OSError``, told apart from the command's other ``OSError``."""


class GuardedStdout:
    """``sys.stdout`` while a command runs: its writes' ``OSError`` (a broken pipe aside, which
    ends quietly) raised as :class:`StdoutFailed`; everything else the stream's."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return int(self._stream.write(text))
        except BrokenPipeError:
            raise
        except OSError as e:
            raise StdoutFailed(e.strerror or str(e)) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as e:
            raise StdoutFailed(e.strerror or str(e)) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def end_quietly_on_broken_pipe() -> int:
    """What a command does when its reader went away (``hetcoll plan --json | head``): the
    standard recipe, stdout pointed at /dev/null so that the interpreter's final flush does
    not raise again, and exit status 1 (no traceback)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # no file behind it (a test's capture)
        return 1
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    return 1


def strict_json(value: Any, indent: int | None = None, *, measured: bool = False) -> str:
    """``value`` as strict JSON, which has no Infinity or NaN: an infinite float (the step
    time of an infeasible plan) is written ``null``; a NaN is a bug, a :class:`CommandFailed`
    naming where it is rather than a file other JSON readers refuse. ``measured``: ``value``
    holds measurements, where a NaN is data (a diverged loss), written ``null`` too."""

    def clean(x: Any, where: str) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            if math.isnan(x) and not measured:
                raise CommandFailed(
                    f"--json: {where or 'the result'} is NaN (a bug: please report it)"
                )
            return None
        if isinstance(x, dict):
            return {k: clean(v, f"{where}.{k}" if where else str(k)) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v, f"{where}[{i}]") for i, v in enumerate(x)]
        return x

    return json.dumps(clean(value, ""), allow_nan=False, indent=indent)
