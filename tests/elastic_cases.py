"""Elastic resume cases for split models, run inside every rank of a real job (gloo through
launch.spawn, or MPI): a first job trains a few steps under one split and writes the full model
and optimizer state; a second job, on another number of ranks with the split re-solved for
other speeds, builds the model afresh (other initial weights), loads the checkpoint and trains
on. Its rank 0 then checks the final weights, and the optimizer's state, against one process
training every step uninterrupted: equal to 1e-10 (relative) in float64. On gloo both jobs run
in one start-up of 3 processes (:func:`run_torch_in_place`: the second on a group of two of
them); on MPI they are two mpiexec jobs (tests/mpi_workers/elastic.py).

A case is (model, optimizer, the first job's split, the second job's split, steps, where to
stop); a split is ``("filter", speeds)`` (:func:`hetcoll.torch.filter_parallel`) or ``("plan",
plan dict)`` (:func:`hetcoll.torch.parallelize`). The checkpoint's format is the same for both,
so a case may stop under a plan and resume filter-parallel.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from plan_cases import batches, cnn, rel
from torch import nn

from hetcoll import Plan
from hetcoll.comm import wrap
from hetcoll.torch import (
    filter_parallel,
    gather_optimizer_state_dict,
    gather_state_dict,
    load_full_optimizer_state_dict,
    load_full_state_dict,
    parallelize,
)
from hetcoll.torch.filters import filter_shares

TOL = 1e-10
LR = 0.05

#: Three ranks: a one-rank stage feeding a stage split over two ranks (1F1B, uneven
#: micro-batches).
PIPELINE_SPLIT_3 = {
    "microbatches": 3,
    "schedule": "1F1B",
    "replicas": [
        {
            "samples": 8,
            "stages": [
                {"ranks": [0], "layers": [0, 5]},
                {"ranks": [1, 2], "speeds": [1.0, 0.5], "layers": [5, 11]},
            ],
        }
    ],
}

#: Two ranks, re-solved for other speeds: rank 1 the faster, every layer split over both.
SPLIT_2 = {
    "microbatches": 2,
    "replicas": [
        {"samples": 8, "stages": [{"ranks": [1, 0], "speeds": [3.0, 1.0], "layers": [0, 11]}]}
    ],
}

#: Three ranks: a pipeline whose second stage is an owners stage (node-wise placement:
#: arbitrary channel sets per rank).
OWNERS_3 = {
    "microbatches": 2,
    "replicas": [
        {
            "samples": 8,
            "stages": [
                {"ranks": [0], "layers": [0, 5]},
                {
                    "ranks": [2, 1],
                    "layers": [5, 11],
                    "owners": {"5": [0, 1, 1] * 3 + [0], "8": [1, 0] * 10, "10": [1, 1, 0, 1, 0]},
                },
            ],
        }
    ],
}

#: Three ranks, one of them idle (rank 1: it holds a placeholder parameter and no state).
IDLE_3 = {
    "microbatches": 2,
    "replicas": [
        {
            "samples": 8,
            "stages": [{"ranks": [2], "layers": [0, 6]}, {"ranks": [0], "layers": [6, 11]}],
        }
    ],
}

#: Two ranks, two uneven pipeline stages.
PIPELINE_2 = {
    "microbatches": 2,
    "schedule": "GPipe",
    "replicas": [
        {
            "samples": 8,
            "stages": [{"ranks": [1], "layers": [0, 3]}, {"ranks": [0], "layers": [3, 11]}],
        }
    ],
}


def resnet18() -> nn.Module:
    import torchvision

    return torchvision.models.resnet18(num_classes=5)


CASES: dict[str, dict[str, Any]] = {
    # ResNet-18 filter-parallel (its BatchNorms split with their convolutions), SGD with
    # momentum; 3 ranks at speeds 1:1:2, then 2 at 3:1. In eval mode: training-mode BatchNorm
    # over 4 rows of 1 x 1 maps (layer4) amplifies the rounding of the split's partial sums
    # into ~1e-6 after 4 steps, an uninterrupted split run as much as a resumed one.
    "resnet18_filter": {
        "model": resnet18,
        "eval": True,
        "shape": (3, 16, 16),
        "batch": 4,
        "optimizer": "sgd",
        "first": ("filter", [1.0, 1.0, 2.0]),
        "second": ("filter", [3.0, 1.0]),
        "steps": 3,
        "stop": 2,
    },
    # A pipeline with a filter-split stage on 3 ranks, then every layer split over 2 ranks at
    # other speeds; Adam (two moments and a step count).
    "plan_pipeline_split": {
        "model": cnn,
        "shape": (3, 8, 8),
        "batch": 8,
        "optimizer": "adam",
        "first": ("plan", PIPELINE_SPLIT_3),
        "second": ("plan", SPLIT_2),
        "steps": 5,
        "stop": 3,
    },
    # A pipeline with an owners stage on 3 ranks, then a 2-stage pipeline.
    "plan_owners": {
        "model": cnn,
        "shape": (3, 8, 8),
        "batch": 8,
        "optimizer": "sgd",
        "first": ("plan", OWNERS_3),
        "second": ("plan", PIPELINE_2),
        "steps": 4,
        "stop": 2,
    },
    # A pipeline beside an idle rank, then every layer split over 2 ranks; Adam.
    "plan_idle": {
        "model": cnn,
        "shape": (3, 8, 8),
        "batch": 8,
        "optimizer": "adam",
        "first": ("plan", IDLE_3),
        "second": ("plan", SPLIT_2),
        "steps": 4,
        "stop": 2,
    },
    # Stopped filter-parallel, resumed under a plan ...
    "filter_to_plan": {
        "model": cnn,
        "shape": (3, 8, 8),
        "batch": 8,
        "optimizer": "sgd",
        "first": ("filter", [1.0, 1.0, 2.0]),
        "second": ("plan", PIPELINE_2),
        "steps": 4,
        "stop": 2,
    },
    # A plan on 3 ranks, then whatever plan the planner picks for 2 ranks of speeds 3:1
    # (re-solved at load time, from the model's costs and the new cluster).
    "plan_replanned": {
        "model": cnn,
        "shape": (3, 8, 8),
        "batch": 8,
        "optimizer": "sgd",
        "first": ("plan", PIPELINE_SPLIT_3),
        "second": ("planner", [3.0, 1.0]),
        "steps": 4,
        "stop": 2,
    },
    # ... and under a plan, resumed filter-parallel: one checkpoint format for both.
    "plan_to_filter": {
        "model": cnn,
        "shape": (3, 8, 8),
        "batch": 8,
        "optimizer": "sgd",
        "first": ("plan", PIPELINE_SPLIT_3),
        "second": ("filter", [1.0, 2.0]),
        "steps": 4,
        "stop": 2,
    },
}


def replan(case: dict[str, Any], speeds: list[float]) -> dict[str, Any]:
    """The planner's best runnable plan for the case's model and batch on devices of these
    relative speeds (one per rank), as a plan dict: what a job resuming on other hardware
    re-solves at load time."""
    from hetcoll.model import Cluster, Device, Link, Node, layer_costs, plan

    costs = layer_costs(case["model"](), case["shape"])
    nodes = [Node(f"n{i}", Device(f"d{i}", 1e10 * f, 1e10, 1e10), 1) for i, f in enumerate(speeds)]
    best = next(p for p in plan(costs, Cluster(nodes, Link("l", 1e-5, 1e9)), case["batch"])
                if p.feasible and p.plan is not None)  # fmt: skip
    return best.to_plan().to_dict()


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=LR / 10)
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


class Runner:
    """One rank's model under a split, with its optimizer: step, save, load."""

    def __init__(self, group: Any, case: dict[str, Any], split: tuple[str, Any], seed: int):
        torch.manual_seed(
            seed
        )  # a resumed job starts from other weights: the load must replace them
        model = case["model"]().double().train(not case.get("eval", False))
        self.kind, self.how = split
        if self.kind == "filter":
            self.net: Any = filter_parallel(model, group=group, speeds=self.how)
            self.shares: Any = filter_shares(case["model"](), size=len(self.how), speeds=self.how)
        else:
            plan = replan(case, self.how) if self.kind == "planner" else self.how
            self.net = parallelize(
                model, Plan.from_dict(plan), loss_fn=nn.CrossEntropyLoss(), group=group
            )
            self.shares = plan
            self.kind = "plan"
        self.opt = make_optimizer(case["optimizer"], self.net.parameters())

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.kind == "filter":
            nn.functional.cross_entropy(self.net(x), y).backward()
        else:
            self.net.step(x, y)
        self.opt.step()
        self.opt.zero_grad()

    def full(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The unsplit model's state dict and optimizer state, on every rank."""
        if self.kind == "filter":
            model = gather_state_dict(self.net, dst=None)
            optim = gather_optimizer_state_dict(self.net, self.opt, dst=None)
            assert model is not None and optim is not None
            return model, optim
        return self.net.full_state_dict(), self.net.full_optimizer_state_dict(self.opt)

    def load(self, model: dict[str, torch.Tensor], optim: dict[str, Any]) -> None:
        if self.kind == "filter":
            load_full_state_dict(self.net, model)
            load_full_optimizer_state_dict(self.net, self.opt, optim)
        else:
            self.net.load_full_state_dict(model)
            self.net.load_full_optimizer_state_dict(self.opt, optim)


def reference(case: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One process, every step, no interruption; its optimizer state keyed by names (the
    gather of a model with nothing split is local)."""
    torch.manual_seed(0)
    model = case["model"]().double().train(not case.get("eval", False))
    opt = make_optimizer(case["optimizer"], model.parameters())
    for x, y in batches(case["shape"], case["batch"], case["steps"]):
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    optim = gather_optimizer_state_dict(model, opt, dst=None)
    assert optim is not None
    return model.state_dict(), optim


def first_job(group: Any, name: str, path: str) -> Any:
    """Train to the case's stop on this job's ranks and write the checkpoint (rank 0)."""
    case = CASES[name]
    run = Runner(group, case, case["first"], seed=0)
    for x, y in batches(case["shape"], case["batch"], case["steps"])[: case["stop"]]:
        run.step(x, y)
    model, optim = run.full()
    if wrap(group).rank == 0:
        torch.save({"model": model, "optimizer": optim, "step": case["stop"]}, path)
    return copy.deepcopy(run.shares)


def second_job(group: Any, name: str, path: str) -> dict[str, Any]:
    """Resume from the checkpoint under the second split, train to the end, and compare with
    the uninterrupted run (on rank 0: the full dicts are the same on every rank). Returns the
    largest relative errors and the shares used."""
    case = CASES[name]
    ckpt = torch.load(path, weights_only=True)
    run = Runner(group, case, case["second"], seed=1)
    # One rank's slice instead of the full tensor: every rank refuses it (the checks are
    # local and see the same dict), before changing anything.
    key = next(k for k, v in ckpt["model"].items() if v.dim() == 2)
    sliced = dict(ckpt["model"], **{key: ckpt["model"][key][:1]})
    try:
        run.load(sliced, ckpt["optimizer"])
    except ValueError as e:
        assert str(e).startswith(f"state_dict: {key!r} has shape"), str(e)
    else:
        raise AssertionError("a sliced state dict was loaded")
    run.load(ckpt["model"], ckpt["optimizer"])
    for x, y in batches(case["shape"], case["batch"], case["steps"])[ckpt["step"] :]:
        run.step(x, y)
    model, optim = run.full()
    if wrap(group).rank != 0:
        return {"shares": copy.deepcopy(run.shares)}
    want_model, want_optim = reference(case)
    assert list(model) == list(want_model)
    weights = max(
        (rel(model[k], v) if v.is_floating_point() else float(not torch.equal(model[k], v)))
        for k, v in want_model.items()
    )
    assert optim["param_groups"] == want_optim["param_groups"], optim["param_groups"]
    assert list(optim["state"]) == list(want_optim["state"])
    state = 0.0
    for n, fields in want_optim["state"].items():
        assert list(optim["state"][n]) == list(fields), (n, list(optim["state"][n]))
        for f, v in fields.items():
            state = max(state, rel(optim["state"][n][f], v))
    return {"weights": weights, "optimizer": state, "shares": copy.deepcopy(run.shares)}


def run_torch_first(rank: int, world: int, names: list[str], directory: str) -> dict[str, Any]:
    """:func:`first_job` of each case in turn, in the same processes (one checkpoint each)."""
    torch.set_num_threads(1)
    return {name: first_job(None, name, f"{directory}/{name}.pt") for name in names}


def run_torch_in_place(
    rank: int, world: int, names: list[str], directory: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both jobs in the same 3 processes, to start them once: the first on all three, then
    the second on a group of ranks 0 and 1 (rank 2 leaves), each model built afresh from
    the checkpoint file."""
    import torch.distributed as dist

    first = run_torch_first(rank, world, names, directory)
    two = dist.new_group([0, 1])
    dist.barrier()  # rank 0 has written the checkpoints
    if rank == 2:
        return first, {}
    return first, {name: second_job(two, name, f"{directory}/{name}.pt") for name in names}


def mismatched_optimizers(rank: int, world: int) -> int:
    """Ranks whose optimizers differ (SGD with momentum on one, Adam on the other) raise
    :class:`hetcoll.CollectiveMismatchError` on every rank from the gathers, instead of
    gathering unrelated state or hanging; returns how many raised."""
    from hetcoll import CollectiveMismatchError

    torch.set_num_threads(1)
    raised = 0
    x, y = batches((3, 8, 8), 8, 1)[0]
    for split in (("filter", [1.0, 2.0]), ("plan", SPLIT_2)):
        run = Runner(None, CASES["plan_to_filter"], split, seed=0)
        run.opt = make_optimizer("adam" if rank else "sgd", run.net.parameters())
        run.step(x, y)
        try:
            run.full()
        except CollectiveMismatchError as e:
            assert "ranks disagree on the" in str(e), str(e)
            raised += 1
    return raised


def run_all(comm: Any, job: str, names: str, directory: str) -> dict[str, Any]:
    """One job (``"first"`` or ``"second"``) of each named case (comma-separated) on the MPI
    communicator ``comm`` (tests/mpi_workers/cases.py), checkpoints in ``directory``."""
    run = first_job if job == "first" else second_job
    return {n: run(comm, n, f"{directory}/{n}.pt") for n in names.split(",")}
