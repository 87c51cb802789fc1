"""allgatherv's first round, whatever carries it: every rank's header (its length along axis 0,
codes of the trailing shape and dtype, the number of dimensions, the algorithm, the rows of its
``out``), and the check that all but the lengths agree and that every ``out`` holds the pieces,
raising :class:`hetcoll.CollectiveMismatchError` on every rank (a rank's own ``out``: its
``ValueError``).
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
    """The fields of allgatherv's first round but the length (slot 0) and the rows of ``out``
    (slot 5): codes of the trailing shape and the dtype, the number of dimensions, the
    algorithm. Cached: read-only."""
    fields = np.array(
        [
            0,
            _shape_code(trailing),
            zlib.crc32(dtype.encode()),
            len(trailing) + 1,
            ALGORITHMS.index(algorithm) if algorithm in ALGORITHMS else _FAILED,
            NO_OUT,
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


#: allgatherv's first-round header words, in order (the length first, the rows of ``out``
#: last: the words between them must agree).
_FIELDS = ("length", "shape[1:]", "dtype", "number of dimensions", "algorithm", "out's rows")
_OUT = len(_FIELDS) - 1
#: The out word of a rank that passed no ``out``.
NO_OUT = -1


def _fields(shape: Sequence[int], dtype: str, algorithm: str, out_rows: int = NO_OUT) -> np.ndarray:
    """This rank's header: :func:`_header` with its length along axis 0 in word 0 and the
    rows of its ``out`` (``NO_OUT``: none) in the last."""
    fields = _header(tuple(shape[1:]), dtype, algorithm).copy()
    fields[0] = shape[0]
    fields[_OUT] = out_rows
    return fields


def _agreed_lengths(rows: np.ndarray, rank: int) -> np.ndarray:
    """Word 0 of every rank's header (``rows``, one per rank), once the other words agree and
    every rank's ``out`` holds all the pieces; else the error every rank raises, as all see
    the same rows: a :class:`CollectiveMismatchError` (:class:`_PeerFailed` first if a rank's
    own arguments failed), or, on the rank (``rank``: this one) whose ``out`` has other rows,
    its ``ValueError``."""
    if (rows[:, 4] == _FAILED).any():
        raise _PeerFailed("a rank failed on its own arguments")
    for j in range(1, _OUT):
        if (rows[:, j] != rows[0, j]).any():
            _disagree(j, rows[:, j])
    total = int(rows[:, 0].sum())
    wrong = [q for q, n in enumerate(rows[:, _OUT].tolist()) if n != NO_OUT and n != total]
    if wrong:
        q = wrong[0]
        has = f"has {int(rows[q, _OUT])} rows along axis 0, the pieces hold {total}"
        if q == rank:
            raise ValueError(f"out: {has}")
        raise CollectiveMismatchError(f"out: rank {q}'s {has}")
    return rows[:, 0]


def _exchange_shapes(
    c: Communicator,
    shape: Sequence[int],
    dtype: str,
    deadline: float | None,
    algorithm: str,
    out_rows: int = NO_OUT,
) -> np.ndarray:
    """Every rank's length along axis 0, after checking the rest of the shape, the dtype, the
    algorithm and every rank's ``out_rows``."""
    return _agreed_lengths(
        c.allgather_int64(_fields(shape, dtype, algorithm, out_rows), deadline), c.rank
    )


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
