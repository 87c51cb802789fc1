"""What each rank of a validation run (:mod:`hetcoll.lab.validate`) does in its own process:
the link and the shared cores measured as the strategy's collectives see them, the device
measured before every timed step, and the steps of the three kinds of run - DDP
(:func:`data_rank`), filter parallel (:func:`filter_rank`) and plans (:func:`plan_rank`) - with
their emulated speeds. Each rank function returns its timings and measurements to the caller,
which pairs them with predictions.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any, TypeVar

from hetcoll.model.hardware import Device

_T = TypeVar("_T")

# Allreduce sizes the link is fitted to (bytes): latency from the small one, bandwidth from the
# large one.
LINK_SIZES = (1024, 8 * 1024 * 1024)
#: Timed allreduces per size (the median is kept): the latency-bound rows hang on the small
#: one, and on this shared host three left it at the mercy of one slow message.
LINK_REPEATS = 9


def emulate_speed(compute_s: float, speed_factor: float) -> float:
    """Make this rank look ``speed_factor`` times as fast as it is (0 < f <= 1): sleep
    ``(1/f - 1) * compute_s`` seconds, so that compute plus sleep takes ``compute_s / f``.
    Returns the seconds slept.

    >>> emulate_speed(0.01, 1.0)
    0.0
    """
    if not 0 < speed_factor <= 1:
        raise ValueError(f"speed_factor: must be in (0, 1], got {speed_factor!r}")
    pause = (1.0 / speed_factor - 1.0) * compute_s
    if pause > 0:
        time.sleep(pause)
    return pause


# -- inside the ranks: the measurement both strategies share --------------------------------------


#: Idle gap before each timed link allreduce: a step's collectives follow milliseconds of
#: compute, not a barrier.
IDLE_S = 0.005


def link_here(
    rank: int, world: int, calibrate_here: bool, hetcoll_allreduce: bool = False
) -> dict[str, object]:
    """The link as the strategy's collectives see it: allreduces timed by all ranks at once,
    sharing the cores: gloo's own ``all_reduce`` (what DDP calls), or with
    ``hetcoll_allreduce`` ``hetcoll.allreduce`` (what the filter-parallel layers call: on two
    ranks its one-round direct exchange, which costs differently). Nothing when the figures
    come from a file or there is one rank."""
    if not calibrate_here or world == 1:
        return {}
    import hetcoll
    from hetcoll.lab import calibrate

    calibrate.set_statistic("median")
    op = hetcoll.allreduce if hetcoll_allreduce else None
    seconds = calibrate.gloo_allreduce_seconds(
        rank, world, LINK_SIZES, LINK_REPEATS, idle_s=IDLE_S, allreduce=op
    )
    return {"allreduce_s": seconds}


def scheduler_here(rank: int, world: int) -> dict[str, object]:
    """With more ranks than cores, lock-step stretches of known compute, from which the caller
    fits the scheduler's time slice (:func:`hetcoll.lab.calibrate.fit_time_slice`)."""
    if world <= (os.cpu_count() or 1):
        return {}
    from hetcoll.lab import calibrate

    # The loop's rate as the device's figures are taken: ``cores`` ranks at once.
    rate = side_by_side(rank, calibrate.spin_rate)
    # The collective the filter-parallel layers call, with data: a 256 KiB hetcoll.allreduce
    # (a one-element token showed less of the wake-up cost: in one run the 3-rank filter rows
    # came out -29 % and -21 % with it, -24 % and -20 % with this).
    return {"lockstep_s": calibrate.lockstep_stretch_seconds(rate, nbytes=256 * 1024)}


def side_by_side(rank: int, measure: Callable[[], _T]) -> _T:
    """``measure()`` on every rank, as many ranks at once as there are cores: all at once while
    the ranks fit in the cores; otherwise in groups of ``cores`` ranks between barriers (the
    last group filled up with ranks measuring a second time, their figure discarded), so each
    figure is that of a full machine with a core to itself and the model adds the sharing."""
    import torch.distributed as dist

    p, cores = dist.get_world_size(), os.cpu_count() or 1
    if p <= cores:
        return measure()
    kept: list[_T] = []
    for g in range(-(-p // cores)):
        if rank in [(g * cores + i) % p for i in range(cores)]:
            value = measure()
            if g == rank // cores:
                kept.append(value)
        dist.barrier()
    return kept[0]


def timed_steps(
    rank: int, step: Callable[[], None], steps: int, warmup: int, calibrate_here: bool
) -> tuple[list[float], list[Device]]:
    """Seconds of ``steps`` calls of ``step`` (after ``warmup``), each timed alone between
    barriers right after every rank has measured its device again (so the prediction for step k
    sees the load step k sees: on a shared machine the load changes within seconds). The ranks
    measure all at once while they fit in the cores (so the figures include what running side
    by side costs), ``cores`` at a time when they outnumber them (the model shares the cores
    itself; :func:`side_by_side`). The caller pairs steps across ranks and takes medians."""
    import torch.distributed as dist

    from hetcoll.lab import calibrate

    calibrate.set_statistic("median")
    dist.barrier()
    for _ in range(warmup):
        step()
    step_s, devices = [], []
    for _ in range(steps):
        if calibrate_here:
            dist.barrier()
            devices.append(
                side_by_side(
                    rank, lambda: calibrate.measure_device(f"rank{rank}", 1e12, quick=True)
                )
            )
        dist.barrier()
        t0 = time.perf_counter()
        step()
        step_s.append(time.perf_counter() - t0)
    return step_s, devices


def data_rank(
    rank: int,
    world: int,
    model_name: str,
    input_shape: tuple[int, ...],
    shares: list[int],
    speeds: list[float],
    steps: int,
    warmup: int,
    calibrate_here: bool,
) -> dict[str, object]:
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hetcoll.model import networks

    measured = {**link_here(rank, world, calibrate_here), **scheduler_here(rank, world)}
    torch.manual_seed(0)
    ddp = DDP(networks.build(model_name, input_shape))
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)
    torch.manual_seed(1 + rank)
    x = torch.randn(shares[rank], *input_shape)
    y = torch.randint(0, 10, (shares[rank],))

    def local_step() -> None:
        # The module DDP wraps: no gradient allreduce and no buffer broadcast.
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp.module(x), y).backward()
        opt.step()

    # This rank's own compute time (no communication), for the speed emulation; timed on a
    # core of its own when the ranks outnumber the cores, as the device is.
    def own_compute() -> float:
        own = []
        for i in range(warmup + 3):
            t0 = time.perf_counter()
            with ddp.no_sync():
                local_step()
            if i >= warmup:
                own.append(time.perf_counter() - t0)
        return statistics.median(own)

    compute_s = side_by_side(rank, own_compute)

    def step() -> None:
        # The pause sits between this rank's forward and its backward, where a slower device
        # spends its extra time: after DDP's broadcast of the BatchNorm buffers at the start of
        # the forward (a pause before it would hold every rank there) and before the gradients
        # reach the allreduce.
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y)
        emulate_speed(compute_s, speeds[rank])
        loss.backward()
        opt.step()

    step_s, devices = timed_steps(rank, step, steps, warmup, calibrate_here)
    return {"step_s": step_s, "devices": devices, **measured}


def filter_rank(
    rank: int,
    world: int,
    model_name: str,
    input_shape: tuple[int, ...],
    batch: int,
    parts: list[float],
    speeds: list[float],
    avoid_gathers: bool,
    steps: int,
    warmup: int,
    calibrate_here: bool,
) -> dict[str, object]:
    import torch
    import torch.nn.functional as F

    from hetcoll.lab.emulate import slow_down_filter_parallel
    from hetcoll.model import networks
    from hetcoll.torch.filters import FilterParallelLayer, filter_parallel

    measured = {
        **link_here(rank, world, calibrate_here, hetcoll_allreduce=True),
        **scheduler_here(rank, world),
    }
    torch.manual_seed(0)
    model = filter_parallel(
        networks.build(model_name, input_shape), speeds=parts, avoid_gathers=avoid_gathers
    )
    slow_down_filter_parallel(model, speeds[rank])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    # Every rank trains on the same whole batch.
    torch.manual_seed(1)
    x = torch.randn(batch, *input_shape)
    y = torch.randint(0, 10, (batch,))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    step_s, devices = timed_steps(rank, step, steps, warmup, calibrate_here)
    split = {n: m for n, m in model.named_modules() if isinstance(m, FilterParallelLayer)}
    return {
        "step_s": step_s,
        "devices": devices,
        "modes": {n: m.mode for n, m in split.items()},
        "shares": {n: list(m.shares) for n, m in split.items()},
        "params": sum(p.numel() for p in model.parameters()),
        **measured,
    }


def plan_rank(
    rank: int,
    world: int,
    model_name: str,
    input_shape: tuple[int, ...],
    plan: dict[str, Any],
    speeds: list[float],
    steps: int,
    warmup: int,
    calibrate_here: bool,
) -> dict[str, object]:
    import warnings

    import torch
    from torch import nn

    from hetcoll.lab.emulate import slow_down
    from hetcoll.model import networks
    from hetcoll.torch import parallelize

    measured = {**link_here(rank, world, calibrate_here), **scheduler_here(rank, world)}
    # A stage's first layer whose input needs no gradient has no backward the emulation can
    # time: torch warns, the layer's backward runs at full speed, and so does the model.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    torch.manual_seed(0)
    par = parallelize(networks.build(model_name, input_shape), plan, loss_fn=nn.CrossEntropyLoss())
    if par.stage is not None:
        slow_down(par.stage, speeds[rank])
    opt = torch.optim.SGD(par.parameters(), lr=1e-3, momentum=0.9)
    # Every rank gets the same global batch.
    batch = sum(r["samples"] for r in plan["replicas"])
    torch.manual_seed(1)
    x = torch.randn(batch, *input_shape)
    y = torch.randint(0, 10, (batch,))

    def step() -> None:
        par.step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step_s, devices = timed_steps(rank, step, steps, warmup, calibrate_here)
    return {"step_s": step_s, "devices": devices, **measured}
