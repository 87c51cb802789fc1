"""Expert parallelism as planner candidates: data-parallel replicas of one device each, every
mixture-of-experts layer's experts placed on them whole (:func:`hetcoll.torch.expert_parallel`'s
rule, :func:`hetcoll.torch.expert_shares`), as a :class:`hetcoll.Plan` with ``experts``
that :func:`hetcoll.torch.parallelize` runs, priced by :func:`predict.predict_plan`."""

from __future__ import annotations

from collections.abc import Sequence

import hetcoll
from hetcoll.model import predict
from hetcoll.model.costs import ModelCosts
from hetcoll.model.hardware import Cluster
from hetcoll.model.predict import Prediction
from hetcoll.plan import Plan


def expert_parallel_candidates(
    costs: ModelCosts,
    cluster: Cluster,
    batch: int,
    speeds: Sequence[float],
    optimizer_state_copies: int = 1,
) -> list[Prediction]:
    """Expert parallelism over the cluster: ``"balanced"``, each device's samples and
    experts in proportion to its ``speeds`` (a device given no sample sits the step out),
    and ``"even"`` (the even experts and samples of DeepSpeed-MoE and Megatron-LM). None
    where the model holds no experts layer or the cluster one device. A placement that does
    not fit a device's memory is an infeasible candidate, as any other."""
    from hetcoll.torch.expert_parallel import expert_shares

    if not costs.experts or cluster.num_devices < 2:
        return []
    out = []
    even = [1.0] * cluster.num_devices
    for name, by in (("balanced", list(speeds)), ("even", even)):
        rows = [int(n) for n in hetcoll.split(batch, by)]
        keep = [d for d, n in enumerate(rows) if n > 0]
        placed = {
            block.module: expert_shares(block.experts, [by[d] for d in keep])
            for block in costs.experts
        }
        alike = {tuple(v) for v in placed.values()}
        plan = Plan.from_dict(
            {
                "microbatches": 1,
                "replicas": [
                    {
                        "samples": rows[d],
                        "stages": [{"ranks": [d], "layers": [0, len(costs.plan_layers)]}],
                    }
                    for d in keep
                ],
                "experts": list(alike.pop()) if len(alike) == 1 else placed,
            }
        )
        out.append(
            predict.predict_plan(
                costs,
                cluster,
                plan,
                optimizer_state_copies=optimizer_state_copies,
                strategy=f"expert parallel, {name}",
            )
        )
    return out
