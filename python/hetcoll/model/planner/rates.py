"""How fast each device trains the model: the numbers the planner's splits and bounds read
(effective FLOP/s, seconds per sample), each computed once per kind of device."""

from __future__ import annotations

import functools
from typing import Any

from hetcoll.model import predict
from hetcoll.model.costs import ModelCosts
from hetcoll.model.hardware import Cluster


def device_speeds(costs: ModelCosts, cluster: Cluster, batch: int) -> list[float]:
    """Effective FLOP/s of each device on this model at ``batch`` samples (roofline included),
    for splitting filters in proportion to speed."""
    flops = costs.forward_flops(batch) + costs.backward_flops(batch)
    out = []
    cache: dict[str, float] = {}
    for d in cluster.devices:
        if d.name not in cache:
            cache[d.name] = flops / max(predict.compute_seconds(costs, d, batch), 1e-30)
        out.append(cache[d.name])
    return out


def per_sample_seconds(costs: ModelCosts, cluster: Cluster, batch: int) -> list[float]:
    """Each device's forward + backward seconds per sample at ``batch`` samples: the least it
    spends per sample at any batch up to ``batch`` (every kernel's roofline time over its
    samples falls as they grow), so a lower bound of any plan's compute."""
    cache: dict[Any, float] = {}
    out = []
    for d in cluster.devices:
        if d not in cache:
            cache[d] = predict.compute_seconds(costs, d, batch) / batch
        out.append(cache[d])
    return out


@functools.lru_cache(maxsize=4096)
def _kind_seconds_per_sample(costs: ModelCosts, device: Any, batch: int) -> float:
    return predict.compute_seconds(costs, device, batch) / batch


def seconds_per_sample(costs: ModelCosts, cluster: Cluster, d: int, batch: int) -> float:
    """Forward + backward seconds per sample of device ``d`` at ``batch`` samples (cached per
    kind of device: the bounds ask for every shape's micro-batch)."""
    return _kind_seconds_per_sample(costs, cluster.devices[d], batch)


def flops_rate(costs: ModelCosts, seconds_per_sample: float, batch: int) -> float:
    """FLOP/s of a device that trains one sample in ``seconds_per_sample`` at ``batch``
    samples (work done once a step whatever the batch, a constant table's, shared among
    them as in :func:`per_sample_seconds`)."""
    flops = costs.forward_flops(batch) + costs.backward_flops(batch)
    return flops / batch / max(seconds_per_sample, 1e-30)
