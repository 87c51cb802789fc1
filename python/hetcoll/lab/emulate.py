"""Emulated heterogeneity (lab code: may import the library, never imported by it): make one
process behave like a slower device.

On one machine every rank runs on the same kind of core, so to show (and test) balancing we slow
some ranks down on purpose. :class:`EmulatedSpeed` wraps a module so that its forward + backward
takes ``1/speed`` times as long as the real computation. The extra time is slept, which frees
the core, so ranks do not steal compute from each other:

- with ``cost`` (a :class:`~hetcoll.torch.SpeedFit` of the *real* model, measured once) the delay
  of a step on ``b`` samples is ``(1/speed - 1) * cost.predict(b)``: deterministic, so noise is not
  amplified;
- without it, ``(1/speed - 1) * t_forward * (1 + backward_ratio)`` from the forward pass it just
  timed (``backward_ratio`` is the backward/forward time ratio, :func:`backward_ratio`).

With ``cost`` the delay is spread the way a slower device spends it: layer by layer, each share in
proportion to its real forward time, a ``1/(1 + backward_ratio)`` part after the layer's forward
and the rest when the layer's backward starts (a tensor hook on its output). So a slow rank
delivers its last layers' gradients early in the backward, like a real slow GPU, and DDP can
overlap their allreduce with the rest of the backward. (Without ``cost`` the delay follows from
the forward's own time, so it is all slept after the forward.) Oversleeping (``time.sleep`` is
late by tens of microseconds) is carried over and taken off the next sleep, so the many small
sleeps add up to the intended total. Every figure obtained this way is *emulated* heterogeneity, and
hetcoll's README and demo say so.
"""

from __future__ import annotations

import copy
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hetcoll.torch.speed import SpeedFit


def delay_points(module: nn.Module) -> list[nn.Module]:
    """The layers that carry the delay: leaves with parameters, else all leaves, else the root."""
    leaves = [m for m in module.modules() if not list(m.children())]
    with_params = [m for m in leaves if any(True for _ in m.parameters(recurse=False))]
    return with_params or leaves or [module]


class EmulatedSpeed(nn.Module):
    """``module`` running at ``speed`` times its real speed (``0 < speed <= 1``).

    ``last_forward_seconds`` holds the wall time of the latest forward, its share of the emulated
    delay included: a compute-time signal that does not include waiting for other ranks.

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
        speed = float(speed)
        if not 0.0 < speed <= 1.0:
            raise ValueError(
                f"speed: must be in (0, 1] (a fraction of the real speed), got {speed}"
            )
        if not backward_ratio >= 0.0:
            raise ValueError(f"backward_ratio: must be >= 0, got {backward_ratio}")
        if cost is not None and not isinstance(cost, SpeedFit):
            raise TypeError(f"cost: must be a SpeedFit or None, got {type(cost).__name__}")
        self.module = module
        self.speed = speed
        self.backward_ratio = float(backward_ratio)
        self.cost = cost
        self.last_forward_seconds = 0.0
        points = delay_points(module)
        # Each layer's share of the delay: its real forward time, smoothed over calls.
        self._weights = [1.0 / len(points)] * len(points)
        self._layer_seconds = [0.0] * len(points)
        self._step_delay = 0.0  # delay of the forward in flight (forward + backward parts)
        self._oversleep = 0.0
        self._active = False
        if speed < 1.0:
            for i, layer in enumerate(points):
                layer.register_forward_pre_hook(functools.partial(self._pre_hook, i))
                layer.register_forward_hook(functools.partial(self._post_hook, i))

    # -- the delay, spread over the layers -------------------------------------------------------

    def _sleep(self, seconds: float) -> None:
        """Sleep ``seconds`` less what earlier sleeps overshot."""
        target = seconds - self._oversleep
        if target <= 0.0:
            self._oversleep = -target
            return
        t0 = time.perf_counter()
        time.sleep(target)
        self._oversleep = max(0.0, time.perf_counter() - t0 - target)

    # Hooks are partials of bound methods, so a deepcopy (measure_speed copies its model) gets
    # hooks bound to the copy, not to this object.
    def _pre_hook(self, i: int, _module: nn.Module, _args: Any) -> None:
        self._layer_seconds[i] = time.perf_counter()

    def _post_hook(self, i: int, _module: nn.Module, _args: Any, out: Any) -> None:
        if not self._active:
            return
        self._layer_seconds[i] = time.perf_counter() - self._layer_seconds[i]
        share = self._step_delay * self._weights[i]
        backward = share * self.backward_ratio / (1.0 + self.backward_ratio)
        if isinstance(out, torch.Tensor) and out.requires_grad and torch.is_grad_enabled():
            out.register_hook(functools.partial(self._backward_hook, backward))
            self._sleep(share - backward)
        else:  # no backward will pass this layer: its whole share goes here
            self._sleep(share if torch.is_grad_enabled() else share - backward)

    def _backward_hook(self, seconds: float, _grad: torch.Tensor) -> None:
        self._sleep(seconds)

    def _delay(self, compute_s: float, batch: int) -> float:
        """Total emulated delay (forward + backward) of a step on ``batch`` samples."""
        if self.speed >= 1.0:
            return 0.0
        if self.cost is not None:
            step = self.cost.predict(batch)  # forward + backward of the real model
        else:
            step = compute_s * (1.0 + self.backward_ratio)
        return (1.0 / self.speed - 1.0) * step

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        batch = len(args[0]) if args and hasattr(args[0], "__len__") else 1
        t0 = time.perf_counter()
        if self.speed < 1.0 and self.cost is None:
            # The delay follows from this forward's real time: run it, then sleep it all here.
            out = self.module(*args, **kwargs)
            delay = self._delay(time.perf_counter() - t0, batch)
            if not torch.is_grad_enabled():
                delay /= 1.0 + self.backward_ratio  # no backward will follow
            self._sleep(delay)
        else:
            self._step_delay = self._delay(0.0, batch)
            self._active = self._step_delay > 0.0
            try:
                out = self.module(*args, **kwargs)
            finally:
                self._active = False
            self._reweight()
        self.last_forward_seconds = time.perf_counter() - t0
        return out

    def _reweight(self) -> None:
        """Smooth each layer's share of the delay towards its share of this forward's time."""
        total = sum(self._layer_seconds)
        if self.speed >= 1.0 or total <= 0.0:
            return
        self._weights = [
            0.5 * w + 0.5 * s / total for w, s in zip(self._weights, self._layer_seconds)
        ]
        norm = sum(self._weights)
        self._weights = [w / norm for w in self._weights]


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
