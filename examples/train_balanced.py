"""Balanced data-parallel training: one script for one process, torchrun and mpiexec.

    python examples/train_balanced.py                                     # one process
    torchrun --standalone --nproc-per-node 2 examples/train_balanced.py --emulate 1,0.25
    torchrun --standalone --nproc-per-node 2 examples/train_balanced.py --emulate 1,0.25 --fsdp
    mpiexec -n 2 python examples/train_balanced.py --emulate 1,0.25       # MPI only

Every rank measures how fast it trains; ``hetcoll.split`` turns the speeds into per-rank batch
sizes that add up to the global batch; ``BalancedSampler`` gives each rank its share of every
global step; and the gradients are averaged weighted by samples (a DDP comm hook under torchrun,
``hetcoll.torch.DistributedOptimizer`` under mpiexec; with ``--fsdp``, FSDP's ``fully_shard``
with each loss weighed by ``hetcoll.torch.weigh_loss``). Every step therefore applies the
gradient of the whole global batch, and the model is the one a single process trains on the same
batches, however the batch is split. A ``Rebalancer`` re-solves the split when the measured
speeds drift: each rank's compute per step, without its waits for the others (DDP's hook marks
when this rank's gradients were ready; under FSDP, whose every layer waits for the other ranks,
a ``hetcoll.torch.StepTimer`` leaves FSDP's gathers and reduce-scatters out).

``--emulate 1,0.25`` makes rank 1 run at a quarter of its real speed (it sleeps), to watch the
balancing on one machine. The model and data are hetcoll's demo (a small CNN on scikit-learn's
bundled digits); put your own in ``make_model``, ``make_optimizer`` and ``load_data``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import hetcoll
from hetcoll.lab.emulate import EmulatedSpeed
from hetcoll.torch import (
    BalancedSampler,
    DistributedOptimizer,
    Rebalancer,
    SpeedFit,
    StepTimer,
    broadcast_parameters,
    gather_speeds,
    measure_speed,
    register_weighted_hook,
    weigh_loss,
)


def make_model() -> nn.Module:
    from hetcoll.lab.demo import DemoNet

    return DemoNet()


def make_optimizer(params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def load_data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train inputs, train labels, test inputs, test labels."""
    from hetcoll.lab.demo import load_digits

    return load_digits(seed)


# -- who runs this: a launcher's environment -------------------------------------------------------


def backend_of(requested: str) -> str:
    """The engine to train on: as asked, or ("auto") from the launcher's environment."""
    if requested != "auto":
        return requested
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:  # torchrun (env://)
        return "nccl" if torch.cuda.is_available() else "gloo"
    if any(k in os.environ for k in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")):  # mpiexec
        return "mpi"
    return "none"


class Job:
    """Rank, world size, device and group of this process on ``backend``."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.device = torch.device("cpu")
        self.group: Any = None  # what hetcoll's gather_speeds and Rebalancer take
        if backend == "mpi":
            from mpi4py import MPI

            self.group = MPI.COMM_WORLD
            self.rank, self.world = self.group.Get_rank(), self.group.Get_size()
        elif backend in ("gloo", "nccl"):
            import torch.distributed as dist

            dist.init_process_group(backend)
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            if backend == "nccl":
                self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
                torch.cuda.set_device(self.device)
        else:
            self.rank, self.world = 0, 1

    def close(self) -> None:
        if self.backend in ("gloo", "nccl"):
            import torch.distributed as dist

            # What held the process groups (a split model's stages and hooks, DDP's reducer; the
            # caller dels them first) is freed now, while every rank is still in the group: freed
            # after the group is destroyed, at exit, it aborted a rank now and then ("terminate
            # called without an active exception"; train_lm 2 of 18 runs before, 0 of 20 after).
            gc.collect()
            dist.barrier()
            dist.destroy_process_group()


# -- the steps -------------------------------------------------------------------------------------


def probe(model: nn.Module, x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace) -> SpeedFit:
    """This rank's training speed: whole steps (forward, backward, optimizer) timed at a few batch
    sizes up to the global batch, on a copy of ``model``; and the largest batch it can hold."""
    top = args.batch
    return measure_speed(
        model,
        lambda b: (x[:b], y[:b]),
        nn.functional.cross_entropy,
        batch_sizes=sorted({max(1, top // 8), max(2, top // 4), max(3, top // 2), top}),
        optimizer=lambda params: make_optimizer(params, args.lr),
        probe_memory=True,  # capacity: the largest batch this rank's memory holds
    )


def plan_shares(
    job: Job, args: argparse.Namespace, model: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> tuple[list[int], list[SpeedFit] | None]:
    """Each rank's samples per step: measured speeds (emulated ones with ``--emulate``) turned
    into integer shares of the global batch by ``hetcoll.split``; and the fits (the Rebalancer
    starts from them), None when the shares were given."""
    if args.plain_ddp:
        if args.batch % job.world:
            raise SystemExit(
                f"--plain-ddp: --batch ({args.batch}) must divide among {job.world} ranks"
            )
        return [args.batch // job.world] * job.world, None
    if args.shares is not None or job.world == 1:
        return args.shares or [args.batch], None
    fits = gather_speeds(probe(model, x, y, args), job.group)
    shares = hetcoll.split(
        args.batch,
        [f.samples_per_s for f in fits],
        latency=[f.latency_s for f in fits],
        capacity=[f.capacity or args.batch for f in fits],
        minimum=1,
    )
    return shares, fits


def distribute(
    job: Job, model: nn.Module, lr: float, plain_ddp: bool = False, fsdp: bool = False
) -> tuple[nn.Module, Any, Callable[[], float] | None]:
    """The model to call, its optimizer and (DDP) when this rank's gradients were ready, for the
    Rebalancer's compute time. Each step's samples are counted off the model's forward, so
    the gradients are weighed right whatever the sampler hands this rank. ``plain_ddp``: DDP
    as PyTorch ships it, the baseline. ``fsdp``: FSDP2, each layer with parameters sharded on
    its own (the loss is weighed in the loop: ``weigh_loss``)."""
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model.modules():
            if layer is not model and any(True for _ in layer.parameters(recurse=False)):
                fully_shard(layer)
        fully_shard(model)
        return model, make_optimizer(model.parameters(), lr), None
    if job.backend in ("gloo", "nccl"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, device_ids=[job.device] if job.backend == "nccl" else None)
        if plain_ddp:
            return ddp, make_optimizer(ddp.parameters(), lr), None
        state = register_weighted_hook(ddp)
        opt = make_optimizer(ddp.parameters(), lr)
        return ddp, opt, lambda: state.ready_at
    opt = make_optimizer(model.parameters(), lr)
    if job.backend == "mpi":
        broadcast_parameters(model, job.group)
        return model, DistributedOptimizer(opt, job.group, model=model), None
    return model, opt, None


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    model.eval()
    with torch.no_grad():
        logits = model(x)
        loss = float(nn.functional.cross_entropy(logits, y))
        accuracy = float((logits.argmax(1) == y).float().mean())
    model.train()
    return loss, accuracy


def train(args: argparse.Namespace) -> dict[str, Any]:
    job = Job(backend_of(args.backend))
    for name in ("emulate", "shares"):
        given = getattr(args, name)
        if given is not None and len(given) != job.world:
            raise SystemExit(f"--{name}: needs one value per rank ({job.world}), got {given}")
    torch.set_num_threads(hetcoll.num_threads())  # the node's cores shared among its ranks
    dtype = torch.float64 if args.float64 else torch.float32
    x_train, y_train, x_test, y_test = load_data(args.seed)
    if args.max_train_samples is not None:
        x_train, y_train = x_train[: args.max_train_samples], y_train[: args.max_train_samples]
    x_train, x_test = (t.to(job.device, dtype) for t in (x_train, x_test))
    y_train, y_test = y_train.to(job.device), y_test.to(job.device)
    torch.manual_seed(args.seed)
    net = make_model().to(job.device, dtype)
    speed = args.emulate[job.rank] if args.emulate else 1.0
    model = net
    if speed < 1:  # sleeps (1/speed - 1) times the real cost, measured once
        model = EmulatedSpeed(net, speed, cost=probe(net, x_train, y_train, args))
    shares, fits = plan_shares(job, args, model, x_train, y_train)
    first_shares = list(shares)
    if args.plain_ddp and args.fsdp:
        raise SystemExit("--fsdp: the baseline --plain-ddp is DDP; give one of the two")
    for flag, given in (("--plain-ddp", args.plain_ddp), ("--fsdp", args.fsdp)):
        if given and job.backend not in ("gloo", "nccl"):
            raise SystemExit(f"{flag}: needs torchrun (torch.distributed)")
    wrapped, opt, ready_at = distribute(job, model, args.lr, args.plain_ddp, args.fsdp)
    timer = StepTimer(wrapped) if args.fsdp else None  # after fully_shard: on its parameters
    sampler = BalancedSampler(range(len(y_train)), shares, job.rank, seed=args.seed)
    rebalancer = (
        Rebalancer(sampler, every=10, fits=fits, group=job.group)
        if job.world > 1 and not (args.no_rebalance or args.plain_ddp)
        else None
    )
    epochs = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        steps = sampler.batch_sampler()  # set_shares applies from the next step
        bar = progress(job, epoch, args.epochs, len(steps), args.quiet)
        t0 = time.perf_counter()
        samples = 0
        for idx in steps:
            started = time.perf_counter()
            opt.zero_grad()
            loss = nn.functional.cross_entropy(wrapped(x_train[idx]), y_train[idx])
            if args.fsdp:  # FSDP divides the ranks' sum by their number: weigh by the samples
                loss = weigh_loss(loss, len(idx))
            loss.backward()
            if timer is not None:
                compute = timer.pop()
            else:
                compute = (ready_at() if ready_at else time.perf_counter()) - started
            opt.step()
            samples += len(idx)
            if rebalancer is not None:
                rebalancer.observe(len(idx), compute)
            if bar is not None:
                bar.update(1)
        seconds = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        test_loss, accuracy = evaluate(net, x_test, y_test)
        epochs.append(
            {
                "epoch": epoch + 1,
                "seconds": seconds,
                "samples_per_s": len(y_train) / seconds,  # every rank's samples, together
                "rank_samples": samples,
                "test_loss": test_loss,
                "test_accuracy": accuracy,
                "shares": list(sampler.shares),
            }
        )
        if job.rank == 0 and not args.quiet:
            print(
                f"epoch {epoch + 1}: {seconds:.2f} s, {len(y_train) / seconds:.0f} samples/s, "
                f"test loss {test_loss:.4f}, accuracy {accuracy:.2%}, shares {sampler.shares}",
                flush=True,
            )
    state = net.state_dict()
    if args.fsdp:  # torch's gather of FSDP's shards (collective: every rank)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True))
    if job.rank == 0 and args.save:
        torch.save(state, args.save)
    report = {
        "rank": job.rank,
        "backend": job.backend,
        "world": job.world,
        "emulated_speeds": args.emulate,
        "first_shares": first_shares,
        "rebalances": sum(e.applied for e in rebalancer.history) if rebalancer else 0,
        "epochs": epochs,
    }
    del wrapped, opt, rebalancer, timer  # before the group goes (Job.close)
    job.close()
    return report


def progress(job: Job, epoch: int, epochs: int, steps: int, quiet: bool) -> Any:
    if job.rank != 0 or quiet:
        return None
    from tqdm import tqdm  # type: ignore[import-untyped]

    return tqdm(total=steps, desc=f"epoch {epoch + 1}/{epochs}", file=sys.stderr, leave=False)


def _numbers(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    return lambda text: [kind(v) for v in text.split(",")]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "gloo", "nccl", "mpi", "none"],
        help="auto: torch.distributed under torchrun, MPI under mpiexec, else none",
    )
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch", type=int, default=128, help="global batch: samples per step")
    p.add_argument(
        "--max-train-samples",
        type=int,
        metavar="N",
        help="train on the first N training samples only (a quick trial run)",
    )
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--emulate",
        type=_numbers(float),
        metavar="S0,S1,...",
        help="run rank r at S_r times its real speed (0 < S_r <= 1): emulated heterogeneity",
    )
    p.add_argument(
        "--shares",
        type=_numbers(int),
        metavar="B0,B1,...",
        help="samples per step for each rank, instead of measuring speeds",
    )
    p.add_argument("--no-rebalance", action="store_true", help="keep the first split")
    p.add_argument(
        "--plain-ddp",
        action="store_true",
        help="the baseline: PyTorch's DDP as it ships (equal batches, its own averaging, no "
        "rebalancing; torchrun only)",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="FSDP2 (fully_shard) instead of DDP, each loss weighed by hetcoll.torch.weigh_loss, "
        "rebalanced on each rank's compute timed by hetcoll.torch.StepTimer (torchrun only)",
    )
    p.add_argument("--float64", action="store_true", help="train in double precision")
    p.add_argument("--save", help="write the trained state dict here (rank 0)")
    p.add_argument("--json", help="write each rank's report here ({rank} is replaced)")
    p.add_argument("--quiet", action="store_true", help="no progress bars or epoch lines")
    args = p.parse_args(argv)
    if args.max_train_samples is not None and args.max_train_samples < args.batch:
        p.error(f"--max-train-samples: must be at least --batch ({args.batch})")
    if args.shares is not None and sum(args.shares) != args.batch:
        p.error(f"--shares: must add up to --batch ({args.batch}), got {sum(args.shares)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    report = train(args)
    if args.json:
        with open(args.json.format(rank=report["rank"]), "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
