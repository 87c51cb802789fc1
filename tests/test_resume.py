"""Resuming counts what was trained (issue 41): a ``BalancedSampler`` checkpoint taken after
step k resumes at step k + 1 whatever the DataLoader fetched ahead (worker processes,
``prefetch_factor``, pinned memory), with torch's DataLoader and torchdata's
StatefulDataLoader, on one process, on 2 gloo ranks (DDP with the weighted hook) and for a plan
resumed on another number of ranks; the resumed run's parameters equal an uninterrupted run's
to 1e-10 in float64, and every epoch sees every sample exactly once."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import hetcoll
from hetcoll import CollectiveMismatchError, Plan
from hetcoll.launch import spawn
from hetcoll.torch import (
    BalancedSampler,
    WeightedAllreduceState,
    parallelize,
    weighted_allreduce_hook,
)

from dp_common import make_data, make_model

# 53 = 6 * 8 + 5: 7 steps an epoch, the last one smaller.
N, BATCH, EPOCHS, SEED, LR = 53, 8, 2, 3, 0.1
STEPS = 2 * 7


def dataset() -> TensorDataset:
    return TensorDataset(*make_data(N))


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)  # momentum: state to carry


def uninterrupted() -> list[torch.Tensor]:
    """One process, every step of every epoch, no loader: the global batches in order."""
    x, y = make_data(N)
    model = make_model()
    opt = optimizer(model.parameters())
    order = BalancedSampler(range(N), [BATCH], 0, seed=SEED, verify=False)
    for epoch in range(EPOCHS):
        order.set_epoch(epoch)
        for idx in order.batch_sampler():
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return [p.detach() for p in model.parameters()]


def first_epoch(state: dict | None) -> int:
    """Where a loop resumes: the saved epoch, or the next one if the saved one was over."""
    if state is None:
        return 0
    return state["epoch"] + (state["position"] == N)


# -- one process ---------------------------------------------------------------------------------


def train(loader_kw: dict, stop: int | None, resume: dict | None, after_break: bool) -> dict:
    """The raw loop on one process, from the start or from ``resume``: to the end, or until
    step ``stop`` is trained, then a checkpoint (taken inside the loop, or ``after_break``
    once the loop was left and the loader's iterator is gone)."""
    data = dataset()
    model = make_model()
    opt = optimizer(model.parameters())
    sampler = BalancedSampler(data, [BATCH], 0, seed=SEED, verify=False)
    step = 0
    if resume is not None:
        model.load_state_dict(resume["model"])
        opt.load_state_dict(resume["optimizer"])
        sampler.load_state_dict(resume["sampler"])
        step = resume["step"]
    loader = DataLoader(data, batch_sampler=sampler.batch_sampler(), **loader_kw)
    ckpt = None
    for epoch in range(first_epoch(resume and resume["sampler"]), EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            step += 1
            if step == stop:
                ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
                if not after_break:
                    ckpt["sampler"] = sampler.state_dict()
                break
        if ckpt is not None:
            break
    if ckpt is not None:
        if after_break:
            ckpt["sampler"] = sampler.state_dict()
        return ckpt
    return {"params": [p.detach() for p in model.parameters()], "step": step}


LOADERS = {
    "2 workers": {"num_workers": 2},
    "2 workers, prefetch 3, pinned": {"num_workers": 2, "prefetch_factor": 3, "pin_memory": True},
    "1 persistent worker, prefetch 1": {
        "num_workers": 1,
        "prefetch_factor": 1,
        "persistent_workers": True,
    },
    "no workers": {},
}


@pytest.mark.parametrize("name", list(LOADERS))
def test_a_raw_loop_with_loader_workers_resumes_at_the_next_step(name):
    """Stopped after step 3 (epoch 0) and after step 9 (epoch 1), the checkpoint resumes at
    the next step: the final weights equal the uninterrupted run's, and the resumed run trains
    exactly the remaining steps."""
    reference = uninterrupted()
    for stop, after_break in ((3, False), (9, True)):
        ckpt = train(LOADERS[name], stop, None, after_break)
        # The loader had fetched ahead of step `stop`; the state counts the steps trained.
        assert ckpt["sampler"]["position"] == (stop % 7) * BATCH
        done = train(LOADERS[name], None, ckpt, False)
        assert done["step"] == STEPS
        for a, b in zip(done["params"], reference):
            assert a.dtype == torch.float64
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_stateful_dataloader_resumes_from_its_own_state():
    """torchdata's StatefulDataLoader snapshots the batch view as it pulls steps and counts what
    it hands out: its state_dict resumes at the next step, with workers, for the batch view and
    for the sampler given as ``sampler=`` (every snapshot interval); the sampler's own state
    agrees."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    data = dataset()

    def loader(sampler, mode, **kw):
        if mode == "batch":
            return stateful.StatefulDataLoader(data, batch_sampler=sampler.batch_sampler(), **kw)
        return stateful.StatefulDataLoader(data, batch_size=5, sampler=sampler, **kw)

    for mode, shares in (("batch", [5, 3]), ("sample", [5, 3])):
        whole = [b[1].tolist() for b in loader(BalancedSampler(data, shares, 0, seed=SEED,
                                                                 verify=False), mode)]  # fmt: skip
        for kw in ({"num_workers": 2}, {"num_workers": 2, "snapshot_every_n_steps": 3}, {}):
            sampler = BalancedSampler(data, shares, 0, seed=SEED, verify=False)
            first = loader(sampler, mode, **kw)
            it = iter(first)
            taken = [next(it)[1].tolist() for _ in range(4)]
            state = first.state_dict()
            assert sampler.state_dict()["position"] == 4 * 8  # 4 steps of 8, whatever it fetched
            del it
            again = loader(BalancedSampler(data, shares, 0, seed=SEED, verify=False), mode, **kw)
            again.load_state_dict(state)
            assert taken + [b[1].tolist() for b in again] == whole, (mode, kw)


@settings(max_examples=12, deadline=None)
@given(
    n=st.integers(10, 60),
    shares=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    resumes=st.lists(
        st.tuples(st.integers(1, 4), st.lists(st.integers(1, 6), min_size=1, max_size=3)),
        min_size=1,
        max_size=3,
    ),
    workers=st.sampled_from([(0, None), (1, 1), (2, 2)]),
    shuffle=st.booleans(),
)
def test_every_sample_once_per_epoch_whatever_the_resumes(n, shares, resumes, workers, shuffle):
    """An epoch stopped after a few steps and resumed, several times, on other numbers of ranks
    with other shares (on as many ranks the saved shares come back; each rank its own sampler
    and loader with workers, in this process):
    the steps trained cover the epoch's samples exactly once (padding aside: a last step with
    fewer samples than ranks repeats some, as DistributedSampler does)."""
    num_workers, prefetch = workers
    kw = {"num_workers": num_workers}
    if num_workers:
        kw["prefetch_factor"] = prefetch
    seen: Counter[int] = Counter()
    state, padded = None, False
    segments = [(0, shares), *((stop, s) for stop, s in resumes)]
    for k, (_, now) in enumerate(segments):
        stop = segments[k + 1][0] if k + 1 < len(segments) else None
        samplers = [
            BalancedSampler(range(n), now, r, seed=SEED, shuffle=shuffle, verify=False)
            for r in range(len(now))
        ]
        for s in samplers:
            if state is not None:
                s.load_state_dict(state)
        start = 0 if state is None else state["position"]
        states = []
        for s in samplers:
            loader = DataLoader(range(n), batch_sampler=s.batch_sampler(), **kw)
            for j, batch in enumerate(loader):
                seen.update(batch.tolist())
                if j + 1 == stop:
                    break
            states.append(s.state_dict())  # after leaving the loop
        assert all(st_ == states[0] for st_ in states)
        state = states[0]
        if state["position"] == n:  # the epoch ended in this segment: on a padded step?
            shares_run = samplers[0].shares  # a restore on as many ranks took the saved ones
            padded = 0 < (n - start) % sum(shares_run) < len(shares_run)
            break
    assert set(seen) == set(range(n))
    if not padded:
        assert all(c == 1 for c in seen.values()), seen


def test_a_checkpoint_of_other_data_is_refused_naming_the_argument():
    s = BalancedSampler(range(20), [3, 1], 0, seed=4, verify=False)
    it = iter(s.batch_sampler())
    next(it)
    state = s.state_dict()
    cases = {
        "dataset": BalancedSampler(range(21), [3, 1], 0, seed=4, verify=False),
        "seed": BalancedSampler(range(20), [3, 1], 0, seed=5, verify=False),
        "shuffle": BalancedSampler(range(20), [3, 1], 0, seed=4, shuffle=False, verify=False),
        "drop_last": BalancedSampler(range(20), [3, 1], 0, seed=4, drop_last=True, verify=False),
    }
    for argument, other in cases.items():
        with pytest.raises(ValueError, match=rf"^{argument}: .*state\['"):
            other.load_state_dict(state)
        assert other.state_dict()["position"] == 0  # unchanged
    with pytest.raises(ValueError, match=r"state\['epoch'\]"):
        s.load_state_dict({**state, "epoch": -1})
    with pytest.raises(ValueError, match="batch: must be a positive integer"):
        BalancedSampler.whole_batches(range(20), 0, verify=False)


def test_a_loop_that_fetches_ahead_says_how_far():
    """A loop holding the next batch while it trains (as Accelerate's DataLoaderShard does)
    passes ``ahead=1``: the state leaves that batch out and the resumed loader yields it."""
    data = list(range(30))
    whole = [b.tolist() for b in DataLoader(data, batch_sampler=BalancedSampler(
        data, [4], 0, seed=SEED, verify=False).batch_sampler())]  # fmt: skip
    sampler = BalancedSampler(data, [4], 0, seed=SEED, verify=False)
    it = iter(DataLoader(data, batch_sampler=sampler.batch_sampler(), num_workers=1))
    held = next(it)
    trained = []
    for _ in range(3):  # train the held batch, then hold the next one
        trained.append(held.tolist())
        held = next(it)
    state = sampler.state_dict(ahead=1)
    with pytest.raises(ValueError, match="ahead"):
        sampler.state_dict(ahead=5)
    with pytest.raises(ValueError, match="ahead"):
        sampler.state_dict(ahead=-1)
    del it
    again = BalancedSampler(data, [4], 0, seed=SEED, verify=False)
    again.load_state_dict(state)
    rest = [b.tolist() for b in DataLoader(data, batch_sampler=again.batch_sampler())]
    assert trained + rest == whole


class SlottedLoaderIterator:
    """A loader iterator hetcoll cannot count into (``__slots__``: no subclass of its type fits
    its layout), pulling steps from its index sampler as torch's ``_next_index`` does."""

    __slots__ = ("_index_sampler", "_steps")

    def __init__(self, index_sampler):
        self._index_sampler = index_sampler
        self._steps = iter(index_sampler)

    def __iter__(self):
        return self

    def __next__(self):
        return self._next_index()

    def _next_index(self):
        return next(self._steps)


def test_a_loader_that_cannot_be_counted_is_warned_about():
    sampler = BalancedSampler(range(20), [4], 0, verify=False)
    it = SlottedLoaderIterator(sampler.batch_sampler())
    with pytest.warns(RuntimeWarning, match="cannot count the batches a SlottedLoaderIterator"):
        next(it)
    assert sampler.state_dict()["position"] == 4  # the steps it pulled


def test_whole_batches_give_every_rank_the_global_batch_and_keep_their_batch():
    a = BalancedSampler.whole_batches(range(20), 8, seed=1, verify=False)
    steps = list(a.batch_sampler())
    assert steps == list(BalancedSampler(range(20), [8], 0, seed=1, verify=False).batch_sampler())
    it = iter(a.batch_sampler())
    next(it)
    b = BalancedSampler.whole_batches(range(20), 6, seed=1, verify=False)  # another plan's
    b.load_state_dict(a.state_dict())
    assert b.shares == [6]
    assert [len(s) for s in b.batch_sampler()] == [6, 6]  # the rest of the epoch: 12 samples


# -- two gloo ranks --------------------------------------------------------------------------------


def ddp_train(rank, world, speeds, loader_kw, stop, resume):
    """The balanced DDP loop on this rank, with loader workers: to the end or to ``stop``
    (a checkpoint), from the start or from ``resume``."""
    data = dataset()
    model = make_model()
    opt = optimizer(model.parameters())
    shares = hetcoll.split(BATCH, speeds, minimum=1)
    sampler = BalancedSampler(data, shares, rank, seed=SEED)
    step = 0
    if resume is not None:
        ckpt = torch.load(resume, weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sampler.load_state_dict(ckpt["sampler"])
        step = ckpt["step"]
    ddp = DDP(model)
    state = WeightedAllreduceState(None, local_batch=shares[rank])
    ddp.register_comm_hook(state, weighted_allreduce_hook)
    loader = DataLoader(data, batch_sampler=sampler.batch_sampler(), **loader_kw)
    for epoch in range(first_epoch(resume and ckpt["sampler"]), EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            state.local_batch = len(y)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            step += 1
            if step == stop:
                return {
                    "model": model.state_dict(),
                    "optimizer": opt.state_dict(),
                    "sampler": sampler.state_dict(),
                    "step": step,
                }
    return [p.detach().clone() for p in model.parameters()], step, list(sampler.shares)


def ddp_stop_and_resume(rank, world, directory):
    # Workers forked from the rank (its default context is the launcher's forkserver, whose
    # workers import torch afresh: seconds each).
    kw = {"num_workers": 2, "prefetch_factor": 2, "multiprocessing_context": "fork"}
    out = {}
    for stop, speeds in ((3, [5.0, 3.0]), (9, [1.0, 3.0])):
        ckpt = ddp_train(rank, world, [5.0, 3.0], kw, stop, None)
        path = f"{directory}/step{stop}.rank{rank}.pt"
        torch.save(ckpt, path)
        # Every rank resumes from rank 0's checkpoint (any rank's holds the same position).
        torch.distributed.barrier()
        out[stop] = ddp_train(rank, world, speeds, kw, None, f"{directory}/step{stop}.rank0.pt")
    # A resumed job whose ranks load different positions raises on every rank ...
    sampler = BalancedSampler(dataset(), [5, 3], rank, seed=SEED)
    saved = torch.load(f"{directory}/step{3 if rank == 0 else 9}.rank0.pt", weights_only=True)
    try:
        sampler.load_state_dict(saved["sampler"])
    except CollectiveMismatchError as e:
        out["mismatch"] = str(e)
    # ... and so does one where rank 1 forgot to load it (at its loader's first step).
    sampler = BalancedSampler(dataset(), [5, 3], rank, seed=SEED)
    loader = DataLoader(dataset(), batch_sampler=sampler.batch_sampler(), **kw)
    try:
        if rank == 0:
            sampler.load_state_dict(saved["sampler"])
        next(iter(loader))
    except CollectiveMismatchError as e:
        out["forgotten"] = str(e)
    return out


@pytest.mark.multiproc
def test_two_ranks_with_loader_workers_resume_at_the_next_step(tmp_path):
    """DDP on 2 gloo ranks with 2 loader workers each: stopped after step 3 and after step 9,
    resumed on 2 ranks (the saved shares come back, 5:3), the weights equal one uninterrupted
    process's; ranks that load different checkpoints, or only one of them, all raise."""
    per_rank = spawn(ddp_stop_and_resume, 2, str(tmp_path), timeout=240)
    reference = uninterrupted()
    for stop in (3, 9):
        (params, steps, shares), (params1, steps1, _) = per_rank[0][stop], per_rank[1][stop]
        assert steps == steps1 == STEPS and shares == [5, 3]
        for a, b, c in zip(params, params1, reference):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
            torch.testing.assert_close(a, c, rtol=0, atol=1e-10)
    for r in range(2):
        assert per_rank[r]["mismatch"].startswith("ranks disagree on the restored epoch")
        assert per_rank[r]["forgotten"].startswith("ranks disagree on ")


# -- a plan, resumed on another number of ranks ----------------------------------------------------

PLAN_N, PLAN_SEED = 45, 2  # 5 steps of 8 an epoch; the remaining 5 samples are dropped
PIPELINE_3 = {
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
SPLIT_2 = {
    "microbatches": 2,
    "replicas": [
        {"samples": 8, "stages": [{"ranks": [1, 0], "speeds": [3.0, 1.0], "layers": [0, 11]}]}
    ],
}


def plan_data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(
        torch.randn(PLAN_N, 3, 8, 8, generator=g, dtype=torch.float64),
        torch.randint(0, 5, (PLAN_N,), generator=g),
    )


def cnn() -> nn.Module:
    from plan_cases import cnn

    torch.manual_seed(0)
    return cnn().double()


def plan_job(group, plan, stop, path, resume):
    """Train under ``plan`` with a loader of 2 workers over ``par.sampler``: to step ``stop``
    (then write a checkpoint: weights, optimizer state, data position) or, from ``resume``,
    to the end of 2 epochs. Returns the full state dict and the steps trained."""
    data = plan_data()
    par = parallelize(cnn(), Plan.from_dict(plan), loss_fn=nn.CrossEntropyLoss(), group=group)
    opt = torch.optim.Adam(par.parameters(), lr=0.01)
    sampler = par.sampler(data, seed=PLAN_SEED)
    step = 0
    if resume is not None:
        ckpt = torch.load(resume, weights_only=True)
        par.load_full_state_dict(ckpt["model"])
        par.load_full_optimizer_state_dict(opt, ckpt["optimizer"])
        sampler.load_state_dict(ckpt["data"])
        step = ckpt["step"]
    # Workers from a fork server, not forked from the rank: a rank holds gloo's threads, and a
    # child forked beside them can deadlock (a CI run's worker hung so, its rank waiting on it
    # for the test's 300 s).
    loader = DataLoader(
        data,
        batch_sampler=sampler.batch_sampler(),
        num_workers=2,
        multiprocessing_context="forkserver",
    )
    start = 0 if resume is None else ckpt["data"]["epoch"]
    for epoch in range(start, 2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            par.step(x, y)
            opt.step()
            opt.zero_grad()
            step += 1
            if step == stop:
                ckpt = {
                    "model": par.full_state_dict(),
                    "optimizer": par.full_optimizer_state_dict(opt),
                    "data": sampler.state_dict(),
                    "step": step,
                }
                if torch.distributed.get_rank() == 0:
                    torch.save(ckpt, path)
                return ckpt["data"], step
    return par.full_state_dict(), step


def plan_stop_on_three_resume_on_two(rank, world, directory):
    path = f"{directory}/plan.pt"
    data_state, _ = plan_job(None, PIPELINE_3, 3, path, None)
    two = torch.distributed.new_group([0, 1])
    torch.distributed.barrier()  # rank 0 has written the checkpoint
    if rank == 2:
        return data_state, None
    return data_state, plan_job(two, SPLIT_2, None, path, path)


@pytest.mark.multiproc
def test_a_plan_resumes_its_data_position_on_another_number_of_ranks():
    """A pipeline with a split stage on 3 ranks stops after step 3 of the first epoch (its
    loader's workers had fetched further); resumed as a 2-rank split plan from weights,
    optimizer state and data position, it ends with one uninterrupted process's weights."""
    import tempfile

    from plan_cases import rel

    with tempfile.TemporaryDirectory() as directory:
        per_rank = spawn(plan_stop_on_three_resume_on_two, 3, directory, timeout=240)
    assert [r[0]["position"] for r in per_rank] == [24] * 3
    (weights, steps), (weights1, _) = per_rank[0][1], per_rank[1][1]
    assert steps == 10  # 5 steps an epoch, 2 epochs
    model = cnn()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = plan_data().tensors
    order = BalancedSampler(range(PLAN_N), [8], 0, seed=PLAN_SEED, drop_last=True, verify=False)
    for epoch in range(2):
        order.set_epoch(epoch)
        for idx in order.batch_sampler():
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            opt.zero_grad()
    for name, want in model.state_dict().items():
        assert torch.equal(weights[name], weights1[name])
        assert rel(weights[name], want) <= 1e-10, name


# -- new shares with loaders that fetch ahead by different numbers of steps ----------------------


def steps_with_uneven_prefetch(rank, world, changes=((1, [2, 6]),)):
    """Rank 0's loader has 2 workers fetching 3 steps each, rank 1's none: after each step
    ``k`` of ``changes`` both set its new shares. Returns this rank's indices per step."""
    data = TensorDataset(torch.arange(2 * N))
    sampler = BalancedSampler(data, [5, 3], rank, seed=SEED)
    kw = {"num_workers": 2, "prefetch_factor": 3, "multiprocessing_context": "fork"}
    loader = DataLoader(data, batch_sampler=sampler.batch_sampler(), **(kw if rank == 0 else {}))
    steps = []
    for k, (idx,) in enumerate(loader):
        steps.append(idx.tolist())
        for at, shares in changes:
            if k == at:
                sampler.set_shares(shares)
    return steps


@pytest.mark.multiproc
def test_new_shares_apply_at_one_step_whatever_each_loader_fetched_ahead():
    """Set after step 2, the new shares [2, 6] apply from step 9 on both ranks (rank 0's workers
    had cut steps 3 to 8 at the old shares, rank 1 none): every step is one global batch of the
    one-process order, no sample twice or left out (the last, of 2 samples, split 1 : 1)."""
    rank0, rank1 = spawn(steps_with_uneven_prefetch, 2, timeout=120)
    order = BalancedSampler(range(2 * N), [BATCH], 0, seed=SEED, verify=False).batch_sampler()
    assert [a + b for a, b in zip(rank0, rank1, strict=True)] == list(order)
    assert [len(s) for s in rank0] == [5] * 8 + [2] * 5 + [1]
    assert [len(s) for s in rank1] == [3] * 8 + [6] * 5 + [1]


@pytest.mark.multiproc
def test_shares_changed_twice_inside_a_loaders_prefetch_apply_in_order():
    """Set after steps 2 and 4, both changes inside what rank 0's workers had cut ahead: [2, 6]
    applies from step 9 and [6, 2] from step 11 on both ranks. (The sampler kept one pending
    switch: the second overwrote the first, and rank 1 cut steps 3 to 10 at [2, 6] where rank 0
    had cut them at [5, 3], training 9 samples twice and leaving others out, silently.)"""
    changes = ((1, [2, 6]), (3, [6, 2]))
    rank0, rank1 = spawn(steps_with_uneven_prefetch, 2, changes, timeout=120)
    order = BalancedSampler(range(2 * N), [BATCH], 0, seed=SEED, verify=False).batch_sampler()
    assert [a + b for a, b in zip(rank0, rank1, strict=True)] == list(order)
    assert [len(s) for s in rank0] == [5] * 8 + [2] * 2 + [6] * 3 + [1]
    assert [len(s) for s in rank1] == [3] * 8 + [6] * 2 + [2] * 3 + [1]
