"""Collectives over uneven shards: the weighted allreduce and allgatherv, on MPI or torch.

- :func:`allreduce` — in place, ``buf <- sum over ranks r of weight_r * buf_r``. "ring" is a
  reduce-scatter + allgather over chunks sized by :func:`hetcoll.split` (even by default,
  proportional to ``speeds`` when given), scheduled in Rust (``schedules/ring.rs``), reduced by
  the Rust ``weighted_sum`` kernel with the weight fused into the reduction and the GIL
  released, moved by the engine's non-blocking send/recv and pipelined segment by segment.
  "native" pre-scales in Rust and calls the engine's allreduce SUM.
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

import math
import time
import zlib
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

from hetcoll import _core
from hetcoll.comm import Communicator, Request, wait_all, wrap
from hetcoll.errors import CollectiveMismatchError
from hetcoll.kernels import _is_tensor, _numpy_view

__all__ = ["ALGORITHMS", "allgatherv", "allgatherv_autograd", "allreduce"]

ArrayT = TypeVar("ArrayT")

ALGORITHMS = ("auto", "ring", "native")
#: Ring segment: large enough that per-message overhead is small next to 1 MiB at ~1 GB/s,
#: small enough that reducing one segment overlaps receiving the next (gloo uses <= 1 MiB).
SEGMENT_BYTES = 1 << 20
#: Message size above which "auto" picks the ring, per engine. The engines' own allreduce was
#: faster than (or level with) the ring at every size measured by benches/bench_collectives.py
#: on one 2-core machine, so "auto" stays native unless chunk ``speeds`` ask for uneven chunks.
RING_CROSSOVER_BYTES: dict[str, float] = {"mpi": math.inf, "gloo": math.inf}
_TAG = 4831  # ring messages: _TAG + step
_KIND_CODE = {"float32": 1, "float64": 2, "float16": 3, "bfloat16": 4}
_ALGO_CODE = {"ring": 1, "native": 2}


def _kind(view: np.ndarray, bf16: bool) -> str:
    if bf16:
        return "bfloat16"
    name = view.dtype.name
    if name not in ("float32", "float64", "float16"):
        raise TypeError(f"buf: dtype {name} is not supported (float32, float64, float16, bfloat16)")
    return name


def _deadline(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout: must be a number of seconds > 0 or None, got {timeout!r}")
    return time.monotonic() + float(timeout)


def _weight(weight: object) -> float:
    if isinstance(weight, bool) or not isinstance(weight, (int, float, np.floating, np.integer)):
        raise TypeError(f"weight: must be a number, got {type(weight).__name__}")
    w = float(weight)
    if not math.isfinite(w):
        raise ValueError(f"weight: must be finite, got {w}")
    return w


def _agree(comm: Communicator, fields: dict[str, int], deadline: float | None) -> None:
    """Raise CollectiveMismatchError on every rank unless every rank passed the same fields."""
    rows = comm.allgather_int64(np.array(list(fields.values()), dtype=np.int64), deadline)
    for j, name in enumerate(fields):
        column = rows[:, j]
        if (column != column[0]).any():
            per_rank = ", ".join(f"rank {r}: {int(v)}" for r, v in enumerate(column))
            raise CollectiveMismatchError(f"ranks disagree on {name} ({per_rank})")


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
    segment_bytes: int = SEGMENT_BYTES,
) -> ArrayT:
    """In place, ``buf <- sum over ranks r of weight_r * buf_r``; returns ``buf``.

    ``buf`` is a C-contiguous numpy array or CPU torch tensor (float32, float64, float16,
    bfloat16; 16-bit types are reduced in float32 and rounded at each ring hop). ``comm`` is
    anything :func:`hetcoll.comm.wrap` takes. ``weight`` is this rank's weight (ranks may
    differ). ``algorithm``: "ring", "native" or "auto" (see :data:`RING_CROSSOVER_BYTES`; "auto"
    with ``speeds`` is the ring). ``speeds`` (one per rank, same on every rank) sizes the ring's
    chunks with :func:`hetcoll.split`; chunk r is reduced last by rank r. Every rank ends with
    bitwise the same result. ``check`` compares length, dtype, algorithm and speeds across ranks
    first (one small allgather). A CUDA tensor (NCCL) takes the native path with a torch
    pre-scale.

    >>> allreduce(grad, comm, weight=local_batch / global_batch)  # doctest: +SKIP
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm: must be one of {ALGORITHMS}, got {algorithm!r}")
    w = _weight(weight)
    deadline = _deadline(timeout)
    if not isinstance(segment_bytes, int) or segment_bytes < 1:
        raise ValueError(f"segment_bytes: must be an integer >= 1, got {segment_bytes!r}")
    if _is_tensor(buf) and buf.device.type != "cpu":  # type: ignore[attr-defined]
        return _allreduce_device(buf, comm, w, algorithm, check, deadline)
    view, bf16 = _numpy_view(buf, "buf")
    if not view.flags.c_contiguous:
        raise ValueError("buf: must be C-contiguous (allreduce works in place)")
    if not view.flags.writeable:
        raise ValueError("buf: must be writeable (allreduce works in place)")
    kind = _kind(view, bf16)
    flat = view.reshape(-1)
    c = wrap(comm)
    if algorithm == "auto":
        crossover = RING_CROSSOVER_BYTES.get(c.engine, math.inf)
        algorithm = "ring" if speeds is not None or flat.nbytes >= crossover else "native"
    counts = _counts(flat.size, c.size, speeds) if algorithm == "ring" else None
    if check:
        fields = {
            "length": flat.size,
            "dtype": _KIND_CODE[kind],
            "algorithm": _ALGO_CODE[algorithm],
            "chunk shares": zlib.crc32(np.asarray(counts or [], np.int64).tobytes()),
        }
        _agree(c, fields, deadline)
    if c.size == 1 or flat.size == 0:
        if w != 1.0 and flat.size:
            _core.weighted_sum_into([flat], [w], flat, bfloat16=bf16)
        return buf
    if algorithm == "native":
        if w != 1.0:
            _core.weighted_sum_into([flat], [w], flat, bfloat16=bf16)
        c.iallreduce_sum(flat, kind).wait(deadline)
    else:
        assert counts is not None
        segment = max(1, segment_bytes // flat.itemsize)
        _ring(c, flat, bf16, w, counts, segment, deadline)
    return buf


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
    scratch = [np.empty(biggest, flat.dtype), np.empty(biggest, flat.dtype)]

    def post(t: int) -> list[Request]:
        reduce, _, recv = steps[t]
        base = recv[0][0]
        if reduce:
            return [c.irecv(scratch[t % 2][a - base : b - base], left, _TAG + t) for a, b in recv]
        return [c.irecv(flat[a:b], left, _TAG + t) for a, b in recv]

    # Step 0 sends this rank's raw chunk r-1, which it never reduces: scale a copy of it here,
    # the only place the weight is not fused into a reduction.
    _, send0, _ = steps[0]
    lo0, hi0 = send0[0][0], send0[-1][1]
    first = np.empty(hi0 - lo0, flat.dtype)
    if hi0 > lo0:
        _core.weighted_sum_into([flat[lo0:hi0]], [w], first, bfloat16=bf16)
    sends = [c.isend(first[a - lo0 : b - lo0], right, _TAG) for a, b in send0]
    recvs = post(0)
    last = len(steps) - 1
    for t, (reduce, _, recv) in enumerate(steps):
        next_recvs = post(t + 1) if t < last else []
        next_sends: list[Request] = []
        base = recv[0][0]
        for j, (a, b) in enumerate(recv):
            recvs[j].wait(deadline)
            if reduce and b > a:
                part = flat[a:b]
                got = scratch[t % 2][a - base : b - base]
                _core.weighted_sum_into([part, got], [w, 1.0], part, bfloat16=bf16)
            if t < last:
                next_sends.append(c.isend(flat[a:b], right, _TAG + t + 1))
        wait_all(sends, deadline)
        sends, recvs = next_sends, next_recvs
    wait_all(sends, deadline)


def _allreduce_device(
    buf: Any, comm: Any, w: float, algorithm: str, check: bool, deadline: float | None
) -> Any:
    """NCCL (device tensors): the Rust kernels run on host memory, so the pre-scale is a torch
    multiply and the reduction is the engine's own; the ring is not offered here."""
    import torch.distributed as dist

    if algorithm == "ring":
        raise ValueError("algorithm: 'ring' runs on CPU buffers; use 'native' for device tensors")
    if not buf.is_contiguous():
        raise ValueError("buf: must be contiguous (allreduce works in place)")
    c = wrap(comm)
    if check:
        fields = {"length": buf.numel(), "dtype": zlib.crc32(str(buf.dtype).encode())}
        _agree(c, fields, deadline)
    if w != 1.0:
        buf.mul_(w)
    work = dist.all_reduce(buf, group=c.native, async_op=True)
    from hetcoll.comm import _TorchRequest

    _TorchRequest(work, "all_reduce").wait(deadline)
    return buf


def _shape_code(shape: Sequence[int]) -> int:
    return zlib.crc32(np.asarray(shape, np.int64).tobytes())


def allgatherv(local: ArrayT, comm: Any = None, *, timeout: float | None = None) -> ArrayT:
    """Concatenation along axis 0 of every rank's ``local``, pieces of different lengths.

    ``local`` is a numpy array (any dtype) or a CPU torch tensor (float types) with at least one
    dimension; the other dimensions and the dtype must match on every rank (else
    :class:`hetcoll.CollectiveMismatchError` on every rank). Returns a new array of the same
    kind. MPI: MPI_Allgatherv; torch: all_to_all_single with uneven splits.

    >>> allgatherv(np.arange(rank + 1.0), comm)  # on 3 ranks  # doctest: +SKIP
    array([0., 0., 1., 0., 1., 2.])
    """
    deadline = _deadline(timeout)
    if _is_tensor(local) and local.device.type != "cpu":  # type: ignore[attr-defined]
        return _allgatherv_device(local, comm, deadline)  # type: ignore[no-any-return]
    if _is_tensor(local):
        local = local.detach().contiguous()  # type: ignore[attr-defined]
        view, _ = _numpy_view(local, "local")
    elif isinstance(local, np.ndarray):
        view = np.ascontiguousarray(local)
    else:
        raise TypeError(
            f"local: must be a numpy array or a torch tensor, got {type(local).__name__}"
        )
    if view.ndim == 0:
        raise ValueError("local: must have at least one dimension (pieces join along axis 0)")
    c = wrap(comm)
    rows = _exchange_shapes(c, view.shape, view.dtype.str, deadline)
    row_bytes = view.itemsize * math.prod(view.shape[1:])
    out_view = np.empty((int(rows.sum()), *view.shape[1:]), dtype=view.dtype)
    counts = [int(n) * row_bytes for n in rows]
    c.iallgatherv(
        view.reshape(-1).view(np.uint8), out_view.reshape(-1).view(np.uint8), counts
    ).wait(deadline)
    if _is_tensor(local):
        import torch

        t = torch.from_numpy(out_view)
        return t.view(torch.bfloat16) if local.dtype == torch.bfloat16 else t  # type: ignore
    return out_view  # type: ignore[return-value]


def _exchange_shapes(
    c: Communicator, shape: Sequence[int], dtype: str, deadline: float | None
) -> np.ndarray:
    """Every rank's length along axis 0, after checking the rest of the shape and the dtype."""
    fields = np.array(
        [shape[0], _shape_code(shape[1:]), zlib.crc32(dtype.encode()), len(shape)], np.int64
    )
    rows = c.allgather_int64(fields, deadline)
    for j, name in enumerate(("", "shape[1:]", "dtype", "number of dimensions")):
        if j and (rows[:, j] != rows[0, j]).any():
            raise CollectiveMismatchError(
                f"local: ranks disagree on {name}; every piece must match but along axis 0"
            )
    return rows[:, 0]


def _allgatherv_device(local: Any, comm: Any, deadline: float | None) -> Any:
    """NCCL path: the same all_to_all_single exchange on device tensors."""
    import torch
    import torch.distributed as dist

    from hetcoll.comm import _TorchRequest

    c = wrap(comm)
    local = local.contiguous()
    if local.dim() == 0:
        raise ValueError("local: must have at least one dimension (pieces join along axis 0)")
    rows = _exchange_shapes(c, tuple(local.shape), str(local.dtype), deadline)
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
    _TorchRequest(work, "all_to_all_single (allgatherv)").wait(deadline)
    return out


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
            out = allgatherv(tensor.detach(), comm, timeout=timeout)
            ctx.comm, ctx.timeout = comm, timeout
            ctx.local_shape = tuple(tensor.shape)
            ctx.rows = out.shape[0]
            ctx.counts = _row_counts(comm, tensor.shape[0], timeout)
            return out

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            comm: Communicator = ctx.comm
            grad = grad.contiguous()
            row = math.prod(ctx.local_shape[1:])
            result = torch.empty(ctx.local_shape, dtype=grad.dtype, device=grad.device)
            deadline = _deadline(ctx.timeout)
            counts = [n * row for n in ctx.counts]
            if grad.device.type != "cpu":
                import torch.distributed as dist

                from hetcoll.comm import _TorchRequest

                work = dist.reduce_scatter(
                    result.view(-1),
                    list(grad.view(-1).split(counts)),
                    group=comm.native,
                    async_op=True,
                )
                _TorchRequest(work, "reduce_scatter").wait(deadline)
                return result, None, None
            g_view, bf16 = _numpy_view(grad, "grad")
            r_view, _ = _numpy_view(result, "grad")
            kind = _kind(g_view, bf16)
            comm.ireduce_scatterv(g_view.reshape(-1), r_view.reshape(-1), counts, kind).wait(
                deadline
            )
            return result, None, None

    return AllgathervFn


def _row_counts(comm: Communicator, n: int, timeout: float | None) -> list[int]:
    rows = comm.allgather_int64(np.array([n], np.int64), _deadline(timeout))
    return [int(x) for x in rows[:, 0]]


class _Lazy:
    """Defers building the autograd Function until torch is needed (numpy users never load it)."""

    fn: Any = None

    def apply(self, *args: Any) -> Any:
        if self.fn is None:
            self.fn = _make_function()
        return self.fn.apply(*args)


_AllgathervFn = _Lazy()
