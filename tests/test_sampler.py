"""BalancedSampler properties: exact coverage, equal step counts, determinism."""

from __future__ import annotations

from collections import Counter

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
