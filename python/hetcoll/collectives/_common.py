"""What every algorithm of the package shares: the algorithm names and their codes, the message
tags (one table, so that no two exchanges share a tag), argument checks, and reusable scratch."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import TypeVar

import numpy as np

from hetcoll import _core

ArrayT = TypeVar("ArrayT")

ALGORITHMS = ("auto", "ring", "native", "direct", "shared")
_TAG = 4831  # ring allreduce messages: _TAG + step
_TAG_DIRECT = 24831  # direct allreduce: weight, then data
_TAG_GATHER_DIRECT = 34831  # direct allgatherv
_TAG_WEIGHT = 44831  # ring allreduce: a rank's weight to its right neighbour
_TAG_GATHER = 14831  # ring allgatherv messages: _TAG_GATHER + step
_TAG_GATHER_HEAD = 54831  # allgatherv's speculative round: header, then predicted bytes
_TAG_GATHER_DATA = 64831
_TAG_GATHER_REST = 74831  # the bytes of pieces longer than predicted
_GATHER_OUT, _GATHER_IN = 4, 5  # scratch slots of allgatherv's batched round
_KIND_CODE = {"float32": 1, "float64": 2, "float16": 3, "bfloat16": 4}
_NO_SHARED = (
    'algorithm: "shared" needs an MPI communicator whose ranks are all on one node, got {} '
    "with ranks on several nodes or no shared memory"
)


# Looked up by dtype on every call (``dtype.name`` builds its string anew each time).
_KIND_OF = {np.dtype(t): np.dtype(t).name for t in (np.float32, np.float64, np.float16)}


def _kind(view: np.ndarray, bf16: bool) -> str:
    if bf16:
        return "bfloat16"
    name = _KIND_OF.get(view.dtype)
    if name is None:
        raise TypeError(
            f"buf: dtype {view.dtype.name} is not supported (float32, float64, float16, bfloat16)"
        )
    return name


def _segment_bytes(segment_bytes: object) -> None:
    """The collectives' ``segment_bytes``: an integer that an agreement's int64 carries, or
    None; ``ValueError`` naming it otherwise."""
    if segment_bytes is not None and (
        isinstance(segment_bytes, bool)
        or not isinstance(segment_bytes, int)
        or not 1 <= segment_bytes < 2**62
    ):
        raise ValueError(
            f"segment_bytes: must be an integer in [1, 2**62) or None, got {segment_bytes!r}"
        )


def _counts(n: int, p: int, speeds: Sequence[float] | None) -> list[int]:
    if speeds is None:
        return _core.split(n, [1.0] * p)
    if isinstance(speeds, (str, bytes, Mapping)) or not hasattr(speeds, "__len__"):
        # a dict's keys were read as the speeds; 5 raised "has no len()"
        raise ValueError(f"speeds: must be a sequence of numbers, one per rank, got {speeds!r}")
    if len(speeds) != p:
        raise ValueError(f"speeds: has {len(speeds)} entries but the communicator has {p} ranks")
    return _core.split(n, speeds)


_SCRATCH = threading.local()


def _scratch(slot: int, n: int, dtype: np.dtype) -> np.ndarray:
    """``n`` elements of reusable scratch: a fresh buffer each call would page-fault its whole
    size again (tens of ms for the chunks of a 256 MB allreduce). Slots in use: 0 and 1 the
    ring, 3 the direct allreduce, :data:`_GATHER_OUT` and :data:`_GATHER_IN` allgatherv's
    batched round."""
    pool: dict[int, np.ndarray] | None = getattr(_SCRATCH, "pool", None)
    if pool is None:
        pool = _SCRATCH.pool = {}
    nbytes = n * dtype.itemsize
    buf = pool.get(slot)
    if buf is None or buf.nbytes < nbytes:
        buf = pool[slot] = np.empty(nbytes, np.uint8)
    return buf[:nbytes].view(dtype)
