"""Validate the model on this machine: run real data-parallel steps (plain torch DDP on gloo, one
process per rank through :func:`hetcoll.launch.spawn`, per-rank batch sizes) and compare the
measured step time with :func:`hetcoll.model.predict.data_parallel`.

Heterogeneity is *emulated*: a rank of speed factor f sleeps (1/f - 1) x its own measured compute
time after each step (:func:`emulate_speed`), and the model sees a device whose FLOP/s, memory
bandwidth and kernel overhead are scaled by f. The device and link figures come either from a
calibration file (ranks beyond the number of cores then share cores: each rank's device is
slowed by cores / ranks) or, by default, from the same microbenchmarks run inside the ranks
before every step (medians, all ranks at once; the link fitted once to gloo allreduce times by
the ring model) - on a shared machine that is the only way to predict under the load the steps
see. DDP's overlap of allreduce and backward is modelled only while the ranks leave cores free
(gloo's copies and reductions need the cores the compute uses).

Filter-parallel validation waits for the filter-parallel layers (hetcoll.torch); it is not run.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from hetcoll.model.costs import ModelCosts, layer_costs
from hetcoll.model.hardware import Cluster, Device, Link, Node
from hetcoll.model.predict import data_parallel


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


def _validation_rank(
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

    measured: dict[str, object] = {}
    if calibrate_here:
        # The link as the DDP allreduce sees it: all ranks at once, sharing the cores.
        from hetcoll.model import calibrate

        calibrate.set_statistic("median")
        if world > 1:
            sizes = (1024, 8 * 1024 * 1024)
            measured["allreduce_s"] = calibrate.gloo_allreduce_seconds(rank, world, sizes, 3)
    torch.manual_seed(0)
    model = networks.build(model_name, input_shape)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)
    torch.manual_seed(1 + rank)
    x = torch.randn(shares[rank], *input_shape)
    y = torch.randint(0, 10, (shares[rank],))

    def local_step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x), y).backward()
        opt.step()

    # This rank's own compute time (no communication), for the speed emulation.
    own = []
    for i in range(warmup + 3):
        t0 = time.perf_counter()
        with ddp.no_sync():
            local_step()
        if i >= warmup:
            own.append(time.perf_counter() - t0)
    compute_s = statistics.median(own)
    torch.distributed.barrier()
    for _ in range(warmup):
        local_step()
        emulate_speed(compute_s, speeds[rank])
    # Steps timed one by one, each right after the device figures are measured again by every
    # rank at once (so the prediction for step k sees the load step k sees: on a shared machine
    # the load changes within seconds). The caller pairs them and takes medians.
    step_s, devices = [], []
    for _ in range(steps):
        if calibrate_here:
            torch.distributed.barrier()
            devices.append(calibrate.measure_device(f"rank{rank}", 1e12, quick=True))
        torch.distributed.barrier()
        t0 = time.perf_counter()
        # The pause "after step k-1" is taken here, after the barrier, at the start of step k:
        # that way it delays this rank's arrival at the allreduce as a slower device would.
        # (Taken after the step it would sit behind the allreduce, where no device's slowness
        # can be, and the barrier would put it on every step's critical path.)
        emulate_speed(compute_s, speeds[rank])
        local_step()
        step_s.append(time.perf_counter() - t0)
    return {"step_s": step_s, "compute_s": compute_s, "devices": devices, **measured}


@dataclass
class ValidationResult:
    """One configuration: predicted and measured seconds per step."""

    model: str
    ranks: int
    shares: list[int]
    speeds: list[float]
    predicted_s: float
    measured_s: float
    overlap: bool = True
    predicted_other_s: float = 0.0  # the prediction with the other overlap setting

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted_s - self.measured_s) / self.measured_s


def validation_cluster(
    devices: Sequence[Device], link: Link, speeds: Sequence[float], cores: int | None = None
) -> Cluster:
    """The model's view of ``len(speeds)`` local ranks: rank r runs on ``devices[r]`` slowed by
    its emulated speed factor and, if ``cores`` is given and the ranks outnumber the cores (the
    devices were measured alone), by cores / ranks."""
    p = len(speeds)
    share = min(1.0, cores / p) if cores else 1.0
    nodes = [
        Node(
            f"rank{r}",
            replace(
                d,
                name=f"rank{r}",
                flops_per_s=d.flops_per_s * f * share,
                mem_bytes_per_s=d.mem_bytes_per_s * f * share,
                elementwise_bytes_per_s=d.elementwise_rate * f * share,
                kernel_overhead_s=d.kernel_overhead_s / (f * share),
            ),
            1,
        )
        for r, (d, f) in enumerate(zip(devices, speeds))
    ]
    return Cluster(nodes, link if p > 1 else None, "<validation>")


def default_configurations(model: str = "cnn") -> list[tuple[str, list[int], list[float]]]:
    """(model, shares, speeds): 1-4 ranks, several batch sizes, balanced and unbalanced shares
    at even and uneven emulated speeds."""
    return [
        (model, [16], [1.0]),
        (model, [64], [1.0]),
        (model, [16, 16], [1.0, 1.0]),
        (model, [64, 64], [1.0, 1.0]),
        (model, [32, 32], [1.0, 0.5]),  # even shares, uneven speeds: the slow rank sets the pace
        (model, [43, 21], [1.0, 0.5]),  # shares balanced to the speeds
        (model, [24, 24, 24], [1.0, 1.0, 0.5]),
        (model, [29, 29, 14], [1.0, 1.0, 0.5]),
        (model, [16, 16, 16, 16], [1.0, 1.0, 1.0, 1.0]),
        (model, [32, 16, 8, 8], [1.0, 0.5, 0.25, 0.25]),
    ]


def run_validation(
    configurations: Sequence[tuple[str, list[int], list[float]]],
    *,
    device: Device | None = None,
    link: Link | None = None,
    input_shape: tuple[int, ...] = (3, 32, 32),
    steps: int = 9,
    warmup: int = 2,
    progress: Callable[[ValidationResult], None] | None = None,
) -> list[ValidationResult]:
    """Run each configuration for real and predict it; return both per configuration.

    Without ``device`` / ``link`` (a calibration file's), each configuration measures them in
    its own rank processes: the device before every step (GEMM, copy, kernel overhead,
    element-wise layers; every rank at once), the link once (gloo allreduce of 1 KiB and 8 MiB,
    fitted by the ring model). Step k is predicted from the figures measured just before it;
    the result pairs the median prediction with the median measured step (slowest rank).
    """
    from hetcoll.launch import spawn
    from hetcoll.model import networks

    cores = os.cpu_count() or 1
    costs_of: dict[str, ModelCosts] = {}
    results = []
    for model, shares, speeds in configurations:
        if len(shares) != len(speeds):
            raise ValueError(f"configurations: {len(shares)} shares but {len(speeds)} speeds")
        if model not in costs_of:
            costs_of[model] = layer_costs(networks.build(model, input_shape), input_shape)
        p = len(shares)
        here = device is None or (link is None and p > 1)
        runs = spawn(
            _validation_rank,
            p,
            model,
            tuple(input_shape),
            list(shares),
            list(speeds),
            steps,
            warmup,
            here,
            timeout=300.0,
        )
        per_step = [max(t) for t in zip(*(r["step_s"] for r in runs))]  # type: ignore[call-overload]
        measured = statistics.median(per_step)
        if link is not None:
            lk = link
        elif p > 1:
            from hetcoll.model.calibrate import fit_ring_allreduce

            slowest = [max(t) for t in zip(*(r["allreduce_s"] for r in runs))]  # type: ignore[call-overload]
            alpha, bw = fit_ring_allreduce(p, (1024, 8 * 1024 * 1024), slowest)
            lk = Link("gloo-allreduce", alpha, bw)
        else:
            lk = Link("none", 0.0, 1.0)
        # DDP overlaps the allreduce with the backward pass, but on a CPU host gloo's copies and
        # reductions run on the same cores as the compute: once the ranks fill the cores there
        # is nothing to overlap with, so the model runs them one after the other.
        overlap = p < cores

        def predict(
            devs: Sequence[Device],
            cores_arg: int | None,
            ov: bool,
            lk: Link = lk,
            speeds: list[float] = speeds,
            costs: ModelCosts = costs_of[model],
            shares: list[int] = shares,
        ) -> float:
            cluster = validation_cluster(devs, lk, speeds, cores_arg)
            return data_parallel(costs, cluster, shares, overlap=ov).step_s

        if device is not None:
            predicted, other = (predict([device] * p, cores, ov) for ov in (overlap, not overlap))
        else:
            steps_devices = list(zip(*(r["devices"] for r in runs)))  # type: ignore[call-overload]
            predicted, other = (
                statistics.median([predict(list(d), None, ov) for d in steps_devices])
                for ov in (overlap, not overlap)
            )
        res = ValidationResult(
            model, p, list(shares), list(speeds), predicted, measured, overlap, other
        )
        results.append(res)
        if progress:
            progress(res)
    return results


def summary(results: Sequence[ValidationResult]) -> tuple[float, float]:
    """(median, worst) absolute relative error."""
    errs = [abs(r.error) for r in results]
    return statistics.median(errs), max(errs)
