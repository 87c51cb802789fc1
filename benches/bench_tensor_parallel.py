"""Tensor parallelism of a decoder on two ranks of emulated speeds 1 and 0.25, one run:

    python benches/bench_tensor_parallel.py [--batch 32] [--steps 20] [--arch llama]
        [--vocab N] [--json F]

The decoder is the LM example's (``examples/train_lm.py``'s ``make_model``: a byte-level
Llama of 6 blocks, hidden 64, 4 query heads in 2 key/value groups, MLP 176; or GPT-2; with
``--vocab`` a vocabulary of that many tokens instead of 256 bytes, random ids), float32,
sequences of the example's length; or (``--arch mixtral``) a mixture of experts in the same
shape: Hugging Face Mixtral, each block's MLP 8 experts of 176 hidden units, 2 per token, run
by Hugging Face's default kernel (``grouped_mm``), its experts split by hidden units; or
(``--arch llama-lora``) the Llama as a LoRA fine-tuning (PEFT's adapters of rank 8 on its
seven projections, the base frozen), the wrapped projections split with their blocks; or
(``--arch llama-dora``) the same with DoRA's adapters (PEFT's ``use_dora``: each adapted
weight's norm too, the magnitude vector learnt). Each
strategy is :func:`hetcoll.torch.filter_parallel` on a
copy of the same model, trained with SGD on the same global batch:

1. the speed-proportional split (heads' key/value groups and MLP units from
   :func:`hetcoll.split` over the speeds, ``empty_blocks=True``: the slow rank, too slow for
   one of the two key/value groups, holds none) against the even split that Megatron-LM,
   DTensor and DeepSpeed AutoTP use (the same code with equal speeds): step time; and the
   time-balanced split (``sample=``: the work every rank repeats around the blocks, timed on
   the batch, charged at each rank's speed); and the planned split (the same balance by
   *predicted* time: :func:`hetcoll.model.predict.time_balanced_shares` on this machine's
   device, measured before the run, slowed to each rank's speed; given as ``shares=`` per
   module path, as a plan's split stage gives them);
2. the paired split (attention by heads, MLPs by hidden units: two reductions per block
   forward) against gather mode (``avoid_gathers=False``: every Linear gathers its output,
   what ``filter_parallel`` did for transformers before): step time and bytes sent per step
   by kind (``CountingCommunicator``: a ring allreduce counts 2 (p-1)/p of its buffer);
3. the speed-proportional split with its loss split too (``loss_parallel=True``: the head's
   logits stay split by vocabulary, the cross-entropy exchanges three numbers per token)
   against the same split gathering the logits: step time and bytes;
4. every split against the unsplit model on the fast rank alone, the slow rank idle (what a
   user without tensor parallelism would run): whether splitting pays at this size at all.

Step time: median over steps of the slowest rank's step (forward, backward, SGD step); the
strategies take turns step by step, so a change in the machine's load hits them alike.
Heterogeneity is emulated alike for every strategy: each rank's split model runs under
:func:`hetcoll.lab.emulate.slow_down` at its speed (its layers with parameters, a split layer
through its local computation, sleep ``(1/speed - 1)`` times their own forward and backward;
collectives and the attention's parameter-free score products run at full speed). Ranks share
the machine's cores (gloo over loopback), so compare the ratios.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from bench_filter_parallel import quartiles, take_turns
from torch import nn

from hetcoll import launch
from hetcoll.comm import wrap
from hetcoll.lab.emulate import slow_down
from hetcoll.torch import filter_parallel
from hetcoll.torch.filters import FilterParallelExperts, FilterParallelLayer
from hetcoll.torch.transport import CountingCommunicator

SPEEDS = (1.0, 0.25)
ROOT = Path(__file__).resolve().parent.parent
STRATEGIES = (
    "paired, speed-proportional",
    "paired, even split",
    "gather mode, speed-proportional",
    "paired, time-balanced",
    "paired, planned",
    "paired, speed-proportional, loss split",
)
#: The peer of any split: the unsplit model on the fast rank alone (the slow rank idle).
ALONE = "unsplit, fast rank alone"


def lm_example() -> Any:
    """examples/train_lm.py as a module (its make_model, SEQ and VOCAB)."""
    if str(ROOT / "examples") not in sys.path:
        sys.path.insert(0, str(ROOT / "examples"))  # it imports its neighbour train_plan
    spec = importlib.util.spec_from_file_location("train_lm", ROOT / "examples" / "train_lm.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: The projections ``--arch llama-lora`` wraps with PEFT's LoRA adapters (all seven).
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_model(arch: str, vocab: int) -> nn.Module:
    """The example's decoder (``arch`` llama, gpt2 or mixtral: its mixture of experts), or
    (``llama-lora``) its Llama as a LoRA fine-tuning: PEFT's adapters of rank 8 on every
    projection, the base weights frozen; (``llama-dora``) the same adapters as DoRA's."""
    if arch in ("llama-lora", "llama-dora"):
        from peft import LoraConfig, get_peft_model

        base = lm_example().make_model("llama", vocab=vocab)
        config = LoraConfig(
            r=8, lora_alpha=16, target_modules=LORA_TARGETS, use_dora=arch == "llama-dora"
        )
        return get_peft_model(base, config)  # type: ignore[no-any-return]
    return lm_example().make_model(arch, vocab=vocab)  # type: ignore[no-any-return]


def fast_rank_alone(model: nn.Module, ids: torch.Tensor, rank: int, speed: float) -> Any:
    """The peer of any split: one step of a copy of the unsplit ``model`` on the whole batch
    ``ids`` (the example's loss, SGD) on rank 0 alone, at its emulated ``speed``; the other
    ranks idle."""
    ex = lm_example()
    alone = copy.deepcopy(model)
    slow_down(alone, speed)
    opt = torch.optim.SGD(alone.parameters(), lr=1e-3)

    def step() -> None:
        if rank != 0:
            return
        opt.zero_grad()
        ex.lm_loss(alone(input_ids=ids), ids).backward()
        opt.step()

    return step


def _strategy(
    name: str,
    model: nn.Module,
    speed: float,
    counts: dict[str, int],
    ids: torch.Tensor,
    planned: dict[str, list[int]],
) -> tuple[nn.Module, CountingCommunicator]:
    comm = CountingCommunicator(wrap(None), counts)
    speeds = [1.0, 1.0] if "even" in name else list(SPEEDS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the untraceable HF forward and the head, named
        if "planned" in name:
            split = filter_parallel(
                copy.deepcopy(model), group=comm, shares=planned, empty_blocks=True
            )
        else:
            split = filter_parallel(
                copy.deepcopy(model),
                group=comm,
                speeds=speeds,
                avoid_gathers="gather" not in name,
                empty_blocks=True,
                sample={"input_ids": ids} if "time-balanced" in name else None,
                loss_parallel="loss split" in name,
            )
    slow_down(split, speed)
    return split, comm


def _rank(
    rank: int,
    world: int,
    arch: str,
    batch: int,
    steps: int,
    planned: dict[str, list[int]],
    vocab: int,
) -> dict[str, Any]:
    torch.set_num_threads(1)
    ex = lm_example()
    torch.manual_seed(0)
    model = make_model(arch, vocab)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, ex.SEQ), generator=g)
    runs: dict[str, Any] = {}
    runs[ALONE] = {
        "step": fast_rank_alone(model, ids, rank, SPEEDS[0]),
        "counts": {},
        "modes": [],
        "shares": {},
    }
    for name in STRATEGIES:
        counts: dict[str, int] = {}
        split, comm = _strategy(name, model, SPEEDS[rank], counts, ids, planned)
        opt = torch.optim.SGD(split.parameters(), lr=1e-3)

        def step(split: nn.Module = split, comm: Any = comm, opt: Any = opt) -> None:
            opt.zero_grad()
            comm.kind = "activations"
            loss = ex.lm_loss(split(input_ids=ids), ids)
            comm.kind = "gradients"
            loss.backward()
            opt.step()

        modes = [m.mode for m in split.modules() if isinstance(m, FilterParallelLayer)]
        shares = {
            n: list(m.shares)
            for n, m in split.named_modules()
            if (isinstance(m, FilterParallelLayer) and m.mode == "split-input")
            or isinstance(m, FilterParallelExperts)
        }
        runs[name] = {"step": step, "counts": counts, "modes": modes, "shares": shares}
    for run in runs.values():
        step_of = run["step"]

        def counted(run: dict[str, Any] = run, step_of: Any = step_of) -> None:
            run["counts"].clear()  # the last step's bytes are kept
            step_of()

        run["step"] = counted
    times = take_turns({name: runs[name]["step"] for name in (*STRATEGIES, ALONE)}, steps)
    out: dict[str, Any] = {
        "arch": arch,
        "batch": batch,
        "seq": ex.SEQ,
        "vocab": vocab,
        "speeds": list(SPEEDS),
    }
    for name in (*STRATEGIES, ALONE):
        run = runs[name]
        out[name] = {
            **quartiles(times[name]),
            "bytes": dict(run["counts"]),  # the last step's, by kind (the same every step)
            "modes": {m: run["modes"].count(m) for m in sorted(set(run["modes"]))},
            "shares": run["shares"],
        }
    return out


def machine(arch: str, vocab: int) -> tuple[Any, Any, Any]:
    """The model's view of this machine, measured now (:mod:`hetcoll.lab.calibrate`): the
    decoder's costs with the benchmark's loss (the example's next-token cross-entropy), one
    rank's device and the gloo link."""
    import hetcoll.model as hm
    from hetcoll.lab import calibrate

    ex = lm_example()
    device = calibrate.measure_device("rank", 4e9, quick=True)
    fit = calibrate.measure_gloo_link()
    link = fit.link("gloo-local")
    costs = hm.layer_costs(
        make_model(arch, vocab), (ex.SEQ,), dtype=torch.int64, loss=ex.costed_loss
    )
    return costs, device, link


def planned_shares(costs: Any, device: Any, link: Any, batch: int) -> dict[str, list[int]]:
    """The planner's split of the decoder for the two emulated ranks: balanced by predicted
    time (:func:`hetcoll.model.predict.time_balanced_shares`, what ``hetcoll plan`` writes for
    a transformer's split stage) on the ranks as the planner sees them (this machine's device
    slowed to each speed: :func:`hetcoll.lab.emulate.emulated_device`)."""
    from hetcoll.lab.emulate import emulated_device
    from hetcoll.lab.validate import validation_cluster
    from hetcoll.model.predict import time_balanced_shares

    cluster = validation_cluster([emulated_device(device, f) for f in SPEEDS], link)
    return time_balanced_shares(costs, cluster, batch, list(SPEEDS))


def predicted(
    costs: Any, device: Any, link: Any, batch: int, planned: dict[str, list[int]]
) -> dict[str, float]:
    """The performance model's step (seconds) for each strategy but the time-balanced one
    (whose split follows timings the model does not make), each rank's layers with
    parameters slowed to its speed as :func:`slow_down` slows them
    (:func:`hetcoll.lab.predict_emulated.filter_parallel`, ``slowed="parameters"``)."""
    from hetcoll.lab import predict_emulated
    from hetcoll.lab.validate import validation_cluster
    from hetcoll.model.predict import filter_modes

    cluster = validation_cluster([device, device], link)
    out = {}
    for name in STRATEGIES:
        if "time-balanced" in name:
            continue
        parts = [1.0, 1.0] if "even" in name else list(SPEEDS)
        modes = filter_modes(costs, avoid_gathers="gather" not in name)
        pred = predict_emulated.filter_parallel(
            costs,
            cluster,
            batch,
            parts,
            list(SPEEDS),
            slowed="parameters",
            modes=modes,
            empty_blocks=True,
            layer_shares=planned if "planned" in name else None,
            loss_parallel="loss split" in name,
        )
        out[name] = pred.step_s
    alone = predict_emulated.filter_parallel(
        costs, validation_cluster([device], link), batch, [1.0], [SPEEDS[0]], slowed="parameters"
    )
    out[ALONE] = alone.step_s
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--arch", default="llama", choices=["llama", "gpt2", "mixtral", "llama-lora", "llama-dora"]
    )
    ap.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    ap.add_argument(
        "--vocab", type=int, default=256, help="vocabulary size (the example's: 256 bytes)"
    )
    ap.add_argument("--steps", type=int, default=20, help="timed steps per strategy")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--no-predict",
        dest="predict",
        action="store_false",
        help="skip the performance model's predictions (the planned row is still planned)",
    )
    args = ap.parse_args(argv)
    costs, device, link = machine(args.arch, args.vocab)
    planned = planned_shares(costs, device, link, args.batch)
    results = launch.spawn(
        _rank,
        len(SPEEDS),
        args.arch,
        args.batch,
        args.steps,
        planned,
        args.vocab,
        timeout=3600,
    )
    r0 = results[0]
    if args.predict:
        for name, step_s in predicted(costs, device, link, args.batch, planned).items():
            for r in results:
                r[name]["predicted_s"] = step_s
    print(
        f"Emulated heterogeneity: 2 ranks, speeds {SPEEDS[0]:g} and {SPEEDS[1]:g}, gloo; "
        f"{args.arch}, batch {args.batch} x {r0['seq']} tokens"
    )
    base = r0["paired, even split"]["step_s"]
    print(
        f"{'strategy':<34} {'step (ms)':>10} {'vs even':>8} {'bytes fwd':>11} {'bytes bwd':>11}"
        f" {'predicted':>10}"
    )
    for name in (*STRATEGIES, ALONE):
        row = r0[name]
        b = row["bytes"]
        guess = f"{row['predicted_s'] * 1e3:10.1f}" if "predicted_s" in row else f"{'-':>10}"
        print(
            f"{name:<34} {row['step_s'] * 1e3:10.1f} {base / row['step_s']:7.2f}x "
            f"{b.get('activations', 0):11,} {b.get('gradients', 0):11,} {guess}"
        )
    print("shares of the row-split layers:", r0["paired, speed-proportional"]["shares"])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return {"results": results}


if __name__ == "__main__":
    main(sys.argv[1:])
