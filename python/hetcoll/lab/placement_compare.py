"""Seed 002's comparison for one model: node-wise (hypergraph) placement against the other ways
of sharing it over devices of unequal speed, as plans hetcoll runs and as predicted figures.

:func:`comparison_plans` builds the five plans that ``benches/bench_placement.py`` measures (and
that ``hetcoll plan`` can show for a user's model), one replica each over ranks ``0 .. k - 1``:

- **hypergraph placement**: :func:`hetcoll.model.hypergraph_plan` (every filter and neuron on
  the rank the partitioner gives it; micro-batches pipeline the blocks across ranks);
- **even filter split**: one stage on every rank, every Conv2d / Linear split into equal shares
  of channels (:func:`hetcoll.torch.filter_parallel`'s pairing);
- **speed-proportional filter split**: the same stage with shares proportional to the speeds;
- **pipeline**: one rank per stage, the top-level layers cut by :func:`hetcoll.partition_chain`
  over each layer's forward FLOPs and the speeds, the batch in micro-batches (GPipe);
- **data parallel**: a whole-model replica per rank, samples split by :func:`hetcoll.split`.

:func:`placement_compare` adds, per plan, the bytes a step moves summed over ranks (by the
kinds of :meth:`hetcoll.torch.Parallel.traffic`) where the library predicts them, and the
load-balance ratio of the compute (:func:`balance`): the slowest rank's compute time over the
time every rank would take if the same work were shared in proportion to the speeds — seed
002's (and the partitioner's) imbalance, a part's weight over its target, for the worst part;
1.0 is perfect, and the step can be no shorter than this times the ideal. Predicted from each
rank's forward FLOPs (Conv2d / Linear, as :func:`hetcoll.model.network_hypergraph` counts them);
the benchmark measures it from timed compute.

Lab code: the library never imports it; the ``hetcoll`` command may, inside a subcommand.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from torch import nn

import hetcoll
from hetcoll.model import terms
from hetcoll.model.costs import layer_costs
from hetcoll.model.costs.inputs import sample_shape
from hetcoll.model.hardware import Cluster
from hetcoll.model.hypergraph import NetworkHypergraph, network_hypergraph
from hetcoll.model.placement import hypergraph_plan, placement_traffic, predict_placement
from hetcoll.model.predict import predict_plan
from hetcoll.plan import Plan
from hetcoll.torch.filters import filter_shares
from hetcoll.torch.layers import model_layers

__all__ = [
    "STRATEGIES",
    "ComparisonRow",
    "balance",
    "comparison_plans",
    "comparison_table",
    "layer_flops",
    "layout",
    "placement_compare",
]

#: The strategies compared, in table order.
STRATEGIES = (
    "hypergraph placement",
    "even filter split",
    "speed-proportional filter split",
    "pipeline",
    "data parallel",
)


def _check(
    model: nn.Module, input_shape: Sequence[int], speeds: Sequence[float], batch: int
) -> tuple[tuple[int, ...], list[float]]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: must be a torch.nn.Module, got {type(model).__name__}")
    shape = sample_shape(input_shape)
    if isinstance(speeds, (str, bytes)) or not isinstance(speeds, Sequence):
        raise TypeError(f"speeds: must be a sequence of numbers, got {speeds!r}")
    try:
        fs = [float(s) for s in speeds]
    except (TypeError, ValueError) as e:
        raise TypeError(f"speeds: must be numbers, got {list(speeds)!r}") from e
    if len(fs) < 2 or any(not math.isfinite(s) or s <= 0 for s in fs):
        raise ValueError(f"speeds: needs two or more finite numbers > 0, got {list(speeds)!r}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < len(fs):
        raise ValueError(f"batch: must be an integer >= the number of speeds, got {batch!r}")
    return shape, fs


def balance(compute_s: Sequence[float], speeds: Sequence[float]) -> float:
    """The load-balance ratio of ranks that computed ``compute_s`` seconds at relative
    ``speeds``: ``max_r t_r / T`` with ``T = sum_r t_r s_r / sum_r s_r``, the time each would
    take were the same work (``t_r s_r``, in seconds at speed 1) shared in proportion to the
    speeds. 1.0 is perfect balance.

    >>> balance([2.0, 2.0, 2.0], [1.0, 0.5, 0.25])  # work in proportion to the speeds
    1.0
    >>> round(balance([1.0, 2.0, 4.0], [1.0, 0.5, 0.25]), 3)  # equal work: 4 / (3 / 1.75)
    2.333
    """
    t = [float(x) for x in compute_s]
    s = [float(x) for x in speeds]
    if len(t) != len(s) or not t:
        raise ValueError(f"compute_s, speeds: need one entry per rank, got {len(t)} and {len(s)}")
    if any(not math.isfinite(x) or x < 0 for x in t):
        raise ValueError(f"compute_s: must be finite seconds >= 0, got {t}")
    if any(not math.isfinite(x) or x <= 0 for x in s):
        raise ValueError(f"speeds: must be finite numbers > 0, got {s}")
    if not any(x > 0 for x in t):
        raise ValueError(f"compute_s: needs some compute, got {t}")
    # The work each rank did, in seconds at speed 1, at the rates of its speed.
    return terms.load_balance([a * b for a, b in zip(t, s)], s)


def _hypergraph(model: nn.Module, shape: tuple[int, ...]) -> NetworkHypergraph:
    bpe = next((p.element_size() for p in model.parameters()), 4)
    return network_hypergraph(model, shape, bytes_per_element=bpe)


def layer_flops(model: nn.Module, input_shape: Sequence[int]) -> list[float]:
    """Forward FLOPs per sample of each of the model's top-level layers
    (:func:`hetcoll.torch.layers.model_layers`): its Conv2d / Linear layers' as
    :func:`~hetcoll.model.network_hypergraph` counts them, 0 for the others.

    >>> layer_flops(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)), (4,))
    [24.0, 0.0, 12.0]
    """
    shape, _ = _check(model, input_shape, [1.0, 1.0], 2)
    h = _hypergraph(model, shape)
    names = [n for n, _ in model_layers(model)]
    out = [0.0] * len(names)
    for name, first, count in h.layers:
        top = [i for i, n in enumerate(names) if name == n or name.startswith(n + ".")]
        if not top:
            raise ValueError(f"model: layer {name!r} is in no top-level layer ({names})")
        out[top[0]] += float(h.vertex_weights[first : first + count].sum())
    return out


def _pipeline_stages(flops: Sequence[float], speeds: Sequence[float]) -> list[dict[str, object]]:
    """One-rank stages cut by partition_chain; a rank given no layers is idle."""
    counts = hetcoll.partition_chain(list(flops), list(speeds))
    stages: list[dict[str, object]] = []
    at = 0
    for rank, n in enumerate(counts):
        if n:
            stages.append({"ranks": [rank], "layers": [at, at + n]})
        at += n
    return stages


def comparison_plans(
    model: nn.Module,
    input_shape: Sequence[int],
    speeds: Sequence[float],
    batch: int,
    *,
    microbatches: int = 4,
    epsilon: float = 0.03,
    seed: int = 0,
) -> dict[str, Plan]:
    """The plans of :data:`STRATEGIES` for ``model`` (top-level layers that
    :func:`hetcoll.torch.parallelize` cuts) on ranks of relative ``speeds`` and global batches
    of ``batch`` samples of ``input_shape``. The hypergraph placement and the pipeline run
    ``microbatches`` GPipe micro-batches; the filter splits and data parallelism one.
    ``ValueError`` names the argument for bad input (``model`` for a model a node-wise
    placement cannot run, as :func:`hetcoll.model.hypergraph_plan` says).

    >>> net = nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
    >>> plans = comparison_plans(net, (1, 8, 8), [2.0, 1.0], 16)
    >>> [r.samples for r in plans["data parallel"].replicas]
    [11, 5]
    """
    shape, fs = _check(model, input_shape, speeds, batch)
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches: must be an integer >= 1, got {microbatches!r}")
    k = len(fs)
    n = len(model_layers(model))
    ranks = list(range(k))

    def one(stages: list[dict[str, object]], m: int = 1) -> Plan:
        return Plan.from_dict(
            {
                "microbatches": m,
                "schedule": "GPipe",
                "replicas": [{"samples": batch, "stages": stages}],
            }
        )

    samples = hetcoll.split(batch, fs, minimum=1)
    return {
        "hypergraph placement": hypergraph_plan(
            model, shape, fs, batch, microbatches=microbatches, epsilon=epsilon, seed=seed
        ),
        "even filter split": one([{"ranks": ranks, "layers": [0, n], "speeds": [1.0] * k}]),
        "speed-proportional filter split": one([{"ranks": ranks, "layers": [0, n], "speeds": fs}]),
        "pipeline": one(_pipeline_stages(layer_flops(model, shape), fs), microbatches),
        "data parallel": Plan.from_dict(
            {
                "microbatches": 1,
                "schedule": "GPipe",
                "replicas": [
                    {"samples": b, "stages": [{"ranks": [r], "layers": [0, n]}]}
                    for r, b in enumerate(samples)
                ],
            }
        ),
    }


@dataclass(frozen=True)
class ComparisonRow:
    """One strategy's plan and predicted figures. ``traffic``: bytes a step moves summed over
    ranks, by kind (None where the library has no prediction: the filter splits' gathers and
    reductions); ``flops``: each rank's forward FLOPs per step; ``balance``: :func:`balance` of
    the compute times ``flops[r] / speeds[r]``; ``step_s``: the predicted step on the cluster
    given to :func:`placement_compare` (None without one, or where the predictor refuses the
    plan: ``note`` says why)."""

    strategy: str
    plan: Plan
    traffic: dict[str, int] | None
    flops: list[float]
    balance: float
    step_s: float | None = None
    note: str = ""

    @property
    def bytes_per_step(self) -> int | None:
        """The traffic summed over kinds (None: not predicted)."""
        return None if self.traffic is None else sum(self.traffic.values())


def _rank_flops(
    model: nn.Module,
    shape: tuple[int, ...],
    plan: Plan,
    h: NetworkHypergraph,
    flops: list[float],
    k: int,
) -> list[float]:
    """Each of ranks ``0 .. k - 1``'s forward FLOPs in a step of ``plan`` (one rank per stage, a
    split stage by its filter shares, an owners stage by its owners; idle ranks 0)."""
    out = np.zeros(k)
    names = [n for n, _ in model_layers(model)]
    first_of = {name: (first, count) for name, first, count in h.layers}
    for replica in plan.replicas:
        for stage in replica.stages:
            lo, hi = stage.layers
            if len(stage.ranks) == 1:
                out[stage.ranks[0]] += replica.samples * sum(flops[lo:hi])
            elif stage.owners is not None:
                for layer, owners in stage.owners.items():
                    first, count = first_of[names[layer]]
                    w = h.vertex_weights[first : first + count]
                    for i, r in enumerate(stage.ranks):
                        out[r] += replica.samples * float(w[np.asarray(owners) == i].sum())
            else:
                sub = nn.Sequential(*[m for _, m in model_layers(model)[lo:hi]])
                speeds = list(stage.speeds) if stage.speeds else [1.0] * len(stage.ranks)
                shares = filter_shares(sub, size=len(stage.ranks), speeds=speeds)
                for j in range(lo, hi):
                    split = shares.get(str(j - lo))
                    for i, r in enumerate(stage.ranks):
                        part = 1.0 if split is None else split[i] / sum(split)
                        out[r] += replica.samples * flops[j] * part
    return [float(x) for x in out]


def placement_compare(
    model: nn.Module,
    input_shape: Sequence[int],
    speeds: Sequence[float],
    batch: int,
    *,
    microbatches: int = 4,
    epsilon: float = 0.03,
    seed: int = 0,
    cluster: Cluster | None = None,
) -> list[ComparisonRow]:
    """:func:`comparison_plans` with each plan's predicted traffic and compute balance, in
    :data:`STRATEGIES` order. Traffic: :func:`hetcoll.model.placement_traffic` for the
    hypergraph placement and the pipeline; a ring allreduce of every parameter for data
    parallelism, ``2 (k - 1) / k`` of the parameter bytes on each of the ``k`` ranks (as
    :meth:`hetcoll.torch.Parallel.traffic` counts a collective); None for the filter splits.

    With a ``cluster`` (device ``r`` = rank ``r``, one per speed), each row also gets a
    predicted step time: :func:`hetcoll.model.predict_placement` for the hypergraph placement
    (each device's convolution FLOP/s, the cluster's ring link),
    :func:`hetcoll.model.predict_plan` for the others.

    >>> net = nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
    >>> rows = placement_compare(net, (1, 8, 8), [2.0, 1.0], 16)
    >>> [r.strategy for r in rows][-1], rows[-1].traffic["allreduce"]
    ('data parallel', 9888)
    """
    plans = comparison_plans(
        model, input_shape, speeds, batch, microbatches=microbatches, epsilon=epsilon, seed=seed
    )
    shape, fs = _check(model, input_shape, speeds, batch)
    if cluster is not None:
        if not isinstance(cluster, Cluster):
            raise TypeError(
                f"cluster: must be a hetcoll.model.Cluster, got {type(cluster).__name__}"
            )
        if cluster.num_devices != len(fs):
            raise ValueError(
                f"cluster: has {cluster.num_devices} devices; give one per speed ({len(fs)})"
            )
    h = _hypergraph(model, shape)
    flops = layer_flops(model, shape)
    k = len(fs)
    rows = []
    for strategy in STRATEGIES:
        plan = plans[strategy]
        traffic: dict[str, int] | None
        if strategy in ("hypergraph placement", "pipeline"):
            traffic = placement_traffic(model, shape, plan)
        elif strategy == "data parallel":
            traffic = {"activations": 0, "gradients": 0, "outputs": 0}
            # Each of the k ranks counts its ring's 2 (k-1)/k of the buffer, rounded.
            traffic["allreduce"] = k * round(2 * (k - 1) / k * h.parameter_bytes)
        else:
            traffic = None
        per_rank = _rank_flops(model, shape, plan, h, flops, k)
        times = [f / s for f, s in zip(per_rank, fs)]
        step_s, note = _predicted_step(model, shape, plan, cluster) if cluster else (None, "")
        rows.append(
            ComparisonRow(strategy, plan, traffic, per_rank, balance(times, fs), step_s, note)
        )
    return rows


def _predicted_step(
    model: nn.Module, shape: tuple[int, ...], plan: Plan, cluster: Cluster
) -> tuple[float | None, str]:
    """The library's predicted step of ``plan`` on ``cluster`` (None and why, if it refuses)."""
    try:
        if any(s.owners is not None for _, _, s in plan.stages()):
            link = cluster.ring_link()
            p = predict_placement(
                model,
                shape,
                plan,
                flops_per_s=[d.conv_rate for d in cluster.devices],
                bytes_per_s=link.bytes_per_s,
                latency_s=link.latency_s,
            )
            return p.step_s, ""
        dtype = next((q.dtype for q in model.parameters()), None)
        if dtype is None:
            costs = layer_costs(model, shape)
        else:
            costs = layer_costs(model, shape, dtype=dtype)
        return predict_plan(costs, cluster, plan).step_s, ""
    except ValueError as e:
        return None, str(e)


def comparison_table(rows: Sequence[ComparisonRow]) -> str:
    """``rows`` as a plain-text table: predicted MB per step, its ratio to data parallelism's,
    the compute balance and each plan's layout."""
    dp = next((r.bytes_per_step for r in rows if r.strategy == "data parallel"), None)
    timed = any(r.step_s is not None for r in rows)
    step = f" {'step ms':>8}" if timed else ""
    lines = [f"{'strategy':<32} {'MB/step':>9} {'vs DP':>7} {'balance':>8}{step}  layout"]
    for r in rows:
        b = r.bytes_per_step
        mb = f"{b / 1e6:9.3f}" if b is not None else f"{'-':>9}"
        rel = f"{b / dp:7.3f}" if b is not None and dp else f"{'-':>7}"
        ms = ""
        if timed:
            ms = f" {r.step_s * 1e3:8.1f}" if r.step_s is not None else f" {'-':>8}"
        lines.append(f"{r.strategy:<32} {mb} {rel} {r.balance:8.2f}{ms}  {layout(r.plan)}")
    return "\n".join(lines)


def layout(plan: Plan) -> str:
    """A plan in a few words: samples per replica, each stage's ranks and layers, and an owners
    stage's channels per rank."""
    parts = []
    for replica in plan.replicas:
        stages = []
        for s in replica.stages:
            lo, hi = s.layers
            who = (
                f"rank {s.ranks[0]}"
                if len(s.ranks) == 1
                else "ranks " + ",".join(map(str, s.ranks))
            )
            text = f"{who}: layers {lo}-{hi}"
            if s.owners is not None:
                counts = np.bincount(
                    np.concatenate([np.asarray(o) for o in s.owners.values()]),
                    minlength=len(s.ranks),
                )
                text += " (channels " + "/".join(str(int(c)) for c in counts) + ")"
            elif s.speeds is not None:
                text += " (speeds " + ":".join(f"{x:g}" for x in s.speeds) + ")"
            stages.append(text)
        parts.append(f"{replica.samples} samples, " + ", ".join(stages))
    return " | ".join(parts)
