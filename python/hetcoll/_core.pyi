"""Type stubs of the Rust extension ``hetcoll._core`` (checked by ``mypy.stubtest``)."""

from collections.abc import Sequence

import numpy as np

__all__ = [
    "__version__",
    "chain_stage_times",
    "finish_times",
    "km1",
    "num_threads",
    "pack_into",
    "partition_chain",
    "partition_hypergraph",
    "partition_items",
    "refine_items",
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
    """Threads the kernels use: ``HETCOLL_NUM_THREADS`` if set, else the node's cores divided
    among the job's ranks on it."""

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

def partition_chain(
    costs: Sequence[float],
    speeds: Sequence[float],
    *,
    boundary_bytes: Sequence[float] | None = None,
    bandwidth: float | None = None,
    memory: Sequence[float] | None = None,
    capacity: Sequence[float] | None = None,
) -> list[int]:
    """Layers per device (in device order) of contiguous pipeline stages, smallest bottleneck.

    Stage ``d`` holding layers ``[i, j)`` takes ``sum(costs[i:j]) / speeds[d]`` seconds plus, when
    ``j < len(costs)``, ``boundary_bytes[j - 1] / bandwidth`` to send its output on (the last stage
    sends nothing). A device may get 0 layers (its stage is skipped). Exact: probe + bisection
    (Pinar & Aykanat 2004) over the bit patterns of doubles, so the bottleneck equals the
    brute-force optimum as computed in floating point. ``boundary_bytes`` (``len(costs) - 1``
    entries, bytes) and ``bandwidth`` (bytes per second) come together or not at all.

    ``memory`` (bytes of each layer: parameters, optimizer state, activations) and ``capacity``
    (bytes each device may hold), together or not at all: the stages also fit, the bottleneck is
    the smallest among placements that fit (still exact), and a request none fits raises
    ``ValueError`` saying by how much (the total need against the total capacity, a layer larger
    than every device, or the layers left over when the devices are filled in order).

    >>> partition_chain([1.0] * 8, [3.0, 1.0])
    [6, 2]
    >>> partition_chain([1.0] * 8, [3.0, 1.0], memory=[1.0] * 8, capacity=[4.0, 8.0])
    [4, 4]
    """

def chain_stage_times(
    costs: Sequence[float],
    speeds: Sequence[float],
    layers: Sequence[int],
    *,
    boundary_bytes: Sequence[float] | None = None,
    bandwidth: float | None = None,
) -> list[float]:
    """Seconds of each stage for ``layers`` per device, in the cost model of ``partition_chain``."""

def partition_items(
    loads: Sequence[float],
    speeds: Sequence[float],
    *,
    capacity: Sequence[int] | None = None,
    max_nodes: int | None = None,
    gap: float = 0.0,
) -> tuple[list[int], bool]:
    """Each item's device, any items on any device, and whether that is proved optimal.

    Item ``i`` carries ``loads[i]`` (an expert's routed tokens, any work), device ``d`` runs
    ``speeds[d]`` per second and holds at most ``capacity[d]`` items; the assignment minimises
    the slowest device's ``sum(loads of its items) / speeds[d]`` (scheduling on uniformly related
    machines; NP-hard). Branch and bound over the items in decreasing load from the greedy
    schedule, cut by the fluid bound, devices of equal speed, room and load tried once; exact
    (the flag is True) when it ends within ``max_nodes`` nodes (default 200000), else the best
    found, never worse than greedy. With ``gap`` > 0 it seeks only bottlenecks below the best
    found over ``1 + gap`` and stops at the lower bound times ``1 + gap``: the flag then says the
    answer is proved within that fraction of the optimum (most searches end at once). Items of
    zero load go, after the others, where items per speed
    stay lowest; a device of speed 0 holds only those. Deterministic: every rank solving the same
    inputs gets the same answer. A request none fits raises ``ValueError`` naming ``capacity``
    (or ``speeds``, where devices of speed 0 leave too little room).

    >>> partition_items([9.0, 9.0, 1.0, 1.0], [1.0, 1.0])
    ([0, 1, 0, 1], True)
    """

def refine_items(
    loads: Sequence[float],
    speeds: Sequence[float],
    owner: Sequence[int],
    *,
    capacity: Sequence[int] | None = None,
) -> list[int]:
    """``owner`` (each item's device) improved a step at a time, few items moving.

    Each step moves one item off the slowest device (largest ``sum(loads) / speeds[d]``), or
    swaps it there for a lighter item of another device: the step leaving the larger of the two
    devices' times lowest, taken only if that is below the slowest device's; it stops when no
    step is, or after ``2 * len(loads) + 2`` steps. The slowest device's time never rises; a
    device receives an item only with room for it under ``capacity`` (the most items each holds),
    and swaps keep every device's count. Ties go to the lower item, then device, a move before
    a swap: deterministic. The local counterpart of :func:`partition_items`, which may move most
    items for a small gain. It moves items off the slowest device only, so a device that starts
    over its ``capacity`` may end over it, and one of speed 0 keeps loaded items where no single
    step helps: :func:`partition_items` places them anew. Bad input raises ``ValueError`` naming
    the argument.

    >>> refine_items([9.0, 9.0, 1.0, 1.0], [1.0, 1.0], [0, 0, 1, 1])
    [1, 0, 0, 1]
    """

def partition_hypergraph(
    num_vertices: int,
    nets: Sequence[Sequence[int]] | Sequence[np.ndarray],
    targets: Sequence[float] | np.ndarray,
    *,
    vertex_weights: Sequence[float] | np.ndarray | None = None,
    net_weights: Sequence[float] | np.ndarray | None = None,
    epsilon: float = 0.03,
    seed: int = 0,
    vertex_memory: Sequence[float] | np.ndarray | None = None,
    capacity: Sequence[float] | np.ndarray | None = None,
) -> np.ndarray:
    """Block (``int64``) of each vertex of a k-way partition, ``k = len(targets)``.

    Block ``b`` weighs at most ``(1 + epsilon) * targets[b] * sum(vertex_weights)`` (targets are
    positive and sum to 1); among such partitions it seeks a small connectivity minus one
    (``km1``). Multilevel (heavy-edge clustering, recursive-bisection initial partitions, k-way FM
    and flow refinement; on inputs up to 50,000 vertices, the cheapest ordered split of the vertex
    order, a pipeline for a network's layers, competes), deterministic for a ``seed``, GIL
    released. Balance is never violated: if no balanced partition exists (or none is found)
    ``ValueError`` says so.

    ``vertex_memory`` (bytes each vertex needs) and ``capacity`` (bytes block ``b`` may hold, one
    per block), together or not at all: every block also holds at most its capacity. Requests that
    cannot fit raise ``ValueError`` with the shortfall (total need against total capacity, or a
    vertex larger than every block); when no fitting balanced partition is found it says so.

    >>> partition_hypergraph(4, [[0, 1], [2, 3], [1, 2]], [0.5, 0.5]).tolist()
    [0, 0, 1, 1]
    """

def km1(
    nets: Sequence[Sequence[int]] | Sequence[np.ndarray],
    parts: Sequence[int] | np.ndarray,
    net_weights: Sequence[float] | np.ndarray | None = None,
) -> float:
    """``sum_e net_weights[e] * (number of blocks net e touches - 1)``."""
