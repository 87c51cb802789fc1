"""Predicted steps of the lab's *emulated* runs on one host (lab code: the library's predictors
know nothing of emulation).

A rank emulated at speed f runs at full speed and sleeps; what it does to a step depends on how
it sleeps, so each emulation is predicted by changing the library's own laid-out step
(:func:`hetcoll.model.predict.data_parallel_schedule`,
:func:`~hetcoll.model.predict.filter_parallel_schedule`) the way the emulation changes the run,
and timing it with the library (:meth:`~hetcoll.model.predict.DataParallelSchedule.prediction`):

- data parallel (:func:`hetcoll.lab.validate.emulate_speed`): a rank of speed f sleeps
  ``(1/f - 1)`` x its step's compute (forward, backward and update) between its forward and its
  backward: its backward starts that much later;
- filter parallel (:func:`hetcoll.lab.emulate.slow_down_filter_parallel`): each split layer's
  local computation sleeps ``(1/f - 1)`` x its own time, forward and backward: the split
  layers take ``1/f`` as long, the replicated ones run at full speed.

A sleeping rank holds no core. That matters when the ranks outnumber the host's cores
(:class:`SharedCores`): the others then compute faster meanwhile, so with shared cores the step
is timed here, on the timeline of :func:`hetcoll.model.terms.shared_cores_finish_seconds`, in
which a pause is a sleep. Why not a slower device (a
:class:`~hetcoll.model.hardware.Device` with ``f`` times the FLOP/s and bandwidth)? It computes
everything ``1/f`` as slowly, where the emulation slows only some of the work (not the update
after the allreduce, not the replicated layers), puts the data-parallel pause in one piece
before the backward, and frees the core while it sleeps; and its lower bandwidth would slow the
reduction inside the allreduce, which the emulated rank does at full speed.

>>> SharedCores(2, time_slice_s=0.01).cores
2
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from hetcoll.model import terms
from hetcoll.model.costs import ModelCosts
from hetcoll.model.hardware import Cluster
from hetcoll.model.predict import (
    DataParallelSchedule,
    FilterParallelSchedule,
    Prediction,
    data_parallel_schedule,
    filter_parallel_schedule,
)


@dataclass(frozen=True)
class SharedCores:
    """The ranks run on one host of ``cores`` CPU cores (more ranks than cores: oversubscribed,
    as on the validation machine). While more ranks compute than there are cores they share
    them (:func:`hetcoll.model.terms.shared_cores_finish_seconds`; ``time_slice_s``: the OS
    scheduler's, 0 for processor sharing) and a sleeping rank leaves its core to the others.
    ``wake_s``: what each collective costs beyond the bare collective, waking the ranks that
    reached it first (:func:`hetcoll.lab.calibrate.fit_wake_seconds`)."""

    cores: int
    time_slice_s: float = 0.0
    wake_s: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.cores, bool) or not isinstance(self.cores, int) or self.cores < 1:
            raise ValueError(f"cores: must be an integer >= 1, got {self.cores!r}")
        for name in ("time_slice_s", "wake_s"):
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (number and value >= 0.0 and math.isfinite(value)):
                raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")

    def shared_by(self, ranks: int) -> bool:
        """Whether ``ranks`` ranks computing at once outnumber the cores."""
        return ranks > self.cores


def _slowdowns(speeds: Sequence[float], num_devices: int) -> np.ndarray:
    """1/f per device."""
    if len(speeds) != num_devices or any(not 0 < float(f) <= 1 for f in speeds):
        raise ValueError(f"speeds: expected {num_devices} factors in (0, 1] (one per device)")
    return 1.0 / np.asarray(speeds, dtype=np.float64)


def data_parallel(
    costs: ModelCosts,
    cluster: Cluster,
    shares: Sequence[int],
    speeds: Sequence[float],
    *,
    host: SharedCores | None = None,
    **options: Any,
) -> Prediction:
    """One data-parallel step (:func:`hetcoll.model.predict.data_parallel`, ``options`` as
    there) with device d emulated at ``speeds[d]``: it pauses ``(1/f - 1)`` x its step's
    compute (forward, backward and update) between its forward and its backward, as
    :func:`hetcoll.lab.validate.emulate_speed` does. On a ``host`` with fewer cores than ranks
    the step runs on the shared-cores timeline: the pausing rank sleeps, holding no core; the
    others share the cores; the allreduce starts after every backward, ``host.wake_s`` late;
    every rank then updates at once. The breakdown adds ``"emulated pause"`` (and ``"core
    sharing"``, the slowest rank's wait for a core).

    >>> data_parallel(costs, cluster, [43, 21], [1.0, 0.5]).step_s  # doctest: +SKIP
    """
    schedule = data_parallel_schedule(costs, cluster, shares, **options)
    slow = _slowdowns(speeds, len(schedule.shares))
    b = schedule.shares
    bwd_total = schedule.layers.backward_s.sum(axis=0)
    pause = np.where(
        b > 0, (slow - 1.0) * (schedule.backward_start_s + bwd_total + schedule.update_s), 0.0
    )
    if host is not None and host.shared_by(int((b > 0).sum())):
        return _shared_data_parallel(schedule, pause, host)
    paused = replace(schedule, backward_start_s=schedule.backward_start_s + pause)
    pred = paused.prediction()
    slowest = int(np.argmax(paused.backward_start_s + bwd_total + schedule.update_s))
    return _with_breakdown(pred, {"emulated pause": float(pause[slowest])})


def _with_breakdown(pred: Prediction, extra: dict[str, float]) -> Prediction:
    """``pred`` with ``extra`` causes in its breakdown, taken off its communication (the rest
    of the step)."""
    breakdown = {**pred.breakdown, "communication": 0.0, **extra}
    breakdown["communication"] = max(0.0, pred.step_s - sum(breakdown.values()))
    return replace(pred, breakdown=breakdown)


def _shared_data_parallel(
    schedule: DataParallelSchedule, pause: np.ndarray, host: SharedCores
) -> Prediction:
    b, lt, opt = schedule.shares, schedule.layers, schedule.update_s
    fwd_total, bwd_total = schedule.backward_start_s, lt.backward_s.sum(axis=0)
    active = np.flatnonzero(b > 0)
    phases = [[("cpu", fwd_total[r]), ("sleep", pause[r]), ("cpu", bwd_total[r])] for r in active]
    cores, q = host.cores, host.time_slice_s
    compute = np.zeros(len(b))
    compute[active] = terms.shared_cores_finish_seconds(phases, cores, q)
    busy = terms.shared_cores_makespan_seconds(phases, cores, q) + host.wake_s
    # Every rank updates at once after the allreduce, which waits for every backward.
    update = terms.shared_cores_makespan_seconds([[("cpu", opt[r])] for r in active], cores, q)
    opt = np.where(b > 0, update, 0.0)
    end = busy
    for _, c in schedule.buckets:
        end += c
    slowest = int(np.argmax(compute + opt))
    step = schedule.broadcast_s + end + float(opt.max())
    alone = fwd_total + pause + bwd_total
    pred = replace(schedule, update_s=opt).prediction()
    pred = replace(
        pred,
        step_s=step,
        breakdown={
            "compute": float(lt.compute_s[:, slowest].sum()),
            "memory": float(lt.memory_s[:, slowest].sum()),
            "overhead": float(lt.overhead_s[:, slowest].sum()),
            "communication": 0.0,
            "optimizer": float(opt[slowest]),
        },
        detail={
            **pred.detail,
            "compute_s_per_device": (
                [float(x) for x in compute] if pred.detail["compute_s_per_device"] else None
            ),
        },
    )
    return _with_breakdown(
        pred,
        {
            "emulated pause": float(pause[slowest]),
            "core sharing": max(0.0, float(compute[slowest] - alone[slowest])),
        },
    )


def filter_parallel(
    costs: ModelCosts,
    cluster: Cluster,
    batch: int,
    parts: Sequence[float],
    speeds: Sequence[float],
    *,
    host: SharedCores | None = None,
    **options: Any,
) -> Prediction:
    """One filter-parallel step (:func:`hetcoll.model.predict.filter_parallel`, ``options`` as
    there) with device d emulated at ``speeds[d]``: the split layers' local computation takes
    ``1/f`` as long, as :func:`hetcoll.lab.emulate.slow_down_filter_parallel` makes it; the
    replicated layers run at full speed. On a ``host`` with fewer cores than ranks, every
    stretch between two collectives runs on the shared-cores timeline (in lock step every rank
    computes the same stretch at once), an emulated sleep timed on the compute as it ran, waits
    for a core included; each collective then costs ``host.wake_s`` more.

    >>> filter_parallel(costs, cluster, 32, [1.0, 0.5], [1.0, 0.5]).step_s  # doctest: +SKIP
    """
    schedule = filter_parallel_schedule(costs, cluster, batch, parts, **options)
    slow = _slowdowns(speeds, len(schedule.update_s))
    factor = np.where(schedule.split[:, None], slow[None, :], 1.0)
    n = len(slow)
    if host is not None and host.shared_by(n):
        return _shared_filter_parallel(schedule, slow, factor * (n / host.cores), host)
    return replace(schedule, layers=schedule.layers.scaled(factor)).prediction()


def _shared_filter_parallel(
    schedule: FilterParallelSchedule, slow: np.ndarray, factor: np.ndarray, host: SharedCores
) -> Prediction:
    """The lock-step stretches on shared cores. ``factor``: per layer and device, the emulated
    slowdown times the cores' contention, for the breakdown's causes."""
    lt, n = schedule.layers, len(slow)
    cores, q = host.cores, host.time_slice_s
    step = 0.0
    phases: list[list[tuple[str, float]]] = [[] for _ in range(n)]
    for i, forward in schedule.order():
        seconds = (lt.forward_s if forward else lt.backward_s)[i]
        for d in range(n):
            phases[d].append(("cpu", float(seconds[d])))
            if schedule.split[i] and slow[d] > 1.0:
                phases[d].append(("pause", float(slow[d] - 1.0)))
        comm_s = (schedule.forward_collective_s if forward else schedule.backward_collective_s)[i]
        if comm_s > 0:
            step += terms.shared_cores_makespan_seconds(phases, cores, q)
            step += float(comm_s) + host.wake_s
            phases = [[] for _ in range(n)]
    for d in range(n):
        phases[d].append(("cpu", float(schedule.update_s[d])))
    step += terms.shared_cores_makespan_seconds(phases, cores, q)
    # The causes as the layers would split them computing side by side at the cores' share of
    # speed (the update too), scaled to the layers' part of this step.
    contention = n / cores
    base = replace(
        schedule, layers=lt.scaled(factor), update_s=contention * schedule.update_s
    ).prediction()
    comm = base.breakdown["communication"] + host.wake_s * schedule.detail["collectives"]
    layers_s = step - comm - base.breakdown["optimizer"]
    causes = ("compute", "memory", "overhead")
    busy = sum(base.breakdown[k] for k in causes)
    breakdown = {k: base.breakdown[k] * layers_s / busy if busy > 0 else 0.0 for k in causes}
    breakdown["communication"] = comm
    breakdown["optimizer"] = base.breakdown["optimizer"]
    return replace(base, step_s=step, breakdown=breakdown)
