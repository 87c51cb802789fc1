"""Plans with experts on real ranks: each replica's rank holds whole experts of Hugging Face
Mixtral, the routed tokens travel between the replicas, and training equals one process on
the whole batch. Run on every rank of a 4-process gloo group (test_plan_experts)."""

from __future__ import annotations

from typing import Any

import pytest
import tensor_parallel_cases as tp
import torch
import transformer_cases as tc

from hetcoll import CollectiveMismatchError, Plan
from hetcoll.torch import parallelize
from hetcoll.torch.expert_parallel import ExpertParallelExperts

LAYERS = 8  # Mixtral's plan layers: embedding, rotary table, 4 blocks, norm, head
EXPERTS = "model.layers.{}.mlp.experts"


def replicas(*samples: int, ranks: tuple[int, ...] | None = None) -> list[dict[str, Any]]:
    """One single-stage replica per entry of ``samples``, on ``ranks`` (default 0, 1, ...)."""
    ranks = ranks or tuple(range(len(samples)))
    return [
        {"samples": n, "stages": [{"ranks": [r], "layers": [0, LAYERS]}]}
        for n, r in zip(samples, ranks, strict=True)
    ]


#: 3 replicas (rank 3 idle), 2 micro-batches each, experts 3 : 1 : 0 of every layer.
BY_SPEED = {"microbatches": 2, "replicas": replicas(3, 2, 2), "experts": [3, 1, 0]}

#: 2 replicas of 2 stages (their ranks crossed), 1F1B, each layer's experts placed its own way.
PIPELINES = {
    "microbatches": 2,
    "schedule": "1F1B",
    "replicas": [
        {
            "samples": 4,
            "stages": [{"ranks": [0], "layers": [0, 4]}, {"ranks": [2], "layers": [4, LAYERS]}],
        },
        {
            "samples": 3,
            "stages": [{"ranks": [3], "layers": [0, 4]}, {"ranks": [1], "layers": [4, LAYERS]}],
        },
    ],
    "experts": {
        EXPERTS.format(0): [4, 0],
        EXPERTS.format(1): [1, 3],
        EXPERTS.format(2): [[1, 3], [0, 2]],  # any experts: each replica's indices
        EXPERTS.format(3): [0, 4],
    },
}


def prompt_rows(plan: Plan, steps: int = 2) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """:func:`transformer_cases.batches` whose last row is all prompt (every label -100, as in
    supervised fine-tuning): the micro-batch holding it weighs nothing in the loss, and its
    backward must still meet the other replicas' at the experts' exchanges."""
    data = tc.batches(plan.batch, steps)
    for _, labels in data:
        labels[-1] = -100
    return data


def trains_as_one_process(
    group: Any,
    plan: Plan,
    data: Any,
    between: Any = None,
    after: Any = None,
    clip: float | None = None,
    make: Any = tc.mixtral,
) -> dict[str, Any]:
    """``plan`` trains Mixtral (``make()``'s, float64, SGD with momentum) as one process on
    the whole batch does: each step's loss and the gathered state to 1e-10.
    ``between(step, par, opt)`` runs between each step's backward and its optimizer step,
    ``after(step, par, opt)`` after it; ``clip``: both clip each step's gradients to that
    norm (every replica's own experts in the plan's). Returns this rank's experts per layer
    and the traffic of its last step."""
    torch.manual_seed(0)
    model = make().double()
    want_losses, want_state = tc.reference(model, data, 0.1, clip)
    par = parallelize(model, plan, loss_fn=tc.lm_loss, items=tc.valid_tokens, group=group)
    opt = torch.optim.SGD(par.parameters(), lr=0.1, momentum=0.9)
    for n, ((x, y), want) in enumerate(zip(data, want_losses, strict=True)):
        loss = par.step(x, y)
        assert abs(loss - want) <= tc.TOL * abs(want), (loss, want)
        if between is not None:
            between(n, par, opt)
        if clip is not None:
            assert par.clip_grad_norm_(clip) > clip
        opt.step()
        opt.zero_grad()
        if after is not None:
            after(n, par, opt)
    got = par.full_state_dict()
    assert list(got) == list(want_state)
    worst = max(tc.rel(got[k], v) for k, v in want_state.items() if v.is_floating_point())
    assert worst <= tc.TOL, worst
    held = {
        n: m.num_experts
        for n, m in (par.stage.named_modules() if par.stage is not None else [])
        if isinstance(m, ExpertParallelExperts)
    }
    return {"held": held, "traffic": par.traffic()}


#: PIPELINES' experts placed again by hand, per replica (each layer its own way: counts, or
#: each replica's experts).
BY_HAND = {
    EXPERTS.format(0): [1, 3],
    EXPERTS.format(1): [4, 0],
    EXPERTS.format(2): [[0, 2, 3], [1]],
    EXPERTS.format(3): [[1, 2], [0, 3]],
}
#: BY_HAND as each replica's experts.
BY_HAND_LISTS = {
    EXPERTS.format(0): [[0], [1, 2, 3]],
    EXPERTS.format(1): [[0, 1, 2, 3], []],
    EXPERTS.format(2): [[0, 2, 3], [1]],
    EXPERTS.format(3): [[1, 2], [0, 3]],
}


def placed_again(group: Any) -> dict[str, Any]:
    """PIPELINES' plan (2 replicas of 2 stages, their ranks crossed) trains 4 steps as one
    process does while its experts move: by hand between the first step's backward and its
    optimizer step (:meth:`Parallel.place_experts`, with their gradients and momentum), then
    by an :class:`ExpertRebalancer` at speeds 1 : 0.25 after the third (looking every 2
    steps), its gradients clipped by the whole model's norm
    (:meth:`Parallel.clip_grad_norm_`), its state loaded in between (the experts moving
    away and back). Returns the plan's experts after each move, the
    rebalancer's decisions, and the routed tokens per layer it placed them by (every
    replica's, summed)."""
    from hetcoll.torch import ExpertRebalancer

    plan = Plan.from_dict(PIPELINES)
    seen: dict[str, Any] = {}
    watch: list[ExpertRebalancer] = []

    def by_hand(n: int, par: Any, opt: Any) -> None:
        if n == 0:
            # Bad arguments raise on every rank, and placements that differ between ranks
            # raise CollectiveMismatchError on every rank, before anything moves.
            for kwargs, error, text in (
                ({}, TypeError, "speeds: give exactly one"),
                ({"speeds": [1.0]}, ValueError, r"speeds: needs one per replica \(2\)"),
                ({"shares": {EXPERTS.format(0): [4, 0]}}, ValueError, "shares: must name every"),
                ({"shares": [4, 0] if par.rank else [0, 4]}, CollectiveMismatchError, "experts"),
            ):
                with pytest.raises(error, match=text):
                    par.place_experts(opt, **kwargs)
            assert par.expert_loads() != {}  # taken: the rebalancer counts from here
            seen["by_hand"] = par.place_experts(opt, shares=BY_HAND)
            assert par.experts_placement == BY_HAND_LISTS  # the plan names them now
            assert par.plan.to_dict()["experts"] == BY_HAND
            watch.append(ExpertRebalancer(par, opt, speeds=[1.0, 0.25], every=2, threshold=0))

    def rebalance(n: int, par: Any, opt: Any) -> None:
        if n > 0:
            watch[0].step()
        if n == 2:  # the tokens the rebalancer placed by: steps 1 and 2's
            assert watch[0].loads is not None
            seen["routed"] = {k: sum(v) for k, v in watch[0].loads.items()}
            seen["loads"] = watch[0].loads
            seen["plan"] = par.experts_placement
            # Its state, as a checkpoint holds it: loaded, the experts go where it puts them,
            # with their momentum, and back (training goes on as one process's).
            saved = watch[0].state_dict()
            assert saved["placement"] == seen["plan"] != BY_HAND_LISTS
            watch[0].load_state_dict({**saved, "step": 0, "placement": BY_HAND_LISTS})
            assert (
                par.experts_placement == BY_HAND_LISTS and par.plan.to_dict()["experts"] == BY_HAND
            )
            watch[0].load_state_dict(saved)
            assert watch[0].state_dict() == saved and par.experts_placement == seen["plan"]

    batches = tc.batches(plan.batch, 4)
    out = trains_as_one_process(group, plan, batches, by_hand, rebalance, clip=0.05)
    decisions = [[e.step, e.new_shares, e.new_placement, e.applied] for e in watch[0].history]
    return {**seen, "decisions": decisions, "held": out["held"]}


def planned(group: Any) -> dict[str, Any]:
    """The planner's expert-parallel plan for Mixtral on a fast device and a slower one (the
    other two ranks idle) trains as one process does."""
    from hetcoll.lab.validate import validation_cluster
    from hetcoll.model import Device, Link, layer_costs, plan

    tokens = {"input_ids": (tc.SEQ,), "attention_mask": (tc.SEQ,)}  # as the batches hold them
    costs = layer_costs(tc.mixtral("grouped_mm"), tokens, dtype=torch.int64)
    devices = [Device(f"d{i}", f, f, 8e9) for i, f in enumerate((2e10, 1e10, 1e10, 1e10))]
    cluster = validation_cluster(devices, Link("link", 1e-4, 1e9))
    found = {p.strategy: p for p in plan(costs, cluster, 8, subsets=False)}
    best = found["expert parallel, balanced"]
    assert best.feasible, best.reason
    chosen = best.to_plan()
    return {"plan": chosen.to_dict(), **trains_as_one_process(group, chosen, tc.batches(8, 2))}


def planned_pipeline(group: Any) -> dict[str, Any]:
    """The planner's fastest pipeline of expert-parallel replicas for Mixtral on one node of
    four devices (2 replicas of 2 stages, each replica's experts by its samples) trains as
    one process does."""
    from hetcoll.model import Cluster, Device, Link, Node, layer_costs, plan

    tokens = {"input_ids": (tc.SEQ,), "attention_mask": (tc.SEQ,)}
    costs = layer_costs(tc.mixtral("grouped_mm"), tokens, dtype=torch.int64)
    node = Node("n", Device("d", 4e10, 4e10, 8e9), 4, Link("l", 1e-4, 1e9))
    twins = [
        p for p in plan(costs, Cluster([node]), 8) if p.strategy.endswith(", experts by speed")
    ]
    assert twins and twins[0].feasible, [p.strategy for p in twins]
    chosen = twins[0].to_plan()
    return {"plan": chosen.to_dict(), **trains_as_one_process(group, chosen, tc.batches(8, 2))}


def bad_plans(group: Any) -> list[str]:
    """Plans with experts that do not fit the model raise the same error on every rank, before
    any transfer (the group works on afterwards)."""
    seen = []
    for model, change in (
        (tc.mixtral(), {"experts": [2, 1, 0]}),  # 3 of Mixtral's 4 experts
        (tc.mixtral(), {"experts": {EXPERTS.format(0): [4, 0, 0]}}),  # one layer of 4
        (tc.llama(), {}),  # no experts to place
    ):
        try:
            parallelize(model, {**BY_SPEED, **change}, loss_fn=tc.lm_loss, group=group)
        except ValueError as e:
            seen.append(str(e))
    return seen


def mixtral_lora() -> torch.nn.Module:
    """:func:`transformer_cases.mixtral` with PEFT's LoRA on its query projections and its
    experts' parameters (``ParamWrapper``), every weight trainable: a plan places each
    replica's experts with their adapters' blocks."""
    parameters = ["experts.gate_up_proj", "experts.down_proj"]
    return tp._trained_whole(tp._with_lora(tc.mixtral(), ["q_proj"], target_parameters=parameters))


def run_all(group: Any, *parts: str) -> dict[str, Any]:
    """The cases named in ``parts`` (every case without), on ``group``."""
    cases = {
        "by_speed": lambda: trains_as_one_process(
            group, Plan.from_dict(BY_SPEED), prompt_rows(Plan.from_dict(BY_SPEED))
        ),
        "lora": lambda: trains_as_one_process(
            group, Plan.from_dict(BY_SPEED), tc.batches(7, 2), make=mixtral_lora
        ),
        "pipelines": lambda: trains_as_one_process(
            group, Plan.from_dict(PIPELINES), tc.batches(Plan.from_dict(PIPELINES).batch, 2)
        ),
        # Weights and Adam's state gathered under one placement resume under the other.
        "resumed": lambda: tc.resumes_on_another_plan(group, tc.mixtral, (BY_SPEED, PIPELINES)),
        "planned": lambda: planned(group),
        "planned_pipeline": lambda: planned_pipeline(group),
        "placed_again": lambda: placed_again(group),
        "errors": lambda: bad_plans(group),
    }
    return {name: run() for name, run in cases.items() if not parts or name in parts}


def run_torch(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    return run_all(None)
