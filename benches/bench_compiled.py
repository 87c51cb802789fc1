"""``torch.compile`` of a plan block by block: the same one-rank plan of a language model with
its decoder layers compiled in place after ``hetcoll.torch.parallelize`` (each one's
``compile()``, torch's regional compilation, inductor's default), against the plan left eager,
interleaved round by round in the same process. A plan's steps call the compiled blocks (the
runtime routes each block's call around its compiled one); what compiling gains a CPU rank is
what a heterogeneous job's slowest ranks gain. Two models built from configs: the LM example's
Llama (examples/train_lm.py) and a GPT-2, their losses averaged over valid tokens. One thread,
on a one-rank gloo group, this host's CPU.

    make bench-compiled      # writes benches/results/compiled.json

Lab code, like everything in benches/: it imports the library, the library never imports it.
"""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hetcoll.torch import model_layers, parallelize

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

#: Interleaved rounds (the first two warm up), each timing ``STEPS`` steps of either plan.
ROUNDS = 12
STEPS = 3
GROUP = (
    "a plan's step with its blocks compiled (inductor) against the same plan eager, same "
    f"process (medians of {ROUNDS - 2} interleaved rounds)"
)


def _example() -> Any:
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import train_lm

    return train_lm


def _llama() -> tuple[nn.Module, type[nn.Module]]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return _example().make_model(), LlamaDecoderLayer


def _gpt2() -> tuple[nn.Module, type[nn.Module]]:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config = GPT2Config(
        vocab_size=256, n_embd=64, n_layer=4, n_head=4, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(config), GPT2Block


#: Each model, by what it is.
MODELS: dict[str, Callable[[], tuple[nn.Module, type[nn.Module]]]] = {
    "the LM example's Llama (width 64), batch 16 of 64 tokens": _llama,
    "GPT-2, 4 blocks of width 64, batch 16 of 64 tokens": _gpt2,
}


@pytest.mark.parametrize("name", list(MODELS))
def test_compiled_blocks_against_the_eager_plan(
    figure: Callable[..., None], interleaved: Callable[..., Any], one_rank: None, name: str
) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    example = _example()
    model, block = MODELS[name]()
    ids = torch.randint(1, 256, (16, 64))
    x = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    whole = {"ranks": [0], "layers": [0, len(model_layers(model))]}
    plan = {"microbatches": 1, "replicas": [{"samples": len(ids), "stages": [whole]}]}
    steps: dict[str, Callable[[], float]] = {}
    for key, m in (("eager", model), ("compiled", copy.deepcopy(model))):
        par = parallelize(m, plan, loss_fn=example.lm_loss, items=example.valid_tokens)
        opt = torch.optim.SGD(par.parameters(), lr=1e-3)

        def step(par: Any = par, opt: torch.optim.Optimizer = opt) -> float:
            opt.zero_grad()
            loss = par.step(x, ids)
            opt.step()
            return float(loss)

        steps[key] = step
        if key == "compiled":
            compiled = [b for b in par.modules() if isinstance(b, block)]
            for b in compiled:
                b.compile()
    # The same weights and batch: the first losses agree (both time the same work), the
    # compiled one's first step compiling its blocks, from scratch (no cached graphs).
    from torch._inductor import config as inductor

    first = steps["eager"]()
    t0 = time.perf_counter()
    with inductor.patch(force_disable_caches=True):
        assert steps["compiled"]() == pytest.approx(first, rel=1e-4)
        steps["compiled"]()
    compile_s = time.perf_counter() - t0
    timed = interleaved(list(steps.items()), rounds=ROUNDS, steps=STEPS, warmup=2)
    e, c = timed.median("eager"), timed.median("compiled")
    spread = timed.spread("eager", "compiled")
    figure(
        GROUP,
        f"{name}: step throughput, {len(compiled)} blocks compiled / eager",
        f"{e / c:.2f}x ({c * 1e3:.1f} ms against {e * 1e3:.1f} ms a step; {spread}; "
        f"the first two steps, compiling without cached graphs, took {compile_s:.0f} s)",
        headline=name.startswith("the LM example"),
    )
