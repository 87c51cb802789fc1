"""Pipelines of one-device stages: stage cuts (:func:`pipeline_stages`, :func:`chain_stages`) and
their prediction (:func:`pipeline`), as plans."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

import hetcoll
from hetcoll.model import terms
from hetcoll.model.costs import ModelCosts
from hetcoll.model.hardware import Cluster
from hetcoll.model.predict.layout import ReplicaLayout, StageLayout
from hetcoll.model.predict.prediction import Prediction
from hetcoll.model.predict.schedule import layout_schedule
from hetcoll.model.predict.timing import (
    _check_shares,
    _layer_times,
    check_costs_and_cluster,
    device_arrays,
)
from hetcoll.plan import Plan


def _pipeline_units(costs: ModelCosts) -> list[int]:
    """Where a pipeline may cut, in costed layers: the start of every plan layer that holds a
    costed layer (a plan layer without one, such as a traced ``torch.flatten``, goes with the
    layer before it), or every layer when the model has no plan layers."""
    if not costs.plan_layers:
        return list(range(len(costs.layers) + 1))
    of = costs.plan_layer_of
    cuts = [0] + [i for i in range(1, len(of)) if of[i] != of[i - 1]]
    return [*cuts, len(of)]


def pipeline_stages(
    costs: ModelCosts, cluster: Cluster, batch: int, micro_batches: int
) -> list[int]:
    """Layers per device (costed layers, in device order) of the exact chain partition on
    the devices' speeds for this model (:func:`hetcoll.partition_chain`), at a micro-batch of
    ``ceil(batch / micro_batches)``, cutting only where a :class:`hetcoll.Plan` can (between
    top-level layers)."""
    n_dev = cluster.num_devices
    micro = math.ceil(batch / micro_batches)
    lt = _layer_times(costs, device_arrays(cluster.devices), np.full(n_dev, micro))
    per_layer_dev = lt.forward_s + lt.backward_s
    cuts = _pipeline_units(costs)
    unit_flops = [
        sum(x.forward_flops(micro) + x.backward_flops(micro) for x in costs.layers[a:b])
        for a, b in itertools.pairwise(cuts)
    ]
    total_flops = max(sum(unit_flops), 1e-30)
    # Devices of one kind have equal columns: each kind's speed computed once.
    kind = device_arrays(cluster.devices).kind
    _, first = np.unique(kind, return_index=True)
    of_kind = [total_flops / max(float(per_layer_dev[:, d].sum()), 1e-30) for d in first]
    speeds = [of_kind[k] for k in kind.tolist()]
    link = cluster.ring_link()
    bandwidth = link.bytes_per_s if math.isfinite(link.bytes_per_s) else None
    boundary = [2 * _boundary_bytes(costs, b) * micro for b in cuts[1:-1]]
    units = hetcoll.partition_chain(
        unit_flops, speeds, boundary_bytes=boundary if bandwidth else None, bandwidth=bandwidth
    )
    out, at = [], 0
    for u in units:
        out.append(cuts[at + u] - cuts[at])
        at += u
    return out


def chain_stages(
    costs: ModelCosts,
    stage_speeds: Sequence[float],
    micro: int,
    bandwidth: float | None = None,
) -> list[tuple[int, int]]:
    """Plan-layer ranges ``(first, end)`` of pipeline stages of the given speeds (FLOP/s, in
    stage order; a stage of several devices counts their sum), chosen by the exact dynamic
    programme over layer cuts (:func:`hetcoll.partition_chain`: the smallest bottleneck of a
    stage's FLOPs at a micro-batch of ``micro`` over its speed, plus the activations and their
    gradients it sends over ``bandwidth`` bytes/s; None: free links). A stage given no layer
    gets an empty range ``(x, x)``.

    >>> chain_stages(costs, [2e12, 1e12], 32)  # doctest: +SKIP
    [(0, 6), (6, 11)]
    """
    speeds = [float(x) for x in stage_speeds]
    if not speeds or any(not math.isfinite(x) or x <= 0 for x in speeds):
        raise ValueError(f"stage_speeds: must be finite numbers > 0, one per stage, got {speeds}")
    if isinstance(micro, bool) or not isinstance(micro, (int, np.integer)) or micro < 1:
        raise ValueError(f"micro: must be an integer >= 1, got {micro!r}")
    if bandwidth is not None and not (math.isfinite(bandwidth) and bandwidth > 0):
        raise ValueError(f"bandwidth: must be a finite number > 0 or None, got {bandwidth!r}")
    costs.check_plan_layers()
    cuts = _pipeline_units(costs)
    unit_flops = [
        sum(x.forward_flops(micro) + x.backward_flops(micro) for x in costs.layers[a:b])
        for a, b in itertools.pairwise(cuts)
    ]
    boundary = [2 * _boundary_bytes(costs, b) * micro for b in cuts[1:-1]]
    units = hetcoll.partition_chain(
        unit_flops,
        speeds,
        boundary_bytes=boundary if bandwidth else None,
        bandwidth=bandwidth if bandwidth else None,
    )
    of, n = costs.plan_layer_of, len(costs.plan_layers)

    def plan_layer(c: int) -> int:  # the plan layer costed layer c starts (n: the end)
        return 0 if c == 0 else (of[c] if c < len(of) else n)

    out, at = [], 0
    for u in units:
        first = plan_layer(cuts[at])
        end = n if at + u == len(cuts) - 1 else plan_layer(cuts[at + u])
        out.append((first, end) if u else (first, first))
        at += u
    return out


def _boundary_bytes(costs: ModelCosts, cut: int) -> float:
    """Bytes per sample a stage ending before costed layer ``cut`` sends: its plan layer's
    output when the cut is between plan layers, else the last costed layer's."""
    of = costs.plan_layer_of
    if of and 0 < cut < len(of) and of[cut - 1] != of[cut]:
        return costs.plan_out_bytes[of[cut] - 1]
    return costs.layers[cut - 1].out_bytes_per_sample


def pipeline(
    costs: ModelCosts,
    cluster: Cluster,
    batch: int,
    micro_batches: int,
    *,
    layers_per_device: Sequence[int] | None = None,
    optimizer_state_copies: int = 1,
    strategy: str = "pipeline",
    schedule: str = "GPipe",
) -> Prediction:
    """One pipeline step: ``batch`` in ``micro_batches`` near-equal micro-batches through
    contiguous one-device stages (``layers_per_device``, costed layers in device order;
    default :func:`pipeline_stages`), each stage handing its output forward and the gradient
    back to the next non-empty device, under ``schedule`` (GPipe or 1F1B). The step is
    :func:`predict_plan`'s simulation of that plan (devices without layers idle): for equal
    stages and micro-batches on free links, ``(m + S - 1)`` times a stage's forward and
    backward (:func:`terms.pipeline_seconds`). ``shares`` are layers per device.
    """
    check_costs_and_cluster(costs, cluster)
    devices = cluster.devices
    n_dev, n_layers = len(devices), len(costs.layers)
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches: must be an integer >= 1, got {micro_batches!r}")
    terms.batch_argument(batch, micro_batches, " (micro_batches)")
    if schedule not in ("GPipe", "1F1B"):
        raise ValueError(f"schedule: must be 'GPipe' or '1F1B', got {schedule!r}")
    if layers_per_device is None:
        layers_per_device = pipeline_stages(costs, cluster, batch, micro_batches)
    counts = _check_shares(layers_per_device, n_dev, "layers_per_device")
    if int(counts.sum()) != n_layers:
        raise ValueError(
            f"layers_per_device: must sum to {n_layers} layers, got {int(counts.sum())}"
        )
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    used = [d for d in range(n_dev) if counts[d] > 0]
    stages = tuple(
        StageLayout(
            (d,),
            int(starts[d]),
            int(starts[d + 1]),
            _boundary_bytes(costs, int(starts[d + 1])) if k + 1 < len(used) else 0.0,
        )
        for k, d in enumerate(used)
    )
    q, rem = divmod(batch, micro_batches)
    micro = tuple([q + 1] * rem + [q] * (micro_batches - rem))
    pred = layout_schedule(
        costs,
        cluster,
        [ReplicaLayout(batch, micro, stages)],
        schedule,
        optimizer_state_copies,
        strategy,
    ).prediction()
    pred.shares = [int(x) for x in counts]
    pred.share_unit = "layers"
    try:
        pred.plan = _pipeline_plan(costs, stages, batch, micro_batches, schedule)
    except ValueError as e:
        pred.plan_note = str(e)
    return pred


def _pipeline_plan(
    costs: ModelCosts,
    stages: Sequence[StageLayout],
    batch: int,
    micro_batches: int,
    schedule: str,
) -> Plan:
    costs.check_plan_layers()
    of, n = costs.plan_layer_of, len(costs.plan_layers)
    out = []
    for k, st in enumerate(stages):
        if k + 1 < len(stages) and of[st.hi - 1] == of[st.hi]:
            raise ValueError(
                f"layers_per_device: the stage of device {st.ranks[0]} ends inside top-level "
                f"layer {costs.plan_layers[of[st.hi]]!r}; a plan cuts between top-level layers"
            )
        first = 0 if k == 0 else of[st.lo]
        end = n if k + 1 == len(stages) else of[st.hi]
        out.append({"ranks": list(st.ranks), "layers": [first, end]})
    return Plan.from_dict(
        {
            "microbatches": micro_batches,
            "schedule": schedule,
            "replicas": [{"samples": batch, "stages": out}],
        }
    )
