"""``hetcoll demo --strategy plan``: the planner picks a plan for the ranks' (emulated) speeds,
and the runtime runs it beside plain data parallelism with even shares.

Before any rank starts, this process measures the machine (one rank's compute, the link
between two local ranks of the chosen engine, gloo or MPI: :mod:`hetcoll.lab.calibrate`),
describes each rank as this machine
slowed to its emulated speed, and asks :func:`hetcoll.model.plan` for the fastest plan the
runtime can run. The ranks then train the demo CNN twice from the same weights:

- **unbalanced**: data parallelism with even shares (DDP on gloo, the MPI
  ``DistributedOptimizer`` under mpiexec), every rank slowed by its emulated speed
  (:class:`hetcoll.lab.emulate.EmulatedSpeed`, as in the data-parallel demo);
- **plan**: :func:`hetcoll.torch.parallelize` running the chosen plan, each rank's stage slowed
  by its emulated speed (:func:`hetcoll.lab.emulate.slow_down`).

Every figure is *emulated* heterogeneity on one machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import warnings
from typing import Any

import torch
from torch import nn

from hetcoll.lab.demo_config import DemoConfig
from hetcoll.lab.demo_ranks import (
    DemoNet,
    Engine,
    Gloo,
    Mpi,
    RunResult,
    evaluate,
    load_digits,
    probe,
    rank_rows,
    run_epochs,
    train_data_parallel,
)
from hetcoll.lab.emulate import emulated_device
from hetcoll.model.hardware import Cluster, Node
from hetcoll.plan import Plan


def choose_plan(cfg: DemoConfig) -> dict[str, Any]:
    """Measure this machine, plan for the emulated speeds; the best runnable plan and the
    predictions of every candidate."""
    from hetcoll.lab import calibrate
    from hetcoll.model import layer_costs, plan

    print("measuring this machine for the planner (about 15 s) ...", file=sys.stderr)
    base = calibrate.measure_device("cpu", 4e9, quick=True)
    link_fit = (
        calibrate.measure_mpi_link() if cfg.backend == "mpi" else calibrate.measure_gloo_link()
    )
    link = link_fit.link(f"{cfg.backend}, local")
    nodes = [
        Node(f"rank{r}", emulated_device(base, s, f"rank{r}"), 1) for r, s in enumerate(cfg.speeds)
    ]
    cluster = Cluster(nodes, link if len(nodes) > 1 else None, "<demo>")
    costs = layer_costs(DemoNet(), (1, 8, 8))
    ranked = plan(costs, cluster, cfg.global_batch)
    runnable = [p for p in ranked if p.feasible and p.plan is not None]
    if not runnable:
        raise ValueError("speeds: the planner found no plan the runtime can run")
    best = runnable[0]
    return {
        "plan": best.to_plan().to_dict(),
        "strategy": best.strategy,
        "predicted_step_s": best.step_s,
        "candidates": [
            {"strategy": p.strategy, "predicted_step_s": p.step_s, "runnable": p.plan is not None}
            for p in ranked
            if p.feasible
        ][:8],
    }


def _train_plan(engine: Engine, cfg: DemoConfig, plan: Plan) -> RunResult:
    from hetcoll.lab.emulate import slow_down
    from hetcoll.torch import parallelize

    rank = engine.rank
    xtr, ytr, xte, yte = load_digits(cfg.seed)
    torch.manual_seed(cfg.seed)
    par = parallelize(DemoNet(), plan, loss_fn=nn.CrossEntropyLoss(), group=engine.group)
    if par.stage is not None:
        slow_down(par.stage, cfg.speeds[rank])
        # The first stage's input needs no gradient, so torch warns that its first layer's
        # backward hook fires on outputs only: that layer's backward is not slowed.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
    opt = torch.optim.SGD(par.parameters(), lr=cfg.lr, momentum=0.9)
    result = RunResult("plan", [r.samples for r in plan.replicas])

    def step(idx: torch.Tensor) -> None:
        par.step(xtr[idx], ytr[idx])
        opt.step()
        opt.zero_grad()

    def test() -> tuple[float, float]:
        net = DemoNet()
        net.load_state_dict(par.full_state_dict())
        return evaluate(net, xte, yte)

    # A plan takes whole global batches only.
    run_epochs(engine, cfg, result, len(ytr), plan.batch, step, test, whole_batches=True)
    return result


def run_rank(engine: Engine, cfg: DemoConfig, chosen: dict[str, Any]) -> dict[str, Any] | None:
    """Both runs on this rank; rank 0 returns the report."""
    import hetcoll

    torch.set_num_threads(1)
    fits, real = probe(engine, cfg)
    plan = Plan.from_dict(chosen["plan"])
    even = hetcoll.split(cfg.global_batch, [1.0] * engine.world)
    runs = [
        train_data_parallel(engine, cfg, "unbalanced", even, real),
        _train_plan(engine, cfg, plan),
    ]
    if engine.rank != 0:
        return None
    return {
        "config": dataclasses.asdict(cfg),
        "strategy": "plan",
        "emulated": True,
        "ranks": rank_rows(cfg, fits),
        "ideal_samples_per_s": sum(f.samples_per_s for f in fits),
        "chosen": chosen,
        "runs": {r.name: dataclasses.asdict(r) for r in runs},
    }


def _gloo_rank(rank: int, world: int, cfg: DemoConfig, chosen: dict[str, Any]) -> Any:
    return run_rank(Gloo(rank, world), cfg, chosen)


def run(cfg: DemoConfig) -> dict[str, Any]:
    """Plan in this process, then launch the ranks (gloo processes, or mpiexec for
    ``backend="mpi"``); return rank 0's report."""
    from hetcoll.launch import mpiexec, spawn

    chosen = choose_plan(cfg)
    print(
        f"planner's choice: {chosen['strategy']} (predicted {chosen['predicted_step_s'] * 1e3:.1f}"
        " ms a step)",
        file=sys.stderr,
    )
    if cfg.backend == "gloo":
        return spawn(_gloo_rank, cfg.world_size, cfg, chosen, timeout=1800)[0]
    with tempfile.TemporaryDirectory(prefix="hetcoll-plan-demo-") as tmp:
        path = os.path.join(tmp, "report.json")
        job = json.dumps({"config": dataclasses.asdict(cfg), "chosen": chosen})
        mpiexec(
            cfg.world_size, ["-m", __name__, "--mpi-rank", job, path], timeout=1800, capture=False
        )
        with open(path) as f:
            report: dict[str, Any] = json.load(f)
            return report


def _mpi_main(job_json: str, path: str) -> None:
    job = json.loads(job_json)
    report = run_rank(Mpi(), DemoConfig.from_dict(job["config"]), job["chosen"])
    if report is not None:
        with open(path, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--mpi-rank":
        _mpi_main(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: hetcoll demo --strategy plan (this module's entry point is for mpiexec)")
