"""Plans on real devices (issue 40, item 4): one GPU rank beside CPU ranks in one gloo group,
the demo CNN run by :func:`hetcoll.torch.parallelize` under ten or eleven plans, each step
measured and predicted by the performance model.

    python benches/device/plans.py --cluster OUT/cluster.toml --json OUT/plans.json

One job of 1 GPU rank + ``--cpu-ranks`` one-thread CPU ranks (3 by default; at least 2). Every
rank first measures its own training step (:func:`hetero.speeds_here`: the shares below come
from these speeds), then the ranks run each plan in turn (global batch ``--batch``, SGD):

- **data-parallel**, whole-model replicas: *balanced* (:func:`hetcoll.split` of the measured
  fits: a rank whose fixed cost alone outlasts the step gets no sample and idles), *balanced,
  every rank* (the same with at least one sample each; run when it differs), *equal* (what DDP
  does), *the GPU alone* (the CPU ranks idle) and *a device subset* (the GPU and CPU rank 1,
  balanced; the others idle);
- **filter split**: one stage of the whole model over every rank, its channels split by the
  measured speeds; the same over the GPU and CPU rank 1;
- **pipeline**: the GPU's stage (the convolutions and the pool, layers 0-4) feeding CPU rank 1's
  (the head, layers 5-8), 1F1B over ``--microbatches``; the head cut into one stage per CPU rank
  (GPipe); the head as one stage filter-split over the CPU ranks;
- **hybrid**: that 2-stage pipeline beside whole-model replicas on CPU ranks 2..C, the batch
  split between the replicas by their speeds (the pipeline's: the GPU's);
- **the planner's pick**: the plan :func:`hetcoll.model.plan` ranks first for these ranks (the
  calibration's CPU ranks and link, the GPU as measured), what a user asking the planner would
  run; ``planner_over`` gives its throughput over the GPU alone's and the best other plan's.

Each plan runs on the ranks a user starts for it (:func:`jobs.plan_group`): 0 up to the last rank
it names, as ``hetcoll plan`` prints the commands; a plan leaving the last ranks idle (the GPU
alone, the device subset, often the planner's pick) runs without them, in a group of its own.
A step is ``par.step`` + the optimizer's step, between barriers, the GPU synchronized; its time is
the slowest rank's; the figure is the median over ``--steps`` steps after ``--warmup``. Rank 0
predicts each plan's step with :func:`hetcoll.model.predict_plan` on this machine's ranks
(:func:`hetero.real_cluster`: the GPU as :func:`hetero.measure_gpu` measured it in the parent,
the CPU ranks and the gloo link from ``hetcoll model calibrate``'s ``--cluster``) and rewrites
``--json`` after each plan, so a timeout keeps what was measured.

Without CUDA (the dry run) rank 0 is a CPU rank like the others (the model sees it through
:func:`hetero.measure_gpu`'s probes run on the CPU), the JSON says
``"status": "skipped: no CUDA (dry run, rank 0 on the CPU)"`` and its figures mean nothing.
"""

from __future__ import annotations

import functools
import statistics
import sys
from typing import Any

import torch
from torch import nn

import hetcoll
from hetcoll.model import layer_costs, predict_plan

import jobs
from hetero import (
    SHAPE,
    demo_model,
    demo_pool,
    real_cluster,
    speeds_here,
    strict_fp32,
    without_step_overhead,
)
from jobs import (
    ALONE,
    PICK,
    plan_stepper,
    planner_over,
    planner_pick,
    prediction,
    run_configurations,
    runtime_breakdown,
    slowest_rank_seconds,
    started_ranks,
    write_results,
)

LR = 0.05
#: DemoNet's plan layers: the convolutions and the pool (the compute), then the head.
CONVS = (0, 5)
LAYERS = 9


def _cut(lo: int, hi: int, parts: int) -> list[list[int]]:
    """``[lo, hi)`` in ``parts`` contiguous near-equal ranges."""
    n = hi - lo
    sizes = [n // parts + (1 if i < n % parts else 0) for i in range(parts)]
    out, at = [], lo
    for s in sizes:
        out.append([at, at + s])
        at += s
    return out


def plans(
    speeds: list[float], latency: list[float], batch: int, microbatches: int
) -> dict[str, tuple[str, dict[str, Any]]]:
    """Name -> (kind, plan dict) for 1 GPU rank (rank 0) + ``len(speeds) - 1`` CPU ranks,
    shares from the measured ``speeds`` (samples/s) and ``latency`` (fixed seconds a step)."""
    world = len(speeds)
    cpus = list(range(1, world))
    if len(cpus) < 2:
        raise ValueError(f"--cpu-ranks: the plans need at least 2 CPU ranks, got {len(cpus)}")
    whole = [0, LAYERS]
    head = [CONVS[1], LAYERS]

    def one(stages: list[dict[str, Any]], samples: int = batch) -> dict[str, Any]:
        return {"samples": samples, "stages": stages}

    def replicas(ranks: list[int], shares: list[int]) -> list[dict[str, Any]]:
        """A replica per rank with samples (ranks with none idle)."""
        return [one([{"ranks": [r], "layers": whole}], s) for r, s in zip(ranks, shares) if s]

    def plan(reps: list[dict[str, Any]], m: int = 1, schedule: str = "1F1B") -> dict[str, Any]:
        return {"microbatches": m, "schedule": schedule, "replicas": reps}

    balanced = hetcoll.split(batch, speeds, latency=latency)
    every = hetcoll.split(batch, speeds, latency=latency, minimum=1)
    equal = hetcoll.split(batch, [1.0] * world)
    pair = hetcoll.split(batch, speeds[:2], latency=latency[:2], minimum=1)
    gpu_stage = {"ranks": [0], "layers": list(CONVS)}
    pipeline = [gpu_stage, {"ranks": [1], "layers": head}]
    n_head = min(len(cpus), head[1] - head[0])
    head_cuts = _cut(head[0], head[1], n_head)
    # The hybrid: the 2-stage pipeline's throughput is about the GPU's (its convolutions are
    # nearly all the compute, the head on CPU rank 1 little), beside CPU ranks 2.. as replicas.
    hybrid = hetcoll.split(
        batch, [speeds[0], *speeds[2:]], latency=[latency[0], *latency[2:]], minimum=1
    )
    out = {
        "data-parallel, balanced": ("data-parallel", plan(replicas([0, *cpus], balanced))),
        "data-parallel, balanced, every rank": (
            "data-parallel",
            plan(replicas([0, *cpus], every)),
        ),
        "data-parallel, equal split": ("data-parallel", plan(replicas([0, *cpus], equal))),
        ALONE: ("data-parallel", plan(replicas([0], [batch]))),
        "device subset: GPU + CPU 1": ("data-parallel", plan(replicas([0, 1], pair))),
        "filter split over every rank": (
            "filter split",
            plan([one([{"ranks": [0, *cpus], "speeds": speeds, "layers": whole}])]),
        ),
        "filter split: GPU + CPU 1": (
            "filter split",
            plan([one([{"ranks": [0, 1], "speeds": speeds[:2], "layers": whole}])]),
        ),
        "pipeline: GPU convs, CPU 1 head": ("pipeline", plan([one(pipeline)], microbatches)),
        "pipeline: GPU convs, head over CPU stages": (
            "pipeline",
            plan(
                [one([gpu_stage] + [{"ranks": [r], "layers": c} for r, c in zip(cpus, head_cuts)])],
                microbatches,
                "GPipe",
            ),
        ),
        "pipeline: GPU convs, head split over CPUs": (
            "pipeline + filter split",
            plan(
                [one([gpu_stage, {"ranks": cpus, "speeds": speeds[1:], "layers": head}])],
                microbatches,
            ),
        ),
        "hybrid: pipeline beside CPU replicas": (
            "hybrid",
            plan(
                [one(pipeline, hybrid[0]), *replicas(cpus[1:], hybrid[1:])],
                microbatches,
            ),
        ),
    }
    if every == balanced:  # the split used every rank: one run of it is enough
        del out["data-parallel, balanced, every rank"]
    return out


def _step_times(
    plan: dict[str, Any], dev: torch.device, x: Any, y: Any, warmup: int, steps: int
) -> list[float]:
    """Each timed step's seconds (the slowest rank's) of ``plan`` under parallelize, on the
    ranks a user starts for it (:func:`jobs.plan_group`)."""
    from hetcoll.torch import parallelize

    torch.manual_seed(0)
    planned = plan_stepper(
        plan,
        lambda group: parallelize(
            demo_model().to(dev), plan, loss_fn=nn.functional.cross_entropy, group=group
        ),
        lambda params: torch.optim.SGD(params, lr=LR),
    )
    step = functools.partial(planned, x, y)
    times = [slowest_rank_seconds(step, dev) for _ in range(warmup + steps)]
    return times[warmup:]


@functools.cache
def _costs() -> Any:
    """The demo CNN's layer costs, computed once (rank 0: the planner's pick and every
    prediction read them)."""
    return layer_costs(demo_model(), SHAPE)


def _predict(cfg: dict[str, Any], world: int, plan: dict[str, Any], measured: float) -> Any:
    cluster, _, why_not = real_cluster(cfg["cluster"], cfg["gpu"], world)
    if why_not is not None:
        return {"status": why_not}
    step, without = (
        predict_plan(_costs(), c, hetcoll.Plan.from_dict(plan)).step_s
        for c in (cluster, without_step_overhead(cluster))
    )
    return prediction(step, without, measured)


def rank_main(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """One rank; rank 0 writes ``cfg["json"]`` after each plan and returns the result."""

    gpu = rank == 0 and cfg["cuda"]
    dev = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        strict_fp32()  # float32 as measure_gpu measured it
    batch = cfg["batch"]
    x, y = demo_pool(batch)
    x, y = x.to(dev), y.to(dev)  # the GPU rank's data on the GPU, as a loader would put it
    fits = speeds_here(dev, x, y, batch, cfg["probe_s"])
    speeds = [f.samples_per_s for f in fits]
    latency = [f.latency_s for f in fits]
    result: dict[str, Any] = cfg["result"]
    result["devices"] = ["cuda" if (r == 0 and cfg["cuda"]) else "cpu" for r in range(world)]
    if rank == 0:  # the report's staging note: the bytes the cost model counts
        result["gradient_bytes"] = _costs().gradient_bytes
    result["speeds"] = [
        {"rank": r, "samples_per_s": s, "latency_s": a}
        for r, (s, a) in enumerate(zip(speeds, latency))
    ]

    def measure(plan: dict[str, Any]) -> dict[str, Any]:
        times = _step_times(plan, dev, x, y, cfg["warmup"], cfg["steps"])
        step = statistics.median(times)
        return {
            "step_s": step,
            "quartiles_s": statistics.quantiles(times, n=4, method="inclusive")[::2],
            "samples_per_s": batch / step,
        }

    runs = plans(speeds, latency, batch, cfg["microbatches"])
    pick = planner_pick(cfg, world, _costs)
    if pick is not None:
        runs[PICK] = pick
    out = run_configurations(
        rank,
        result,
        runs,
        measure,
        lambda plan, step: _predict(cfg, started_ranks(plan), plan, step),
        cfg["json"],
        lambda result: planner_over(result, "samples_per_s"),
    )
    # Last: a hang here (the job's timeout) keeps every plan's figures already written.
    breakdown = runtime_breakdown(
        rank,
        runs[ALONE][1],
        demo_model,
        lambda model, inputs: model(inputs),
        nn.functional.cross_entropy,
        lambda params: torch.optim.SGD(params, lr=LR),
        (x, y),
        dev,
        cfg["steps"],
    )
    if out is not None and breakdown is not None:
        out["runtime"] = breakdown
        write_results(cfg["json"], out)
    return out


def main(argv: list[str] | None = None) -> int:
    args = jobs.parse(
        __doc__, argv, min_cpu_ranks=2, batch=256, batch_help="the global batch", warmup=3, steps=15
    )  # two CPU ranks at least: the hybrid needs them
    about = {"model": "DemoNet (hetcoll.lab.demo_ranks), 1x8x8 inputs, SGD"}
    return jobs.main(rank_main, args, about)


if __name__ == "__main__":
    sys.exit(main())
