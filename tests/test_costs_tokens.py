"""Costs and plans of token models (issue 38 item 3): Hugging Face Llama and GPT-2 built from
configs (``attn_implementation="eager"``, no downloads) and a user's ``nn.TransformerEncoder``
language model, costed on token inputs (a shape and ``torch.int64``, a dict of keyword inputs,
example tensors).

What is compared with torch's ``FlopCounterMode``: it counts matmul-class ops only (mm, addmm,
bmm, convolutions, attention kernels), so the costs' ``forward_flops`` / ``backward_flops`` - the
same class of FLOPs - must agree with it within 5% (they agree exactly: the same formulas on the
same ops), forward and backward, fp32 and bf16, against a real run of the model. The element-wise
FLOPs (embedding backward, softmax, masks, RoPE, RMSNorm / LayerNorm, SiLU gating, residual
adds) have no torch counter to compare with; they are counted apart
(``ModelCosts.elementwise_flops``) and checked here by hand on the norms."""

from __future__ import annotations

import itertools
import json
import math
import re
import sys
import textwrap
import warnings
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from hetcoll import Plan
from hetcoll.cli import main
from hetcoll.model import cluster_from_dict, layer_costs, plan, predict_plan
from hetcoll.model.predict import filter_parallel_schedule
from hetcoll.torch.filters import filter_shares
from hetcoll.torch.layers import model_cut, model_layers

from lm_common import hf_mixtral, hf_t5

transformers = pytest.importorskip("transformers")

SEQ = 16
HIDDEN = 64


def llama(dtype: torch.dtype = torch.float32, layers: int = 2) -> nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=HIDDEN,
        intermediate_size=160,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def gpt2(dtype: torch.dtype = torch.float32, layers: int = 2) -> nn.Module:
    cfg = transformers.GPT2Config(
        vocab_size=128,
        n_embd=HIDDEN,
        n_layer=layers,
        n_head=4,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).to(dtype)


class EncoderLM(nn.Module):
    """A user's own language model around ``nn.TransformerEncoder`` (causal mask in forward)."""

    def __init__(self, vocab: int = 100, dim: int = 32, layers: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf"), device=ids.device), diagonal=1)
        return self.head(self.enc(self.emb(ids), mask=mask, is_causal=True))


#: Whether this torch's FlopCounterMode counts the fused attention ``nn.MultiheadAttention``
#: runs on the CPU (torch 2.11's has no formula for it, so it counts no attention there).
COUNTS_CPU_ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu in flop_registry
needs_counted_cpu_attention = pytest.mark.skipif(
    not COUNTS_CPU_ATTENTION,
    reason="this torch's FlopCounterMode has no formula for the CPU's fused attention",
)


def flop_counter(model: nn.Module, batch: int, seq: int = SEQ) -> tuple[int, int]:
    """FlopCounterMode's forward and backward FLOPs of a real run on ``batch`` sequences."""
    ids = torch.randint(0, 100, (batch, seq))
    with FlopCounterMode(display=False) as fc:
        out = model(ids)
        forward = fc.get_total_flops()
        logits = out if isinstance(out, torch.Tensor) else out.logits
        logits.float().sum().backward()
    return forward, fc.get_total_flops() - forward


def close(a: float, b: float, tol: float = 0.05) -> bool:
    return abs(a - b) <= tol * max(abs(a), abs(b))


@pytest.mark.parametrize(
    "make",
    [llama, gpt2, pytest.param(EncoderLM, marks=needs_counted_cpu_attention)],
    ids=["llama", "gpt2", "encoder"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matmul_flops_of_token_models_agree_with_flop_counter(
    make: Any, dtype: torch.dtype
) -> None:
    model = make().to(dtype)
    costs = layer_costs(model, (SEQ,), dtype=torch.int64)
    fwd, bwd = flop_counter(model, 3)
    assert fwd > 0 and bwd > 0
    assert close(costs.forward_flops(3), fwd), (costs.forward_flops(3), fwd)
    assert close(costs.backward_flops(3), bwd), (costs.backward_flops(3), bwd)
    # Within 5% is the requirement. Eager attention agrees exactly (the same formulas on the
    # same ops); nn.MultiheadAttention calls F.scaled_dot_product_attention, whose fused
    # backward recomputes the scores on a real run, not on the meta device (docs/model.md).
    if make is not EncoderLM:
        assert (costs.forward_flops(3), costs.backward_flops(3)) == (fwd, bwd)
    else:
        assert costs.forward_flops(3) == fwd and 0.97 * bwd < costs.backward_flops(3) < bwd
    # Bytes are the activations' (the model's dtype), not the token ids'.
    assert costs.itemsize == torch.empty((), dtype=dtype).element_size()
    assert costs.inputs[0].dtype == "int64" and costs.input_shape == (SEQ,)
    # Element-wise work counted apart, forward and backward.
    ew_f, ew_b = costs.elementwise_flops(1)
    assert ew_f > 0 and ew_b > 0


class SequenceFirst(nn.Module):
    """torch's encoder layers as they come by default, sequence first: the batch is the
    second dimension of every linear layer's input."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 100)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(ids).transpose(0, 1)).transpose(0, 1))


@needs_counted_cpu_attention
def test_a_sequence_first_model_counts_its_rows_per_sample() -> None:
    # One sample's rows are its sequence, wherever the batch dimension is: a linear layer of a
    # sequence-first encoder costs what FlopCounterMode counts, as a batch-first one does.
    model = SequenceFirst()
    costs = layer_costs(model, (SEQ,), dtype=torch.int64)
    fwd, bwd = flop_counter(model, 3)
    assert costs.forward_flops(3) == fwd and not costs.notes, costs.notes
    assert 0.97 * bwd < costs.backward_flops(3) <= bwd
    linear1 = next(x for x in costs.layers if x.name == "enc.layers.0.linear1")
    assert linear1.in_bytes_per_sample == SEQ * 32 * 4


def mixture_of_experts(family: str, implementation: str) -> nn.Module:
    """Hugging Face Mixtral (:func:`lm_common.hf_mixtral`) or Qwen3-MoE from a config: 4
    experts, 2 per token, run by ``implementation`` (``"grouped_mm"``, the default,
    ``"batched_mm"`` or ``"eager"``)."""
    torch.manual_seed(0)
    if family == "mixtral":
        return hf_mixtral(
            vocab=128, hidden=32, layers=2, heads=4, kv_heads=2, experts=4,
            implementation=implementation,
        )  # fmt: skip
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
        attn_implementation="eager", experts_implementation=implementation,
    )  # fmt: skip
    return transformers.Qwen3MoeForCausalLM(cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("a", "b", "groups"),
    [((10, 16), (3, 16, 8), 3), ((3, 10, 16), (16, 24), 3), ((10, 24), (24, 8), 3),
     ((3, 10, 16), (3, 16, 8), None)],
    ids=["2d-3d", "3d-2d", "2d-2d", "3d-3d"],
)  # fmt: skip
def test_grouped_mm_outputs_on_the_meta_device_are_torchs(
    monkeypatch: pytest.MonkeyPatch, a: tuple, b: tuple, groups: int | None, dtype: torch.dtype
) -> None:
    # Where this torch's meta kernel refuses a dtype its real kernels take (torch 2.11's takes
    # bfloat16 only), hetcoll's meta runs make its outputs themselves: as a newer torch's meta
    # kernel does, which is compared here on every layout (this torch's, where it takes the
    # dtype), through the costs' runner and hetcoll.torch.meta_ops' mode.
    from hetcoll.model.costs import counting
    from hetcoll.torch import meta_ops

    op = torch.ops.aten._grouped_mm.default
    mat_a = torch.empty(a, dtype=dtype, device="meta")
    mat_b = torch.empty(b, dtype=dtype, device="meta")
    offs = None if groups is None else torch.empty((groups,), dtype=torch.int32, device="meta")
    if not meta_ops._meta_grouped_mm_takes(dtype):
        pytest.skip(f"this torch's meta kernel of _grouped_mm refuses {dtype}")
    assert meta_ops.made_outputs(op, (mat_a, mat_b, offs), {}) is None  # torch's kernel runs
    want = op(mat_a, mat_b, offs)
    monkeypatch.setattr(meta_ops, "_meta_grouped_mm_takes", lambda dtype: False)
    assert meta_ops.needed()
    made = counting._run(op, (mat_a, mat_b, offs), {})
    with meta_ops.meta_ops():
        also = torch.ops.aten._grouped_mm(mat_a, mat_b, offs)
    for out in (made, also):
        assert (out.shape, out.stride(), out.dtype) == (want.shape, want.stride(), want.dtype)
        assert out.device.type == "meta"


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_mixture_of_experts_counts_every_routed_token_whatever_runs_the_experts(
    family: str,
) -> None:
    """Every token goes through its 2 experts' gated MLPs, however Hugging Face runs them:
    ``grouped_mm`` (one ``aten._grouped_mm``, which torch's formulas do not count), ``bmm``
    or a loop of ``mm``. The experts' FLOPs are counted by hand, and the whole model's against
    FlopCounterMode on a real run of the implementations it counts."""
    experts = {}
    for implementation in ("grouped_mm", "batched_mm", "eager"):
        model = mixture_of_experts(family, implementation)
        costs = layer_costs(model, (SEQ,), dtype=torch.int64)
        mlp = model.model.layers[0].mlp.experts
        hidden, units = mlp.hidden_dim, mlp.intermediate_dim
        # Per token and expert: gate and up (hidden -> 2 x units), down (units -> hidden).
        by_hand = 2 * SEQ * 2 * (hidden * 2 * units + units * hidden)
        own = [x for x in costs.layers if x.name == "model.layers.0.mlp.experts"]
        forward = sum(k.flops_per_sample for x in own for k in x.forward)
        backward = sum(k.flops_per_sample for x in own for k in x.backward)
        assert (forward, backward) == (by_hand, 2 * by_hand), (implementation, forward)
        experts[implementation] = (costs.forward_flops(3), costs.backward_flops(3))
        if implementation != "grouped_mm":
            assert experts[implementation] == flop_counter(model, 3), implementation
    assert len(set(experts.values())) == 1, experts


def _phimoe(implementation: str) -> nn.Module:
    """Hugging Face PhiMoE from a config: 4 experts, 2 per token, its router sampling the
    experts at random in training (sparsemixer)."""
    torch.manual_seed(0)
    cfg = transformers.PhimoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64,
        attn_implementation="eager", experts_implementation=implementation,
    )  # fmt: skip
    return transformers.PhimoeForCausalLM(cfg)


def test_tokens_routed_at_random_cost_bytes_per_sample_not_fixed() -> None:
    """PhiMoE's router samples its experts at random in training, so the tokens each expert
    gets in the counting batch are no multiple of its samples: the eager loop's tensors of
    them were booked as fixed bytes (megabytes paid at every step: PhiMoE's predicted step
    was about 80x too slow). Their bytes now grow with the batch, as grouped_mm's; what stays
    fixed is what the weights cost: read forward and backward, and per expert its slice's
    gradient written into zeros of the whole stacked weight, then added to the gradient (a
    write and two reads more)."""
    moved = {}
    for implementation in ("grouped_mm", "eager"):
        model = _phimoe(implementation)
        costs = layer_costs(model, (SEQ,), dtype=torch.int64)
        own = [x for x in costs.layers if x.name == "model.layers.0.mlp.experts"]
        kernels = [k for x in own for k in (*x.forward, *x.backward)]
        weights = sum(p.numel() * 4 for p in model.model.layers[0].mlp.experts.parameters())
        fixed = sum(k.bytes_fixed for k in kernels)
        assert fixed <= (2 + 4 * 4) * weights, (implementation, fixed, weights)
        moved[implementation] = sum(k.bytes_per_sample for k in kernels)
    assert 0.5 < moved["eager"] / moved["grouped_mm"] < 2, moved


def test_elementwise_flops_of_the_norms_by_hand() -> None:
    """Llama's RMSNorm: x.pow(2), .mean(-1), + eps, rsqrt, x * r, weight * x: four ops over the
    S x d elements and two over the S rows. GPT-2's LayerNorm is one fused op: S x d. Attention
    holds its softmax (at least one FLOP per score, heads x S x S) and RoPE."""
    c = layer_costs(llama(), (SEQ,), dtype=torch.int64)
    by = {x.name: x for x in c.layers}
    assert by["model.layers.0.input_layernorm"].elementwise_flops_per_sample[0] == (
        4 * SEQ * HIDDEN + 2 * SEQ
    )
    attention = by["model.layers.0.self_attn"].elementwise_flops_per_sample
    assert attention[0] >= 4 * SEQ * SEQ and attention[1] >= 4 * SEQ * SEQ
    g = layer_costs(gpt2(), (SEQ,), dtype=torch.int64)
    ln = {x.name: x for x in g.layers}["transformer.h.0.ln_1"]
    assert ln.elementwise_flops_per_sample[0] == SEQ * HIDDEN
    # The embedding's lookup reads the rows it gathers, not the whole table.
    emb = {x.name: x for x in g.layers}["transformer.wte"]
    moved = emb.forward[0].bytes_per_sample + emb.forward[0].bytes_fixed
    assert moved < 128 * HIDDEN * 4


def test_keyword_inputs_shapes_pairs_and_example_tensors_cost_alike() -> None:
    model = llama()
    base = layer_costs(model, (SEQ,), dtype=torch.int64)
    variants = [
        layer_costs(model, {"input_ids": (SEQ,)}, dtype=torch.int64),
        layer_costs(model, {"input_ids": (SEQ,), "attention_mask": (SEQ,)}, dtype=torch.int64),
        layer_costs(model, {"input_ids": ((SEQ,), torch.int64)}),
        layer_costs(model, {"input_ids": torch.zeros(2, SEQ, dtype=torch.long)}),
        layer_costs(model, torch.zeros(5, SEQ, dtype=torch.long)),
        layer_costs(model, str(SEQ), dtype=torch.int64),
    ]
    for c in variants:
        assert c.forward_flops(1) == base.forward_flops(1)
        assert c.backward_flops(1) == base.backward_flops(1)
        assert c.plan_layers == base.plan_layers
    assert [x.name for x in variants[1].inputs] == ["input_ids", "attention_mask"]
    assert variants[3].inputs[0].to_json() == {
        "name": "input_ids",
        "shape": [SEQ],
        "dtype": "int64",
    }


@pytest.mark.parametrize(
    ("inputs", "kwargs", "words"),
    [
        ({}, {}, ("input_shape", "empty")),
        ({"input ids": (4,)}, {}, ("input_shape", "keyword")),
        ({"input_ids": (0,)}, {}, ("input_shape['input_ids']", "positive")),
        ((SEQ, -1), {}, ("input_shape", "positive")),
        (torch.tensor(3), {}, ("input_shape", "batch")),
        ((SEQ,), {"dtype": "int64"}, ("dtype", "torch.dtype")),
        ((SEQ,), {}, ("input_shape", "float32")),  # token ids given as floats
    ],
)
def test_bad_inputs_raise_naming_the_argument(inputs: Any, kwargs: Any, words: Any) -> None:
    with pytest.raises((ValueError, TypeError)) as e:
        layer_costs(llama(), inputs, **kwargs)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("make", [llama, gpt2, EncoderLM], ids=["llama", "gpt2", "encoder"])
def test_costs_map_onto_the_blocks_a_plan_cuts(make: Any) -> None:
    model = make()
    costs = layer_costs(model, (SEQ,), dtype=torch.int64)
    names = [n for n, _ in model_layers(model)]
    assert model_cut(model).kind == "blocks" and costs.plan_cut == "blocks"
    assert list(costs.plan_layers) == names, costs.plan_layers_note
    # Every costed layer sits in the block holding it; the code between blocks with the
    # block before it; in order.
    for x, i in zip(costs.layers, costs.plan_layer_of, strict=True):
        block = names[i]
        assert x.name == block or x.name.startswith(block + ".") or x.own_ops, (x.name, block)
    assert list(costs.plan_layer_of) == sorted(costs.plan_layer_of)
    # Each decoder block's costs: its own layers' FLOPs, all alike.
    decoders = [i for i, n in enumerate(names) if n.rsplit(".", 1)[-1].isdigit()]
    per_block = []
    for i in decoders:
        lo, hi = costs.plan_range(i, i + 1)
        per_block.append(sum(x.forward_flops(1) for x in costs.layers[lo:hi]))
    assert len(set(per_block)) == 1 and per_block[0] > 0
    # What crosses a cut between two decoder blocks: the hidden states (S x d floats per
    # sample), and for Llama the rotary embedding's cos and sin (1 x S x head_dim each, sent
    # whole with each micro-batch) that every decoder layer reads.
    dim = HIDDEN if make is not EncoderLM else 32
    hidden = SEQ * dim * 4
    extra = 2 * SEQ * (HIDDEN // 4) * 4 if make is llama else 0
    for i in decoders[:-1]:
        assert costs.plan_out_bytes[i] == hidden + extra, (names[i], costs.plan_out_bytes[i])
    # A stage split over ranks splits as the runtime splits the model: its attentions by
    # key/value groups, MLPs by hidden units, any other Linear gathering (the LM head).
    n = len(names)
    modes = costs.stage_filter_modes(0, n)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # layers left replicated
        runtime = filter_shares(model, size=2, speeds=[1.0, 0.25], empty_blocks=True)
    assert set(modes) == set(runtime), set(modes) ^ set(runtime)
    two = decoders[1:3]
    inside = costs.stage_filter_modes(two[0], two[-1] + 1)
    assert inside and all(any(k.startswith(names[i] + ".") for i in two) for k in inside), inside
    assert {k: modes[k] for k in inside} == inside
    split = Plan.from_dict(
        {
            "replicas": [
                {
                    "samples": 4,
                    "stages": [{"ranks": [0, 1], "layers": [0, n], "speeds": [1.0, 0.25]}],
                }
            ]
        }
    )
    pred = predict_plan(costs, _cluster(1e12), split)
    assert pred.feasible and pred.step_s > 0
    # Shares per layer as the runtime's (empty_blocks: a rank may hold no heads).
    with_empty = Plan.from_dict(
        {
            "replicas": [
                {
                    "samples": 4,
                    "stages": [
                        {
                            "ranks": [0, 1],
                            "layers": [0, n],
                            "speeds": [1.0, 0.25],
                            "empty_blocks": True,
                        }
                    ],
                }
            ]
        }
    )
    assert predict_plan(costs, _cluster(1e12), with_empty).feasible
    sched = filter_parallel_schedule(
        costs, _cluster(1e12).subset([0, 1]), 4, [1.0, 0.25], modes=modes, empty_blocks=True
    )
    assert sched.detail["shares_per_layer"] == {
        k: v for k, v in runtime.items() if k in sched.detail["shares_per_layer"]
    }

    # The same split by shares per module path (filter_shares' dict): the same layers, modes
    # and shares; shares that are not whole units are refused as the runtime refuses them.
    def by_path(shares: dict[str, list[int]]) -> Plan:
        stage = {"ranks": [0, 1], "layers": [0, n], "shares": shares, "empty_blocks": True}
        return Plan.from_dict({"replicas": [{"samples": 4, "stages": [stage]}]})

    named = predict_plan(costs, _cluster(1e12), by_path(runtime))
    assert named.feasible and math.isclose(
        named.step_s, predict_plan(costs, _cluster(1e12), with_empty).step_s, rel_tol=1e-12
    )
    for block in costs.split_blocks[:2]:
        if block.kind == "mha":
            continue
        row = block.layers[-1]
        broken = {**runtime, row: [runtime[row][0] - 1, runtime[row][1] + 1]}
        # Whole heads of several features; an MLP's units are single features, and its input
        # projections must follow its output's shares.
        why = "are not whole units" if block.width > 1 else "so its shares must be"
        with pytest.raises(ValueError, match=why):
            predict_plan(costs, _cluster(1e12), by_path(broken))
    # One sum (or broadcast) per attention and MLP forward, one backward, besides the
    # gathering layers' gather and input-gradient sum.
    gathers = sum(1 for m in modes.values() if m == "gather")
    assert sched.detail["collectives"] == 2 * len(costs.split_blocks) + 2 * gathers
    with pytest.raises(ValueError, match="shares"):
        predict_plan(
            costs,
            _cluster(1e12),
            Plan.from_dict(
                {
                    "replicas": [
                        {
                            "samples": 4,
                            "stages": [
                                {"ranks": [0, 1], "layers": [0, n], "shares": {"0": [1, 1]}}
                            ],
                        }
                    ]
                }
            ),
        )


def _cluster(memory: float) -> Any:
    return cluster_from_dict(
        {
            "devices": {
                "fast": {"flops_per_s": 1e12, "mem_bytes_per_s": 1e11, "memory_bytes": memory},
                "slow": {"flops_per_s": 5e11, "mem_bytes_per_s": 5e10, "memory_bytes": memory},
            },
            "links": {"l": {"latency_s": 1e-6, "bytes_per_s": 1e10}},
            "nodes": [
                {"name": "a", "device": "fast", "count": 2, "link": "l"},
                {"name": "b", "device": "slow", "count": 2, "link": "l"},
            ],
            "network": {"link": "l"},
        }
    )


@pytest.mark.parametrize("make", [llama, gpt2], ids=["llama", "gpt2"])
def test_planner_cuts_token_models_between_decoder_blocks(make: Any) -> None:
    model = make(layers=4)
    costs = layer_costs(model, (32,), dtype=torch.int64)
    names = [n for n, _ in model_layers(model)]
    whole = max(plan(costs, _cluster(1e12), 16)[0].memory_bytes)
    # Devices that cannot hold the whole model's step: pipelines of several stages win.
    ranked = plan(costs, _cluster(0.6 * whole), 16, prune=False)
    best = ranked[0]
    assert best.feasible and best.has_plan, best.reason
    pipelines = []
    for p in ranked:
        if not (p.feasible and p.has_plan):
            continue
        doc = p.to_plan().to_dict()
        for r in doc["replicas"]:
            ranges = [tuple(st["layers"]) for st in r["stages"]]
            # The stages' layer ranges index model_layers, cover it in order, one rank each.
            assert ranges[0][0] == 0 and ranges[-1][1] == len(names)
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
            assert all(len(st["ranks"]) == 1 for st in r["stages"])
            if len(ranges) > 1:
                pipelines.append([names[a] for a, _ in ranges[1:]])
    assert len(best.to_plan().to_dict()["replicas"][-1]["stages"]) > 1
    # Some cut falls between two decoder blocks (before layers.k / h.k with k > 0).
    assert any(
        n.rsplit(".", 1)[-1].isdigit() and n.rsplit(".", 1)[-1] != "0"
        for cuts in pipelines
        for n in cuts
    ), pipelines


MYMODELS = """
from torch import nn
import transformers


def llama() -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="eager"))
"""


def test_cli_costs_and_plan_of_a_token_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "tokmodels.py").write_text(textwrap.dedent(MYMODELS))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "tokmodels", raising=False)
    model_args = ["--model", "tokmodels:llama", "--input", "32", "--dtype", "int64"]
    assert main(["model", "costs", *model_args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    import tokmodels

    model = tokmodels.llama()
    fwd, _ = flop_counter(model, 1, 32)
    assert close(out["forward_flops"], fwd) and out["dtype"] == "int64"
    assert out["inputs"] == [{"name": "", "shape": [32], "dtype": "int64"}]
    assert out["elementwise_forward_flops"] > 0 and out["loss"] is None
    assert main(["model", "costs", *model_args, "--loss", "cross-entropy", "--json"]) == 0
    lossy = json.loads(capsys.readouterr().out)
    assert lossy["loss"] == "cross-entropy" and lossy["forward_flops"] == out["forward_flops"]
    assert [x["name"] for x in lossy["layers"]] == [*(x["name"] for x in out["layers"]), "(loss)"]
    whole = max(
        plan(layer_costs(model, (32,), dtype=torch.int64), _cluster(1e12), 16)[0].memory_bytes
    )
    toml = textwrap.dedent(
        f"""
        [devices.fast]
        flops_per_s = 1e12
        mem_bytes_per_s = 1e11
        memory_bytes = {0.6 * whole}
        [devices.slow]
        flops_per_s = 5e11
        mem_bytes_per_s = 5e10
        memory_bytes = {0.6 * whole}
        [links.l]
        latency_s = 1e-6
        bytes_per_s = 1e10
        [[nodes]]
        name = "a"
        device = "fast"
        count = 2
        link = "l"
        [[nodes]]
        name = "b"
        device = "slow"
        count = 2
        link = "l"
        [network]
        link = "l"
        """
    )
    (tmp_path / "cluster.toml").write_text(toml)
    out_file = tmp_path / "plan.json"
    args = ["plan", *model_args, "--cluster", "cluster.toml", "--batch", "16"]
    assert main([*args, "--out", str(out_file)]) == 0
    text = capsys.readouterr().out
    assert "filter parallel" not in text.split("not searched:", 1)[-1], text
    doc = Plan.load(str(out_file)).to_dict()
    names = [n for n, _ in model_layers(model)]
    stages = [st for r in doc["replicas"] for st in r["stages"]]
    assert any(st["layers"][0] > 0 for st in stages)  # a pipeline
    for st in stages:
        a, b = st["layers"]
        assert 0 <= a < b <= len(names) and len(st["ranks"]) == 1


def test_a_chain_of_token_layers_still_filter_splits() -> None:
    """An nn.Sequential starting with an embedding is a chain: its Linear layers still split."""
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 50))
    c = layer_costs(model, (8,), dtype=torch.int64)
    assert c.plan_cut == "chain" and c.plan_layers == ("0", "1", "2", "3")
    assert c.stage_filter_modes(0, 4) == {"1": "split-output", "3": "split-input"}
    assert c.plan_out_bytes[0] == 8 * 16 * 4
    assert math.isclose(c.forward_flops(1), 2 * 8 * (16 * 32 + 32 * 50))


def llama_lora() -> nn.Module:
    """:func:`llama` with PEFT's LoRA adapters on its seven projections, split with them."""
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return get_peft_model(llama(), LoraConfig(r=8, target_modules=targets))


def test_lora_dropout_and_dora_rows_cost_the_sums_the_runtime_makes() -> None:
    """With LoRA's dropout active, each wrapped column's adapter reads a dropped input of its
    own: one more copy to the ranks, its gradient summed backward (hidden features per
    token); a DoRA row recomputes its base output on its dropped input, summed forward (its
    output features per token). Without dropout, neither."""
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

    def sums(dropout: float, dora: bool) -> dict[str, list[tuple[float, bool]]]:
        config = LoraConfig(r=4, target_modules=targets, lora_dropout=dropout, use_dora=dora)
        costs = layer_costs(get_peft_model(llama(), config), (SEQ,), dtype=torch.int64)
        first = costs.split_blocks[:2]  # the first layer's attention and MLP
        return {b.kind: sorted(b.sums) for b in first}

    hidden = SEQ * HIDDEN * 4  # bytes per sample of a block's input and output (float32)
    for dora in (False, True):
        bare, dropped = sums(0.0, dora), sums(0.1, dora)
        extra = {k: sorted((Counter(dropped[k]) - Counter(bare[k])).elements()) for k in bare}
        # The attention's q, k and v adapters, the MLP's gate and up adapters: a copy each.
        want = {"attention": [(hidden, False)] * 3, "mlp": [(hidden, False)] * 2}
        if dora:  # and the row's base output (o_proj's, down_proj's: HIDDEN features)
            want = {k: sorted([*v, (hidden, True)]) for k, v in want.items()}
        assert extra == want, (dora, bare, dropped)


def test_dora_rows_cost_their_weight_norms_sums_each_forward() -> None:
    """A DoRA row sums its weight's rows' squares over the devices each forward: a number per
    output feature whatever the batch, none backward (the runtime's: "dora norm sums" in
    tensor_parallel_cases.lora_more); a column's norms are its own rows'. The schedule prices
    one allreduce of that more per DoRA row, forward."""
    from peft import LoraConfig, get_peft_model

    from hetcoll.model.predict.splits import SplitCollectives

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    for dora in (False, True):
        config = LoraConfig(r=4, target_modules=targets, use_dora=dora)
        costs = layer_costs(get_peft_model(llama(), config), (SEQ,), dtype=torch.int64)
        want = ((HIDDEN * 4.0, True),) if dora else ()  # o_proj's, down_proj's outputs
        assert [b.fixed_sums for b in costs.split_blocks] == [want] * 4
        assert all(b.by_head is None or b.by_head.fixed_sums == want for b in costs.split_blocks)
    # Priced as the block's sums: an allreduce on a copy, forward, whatever the batch.
    cluster = _cluster(1e12).subset([0, 2])
    sums = SplitCollectives(costs, cluster)
    block = costs.split_blocks[0]
    bare = replace(block, fixed_sums=())
    rows = [i for i, x in enumerate(costs.layers) if block.layer_at(x.name) is not None]
    norm = sums.allreduce_s(HIDDEN * 4.0) + sums.copy_s(HIDDEN * 4.0)
    for batch in (8, 64):
        (fwd, bwd), (fwd0, bwd0) = (sums.block_sums_s(batch, rows, False, b) for b in (block, bare))
        assert fwd - fwd0 == pytest.approx(norm, rel=1e-12) and bwd == bwd0
    stripped = replace(
        costs,
        split_blocks=tuple(
            replace(b, fixed_sums=(), by_head=b.by_head and replace(b.by_head, fixed_sums=()))
            for b in costs.split_blocks
        ),
    )
    got, without = (filter_parallel_schedule(c, cluster, 8, [1.0, 0.5]) for c in (costs, stripped))
    extra = got.forward_collective_s.sum() - without.forward_collective_s.sum()
    assert extra == pytest.approx(4 * norm, rel=1e-9)
    assert (got.backward_collective_s == without.backward_collective_s).all()


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_adapters_split_with_their_layer_are_priced_on_each_device_s_share(dora: bool) -> None:
    """The runtime splits a column's ``lora_B`` along its rows and a row's ``lora_A`` along its
    columns (tensor_parallel_cases: "dora"), and a DoRA layer's work on its weight (``B A``,
    ``W + s B A``, its norm: PEFT's calls of the adapters on an identity matrix and the
    magnitude's layer) on its share of the layer. The model prices each on a device's
    fraction of the block's units: its compute that fraction of the whole layer's; a column's
    ``lora_A`` stays whole."""
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(r=4, target_modules=targets, use_dora=dora)
    costs = layer_costs(get_peft_model(llama(), config), (SEQ,), dtype=torch.int64)
    mlp = costs.split_blocks[1]
    at = "base_model.model.model.layers.0.mlp."
    assert mlp.split_adapters == (
        f"{at}gate_proj.lora_B.default",
        f"{at}up_proj.lora_B.default",
        f"{at}down_proj.lora_A.default",
    )
    parts = ("lora_magnitude_vector", "lora_A", "lora_B")
    assert mlp.dora_work == tuple(
        f"{at}{p}.{part}.default"
        for p in ("gate_proj", "up_proj", "down_proj")
        for part in parts
        if dora
    )
    cluster = _cluster(1e12).subset([0, 2])
    speeds = [1.0, 0.25]
    split = filter_parallel_schedule(costs, cluster, 8, speeds).layers
    fraction = [u / mlp.units for u in mlp.shares(speeds)]
    assert 0 < fraction[1] < fraction[0] < 1
    split_names, work_names = set(mlp.split_adapters), set(mlp.dora_work)
    checked = {"split": 0, "work": 0, "whole": 0}
    for d in range(2):
        whole = filter_parallel_schedule(costs, cluster.subset([d]), 8, [1.0]).layers
        for i, x in enumerate(costs.layers):
            adapter = re.search(r"\.lora_(A|B|magnitude_vector)\.", x.name)
            if not x.name.startswith(at) or adapter is None:
                continue
            got = (split.compute_s[i, d], split.memory_s[i, d])
            if x.filters == 0:  # DoRA's work on its weight, whatever the batch
                assert x.name in work_names
                assert got[0] == pytest.approx(fraction[d] * whole.compute_s[i, 0], rel=1e-12)
                # (Its backward's element-wise work on the output, per sample, not shared.)
                least = fraction[d] * whole.memory_s[i, 0] * (1 - 1e-12)
                assert least <= got[1] < whole.memory_s[i, 0], x.name
                checked["work"] += 1
            elif x.name in split_names:  # its flops on the share (its input read whole)
                assert got[0] == pytest.approx(fraction[d] * whole.compute_s[i, 0], rel=1e-12)
                checked["split"] += 1
            else:  # a column's lora_A, a row's lora_B: whole on every device
                assert got == (whole.compute_s[i, 0], whole.memory_s[i, 0]), x.name
                checked["whole"] += 1
    assert checked == {"split": 2 * 3, "work": 2 * 3 * 3 if dora else 0, "whole": 2 * 3}


@pytest.mark.parametrize(
    "make", [llama, gpt2, EncoderLM, llama_lora], ids=["llama", "gpt2", "encoder", "lora"]
)
def test_time_balanced_shares_run_as_shares_by_module_path(make: Any) -> None:
    """The model's split by predicted time names every layer the runtime splits, in whole
    heads and units the runtime accepts; a device much slower than the others' repeated work
    gets nothing of a block; its plan, by module path, predicts what the shares say. PEFT's
    LoRA wrappers are named as the runtime splits them (the wrapper's path), priced as their
    base layers."""
    from hetcoll.model.predict import filter_parallel, time_balanced_shares

    model = make()
    costs = layer_costs(model, (SEQ,), dtype=torch.int64)
    cluster = _cluster(1e12).subset([0, 2])  # a fast and a slow device (2:1)
    shares = time_balanced_shares(costs, cluster, 8, [1.0, 0.5])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert filter_shares(model, size=2, shares=shares, empty_blocks=True) == shares
        by_speed = filter_shares(model, size=2, speeds=[1.0, 0.5], empty_blocks=True)
    assert set(shares) == set(by_speed)
    # Far slower than the block's work is worth, the second device holds none of any block.
    slow = cluster_from_dict(
        {
            "devices": {
                "fast": {"flops_per_s": 1e12, "mem_bytes_per_s": 1e11, "memory_bytes": 1e12},
                "crawl": {"flops_per_s": 1e8, "mem_bytes_per_s": 1e7, "memory_bytes": 1e12},
            },
            "links": {"l": {"latency_s": 1e-6, "bytes_per_s": 1e10}},
            "nodes": [
                {"name": "a", "device": "fast", "link": "l"},
                {"name": "b", "device": "crawl", "link": "l"},
            ],
            "network": {"link": "l"},
        }
    )
    none = time_balanced_shares(costs, slow, 8, [1.0, 1e-4])
    rows = [b.layers[-1] for b in costs.split_blocks]
    assert all(none[r][1] == 0 for r in rows), {r: none[r] for r in rows}
    pred = filter_parallel(costs, cluster, 8, [1.0, 0.5], balance="time")
    assert pred.has_plan, pred.plan_note
    stage = pred.to_plan().replicas[0].stages[0]
    assert stage.named_shares == {k: tuple(v) for k, v in shares.items()}
    # The plan's step: the same, plus its loss allreduce, whose wait for the slower device
    # comes before the optimizer (which the lock-step prediction lets each device start alone).
    got = predict_plan(costs, cluster, pred.to_plan())
    low = pred.step_s + got.detail["loss_allreduce_s"]
    assert low - 1e-15 <= got.step_s <= low + got.breakdown["optimizer"]
    with pytest.raises(ValueError, match="balance: must be 'speed' or 'time'"):
        filter_parallel(costs, cluster, 8, [1.0, 0.5], balance="fast")


def test_planned_split_stages_of_a_transformer_are_time_balanced() -> None:
    """The planner's stage descriptions (predict_stages: replicated pipelines with stages of
    several devices) split a transformer's stage by predicted time, over that stage's blocks
    alone; the plan built carries the shares by module path and predicts the same step."""
    import numpy as np

    from hetcoll.model.predict import predict_stages, time_balanced_shares

    model = llama(layers=4)
    costs = layer_costs(model, (SEQ,), dtype=torch.int64)
    n = len(costs.plan_layers)
    cluster = _cluster(1e12)
    # A replica of two stages: [0, 4) on one device, [4, n) split over two, beside a
    # whole-model replica on the fourth.
    spec = [
        (8, (((0,), (0, 4), None), (np.array([[2, 1]]), (4, n), (1.0, 0.5)))),
        (8, (((3,), (0, n), None),)),
    ]
    pred = predict_stages(costs, cluster, spec, 2, "1F1B")
    the_plan = pred.to_plan()
    split = the_plan.replicas[0].stages[1]
    assert split.speeds is None and split.named_shares is not None
    want = time_balanced_shares(costs, cluster.subset([2, 1]), 4, [1.0, 0.5], layers=(4, n))
    assert split.named_shares == {k: tuple(v) for k, v in want.items()}
    # Only the stage's blocks (decoder layers 2 and 3, and the head) are split.
    assert all(k.startswith(("model.layers.2.", "model.layers.3.", "lm_head")) for k in want)
    assert predict_plan(costs, cluster, the_plan).step_s == pytest.approx(pred.step_s, rel=1e-9)


def test_parameters_the_heads_share_cost_a_sum_of_their_gradient() -> None:
    # Qwen3's q_norm and k_norm (one weight of head_dim per attention, applied to every head):
    # the costs record them with the attention, and a split step's backward pays one more
    # allreduce for each, as the runtime sums their gradients.
    from dataclasses import replace

    import transformers

    from hetcoll.model.predict.splits import SplitCollectives

    cfg = transformers.Qwen3Config(
        vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        attn_implementation="eager", bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    costs = layer_costs(transformers.Qwen3ForCausalLM(cfg), (SEQ,), dtype=torch.int64)
    attention = [b for b in costs.split_blocks if b.kind == "attention"]
    assert [b.shared for b in attention] == [(8, 8), (8, 8)]
    assert all(b.shared == () for b in costs.split_blocks if b.kind == "mlp")
    sums = SplitCollectives(costs, _cluster(1e10))
    rows = [i for i, x in enumerate(costs.layers) if attention[0].contains(x.name)]
    fwd, bwd = sums.block_sums_s(4, rows, False, attention[0])
    fwd0, bwd0 = sums.block_sums_s(4, rows, False, replace(attention[0], shared=()))
    assert fwd == fwd0 and bwd > bwd0


def test_the_loss_split_by_vocabulary_is_priced_as_the_runtime_runs_it() -> None:
    """With ``loss_parallel`` the model's output layer (Llama's untied head) is not gathered:
    its forward collective is the split cross-entropy's agreement (a latency each way) and its
    allgather of three numbers per token; every other collective is unchanged, the plan says
    so on its stage, and the plan's prediction agrees."""
    from hetcoll.model import terms
    from hetcoll.model.predict import filter_parallel

    costs = layer_costs(llama(), (SEQ,), dtype=torch.int64)
    cluster = _cluster(1e12).subset([0, 2])
    base = filter_parallel_schedule(costs, cluster, 8, [1.0, 0.5])
    split = filter_parallel_schedule(costs, cluster, 8, [1.0, 0.5], loss_parallel=True)
    head = next(i for i, x in enumerate(costs.layers) if x.name == "lm_head")
    link = cluster.ring_link()
    stats = 3 * 8 * SEQ * 4  # three float32 numbers per token
    want = 2 * link.latency_s + terms.ring_allgatherv_seconds(
        stats, 2, link.latency_s, link.bytes_per_s
    )
    assert split.forward_collective_s[head] == pytest.approx(want, rel=1e-12)
    assert split.forward_collective_s[head] < base.forward_collective_s[head]
    others = [i for i in range(len(costs.layers)) if i != head]
    assert (split.forward_collective_s[others] == base.forward_collective_s[others]).all()
    assert (split.backward_collective_s == base.backward_collective_s).all()
    pred = filter_parallel(costs, cluster, 8, [1.0, 0.5], loss_parallel=True)
    assert pred.step_s < filter_parallel(costs, cluster, 8, [1.0, 0.5]).step_s
    assert pred.has_plan, pred.plan_note
    the_plan = pred.to_plan()
    assert the_plan.replicas[0].stages[0].loss_parallel
    got = predict_plan(costs, cluster, the_plan)
    low = pred.step_s + got.detail["loss_allreduce_s"]
    assert low - 1e-15 <= got.step_s <= low + got.breakdown["optimizer"]


def test_a_tied_head_split_through_the_loss_is_priced_as_the_runtime_splits_it() -> None:
    """GPT-2's head tied to its token embedding stays replicated without ``loss_parallel``;
    with it, the runtime splits both by vocabulary (FilterParallelEmbedding): the head's
    columns by speed like an untied head's, its logits kept split through the loss, and the
    embedding's lookup summed over the devices (one allreduce of its output, forward only).
    Each device owns its rows of the tied weight, so its optimizer step shrinks too."""
    from hetcoll.model.predict.splits import SplitCollectives

    costs = layer_costs(gpt2(), (SEQ,), dtype=torch.int64)
    assert costs.vocabulary_ties == (("lm_head", "transformer.wte"),)
    cluster = _cluster(1e12).subset([0, 2])
    base = filter_parallel_schedule(costs, cluster, 8, [1.0, 0.5])
    split = filter_parallel_schedule(costs, cluster, 8, [1.0, 0.5], loss_parallel=True)
    index = {x.name: i for i, x in enumerate(costs.layers)}
    head, wte = index["lm_head"], index["transformer.wte"]
    assert "lm_head" not in base.detail["modes"] and not base.split[head]
    assert split.detail["modes"]["lm_head"] == "gather" and split.split[head]
    shares = split.detail["shares_per_layer"]["lm_head"]
    assert shares[0] > shares[1] > 0 and sum(shares) == costs.layers[head].filters
    for d, share in enumerate(shares):
        assert split.layers.forward_s[head, d] == pytest.approx(
            base.layers.forward_s[head, d] * share / sum(shares), rel=0.05
        )
    sums = SplitCollectives(costs, cluster)
    out = costs.layers[wte].out_bytes_per_sample * 8
    assert base.forward_collective_s[wte] == 0 and split.backward_collective_s[wte] == 0
    assert split.forward_collective_s[wte] == sums.allreduce_s(out) + sums.copy_s(out)
    assert (split.update_s < base.update_s).all()


def _shifted_loss(out: Any) -> torch.Tensor:
    """A next-token cross-entropy as a causal LM's training loop computes it: the logits of
    every token but the last (a copy: the slice is not contiguous) against the next token."""
    logits = out.logits[:, :-1]
    target = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _vocab_llama(vocab: int) -> nn.Module:
    model = llama(layers=1)
    model.resize_token_embeddings(vocab)
    return model


def test_the_loss_is_costed_after_the_model_on_its_last_plan_layer() -> None:
    """``loss=`` costs the step's loss as one more layer, ``(loss)``, after the model's last
    (on the last plan layer: a pipeline's last stage runs it). Its matmul FLOPs are none, the
    model's are unchanged, and what it moves is the cross-entropy's passes over the logits,
    linear in the vocabulary: forward, the log-softmax reads and writes them and the NLL reads
    its row (3 passes); backward, the NLL's gradient is written (and its zeros), the
    log-softmax's backward reads two and writes one (5). A classifier's chain costs its loss
    the same way. Under bf16 the loss keeps float32 bytes (autocast runs it in float32)."""
    costs = {v: layer_costs(_vocab_llama(v), (SEQ,), dtype=torch.int64) for v in (128, 256)}
    with_loss = {
        v: layer_costs(_vocab_llama(v), (SEQ,), dtype=torch.int64, loss="cross-entropy")
        for v in (128, 256)
    }
    for v in (128, 256):
        plain, lossy = costs[v], with_loss[v]
        assert [x.name for x in lossy.layers] == [*(x.name for x in plain.layers), "(loss)"]
        assert lossy.loss == "cross-entropy" and plain.loss == "" and plain.loss_layer is None
        loss = lossy.layers[lossy.loss_layer]
        assert (loss.kind, loss.params, loss.forward_flops(1), loss.backward_flops(1)) == (
            "loss",
            0,
            0.0,
            0.0,
        )
        assert lossy.forward_flops(8) == plain.forward_flops(8)
        assert lossy.backward_flops(8) == plain.backward_flops(8)
        assert lossy.plan_layers == plain.plan_layers
        assert lossy.plan_layer_of == (*plain.plan_layer_of, len(plain.plan_layers) - 1)
    item = 4
    fwd, bwd = (
        {v: sum(k.bytes_per_sample for k in getattr(c.layers[-1], d)) for v, c in with_loss.items()}
        for d in ("forward", "backward")
    )
    assert fwd[256] - fwd[128] == 3 * SEQ * 128 * item
    assert bwd[256] - bwd[128] == 5 * SEQ * 128 * item
    bf16 = with_loss[128].at_precision("bf16")
    assert bf16.layers[-1] == with_loss[128].layers[-1]
    assert (
        bf16.layers[-2].out_bytes_per_sample == with_loss[128].layers[-2].out_bytes_per_sample / 2
    )
    chain = layer_costs(nn.Sequential(nn.Linear(8, 10)), (8,), loss="cross-entropy")
    assert [x.name for x in chain.layers] == ["0", "(loss)"] and chain.plan_layer_of == (0, 0)


def test_a_loss_function_of_the_output_is_costed_as_it_runs() -> None:
    """A function of the model's output is costed by its own ops: a shifted next-token loss
    copies the sliced logits (a read and a write forward, and the slice's backward writes the
    whole gradient), so it moves more than the plain cross-entropy of every token."""
    plain = layer_costs(llama(layers=1), (SEQ,), dtype=torch.int64, loss="cross-entropy")
    shifted = layer_costs(llama(layers=1), (SEQ,), dtype=torch.int64, loss=_shifted_loss)
    assert shifted.loss == "_shifted_loss"
    moved = [
        sum(k.bytes_per_sample for k in (*c.layers[-1].forward, *c.layers[-1].backward))
        for c in (plain, shifted)
    ]
    assert moved[1] > moved[0]
    # The model's own kernels are the same; the slice's backward runs one more kernel, which
    # the trace gives the head (the last op of the model's own before the slice, a view).
    model_kernels = [
        [
            (x.name, *(replace(k, launches=1) for k in (*x.forward, *x.backward)))
            for x in c.layers[:-1]
        ]
        for c in (plain, shifted)
    ]
    assert model_kernels[0] == model_kernels[1]
    launches = [
        sum(k.launches for x in c.layers for k in (*x.forward, *x.backward))
        for c in (plain, shifted)
    ]
    assert launches[1] == launches[0] + 2  # the copy of the slice, and its backward


@pytest.mark.parametrize(
    "loss, error, words",
    [
        ("mse", ValueError, "loss: expected None, one of ('cross-entropy',)"),
        (3, TypeError, "loss: expected None"),
        (lambda out: out.logits, ValueError, "loss: must return one number"),
        (lambda out: out.logits.detach().sum(), ValueError, "loss: must return one number"),
        (lambda out: out.nothing, ValueError, "loss: fails on the model's output"),
    ],
    ids=["unknown-name", "not-callable", "not-scalar", "no-gradient", "raises"],
)
def test_bad_losses_raise_naming_loss(loss: Any, error: type, words: str) -> None:
    with pytest.raises(error, match=re.escape(words)):
        layer_costs(llama(layers=1), (SEQ,), dtype=torch.int64, loss=loss)


def test_the_split_loss_is_priced_on_each_devices_slice_of_the_vocabulary() -> None:
    """With ``loss_parallel`` each device runs the cross-entropy on its columns of the head's
    logits: the loss layer's time on a device is its share of the head's outputs times the
    whole loss's (these devices have no kernel overhead; the loss's few scalars are fixed
    bytes, hence the tolerance), where without it every device runs the whole loss."""
    costs = layer_costs(llama(), (SEQ,), dtype=torch.int64, loss="cross-entropy")
    cluster = _cluster(1e12).subset([0, 2])
    base = filter_parallel_schedule(costs, cluster, 8, [1.0, 0.5])
    split = filter_parallel_schedule(costs, cluster, 8, [1.0, 0.5], loss_parallel=True)
    loss = costs.loss_layer
    head = split.detail["shares_per_layer"]["lm_head"]
    for d, share in enumerate(head):
        for part in ("forward_s", "backward_s"):
            whole = getattr(base.layers, part)[loss, d]
            assert getattr(split.layers, part)[loss, d] == pytest.approx(
                whole * share / sum(head), rel=1e-3
            )


def test_t5s_attentions_are_balanced_with_the_heads_of_the_first_of_their_class() -> None:
    """T5's first attention hands the position bias of the heads a device holds to every
    attention of its class, so the runtime needs the same heads in each
    (``SplitBlock.heads_with``): the time-balanced shares a plan's split stage is given keep
    them so, where balancing each attention alone would not (its decoder, reading 3 tokens
    against the encoder's 16, would go whole to the fast device)."""
    from dataclasses import replace

    from hetcoll.model.predict import time_balanced_shares

    config = transformers.T5Config(
        vocab_size=40, d_model=24, d_kv=4, d_ff=40, num_layers=2, num_decoder_layers=2,
        num_heads=6, decoder_start_token_id=0,
    )  # fmt: skip
    t5 = transformers.T5ForConditionalGeneration(config)
    costs = layer_costs(t5, {"input_ids": (16,), "decoder_input_ids": (3,)}, dtype=torch.int64)
    blocks = [b for b in costs.split_blocks if b.kind == "attention"]
    lead = "encoder.block.0.layer.0.SelfAttention"
    assert len(blocks) == 6 and blocks[0].module == lead and blocks[0].heads_with == ""
    assert all(b.heads_with == lead for b in blocks[1:])
    cluster = _cluster(1e12).subset([0, 2])
    shares = time_balanced_shares(costs, cluster, 8, [1.0, 0.5])
    assert len({tuple(b.units_of(shares) or ()) for b in blocks}) == 1
    alone = replace(
        costs, split_blocks=tuple(replace(b, heads_with="") for b in costs.split_blocks)
    )
    apart = time_balanced_shares(alone, cluster, 8, [1.0, 0.5])
    assert len({tuple(b.units_of(apart) or ()) for b in blocks}) > 1


def test_an_attention_that_cannot_run_without_heads_is_never_planned_empty() -> None:
    """BLOOM's attention divides by its head count to merge its heads, which only the model's
    own forward shows (it hands the attention ``alibi``): the costs probe it on the inputs
    that forward gives it (``check_empty_heads``), so its blocks may not be empty and a
    time-balanced split with ``empty_blocks`` still gives every device a head, where Llama's
    gives the slow device none."""
    from hetcoll.model.predict import time_balanced_shares

    config = transformers.BloomConfig(
        vocab_size=128, hidden_size=HIDDEN, n_layer=2, n_head=4, attn_implementation="eager"
    )
    bloom = layer_costs(transformers.BloomForCausalLM(config), (SEQ,), dtype=torch.int64)
    cluster = _cluster(1e12).subset([0, 2])
    for costs, empty in ((bloom, False), (layer_costs(llama(), (SEQ,), dtype=torch.int64), True)):
        attention = [b for b in costs.split_blocks if b.kind == "attention"]
        assert len(attention) == 2 and all(b.empty is empty for b in attention)
        shares = time_balanced_shares(costs, cluster, 8, [1.0, 0.01], empty_blocks=True)
        units = [b.units_of(shares) for b in attention]
        assert all(min(u or [0]) >= 1 for u in units) is not empty, units


class _KernelsRun(TorchDispatchMode):
    """Counts the ops of a real run that launch a kernel: not views, not bare allocations."""

    FREE = frozenset(
        {"empty", "empty_like", "empty_strided", "detach", "alias", "lift_fresh", "_unsafe_view"}
    )

    def __init__(self) -> None:
        super().__init__()
        self.launched = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if not func.is_view and func._overloadpacket.__name__ not in self.FREE:
            self.launched += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("make", [llama, gpt2])
def test_a_traced_layer_pays_a_launch_for_every_op_it_sums(make: Any) -> None:
    """A layer no formula describes is summed into one matmul-class and one element-wise
    kernel a direction, but the device pays its fixed cost per kernel for every op it runs:
    Llama's RMSNorm forward is six (pow, mean, + eps, rsqrt, x * r, weight * x). Over the
    whole model the launches are the kernels a real run on the CPU dispatches (within 3%: the
    formulas count a bias as a kernel of its own), and the predicted overhead of a
    step is exactly the launches at the device's cost per kernel, whatever the batch."""
    from hetcoll.model import Cluster, Device, Node
    from hetcoll.model.predict import data_parallel_schedule

    model = make()
    costs = layer_costs(model, {"input_ids": (SEQ,), "attention_mask": (SEQ,)}, dtype=torch.int64)
    by = {x.name: x for x in costs.layers}
    if make is llama:
        norm = by["model.layers.0.input_layernorm"]
        assert [(k.name, k.launches) for k in norm.forward] == [("ops", 6)]
    launches = sum(k.launches for x in costs.layers for k in (*x.forward, *x.backward))
    kernels = sum(len(x.forward) + len(x.backward) for x in costs.layers)
    ids = torch.randint(0, 128, (3, SEQ))
    run = _KernelsRun()
    with run:
        model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.sum().backward()
    # Llama 293 against 296 (the run's own sum, its seed), GPT-2 193 against 188 (biases).
    assert abs(launches - run.launched) <= 0.03 * run.launched, (launches, run.launched)
    assert launches > 2 * kernels  # what one launch per summed kernel undercounted
    device = Device("d", 1e12, 1e12, 1e12, kernel_overhead_s=1e-5)
    cluster = Cluster([Node("n", device, 1)], None)
    for batch in (1, 5):
        schedule = data_parallel_schedule(costs, cluster, [batch])
        assert schedule.layers.overhead_s.sum() == pytest.approx(launches * 1e-5, rel=1e-12)


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_default_sdpa_attention_given_its_mask_costs_on_the_meta_device(family: str) -> None:
    """Hugging Face's default attention (``sdpa``) reads the attention mask's values to leave
    a mask of no padding out, which the meta device cannot: the model is counted there with
    its eager attention instead (a note says so), costs what its eager twin costs, layer by
    layer, and gets its own attention back; nothing runs on the CPU."""

    def make(attention: str) -> nn.Module:
        torch.manual_seed(0)
        if family == "llama":
            return transformers.LlamaForCausalLM(
                transformers.LlamaConfig(
                    vocab_size=128, hidden_size=HIDDEN, intermediate_size=160,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    attn_implementation=attention,
                )
            )  # fmt: skip
        return hf_mixtral(
            vocab=128, hidden=32, layers=2, heads=4, kv_heads=2, experts=4,
            implementation="grouped_mm", attention=attention,
        )  # fmt: skip

    tokens = {"input_ids": (SEQ,), "attention_mask": (SEQ,)}
    sdpa = make("sdpa")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to a CPU run
        costs = layer_costs(sdpa, tokens, dtype=torch.int64)
    eager = layer_costs(make("eager"), tokens, dtype=torch.int64)
    assert sdpa.config._attn_implementation == "sdpa"
    assert costs.layers == eager.layers and costs.plan_out_bytes == eager.plan_out_bytes
    assert costs.split_blocks == eager.split_blocks and costs.experts == eager.experts
    assert any("eager implementation" in n for n in costs.notes) and not eager.notes


def test_each_sub_model_gets_its_own_attention_back_after_the_count() -> None:
    """DETR (sdpa) around a ResNet backbone (eager: it supports no other): the count switched
    the model to eager and back with the model's own, which set sdpa on the backbone too,
    and the backbone refused it (ValueError: the costs and ``hetcoll plan`` failed)."""
    backbone = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16, 16, 32], depths=[1, 1, 1, 1],
        layer_type="basic", out_features=["stage4"],
    )  # fmt: skip
    config = transformers.DetrConfig(
        use_timm_backbone=False, backbone_config=backbone, use_pretrained_backbone=False,
        d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, num_queries=6,
    )  # fmt: skip
    model = transformers.DetrModel(config)
    assert model.config._attn_implementation == "sdpa"
    costs = layer_costs(model, (3, 64, 64))
    assert costs.forward_flops(1) > 0
    assert model.config._attn_implementation == "sdpa"
    assert model.backbone.model.config._attn_implementation == "eager"


def test_a_parameter_free_module_every_block_holds_belongs_to_the_block_running_it() -> None:
    """OpenAI GPT takes its activation from a module-level table: one module object in every
    block's MLP, named by the first. Its call inside the second block counted for the first,
    so the blocks seemed to run out of order and no plan could cut the model."""
    config = transformers.OpenAIGPTConfig(
        vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = transformers.OpenAIGPTLMHeadModel(config)
    assert model.transformer.h[0].mlp.act is model.transformer.h[1].mlp.act
    ids = torch.randint(1, 60, (2, 8))
    costs = layer_costs(model, {"input_ids": ids})
    assert costs.plan_layers_note == ""
    assert costs.plan_layers[3:5] == ("transformer.h.0", "transformer.h.1")
    acts = [b for layer, b in zip(costs.layers, costs.plan_layer_of) if layer.name.endswith("act")]
    assert acts == [3, 4]


def test_experts_given_routed_rows_that_hold_no_whole_samples_keep_their_counted_ops() -> None:
    """NLLB-MoE's experts run on the tokens routed to them (a gather of rows). The decoder's
    rows (6 tokens a sample) made no multiple of the batch, so a Linear's per-sample formula
    read the features as the samples: its experts counted 24576 FLOPs where they run 294912,
    the model 0.84x FlopCounterMode's. Their counted ops are kept: every count equal."""
    config = transformers.NllbMoeConfig(
        vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48,
        max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        pad_token_id=0, eos_token_id=1, bos_token_id=0, decoder_start_token_id=0,
        use_cache=False, num_experts=4, expert_capacity=64, encoder_sparse_step=2,
        decoder_sparse_step=2, router_z_loss_coef=0.0, router_aux_loss_coef=0.0,
        moe_token_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
        attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.NllbMoeForConditionalGeneration(config)
    g = torch.Generator().manual_seed(1000)
    batch = {
        "input_ids": torch.randint(1, 60, (2, 8), generator=g),
        "decoder_input_ids": torch.randint(1, 64, (2, 6), generator=g),
    }
    costs = layer_costs(model, batch)
    with FlopCounterMode(display=False) as counter:
        model(**batch)
    assert costs.forward_flops(2) == counter.get_total_flops()


def test_an_encoder_decoder_is_costed_by_the_blocks_a_plan_cuts() -> None:
    """Hugging Face T5 on the meta device, its blocks in call order: each stack's dropout,
    called before its first block and after its last norm (listed last), is code between
    blocks, costed with the block before each call, as every stage runs it; the encoder's
    output crosses every cut up to the decoder's blocks that read it; the planner cuts T5
    into pipelines."""
    with torch.device("meta"):
        model = hf_t5(vocab=48, hidden=16, kv=4, ff=24, layers=2, heads=4)
    inputs = {"input_ids": (8,), "attention_mask": (8,), "decoder_input_ids": (6,)}
    costs = layer_costs(model, inputs, dtype=torch.int64)
    names = [n for n, _ in model_layers(model)]
    assert costs.plan_cut == "blocks" and list(costs.plan_layers) == names, costs.plan_layers_note
    assert names[-3:] == ["shared", "encoder.dropout", "decoder.dropout"]
    assert list(costs.plan_layer_of) == sorted(costs.plan_layer_of)
    dropouts = [i for x, i in zip(costs.layers, costs.plan_layer_of) if x.name.endswith("dropout")]
    at = {n: i for i, n in enumerate(names)}
    assert at["encoder.embed_tokens"] in dropouts and at["encoder.final_layer_norm"] in dropouts
    # After the encoder, its output (8 tokens x 16 floats); after the decoder's embedding,
    # that and the decoder's hidden states (6 x 16).
    assert costs.plan_out_bytes[at["encoder.final_layer_norm"]] == 8 * 16 * 4
    assert costs.plan_out_bytes[at["decoder.embed_tokens"]] == (8 + 6) * 16 * 4
    devices = {"d": {"flops_per_s": 1e10, "mem_bytes_per_s": 1e10, "memory_bytes": 1e10}}
    cluster = cluster_from_dict(
        {
            "devices": devices,
            "links": {"l": {"latency_s": 1e-6, "bytes_per_s": 1e10}},
            "nodes": [{"name": "n", "device": "d", "count": 2, "link": "l"}],
            "network": {"link": "l"},
        }
    )
    pipelines = [
        p.to_plan().to_dict()
        for p in plan(costs, cluster, 8, prune=False)
        if p.feasible and p.has_plan and p.strategy.startswith("pipeline")
    ]
    assert pipelines and all(len(r["stages"]) == 2 for doc in pipelines for r in doc["replicas"]), (
        pipelines
    )


def _bart() -> nn.Module:
    import transformers

    config = transformers.BartConfig(
        vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_position_embeddings=32, pad_token_id=0, bos_token_id=0,
        eos_token_id=0, decoder_start_token_id=0, forced_eos_token_id=None,
    )  # fmt: skip
    return transformers.BartForConditionalGeneration(config)


def _gemma3() -> nn.Module:
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, sliding_window=4,
        query_pre_attn_scalar=8, max_position_embeddings=32,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=0,
    )  # fmt: skip
    return transformers.Gemma3ForCausalLM(config)


@pytest.mark.parametrize("make", [_bart, _gemma3], ids=["bart", "gemma3"])
def test_a_model_on_the_meta_device_is_probed_on_the_cpu_where_its_forward_wants_values(
    make: Any,
) -> None:
    # Hugging Face's sdpa masks read a value (padding_mask.all()), so the probe of the code
    # between blocks runs on the CPU; there it read tensors the model holds outside its blocks
    # (BART's final_logits_bias, Gemma 3's rotary inv_freq: one rotary module called for two
    # kinds of layer, so run between blocks) from the meta device, and the model had no plan
    # layers ("hetcoll plan: error: ... top-level layers are unknown").
    with torch.device("meta"):
        model = make()
    costs = layer_costs(model, {"input_ids": (8,), "attention_mask": (8,)}, dtype=torch.int64)
    assert costs.plan_layers_note == ""
    assert list(costs.plan_layers) == [n for n, _ in model_layers(model)]
    assert {t.device.type for t in (*model.parameters(), *model.buffers())} == {"meta"}
    # The blocks a plan counts are the runtime's, the model built for real: in call order
    # (BART's layernorm_embedding, registered after its layers, runs before them).
    assert costs.plan_layers == tuple(n for n, _ in model_layers(make()))


def test_a_lora_heads_outputs_are_priced_as_one_gather() -> None:
    """A LoRA head split alone adds its base layer's and its ``lora_B``'s outputs split and
    gathers the sum once (the runtime's: "lora head" in tensor_parallel_cases.lora_more):
    priced as the bare head's one gather, and, kept split through the loss, as its split
    loss alone. Each layer's input gradient is summed backward, as before."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "lm_head"])
    wrapped = layer_costs(get_peft_model(llama(), config), (SEQ,), dtype=torch.int64)
    bare = layer_costs(llama(), (SEQ,), dtype=torch.int64)
    cluster = _cluster(1e12).subset([0, 2])

    def at(costs: Any, name: str) -> int:
        return next(i for i, x in enumerate(costs.layers) if x.name.endswith(name))

    base, lora_b = at(wrapped, "lm_head.base_layer"), at(wrapped, "lm_head.lora_B.default")
    head = at(bare, "lm_head")
    for kept in (False, True):
        got, want = (
            filter_parallel_schedule(c, cluster, 8, [1.0, 0.5], loss_parallel=kept)
            for c in (wrapped, bare)
        )
        one, other = (lora_b, base) if kept else (base, lora_b)
        assert got.forward_collective_s[one] == want.forward_collective_s[head] > 0
        assert got.forward_collective_s[other] == 0.0
        assert got.backward_collective_s[base] == want.backward_collective_s[head] > 0
        assert got.backward_collective_s[lora_b] > 0


def test_a_dora_heads_gathers_are_priced_as_the_runtime_gathers() -> None:
    """A DoRA head (its base layer split alone, gathering) gathers each forward its norms (a
    number per output feature) and its gathering lora_A's weight (to compute B A), whatever
    the batch, and, its dropout active, the base output it recomputes on the dropped input:
    one more gather of the head's output (the runtime's: "lora head" in
    tensor_parallel_cases.lora_more). Priced at the base layer, beside its own gather."""
    from peft import LoraConfig, get_peft_model

    bare = layer_costs(llama(), (SEQ,), dtype=torch.int64)
    cluster = _cluster(1e12).subset([0, 2])
    head = next(i for i, x in enumerate(bare.layers) if x.name == "lm_head")

    def forward_at_base(dropout: float, batch: int) -> tuple[float, float]:
        config = LoraConfig(r=4, target_modules=["lm_head"], use_dora=True, lora_dropout=dropout)
        costs = layer_costs(get_peft_model(llama(), config), (SEQ,), dtype=torch.int64)
        base = next(i for i, x in enumerate(costs.layers) if x.name.endswith("head.base_layer"))
        got = filter_parallel_schedule(costs, cluster, batch, [1.0, 0.5])
        want = filter_parallel_schedule(bare, cluster, batch, [1.0, 0.5])
        # PEFT's calls of the adapters on an identity matrix (B A), outputs of no features of
        # their own, stay whole (they were split into NaN shares, the whole step NaN).
        assert all(math.isfinite(t) for t in got.forward_collective_s), got.forward_collective_s
        return got.forward_collective_s[base], want.forward_collective_s[head]

    norms = []
    for batch in (8, 16):
        (kept, gather), (dropped, _) = (forward_at_base(d, batch) for d in (0.0, 0.1))
        norms.append(kept - gather)  # the norms' and lora_A's weight's gathers
        assert norms[-1] > 0 and dropped == pytest.approx(kept + gather, rel=1e-12)
    assert norms[0] == pytest.approx(norms[1], rel=1e-12)  # whatever the batch
