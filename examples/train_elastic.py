"""Elastic balanced training under torchrun: a checkpoint every step, and a restart on whatever
ranks are left continues exactly where training stopped.

    # on each of up to 3 nodes (one rank each), the same command but its own --speed:
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=1:3 --nproc-per-node=1 \\
        --max-restarts=3 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 --rdzv-id=job42 \\
        examples/train_elastic.py --checkpoints ckpt/ --speed 2.0

When a worker fails or a node is lost, torchrun stops the others and, while ``--max-restarts``
allows, starts the workers again on the nodes still present (``--nnodes=1:3``: any of 1 to 3).
Every start of this script reads the newest checkpoint in ``--checkpoints`` (model, optimizer,
sampler and step), solves the shares of the global batch anew for the ranks of this start
(``hetcoll.split`` over their speeds, the global batch unchanged) and continues the epoch from
the saved position with them. Each step applies the gradient of the whole global batch
(``BalancedSampler`` + the weighted DDP comm hook), so the model is the one a single process
trains on the same global batches, however many restarts and ranks there were:
``tests/test_elastic_torchrun.py`` loses a node mid-run and checks it to 1e-10 in float64.

``--speed``: this node's samples per second (comma-separated, one per local rank when
``--nproc-per-node`` > 1); left out, every rank measures itself (``measure_speed``) at each
start. Rank 0 writes each checkpoint (a file per step, written whole then renamed into place,
the previous one kept), a line per start in ``<checkpoints>/starts.jsonl`` and the final
weights to ``<checkpoints>/final.pt``. Run without torchrun it trains in one process: the
reference the test compares with. The rendezvous endpoint must outlive the nodes that may be
lost (``--rdzv-conf is_host=1`` on a node that stays, or a store of its own), and on this torch
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives each restart a fresh store (the agents' shared
one keeps the last attempt's keys, and gloo may read a dead peer's address from them: pytorch
#135712).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hetcoll
from hetcoll.torch import (
    BalancedSampler,
    SpeedFit,
    gather_speeds,
    measure_speed,
    register_weighted_hook,
)

SAMPLES, SEED = 53, 3  # 53 = 6 global batches of 8 and 5 more: each epoch ends on a small step


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)
    ).double()


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 1, 6, 6, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 3, (SAMPLES,), generator=g)


def make_optimizer(params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:06d}.pt"


def newest_checkpoint(directory: str | Path) -> Path | None:
    """The checkpoint of the latest step in ``directory`` (files being written are named
    ``*.tmp`` until complete, so never chosen), or None."""
    steps = [
        int(m.group(1))
        for p in Path(directory).glob("step-*.pt")
        if (m := re.fullmatch(r"step-(\d+)\.pt", p.name))
    ]
    return checkpoint_path(directory, max(steps)) if steps else None


def save(directory: Path, step: int, state: dict[str, Any]) -> None:
    """Write the checkpoint of ``step`` whole, then rename it into place; drop all but it and
    the one before (a restart needs only the newest complete one)."""
    path = checkpoint_path(directory, step)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    for old in directory.glob("step-*.pt"):
        if old.name < checkpoint_path(directory, step - 1).name:
            old.unlink(missing_ok=True)


def speeds_of_ranks(
    args: argparse.Namespace, model: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> list[float]:
    """Every rank's speed (samples/s), in rank order: given per node, or measured."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.speed is not None:
        if local_rank >= len(args.speed):
            raise SystemExit(
                f"--speed: gives {len(args.speed)} speeds, local rank {local_rank} has none"
            )
        fit = SpeedFit(latency_s=0.0, samples_per_s=args.speed[local_rank])
    else:
        fit = measure_speed(
            model,
            lambda b: (x[:b], y[:b]),
            nn.functional.cross_entropy,
            batch_sizes=(2, 4, 8),
            time_budget=2.0,
        )
    if not dist.is_initialized():
        return [fit.samples_per_s]
    return [f.samples_per_s for f in gather_speeds(fit)]


def train(
    args: argparse.Namespace, after_step: Callable[[int], None] | None = None
) -> dict[str, torch.Tensor]:
    """Train to the end from the newest checkpoint (or the start) on this start's ranks;
    ``after_step(step)`` runs on every rank after each step's checkpoint is written (a test
    injects its failures there). Returns the final state dict."""
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    torch.set_num_threads(1)
    directory = Path(args.checkpoints)
    directory.mkdir(parents=True, exist_ok=True)

    x, y = make_data()
    model = make_model()
    opt = make_optimizer(model.parameters(), args.lr)
    speeds = speeds_of_ranks(args, model, x, y)
    shares = hetcoll.split(args.batch, speeds, minimum=1)  # solved for the ranks of this start
    sampler = BalancedSampler(range(SAMPLES), shares, rank, seed=SEED, verify=distributed)
    epoch, step = 0, 0
    newest = newest_checkpoint(directory)
    if newest is not None:
        ckpt = torch.load(newest, weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sampler.load_state_dict(ckpt["sampler"])  # keeps this start's shares
        epoch, step = ckpt["sampler"]["epoch"], ckpt["step"]
        if ckpt["sampler"]["position"] == SAMPLES:  # saved after the epoch's last step
            epoch += 1
    if rank == 0:
        start = {
            "world": world,
            "resumed_from": step,
            "shares": shares,
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            "time": time.time(),  # when training (re)started: after rendezvous and loading
        }
        with open(directory / "starts.jsonl", "a") as f:
            f.write(json.dumps(start) + "\n")
        print(f"start on {world} ranks from step {step}, shares {shares}", flush=True)

    net: nn.Module = model
    if distributed:
        net = DDP(model)
        register_weighted_hook(net)  # each rank weighted by the samples it ran
    for e in range(epoch, args.epochs):
        sampler.set_epoch(e)  # the restored epoch keeps its restored position
        for idx in sampler.batch_sampler():
            opt.zero_grad()
            nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
            opt.step()
            step += 1
            if rank == 0:
                state = {
                    "model": model.state_dict(),
                    "optimizer": opt.state_dict(),
                    "sampler": sampler.state_dict(),
                    "step": step,
                }
                save(directory, step, state)
            if after_step is not None:
                after_step(step)
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(final, directory / "final.pt")
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return final


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoints", required=True, help="directory of the checkpoints")
    p.add_argument(
        "--speed",
        type=lambda s: [float(v) for v in s.split(",")],
        default=None,
        help="this node's samples/s, one per local rank (default: measured)",
    )
    p.add_argument("--batch", type=int, default=8, help="the global batch")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a collective may wait")
    return p.parse_args(argv)


if __name__ == "__main__":
    started = time.monotonic()
    train(parse())
    print(f"done in {time.monotonic() - started:.1f} s", flush=True)
