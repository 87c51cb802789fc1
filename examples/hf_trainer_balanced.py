"""A language model trained with Hugging Face's ``Trainer`` on ranks of unequal speed:
``hetcoll.accelerate.BalancedTrainer``.

    python examples/hf_trainer_balanced.py                                  # one process
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer_balanced.py \
        --emulate 1,0.5 --measure                                           # measured speeds
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer_balanced.py \
        --shares 5,3 --batch 8 --accumulate 2                               # given shares

``BalancedTrainer`` is ``Trainer`` with the training loader balanced: the global batch
(``--batch``, i.e. ``per_device_train_batch_size`` times the processes) is split among the ranks
by ``--shares``, relative ``--speeds`` or speeds ``--measure``d when training starts, and each
rank takes its share of every global batch. Trainer's own token averaging across devices
(``average_tokens_across_devices``, on by default) weighs the gradients by tokens, so every
step, gradient accumulation included, is the gradient of the mean over all valid tokens of the
global step: the model trains as one process on the same global batches (``--float64``: to
rounding on 2 ranks; Hugging Face's loss computes in float32 inside, so on 3 ranks, whose loss
scale 3 is not exact there, to float32's). Trainer's
logs show every rank's share (``share/r``) and speed (``speed/r``).

The model and text are those of ``examples/accelerate_balanced.py`` (a small byte-level Llama,
Mixtral or GPT-2 from a config; rows of the standard library's source, padded). ``--emulate
1,0.5`` runs rank r at that fraction of its real speed (emulated heterogeneity,
``hetcoll.lab.emulate``). ``--arch mixtral --experts`` places Mixtral's experts on the ranks,
whole, by the same shares or speeds (``hetcoll.torch.expert_parallel``): each rank holds its
own experts only, the routed tokens travel between the ranks, and it still trains as one
process (to the router's float32 softmax).

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer_balanced.py \
        --arch mixtral --experts --shares 5,3                               # experts placed

``--rebalance-every N`` re-solves the shares from every rank's own compute time every N
optimizer steps' worth of micro-batches, N times ``--accumulate``
(``BalancedTrainer(rebalance_every=N)``: an ``hetcoll.torch.Rebalancer``); the shares each
step ran at are in the logs:

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer_balanced.py \
        --emulate 1,0.5 --rebalance-every 1 --epochs 3                      # shares follow

``--rebalance-experts N`` places them again by their routed tokens every N optimizer steps
(``BalancedTrainer(rebalance_experts_every=N)``: an ``hetcoll.torch.ExpertRebalancer``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate_balanced import (
    arguments,
    checked,
    make_model,
    place_experts_on_ranks,
    text_rows,
)
from transformers import TrainingArguments

from hetcoll.accelerate import BalancedTrainer
from hetcoll.plan import experts_field
from hetcoll.torch import gather_state_dict


def train(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(
            output_dir=out,
            use_cpu=True,
            per_device_train_batch_size=1,  # set below, once the processes are known
            gradient_accumulation_steps=args.accumulate,
            num_train_epochs=args.epochs,
            learning_rate=args.lr,
            optim="sgd",
            lr_scheduler_type="constant",
            weight_decay=0.0,
            seed=args.seed,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            ddp_find_unused_parameters=False,
            disable_tqdm=args.quiet,
        )
        ranks = training.world_size
        if args.batch % ranks:
            raise SystemExit(f"--batch: {args.batch} is not a multiple of {ranks} processes")
        training.per_device_train_batch_size = args.batch // ranks  # the global batch: --batch
        torch.manual_seed(args.seed)  # every rank builds the same model
        model = make_model(args.arch)
        if args.float64:
            model = model.double()
        if args.experts:  # BalancedTrainer weighs their rows as Trainer's loss needs
            place_experts_on_ranks(model, args, ranks)
        if args.emulate is not None:
            if len(args.emulate) != ranks:
                raise SystemExit(f"--emulate: one speed per process ({ranks}), got {args.emulate}")
            from hetcoll.lab.emulate import slow_down

            slow_down(model, args.emulate[training.process_index])
        trainer = BalancedTrainer(
            model=model,
            args=training,
            train_dataset=text_rows(args.rows, args.seed),
            shares=args.shares,
            speeds=args.speeds,
            measure=args.measure,
            measure_budget=2.0,
            rebalance_every=args.rebalance_every,
            rebalance_experts_every=args.rebalance_experts,
        )
        trainer.train()
        assert trainer.balanced is not None
        logged = [e for e in trainer.state.log_history if "share/0" in e]
        report = {
            "rank": training.process_index,
            "world": ranks,
            "shares": trainer.balanced.shares,
            "speeds": trainer.balanced.speeds,
            "logged": logged,
            "rebalanced": [  # the rebalancer's decisions: after which batch, to which shares
                {"batch": e.step, "shares": list(e.new_shares), "applied": e.applied}
                for e in (trainer.rebalancer.history if trainer.rebalancer else [])
            ],
            "experts_moves": [
                # Counts where runs in expert order, else each rank's experts.
                {"step": e.step, "experts": experts_field(e.new_placement), "moved": e.applied}
                for e in (trainer.expert_rebalancer.history if trainer.expert_rebalancer else [])
            ],
        }
        # With placed experts, every rank's gathered to rank 0 (collective).
        state = gather_state_dict(model, dst=0) if args.experts else model.state_dict()
        if args.save and training.process_index == 0:
            torch.save(state, args.save)
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        return report


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = arguments(__doc__)
    p.add_argument(
        "--rebalance-experts",
        type=int,
        metavar="N",
        help="with --experts: place them again by their routed tokens every N steps",
    )
    args = checked(p, argv)
    if args.rebalance_experts is not None and not args.experts:
        p.error("--rebalance-experts: needs --experts (experts placed on the ranks)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    report = train(args)
    if args.json:
        Path(args.json.format(rank=report["rank"])).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
