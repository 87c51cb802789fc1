"""Emulated heterogeneity: make one process behave like a slower device.

On one machine every rank runs on the same kind of core, so to show (and test) balancing we slow
some ranks down on purpose. :class:`EmulatedSpeed` wraps a module; after each real forward pass
it sleeps so that the rank's forward + backward takes ``1/speed`` times as long as the real
computation:

- with ``cost`` (a :class:`~hetcoll.torch.SpeedFit` of the *real* model, measured once), it sleeps
  ``(1/speed - 1) * cost.predict(batch)``: a deterministic delay that does not amplify noise;
- without it, ``(1/speed - 1) * t_forward * (1 + backward_ratio)`` from the forward pass it just
  timed (``backward_ratio`` is the backward/forward time ratio, :func:`backward_ratio`).

Sleeping frees the core, so ranks do not steal compute from each other. Every figure obtained
this way is *emulated* heterogeneity, and hetcoll's README and demo say so.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hetcoll.torch.speed import SpeedFit


class EmulatedSpeed(nn.Module):
    """``module`` running at ``speed`` times its real speed (``0 < speed <= 1``).

    ``last_forward_seconds`` holds the wall time of the latest forward, emulated delay included:
    a compute-time signal that does not include waiting for other ranks.

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
        self.module = module
        self.speed = speed
        self.backward_ratio = float(backward_ratio)
        self.cost = cost
        self.last_forward_seconds = 0.0

    def _delay(self, compute_s: float, batch: int) -> float:
        """Seconds to sleep after a forward that took ``compute_s`` on ``batch`` samples."""
        if self.speed >= 1.0:
            return 0.0
        if self.cost is not None:
            step = self.cost.predict(batch)  # forward + backward of the real model
        else:
            step = compute_s * (1.0 + self.backward_ratio)
        if not torch.is_grad_enabled():
            step /= 1.0 + self.backward_ratio  # no backward will follow
        return (1.0 / self.speed - 1.0) * step

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = self.module(*args, **kwargs)
        compute = time.perf_counter() - t0
        batch = len(args[0]) if args and hasattr(args[0], "__len__") else 1
        delay = self._delay(compute, batch)
        if delay > 0:
            time.sleep(delay)
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
