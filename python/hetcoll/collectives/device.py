"""Device tensors (NCCL): the Rust kernels run on host memory, so the reductions and exchanges
are the engine's own, with the allreduce weight fused into NCCL's reduction (``PREMUL_SUM``)
where the engine has it. On engines that move host memory (gloo, MPI) device tensors are
staged through the host instead (:func:`stage_on_host`) and take the CPU algorithms, the same
as the group's CPU ranks take."""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np

from hetcoll.collectives._common import ALGORITHMS
from hetcoll.collectives._header import _exchange_shapes, _inline_words
from hetcoll.comm import agree, wrap
from hetcoll.kernels import is_tensor


def stage_on_host(x: Any, group: Any) -> Any:
    """A host copy of ``x`` when ``x`` is a device (CUDA) tensor and ``group``'s engine moves
    host memory (gloo, MPI: anything but NCCL), else None (``x`` goes as it is, to NCCL or to
    the CPU path). Every rank of such a group then runs the same CPU algorithm, whichever
    device its tensor is on: a collective's ranks must agree on the algorithm, and gloo's own
    CUDA support would not mix with the CPU ranks' point-to-point algorithms. The copy keeps
    ``x``'s strides where they are dense, so the host path refuses a non-contiguous tensor with
    its own error; a ``group`` that is no group gives None (the caller's own check raises)."""
    if not is_tensor(x) or x.device.type in ("cpu", "meta"):  # meta: refused by the caller
        return None
    try:
        engine = wrap(group).engine
    except (TypeError, ValueError):
        return None
    if engine == "nccl":
        return None
    import torch

    return x.detach().to("cpu", memory_format=torch.preserve_format)


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
        fields = {
            "length": buf.numel(),
            "dtype": zlib.crc32(str(buf.dtype).encode()),
            "algorithm": ALGORITHMS.index(algorithm),
        }
        # As many words as a CPU buffer's agreement carries: ranks may mix the two paths.
        agree(c, fields, deadline, values=np.zeros(_inline_words(c.size), np.int64))
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
