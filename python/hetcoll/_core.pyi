"""Type stubs of the Rust extension ``hetcoll._core`` (checked by ``mypy.stubtest``)."""

from collections.abc import Sequence

import numpy as np

__all__ = [
    "__version__",
    "finish_times",
    "num_threads",
    "pack_into",
    "ring_schedule",
    "split",
    "unpack_from",
    "weighted_sum_into",
]
__version__: str

def split(
    total: int,
    speeds: Sequence[float],
    *,
    latency: Sequence[float] | None = None,
    capacity: Sequence[int] | None = None,
    multiple_of: int = 1,
    minimum: int = 0,
) -> list[int]:
    """Integer shares with sum ``total`` minimising ``max_i(latency[i] + shares[i] / speeds[i])``.

    Constraints: ``minimum <= shares[i] <= capacity[i]`` and ``shares[i] % multiple_of == 0``.
    Exact (greedy over unit increments, found by bisection); among optimal splits it returns the
    one that gives each unit to the rank finishing earliest after taking it, lowest rank on ties.
    Malformed or infeasible input raises ``ValueError`` naming the argument.

    >>> split(100, [3.0, 1.0])
    [75, 25]
    """

def finish_times(
    shares: Sequence[int], speeds: Sequence[float], *, latency: Sequence[float] | None = None
) -> list[float]:
    """Seconds at which each rank finishes: ``latency[i] + shares[i] / speeds[i]``."""

def weighted_sum_into(
    arrays: Sequence[np.ndarray],
    weights: Sequence[float],
    out: np.ndarray,
    *,
    bfloat16: bool = False,
) -> None:
    """``out[k] = sum_i weights[i] * arrays[i][k]``; ``out`` may be one of ``arrays``."""

def num_threads() -> int:
    """Threads the kernels use: ``HETCOLL_NUM_THREADS`` if set, else every core."""

def pack_into(
    arrays: Sequence[np.ndarray], out: np.ndarray, *, scale: float = 1.0, bfloat16: bool = False
) -> None:
    """``out = scale * concat(arrays)``; ``arrays`` C-contiguous, any shape, ``out``'s dtype."""

def unpack_from(
    flat: np.ndarray, arrays: Sequence[np.ndarray], *, scale: float = 1.0, bfloat16: bool = False
) -> None:
    """``arrays[i] = scale * flat[o_i : o_i + arrays[i].size]`` in place, ``o_i`` running sizes."""

def ring_schedule(
    counts: Sequence[int], rank: int, segment: int
) -> list[tuple[bool, list[tuple[int, int]], list[tuple[int, int]]]]:
    """The ``2 (p - 1)`` ring-allreduce steps of ``rank``: (reduce?, sent, received segments).

    Chunk ``c`` is ``counts[c]`` elements; segments are element ranges ``[lo, hi)`` of at most
    ``segment`` elements. Reduce-scatter steps come first; afterwards rank ``r`` owns chunk ``r``.
    """
