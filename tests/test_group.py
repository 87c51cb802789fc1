"""One way to pass the communicator: every public function of hetcoll that communicates takes
``group=`` (an mpi4py communicator or a torch.distributed process group) with one default,
decided by :func:`hetcoll.comm.wrap`: torch's default group when torch.distributed is
initialised, else ``MPI.COMM_WORLD`` under mpiexec, else a ``ValueError`` naming ``group``.
Old keyword names keep working for one release with a ``DeprecationWarning``. Here in one
process with neither engine, and on real gloo processes (tests/mpi_workers/data_parallel.py
runs the same under mpiexec, without torch.distributed)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import hetcoll
from hetcoll.collectives import allgatherv_autograd
from hetcoll.comm import MPI_LAUNCHER_VARIABLES, has_default
from hetcoll.launch import spawn
from hetcoll.torch import (
    BalancedSampler,
    DistributedOptimizer,
    GroupGradScaler,
    Rebalancer,
    SpeedFit,
    WeightedAllreduceState,
    broadcast_parameters,
    filter_parallel,
    gather_speeds,
    weigh_loss,
)

from dp_common import make_data, make_model, reference_step, rel_err

NO_DEFAULT = "group: none given and no default"


@pytest.fixture
def no_engine(monkeypatch):
    for name in MPI_LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized() and not has_default()


def test_without_an_engine_every_function_names_group(no_engine):
    model = make_model()
    calls = {
        "allreduce": lambda: hetcoll.allreduce(np.ones(3), None),
        "allgatherv": lambda: hetcoll.allgatherv(np.ones(3)),
        "allgatherv_autograd": lambda: allgatherv_autograd(torch.ones(3)),
        "gather_speeds": lambda: gather_speeds(SpeedFit(0.0, 1.0)),
        "broadcast_parameters": lambda: broadcast_parameters(model),
        "DistributedOptimizer": lambda: DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), local_batch=1
        ),
        "filter_parallel": lambda: filter_parallel(model, [1.0]),
        "GroupGradScaler": lambda: GroupGradScaler("cpu"),
        "weigh_loss": lambda: weigh_loss(torch.tensor(1.0), 3),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=NO_DEFAULT):
            call()
        assert name
    # The Rebalancer communicates at its first decision, not before.
    reb = Rebalancer(BalancedSampler(range(8), [2, 2], 0), every=1)
    with pytest.raises(ValueError, match=NO_DEFAULT):
        reb.observe(2, 0.1)
    # One process with no engine: a sampler has nothing to check its shares against.
    assert BalancedSampler(range(8), [2, 2], 0).shares == [2, 2]
    with pytest.raises(TypeError, match="group"):
        gather_speeds(SpeedFit(0.0, 1.0), "world")
    with pytest.raises(TypeError, match=r"^loss: must be a tensor"):
        weigh_loss([1.0], 3)  # its own error first, with no one to tell


def test_mpi_is_detected_from_the_launcher(no_engine, monkeypatch):
    monkeypatch.setenv("PMI_RANK", "0")  # what mpiexec (MPICH's Hydra) sets in each rank
    assert has_default()


def test_old_names_still_work_with_a_deprecation_warning(no_engine):
    model = make_model()
    cases = {
        "allreduce(comm=": lambda: hetcoll.allreduce(np.ones(3), comm=None),
        "allgatherv(comm=": lambda: hetcoll.allgatherv(np.ones(3), comm=None),
        "allgatherv_autograd(comm=": lambda: allgatherv_autograd(torch.ones(3), comm=None),
        "broadcast_parameters(comm=": lambda: broadcast_parameters(model, comm=None),
        "DistributedOptimizer(comm=": lambda: DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), comm=None, local_batch=1
        ),
    }
    for what, call in cases.items():
        # The old name is taken (and warned about); with no engine the default then fails.
        with (
            pytest.warns(DeprecationWarning, match=r"is now .*group=") as w,
            pytest.raises(ValueError, match=NO_DEFAULT),
        ):
            call()
        assert what in str(w[0].message)
    with pytest.warns(DeprecationWarning, match=r"WeightedAllreduceState\(process_group="):
        state = WeightedAllreduceState(process_group=None, local_batch=3)
    assert state.group is None and state.local_batch == 3
    with (
        pytest.raises(ValueError, match="group: give group= or the deprecated comm="),
        pytest.warns(DeprecationWarning),
    ):
        hetcoll.allreduce(np.ones(3), "a", comm="b")


class _FakeMpiComm:
    """Passes for an mpi4py communicator with hetcoll.comm.is_mpi_comm (without MPI_Init)."""


@pytest.fixture
def _fake_mpi(monkeypatch):
    import sys
    import types

    fake = types.ModuleType("mpi4py.MPI")
    fake.Comm = _FakeMpiComm  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", fake)


@pytest.mark.usefixtures("_fake_mpi")
def test_the_hook_refuses_an_mpi_communicator():
    with pytest.raises(TypeError, match="DistributedOptimizer"):
        WeightedAllreduceState(_FakeMpiComm(), 1)


# -- real gloo processes: None and an explicit group, every function -----------------------------


def _everything(rank, world):
    out = {}
    sub = dist.new_group(list(range(world)))  # an explicit group: all ranks, another object
    for name, group in (("default", None), ("explicit", sub)):
        r = {}
        fits = gather_speeds(SpeedFit(0.001 * rank, 100.0 * (rank + 1)), group)
        r["fits"] = [f.samples_per_s for f in fits]
        model = make_model()
        if rank:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        broadcast_parameters(model, group)
        r["broadcast"] = max(
            rel_err(p, q) for p, q in zip(model.parameters(), make_model().parameters())
        )
        # DistributedOptimizer on gloo: the exact full-batch step, as under MPI.
        shares = [3, 5][:world]
        x, y = make_data(sum(shares))
        start = sum(shares[:rank])
        opt = DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), group, local_batch=shares[rank]
        )
        nn.functional.cross_entropy(
            model(x[start : start + shares[rank]]), y[start : start + shares[rank]]
        ).backward()
        opt.step()
        _, ref = reference_step(sum(shares))
        r["optimizer"] = max(rel_err(p.detach(), q) for p, q in zip(model.parameters(), ref))
        r["allreduce"] = hetcoll.allreduce(np.ones(2), group).tolist()
        try:
            BalancedSampler(range(10), [1, 2] if rank == 0 else [2, 1], rank, group=group)
            r["sampler"] = "no error"
        except hetcoll.CollectiveMismatchError as e:
            r["sampler"] = str(e)
        sampler = BalancedSampler(range(1000), [8, 8], rank, group=group)
        reb = Rebalancer(sampler, every=2, group=group)
        for _ in range(6):
            b = sampler.shares[rank]
            reb.observe(b, b / (100.0 if rank == 0 else 25.0))
        r["rebalanced"] = list(sampler.shares)
        out[name] = r
    return out


@pytest.mark.multiproc
def test_every_function_takes_none_or_a_group_on_gloo():
    per_rank = spawn(_everything, 2, timeout=120)
    for r in per_rank:
        for name in ("default", "explicit"):
            got = r[name]
            assert got["fits"] == [100.0, 200.0]
            assert got["broadcast"] == 0.0
            assert got["optimizer"] <= 1e-10
            assert got["allreduce"] == [2.0, 2.0]
            assert "ranks disagree on shares[0]" in got["sampler"]
            assert got["rebalanced"] == per_rank[0][name]["rebalanced"] != [8, 8]


def _split_stage_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 5)
    ).double()


def _planned_on(rank, world, members, reordered):
    from hetcoll.torch import parallelize

    group = dist.new_group(members, sort_ranks=False) if reordered else dist.new_group(members)
    out: dict = {}
    if rank in members:
        plan = {
            "microbatches": 1,
            "replicas": [
                {
                    "samples": 6,
                    "stages": [{"ranks": [0, 1], "speeds": [1.0, 0.25], "layers": [0, 4]}],
                }
            ],
        }
        par = parallelize(
            _split_stage_net(), plan, loss_fn=nn.functional.cross_entropy, group=group
        )
        ref = _split_stage_net()
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (par, ref)]
        g = torch.Generator().manual_seed(1)
        x = torch.randn(6, 3, 4, 4, generator=g, dtype=torch.float64)
        y = torch.randint(0, 5, (6,), generator=g)
        par.step(x, y)
        nn.functional.cross_entropy(ref(x), y).backward()
        for opt in opts:
            opt.step()
        full = par.full_state_dict()
        out["off"] = max(float((full[k] - v).abs().max()) for k, v in ref.state_dict().items())
        out["channels"] = next(par.stage.parameters()).shape[0]
        out["group rank"] = dist.get_rank(group)
    # Every rank then makes a group of its own and uses it: the plan's groups made on the
    # members alone had moved torch's count of groups there, and this one never connected.
    later = dist.new_group([0, world - 1])
    if rank in (0, world - 1):
        t = torch.ones(1)
        dist.all_reduce(t, group=later)
        out["later"] = float(t)
    return out


#: Whether this torch numbers a group's ranks in the order given (``new_group``'s
#: ``sort_ranks``, newer than torch 2.11, whose groups follow the default group's order).
REORDERS = "sort_ranks" in inspect.signature(dist.new_group).parameters
reorders = pytest.mark.skipif(not REORDERS, reason="this torch's groups keep the world's order")


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("world", "members", "reordered"),
    [
        (3, [1, 2], False),
        pytest.param(
            2, [1, 0], True,
            marks=reorders,
        ),
    ],
)  # fmt: skip
def test_a_plan_on_a_subgroup_or_a_reordered_world(world, members, reordered):
    """A split stage over the whole group: on ranks [1, 2] of 3 (the next group every rank made
    waited for ever), and on every rank in another order (the fast group rank got 1 of 8
    channels, and full_state_dict failed)."""
    results = spawn(_planned_on, world, members, reordered, timeout=120)
    for rank, got in enumerate(results):
        if rank in members:
            assert got["off"] <= 1e-12, got
            assert got["channels"] == (7 if got["group rank"] == 0 else 1), got  # speeds 1 : 0.25
        if rank in (0, world - 1):
            assert got["later"] == 2.0


def _ddp_over_a_split(rank, world):
    from torch.nn.parallel import DistributedDataParallel

    from lm_common import hf_llama

    torch.manual_seed(0)
    # Multi-query: the key and value held whole on both ranks, their gradients summed.
    model = hf_llama(
        vocab=32, hidden=16, intermediate=24, layers=1, heads=2, kv_heads=1, positions=8
    )
    split = filter_parallel(model.double(), speeds=[1.0, 0.5])
    alone = [dist.new_group([r]) for r in range(world)][rank]  # each rank its own replica
    ddp = DistributedDataParallel(split, process_group=alone)
    ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(1))
    try:
        ddp(input_ids=ids, labels=ids).loss.backward()
    except ValueError as e:
        return str(e)
    return "no error"


def _ddp_on_the_split_ranks(rank, world):
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    split = filter_parallel(
        nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)), speeds=[1.0, 1.0]
    )
    try:  # Accelerate's prepare does it: DDP had copied rank 0's slices over rank 1's
        DistributedDataParallel(split)(torch.ones(3, 4))
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.multiproc
def test_ddp_over_the_ranks_of_one_split_is_refused():
    for said in spawn(_ddp_on_the_split_ranks, 2, timeout=60):
        assert said.startswith("model: DDP runs over ranks [0, 1] of one filter_parallel"), said


def _mpi_optimizer_over_a_split(rank, world):
    from hetcoll.torch import DistributedOptimizer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)).double()
    split = filter_parallel(model, speeds=[1.0, 1.0])  # even: the slices have one shape
    said = []
    # Over the split's own ranks: refused. Over a group of one rank of each split (replicas
    # of it, here one each): trains.
    for group in (None, [dist.new_group([r]) for r in range(world)][rank]):
        opt = DistributedOptimizer(
            torch.optim.SGD(split.parameters(), lr=0.1), group, local_batch=3
        )
        split(torch.ones(3, 4, dtype=torch.float64)).sum().backward()
        try:
            opt.step()
            said.append("stepped")
        except ValueError as e:
            said.append(str(e))
        opt.zero_grad()
    return said


@pytest.mark.multiproc
def test_the_mpi_optimizer_over_the_ranks_of_one_split_is_refused():
    """DistributedOptimizer over the ranks of one split averaged their slices' gradients (on
    an even split they have one shape): every rank raises, naming the split."""
    for refused, replicas in spawn(_mpi_optimizer_over_a_split, 2, timeout=60):
        assert refused.startswith("optimizer: its group holds 2 ranks of one filter_parallel"), (
            refused
        )
        assert replicas == "stepped", replicas


@pytest.mark.multiproc
def test_ddp_over_a_split_holding_parameters_whole_is_refused():
    """DDP over the replicas of a split model averaged the gradients of what the split holds
    whole before their sums over the split were added, and wrote its average over them (a
    multi-query attention's key and value projections never trained): every rank raises."""
    pytest.importorskip("transformers")
    for got in spawn(_ddp_over_a_split, 2, timeout=120):
        assert got.startswith("model: DDP runs a split model whose 'model.layers.0.self_attn"), got
        assert "Average the replicas after the backward instead" in got


def test_a_rank_outside_the_group_is_told_so(no_engine):
    """torch gives a rank outside a new group GroupMember.NON_GROUP_MEMBER (the int -100):
    every function said "must be ... got int"."""
    with pytest.raises(ValueError, match=r"^group: this rank is not a member of the group"):
        hetcoll.allreduce(np.ones(2), group=dist.GroupMember.NON_GROUP_MEMBER)
    with pytest.raises(ValueError, match=r"^group: this rank is not a member of the group"):
        BalancedSampler(range(4), [2, 2], 0, group=dist.GroupMember.NON_GROUP_MEMBER)


def test_what_is_no_group_is_named_where_it_is_given():
    """A str group was held by a sampler that never verifies, and by a hook state that wraps
    its group at the first step only."""
    from hetcoll.torch import BalancedSampler

    text = r"^group: must be an mpi4py communicator, a torch.distributed ProcessGroup, None or"
    with pytest.raises(TypeError, match=text):
        BalancedSampler(range(10), [5, 5], 0, verify=False, group="abc")
    with pytest.raises(TypeError, match=text):
        WeightedAllreduceState("abc", 1)
