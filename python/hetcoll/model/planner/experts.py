"""Expert parallelism as planner candidates: data-parallel replicas of one device each, every
mixture-of-experts layer's experts placed on them whole (:func:`hetcoll.torch.expert_parallel`'s
rule, :func:`hetcoll.torch.expert_assignment`: in runs by speed, or by the experts' measured
loads where they are given), as a :class:`hetcoll.Plan` with ``experts`` that
:func:`hetcoll.torch.parallelize` runs, priced by :func:`predict.predict_plan`; and the
replicated pipelines the planner found, their experts placed on their replicas likewise
(:func:`expert_pipeline_candidates`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

import hetcoll
from hetcoll.model import predict
from hetcoll.model.costs import ModelCosts
from hetcoll.model.hardware import Cluster
from hetcoll.model.predict import Prediction
from hetcoll.plan import Plan, experts_field


def place_layers(
    experts: Sequence[tuple[str, int]],
    speeds: Sequence[float],
    loads: Mapping[str, np.ndarray] | None = None,
) -> dict[str, list[list[int]]]:
    """Each experts layer's experts (``experts``: module path and experts) on devices of
    ``speeds``: :func:`hetcoll.torch.expert_assignment`, which places them in runs by speed
    where every expert counts alike, and where ``loads`` (checked:
    :func:`predict.checked_loads`) gives the layer's measured tokens per expert, any experts on
    any device so that the slowest device's tokens over its speed are fewest."""
    from hetcoll.torch.expert_parallel import expert_assignment

    placed = {}
    for path, n in experts:
        load = None if loads is None else loads.get(path)
        placed[path] = expert_assignment(
            n, list(speeds), loads=None if load is None else load.tolist()
        )
    return placed


def expert_parallel_plan(
    batch: int,
    speeds: Sequence[float],
    experts: Sequence[tuple[str, int]],
    layers: int,
    microbatches: int = 1,
    loads: Mapping[str, np.ndarray] | None = None,
) -> Plan:
    """Expert parallelism at ``speeds`` (one per device) as a :class:`hetcoll.Plan`: a
    single-rank replica of the model's ``layers`` on each device its share of ``batch``
    (:func:`hetcoll.split`) gives samples, and each experts layer (``experts``: module path
    and experts, as :func:`hetcoll.torch.expert_parallel.find_experts` and ``costs.experts``
    give them) placed on those devices by the same speeds and by ``loads`` where given
    (:func:`place_layers`): counts where a layer's experts lie in runs. ``microbatches``: each
    replica's samples run in that many passes (every replica at least that many samples),
    under 1F1B, so that one pass's activations live at a time (GPipe would hold them all)."""
    rows = [int(n) for n in hetcoll.split(batch, list(speeds))]
    keep = [d for d, n in enumerate(rows) if n > 0]
    placed = place_layers(experts, [speeds[d] for d in keep], loads)
    return Plan.from_dict(
        {
            "microbatches": microbatches,
            **({"schedule": "1F1B"} if microbatches > 1 else {}),
            "replicas": [
                {"samples": rows[d], "stages": [{"ranks": [d], "layers": [0, layers]}]}
                for d in keep
            ],
            "experts": experts_field(placed),
        }
    )


def expert_parallel_candidates(
    costs: ModelCosts,
    cluster: Cluster,
    batch: int,
    speeds: Sequence[float],
    optimizer_state_copies: int = 1,
    loads: Mapping[str, np.ndarray] | None = None,
) -> list[Prediction]:
    """Expert parallelism over the cluster (:func:`expert_parallel_plan`): ``"balanced"``,
    each device's samples and experts in proportion to its ``speeds`` (a device given no
    sample sits the step out; with ``loads``, the experts placed by them), and ``"even"``
    (the even runs of experts and the even samples of DeepSpeed-MoE and Megatron-LM, whatever
    the loads). Both priced at ``loads`` (checked: :func:`predict.checked_loads`) where given.
    None where the model holds no experts layer or the cluster one device.
    Where a placement's activations do not fit a device's memory, its samples run in
    micro-batches, the fewest of 2, 4, 8, ... that fit (each replica at least one sample a
    micro-batch); a placement that fits in none is an infeasible candidate, as any other."""
    if not costs.experts or cluster.num_devices < 2:
        return []
    layers = [(block.module, block.experts) for block in costs.experts]
    out = []
    # The even candidate stays in runs whatever the loads (the peer's placement).
    for name, by, placed_by in (
        ("balanced", list(speeds), loads),
        ("even", [1.0] * cluster.num_devices, None),
    ):
        fewest = min(n for n in hetcoll.split(batch, by) if n > 0)
        m = 1
        while True:
            found = predict.predict_plan(
                costs,
                cluster,
                expert_parallel_plan(batch, by, layers, len(costs.plan_layers), m, placed_by),
                optimizer_state_copies=optimizer_state_copies,
                strategy=f"expert parallel, {name}",
                loads=loads,
            )
            if found.feasible or 2 * m > fewest:
                break
            m *= 2
        out.append(found)
    return out


#: The replicated pipelines whose expert-parallel twin the planner costs: the fastest few, of
#: one-rank stages and at most ``EXPERT_PIPELINE_MAX_REPLICAS`` replicas (a twin is simulated
#: replica by replica: its replicas meet at every exchange).
EXPERT_PIPELINES = 4
EXPERT_PIPELINE_MAX_REPLICAS = 64


def expert_pipeline_candidates(
    costs: ModelCosts,
    cluster: Cluster,
    candidates: Sequence[Prediction],
    optimizer_state_copies: int = 1,
    loads: Mapping[str, np.ndarray] | None = None,
) -> list[Prediction]:
    """Pipelines of expert-parallel replicas: of ``candidates``, the ``EXPERT_PIPELINES``
    fastest replicated pipelines of one-rank stages (feasible or not), each again with every
    experts layer's experts placed on its replicas in proportion to their samples (the
    planner split the batch by each replica's speed), and by ``loads`` where given
    (:func:`place_layers`), priced by :func:`predict.predict_plan` at those loads. Each rank
    then holds its replica's experts of its stage only, so pipelines too large for a device
    with every expert can fit. None for a model without experts layers."""
    if not costs.experts:
        return []
    layers = [(block.module, block.experts) for block in costs.experts]
    pipelines = sorted(
        (
            x
            for x in candidates
            if x.has_plan
            and 2 <= x.detail.get("replicas", 0) <= EXPERT_PIPELINE_MAX_REPLICAS
            and x.detail.get("stages", 1) > 1
            and "experts" not in x.detail
        ),
        key=lambda x: x.step_s,
    )
    out: list[Prediction] = []
    for pred in pipelines:
        if len(out) == EXPERT_PIPELINES:
            break
        base = pred.plan
        if base is None:
            continue
        samples = [float(r.samples) for r in base.replicas]
        placed = place_layers(layers, samples, loads)
        try:
            twin = Plan.from_dict({**base.to_dict(), "experts": experts_field(placed)})
            out.append(
                predict.predict_plan(
                    costs,
                    cluster,
                    twin,
                    optimizer_state_copies=optimizer_state_copies,
                    strategy=f"{pred.strategy}, experts by {'load' if loads else 'speed'}",
                    loads=loads,
                )
            )
        except ValueError:
            # Replicas the plan's experts cannot span (a stage over several ranks, too few
            # samples for the micro-batches; Plan says which), or experts across stages.
            continue
    return out
