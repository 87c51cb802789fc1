"""Worker of tests/test_accelerate.py, under torchrun on a host without GPUs: Accelerate
initialises torch.distributed on every rank yet runs as one process unless told to use the CPU;
prepare_balanced and BalancedTrainer say so, where each rank took the whole batch for its own
(or failed on a count of speeds). Writes each rank's errors to $HETCOLL_TEST_OUT/<rank>.json."""

import json
import os

import torch
import torch.distributed as dist
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from hetcoll.accelerate import BalancedTrainer, prepare_balanced

torch.set_num_threads(1)
accelerator = Accelerator()
out = {"processes": accelerator.num_processes, "world": dist.get_world_size()}
try:
    prepare_balanced(accelerator, list(range(16)), 8, speeds=[3, 1])
except ValueError as e:
    out["prepare_balanced"] = str(e)
try:
    BalancedTrainer(
        model=GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16)),
        args=TrainingArguments(output_dir=os.environ["HETCOLL_TEST_OUT"], report_to="none"),
        train_dataset=[{"input_ids": torch.zeros(4, dtype=torch.long)}] * 16,
        speeds=[3, 1],
    )
except ValueError as e:
    out["trainer"] = str(e)
with open(os.path.join(os.environ["HETCOLL_TEST_OUT"], f"{dist.get_rank()}.json"), "w") as f:
    json.dump(out, f)
