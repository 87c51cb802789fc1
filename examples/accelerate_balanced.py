"""A language model trained with Hugging Face Accelerate on ranks of unequal speed:
``hetcoll.accelerate``.

    python examples/accelerate_balanced.py                                  # one process
    torchrun --standalone --nproc-per-node 2 examples/accelerate_balanced.py \
        --emulate 1,0.5 --measure                                           # measured speeds
    torchrun --standalone --nproc-per-node 2 examples/accelerate_balanced.py \
        --shares 5,3 --batch 8 --accumulate 2                               # given shares

Each rank takes its share of every global batch (``--shares``, split from ``--speeds``, or
``--measure``d: every rank's training step timed, the fits exchanged and split), the loader
prepared by Accelerate for the device but not re-sharded (``hetcoll.accelerate.prepare_balanced``).
Every optimizer step (``--accumulate`` micro-batches) counts its valid tokens on every rank
(``hetcoll.accelerate.step_items``); the model divides its summed token losses by the global
count (``num_items_in_batch``) and the loss is scaled by ``step.loss_scale``, so the step is the
gradient of the mean over every valid token of the global step: the model trains as one process
on the same global batches (``--float64``: to rounding, Llama and GPT-2 alike, on 2 ranks;
Hugging Face's loss computes in float32 inside, so on 3 ranks, whose loss scale 3 is not exact
there, to float32's rounding, unless ``--own-loss`` sums the loss in float64 here).
``--plain-mean``, the loss as Accelerate's examples write it, does not. The progress bar
(Accelerate's tqdm, rank 0) shows the shares and speeds. ``--rebalance-every N`` re-solves the
shares every N optimizer steps' worth of micro-batches (N times ``--accumulate``) from each
rank's own compute time (``hetcoll.torch.Rebalancer``
fed by a ``hetcoll.torch.StepTimer``, which leaves out DDP's wait for the other ranks).

The model is a small byte-level Llama (or ``--arch gpt2``, ``--arch mixtral``) built from a
config (no download: ``examples/train_lm.py``'s ``make_model``, smaller); the text, the Python
standard library's own source: rows of ``SEQ`` bytes at random places, each of a random
length (the rest padding, labels -100), so ranks hold different numbers of tokens.
``--emulate 1,0.5`` runs rank r at that fraction of its real speed (it sleeps: emulated
heterogeneity, ``hetcoll.lab.emulate``). ``--arch mixtral --experts`` places Mixtral's experts
on the ranks, whole, by the same shares or speeds (``hetcoll.torch.expert_parallel`` with
``combine="mean"``, as this loss is scaled for DDP's mean): it still trains as one process.
``--save-state DIR`` calls ``accelerator.save_state(DIR)`` after every epoch and ``--resume
DIR`` its ``load_state`` first: the unsplit model and optimizer state
(``hetcoll.accelerate.whole_checkpoints``), so a run saved with its experts placed one way
resumes placed another way, or on another number of processes, and trains on as one process.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sysconfig
from pathlib import Path
from typing import Any

import torch
import train_lm
from accelerate import Accelerator
from torch import nn
from torch.utils.data import default_collate

from hetcoll.accelerate import (
    measure_model_speed,
    optimizer_steps,
    prepare_balanced,
    step_items,
    whole_checkpoints,
)
from hetcoll.torch import Rebalancer, StepTimer, gather_speeds

SEQ = 16
#: Standard-library modules whose source is the text (they ship with every CPython).
CORPUS = ("textwrap.py", "string.py", "difflib.py")


def make_model(arch: str = "llama") -> nn.Module:
    """examples/train_lm.py's byte-level decoder, smaller: 2 layers of width 32 (Llama: 4 heads
    in 2 key-value groups, MLP 88 wide; Mixtral: Llama's with each MLP 4 experts that wide, 2
    per token, its eager kernel; GPT-2: 2 heads), for rows of ``SEQ`` bytes."""
    return train_lm.make_model(
        arch,
        hidden=32,
        layers=2,
        heads=2 if arch == "gpt2" else 4,
        kv_heads=2,
        intermediate=88,
        positions=SEQ,
        experts=4,
        experts_implementation="eager",
    )


def place_experts_on_ranks(
    model: nn.Module, args: argparse.Namespace, ranks: int, combine: str = "average"
) -> None:
    """``--experts``: the model's experts placed whole on the ranks (collective), by
    ``--expert-shares``, else as the rows are split (``--shares``, ``--speeds``, else evenly)."""
    from hetcoll.torch import expert_parallel

    if args.expert_shares:
        expert_parallel(model, shares=args.expert_shares, combine=combine)
    else:
        by = args.shares or args.speeds or [1] * ranks
        expert_parallel(model, speeds=[float(v) for v in by], combine=combine)


class EpochsDone:
    """The epochs trained, saved with Accelerate's state (``register_for_checkpointing``)."""

    def __init__(self) -> None:
        self.epochs = 0

    def state_dict(self) -> dict[str, int]:
        return {"epochs": self.epochs}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epochs = int(state["epochs"])


def text_rows(rows: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``rows`` samples of the standard library's source: ``SEQ`` bytes from a random place,
    the first 2 to ``SEQ`` of them valid, the rest padding (0, masked, labels -100)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data = b"".join((stdlib / name).read_bytes() for name in CORPUS)
    text = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(text) - SEQ, (rows,), generator=g).tolist()
    lengths = torch.randint(2, SEQ + 1, (rows,), generator=g).tolist()
    out = []
    for start, length in zip(starts, lengths):
        mask = (torch.arange(SEQ) < length).long()
        ids = text[start : start + SEQ] * mask
        out.append(
            {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
        )
    return out


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of every valid next-token target, in the logits' precision
    (Hugging Face's own loss computes in float32 inside, whatever the model's dtype)."""
    return nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum"
    )


def train(args: argparse.Namespace) -> dict[str, Any]:
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(args.seed)  # every rank builds the same model
    model = make_model(args.arch)
    if args.float64:
        model = model.double()
    rank, ranks = accelerator.process_index, accelerator.num_processes
    if args.experts:
        # The loss below is scaled for DDP's mean (step.loss_scale): the experts' rows weigh
        # 1 / processes ("mean"), as Trainer's do.
        place_experts_on_ranks(model, args, ranks, combine="mean")
    if args.emulate is not None:
        if len(args.emulate) != ranks:
            raise SystemExit(f"--emulate: one speed per process ({ranks}), got {args.emulate}")
        from hetcoll.lab.emulate import slow_down

        slow_down(model, args.emulate[rank])
    dataset = text_rows(args.rows, args.seed)
    fits = None
    if args.measure:
        fit = measure_model_speed(model, dataset, default_collate, args.batch, time_budget=2.0)
        fits = gather_speeds(fit) if ranks > 1 else [fit]
    data = prepare_balanced(
        accelerator,
        dataset,
        args.batch,
        shares=args.shares,
        speeds=args.speeds,
        fits=fits,
        seed=args.seed,
        collate_fn=default_collate,
    )
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, opt = accelerator.prepare(model, opt)
    # Checkpoints (--save-state, --resume) of the unsplit model and optimizer, whatever the
    # placement of the experts: every process saves and loads; the epochs done ride along.
    whole_checkpoints(accelerator, model, opt)
    done = EpochsDone()
    accelerator.register_for_checkpointing(done)
    if args.resume:
        accelerator.load_state(args.resume)
    rebalancer, timer = None, None
    if args.rebalance_every is not None and ranks > 1:
        # Each rank's own compute per micro-batch (not its wait for the others in DDP's
        # backward); new shares apply from the first batch no rank's loader has cut.
        every = args.rebalance_every * args.accumulate
        rebalancer = Rebalancer(data.sampler, every=every, fits=fits)
        timer = StepTimer(model)
    tokens = 0
    for epoch in range(done.epochs, args.epochs):
        data.set_epoch(epoch)
        bar = data.progress(f"epoch {epoch + 1}/{args.epochs}", disable=args.quiet)
        for micro in optimizer_steps(bar, args.accumulate):
            step = step_items(accelerator, micro)  # every rank's tokens in this step
            for i, batch in enumerate(micro):
                last = i == len(micro) - 1
                with contextlib.nullcontext() if last else accelerator.no_sync(model):
                    if args.plain_mean:  # each rank's own mean, DDP averaging ranks alike
                        loss = model(**batch).loss / len(micro)
                    elif args.own_loss:  # a summed loss of one's own over the step's tokens
                        inputs = {k: v for k, v in batch.items() if k != "labels"}
                        logits = model(**inputs).logits
                        loss = token_loss_sum(logits, batch["labels"]) / step.num_items
                        loss = loss * step.loss_scale
                    else:  # Hugging Face's loss over the global step's tokens
                        loss = model(**batch, num_items_in_batch=step.num_items).loss
                        loss = loss * step.loss_scale
                    accelerator.backward(loss)
                if rebalancer is not None and timer is not None:
                    rebalancer.observe(len(batch["input_ids"]), timer.pop())
            opt.step()
            opt.zero_grad()
            if rebalancer is not None:
                bar.set_postfix(data.postfix(), refresh=False)  # the shares as they move
            tokens += sum(step.local)
        bar.close()
        done.epochs = epoch + 1
        if args.save_state:
            accelerator.save_state(args.save_state)
    report = {
        "rank": rank,
        "world": ranks,
        "shares": data.shares,
        "speeds": data.speeds,
        "tokens": tokens,
        "rebalanced": [  # the rebalancer's decisions: after which batch, to which shares
            {"batch": e.step, "shares": list(e.new_shares), "applied": e.applied}
            for e in (rebalancer.history if rebalancer else [])
        ],
    }
    if args.save or args.save_pretrained:
        # The unsplit model (whole_checkpoints: with --experts, every rank's experts gathered
        # to the main process; collective, and every rank has the same arguments).
        state = accelerator.get_state_dict(model)
        if args.save and accelerator.is_main_process:
            torch.save(state, args.save)
        if args.save_pretrained:  # Accelerate's idiom for a Hugging Face model
            accelerator.unwrap_model(model).save_pretrained(
                args.save_pretrained,
                is_main_process=accelerator.is_main_process,
                save_function=accelerator.save,
                state_dict=state,
            )
    if args.save_model:
        accelerator.save_model(model, args.save_model)  # Accelerate's safetensors, unsplit
    accelerator.end_training()
    # Accelerate keeps the DDP-wrapped model and the optimizer: released here, so that they go
    # while the process group still exists (main collects them before destroying it).
    accelerator.free_memory()
    return report


def numbers(kind: type) -> Any:
    return lambda text: [kind(v) for v in text.split(",")]


def arguments(description: str | None) -> argparse.ArgumentParser:
    """The command line this script shares with examples/hf_trainer_balanced.py."""
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--arch", default="llama", choices=["llama", "mixtral", "gpt2"])
    p.add_argument("--rows", type=int, default=96, help="training rows (samples)")
    p.add_argument("--batch", type=int, default=16, help="the global batch of one micro-step")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    how = p.add_mutually_exclusive_group()
    how.add_argument("--shares", type=numbers(int), help="per-rank batch sizes, e.g. 5,3")
    how.add_argument("--speeds", type=numbers(float), help="relative per-rank speeds, e.g. 2,1")
    how.add_argument("--measure", action="store_true", help="time every rank's step first")
    p.add_argument(
        "--emulate", type=numbers(float), metavar="S0,S1,...", help="rank r at S_r of its speed"
    )
    p.add_argument(
        "--experts",
        action="store_true",
        help="--arch mixtral: place its experts on the ranks by the shares or speeds",
    )
    p.add_argument(
        "--expert-shares",
        type=numbers(int),
        metavar="E0,E1,...",
        help="--experts, each rank holding that many experts of every layer instead",
    )
    p.add_argument(
        "--rebalance-every",
        type=int,
        metavar="N",
        help="re-solve the shares from the ranks' own compute times every N x --accumulate "
        "micro-batches",
    )
    p.add_argument("--float64", action="store_true", help="train in float64")
    p.add_argument("--save", help="write the trained state dict here (rank 0)")
    p.add_argument("--json", help="write each rank's report here ({rank} is replaced)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def checked(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``p``'s arguments, ``--experts`` checked (this script's and hf_trainer_balanced.py's)."""
    args = p.parse_args(argv)
    args.experts = args.experts or args.expert_shares is not None
    if args.experts and args.arch != "mixtral":
        p.error("--experts: places a mixture of experts' experts; use --arch mixtral")
    if args.experts and args.measure:
        p.error("--experts: give --shares or --speeds (the probe cannot time placed experts)")
    if args.rebalance_every is not None and args.rebalance_every < 1:
        p.error("--rebalance-every: must be >= 1")
    return args


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = arguments(__doc__)
    p.add_argument(
        "--plain-mean",
        action="store_true",
        help="the baseline: each rank's loss its own mean (as Accelerate's examples write it), "
        "DDP averaging the ranks alike: not the global step's mean on uneven shares",
    )
    p.add_argument(
        "--own-loss",
        action="store_true",
        help="the loss summed by this script in the model's precision and divided by the "
        "step's tokens, instead of Hugging Face's (float32 inside)",
    )
    p.add_argument(
        "--save-state",
        metavar="DIR",
        help="accelerator.save_state here after every epoch: the unsplit model and optimizer "
        "(hetcoll.accelerate.whole_checkpoints), the epochs done",
    )
    p.add_argument(
        "--save-model",
        metavar="DIR",
        help="accelerator.save_model here at the end: the unsplit model's safetensors",
    )
    p.add_argument(
        "--save-pretrained",
        metavar="DIR",
        help="the model's save_pretrained here at the end, of accelerator.get_state_dict: the "
        "unsplit model, which from_pretrained reads",
    )
    p.add_argument(
        "--resume", metavar="DIR", help="accelerator.load_state from here first, and go on"
    )
    args = checked(p, argv)
    if args.accumulate < 1:
        p.error("--accumulate: must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    report = train(args)
    if args.json:
        Path(args.json.format(rank=report["rank"])).write_text(json.dumps(report))
    if torch.distributed.is_initialized():  # an orderly end: the ranks leave the group together
        # DDP's reducer, freed at interpreter exit after the group was destroyed, could abort
        # a rank ("terminate called without an active exception"): free it first.
        gc.collect()
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
