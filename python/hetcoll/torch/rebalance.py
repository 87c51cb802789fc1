"""Rebalancer: keep the split right while the workers' speeds drift.

Each rank's step time is modelled as the probe models it, ``t_r(b) = a_r + c_r b`` (a fixed
cost and a per-sample cost, both >= 0). Every ``every`` steps the ranks exchange a robust
summary of the steps they just ran (per batch size: the median seconds, its standard error and
the count; one small all-gather over a torch.distributed group or an mpi4py communicator) and
every rank updates every rank's model the same way, with a Kalman filter on ``(a_r, c_r)``:

- a window's median at batch size ``b`` is one observation of ``a_r + c_r b``;
- between windows the model may drift: mostly all of it at once (a device slowing down or
  speeding up scales both costs), a little in shape; that is the process noise (``drift``);
- a window far outside what the model expects (beyond three standard deviations) widens the
  model's uncertainty to match, so a sudden change is followed within a few windows;
- ``smoothing`` caps the share of a window's surprise the model takes in (it dampens).

The fixed cost is what keeps a rank with a small share from looking slow: its step time hardly
falls with its share, so its per-sample cost stays low and it is not starved. The start is the
probe's :class:`~hetcoll.torch.SpeedFit` of every rank (``fits``, with its covariance) or,
without it, the first window's times read as all per-sample cost, the fixed cost then learnt
as the shares move.

Then :func:`hetcoll.split` (exact) re-solves the shares from the models, within each rank's
``capacity`` (the largest batch it can hold: given, or the probe's) and at least ``minimum``
each, and the sampler switches to them when the predicted step improves by more than
``threshold``, so that noise does not make the shares thrash. Every rank reaches the same
decision, because it decides on the same gathered data.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import hetcoll
from hetcoll.comm import NOT_GIVEN, Communicator, group_argument, wrap
from hetcoll.errors import CollectiveMismatchError
from hetcoll.torch.sampler import BalancedSampler
from hetcoll.torch.speed import SpeedFit, every_argument, robust_quantile

#: A window's median counts as no more precise than this relative error per step (steps vary
#: more from window to window than within one).
STEP_NOISE = 0.02
#: Surprises beyond this many standard deviations (squared) widen the model's uncertainty.
CHANGE_CHI2 = 9.0
#: A rank whose per-sample cost has a larger relative standard error than this, and that idles,
#: gets a few more samples to learn it from (:meth:`Rebalancer._explore`).
EXPLORE_ABOVE = 0.25
#: Batch-size groups per rank in a window's summary (the share, and e.g. an epoch's last step).
GROUPS = 2
_FIELDS = 4 * GROUPS
#: The least per-sample cost a model keeps (seconds): a finite speed for :func:`hetcoll.split`.
C_MIN = 1e-12  # (batch size, median seconds, its standard error, steps) per group


@dataclass(frozen=True)
class RebalanceEvent:
    """One decision: the step, each rank's model (``speeds`` in samples/s, ``latencies`` in
    seconds), old and new shares, and the predicted step seconds before and after.
    ``explored``: a small move made to learn an idle rank's per-sample cost (the model alone
    predicted no gain)."""

    step: int
    speeds: tuple[float, ...]
    old_shares: tuple[int, ...]
    new_shares: tuple[int, ...]
    predicted_old_s: float
    predicted_new_s: float
    applied: bool
    latencies: tuple[float, ...] = ()
    explored: bool = False


def window_summary(steps: Sequence[tuple[int, float]]) -> np.ndarray:
    """A window's ``(samples, seconds)`` steps as the fixed-size row the ranks exchange: for the
    :data:`GROUPS` most frequent batch sizes, ``(batch size, median seconds, its standard error,
    steps)``; zeros where there are fewer sizes."""
    by_size: dict[int, list[float]] = {}
    for b, t in steps:
        if b > 0:
            by_size.setdefault(int(b), []).append(float(t))
    row = np.zeros(_FIELDS, np.float64)
    sizes = sorted(by_size, key=lambda b: (-len(by_size[b]), -b))[:GROUPS]
    for g, b in enumerate(sizes):
        med, se, n = robust_quantile(by_size[b])
        row[4 * g : 4 * g + 4] = (b, med, se, n)
    return row


class _Model:
    """One rank's ``t(b) = a + c b`` with the covariance ``P`` of ``(a, c)``."""

    def __init__(self, theta: np.ndarray, cov: np.ndarray) -> None:
        self.theta = theta
        self.cov = cov

    @classmethod
    def from_fit(cls, fit: SpeedFit, drift: float) -> _Model:
        theta = np.array([fit.latency_s, 1.0 / fit.samples_per_s])
        va, cac, vc = fit.covariance
        probe = np.array([[va, cac], [cac, vc]])
        # The probe timed the model alone; training adds data loading, hooks and other ranks:
        # its level is known to a few ``drift`` at best.
        return cls(theta, probe + (2 * drift) ** 2 * np.outer(theta, theta))

    @classmethod
    def from_window(cls, b: int, t: float, drift: float) -> _Model:
        # All per-sample cost, and as uncertain as "anywhere between that and all fixed cost".
        theta = np.array([0.0, t / b])
        split = np.array([t, -t / b])
        return cls(theta, 0.25 * np.outer(split, split) + drift**2 * np.outer(theta, theta))

    def predict(self, b: float) -> float:
        return float(self.theta[0] + self.theta[1] * b)

    def drift(self, drift: float, b: float) -> None:
        """Process noise of one window: mostly a common scale of ``a`` and ``c``, a little of
        each on its own (scaled so neither is stuck at 0)."""
        a, c = self.theta
        t = max(a + c * b, 1e-12)
        scale = np.array([max(a, 0.05 * t), max(c, 0.05 * t / max(b, 1.0))])
        self.cov = self.cov + drift**2 * (
            np.outer(self.theta, self.theta) + 0.25 * np.diag(scale**2)
        )

    def update(self, b: float, t: float, var: float, smoothing: float) -> None:
        h = np.array([1.0, b])
        ph = self.cov @ h
        s = float(h @ ph) + var
        nu = t - self.predict(b)
        level = float(h @ self.theta)
        if nu * nu > CHANGE_CHI2 * s and level > 0:
            # A change, not noise: the likeliest is the whole device getting slower or faster,
            # so widen the model along a common scale of a and c, enough to explain it.
            self.cov = self.cov + (nu * nu - s) / level**2 * np.outer(self.theta, self.theta)
            ph = self.cov @ h
            s = float(h @ ph) + var
        gain = ph / s
        taken = float(h @ gain)
        if taken > smoothing:
            gain = gain * (smoothing / taken)
        self.theta = self.theta + gain * nu
        i_kh = np.eye(2) - np.outer(gain, h)
        self.cov = i_kh @ self.cov @ i_kh.T + var * np.outer(gain, gain)
        self._project()

    def _project(self) -> None:
        """Back onto ``a >= 0, c >= C_MIN`` the way the covariance says (the most likely model
        on the bound, as if the bound had been measured): a negative fixed cost is the sign of
        too steep a slope, and clipping ``a`` alone would keep the slope, and the next window
        would push it steeper still. The covariance is kept (the bound is no measurement)."""
        for j, bound in ((0, 0.0), (1, C_MIN)):
            if self.theta[j] < bound and self.cov[j, j] > 0:
                self.theta = self.theta - self.cov[:, j] * (self.theta[j] - bound) / self.cov[j, j]
        self.theta = np.maximum(self.theta, [0.0, C_MIN])


def _capacities(
    capacity: int | Sequence[int | None] | None, fits: Sequence[SpeedFit] | None, size: int
) -> list[int | None]:
    if capacity is None:
        return [f.capacity for f in fits] if fits is not None else [None] * size
    if isinstance(capacity, bool) or not isinstance(capacity, (int, Sequence)):
        raise ValueError(f"capacity: must be an integer, one per rank, or None; got {capacity!r}")
    caps: list[int | None] = [capacity] * size if isinstance(capacity, int) else list(capacity)
    if len(caps) != size:
        raise ValueError(f"capacity: needs one entry per rank ({size}), got {len(caps)}")
    for i, c in enumerate(caps):
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise ValueError(f"capacity[{i}]: must be a positive integer or None, got {c!r}")
    return caps


def _number(value: object) -> bool:
    """Whether ``value`` is a real number a comparison can check (a bool is none)."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real)


class Rebalancer:
    """Re-solve the split every ``every`` steps from the step times the ranks observe.

    Call :meth:`observe` on every rank after every step with the samples it processed and the
    seconds it spent computing them, not waiting for others (a
    :class:`~hetcoll.torch.StepTimer`'s ``pop()``: from the model's forward to its last
    gradient); it returns True on the steps where the shares changed, from the sampler's next
    step on (iterate ``sampler.batch_sampler()``).

    ``fits``: every rank's probe (:func:`gather_speeds`), the model's start and, unless
    ``capacity`` is given, each rank's capacity. ``capacity``: the largest batch each rank can
    hold (one int for all, or one per rank, None: no limit). ``minimum``: the least share of a
    rank. ``smoothing`` (0, 1]: the largest share of a window's surprise the models take in.
    ``threshold``: the relative gain in predicted step time a change must bring. ``drift``: how
    much a rank's speed may change from one window to the next (relative standard deviation).
    ``group``: an mpi4py communicator or a torch.distributed process group; None is the
    sampler's group, else :func:`hetcoll.comm.wrap`'s default (torch's default group, else
    ``MPI.COMM_WORLD`` under mpiexec; resolved at the first exchange). ``comm=`` is its
    deprecated name. A sampler whose
    shares break ``capacity`` or ``minimum`` is re-split at once (on every rank alike, no
    communication).

    >>> reb = Rebalancer(sampler, fits=gather_speeds(fit), every=10)  # doctest: +SKIP
    >>> reb.observe(len(x), seconds)  # after each step, on every rank  # doctest: +SKIP
    """

    def __init__(
        self,
        sampler: BalancedSampler,
        *,
        every: int = 10,
        fits: Sequence[SpeedFit] | None = None,
        capacity: int | Sequence[int | None] | None = None,
        minimum: int = 1,
        smoothing: float = 0.5,
        threshold: float = 0.05,
        drift: float = 0.05,
        group: Any = None,
        comm: Any = NOT_GIVEN,
    ) -> None:
        if not isinstance(sampler, BalancedSampler):
            raise TypeError(f"sampler: must be a BalancedSampler, got {type(sampler).__name__}")
        every = every_argument(every, "every", optional=False)
        if not _number(smoothing) or not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing: must be in (0, 1], got {smoothing!r}")
        try:
            limit = float(threshold) if _number(threshold) else math.nan  # type: ignore[arg-type]
        except OverflowError:  # 10**400
            limit = math.inf
        if not 0.0 <= limit < math.inf:
            raise ValueError(f"threshold: must be a finite number >= 0, got {threshold!r}")
        if not _number(drift) or not 0.0 <= drift < 1.0:
            raise ValueError(f"drift: must be in [0, 1), got {drift!r}")
        if isinstance(minimum, bool) or not isinstance(minimum, int) or minimum < 1:
            raise ValueError(f"minimum: must be an integer >= 1, got {minimum!r}")
        group = group_argument(group, "Rebalancer", comm=comm)
        if group is None:  # the sampler's ranks: their shares are what it decides
            group = sampler.group
        size = len(sampler.shares)
        if fits is not None:
            if not isinstance(fits, Sequence) or isinstance(fits, (str, bytes)):
                raise ValueError(f"fits: needs one SpeedFit per rank ({size}), got {fits!r}")
            fits = list(fits)
            if len(fits) != size or not all(isinstance(f, SpeedFit) for f in fits):
                raise ValueError(f"fits: needs one SpeedFit per rank ({size})")
        self.sampler = sampler
        self.every = every
        self.smoothing = float(smoothing)
        self.threshold = limit
        self.drift = float(drift)
        self.group = group
        self._comm: Communicator | None = None
        self.minimum = minimum
        self.capacity = _capacities(capacity, fits, size)
        total = sum(sampler.shares)
        if minimum * size > total:
            raise ValueError(f"minimum: {minimum} per rank is more than the batch ({total})")
        for i, cap in enumerate(self.capacity):
            if cap is not None and cap < minimum:
                raise ValueError(f"capacity[{i}]: {cap} is below minimum ({minimum})")
        if sum(total if c is None else c for c in self.capacity) < total:
            raise ValueError(f"capacity: {self.capacity} cannot hold the batch ({total})")
        self._models = [_Model.from_fit(f, self.drift) for f in fits] if fits is not None else None
        self.history: list[RebalanceEvent] = []
        self._step = 0
        self._window: list[tuple[int, float]] = []
        self._zero_told = False  # warned once of a step timed at 0 seconds
        shares = list(sampler.shares)
        if any(not self._fits_in(i, b) for i, b in enumerate(shares)):
            # The shares the sampler came with are infeasible: keep their proportions, feasibly.
            sampler.set_shares(self._split(total, [float(b) for b in shares], [0.0] * size))

    @property
    def speeds(self) -> list[float] | None:
        """Each rank's modelled samples per second (None before the first window)."""
        return None if self._models is None else [1.0 / m.theta[1] for m in self._models]

    @property
    def fits(self) -> list[SpeedFit] | None:
        """Each rank's current model as a :class:`SpeedFit` (None before the first window)."""
        if self._models is None:
            return None
        return [
            SpeedFit(
                float(m.theta[0]),
                float(1.0 / m.theta[1]),
                cap,
                covariance=(float(m.cov[0, 0]), float(m.cov[0, 1]), float(m.cov[1, 1])),
            )
            for m, cap in zip(self._models, self.capacity)
        ]

    def _fits_in(self, rank: int, b: int) -> bool:
        cap = self.capacity[rank]
        return b >= self.minimum and (cap is None or b <= cap)

    def _split(self, total: int, speeds: list[float], latency: list[float]) -> list[int]:
        caps = [total if c is None else min(c, total) for c in self.capacity]
        return hetcoll.split(total, speeds, latency=latency, capacity=caps, minimum=self.minimum)

    def observe(self, samples: int, seconds: float) -> bool:
        """Record one step of this rank; every ``every`` steps decide (collectively). Every
        rank calls it once for every step, as many times: a rank that skips a step decides
        at another step than the others, whose exchange then waits for it (or meets another
        collective of theirs).

        Bad ``samples`` or ``seconds`` raise ``ValueError`` naming them, and the step still
        counts (the rank stays in step if the caller goes on). At a deciding step the others
        are told in its exchange and raise :class:`hetcoll.CollectiveMismatchError`; at any
        other step nothing is exchanged, so only this rank raises (no rank waits on it), and
        its window leaves the step out."""
        failure = None
        try:
            # A 0-d tensor or array of seconds is a number too; a bool or a str is not.
            if isinstance(seconds, (bool, str, bytes)):
                raise TypeError
            value = float(seconds)
        except (TypeError, ValueError):
            value = math.nan
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            failure = ValueError(f"samples: must be an integer >= 0, got {samples!r}")
        elif not (math.isfinite(value) and value >= 0.0):
            failure = ValueError(f"seconds: must be a finite number >= 0, got {seconds!r}")
        if failure is not None:
            # Counted all the same: a caller that catches the error and goes on stays in step
            # with the others (it decided one step after them, and their exchanges met its
            # other collectives, or none, before).
            self._step += 1
            if self._step % self.every == 0:
                # The others exchange their windows now: told, they raise at once instead of
                # waiting for this rank (whose own error comes first, whatever the exchange
                # met).
                self._window = []
                try:
                    self._exchange(np.full(_FIELDS, np.nan))
                except BaseException as e:
                    raise failure from e
            # At a step that does not decide nothing is exchanged, and no rank waits: the
            # others are not told (that would take an exchange every step), and this rank's
            # window goes on without the step.
            raise failure
        self._step += 1
        if samples > 0 and value == 0.0:
            # No measurement (a clock too coarse for the step, or a timer read twice): as a
            # time it would make this rank infinitely fast, or, from the first window, keep
            # the models from ever starting.
            if not self._zero_told:
                self._zero_told = True
                warnings.warn(
                    f"Rebalancer.observe: 0 seconds for {samples} samples; such steps are left "
                    "out of the speed estimate (time the step's compute with "
                    "time.perf_counter())",
                    RuntimeWarning,
                    stacklevel=2,
                )
        else:
            self._window.append((samples, value))
        if self._step % self.every:
            return False
        mine = window_summary(self._window)
        self._window = []
        rows = self._exchange(mine)
        failed = [r for r in range(len(rows)) if np.isnan(rows[r]).all()]
        if failed:
            raise CollectiveMismatchError(
                f"Rebalancer.observe: rank {failed[0]} was given bad samples or seconds "
                "(it raised ValueError naming them)"
            )
        return self.update(rows)

    def _exchange(self, mine: np.ndarray) -> np.ndarray:
        """Every rank's window summary (one row per rank, in rank order)."""
        if self._comm is None:
            self._comm = wrap(self.group)
        rows = self._comm.allgather_fixed(mine.view(np.uint8), None)
        return rows.view(np.float64).reshape(-1, _FIELDS)

    def update(self, rows: np.ndarray) -> bool:
        """Take in every rank's :func:`window_summary` (one row per rank, in rank order), update
        the models and decide; True when the shares changed. :meth:`observe` calls it with the
        gathered rows; tests and simulations may call it directly."""
        rows = np.asarray(rows, np.float64)
        old = list(self.sampler.shares)
        if rows.shape != (len(old), _FIELDS):
            raise ValueError(f"rows: must have shape ({len(old)}, {_FIELDS}), got {rows.shape}")
        if not np.isfinite(rows).all() or (rows < 0).any():
            # window_summary's sizes, seconds and counts: NaN once reached int(), inf overflowed
            raise ValueError(f"rows: must be finite numbers >= 0, got {rows.tolist()}")
        if self._models is None:
            if any(rows[i, 0] <= 0 or rows[i, 1] <= 0 for i in range(len(old))):
                return False  # a rank ran no timed step yet: nothing to start from
            self._models = [_Model.from_window(int(r[0]), r[1], self.drift) for r in rows]
        else:
            for i, m in enumerate(self._models):
                m.drift(self.drift, old[i])
        for m, r in zip(self._models, rows):
            for g in range(GROUPS):
                b, med, se, n = r[4 * g : 4 * g + 4]
                if b > 0 and n > 0:
                    var = max(se * se, (STEP_NOISE * med) ** 2 / n)
                    m.update(b, med, var, self.smoothing)
        return self._decide(old)

    def _decide(self, old: list[int]) -> bool:
        assert self._models is not None
        total = sum(old)
        a = [float(m.theta[0]) for m in self._models]
        c = [float(m.theta[1]) for m in self._models]
        new = self._split(total, [1.0 / ci for ci in c], a)
        t_old = max(ai + ci * b for ai, ci, b in zip(a, c, old))
        t_new = max(ai + ci * b for ai, ci, b in zip(a, c, new))
        infeasible = any(not self._fits_in(i, b) for i, b in enumerate(old))
        applied = new != old and (infeasible or t_old - t_new > self.threshold * t_old)
        explored = False
        if not applied:
            probe = self._explore(old, a, c)
            if probe is not None:
                new, t_new, applied, explored = probe, t_old, True, True
        self.history.append(
            RebalanceEvent(
                self._step,
                tuple(1.0 / ci for ci in c),
                tuple(old),
                tuple(new),
                t_old,
                t_new,
                applied,
                tuple(a),
                explored,
            )
        )
        if applied:
            self.sampler.set_shares(new)
        return applied

    def over(self, sampler: BalancedSampler, *, every: int | None = None) -> Rebalancer:
        """This rebalancer carried over to ``sampler``, a rebuilt loader's (as many ranks):
        the same settings and capacities (``every`` anew if given), and its models, steps and
        :attr:`history`, so that it decides on as it would have."""
        moved = Rebalancer(
            sampler,
            every=self.every if every is None else every,
            capacity=self.capacity,
            minimum=self.minimum,
            smoothing=self.smoothing,
            threshold=self.threshold,
            drift=self.drift,
            group=self.group,
        )
        moved.load_state_dict(self.state_dict())
        moved.history = self.history
        return moved

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to carry on learning where this one was: the steps counted
        and every rank's model (``(a, c)`` and their covariance; None before the first
        window). Plain ints, floats and lists, for any checkpoint format; the same on every
        rank. The shares are the sampler's (its own ``state_dict``); the steps of a window not
        yet decided on, each rank's own, are not kept, nor is :attr:`history`."""
        models = None
        if self._models is not None:
            models = [
                [float(m.theta[0]), float(m.theta[1]), *(float(x) for x in m.cov.ravel())]
                for m in self._models
            ]
        return {"step": self._step, "models": models}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (a :meth:`state_dict`): the steps counted and, saved on as
        many ranks, every rank's model (else this rebalancer's own start stays: its ``fits``,
        or the first window). Local (every rank loads the same state). ``ValueError`` naming
        the field where ``state`` is no such state."""
        if not isinstance(state, dict):
            raise TypeError(f"state: must be a dict from state_dict(), got {type(state).__name__}")
        missing = [k for k in ("step", "models") if k not in state]
        if missing:
            raise ValueError(f"state: missing {missing} (not a Rebalancer state_dict)")
        step, models = state["step"], state["models"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"state['step']: must be an integer >= 0, got {step!r}")
        restored: list[_Model] | None = None
        if models is not None:
            if not isinstance(models, list):
                raise ValueError(f"state['models']: must be a list or None, got {models!r}")
            rows = []
            for i, row in enumerate(models):
                try:
                    values = np.array(row, np.float64)
                except (TypeError, ValueError):
                    values = np.empty(0)
                if values.shape != (6,) or not np.isfinite(values).all():
                    raise ValueError(
                        f"state['models'][{i}]: must be 6 finite numbers (a, c and their "
                        f"covariance), got {row!r}"
                    )
                rows.append(values)
            if len(rows) == len(self.sampler.shares):
                restored = [_Model(v[:2].copy(), v[2:].reshape(2, 2).copy()) for v in rows]
        self._step, self._window = step, []
        if restored is not None:
            self._models = restored

    def _explore(self, old: list[int], a: list[float], c: list[float]) -> list[int] | None:
        """Shares that try a rank whose per-sample cost is still unknown (relative standard
        error above :data:`EXPLORE_ABOVE`) and that idles more than ``threshold`` of the step,
        else None. One batch size cannot tell a fixed cost from a per-sample one: read as
        per-sample cost, a rank's idle time may look like no gain, and without a move there
        would never be a second batch size to learn from. So the split is solved again with
        such ranks' per-sample cost at its optimistic end (two standard errors lower, the fixed
        cost making up the rest of their present time); when that promises more than
        ``threshold``, the shares move ``smoothing`` of the way there, a tried rank's share at
        most doubling."""
        assert self._models is not None
        times = [ai + ci * b for ai, ci, b in zip(a, c, old)]
        slowest = max(times)
        a2, c2 = list(a), list(c)
        for i, m in enumerate(self._models):
            se = math.sqrt(max(m.cov[1, 1], 0.0))
            if times[i] < (1 - self.threshold) * slowest and se > EXPLORE_ABOVE * c[i]:
                c2[i] = max(c[i] - 2 * se, C_MIN)
                a2[i] = a[i] + (c[i] - c2[i]) * old[i]
        if c2 == c:
            return None
        total = sum(old)
        hope = self._split(total, [1.0 / ci for ci in c2], a2)
        t_hope = max(ai + ci * b for ai, ci, b in zip(a2, c2, hope))
        if not slowest - t_hope > self.threshold * slowest:
            return None
        # An experiment, not a bet: a tried rank's share at most doubles.
        way = [b + self.smoothing * (h - b) for b, h in zip(old, hope)]
        caps = [
            min(total if cap is None else cap, 2 * b if ci != c2i else total)
            for cap, b, ci, c2i in zip(self.capacity, old, c, c2)
        ]
        new = hetcoll.split(total, way, capacity=caps, minimum=self.minimum)  # in proportion
        return new if new != old else None
