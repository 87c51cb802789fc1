"""The planner: which strategy, which split, how fast - and how that changes along seed 003's five
axes (batch size, device FLOP/s, memory bandwidth, link bandwidth, cluster size).

:func:`plan` costs every candidate of its space and ranks them: feasible plans first, fastest
first. Each candidate carries the :class:`hetcoll.Plan` the runtime runs (built when first
read: a plan of 10,240 replicas takes longer to build and check than to cost). The space:

- data parallel with balanced and with even shares; filter parallel (one stage over the
  devices, filters split by speed);
- one pipeline of one-device stages over the cluster, 1 to 32 micro-batches, GPipe and 1F1B
  (the same bubble; 1F1B keeps fewer micro-batches' activations, which the predictor counts);
- replicated pipelines: replicas of S = 2, 4, 8 stages of g = 1, 2, 4, 8 devices of one node
  (g > 1: a filter-split stage), S, 2S or 4S micro-batches, both schedules. Each kind of device
  forms replicas of its own; the samples are split over all replicas in proportion to their
  speed; each kind's stage boundaries are the exact dynamic programme over the top-level layer
  cuts (:func:`hetcoll.partition_chain` through :func:`predict.chain_stages`: the smallest
  bottleneck of a stage's FLOPs over its devices' speed plus what its cut sends over the link
  to the next stage);
- device subsets: the fastest k kinds of device, the strongest node, and on clusters of up to
  ``SUBSET_FULL_SEARCH_MAX_DEVICES`` devices the first 1, 2, 4, ... nodes, each with the
  strategies above (the large clusters' subsets with data and filter parallelism and the
  replicated pipelines);
- asymmetric replicas (clusters of up to ``ASYMMETRIC_MAX_DEVICES`` devices): whole-model
  replicas on the fast kinds beside one pipeline or filter-split replica of the rest;
- node-wise placements (seed 002), when the model itself is given: the hypergraph partition,
  the even and the speed-proportional channel split, on at most ``OWNERS_MAX_DEVICES``
  devices (all of them, or the strongest subset that small), with seed 002's comparison
  (:class:`SearchReport`).

How it stays fast:

- **Kinds, not devices.** Devices of one kind doing the same work are timed once
  (:mod:`hetcoll.model.predict` times distinct columns), and replicas that run alike are
  simulated once: a plan of 2,560 replicas of two kinds simulates two.
- **Bounds.** A pipeline of S stages and m micro-batches idles at least (S - 1) / (m + S - 1) of
  its step (fill and drain), so its step is at least ``floor * (m + S - 1) / m``, where
  ``floor`` is the batch's compute spread perfectly over the devices it uses, each at its
  per-sample time at the shape's largest micro-batch (a device's time per sample only falls as
  its batch grows: every kernel's roofline is a maximum of terms linear in the batch with
  non-negative intercepts, plus a launch; so small micro-batches, paying their launches, bound
  high). The
  cheap candidates (data and filter parallelism, subsets) are costed first; then a pipeline
  whose bound is not below the best step found so far is not costed (counted in
  ``SearchReport.pruned``), and the replicated pipelines are costed best bound first.
- **A work budget.** Costing a replicated pipeline still reads each of its devices a few
  times (numpy: replicas are grouped into classes of alike replicas by their devices' kinds
  and links), so they are costed best bound first until ``HYBRID_WORK_BUDGET``
  device-candidates are spent: every shape up to about 10,240 devices, the most promising
  beyond.
- **Node-wise plans on small sets only** (``OWNERS_MAX_DEVICES``): each is a partition of the
  model's every filter and neuron and a replay of its schedule in Python.

:func:`explain` says why a plan takes its time (its bottleneck term); :func:`plot_plans` draws
predicted step time by plan; :func:`sweep` re-plans along one axis.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

import hetcoll
from hetcoll.model import predict, terms
from hetcoll.model.costs import ModelCosts
from hetcoll.model.hardware import Cluster
from hetcoll.model.predict import Prediction
from hetcoll.plan import Plan

PIPELINE_MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
#: Micro-batch counts of the pipeline replica beside whole-model replicas.
ASYMMETRIC_MICRO_BATCHES = (2, 4, 8)
#: The largest cluster the planner tries asymmetric replicas on (each candidate is a
#: simulation of every device's step; the other candidates are vectorised over devices).
ASYMMETRIC_MAX_DEVICES = 64
#: Stages per replica of the replicated pipelines (each stage a group of devices of one node).
HYBRID_STAGES = (2, 4, 8)
#: Devices per stage of the replicated pipelines (a filter-split stage when more than one).
HYBRID_GROUP_SIZES = (1, 2, 4, 8)
#: Micro-batches per replica of a replicated pipeline of S stages: S times these (fewer leave
#: a bubble of at least (S - 1) / (m + S - 1) of the step, which the bound prunes anyway).
HYBRID_MICRO_PER_STAGE = (1, 2, 4)
#: How much work the replicated pipelines may take, in device-candidates (a candidate on 10,240
#: devices costs 10,240): their shapes are costed best bound first until it is spent. Every
#: shape of a 10,240-device cluster fits (about 50 of them); on larger ones the most promising
#: are costed (numpy reads every device of a candidate's plan a few times; the simulation
#: itself runs one replica of each class).
HYBRID_WORK_BUDGET = 1_000_000
#: The largest micro-batch count the planner tries.
MAX_MICRO_BATCHES = 32
#: Node-wise (owners) plans are searched on one set of at most this many devices, for models of
#: at most ``OWNERS_MAX_VERTICES`` filters and neurons: each is a run of the hypergraph
#: partitioner (:func:`hetcoll.partition_hypergraph`) over every filter and neuron, whose time
#: grows faster than their number, and a replay of the placement's schedule
#: (:func:`~hetcoll.model.predict_placement`), which steps every channel block of every
#: micro-batch in Python. Measured here (2 shared cores, load average 9): the built-in `cnn`
#: (714 filters and neurons) partitions into 2 / 4 / 8 parts in 0.19 / 0.24 / 0.28 s, the
#: built-in `vgg` (3,786) in 4.0 / 6.5 / 6.1 s - a partition of a larger model costs more than
#: the rest of the search. Call :func:`~hetcoll.model.hypergraph_plan` and
#: :func:`~hetcoll.model.predict_placement` directly for those.
OWNERS_MAX_DEVICES = 8
#: See ``OWNERS_MAX_DEVICES``.
OWNERS_MAX_VERTICES = 1500
#: On clusters of up to this many devices, the planner tries the first 1, 2, 4, ... nodes (or
#: devices) too, with every strategy on each subset; on larger ones, fewer subsets with the
#: balanced data- and filter-parallel splits only.
SUBSET_FULL_SEARCH_MAX_DEVICES = 64


def _infeasible(strategy: str, batch: int, num_devices: int, unit: str, reason: str) -> Prediction:
    return Prediction(
        strategy,
        [0] * num_devices,
        unit,
        float("inf"),
        {},
        [0.0] * num_devices,
        False,
        reason,
        batch,
    )


def _device_speeds(costs: ModelCosts, cluster: Cluster, batch: int) -> list[float]:
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


def _runnable(pred: Prediction, costs: ModelCosts) -> Prediction:
    """Mark a candidate the runtime cannot run infeasible (when the model can be cut into a
    plan at all; otherwise plans are not asked for and the prediction stands)."""
    if costs.plan_layers and not pred.has_plan and pred.feasible:
        pred.feasible = False
        pred.reason = f"the runtime cannot run it: {pred.plan_note}"
    return pred


def _on_devices(pred: Prediction, keep: Sequence[int], num_devices: int, suffix: str) -> Prediction:
    """A prediction made on the sub-cluster of devices ``keep``, in the whole cluster's device
    numbering: the others idle."""
    shares = [0] * num_devices
    memory = [0.0] * num_devices
    for j, d in enumerate(keep):
        shares[d] = pred.shares[j]
        memory[d] = pred.memory_bytes[j]
    factory = None
    if pred.has_plan:

        def factory() -> Plan:
            doc = pred.to_plan().to_dict()
            for r in doc["replicas"]:
                for st in r["stages"]:
                    st["ranks"] = [keep[x] for x in st["ranks"]]
            return Plan.from_dict(doc)

    detail = {**pred.detail, "devices": list(keep)}
    if "critical_device" in detail:
        detail["critical_device"] = keep[detail["critical_device"]]
    return replace(
        pred,
        strategy=f"{pred.strategy}{suffix}",
        shares=shares,
        memory_bytes=memory,
        plan=None,
        plan_factory=factory,
        detail=detail,
    )


def _tiers(cluster: Cluster, speeds: Sequence[float]) -> list[list[int]]:
    """Devices grouped by kind (equal :class:`Device`), fastest kind first."""
    kinds: dict[Any, list[int]] = {}
    for d, device in enumerate(cluster.devices):
        kinds.setdefault(device, []).append(d)
    return sorted(kinds.values(), key=lambda ds: (-speeds[ds[0]], ds[0]))


def _subsets(cluster: Cluster, tiers: list[list[int]], speeds: Sequence[float]) -> list[list[int]]:
    """Device subsets worth trying (a few, deterministic): the fastest k kinds of device for
    every k short of all, the node with the most compute, and on clusters of up to
    ``SUBSET_FULL_SEARCH_MAX_DEVICES`` devices the first 1, 2, 4, ... nodes and the first
    node's first 1, 2, 4, ... devices (the devices of a single node): the subsets
    ``sweep(..., "nodes")`` plans on."""
    p = cluster.num_devices
    out: list[list[int]] = []
    for k in range(1, len(tiers)):
        out.append(sorted(d for t in tiers[:k] for d in t))
    if p <= SUBSET_FULL_SEARCH_MAX_DEVICES:
        for v in _node_counts(cluster):
            out.append(list(range(_prefix(cluster, v).num_devices)))
        if len(cluster.nodes) > 1:  # the first node's first devices: the sweep's first point
            first = cluster.nodes[0].count
            out += [list(range(2**k)) for k in range(first.bit_length()) if 2**k < first]
    if len(cluster.nodes) > 1:
        by_node: dict[int, list[int]] = {}
        for d, node in enumerate(cluster.node_of_device):
            by_node.setdefault(node, []).append(d)
        best = max(by_node.values(), key=lambda ds: (sum(speeds[d] for d in ds), -ds[0]))
        out.append(best)
    seen: set[tuple[int, ...]] = set()
    unique = []
    for keep in out:
        if 0 < len(keep) < p and tuple(keep) not in seen:
            seen.add(tuple(keep))
            unique.append(keep)
    return unique


def _fit(t1: float, t2: float, b1: int) -> tuple[float, float]:
    """t(b) = a + b / s through (b1, t1) and (2 b1, t2): (a, s)."""
    slope = max((t2 - t1) / b1, 1e-30)
    return max(t1 - slope * b1, 0.0), 1.0 / slope


def _asymmetric(
    costs: ModelCosts,
    cluster: Cluster,
    batch: int,
    fast: list[int],
    slow: list[int],
    speeds: Sequence[float],
    micro_batches: Sequence[int],
    s: int,
) -> list[Prediction]:
    """Whole-model replicas on the ``fast`` devices beside one replica of the ``slow`` ones (a
    pipeline of one-device stages, or one filter-split stage), samples split by each
    replica's predicted time t(b) = a + b / s (:func:`hetcoll.split`)."""
    dev = predict._device_arrays([cluster.devices[d] for d in fast])
    guess = max(1, batch // max(1, len(fast) + 1))
    a, c = predict._linear_fit(costs, dev, guess)
    update = np.asarray(terms.optimizer_update_seconds(costs.param_bytes, dev.mem_bytes_per_s, s))
    whole = [(float(a[i] + update[i]), 1.0 / float(c[i])) for i in range(len(fast))]
    sub = cluster.subset(slow)
    total_speed = sum(speeds)
    share_guess = max(1, round(batch * sum(speeds[d] for d in slow) / total_speed))
    options: list[tuple[str, int, Any]] = []
    n = len(costs.plan_layers)
    for m in micro_batches:
        if m <= share_guess:
            options.append(("pipeline", m, predict.pipeline_stages(costs, sub, share_guess, m)))
    if costs.stage_filter_modes(0, n):
        try:
            predict.stage_split(costs, 0, n, len(slow), None, "filter split")
            options.append(("filter", 1, None))
        except ValueError:
            pass
    slow_speeds = [speeds[d] for d in slow]
    modes = costs.stage_filter_modes(0, n)
    out = []
    for kind, m, stages in options:

        def replica(b: int, kind: str = kind, m: int = m, stages: Any = stages) -> Prediction:
            if kind == "pipeline":
                return predict.pipeline(
                    costs, sub, b, m, layers_per_device=stages, optimizer_state_copies=s
                )
            return predict.filter_parallel(
                costs, sub, b, slow_speeds, modes=modes, optimizer_state_copies=s
            )

        b1 = max(m, share_guess // 2)
        fit = _fit(replica(b1).step_s, replica(2 * b1).step_s, b1)
        fits = [*whole, fit]
        shares = hetcoll.split(batch, [f[1] for f in fits], latency=[f[0] for f in fits])
        if shares[-1] < m:
            continue  # the slow devices' replica gets (almost) nothing: a subset plan
        slow_plan = replica(shares[-1]).plan
        if slow_plan is None:
            continue
        stage_dicts = slow_plan.to_dict()["replicas"][0]["stages"]
        for st in stage_dicts:
            st["ranks"] = [slow[x] for x in st["ranks"]]
        replicas = [
            {"samples": b, "stages": [{"ranks": [d], "layers": [0, n]}]}
            for d, b in zip(fast, shares)
            if b > 0
        ]
        replicas.append({"samples": shares[-1], "stages": stage_dicts})
        the_plan = Plan.from_dict({"microbatches": m, "schedule": "1F1B", "replicas": replicas})
        what = (
            f"pipeline of {len(stage_dicts)}, {m} micro-batches"
            if kind == "pipeline"
            else f"filter split over {len(slow)}"
        )
        out.append(
            predict.predict_plan(
                costs,
                cluster,
                the_plan,
                optimizer_state_copies=s,
                strategy=f"asymmetric, {len(replicas) - 1} whole-model "
                f"replica{'s' if len(replicas) > 2 else ''} + {what}",
            )
        )
    return out


def _per_sample_seconds(costs: ModelCosts, cluster: Cluster, batch: int) -> list[float]:
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


def _seconds_per_sample(costs: ModelCosts, cluster: Cluster, d: int, batch: int) -> float:
    """Forward + backward seconds per sample of device ``d`` at ``batch`` samples (cached per
    kind of device: the bounds ask for every shape's micro-batch)."""
    return _kind_seconds_per_sample(costs, cluster.devices[d], batch)


def _groups(cluster: Cluster, devices: Sequence[int], g: int) -> dict[Any, list[tuple[int, ...]]]:
    """Groups of ``g`` consecutive devices of one node among ``devices``, by kind of device
    (fastest kind first is the caller's order), each node's leftover devices left out."""
    by_node: dict[int, list[int]] = {}
    nodes = cluster.node_of_device
    for d in devices:
        by_node.setdefault(nodes[d], []).append(d)
    out: dict[Any, list[tuple[int, ...]]] = {}
    for node in sorted(by_node):
        ds = by_node[node]
        kind = cluster.devices[ds[0]]
        for i in range(0, len(ds) - g + 1, g):
            out.setdefault(kind, []).append(tuple(ds[i : i + g]))
    return out


@dataclass
class SearchReport:
    """What :func:`plan`'s search did: ``costed`` candidates; ``pruned``, per family, those a
    bound skipped uncosted; ``skipped``, per family, why it was not searched (the model
    does not allow it); ``placement_comparison``, when node-wise plans were searched, seed
    002's table for their devices: per strategy its bytes per step, load balance (the slowest
    device's work time over the ideal, 1.0 is perfect) and predicted step."""

    costed: int = 0
    pruned: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    placement_comparison: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "costed": self.costed,
            "pruned": self.pruned,
            "skipped": self.skipped,
            "placement_comparison": self.placement_comparison,
        }

    def prune(self, family: str) -> None:
        self.pruned[family] = self.pruned.get(family, 0) + 1


def _replicated_pipelines(
    costs: ModelCosts,
    cluster: Cluster,
    batch: int,
    devices: Sequence[int],
    suffix: str,
    per_sample: Sequence[float],
    s: int,
    best: list[float],
    budget: list[int],
    report: SearchReport,
    prune: bool = True,
) -> list[Prediction]:
    """Replicas of S pipeline stages of g devices each (a filter-split stage when g > 1), m
    micro-batches, GPipe and 1F1B, on ``devices``: each kind of device forms replicas of its
    own (stage groups within a node, a replica's stages on consecutive groups), the samples
    split over the replicas in proportion to their speed (:func:`hetcoll.split`), each kind's
    stage boundaries the exact chain partition at its micro-batch
    (:func:`predict.chain_stages`).

    Best first: every shape's lower bound (the batch at the devices' best per-sample rates,
    stretched by the bubble's ``(m + S - 1) / m``) is computed, and the shapes are costed in
    order of it while it is below ``best[0]``, the best step found so far, and the work left
    in ``budget[0]`` (device-candidates: costing a candidate reads each of its devices) lasts;
    the others count as pruned. ``prune=False``: ``best`` is left as given (infinite: every
    shape is costed)."""
    out: list[Prediction] = []
    units = len(set(costs.plan_layer_of))
    rate = sum(1.0 / per_sample[d] for d in devices)
    floor = batch / rate  # the batch's compute, perfectly spread over these devices
    family = "replicated pipeline"
    shapes = []
    for g in HYBRID_GROUP_SIZES:
        groups = {
            k: np.asarray(gs, dtype=np.int64) for k, gs in _groups(cluster, devices, g).items()
        }
        for n_st in HYBRID_STAGES:
            if n_st > units:
                continue
            # Each kind's replicas: consecutive groups, n_st at a time (replica x stage x rank).
            kinds = [
                (k, gs[: len(gs) // n_st * n_st].reshape(-1, n_st, g))
                for k, gs in groups.items()
                if len(gs) >= n_st
            ]
            count = sum(len(r) for _, r in kinds)
            if not count or (count == 1 and g == 1 and len(devices) == n_st):
                continue  # (the one-replica pipeline over these devices is costed already)
            speed = {k: 1.0 / per_sample[int(r[0, 0, 0])] for k, r in kinds}
            shares = np.asarray(
                hetcoll.split(batch, [speed[k] * n_st * g for k, r in kinds for _ in range(len(r))])
            )
            for mult in HYBRID_MICRO_PER_STAGE:
                m = n_st * mult
                if m > MAX_MICRO_BATCHES or m * count > batch:
                    continue
                # The compute floor at this shape's micro-batches: each kind's devices at their
                # per-sample time at its largest micro-batch (no less at smaller ones), the
                # devices the shape leaves out not counted.
                rate, at = 0.0, 0
                for _, r in kinds:
                    micro = math.ceil(int(shares[at : at + len(r)].max()) / m)
                    at += len(r)
                    if micro > 0:
                        rate += r.size / _seconds_per_sample(costs, cluster, int(r[0, 0, 0]), micro)
                shape_floor = max(floor, batch / rate) if rate > 0 else math.inf
                bound = shape_floor * (m + n_st - 1) / m
                shapes.append((bound, g, n_st, m, kinds, count, shares))
    shapes.sort(key=lambda x: x[:4])
    for bound, g, n_st, m, kinds, count, shares in shapes:
        used = count * n_st * g
        if bound >= best[0] or budget[0] < used:
            report.prune(family)
            continue
        budget[0] -= used
        # Replicas of one kind with equal shares: one entry of the plan's description.
        entries = []
        at = 0
        for k, r in kinds:
            mine = shares[at : at + len(r)]
            at += len(r)
            for b in sorted(set(mine.tolist()), reverse=True):
                if b > 0:
                    entries.append((k, r[mine == b], int(b)))
        if not entries or m > min(b for _, _, b in entries):
            continue
        spec = []
        cuts: dict[tuple[Any, int], list[tuple[int, int]] | None] = {}
        for k, r, b in entries:
            micro = math.ceil(b / m)
            if (k, micro) not in cuts:
                link = cluster.link_between(int(r[0, 0, 0]), int(r[0, 1, 0])) if n_st > 1 else None
                bw = link.bytes_per_s if link and math.isfinite(link.bytes_per_s) else None
                ranges = predict.chain_stages(
                    costs, [g * _flops_rate(costs, per_sample[int(r[0, 0, 0])])] * n_st, micro, bw
                )
                # A stage without layers: the same as fewer stages, costed there.
                cuts[k, micro] = None if any(a == e for a, e in ranges) else ranges
            ranges_k = cuts[k, micro]
            if ranges_k is None:
                break
            spec.append((b, tuple((r[:, j, :], ranges_k[j], None) for j in range(n_st))))
        if len(spec) < len(entries):
            continue
        replicas = sum(len(r) for _, r, _ in entries)
        what = f"{replicas} replica{'s' if replicas > 1 else ''} x {n_st} stages"
        if g > 1:
            what += f" of {g} devices"
        for schedule in ("GPipe", "1F1B"):
            strategy = f"{family}, {what}, {m} micro-batches {schedule}{suffix}"
            try:
                pred = predict.predict_stages(
                    costs, cluster, spec, m, schedule, optimizer_state_copies=s, strategy=strategy
                )
            except ValueError as e:
                report.skipped[f"{family}, stages of {g} devices"] = str(e)
                break
            report.costed += 1
            # (No detail["devices"]: predicted with the other devices idle in the run, as its
            # plan runs on the whole cluster's ranks.)
            if pred.feasible and prune:
                best[0] = min(best[0], pred.step_s)
            out.append(pred)
    return out


#: Micro-batch counts of the node-wise plans (their replay pipelines channel blocks across
#: micro-batches).
OWNERS_MICRO_BATCHES = (8,)


def _placements(
    costs: ModelCosts,
    cluster: Cluster,
    batch: int,
    model: Any,
    keep: list[int],
    s: int,
    report: SearchReport,
) -> list[Prediction]:
    """Node-wise (owners) plans on devices ``keep``: the hypergraph partition
    (:func:`~hetcoll.model.hypergraph_plan`, each device's target its share of the speed),
    every layer's channels split evenly, and split in proportion to speed, each at
    ``OWNERS_MICRO_BATCHES`` micro-batches, predicted by
    :func:`~hetcoll.model.predict_placement` on the devices' speeds on this model and the
    slowest link among them, plus the optimizer step of the weights each device owns and the
    loss's allreduce. Fills ``report.placement_comparison`` (seed 002's table: bytes per
    step, load balance, predicted step) with these and the other strategies on the same
    devices."""
    from hetcoll.model.hypergraph import network_hypergraph
    from hetcoll.model.placement import _layer_index, hypergraph_plan, placement_traffic
    from hetcoll.model.placement import predict_placement as replay
    from hetcoll.torch.layers import model_layers
    from hetcoll.torch.placement import owners_blocks

    shape = tuple(costs.input_shape)
    k, p = len(keep), cluster.num_devices
    sub = cluster.subset(keep)
    suffix = f", {k} of {p} devices" if k < p else ""
    try:
        h = network_hypergraph(model, shape, bytes_per_element=costs.itemsize)
        index = _layer_index(model, h)
        layers = model_layers(model)
    except ValueError as e:
        report.skipped["node-wise placement"] = str(e)
        return []
    if h.num_vertices > OWNERS_MAX_VERTICES:
        report.skipped["node-wise placement"] = (
            f"the model has {h.num_vertices:,} filters and neurons; the planner partitions up "
            f"to {OWNERS_MAX_VERTICES:,} (call hypergraph_plan and predict_placement directly)"
        )
        return []
    if k < 2 or k > h.num_vertices:
        return []
    per_sample = _per_sample_seconds(costs, sub, batch)
    hyper_flops = 3.0 * float(h.vertex_weights.sum())  # forward, and twice that backward
    rates = [hyper_flops / t for t in per_sample]  # the hypergraph's FLOP/s on each device
    link = sub.ring_link()
    bw = link.bytes_per_s if math.isfinite(link.bytes_per_s) else 1e30
    param_elems = {name: model.get_submodule(name).weight[0].numel() for name, _, _ in h.layers}
    placed = sum(param_elems[name] * count for name, _, count in h.layers) * costs.itemsize
    rest = max(costs.param_bytes - placed, 0.0)
    loss_s = float(
        terms.ring_allreduce_seconds(
            8.0, k, link.latency_s, link.bytes_per_s, min(d.mem_bytes_per_s for d in sub.devices), 8
        )
    )

    def contiguous(weights: Sequence[float]) -> dict[str, list[int]]:
        owners = {}
        for name, _, count in h.layers:
            shares = hetcoll.split(count, list(weights))
            owners[str(index[name])] = [r for r, c in enumerate(shares) for _ in range(c)]
        return owners

    def owners_plan(owners: dict[str, list[int]], m: int) -> Plan:
        return Plan.from_dict(
            {
                "microbatches": m,
                "schedule": "GPipe",
                "replicas": [
                    {
                        "samples": batch,
                        "stages": [
                            {"ranks": list(range(k)), "layers": [0, len(layers)], "owners": owners}
                        ],
                    }
                ],
            }
        )

    try:
        hyper = hypergraph_plan(model, shape, rates, batch)
        assert hyper.replicas[0].stages[0].owners is not None
        found = {
            "hypergraph placement": {
                str(x): list(v) for x, v in hyper.replicas[0].stages[0].owners.items()
            }
        }
    except ValueError as e:
        report.skipped["node-wise placement"] = str(e)
        return []
    found["even filter split"] = contiguous([1.0] * k)
    proportional = contiguous(rates)
    if proportional != found["even filter split"]:  # on equal devices they are one split
        found["speed-proportional filter split"] = proportional
    # Kernel launches the replay leaves out: a device runs every kernel of each block it owns
    # channels of, once per micro-batch (the block: a Conv2d / Linear and the layers up to the
    # next one, as costed).
    current = ""
    placed_names = {name for name, _, _ in h.layers}
    kernels: dict[str, int] = {}
    for layer in costs.layers:
        if layer.name in placed_names:
            current = layer.name
        if current:
            kernels[current] = kernels.get(current, 0) + len(layer.forward) + len(layer.backward)
    overhead = np.array([d.kernel_overhead_s for d in sub.devices])
    out: list[Prediction] = []
    rows: list[dict[str, Any]] = []
    for what, owners in found.items():
        best_row: dict[str, Any] | None = None
        for m in OWNERS_MICRO_BATCHES:
            local = owners_plan(owners, m)
            try:
                owners_blocks(layers, local.replicas[0].stages[0], "plan")
                run = replay(
                    model, shape, local, flops_per_s=rates, bytes_per_s=bw, latency_s=link.latency_s
                )
            except ValueError as e:
                report.skipped[f"node-wise placement, {what}"] = str(e)
                break
            # Weights each device owns: its channels' rows of every placed layer, and the
            # rest (BatchNorm and the like, per channel too) in proportion; activations kept:
            # its share of the work times the batch (GPipe keeps every micro-batch).
            work = np.zeros(k)
            owned = np.zeros(k)
            for name, first, count in h.layers:
                who = np.asarray(owners[str(index[name])])
                work += np.bincount(
                    who, weights=h.vertex_weights[first : first + count], minlength=k
                )
                owned += np.bincount(who, minlength=k) * param_elems[name] * costs.itemsize
            launches = np.zeros(k)
            for name, _, _ in h.layers:
                launches[np.unique(owners[str(index[name])])] += kernels.get(name, 0)
            extra = launches * overhead * m
            frac = work / max(work.sum(), 1e-30)
            owned += rest * frac
            update = np.asarray(
                terms.optimizer_update_seconds(
                    owned, np.array([d.mem_bytes_per_s for d in sub.devices]), s
                )
            )
            mem = owned * (2 + s) + frac * batch * costs.saved_bytes_per_sample()
            step = run.step_s + float(extra.max()) + loss_s + float(update.max())
            crit = int(np.argmax(np.asarray(run.compute_s[:k]) + extra))
            breakdown = {
                "compute": float(run.compute_s[crit]),
                "overhead": float(extra.max()),
                "communication": max(0.0, run.step_s - float(run.compute_s[crit])) + loss_s,
                "optimizer": float(update.max()),
            }
            full_mem = [0.0] * p
            shares = [0] * p
            for j, d in enumerate(keep):
                full_mem[d] = float(mem[j])
                shares[d] = int(sum(1 for v in owners.values() for o in v if o == j))
            reason = predict._memory_shortfall(np.asarray(full_mem), cluster.devices)
            doc = local.to_dict()
            doc["replicas"][0]["stages"][0]["ranks"] = list(keep)
            pred = Prediction(
                f"node-wise, {what}, {m} micro-batches{suffix}",
                shares,
                "channels",
                step,
                breakdown,
                full_mem,
                not reason,
                reason,
                batch,
                {
                    "devices": list(keep),
                    "critical_device": keep[crit],
                    "traffic_bytes": run.traffic,
                    "schedule": "GPipe",
                    "micro_batches": m,
                },
                plan=Plan.from_dict(doc),
            )
            report.costed += 1
            out.append(pred)
            balance = terms.load_balance(work, rates)
            row = {
                "strategy": what,
                "bytes_per_step": int(sum(run.traffic.values())),
                "load_balance": balance,
                "step_s": step,
                "plan": pred.strategy,
            }
            if best_row is None or step < best_row["step_s"]:
                best_row = row
        if best_row is not None:
            rows.append(best_row)
            if what == "even filter split" and proportional == owners:
                # On equal devices the speed-proportional split is the even one.
                rows.append({**best_row, "strategy": "speed-proportional filter split"})
    # The same devices' pipeline of one-device stages and balanced data parallelism.
    flops_of = {
        name: h.vertex_weights[first : first + count].sum() for name, first, count in h.layers
    }
    pipes = []
    for m in (k, 2 * k):
        if m <= batch:
            pipe = predict.pipeline(costs, sub, batch, m, optimizer_state_copies=s)
            if pipe.plan is not None:
                pipes.append((pipe.step_s, m, pipe))
    if pipes:
        step, m, pipe = min(pipes, key=lambda x: x[0])
        local = pipe.to_plan()
        load = np.zeros(k)
        for _, _, st in local.stages():
            for name, _, _ in h.layers:
                if st.layers[0] <= index[name] < st.layers[1]:
                    load[st.ranks[0]] += flops_of[name]
        rows.append(
            {
                "strategy": "pipeline stages",
                "bytes_per_step": int(sum(placement_traffic(model, shape, local).values())),
                "load_balance": terms.load_balance(load, rates),
                "step_s": step,
                "plan": f"pipeline, {m} micro-batches GPipe{suffix}",
            }
        )
    try:
        dp_shares = predict.balanced_batch_shares(costs, sub, batch, optimizer_state_copies=s)
        dp = predict.data_parallel(costs, sub, dp_shares, optimizer_state_copies=s)
        rows.append(
            {
                "strategy": "data parallel",
                "bytes_per_step": int(2 * (k - 1) * costs.param_bytes),
                "load_balance": terms.load_balance(dp_shares, rates),
                "step_s": dp.step_s,
                "plan": f"data parallel, balanced{suffix}",
            }
        )
    except ValueError as e:
        report.skipped["data parallel"] = str(e)
    report.placement_comparison = {"devices": list(keep), "rows": rows}
    return out


def _flops_rate(costs: ModelCosts, seconds_per_sample: float) -> float:
    """FLOP/s of a device that trains one sample in ``seconds_per_sample``."""
    return (costs.forward_flops(1) + costs.backward_flops(1)) / max(seconds_per_sample, 1e-30)


def plan(
    costs: ModelCosts,
    cluster: Cluster,
    batch: int,
    *,
    optimizer_state_copies: int = 1,
    micro_batches: Sequence[int] = PIPELINE_MICRO_BATCHES,
    subsets: bool = True,
    asymmetric: bool = True,
    replicated_pipelines: bool = True,
    precision: str | None = None,
    model: Any = None,
    report: SearchReport | None = None,
    prune: bool = True,
) -> list[Prediction]:
    """Every candidate plan for one step of ``batch`` samples, best first (feasible before
    infeasible, then by predicted step time). Each carries the :class:`hetcoll.Plan` that
    :func:`hetcoll.torch.parallelize` runs (:meth:`Prediction.to_plan`, built when first
    read) when the model can be cut into one (``costs.plan_layers``); candidates the runtime
    cannot run are marked infeasible.

    The candidates: data parallel with balanced and with even shares; filter parallel with
    balanced filters; pipelines of one-device stages cut between top-level layers, for each
    count of ``micro_batches``, GPipe and 1F1B; with ``replicated_pipelines``, replicas of
    2, 4 or 8 stages of 1, 2, 4 or 8 devices of one node (filter-split stages), each kind of
    device its own replicas, S, 2S or 4S micro-batches, GPipe and 1F1B, on all devices and on
    the fastest kinds (:func:`_replicated_pipelines`); with ``subsets``, balanced data and
    filter parallelism on a few device subsets (the fastest kinds of device, the strongest
    node), so that a device that only slows the step is left out; with ``asymmetric``
    (clusters of up to ``ASYMMETRIC_MAX_DEVICES`` devices and several kinds of device),
    whole-model replicas on the fastest kinds beside one replica of the others (a pipeline,
    or one filter-split stage), the samples split by each replica's predicted time; with
    ``model`` (the module ``costs`` were read from), node-wise placements on at most
    ``OWNERS_MAX_DEVICES`` devices (:func:`_placements`). Pipelines whose lower bound is not
    below the best step found so far are not costed (see the module's docs).

    ``precision``: the training precision (``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"``;
    :meth:`ModelCosts.at_precision`); default that of ``costs`` (``costs.precision``).
    ``report``: a :class:`SearchReport` the search fills in (counts, the seed-002 table).
    ``prune=False`` costs every candidate (the bounds never drop the best plan, but they drop
    runners-up; the tests compare both).

    >>> best = plan(costs, cluster, 256, precision="bf16")[0]  # doctest: +SKIP
    >>> best.strategy, best.shares, best.step_s  # doctest: +SKIP
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch: must be an integer >= 1, got {batch!r}")
    if report is not None and not isinstance(report, SearchReport):
        raise TypeError(f"report: must be a SearchReport, got {type(report).__name__}")
    if model is not None and not hasattr(model, "named_children"):
        raise TypeError(f"model: must be a torch.nn.Module, got {type(model).__name__}")
    if precision is not None:
        costs = costs.at_precision(precision)
    report = report if report is not None else SearchReport()
    p = cluster.num_devices
    out: list[Prediction] = []
    s = optimizer_state_copies
    n = len(costs.plan_layers)
    modes = costs.stage_filter_modes(0, n) if n else None
    # Filter parallelism only where filter_parallel splits something (not an LSTM, say).
    splits = bool(modes) if n else bool(costs.filter_modes)
    if not splits:
        report.skipped["filter parallel"] = "the model has no layer filter parallelism splits"

    def data_balanced(c: Cluster, strategy: str) -> Prediction:
        try:
            shares = predict.balanced_batch_shares(costs, c, batch, optimizer_state_copies=s)
            return predict.data_parallel(
                costs, c, shares, strategy=strategy, optimizer_state_copies=s
            )
        except ValueError as e:
            return _infeasible(strategy, batch, c.num_devices, "samples", str(e))

    def filter_balanced(c: Cluster, strategy: str) -> Prediction:
        speeds = _device_speeds(costs, c, batch)
        return predict.filter_parallel(
            costs, c, batch, speeds, modes=modes, strategy=strategy, optimizer_state_copies=s
        )

    def best_step() -> float:
        if not prune:
            return math.inf
        return min((x.step_s for x in out if x.feasible), default=math.inf)

    out.append(data_balanced(cluster, "data parallel, balanced"))
    out.append(
        predict.data_parallel(
            costs,
            cluster,
            predict.even_batch_shares(batch, p),
            strategy="data parallel, even",
            optimizer_state_copies=s,
        )
    )
    if p > 1 and splits:
        out.append(filter_balanced(cluster, "filter parallel, balanced"))
    per_sample = _per_sample_seconds(costs, cluster, batch)
    if p > 1:
        speeds = _device_speeds(costs, cluster, batch)
        tiers = _tiers(cluster, speeds)
        if subsets:
            # A subset's plan can be one already there (a balanced split that leaves the same
            # devices out): not repeated.
            seen = {_same_plan_key(x) for x in out if x.has_plan}
            for keep in _subsets(cluster, tiers, speeds):
                sub = cluster.subset(keep)
                suffix = f", {len(keep)} of {p} devices"
                # On a small cluster, every strategy on each subset of the first devices (as
                # `sweep(..., "nodes")` plans each of its points), its feasible plans only, the
                # subset's own subsets not searched; its figure is the plan's run on just those
                # ranks (no idle rank joins the loss allreduce). Otherwise the balanced splits
                # only, to keep the search fast.
                if p <= SUBSET_FULL_SEARCH_MAX_DEVICES and keep == list(range(len(keep))):
                    candidates = plan(
                        costs,
                        sub,
                        batch,
                        optimizer_state_copies=s,
                        micro_batches=micro_batches,
                        subsets=False,
                        asymmetric=asymmetric,
                        replicated_pipelines=replicated_pipelines,
                        report=report,
                        prune=prune,
                    )
                else:
                    candidates = [data_balanced(sub, "data parallel, balanced")]
                    if splits:
                        candidates.append(filter_balanced(sub, "filter parallel, balanced"))
                for pred in candidates:
                    if not pred.feasible:
                        continue
                    pred = _on_devices(pred, keep, p, suffix)
                    key = _same_plan_key(pred) if pred.has_plan else None
                    if key is None:
                        out.append(pred)
                    elif key not in seen:
                        seen.add(key)
                        out.append(pred)
        # One pipeline of one-device stages over the cluster: with S of its devices given
        # layers (at most one per top-level layer; the partition decides how many), it idles
        # (S - 1) / (m + S - 1) of the step at best, and its compute is at best spread over
        # its S fastest devices at their per-sample time at its micro-batch. A pipeline whose
        # least such bound over S is not below the best step is not costed.
        stages = min(p, len(set(costs.plan_layer_of)) if n else len(costs.layers))
        for m in micro_batches:
            if m > batch:
                continue
            micro = math.ceil(batch / m)
            rates: list[float] = []
            for tier in tiers:  # fastest kind first; each kind's rate at this micro-batch
                rate = 1.0 / _seconds_per_sample(costs, cluster, tier[0], micro)
                rates += [rate] * min(len(tier), stages)
            rates = sorted(rates, reverse=True)[:stages]
            bound = min(batch / sum(rates[:k]) * (m + k - 1) / m for k in range(1, len(rates) + 1))
            for schedule in ("GPipe", "1F1B"):
                if bound >= best_step():
                    report.prune("pipeline")
                    continue
                report.costed += 1
                out.append(
                    predict.pipeline(
                        costs,
                        cluster,
                        batch,
                        m,
                        strategy=f"pipeline, {m} micro-batches {schedule}",
                        optimizer_state_copies=s,
                        schedule=schedule,
                    )
                )
        if replicated_pipelines and n:
            best = [best_step()]
            budget = [HYBRID_WORK_BUDGET]
            sets = [list(range(p))]
            if subsets:  # (a subset's own subsets are not searched)
                sets += [sorted(d for t in tiers[:k] for d in t) for k in range(1, len(tiers))]
            for keep in sets:
                prefix = keep == list(range(len(keep)))
                if subsets and prefix and len(keep) < p <= SUBSET_FULL_SEARCH_MAX_DEVICES:
                    continue  # searched with every strategy among the subsets above
                suffix = f", {len(keep)} of {p} devices" if len(keep) < p else ""
                out += _replicated_pipelines(
                    costs,
                    cluster,
                    batch,
                    keep,
                    suffix,
                    per_sample,
                    s,
                    best,
                    budget,
                    report,
                    prune,
                )
        if asymmetric and n and len(tiers) > 1 and p <= ASYMMETRIC_MAX_DEVICES:
            for k in range(1, len(tiers)):
                fast = sorted(d for t in tiers[:k] for d in t)
                slow = sorted(d for t in tiers[k:] for d in t)
                if len(slow) > 1:
                    out += _asymmetric(
                        costs, cluster, batch, fast, slow, speeds, ASYMMETRIC_MICRO_BATCHES, s
                    )
        if model is not None and n:
            if p <= OWNERS_MAX_DEVICES:
                keep = list(range(p))
            else:
                small = [
                    k for k in _subsets(cluster, tiers, speeds) if len(k) <= OWNERS_MAX_DEVICES
                ]
                keep = max(small, key=lambda k: (sum(speeds[d] for d in k), -k[0]), default=[])
            if len(keep) > 1:
                out += _placements(costs, cluster, batch, model, keep, s, report)
    out = [_runnable(x, costs) for x in out]
    out.sort(key=lambda x: (not x.feasible, x.step_s))
    return out


def _same_plan_key(pred: Prediction) -> tuple[Any, ...]:
    """Two candidates with this equal are the same plan (for dropping repeats)."""
    return (pred.share_unit, tuple(pred.shares), pred.step_s)


def explain(pred: Prediction, cluster: Cluster) -> dict[str, Any]:
    """Why ``pred`` takes the time it does: the largest term on its critical path (its
    breakdown's compute, memory stalls and kernel overheads together as the critical device's
    compute; exposed communication; the pipeline bubble; the optimizer step), with the device
    or the collective it is. Returns ``{"term", "seconds", "share", "device", "text"}``.

    >>> explain(plan(costs, cluster, 512)[0], cluster)["text"]  # doctest: +SKIP
    'compute of device 0 (a100-sxm4-40gb): 5.9 ms of the 8.8 ms step (67 %)'
    """
    if not isinstance(pred, Prediction):
        raise TypeError(f"pred: must be a Prediction, got {type(pred).__name__}")
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster: must be a Cluster, got {type(cluster).__name__}")
    b = pred.breakdown
    parts = {
        "compute": b.get("compute", 0.0) + b.get("memory", 0.0) + b.get("overhead", 0.0),
        "communication": b.get("communication", 0.0),
        "bubble": b.get("bubble", 0.0),
        "optimizer": b.get("optimizer", 0.0),
    }
    if not pred.feasible or not math.isfinite(pred.step_s) or pred.step_s <= 0:
        return {
            "term": "infeasible",
            "seconds": 0.0,
            "share": 0.0,
            "device": None,
            "text": pred.reason or "no step",
        }
    term = max(parts, key=lambda k: parts[k])
    seconds = parts[term]
    d = pred.detail.get("critical_device")
    if d is not None and not 0 <= d < cluster.num_devices:
        raise ValueError(
            f"cluster: has {cluster.num_devices} devices, but pred's critical device is {d} "
            "(give the cluster pred was planned on)"
        )
    where = f"device {d} ({cluster.devices[d].name})" if d is not None else "the slowest device"
    strategy = pred.strategy
    if term == "compute":
        stalls = b.get("memory", 0.0) / seconds if seconds > 0 else 0.0
        what = f"compute of {where}" + (
            f", {stalls:.0%} of it memory stalls" if stalls >= 0.2 else ""
        )
    elif term == "communication":
        if strategy.startswith("data parallel"):
            what = "the gradient allreduce (the part the backward does not hide)"
        elif strategy.startswith("filter parallel"):
            what = "the filter-split layers' collectives (partial sums and gathers)"
        elif strategy.startswith("node-wise"):
            what = f"feature maps sent between devices, waited for by {where}"
        elif pred.detail.get("gradient_allreduce_s", 0.0) >= 0.5 * seconds:
            what = "the gradient allreduce across replicas"
        else:
            what = f"the split stages' collectives on {where}"
    elif term == "bubble":
        what = f"the pipeline bubble: {where} waits for other stages"
    else:
        what = "the optimizer step"
    share = seconds / pred.step_s
    text = (
        f"{what}: {_seconds_text(seconds)} of the {_seconds_text(pred.step_s)} step ({share:.0%})"
    )
    return {"term": term, "seconds": seconds, "share": share, "device": d, "text": text}


def _seconds_text(x: float) -> str:
    return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"


def plot_plans(ranked: Sequence[Prediction], path: str, title: str = "", top: int = 24) -> None:
    """Predicted step time of the ``top`` best plans of ``ranked`` (as :func:`plan` returns
    them), one bar each, best at the top, infeasible ones hatched, as a PNG (matplotlib,
    Agg)."""
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"top: must be an integer >= 1, got {top!r}")
    if any(not isinstance(x, Prediction) for x in ranked):
        raise TypeError("ranked: must hold Predictions (as plan returns them)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [x for x in ranked if math.isfinite(x.step_s)][:top]
    if not shown:
        raise ValueError("ranked: no plan with a finite step time to plot")
    fig, ax = plt.subplots(figsize=(8.0, 1.2 + 0.28 * len(shown)))
    y = np.arange(len(shown))[::-1]
    families = sorted({_family(x.strategy) for x in shown})
    colours = {f: plt.get_cmap("tab10")(i % 10) for i, f in enumerate(families)}
    for yi, x in zip(y, shown):
        ax.barh(
            yi,
            x.step_s * 1e3,
            color=colours[_family(x.strategy)],
            hatch="" if x.feasible else "//",
            edgecolor="black" if not x.feasible else None,
        )
    ax.set_yticks(
        y,
        [x.strategy if len(x.strategy) <= 70 else x.strategy[:67] + "..." for x in shown],
        fontsize=7,
    )
    ax.set_xlabel("predicted step time (ms)")
    ax.set_xlim(0, max(x.step_s for x in shown) * 1e3 * 1.05)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[f]) for f in families]
    ax.legend(handles, families, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(title or "predicted step time by plan (hatched: infeasible)", fontsize=9)
    ax.grid(True, axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


SWEEP_AXES = ("batch", "flops", "mem_bw", "link_bw", "nodes")
_FACTORS = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)


@dataclass
class SweepPoint:
    """One point of a sweep: the axis value and the best plan of each strategy family there."""

    value: float
    best: dict[str, Prediction]


def _family(strategy: str) -> str:
    """The strategy without its micro-batches, device subset or replica shapes."""
    if strategy.startswith(("pipeline", "asymmetric", "replicated pipeline", "node-wise")):
        return strategy.split(",")[0]
    return re.sub(r", \d+ of \d+ devices$", "", strategy)


def _node_counts(cluster: Cluster) -> list[int]:
    """The ``nodes`` sweep's points: 1, 2, 4, ... nodes and all of them (devices, on one node)."""
    n = len(cluster.nodes) if len(cluster.nodes) > 1 else cluster.num_devices
    return sorted({min(n, 2**k) for k in range(0, n.bit_length() + 1)})


def _prefix(cluster: Cluster, k: int) -> Cluster:
    """The first ``k`` nodes of ``cluster`` (its first ``k`` devices when it has one node)."""
    if len(cluster.nodes) > 1:
        return Cluster(cluster.nodes[:k], cluster.network if k > 1 else None, cluster.source)
    return cluster.first_devices(k)


def sweep(
    costs: ModelCosts,
    cluster: Cluster,
    batch: int,
    axis: str,
    values: Sequence[float] | None = None,
    *,
    optimizer_state_copies: int = 1,
    precision: str | None = None,
) -> list[SweepPoint]:
    """Plan at each value of ``axis``: ``batch`` (samples), ``flops`` / ``mem_bw`` / ``link_bw``
    (factors applied to every device or link), ``nodes`` (the first k nodes, or the first k
    devices of a single-node cluster). Default values: powers of two around the given point.
    ``precision`` as in :func:`plan`.
    """
    if precision is not None:
        costs = costs.at_precision(precision)
    if axis not in SWEEP_AXES:
        raise ValueError(f"axis: expected one of {SWEEP_AXES}, got {axis!r}")
    if values is None:
        if axis == "batch":
            values = [max(1, int(batch * f)) for f in _FACTORS]
        elif axis == "nodes":
            values = _node_counts(cluster)
        else:
            values = list(_FACTORS)
    points = []
    for v in values:
        c, b = cluster, batch
        if axis == "batch":
            b = int(v)
        elif axis == "flops":
            c = cluster.scaled(flops=v)
        elif axis == "mem_bw":
            c = cluster.scaled(mem_bw=v)
        elif axis == "link_bw":
            c = cluster.scaled(link_bw=v)
        else:
            c = _prefix(cluster, int(v))
        best: dict[str, Prediction] = {}
        for pred in plan(costs, c, b, optimizer_state_copies=optimizer_state_copies):
            fam = _family(pred.strategy)
            if pred.feasible and fam not in best:
                best[fam] = pred
        points.append(SweepPoint(float(v), best))
    return points


def plot_sweep(points: Sequence[SweepPoint], axis: str, path: str, title: str = "") -> None:
    """Samples/s of each strategy's best plan along the axis, as a PNG (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = sorted({f for pt in points for f in pt.best})
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for fam in families:
        xs = [pt.value for pt in points if fam in pt.best]
        ys = [pt.best[fam].samples_per_s for pt in points if fam in pt.best]
        ax.plot(xs, ys, marker="o", label=fam)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    label = {
        "batch": "batch size (samples)",
        "flops": "device FLOP/s (x given)",
        "mem_bw": "device memory bandwidth (x given)",
        "link_bw": "link bandwidth (x given)",
        "nodes": "cluster size (nodes)",
    }[axis]
    ax.set_xlabel(label)
    ax.set_ylabel("predicted samples / s")
    ax.set_title(title or f"sweep over {axis}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
