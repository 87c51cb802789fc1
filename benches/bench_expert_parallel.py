"""Expert parallelism of a mixture of experts on two ranks of emulated speeds 1 and 0.25:

    python benches/bench_expert_parallel.py [--batch 32] [--steps 20] [--json F]

The model is Hugging Face Mixtral in the LM example's shape (``bench_tensor_parallel.py
--arch mixtral``'s: 6 blocks, hidden 64, each block's MLP 8 experts of 176 hidden units, 2
per token, Hugging Face's default kernel ``grouped_mm``), float32, random byte sequences of
the example's length. Each strategy trains a copy of the same model with SGD on the same
global batch, data-parallel (DDP with :func:`hetcoll.torch.register_weighted_hook`, rows of
the batch by :func:`hetcoll.split` over the speeds unless said otherwise):

1. experts placed by speed (:func:`hetcoll.torch.expert_parallel`, ``speeds=``: 7 of the 8
   experts on the fast rank) against the even placement DeepSpeed-MoE and Megatron-LM use
   (4 and 4, the same code given ``shares=``), both with rows by speed; and the even
   placement with even rows too (16 and 16: those libraries' data parallelism as well);
2. every expert on every rank (plain data parallelism, the experts replicated: twice their
   memory, no all-to-all), rows by speed;
3. the unsplit model on the fast rank alone, the slow rank idle;
4. the placement by speed as a plan (:func:`hetcoll.torch.parallelize` of a
   :class:`hetcoll.Plan` with ``experts``, the plan the planner's ``"expert parallel,
   balanced"`` candidate writes at these speeds): the same experts and rows, run by the plan
   runtime (its gradients summed after the backward) rather than DDP's bucketed hook;
5. the same plan in 4 micro-batches (one forward and backward per micro-batch, every
   replica in each: a quarter of the activations held, four times the exchanges).

6. a router that favours two experts (``SKEWED``: a bias of ``SKEW_BIAS`` on the logits of
   experts 5 and 7, as a trained router's loads can drift): the experts placed by speed (runs:
   expert 7 alone on the slow rank) against placed by the loads measured in one forward of
   the batch (:func:`hetcoll.torch.expert_loads`, then ``expert_parallel(..., loads=)``: any
   experts on any rank), rows by speed for both; predicted at those loads.

Each strategy also reports the bytes of parameters each rank holds (the experts' memory).

Predicted: the performance model's step for each strategy
(:func:`hetcoll.model.predict.expert_parallel_schedule`, replicated experts and the fast rank
alone :func:`~hetcoll.model.predict.data_parallel_schedule`, the plan
:func:`~hetcoll.model.predict.expert_plan_schedule`), on this machine's device and gloo
link measured before the run (:mod:`hetcoll.lab.calibrate`), each rank's layers with
parameters slowed to its speed as ``slow_down`` slows them
(:func:`hetcoll.lab.predict_emulated.slowed_by_parameters`).

Step time: median over steps of the slowest rank's step (forward, backward, SGD step); the
strategies take turns step by step, so a change in the machine's load hits them alike.
Heterogeneity is emulated alike for every strategy: each rank's model runs under
:func:`hetcoll.lab.emulate.slow_down` at its speed (its layers with parameters, the placed
experts through their local computation, sleep ``(1/speed - 1)`` times their own forward and
backward; collectives run at full speed). Ranks share the machine's cores (gloo over
loopback), so compare the ratios.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import warnings
from typing import Any

import torch
from bench_filter_parallel import quartiles, take_turns
from bench_tensor_parallel import fast_rank_alone, lm_example
from bench_tensor_parallel import make_model as bench_model
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import hetcoll
import hetcoll.torch
from hetcoll import launch
from hetcoll.lab.emulate import slow_down
from hetcoll.model.planner.experts import expert_parallel_plan
from hetcoll.torch import (
    ExpertParallelExperts,
    expert_parallel,
    parallelize,
    register_weighted_hook,
)
from hetcoll.torch.expert_parallel import find_experts
from hetcoll.torch.layers import model_layers

SPEEDS = (1.0, 0.25)
EXPERTS = 8
#: name -> (experts placed: "speed", "even" or None for replicated; rows: "speed" or "even")
STRATEGIES: dict[str, tuple[str | None, str]] = {
    "experts by speed, rows by speed": ("speed", "speed"),
    "experts even, rows by speed": ("even", "speed"),
    "experts even, rows even": ("even", "even"),
    "experts replicated, rows by speed": (None, "speed"),
}
#: The peer of any placement: the unsplit model on the fast rank alone (the slow rank idle).
ALONE = "unsplit, fast rank alone"
#: The placement by speed as a plan run by parallelize, in one micro-batch and in several.
PLANNED = "experts by speed, rows by speed, plan"
PLANNED_MB = "experts by speed, rows by speed, plan, 4 micro-batches"
PLANS = {PLANNED: 1, PLANNED_MB: 4}
#: The peer the placement by speed is compared with: the even placement of DeepSpeed-MoE and
#: Megatron-LM, rows even too.
EVEN = "experts even, rows even"
#: The router that favours two experts: its logits get SKEW_BIAS on experts SKEW_HOT.
SKEW_HOT = (5, 7)
SKEW_BIAS = 0.2
#: Strategies on the skewed router: experts by speed (the peer) and by measured loads.
SKEWED = {
    "skewed router: experts by speed": "speed",
    "skewed router: experts by load": "load",
}


class SkewedRouter(nn.Module):
    """Mixtral's top-k router (the same weight, the same softmax, top-k and renormalisation)
    with a fixed bias on some experts' logits: a router whose loads lean to those experts."""

    def __init__(self, router: Any, hot: tuple[int, ...], bias: float) -> None:
        super().__init__()
        self.top_k: int = router.top_k
        self.hidden_dim: int = router.hidden_dim
        self.weight: nn.Parameter = router.weight
        self.shift = torch.zeros(int(self.weight.shape[0]))
        self.shift[list(hot)] = bias

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states, self.weight) + self.shift
        probs = torch.softmax(logits.float(), dim=-1)
        top, index = torch.topk(probs, self.top_k, dim=-1)
        return logits, top / top.sum(dim=-1, keepdim=True), index


def skewed(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose every router favours experts ``SKEW_HOT``."""
    out = copy.deepcopy(model)
    for block in [m for m in out.modules() if hasattr(m, "gate") and hasattr(m, "experts")]:
        block.gate = SkewedRouter(block.gate, SKEW_HOT, SKEW_BIAS)
    return out


def measured_loads(model: nn.Module, mine: torch.Tensor) -> dict[str, list[int]]:
    """The tokens each expert of ``model`` (placed by speed here) receives in one forward of
    every rank's rows: :func:`hetcoll.torch.expert_loads` (collective)."""
    from hetcoll.torch import expert_loads

    probe = copy.deepcopy(model)
    expert_parallel(probe, speeds=list(SPEEDS))
    with torch.no_grad():
        probe(input_ids=mine)
    return expert_loads(probe)


def make_model() -> nn.Module:
    return bench_model("mixtral", 256)


def _strategy(name: str, model: nn.Module, speed: float) -> tuple[nn.Module, list[int]]:
    """The rank's model for strategy ``name``, slowed to ``speed``; the experts per rank."""
    experts, _ = STRATEGIES[name]
    placed = copy.deepcopy(model)
    if experts is not None:
        how: dict[str, Any] = (
            {"speeds": list(SPEEDS)} if experts == "speed" else {"shares": [EXPERTS // 2] * 2}
        )
        expert_parallel(placed, **how)
    slow_down(placed, speed)
    held = next(
        (list(m.shares) for m in placed.modules() if isinstance(m, ExpertParallelExperts)),
        [EXPERTS] * len(SPEEDS),
    )
    return placed, held


def _rank(rank: int, world: int, batch: int, steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*bos_token_id|.*eos_token_id")
    ex = lm_example()
    torch.manual_seed(0)
    model = make_model()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (batch, ex.SEQ), generator=g)
    runs: dict[str, Any] = {}
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    runs[ALONE] = {
        "step": fast_rank_alone(model, ids, rank, SPEEDS[0]),
        "experts": [EXPERTS, 0],
        "rows": [batch, 0],
        "param_bytes": int(whole) if rank == 0 else 0,
    }
    for name, (_, rows_by) in STRATEGIES.items():
        placed, held = _strategy(name, model, SPEEDS[rank])
        ddp = DistributedDataParallel(placed)
        register_weighted_hook(ddp)
        opt = torch.optim.SGD(placed.parameters(), lr=1e-3)
        rows = hetcoll.split(batch, list(SPEEDS) if rows_by == "speed" else [1.0] * world)
        start = sum(rows[:rank])
        mine = ids[start : start + rows[rank]]

        def step(ddp: nn.Module = ddp, opt: Any = opt, mine: torch.Tensor = mine) -> None:
            opt.zero_grad()
            ex.lm_loss(ddp(input_ids=mine), mine).backward()
            opt.step()

        own = sum(p.numel() * p.element_size() for p in placed.parameters())
        runs[name] = {
            "step": step,
            "experts": held,
            "rows": [int(r) for r in rows],
            "param_bytes": int(own),
        }
    for name, m in PLANS.items():
        plan = expert_parallel_plan(batch, SPEEDS, find_experts(model), len(model_layers(model)), m)
        par = parallelize(copy.deepcopy(model), plan, loss_fn=ex.lm_loss)
        assert par.stage is not None
        slow_down(par.stage, SPEEDS[rank])
        par_opt = torch.optim.SGD(par.parameters(), lr=1e-3)

        def plan_step(par: Any = par, par_opt: Any = par_opt) -> None:
            par_opt.zero_grad()
            par.step({"input_ids": ids}, ids)
            par_opt.step()

        runs[name] = {
            "step": plan_step,
            "experts": plan.to_dict().get("experts", []),  # counts where runs: as written
            "rows": [r.samples for r in plan.replicas],
            "param_bytes": int(sum(p.numel() * p.element_size() for p in par.parameters())),
        }
    lean = skewed(model)
    rows = hetcoll.split(batch, list(SPEEDS))
    mine = ids[sum(rows[:rank]) : sum(rows[: rank + 1])]
    loads = measured_loads(lean, mine)
    placements: dict[str, Any] = {}
    for name, by in SKEWED.items():
        placed = copy.deepcopy(lean)
        how: dict[str, Any] = {"loads": loads} if by == "load" else {}
        expert_parallel(placed, speeds=list(SPEEDS), **how)
        placements[name] = {
            path: [list(h) for h in m.placement]
            for path, m in placed.named_modules()
            if isinstance(m, ExpertParallelExperts)
        }
        slow_down(placed, SPEEDS[rank])
        ddp = DistributedDataParallel(placed)
        register_weighted_hook(ddp)
        opt = torch.optim.SGD(placed.parameters(), lr=1e-3)

        def lean_step(ddp: nn.Module = ddp, opt: Any = opt, mine: torch.Tensor = mine) -> None:
            opt.zero_grad()
            ex.lm_loss(ddp(input_ids=mine), mine).backward()
            opt.step()

        first = next(iter(placements[name].values()))
        runs[name] = {
            "step": lean_step,
            "experts": [len(h) for h in first],
            "rows": [int(r) for r in rows],
            "param_bytes": int(sum(p.numel() * p.element_size() for p in placed.parameters())),
        }
    names = (*STRATEGIES, *PLANS, ALONE, *SKEWED)
    times = take_turns({name: runs[name]["step"] for name in names}, steps)
    out: dict[str, Any] = {"arch": "mixtral", "batch": batch, "seq": ex.SEQ, "speeds": [*SPEEDS]}
    for name in names:
        out[name] = {
            **quartiles(times[name]),
            "experts": runs[name]["experts"],
            "rows": runs[name]["rows"],
            "param_bytes": runs[name]["param_bytes"],  # this rank's
        }
    out["skewed router"] = {
        "hot": list(SKEW_HOT),
        "bias": SKEW_BIAS,
        "loads": loads,
        "placements": placements,
    }
    return out


def predicted(batch: int) -> dict[str, float]:
    """The performance model's step (seconds) for each strategy, the emulation modelled."""
    from bench_tensor_parallel import machine

    from hetcoll.lab.predict_emulated import slowed_by_parameters
    from hetcoll.lab.validate import validation_cluster
    from hetcoll.model.predict import (
        data_parallel_schedule,
        expert_parallel_schedule,
        expert_plan_schedule,
    )

    costs, device, link = machine("mixtral", 256)
    cluster = validation_cluster([device] * len(SPEEDS), link)
    out: dict[str, float] = {}
    for name, (experts, rows_by) in STRATEGIES.items():
        rows = hetcoll.split(batch, list(SPEEDS) if rows_by == "speed" else [1.0] * len(SPEEDS))
        if experts is None:
            schedule: Any = data_parallel_schedule(costs, cluster, rows)
        else:
            held = (
                hetcoll.torch.expert_shares(EXPERTS, list(SPEEDS))
                if experts == "speed"
                else [EXPERTS // 2] * 2
            )
            schedule = expert_parallel_schedule(costs, cluster, rows, held)
        out[name] = slowed_by_parameters(schedule, costs, list(SPEEDS)).step_s
    layers = [(block.module, block.experts) for block in costs.experts]
    for name, m in PLANS.items():
        plan = expert_parallel_plan(batch, SPEEDS, layers, len(costs.plan_layers), m)
        out[name] = slowed_by_parameters(
            expert_plan_schedule(costs, cluster, plan), costs, list(SPEEDS)
        ).step_s
    alone = data_parallel_schedule(costs, validation_cluster([device], link), [batch])
    out[ALONE] = slowed_by_parameters(alone, costs, [SPEEDS[0]]).step_s
    return out


def predicted_skewed(batch: int, skew: dict[str, Any]) -> dict[str, float]:
    """The model's step for the skewed router's strategies: each placement priced at the loads
    the run measured (``expert_parallel_schedule(..., loads=)``), the emulation modelled."""
    from bench_tensor_parallel import machine

    from hetcoll.lab.predict_emulated import slowed_by_parameters
    from hetcoll.lab.validate import validation_cluster
    from hetcoll.model.predict import expert_parallel_schedule

    costs, device, link = machine("mixtral", 256)
    cluster = validation_cluster([device] * len(SPEEDS), link)
    rows = hetcoll.split(batch, list(SPEEDS))
    return {
        name: slowed_by_parameters(
            expert_parallel_schedule(
                costs, cluster, rows, skew["placements"][name], loads=skew["loads"]
            ),
            costs,
            list(SPEEDS),
        ).step_s
        for name in SKEWED
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per strategy")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--no-predict",
        dest="predict",
        action="store_false",
        help="skip the performance model's predictions",
    )
    args = ap.parse_args(argv)
    guesses = predicted(args.batch) if args.predict else {}
    results = launch.spawn(_rank, len(SPEEDS), args.batch, args.steps, timeout=3600)
    if args.predict:
        guesses.update(predicted_skewed(args.batch, results[0]["skewed router"]))
    for r in results:
        for name, step_s in guesses.items():
            r[name]["predicted_s"] = step_s
        for name in (*STRATEGIES, *PLANS, ALONE, *SKEWED):
            r[name]["param_bytes_per_rank"] = [q[name]["param_bytes"] for q in results]
    r0 = results[0]
    print(
        f"Emulated heterogeneity: 2 ranks, speeds {SPEEDS[0]:g} and {SPEEDS[1]:g}, gloo; "
        f"Mixtral ({EXPERTS} experts, 2 per token), batch {args.batch} x {r0['seq']} tokens"
    )
    base = r0[EVEN]["step_s"]
    print(
        f"{'strategy':<55} {'step (ms)':>10} {'vs even':>8} {'experts':>9} {'rows':>9}"
        f" {'predicted':>10}"
    )
    for name in (*STRATEGIES, *PLANS, ALONE, *SKEWED):
        row = r0[name]
        guess = f"{row['predicted_s'] * 1e3:10.1f}" if "predicted_s" in row else f"{'-':>10}"
        print(
            f"{name:<55} {row['step_s'] * 1e3:10.1f} {base / row['step_s']:7.2f}x "
            f"{':'.join(map(str, row['experts'])):>9} {':'.join(map(str, row['rows'])):>9}"
            f" {guess}"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return {"results": results}


if __name__ == "__main__":
    main(sys.argv[1:])
