"""Run by tests/test_accelerate.py: BalancedTrainer with ``rebalance_every=1`` on GPT-2
(float64, AdamW), two accumulated micro-batches of a global 8 rows per optimizer step, 40 rows
(5 micro-batches, 3 optimizer steps an epoch), checkpointing every 2 steps, for ``max_steps``
steps, from ``resume`` (a checkpoint directory, or "none").

Only the clock is faked, so that the speeds are known and the decisions deterministic: the
:class:`~hetcoll.torch.StepTimer` reads a clock that the model's forward advances by its rows
times the rank's cost (``COST``: rank 1 three times slower), i.e. ``t_r(b) = COST[r] b``,
whose best split of 8 rows is 6 : 2.

Under ``torchrun --nproc-per-node 2`` each rank writes ``out/{rank}.json``: the rows it ran in
each micro-batch with the optimizer step it belonged to, the logged shares, the rebalancer's
decisions and, rank 0, the trained weights (``out/final.pt``). Run as one process (no
torchrun, no rebalancer: one rank takes the whole batch) it writes the reference weights.

``GLOBAL`` (default 8): another global batch, for a run resumed from one of 8.

    torchrun --nproc-per-node 2 trainer_rebalance.py OUT RESUME MAX_STEPS [GLOBAL]
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import torch
from transformers import TrainingArguments

import hetcoll.torch.step_timer as step_timer
from hetcoll.accelerate import BalancedTrainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases import gpt2, text_rows

#: Seconds per row on each rank.
COST = (1e-3, 3e-3)
CLOCK = [0.0]


def main() -> None:
    out, resume, max_steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    batch = int(sys.argv[4]) if len(sys.argv) > 4 else 8
    step_timer.time = types.SimpleNamespace(perf_counter=lambda: CLOCK[0])  # type: ignore[attr-defined]
    args = TrainingArguments(
        output_dir=out,
        use_cpu=True,
        per_device_train_batch_size=1,  # set below: a global batch of 8 rows
        gradient_accumulation_steps=2,
        num_train_epochs=2,
        max_steps=max_steps,
        learning_rate=0.05,
        optim="adamw_torch",
        lr_scheduler_type="constant",
        seed=0,
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        report_to="none",
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
    )
    ranks, rank = args.world_size, args.process_index
    args.per_device_train_batch_size = batch // ranks
    model = gpt2()
    ran: list[list[int]] = []  # (optimizer step, rows) of every micro-batch trained

    def advance(module: Any, inputs: Any, kwargs: dict[str, Any], output: Any) -> None:
        rows = int(kwargs["input_ids"].shape[0])
        CLOCK[0] += rows * COST[rank]
        if torch.is_grad_enabled():  # not the trainer's first-step check of the loss
            ran.append([trainer.state.global_step + 1, rows])

    model.register_forward_hook(advance, with_kwargs=True)
    trainer = BalancedTrainer(
        model=model,
        args=args,
        train_dataset=text_rows(40),
        rebalance_every=1,  # one process: nothing to balance, no rebalancer
    )
    trainer.train(resume_from_checkpoint=None if resume == "none" else resume)
    if rank == 0:
        torch.save(model.state_dict(), Path(out, "final.pt"))
    report = {
        "ran": ran,
        "logged": [
            [e[f"share/{r}"] for r in range(ranks)]
            for e in trainer.state.log_history
            if "share/0" in e
        ],
        "decisions": [
            [e.step, list(e.new_shares), e.applied]
            for e in (trainer.rebalancer.history if trainer.rebalancer else [])
        ],
        "speeds": trainer.rebalancer.speeds if trainer.rebalancer else None,
        # The step timer's hooks came off the model with the end of train().
        "hooks_left": len(model._forward_pre_hooks),
    }
    Path(out, f"{rank}.json").write_text(json.dumps(report))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
