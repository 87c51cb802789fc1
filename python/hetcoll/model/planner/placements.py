"""Seed 002's node-wise (owners) plans as planner candidates: every filter and neuron of the
model placed on a device - the hypergraph partition, the even and the speed-proportional
channel split - on a small set of devices, with seed 002's comparison against the other
strategies on the same devices (:attr:`SearchReport.placement_comparison`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

import hetcoll
from hetcoll.model import predict, terms
from hetcoll.model.costs import ModelCosts
from hetcoll.model.hardware import Cluster
from hetcoll.model.planner.rates import per_sample_seconds
from hetcoll.model.planner.report import SearchReport
from hetcoll.model.predict import Prediction
from hetcoll.model.predict.timing import memory_shortfall
from hetcoll.plan import Plan

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
#: Micro-batch counts of the node-wise plans (their replay pipelines channel blocks across
#: micro-batches).
OWNERS_MICRO_BATCHES = (8,)


def node_wise_candidates(
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
    from hetcoll.model.placement import hypergraph_plan, layer_index, placement_traffic
    from hetcoll.model.placement import predict_placement as replay
    from hetcoll.torch.layers import model_layers
    from hetcoll.torch.placement import owners_blocks

    shape = tuple(costs.input_shape)
    k, p = len(keep), cluster.num_devices
    sub = cluster.subset(keep)
    suffix = f", {k} of {p} devices" if k < p else ""
    try:
        h = network_hypergraph(
            model, shape, bytes_per_element=costs.itemsize, max_vertices=OWNERS_MAX_VERTICES
        )
        index = layer_index(model, h)
        layers = model_layers(model)
    except ValueError as e:  # past OWNERS_MAX_VERTICES: checked before any list is built
        report.skipped["node-wise placement"] = str(e).replace("max_vertices: ", "", 1) + (
            " (the planner partitions up to that many; call hypergraph_plan and predict_placement "
            "directly)"
            if str(e).startswith("max_vertices:")
            else ""
        )
        return []
    if k < 2 or k > h.num_vertices:
        return []
    per_sample = per_sample_seconds(costs, sub, batch)
    hyper_flops = 3.0 * float(h.vertex_weights.sum())  # forward, and twice that backward
    rates = [hyper_flops / t for t in per_sample]  # the hypergraph's FLOP/s on each device
    link = sub.ring_link()
    bw = link.bytes_per_s if math.isfinite(link.bytes_per_s) else 1e30
    param_elems = {name: model.get_submodule(name).weight[0].numel() for name, _, _ in h.layers}
    # the share of each placed layer's weights that trains (frozen weights: no gradient)
    trains = {x.name: x.gradient_bytes / x.param_bytes for x in costs.layers if x.param_bytes > 0}
    placed = sum(param_elems[name] * count for name, _, count in h.layers) * costs.itemsize
    placed_trained = sum(
        param_elems[name] * count * trains.get(name, 1.0) for name, _, count in h.layers
    )
    rest = max(costs.param_bytes - placed, 0.0)
    rest_trained = max(costs.gradient_bytes - placed_trained * costs.itemsize, 0.0)
    loss_s = float(
        terms.ring_allreduce_seconds(
            8.0,
            k,
            link.latency_s,
            link.bytes_per_s,
            min(d.mem_bytes_per_s for d in sub.devices),
            8,
            call_s=link.call_of("allreduce"),
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
    # Per block: its convolution kernels and its other kernels, which cost apart
    # (Device.conv_call_s, Device.kernel_overhead_s).
    current = ""
    placed_names = {name for name, _, _ in h.layers}
    kernels: dict[str, np.ndarray] = {}
    for layer in costs.layers:
        if layer.name in placed_names:
            current = layer.name
        if current:
            both = (*layer.forward, *layer.backward)
            conv = sum(k.launches for k in both if k.conv)
            other = sum(k.launches for k in both if not k.conv)
            kernels[current] = kernels.get(current, np.zeros(2)) + np.array([conv, other])
    overhead = np.array([[d.conv_call_s, d.kernel_overhead_s] for d in sub.devices])
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
            owned, trained = np.zeros(k), np.zeros(k)
            for name, first, count in h.layers:
                who = np.asarray(owners[str(index[name])])
                work += np.bincount(
                    who, weights=h.vertex_weights[first : first + count], minlength=k
                )
                mine = np.bincount(who, minlength=k) * param_elems[name] * costs.itemsize
                owned += mine
                trained += mine * trains.get(name, 1.0)
            launches = np.zeros((k, 2))
            for name, _, _ in h.layers:
                launches[np.unique(owners[str(index[name])])] += kernels.get(name, np.zeros(2))
            extra = (launches * overhead).sum(axis=1) * m
            frac = work / max(work.sum(), 1e-30)
            owned += rest * frac
            trained += rest_trained * frac
            update = np.asarray(
                terms.step_update_seconds(
                    trained,
                    np.array([d.mem_bytes_per_s for d in sub.devices]),
                    s,
                    np.array([d.step_overhead_s for d in sub.devices]),
                )
            )
            mem = terms.training_state_bytes(owned, trained, s) + (
                frac * batch * costs.saved_bytes_per_sample()
            )
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
            reason = memory_shortfall(np.asarray(full_mem), cluster.devices)
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
                "bytes_per_step": int(2 * (k - 1) * costs.gradient_bytes),
                "load_balance": terms.load_balance(dp_shares, rates),
                "step_s": dp.step_s,
                "plan": f"data parallel, balanced{suffix}",
            }
        )
    except ValueError as e:
        report.skipped["data parallel"] = str(e)
    report.placement_comparison = {"devices": list(keep), "rows": rows}
    return out
