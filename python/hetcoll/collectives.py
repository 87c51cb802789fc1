"""Collectives over uneven shards: the weighted allreduce and allgatherv, on MPI or torch.

- :func:`allreduce` — in place, ``buf <- sum over ranks r of weight_r * buf_r``. "ring" is a
  reduce-scatter + allgather over chunks sized by :func:`hetcoll.split` (even by default,
  proportional to ``speeds`` when given), scheduled in Rust (``schedules/ring.rs``), reduced by
  the Rust ``weighted_sum`` kernel with the weight fused into the reduction and the GIL
  released, moved by the engine's non-blocking send/recv and pipelined segment by segment.
  "native" pre-scales in Rust and calls the engine's allreduce SUM (on gloo from 16 MiB, on
  two ranks from 4 MiB, in two halves at once, one per worker thread of the process group).
  "direct" sends the raw buffer and the weight to every other rank in one round of
  non-blocking messages and forms the weighted sum in rank order in one Rust pass (the weights
  fused, the fewest message latencies; ``p - 1`` buffers of traffic and scratch per rank, so
  "auto" takes it only for small buffers on more than two ranks). "shared" (MPI, every
  rank on one node) sums through MPI-3 shared-memory windows that every rank maps, in pieces,
  the weights fused into one Rust pass (:func:`_shared`); "auto" takes it there from 16 KiB.
- :func:`allgatherv` — pieces of different lengths along axis 0 (MPI_Allgatherv; on gloo, whose
  all_gather rejects uneven pieces, all_to_all_single with uneven splits).
- :func:`allgatherv_autograd` — the same for torch tensors that carry gradients: the gradient
  of a rank's piece is its slice of the output gradient summed over ranks (a reduce-scatter).

Every call takes ``timeout`` (seconds): a dead or silent peer raises
:class:`hetcoll.CollectiveTimeout` instead of hanging. ``check=True`` first compares length,
dtype, algorithm and chunk shares across ranks and raises :class:`hetcoll.CollectiveMismatchError`
on every rank when they differ.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
import zlib
from collections import deque
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

from hetcoll import _core
from hetcoll.comm import (
    Communicator,
    NodeWindows,
    Request,
    agree,
    same_rows,
    wait_all,
    wrap,
)
from hetcoll.comm import deadline as deadline_of
from hetcoll.errors import CollectiveMismatchError
from hetcoll.kernels import is_tensor, numpy_view

__all__ = [
    "ALGORITHMS",
    "BATCHED_GATHER_BYTES",
    "DIRECT_BYTES",
    "DIRECT_TWO_RANKS_FROM_BYTES",
    "GATHER_PERIODS",
    "GATHER_RING_CROSSOVER_BYTES",
    "NATIVE_HALVES_FROM_BYTES",
    "NATIVE_HALVES_TWO_RANKS_FROM_BYTES",
    "RING_CROSSOVER_BYTES",
    "RING_TWO_RANKS_FROM_BYTES",
    "SEGMENT_BYTES",
    "SHARED_FROM_BYTES",
    "SHARED_GATHER_BELOW_BYTES",
    "SHARED_ONE_ROUND_BYTES",
    "SHARED_SEGMENT_BYTES",
    "SPECULATIVE_GATHER_ENGINES",
    "TWO_RANK_SEGMENT_BYTES",
    "allgatherv",
    "allgatherv_autograd",
    "allreduce",
]

ArrayT = TypeVar("ArrayT")

ALGORITHMS = ("auto", "ring", "native", "direct", "shared")
#: "shared" (MPI, every rank on one node): each rank's segment in each of the two
#: shared-memory windows (:class:`hetcoll.comm.NodeWindows`); larger buffers go through them in
#: pieces of this size, which stay in the caches between a rank writing them and its peers
#: reading them. Paired on one 2-core host, at 4, 16 and 64 MiB on two and four MPI ranks,
#: 1 MiB pieces took 0.26-0.68x MPI_Allreduce's time; 16 MiB pieces 0.78-1.45x at 16 MiB,
#: where they leave the caches; 256 KiB-2 MiB pieces within 0.03-0.2x of 1 MiB.
SHARED_SEGMENT_BYTES = 1 << 20
#: "shared" sums a piece in one round (every rank sums the whole piece from every rank's
#: segment: one fence) while ``ranks * piece bytes`` is at most this; above it, in two (each
#: rank sums its own chunk, a fence, and every rank copies every chunk out). On one host, one
#: round took 0.50-0.54x MPI_Allreduce's time at 256 KiB where two took 0.59-0.63x; at 1 MiB on
#: four ranks two rounds won (0.50x against 0.60x).
SHARED_ONE_ROUND_BYTES = 1 << 20
#: allgatherv "auto" on one node carries the pieces through the windows while their total is
#: below this, per engine; from it, the windows' first round carries the headers (lengths and
#: agreement) and the pieces go as if "auto" had no windows (:data:`GATHER_RING_CROSSOVER_BYTES`).
#: Eight full runs of benches/bench_collectives.py on one host, against MPI_Allgather of the
#: same bytes: two ranks at 64 and 256 MiB, through the windows 0.95-1.06x in five runs and
#: 2.07-2.38x in three (each round copies every piece in and out, and when the host is busy that
#: traffic costs), the ring 0.99-1.35x in all eight; four ranks at 64-256 MiB, both about 1.2x on
#: average. At 16 MiB four ranks did better through the windows (1.07-1.40x, the ring 1.22-1.45x).
SHARED_GATHER_BELOW_BYTES: dict[str, float] = {"mpi": 64 << 20}
#: Ring segment: large enough that per-message overhead is small next to 1 MiB at ~1 GB/s,
#: small enough that reducing one segment overlaps receiving the next (gloo uses <= 1 MiB).
SEGMENT_BYTES = 1 << 20
#: ... except on two ranks of these engines, where the ring's segment defaults to this. There
#: each step's segments are only reduced, not forwarded, so cutting them pipelines less; and
#: MPICH's shared-memory transfers are copies on the same cores that reduce. Two MPI ranks,
#: 16-256 MiB: 16 MiB segments took 0.88-0.92x of MPI_Allreduce's time at 16 MiB where 1 MiB
#: segments took 1.02-1.08x, and 5-12% less at 64 and 256 MiB; on four ranks 1 MiB was best.
TWO_RANK_SEGMENT_BYTES: dict[str, int] = {"mpi": 16 << 20}
#: Message size above which "auto" picks the ring, per engine, from
#: benches/bench_collectives.py on one 2-core host: with MPICH the weighted ring took 0.46-0.64x
#: the time of MPI_Allreduce at 64 and 256 MiB (p = 2 and 4); at 16 MiB on 4 ranks 1.07-1.19x
#: in five runs, where the native path's pre-scale pass (four ranks sharing two cores) made it
#: 1.29-1.36x. At 4 MiB, with each chunk in one segment (one blocking exchange a step), the ring
#: took 1.14-1.27x and the native path 1.23-1.36x in three paired runs; at 1 MiB native won
#: (1.17-1.31x against 1.28-1.57x). On gloo with 4 ranks the ring took 0.99x of dist.all_reduce
#: from 64 MiB, where the native weighted path took 1.1-1.2x.
#: (Two ranks: :data:`RING_TWO_RANKS_FROM_BYTES`.) "auto" with chunk ``speeds`` is always the
#: ring.
RING_CROSSOVER_BYTES: dict[str, float] = {"mpi": 4 << 20, "gloo": 64 << 20}
#: Total output size above which "auto" allgatherv takes the ring, on engines without the
#: speculative round (:data:`SPECULATIVE_GATHER_ENGINES`, where "auto" is that round). MPICH's
#: Allgatherv with uneven pieces took seconds where Allgather of the same bytes took tens of
#: milliseconds (64 MiB, 4 ranks, one host); from benches/bench_collectives.py the ring beat it
#: from 1 MiB.
GATHER_RING_CROSSOVER_BYTES: dict[str, float] = {"mpi": 1 << 20}
#: "auto" picks "direct" on more than two ranks when the bytes a rank sends, ``(p - 1) * size``,
#: are at most this, per engine. From benches/bench_collectives.py on one 2-core host: with 4
#: ranks it beat gloo's allreduce up to 1 MiB (0.6-0.9x) and lost to MPICH's at every size. On
#: two ranks "auto" takes it only from :data:`DIRECT_TWO_RANKS_FROM_BYTES`: timed in loops of
#: back-to-back calls, two gloo ranks' native weighted path beat it in 35 of 36 cells at
#: 4-256 KiB over nine full runs (direct 1.0-2.2x of dist.all_reduce's time, native 0.8-1.5x;
#: single calls after a barrier had favoured it), and on two MPI ranks it lost to the ring from
#: 1 MiB.
DIRECT_BYTES: dict[str, float] = {"mpi": 0, "gloo": 3 << 20}
#: "auto" picks "shared" from this size, per engine, when every rank is on one node
#: (:meth:`hetcoll.comm.Communicator.node_windows`). On one 2-core host with 2 and 4 MPI ranks,
#: it took 0.55-0.72x MPI_Allreduce's time at 16-64 KiB and 1.15-1.8x at 4 KiB, where
#: MPI_Allreduce takes 5-40 µs and each fence (a barrier) several. In five later full runs of
#: benches/bench_collectives.py, two of them on a busier host: at 16 KiB 0.99-1.64x, where the
#: native weighted path took 1.22-1.44x (ahead of "shared" in the two busy runs, by 0.05-0.2x);
#: at 64 KiB 0.72-1.14x against 1.11-1.32x.
SHARED_FROM_BYTES: dict[str, float] = {"mpi": 16 << 10}
#: On two ranks "auto" picks the ring from this size up. Two MPI ranks, weighted, against
#: MPI_Allreduce: the ring 1.08-1.11x at 1 MiB (direct 1.08-1.16x, native 1.27x), 0.84-1.08x at
#: 4 MiB (direct 1.38-1.57x). Two gloo ranks, in loops of back-to-back calls, paired within
#: each repeat: at 16 MiB the ring took 0.88-0.93x the native weighted path's time in four full
#: runs (0.96-1.08x of dist.all_reduce's, native 1.10-1.18x); at 4 MiB 1.06-1.32x.
RING_TWO_RANKS_FROM_BYTES: dict[str, float] = {"mpi": 1 << 20, "gloo": 16 << 20}
#: On two ranks below :data:`RING_TWO_RANKS_FROM_BYTES`, "auto" picks "direct" from this size, per
#: engine. Two gloo ranks, weighted, timed in loops of back-to-back calls, the direct exchange's
#: time over the native path's paired within each repeat and pooled over runs (median [95% two-level
#: bootstrap interval], as benches/score_collectives.py pools): at 4 MiB 0.97x [0.92, 1.04] (native
#: in two halves) over eight full runs of benches/bench_collectives.py and 0.98x [0.93, 1.04] over
#: six runs of its gloo cells alone; 0.97x [0.93, 1.01], 1.00x [0.95, 1.04] and 0.93x [0.89, 0.96]
#: (native in one call) over eight, six and six runs of the allreduce variants alone. At 1 MiB no
#: side won: 1.07x [0.93, 1.19] and 1.06x [0.95, 1.16] in the benchmark's runs, 0.85x [0.71, 0.97]
#: and 0.93x [0.79, 1.04] in the others; below 1 MiB native won (see :data:`DIRECT_BYTES`). The
#: direct exchange moves the same bytes as the engine's ring on two ranks (the whole buffer each
#: way), in one step instead of two.
DIRECT_TWO_RANKS_FROM_BYTES: dict[str, float] = {"gloo": 4 << 20}
#: From this size, per engine, "native" hands the engine the buffer in two halves, both in
#: flight at once (each pre-scaled just before it goes): torch's gloo process group runs its
#: collectives on two worker threads by default, and one call keeps only one of them busy. On
#: one 2-core host, weighted, against one dist.all_reduce of the whole buffer, paired within
#: each repeat: four ranks at 16 MiB, 0.97-1.10x where one pre-scaled call took 1.08-1.18x (five
#: runs), at 32 MiB 0.97-1.05x against 1.04-1.07x; two ranks at 8-32 MiB 0.90-1.09x against
#: 1.04-1.14x. Below 16 MiB on four ranks the halves lost (1.36-1.40x at 4 MiB, 1.13x at 8).
#: Two ranks: :data:`NATIVE_HALVES_TWO_RANKS_FROM_BYTES`.
NATIVE_HALVES_FROM_BYTES: dict[str, float] = {"gloo": 16 << 20}
#: The same on two ranks, where the halves pay from 8 MiB. Timed in loops of back-to-back calls,
#: one pre-scaled call's time over the halves', paired within each repeat and pooled over runs
#: (median [95% two-level bootstrap interval], as benches/score_collectives.py pools): at 8 MiB
#: 1.08x [1.05, 1.14] (four runs; earlier, against one dist.all_reduce, the halves 0.90-1.06x
#: where one call took 1.06-1.16x); at 4 MiB 0.94x [0.89, 0.97] (six runs of 100 repeats: the
#: halves 1.15x of dist.all_reduce's time, one call 1.05x); at 2 MiB no clear gain either way.
NATIVE_HALVES_TWO_RANKS_FROM_BYTES: dict[str, float] = {"gloo": 8 << 20}
#: Engines on which allgatherv's first round, which every rank needs for the others' lengths,
#: is speculative: each rank sends its header and, in the same round, as many bytes of its piece
#: as the group's recent gathers predict (:func:`_predict`). When the prediction holds, as it
#: does for a filter-parallel layer's gathers every step, "auto" is done in that one round;
#: pieces longer than predicted send the rest in a second round. MPI keeps its own Allgatherv
#: after an allgather of the lengths.
SPECULATIVE_GATHER_ENGINES = ("gloo",)
#: The longest repeating pattern of gathers on a group that the prediction recognises: a model
#: whose step gathers at up to this many different shapes, in the same order every step.
GATHER_PERIODS = 16
#: A speculative round predicted to move at most this many bytes in all is one
#: ``all_to_all_single``: each rank's header and predicted bytes in one block per peer, copied
#: in and out of scratch. On two gloo ranks that took 1.0-1.15x an all_gather of the same bytes
#: up to 1 MiB where point-to-point messages took 1.6-1.9x (their waits are woken late on a busy
#: host twice as often), and on four ranks 0.3-0.6x. Larger rounds are point to point, each
#: piece straight into place, with no copy.
BATCHED_GATHER_BYTES = 4 << 20
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
_ALGO_CODE = {"ring": 1, "native": 2, "direct": 3, "shared": 4}


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


def _weight(weight: object) -> float:
    if isinstance(weight, bool) or not isinstance(weight, (int, float, np.floating, np.integer)):
        raise TypeError(f"weight: must be a number, got {type(weight).__name__}")
    w = float(weight)
    if not math.isfinite(w):
        raise ValueError(f"weight: must be finite, got {w}")
    return w


def _counts(n: int, p: int, speeds: Sequence[float] | None) -> list[int]:
    if speeds is None:
        return _core.split(n, [1.0] * p)
    if len(speeds) != p:
        raise ValueError(f"speeds: has {len(speeds)} entries but the communicator has {p} ranks")
    return _core.split(n, speeds)


def allreduce(
    buf: ArrayT,
    comm: Any = None,
    *,
    weight: float = 1.0,
    algorithm: str = "auto",
    speeds: Sequence[float] | None = None,
    check: bool = False,
    timeout: float | None = None,
    segment_bytes: int | None = None,
) -> ArrayT:
    """In place, ``buf <- sum over ranks r of weight_r * buf_r``; returns ``buf``.

    ``buf`` is a C-contiguous numpy array or CPU torch tensor (float32, float64, float16,
    bfloat16; 16-bit types are reduced in float32 and rounded at each ring hop). ``comm`` is
    anything :func:`hetcoll.comm.wrap` takes. ``weight`` is this rank's weight (ranks may
    differ). ``algorithm``: "ring", "native", "direct", "shared" (MPI, one node) or "auto" (see
    :data:`SHARED_FROM_BYTES`, :data:`DIRECT_BYTES` and :data:`RING_CROSSOVER_BYTES`, on two
    ranks :data:`DIRECT_TWO_RANKS_FROM_BYTES` and :data:`RING_TWO_RANKS_FROM_BYTES`; "auto"
    with ``speeds`` is "shared" where it runs, else the ring). ``speeds`` (one per rank, same
    on every rank) sizes the chunks of the ring and of "shared" with :func:`hetcoll.split`;
    chunk r is reduced last by rank r. Every rank ends with bitwise the same result. ``check``
    compares length, dtype, algorithm and speeds across ranks first (one small allgather).
    ``segment_bytes`` cuts the ring's messages (default :data:`SEGMENT_BYTES`, or
    :data:`TWO_RANK_SEGMENT_BYTES` on two ranks). A device tensor takes the native path, the
    weight fused by NCCL (``PREMUL_SUM``), or on other engines a torch pre-scale.

    >>> allreduce(grad, comm, weight=local_batch / global_batch)  # doctest: +SKIP
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm: must be one of {ALGORITHMS}, got {algorithm!r}")
    w = _weight(weight)
    deadline = deadline_of(timeout)
    if segment_bytes is not None and (not isinstance(segment_bytes, int) or segment_bytes < 1):
        raise ValueError(f"segment_bytes: must be an integer >= 1 or None, got {segment_bytes!r}")
    if is_tensor(buf) and buf.device.type != "cpu":  # type: ignore[attr-defined]
        return _allreduce_device(buf, comm, w, algorithm, check, deadline)
    view, bf16 = numpy_view(buf, "buf")
    if not view.flags.c_contiguous:
        raise ValueError("buf: must be C-contiguous (allreduce works in place)")
    if not view.flags.writeable:
        raise ValueError("buf: must be writeable (allreduce works in place)")
    kind = _kind(view, bf16)
    flat = view.reshape(-1)
    c = wrap(comm)
    if algorithm == "auto":
        algorithm = choose_algorithm(c, flat.nbytes, speeds is not None, deadline)
    windows = None
    if algorithm == "shared":
        windows = c.node_windows(SHARED_SEGMENT_BYTES, deadline)
        if windows is None:
            raise ValueError(_NO_SHARED.format(c.engine))
        if speeds is not None:
            _counts(1, c.size, speeds)  # the argument's errors now, not at the first piece
    counts = _counts(flat.size, c.size, speeds) if algorithm == "ring" else None
    if check:
        fields = {
            "length": flat.size,
            "dtype": _KIND_CODE[kind],
            "algorithm": _ALGO_CODE[algorithm],
            "chunk shares": zlib.crc32(np.asarray(counts or [], np.int64).tobytes()),
        }
        agree(c, fields, deadline)
    if c.size == 1 or flat.size == 0:
        if w != 1.0 and flat.size:
            _core.weighted_sum_into([flat], [w], flat, bfloat16=bf16)
        return buf
    if algorithm == "native":
        _native(c, flat, bf16, w, kind, deadline)
    elif algorithm == "direct":
        direct_allreduce(c, flat, bf16, w, deadline)
    elif algorithm == "shared":
        assert windows is not None
        _shared(c, windows, flat, bf16, w, kind, speeds, deadline)
    else:
        assert counts is not None
        if segment_bytes is None:
            two = TWO_RANK_SEGMENT_BYTES.get(c.engine) if c.size == 2 else None
            segment_bytes = SEGMENT_BYTES if two is None else two
        segment = max(1, segment_bytes // flat.itemsize)
        if max(counts) <= segment:
            _ring_blocking(c, flat, bf16, w, counts, deadline)
        else:
            _ring(c, flat, bf16, w, counts, segment, deadline)
    return buf


def choose_algorithm(
    c: Communicator, nbytes: int, chunk_speeds: bool, deadline: float | None = None
) -> str:
    """The algorithm "auto" stands for; the same on every rank (it reads only what ranks agree
    on: sizes, the rank count, the engine and whether the ranks share one node)."""
    if (
        c.size > 1
        and nbytes >= SHARED_FROM_BYTES.get(c.engine, math.inf)
        and c.node_windows(SHARED_SEGMENT_BYTES, deadline) is not None
    ):
        return "shared"
    if chunk_speeds:
        return "ring"
    if c.size == 2:
        if nbytes >= RING_TWO_RANKS_FROM_BYTES.get(c.engine, math.inf):
            return "ring"
        if nbytes >= DIRECT_TWO_RANKS_FROM_BYTES.get(c.engine, math.inf):
            return "direct"
        return "native"
    if c.size > 2 and (c.size - 1) * nbytes <= DIRECT_BYTES.get(c.engine, 0):
        return "direct"
    if nbytes >= RING_CROSSOVER_BYTES.get(c.engine, math.inf):
        return "ring"
    return "native"


def _native(
    c: Communicator, flat: np.ndarray, bf16: bool, w: float, kind: str, deadline: float | None
) -> None:
    """The weight fused into a Rust pre-scale, then the engine's allreduce: one call, or from
    :data:`NATIVE_HALVES_FROM_BYTES` (:data:`NATIVE_HALVES_TWO_RANKS_FROM_BYTES` on two ranks)
    two calls in flight at once, the second half pre-scaled while the first is under way."""
    halves = NATIVE_HALVES_TWO_RANKS_FROM_BYTES if c.size == 2 else NATIVE_HALVES_FROM_BYTES
    if flat.nbytes < halves.get(c.engine, math.inf):
        if w != 1.0:
            _core.weighted_sum_into([flat], [w], flat, bfloat16=bf16)
        c.allreduce_sum(flat, kind, deadline)
        return
    half = flat.size // 2
    requests = []
    for part in (flat[:half], flat[half:]) if half else (flat,):
        if w != 1.0:
            _core.weighted_sum_into([part], [w], part, bfloat16=bf16)
        requests.append(c.iallreduce_sum(part, kind))
    wait_all(requests, deadline)


def direct_allreduce(
    c: Communicator,
    flat: np.ndarray,
    bf16: bool,
    w: float,
    deadline: float | None,
    *,
    normalize: bool = False,
    tag: int = _TAG_DIRECT,
) -> None:
    """Every rank sends its raw buffer and its weight to every other rank (one round), then
    ``flat <- sum_q w_q * buf_q`` in rank order, in one Rust pass, on every rank alike.

    ``normalize`` divides the weights by their sum first (the weighted DDP hook: weights are
    sample counts); ``tag`` and ``tag + 1`` carry the weights and the data, so exchanges with
    different tags may run at once on different threads (each thread has its own scratch)."""
    p, r = c.size, c.rank
    weights = np.empty(p, np.float64)
    weights[r] = w
    got = _scratch(3, (p - 1) * flat.size, flat.dtype).reshape(p - 1, flat.size)
    peer = {q: got[q if q < r else q - 1] for q in range(p) if q != r}
    requests = []
    for q, into in peer.items():
        requests += [
            c.irecv(weights[q : q + 1], q, tag),
            c.irecv(into, q, tag + 1),
            c.isend(weights[r : r + 1], q, tag),
            c.isend(flat, q, tag + 1),
        ]
    wait_all(requests, deadline)
    if normalize:
        total = float(weights.sum())
        if not total > 0:
            raise ValueError(f"weight: the ranks' weights sum to {total}; normalizing needs > 0")
        weights /= total
    sources = [flat if q == r else peer[q] for q in range(p)]
    _core.weighted_sum_into(sources, [float(x) for x in weights], flat, bfloat16=bf16)


def _shared(
    c: Communicator,
    windows: NodeWindows,
    flat: np.ndarray,
    bf16: bool,
    w: float,
    kind: str,
    speeds: Sequence[float] | None,
    deadline: float | None,
) -> None:
    """``flat <- sum_q w_q * buf_q`` through memory every rank of the node maps, piece by
    piece (:data:`SHARED_SEGMENT_BYTES`), each piece in its own window of the two.

    A rank writes its weight, length and dtype into its header and its piece into its segment,
    and fences. In one round (small pieces, :data:`SHARED_ONE_ROUND_BYTES`) every rank then sums
    the whole piece from every rank's segment, in rank order. In two, rank r sums only its
    chunk (sized by :func:`hetcoll.split`, ``speeds`` when given) into its own segment, which
    no other rank reads until the second fence, after which every rank copies every chunk
    out: the weights fused into the one sum, every element summed once, the same bits
    everywhere. A rank's own chunk never goes through the window on the way in (only it reads
    it). The headers also hold each rank's length and dtype: ranks that disagree all raise
    :class:`hetcoll.CollectiveMismatchError` after the first fence, before anything is read."""
    p, r = c.size, c.rank
    per = windows.capacity // flat.itemsize
    code = float(_KIND_CODE[kind])
    chunked = 0  # the piece length ``counts`` were split for (every piece but the last shares it)
    for start in range(0, flat.size, per):
        piece = flat[start : start + per]
        m = piece.size
        i = windows.take()
        heads = windows.headers[i]
        segs = [s[: piece.nbytes].view(flat.dtype) for s in windows.segments[i]]
        heads[r][:3] = (w, flat.size, code)
        one_round = p * piece.nbytes <= SHARED_ONE_ROUND_BYTES
        if one_round:
            segs[r][:] = piece
        else:
            if m != chunked:
                counts = _counts(m, p, speeds)
                lo = sum(counts[:r])
                hi = lo + counts[r]
                chunked = m
            segs[r][:lo] = piece[:lo]
            segs[r][hi:] = piece[hi:]
        windows.fence(i, deadline)
        if start == 0:  # length and dtype, from every rank's header
            same_rows(("length", "dtype"), np.array([h[1:3] for h in heads], np.int64))
        weights = [float(h[0]) for h in heads]
        if one_round:
            sources = [piece if q == r else segs[q] for q in range(p)]
            _core.weighted_sum_into(sources, weights, piece, bfloat16=bf16)
            continue
        sources = [piece[lo:hi] if q == r else segs[q][lo:hi] for q in range(p)]
        _core.weighted_sum_into(sources, weights, segs[r][lo:hi], bfloat16=bf16)
        windows.fence(i, deadline)
        a = 0
        for q, n_q in enumerate(counts):
            piece[a : a + n_q] = segs[q][a : a + n_q]
            a += n_q


_NO_SHARED = (
    'algorithm: "shared" needs an MPI communicator whose ranks are all on one node, got {} '
    "with ranks on several nodes or no shared memory"
)


def _shared_round(
    c: Communicator,
    windows: NodeWindows,
    shape: Sequence[int],
    dtype: str,
    send: np.ndarray,
    row_bytes: int,
    deadline: float | None,
    algorithm: str,
    into_bytes: np.ndarray | None,
) -> tuple[list[int], np.ndarray | None]:
    """allgatherv's first round on one node, through the node windows, whatever the
    algorithm: every rank writes its header (:func:`_fields`) and, for "auto" and "shared", the
    first segment of its piece, and fences once. Every rank then reads the same headers, so
    ranks that disagree on shape, dtype or algorithm all raise. For "auto" and "shared" the
    pieces are then copied out (and their rest sent in further rounds, one fence each) into
    ``into_bytes`` if it has the right size, else a new array, which is returned with the
    lengths; for the other algorithms, and for "auto" from :data:`SHARED_GATHER_BELOW_BYTES`,
    only the lengths."""
    r = c.rank
    data = algorithm in ("auto", "shared")
    i = windows.take()
    heads = [h.view(np.int64)[: len(_FIELDS)] for h in windows.headers[i]]
    heads[r][:] = _fields(shape, dtype, algorithm)
    first = send[: windows.capacity] if data else send[:0]
    windows.segments[i][r][: first.size] = first
    windows.fence(i, deadline)
    lengths = [int(n) for n in _agreed_lengths(np.stack(heads))]
    counts = [n * row_bytes for n in lengths]
    total = sum(counts)
    if not data or (
        algorithm == "auto" and total >= SHARED_GATHER_BELOW_BYTES.get(c.engine, math.inf)
    ):
        return lengths, None
    recv = into_bytes if into_bytes is not None and into_bytes.size == total else None
    if recv is None:
        recv = np.empty(total, np.uint8)
    _copy_parts(r, first, windows.segments[i], recv, counts, 0, windows.capacity)
    _shared_gather(c, windows, send, recv, counts, deadline, windows.capacity)
    return lengths, recv


def _copy_parts(
    r: int,
    mine: np.ndarray,
    segs: list[np.ndarray],
    recv: np.ndarray,
    counts: Sequence[int],
    a: int,
    cap: int,
) -> None:
    """Bytes ``a`` to ``a + cap`` of every rank's piece from its segment (this rank's from
    ``mine``) to their places in ``recv``."""
    start = 0
    for q, n in enumerate(counts):
        part = min(cap, n - a)
        if part > 0:
            recv[start + a : start + a + part] = mine if q == r else segs[q][:part]
        start += n


def _shared_gather(
    c: Communicator,
    windows: NodeWindows,
    send: np.ndarray,
    recv: np.ndarray,
    counts: Sequence[int],
    deadline: float | None,
    start: int = 0,
) -> None:
    """Every rank's bytes from ``start`` on into ``recv`` at their offsets (``counts[q]``
    bytes from rank q), through the node windows: in each round every rank writes up to a
    segment of its piece into its segment, fences once, and copies every rank's part out. A
    window is written again two rounds later, after the next round's fence, when every rank has
    copied it out."""
    cap = windows.capacity
    r = c.rank
    for a in range(start, max(counts, default=0), cap):
        i = windows.take()
        segs = windows.segments[i]
        mine = send[a : a + cap]
        segs[r][: mine.size] = mine
        windows.fence(i, deadline)
        _copy_parts(r, mine, segs, recv, counts, a, cap)


_SCRATCH = threading.local()


def _scratch(slot: int, n: int, dtype: np.dtype) -> np.ndarray:
    """``n`` elements of reusable scratch: a fresh buffer each call would page-fault its whole
    size again (tens of ms for the chunks of a 256 MB allreduce)."""
    pool: dict[int, np.ndarray] | None = getattr(_SCRATCH, "pool", None)
    if pool is None:
        pool = _SCRATCH.pool = {}
    nbytes = n * dtype.itemsize
    buf = pool.get(slot)
    if buf is None or buf.nbytes < nbytes:
        buf = pool[slot] = np.empty(nbytes, np.uint8)
    return buf[:nbytes].view(dtype)


def _ring(
    c: Communicator,
    flat: np.ndarray,
    bf16: bool,
    w: float,
    counts: list[int],
    segment: int,
    deadline: float | None,
) -> None:
    """Reduce-scatter then allgather around the ring; see ``schedules/ring.rs``.

    Step t sends exactly the segments step t-1 received, so each segment goes out as soon as it
    is reduced; receives of step t+1 are posted before step t is processed. Two scratch buffers
    alternate between reduce-scatter steps; allgather receives land in ``flat`` directly.
    """
    p, r = c.size, c.rank
    right, left = (r + 1) % p, (r - 1) % p
    steps = _core.ring_schedule(counts, r, segment)
    biggest = max(counts)
    scratch = [_scratch(0, biggest, flat.dtype), _scratch(1, biggest, flat.dtype)]

    def post(t: int) -> list[Request]:
        reduce, _, recv = steps[t]
        base = recv[0][0]
        if reduce:
            return [c.irecv(scratch[t % 2][a - base : b - base], left, _TAG + t) for a, b in recv]
        return [c.irecv(flat[a:b], left, _TAG + t) for a, b in recv]

    # Step 0 sends this rank's raw chunk, which it never reduces, unscaled: the receiver applies
    # the sender's weight in its first reduction, so no pass scales it. The weight travels
    # ahead, 8 bytes from each rank to its right neighbour.
    _, send0, _ = steps[0]
    weights = np.array([w, 0.0])
    weight_in = c.irecv(weights[1:], left, _TAG_WEIGHT)
    weight_out = c.isend(weights[:1], right, _TAG_WEIGHT)
    recvs = post(0)
    sends = [c.isend(flat[a:b], right, _TAG) for a, b in send0]
    weight_in.wait(deadline)
    w_left = float(weights[1])
    last = len(steps) - 1
    # On two ranks the raw chunk sent at step 0 is the one step 1 receives the result into:
    # each of its segments is received again only after its step-0 send has completed.
    reuse = p == 2
    reposted = 0  # step-0 segments whose send completed and whose receive is posted

    def repost(upto: int) -> None:
        nonlocal reposted
        while reposted < min(upto, len(send0)):
            sends[reposted].wait(deadline)
            a, b = send0[reposted]
            next_recvs.append(c.irecv(flat[a:b], left, _TAG + 1))
            reposted += 1

    for t, (reduce, _, recv) in enumerate(steps):
        next_recvs = post(t + 1) if t < last and not (reuse and t == 0) else []
        next_sends: list[Request] = []
        base = recv[0][0]
        for j, (a, b) in enumerate(recv):
            recvs[j].wait(deadline)
            if reduce and b > a:
                part = flat[a:b]
                got = scratch[t % 2][a - base : b - base]
                w_got = w_left if t == 0 else 1.0
                _core.weighted_sum_into([part, got], [w, w_got], part, bfloat16=bf16)
            if t < last:
                next_sends.append(c.isend(flat[a:b], right, _TAG + t + 1))
            if reuse and t == 0:
                repost(j + 1)
        if reuse and t == 0:
            repost(len(send0))
            sends = sends[reposted:]
        wait_all(sends, deadline)
        sends, recvs = next_sends, next_recvs
    wait_all([*sends, weight_out], deadline)


def _ring_blocking(
    c: Communicator,
    flat: np.ndarray,
    bf16: bool,
    w: float,
    counts: list[int],
    deadline: float | None,
) -> None:
    """:func:`_ring` when each chunk is one segment: nothing to pipeline, so each step is one
    blocking exchange with the neighbours (on MPI without a deadline, one ``MPI_Sendrecv``),
    after the weights' own. The same reductions, in the same order, as :func:`_ring`."""
    p, r = c.size, c.rank
    right, left = (r + 1) % p, (r - 1) % p
    steps = _core.ring_schedule(counts, r, max(1, *counts))
    weights = np.array([w, 0.0])
    c.sendrecv(weights[:1], right, weights[1:], left, _TAG_WEIGHT, deadline)
    w_left = float(weights[1])
    scratch = _scratch(0, max(counts), flat.dtype)
    for t, (reduce, ((sa, sb),), ((a, b),)) in enumerate(steps):
        if reduce:
            got = scratch[: b - a]
            c.sendrecv(flat[sa:sb], right, got, left, _TAG + t, deadline)
            if b > a:
                part = flat[a:b]
                w_got = w_left if t == 0 else 1.0
                _core.weighted_sum_into([part, got], [w, w_got], part, bfloat16=bf16)
        else:
            c.sendrecv(flat[sa:sb], right, flat[a:b], left, _TAG + t, deadline)


def _ring_allgather(
    c: Communicator,
    send: np.ndarray,
    out: np.ndarray,
    counts: list[int],
    segment: int,
    deadline: float | None,
) -> None:
    """The allgather half of the ring (``schedules/ring.rs``) on bytes: rank r's piece is chunk
    r of ``out``; each step forwards, segment by segment, what the previous step received."""
    p, r = c.size, c.rank
    right, left = (r + 1) % p, (r - 1) % p
    bounds = np.concatenate([[0], np.cumsum(counts)])
    out[bounds[r] : bounds[r + 1]] = send
    steps = _core.ring_schedule(counts, r, segment)[p - 1 :]
    last = len(steps) - 1

    def post(t: int) -> list[Request]:
        return [c.irecv(out[a:b], left, _TAG_GATHER + t) for a, b in steps[t][2]]

    sends = [c.isend(out[a:b], right, _TAG_GATHER) for a, b in steps[0][1]]
    recvs = post(0)
    for t, (_, _, recv) in enumerate(steps):
        next_recvs = post(t + 1) if t < last else []
        next_sends: list[Request] = []
        for j, (a, b) in enumerate(recv):
            recvs[j].wait(deadline)
            if t < last:
                next_sends.append(c.isend(out[a:b], right, _TAG_GATHER + t + 1))
        wait_all(sends, deadline)
        sends, recvs = next_sends, next_recvs
    wait_all(sends, deadline)


def _allreduce_device(
    buf: Any, comm: Any, w: float, algorithm: str, check: bool, deadline: float | None
) -> Any:
    """NCCL (device tensors): the Rust kernels run on host memory, so the reduction is the
    engine's own. The weight is fused into it: NCCL's PREMUL_SUM multiplies each rank's input by
    that rank's own factor inside the reduction kernel, with no pass of its own. Engines without
    it pre-scale with a torch multiply. The ring is not offered here."""
    import torch.distributed as dist

    if algorithm == "ring":
        raise ValueError("algorithm: 'ring' runs on CPU buffers; use 'native' for device tensors")
    if not buf.is_contiguous():
        raise ValueError("buf: must be contiguous (allreduce works in place)")
    c = wrap(comm)
    if check:
        fields = {"length": buf.numel(), "dtype": zlib.crc32(str(buf.dtype).encode())}
        agree(c, fields, deadline)
    op = dist.ReduceOp.SUM
    if w != 1.0:
        fused = premul_sum_op(c.engine, w)
        if fused is None:
            buf.mul_(w)
        else:
            op = fused
    work = dist.all_reduce(buf, op=op, group=c.native, async_op=True)
    from hetcoll.comm import TorchRequest

    TorchRequest(work, "all_reduce").wait(deadline)
    return buf


def premul_sum_op(engine: str, w: float) -> Any:
    """The reduce op for ``sum over ranks of w_r * buf_r`` with each rank's weight fused into
    the engine's reduction kernel: NCCL's PREMUL_SUM (each rank passes its own factor). None
    on engines without it; the caller pre-scales then."""
    import torch.distributed as dist

    make = getattr(dist, "_make_nccl_premul_sum", None)
    return make(w) if engine == "nccl" and make is not None else None


def _shape_code(shape: Sequence[int]) -> int:
    return zlib.crc32(np.asarray(shape, np.int64).tobytes())


def allgatherv(
    local: ArrayT,
    comm: Any = None,
    *,
    out: ArrayT | None = None,
    algorithm: str = "auto",
    timeout: float | None = None,
    segment_bytes: int | None = None,
) -> ArrayT:
    """Concatenation along axis 0 of every rank's ``local``, pieces of different lengths.

    ``local`` is a numpy array or a CPU torch tensor (any dtype) with at least one
    dimension; the other dimensions and the dtype must match on every rank (else
    :class:`hetcoll.CollectiveMismatchError` on every rank). Returns a new array of the same
    kind, or ``out``: an array of that kind, dtype and trailing shape, C-contiguous, with as
    many rows as all pieces together (checked once the lengths are known; a wrong count raises
    a ValueError on that rank after the exchange, so the others do not wait for it), which
    saves allocating (and, for large outputs, page-faulting) a new one every call.
    ``algorithm``: "native" is MPI_Allgatherv, or on torch all_to_all_single with uneven splits
    (gloo's all_gather rejects uneven pieces); "ring" passes the pieces around the ring with the
    engine's send/recv straight into the output, segment by segment; "direct" sends each piece
    to every other rank in one round of send/recv straight into the output; "auto" on MPI
    picks by total size (:data:`GATHER_RING_CROSSOVER_BYTES`). Every call starts with one round
    that exchanges the lengths (and checks shapes, dtype and algorithm). On gloo that round
    also carries as many bytes of each piece as the group's recent gathers predict
    (:data:`SPECULATIVE_GATHER_ENGINES`), in one all-to-all for small gathers
    (:data:`BATCHED_GATHER_BYTES`), else point to point: "auto" is then done in that round
    when the prediction holds, and sends only the rest of longer pieces when it does not.
    ``segment_bytes`` cuts the ring's messages (default: one message per piece and step;
    nothing is computed between them, so smaller messages would only add per-message cost).

    >>> allgatherv(np.arange(rank + 1.0), comm)  # on 3 ranks  # doctest: +SKIP
    array([0., 0., 1., 0., 1., 2.])
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm: must be one of {ALGORITHMS}, got {algorithm!r}")
    if segment_bytes is not None and (not isinstance(segment_bytes, int) or segment_bytes < 1):
        raise ValueError(f"segment_bytes: must be an integer >= 1 or None, got {segment_bytes!r}")
    deadline = deadline_of(timeout)
    result, _ = _gather(local, comm, deadline, algorithm, segment_bytes, out)
    return result  # type: ignore[no-any-return]


def _gather(
    local: Any,
    comm: Any,
    deadline: float | None,
    algorithm: str = "auto",
    segment_bytes: int | None = None,
    out: Any = None,
) -> tuple[Any, list[int]]:
    """:func:`allgatherv`, plus every rank's length along axis 0."""
    if is_tensor(local) and local.device.type != "cpu":
        if out is not None:
            raise ValueError("out: not supported for device tensors")
        return _allgatherv_device(local, comm, deadline)
    if is_tensor(local):
        local = local.detach().contiguous()
        view = _tensor_bytes_view(local)
    elif isinstance(local, np.ndarray):
        view = np.ascontiguousarray(local)
    else:
        raise TypeError(
            f"local: must be a numpy array or a torch tensor, got {type(local).__name__}"
        )
    if view.ndim == 0:
        raise ValueError("local: must have at least one dimension (pieces join along axis 0)")
    into = None if out is None else _out_view(out, local, view)
    c = wrap(comm)
    send = view.reshape(-1).view(np.uint8)
    row_bytes = view.itemsize * math.prod(view.shape[1:])
    into_bytes = None if into is None else into.reshape(-1).view(np.uint8)
    joined = None
    if c.size > 1 and c.engine in SPECULATIVE_GATHER_ENGINES:
        lengths, joined = _speculative_round(
            c, view.shape, view.dtype.str, send, row_bytes, deadline, algorithm, into_bytes
        )
    elif c.size > 1 and (windows := c.node_windows(SHARED_SEGMENT_BYTES, deadline)) is not None:
        lengths, joined = _shared_round(
            c, windows, view.shape, view.dtype.str, send, row_bytes, deadline, algorithm, into_bytes
        )
    else:
        lengths = [
            int(n) for n in _exchange_shapes(c, view.shape, view.dtype.str, deadline, algorithm)
        ]
    rows = sum(lengths)
    # ``out`` if its row count is right; a wrong one is this rank's error alone, raised once the
    # exchange is over so that the others are not left waiting.
    dest = into if into is not None and into.shape[0] == rows else None
    if joined is not None:  # "auto": the pieces are in place after the speculative round
        out_view = joined.view(view.dtype).reshape(rows, *view.shape[1:])
        if dest is not None and joined is not into_bytes:
            dest[...] = out_view
    else:
        out_view = dest if dest is not None else np.empty((rows, *view.shape[1:]), view.dtype)
        counts = [n * row_bytes for n in lengths]
        recv = out_view.reshape(-1).view(np.uint8)
        if algorithm == "auto":
            crossover = GATHER_RING_CROSSOVER_BYTES.get(c.engine, math.inf)
            algorithm = "ring" if recv.nbytes >= crossover else "native"
        if algorithm == "native" or c.size == 1:
            c.iallgatherv(send, recv, counts).wait(deadline)
        elif algorithm == "shared":  # only here without shared memory: ranks agreed, all raise
            raise ValueError(_NO_SHARED.format(c.engine))
        elif algorithm == "direct":
            _direct_allgather(c, send, recv, counts, deadline)
        else:
            segment = segment_bytes if segment_bytes is not None else max(1, *counts)
            _ring_allgather(c, send, recv, counts, segment, deadline)
    if into is not None:
        if dest is None:
            raise ValueError(f"out: has {into.shape[0]} rows along axis 0, the pieces hold {rows}")
        return out, lengths
    if is_tensor(local):
        import torch

        t = torch.from_numpy(out_view)
        return (t.view(torch.bfloat16) if local.dtype == torch.bfloat16 else t), lengths
    return out_view, lengths


def _tensor_bytes_view(t: Any) -> np.ndarray:
    """A CPU tensor's memory as numpy: any dtype as itself, bfloat16 (unknown to numpy) as its
    16-bit patterns, so that it travels as bytes."""
    import torch

    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def _out_view(out: Any, local: Any, view: np.ndarray) -> np.ndarray:
    """``out`` as a writeable numpy array of ``view``'s dtype (bfloat16 as its bit patterns),
    after the checks that need no lengths: kind, dtype, trailing shape, layout."""
    if is_tensor(local):
        if not is_tensor(out) or out.device.type != "cpu":
            raise TypeError(f"out: must be a CPU torch tensor like local, got {type(out).__name__}")
        if out.dtype != local.dtype:
            raise TypeError(f"out: dtype {out.dtype} differs from local's {local.dtype}")
        if out.requires_grad:
            raise ValueError("out: must not require grad")
        array = _tensor_bytes_view(out)
    elif isinstance(out, np.ndarray):
        array = out
    else:
        raise TypeError(f"out: must be a numpy array like local, got {type(out).__name__}")
    if array.dtype != view.dtype:
        raise TypeError(f"out: dtype {array.dtype} differs from local's {view.dtype}")
    if array.shape[1:] != view.shape[1:] or array.ndim != view.ndim:
        raise ValueError(
            f"out: shape {tuple(array.shape)} must be (rows, *{tuple(view.shape[1:])})"
        )
    if not array.flags.c_contiguous or not array.flags.writeable:
        raise ValueError("out: must be C-contiguous and writeable")
    if np.may_share_memory(array, view):
        raise ValueError("out: must not overlap local")
    return array


def _direct_allgather(
    c: Communicator, send: np.ndarray, out: np.ndarray, counts: list[int], deadline: float | None
) -> None:
    """One round: this rank's piece goes to every other rank, and every other rank's piece
    lands in its place in ``out`` (empty pieces send nothing; every rank knows the counts)."""
    bounds = np.concatenate([[0], np.cumsum(counts)])
    r = c.rank
    out[bounds[r] : bounds[r + 1]] = send
    requests = []
    for q in range(c.size):
        if q == r:
            continue
        if counts[q]:
            requests.append(c.irecv(out[bounds[q] : bounds[q + 1]], q, _TAG_GATHER_DIRECT))
        if counts[r]:
            requests.append(c.isend(send, q, _TAG_GATHER_DIRECT))
    wait_all(requests, deadline)


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
            ALGORITHMS.index(algorithm),
        ],
        np.int64,
    )
    fields.flags.writeable = False
    return fields


#: allgatherv's first-round header words, in order (the length first).
_FIELDS = ("length", "shape[1:]", "dtype", "number of dimensions", "algorithm")


def _fields(shape: Sequence[int], dtype: str, algorithm: str) -> np.ndarray:
    """This rank's header: :func:`_header` with its length along axis 0 in word 0."""
    fields = _header(tuple(shape[1:]), dtype, algorithm).copy()
    fields[0] = shape[0]
    return fields


def _agreed_lengths(rows: np.ndarray) -> np.ndarray:
    """Word 0 of every rank's header (``rows``, one per rank), once the other words agree;
    else the :class:`CollectiveMismatchError` every rank raises, as all see the same rows."""
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


def _predict(records: deque[tuple[int, ...]], p: int) -> tuple[int, ...]:
    """Every rank's piece bytes in the group's next gather, from its last ones (``records``,
    the same on every rank): the gather ``k`` calls back for the shortest ``k`` <=
    :data:`GATHER_PERIODS` with which the last ``k`` gathers repeat the ``k`` before them, else
    the last gather, else nothing.

    >>> _predict(deque([(1, 2), (3, 4), (1, 2), (3, 4)]), 2)
    (1, 2)
    """
    n = len(records)
    for k in range(1, min(GATHER_PERIODS, n // 2) + 1):
        if all(records[n - j] == records[n - j - k] for j in range(1, k + 1)):
            return records[n - k]
    return records[-1] if records else (0,) * p


def _speculative_round(
    c: Communicator,
    shape: Sequence[int],
    dtype: str,
    send: np.ndarray,
    row_bytes: int,
    deadline: float | None,
    algorithm: str,
    into: np.ndarray | None = None,
) -> tuple[list[int], np.ndarray | None]:
    """:func:`_exchange_shapes` with every rank's header travelling with as many bytes of its
    piece as predicted. Returns the lengths and, for "auto", the pieces joined (uint8), in
    ``into`` (uint8) when its size is right; pieces longer than predicted are completed by a
    second round.

    Every message size comes from the prediction, which only depends on what all ranks
    exchanged before, so senders and receivers agree on it whatever this call's arguments: a
    rank sends at most the predicted bytes, and a receive takes a message up to its buffer's
    size (gloo aborts the process on a longer one). Ranks that disagree on shapes, dtype or
    algorithm therefore all get through this round, and all raise."""
    p, r = c.size, c.rank
    if c.gather_history is None:
        c.gather_history = deque(maxlen=2 * GATHER_PERIODS)
    records = c.gather_history
    guess = _predict(records, p)
    head = _fields(shape, dtype, algorithm)
    if not send.flags.writeable:
        send = send.copy()  # torch will not wrap a read-only array
    mine = send[: guess[r]]
    joined: np.ndarray | None = None  # the predicted layout, where point to point lands
    if sum(guess) <= BATCHED_GATHER_BYTES:
        heads, boxes = _batched_round(c, head, mine, guess, deadline)
    else:
        heads, boxes, joined = _direct_round(c, head, mine, guess, deadline, into)
    lengths = _agreed_lengths(heads).tolist()
    counts = tuple(n * row_bytes for n in lengths)
    records.append(counts)  # the same on every rank
    if algorithm != "auto":
        return lengths, None
    if joined is not None and counts == guess:
        return lengths, joined  # every piece is in place
    # The exact layout: the bytes that came, then the rest of pieces longer than predicted.
    to = [0, *itertools.accumulate(counts)]
    out = into if into is not None and into.size == to[-1] else np.empty(to[-1], np.uint8)
    if joined is not None and joined is into:
        boxes = [box.copy() for box in boxes]  # the two layouts overlap
    peers = [q for q in range(p) if q != r]
    for q in peers:
        k = min(counts[q], guess[q])
        out[to[q] : to[q] + k] = boxes[q][:k]
    out[to[r] : to[r + 1]] = send
    requests = [
        c.irecv(out[to[q] + guess[q] : to[q + 1]], q, _TAG_GATHER_REST)
        for q in peers
        if counts[q] > guess[q]
    ]
    if counts[r] > guess[r]:
        requests += [c.isend(send[guess[r] :], q, _TAG_GATHER_REST) for q in peers]
    wait_all(requests, deadline)
    return lengths, out


def _batched_round(
    c: Communicator,
    head: np.ndarray,
    mine: np.ndarray,
    guess: tuple[int, ...],
    deadline: float | None,
) -> tuple[np.ndarray, list[np.ndarray]]:
    """The speculative round as one all-to-all: to each peer a block of this rank's header and
    predicted bytes (``mine``), from each peer its block, through reused scratch. Returns the
    headers (a row per rank) and each rank's predicted bytes as they came (``mine`` for this
    rank), still in scratch: no piece is in its final place yet."""
    p, r, h = c.size, c.rank, head.nbytes
    block = [h + g for g in guess]
    outgoing = _scratch(_GATHER_OUT, (p - 1) * block[r], np.dtype(np.uint8))
    rows = outgoing.reshape(p - 1, block[r])
    rows[:, :h] = head.view(np.uint8)
    rows[:, h : h + mine.size] = mine  # a piece shorter than predicted leaves stale bytes
    sizes_in = [0 if q == r else block[q] for q in range(p)]
    incoming = _scratch(_GATHER_IN, sum(sizes_in), np.dtype(np.uint8))
    sizes_out = [0 if q == r else block[r] for q in range(p)]
    c.ialltoallv(outgoing, sizes_out, incoming, sizes_in).wait(deadline)
    heads = np.empty((p, h), np.uint8)
    boxes = []
    at = 0
    for q in range(p):
        if q == r:
            heads[q] = head.view(np.uint8)
            boxes.append(mine)
            continue
        heads[q] = incoming[at : at + h]
        boxes.append(incoming[at + h : at + block[q]])
        at += block[q]
    return heads.view(np.int64), boxes


def _direct_round(
    c: Communicator,
    head: np.ndarray,
    mine: np.ndarray,
    guess: tuple[int, ...],
    deadline: float | None,
    into: np.ndarray | None,
) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
    """The speculative round point to point: this rank's header to every peer, and its
    predicted bytes (``mine``) in their own message, which each peer receives straight into
    place in the predicted layout (``into`` when its size is right). Returns the headers (a
    row per rank), each rank's predicted bytes as they came, and the predicted layout."""
    p, r, h = c.size, c.rank, head.nbytes
    at = [0, *itertools.accumulate(guess)]
    joined = into if into is not None and into.size == at[-1] else np.empty(at[-1], np.uint8)
    heads = np.empty((p, h), np.uint8)
    heads[r] = head.view(np.uint8)
    boxes = [joined[at[q] : at[q + 1]] for q in range(p)]
    requests = []
    for k in range(1, p):  # each peer in turn from the right neighbour on
        q = (r + k) % p
        requests.append(c.irecv(heads[q], q, _TAG_GATHER_HEAD))
        if guess[q]:
            requests.append(c.irecv(boxes[q], q, _TAG_GATHER_DATA))
    for k in range(1, p):
        q = (r - k) % p
        requests.append(c.isend(heads[r], q, _TAG_GATHER_HEAD))
        if guess[r]:
            requests.append(c.isend(mine, q, _TAG_GATHER_DATA))
    boxes[r][: mine.size] = mine  # while the messages travel
    wait_all(requests, deadline)
    return heads.view(np.int64), boxes, joined


def _disagree(field: int, per_rank: np.ndarray) -> None:
    """Raise the :class:`CollectiveMismatchError` of header word ``field``, whose value on each
    rank is ``per_rank`` (every rank raises: all see the same words)."""
    if _FIELDS[field] == "algorithm":
        listed = ", ".join(f"rank {r}: {ALGORITHMS[int(a)]!r}" for r, a in enumerate(per_rank))
        raise CollectiveMismatchError(f"algorithm: ranks disagree ({listed})")
    raise CollectiveMismatchError(
        f"local: ranks disagree on {_FIELDS[field]}; every piece must match but along axis 0"
    )


def _allgatherv_device(local: Any, comm: Any, deadline: float | None) -> tuple[Any, list[int]]:
    """NCCL path: the same all_to_all_single exchange on device tensors."""
    import torch
    import torch.distributed as dist

    from hetcoll.comm import TorchRequest

    c = wrap(comm)
    local = local.contiguous()
    if local.dim() == 0:
        raise ValueError("local: must have at least one dimension (pieces join along axis 0)")
    rows = _exchange_shapes(c, tuple(local.shape), str(local.dtype), deadline, "auto")
    row = math.prod(local.shape[1:])
    out = torch.empty((int(rows.sum()), *local.shape[1:]), dtype=local.dtype, device=local.device)
    work = dist.all_to_all_single(
        out.view(-1),
        local.reshape(-1).repeat(c.size),
        output_split_sizes=[int(n) * row for n in rows],
        input_split_sizes=[local.numel()] * c.size,
        group=c.native,
        async_op=True,
    )
    TorchRequest(work, "all_to_all_single (allgatherv)").wait(deadline)
    return out, [int(n) for n in rows]


def allgatherv_autograd(tensor: Any, comm: Any = None, *, timeout: float | None = None) -> Any:
    """:func:`allgatherv` of a torch tensor, differentiable: the gradient of this rank's piece
    is its slice of the output gradient summed over ranks (reduce-scatter with uneven counts).

    For the filter-parallel layers: each rank computes its share of output channels and every
    rank needs all of them.

    >>> y = allgatherv_autograd(local_out, group)  # doctest: +SKIP
    """
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor: must be a torch tensor, got {type(tensor).__name__}")
    return _AllgathervFn.apply(tensor, wrap(comm), timeout)


def _make_function() -> Any:
    import torch

    class AllgathervFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, tensor: Any, comm: Communicator, timeout: float | None) -> Any:
            out, ctx.counts = _gather(tensor.detach(), comm, deadline_of(timeout))
            ctx.comm, ctx.timeout = comm, timeout
            ctx.local_shape = tuple(tensor.shape)
            return out

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            comm: Communicator = ctx.comm
            grad = grad.contiguous()
            row = math.prod(ctx.local_shape[1:])
            result = torch.empty(ctx.local_shape, dtype=grad.dtype, device=grad.device)
            deadline = deadline_of(ctx.timeout)
            counts = [n * row for n in ctx.counts]
            if grad.device.type != "cpu":
                import torch.distributed as dist

                from hetcoll.comm import TorchRequest

                work = dist.reduce_scatter(
                    result.view(-1),
                    list(grad.view(-1).split(counts)),
                    group=comm.native,
                    async_op=True,
                )
                TorchRequest(work, "reduce_scatter").wait(deadline)
                return result, None, None
            g_view, bf16 = numpy_view(grad, "grad")
            r_view, _ = numpy_view(result, "grad")
            kind = _kind(g_view, bf16)
            comm.ireduce_scatterv(g_view.reshape(-1), r_view.reshape(-1), counts, kind).wait(
                deadline
            )
            return result, None, None

    return AllgathervFn


class _Lazy:
    """Defers building the autograd Function until torch is needed (numpy users never load it)."""

    fn: Any = None

    def apply(self, *args: Any) -> Any:
        if self.fn is None:
            self.fn = _make_function()
        return self.fn.apply(*args)


_AllgathervFn = _Lazy()
