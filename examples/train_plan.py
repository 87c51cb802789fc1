"""Train from a plan file: the planner's plan (or your own) run by hetcoll.torch.parallelize.

    hetcoll plan --model hetcoll.lab.demo_ranks:DemoNet --input 1x8x8 --classes 10 \\
        --cluster my_cluster.toml --batch 64 --out plan.json           # or write plan.json
    torchrun --standalone --nproc-per-node 3 examples/train_plan.py --plan plan.json
    mpiexec -n 3 python examples/train_plan.py --plan plan.json --mpi
    python examples/train_plan.py --plan one_rank_plan.json           # one process

A plan (``hetcoll.Plan``, JSON) says which ranks run which layers of the model on how many
samples of every global batch: data-parallel replicas of any shape, each a pipeline of stages,
a stage over several ranks splitting its Conv2d / Linear channels among them. Every rank reads
the same plan and the same global batches; ``par.step(x, y)`` runs the rank's part of the step
and returns the global batch's mean loss; the optimizer steps the rank's own parameters. The
trained model is the one a single process trains on the same batches (to rounding, in float64;
models with BatchNorm normalise per micro-batch instead: see hetcoll.torch.parallel).

The model and data are hetcoll's demo (a small CNN on scikit-learn's bundled 8x8 digits); put
your own in ``make_model``, ``make_optimizer`` and ``load_data``. ``make_model`` must build the
model the plan was made for (``hetcoll plan --model examples.train_plan:make_model`` plans for
it; the plan's layers count ``hetcoll.torch.layers.model_layers(make_model())``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any

import torch
from torch import nn

import hetcoll
from hetcoll import Plan
from hetcoll.torch import parallelize


def make_model() -> nn.Module:
    from hetcoll.lab.demo_ranks import DemoNet

    return DemoNet()


def make_optimizer(params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def load_data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train inputs, train labels, test inputs, test labels."""
    from hetcoll.lab.demo_ranks import load_digits

    return load_digits(seed)


# -- who runs this: a launcher's environment -------------------------------------------------------


class Job:
    """Rank, world size, device and group (what parallelize takes) of this process: MPI with
    ``--mpi``, torch.distributed under torchrun (gloo on CPU, NCCL on GPU), else one process."""

    def __init__(self, mpi: bool) -> None:
        self.device = torch.device("cpu")
        self.group: Any = None
        if mpi:
            from mpi4py import MPI

            self.backend = "mpi"
            self.group = MPI.COMM_WORLD
            self.rank, self.world = self.group.Get_rank(), self.group.Get_size()
        elif "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:  # torchrun (env://)
            import torch.distributed as dist

            self.backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(self.backend)
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            if self.backend == "nccl":
                self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
                torch.cuda.set_device(self.device)
        else:
            self.backend, self.rank, self.world = "none", 0, 1
            # parallelize needs a group: a one-rank gloo group of this process.
            import torch.distributed as dist

            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    def close(self) -> None:
        if self.backend != "mpi":
            import torch.distributed as dist

            # What held the process groups (a split model's stages and hooks, DDP's reducer; the
            # caller dels them first) is freed now, while every rank is still in the group: freed
            # after the group is destroyed, at exit, it aborted a rank now and then ("terminate
            # called without an active exception"; train_lm 2 of 18 runs before, 0 of 20 after).
            gc.collect()
            dist.barrier()
            dist.destroy_process_group()


# -- training --------------------------------------------------------------------------------------


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    model.eval()
    with torch.no_grad():
        logits = model(x)
        loss = float(nn.functional.cross_entropy(logits, y))
        accuracy = float((logits.argmax(1) == y).float().mean())
    return loss, accuracy


def train(args: argparse.Namespace) -> dict[str, Any]:
    plan = Plan.load(args.plan)
    job = Job(args.mpi)
    torch.set_num_threads(hetcoll.num_threads())  # the node's cores shared among its ranks
    dtype = torch.float64 if args.float64 else torch.float32
    x_train, y_train, x_test, y_test = load_data(args.seed)
    x_train, x_test = (t.to(job.device, dtype) for t in (x_train, x_test))
    y_train, y_test = y_train.to(job.device), y_test.to(job.device)
    torch.manual_seed(args.seed)
    net = make_model().to(job.device, dtype)
    # Collective: every rank must pass the same plan (rank 0's weights are used).
    par = parallelize(net, plan, loss_fn=nn.CrossEntropyLoss(), group=job.group)
    opt = make_optimizer(par.parameters(), args.lr)
    batch = plan.batch
    steps = len(y_train) // batch
    if args.steps:
        steps = min(steps, args.steps)
    g = torch.Generator().manual_seed(args.seed)  # the same global batches on every rank
    epochs, losses = [], []
    for epoch in range(args.epochs):
        order = torch.randperm(len(y_train), generator=g).to(job.device)
        bar = progress(job, epoch, args.epochs, steps, args.quiet)
        t0 = time.perf_counter()
        for i in range(steps):
            idx = order[i * batch : (i + 1) * batch]
            losses.append(par.step(x_train[idx], y_train[idx]))
            opt.step()
            opt.zero_grad()
            if bar is not None:
                bar.update(1)
        seconds = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        state = par.full_state_dict()  # collective
        net.load_state_dict(state)
        loss, accuracy = evaluate(net, x_test, y_test)
        epochs.append(
            {
                "epoch": epoch + 1,
                "seconds": seconds,
                "samples_per_s": steps * batch / seconds,
                "test_loss": loss,
                "test_accuracy": accuracy,
            }
        )
        if job.rank == 0 and not args.quiet:
            print(
                f"epoch {epoch + 1}: {seconds:.2f} s, {steps * batch / seconds:.0f} samples/s, "
                f"test loss {loss:.4f}, accuracy {accuracy:.2%}",
                flush=True,
            )
    if job.rank == 0 and args.save:
        torch.save(net.state_dict(), args.save)
    report = {
        "rank": job.rank,
        "backend": job.backend,
        "world": job.world,
        "place": par.place,
        "losses": losses,
        "traffic": par.traffic(),
        "epochs": epochs,
    }
    del par, opt  # before the group goes (Job.close)
    job.close()
    return report


def progress(job: Job, epoch: int, epochs: int, steps: int, quiet: bool) -> Any:
    if job.rank != 0 or quiet:
        return None
    from tqdm import tqdm  # type: ignore[import-untyped]

    return tqdm(total=steps, desc=f"epoch {epoch + 1}/{epochs}", file=sys.stderr, leave=False)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--plan", required=True, help="the plan file (hetcoll plan ... --out)")
    p.add_argument("--mpi", action="store_true", help="run on MPI (under mpiexec)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps", type=int, default=0, help="at most this many steps per epoch")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--float64", action="store_true", help="train in double precision")
    p.add_argument("--save", help="write the trained state dict here (rank 0)")
    p.add_argument("--json", help="write each rank's report here ({rank} is replaced)")
    p.add_argument("--quiet", action="store_true", help="no progress bars or epoch lines")
    args = p.parse_args(argv)
    try:
        Plan.load(args.plan)
    except (OSError, ValueError) as e:
        p.error(f"--plan: {e}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    report = train(args)
    if args.json:
        with open(args.json.format(rank=report["rank"]), "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
