"""What ``hetcoll.torch.StepTimer`` adds to a training step: its forward pre-hook and one
post-accumulate-grad hook per parameter, on the CPU. The peer is the same step (forward,
backward, SGD step) of the same model without the timer, in the same run. Two models: a
torchvision ResNet-18 (62 parameter tensors, batch 8 of 64 x 64 images) and a deep, narrow
GPT-2 built from a config (12 blocks of width 64: 148 parameter tensors for little compute, the
timer's worst case per step), batch 8 of 32 tokens. One thread.

    make bench-step-timer      # writes benches/results/step_timer.json

Lab code, like everything in benches/: it imports the library, the library never imports it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from hetcoll.torch import StepTimer

ROUNDS = 40


def resnet() -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    from torchvision.models import resnet18  # type: ignore[import-untyped]

    torch.manual_seed(0)
    model = resnet18(num_classes=10)
    x, y = torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,))
    return model, lambda: nn.functional.cross_entropy(model(x), y)


def gpt2() -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_embd=64, n_layer=12, n_head=4, n_positions=32)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 256, (8, 32))
    return model, lambda: model(input_ids=ids, labels=ids).loss


MODELS = {
    "ResNet-18 (62 parameter tensors), batch 8 of 64x64": resnet,
    "GPT-2, 12 blocks of width 64 (148 parameter tensors), batch 8 of 32 tokens": gpt2,
}


@pytest.mark.parametrize("timed", [False, True], ids=["plain", "timed"])
@pytest.mark.parametrize("name", list(MODELS))
def test_step(benchmark, record, name, timed):
    torch.set_num_threads(1)
    model, loss_of = MODELS[name]()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    timer = StepTimer(model) if timed else None
    seconds: list[float] = []

    def step() -> None:
        opt.zero_grad()
        loss_of().backward()
        opt.step()
        if timer is not None:
            seconds.append(timer.pop())

    step()  # warm-up
    seconds.clear()
    benchmark.pedantic(step, rounds=ROUNDS, iterations=1, warmup_rounds=2)
    group = f"step with and without StepTimer: {name}"
    if timer is None:
        record(benchmark, group, "the step without a timer", peer=True)
    else:
        record(benchmark, group, "the step with StepTimer (popped after the backward)")
        # Every step was timed (the warm-up rounds too).
        assert len(seconds) == ROUNDS + 2 and all(s > 0 for s in seconds)
