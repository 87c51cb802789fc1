"""hetcoll.split: optimal against brute force, identical to the unit greedy, valid at scale."""

from __future__ import annotations

import heapq
import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hetcoll


def finish(lat: float, speed: float, share: int) -> float:
    # The same float expression the solver documents: latency + share / speed.
    return lat + float(share) / speed


def makespan(shares, speeds, latency) -> float:
    return max(finish(a, s, b) for a, s, b in zip(latency, speeds, shares))


def brute_force(total, speeds, latency, capacity, multiple_of, minimum):
    """Smallest makespan over every feasible split, or None if there is none."""
    choices = [
        [b for b in range(0, min(cap, total) + 1) if b >= minimum and b % multiple_of == 0]
        for cap in capacity
    ]
    best = None
    for shares in itertools.product(*choices):
        if sum(shares) == total:
            m = makespan(shares, speeds, latency)
            best = m if best is None else min(best, m)
    return best


def heap_greedy(total, speeds, latency=None, capacity=None, multiple_of=1, minimum=0):
    """Hand out one unit of multiple_of at a time to the rank that finishes first after taking
    it, lowest index on ties: the rule the solver documents."""
    p = len(speeds)
    latency = latency or [0.0] * p
    lo = -(-minimum // multiple_of)
    hi = [(c // multiple_of if capacity else total // multiple_of) for c in (capacity or [0] * p)]
    units = [lo] * p
    heap = [
        (finish(latency[i], speeds[i], (lo + 1) * multiple_of), i) for i in range(p) if lo < hi[i]
    ]
    heapq.heapify(heap)
    for _ in range(total // multiple_of - lo * p):
        _, i = heapq.heappop(heap)
        units[i] += 1
        if units[i] < hi[i]:
            heapq.heappush(heap, (finish(latency[i], speeds[i], (units[i] + 1) * multiple_of), i))
    return [u * multiple_of for u in units]


speed_st = st.one_of(
    st.sampled_from([0.25, 0.5, 1.0, 2.0, 3.0]),
    st.floats(0.05, 20.0, allow_nan=False, allow_infinity=False),
)


@st.composite
def instances(draw):
    p = draw(st.integers(1, 4))
    speeds = draw(st.lists(speed_st, min_size=p, max_size=p))
    latency = draw(
        st.one_of(
            st.just([0.0] * p),
            st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.5]), min_size=p, max_size=p),
            st.lists(st.floats(0.0, 5.0), min_size=p, max_size=p),
        )
    )
    multiple_of = draw(st.sampled_from([1, 1, 2, 3]))
    minimum = draw(st.sampled_from([0, 0, 1, 2]))
    total = multiple_of * draw(st.integers(0, 12 // multiple_of))
    capacity = draw(
        st.one_of(st.just([total] * p), st.lists(st.integers(0, total + 2), min_size=p, max_size=p))
    )
    return total, speeds, latency, capacity, multiple_of, minimum


@settings(max_examples=400, deadline=None)
@given(instances())
def test_optimal_against_brute_force(inst):
    total, speeds, latency, capacity, multiple_of, minimum = inst
    best = brute_force(total, speeds, latency, capacity, multiple_of, minimum)
    kwargs = dict(latency=latency, capacity=capacity, multiple_of=multiple_of, minimum=minimum)
    if best is None:
        with pytest.raises(ValueError, match="infeasible"):
            hetcoll.split(total, speeds, **kwargs)
        return
    shares = hetcoll.split(total, speeds, **kwargs)
    assert sum(shares) == total
    for b, cap in zip(shares, capacity):
        assert minimum <= b <= cap and b % multiple_of == 0
    assert makespan(shares, speeds, latency) == best
    # Deterministic tie-breaking: exactly the documented unit greedy.
    assert shares == heap_greedy(total, speeds, **kwargs)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(0.01, 100.0), min_size=1, max_size=64),
    st.integers(0, 100_000),
)
def test_matches_greedy_on_larger_instances(speeds, total):
    assert hetcoll.split(total, speeds) == heap_greedy(total, speeds)


def test_seed_000_example_and_exactness_beyond_rounding():
    # Seed 000 split 60 filters at 70/25/5 as 42/15/3 by flooring and giving the rest to the
    # fastest; the optimum agrees here ...
    assert hetcoll.split(60, [70, 25, 5]) == [42, 15, 3]
    # ... but proportional rounding is not optimal in general: 7 units at speeds 1, 1, 1.1.
    speeds = [1.0, 1.0, 1.1]
    shares = hetcoll.split(7, speeds)
    assert makespan(shares, speeds, [0.0] * 3) == brute_force(7, speeds, [0.0] * 3, [7] * 3, 1, 0)


def test_large_instance_against_lower_bound():
    rng = random.Random(7)
    p, total = 10_000, 10**7
    speeds = [rng.uniform(0.5, 20.0) for _ in range(p)]
    latency = [rng.uniform(0.0, 0.01) for _ in range(p)]
    shares = hetcoll.split(total, speeds, latency=latency)
    assert sum(shares) == total and min(shares) >= 0
    # Continuous relaxation: the level T with sum_i max(0, (T - a_i) s_i) = total is a lower
    # bound; integers cost at most one unit on some rank above it.
    lo, hi = 0.0, max(latency) + total / min(speeds)
    for _ in range(200):
        mid = (lo + hi) / 2
        if sum(max(0.0, (mid - a) * s) for a, s in zip(latency, speeds)) < total:
            lo = mid
        else:
            hi = mid
    got = makespan(shares, speeds, latency)
    assert lo * (1 - 1e-12) <= got <= hi + max(1 / s for s in speeds)


def test_finish_times():
    assert hetcoll.finish_times([30, 10], [3.0, 1.0], latency=[0.5, 0.0]) == [10.5, 10.0]


@pytest.mark.parametrize(
    ("args", "kwargs", "argument"),
    [
        ((10, [1.0, 2.0]), {"latency": [0.0]}, "latency"),
        ((10, [1.0, 2.0]), {"capacity": [5]}, "capacity"),
        ((10, [1.0, math.nan]), {}, r"speeds\[1\]"),
        ((10, [1.0, math.inf]), {}, r"speeds\[1\]"),
        ((10, [0.0]), {}, r"speeds\[0\]"),
        ((10, [-1.0]), {}, r"speeds\[0\]"),
        ((10, []), {}, "speeds"),
        ((10, "12"), {}, "speeds"),
        ((10, 3.0), {}, "speeds"),
        ((10, [1.0, "x"]), {}, r"speeds\[1\]"),
        ((10, [1.0]), {"latency": [-0.1]}, r"latency\[0\]"),
        ((10, [1.0]), {"latency": [math.nan]}, r"latency\[0\]"),
        ((10, [1.0, 1.0]), {"capacity": [4, 5]}, "capacity"),
        ((10, [1.0, 1.0]), {"capacity": [4, -5]}, r"capacity\[1\]"),
        ((10, [1.0, 1.0]), {"multiple_of": 3}, "multiple_of"),
        ((10, [1.0, 1.0]), {"multiple_of": 0}, "multiple_of"),
        ((10, [1.0, 1.0]), {"multiple_of": -2}, "multiple_of"),
        ((10, [1.0, 1.0]), {"minimum": 6}, "minimum"),
        ((10, [1.0, 1.0]), {"minimum": 4, "capacity": [3, 10]}, r"capacity\[0\]"),
        ((-1, [1.0]), {}, "total"),
        ((10.0, [1.0]), {}, "total"),
        ((10.5, [1.0]), {}, "total"),
        (("10", [1.0]), {}, "total"),
        ((True, [1.0]), {}, "total"),
        ((None, [1.0]), {}, "total"),
    ],
)
def test_bad_input_names_the_argument(args, kwargs, argument):
    with pytest.raises(ValueError, match=f"^{argument}"):
        hetcoll.split(*args, **kwargs)


def test_numpy_inputs_are_accepted():
    np = pytest.importorskip("numpy")
    assert hetcoll.split(np.int64(100), np.array([3.0, 1.0])) == [75, 25]
