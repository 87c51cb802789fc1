"""The MPI DistributedOptimizer under mpiexec: exact full-batch updates with uneven batches."""

import json
import os

import pytest

from hetcoll.launch import mpiexec

pytestmark = pytest.mark.multiproc
WORKER = os.path.join(os.path.dirname(__file__), "mpi_workers", "data_parallel.py")


@pytest.mark.parametrize("world", [2, 3])
def test_mpi_optimizer_matches_single_process(world):
    out = mpiexec(world, [WORKER], timeout=240).stdout
    results = json.loads(next(line for line in out.splitlines() if line.startswith("[")))
    assert sorted(r["rank"] for r in results) == list(range(world))
    for r in results:
        assert r["step_grad"] <= 1e-10
        assert r["step_param"] <= 1e-10
        assert r["epoch_param"] <= 1e-10
        assert "ranks disagree" in r["disagree"]
        assert r["twice"] == (
            "local_batch: on rank 0, opt.synchronize() was called twice for one step (its count "
            "was taken already); the step() after it averages no more"
        ), r
        assert r["heads"] <= 1e-10 and r["unused_grad"] == [True, True]
        assert (
            "ranks disagree on the module tensor elements (rank 0: 15, rank 1: 10"
            in (r["bcast_mismatch"])
        )
        assert r["bcast_bf16"] == 6.0  # rank 0's ones
        assert r["scheduled_lr"] == [0.025, 0.025]
        for name in ("lbfgs", "sgd"):  # step(closure): one process's steps and losses
            got = r[f"closure_{name}"]
            assert got["param"] <= 1e-10 and got["loss"] <= 1e-10, (name, got)
            assert got["calls"][0] == got["calls"][1], (name, got)
        assert r["closure_lbfgs"]["calls"][0] > 3  # several calls a step
        for recipe in ("synchronize", "plain", "unscale"):  # an inf on one rank's rows:
            scaled = r[f"grad_scaler_{recipe}"]  # every rank skips that step alike
            assert scaled["param"] <= 1e-10, (recipe, scaled)
            assert scaled["skipped"] == [False, True, False, False], (recipe, scaled)
            # Averaged first, every rank lowers its scale; else the rank that overflowed alone.
            lowered = recipe == "synchronize" or r["rank"] == world - 1
            assert scaled["scales"] == [512.0 if lowered else 1024.0, 512.0], (recipe, scaled)
        assert r["layouts_every_rank"] <= 1e-10 and r["layouts_rank_0"] <= 1e-10, r
        assert r["bcast_layouts"], r
        if r["rank"] == 0:
            assert r["left_out"].startswith("group: this rank is not a member of the group (MPI.")
        assert r["sparse"].startswith("TypeError: optimizer: parameter 0's gradient is "), r
        if world == 2:  # the discriminator's forward in the generator's step, zeroed
            assert r["gan"] <= 1e-12, r["gan"]
        reb = r["rebalance"]  # the same decisions on every rank, and the right ones
        assert reb["settled_before"] == reb["want_before"]
        assert reb["settled_after"] == reb["want_after"] and reb["stable"]
        assert 2 <= reb["changes"] <= 8
        for got in r["groups"].values():  # group=None is COMM_WORLD under mpiexec
            assert got["fits"] == [100.0 * (q + 1) for q in range(world)]
            assert got["allreduce"] == [float(world)] * 2
            assert "ranks disagree on the number of shares" in got["sampler_count"]
            assert "ranks disagree on shares[0]" in got["sampler_values"]
            assert (
                f"has {world + 1} entries but the group has {world} ranks" in got["sampler_world"]
            )
            assert got["rebalanced"] == results[0]["groups"]["default"]["rebalanced"]
            assert got["rebalanced"] != [8] * world


ITEMS_WORKER = os.path.join(os.path.dirname(__file__), "mpi_workers", "items.py")


@pytest.mark.parametrize("world", [2, 3])
def test_mpi_optimizer_with_items_trains_a_padded_lm_as_one_process(world):
    """Hugging Face GPT-2 and a TransformerEncoder decoder, uneven shares and padding (a rank
    with no valid label in one step): DistributedOptimizer(items=...) equals one process on the
    global batches to 1e-10; weighing rows instead does not; bad counts raise on every rank."""
    from lm_common import SHARES, global_batches, items, rank_rows

    out = mpiexec(world, [ITEMS_WORKER], timeout=240).stdout
    results = json.loads(next(line for line in out.splitlines() if line.startswith("[")))
    assert sorted(r["rank"] for r in results) == list(range(world))
    per_step = [
        [items(y[rank_rows(world, q)]) for q in range(world)] for _, y in global_batches(world)
    ]
    assert per_step[1][-1] == 0 and len(SHARES[world]) == world
    for r in results:
        for name in ("gpt2", "encoder"):
            assert r[name]["items"] <= 1e-10, (name, r)
            assert r[name]["seen"] == [[c[r["rank"]], sum(c)] for c in per_step]
        assert not r["gpt2"]["rows"] <= 1e-3
        bad = r["bad"]
        assert bad["non_integer"] == [
            "ValueError",
            f"items: rank {world - 1} counted 1.5 for this step; items(y) must be an integer >= 0 "
            "(what the loss averages over)",
        ]
        assert bad["all_zero"][0] == "ValueError"
        assert "items: every rank counted 0 items" in bad["all_zero"][1]
        assert bad["raises"] == ["ValueError", "items: items(y) raised an exception on rank 0"]
        assert bad["not_counted"][0] == "RuntimeError"
        assert "items: rank 1 counted nothing for this step" in bad["not_counted"][1]


#: DistributedOptimizer's arguments given on rank 1 only, and what each rank raises at the
#: first step: before, rank 1's constructor raised alone and rank 0 waited in its step.
OPTIMIZER_ONE_RANK = {
    "fusion_bytes": (
        {"fusion_bytes": 0},
        "CollectiveMismatchError: rank 1 raised ValueError: fusion_bytes: must be a number in "
        "[1, 2**62), got 0",
        "ValueError: fusion_bytes: must be a number in [1, 2**62), got 0",
    ),
    "batch_dim": (
        {"batch_dim": -1},
        "CollectiveMismatchError: rank 1 raised ValueError: batch_dim: must be an integer >= 0",
        "ValueError: batch_dim: must be an integer >= 0, got -1",
    ),
}


def _optimizer_one_rank(rank, world):
    import torch
    from torch import nn

    from hetcoll.torch import DistributedOptimizer

    out = {}
    for case, (bad, *_) in OPTIMIZER_ONE_RANK.items():
        model = nn.Linear(3, 2).double()
        try:
            opt = DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1),
                model=model,
                **(bad if rank == 1 else {}),
            )
            model(torch.ones(2 + rank, 3, dtype=torch.float64)).sum().backward()
            opt.step()
            out[case] = "no error"
        except (ValueError, TypeError, RuntimeError) as e:
            out[case] = f"{type(e).__name__}: {e}"
    # The group still works: a good optimizer averages exactly, (1 * 1 + 3 * 2) / 4.
    p = nn.Parameter(torch.zeros(4, dtype=torch.float64))
    p.grad = torch.full((4,), rank + 1.0, dtype=torch.float64)
    opt = DistributedOptimizer(torch.optim.SGD([p], lr=1.0), local_batch=1 + 2 * rank)
    opt.step()
    out["after"] = p.detach().tolist()
    return out


def test_a_bad_optimizer_argument_on_one_rank_raises_on_every_rank_at_the_step():
    """On a gloo group (the optimizer's torch.distributed path): the constructor exchanges
    nothing, so rank 1's bad fusion_bytes / batch_dim is raised from the first step, where
    every rank communicates; rank 0 raises there too instead of waiting (short timeout)."""
    from hetcoll.launch import spawn

    per_rank = spawn(_optimizer_one_rank, 2, timeout=20)
    for case, (_, *said) in OPTIMIZER_ONE_RANK.items():
        for r in range(2):
            assert per_rank[r][case].startswith(said[r]), (case, r, per_rank[r][case])
    assert [o["after"] for o in per_rank] == [[-1.75] * 4] * 2


def _dropped_micro_batch(rank, world, loop):
    """One step on shares 3:2:1 after a micro-batch whose gradients zero_grad dropped
    (``loop="dropped"``: count, backward, zero_grad), or with the step's count made before
    its zero_grad (``"count first"``: count, zero_grad, backward): the parameters after it."""
    import torch
    from torch import nn

    from hetcoll.torch import DistributedOptimizer

    torch.manual_seed(0)
    model = nn.Linear(4, 2).double()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), items=len)
    x, y = _rows(0, 6)
    if loop == "dropped":
        lo, hi = [(0, 1), (1, 2), (2, 6)][rank]
        opt.count(y[lo:hi])
        nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]).backward()
    x, y = _rows(1, 6)
    lo, hi = [(0, 3), (3, 5), (5, 6)][rank]
    opt.count(y[lo:hi])
    opt.zero_grad()
    nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi]).backward()
    opt.step()
    return [p.detach().clone() for p in model.parameters()], opt.global_batch


def _rows(seed, n):
    import torch

    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, 4, generator=g, dtype=torch.float64),
        torch.randn(n, 2, generator=g, dtype=torch.float64),
    )


@pytest.mark.parametrize("loop", ["dropped", "count first"])
def test_zero_grad_drops_the_counts_of_the_gradients_it_drops(loop):
    """With items=, zero_grad drops a count whose backward ran since (a micro-batch skipped
    after its backward, as the forwards counted by model=), and keeps one made before it whose
    backward comes after: both steps weigh 6 items. Before, the dropped micro-batch's count
    stayed in the step (global batch 12, 9e-2 off)."""
    import torch
    from torch import nn

    from hetcoll.launch import spawn

    torch.manual_seed(0)
    ref = nn.Linear(4, 2).double()
    x, y = _rows(1, 6)
    nn.functional.mse_loss(ref(x), y).backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    for params, total in spawn(_dropped_micro_batch, 3, loop):
        assert total == 6
        for got, want in zip(params, ref.parameters(), strict=True):
            assert float((got - want.detach()).abs().max() / want.detach().abs().max()) <= 1e-12
