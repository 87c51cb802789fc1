"""Predicted steps of the lab's *emulated* runs on one host (lab code: the library's predictors
know nothing of emulation).

A rank emulated at speed f runs at full speed and sleeps; what it does to a step depends on how
it sleeps, so each emulation is predicted by changing the library's own laid-out step
(:func:`hetcoll.model.predict.data_parallel_schedule`,
:func:`~hetcoll.model.predict.filter_parallel_schedule`) the way the emulation changes the run,
and timing it with the library (:meth:`~hetcoll.model.predict.DataParallelSchedule.prediction`):

- data parallel (:func:`hetcoll.lab.validate_ranks.emulate_speed`): a rank of speed f sleeps
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
    ExpertParallelSchedule,
    ExpertPlanSchedule,
    FilterParallelSchedule,
    Prediction,
    data_parallel_schedule,
    filter_parallel_schedule,
    plan_schedule,
)
from hetcoll.plan import Plan


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
    :func:`hetcoll.lab.validate_ranks.emulate_speed` does. On a ``host`` with fewer cores than ranks
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
        breakdown=lt.breakdown(slowest, float(opt[slowest]), step),
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
    slowed: str = "split",
    **options: Any,
) -> Prediction:
    """One filter-parallel step (:func:`hetcoll.model.predict.filter_parallel`, ``options`` as
    there) with device d emulated at ``speeds[d]``: the split layers' local computation takes
    ``1/f`` as long, as :func:`hetcoll.lab.emulate.slow_down_filter_parallel` makes it; the
    replicated layers run at full speed. ``slowed="parameters"``: every layer with parameters
    takes ``1/f`` as long (split or replicated: :func:`hetcoll.lab.emulate.slow_down` of the
    split model), the parameter-free ones (an attention's scores, activations) full speed. On
    a ``host`` with fewer cores than ranks, every stretch between two collectives runs on the
    shared-cores timeline (in lock step every rank computes the same stretch at once), an
    emulated sleep timed on the compute as it ran, waits for a core included; each collective
    then costs ``host.wake_s`` more.

    >>> filter_parallel(costs, cluster, 32, [1.0, 0.5], [1.0, 0.5]).step_s  # doctest: +SKIP
    """
    if slowed not in ("split", "parameters"):
        raise ValueError(f"slowed: must be 'split' or 'parameters', got {slowed!r}")
    schedule = filter_parallel_schedule(costs, cluster, batch, parts, **options)
    slow = _slowdowns(speeds, len(schedule.update_s))
    rows = (
        schedule.split
        if slowed == "split"
        else np.array([x.param_bytes > 0 for x in costs.layers], dtype=bool)
    )
    factor = np.where(rows[:, None], slow[None, :], 1.0)
    n = len(slow)
    if host is not None and host.shared_by(n):
        return _shared_filter_parallel(schedule, slow, factor * (n / host.cores), host)
    return replace(schedule, layers=schedule.layers.scaled(factor)).prediction()


def slowed_by_parameters(
    schedule: DataParallelSchedule | ExpertParallelSchedule | ExpertPlanSchedule,
    costs: ModelCosts,
    speeds: Sequence[float],
) -> Prediction:
    """A data- or expert-parallel step whose devices run under :func:`hetcoll.lab.emulate.
    slow_down` at ``speeds``: every layer with parameters takes ``1/f`` as long on a device of
    speed f (placed experts through their own computation), the parameter-free ones, the
    collectives and the update full speed.

    >>> slowed_by_parameters(expert_parallel_schedule(costs, c, [26, 6], [7, 1]), costs,
    ...                      [1.0, 0.25]).step_s  # doctest: +SKIP
    """
    one = schedule.passes[0] if isinstance(schedule, ExpertPlanSchedule) else schedule
    slow = _slowdowns(speeds, len(one.update_s))
    rows = np.array([x.param_bytes > 0 for x in costs.layers], dtype=bool)
    factor = np.where(rows[:, None], slow[None, :], 1.0)
    if isinstance(schedule, ExpertPlanSchedule):  # each micro-batch's pass alike
        passes = tuple(replace(p, layers=p.layers.scaled(factor)) for p in schedule.passes)
        return replace(schedule, passes=passes).prediction()
    layers = schedule.layers.scaled(factor)
    if isinstance(schedule, DataParallelSchedule):  # its backward starts after the slower forward
        return replace(
            schedule, layers=layers, backward_start_s=layers.forward_s.sum(axis=0)
        ).prediction()
    return replace(schedule, layers=layers).prediction()


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


def parallel_plan(
    costs: ModelCosts,
    cluster: Cluster,
    plan: Plan,
    speeds: Sequence[float],
    *,
    host: SharedCores | None = None,
    **options: Any,
) -> Prediction:
    """One step of ``plan`` (:func:`hetcoll.model.predict.predict_plan`, ``options`` as there)
    with device d emulated at ``speeds[d]`` by :func:`hetcoll.lab.emulate.slow_down` on its
    stage: every layer with parameters sleeps ``(1/f - 1)`` x its own forward after the
    forward and x its own backward after the backward (in a filter-split stage, the split
    layers' local computation: the collectives run at full speed); layers without parameters
    run at full speed, and so does the backward of the model's first layer (its input needs no
    gradient, so the emulation cannot time it). The library's laid-out step
    (:func:`hetcoll.model.predict.plan_schedule`) is re-timed layer by layer. On a ``host``
    with fewer cores than ranks the programs run on the shared-cores timeline of
    :func:`shared_schedule_finish_seconds` (a sleeping rank holds no core; each collective
    costs ``host.wake_s`` more), else on the library's.

    >>> speeds = [1.0, 0.5, 0.25]
    >>> parallel_plan(costs, cluster, Plan.load("plan.json"), speeds).step_s  # doctest: +SKIP
    """
    schedule = plan_schedule(costs, cluster, plan, **options)
    slow = _slowdowns(speeds, len(schedule.devices))
    slowed = [layer.param_bytes > 0 for layer in costs.layers]

    def factor(layer: int, direction: str) -> bool:
        return slowed[layer] and not (layer == 0 and direction == "B")

    shared = host is not None and host.shared_by(sum(1 for s in schedule.samples if s > 0))
    programs: list[list[tuple[Any, ...]]] = []
    for d, prog in zip(schedule.program_devices, schedule.programs):
        out: list[tuple[Any, ...]] = []
        for op in prog:
            if op[0] != "compute":
                out.append(op)
            elif shared:
                for layer, s, direction in op[2]:
                    out.append(("cpu", s))
                    if slow[d] > 1.0 and factor(layer, direction):
                        out.append(("pause", float(slow[d] - 1.0)))
            elif slow[d] == 1.0:
                out.append(op)
            else:
                s = sum(t * (slow[d] if factor(i, k) else 1.0) for i, t, k in op[2])
                out.append(("compute", s, op[2]))
        programs.append(out)
    if not shared:
        return replace(schedule, programs=programs).prediction()
    assert host is not None
    finish, in_collectives = shared_schedule_finish_seconds(programs, schedule.collectives, host)
    return schedule.prediction(finish, in_collectives)


def shared_schedule_finish_seconds(
    programs: list[list[tuple[Any, ...]]],
    collectives: dict[object, tuple[int, float]],
    host: SharedCores,
) -> tuple[list[float], list[float]]:
    """:func:`hetcoll.model.terms.schedule_finish_seconds` on a host of ``host.cores`` cores
    shared by the devices (processor sharing: while ``n`` devices compute, each runs at
    ``min(1, cores / n)`` of its speed). Besides the library's operations a program may hold
    ``("cpu", s)`` (``s`` seconds of compute on a core of its own), ``("sleep", s)`` (wall time
    holding no core) and ``("pause", x)`` (a sleep of ``x`` times the wall time the device's
    previous ``cpu`` phase took: the emulation times its own compute, waits for a core
    included). A collective ends ``s + host.wake_s`` after its last participant reaches it.
    Returns each device's finish time and its seconds inside collectives (their own, as the
    library counts them, waits for the last participant aside); ``ValueError`` when the
    programs deadlock.

    >>> cpu = [("cpu", 1.0)]
    >>> shared_schedule_finish_seconds([cpu, cpu, cpu], {}, SharedCores(2))[0]
    [1.5, 1.5, 1.5]
    >>> two = [[("cpu", 1.0), ("pause", 1.0)], [("cpu", 1.0), ("collective", "c")]]
    >>> shared_schedule_finish_seconds(two + [[("collective", "c")]], {"c": (2, 0.5)},
    ...                                SharedCores(1))[0]
    [4.0, 2.5, 2.5]
    """
    n = len(programs)
    cores, wake = host.cores, host.wake_s
    pc = [0] * n
    now = 0.0
    finish = [math.nan] * n
    in_collectives = [0.0] * n
    cpu_left: dict[int, float] = {}  # device -> compute seconds left in its cpu phase
    cpu_start = [0.0] * n
    cpu_wall = [0.0] * n
    wait_until: dict[int, float] = {}  # device -> end of its sleep
    link_free = [0.0] * n
    sent_until = [0.0] * n
    arrival: dict[object, float] = {}
    joined: dict[object, list[float]] = {}  # collective -> the times its participants joined
    ends: dict[object, float] = {}
    entered = [False] * n  # whether the device has joined the collective it waits in
    eps = 1e-15

    def advance(d: int) -> None:
        """Run device d's operations that take no time at ``now``, up to one that does."""
        prog = programs[d]
        while pc[d] < len(prog):
            op = prog[pc[d]]
            kind = op[0]
            if kind in ("cpu", "compute"):
                if d not in cpu_left:
                    if op[1] <= 0.0:
                        pc[d] += 1
                        continue
                    cpu_left[d] = float(op[1])
                    cpu_start[d] = now
                return
            if kind in ("sleep", "pause"):
                if d not in wait_until:
                    s = op[1] if kind == "sleep" else op[1] * cpu_wall[d]
                    if s <= 0.0:
                        pc[d] += 1
                        continue
                    wait_until[d] = now + s
                if wait_until[d] > now + eps:
                    return
                del wait_until[d]
            elif kind == "send":
                link_free[d] = terms.post_sends(now, op[1], link_free[d], arrival)
                sent_until[d] = max([sent_until[d], *(arrival[m] for m, _, _ in op[1])])
            elif kind == "recv":
                at = arrival.get(op[1])
                if at is None or at > now + eps:
                    return
            elif kind == "collective":
                key = op[1]
                if not entered[d]:
                    entered[d] = True
                    times = joined.setdefault(key, [])
                    times.append(now)
                    participants, seconds = collectives[key]
                    if len(times) == participants:
                        ends[key] = now + seconds + wake
                end = ends.get(key)
                if end is None or end > now + eps:
                    return
                in_collectives[d] += collectives[key][1] + wake
                entered[d] = False
            elif kind == "wait_sends":
                if sent_until[d] > now + eps:
                    return
            else:
                raise ValueError(f"programs: unknown operation {kind!r}")
            pc[d] += 1
        if math.isnan(finish[d]):
            finish[d] = now

    def settle() -> None:
        """Advance every device until none moves: one device's send or arrival at a
        collective may release another at the same instant."""
        while True:
            before = list(pc)
            for d in range(n):
                if math.isnan(finish[d]):
                    advance(d)
            if pc == before:
                return

    settle()
    while any(math.isnan(f) for f in finish):
        rate = min(1.0, cores / len(cpu_left)) if cpu_left else 1.0
        events = [now + left / rate for left in cpu_left.values()]
        events += [t for t in wait_until.values() if t > now]
        for d in range(n):
            if math.isnan(finish[d]) and d not in cpu_left and d not in wait_until:
                op = programs[d][pc[d]]
                if op[0] == "recv" and arrival.get(op[1], -1.0) > now:
                    events.append(arrival[op[1]])
                elif op[0] == "collective" and ends.get(op[1], -1.0) > now:
                    events.append(ends[op[1]])
                elif op[0] == "wait_sends" and sent_until[d] > now:
                    events.append(sent_until[d])
        if not events:
            stuck = [d for d in range(n) if math.isnan(finish[d])]
            raise ValueError(
                f"programs: deadlock: devices {stuck} wait for what no device provides "
                f"({[programs[d][pc[d]] for d in stuck]})"
            )
        later = min(events)
        done = []
        for d, left in cpu_left.items():
            left -= rate * (later - now)
            cpu_left[d] = left
            if left <= eps * max(1.0, later):
                done.append(d)
        now = later
        for d in done:
            del cpu_left[d]
            cpu_wall[d] = now - cpu_start[d]
            pc[d] += 1
        settle()
    return finish, in_collectives
