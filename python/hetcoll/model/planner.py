"""The planner: which strategy, which split, how fast - and how that changes along seed 003's five
axes (batch size, device FLOP/s, memory bandwidth, link bandwidth, cluster size).

:func:`plan` evaluates every candidate (data parallel with balanced and with even shares, filter
parallel with balanced filters, pipelines of a few micro-batch counts, the same on a few device
subsets, and asymmetric replicas) and ranks them: feasible plans first, fastest first. Each
candidate carries the :class:`hetcoll.Plan` the runtime runs. :func:`sweep` re-plans along one
axis.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
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
    if costs.plan_layers and pred.plan is None and pred.feasible:
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
    plan = None
    if pred.plan is not None:
        doc = pred.plan.to_dict()
        for r in doc["replicas"]:
            for st in r["stages"]:
                st["ranks"] = [keep[x] for x in st["ranks"]]
        plan = Plan.from_dict(doc)
    return replace(
        pred,
        strategy=f"{pred.strategy}{suffix}",
        shares=shares,
        memory_bytes=memory,
        plan=plan,
        detail={**pred.detail, "devices": list(keep)},
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


def plan(
    costs: ModelCosts,
    cluster: Cluster,
    batch: int,
    *,
    optimizer_state_copies: int = 1,
    micro_batches: Sequence[int] = PIPELINE_MICRO_BATCHES,
    subsets: bool = True,
    asymmetric: bool = True,
    precision: str | None = None,
) -> list[Prediction]:
    """Every candidate plan for one step of ``batch`` samples, best first (feasible before
    infeasible, then by predicted step time). Each carries the :class:`hetcoll.Plan` that
    :func:`hetcoll.torch.parallelize` runs (:meth:`Prediction.to_plan`) when the model can be
    cut into one (``costs.plan_layers``); candidates the runtime cannot run are marked
    infeasible.

    The candidates: data parallel with balanced and with even shares; filter parallel with
    balanced filters; pipelines of one-device stages cut between top-level layers, for each
    count of ``micro_batches``; with ``subsets``, balanced data and filter parallelism on a
    few device subsets (the fastest kinds of device, the strongest node), so that a device
    that only slows the step is left out; with ``asymmetric`` (clusters of up to
    ``ASYMMETRIC_MAX_DEVICES`` devices and several kinds of device), whole-model replicas on
    the fastest kinds beside one replica of the others (a pipeline, or one filter-split
    stage), the samples split by each replica's predicted time.

    ``precision``: the training precision (``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"``;
    :meth:`ModelCosts.at_precision`); default that of ``costs`` (``costs.precision``).

    >>> best = plan(costs, cluster, 256, precision="bf16")[0]  # doctest: +SKIP
    >>> best.strategy, best.shares, best.step_s  # doctest: +SKIP
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch: must be an integer >= 1, got {batch!r}")
    if precision is not None:
        costs = costs.at_precision(precision)
    p = cluster.num_devices
    out: list[Prediction] = []
    s = optimizer_state_copies
    n = len(costs.plan_layers)
    modes = costs.stage_filter_modes(0, n) if n else None
    # Filter parallelism only where filter_parallel splits something (not an LSTM, say).
    splits = bool(modes) if n else bool(costs.filter_modes)

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
    if p > 1:
        if splits:
            out.append(filter_balanced(cluster, "filter parallel, balanced"))
        for m in micro_batches:
            if m <= batch:
                out.append(
                    predict.pipeline(
                        costs,
                        cluster,
                        batch,
                        m,
                        strategy=f"pipeline, {m} micro-batches",
                        optimizer_state_copies=s,
                    )
                )
        speeds = _device_speeds(costs, cluster, batch)
        tiers = _tiers(cluster, speeds)
        if subsets:
            # A subset's plan can be one already there (a balanced split that leaves the same
            # devices out): not repeated.
            seen = {repr((x.plan.to_dict(), x.step_s)) for x in out if x.plan is not None}
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
                    )
                else:
                    candidates = [data_balanced(sub, "data parallel, balanced")]
                    if splits:
                        candidates.append(filter_balanced(sub, "filter parallel, balanced"))
                for pred in candidates:
                    if not pred.feasible:
                        continue
                    pred = _on_devices(pred, keep, p, suffix)
                    key = repr((pred.plan.to_dict(), pred.step_s)) if pred.plan else ""
                    if not key or key not in seen:
                        seen.add(key)
                        out.append(pred)
        if asymmetric and n and len(tiers) > 1 and p <= ASYMMETRIC_MAX_DEVICES:
            for k in range(1, len(tiers)):
                fast = sorted(d for t in tiers[:k] for d in t)
                slow = sorted(d for t in tiers[k:] for d in t)
                if len(slow) > 1:
                    out += _asymmetric(
                        costs, cluster, batch, fast, slow, speeds, ASYMMETRIC_MICRO_BATCHES, s
                    )
    out = [_runnable(x, costs) for x in out]
    out.sort(key=lambda x: (not x.feasible, x.step_s))
    return out


SWEEP_AXES = ("batch", "flops", "mem_bw", "link_bw", "nodes")
_FACTORS = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)


@dataclass
class SweepPoint:
    """One point of a sweep: the axis value and the best plan of each strategy family there."""

    value: float
    best: dict[str, Prediction]


def _family(strategy: str) -> str:
    """The strategy without its micro-batches, device subset or replica shapes."""
    if strategy.startswith(("pipeline", "asymmetric")):
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
