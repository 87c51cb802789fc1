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
from typing import TYPE_CHECKING

import numpy as np

import hetcoll
from hetcoll.model.hypergraph import NetworkHypergraph, network_hypergraph
from hetcoll.plan import Plan

if TYPE_CHECKING:
    import torch

__all__ = ["hypergraph_plan", "placement_traffic"]


def _bytes_per_element(model: torch.nn.Module) -> int:
    for p in model.parameters():
        return p.element_size()
    return 4


def _layer_index(model: torch.nn.Module, h: NetworkHypergraph) -> dict[str, int]:
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
    index = _layer_index(model, h)
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
    import torch

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
    index = _layer_index(model, h)
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
        x = torch.zeros((1, *input_shape), dtype=next(model.parameters()).dtype, device="meta")
        with torch.no_grad():
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


def _meta_call(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``m(x)`` on the meta device (shapes only), leaving ``m`` where it is."""
    import copy

    return copy.deepcopy(m).to("meta")(x)
