"""Measure how fast this rank trains: time forward + backward (+ the optimizer step, when given an
optimizer factory) at a few batch sizes and fit
``t(b) = latency_s + b / samples_per_s`` (least squares on the medians of repeats)."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hetcoll.comm import is_mpi_comm


@dataclass(frozen=True)
class SpeedFit:
    """``t(b) = latency_s + b / samples_per_s`` seconds per step at batch size ``b``.

    ``capacity`` is the largest batch that fits in device memory when it was probed (else None).
    ``points`` are the measured ``(batch_size, median_seconds)`` pairs.
    """

    latency_s: float
    samples_per_s: float
    capacity: int | None = None
    points: tuple[tuple[int, float], ...] = field(default=())

    def predict(self, batch_size: int) -> float:
        """Predicted seconds per step at ``batch_size``."""
        return self.latency_s + batch_size / self.samples_per_s


def _fit(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``t = a + c b``; falls back to a line through the origin when noise makes the
    slope non-positive or the intercept negative."""
    n = len(points)
    bs = [float(b) for b, _ in points]
    ts = [t for _, t in points]
    mb, mt = sum(bs) / n, sum(ts) / n
    var = sum((b - mb) ** 2 for b in bs)
    if n >= 2 and var > 0:
        c = sum((b - mb) * (t - mt) for b, t in zip(bs, ts)) / var
        a = mt - c * mb
        if c > 0 and a >= 0:
            return a, c
    c = sum(b * t for b, t in zip(bs, ts)) / sum(b * b for b in bs)
    return 0.0, c


def measure_speed(
    model: nn.Module,
    make_batch: Callable[[int], tuple[Any, Any]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    batch_sizes: Sequence[int] = (8, 16, 32, 64),
    warmup: int = 2,
    repeats: int = 3,
    probe_memory: bool = False,
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
) -> SpeedFit:
    """Time forward + backward of a copy of ``model`` (the caller's weights are untouched) on
    ``make_batch(b)`` for each ``b`` in ``batch_sizes`` and fit the step time.

    ``optimizer``, a factory such as ``lambda ps: torch.optim.SGD(ps, lr=0.1)``, adds the
    optimizer step to each timed step (on the copy's parameters), so the fit is the whole training
    step.

    ``probe_memory`` (CUDA models only) fits peak memory against batch size and reports the
    largest batch that fits as ``capacity``.

    >>> fit = measure_speed(net, lambda b: (torch.randn(b, 4), torch.randn(b, 2)),
    ...                     nn.functional.mse_loss)  # doctest: +SKIP
    """
    sizes = [int(b) for b in batch_sizes]
    if len(sizes) < 1 or any(b < 1 for b in sizes):
        raise ValueError(f"batch_sizes: must be positive integers, got {list(batch_sizes)}")
    if warmup < 0 or repeats < 1:
        raise ValueError(f"repeats: must be >= 1 (and warmup >= 0), got {repeats}, {warmup}")
    if optimizer is not None and not callable(optimizer):
        raise TypeError(f"optimizer: must be a callable taking parameters, got {optimizer!r}")
    m = copy.deepcopy(model)
    m.train()
    opt = optimizer(m.parameters()) if optimizer is not None else None
    cuda = next((p.is_cuda for p in m.parameters()), False)
    points, mem_points = [], []
    for b in sizes:
        x, y = make_batch(b)
        times = []
        if cuda and probe_memory:
            torch.cuda.reset_peak_memory_stats()
        for i in range(warmup + repeats):
            m.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss_fn(m(x), y).backward()
            if opt is not None:
                opt.step()
            if cuda:
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        points.append((b, float(statistics.median(times))))
        if cuda and probe_memory:
            mem_points.append((b, float(torch.cuda.max_memory_allocated())))
    a, c = _fit(points)
    capacity = None
    if mem_points:
        m0, m1 = _fit(mem_points)
        free, _ = torch.cuda.mem_get_info()
        capacity = max(0, int((free + mem_points[-1][1] - m0) / m1)) if m1 > 0 else None
    return SpeedFit(latency_s=a, samples_per_s=1.0 / c, capacity=capacity, points=tuple(points))


def gather_speeds(fit: SpeedFit, group: Any = None) -> list[SpeedFit]:
    """Every rank's :class:`SpeedFit`, in rank order (a collective: call it on every rank).

    ``group`` is a torch.distributed process group (None: the default one) or, for jobs
    launched with ``mpiexec`` and no torch.distributed, an mpi4py communicator.

    >>> fits = gather_speeds(measure_speed(model, make_batch, loss_fn))  # doctest: +SKIP
    """
    if not isinstance(fit, SpeedFit):
        raise TypeError(f"fit: must be a SpeedFit, got {type(fit).__name__}")
    if is_mpi_comm(group):
        return list(group.allgather(fit))
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, fit, group=group)
    return out
