"""The speed probe: the constrained affine fit and its uncertainty, robust per-size statistics,
and measure_speed on a simulated clock (a model whose step takes ``a + c b`` seconds plus noise
and bursts of interference), so that its stability, budget and stopping rule are tested
deterministically."""

from __future__ import annotations

import math
import random
import statistics

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hetcoll
from hetcoll import launch
from hetcoll.torch import SpeedFit, gather_speeds, measure_speed
from hetcoll.torch import speed as speed_module
from hetcoll.torch.speed import fit_affine, fit_step_time, robust_quantile

# -- the fit -------------------------------------------------------------------------------------


def _cost(a, c, xs, ys, errors=None):
    w = [1.0] * len(xs) if errors is None else [1 / e**2 for e in errors]
    return sum(wi * (y - a - c * x) ** 2 for wi, x, y in zip(w, xs, ys))


def test_fit_recovers_an_exact_line_with_zero_uncertainty():
    a, c, cov = fit_affine([8, 16, 32, 64], [0.002 + 0.001 * b for b in (8, 16, 32, 64)])
    assert a == pytest.approx(0.002) and c == pytest.approx(0.001)
    assert all(abs(v) < 1e-15 for v in cov)


def test_fit_is_constrained_to_the_quadrant():
    # Falling times: no negative slope, the best flat line instead.
    a, c, _ = fit_affine([1, 2, 3], [3.0, 2.0, 1.0])
    assert (a, c) == (2.0, 0.0)
    # A line that would cross below zero at b = 0: through the origin instead.
    a, c, _ = fit_affine([10, 20, 30], [0.5, 2.0, 3.5])
    assert a == 0.0 and c > 0


points = st.lists(
    st.tuples(
        st.integers(1, 4096),
        st.floats(1e-6, 10.0, allow_nan=False),
        st.floats(1e-6, 1.0, allow_nan=False),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(points)
def test_fit_never_negative_and_optimal_among_feasible_lines(pts):
    xs, ys, errors = zip(*pts)
    a, c, (va, cac, vc) = fit_affine(xs, ys, errors)
    assert a >= 0 and c >= 0
    assert va >= 0 and vc >= 0 and cac * cac <= va * vc * (1 + 1e-9) + 1e-300
    best = _cost(a, c, xs, ys, errors)
    rng = random.Random(0)
    for _ in range(50):  # no feasible line fits better
        a2 = a * rng.uniform(0, 2) + rng.uniform(0, 1e-3)
        c2 = c * rng.uniform(0, 2) + rng.uniform(0, 1e-5)
        assert best <= _cost(a2, c2, xs, ys, errors) * (1 + 1e-9) + 1e-12


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 512), st.floats(0.0, 5.0)), min_size=1, max_size=40))
def test_fit_step_time_never_negative(observations):
    fit = fit_step_time(observations)
    assert fit.latency_s >= 0 and fit.samples_per_s > 0
    assert fit.latency_se_s >= 0 and fit.samples_per_s_se >= 0


def test_robust_quantile_rejects_outliers_and_reports_its_error():
    est, se, n = robust_quantile([1.0, 1.02, 0.98, 1.01, 0.99, 25.0])
    assert est == 1.0 and n == 5 and 0 < se < 0.02
    low, _, _ = robust_quantile([1.0, 1.1, 1.2, 1.3, 1.4], 0.25)
    assert low == pytest.approx(1.1)
    with pytest.raises(ValueError, match="values"):
        robust_quantile([])
    with pytest.raises(ValueError, match="q"):
        robust_quantile([1.0], 1.0)


def test_fit_uncertainty_covers_the_truth():
    rng = random.Random(3)
    a, c = 0.004, 0.0005
    obs = [(b, (a + c * b) * rng.gauss(1, 0.03)) for _ in range(15) for b in (8, 16, 32, 64)]
    fit = fit_step_time(obs)
    assert abs(fit.latency_s - a) < 4 * fit.latency_se_s
    assert abs(1 / fit.samples_per_s - c) < 4 * math.sqrt(fit.covariance[2])
    assert fit.predict_se(32) < 0.02 * fit.predict(32)


def test_speed_fit_keeps_its_old_constructor():
    fit = SpeedFit(0.001, 1000.0)
    assert fit.predict(10) == pytest.approx(0.011) and fit.covariance == (0.0, 0.0, 0.0)
    assert fit.seconds_per_sample == pytest.approx(1e-3)


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"latency_s": float("nan")}, "latency_s: must be a finite number"),
        ({"latency_s": -0.5}, "latency_s: must be a finite number of seconds >= 0"),
        ({"latency_s": math.inf}, "latency_s: must be a finite number"),
        ({"latency_s": "a"}, "latency_s: must be a finite number"),
        ({"latency_s": 10**400}, "latency_s: must be a finite number"),
        ({"latency_s": None}, "latency_s: must be a finite number"),
        ({"samples_per_s": -5.0}, r"samples_per_s: must be a number > 0"),
        ({"samples_per_s": 0.0}, r"samples_per_s: must be a number > 0"),
        ({"samples_per_s": float("nan")}, r"samples_per_s: must be a number > 0"),
        ({"samples_per_s": "1"}, r"samples_per_s: must be a number > 0"),
        ({"capacity": -3}, "capacity: must be None or an integer >= 0"),
        ({"capacity": 2.5}, "capacity: must be None or an integer >= 0"),
        ({"capacity": True}, "capacity: must be None or an integer >= 0"),
        ({"points": [8]}, "points: must be"),
        ({"points": [(8, "a")]}, "points: must be pairs of numbers"),
        ({"covariance": (1.0, 2.0)}, "covariance: must be three numbers"),
        ({"covariance": (1.0, 2.0, float("nan"))}, "covariance: must be three numbers"),
    ],
)
def test_speed_fit_names_a_bad_field(kwargs, text):
    with pytest.raises(ValueError, match=text):
        SpeedFit(**{"latency_s": 0.001, "samples_per_s": 1000.0, **kwargs})


def test_speed_fit_takes_what_the_fits_give():
    """An infinite speed (fit_step_time's, where time does not grow with the batch), a
    capacity of 0 (measure_speed's, where not one sample fits), ints and numpy numbers."""
    assert fit_step_time([(8, 0.01), (16, 0.01)]).samples_per_s == math.inf
    assert SpeedFit(0.0, math.inf).seconds_per_sample == 0.0
    assert SpeedFit(0, 1, capacity=0).capacity == 0
    fit = SpeedFit(0.0, 1.0, capacity=np.int64(3), points=[(8, 0.5)], covariance=[0, 0, 0])
    assert fit.capacity == 3 and type(fit.capacity) is int
    assert fit.points == ((8, 0.5),) and fit.covariance == (0, 0, 0)


def _gather_a_bad_fit(rank, world):
    """Rank 1 passes no SpeedFit: every rank raises at once; then the ranks gather again."""
    try:
        gather_speeds(None if rank == 1 else SpeedFit(0.0, 1.0))
        first = None
    except Exception as e:
        first = (type(e).__name__, str(e))
    return first, [f.samples_per_s for f in gather_speeds(SpeedFit(0.0, 10.0 * (rank + 1)))]


@pytest.mark.multiproc
def test_gather_speeds_tells_every_rank_of_a_bad_fit():
    """A collective: a bad argument on one rank reaches every rank (it hung the others)."""
    (first0, again0), (first1, again1) = launch.spawn(_gather_a_bad_fit, 2, timeout=90)
    assert first1 == ("TypeError", "fit: must be a SpeedFit, got NoneType")
    assert first0[0] == "CollectiveMismatchError" and "rank 1" in first0[1], first0
    assert "fit: must be a SpeedFit" in first0[1]
    assert again0 == again1 == [10.0, 20.0]


# -- measure_speed on a simulated clock ------------------------------------------------------------


class Clock:
    """Stands in for the ``time`` module in hetcoll.torch.speed: ``perf_counter`` is simulated
    time, which the model below advances (and counts its steps)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.steps = 0

    def __deepcopy__(self, memo):  # measure_speed copies the model: the copy keeps the clock
        return self

    def perf_counter(self) -> float:
        return self.now


class SimulatedStep(nn.Module):
    """A step of ``a + c b`` simulated seconds, each timing multiplied by ``1 + N(0, jitter)``
    and, with probability ``busy``, by a slow-down in [1.5, 3] (another process took the core)."""

    def __init__(self, clock, a, c, *, jitter=0.01, busy=0.0, seed=0) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.clock, self.a, self.c = clock, a, c
        self.jitter, self.busy = jitter, busy
        self.rng = random.Random(seed)

    def forward(self, x):
        self.clock.steps += 1
        t = (self.a + self.c * len(x)) * (1 + self.rng.gauss(0, self.jitter))
        if self.rng.random() < self.busy:
            t *= self.rng.uniform(1.5, 3.0)
        self.clock.now += max(t, 0.0)
        return x * self.w


def _probe(monkeypatch, model, **kwargs):
    monkeypatch.setattr(speed_module, "time", model.clock)
    return measure_speed(
        model,
        lambda b: (torch.ones(b, 1), torch.zeros(b, 1)),
        nn.functional.mse_loss,
        **({"batch_sizes": (16, 32, 64, 128)} | kwargs),
    )


def test_quiet_probe_recovers_the_model_and_stops_once_precise(monkeypatch):
    model = SimulatedStep(Clock(), 0.003, 0.0002, jitter=0.0)
    fit = _probe(monkeypatch, model, warmup=1, repeats=4)
    assert fit.latency_s == pytest.approx(0.003) and fit.samples_per_s == pytest.approx(5000)
    assert model.clock.steps == 4 * (1 + 4)  # warm-up, then the minimum number of rounds
    assert [b for b, _ in fit.points] == [16, 32, 64, 128]


def test_the_probe_keeps_to_its_time_budget(monkeypatch):
    model = SimulatedStep(Clock(), 0.01, 0.001, jitter=0.3, busy=0.3)
    round_s = 4 * 0.01 + 0.001 * (16 + 32 + 64 + 128)
    fit = _probe(monkeypatch, model, warmup=0, repeats=3, max_repeats=1000, time_budget=2.0)
    assert model.clock.now <= 2.0 + 1e-9  # no round started that would end past the budget
    assert model.clock.now > 2.0 - 4 * round_s  # and it used the budget while imprecise
    assert fit.samples_per_s > 0
    # The first round always runs, whatever the budget.
    model = SimulatedStep(Clock(), 0.01, 0.001)
    _probe(monkeypatch, model, warmup=0, repeats=3, time_budget=1e-6)
    assert model.clock.steps == 4


def _first_split(monkeypatch, seed, busy):
    fits = [
        _probe(
            monkeypatch,
            SimulatedStep(Clock(), 0.002 / s, 0.0002 / s, jitter=0.03, busy=busy, seed=seed + r),
            batch_sizes=(32, 64, 128, 256),
        )
        for r, s in enumerate((1.0, 0.3))
    ]
    return hetcoll.split(
        256, [f.samples_per_s for f in fits], latency=[f.latency_s for f in fits], minimum=1
    )


@pytest.mark.parametrize(("busy", "spread"), [(0.0, 0.02), (0.5, 0.03)])
def test_the_first_split_is_stable_across_runs(monkeypatch, busy, spread):
    # Speeds 1 and 0.3 (fixed costs too): the split of the true model is 203 / 53.
    best = hetcoll.split(256, [5000, 1500], latency=[0.002, 0.002 / 0.3], minimum=1)
    assert best == [203, 53]
    firsts = [_first_split(monkeypatch, 100 * seed, busy)[0] for seed in range(10)]
    assert max(firsts) - min(firsts) <= spread * 256, firsts
    assert abs(statistics.median(firsts) - best[0]) <= 2, firsts


def test_flat_step_time_warns_and_keeps_a_finite_speed(monkeypatch):
    model = SimulatedStep(Clock(), 0.01, 0.0, jitter=0.01)
    with pytest.warns(RuntimeWarning, match="does not grow measurably"):
        fit = _probe(monkeypatch, model, warmup=0)
    assert math.isfinite(fit.samples_per_s) and fit.samples_per_s > 0


@pytest.mark.filterwarnings("ignore:measure_speed:RuntimeWarning")  # a tiny model: flat times
def test_the_callers_model_is_untouched_and_bad_arguments_are_named():
    net = nn.Linear(4, 2)
    before = [p.detach().clone() for p in net.parameters()]
    fit = measure_speed(
        net,
        lambda b: (torch.randn(b, 4), torch.randn(b, 2)),
        nn.functional.mse_loss,
        batch_sizes=(2, 4),
        repeats=2,
        time_budget=2.0,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0),
    )
    assert fit.samples_per_s > 0
    assert all(torch.equal(p, q) for p, q in zip(before, net.parameters()))
    args = (net, lambda b: (torch.randn(b, 4), torch.randn(b, 2)), nn.functional.mse_loss)
    for kwargs, name in [
        ({"batch_sizes": (0, 4)}, "batch_sizes"),
        ({"repeats": 0}, "repeats"),
        ({"repeats": 5, "max_repeats": 2}, "max_repeats"),
        ({"time_budget": 0}, "time_budget"),
        ({"warmup": -1}, "warmup"),
        ({"rtol": -1}, "rtol"),
        # Sizes and counts of another type once ran truncated (2.5 as 2, True as 1).
        ({"batch_sizes": (2.5, 4)}, r"^batch_sizes\[0\]: must be an integer >= 1, got 2.5"),
        ({"batch_sizes": (True, 4)}, r"^batch_sizes\[0\]: must be an integer >= 1, got True"),
        ({"batch_sizes": "24"}, r"^batch_sizes: must be positive integers, got '24'"),
        ({"batch_sizes": ()}, r"^batch_sizes: must be positive integers, got none"),
        ({"warmup": 1.5}, r"^warmup: must be an integer >= 0, got 1.5"),
        ({"repeats": None}, r"^repeats: must be an integer >= 1, got None"),
        ({"max_repeats": "9"}, r"^max_repeats: must be an integer >= 1"),
        ({"rtol": "0.1"}, r"^rtol: must be a number >= 0"),
        ({"time_budget": float("nan")}, r"^time_budget: must be a number of seconds > 0"),
        ({"quantile": 1.0}, r"^quantile: must be in \(0, 1\), got 1.0"),
    ]:
        with pytest.raises(ValueError, match=name):
            measure_speed(*args, **kwargs)
    with pytest.raises(TypeError, match=r"^model: must be a torch.nn.Module, got NoneType"):
        measure_speed(None, *args[1:])  # type: ignore[arg-type]


def test_cpu_memory_probe_counts_what_a_step_holds():
    """On the CPU the step's memory is counted: weights, gradients, optimizer state and the
    tensors autograd saves. For this float64 MLP that is at least the input and the hidden
    activation per sample (1,200 bytes) and at most every intermediate tensor (1,768 bytes);
    the fixed part is the weights, their gradients and SGD momentum (3 x 44,480 bytes)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(100, 50), nn.ReLU(), nn.Linear(50, 10)).double()

    def batch(b):
        return torch.randn(b, 100, dtype=torch.float64), torch.randint(0, 10, (b,))

    budget, fixed = 1_000_000, 3 * 5_560 * 8
    fit = measure_speed(
        net,
        batch,
        nn.functional.cross_entropy,
        probe_memory=True,
        memory_bytes=budget,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        time_budget=1.0,
    )
    assert (budget - fixed) // 1_768 <= fit.capacity <= (budget - fixed) // 1_200
    # Twice the budget holds about twice the batch more; no budget: the host's share.
    bigger = measure_speed(
        net, batch, nn.functional.cross_entropy, probe_memory=True, memory_bytes=2 * budget,
        time_budget=1.0,
    )  # fmt: skip
    assert bigger.capacity > 2 * fit.capacity
    assert (
        measure_speed(
            net, batch, nn.functional.cross_entropy, probe_memory=True, time_budget=0.5
        ).capacity
        > 1_000_000
    )
    assert measure_speed(net, batch, nn.functional.cross_entropy, time_budget=0.5).capacity is None
    with pytest.raises(ValueError, match="memory_bytes"):
        measure_speed(net, batch, nn.functional.cross_entropy, memory_bytes=0)


def test_host_memory_is_shared_among_the_nodes_ranks(monkeypatch):
    from hetcoll.torch.speed import host_memory_per_rank

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("MPI_LOCALNRANKS", raising=False)
    monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_SIZE", raising=False)
    alone = host_memory_per_rank()
    monkeypatch.setenv("MPI_LOCALNRANKS", "4")
    assert 0 < host_memory_per_rank() <= alone // 4 * 1.5  # available memory moves a little


def test_a_fit_predicts_only_at_a_batch_it_can_run():
    fit = SpeedFit(0.001, 100.0)
    assert fit.predict(4) == pytest.approx(0.041) and fit.predict(np.int64(4)) == fit.predict(4)
    for bad in (-5, float("nan"), float("inf"), "3", None, True):
        for predict in (fit.predict, fit.predict_se):
            with pytest.raises(ValueError, match=r"^batch_size: must be a finite number >= 0"):
                predict(bad)  # type: ignore[arg-type]
