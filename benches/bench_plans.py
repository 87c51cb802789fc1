"""Plans of one CNN on three gloo ranks of emulated speeds 1 : 0.5 : 0.25, and the same pipeline
under torch.distributed.pipelining:

    python benches/bench_plans.py [--launches 3] [--steps 30] [--json out.json]

Four plans of :class:`hetcoll.Plan`, each run by :func:`hetcoll.torch.parallelize` on a global
batch of 64 in 4 micro-batches:

- **pipeline**: one rank per stage, the stages cut by :func:`hetcoll.partition_chain` over each
  layer's measured forward + backward time and the ranks' speeds; 1F1B and GPipe;
- **asymmetric replicas**: rank 0 runs the whole model beside a 2-stage pipeline of ranks 1 and
  2, the batch split between the replicas by their throughputs;
- **filter-split stage**: rank 0 runs the first stage, ranks 1 and 2 split the second stage's
  channels by their speeds;
- **device subset**: ranks 0 and 1 run data-parallel replicas (batches split by their speeds),
  rank 2 is idle: it only slows a step down.

Peer, in the same launch: the pipeline's stages and micro-batches under
``torch.distributed.pipelining`` (``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B``);
``vs_torch_pipelining`` = torch's step time / hetcoll's with the same schedule.

Heterogeneity is *emulated* the same way for every run: each rank slows its own stage with
:func:`hetcoll.lab.emulate.slow_down` (each layer sleeps ``(1/speed - 1)`` times its own forward
and backward). A step is forward, backward and an SGD step; its time is the slowest rank's
(barrier, step, max over ranks), the configurations taking turns step by step in an order
shuffled every step; the figure is the median over steps after warm-up, and over launches the
median of the launches' medians.

``predicted_s`` is the model's step for the emulated cluster as the emulation runs it
(:func:`hetcoll.lab.predict_emulated.parallel_plan`: the library's laid-out plan with the
sleeps and the host's shared cores put in: with more ranks than cores, each collective's
wake-up cost fitted to lock-step stretches the ranks run at the start of the launch, as
``hetcoll model validate`` fits it); ``planner_s`` is what the planner itself predicts,
each rank a device slowed to its speed (:func:`hetcoll.model.predict_plan`). Both take the
ranks' devices measured inside the launch every ``DEVICE_EVERY`` steps, under the load the
steps see (on a shared host a calibration made before the launch misses it): the launch's
prediction is the median over those measurements, and the figure the median over launches.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hetcoll
from hetcoll import launch

SPEEDS = (1.0, 0.5, 0.25)
BATCH = 64
MICROBATCHES = 4
SHAPE = (3, 16, 16)
CLASSES = 10


def conv_net() -> nn.Sequential:
    """15 layers, ~15 ms forward + backward on one quiet core for a micro-batch of 16
    (3 x 16 x 16), nearly all of it in the five convolutions; ReLUs not in place (the
    emulation's backward hooks forbid it)."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(64, 128, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(128, 128, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, CLASSES),
    )


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, *SHAPE, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)


# -- the plans ------------------------------------------------------------------------------------


def layer_seconds(rows: int = BATCH // MICROBATCHES, repeats: int = 7) -> list[float]:
    """Each layer's forward + backward seconds on a micro-batch, one thread (best of
    ``repeats``): the costs the pipeline's stages are cut by."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = conv_net()
    x = torch.randn(rows, *SHAPE)
    best = [float("inf")] * len(model)
    for _ in range(repeats + 1):
        h = x
        for i, layer in enumerate(model):
            h = h.detach().requires_grad_(i > 0)
            t0 = time.perf_counter()
            out = layer(h)
            grad = torch.ones_like(out)
            out.backward(grad)
            best[i] = min(best[i], time.perf_counter() - t0)
            h = out
    return best


def _cuts(costs: Sequence[float], speeds: Sequence[float]) -> list[list[int]]:
    counts = hetcoll.partition_chain(list(costs), list(speeds))
    ranges, at = [], 0
    for n in counts:
        ranges.append([at, at + n])
        at += n
    return ranges


def _pipeline_seconds(costs: Sequence[float], speeds: Sequence[float]) -> float:
    """Seconds per sample-worth of cost of a pipeline of one-rank stages cut by
    :func:`_cuts`: its bottleneck stage, times the GPipe bubble ``(m + S - 1) / m``."""
    stages = _cuts(costs, speeds)
    bottleneck = max(sum(costs[lo:hi]) / f for (lo, hi), f in zip(stages, speeds))
    return bottleneck * (MICROBATCHES + len(stages) - 1) / MICROBATCHES


def plans(costs: Sequence[float]) -> dict[str, dict[str, Any]]:
    """The benchmark's plans (dict form) for layer ``costs`` at :data:`SPEEDS`."""
    n = len(costs)
    total = sum(costs)
    fast, mid, slow = SPEEDS
    cuts = _cuts(costs, SPEEDS)
    if any(hi == lo for lo, hi in cuts):
        raise RuntimeError(f"partition_chain left a rank without layers: {cuts}")
    pipeline = [{"ranks": [r], "layers": lo_hi} for r, lo_hi in enumerate(cuts)]
    # Asymmetric replicas: the 2-stage replica's throughput is its bottleneck stage's, with the
    # pipeline's bubble; the batch is split by the two replicas' throughputs.
    rate = [fast / total, 1.0 / _pipeline_seconds(costs, (mid, slow))]
    samples = hetcoll.split(BATCH, rate, minimum=MICROBATCHES)
    second = _cuts(costs, (mid, slow))
    # Filter-split stage: ranks 1 and 2 together compute at mid + slow.
    first, split = _cuts(costs, (fast, mid + slow))
    subset = hetcoll.split(BATCH, [fast, mid], minimum=1)

    def one(replicas: list[dict[str, Any]], schedule: str = "1F1B") -> dict[str, Any]:
        return {"microbatches": MICROBATCHES, "schedule": schedule, "replicas": replicas}

    return {
        "pipeline (1F1B)": one([{"samples": BATCH, "stages": pipeline}]),
        "pipeline (GPipe)": one([{"samples": BATCH, "stages": pipeline}], "GPipe"),
        "asymmetric replicas": one(
            [
                {"samples": samples[0], "stages": [{"ranks": [0], "layers": [0, n]}]},
                {
                    "samples": samples[1],
                    "stages": [
                        {"ranks": [1], "layers": second[0]},
                        {"ranks": [2], "layers": second[1]},
                    ],
                },
            ]
        ),
        "filter-split stage": one(
            [
                {
                    "samples": BATCH,
                    "stages": [
                        {"ranks": [0], "layers": first},
                        {"ranks": [1, 2], "speeds": [mid, slow], "layers": split},
                    ],
                }
            ]
        ),
        "device subset": one(
            [
                {"samples": subset[0], "stages": [{"ranks": [0], "layers": [0, n]}]},
                {"samples": subset[1], "stages": [{"ranks": [1], "layers": [0, n]}]},
            ]
        ),
    }


#: The plans whose stages torch.distributed.pipelining runs too: plan name -> torch schedule.
TORCH_PEERS = {"pipeline (GPipe)": "ScheduleGPipe", "pipeline (1F1B)": "Schedule1F1B"}


# -- inside a rank ------------------------------------------------------------------------------


def _hetcoll_step(plan: dict[str, Any], speed: float) -> Callable[[], None]:
    from hetcoll.lab.emulate import slow_down
    from hetcoll.torch import parallelize

    torch.manual_seed(0)
    par = parallelize(conv_net(), plan, loss_fn=nn.CrossEntropyLoss())
    if par.stage is not None:
        slow_down(par.stage, speed)
    opt = torch.optim.SGD(par.parameters(), lr=0.01, momentum=0.9)
    x, y = _batch()

    def step() -> None:
        par.step(x, y)
        opt.step()
        opt.zero_grad()

    return step


def _torch_step(plan: dict[str, Any], schedule: str, rank: int, speed: float) -> Callable[[], None]:
    from torch.distributed import pipelining

    from hetcoll.lab.emulate import slow_down

    stages = plan["replicas"][0]["stages"]
    torch.manual_seed(0)
    layers = list(conv_net())
    lo, hi = stages[rank]["layers"]
    module = nn.Sequential(*layers[lo:hi])
    slow_down(module, speed)
    stage = pipelining.PipelineStage(module, rank, len(stages), torch.device("cpu"))
    make = getattr(pipelining, schedule)
    sched = make(stage, MICROBATCHES, loss_fn=nn.CrossEntropyLoss())
    opt = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9)
    x, y = _batch()
    first, last = rank == 0, rank == len(stages) - 1

    def step() -> None:
        if first:
            sched.step(x)
        elif last:
            losses: list[torch.Tensor] = []
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        opt.step()
        opt.zero_grad()

    return step


def _rank(
    rank: int, world: int, plan_dicts: dict[str, dict[str, Any]], steps: int, warmup: int
) -> dict[str, Any]:
    from hetcoll.lab.validate_ranks import scheduler_here

    torch.set_num_threads(1)
    # A stage's first layer whose input needs no gradient has no backward the emulation can
    # time (hetcoll.lab.emulate.SlowDown): torch warns; that layer's backward is not slowed.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    # With more ranks than cores: lock-step stretches, which the prediction's shared cores
    # are fitted to (the scheduler's time slice, the wake-up cost of a collective), as
    # `hetcoll model validate` fits them.
    scheduler = scheduler_here(rank, world)
    speed = SPEEDS[rank]
    runs: dict[str, Callable[[], None]] = {}
    for name, plan in plan_dicts.items():
        runs[name] = _hetcoll_step(plan, speed)
        if name in TORCH_PEERS:
            runs[f"torch {TORCH_PEERS[name]}"] = _torch_step(plan, TORCH_PEERS[name], rank, speed)
    times: dict[str, list[float]] = {name: [] for name in runs}
    devices = []
    for i in range(warmup + steps):
        if i >= warmup and (i - warmup) % DEVICE_EVERY == 0:
            devices.append(_device_here(rank))
        # A new order every step (the same on every rank), so that no configuration always
        # follows the same other one.
        order = list(runs)
        random.Random(i).shuffle(order)
        for name in order:
            step = runs[name]
            dist.barrier()
            t0 = time.perf_counter()
            step()
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if i >= warmup:
                times[name].append(float(t))
    return {"times": times, "devices": devices, **scheduler}


#: Timed steps between two measurements of the ranks' devices.
DEVICE_EVERY = 10


def _device_here(rank: int) -> Any:
    """This rank's device measured now, under the load the steps see, as many ranks at once
    as there are cores (:func:`hetcoll.lab.validate_ranks.side_by_side`: the prediction shares the
    cores itself), medians of the timings."""
    from hetcoll.lab import calibrate
    from hetcoll.lab.validate_ranks import side_by_side

    calibrate.set_statistic("median")
    dist.barrier()
    return side_by_side(rank, lambda: calibrate.measure_device(f"rank{rank}", 4e9, quick=True))


# -- the prediction -------------------------------------------------------------------------------


def predictors(
    devices: Sequence[Any], link: Any, costs: Any, host: Any
) -> dict[str, Callable[[dict[str, Any]], float]]:
    """``plan -> predicted seconds`` for the ranks' ``devices`` (each measured inside the
    launch, one thread, under the load its steps saw: :func:`_device_here`), this machine's
    gloo ``link`` and the model's ``costs`` (both measured once: :func:`main`), and the
    ``host``'s shared cores as the launch fitted them
    (:func:`hetcoll.lab.validate.shared_cores_of`), two ways:

    - ``"predicted_s"``: the step as the emulation runs it
      (:func:`hetcoll.lab.predict_emulated.parallel_plan`): each layer with parameters sleeps
      ``(1/f - 1)`` x its own time, the others run at full speed, and the ranks share this
      host's cores while they compute (a sleeping rank holds none);
    - ``"planner_s"``: what the planner sees (:func:`hetcoll.model.predict_plan`): each rank a
      device with every rate times its speed (:func:`hetcoll.lab.emulate.emulated_device`),
      on cores of its own."""
    import hetcoll.model as model
    from hetcoll.lab import predict_emulated
    from hetcoll.lab.emulate import emulated_device
    from hetcoll.lab.validate import validation_cluster

    slowed = validation_cluster([emulated_device(d, f) for d, f in zip(devices, SPEEDS)], link)
    full = validation_cluster(list(devices), link)

    def emulated(plan: dict[str, Any]) -> float:
        p = hetcoll.Plan.from_dict(plan)
        return float(predict_emulated.parallel_plan(costs, full, p, SPEEDS, host=host).step_s)

    def planner(plan: dict[str, Any]) -> float:
        return float(model.predict_plan(costs, slowed, hetcoll.Plan.from_dict(plan)).step_s)

    return {"predicted_s": emulated, "planner_s": planner}


# -- the caller -----------------------------------------------------------------------------------


def _quartiles(xs: Sequence[float]) -> tuple[float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launches", type=int, default=3, help="launches of the three ranks")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per configuration")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--only", nargs="+", metavar="PLAN", help="run only these plans (names)")
    args = ap.parse_args(argv)
    costs = layer_seconds()
    plan_dicts = plans(costs)
    if args.only:
        unknown = sorted(set(args.only) - set(plan_dicts))
        if unknown:
            ap.error(f"--only: no plan named {unknown[0]!r} (plans: {', '.join(plan_dicts)})")
        plan_dicts = {k: v for k, v in plan_dicts.items() if k in args.only}
    import hetcoll.model as model
    from hetcoll.lab import calibrate, predict_emulated
    from hetcoll.lab.validate import shared_cores_of

    cores = os.cpu_count() or 1
    fit = calibrate.measure_gloo_link()
    link = fit.link("gloo-local")
    model_costs = model.layer_costs(conv_net(), SHAPE)
    launches, predictions, hosts = [], [], []
    for _ in range(args.launches):
        ranks = launch.spawn(_rank, len(SPEEDS), plan_dicts, args.steps, args.warmup, timeout=1800)
        launches.append(ranks[0]["times"])
        host = shared_cores_of(ranks, cores) or predict_emulated.SharedCores(cores)
        hosts.append({"time_slice_s": host.time_slice_s, "wake_s": host.wake_s})
        # The launch's prediction: the median over its measurements of the ranks' devices.
        per_measure = [
            predictors(list(d), link, model_costs, host)
            for d in zip(*(r["devices"] for r in ranks))
        ]
        predictions.append(
            {
                name: {
                    k: statistics.median(p[k](plan) for p in per_measure) for k in per_measure[0]
                }
                for name, plan in plan_dicts.items()
            }
        )
    rows = []
    for name, plan in plan_dicts.items():
        medians = [statistics.median(t[name]) for t in launches]
        quartiles = [_quartiles(t[name]) for t in launches]
        peer = TORCH_PEERS.get(name)
        torch_medians = [statistics.median(t[f"torch {peer}"]) for t in launches] if peer else []
        ratios = [tm / m for tm, m in zip(torch_medians, medians)]
        rows.append(
            {
                "name": name,
                **{
                    key: statistics.median(p[name][key] for p in predictions)
                    for key in predictions[0][name]
                },
                "predicted_s_per_launch": [p[name]["predicted_s"] for p in predictions],
                "measured_s": statistics.median(medians),
                "vs_torch_pipelining": statistics.median(ratios) if ratios else None,
                "measured_s_per_launch": medians,
                "quartiles_s_per_launch": quartiles,
                "torch_schedule": peer,
                "torch_s_per_launch": torch_medians or None,
                "vs_torch_per_launch": ratios or None,
                "plan": plan,
            }
        )
    out = {
        "plans": rows,
        "speeds": list(SPEEDS),
        "batch": BATCH,
        "microbatches": MICROBATCHES,
        "input_shape": list(SHAPE),
        "layer_seconds": costs,
        "launches": args.launches,
        "steps": args.steps,
        "warmup": args.warmup,
        "step_s": launches,
        "shared_cores": hosts,
    }
    print(
        f"Emulated heterogeneity: {len(SPEEDS)} gloo ranks, speeds "
        f"{' : '.join(f'{s:g}' for s in SPEEDS)}; batch {BATCH} in {MICROBATCHES} micro-batches; "
        f"{args.launches} launch(es) x {args.steps} steps"
    )
    print(
        f"{'plan':<22} {'predicted (planner) ms':>22} {'measured (ms)':>14} {'launches (ms)':>24} "
        f"{'vs torch':>9}"
    )
    for row in rows:
        pred = f"{row['predicted_s'] * 1e3:.1f} ({row['planner_s'] * 1e3:.1f})"
        per = ", ".join(f"{m * 1e3:.1f}" for m in row["measured_s_per_launch"])
        vs = f"{row['vs_torch_pipelining']:.2f}x" if row["vs_torch_pipelining"] else "-"
        print(f"{row['name']:<22} {pred:>22} {row['measured_s'] * 1e3:14.1f} {per:>24} {vs:>9}")
    for row in rows:
        stages = [[s["ranks"], s["layers"]] for r in row["plan"]["replicas"] for s in r["stages"]]
        samples = [r["samples"] for r in row["plan"]["replicas"]]
        print(f"  {row['name']}: samples {samples}, stages (ranks, layers) {stages}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
