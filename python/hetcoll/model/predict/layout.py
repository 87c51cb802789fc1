"""A plan in costed layers: each stage's devices, layers ``[lo, hi)``, the bytes it sends the
next stage and how a filter-split stage splits (:class:`StageLayout`), and each replica's
samples, micro-batches and stages (:class:`ReplicaLayout`); :func:`plan_layout` reads a
:class:`hetcoll.Plan` into them, checked against the model and the cluster as the runtime
checks it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hetcoll.model.costs import ModelCosts
from hetcoll.model.hardware import Cluster
from hetcoll.model.predict.filters import stage_split
from hetcoll.plan import Plan


@dataclass(frozen=True)
class StageLayout:
    """A stage as the simulation needs it: devices, costed layers ``[lo, hi)``, the bytes per
    sample it sends the next stage, and how a filter-split stage splits."""

    ranks: tuple[int, ...]
    lo: int
    hi: int
    out_bytes_per_sample: float
    parts: tuple[float, ...] = ()
    modes: Mapping[str, str] | None = None
    layer_shares: Mapping[str, Sequence[int]] | None = None
    empty_blocks: bool = False
    loss_parallel: bool = False  # the last stage's output split through the loss


@dataclass(frozen=True)
class ReplicaLayout:
    samples: int
    micro: tuple[int, ...]
    stages: tuple[StageLayout, ...]


def plan_layout(costs: ModelCosts, cluster: Cluster, plan: Plan) -> list[ReplicaLayout]:
    """The plan in costed layers, checked against the model and the cluster."""
    if not isinstance(plan, Plan):
        raise TypeError(f"plan: must be a hetcoll.Plan, got {type(plan).__name__}")
    costs.check_plan_layers()
    n_layers = len(costs.plan_layers)
    if plan.num_layers != n_layers:
        raise ValueError(
            f"plan: its stages cover {plan.num_layers} layers but the model has {n_layers} "
            f"({', '.join(costs.plan_layers)})"
        )
    missing = [r for r in plan.ranks if r >= cluster.num_devices]
    if missing:
        raise ValueError(
            f"plan: names rank {missing[0]} but the cluster has {cluster.num_devices} devices"
        )
    out = []
    # Stages alike but for their ranks are checked and laid out once (and so share their
    # modes: the replica classes of .classes key them by identity).
    built: dict[tuple[Any, ...], StageLayout] = {}
    for i, replica in enumerate(plan.replicas):
        stages = []
        for j, stage in enumerate(replica.stages):
            where = f"plan.replicas[{i}].stages[{j}]"
            if stage.owners is not None:
                raise ValueError(
                    f"{where}: places channels by owners; predict_plan does not model such "
                    "stages yet (hetcoll.model.predict_placement predicts a one-stage one)"
                )
            last = j + 1 == len(replica.stages)
            shares = (
                None
                if stage.shares is None
                else tuple(sorted((k, tuple(v)) for k, v in stage.shares.items()))
            )
            key = (
                len(stage.ranks),
                tuple(stage.layers),
                last,
                stage.speeds,
                shares,
                stage.empty_blocks,
                None if stage.named_shares is None else tuple(stage.named_shares.items()),
            )
            if key not in built:
                built[key] = stage_layout(
                    costs,
                    stage.ranks,
                    stage.layers,
                    last,
                    stage.speeds,
                    stage.shares,
                    where,
                    stage.empty_blocks,
                    stage.named_shares,
                )
            b = built[key]
            stages.append(
                StageLayout(
                    tuple(stage.ranks),
                    b.lo,
                    b.hi,
                    b.out_bytes_per_sample,
                    b.parts,
                    b.modes,
                    b.layer_shares,
                    b.empty_blocks,
                    stage.loss_parallel and len(stage.ranks) > 1,
                )
            )
        out.append(ReplicaLayout(replica.samples, tuple(plan.microbatch_sizes(i)), tuple(stages)))
    return out


def stage_layout(
    costs: ModelCosts,
    ranks: Sequence[int],
    layers: tuple[int, int],
    last: bool,
    speeds: Sequence[float] | None,
    shares: Mapping[int, Sequence[int]] | None,
    where: str,
    empty_blocks: bool = False,
    named_shares: Mapping[str, Sequence[int]] | None = None,
    loss_parallel: bool = False,
) -> StageLayout:
    """A stage over plan layers ``layers`` on ``ranks``, checked as the runtime checks it
    (``named_shares``: a transformer stage's shares by module path; ``loss_parallel``: a
    last stage's output split through the loss, where several ranks split it)."""
    first, end = layers
    lo, hi = costs.plan_range(first, end)
    sent = 0.0 if last else costs.plan_out_bytes[end - 1]
    p = len(ranks)
    if p == 1:
        return StageLayout(tuple(ranks), lo, hi, sent)
    modes, named = stage_split(costs, first, end, p, shares, where, empty_blocks, named_shares)
    parts = speeds if speeds is not None else (1.0,) * p
    return StageLayout(
        tuple(ranks), lo, hi, sent, tuple(parts), modes, named, empty_blocks, loss_parallel and last
    )
