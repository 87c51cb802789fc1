"""Measure how fast this rank trains, robustly: time the training step at a few batch sizes and
fit ``t(b) = a + c b`` (``a = latency_s``, the fixed cost of a step; ``c = 1 / samples_per_s``).

What keeps the estimate steady on a noisy, shared host:

- **rounds**: each round times every batch size once, ascending in odd rounds and descending in
  even ones, so a load that comes and goes during the probe shifts all sizes alike instead of
  tilting the slope;
- **robust statistics per size** (:func:`robust_quantile`): timings further than
  :data:`OUTLIER_SIGMAS` robust standard deviations (1.4826 times the median absolute deviation)
  from the median are rejected; the size's time is the lower quartile of the rest (the median
  of the faster half, :data:`PROBE_QUANTILE`), with its standard error from their spread.
  Interference from other processes only ever adds time, so the faster half is where the
  device's own speed shows: on a quiet host it is within the jitter of the median, on a busy
  one it moves less than the median from run to run (``tests/test_speed.py`` simulates it,
  ``benches/probe_spread.py`` measures the first split it gives);
- **a constrained fit** (:func:`fit_affine`): weighted least squares of ``a + c b`` on those
  times, with ``a, c >= 0`` (the best feasible of the unconstrained solution, ``a = 0`` and
  ``c = 0``), and the covariance of ``(a, c)``; a fit whose scatter exceeds the times' own
  errors has its covariance scaled up by it;
- **a bounded probe**: rounds go on until the time of every size is known to ``rtol``
  (relative standard error), after at least ``repeats`` rounds and at most ``max_repeats``, and
  no round starts that would end past ``time_budget`` seconds (the first always runs).

:class:`SpeedFit` carries the fit, its covariance and the points; :class:`hetcoll.torch.Rebalancer`
starts from it and keeps updating the same model from the step times it observes.
"""

from __future__ import annotations

import copy
import math
import numbers
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, overload

import torch
from torch import nn

from hetcoll.comm import agree, wrap_or_raise

#: Timings further than this many robust standard deviations from their median are outliers.
OUTLIER_SIGMAS = 3.0
#: 1.4826 * MAD estimates a normal distribution's standard deviation.
_MAD_TO_SIGMA = 1.4826
#: The quantile of each batch size's timings that :func:`measure_speed` fits (see above).
PROBE_QUANTILE = 0.25
#: The smallest relative error a median is credited with (timer resolution, clock jitter): no
#: size gets an infinite weight because its few timings happened to agree.
REL_ERROR_FLOOR = 1e-3
#: ... and the smallest absolute one, in seconds (the order of perf_counter's resolution).
ABS_ERROR_FLOOR = 1e-7


@dataclass(frozen=True)
class SpeedFit:
    """``t(b) = latency_s + b / samples_per_s`` seconds per step at batch size ``b``.

    ``capacity`` is the largest batch that fits in device memory when it was probed (else None).
    ``points`` are the measured ``(batch_size, median_seconds)`` pairs. ``covariance`` is that of
    ``(latency_s, seconds_per_sample)`` as ``(var_a, cov_ac, var_c)`` (zeros: unknown).

    Checked when made: ``latency_s`` a finite number >= 0, ``samples_per_s`` a number > 0
    (infinite where the step time does not grow with the batch, as :func:`fit_step_time`
    gives), ``capacity`` None or an integer >= 0 (0: not even one sample fits), ``points``
    pairs of numbers and ``covariance`` three numbers, not NaN; else ``ValueError`` naming
    the field.
    """

    latency_s: float
    samples_per_s: float
    capacity: int | None = None
    points: tuple[tuple[int, float], ...] = field(default=())
    covariance: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def __post_init__(self) -> None:
        a, s = self.latency_s, self.samples_per_s
        if not _is_number(a) or not (_is_finite(a) and a >= 0):
            raise ValueError(f"latency_s: must be a finite number of seconds >= 0, got {a!r}")
        if not _is_number(s) or not s > 0:
            raise ValueError(f"samples_per_s: must be a number > 0 (inf allowed), got {s!r}")
        cap = self.capacity
        if cap is not None and (
            isinstance(cap, bool) or not isinstance(cap, numbers.Integral) or cap < 0
        ):
            raise ValueError(f"capacity: must be None or an integer >= 0, got {cap!r}")
        try:
            points = tuple((b, t) for b, t in self.points)
        except (TypeError, ValueError):
            raise ValueError(
                f"points: must be (batch_size, seconds) pairs, got {self.points!r}"
            ) from None
        if not all(_is_number(b) and _is_number(t) for b, t in points):
            raise ValueError(f"points: must be pairs of numbers, got {self.points!r}")
        cov = self.covariance
        if (
            isinstance(cov, (str, bytes))
            or not isinstance(cov, Sequence)
            or len(cov) != 3
            or not all(_is_number(v) for v in cov)
        ):
            raise ValueError(
                f"covariance: must be three numbers (var_a, cov_ac, var_c), got {cov!r}"
            )
        if cap is not None:
            object.__setattr__(self, "capacity", int(cap))
        object.__setattr__(self, "points", points)
        object.__setattr__(self, "covariance", tuple(cov))

    @property
    def seconds_per_sample(self) -> float:
        """``c`` of ``t(b) = a + c b``."""
        return 1.0 / self.samples_per_s if self.samples_per_s > 0 else math.inf

    @property
    def latency_se_s(self) -> float:
        """Standard error of ``latency_s``."""
        return math.sqrt(max(self.covariance[0], 0.0))

    @property
    def samples_per_s_se(self) -> float:
        """Standard error of ``samples_per_s`` (first order: ``se(c) / c**2``)."""
        s = self.samples_per_s
        return math.sqrt(max(self.covariance[2], 0.0)) * s * s if math.isfinite(s) else math.inf

    def predict(self, batch_size: int) -> float:
        """Predicted seconds per step at ``batch_size``."""
        return self.latency_s + _batch(batch_size) / self.samples_per_s

    def predict_se(self, batch_size: int) -> float:
        """Standard error of :meth:`predict` at ``batch_size``."""
        va, cac, vc = self.covariance
        b = float(_batch(batch_size))
        return math.sqrt(max(va + 2 * b * cac + b * b * vc, 0.0))


def _batch(batch_size: object) -> float:
    """``batch_size``, a finite number >= 0 (a prediction at -5 samples was a negative time);
    ``ValueError`` naming it otherwise."""
    if not _is_number(batch_size) or not 0 <= batch_size < math.inf:  # type: ignore[operator]
        raise ValueError(f"batch_size: must be a finite number >= 0, got {batch_size!r}")
    return batch_size  # type: ignore[return-value]


def _is_number(x: object) -> bool:
    """Whether ``x`` is a real number (not a bool, nor NaN)."""
    return not isinstance(x, bool) and isinstance(x, numbers.Real) and x == x  # NaN != NaN


def _is_finite(x: float) -> bool:
    """Whether the number ``x`` is finite (an int too large for a float is not)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def robust_quantile(values: Sequence[float], q: float = 0.5) -> tuple[float, float, int]:
    """``(estimate, its standard error, count kept)``: the ``q``-quantile of ``values`` (the
    median by default) after rejecting those further than :data:`OUTLIER_SIGMAS` robust standard
    deviations from the median. The error is the normal approximation
    ``sqrt(q (1 - q)) / pdf(z_q) * sigma / sqrt(n)`` (``sqrt(pi / 2) sigma / sqrt(n)`` for the
    median), ``sigma`` from the kept values' median absolute deviation and at least
    :data:`REL_ERROR_FLOOR` of the estimate (and :data:`ABS_ERROR_FLOOR`).

    >>> robust_quantile([1.0, 1.1, 0.9, 1.0, 9.0])[0]  # 9.0 is rejected
    1.0
    """
    if not 0.0 < q < 1.0:
        raise ValueError(f"q: must be in (0, 1), got {q!r}")
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("values: must not be empty")
    med = statistics.median(xs)
    sigma = _MAD_TO_SIGMA * statistics.median(abs(x - med) for x in xs)
    kept = sorted(x for x in xs if abs(x - med) <= OUTLIER_SIGMAS * sigma) if sigma > 0 else xs
    n = len(kept)
    if q == 0.5:
        est = statistics.median(kept)
    else:  # linear interpolation between order statistics (numpy's default)
        kept = sorted(kept)
        pos = q * (n - 1)
        lo = int(pos)
        hi = min(lo + 1, n - 1)
        est = kept[lo] + (pos - lo) * (kept[hi] - kept[lo])
    mid = statistics.median(kept)
    sigma = max(_MAD_TO_SIGMA * statistics.median(abs(x - mid) for x in kept), 0.0)
    sigma = max(sigma, REL_ERROR_FLOOR * abs(est), ABS_ERROR_FLOOR)
    normal = statistics.NormalDist()
    factor = math.sqrt(q * (1 - q)) / normal.pdf(normal.inv_cdf(q))
    return est, factor * sigma / math.sqrt(n), n


def fit_affine(
    xs: Sequence[float], ys: Sequence[float], errors: Sequence[float] | None = None
) -> tuple[float, float, tuple[float, float, float]]:
    """Weighted least squares ``y = a + c x`` with ``a, c >= 0``: ``(a, c, (var_a, cov_ac,
    var_c))``. ``errors`` are the standard errors of ``ys`` (None: all equal, estimated from the
    scatter); the covariance is scaled by the reduced chi-square when that exceeds 1.

    The constrained optimum of a convex quadratic on the quadrant is the unconstrained one when
    it is feasible, else the best of the optima on the two edges ``a = 0`` and ``c = 0``.
    """
    n = len(xs)
    if n == 0 or len(ys) != n or (errors is not None and len(errors) != n):
        raise ValueError("xs, ys, errors: must be non-empty and of one length")
    x = [float(v) for v in xs]
    y = [float(v) for v in ys]
    if errors is None:
        w = [1.0] * n
        known = False
    else:
        if not all(float(e) > 0 for e in errors):
            raise ValueError(f"errors: must be > 0, got {list(errors)}")
        w = [1.0 / float(e) ** 2 for e in errors]
        known = True
    sw = sum(w)
    sx = sum(wi * xi for wi, xi in zip(w, x))
    sy = sum(wi * yi for wi, yi in zip(w, y))
    sxx = sum(wi * xi * xi for wi, xi in zip(w, x))
    sxy = sum(wi * xi * yi for wi, xi, yi in zip(w, x, y))
    det = sw * sxx - sx * sx

    def cost(a: float, c: float) -> float:
        return sum(wi * (yi - a - c * xi) ** 2 for wi, xi, yi in zip(w, x, y))

    candidates: list[tuple[float, float]] = []
    if det > 1e-12 * sw * sxx:
        a = (sxx * sy - sx * sxy) / det
        c = (sw * sxy - sx * sy) / det
        if a >= 0 and c >= 0:
            candidates.append((a, c))
    if not candidates:
        if sxx > 0:
            candidates.append((0.0, max(sxy / sxx, 0.0)))
        candidates.append((max(sy / sw, 0.0), 0.0))
    a, c = min(candidates, key=lambda ac: cost(*ac))
    # Covariance of the unconstrained estimator (the constrained one is no less certain), scaled
    # by the residual scatter when the given errors understate it (or when none were given).
    dof = n - 2
    chi2 = cost(a, c)
    reduced = chi2 / dof if dof > 0 else float(known)
    scale = max(1.0, reduced) if known else reduced
    if det > 1e-12 * sw * sxx:
        cov = (scale * sxx / det, -scale * sx / det, scale * sw / det)
    else:  # one distinct x: only the level is known
        cov = (scale / sw, 0.0, 0.0)
    return a, c, cov


def fit_step_time(observations: Iterable[tuple[int, float]], quantile: float = 0.5) -> SpeedFit:
    """The :class:`SpeedFit` of raw ``(batch_size, seconds)`` timings: per batch size the
    :func:`robust_quantile` (the median by default), then :func:`fit_affine` weighted by their
    errors.

    ``samples_per_s`` is infinite when the fitted per-sample cost is 0 (time does not grow with
    the batch over the sizes given).

    >>> fit = fit_step_time([(8, 0.010), (8, 0.011), (32, 0.025), (32, 0.026), (32, 0.4)])
    >>> round(fit.latency_s, 4), round(fit.samples_per_s), len(fit.points)  # 0.4 s rejected
    (0.0055, 1600, 2)
    """
    by_size: dict[int, list[float]] = {}
    for b, t in observations:
        if isinstance(b, bool) or not hasattr(b, "__index__") or int(b) < 1:
            raise ValueError(f"observations: batch sizes must be positive integers, got {b!r}")
        if not math.isfinite(t) or t < 0:
            raise ValueError(f"observations: seconds must be finite and >= 0, got {t!r}")
        by_size.setdefault(int(b), []).append(float(t))
    if not by_size:
        raise ValueError("observations: must not be empty")
    sizes = sorted(by_size)
    stats = [robust_quantile(by_size[b], quantile) for b in sizes]
    a, c, cov = fit_affine(sizes, [m for m, _, _ in stats], [se for _, se, _ in stats])
    return SpeedFit(
        latency_s=a,
        samples_per_s=1.0 / c if c > 0 else math.inf,
        points=tuple((b, m) for b, (m, _, _) in zip(sizes, stats)),
        covariance=cov,
    )


def measure_speed(
    model: nn.Module,
    make_batch: Callable[[int], tuple[Any, Any]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    batch_sizes: Sequence[int] = (8, 16, 32, 64),
    warmup: int = 2,
    repeats: int = 5,
    max_repeats: int = 30,
    rtol: float = 0.01,
    time_budget: float | None = 10.0,
    quantile: float = PROBE_QUANTILE,
    probe_memory: bool = False,
    memory_bytes: int | None = None,
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
) -> SpeedFit:
    """Time the training step of a copy of ``model`` (the caller's weights are untouched) on
    ``make_batch(b)`` for each ``b`` in ``batch_sizes`` and fit ``t(b) = a + c b`` robustly
    (see the module docstring). No communication: each rank probes itself, then
    :func:`gather_speeds` exchanges the fits.

    ``warmup`` untimed steps per size come first; then rounds of one timed step per size, at
    least ``repeats`` and at most ``max_repeats`` of them, until the step time of every size
    (the ``quantile`` of its timings, :data:`PROBE_QUANTILE`) has a relative standard error of
    at most ``rtol``. ``time_budget`` (seconds, None: no
    limit) bounds the whole probe: no round starts that would end past it, except the first.
    Use sizes that span the batches the rank will run (e.g. up to the global batch): the fit is
    an interpolation there. A rank far slower than its peers (a CPU rank beside a GPU) may be
    given a few rows a step, where its fixed cost is most of the step: include 1 and a few small
    sizes, or that cost, small beside a large batch's time, may read 0.

    ``optimizer``, a factory such as ``lambda ps: torch.optim.SGD(ps, lr=0.1)``, adds the
    optimizer step to each timed step (on the copy's parameters), so the fit is the whole training
    step.

    ``probe_memory`` fits the step's memory against batch size, ``m(b) = m0 + m1 b``, and
    reports the largest batch that fits in ``memory_bytes`` as ``capacity``. On CUDA the memory
    is the allocator's peak and ``memory_bytes`` defaults to the device's free memory plus what
    the probe holds. On the CPU it is counted, not sampled (the CPU allocator keeps no peak):
    parameters, their gradients and the optimizer's state, plus every tensor autograd saves for
    the backward (the activations, the input batch included; each storage once) — what a
    training step holds at its peak, less transient buffers; ``memory_bytes`` defaults to the
    host's available memory (``MemAvailable``) shared among the node's ranks
    (:func:`host_memory_per_rank`).

    When the step time does not grow measurably over ``batch_sizes`` (the fitted per-sample cost
    is 0), a ``RuntimeWarning`` says so and the per-sample cost is taken as its standard error,
    an upper estimate, so the speed stays finite.

    >>> fit = measure_speed(net, lambda b: (torch.randn(b, 4), torch.randn(b, 2)),
    ...                     nn.functional.mse_loss)  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(batch_sizes, (str, bytes)) or not isinstance(batch_sizes, Sequence):
        raise ValueError(f"batch_sizes: must be positive integers, got {batch_sizes!r}")
    sizes = [_whole(b, f"batch_sizes[{i}]", 1) for i, b in enumerate(batch_sizes)]  # 2.5 ran as 2
    if not sizes:
        raise ValueError("batch_sizes: must be positive integers, got none")
    _whole(warmup, "warmup", 0)
    _whole(repeats, "repeats", 1)
    _whole(max_repeats, "max_repeats", 1)
    if max_repeats < repeats:
        raise ValueError(f"max_repeats: must be >= repeats ({repeats}), got {max_repeats!r}")
    if isinstance(rtol, bool) or not isinstance(rtol, (int, float)) or not rtol >= 0:
        raise ValueError(f"rtol: must be a number >= 0, got {rtol!r}")
    if time_budget is not None and (
        isinstance(time_budget, bool)
        or not isinstance(time_budget, (int, float))
        or not time_budget > 0
    ):
        raise ValueError(f"time_budget: must be a number of seconds > 0 or None, got {time_budget}")
    if isinstance(quantile, bool) or not isinstance(quantile, (int, float)) or not 0 < quantile < 1:
        raise ValueError(f"quantile: must be in (0, 1), got {quantile!r}")
    if optimizer is not None and not callable(optimizer):
        raise TypeError(f"optimizer: must be a callable taking parameters, got {optimizer!r}")
    start = time.perf_counter()
    m = copy.deepcopy(model)
    m.train()
    opt = optimizer(m.parameters()) if optimizer is not None else None
    cuda = next((p.is_cuda for p in m.parameters()), False)
    if memory_bytes is not None and (
        isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int) or memory_bytes < 1
    ):
        raise ValueError(f"memory_bytes: must be a positive integer or None, got {memory_bytes!r}")
    batches = {b: make_batch(b) for b in sizes}
    mem_points: list[tuple[int, float]] = []

    def step(b: int) -> float:
        x, y = batches[b]
        m.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss_fn(m(x), y).backward()
        if opt is not None:
            opt.step()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for b in sizes:
        if cuda and probe_memory:
            torch.cuda.reset_peak_memory_stats()
        for _ in range(warmup):
            step(b)
        if cuda and probe_memory:
            if warmup == 0:
                step(b)
            mem_points.append((b, float(torch.cuda.max_memory_allocated())))
        elif probe_memory:
            mem_points.append((b, _counted_step_bytes(m, opt, batches[b], loss_fn)))
    timings: list[tuple[int, float]] = []
    rounds = 0
    while rounds < max_repeats:
        round_start = time.perf_counter()
        order = sizes if rounds % 2 == 0 else sizes[::-1]
        timings.extend((b, step(b)) for b in order)
        rounds += 1
        now = time.perf_counter()
        if rounds >= repeats and _precise(timings, rtol, quantile):
            break
        if time_budget is not None and now + (now - round_start) > start + time_budget:
            break
    fit = fit_step_time(timings, quantile)
    if not math.isfinite(fit.samples_per_s):
        c = math.sqrt(max(fit.covariance[2], 0.0)) or max(t for _, t in fit.points) / max(sizes)
        warnings.warn(
            f"measure_speed: the step time does not grow measurably between batch sizes "
            f"{min(sizes)} and {max(sizes)}; probe larger batch sizes (the per-sample cost is "
            f"taken as its standard error, {c:.3g} s)",
            RuntimeWarning,
            stacklevel=2,
        )
        fit = SpeedFit(fit.latency_s, 1.0 / c, None, fit.points, fit.covariance)
    capacity = None
    if len(mem_points) >= 2:
        m0, m1, _ = fit_affine([b for b, _ in mem_points], [v for _, v in mem_points])
        if memory_bytes is not None:
            budget = float(memory_bytes)
        elif cuda:
            budget = torch.cuda.mem_get_info()[0] + mem_points[-1][1]
        else:
            budget = float(host_memory_per_rank())
        capacity = max(0, int((budget - m0) / m1)) if m1 > 0 else None
    return SpeedFit(fit.latency_s, fit.samples_per_s, capacity, fit.points, fit.covariance)


def _counted_step_bytes(
    m: nn.Module,
    opt: torch.optim.Optimizer | None,
    batch: tuple[Any, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
) -> float:
    """Bytes one training step holds on the CPU at its peak, counted: the parameters, their
    gradients and the optimizer's state, and each storage autograd saves for the backward."""
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    x, y = batch
    m.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(m(x), y)
    loss.backward()
    if opt is not None:
        opt.step()
    state = 0
    if opt is not None:
        for per_param in opt.state.values():
            state += sum(v.nbytes for v in per_param.values() if isinstance(v, torch.Tensor))
    weights = sum(2 * p.nbytes for p in m.parameters() if p.requires_grad)  # and the gradients
    return float(weights + state + sum(saved.values()))


def host_memory_per_rank() -> int:
    """This host's available memory (``MemAvailable`` in /proc/meminfo, else the physical
    memory) divided by the ranks on this node: ``LOCAL_WORLD_SIZE`` under torchrun,
    ``MPI_LOCALNRANKS`` (MPICH) or ``OMPI_COMM_WORLD_LOCAL_SIZE`` (Open MPI) under mpiexec,
    else 1."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    local = 1
    for name in ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            local = int(value)
            break
    return available // local


def _whole(value: object, name: str, minimum: int) -> int:
    """``value``, an integer >= ``minimum`` (a bool or a float is none); ``ValueError`` naming
    ``name`` otherwise."""
    if isinstance(value, bool) or not hasattr(value, "__index__") or value.__index__() < minimum:
        raise ValueError(f"{name}: must be an integer >= {minimum}, got {value!r}")
    return int(value.__index__())


def _precise(timings: Sequence[tuple[int, float]], rtol: float, quantile: float) -> bool:
    """Whether every batch size's step time is known to ``rtol`` (relative standard error).
    The fit's own scatter is not asked: more rounds cannot make a step time more affine."""
    by_size: dict[int, list[float]] = {}
    for b, t in timings:
        by_size.setdefault(b, []).append(t)
    for ts in by_size.values():
        med, se, _ = robust_quantile(ts, quantile)
        if se > rtol * med:
            return False
    return True


def check_share_source(
    shares: object, speeds: object, measure: object, measure_budget: object
) -> None:
    """The rule every balanced front end (Lightning's strategy, Hugging Face's trainer) applies
    to where its shares come from: at most one of ``shares``, ``speeds`` and ``measure=True``,
    and a measuring budget of seconds > 0. Raises naming the argument."""
    given = [n for n, v in (("shares", shares), ("speeds", speeds)) if v is not None]
    if not isinstance(measure, bool):
        raise TypeError(f"measure: must be True or False, got {measure!r}")
    if measure:
        given.append("measure")
    if len(given) > 1:
        raise ValueError(f"{given[1]}: give at most one of shares, speeds, measure=True")
    if isinstance(measure_budget, bool) or not (
        isinstance(measure_budget, (int, float)) and measure_budget > 0
    ):
        raise ValueError(f"measure_budget: must be a number of seconds > 0, got {measure_budget!r}")


@overload
def every_argument(value: Any, name: str, *, optional: Literal[False]) -> int: ...
@overload
def every_argument(value: Any, name: str, *, optional: bool = True) -> int | None: ...
def every_argument(value: Any, name: str, *, optional: bool = True) -> int | None:
    """A rebalancing cadence (``rebalance_every``, a rebalancer's ``every``): an integer >= 1
    (numpy's too), or None where ``optional``; ``ValueError`` naming ``name`` otherwise."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        also = " or None" if optional else ""
        raise ValueError(f"{name}: must be an integer >= 1{also}, got {value!r}")
    return int(value)


def gather_speeds(fit: SpeedFit, group: Any = None) -> list[SpeedFit]:
    """Every rank's :class:`SpeedFit`, in rank order (a collective: call it on every rank).

    ``group``: an mpi4py communicator or a torch.distributed process group; None is
    :func:`hetcoll.comm.wrap`'s default (torch's default group, else ``MPI.COMM_WORLD`` under
    mpiexec).

    A rank whose ``fit`` is no :class:`SpeedFit` raises ``TypeError`` naming it, after telling
    the others, which raise :class:`hetcoll.CollectiveMismatchError` naming that rank (none
    waits for it).

    >>> fits = gather_speeds(measure_speed(model, make_batch, loss_fn))  # doctest: +SKIP
    """
    failure = None
    if not isinstance(fit, SpeedFit):
        failure = TypeError(f"fit: must be a SpeedFit, got {type(fit).__name__}")
    c = wrap_or_raise(group, failure)
    agree(c, {}, failure=failure)
    if c.engine == "mpi":
        return list(c.native.allgather(fit))
    import torch.distributed as dist

    out: list[Any] = [None] * c.size
    dist.all_gather_object(out, fit, group=c.native)
    return out
