"""Exact sample-weighted gradient averaging as a DDP communication hook.

DDP averages gradients by dividing the sum by the world size, which is the full-batch gradient
only when every rank has the same batch size. With local batches ``n_r`` and each rank's loss the
mean over its own batch (PyTorch's default), the full-batch gradient is
``sum_r n_r * g_r / sum_r n_r``. This hook computes exactly that: each bucket is pre-scaled by
``n_r`` (one fused pass; the Rust kernel for CPU tensors, torch for device tensors), summed with
the process group's allreduce, and divided by ``N = sum_r n_r``. ``N`` is itself summed across
ranks once per step, by a one-element allreduce issued with the step's first bucket, so a ragged
last batch or a share change between steps needs nothing but ``state.local_batch = len(batch)``.

Usage, as with PyTorch's own hooks::

    state = WeightedAllreduceState(None, local_batch=shares[rank])
    ddp.register_comm_hook(state, weighted_allreduce_hook)
    for x, y in loader:
        state.local_batch = len(x)
        loss_fn(ddp(x), y).backward()
"""

# No `from __future__ import annotations`: DDP inspects the hook's annotations at runtime and
# requires the real `dist.GradBucket` / `Future[Tensor]` objects.
from typing import Any

import torch
import torch.distributed as dist

import hetcoll


def local_batch_value(n: object) -> int:
    """A rank's sample count for one step, checked: an integer >= 0."""
    if isinstance(n, bool) or not hasattr(n, "__index__") or int(n.__index__()) < 0:
        raise ValueError(f"local_batch: must be an integer >= 0, got {n!r}")
    return int(n.__index__())


class WeightedAllreduceState:
    """State of :func:`weighted_allreduce_hook`: the process group (``None`` = default) and this
    rank's number of samples in the current step (set it before each backward when it changes).
    """

    def __init__(self, process_group: dist.ProcessGroup | None, local_batch: int) -> None:
        self.process_group = process_group
        self.local_batch = local_batch
        self._step_total: torch.futures.Future | None = None

    @property
    def local_batch(self) -> int:
        return self._local_batch

    @local_batch.setter
    def local_batch(self, n: int) -> None:
        self._local_batch = local_batch_value(n)

    def _global_batch(self) -> torch.futures.Future:
        """Future of ``N = sum_r n_r`` for the current step; launched once per step."""
        if self._step_total is None:
            count = torch.tensor([float(self.local_batch)], dtype=torch.float64)
            if _backend(self.process_group) == "nccl":
                count = count.cuda()
            work = dist.all_reduce(count, group=self.process_group, async_op=True)
            self._step_total = work.get_future()
        return self._step_total


def _backend(group: Any) -> str:
    try:
        return str(dist.get_backend(group))
    except Exception:
        return "gloo"


def _scale_(buf: torch.Tensor, factor: float) -> None:
    if buf.device.type == "cpu" and buf.dtype in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
    ):
        hetcoll.weighted_sum([buf], [factor], out=buf)
    else:
        buf.mul_(factor)


def weighted_allreduce_hook(
    state: WeightedAllreduceState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket becomes ``sum_r n_r * grad_r / sum_r n_r`` on every rank."""
    if not isinstance(state, WeightedAllreduceState):
        raise TypeError(
            "state: weighted_allreduce_hook needs a WeightedAllreduceState, got "
            f"{type(state).__name__} (register with ddp.register_comm_hook(state, hook))"
        )
    total_fut = state._global_batch()
    if bucket.is_last():
        state._step_total = None  # the next step sums its own batch sizes
    buf = bucket.buffer()
    _scale_(buf, float(state.local_batch))
    work = dist.all_reduce(buf, group=state.process_group, async_op=True)

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        reduced = fut.value()[0]
        total = float(total_fut.wait()[0].item())
        if total <= 0:
            raise ValueError("local_batch: every rank reported 0 samples for this step")
        reduced.div_(total)
        return reduced

    return work.get_future().then(finish)
