"""What :func:`hetcoll.torch.parallelize`'s step adds on the host: a plan of one rank holding
the whole model (no message leaves it), against the bare step of the same model in the same
process (zero_grad, forward, loss, backward, SGD step, the loss read), interleaved round by
round. What is left is the runtime's own work a step (the batch's check, the micro-batches'
weights, the loss's sum, the gradients set aside and restored), the part of a plan's step
that a fast device (a GPU rank's microseconds of compute) cannot hide. Three models: a tiny
MLP (the overhead alone), a torchvision ResNet-18 (62 parameter tensors) and a GPT-2 built
from a config whose forward the plan replays around its blocks (keyword inputs, the loss
averaged over valid tokens). One thread, on a one-rank gloo group.

    make bench-step-overhead      # writes benches/results/step_overhead.json

Lab code, like everything in benches/: it imports the library, the library never imports it.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hetcoll.torch import model_layers, parallelize

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

#: Interleaved rounds (the first three warm up), each timing a model's steps (``MODELS``) of
#: either.
ROUNDS = 23
GROUP = (
    "parallelize's step on one rank against the bare step, same process (medians of "
    f"{ROUNDS - 3} interleaved rounds)"
)


def _tiny() -> tuple[nn.Module, Any, torch.Tensor, Callable[..., Any], Any]:
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    return model, x, y, nn.functional.cross_entropy, None


def _resnet() -> tuple[nn.Module, Any, torch.Tensor, Callable[..., Any], Any]:
    from torchvision.models import resnet18  # type: ignore[import-untyped]

    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    return resnet18(num_classes=10), x, y, nn.functional.cross_entropy, None


def _gpt2() -> tuple[nn.Module, Any, torch.Tensor, Callable[..., Any], Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    # The LM example's loss and its count of valid tokens (examples/train_lm.py).
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    from train_lm import lm_loss, valid_tokens

    config = GPT2Config(
        vocab_size=256, n_embd=64, n_layer=4, n_head=4, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    ids = torch.randint(0, 256, (8, 32))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return GPT2LMHeadModel(config), inputs, ids, lm_loss, valid_tokens


#: Each model and the steps a round times of it.
MODELS = {
    "tiny MLP (4 parameter tensors), batch 8": (_tiny, 20),
    "ResNet-18 (62 parameter tensors), batch 4 of 32x32": (_resnet, 2),
    "GPT-2, 4 blocks of width 64, batch 8 of 32 tokens (blocks replayed)": (_gpt2, 5),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_parallelize_step_against_the_bare_step(figure, interleaved, one_rank, name):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    make, steps = MODELS[name]
    model, x, y, loss_fn, items = make()
    bare = copy.deepcopy(model)
    rows = len(y)
    whole = {"ranks": [0], "layers": [0, len(model_layers(model))]}
    plan = {"microbatches": 1, "replicas": [{"samples": rows, "stages": [whole]}]}
    par = parallelize(model, plan, loss_fn=loss_fn, items=items)
    par_opt = torch.optim.SGD(par.parameters(), lr=1e-3)
    bare_opt = torch.optim.SGD(bare.parameters(), lr=1e-3)

    def bare_step() -> float:
        bare_opt.zero_grad()
        out = bare(**x) if isinstance(x, dict) else bare(x)
        loss = loss_fn(out, y)
        loss.backward()
        bare_opt.step()
        return loss.item()

    def par_step() -> float:
        par_opt.zero_grad()
        loss = par.step(x, y)
        par_opt.step()
        return loss

    # The same model, batch and optimizer: the first losses agree (a check that both time the
    # same work), before the timed rounds move the two copies apart.
    assert par_step() == pytest.approx(bare_step(), rel=1e-5)
    runs = [("bare", bare_step), ("par", par_step)]
    timed = interleaved(runs, rounds=ROUNDS, steps=steps, warmup=3)
    b, p = timed.median("bare"), timed.median("par")
    spread = timed.spread("par", "bare")
    figure(
        GROUP,
        f"{name}: step time, parallelize / bare",
        f"{p / b:.2f}x ({p * 1e3:.3f} ms against {b * 1e3:.3f} ms; the runtime's own "
        f"{(p - b) * 1e6:.0f} us a step; {spread})",
    )
