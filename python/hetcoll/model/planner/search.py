"""The plan search: which strategy, which split, how fast.

:func:`plan` costs every candidate of its space and ranks them: feasible plans first, fastest
first. Each candidate carries the :class:`hetcoll.Plan` the runtime runs (built when first
read: a plan of 10,240 replicas takes longer to build and check than to cost). The space:

- data parallel with balanced and with even shares; filter parallel (one stage over the
  devices, filters split by speed); for a mixture-of-experts model, expert parallelism (whole
  experts per device, samples and experts by speed, and both even: :mod:`.experts`), and the
  fastest few replicated pipelines below again with their experts placed on their replicas;
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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

import hetcoll
from hetcoll.model import predict, terms
from hetcoll.model.costs import ModelCosts
from hetcoll.model.hardware import Cluster
from hetcoll.model.planner.experts import expert_parallel_candidates, expert_pipeline_candidates
from hetcoll.model.planner.placements import OWNERS_MAX_DEVICES, node_wise_candidates
from hetcoll.model.planner.rates import (
    device_speeds,
    flops_rate,
    per_sample_seconds,
    seconds_per_sample,
)
from hetcoll.model.planner.report import SearchReport
from hetcoll.model.planner.subsets import (
    SUBSET_FULL_SEARCH_MAX_DEVICES,
    device_subsets,
    device_tiers,
    node_groups,
)
from hetcoll.model.predict import Prediction
from hetcoll.model.predict.prediction import on_devices
from hetcoll.model.predict.timing import device_arrays, linear_fit
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


def _balance(costs: ModelCosts) -> str:
    """How the planner splits a stage over devices: a transformer's heads and hidden units by
    predicted time (the work every device repeats around them counted, as
    filter_parallel(sample=) counts it measured), anything else in proportion to speed."""
    return "time" if costs.plan_cut == "blocks" and costs.split_blocks else "speed"


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
    factory = None
    if pred.has_plan:

        def factory() -> Plan:
            doc = pred.to_plan().to_dict()
            for r in doc["replicas"]:
                for st in r["stages"]:
                    st["ranks"] = [keep[x] for x in st["ranks"]]
            return Plan.from_dict(doc)

    placed = on_devices(pred, keep, num_devices)
    return replace(
        placed,
        strategy=f"{pred.strategy}{suffix}",
        plan=None,
        plan_factory=factory,
        detail={**placed.detail, "devices": list(keep)},
    )


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
    dev = device_arrays([cluster.devices[d] for d in fast])
    guess = max(1, batch // max(1, len(fast) + 1))
    a, c = linear_fit(costs, dev, guess)
    update = np.asarray(
        terms.step_update_seconds(costs.gradient_bytes, dev.mem_bytes_per_s, s, dev.step_overhead_s)
    )
    whole = [(float(a[i] + update[i]), 1.0 / float(c[i])) for i in range(len(fast))]
    sub = cluster.subset(slow)
    total_speed = sum(speeds)
    share_guess = max(1, round(batch * sum(speeds[d] for d in slow) / total_speed))
    options: list[tuple[str, int, Any]] = []
    n = len(costs.plan_layers)
    for m in micro_batches:
        if m <= share_guess:
            options.append(("pipeline", m, predict.pipeline_stages(costs, sub, share_guess, m)))
    slow_speeds = [speeds[d] for d in slow]
    empty = predict.blocks_need_empty(costs, 0, n, slow_speeds)
    if costs.stage_filter_modes(0, n):
        try:
            predict.stage_split(costs, 0, n, len(slow), None, "filter split", empty)
            options.append(("filter", 1, None))
        except ValueError:
            pass
    modes = costs.stage_filter_modes(0, n)
    out = []
    for kind, m, stages in options:

        def replica(b: int, kind: str = kind, m: int = m, stages: Any = stages) -> Prediction:
            if kind == "pipeline":
                return predict.pipeline(
                    costs, sub, b, m, layers_per_device=stages, optimizer_state_copies=s
                )
            return predict.filter_parallel(
                costs,
                sub,
                b,
                slow_speeds,
                modes=modes,
                optimizer_state_copies=s,
                empty_blocks=empty,
                balance=_balance(costs),
                loss_parallel=predict.splits_loss(costs),
            )

        b1 = max(m, share_guess // 2)
        try:
            fit = _fit(replica(b1).step_s, replica(2 * b1).step_s, b1)
            fits = [*whole, fit]
            shares = hetcoll.split(batch, [f[1] for f in fits], latency=[f[0] for f in fits])
            if shares[-1] < m:
                continue  # the slow devices' replica gets (almost) nothing: a subset plan
            slow_plan = replica(shares[-1]).plan
        except ValueError:
            continue  # a split the slow devices cannot take (too few filters for them)
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
            k: np.asarray(gs, dtype=np.int64) for k, gs in node_groups(cluster, devices, g).items()
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
                        rate += r.size / seconds_per_sample(costs, cluster, int(r[0, 0, 0]), micro)
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
                    costs,
                    [g * flops_rate(costs, per_sample[int(r[0, 0, 0])], batch)] * n_st,
                    micro,
                    bw,
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
    expert_loads: predict.Loads | None = None,
) -> list[Prediction]:
    """Every candidate plan for one step of ``batch`` samples, best first (feasible before
    infeasible, then by predicted step time). Each carries the :class:`hetcoll.Plan` that
    :func:`hetcoll.torch.parallelize` runs (:meth:`Prediction.to_plan`, built when first
    read) when the model can be cut into one (``costs.plan_layers``); candidates the runtime
    cannot run are marked infeasible.

    The candidates: data parallel with balanced and with even shares; filter parallel with
    balanced filters; for a model with experts layers (``costs.experts``), expert parallelism
    with samples and experts by speed and with both even (:func:`expert_parallel_candidates`),
    and the fastest few replicated pipelines found again with each replica's experts only
    (:func:`expert_pipeline_candidates`);
    pipelines of one-device stages cut between top-level layers, for each
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
    ``OWNERS_MAX_DEVICES`` devices (:func:`node_wise_candidates`). Pipelines whose lower bound
    is not below the best step found so far are not costed (see the module's docs).

    ``precision``: the training precision (``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"``;
    :meth:`ModelCosts.at_precision`); default that of ``costs`` (``costs.precision``).
    ``report``: a :class:`SearchReport` the search fills in (counts, the seed-002 table).
    ``prune=False`` costs every candidate (the bounds never drop the best plan, but they drop
    runners-up; the tests compare both). ``expert_loads``: each experts layer's routed tokens
    per expert, by module path, measured in a run (:func:`hetcoll.torch.expert_loads`, an
    ``ExpertRebalancer``'s ``loads``): the expert-parallel candidates place those layers'
    experts by them (any experts on any device, :func:`hetcoll.torch.expert_assignment`)
    and every candidate holding experts is priced at them; without, each expert counts alike.

    >>> best = plan(costs, cluster, 256, precision="bf16")[0]  # doctest: +SKIP
    >>> best.strategy, best.shares, best.step_s  # doctest: +SKIP
    """
    predict.check_costs_and_cluster(costs, cluster)
    terms.batch_argument(batch)
    if report is not None and not isinstance(report, SearchReport):
        raise TypeError(f"report: must be a SearchReport, got {type(report).__name__}")
    if model is not None and not hasattr(model, "named_children"):
        raise TypeError(f"model: must be a torch.nn.Module, got {type(model).__name__}")
    if precision is not None:
        costs = costs.at_precision(precision)
    loads = predict.checked_loads(costs, expert_loads, "expert_loads")
    report = report if report is not None else SearchReport()
    p = cluster.num_devices
    out: list[Prediction] = []
    s = terms.state_copies_argument(optimizer_state_copies)  # else every candidate fails alike
    if isinstance(micro_batches, (str, bytes)) or not isinstance(micro_batches, Sequence):
        raise ValueError(f"micro_batches: must be integers >= 1, got {micro_batches!r}")
    for i, m in enumerate(micro_batches):  # 0 once divided by zero, deep in a candidate
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1:
            raise ValueError(f"micro_batches[{i}]: must be an integer >= 1, got {m!r}")
    n = len(costs.plan_layers)
    modes = costs.stage_filter_modes(0, n) if n else None
    # Filter parallelism only where filter_parallel splits something (not an LSTM, say).
    splits = bool(modes) if n else bool(costs.filter_modes)
    if not splits:
        report.skipped["filter parallel"] = "the model has no layer filter parallelism splits"
    if not n and costs.plan_layers_note:  # the predictions stand, no plan runs them
        report.skipped["plans cutting the model (pipelines, split stages)"] = costs.plan_layers_note

    def data_balanced(c: Cluster, strategy: str) -> Prediction:
        try:
            shares = predict.balanced_batch_shares(costs, c, batch, optimizer_state_copies=s)
            return predict.data_parallel(
                costs, c, shares, strategy=strategy, optimizer_state_copies=s
            )
        except ValueError as e:
            return _infeasible(strategy, batch, c.num_devices, "samples", str(e))

    def filter_balanced(c: Cluster, strategy: str) -> Prediction:
        speeds = device_speeds(costs, c, batch)
        try:
            return predict.filter_parallel(
                costs,
                c,
                batch,
                speeds,
                modes=modes,
                strategy=strategy,
                optimizer_state_copies=s,
                empty_blocks=bool(n) and predict.blocks_need_empty(costs, 0, n, speeds),
                balance=_balance(costs),
                loss_parallel=predict.splits_loss(costs),
            )
        except ValueError as e:  # a split the devices cannot take (too few heads for them)
            return _infeasible(strategy, batch, c.num_devices, "filters", str(e))

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
    per_sample = per_sample_seconds(costs, cluster, batch)
    if p > 1:
        speeds = device_speeds(costs, cluster, batch)
        tiers = device_tiers(cluster, speeds)
        if n:
            out += expert_parallel_candidates(costs, cluster, batch, speeds, s, loads)
        if subsets:
            # A subset's plan can be one already there (a balanced split that leaves the same
            # devices out): not repeated.
            seen = {_same_plan_key(x) for x in out if x.has_plan}
            for keep in device_subsets(cluster, tiers, speeds):
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
                        expert_loads=loads,
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
                rate = 1.0 / seconds_per_sample(costs, cluster, tier[0], micro)
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
        if n:
            out += expert_pipeline_candidates(costs, cluster, out, s, loads)
        if model is not None and n and costs.plan_cut == "blocks":
            report.skipped["node-wise placement"] = (
                "places the filters and neurons of a chain of layers; this model is cut into "
                "blocks (its forward is no chain: a transformer's, a DenseNet's)"
            )
        elif model is not None and n:
            if p <= OWNERS_MAX_DEVICES:
                keep = list(range(p))
            else:
                small = [
                    k
                    for k in device_subsets(cluster, tiers, speeds)
                    if len(k) <= OWNERS_MAX_DEVICES
                ]
                keep = max(small, key=lambda k: (sum(speeds[d] for d in k), -k[0]), default=[])
            if len(keep) > 1:
                out += node_wise_candidates(costs, cluster, batch, model, keep, s, report)
    out = [_runnable(x, costs) for x in out]
    out.sort(key=lambda x: (not x.feasible, x.step_s))
    return out


def _same_plan_key(pred: Prediction) -> tuple[Any, ...]:
    """Two candidates with this equal are the same plan (for dropping repeats)."""
    return (pred.share_unit, tuple(pred.shares), pred.step_s)
