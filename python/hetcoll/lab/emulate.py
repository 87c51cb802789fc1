"""Emulated heterogeneity (lab code: may import the library, never imported by it): make one
process behave like a slower device.

On one machine every rank runs on the same kind of core, so to show (and test) balancing we slow
some ranks down on purpose. There is one mechanism, :class:`SlowDown`: module hooks put on layers
from outside (nothing in the library knows about them) that time each layer and sleep. The
sleep frees the core, so ranks do not steal compute from each other. Oversleeping
(``time.sleep`` is late by tens of microseconds) is carried over and taken off the next sleep, so
the many small sleeps add up to the intended total. It is applied three ways:

- :func:`slow_down` (``model`` or a list of layers, ``speed``): each layer sleeps
  ``(1/speed - 1)`` times its own forward after the forward, and ``(1/speed - 1)`` times its own
  backward once the backward has produced its input gradients;
- :func:`slow_down_filter_parallel`: the same on the local computation of every split layer of a
  :func:`hetcoll.torch.filter_parallel` model (its child ``layer.local``, see
  :class:`hetcoll.torch.filters.FilterParallelLayer`): the collectives around them, and the
  replicated layers, run at full speed. This is what the filter demo and ``hetcoll model
  validate`` run, and what :func:`hetcoll.lab.predict_emulated.filter_parallel` predicts;
- :class:`EmulatedSpeed` wraps a module so that its forward + backward takes ``1/speed`` times as
  long as the real computation:

  - with ``cost`` (a :class:`~hetcoll.torch.SpeedFit` of the *real* model, measured once) the
    delay of a step on ``b`` samples is ``(1/speed - 1) * cost.predict(b)``: deterministic, so
    noise is not amplified. It is spread the way a slower device spends it: layer by layer, each
    share in proportion to its real forward time, a ``1/(1 + backward_ratio)`` part after the
    layer's forward and the rest when the layer's backward starts (a tensor hook on its output).
    So a slow rank delivers its last layers' gradients early in the backward, like a real slow
    GPU, and DDP can overlap their allreduce with the rest of the backward;
  - without it, ``(1/speed - 1) * t_forward * (1 + backward_ratio)`` from the forward pass it
    just timed (``backward_ratio`` is the backward/forward time ratio, :func:`backward_ratio`),
    all slept after the forward.

(The data-parallel validation pauses once per step instead, between the forward and the
backward of DDP's step: :func:`hetcoll.lab.validate_ranks.emulate_speed`, one sleep call.)

Every figure obtained this way is *emulated* heterogeneity, and hetcoll's README and demo say so.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hetcoll.model.hardware import Device
from hetcoll.torch.expert_parallel import ExpertParallelExperts
from hetcoll.torch.filters import FilterParallelDoRA, FilterParallelExperts, FilterParallelLayer
from hetcoll.torch.speed import SpeedFit


def _check_speed(speed: float) -> float:
    speed = float(speed)
    if not 0.0 < speed <= 1.0:
        raise ValueError(f"speed: must be in (0, 1] (a fraction of the real speed), got {speed}")
    return speed


def delay_points(module: nn.Module) -> list[nn.Module]:
    """The layers that carry the delay: leaves with parameters, and modules holding parameters
    of their own above parameter-free children (Hugging Face's experts: stacked weights and an
    activation); a split layer (a filter-parallel layer, split experts, experts placed on
    ranks) counts through its local computation, so that its collectives run at full speed,
    and a split DoRA layer's magnitudes not at all (its forward sums its weight norm over the
    ranks: timed, a slow rank would sleep its wait for the others); else all leaves, else the
    root."""
    split = (FilterParallelLayer, FilterParallelExperts, ExpertParallelExperts)
    local = {id(m.local) for m in module.modules() if isinstance(m, split)}
    leaves = [m for m in module.modules() if not list(m.children())]

    def owns(m: nn.Module) -> bool:
        if isinstance(m, (*split, FilterParallelDoRA)):
            return False
        if not any(True for _ in m.parameters(recurse=False)):
            return False
        return not any(True for c in m.children() for _ in c.parameters())

    with_params = [m for m in module.modules() if id(m) in local or owns(m)]
    return with_params or leaves or [module]


class SlowDown:
    """Module hooks that make ``layers`` run at ``speed`` times their real speed (``0 < speed <=
    1``) by sleeping: the one emulation mechanism (:func:`slow_down` makes one, as do
    :func:`slow_down_filter_parallel` and :class:`EmulatedSpeed`).

    Each layer is timed from outside: a forward pre-hook and a forward hook around its forward, a
    tensor hook on its output when its backward starts and (``times_backward``) a full backward
    hook once the backward has produced the layer's input gradients. How long to sleep at each
    of these points is :meth:`forward_delay`, :meth:`backward_start_delay` and
    :meth:`backward_delay`: by default ``(1/speed - 1)`` times the forward, nothing, and
    ``(1/speed - 1)`` times the backward; :class:`EmulatedSpeed` changes them. A full backward
    hook sees a layer's inputs: a filter-parallel layer's local computation takes the weight and
    bias as inputs, so its sleep comes before their gradients are used; a plain layer's
    parameter gradients are accumulated (and DDP may send them) before it, and a layer none of
    whose inputs needs a gradient (a model's first) has no backward torch can time from
    outside: it warns, and the layer's backward is not slowed. Like every full backward hook it
    also forbids modifying the layer's output in place (``ReLU(inplace=True)`` right after it).

    ``forward_seconds``: each layer's latest forward, its real time. :meth:`remove` takes the
    hooks off; slow-downs of the same layer add up (the later one times the earlier one's
    sleeps too), so remove one before slowing a layer again. A ``copy.deepcopy`` of a slowed
    model is slowed alike, by its own copy of the hooks.

    >>> handle = slow_down(nn.Linear(4, 2), 0.25)
    >>> handle.remove()
    """

    #: Whether :meth:`backward_delay` is used (it needs the full backward hook).
    times_backward = True

    def __init__(self, layers: Iterable[nn.Module], speed: float) -> None:
        self.speed = _check_speed(speed)
        self.layers = list(layers)
        for m in self.layers:
            if not isinstance(m, nn.Module):
                raise TypeError(f"layers: must be torch.nn.Modules, got {type(m).__name__}")
        n = len(self.layers)
        self.forward_seconds = [0.0] * n
        self._forward_start = [0.0] * n
        self._backward_start: list[float | None] = [None] * n
        self._oversleep = 0.0
        self._handles: list[RemovableHandle] = []
        if self.speed < 1.0:
            for i, layer in enumerate(self.layers):
                self._attach(i, layer)

    # Hooks are partials of bound methods, so a deepcopy (measure_speed copies its model) gets
    # hooks bound to the copy, not to this object.
    def _attach(self, i: int, layer: nn.Module) -> None:
        self._handles.append(
            layer.register_forward_pre_hook(functools.partial(self._before_forward, i))
        )
        self._handles.append(layer.register_forward_hook(functools.partial(self._after_forward, i)))
        if self.times_backward:
            self._handles.append(
                layer.register_full_backward_hook(functools.partial(self._after_backward, i))
            )

    def remove(self) -> None:
        """Take every hook off: the layers run at their real speed again."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- how long to sleep (subclasses change these) ---------------------------------------------

    def forward_delay(self, i: int, seconds: float, backward: bool) -> float:
        """Seconds layer ``i`` sleeps after a forward that took ``seconds``; ``backward``: a
        backward will pass through the layer."""
        return (1.0 / self.speed - 1.0) * seconds

    def backward_start_delay(self, i: int) -> float:
        """Seconds layer ``i`` sleeps when its backward starts."""
        return 0.0

    def backward_delay(self, i: int, seconds: float) -> float:
        """Seconds layer ``i`` sleeps after a backward that took ``seconds``."""
        return (1.0 / self.speed - 1.0) * seconds

    def sleep(self, seconds: float) -> None:
        """Sleep ``seconds`` less what earlier sleeps overshot."""
        target = seconds - self._oversleep
        if target <= 0.0:
            self._oversleep = -target
            return
        t0 = time.perf_counter()
        time.sleep(target)
        self._oversleep = max(0.0, time.perf_counter() - t0 - target)

    # -- the hooks -------------------------------------------------------------------------------

    def _before_forward(self, i: int, _module: nn.Module, _args: Any) -> None:
        self._forward_start[i] = time.perf_counter()

    def _after_forward(self, i: int, _module: nn.Module, args: Any, out: Any) -> None:
        seconds = time.perf_counter() - self._forward_start[i]
        self.forward_seconds[i] = seconds
        backward = isinstance(out, torch.Tensor) and out.requires_grad and torch.is_grad_enabled()
        self._backward_start[i] = None
        # Time the backward only where torch can end it: when an input needs a gradient. (Else
        # the full backward hook fires at the output, before this start; a start left set
        # would then time a later micro-batch's whole backward, when several forwards run
        # before their backwards, as in GPipe.)
        timed = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        if backward:
            out.register_hook(functools.partial(self._backward_starts, i, timed))
        self._sleep_if(self.forward_delay(i, seconds, backward))

    def _backward_starts(self, i: int, timed: bool, _grad: torch.Tensor) -> None:
        self._sleep_if(self.backward_start_delay(i))
        if timed:
            self._backward_start[i] = time.perf_counter()

    def _after_backward(self, i: int, _module: nn.Module, _grad_in: Any, _grad_out: Any) -> None:
        # No start: torch fired the hook at the layer's output, as it does when none of the
        # layer's inputs needs a gradient (a model's first layer); there is no backward to time.
        start, self._backward_start[i] = self._backward_start[i], None
        if start is not None:
            self._sleep_if(self.backward_delay(i, time.perf_counter() - start))

    def _sleep_if(self, seconds: float) -> None:
        if seconds > 0.0:
            self.sleep(seconds)


def slow_down(model_or_layers: nn.Module | Iterable[nn.Module], speed: float) -> SlowDown:
    """Make ``model_or_layers`` run at ``speed`` times its real speed (``0 < speed <= 1``), from
    outside: a model's :func:`delay_points`, or the given layers, each sleep ``(1/speed - 1)``
    times their own forward and backward (:class:`SlowDown`, whose ``remove()`` undoes it).

    >>> handle = slow_down(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), 0.5)
    >>> len(handle.layers)
    2
    """
    if isinstance(model_or_layers, nn.Module):
        return SlowDown(delay_points(model_or_layers), speed)
    if isinstance(model_or_layers, (str, bytes)) or not isinstance(model_or_layers, Iterable):
        raise TypeError(
            "model_or_layers: must be a torch.nn.Module or an iterable of them, got "
            f"{type(model_or_layers).__name__}"
        )
    return SlowDown(model_or_layers, speed)


def slow_down_filter_parallel(model: nn.Module, speed: float) -> SlowDown:
    """A filter-parallel rank at ``speed``: the local computation of every split layer of
    ``model`` (:func:`hetcoll.torch.filter_parallel`) sleeps ``(1/speed - 1)`` times its own
    forward and backward; the collectives and the replicated layers run at full speed. (Was
    ``hetcoll.torch.set_emulated_speed``.)

    >>> slow_down_filter_parallel(model, 0.25)  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: must be a torch.nn.Module, got {type(model).__name__}")
    return SlowDown([m.local for m in model.modules() if isinstance(m, FilterParallelLayer)], speed)


class _AfterForward(SlowDown):
    """:class:`EmulatedSpeed` without a cost: on the whole module, the step's delay follows from
    the forward's own time and is all slept after it."""

    times_backward = False

    def __init__(self, module: nn.Module, speed: float, backward_ratio: float) -> None:
        super().__init__([module], speed)
        self.backward_ratio = backward_ratio
        self.active = False

    def forward_delay(self, i: int, seconds: float, backward: bool) -> float:
        if not self.active:
            return 0.0
        delay = (1.0 / self.speed - 1.0) * seconds * (1.0 + self.backward_ratio)
        if not torch.is_grad_enabled():
            delay /= 1.0 + self.backward_ratio  # no backward will follow
        return delay


class _CostShares(SlowDown):
    """:class:`EmulatedSpeed` with a cost: the step's delay (set per step) spread over the
    layers in proportion to their real forward times."""

    times_backward = False

    def __init__(self, module: nn.Module, speed: float, backward_ratio: float) -> None:
        super().__init__(delay_points(module), speed)
        self.backward_ratio = backward_ratio
        self.step_delay = 0.0  # delay of the forward in flight (forward + backward parts)
        self.active = False
        n = len(self.layers)
        # Each layer's share of the delay: its real forward time, smoothed over calls.
        self._weights = [1.0 / n] * n
        self._pending = [0.0] * n  # the backward part, slept when the layer's backward starts

    def forward_delay(self, i: int, seconds: float, backward: bool) -> float:
        if not self.active:
            return 0.0
        share = self.step_delay * self._weights[i]
        later = share * self.backward_ratio / (1.0 + self.backward_ratio)
        if backward:
            self._pending[i] = later
            return share - later
        # No backward will pass this layer: its whole share goes here (none of the backward's
        # part without grad mode: no backward at all).
        return share if torch.is_grad_enabled() else share - later

    def backward_start_delay(self, i: int) -> float:
        seconds, self._pending[i] = self._pending[i], 0.0
        return seconds

    def reweight(self) -> None:
        """Smooth each layer's share of the delay towards its share of this forward's time."""
        total = sum(self.forward_seconds)
        if total <= 0.0:
            return
        self._weights = [
            0.5 * w + 0.5 * s / total for w, s in zip(self._weights, self.forward_seconds)
        ]
        norm = sum(self._weights)
        self._weights = [w / norm for w in self._weights]


class EmulatedSpeed(nn.Module):
    """``module`` running at ``speed`` times its real speed (``0 < speed <= 1``).

    ``last_forward_seconds`` holds the wall time of the latest forward, its share of the emulated
    delay included: a compute-time signal that does not include waiting for other ranks.
    ``slowdown``: the :class:`SlowDown` whose hooks sleep.

    >>> slow = EmulatedSpeed(nn.Linear(4, 2), speed=0.25)
    """

    def __init__(
        self,
        module: nn.Module,
        speed: float,
        *,
        backward_ratio: float = 2.0,
        cost: SpeedFit | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module: must be a torch.nn.Module, got {type(module).__name__}")
        speed = _check_speed(speed)
        if not backward_ratio >= 0.0:
            raise ValueError(f"backward_ratio: must be >= 0, got {backward_ratio}")
        if cost is not None and not isinstance(cost, SpeedFit):
            raise TypeError(f"cost: must be a SpeedFit or None, got {type(cost).__name__}")
        self.module = module
        self.speed = speed
        self.backward_ratio = float(backward_ratio)
        self.cost = cost
        self.last_forward_seconds = 0.0
        self.slowdown: _AfterForward | _CostShares = (
            _AfterForward(module, speed, self.backward_ratio)
            if cost is None
            else _CostShares(module, speed, self.backward_ratio)
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        batch = len(args[0]) if args and hasattr(args[0], "__len__") else 1
        t0 = time.perf_counter()
        slowdown = self.slowdown
        if isinstance(slowdown, _CostShares) and self.cost is not None and self.speed < 1.0:
            # forward + backward of the real model
            slowdown.step_delay = (1.0 / self.speed - 1.0) * self.cost.predict(batch)
        slowdown.active = True
        try:
            out = self.module(*args, **kwargs)
        finally:
            slowdown.active = False
        if isinstance(slowdown, _CostShares) and self.speed < 1.0:
            slowdown.reweight()
        self.last_forward_seconds = time.perf_counter() - t0
        return out


def backward_ratio(
    model: nn.Module,
    make_batch: Callable[[int], tuple[Any, Any]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    batch_size: int = 32,
    repeats: int = 5,
) -> float:
    """Median backward/forward time ratio of ``model`` at ``batch_size`` (on a copy)."""
    m = copy.deepcopy(model)
    x, y = make_batch(batch_size)
    ratios = []
    for i in range(repeats + 1):
        m.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = loss_fn(m(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if i:  # the first run warms up
            ratios.append((t2 - t1) / max(t1 - t0, 1e-9))
    return float(statistics.median(ratios))


def emulated_device(device: Device, speed: float, name: str | None = None) -> Device:
    """How a rank slowed to ``speed`` looks to the planner: ``device`` with every rate times
    ``speed`` and its per-kernel overhead divided by it (:func:`slow_down` stretches each
    layer's forward and backward by ``1/speed``). For planning; the validation's predictions
    model the sleeps themselves (:mod:`hetcoll.lab.predict_emulated`)."""
    if not 0 < speed <= 1:
        raise ValueError(f"speed: must be in (0, 1], got {speed!r}")
    return dataclasses.replace(
        device,
        name=device.name if name is None else name,
        flops_per_s=device.flops_per_s * speed,
        conv_flops_per_s=device.conv_rate * speed,
        mem_bytes_per_s=device.mem_bytes_per_s * speed,
        elementwise_bytes_per_s=device.elementwise_rate * speed,
        pool_bytes_per_s=device.pool_rate * speed,
        first_touch_bytes_per_s=device.first_touch_bytes_per_s * speed,
        kernel_overhead_s=device.kernel_overhead_s / speed,
        conv_overhead_s=device.conv_call_s / speed,
    )
