"""Balanced vs unbalanced data-parallel training (the demo's job), repeated, medians reported.

Two gloo ranks with *emulated* speeds 1 and 0.25 (a slow rank sleeps in proportion to its real
compute; see hetcoll.lab.emulate), the demo CNN on scikit-learn's digits. The peer is the
unbalanced run in the same launch: equal batches, DDP's own averaging. Targets (issue 3):
balanced >= 90% of the ideal (sum of each rank's measured speed), >= 2.0x the unbalanced run
(2.5x is the ceiling for speeds 1 and 0.25), accuracy within 1 point.

    .venv/bin/python -m pytest benches/bench_data_parallel.py -s

Both engines: gloo (DDP and the weighted comm hook) and MPI (the MPI DistributedOptimizer).
``test_user_job`` measures the same with a user's own job, ``examples/train_balanced.py`` under
torchrun and mpiexec, against plain DDP. ``test_weighted_hook_against_ddps_own`` measures what
exact weighting costs a DDP step: the weighted hook against DDP's own hook at equal shares, on
models whose gradients fill a bucket of a few KiB to a few MiB (no emulation: both ranks at
their own speed), and what hetcoll's runtime costs one: :func:`hetcoll.torch.parallelize` running a
data-parallel plan of the same shares, against the same DDP step.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from hetcoll import launch
from hetcoll.lab.demo import DemoConfig, run, summary_rows

GROUP = "data parallel, 2 ranks, emulated speeds 1 and 0.25 (median of 3 launches), {}"


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_balanced_vs_unbalanced(benchmark, figure, backend):
    group = GROUP.format(backend)
    cfg = DemoConfig(speeds=(1.0, 0.25), progress=False, backend=backend)
    reports = []
    benchmark.pedantic(lambda: reports.append(run(cfg)), rounds=3, iterations=1)
    speedup, of_ideal, of_in_run, acc_diff, shares = [], [], [], [], []
    for report in reports:
        rows = {r["run"]: r for r in summary_rows(report)}
        b, u = rows["balanced"], rows["unbalanced"]
        speedup.append(b["samples_per_s"] / u["samples_per_s"])
        of_ideal.append(b["fraction_of_ideal"])
        of_in_run.append(b["fraction_of_in_run_ideal"])
        acc_diff.append(100 * (b["test_accuracy"] - u["test_accuracy"]))
        shares.append(b["shares"])
    figure(
        group,
        "balanced / unbalanced throughput",
        f"{statistics.median(speedup):.2f}x (runs: {', '.join(f'{x:.2f}' for x in speedup)})",
        headline=True,
    )
    figure(
        group,
        "balanced throughput / ideal",
        f"{statistics.median(of_ideal):.0%} (runs: {', '.join(f'{x:.0%}' for x in of_ideal)})",
        headline=True,
    )
    figure(
        group,
        "balanced throughput / in-run ideal (each rank's own compute in the run)",
        f"{statistics.median(of_in_run):.0%} (runs: {', '.join(f'{x:.0%}' for x in of_in_run)})",
    )
    figure(
        group,
        "unbalanced throughput / ideal",
        ", ".join(f"{summary_rows(r)[0]['fraction_of_ideal']:.0%}" for r in reports),
    )
    figure(
        group, "accuracy balanced - unbalanced (points)", ", ".join(f"{x:+.1f}" for x in acc_diff)
    )
    figure(group, "balanced shares", "; ".join(map(str, shares)))


# -- a user's own job ------------------------------------------------------------------------------

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_balanced.py"
USER_GROUP = (
    "a user's job (examples/train_balanced.py, 3 epochs), 2 ranks, emulated speeds 1 and 0.25 "
    "(median of 3 launch pairs), {}"
)


def _launch(launcher: str, extra: list[str]) -> float:
    """One run of the example; its throughput (samples/s over all ranks, median of the
    epochs), as rank 0 reports it."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank{rank}.json"
        args = [str(EXAMPLE), "--emulate", "1,0.25", "--epochs", "3", "--quiet", "--json", str(out)]
        if launcher == "torchrun":
            torchrun = Path(sys.executable).parent / "torchrun"
            cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", *args, *extra]
            subprocess.run(cmd, check=True, capture_output=True, timeout=600)
        else:
            launch.mpiexec(2, [*args, *extra], timeout=600)
        report = json.loads(Path(tmp, "rank0.json").read_text())
    return statistics.median(e["samples_per_s"] for e in report["epochs"])


@pytest.mark.parametrize("launcher", ["torchrun", "mpiexec"])
def test_user_job(figure, launcher):
    """What a user measures with their own job: the example script, balanced (measured speeds,
    hetcoll's weighted averaging, the Rebalancer) against the same script with equal batches —
    under torchrun PyTorch's DDP as it ships (``--plain-ddp``), under mpiexec hetcoll's MPI
    optimizer at an even split (there is no plain MPI path to compare with)."""
    peer = ["--plain-ddp"] if launcher == "torchrun" else ["--shares", "64,64", "--no-rebalance"]
    ratios = []
    for i in range(3):  # alternate which runs first: the host's load drifts
        order = [[], peer] if i % 2 == 0 else [peer, []]
        rates = {tuple(extra): _launch(launcher, extra) for extra in order}
        ratios.append(rates[()] / rates[tuple(peer)])
    what = "plain DDP" if launcher == "torchrun" else "an even split"
    figure(
        USER_GROUP.format(launcher),
        f"balanced / {what}, throughput",
        f"{statistics.median(ratios):.2f}x (runs: {', '.join(f'{x:.2f}' for x in ratios)})",
        headline=True,
    )


# -- the weighted hook's own cost, against DDP's own hook ------------------------------------------

HOOK_GROUP = (
    "the weighted hook and parallelize's data-parallel plan against DDP's own allreduce hook, "
    "2 gloo ranks, equal shares (medians of {rounds} interleaved rounds of 10 steps)"
)
HOOK_ROUNDS = 15
#: The models timed: a step's gradients in one bucket from a few KiB to a few MiB.
HOOK_MODELS = {
    "tiny MLP (4.8 KiB of gradients)": "tiny",
    "demo CNN (0.41 MiB)": "demo",
    "1024-wide Linear (4.3 MiB)": "wide",
}


def hook_model(kind: str) -> Any:
    from torch import nn

    from hetcoll.lab.demo_ranks import DemoNet

    if kind == "demo":
        return DemoNet()
    if kind == "tiny":
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))
    return nn.Sequential(
        nn.Flatten(), nn.Linear(64, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 10)
    )


#: The runtime's entry in the table: parallelize running a data-parallel plan.
RUNTIME = "parallelize"


def _hook_steps(rank: int, world: int, kind: str, rounds: int) -> dict[str, float]:
    """Rank 0's median seconds per step (forward, backward, SGD) of one model under DDP's own
    hook, under the weighted hook with each algorithm, and under :func:`hetcoll.torch.parallelize`
    running a data-parallel plan of the same shares (its step also sums the batch's loss),
    interleaved round by round."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hetcoll.torch import model_layers, parallelize, register_weighted_hook

    def batch(r: int) -> tuple[Any, Any]:
        g = torch.Generator().manual_seed(r)
        return torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)

    x, y = batch(rank)
    steps: dict[str, Any] = {}
    torch.manual_seed(0)
    model = hook_model(kind)
    whole = [0, len(model_layers(model))]
    plan = {
        "microbatches": 1,
        "schedule": "GPipe",
        "replicas": [
            {"samples": 4, "stages": [{"ranks": [r], "layers": whole}]} for r in range(world)
        ],
    }
    par = parallelize(model, plan, loss_fn=nn.functional.cross_entropy)
    par_opt = torch.optim.SGD(par.parameters(), lr=0.01)
    every = [batch(r) for r in range(world)]  # the global batch, each replica's rows in turn
    gx, gy = torch.cat([b[0] for b in every]), torch.cat([b[1] for b in every])

    def runtime_step() -> None:
        par.step(gx, gy)
        par_opt.step()
        par_opt.zero_grad()

    for name in ("DDP's own hook", "auto", "allreduce", "direct"):
        torch.manual_seed(0)
        ddp = DDP(hook_model(kind))
        if name != "DDP's own hook":
            register_weighted_hook(ddp, algorithm=name)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

        def step(ddp: Any = ddp, opt: Any = opt) -> None:
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()

        steps[name] = step
    steps[RUNTIME] = runtime_step
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(rounds + 3):  # three rounds to warm up (DDP rebuilds its buckets)
        for name, step in steps.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(10):
                step()
            dist.barrier()
            if r >= 3:
                times[name].append((time.perf_counter() - t0) / 10)
    return {name: statistics.median(t) for name, t in times.items()}


@pytest.mark.parametrize("model", list(HOOK_MODELS))
def test_weighted_hook_against_ddps_own(figure, model):
    """The price of exact weighting in a DDP step: the weighted hook ("auto", and each of its
    roads) against DDP's own allreduce hook on the same model and batches."""
    got = launch.spawn(
        _hook_steps, 2, HOOK_MODELS[model], HOOK_ROUNDS, threads_per_rank=1, timeout=600
    )[0]
    ddp = got["DDP's own hook"]
    roads = ", ".join(f"{name} {got[name] / ddp:.2f}x" for name in ("allreduce", "direct"))
    figure(
        HOOK_GROUP.format(rounds=HOOK_ROUNDS),
        f"{model}: step time, weighted hook (auto) / DDP's own",
        f"{got['auto'] / ddp:.2f}x ({got['auto'] * 1e3:.2f} ms against {ddp * 1e3:.2f} ms; "
        f"each road: {roads})",
        headline=model.startswith("demo"),
    )
    figure(
        HOOK_GROUP.format(rounds=HOOK_ROUNDS),
        f"{model}: step time, parallelize's data-parallel plan / DDP's own",
        f"{got[RUNTIME] / ddp:.2f}x ({got[RUNTIME] * 1e3:.2f} ms against {ddp * 1e3:.2f} ms)",
    )
