"""The main job's training: a small CNN on scikit-learn's bundled digits, trained on local ranks
of unequal (emulated) speed, unbalanced and balanced (see :mod:`hetcoll.demo_cli` for the command
and what it shows). Ranks run on gloo (DDP and the weighted comm hook) or MPI (the MPI
``DistributedOptimizer``); rank 0 returns the report that :func:`format_table` and :func:`plot`
present.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import hetcoll
from hetcoll.demo_cli import DemoConfig
from hetcoll.torch import (
    BalancedSampler,
    EmulatedSpeed,
    Rebalancer,
    SpeedFit,
    measure_speed,
)


class DemoNet(nn.Sequential):
    """Two 3x3 convolutions, a 4x4 max-pool and two linear layers for 8x8 digits (108k
    parameters). The convolutions hold nearly all the compute and the parameters are few, so a
    step is mostly compute and little gradient traffic, as in conv nets generally."""

    def __init__(self) -> None:
        super().__init__(
            nn.Conv2d(1, 64, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(64, 128, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(4),
            nn.Flatten(),
            nn.Linear(128 * 2 * 2, 64),
            nn.ReLU(),
            nn.Linear(64, 10),
        )


def load_digits(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled 8x8 digits (1,797 images, no download): 80% train, 20% test."""
    from sklearn.datasets import load_digits as sk_digits  # type: ignore[import-untyped]

    d = sk_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(y), generator=g)
    cut = int(0.8 * len(y))
    return x[perm[:cut]], y[perm[:cut]], x[perm[cut:]], y[perm[cut:]]


# -- the two engines ------------------------------------------------------------------------------


class _Engine(ABC):
    """What differs between torch.distributed and MPI: collectives and gradient averaging."""

    rank: int
    world: int
    #: What the Rebalancer gathers over (hetcoll.comm.wrap's argument).
    group: Any = None

    @abstractmethod
    def barrier(self) -> None: ...

    @abstractmethod
    def allgather(self, obj: Any) -> list[Any]: ...

    @abstractmethod
    def prepare(
        self, model: nn.Module, local_batch: int, weighted: bool, lr: float
    ) -> tuple[nn.Module, Any, Callable[[int], None], Callable[[], float] | None]:
        """The wrapped model, the optimizer, a setter of this rank's batch size and, where the
        engine knows it, when this step's gradients were ready (``perf_counter``)."""


class _Gloo(_Engine):
    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def barrier(self) -> None:
        torch.distributed.barrier()

    def allgather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def prepare(self, model, local_batch, weighted, lr):
        from torch.nn.parallel import DistributedDataParallel as DDP

        from hetcoll.torch import WeightedAllreduceState, weighted_allreduce_hook

        ddp = DDP(model)
        state = WeightedAllreduceState(None, local_batch)
        if weighted:
            ddp.register_comm_hook(state, weighted_allreduce_hook)

        def set_batch(n: int) -> None:
            state.local_batch = n

        ready = (lambda: state.ready_at) if weighted else None
        return ddp, torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9), set_batch, ready


class _Mpi(_Engine):
    def __init__(self) -> None:
        from mpi4py import MPI

        self.comm = MPI.COMM_WORLD
        self.rank, self.world = self.comm.Get_rank(), self.comm.Get_size()

    @property
    def group(self) -> Any:
        return self.comm

    def barrier(self) -> None:
        self.comm.Barrier()

    def allgather(self, obj: Any) -> list[Any]:
        return self.comm.allgather(obj)

    def prepare(self, model, local_batch, weighted, lr):
        from hetcoll.torch import DistributedOptimizer, broadcast_parameters

        broadcast_parameters(model, self.comm)
        # Equal shares make the weighted mean the plain mean, as in the unbalanced run.
        opt = DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
            self.comm,
            local_batch=local_batch,
        )

        def set_batch(n: int) -> None:
            opt.local_batch = n

        return model, opt, set_batch, None


# -- one rank's work ------------------------------------------------------------------------------


@dataclass
class RunResult:
    name: str
    shares: list[int]
    epochs: list[dict[str, Any]] = field(default_factory=list)
    rebalances: int = 0


def _evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    model.eval()
    with torch.no_grad():
        logits = model(x)
        loss = float(nn.functional.cross_entropy(logits, y))
        acc = float((logits.argmax(1) == y).float().mean())
    model.train()
    return loss, acc


def progress_bar(cfg: DemoConfig, rank: int, name: str, epoch: int, steps: int) -> Any:
    """A tqdm bar over one epoch's steps on rank 0 (None elsewhere or with progress off)."""
    if not (cfg.progress and rank == 0):
        return None
    from tqdm import tqdm  # type: ignore[import-untyped]

    return tqdm(
        total=steps,
        desc=f"{name:>10} epoch {epoch + 1}/{cfg.epochs}",
        file=sys.stderr,
        leave=True,
        dynamic_ncols=True,
    )


def _train(engine: _Engine, cfg: DemoConfig, name: str, shares: list[int], real: SpeedFit):
    rank = engine.rank
    xtr, ytr, xte, yte = load_digits(cfg.seed)
    torch.manual_seed(cfg.seed)
    net = DemoNet()
    model = EmulatedSpeed(net, cfg.speeds[rank], cost=real)
    weighted = name == "balanced"
    wrapped, opt, set_batch, ready_at = engine.prepare(model, shares[rank], weighted, cfg.lr)
    sampler = BalancedSampler(
        range(len(ytr)), shares, rank, seed=cfg.seed, verify=cfg.backend == "gloo"
    )
    rebalancer = (
        Rebalancer(sampler, every=10, threshold=0.05, group=engine.group)
        if cfg.rebalance and weighted
        else None
    )
    result = RunResult(name, list(shares))
    wall = 0.0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        steps = sampler.batch_sampler()
        bar = progress_bar(cfg, rank, name, epoch, len(steps))
        engine.barrier()
        t0 = time.perf_counter()
        samples, own = 0, 0.0
        for idx in steps:
            started = time.perf_counter()
            set_batch(len(idx))
            opt.zero_grad()
            nn.functional.cross_entropy(wrapped(xtr[idx]), ytr[idx]).backward()
            # This rank's own compute: until its gradients were ready, not waiting for others
            # (on MPI the gradients are averaged in opt.step, after this point).
            compute = (ready_at() if ready_at else time.perf_counter()) - started
            stepped = time.perf_counter()
            opt.step()
            # Its own time adds the optimizer's update where the step holds nothing else (DDP:
            # the gradients are averaged already; MPI's step averages them first).
            own += compute + (time.perf_counter() - stepped if ready_at else 0.0)
            samples += len(idx)
            if rebalancer is not None and rebalancer.observe(len(idx), compute):
                result.rebalances += 1
            if bar is not None:
                bar.update(1)
        engine.barrier()
        seconds = time.perf_counter() - t0
        wall += seconds
        per_rank = engine.allgather((samples, own))
        total_samples = sum(n for n, _ in per_rank)
        if bar is not None:
            bar.close()
        loss, acc = _evaluate(net, xte, yte)
        result.epochs.append(
            {
                "epoch": epoch + 1,
                "train_seconds": seconds,
                "wall_seconds": wall,
                "samples": total_samples,
                "samples_per_s": total_samples / seconds,
                "rank_samples": [n for n, _ in per_rank],
                "rank_compute_seconds": [c for _, c in per_rank],
                "test_loss": loss,
                "test_accuracy": acc,
            }
        )
    result.shares = list(sampler.shares)
    return result


def _probe(engine: _Engine, cfg: DemoConfig) -> tuple[list[SpeedFit], SpeedFit]:
    """Each rank measures its real speed once (the cost the emulation scales), then its emulated
    speed, which is what the balanced split is solved from; every rank gets everybody's fit. Both
    time the whole training step: forward, backward and the optimizer's step."""
    xtr, ytr, _, _ = load_digits(cfg.seed)
    torch.manual_seed(cfg.seed)
    net = DemoNet()

    def make_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return xtr[:b], ytr[:b]

    loss = nn.functional.cross_entropy
    top = max(8, cfg.global_batch)
    sizes = sorted({max(1, top // 8), max(2, top // 4), max(3, top // 2), top})

    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9)

    real = measure_speed(
        net, make_batch, loss, batch_sizes=sizes, warmup=2, repeats=5, optimizer=sgd
    )
    emulated = EmulatedSpeed(net, cfg.speeds[engine.rank], cost=real)
    fit = measure_speed(
        emulated, make_batch, loss, batch_sizes=sizes, warmup=1, repeats=5, optimizer=sgd
    )
    return engine.allgather(fit), real


def rank_rows(cfg: DemoConfig, fits: list[SpeedFit]) -> list[dict[str, Any]]:
    """The report's per-rank entries: emulated speed and the measured fit."""
    return [
        {
            "rank": r,
            "emulated_speed": cfg.speeds[r],
            "measured_samples_per_s": f.samples_per_s,
            "measured_latency_s": f.latency_s,
            "points": f.points,
        }
        for r, f in enumerate(fits)
    ]


def run_rank(engine: _Engine, cfg: DemoConfig) -> dict[str, Any] | None:
    """Both runs on this rank; rank 0 returns the report."""
    if cfg.strategy == "filter":
        from hetcoll.torch.filter_demo import run_rank as run_filter_rank

        return run_filter_rank(engine, cfg)
    torch.set_num_threads(1)
    fits, real = _probe(engine, cfg)
    speeds = [f.samples_per_s for f in fits]
    latency = [f.latency_s for f in fits]
    plans = {
        "unbalanced": hetcoll.split(cfg.global_batch, [1.0] * engine.world),
        "balanced": hetcoll.split(cfg.global_batch, speeds, latency=latency, minimum=1),
    }
    runs = [_train(engine, cfg, name, plans[name], real) for name in cfg.runs]
    if engine.rank != 0:
        return None
    balanced = plans["balanced"]
    ideal = sum(b / f.predict(b) for b, f in zip(balanced, fits))
    return {
        "config": dataclasses.asdict(cfg),
        "emulated": True,
        "ranks": rank_rows(cfg, fits),
        "ideal_samples_per_s": ideal,
        "predicted_balanced_step_s": max(f.predict(b) for b, f in zip(balanced, fits)),
        "runs": {r.name: dataclasses.asdict(r) for r in runs},
    }


def _gloo_rank(rank: int, world: int, cfg: DemoConfig) -> dict[str, Any] | None:
    return run_rank(_Gloo(rank, world), cfg)


# -- the launcher and the report ------------------------------------------------------------------


def run(cfg: DemoConfig) -> dict[str, Any]:
    """Launch the ranks (gloo processes, or mpiexec for ``backend="mpi"``); return the report."""
    cfg.validate()
    from hetcoll.launch import mpiexec, spawn

    if cfg.backend == "gloo":
        return spawn(_gloo_rank, cfg.world_size, cfg, timeout=1800)[0]
    with tempfile.TemporaryDirectory(prefix="hetcoll-demo-") as tmp:
        path = os.path.join(tmp, "report.json")
        argv = ["-m", "hetcoll.demo", "--mpi-rank", json.dumps(dataclasses.asdict(cfg)), path]
        mpiexec(cfg.world_size, argv, timeout=1800, capture=False)
        with open(path) as f:
            return json.load(f)


def _mpi_main(config_json: str, path: str) -> None:
    raw = json.loads(config_json)
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
    cfg = DemoConfig(**fields)
    report = run_rank(_Mpi(), cfg)
    if report is not None:
        with open(path, "w") as f:
            json.dump(report, f)


def _in_run_ideal(run_: dict[str, Any]) -> float:
    """Sum over ranks of each rank's own speed in this run: its samples over the seconds it
    spent computing them (forward and backward until its gradients were ready, and on DDP the
    optimizer's update; no waiting, no averaging), epoch 1 left out."""
    timed = run_["epochs"][1:] or run_["epochs"]
    if "rank_samples" not in timed[0]:  # runs that do not record it (the filter strategy)
        return float("nan")
    ranks = len(timed[0]["rank_samples"])
    return sum(
        sum(e["rank_samples"][r] for e in timed) / sum(e["rank_compute_seconds"][r] for e in timed)
        for r in range(ranks)
    )


def summary_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per run: seconds per epoch, samples/s, share of the ideal, final loss/accuracy.
    Epoch 1 is left out of the timing (warm-up).

    Two ideals, both the sum of the ranks' own speeds at the balanced shares: from the speed
    probe before training (``ideal_samples_per_s``), and from each rank's own compute time in
    the balanced run itself (``in_run_ideal_samples_per_s``; on a shared machine whose speed
    drifts within a minute, the probe's moment can be faster or slower than the run's)."""
    rows = []
    ideal = report["ideal_samples_per_s"]
    runs = report["runs"]
    in_run = _in_run_ideal(runs["balanced"]) if "balanced" in runs else float("nan")
    for name, run_ in runs.items():
        timed = run_["epochs"][1:] or run_["epochs"]
        secs = sum(e["train_seconds"] for e in timed)
        samples = sum(e["samples"] for e in timed)
        last = run_["epochs"][-1]
        rows.append(
            {
                "run": name,
                "shares": run_["shares"],
                "seconds_per_epoch": secs / len(timed),
                "samples_per_s": samples / secs,
                "ideal_samples_per_s": ideal,
                "fraction_of_ideal": samples / secs / ideal,
                "in_run_ideal_samples_per_s": in_run,
                "fraction_of_in_run_ideal": samples / secs / in_run,
                "test_loss": last["test_loss"],
                "test_accuracy": last["test_accuracy"],
            }
        )
    return rows


def format_table(report: dict[str, Any]) -> str:
    rows = summary_rows(report)
    in_run = not math.isnan(rows[0]["in_run_ideal_samples_per_s"])
    lines = [
        "Emulated heterogeneity: rank speeds "
        + ", ".join(f"{r['emulated_speed']:g}" for r in report["ranks"])
        + " (measured "
        + ", ".join(f"{r['measured_samples_per_s']:.0f}" for r in report["ranks"])
        + " samples/s)",
        f"{'run':<11} {'shares':<12} {'s/epoch':>8} {'samples/s':>10} {'ideal':>8} "
        f"{'of ideal':>9}"
        + (f" {'in-run':>7} {'of it':>6}" if in_run else "")
        + f" {'loss':>7} {'accuracy':>9}",
    ]
    for r in rows:
        lines.append(
            f"{r['run']:<11} {','.join(map(str, r['shares'])):<12} {r['seconds_per_epoch']:8.2f} "
            f"{r['samples_per_s']:10.0f} {r['ideal_samples_per_s']:8.0f} "
            f"{r['fraction_of_ideal']:8.0%}"
            + (
                f" {r['in_run_ideal_samples_per_s']:7.0f} {r['fraction_of_in_run_ideal']:5.0%}"
                if in_run
                else ""
            )
            + f" {r['test_loss']:7.3f} {r['test_accuracy']:9.2%}"
        )
    by = {r["run"]: r for r in rows}
    if "balanced" in by and "unbalanced" in by:
        lines.append(
            f"balanced / unbalanced throughput: "
            f"{by['balanced']['samples_per_s'] / by['unbalanced']['samples_per_s']:.2f}x; "
            f"accuracy difference: "
            f"{100 * (by['balanced']['test_accuracy'] - by['unbalanced']['test_accuracy']):+.1f}"
            " points"
        )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    """Throughput and test accuracy against wall time, both runs, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, run_ in report["runs"].items():
        t = [e["wall_seconds"] for e in run_["epochs"]]
        ax1.plot(t, [e["samples_per_s"] for e in run_["epochs"]], marker="o", label=name)
        ax2.plot(t, [100 * e["test_accuracy"] for e in run_["epochs"]], marker="o", label=name)
    ax1.axhline(report["ideal_samples_per_s"], ls="--", c="gray", label="ideal (sum of speeds)")
    ax1.set(xlabel="training wall time (s)", ylabel="samples / s", title="throughput per epoch")
    ax2.set(xlabel="training wall time (s)", ylabel="test accuracy (%)", title="accuracy")
    speeds = ", ".join(f"{r['emulated_speed']:g}" for r in report["ranks"])
    fig.suptitle(f"hetcoll demo: {len(report['ranks'])} ranks, emulated speeds {speeds}")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--mpi-rank":
        _mpi_main(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: hetcoll demo (this module's entry point is for mpiexec workers)")
