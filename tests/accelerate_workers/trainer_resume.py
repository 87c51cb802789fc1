"""Run under ``torchrun --nproc-per-node 2`` by tests/test_accelerate.py: BalancedTrainer on
GPT-2 (float64) at shares 5:3, checkpointing every 2 steps (Trainer's own checkpoints), for
``max_steps`` steps, from ``resume`` (a checkpoint directory, or "none"). Rank 0 writes the
trained weights to ``out/final-{max_steps}.pt``.

    torchrun --nproc-per-node 2 trainer_resume.py OUT RESUME MAX_STEPS
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import TrainingArguments

from hetcoll.accelerate import BalancedTrainer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from accelerate_balanced import make_model, text_rows


def main() -> None:
    out, resume, max_steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    args = TrainingArguments(
        output_dir=out,
        use_cpu=True,
        per_device_train_batch_size=4,  # the global batch: 8 rows, 5 steps an epoch
        num_train_epochs=2,
        max_steps=max_steps,
        learning_rate=0.05,
        optim="sgd",
        lr_scheduler_type="constant",
        seed=0,
        save_strategy="steps",
        save_steps=2,
        report_to="none",
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
    )
    torch.manual_seed(0)
    model = make_model("gpt2").double()
    trainer = BalancedTrainer(model=model, args=args, train_dataset=text_rows(40), shares=[5, 3])
    trainer.train(resume_from_checkpoint=None if resume == "none" else resume)
    if args.process_index == 0:
        torch.save(model.state_dict(), Path(out, f"final-{max_steps}.pt"))
    # An orderly end, as torch.distributed asks: both ranks wait for the save, then leave the
    # group together (a rank that exits while the other still holds the group can abort in
    # gloo's teardown: "terminate called without an active exception").
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
