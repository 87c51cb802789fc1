"""Rebalancer: keep the split right while the workers' speeds drift.

Every ``every`` steps the ranks exchange how many samples they processed and how long their
compute took (one small all-gather, over a torch.distributed group or an mpi4py communicator),
update each rank's speed estimate with exponential smoothing, re-solve the split with
:func:`hetcoll.split`, and switch the sampler (and the weighted-averaging state) to the new
shares only when the predicted step time improves by more than ``threshold``, so noise does not
make the shares thrash. Seed 001 balanced statically once;
this keeps balancing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

import hetcoll
from hetcoll.comm import wrap
from hetcoll.torch.sampler import BalancedSampler


@dataclass(frozen=True)
class RebalanceEvent:
    """One decision: the step, the speed estimates (samples/s), old and new shares, and the
    predicted step seconds before and after."""

    step: int
    speeds: tuple[float, ...]
    old_shares: tuple[int, ...]
    new_shares: tuple[int, ...]
    predicted_old_s: float
    predicted_new_s: float
    applied: bool


class Rebalancer:
    """Re-solve the split every ``every`` steps from measured compute times.

    Call :meth:`observe` on every rank after every step with the samples it processed and the
    seconds it spent computing them (not waiting for others: e.g. the forward pass, or
    :attr:`EmulatedSpeed.last_forward_seconds`); it returns True on the steps where the shares
    changed. All ranks reach the same decision, because they decide on the same gathered data.
    ``group``: what :func:`hetcoll.comm.wrap` takes, a torch.distributed process group (None:
    the default one) or an mpi4py communicator (for :class:`hetcoll.torch.DistributedOptimizer`
    users).
    """

    def __init__(
        self,
        sampler: BalancedSampler,
        *,
        every: int = 10,
        smoothing: float = 0.5,
        threshold: float = 0.05,
        group: Any = None,
        minimum: int = 1,
    ) -> None:
        if not isinstance(sampler, BalancedSampler):
            raise TypeError(f"sampler: must be a BalancedSampler, got {type(sampler).__name__}")
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every: must be an integer >= 1, got {every!r}")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing: must be in (0, 1], got {smoothing!r}")
        if not threshold >= 0.0:
            raise ValueError(f"threshold: must be >= 0, got {threshold!r}")
        self.sampler = sampler
        self.every = every
        self.smoothing = float(smoothing)
        self.threshold = float(threshold)
        self.group = group
        self.minimum = int(minimum)
        self.speeds: list[float] | None = None
        self.history: list[RebalanceEvent] = []
        self._step = 0
        self._samples = 0
        self._seconds = 0.0

    def observe(self, samples: int, seconds: float) -> bool:
        """Record one step of this rank; every ``every`` steps decide (collectively)."""
        if samples < 0 or not seconds >= 0.0:
            raise ValueError(f"samples/seconds: must be >= 0, got {samples!r}, {seconds!r}")
        self._step += 1
        self._samples += int(samples)
        self._seconds += float(seconds)
        if self._step % self.every:
            return False
        mine = np.array([float(self._samples), self._seconds], np.float64)
        gathered = wrap(self.group).allgather_fixed(mine.view(np.uint8), None).view(np.float64)
        self._samples, self._seconds = 0, 0.0
        measured = [float(n / t) if t > 0 else 0.0 for n, t in gathered]
        if self.speeds is None:
            self.speeds = measured
        else:
            a = self.smoothing
            self.speeds = [a * m + (1 - a) * s for m, s in zip(measured, self.speeds)]
        if min(self.speeds) <= 0:
            return False
        old = list(self.sampler.shares)
        total = sum(old)
        new = hetcoll.split(total, self.speeds, minimum=self.minimum)
        t_old = max(hetcoll.finish_times(old, self.speeds))
        t_new = max(hetcoll.finish_times(new, self.speeds))
        applied = new != old and (t_old - t_new) > self.threshold * t_old
        self.history.append(
            RebalanceEvent(
                self._step, tuple(self.speeds), tuple(old), tuple(new), t_old, t_new, applied
            )
        )
        if applied:
            self.sampler.set_shares(new)
        return applied
