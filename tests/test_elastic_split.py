"""Elastic resume of split models (issue 29): filter-parallel models and plans stop after k
optimizer steps on 3 ranks and resume on 2, with their split re-solved for other speeds; the
final weights and optimizer state equal one uninterrupted process in float64 (to 1e-10). The
cases (tests/elastic_cases.py) run on gloo, both jobs in one start-up of 3 processes (the
resumed job on a group of two of them, every model built afresh from the checkpoint file), and
on MPI as two jobs, ``mpiexec -n 3`` then ``mpiexec -n 2``; the checks of a full state dict's
keys, shapes and format run in-process."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import elastic_cases
import pytest
import torch
from torch import nn

from hetcoll import launch
from hetcoll.torch import (
    gather_optimizer_state_dict,
    load_full_optimizer_state_dict,
    load_full_state_dict,
)

HERE = Path(__file__).resolve().parent


PLANS = [
    "plan_pipeline_split",
    "plan_owners",
    "plan_idle",
    "plan_to_filter",
    "filter_to_plan",
    "plan_replanned",
]


def _exact(name: str, results: list[dict]) -> None:
    r = results[0][name]  # rank 0 compared the full dicts, the same on every rank
    assert r["weights"] <= elastic_cases.TOL, (name, r)
    assert r["optimizer"] <= elastic_cases.TOL, (name, r)


@pytest.mark.multiproc
def test_resnet18_filter_parallel_stops_on_three_ranks_and_resumes_on_two(tmp_path):
    # One start-up of 3 processes: the resumed job runs on a group of two of them.
    ranks = launch.spawn(
        elastic_cases.run_torch_in_place, 3, ["resnet18_filter"], str(tmp_path), timeout=240
    )
    first, second = [r[0] for r in ranks], [r[1] for r in ranks]
    _exact("resnet18_filter", second)
    # The split was re-solved for the ranks that resumed: conv1's 64 filters at 1:1:2, then 3:1.
    assert first[0]["resnet18_filter"]["conv1"] == [16, 16, 32]
    assert second[0]["resnet18_filter"]["shares"]["conv1"] == [48, 16]


@pytest.mark.multiproc
def test_plans_stop_on_three_ranks_and_resume_on_two(tmp_path):
    """A pipeline with a filter-split stage re-split over 2 ranks (Adam), a pipeline with an
    owners stage resumed as a 2-stage pipeline, a pipeline beside an idle rank (Adam), a plan
    resumed filter-parallel, a filter-parallel model resumed under a plan, and a plan resumed
    under the plan the planner picks for the two ranks left."""
    ranks = launch.spawn(elastic_cases.run_torch_in_place, 3, PLANS, str(tmp_path), timeout=240)
    second = [r[1] for r in ranks]
    for name in PLANS:
        _exact(name, second)
    # The planner's plan covers the two ranks that resumed, and differs from the first job's.
    replanned = second[0]["plan_replanned"]["shares"]
    assert {r for rep in replanned["replicas"] for st in rep["stages"] for r in st["ranks"]} <= {
        0,
        1,
    }
    assert replanned != elastic_cases.PIPELINE_SPLIT_3


@pytest.mark.multiproc
def test_ranks_with_different_optimizers_raise_on_every_rank():
    assert launch.spawn(elastic_cases.mismatched_optimizers, 2, timeout=240) == [2, 2]


@pytest.mark.multiproc
def test_mpi_plans_stop_on_three_ranks_and_resume_on_two(tmp_path):
    """On MPI: the pipeline with a split stage, re-split; and the plan resumed filter-parallel."""
    names = ["plan_pipeline_split", "plan_to_filter"]
    worker = [str(HERE / "mpi_workers" / "cases.py"), "elastic_cases"]
    launch.mpiexec(3, [*worker, "first", ",".join(names), str(tmp_path)], timeout=240)
    proc = launch.mpiexec(2, [*worker, "second", ",".join(names), str(tmp_path)], timeout=240)
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in names:
        _exact(name, results)


def _trained(optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)).double()
    opt = optimizer(model.parameters())
    for _ in range(2):
        model(torch.randn(5, 4, dtype=torch.float64)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_full_optimizer_state_of_an_unsplit_model_is_its_own_state_by_name():
    """With nothing split the gather is local: the optimizer's state keyed by parameter names
    (the form of torch.distributed.checkpoint's full optimizer state dict), and loading it into a
    fresh optimizer gives back the same state and the same next steps."""
    model, opt = _trained(lambda p: torch.optim.Adam(p, lr=0.01))
    full = gather_optimizer_state_dict(model, opt)
    own = opt.state_dict()
    names = [n for n, _ in model.named_parameters()]
    assert full["param_groups"][0]["params"] == names
    assert {k: v for k, v in full["param_groups"][0].items() if k != "params"} == {
        k: v for k, v in own["param_groups"][0].items() if k != "params"
    }
    for i, n in enumerate(names):
        assert list(full["state"][n]) == ["step", "exp_avg", "exp_avg_sq"]
        for f, v in own["state"][i].items():
            assert torch.equal(full["state"][n][f], v)
    fresh = copy.deepcopy(model)
    opt2 = torch.optim.Adam(fresh.parameters(), lr=123.0)  # the saved lr comes back
    load_full_state_dict(fresh, model.state_dict())
    load_full_optimizer_state_dict(fresh, opt2, full)
    assert opt2.param_groups[0]["lr"] == 0.01
    x = torch.randn(5, 4, dtype=torch.float64)
    for m, o in ((model, opt), (fresh, opt2)):
        m(x).sum().backward()
        o.step()
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    # The loaded state is a copy: stepping never writes into the checkpoint.
    assert not torch.equal(
        full["state"]["0.weight"]["exp_avg"], opt2.state_dict()["state"][0]["exp_avg"]
    )


def test_bad_full_state_dicts_raise_naming_the_argument():
    model, opt = _trained()
    state = model.state_dict()
    full = gather_optimizer_state_dict(model, opt)

    def raises(kind, text, fn):
        with pytest.raises(kind) as e:
            fn()
        assert text in str(e.value), str(e.value)

    missing = {k: v for k, v in state.items() if k != "2.bias"}
    raises(
        ValueError,
        "state_dict: lacks key(s) '2.bias'",
        lambda: load_full_state_dict(model, missing),
    )
    other = dict(state, **{"head.weight": torch.zeros(2, 3)})
    raises(ValueError, "state_dict: has key(s) the model does not have: 'head.weight'",
           lambda: load_full_state_dict(model, other))  # fmt: skip
    sliced = dict(state, **{"0.weight": state["0.weight"][:2]})
    raises(ValueError, "state_dict: '0.weight' has shape (2, 4), the unsplit model's is (3, 4)",
           lambda: load_full_state_dict(model, sliced))  # fmt: skip
    raises(ValueError, "state_dict: param_groups[0] lists 0, not a parameter name",
           lambda: load_full_optimizer_state_dict(model, opt, opt.state_dict()))  # fmt: skip
    renamed = copy.deepcopy(full)
    renamed["param_groups"][0]["params"][0] = "encoder.weight"
    raises(ValueError, "names parameter 'encoder.weight', which the model does not have",
           lambda: load_full_optimizer_state_dict(model, opt, renamed))  # fmt: skip
    wrong = copy.deepcopy(full)
    wrong["state"]["2.weight"]["momentum_buffer"] = torch.zeros(2, 2)
    raises(ValueError, "state 'momentum_buffer' of parameter '2.weight' has shape (2, 2)",
           lambda: load_full_optimizer_state_dict(model, opt, wrong))  # fmt: skip
    two_groups = copy.deepcopy(full)
    two_groups["param_groups"] = [
        dict(full["param_groups"][0], params=["0.weight", "0.bias"]),
        dict(full["param_groups"][0], params=["2.weight", "2.bias"]),
    ]
    raises(ValueError, "state_dict: has 2 param groups, the optimizer 1",
           lambda: load_full_optimizer_state_dict(model, opt, two_groups))  # fmt: skip
    raises(TypeError, "optimizer: must be a torch.optim.Optimizer",
           lambda: gather_optimizer_state_dict(model, "sgd"))  # fmt: skip
    stranger = torch.optim.SGD([*model.parameters(), nn.Parameter(torch.zeros(7))], lr=0.1)
    raises(ValueError, "optimizer: param_groups[0] holds a tensor of shape (7,)",
           lambda: gather_optimizer_state_dict(model, stranger))  # fmt: skip
    # A factored optimizer's state (row and column statistics) cannot follow a split.
    factored, fopt = _trained(lambda p: torch.optim.Adafactor(p, lr=0.01))
    raises(ValueError, "optimizer: state 'row_var' of parameter '0.weight' has shape (3, 1)",
           lambda: gather_optimizer_state_dict(factored, fopt))  # fmt: skip
