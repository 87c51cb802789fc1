"""Run under ``torchrun --nproc-per-node 2`` by tests/test_accelerate.py: hetcoll.accelerate's
collective checks and its token weighting on one step, on two real ranks (gloo). Each rank
writes what happened in each case to ``$HETCOLL_TEST_OUT/{rank}.json``."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

import hetcoll
from hetcoll.accelerate import BalancedTrainer, prepare_balanced, step_items

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from accelerate_balanced import SEQ, text_rows


def outcome(fn: Any) -> dict[str, str]:
    """What ``fn()`` raised (type and message), or "ok"."""
    try:
        fn()
    except Exception as e:
        return {"raised": type(e).__name__, "message": str(e)}
    return {"raised": "", "message": "ok"}


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=256,
        n_embd=16,
        n_layer=1,
        n_head=2,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    return GPT2LMHeadModel(config).double()


class NoKwargs(torch.nn.Module):
    """A model whose forward takes no ``num_items_in_batch``: its loss is its own mean."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.lin(input_ids.double()).mean(),)


class IgnoresItems(torch.nn.Module):
    """A forward that takes ``**kwargs`` (so Trainer hands it ``num_items_in_batch``) but
    whose loss is a mean over its own rows, as Hugging Face's sequence classification heads'."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(SEQ, 1).double()

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor, **kwargs: Any
    ) -> tuple[torch.Tensor]:
        return (self.lin(input_ids.double()).square().mean(),)


def gpt2_targets(rows: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """GPT-2 (``GPT2LMHeadModel``, a causal LM whose class names no ``loss_type``) under
    BalancedTrainer at shares 3 : 1, one optimizer step of two accumulated micro-batches with
    a float64 loss summed over the shifted targets and divided by ``num_items_in_batch``: the
    count Trainer hands over is the targets' (``labels[..., 1:]``: Trainer counted every label,
    a row's first too), and the step is one process's on the mean over the global batch's
    targets (SGD)."""
    model, reference = gpt2(), gpt2()
    seen: list[int] = []

    def own_loss(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any) -> torch.Tensor:
        seen.append(int(num_items_in_batch))
        logits = outputs.logits[:, :-1].flatten(0, 1)
        summed = torch.nn.functional.cross_entropy(logits, labels[:, 1:].flatten(), reduction="sum")
        return summed / num_items_in_batch

    args = TrainingArguments(
        output_dir=os.environ["HETCOLL_TEST_OUT"], use_cpu=True, report_to="none",
        per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1,
        optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=0.0, train_sampling_strategy="sequential", save_strategy="no",
    )  # fmt: skip
    trainer = BalancedTrainer(
        model=model, args=args, train_dataset=rows, shares=[3, 1], compute_loss_func=own_loss
    )
    trainer.train()
    batch = torch.utils.data.default_collate(rows)
    targets = int((batch["labels"][:, 1:] != -100).sum())
    logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    own_loss(type("Out", (), {"logits": logits}), batch["labels"], targets).backward()
    seen.pop()
    diff = 0.0
    with torch.no_grad():
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            diff = max(diff, float((p - (q - 0.5 * q.grad)).abs().max()))
    return {"counted": sorted(set(seen)), "targets": targets, "max_diff": diff}


def rebalancing(rank: int, rows: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """BalancedTrainer(rebalance_every=1): a checkpoint's rebalancer state found on one rank
    only (no shared filesystem) or unreadable on one raises on every rank (the shares are set
    collectively after: they would wait)."""
    base = Path(os.environ["HETCOLL_TEST_OUT"])
    args = TrainingArguments(
        output_dir=str(base), use_cpu=True, report_to="none", per_device_train_batch_size=4
    )

    def resumed(checkpoint: Path) -> list[int]:
        trainer = BalancedTrainer(
            model=gpt2(), args=args, train_dataset=rows, shares=[5, 3], rebalance_every=1
        )
        trainer.get_train_dataloader()
        assert trainer.rebalancer is not None
        trainer._load_rebalancer(str(checkpoint), trainer.rebalancer)
        return trainer.rebalancer.sampler.shares

    saved = json.dumps({"shares": [6, 2], "rebalancer": {"step": 4, "models": None}})
    dirs = {}
    for name, text in (("good", saved), ("none", None), ("bad", "{" if rank == 1 else saved)):
        dirs[name] = base / f"{name}{rank}"  # each rank's own copy, as on another node
        dirs[name].mkdir(exist_ok=True)
        if text is not None:
            (dirs[name] / "rebalancer.json").write_text(text)
    shares: list[int] = []
    out = {
        "rebalancer_missing": outcome(lambda: resumed(dirs["good" if rank == 0 else "none"])),
        "rebalancer_bad": outcome(lambda: resumed(dirs["bad"])),
        "rebalancer_good": outcome(lambda: shares.extend(resumed(dirs["good"]))),
    }
    out["restored_shares"] = shares
    return out


def main() -> None:
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    rows = text_rows(8, seed=1)
    batch = torch.utils.data.default_collate(rows)
    out: dict[str, Any] = {}

    # A bad count on rank 1 only: every rank raises ValueError naming items.
    out["bad_items"] = outcome(
        lambda: step_items(accelerator, [batch], items=lambda b: -3 if rank == 1 else 5)
    )
    # Ranks with different numbers of micro-batches in the step: raise on every rank.
    out["micro_batches"] = outcome(lambda: step_items(accelerator, [batch] * (1 + rank)))
    # Shares that disagree between the ranks: raise on every rank.
    out["shares"] = outcome(
        lambda: prepare_balanced(accelerator, rows, 8, shares=[5, 3] if rank == 0 else [4, 4])
    )
    out["shares_sum"] = outcome(lambda: prepare_balanced(accelerator, rows, 8, shares=[5, 4]))

    # One step with rank 1's rows holding no valid token at all: weight 0, no NaN, and the
    # gradient of the mean over rank 0's tokens, the global batch's (one process, no DDP).
    data = prepare_balanced(accelerator, rows, 8, shares=[5, 3], shuffle=False)
    (mine,) = list(data)
    if rank == 1:
        mine = {**mine, "labels": torch.full_like(mine["labels"], -100)}
    reference = gpt2()
    model = accelerator.prepare(copy.deepcopy(reference))
    step = step_items(accelerator, [mine])
    loss = model(**mine, num_items_in_batch=step.num_items).loss * step.loss_scale
    accelerator.backward(loss)
    full = dict(batch)
    full["labels"] = batch["labels"].clone()
    full["labels"][5:] = -100  # rank 1's rows (positions 5..7 of the unshuffled global batch)
    reference(**full).loss.backward()
    worst = max(
        float((p.grad - q.grad).abs().max())
        for p, q in zip(accelerator.unwrap_model(model).parameters(), reference.parameters())
    )
    out["zero_rank"] = {
        "weights": step.weights.tolist(),
        "counts": list(step.counts),
        "max_grad_diff": worst,
        "finite": all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()),
    }

    # BalancedTrainer's preconditions on several processes.
    def trainer(model: torch.nn.Module, **arguments: Any) -> BalancedTrainer:
        args = TrainingArguments(
            output_dir=os.environ["HETCOLL_TEST_OUT"], use_cpu=True, report_to="none", **arguments
        )
        return BalancedTrainer(model=model, args=args, train_dataset=rows, shares=[5, 3])

    out["average_tokens"] = outcome(lambda: trainer(gpt2(), average_tokens_across_devices=False))
    out["no_kwargs"] = outcome(lambda: trainer(NoKwargs()))
    # Its loss does not divide by num_items_in_batch: told at the first step, on every rank.
    out["ignores_items"] = outcome(
        lambda: trainer(IgnoresItems(), max_steps=1, per_device_train_batch_size=4).train()
    )
    out["strategy"] = outcome(lambda: trainer(gpt2(), train_sampling_strategy="group_by_length"))
    out["ranks"] = outcome(
        lambda: BalancedTrainer(
            model=gpt2(),
            args=TrainingArguments(output_dir=os.environ["HETCOLL_TEST_OUT"], use_cpu=True),
            speeds=[1, 2, 3],
        )
    )
    out.update(rebalancing(rank, rows))
    out["gpt2_targets"] = gpt2_targets(rows)
    out["world"] = accelerator.num_processes
    out["split"] = hetcoll.split(8, [5, 3])
    Path(os.environ["HETCOLL_TEST_OUT"], f"{rank}.json").write_text(json.dumps(out))
    accelerator.end_training()


if __name__ == "__main__":
    main()
