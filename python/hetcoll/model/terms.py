"""Cost terms of the performance model: one function per term, each citing what it models.

The terms follow seed 003 (Castelló et al., "Performance Modeling for Distributed Training of
Convolutional Neural Networks", PDP 2021) as implemented in PyDTNN
(github hpca-uji/PyDTNN, ``pydtnn/performance_models.py``); where we deviate, the docstring says
why. Units are in the names: ``*_flops`` (floating-point operations), ``*_bytes``, ``*_s``
(seconds), ``*_per_s`` (rates). Every function accepts numpy arrays as well as floats, so the
planner evaluates one term for 1,024 devices in one vectorised call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

#: The largest batch, or share of one, the model prices: sample counts stay exact in its
#: float64 arithmetic (and their int64 sums cannot wrap), far above any real batch.
MAX_SAMPLES = 2**53

# A float, or a numpy array of them (one per device); results follow numpy broadcasting.
Num = float | np.ndarray


def roofline_seconds(
    flops: Num,
    moved_bytes: Num,
    flops_per_s: Num,
    mem_bytes_per_s: Num,
    overhead_s: Num = 0.0,
) -> Num:
    """Seconds of one kernel under the roofline: ``overhead_s + max(flops / flops_per_s,
    moved_bytes / mem_bytes_per_s)``.

    Models PyDTNN ``roofline`` + ``flops2time``: speed = min(C, mem_bw * flops / bytes), time =
    flops / speed, which is the max above; written as a max it also charges pure data movement
    (flops = 0), which PyDTNN's form turns into zero seconds. ``overhead_s`` is the fixed launch
    cost of a kernel (not in PyDTNN; it dominates small CPU kernels in PyTorch).

    >>> float(roofline_seconds(2e9, 1e6, 1e9, 1e9))
    2.0
    """
    return overhead_s + np.maximum(flops / flops_per_s, moved_bytes / mem_bytes_per_s)


def gemm_flops(m: float, n: float, k: float) -> float:
    """FLOPs of C[m,n] += A[m,k] B[k,n]: ``2 m n k`` (PyDTNN ``matmul_time``)."""
    return 2.0 * m * n * k


def gemm_bytes(m: float, n: float, k: float, itemsize_bytes: int) -> float:
    """Bytes a GEMM moves at least once: ``(m n + m k + n k) * itemsize`` (PyDTNN
    ``matmul_time`` memops, times the element size as in ``flops2time``)."""
    return (m * n + m * k + n * k) * float(itemsize_bytes)


def ring_allreduce_seconds(
    message_bytes: Num,
    num_ranks: int,
    latency_s: float,
    link_bytes_per_s: float,
    reduce_bytes_per_s: float,
    itemsize_bytes: int = 4,
    reduce_flops_per_s: float = float("inf"),
    call_s: float = 0.0,
) -> Num:
    """Seconds of a ring allreduce of ``message_bytes`` over ``num_ranks`` ranks (alpha-beta):
    ``2(p-1) alpha + 2(p-1)/p * n b / B + (p-1)/p * reduce(n)``, plus the engine's fixed
    ``call_s`` per collective call (:class:`~hetcoll.model.hardware.Link`).

    Models the ring allreduce of seed 003 (Castelló et al., PDP 2021; Patarasuk & Yuan 2009) and
    PyDTNN's ``allreduce_time`` in ``pydtnn/performance_models.py`` (whose "bta"
    variant has 2 log2(p) alpha for the latency term; the ring has 2(p-1) start-ups). The
    reduction term n/C is evaluated with the roofline: a reduction reads two operands and writes
    one (3 n b bytes, n flops), so on real parts it is memory-bound, not FLOP-bound.

    >>> float(ring_allreduce_seconds(1e6, 2, 0.0, 1e6, float("inf")))
    1.0
    """
    p = num_ranks
    if p <= 1:
        return 0.0 * message_bytes
    elems = message_bytes / itemsize_bytes
    reduce_s = roofline_seconds(elems, 3.0 * message_bytes, reduce_flops_per_s, reduce_bytes_per_s)
    return (
        call_s
        + 2.0 * (p - 1) * latency_s
        + 2.0 * (p - 1) / p * message_bytes / link_bytes_per_s
        + (p - 1) / p * reduce_s
    )


def ring_allgatherv_seconds(
    largest_piece_bytes: Num,
    num_ranks: int,
    latency_s: float,
    link_bytes_per_s: float,
    call_s: float = 0.0,
) -> Num:
    """Seconds of a ring allgather(v) whose largest piece has ``largest_piece_bytes``:
    ``(p-1) (alpha + largest / B)``, plus the engine's fixed ``call_s`` per call.

    Models PyDTNN ``allgather_time`` ("bta": (p-1) alpha + (p-1)/p n/B). With even pieces
    largest = n/p and the two agree; with uneven pieces every ring step waits for the largest
    piece in flight, so the largest piece, not the mean, sets the time.

    >>> ring_allgatherv_seconds(1e6, 3, 0.0, 1e6)
    2.0
    """
    p = num_ranks
    if p <= 1:
        return 0.0 * largest_piece_bytes
    return call_s + (p - 1) * (latency_s + largest_piece_bytes / link_bytes_per_s)


def all_to_all_seconds(
    busiest_bytes: Num,
    num_ranks: int,
    latency_s: float,
    link_bytes_per_s: float,
    call_s: float = 0.0,
) -> Num:
    """Seconds of an all-to-all(v) whose busiest rank sends or receives ``busiest_bytes``:
    ``(p-1) alpha + busiest / B`` (a message to each other rank, the busiest rank's bytes over
    its link), plus the engine's fixed ``call_s`` per call; 0 on one rank.

    >>> all_to_all_seconds(1e6, 3, 1e-3, 1e9, 1e-3)
    0.004
    """
    if num_ranks <= 1:
        return 0.0 * busiest_bytes
    return call_s + (num_ranks - 1) * latency_s + busiest_bytes / link_bytes_per_s


def copy_seconds(copied_bytes: Num, mem_bytes_per_s: Num) -> Num:
    """Seconds of a local copy of ``copied_bytes`` (read once, written once):
    ``2 n / bandwidth``. Not in PyDTNN; here the staging copies around a collective (the
    contiguous send buffer, the channel-dimension moves of a filter-parallel gather), which on
    a CPU host take the same memory bus as the transfer.

    >>> copy_seconds(1e9, 4e9)
    0.5
    """
    return 2.0 * copied_bytes / mem_bytes_per_s


def point_to_point_seconds(message_bytes: Num, latency_s: float, link_bytes_per_s: float) -> Num:
    """Seconds of one message: ``alpha + n / B`` (the alpha-beta model of every PyDTNN
    collective for p = 2; here the activation hand-off between pipeline stages).

    >>> point_to_point_seconds(1e6, 1e-3, 1e9)
    0.002
    """
    return latency_s + message_bytes / link_bytes_per_s


def broadcast_seconds(
    message_bytes: Num,
    num_ranks: int,
    latency_s: float,
    link_bytes_per_s: float,
    call_s: float = 0.0,
) -> Num:
    """Seconds of a binomial-tree broadcast: ``ceil(log2 p) * (alpha + n / B)`` plus the
    engine's fixed ``call_s`` per call, and 0 on one rank. Here DDP's broadcast of the module
    buffers (BatchNorm statistics) from rank 0 at the start of every forward.

    >>> broadcast_seconds(1e6, 4, 1e-3, 1e9)
    0.004
    >>> broadcast_seconds(1e6, 1, 1e-3, 1e9)
    0.0
    """
    if num_ranks <= 1:
        return 0.0 * message_bytes
    rounds = math.ceil(math.log2(num_ranks))
    return call_s + rounds * (latency_s + message_bytes / link_bytes_per_s)


def batch_argument(batch: object, least: int = 1, rule: str = "") -> int:
    """``batch``, an integer in [``least``, :data:`MAX_SAMPLES`]; ``ValueError`` naming it
    otherwise (``rule`` says where ``least`` comes from: ``" (micro_batches)"``)."""
    whole = not isinstance(batch, bool) and isinstance(batch, (int, np.integer))
    if not whole or not least <= batch <= MAX_SAMPLES:  # type: ignore[operator]
        raise ValueError(f"batch: must be an integer in [{least}{rule}, 2**53], got {batch!r}")
    return int(batch)  # type: ignore[call-overload]


def state_copies_argument(state_copies: object) -> int:
    """``optimizer_state_copies`` (state tensors per trained weight: SGD 0, momentum 1,
    Adam 2), an integer in [0, 64]; ``ValueError`` naming it otherwise (NaN once priced
    every plan at NaN seconds, ranked first, and -100 held negative memory, marked
    feasible)."""
    whole = not isinstance(state_copies, bool) and isinstance(state_copies, (int, np.integer))
    if not whole or not 0 <= state_copies <= 64:  # type: ignore[operator]
        raise ValueError(
            f"optimizer_state_copies: must be an integer in [0, 64], got {state_copies!r}"
        )
    return int(state_copies)  # type: ignore[call-overload]


def training_state_bytes(param_bytes: Num, gradient_bytes: Num, state_copies: int = 1) -> Num:
    """Bytes a device holds for its parameters between steps: the weights
    (``param_bytes``), and the gradients and ``state_copies`` optimizer state tensors of
    those that train (``gradient_bytes``: frozen weights have neither).

    >>> training_state_bytes(100.0, 40.0, state_copies=2)
    220.0
    """
    return param_bytes + gradient_bytes * (1 + state_copies_argument(state_copies))


def optimizer_update_seconds(param_bytes: Num, mem_bytes_per_s: Num, state_copies: int = 1) -> Num:
    """Seconds of an element-wise optimizer step (memory-bound) on the ``param_bytes`` of
    weights that train: it reads weights, gradients and ``state_copies`` state tensors and
    writes weights and state, ``(3 + 2 s) * param_bytes`` bytes (SGD s=0, SGD with momentum
    s=1, Adam s=2). Not in PyDTNN (its model ends at the allreduce); measurable on small CNNs,
    whose update moves more bytes than a GEMM.

    >>> optimizer_update_seconds(1e9, 5e9, state_copies=1)
    1.0
    """
    return (3.0 + 2.0 * state_copies_argument(state_copies)) * param_bytes / mem_bytes_per_s


def step_update_seconds(
    param_bytes: Num, mem_bytes_per_s: Num, state_copies: int, step_overhead_s: Num
) -> Num:
    """What a rank's step costs beyond its layers and its communication, as the predictors
    add it after its last backward: the optimizer's update of the ``param_bytes`` it trains
    (:func:`optimizer_update_seconds`) and the step's fixed host seconds
    (:attr:`hetcoll.model.Device.step_overhead_s`: the runtime's work once a step, the
    optimizer's call).

    >>> step_update_seconds(1e9, 5e9, 1, 0.25)
    1.25
    """
    return optimizer_update_seconds(param_bytes, mem_bytes_per_s, state_copies) + step_overhead_s


def pipeline_seconds(slowest_stage_s: Num, num_stages: int, micro_batches: int) -> Num:
    """Seconds of one GPipe step (all forwards, then all backwards) whose slowest stage takes
    ``slowest_stage_s`` per micro-batch (forward + backward + hand-off):
    ``(m + S - 1) * slowest``. The bubble is the ``(S - 1) * slowest`` part; seed 003 models
    model parallelism layer by layer (no micro-batches), the m = 1 case.

    >>> pipeline_seconds(1.0, 4, 4)
    7.0
    """
    return (micro_batches + num_stages - 1) * slowest_stage_s


def pipeline_bubble_seconds(slowest_stage_s: Num, num_stages: int) -> Num:
    """The idle part of :func:`pipeline_seconds`: ``(S - 1) * slowest``."""
    return (num_stages - 1) * slowest_stage_s


def shared_cores_finish_seconds(
    phases: list[list[tuple[str, float]]], cores: int, time_slice_s: float = 0.0
) -> list[float]:
    """When each of several ranks sharing ``cores`` CPU cores finishes its ``phases``, all
    starting at 0. A phase is ``("cpu", s)`` (``s`` seconds of compute on a core of its own),
    ``("sleep", s)`` (``s`` seconds of wall time holding no core) or ``("pause", x)`` (a sleep of
    ``x`` times the wall time the rank's previous ``cpu`` phase took from its first moment on a
    core: a slowdown that times its own compute, as the lab's emulation does, and so grows when
    the compute waits for a core).

    ``time_slice_s = 0``: the cores are shared fairly at every instant (processor sharing):
    while ``n`` ranks compute, each runs at ``min(1, cores / n)`` of its speed.
    ``time_slice_s > 0``: round robin, as an OS scheduler does at the scale of its time
    slice: a rank runs on a core until its compute ends or it has run ``time_slice_s`` while
    others wait, then goes to the back of the queue; ranks that become ready (start, wake)
    join the back, in rank order. Over stretches much longer than the slice the two agree;
    over stretches shorter than it, ``n`` ranks with ``s`` each on ``c`` cores take
    ``ceil(n / c) * s``, not ``n / c * s`` (:func:`shared_cores_makespan_seconds`
    averages over the ranks' order).

    Not in PyDTNN, whose devices never share, nor in the predictors; here for validation on one
    host with more ranks than cores (:mod:`hetcoll.lab.predict_emulated`,
    :mod:`hetcoll.lab.calibrate`), where a sleeping (emulated slow) rank leaves its core to the
    others.

    >>> shared_cores_finish_seconds([[("cpu", 1.0)], [("cpu", 1.0)], [("cpu", 1.0)]], 2)
    [1.5, 1.5, 1.5]
    >>> shared_cores_finish_seconds([[("cpu", 1.0)], [("sleep", 1.0), ("cpu", 0.5)]], 1)
    [1.0, 1.5]
    >>> shared_cores_finish_seconds([[("cpu", 1.0)]] * 3, 2, time_slice_s=4.0)
    [1.0, 1.0, 2.0]
    """
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
        raise ValueError(f"cores: must be an integer >= 1, got {cores!r}")
    if not (time_slice_s >= 0.0 and math.isfinite(time_slice_s)):
        raise ValueError(f"time_slice_s: must be a finite number >= 0, got {time_slice_s!r}")
    todo: list[list[tuple[str, float]]] = []
    for ph in phases:
        rank_todo = []
        for kind, s in ph:
            if kind not in ("cpu", "sleep", "pause"):
                raise ValueError(f"phases: kind must be 'cpu', 'sleep' or 'pause', got {kind!r}")
            if not (float(s) >= 0.0 and math.isfinite(float(s))):
                raise ValueError(f"phases: seconds must be finite and >= 0, got {s!r}")
            if s > 0:
                rank_todo.append((kind, float(s)))
        todo.append(rank_todo)
    return _Timeline(todo, cores, float(time_slice_s)).run()


def shared_cores_makespan_seconds(
    phases: list[list[tuple[str, float]]], cores: int, time_slice_s: float = 0.0
) -> float:
    """When the last of the ranks of :func:`shared_cores_finish_seconds` finishes: with a time
    slice the mean over the ``n`` rotations of the ranks' start order (which rank waits for a
    core first is up to the scheduler), else the one processor-sharing answer.

    >>> shared_cores_makespan_seconds([[("cpu", 1.0)]] * 3, 2, time_slice_s=4.0)
    2.0
    >>> shared_cores_makespan_seconds([[("cpu", 1.0)]] * 3, 2)
    1.5
    """
    n = len(phases)
    if n == 0:
        return 0.0
    if time_slice_s == 0.0:
        return max(shared_cores_finish_seconds(phases, cores))
    ends = [
        max(shared_cores_finish_seconds(phases[k:] + phases[:k], cores, time_slice_s))
        for k in range(n)
    ]
    return sum(ends) / n


class _Timeline:
    """The event loop of :func:`shared_cores_finish_seconds` (``todo``: each rank's phases,
    consumed as they end)."""

    def __init__(self, todo: list[list[tuple[str, float]]], cores: int, time_slice_s: float):
        self.todo, self.cores, self.slice = todo, cores, time_slice_s
        n = len(todo)
        self.finish = [0.0] * n
        self.now = 0.0
        self.queue: list[int] = []  # ready to compute, waiting for a core (round robin)
        self.running: dict[int, float] = {}  # rank -> end of its slice (round robin)
        self.computing: set[int] = set()  # ranks in a cpu phase (processor sharing)
        self.sleeping: dict[int, float] = {}  # rank -> wake-up time
        self.cpu_start = [-1.0] * n  # first moment on a core of the current cpu phase
        self.cpu_wall = [0.0] * n  # wall time of the last finished cpu phase

    def _next(self, r: int) -> None:
        """Rank ``r`` starts its next phase at ``now``."""
        ph = self.todo[r]
        while ph and ph[0][0] == "pause":
            # A pause becomes a sleep of its factor times the last compute's wall time.
            factor = ph[0][1]
            ph[0] = ("sleep", factor * self.cpu_wall[r])
            if ph[0][1] <= 0.0:
                ph.pop(0)
        if not ph:
            self.finish[r] = self.now
        elif ph[0][0] == "sleep":
            self.sleeping[r] = self.now + ph[0][1]
        elif self.slice > 0.0:
            self.queue.append(r)
        else:
            self.computing.add(r)
            self.cpu_start[r] = self.now

    def run(self) -> list[float]:
        for r in range(len(self.todo)):
            self._next(r)
        while True:
            if self.slice > 0.0:
                while self.queue and len(self.running) < self.cores:
                    r = self.queue.pop(0)
                    self.running[r] = self.now + self.slice
                    if self.cpu_start[r] < 0.0:
                        self.cpu_start[r] = self.now
                active = list(self.running)
                rate = 1.0
            else:
                active = sorted(self.computing)
                rate = min(1.0, self.cores / len(active)) if active else 1.0
            if not active and not self.sleeping:
                return self.finish
            events = [self.now + self.todo[r][0][1] / rate for r in active]
            events += list(self.running.values()) + list(self.sleeping.values())
            step = min(events) - self.now
            self.now += step
            eps = 1e-12 * max(1.0, self.now)
            for r in active:
                left = self.todo[r][0][1] - step * rate
                if left <= eps:
                    self.todo[r].pop(0)
                    self.cpu_wall[r] = self.now - self.cpu_start[r]
                    if r in self.running and self.todo[r] and self.todo[r][0][0] == "cpu":
                        self.cpu_start[r] = self.now  # computes on, on the same core and slice
                        continue
                    self.cpu_start[r] = -1.0
                    self.running.pop(r, None)
                    self.computing.discard(r)
                    self._next(r)
                    continue
                self.todo[r][0] = ("cpu", left)
                if r in self.running and self.running[r] <= self.now + eps:
                    if self.queue:  # its slice is over and others wait: to the back
                        del self.running[r]
                        self.queue.append(r)
                    else:
                        self.running[r] = self.now + self.slice
            for r, wake in list(self.sleeping.items()):
                if wake <= self.now + eps:
                    del self.sleeping[r]
                    self.todo[r].pop(0)
                    self._next(r)


def load_balance(work: Any, rates: Any) -> float:
    """Seed 002's load-balance ratio of devices given ``work`` (any unit: FLOPs, samples x
    cost) at ``rates`` (work per second): the slowest device's time over the time every device
    would take were the same total work shared in proportion to the rates,
    ``max_d (w_d / r_d) / (sum w / sum r)``. 1.0 is perfect balance.

    >>> load_balance([4.0, 2.0, 1.0], [1.0, 0.5, 0.25])
    1.0
    >>> round(load_balance([1.0, 1.0, 1.0], [1.0, 0.5, 0.25]), 3)  # equal work: 4 / (3 / 1.75)
    2.333
    """
    w = np.asarray(work, dtype=np.float64)
    r = np.asarray(rates, dtype=np.float64)
    if w.ndim != 1 or w.shape != r.shape or not len(w):
        raise ValueError(f"work, rates: need one entry per device, got {w.shape} and {r.shape}")
    if not (np.isfinite(w).all() and (w >= 0).all()):
        raise ValueError(f"work: must be finite and >= 0, got {w.tolist()}")
    if not (np.isfinite(r).all() and (r > 0).all()):
        raise ValueError(f"rates: must be finite and > 0, got {r.tolist()}")
    if not w.sum() > 0:
        raise ValueError(f"work: needs some work, got {w.tolist()}")
    return float((w / r).max() / (w.sum() / r.sum()))


def post_sends(
    now: float,
    sends: Sequence[tuple[object, float, float]],
    link_free: float,
    arrival: dict[object, float],
) -> float:
    """Non-blocking sends posted at ``now`` on a device's outgoing link, free from
    ``link_free`` on: one after another, each ``(message, latency_s, transfer_s)`` occupying
    the link ``transfer_s`` and arriving ``latency_s + transfer_s`` after its start (written
    to ``arrival``). Returns when the link is free again (the rule of every schedule
    simulation: :func:`schedule_finish_seconds` and the lab's shared-cores timeline).

    >>> arrival = {}
    >>> post_sends(1.0, [("a", 0.5, 2.0), ("b", 0.5, 1.0)], 0.0, arrival), arrival
    (4.0, {'a': 3.5, 'b': 4.5})
    """
    for message, latency_s, transfer_s in sends:
        start = max(now, link_free)
        link_free = start + transfer_s
        arrival[message] = start + latency_s + transfer_s
    return link_free


def schedule_finish_seconds(
    programs: list[list[tuple]], collectives: dict[object, tuple[int, float]]
) -> tuple[list[float], list[float]]:
    """When each device finishes its program, all starting at 0: the dependency graph of a
    step (pipeline stages, filter-split stages, replicas) simulated event by event rather than
    by a closed formula, so uneven stages and micro-batches cost what they cost. A program is a
    list of operations run in order:

    - ``("compute", s)``: ``s`` seconds of work;
    - ``("send", ((message, latency_s, transfer_s), ...))``: non-blocking sends, one after
      another over the device's outgoing link (each occupies it ``transfer_s``; ``message``
      arrives ``latency_s + transfer_s`` after its start);
    - ``("recv", message)``: waits until ``message`` has arrived;
    - ``("collective", key)``: a collective of ``collectives[key] = (participants, s)``
      (reached by that many devices): it starts when the last participant reaches it and ends
      ``s`` later for all of them;
    - ``("wait_sends",)``: waits until every message the device sent has arrived.

    Returns each device's finish time and the seconds it spent inside collectives. Raises
    ``ValueError`` if the programs deadlock (a receive with no send, a collective short of
    participants). Not in PyDTNN, whose pipeline is the closed form :func:`pipeline_seconds`,
    which this reproduces for equal stages and micro-batches on free links.

    >>> f, b = ("compute", 1.0), ("compute", 2.0)
    >>> send, recv = ("send", (("x", 0.0, 0.5),)), ("recv", "x")
    >>> schedule_finish_seconds([[f, send], [recv, b]], {})[0]
    [1.0, 3.5]
    >>> schedule_finish_seconds([[f, ("collective", 0)], [b, ("collective", 0)]], {0: (2, 1.0)})
    ([3.0, 3.0], [1.0, 1.0])
    """
    n = len(programs)
    now = [0.0] * n
    pc = [0] * n
    link_free = [0.0] * n
    sent_until = [0.0] * n
    in_collectives = [0.0] * n
    arrival: dict[object, float] = {}
    # Per collective reached: [participants so far, their latest arrival, its seconds, its end
    # (None until the last participant arrives), the devices waiting in it].
    joined: dict[object, list[Any]] = {}
    waiting: dict[object, list[int]] = {}  # per message not yet sent, the devices awaiting it
    # Each device runs until it waits, and is run again once what it waits for is there (every
    # time is a function of the dependencies alone, so the order devices run in does not
    # change it; no device is looked at while it still waits).
    ready = list(range(n - 1, -1, -1))
    while ready:
        d = ready.pop()
        prog, i, t = programs[d], pc[d], now[d]
        size = len(prog)
        while i < size:
            op = prog[i]
            kind = op[0]
            if kind == "compute":
                t += op[1]
            elif kind == "collective":
                key = op[1]
                c = joined.get(key)
                if c is None:
                    need, seconds = collectives[key]
                    c = joined[key] = [1, max(0.0, t), seconds, None, []]
                elif c[3] is None:
                    need = collectives[key][0]
                    c[0] += 1
                    c[1] = max(c[1], t)
                if c[3] is None:
                    if c[0] < need:
                        c[4].append(d)
                        break
                    end = c[3] = c[1] + c[2]
                    for w in c[4]:  # they leave it with this device
                        now[w] = end
                        in_collectives[w] += c[2]
                        pc[w] += 1
                    ready.extend(c[4])
                in_collectives[d] += c[2]
                t = c[3]
            elif kind == "recv":
                at = arrival.get(op[1])
                if at is None:
                    waiting.setdefault(op[1], []).append(d)
                    break
                t = max(t, at)
            elif kind == "send":
                link_free[d] = post_sends(t, op[1], link_free[d], arrival)
                sent_until[d] = max([sent_until[d], *(arrival[m] for m, _, _ in op[1])])
                for m, _, _ in op[1]:
                    if m in waiting:
                        ready.extend(waiting.pop(m))
            elif kind == "wait_sends":
                t = max(t, sent_until[d])
            else:
                raise ValueError(f"programs: unknown operation {kind!r}")
            i += 1
        pc[d], now[d] = i, t
    stuck = [f"device {d}: {programs[d][pc[d]]!r}" for d in range(n) if pc[d] < len(programs[d])]
    if stuck:
        raise ValueError("programs: deadlock; waiting: " + "; ".join(stuck[:4]))
    return now, in_collectives
