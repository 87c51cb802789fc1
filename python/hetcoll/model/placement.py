"""Node-wise placements (seed 002) as Plans: from the hypergraph partitioner, and their traffic.

:func:`hypergraph_plan` partitions :func:`~hetcoll.model.network_hypergraph` with
:func:`hetcoll.partition_hypergraph` (each device's target share of the FLOPs proportional to its
speed) and returns the placement as a :class:`hetcoll.Plan` whose one stage gives every filter and
neuron its owner, which :func:`hetcoll.torch.parallelize` runs. :func:`placement_traffic`
predicts the bytes such a plan moves in a step, by the runtime's kinds: the activations and their
gradients are the partition's km1 times the batch (each feature map goes once to each other
rank reading it, and its gradient comes back), the outputs the last layer's channels gathered at
the stage's lead and their gradients sent back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

import hetcoll
from hetcoll.model.hypergraph import NetworkHypergraph, network_hypergraph
from hetcoll.plan import Plan

if TYPE_CHECKING:
    import torch

__all__ = ["PlacementPrediction", "hypergraph_plan", "placement_traffic", "predict_placement"]


def _bytes_per_element(model: torch.nn.Module) -> int:
    for p in model.parameters():
        return p.element_size()
    return 4


def layer_index(model: torch.nn.Module, h: NetworkHypergraph) -> dict[str, int]:
    """network_hypergraph's Conv2d / Linear names -> their index among the plan's layers; each
    must be a top-level layer (an owners stage places chains of top-level children)."""
    from hetcoll.torch.layers import model_layers

    names = [n for n, _ in model_layers(model)]
    out = {}
    for name, _, _ in h.layers:
        if name not in names:
            raise ValueError(
                f"model: layer {name!r} is not one of the model's top-level layers "
                f"({', '.join(names)}); a node-wise placement places top-level Conv2d / Linear "
                "layers"
            )
        out[name] = names.index(name)
    return out


def hypergraph_plan(
    model: torch.nn.Module,
    input_shape: tuple[int, ...],
    speeds: Sequence[float],
    batch: int,
    *,
    microbatches: int = 1,
    epsilon: float = 0.03,
    seed: int = 0,
) -> Plan:
    """The node-wise placement of ``model`` over ranks ``0 .. len(speeds) - 1`` (relative
    FLOP/s) for batches of ``batch`` samples of ``input_shape``: one replica, one stage, every
    Conv2d / Linear channel owned by the block :func:`hetcoll.partition_hypergraph` gives it
    (block ``b``'s FLOPs at most ``(1 + epsilon)`` times its speed's share). Raises
    ``ValueError`` naming the argument for bad input, or ``model`` when the runtime could not
    run the placement (checked as :func:`hetcoll.torch.parallelize` checks it).

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
    ...                           torch.nn.Linear(8 * 6 * 6, 4))
    >>> plan = hypergraph_plan(net, (3, 8, 8), [2.0, 1.0], 16)
    >>> sorted(plan.replicas[0].stages[0].owners)
    [0, 3]
    """
    from hetcoll.torch.layers import model_layers
    from hetcoll.torch.placement import owners_blocks

    speeds = [float(s) for s in speeds]
    if not speeds or any(not math.isfinite(s) or s <= 0 for s in speeds):
        raise ValueError(f"speeds: must be finite numbers > 0, got {speeds}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch: must be an integer >= 1, got {batch!r}")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches: must be an integer >= 1, got {microbatches!r}")
    h = network_hypergraph(model, input_shape, bytes_per_element=_bytes_per_element(model))
    index = layer_index(model, h)
    layers = model_layers(model)
    k = len(speeds)
    stage: dict[str, object] = {"ranks": list(range(k)), "layers": [0, len(layers)]}
    if k > 1:
        if k > h.num_vertices:
            raise ValueError(
                f"speeds: {k} devices but the model has {h.num_vertices} filters and neurons"
            )
        total = sum(speeds)
        parts = hetcoll.partition_hypergraph(
            h.num_vertices,
            h.nets,
            [s / total for s in speeds],
            vertex_weights=h.vertex_weights,
            net_weights=h.net_weights,
            epsilon=epsilon,
            seed=seed,
        )
        stage["owners"] = {
            str(index[name]): [int(b) for b in parts[first : first + count]]
            for name, first, count in h.layers
        }
    plan = Plan.from_dict(
        {
            "microbatches": microbatches,
            "schedule": "GPipe",
            "replicas": [{"samples": batch, "stages": [stage]}],
        }
    )
    if k > 1:
        owners_blocks(layers, plan.replicas[0].stages[0], "model")
    return plan


def placement_traffic(
    model: torch.nn.Module, input_shape: tuple[int, ...], plan: Plan
) -> dict[str, int]:
    """Bytes a step of ``plan`` moves, summed over ranks, by the kinds of
    :meth:`hetcoll.torch.Parallel.traffic`, as the runtime moves them. For one-replica plans
    whose stages are one-rank stages or owners stages, an owners stage being the last one (its
    lead then gathers the outputs; ``ValueError`` names ``plan`` otherwise). Elements are the
    model's dtype.

    The activations (and their gradients) are km1 of the partition the plan makes of
    :func:`network_hypergraph`'s vertices (each filter / neuron on its rank) times the batch: a
    one-rank stage sends its output to each reading rank of the next stage, an owners stage each
    map to each other rank reading it."""
    from hetcoll.torch.layers import model_layers

    if not isinstance(plan, Plan):
        raise TypeError(f"plan: must be a hetcoll.Plan, got {type(plan).__name__}")
    if len(plan.replicas) != 1:
        raise ValueError(f"plan: has {len(plan.replicas)} replicas; traffic is predicted for one")
    stages = plan.replicas[0].stages
    for j, s in enumerate(stages):
        where = f"plan.replicas[0].stages[{j}]"
        if len(s.ranks) > 1 and s.owners is None:
            raise ValueError(f"{where}: splits channels by speeds or shares; give owners")
        if s.owners is not None and j + 1 < len(stages):
            raise ValueError(f"{where}: an owners stage before another stage is not predicted")
    bpe = _bytes_per_element(model)
    h = network_hypergraph(model, input_shape, bytes_per_element=bpe)
    index = layer_index(model, h)
    parts = np.empty(h.num_vertices, dtype=np.int64)
    for name, first, count in h.layers:
        layer = index[name]
        s = next(s for s in stages if s.layers[0] <= layer < s.layers[1])
        if s.owners is not None:
            parts[first : first + count] = [s.ranks[i] for i in s.owners[layer]]
        else:
            parts[first : first + count] = s.ranks[0]
    cut = hetcoll.km1(h.nets, parts, h.net_weights) * plan.batch
    outputs = 0
    last = stages[-1]
    if last.owners is not None:
        from hetcoll.torch.placement import owners_blocks

        layers = model_layers(model)
        block = owners_blocks(layers, last, "plan.replicas[0].stages[-1]")[-1]
        x = _zeros_meta(model, input_shape)
        for _, m in layers[: block.last_layer + 1]:
            x = _meta_call(m, x)
        per_channel = x[0, 0].numel() * bpe
        away = sum(1 for o in block.owners if o != last.ranks[0])
        outputs = 2 * away * per_channel * plan.batch
    return {
        "activations": round(cut),
        "gradients": round(cut),
        "outputs": outputs,
        "allreduce": 0,
    }


@dataclass
class PlacementPrediction:
    """A step of an owners plan: ``step_s`` (seconds, the critical path), ``compute_s`` (each
    rank's busy seconds) and ``traffic`` (:func:`placement_traffic`'s bytes by kind)."""

    step_s: float
    compute_s: list[float]
    traffic: dict[str, int]


def predict_placement(
    model: torch.nn.Module,
    input_shape: tuple[int, ...],
    plan: Plan,
    *,
    flops_per_s: Sequence[float],
    bytes_per_s: float,
    latency_s: float = 0.0,
) -> PlacementPrediction:
    """The step time of a one-stage owners ``plan`` (as :func:`hypergraph_plan` makes) on ranks
    of ``flops_per_s`` (one per group rank) joined by links of ``bytes_per_s`` and
    ``latency_s`` per message.

    It replays the runtime's order (:mod:`hetcoll.torch.placement`): each rank runs the
    forwards of every micro-batch of its first block, then of its next ..., the lead gathers
    the outputs, then the backwards in reverse; an operation starts when its rank is free and
    its inputs have arrived (sent when their producer finished, taking ``latency_s + bytes /
    bytes_per_s``; sends overlap compute, links do not contend). A channel's forward costs its
    ``network_hypergraph`` FLOPs times the micro-batch's rows, its backward twice that; the
    layers between Conv2d / Linear and the loss cost nothing. So a placement giving whole layers
    to different ranks overlaps them across micro-batches rather than serialising them.
    """
    from hetcoll.torch.layers import model_layers
    from hetcoll.torch.placement import owners_blocks

    if not isinstance(plan, Plan):
        raise TypeError(f"plan: must be a hetcoll.Plan, got {type(plan).__name__}")
    if len(plan.replicas) != 1 or len(plan.replicas[0].stages) != 1:
        raise ValueError("plan: must have one replica of one stage (as hypergraph_plan makes)")
    stage = plan.replicas[0].stages[0]
    if stage.owners is None:
        raise ValueError("plan.replicas[0].stages[0]: has no owners")
    speeds = [float(f) for f in flops_per_s]
    if len(speeds) <= max(stage.ranks) or any(not math.isfinite(f) or f <= 0 for f in speeds):
        raise ValueError(
            f"flops_per_s: needs a finite FLOP/s > 0 for each of ranks 0 .. {max(stage.ranks)}, "
            f"got {list(flops_per_s)}"
        )
    if not bytes_per_s > 0 or not latency_s >= 0:
        raise ValueError(
            f"bytes_per_s, latency_s: must be > 0 and >= 0, got {bytes_per_s}, {latency_s}"
        )
    traffic = placement_traffic(model, input_shape, plan)
    bpe = _bytes_per_element(model)
    h = network_hypergraph(model, input_shape, bytes_per_element=bpe)
    first_of = {name: first for name, first, _ in h.layers}
    blocks = owners_blocks(model_layers(model), stage, "plan.replicas[0].stages[0]")
    # Bytes per sample of each output channel as sent: its net's weight (the last block's
    # channels have no net: their map size from a run on the meta device).
    out_bytes = np.zeros(h.num_vertices)
    for net, w in zip(h.nets, h.net_weights, strict=True):
        out_bytes[net[0]] = w
    last = blocks[-1]
    x = _zeros_meta(model, input_shape)
    for _, layer in model_layers(model)[: last.last_layer + 1]:
        x = _meta_call(layer, x)
    first_last = first_of[last.name]
    out_bytes[first_last : first_last + len(last.owners)] = x[0, 0].numel() * bpe
    K, lead = len(blocks), stage.ranks[0]
    sizes = plan.microbatch_sizes(0)

    def flops(k: int, r: int) -> float:
        first = first_of[blocks[k].name]
        mine = [c for c, o in enumerate(blocks[k].owners) if o == r]
        return float(h.vertex_weights[[first + c for c in mine]].sum())

    def message_s(k: int, src: int, rows: int) -> float:
        first = first_of[blocks[k].name]
        mine = [first + c for c, o in enumerate(blocks[k].owners) if o == src]
        return latency_s + float(out_bytes[mine].sum()) * rows / bytes_per_s

    def readers(k: int) -> list[int]:
        return blocks[k + 1].owner_ranks if k + 1 < K else [lead]

    free: dict[int, float] = dict.fromkeys(stage.ranks, 0.0)
    busy: dict[int, float] = dict.fromkeys(stage.ranks, 0.0)
    fwd: dict[tuple[int, int, int], float] = {}  # (block, micro-batch, rank) -> finish
    bwd: dict[tuple[int, int, int], float] = {}

    def run(r: int, ready: float, seconds: float) -> float:
        free[r] = max(free[r], ready) + seconds
        busy[r] += seconds
        return free[r]

    for k in range(K):
        for r in blocks[k].owner_ranks:
            for m, rows in enumerate(sizes):
                ready = 0.0
                if k > 0:
                    ready = max(
                        fwd[k - 1, m, o] + (message_s(k - 1, o, rows) if o != r else 0.0)
                        for o in blocks[k - 1].owner_ranks
                    )
                fwd[k, m, r] = run(r, ready, flops(k, r) * rows / speeds[r])
    gathered = []
    for m, rows in enumerate(sizes):
        ready = max(
            fwd[K - 1, m, o] + (message_s(K - 1, o, rows) if o != lead else 0.0)
            for o in last.owner_ranks
        )
        gathered.append(run(lead, ready, 0.0))
    for m in range(len(sizes)):
        bwd[K, m, lead] = run(lead, gathered[m], 0.0)
    for k in reversed(range(K)):
        for r in blocks[k].owner_ranks:
            for m, rows in enumerate(sizes):
                # A reader's gradient slice for r's channels is as large as r's maps.
                ready = max(
                    bwd[k + 1, m, j] + (message_s(k, r, rows) if j != r else 0.0)
                    for j in readers(k)
                )
                bwd[k, m, r] = run(r, ready, 2 * flops(k, r) * rows / speeds[r])
    return PlacementPrediction(
        step_s=max(free.values()),
        compute_s=[busy.get(r, 0.0) for r in range(len(speeds))],
        traffic=traffic,
    )


def _zeros_meta(model: torch.nn.Module, input_shape: tuple[int, ...]) -> torch.Tensor:
    """One sample of zeros of the model's dtype on the meta device."""
    import torch

    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return torch.zeros((1, *input_shape), dtype=dtype, device="meta")


def _meta_call(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``m(x)`` on the meta device (shapes only), leaving ``m`` where it is."""
    import copy

    import torch

    with torch.no_grad():
        return copy.deepcopy(m).to("meta")(x)
