"""allgatherv's first round, whatever carries it: every rank's header (its length along axis 0,
codes of the trailing shape and dtype, the number of dimensions, the algorithm), and the check
that all but the length agree, raising :class:`hetcoll.CollectiveMismatchError` on every rank.
Also the size of allreduce's agreement message (:func:`_inline_words`)."""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence

import numpy as np

from hetcoll.collectives import _tuning
from hetcoll.collectives._common import ALGORITHMS
from hetcoll.comm import Communicator
from hetcoll.errors import CollectiveMismatchError


def _shape_code(shape: Sequence[int]) -> int:
    return zlib.crc32(np.asarray(shape, np.int64).tobytes())


@functools.lru_cache(maxsize=256)
def _header(trailing: tuple[int, ...], dtype: str, algorithm: str) -> np.ndarray:
    """The fields of allgatherv's first round but the length (slot 0): codes of the trailing
    shape and the dtype, the number of dimensions, the algorithm. Cached: read-only."""
    fields = np.array(
        [
            0,
            _shape_code(trailing),
            zlib.crc32(dtype.encode()),
            len(trailing) + 1,
            ALGORITHMS.index(algorithm) if algorithm in ALGORITHMS else _FAILED,
        ],
        np.int64,
    )
    fields.flags.writeable = False
    return fields


#: The algorithm word of a rank whose own arguments failed (:data:`FAILED`): it still sends a
#: header, with nothing to gather, so that the others raise at once.
_FAILED = -1
#: The algorithm name a failing rank passes to :func:`_fields`.
FAILED = "(failed)"


class _PeerFailed(CollectiveMismatchError):
    """A rank's header says its own arguments failed (raised on every rank alike)."""


#: allgatherv's first-round header words, in order (the length first).
_FIELDS = ("length", "shape[1:]", "dtype", "number of dimensions", "algorithm")


def _fields(shape: Sequence[int], dtype: str, algorithm: str) -> np.ndarray:
    """This rank's header: :func:`_header` with its length along axis 0 in word 0."""
    fields = _header(tuple(shape[1:]), dtype, algorithm).copy()
    fields[0] = shape[0]
    return fields


def _agreed_lengths(rows: np.ndarray) -> np.ndarray:
    """Word 0 of every rank's header (``rows``, one per rank), once the other words agree;
    else the :class:`CollectiveMismatchError` every rank raises, as all see the same rows
    (:class:`_PeerFailed` first if a rank's own arguments failed)."""
    if (rows[:, 4] == _FAILED).any():
        raise _PeerFailed("a rank failed on its own arguments")
    for j in range(1, len(_FIELDS)):
        if (rows[:, j] != rows[0, j]).any():
            _disagree(j, rows[:, j])
    return rows[:, 0]


def _exchange_shapes(
    c: Communicator, shape: Sequence[int], dtype: str, deadline: float | None, algorithm: str
) -> np.ndarray:
    """Every rank's length along axis 0, after checking the rest of the shape, the dtype and the
    algorithm."""
    return _agreed_lengths(c.allgather_int64(_fields(shape, dtype, algorithm), deadline))


def _disagree(field: int, per_rank: np.ndarray) -> None:
    """Raise the :class:`CollectiveMismatchError` of header word ``field``, whose value on each
    rank is ``per_rank`` (every rank raises: all see the same words)."""
    if _FIELDS[field] == "algorithm":
        listed = ", ".join(f"rank {r}: {ALGORITHMS[int(a)]!r}" for r, a in enumerate(per_rank))
        raise CollectiveMismatchError(f"algorithm: ranks disagree ({listed})")
    raise CollectiveMismatchError(
        f"local: ranks disagree on {_FIELDS[field]}; every piece must match but along axis 0"
    )


def _inline_words(p: int) -> int:
    """int64 words a rank adds to allreduce's agreement (:data:`CHECK_INLINE_BYTES` over
    ``p`` ranks, at least one): the same on every rank, whatever path its buffer takes, so
    that every rank's agreement message has one size."""
    return max(1, _tuning.CHECK_INLINE_BYTES // (8 * p))
