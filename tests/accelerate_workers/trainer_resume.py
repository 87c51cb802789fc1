"""Run under ``torchrun --nproc-per-node 2`` by tests/test_accelerate.py: BalancedTrainer on
Mixtral (float64, AdamW: the checkpoint must hold its moments) at shares 5:3, checkpointing
every 2 steps (Trainer's own checkpoints), for ``max_steps`` steps, from ``resume`` (a
checkpoint directory, or "none"). Rank 0 writes the trained weights to
``out/final-{max_steps}.pt`` and, not resumed, the weights Trainer's
``load_best_model_at_end`` loads from the step-2 checkpoint to ``out/best.pt``. With
``experts``: its experts placed on the ranks 1 : 3 and placed again by their loads every 2
steps (its decisions in ``out/events.json``: step, placement before and after, predicted
time before, applied); the weights written are then the unsplit model's (gathered).

    torchrun --nproc-per-node 2 trainer_resume.py OUT RESUME MAX_STEPS [experts]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import TrainingArguments

from hetcoll.accelerate import BalancedTrainer
from hetcoll.torch import expert_parallel, gather_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from accelerate_balanced import make_model, text_rows


def main() -> None:
    out, resume, max_steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    experts = sys.argv[4:] == ["experts"]
    args = TrainingArguments(
        output_dir=out,
        use_cpu=True,
        per_device_train_batch_size=4,  # the global batch: 8 rows, 5 steps an epoch
        num_train_epochs=2,
        max_steps=max_steps,
        learning_rate=0.05,
        optim="adamw_torch",
        lr_scheduler_type="constant",
        seed=0,
        save_strategy="steps",
        save_steps=2,
        report_to="none",
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
    )
    torch.manual_seed(0)
    model = make_model("mixtral").double()
    if experts:
        expert_parallel(model, shares=[1, 3])
    trainer = BalancedTrainer(
        model=model,
        args=args,
        train_dataset=text_rows(40),
        shares=[5, 3],
        rebalance_experts_every=2 if experts else None,
    )
    trainer.train(resume_from_checkpoint=None if resume == "none" else resume)
    state = gather_state_dict(model) if experts else model.state_dict()
    if args.process_index == 0:
        torch.save(state, Path(out, f"final-{max_steps}.pt"))
    if trainer.expert_rebalancer is not None and args.process_index == 0:
        # The rebalancer's decisions: step, placement before and after, moved or not.
        events = [
            [e.step, e.old_placement, e.new_placement, e.predicted_old, e.applied]
            for e in trainer.expert_rebalancer.history
        ]
        Path(out, "events.json").write_text(json.dumps(events))
    if resume == "none":  # load_best_model_at_end's load, of the step-2 checkpoint
        trainer.state.best_model_checkpoint = str(Path(out, "checkpoint-2"))
        trainer._load_best_model()
        best = gather_state_dict(model) if experts else model.state_dict()
        if args.process_index == 0:
            torch.save(best, Path(out, "best.pt"))
    # An orderly end, as torch.distributed asks: both ranks wait for the save, then leave the
    # group together (a rank that exits while the other still holds the group can abort in
    # gloo's teardown: "terminate called without an active exception").
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
