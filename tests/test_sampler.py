"""BalancedSampler properties: exact coverage, equal step counts, determinism."""

from __future__ import annotations

import gc
import threading
import warnings
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetcoll.torch import BalancedSampler


def plans(n, shares, **kw):
    samplers = [
        BalancedSampler(range(n), shares, r, verify=False, **kw) for r in range(len(shares))
    ]
    return samplers, [list(s.batch_sampler()) for s in samplers]


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 300),
    shares=st.lists(st.integers(1, 20), min_size=1, max_size=6),
    seed=st.integers(0, 5),
    epoch=st.integers(0, 3),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
)
def test_coverage_steps_and_determinism(n, shares, seed, epoch, shuffle, drop_last):
    kw = dict(seed=seed, shuffle=shuffle, drop_last=drop_last)
    samplers, batches = plans(n, shares, **kw)
    for s in samplers:
        s.set_epoch(epoch)
    batches = [list(s.batch_sampler()) for s in samplers]
    steps = {len(b) for b in batches}
    assert len(steps) == 1  # every rank runs the same number of steps
    assert steps == {samplers[0].steps_per_epoch}
    total = sum(shares)
    counts = Counter(i for b in batches for step in b for i in step)
    if drop_last:
        assert sum(counts.values()) == (n // total) * total
        assert all(c == 1 for c in counts.values())
    else:
        # Every sample exactly once, plus padding only when the tail is shorter than the ranks.
        assert set(counts) == set(range(n))
        extra = sum(counts.values()) - n
        assert extra == (max(0, len(shares) - n % total) if n % total else 0)
    for r, b in enumerate(batches):
        assert all(len(step) >= 1 for step in b)
        full = [len(step) for step in b[: n // total]]
        assert all(size == shares[r] for size in full)
        assert [i for step in b for i in step] == list(samplers[r])
        assert len(samplers[r]) == sum(len(step) for step in b)
    # Determinism per (seed, epoch).
    again = [BalancedSampler(range(n), shares, r, verify=False, **kw) for r in range(len(shares))]
    for s in again:
        s.set_epoch(epoch)
    assert [list(s) for s in again] == [list(s) for s in samplers]


def test_epochs_reshuffle_and_last_step_is_proportional():
    s = BalancedSampler(range(1000), [30, 10], 0, seed=1, verify=False)
    first = list(s)
    s.set_epoch(1)
    assert list(s) != first
    # 1000 = 25 * 40; 1010 leaves 10 -> split 3:1 -> [8, 2] (exact makespan split).
    _, b0 = plans(1010, [30, 10], shuffle=False)
    assert [len(b[-1]) for b in b0] == [8, 2]


def _workers_gone() -> None:
    """A refused loader's worker processes shut down and its queues' feeder threads ended, so
    that a later loader's fork does not meet them closing their pipes (a descriptor number
    the fork has just reused: ``OSError: Bad file descriptor``, seen once in a full run)."""
    gc.collect()
    for t in threading.enumerate():
        if t.name == "QueueFeederThread":
            t.join(timeout=10)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_batching_by_another_size_than_the_share_is_refused(workers):
    """DataLoader(sampler=..., batch_size=B), DistributedSampler's form, with one B on every
    rank cut this rank's steps elsewhere than the others' (ranks ran other numbers of steps
    and waited for each other); batch_size=sampler.batch_size, or the batch view, is fine."""
    import torch
    from torch.utils.data import DataLoader

    data = torch.arange(40)
    for rank, share in enumerate([5, 3]):
        sampler = BalancedSampler(data, [5, 3], rank, shuffle=False, verify=False)
        bad = DataLoader(data, sampler=sampler, batch_size=4, num_workers=workers)
        with pytest.raises(ValueError, match=f"^batch_size: .* by 4, .* is {share};"):
            next(iter(bad))
        _workers_gone()
        # Dropping a short last batch the sampler keeps: a rank whose piece of the epoch's
        # last step is its share would run it, another not, and wait (ranks hung at 1 : 3).
        dropping = DataLoader(data, sampler=sampler, batch_size=share, drop_last=True)
        with pytest.raises(ValueError, match=r"^drop_last: the DataLoader drops a short last"):
            next(iter(dropping))
        good = DataLoader(data, sampler=sampler, batch_size=sampler.batch_size)
        view = DataLoader(data, batch_sampler=sampler.batch_sampler(), num_workers=workers)
        want = [b.tolist() for b in DataLoader(data, batch_sampler=sampler.batch_sampler())]
        assert [b.tolist() for b in good] == want == [b.tolist() for b in view]
        assert len(want) == 5 and all(len(b) == share for b in want)


def _one_batch_size(rank, world):
    import torch
    from torch.utils.data import DataLoader

    import hetcoll

    data = torch.arange(40)
    sampler = BalancedSampler(data, [5, 3], rank, shuffle=False)
    try:
        next(iter(DataLoader(data, sampler=sampler, batch_size=5)))  # rank 0's share
    except (ValueError, hetcoll.CollectiveMismatchError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.multiproc
def test_one_batch_size_on_every_rank_raises_on_every_rank():
    """The rank whose share the loader's batch size is raises too (it went on into its first
    collective and waited for the other)."""
    from hetcoll.launch import spawn

    first, second = spawn(_one_batch_size, 2, timeout=60)
    assert first.startswith("CollectiveMismatchError: ") and "rank 1" in first, first
    assert second.startswith("ValueError: batch_size: the DataLoader batches rank 1's"), second


def _on_a_subgroup(rank, world):
    import torch.distributed as dist

    from hetcoll.torch import Rebalancer

    members = dist.new_group([1, 2])
    if rank == 0:  # outside the group: takes no part
        return None
    mine = dist.get_rank(members)
    try:
        BalancedSampler(range(40), [5, 3], 0, group=members)  # both pass rank 0
        wrong = "no error"
    except ValueError as e:
        wrong = str(e)
    sampler = BalancedSampler(range(400), [4, 4], mine, group=members)
    # No group given: the sampler's (it took the default group, and waited for rank 0).
    reb = Rebalancer(sampler, every=2, threshold=0.0)
    speeds = [100.0, 25.0]
    for _ in range(8):
        reb.observe(sampler.shares[mine], sampler.shares[mine] / speeds[mine])
    return wrong, sampler.shares


@pytest.mark.multiproc
def test_a_sampler_and_its_rebalancer_on_a_subgroup():
    """Two ranks passing one rank would take the same samples; the Rebalancer took the default
    group rather than the sampler's (a shape error, or a wait for a rank outside it)."""
    from hetcoll.launch import spawn

    got = spawn(_on_a_subgroup, 3, timeout=60)
    assert got[0] is None
    for wrong, shares in got[1:]:
        assert wrong.startswith("rank: the group's rank 1 passed rank=0; each rank passes"), wrong
        assert shares == got[1][1] and shares[0] > shares[1], shares  # the fast rank gets more


def test_a_padded_last_step_is_warned_about_once():
    """50 = 6 * 8 + 2 on 3 ranks: the last step repeats one sample from the epoch's start, so
    it is not one process's step; the sampler says so, once. 51 leaves one per rank."""
    s = BalancedSampler(range(50), [3, 3, 2], 2, shuffle=False, verify=False)
    with pytest.warns(UserWarning, match="holds 2 samples for 3 ranks.*1 are repeated"):
        steps = list(s.batch_sampler())
    assert steps[-1] == [0]  # rank 2's sample of the last step: the epoch's first
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(s.batch_sampler())  # told already
        list(BalancedSampler(range(51), [3, 3, 2], 2, verify=False).batch_sampler())
        list(BalancedSampler(range(50), [3, 3, 2], 2, drop_last=True, verify=False))


# -- resuming: state_dict / load_state_dict ----------------------------------------------------


def _run(samplers, steps, changes):
    """Every rank's next ``steps`` steps, with ``changes[k]`` (new shares) set before step k."""
    iters = [iter(s.batch_sampler()) for s in samplers]
    out = []
    for k in range(steps):
        if k in changes:
            for s in samplers:
                s.set_shares(changes[k])
        step = [next(it, None) for it in iters]
        if step[0] is None:
            break
        out.append(step)
    return iters, out


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 120),
    shares=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    data=st.data(),
    seed=st.integers(0, 3),
    epoch=st.integers(0, 2),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
)
def test_restored_sampler_yields_what_the_original_would(
    n, shares, data, seed, epoch, shuffle, drop_last
):
    p = len(shares)
    kw = dict(seed=seed, shuffle=shuffle, drop_last=drop_last, verify=False)
    original = [BalancedSampler(range(n), shares, r, **kw) for r in range(p)]
    for s in original:
        s.set_epoch(epoch)
    stop = data.draw(st.integers(0, n), label="stop")
    changed = data.draw(st.lists(st.integers(1, 9), min_size=p, max_size=p), label="changed")
    change_at = data.draw(st.integers(0, max(stop, 0)), label="change_at")
    iters, _ = _run(original, stop, {change_at: changed})
    states = [s.state_dict() for s in original]
    # Fresh samplers, built with other shares and at another epoch: the state decides.
    restored = [BalancedSampler(range(n), [1] * p, r, **kw) for r in range(p)]
    for s, st_ in zip(restored, states):
        s.load_state_dict(st_)
    rest_original = [list(it) for it in iters]
    if states[0]["position"] == n:
        # The epoch was over: what the original yields next is its next iteration.
        rest_original = [list(s.batch_sampler()) for s in original]
    rest_restored = [list(s.batch_sampler()) for s in restored]
    assert rest_restored == rest_original
    # And the epoch after continues alike.
    for a, b in zip(original, restored):
        a.set_epoch(epoch + 1)
        b.set_epoch(epoch + 1)
    assert [list(s) for s in restored] == [list(s) for s in original]


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(1, 120),
    before=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    after=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    data=st.data(),
)
def test_restored_on_other_ranks_resplits_the_rest_of_the_epoch(n, before, after, data):
    """Stop on len(before) ranks, resume on len(after): the steps before the stop and the
    re-split rest cover the epoch exactly once (no padding needed while n - stop >= ranks)."""
    kw = dict(seed=5, verify=False)
    old = [BalancedSampler(range(n), before, r, **kw) for r in range(len(before))]
    stop = data.draw(st.integers(0, n))
    _, done = _run(old, stop, {})
    state = old[0].state_dict()
    new = [BalancedSampler(range(n), after, r, **kw) for r in range(len(after))]
    for s in new:
        s.load_state_dict(state)
    if len(after) != len(before):
        assert all(s.shares == after for s in new)
    if state["position"] == n:
        return  # the epoch was over: the next iteration is a whole epoch (the test above)
    rest = [list(s.batch_sampler()) for s in new]
    assert len({len(r) for r in rest}) == 1  # every new rank runs the same number of steps
    seen = Counter(i for step in done for piece in step for i in piece)
    seen.update(i for r in rest for step in r for i in step)
    assert set(seen) == set(range(n))
    tail = (n - state["position"]) % sum(new[0].shares)  # the saved shares on as many ranks
    if tail == 0 or tail >= len(after):  # no padding needed
        assert all(c == 1 for c in seen.values())


def test_load_state_dict_rejects_bad_state():
    s = BalancedSampler(range(10), [3, 1], 0, verify=False)
    with pytest.raises(TypeError, match="state"):
        s.load_state_dict([1, 2])
    with pytest.raises(ValueError, match="missing"):
        s.load_state_dict({"epoch": 0})
    good = s.state_dict()
    with pytest.raises(ValueError, match="num_samples_total"):
        BalancedSampler(range(11), [3, 1], 0, verify=False).load_state_dict(good)
    with pytest.raises(ValueError, match=r"state\['position'\]"):
        s.load_state_dict({**good, "position": 11})
    with pytest.raises(ValueError, match=r"state\['shares'\]\[1\]"):
        s.load_state_dict({**good, "shares": [3, 0]})


def test_epochs_and_seeds_a_sampler_cannot_restore_or_seed_are_named():
    """An epoch or seed the sampler could not read back from its own state, or seed a
    torch.Generator with, is refused where it is given (a negative epoch once made
    load_state_dict(state_dict()) raise, and 1.5 ran as epoch 1)."""
    s = BalancedSampler(range(20), [3, 1], 0, verify=False)
    for epoch in (-1, 1.5, "2", None, True, 2**62):
        with pytest.raises(ValueError, match=r"^epoch: must be an integer in \[0, 2\*\*62\)"):
            s.set_epoch(epoch)  # type: ignore[arg-type]
    assert s.epoch == 0
    s.set_epoch(2**62 - 1)
    s.load_state_dict(s.state_dict())
    assert s.epoch == 2**62 - 1 and len(list(s)) == 15  # 5 steps of its 3 samples
    with pytest.raises(ValueError, match=r"^state\['epoch'\]: must be an integer in \[0, 2"):
        s.load_state_dict({**s.state_dict(), "epoch": 2**62})
    for seed in (2**63, -(2**63) - 1, 1.0):
        with pytest.raises(ValueError, match=r"^seed: must be an integer in \[-2\*\*63, 2\*\*63\)"):
            BalancedSampler(range(20), [3, 1], 0, seed=seed, verify=False)  # type: ignore[arg-type]


def test_a_restored_position_holds_for_its_own_epoch_only():
    s = BalancedSampler(range(20), [3, 1], 0, seed=2, verify=False)
    s.set_epoch(1)
    it = iter(s.batch_sampler())
    next(it), next(it)
    state = s.state_dict()
    fresh = BalancedSampler(range(20), [3, 1], 0, seed=2, verify=False)
    fresh.load_state_dict(state)
    fresh.set_epoch(1)  # the usual loop sets the epoch it resumes: the position holds
    assert list(fresh.batch_sampler()) == list(it)
    fresh.load_state_dict(state)
    fresh.set_epoch(2)  # another epoch starts from its beginning
    whole = BalancedSampler(range(20), [3, 1], 0, seed=2, verify=False)
    whole.set_epoch(2)
    assert list(fresh.batch_sampler()) == list(whole.batch_sampler())


def test_taken_shares_are_those_of_the_step_taken_last():
    """taken_shares (what a logger reports for the step that ran) against shares (what the
    next steps are cut with): before any step, after set_shares inside an iteration, on the
    epoch's short last step (cut from the shares in force), after set_epoch and after
    load_state_dict."""
    sampler = BalancedSampler(range(29), [5, 3], 0, shuffle=False, verify=False)
    assert sampler.taken_shares() == [5, 3]
    steps = iter(sampler.batch_sampler())
    next(steps)
    sampler.set_shares([2, 6])  # no loader fetches ahead: from the next step
    assert sampler.taken_shares() == [5, 3] and sampler.shares == [2, 6]
    assert len(next(steps)) == 2 and sampler.taken_shares() == [2, 6]
    rest = list(steps)  # steps 3 and 4: the last holds 29 - 24 = 5 samples, cut 1 : 4
    assert [len(s) for s in rest] == [2, 1] and sampler.taken_shares() == [2, 6]
    state = sampler.state_dict()
    sampler.set_epoch(1)  # a new epoch: nothing of it taken
    assert sampler.taken_shares() == [2, 6]
    sampler.set_shares([4, 4])
    assert sampler.taken_shares() == [4, 4]
    sampler.load_state_dict({**state, "position": 8})
    assert sampler.taken_shares() == [2, 6]  # the restored shares, nothing taken yet


def test_shares_as_a_dict_are_refused_not_read_by_their_keys():
    with pytest.raises(ValueError, match=r"^shares: must be a sequence of positive integers"):
        BalancedSampler(range(10), {0: 5, 1: 5}, 0, verify=False)  # type: ignore[arg-type]
