"""The pieces a demo rank runs (lab code: may import the library, never imported by it): the
digits data and CNN, the engine a rank trains on (gloo DDP with the weighted hook, or the MPI
``DistributedOptimizer``), the speed probe, evaluation and the data-parallel training loop.
:mod:`hetcoll.lab.demo` launches the ranks and reports; :mod:`hetcoll.lab.filter_demo` trains
the same network filter-parallel.
"""

from __future__ import annotations

import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hetcoll.lab.demo_config import DemoConfig
from hetcoll.lab.emulate import EmulatedSpeed
from hetcoll.torch import (
    BalancedSampler,
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


class Engine(ABC):
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
        self, model: nn.Module, weighted: bool, lr: float
    ) -> tuple[nn.Module, Any, Callable[[], float] | None]:
        """The wrapped model, the optimizer (each step's samples counted off the model's
        forwards) and, where the engine knows it, when this step's gradients were ready
        (``perf_counter``)."""


class Gloo(Engine):
    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def barrier(self) -> None:
        torch.distributed.barrier()

    def allgather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def prepare(self, model, weighted, lr):
        from torch.nn.parallel import DistributedDataParallel as DDP

        from hetcoll.torch import register_weighted_hook

        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
        if not weighted:
            return ddp, opt, None
        state = register_weighted_hook(ddp)
        return ddp, opt, lambda: state.ready_at


class Mpi(Engine):
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

    def prepare(self, model, weighted, lr):
        from hetcoll.torch import DistributedOptimizer, broadcast_parameters

        broadcast_parameters(model, self.comm)
        # Equal shares make the weighted mean the plain mean, as in the unbalanced run.
        opt = DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9), self.comm, model=model
        )
        return model, opt, None


# -- one rank's work ------------------------------------------------------------------------------


@dataclass
class RunResult:
    name: str
    shares: list[int]
    epochs: list[dict[str, Any]] = field(default_factory=list)
    rebalances: int = 0


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
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


def run_epochs(
    engine: Engine,
    cfg: DemoConfig,
    result: RunResult,
    samples: int,
    batch: int,
    step: Callable[[torch.Tensor], None],
    test: Callable[[], tuple[float, float]],
    *,
    whole_batches: bool = False,
) -> None:
    """``cfg.epochs`` epochs of ``step(indices)`` over the same permutation of ``samples`` on
    every rank (every rank sees the whole global batch), timed between barriers, with a
    progress bar and ``test()`` (loss, accuracy) after each; appended to ``result``.
    ``whole_batches``: leave out a last batch shorter than ``batch``."""
    gen = torch.Generator().manual_seed(cfg.seed)
    wall = 0.0
    for epoch in range(cfg.epochs):
        perm = torch.randperm(samples, generator=gen)
        steps = [idx for idx in perm.split(batch) if len(idx) == batch or not whole_batches]
        bar = progress_bar(cfg, engine.rank, result.name, epoch, len(steps))
        engine.barrier()
        t0 = time.perf_counter()
        for idx in steps:
            step(idx)
            if bar is not None:
                bar.update(1)
        engine.barrier()
        seconds = time.perf_counter() - t0
        wall += seconds
        if bar is not None:
            bar.close()
        loss, acc = test()
        trained = sum(len(idx) for idx in steps)
        result.epochs.append(
            {
                "epoch": epoch + 1,
                "train_seconds": seconds,
                "wall_seconds": wall,
                "samples": trained,
                "samples_per_s": trained / seconds,
                "test_loss": loss,
                "test_accuracy": acc,
            }
        )


def train_data_parallel(
    engine: Engine,
    cfg: DemoConfig,
    name: str,
    shares: list[int],
    real: SpeedFit,
    fits: list[SpeedFit] | None = None,
):
    rank = engine.rank
    xtr, ytr, xte, yte = load_digits(cfg.seed)
    torch.manual_seed(cfg.seed)
    net = DemoNet()
    model = EmulatedSpeed(net, cfg.speeds[rank], cost=real)
    weighted = name == "balanced"
    wrapped, opt, ready_at = engine.prepare(model, weighted, cfg.lr)
    sampler = BalancedSampler(range(len(ytr)), shares, rank, seed=cfg.seed, group=engine.group)
    rebalancer = (
        Rebalancer(sampler, every=10, fits=fits, threshold=0.05, group=engine.group)
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
        loss, acc = evaluate(net, xte, yte)
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


def probe(engine: Engine, cfg: DemoConfig) -> tuple[list[SpeedFit], SpeedFit]:
    """Each rank measures its real speed, the ranks agree on the cost the emulation scales (the
    fastest real fit: this machine's speed with the least interference from other processes,
    the same on every rank), then each measures its emulated speed, which is what the balanced
    split is solved from; every rank gets everybody's fit. Both time the whole training step:
    forward, backward and the optimizer's step. A rank's own real fit would pin the emulated
    speed to whatever load the host had during its probe, for the whole run."""
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

    mine = measure_speed(net, make_batch, loss, batch_sizes=sizes, warmup=2, optimizer=sgd)
    real = min(engine.allgather(mine), key=lambda f: f.predict(top))
    emulated = EmulatedSpeed(net, cfg.speeds[engine.rank], cost=real)
    fit = measure_speed(emulated, make_batch, loss, batch_sizes=sizes, warmup=1, optimizer=sgd)
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
