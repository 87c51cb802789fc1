"""The Rebalancer on a simulated cluster, deterministically: rank i's step takes
``a_i + c_i b_i`` seconds times ``1 + noise`` (and now and then twice that: another process took
the core). Every rank decides on the same gathered rows, so one Rebalancer fed every rank's
window summary (:meth:`Rebalancer.update`) is what each rank computes. It reaches the optimum
from a skewed start, follows a speed that changes mid-run, never starves a rank, never gives a
rank more than it can hold, and keeps the shares still under noise once balanced."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hetcoll
from hetcoll.launch import spawn
from hetcoll.torch import BalancedSampler, Rebalancer, SpeedFit
from hetcoll.torch.rebalance import window_summary


def optimum(total, a, c, capacity=None, minimum=1):
    caps = None if capacity is None else [total if x is None else x for x in capacity]
    return hetcoll.split(
        total, [1 / ci for ci in c], latency=list(a), capacity=caps, minimum=minimum
    )


def makespan(shares, a, c):
    return max(ai + ci * b for ai, ci, b in zip(a, c, shares))


def simulate(a, c, start, windows, *, every=10, noise=0.03, spikes=0.05, seed=0, at=None, **kwargs):
    """Shares after each window; ``at(w)`` may return other ``(a, c)`` from window ``w``."""
    sampler = BalancedSampler(range(10**6), start, 0, shuffle=False, verify=False)
    reb = Rebalancer(sampler, every=every, **kwargs)
    rng = np.random.default_rng(seed)
    seen = []
    for w in range(windows):
        aw, cw = at(w) if at is not None else (a, c)
        shares = list(sampler.shares)
        rows = []
        for i, b in enumerate(shares):
            times = (aw[i] + cw[i] * b) * (1 + noise * rng.standard_normal(every))
            times *= np.where(rng.random(every) < spikes, 2.0, 1.0)
            rows.append(window_summary([(b, float(t)) for t in times]))
        reb.update(np.stack(rows))
        seen.append(list(sampler.shares))
    return seen, reb


# Speeds 1 and 0.3 of 5,000 samples/s, fixed costs 2 ms and 2 / 0.3 ms.
A2, C2 = [0.002, 0.002 / 0.3], [1 / 5000, 1 / 1500]


def probe_fits(a, c, error=0.15):
    """What a probe might have said: each rank's costs off by ``error`` (fast rank slower,
    slow rank faster: the worst direction), with a covariance of that size."""
    fits = []
    for i, (ai, ci) in enumerate(zip(a, c)):
        f = 1 + error if i == 0 else 1 - error
        cov = ((error * ai) ** 2, 0.0, (error * ci) ** 2)
        fits.append(SpeedFit(ai * f, 1 / (ci * f), covariance=cov))
    return fits


@pytest.mark.parametrize("with_fits", [True, False])
def test_reaches_the_optimum_from_a_skewed_start(with_fits):
    best = optimum(256, A2, C2)
    assert best == [203, 53]
    fits = probe_fits(A2, C2) if with_fits else None
    seen, reb = simulate(A2, C2, [250, 6], 30, fits=fits, threshold=0.02)
    assert abs(seen[-1][0] - best[0]) <= 3, seen
    assert makespan(seen[-1], A2, C2) <= 1.02 * makespan(best, A2, C2)
    assert min(min(s) for s in seen) >= 6  # never below where it started
    # Settled: no change over the last 15 windows, and few changes in all.
    assert all(s == seen[-1] for s in seen[-15:]), seen
    assert sum(e.applied for e in reb.history) <= 6


def test_learns_the_fixed_costs():
    _, reb = simulate(A2, C2, [250, 6], 30, fits=None, noise=0.01, spikes=0.0, threshold=0.02)
    assert reb.fits is not None
    for fit, a, c in zip(reb.fits, A2, C2):
        assert fit.predict(203) == pytest.approx(a + 203 * c, rel=0.03) or fit.predict(
            53
        ) == pytest.approx(a + 53 * c, rel=0.03)
        assert fit.latency_s > 0  # the fixed cost is seen, not read as per-sample cost


def test_a_large_fixed_cost_does_not_starve_the_rank():
    # The case: the slow rank pays 30 ms per step whatever its share. Read as samples /
    # seconds it looks slow at a small share, and gets less. The affine model sees its
    # per-sample cost; started with no probe at 250 / 6, where one batch size cannot tell the
    # two costs apart, it moves a few samples to the idle rank to learn them (explores).
    a, c = [0.004, 0.03], [1 / 5000, 1 / 1500]
    best = optimum(256, a, c)
    assert best == [227, 29]
    for start, fits in (([128, 128], None), ([250, 6], None), ([250, 6], probe_fits(a, c))):
        seen, reb = simulate(a, c, start, 40, fits=fits, threshold=0.02)
        assert makespan(seen[-1], a, c) <= 1.03 * makespan(best, a, c), (start, seen[-1])
        assert min(s[1] for s in seen) >= min(best[1], start[1]) - 3, (start, seen)
        explored = sum(e.explored for e in reb.history)
        assert (explored > 0) == (start == [250, 6] and fits is None)


def test_follows_a_speed_that_changes_mid_run():
    # At window 15 the ranks swap speeds (the fast one throttled, the slow one freed).
    def at(w):
        return (A2, C2) if w < 15 else (A2[::-1], C2[::-1])

    seen, _ = simulate(A2, C2, [128, 128], 45, fits=probe_fits(A2, C2), at=at, threshold=0.02)
    before, after = optimum(256, A2, C2), optimum(256, A2[::-1], C2[::-1])
    assert abs(seen[14][0] - before[0]) <= 3
    assert abs(seen[-1][0] - after[0]) <= 3, seen
    # Within a few windows of the change, not slowly over many.
    caught_up = next(w for w in range(15, 45) if abs(seen[w][0] - after[0]) <= 10)
    assert caught_up <= 15 + 6, seen[14:]


def test_gradual_drift_is_followed():
    def at(w):
        k = 1 + 0.05 * w  # the slow rank slows down 5% more every window
        return A2, [C2[0], C2[1] * k]

    seen, _ = simulate(A2, C2, [203, 53], 40, fits=probe_fits(A2, C2, 0.0), at=at)
    final_a, final_c = at(39)
    assert makespan(seen[-1], final_a, final_c) <= 1.08 * makespan(
        optimum(256, final_a, final_c), final_a, final_c
    )


def test_respects_capacity_and_minimum():
    # The fast rank would take 203 but holds 180; rank 2 must keep 10.
    a, c = [0.002, 0.002 / 0.3, 0.004], [1 / 5000, 1 / 1500, 1 / 800]
    cap = [180, None, None]
    seen, _ = simulate(a, c, [200, 50, 6], 30, capacity=cap, minimum=10, threshold=0.02)
    assert all(s[0] <= 180 and min(s) >= 10 and sum(s) == 256 for s in seen)
    best = optimum(256, a, c, cap, 10)
    assert makespan(seen[-1], a, c) <= 1.02 * makespan(best, a, c)


def test_infeasible_start_is_fixed_at_once_and_fits_bring_capacity():
    sampler = BalancedSampler(range(1000), [250, 6], 0, verify=False)
    fits = [SpeedFit(0.0, 5000.0, capacity=200), SpeedFit(0.0, 1500.0)]
    Rebalancer(sampler, fits=fits)
    assert sampler.shares[0] <= 200 and sum(sampler.shares) == 256
    sampler = BalancedSampler(range(1000), [250, 6], 0, verify=False)
    Rebalancer(sampler, minimum=8)
    assert min(sampler.shares) >= 8 and sum(sampler.shares) == 256


def test_bad_arguments_are_named():
    sampler = BalancedSampler(range(100), [8, 8], 0, verify=False)
    for kwargs, name in [
        ({"every": 0}, "every"),
        ({"every": True}, r"^every: must be an integer >= 1, got True"),
        ({"every": 2.0}, "every"),
        ({"every": None}, r"^every: must be an integer >= 1, got None"),
        ({"smoothing": 0}, "smoothing"),
        ({"threshold": -1}, "threshold"),
        ({"drift": 1.5}, "drift"),
        ({"minimum": 9}, "minimum"),
        ({"capacity": [4, 4]}, "capacity"),
        ({"capacity": [4]}, "capacity"),
        ({"capacity": [0, 20]}, r"capacity\[0\]"),
        ({"capacity": [20, 1], "minimum": 2}, r"capacity\[1\]"),
        ({"fits": [SpeedFit(0, 1.0)]}, "fits"),
        # Of another type: they once raised TypeErrors from a comparison, naming nothing.
        ({"smoothing": None}, r"^smoothing: must be in \(0, 1\], got None"),
        ({"smoothing": "0.5"}, r"^smoothing: must be in \(0, 1\], got '0.5'"),
        ({"threshold": "0"}, r"^threshold: must be a finite number >= 0"),
        ({"threshold": float("inf")}, r"^threshold: must be a finite number >= 0"),
        ({"drift": None}, r"^drift: must be in \[0, 1\), got None"),
        ({"fits": 5}, r"^fits: needs one SpeedFit per rank \(2\), got 5"),
    ]:
        with pytest.raises(ValueError, match=name):
            Rebalancer(sampler, **kwargs)
    with pytest.raises(TypeError, match="sampler"):
        Rebalancer([8, 8])  # type: ignore[arg-type]
    assert Rebalancer(sampler, every=np.int64(3)).every == 3  # numpy integers are integers
    reb = Rebalancer(sampler)
    with pytest.raises(ValueError, match="seconds"):
        reb.observe(8, float("nan"))
    good = np.zeros((2, 8))
    good[:, :4] = [8, 0.1, 0.001, 10]
    for bad in (float("nan"), float("inf"), -1.0):
        rows = good.copy()
        rows[1, 1] = bad  # NaN reached int(), inf overflowed, a negative time was taken in
        with pytest.raises(ValueError, match=r"^rows: must be finite numbers >= 0"):
            reb.update(rows)
    assert reb.update(good) is False  # equal speeds: the shares stay
    for seconds in ("1.0", True, None, torch.tensor([1.0, 2.0])):
        with pytest.raises(ValueError, match=r"^seconds: must be a finite number"):
            reb.observe(8, seconds)
    # A 0-d tensor or array is a number (a timer's result may be one).
    assert reb.observe(8, torch.tensor(0.5)) is False and reb.observe(8, np.float64(0.5)) is False
    # At a deciding step the exchange's own failure (here: no group to exchange on) does not
    # hide the argument's error.
    one = Rebalancer(sampler, every=1)
    with pytest.raises(ValueError, match=r"^samples: must be an integer >= 0, got -1"):
        one.observe(-1, 1.0)
    with pytest.raises(ValueError, match="rows"):
        reb.update(np.zeros((3, 8)))


def observe_bad_seconds(rank, world, bad, at):
    """2 ranks of 100 samples/s at shares 8 : 8, deciding every 2 steps; rank 1 observes
    ``bad`` seconds from step ``at``. Returns the shares, speeds and Rebalancer warnings, or the
    error raised."""
    torch.set_num_threads(1)
    sampler = BalancedSampler(range(10_000), [8, 8], rank)
    reb = Rebalancer(sampler, every=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for k in range(20):
                b = sampler.shares[rank]
                reb.observe(b, bad if rank == 1 and k >= at else 0.001 + b / 100.0)
        except ValueError as e:
            return f"{type(e).__name__}: {e}"
    told = [str(w.message) for w in caught if "Rebalancer" in str(w.message)]
    return sampler.shares, reb.speeds, told


@pytest.mark.multiproc
def test_steps_timed_at_zero_seconds_are_left_out_with_a_warning():
    """0 seconds for a step's samples is no measurement: it made the rank 1e12 samples/s fast
    and cut the other to the minimum share (1 : 15), or, from the first step, kept the models
    from starting; silently. Now such steps are left out, and the rank says so once."""
    zero = "Rebalancer.observe: 0 seconds for 8 samples; such steps are left out"
    (shares0, speeds0, told0), (shares1, speeds1, told1) = spawn(
        observe_bad_seconds, 2, 0.0, 6, timeout=120
    )
    assert shares0 == shares1 == [8, 8]
    assert speeds0 == speeds1 and max(speeds0) < 200  # 100 samples/s each, as timed
    assert told0 == [] and len(told1) == 1 and told1[0].startswith(zero)
    (shares0, speeds0, told0), (shares1, speeds1, told1) = spawn(
        observe_bad_seconds, 2, 0.0, 0, timeout=120
    )
    assert shares0 == shares1 == [8, 8] and speeds0 is speeds1 is None  # no start: warned
    assert len(told1) == 1 and told1[0].startswith(zero)


@pytest.mark.multiproc
def test_bad_seconds_on_one_rank_raise_on_every_rank_at_the_exchange():
    """NaN seconds on rank 1 at a deciding step: rank 1 raises its ValueError and rank 0,
    told in the exchange, the mismatch (it failed on gloo's closed connection before)."""
    got = spawn(observe_bad_seconds, 2, float("nan"), 5, timeout=120)
    assert got == [
        "CollectiveMismatchError: Rebalancer.observe: rank 1 was given bad samples or seconds "
        "(it raised ValueError naming them)",
        "ValueError: seconds: must be a finite number >= 0, got nan",
    ]


def test_deprecated_comm_still_works():
    sampler = BalancedSampler(range(100), [8, 8], 0, verify=False)
    with pytest.warns(DeprecationWarning, match="group="):
        reb = Rebalancer(sampler, comm="a communicator")
    assert reb.group == "a communicator"


def test_window_summary_keeps_the_two_most_frequent_sizes():
    row = window_summary([(8, 0.1)] * 5 + [(3, 0.05)] + [(8, 0.5)])
    assert row[0] == 8 and row[1] == pytest.approx(0.1) and row[3] == 6  # 0.5 is an outlier
    assert row[4] == 3 and row[5] == pytest.approx(0.05) and row[7] == 1


clusters = st.integers(2, 4).flatmap(
    lambda p: st.tuples(
        st.lists(st.floats(0.0, 0.05), min_size=p, max_size=p),
        st.lists(st.floats(1e-5, 1e-2), min_size=p, max_size=p),
        st.lists(st.integers(1, 100), min_size=p, max_size=p),
        st.lists(st.none() | st.integers(1, 300), min_size=p, max_size=p),
        st.integers(1, 3),
        st.integers(0, 2**16),
    )
)


@settings(max_examples=60, deadline=None)
@given(clusters)
def test_shares_always_sum_to_the_batch_within_minimum_and_capacity(cluster):
    a, c, start, capacity, minimum, seed = cluster
    total = sum(start)
    if (
        minimum * len(start) > total
        or sum(total if x is None else x for x in capacity) < total
        or any(x is not None and x < minimum for x in capacity)
    ):
        return  # the Rebalancer rejects these (tested above)
    seen, _ = simulate(
        a, c, start, 8, capacity=capacity, minimum=minimum, seed=seed, noise=0.2, spikes=0.2
    )
    for shares in seen:
        assert sum(shares) == total
        assert all(b >= minimum for b in shares)
        assert all(x is None or b <= x for b, x in zip(shares, capacity))


def test_the_same_observations_give_the_same_decisions():
    one = simulate(A2, C2, [250, 6], 10, seed=7)[0]
    two = simulate(A2, C2, [250, 6], 10, seed=7)[0]
    assert one == two


def _windows(reb, a, c, rng, count, every=10):
    """``count`` windows of noisy step times at the sampler's shares, fed to ``reb``."""
    for _ in range(count):
        rows = []
        for i, b in enumerate(reb.sampler.shares):
            times = (a[i] + c[i] * b) * (1 + 0.03 * rng.standard_normal(every))
            rows.append(window_summary([(b, float(t)) for t in times]))
        reb.update(np.stack(rows))


def test_a_rebalancer_resumed_from_its_state_decides_as_the_saved_one():
    """Saved after 4 windows (JSON, as a checkpoint holds it) and loaded into a new
    rebalancer over a sampler at the saved shares, it takes the same next windows to the same
    models and shares as the saved one; without the state it starts from scratch and differs."""
    import json

    def made(shares):
        sampler = BalancedSampler(range(10**6), shares, 0, shuffle=False, verify=False)
        return Rebalancer(sampler, every=10)

    saved = made([250, 6])
    _windows(saved, A2, C2, np.random.default_rng(3), 4)
    state = json.loads(json.dumps(saved.state_dict()))
    assert state["step"] == 0 and len(state["models"]) == 2  # update() counts no steps
    resumed, fresh = made(list(saved.sampler.shares)), made(list(saved.sampler.shares))
    resumed.load_state_dict(state)
    assert resumed.state_dict() == saved.state_dict() and resumed.speeds == saved.speeds
    for reb in (saved, resumed, fresh):
        _windows(reb, A2, C2, np.random.default_rng(4), 3)
    assert resumed.history == saved.history[4:]
    assert resumed.state_dict() == saved.state_dict()
    assert fresh.speeds != saved.speeds
    # Saved on another number of ranks: the steps come back, the models stay this one's own.
    fits = probe_fits([*A2, A2[0]], [*C2, C2[0]])
    three = Rebalancer(BalancedSampler(range(100), [4, 4, 4], 0, verify=False), fits=fits)
    before = three.speeds
    three.load_state_dict({**state, "step": 30})
    assert three.speeds == before and three.state_dict()["step"] == 30


@pytest.mark.parametrize(
    ("state", "error", "text"),
    [
        ([], TypeError, "state: must be a dict"),
        ({"step": 1}, ValueError, r"state: missing \['models'\]"),
        ({"step": -1, "models": None}, ValueError, r"state\['step'\]: must be an integer >= 0"),
        ({"step": 0, "models": "x"}, ValueError, r"state\['models'\]: must be a list or None"),
        ({"step": 0, "models": [[1.0] * 5]}, ValueError, r"state\['models'\]\[0\]: must be 6"),
        ({"step": 0, "models": [[float("nan")] * 6]}, ValueError, r"state\['models'\]\[0\]"),
    ],
)
def test_a_bad_rebalancer_state_is_named(state, error, text):
    reb = Rebalancer(BalancedSampler(range(100), [5, 5], 0, verify=False))
    with pytest.raises(error, match=text):
        reb.load_state_dict(state)
    assert reb.state_dict() == {"step": 0, "models": None}  # unchanged


def test_a_rebalancer_carried_over_to_a_rebuilt_loaders_sampler_decides_on():
    """Rebalancer.over (a reloaded loader's sampler): the settings, capacities, models, steps
    and decisions carry over, ``every`` anew if given."""
    fits = [SpeedFit(0.0, 300.0, capacity=12), SpeedFit(0.0, 100.0)]
    first = BalancedSampler(range(100), [8, 8], 0, verify=False)
    reb = Rebalancer(first, every=2, fits=fits, threshold=0.1, minimum=2)
    reb.update(np.stack([window_summary([(12, 0.04)] * 2), window_summary([(4, 0.04)] * 2)]))
    again = BalancedSampler(range(100), list(first.shares), 0, verify=False)
    moved = reb.over(again, every=4)
    assert moved.sampler is again and moved.every == 4 and reb.over(again).every == 2
    assert (moved.capacity, moved.minimum, moved.threshold) == ([12, None], 2, 0.1)
    assert moved.state_dict() == reb.state_dict() and moved.history is reb.history
    assert moved.speeds == reb.speeds


def observe_bad_samples_once(rank, world):
    """Rank 1 observes -1 samples at step 3 (deciding every 2), catches the error and goes
    on: it decided one step after rank 0 from then on, and rank 0's last exchange waited for
    it (before)."""
    sampler = BalancedSampler(range(10_000), [8, 8], rank)
    reb = Rebalancer(sampler, every=2)
    said = None
    for k in range(12):
        b = sampler.shares[rank]
        try:
            reb.observe(-1 if rank == 1 and k == 2 else b, 0.001 + b / (100.0 * (1 + rank)))
        except ValueError as e:
            said = f"{type(e).__name__}: {e}"
    return said, sampler.shares, reb.speeds


@pytest.mark.multiproc
def test_a_bad_observation_at_a_step_that_does_not_decide_keeps_the_rank_in_step():
    (said0, shares0, speeds0), (said1, shares1, speeds1) = spawn(
        observe_bad_samples_once, 2, timeout=20
    )
    assert said0 is None and said1 == "ValueError: samples: must be an integer >= 0, got -1"
    assert shares0 == shares1 and speeds0 == speeds1 and speeds0 is not None
