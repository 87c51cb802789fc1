"""Tensor parallelism of transformer blocks through filter_parallel: attention split by whole
heads (key/value groups), MLPs by hidden units, at uneven speeds, on real gloo ranks
(tests/tensor_parallel_cases.py), and the layouts it recognises, locally."""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import pytest
import tensor_parallel_cases as cases
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

from hetcoll import launch
from hetcoll.torch.filters import filter_shares

from lm_common import hf_llama

pytest.importorskip("transformers")

#: What the gloo job of each rank count runs (tests/tensor_parallel_cases.py's run_parts): one
#: job per rank count, as each rank's imports (torch, transformers) take seconds; the 3-rank
#: job runs the mixtures of experts and the other architectures beside the rest.
PARTS = {2: ("all", "lora"), 3: ("all", "architectures", "experts"), 4: ("empty",)}
_jobs: dict[int, list[dict[str, Any]] | launch.RankFailed] = {}

#: Each gloo job's limit: past it, launch says where each rank was.
JOB_S = 400
#: The first test reading a job waits for all of it: the 3-rank job took 78 s alone, 172 s
#: beside another test (CI) and 299 s on a busier host. The job's own limit (and launch's
#: start-up slack) comes before pytest's.
job_timeout = pytest.mark.timeout(JOB_S + 80)


def _gloo(p: int, part: str) -> list[Any]:
    """Each rank's result of ``part`` in the gloo job of ``p`` ranks, run by the first test
    that reads it (a failed job fails each test that reads it, with its ranks' errors)."""
    if p not in _jobs:
        try:
            _jobs[p] = launch.spawn(cases.run_parts, p, PARTS[p], timeout=JOB_S)
        except launch.RankFailed as e:
            _jobs[p] = e
    job = _jobs[p]
    if isinstance(job, launch.RankFailed):
        raise launch.RankFailed(f"the {p}-rank gloo job ({', '.join(PARTS[p])}) failed") from job
    return [r[part] for r in job]


@pytest.mark.multiproc
@job_timeout
@pytest.mark.parametrize("p", [2, 3])
def test_gloo_transformers_split_by_heads_equal_unsplit(p):
    results = _gloo(p, "all")
    assert all(r == results[0] for r in results)
    r = results[0]
    # With dropout, every rank's whole tensors stay the same (cases.dropout).
    why = (
        "state in training, the model having dropout or a router's jitter (seed every rank "
        "alike, torch.manual_seed(s) with one s, or set them to 0: random draws on whole "
        "tensors must be the same on every rank)"
    )
    assert r["dropout"] == {
        "same": True,
        "norms": True,
        "deberta": True,
        "apart": f"ranks disagree on the random generator's {why}",
        # Ranks on several kinds of device: every draw on the CPU, its generators checked.
        "kinds": {
            "same": True,
            "cpu draws": True,
            "apart": f"ranks disagree on the CPU random generator's {why}",
        },
        # A mixture of experts' router jitter is checked as dropout is.
        "jitter": {"same": True, "apart": f"ranks disagree on the random generator's {why}"},
    }, r["dropout"]
    # Every block layer is split and paired; only Llama's untied head gathers (its logits).
    assert r["llama_gathers"] == ["lm_head"] and r["gpt2_gathers"] == []
    # The runs' torch.fx traces of a split's plan: each module's once, read again after.
    assert r["traces"] == {"llama": 1, "t5": 1, "swin": 1}, r["traces"]
    assert r["llama_split"] == 2 * 7 and r["gpt2_split"] == 2 * 4
    assert r["encoder_gathers"] == ["head"] and r["encoder_split"] == 2 * 3
    # Query, key and value packed under grouped-query attention: Phi-3's three blocks (its
    # forward reading the query heads' count from its config), and group by group.
    assert r["phi3_gathers"] == ["lm_head"] and r["phi3_split"] == 2 * 4
    assert r["grouped_gathers"] == ["head"] and r["grouped_split"] == 2 * 2
    assert r["falcon_gqa_gathers"] == [] and r["falcon_gqa_split"] == 2 * 4
    # Cohere's query and key norms, a row per head (Command R+'s use_qk_norm), read at the
    # rank's heads: by group on 2 ranks, by query head on 3 (key and value whole).
    assert r["cohere_gathers"] == [] and r["cohere_split"] == {2: 2 * 7, 3: 2 * 5}[p]
    # StableLM's lists of a LayerNorm per query and per key/value head (stablelm-2-12b's
    # qk_layernorm), its forward given the rank's heads' norms: by group on 2 and 3 ranks.
    assert r["stablelm_gathers"] == ["lm_head"] and r["stablelm_split"] == 2 * 7
    # Grouped-query attention with 2 groups: by group on 2 ranks at speeds 1 : 0.25 (q_proj's
    # shares in groups), by query head on 3 (shares in heads), its key and value whole.
    assert r["llama_gqa_gathers"] == ["lm_head"]
    assert r["llama_gqa_split"] == {2: 2 * 7, 3: 2 * 5}[p]
    assert r["llama_gqa_heads"] == {2: [1, 1], 3: [4, 1, 1]}[p]
    # Qwen2-0.5B's layout: 14 query heads in 2 groups, biases on the query, key and value.
    assert r["qwen2_gathers"] == ["lm_head"] and r["qwen2_split"] == {2: 2 * 7, 3: 2 * 5}[p]
    assert r["qwen2_heads"] == {2: [1, 1], 3: [10, 2, 2]}[p]
    # Named by its query and output projections alone, the last rank holding no query head.
    assert r["llama_gqa_empty"] == {2: [6, 0], 3: [5, 1, 0]}[p]
    # With empty_blocks the slow rank (speed 0.1) holds none of Llama's 3 key/value groups,
    # GPT-2's 6 heads (q, k and v packed) or the encoder's 6 heads.
    empty = {2: [3, 0], 3: [2, 0, 1]}[p]
    heads = [2 * u for u in empty]
    # OPT-style reshapes with -1 (old_style_lm) run on the rank holding no heads too.
    # Under multi-query attention the slow rank holds no query head, and computes the whole
    # key and value all the same.
    assert r["empty_blocks"] == {
        "llama": empty, "llama_cached": empty, "cohere": empty, "llama_mqa": heads, "falcon": heads,
        "gpt2": heads, "encoder": heads, "old": heads, "neox": heads, "t5": heads,
    }  # fmt: skip
    assert r["mha_weights"] == 2 and r["sdpa_float32"] == 2
    assert r["errors"] == 10
    # loss_parallel: the untied heads' logits stay split by vocabulary through the loss.
    assert r["loss_parallel"]["llama"] == r["loss_parallel"]["encoder"] == "fewer bytes"
    assert r["loss_parallel"]["oracle"] >= 10
    # LoRA on GPT-2's token embedding: it and its tied head whole, GPT-2's blocks split (in
    # each of the 2: c_attn's base layer and lora_B, c_fc, and both c_proj).
    assert r["loss_parallel"]["lora_embedding"] == ["Linear", "Embedding", 10]
    # Timed, the slow ranks hold no more of an MLP than by speed alone (ranks in order of
    # speed 1, 0.5, 0.25: each slower rank carries the repeated work at its speed).
    timed, by_speed = r["time_balanced"]["timed"], r["time_balanced"]["by speed"]
    assert sum(timed) == sum(by_speed) == 40 and timed[0] >= by_speed[0], r["time_balanced"]
    # PEFT's LoRA wrappers split with their blocks (base layer and adapters), exact; with
    # dropout on the adapters' inputs, the ranks' whole tensors and adapters stay the same.
    assert r["lora"] == {"llama_gathers": ["base_model.model.lm_head"], "gpt2_gathers": []}


@pytest.mark.multiproc
@job_timeout
def test_gloo_lora_layouts_dropout_saving_and_peft_switches():
    """More of PEFT's LoRA split by heads, on the 2-rank job (tensor_parallel_cases.lora_more):
    every linear layer wrapped on five more layouts, DeepSeek's latent attention among them;
    DoRA split with its layers; dropout on the adapters' inputs keeps every rank's whole
    tensors alike; adapters saved load unsplit; PEFT's disable_adapter, merge_adapter and
    unmerge_adapter compute as unsplit (DoRA's too)."""
    results = _gloo(2, "lora")
    assert all(r == results[0] for r in results)
    head = ["base_model.model.lm_head"]
    assert results[0] == {
        "phi3_gathers": head, "falcon_gathers": [], "neox_gathers": head, "qwen3_gathers": head,
        "mqa_gathers": head, "falcon_dora_gathers": [],
        # DeepSeek-V3's latent attention by heads with its adapters, a rank allowed none of the
        # 4 heads (1 : 0.5 of them: 3 and 1); its experts under PEFT's ParamWrapper split by
        # hidden units with their adapters.
        "latent": {"q_b_proj": [3, 1], "q_proj": [3, 1], "experts_split": True},
        # DoRA's magnitudes split with their columns, whole beside their rows (a weight norm
        # summed over the ranks).
        "dora": {
            "llama_dora q_proj": "split-output", "llama_dora v_proj": "split-output",
            "llama_dora o_proj": "split-input", "llama_dora down_proj": "split-input",
            "gpt2_dora c_attn": "split-output", "gpt2_dora c_proj": "split-input",
        },
        # Outside attentions and MLPs: a chain pair, and a layer alone gathering its output
        # (its norms gathered), its adapters split alone or whole.
        "dora alone": {
            "pair": ["split-input", "split-output"], "gathering": ["gather"],
            "gathering, adapters whole": ["gather"],
        },
        # Each forward, whatever the batch: each DoRA row's (o_proj's, down_proj's) sums of
        # squares, a number per output feature (24), as the cost model prices them
        # (test_costs_tokens: fixed_sums).
        "dora norm sums": [[24]] * (2 * 2),
        # A LoRA head split alone: lora_A's output (the adapter rank, 4) gathered, and the
        # vocabulary (40) once, its base and lora_B outputs added split (each was gathered:
        # [40, 4, 40]); with loss_parallel none (before: [4, 40, 40]), the split loss's
        # exchange of one number per rank (2) instead.
        # A DoRA head, its dropout active: (whole width, dimensions) of each gather: lora_A's
        # weight (to compute B A) and its output, the norms, the base and lora_B outputs,
        # and the base output recomputed on the dropped input.
        "lora head": {
            "gathered": [4, 40], "loss_parallel": [4, 2],
            "dora": [[4, 2], [4, 3], [40, 1], [40, 3], [40, 3], [40, 3]],
        },
        "dropout_same": True, "saved": "loads unsplit", "disabled and merged": [],
        # Per layer: the attention's input, its query and value adapters' dropped inputs, the
        # MLP's input; and the head's input. The attention's input was copied again after each
        # dropped one (11).
        "input copies": 2 * 4 + 1,
    }  # fmt: skip


@pytest.mark.multiproc
@job_timeout
def test_gloo_architectures_split_by_heads_equal_unsplit():
    """More architectures' layouts, on the 3-rank job (uneven, 1 : 0.5 : 0.25): each split
    model trains as the unsplit one; which layers split and which gather."""
    results = _gloo(3, "architectures")
    assert all(r == results[0] for r in results)
    r = results[0]
    # Qwen3's per-head query/key norms (their gradients summed over the ranks) and Gemma's
    # tanh-approximated GELU MLP split like Llama's blocks.
    assert r["qwen3_gathers"] == ["lm_head"] and r["qwen3_split"] == 2 * 7
    assert r["gemma_gathers"] == [] and r["gemma_split"] == 2 * 7
    # OLMo 2's RMS norms over all query (key) heads split with their projections, each rank's
    # sum of squares summed with the others' (to float32's rounding, as its norms compute).
    assert r["olmo2_gathers"] == ["lm_head"] and r["olmo2_split"] == 2 * 7
    # A packed gate/up projection (Phi-3's gate_up_proj, chunked in two) splits by units.
    assert r["gate_up_gathers"] == ["head"] and r["gate_up_split"] == 2 * 2
    # Query, key and value packed head by head (GPT-NeoX's query_key_value; BLOOM's layout
    # in a user's attention) split by heads as a probe forward of the attention reads them.
    assert r["neox_gathers"] == ["lm_head"] and r["neox_split"] == 2 * 4
    assert r["packed_gathers"] == ["head"] and r["packed_split"] == 2 * 2
    # Falcon's FalconLinear (an nn.Linear subclass computing the same) splits: its MLPs by
    # units; its multi-query attention packed in one projection (Falcon-7B's) by query head,
    # the key and value rows whole on every rank.
    assert r["falcon_gathers"] == [] and r["falcon_split"] == 2 * 4
    # OPT's MLP is two layers of its decoder layer; BERT's attention output projection and
    # MLP sit in sibling modules; the one layer left gathering is BERT's head transform.
    assert r["opt_gathers"] == [] and r["opt_split"] == 2 * 6
    assert r["bert_gathers"] == ["cls.predictions.transform.dense"]
    assert r["bert_split"] == 2 * 6
    # BLOOM's alibi (batch x heads rows, computed outside the attention) is cut to each
    # rank's heads.
    assert r["bloom_gathers"] == [] and r["bloom_split"] == 2 * 4
    # T5's relative position bias (a column per head, in the first attention of each stack)
    # is read at each rank's heads, and every attention of its stack holds those heads: its
    # encoder's and decoder's self-attentions, cross-attentions and MLPs all split.
    assert r["t5_gathers"] == [] and r["t5_split"] == 2 * 6 + 2 * 10
    # GPT-BigCode's (StarCoder's) packed with the queries in c_attn, read after an unsqueeze.
    assert r["bigcode_gathers"] == [] and r["bigcode_split"] == 2 * 4
    # MPT's ALiBi (heads x 1 x keys, computed outside the attention, as many heads as the
    # batch's rows) is cut to each rank's heads.
    assert r["mpt_gathers"] == [] and r["mpt_split"] == 2 * 4
    # Cohere's key norm under multi-query attention: its one row, whole on every rank.
    assert r["cohere_mqa_gathers"] == [] and r["cohere_mqa_split"] == 2 * 5
    # Mamba's mixer, which fx cannot trace, reads dt_proj's weight itself (its fused path
    # x_proj's and out_proj's too): those stay whole, in_proj splits and gathers (the mixer
    # crashed on the split weight).
    mixers = [f"backbone.layers.{k}.mixer.in_proj" for k in range(2)]
    assert r["mamba_gathers"] == mixers and r["mamba_split"] == 0
    # DBRX's packed Wqkv, clamped before it is cut at its hidden_size (the rank's query
    # width), splits by group; its routers gather; its experts, stacked in 2-D weights, split
    # by hidden units (20 of each expert, by speed 1 : 0.5 : 0.25).
    routers = [f"transformer.blocks.{k}.ffn.router.layer" for k in range(2)]
    assert r["dbrx_gathers"] == ["lm_head", *routers] and r["dbrx_split"] == 2 * 2
    assert r["dbrx_experts"] == [[12, 6, 2]] * 2
    # ALBERT's attention splits by heads though a norm of its residual sum follows the output
    # projection inside it (that norm runs on the summed output); its one layer, called
    # once per layer, is split once. Its embeddings' projection and head's dense layer gather.
    assert r["albert_gathers"] == [
        "albert.encoder.embedding_hidden_mapping_in",
        "predictions.dense",
    ]
    assert r["albert_split"] == 6
    # StableLM's per-head norms split by query head (2 key/value groups on 3 ranks): each
    # rank's key norms are those of the key/value head each of its query heads reads.
    assert r["stablelm_gqa_gathers"] == ["lm_head"] and r["stablelm_gqa_split"] == 2 * 5
    # A learned bias per head made outside the attention and handed to it: MPNet's (one
    # embedding at the encoder for every layer) and BEiT's (each layer's table, given as the
    # attention's mask). Every rank computes it whole from its tables, held whole, and reads
    # its heads; the tables' gradients, each rank's its heads' part, are summed (the first
    # forward raised ValueError).
    assert r["mpnet_gathers"] == ["lm_head.dense"] and r["mpnet_split"] == 2 * 6
    patches = "classifier.beit.embeddings.patch_embeddings.projection"
    assert r["beit_gathers"] == [patches, "classifier.classifier"] and r["beit_split"] == 2 * 6
    # Swin v2's attentions: a learned number per head (logit_scale, heads x 1 x 1) read at
    # the rank's heads, and an MLP of its own making a bias per head (held whole, its output
    # read at the rank's heads' columns, its gradients summed). They stayed whole before.
    # (Its MLPs gather: its layers' forwards are not traced.)
    assert r["swinv2_split"] == 2 * 4
    assert not any(n.endswith(("query", "key", "value")) for n in r["swinv2_gathers"])
    # Swin's (v1) table of a column per head, looked up by a child called without inputs
    # (1 x heads x window x window): its output is read at the rank's heads, dimension 1.
    assert r["swin_gathers"] == [
        "classifier.classifier",
        "classifier.swin.embeddings.patch_embeddings.projection",
        "classifier.swin.encoder.layers.0.downsample.reduction",
    ]
    assert r["swin_split"] == 2 * 6
    # Apertus's MLPs split around xIELU, whose two learnt numbers every rank holds whole
    # (their gradients, each rank's units' part, summed over the ranks). They gathered before.
    assert r["apertus_gathers"] == ["lm_head"] and r["apertus_split"] == 2 * 6
    # DiffLlama's attentions pair head h with head h + 2 across the halves they cut their
    # heads into: split by heads, a rank's heads paired among themselves (other logits, by
    # 0.96 relative at 1 : 1). They stay whole, named, their 4 layers and the head gathering;
    # its MLPs split.
    # Where a probe at the split cannot run such an attention (an input it requires), its
    # first forward looks again, on its own inputs, and every rank raises.
    assert r["diffllama"] == {
        "gathers": 2 * 4 + 1, "split": 2 * 3,
        "named": ["model.layers.0.self_attn", "model.layers.1.self_attn"],
        "first forward": [
            "filter_parallel: attention 'blocks.0' cuts its heads into parts (chunk of its 6 "
            "heads into 2 (dim 1)), which its forward may combine: split by heads, a rank's "
            "heads are not the unsplit attention's parts; leave its layers out (layers=...)",
            # And one that cannot run on part of its heads (it reshapes to its input's width).
            "filter_parallel: attention 'blocks.0' cannot run on a rank holding 2 of its 6 "
            "units of heads, as rank 0 does (RuntimeError: shape '[3, 7, 24]' is invalid for "
            "input of size 168); leave its layers out (layers=...)",
        ],
    }  # fmt: skip


@pytest.mark.multiproc
@job_timeout
def test_gloo_four_ranks_where_one_holds_no_heads():
    # Speeds 1 : 0.1 : 0.5 : 0.75 (hetcoll.split, least finishing time): Llama's 3 key/value
    # groups go 2 : 0 : 0 : 1, two ranks holding none; 6 heads go 3 : 0 : 1 : 2. Several ranks
    # hold each block, so its sums are reductions.
    results = _gloo(4, "empty")
    # Multi-query attention splits its 6 query heads as GPT-2's.
    # Cohere's query and key norm rows: none on the ranks holding no group.
    want = {"llama": [2, 0, 0, 1], "llama_cached": [2, 0, 0, 1], "gpt2": [3, 0, 1, 2]}
    want["cohere"] = want["llama"]
    heads = {k: [3, 0, 1, 2] for k in ("llama_mqa", "falcon", "encoder", "old", "neox", "t5")}
    assert results == [{**want, **heads}] * 4


def test_shares_follow_heads_and_speeds():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shares = filter_shares(cases.llama(), size=2, speeds=[1.0, 0.5])
    attn = "model.layers.0.self_attn."
    # 3 key/value groups of 2 query heads of 4: 2 groups to the fast rank, 1 to the slow one.
    assert shares[attn + "q_proj"] == [16, 8]
    assert shares[attn + "k_proj"] == shares[attn + "v_proj"] == [8, 4]
    assert shares[attn + "o_proj"] == [16, 8]
    # 40 hidden units at 2:1 (hetcoll.split: 27, 13), gate and up alike, down reading them.
    mlp = "model.layers.0.mlp."
    assert shares[mlp + "gate_proj"] == shares[mlp + "up_proj"] == shares[mlp + "down_proj"]
    assert shares[mlp + "gate_proj"] in ([27, 13], [26, 14])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = filter_shares(cases.gpt2(), size=2, speeds=[1.0, 0.5])
    # GPT-2's packed c_attn: 4 of 6 heads of 4 each of q, k and v to the fast rank.
    assert g["transformer.h.0.attn.c_attn"] == [48, 24]
    assert g["transformer.h.0.attn.c_proj"] == [16, 8]


def test_lora_wrappers_split_as_their_blocks_projections():
    """PEFT's LoRA wrappers of a block's projections take the block's shares under their own
    paths; one named alone (its block's other projections not) raises ValueError naming it and
    its base layer, which can be named instead (split alone, its adapters replicated). A
    wrapper it does not know keeps its layers whole."""
    torch.manual_seed(0)
    model = cases.llama_lora()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shares = filter_shares(model, size=2, speeds=[1.0, 0.5])
    attn = "base_model.model.model.layers.0.self_attn."
    assert shares[attn + "q_proj"] == [16, 8] and shares[attn + "o_proj"] == [16, 8]
    assert not [n for n in shares if ".lora_" in n or n.endswith(".base_layer")], list(shares)
    with pytest.raises(ValueError, match=r"shares: '.*q_proj' is PEFT's LoRA wrapper.*base_layer"):
        filter_shares(model, size=2, shares={attn + "q_proj": [16, 8]})
    alone = filter_shares(model, size=2, shares={attn + "q_proj.base_layer": [16, 8]})
    assert alone == {attn + "q_proj.base_layer": [16, 8]}
    # DoRA splits with its block as plain LoRA does.
    dora = cases._with_lora(cases.llama(), ["q_proj"], use_dora=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert filter_shares(dora, size=2, speeds=[1.0, 0.5])[attn + "q_proj"] == [16, 8]
    # A wrapper the split does not know (adapters merged into the base layer: a split layer
    # would unmerge against a slice) keeps its layers whole, named in the warning; named,
    # they raise.
    merged = cases._with_lora(cases.llama(), ["q_proj"])
    merged.merge_adapter()
    with pytest.warns(UserWarning, match=r"q_proj.base_layer' \('.*q_proj': its adapters merged"):
        shares = filter_shares(merged, size=2, speeds=[1.0, 0.5])
    assert not [n for n in shares if ".q_proj." in n], list(shares)
    with pytest.raises(ValueError, match=r"'.*q_proj.base_layer' cannot be split: .* merged"):
        filter_shares(merged, size=2, shares={attn + "q_proj.base_layer": [16, 8]})


class _Unknown(nn.Module):
    """Counts heads but its projections are neither separate nor packed q/k/v."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads = 2
        self.head_dim = 4
        self.qk = nn.Linear(8, 16)
        self.v = nn.Linear(8, 8)
        self.o = nn.Linear(8, 8)

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.o(self.v(x) * self.qk(x)[..., :8])


def test_an_attention_it_does_not_know_is_named_in_a_warning():
    with pytest.warns(
        UserWarning, match=r"left unsplit by heads.*'_Unknown' \(its projections \(qk 8->16"
    ):
        filter_shares(_Unknown(), size=2, speeds=[1.0, 1.0])


@pytest.mark.multiproc
@job_timeout
def test_gloo_mixtures_of_experts_split_by_hidden_units_equal_unsplit():
    results = _gloo(3, "experts")
    assert all(r == results[0] for r in results)
    # Speeds 1 : 0.5 : 0.25 over 5 steps of 8 hidden units (Mixtral's 40), 4 (32): every
    # block's experts alike. DeepSeek-V3's latent attention splits by heads (no warning).
    mixtral = [(24, 8, 8)]
    assert results[0] == {
        "mixtral": mixtral, "batched_mm": mixtral, "grouped_mm": mixtral,
        "gpt_oss": [(16, 8, 8)], "qwen2_moe": [(16, 8, 8)], "deepseek_v3": [(16, 8, 8)],
        "olmoe": [(16, 8, 8)], "errors": 4, "mixtral_lora": mixtral, "gpt_oss_lora": [(16, 8, 8)],
        "latent_heads": [3, 1, 0],  # its 4 heads at speeds 1 : 0.5 : 0.05
    }  # fmt: skip


def test_a_mixture_of_experts_splits_by_hidden_units_beside_its_attention():
    """Mixtral's experts (4 experts' weights stacked in 3-D parameters) split by each expert's
    hidden units, in steps of 8 (grouped_mm's alignment), as its attention by heads; per-layer
    shares naming them split them alike; the experts module is no layer to gather."""
    shares = filter_shares(cases.mixtral(), size=2, speeds=[1.0, 0.25])
    assert shares["model.layers.0.self_attn.q_proj"] == [8, 8]
    assert shares["model.layers.0.mlp.experts"] == shares["model.layers.1.mlp.experts"] == [32, 8]
    assert filter_shares(cases.mixtral(), size=2, shares=shares) == shares
    with pytest.raises(ValueError, match=r"\[36, 4\] are not whole steps of 8 hidden units"):
        filter_shares(
            cases.mixtral(), size=2, shares={**shares, "model.layers.0.mlp.experts": [36, 4]}
        )
    only = filter_shares(
        cases.mixtral(), size=2, speeds=[1.0, 1.0], layers=["model.layers.1.mlp.experts"]
    )
    assert only == {"model.layers.1.mlp.experts": [24, 16]}
    with pytest.raises(ValueError, match="too few for 6 ranks"):
        filter_shares(cases.mixtral(), size=6, speeds=[1.0] * 6)


def _muse_spark() -> nn.Module:
    import transformers

    cfg = transformers.MuseSparkTextConfig(
        vocab_size=32, hidden_size=16, moe_hidden_size=16, intermediate_size=32,
        moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=4, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    return transformers.MuseSparkTextModel(cfg)


class _OwnExperts(nn.Module):
    """A user's mixture of experts: stacked 3-D weights without Hugging Face's layout flags."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = 2
        self.w = nn.Parameter(torch.randn(2, 8, 8))

    def forward(self, x):  # type: ignore[no-untyped-def]
        return torch.einsum("eoi,ti->to", self.w, x)


def test_experts_no_share_of_hidden_units_can_run_stay_whole_and_are_named():
    """A norm of each expert's whole output (MuseSpark's has_post_expert_norm) and a layout
    hetcoll does not know keep the experts whole on every rank, said in a warning; named in
    layers, they raise."""
    with pytest.warns(UserWarning, match=r"left whole on every rank.*has_post_expert_norm"):
        shares = filter_shares(_muse_spark(), size=2, speeds=[1.0, 1.0])
    assert not any("experts" in n for n in shares) and shares
    with pytest.warns(UserWarning, match=r"'' \(its parameters are not laid out as Hugging"):
        filter_shares(_OwnExperts(), size=2, speeds=[1.0, 1.0])
    with pytest.raises(ValueError, match=r"layers: '' cannot split its experts by hidden units"):
        filter_shares(_OwnExperts(), size=2, speeds=[1.0, 1.0], layers=[""])


def test_experts_split_where_parts_of_their_hidden_units_add_up():
    """The probe forward tells a layout it knows from one it does not: Nemotron-H's ungated
    experts split; an experts module adding each routed token whole (an identity expert, as
    LongCat's zero experts) does not."""
    import transformers

    from hetcoll.torch.filters import experts_layout
    from hetcoll.torch.filters.experts import ExpertsLayout, experts_split

    cfg = transformers.NemotronHConfig(
        hidden_size=16, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2
    )
    nemotron = transformers.models.nemotron_h.modeling_nemotron_h.NemotronHExperts(cfg)
    layout = experts_layout(nemotron)
    assert isinstance(layout, ExpertsLayout)
    assert layout.params == {"up_proj": (1, (1,)), "down_proj": (2, (1,))}
    split = experts_split("e", nemotron)
    assert split is not None and not isinstance(split, str)
    assert (split.units, split.width) == (2, 8)

    class Identity(type(nemotron)):  # type: ignore[misc]
        def forward(self, hidden_states, top_k_index, top_k_weights):  # type: ignore[no-untyped-def]
            return super().forward(hidden_states, top_k_index, top_k_weights) + hidden_states

    odd = Identity(cfg)
    assert experts_split("e", odd) == (
        "parts of its hidden units do not add up to its output (a probe forward)"
    )


def test_experts_of_earlier_transformers_releases_split_as_their_flags_meant():
    """Releases before transformers 5.20 set no ``has_post_expert_norm``, before 5.7 no
    ``is_concatenated``, before 5.3 no ``has_gate`` (the H100 run's release lacked one, and
    Mixtral's experts stayed whole there). Without them Mixtral's experts lay out, split and
    place as with them; GPT-OSS's interleaved rows (its own ``_apply_gate``) without
    ``is_concatenated`` are refused, not read as halves; without the flags every release sets,
    no layout is guessed."""
    import copy

    from hetcoll.torch.expert_parallel import experts_module
    from hetcoll.torch.filters import experts_layout
    from hetcoll.torch.filters.experts import ExpertsLayout, experts_split

    mixtral = cases.mixtral().get_submodule("model.layers.0.mlp.experts")
    want = experts_layout(mixtral)
    assert isinstance(want, ExpertsLayout) and want.params["gate_up_proj"] == (1, (1, 1))
    later = ("has_post_expert_norm", "is_concatenated", "has_gate")
    for k in range(1, len(later) + 1):
        earlier = copy.deepcopy(mixtral)
        for flag in later[:k]:
            delattr(earlier, flag)
        assert experts_layout(earlier) == want, later[:k]
        split = experts_split("e", earlier)  # its probe forward agrees
        assert split is not None and not isinstance(split, str)
        assert (split.units, split.width) == (5, 8)  # 40 hidden units in steps of 8
        assert experts_module(earlier) == ""
    oss = cases.gpt_oss().get_submodule("model.layers.0.mlp.experts")
    layout = experts_layout(oss)
    assert isinstance(layout, ExpertsLayout) and layout.params["gate_up_proj"] == (2, (2,))
    del oss.is_concatenated
    why = (
        "its class splits gate_up_proj by an _apply_gate of its own, and it has no "
        "is_concatenated flag to say how (transformers before 5.7)"
    )
    assert experts_layout(oss) == why and experts_module(oss) == why
    del mixtral.is_transposed
    assert experts_layout(mixtral) == (
        "its parameters are not laid out as Hugging Face's use_experts_implementation "
        "describes them"
    )


class _Weights(nn.Module):
    """A module holding weights its parent reads."""


class _StackedWeights(nn.Module):
    """A user's experts stacked in 2-D weights (experts x hidden units by features) in a
    child, as DBRX's; with ``count`` the parent's attribute its forward views them by."""

    def __init__(self, count: bool) -> None:
        super().__init__()
        self.num_experts, self.features = 2, 4
        if count:
            self.ffn_hidden_size = 3
        self.mlp = _Weights()
        self.mlp.w_in = nn.Parameter(torch.randn(6, 4))
        self.mlp.w_out = nn.Parameter(torch.randn(6, 4))

    def forward(self, hidden_states, top_k_index, top_k_weights):  # type: ignore[no-untyped-def]
        units = getattr(self, "ffn_hidden_size", 3)
        w_in = self.mlp.w_in.view(-1, units, self.features)
        w_out = self.mlp.w_out.view(-1, units, self.features)
        out = torch.zeros_like(hidden_states)
        for k in range(top_k_index.shape[1]):
            e = top_k_index[:, k]
            h = torch.relu(torch.einsum("tf,tuf->tu", hidden_states, w_in[e]))
            out = out + top_k_weights[:, k, None] * torch.einsum("tu,tuf->tf", h, w_out[e])
        return out


def test_experts_stacked_in_two_dimensional_weights_split_by_their_count():
    """DBRX's experts (``mlp.w1``, ``mlp.v1``, ``mlp.w2``: experts x hidden units by features,
    counted by ``ffn_hidden_size``) split by each expert's hidden units, a run of rows of
    each expert; the same layout without a count to set is named in a warning and stays
    whole (it was kept whole silently)."""
    from hetcoll.torch.filters import experts_layout
    from hetcoll.torch.filters.experts import ExpertsLayout, experts_split

    dbrx = cases.dbrx().get_submodule("transformer.blocks.0.ffn.experts")
    layout = experts_layout(dbrx)
    assert isinstance(layout, ExpertsLayout)
    four = (0, (1, 1, 1, 1))  # 4 experts of 20 hidden units each
    assert layout.params == {"mlp.w1": four, "mlp.v1": four, "mlp.w2": four}
    assert (layout.units, layout.features) == (20, 24)
    assert layout.counts == ("ffn_hidden_size", "mlp.ffn_hidden_size")
    split = experts_split("e", dbrx)
    assert split is not None and not isinstance(split, str) and split.units == 20
    # A user's own module in that layout: the probe forward checks it.
    assert isinstance(experts_split("e", _StackedWeights(count=True)), type(split))
    assert experts_split("e", _StackedWeights(count=False)) == (
        "its experts' weights ['mlp.w_in', 'mlp.w_out'] are stacked in 2-D, with no attribute "
        "of its own (intermediate_dim, intermediate_size, expert_dim, ffn_hidden_size) "
        "counting each expert's 3 hidden units"
    )
    with pytest.warns(UserWarning, match=r"left whole on every rank.*stacked in 2-D"):
        filter_shares(_StackedWeights(count=False), size=2, speeds=[1.0, 1.0])
    assert filter_shares(_StackedWeights(count=True), size=2, speeds=[1.0, 0.5]) == {"": [2, 1]}


class _Coefficients(nn.Module):
    """Gemma 3n's AltUp in small: a forward fx traces, and a method its parent calls instead,
    which in training reads its child's weight itself (clamped)."""

    def __init__(self) -> None:
        super().__init__()
        self.coefs = nn.Linear(4, 2, bias=False)

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.coefs(x)

    def correct(self, x):  # type: ignore[no-untyped-def]
        return F.linear(x, self.coefs.weight.clamp(-1.0, 1.0)) + 1.0


class _CallsCorrect(nn.Module):
    """Calls the method, in a forward fx cannot trace (a branch on values)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.altup = _Coefficients()

    def forward(self, x):  # type: ignore[no-untyped-def]
        h = self.inp(x)
        return self.altup.correct(h) if bool(h.sum() > -1e9) else self.altup(h)


def test_weights_a_method_other_than_forward_reads_stay_whole():
    """A child's weight read by a method of its parent's class other than ``forward``
    (Gemma 3n's ``altup.correct``, in training) stays whole: split, each rank computed one of
    the two coefficients, broadcast over both silently (logits 6e-5 off, the weight's
    gradient wholly wrong). The metadata of a weight (its shape, dtype) reads no values."""
    from hetcoll.torch.filters import split_layout

    assert split_layout(_CallsCorrect()).read_directly == ["altup.coefs"]
    assert filter_shares(_CallsCorrect(), size=2, speeds=[1.0, 1.0]) == {"inp": [2, 2]}
    import transformers

    config = transformers.Gemma3nTextConfig(
        vocab_size=40, vocab_size_per_layer_input=40, hidden_size=16,
        hidden_size_per_layer_input=8, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=4, max_position_embeddings=32,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"], laurel_rank=4,
        altup_num_inputs=2, num_kv_shared_layers=0, activation_sparsity_pattern=[0.0, 0.0],
    )  # fmt: skip
    reads = split_layout(transformers.Gemma3nForCausalLM(config)).read_directly
    assert [n for n in reads if "correction_coefs" in n] == [
        f"model.layers.{k}.altup.correction_coefs" for k in range(2)
    ]


def test_an_attention_that_cannot_run_on_part_of_its_heads_stays_whole():
    """Hugging Face LED's decoder attention reshapes its heads' output to its input's width
    (``embed_dim`` read off the hidden states): split, the first forward crashed inside it.
    A probe forward holding one unit of heads tells it; the attention stays whole, named in
    the warning, and its MLPs still split."""
    import transformers

    from hetcoll.torch.filters import split_layout

    config = transformers.LEDConfig(
        vocab_size=40, d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=24,
        decoder_ffn_dim=24, max_encoder_position_embeddings=32,
        max_decoder_position_embeddings=32, attention_window=4, attn_implementation="eager",
        pad_token_id=0, bos_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )  # fmt: skip
    layout = split_layout(transformers.LEDForConditionalGeneration(config))
    decoder = ["led.decoder.layers.0.encoder_attn", "led.decoder.layers.0.self_attn"]
    assert sorted(n for n in layout.kept if n.startswith("led.decoder")) == decoder
    assert all("fails on a rank holding some of its heads" in layout.kept[n] for n in decoder)
    # The layers' MLPs (fc1, fc2) still split.
    assert sorted(ts.module for ts in layout.splits) == [
        "led.decoder.layers.0",
        "led.encoder.layers.0",
    ]
    # ProphetNet's attention counts its heads as num_attn_heads, and reshapes as LED's: it
    # was kept whole for "a head size but no head count"; now for what its forward does.
    config = transformers.ProphetNetConfig(
        vocab_size=40, hidden_size=16, encoder_ffn_dim=24, decoder_ffn_dim=24,
        num_encoder_layers=1, num_decoder_layers=1, num_encoder_attention_heads=4,
        num_decoder_attention_heads=4, max_position_embeddings=32, ngram=2,
        pad_token_id=0, bos_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )  # fmt: skip
    layout = split_layout(transformers.ProphetNetForConditionalGeneration(config))
    attention = "prophetnet.encoder.layers.0.self_attn"
    assert "fails on a rank holding some of its heads" in layout.kept[attention]


def test_an_attention_that_cuts_its_heads_into_parts_stays_whole():
    """Hugging Face DiffLlama's attention cuts its key/value heads in two halves and pairs
    head h of one with head h of the other: split by heads, a rank's heads paired among
    themselves and the split computed other numbers, with no error. A probe forward (Hugging
    Face's rotary inputs given as zeros) sees the cut; the attention stays whole, named in
    the warning, and its MLPs still split. Llama's attention, with the same inputs and
    rotary embedding, cuts nothing of its heads."""
    from hetcoll.torch.filters import split_layout

    layout = split_layout(cases.diffllama())
    attentions = [f"model.layers.{k}.self_attn" for k in range(2)]
    assert sorted(layout.kept) == attentions
    for n in attentions:
        assert layout.kept[n].startswith(
            "its forward cuts its heads into parts (chunk of its 4 heads into 2 (dim 1))"
        ), layout.kept[n]
    assert sorted(ts.module for ts in layout.splits) == [f"model.layers.{k}.mlp" for k in range(2)]
    llama = split_layout(cases.llama())
    assert not llama.kept and len(llama.splits) == 4
    assert not any(ts.cut_unseen for ts in llama.splits)
    # An attention no probe at the split can run (an input it requires) is split, and looked
    # at again at its first forward (tensor_parallel_cases.differential).
    kept = split_layout(cases.kept_differential_lm())
    assert not kept.kept
    assert [ts.module for ts in kept.splits if ts.cut_unseen] == ["blocks.0", "blocks.1"]


def test_an_mlp_whose_activation_holds_learnt_numbers_splits_by_units():
    """Apertus's xIELU reads two one-element parameters and two one-element buffers: the same
    numbers for every hidden unit, so its MLP splits by units, the parameters among the
    block's shared ones (held whole, their gradients summed). An activation holding a number
    per unit, or reducing along a dimension (``torch.min(x, -1)``), keeps the MLP whole."""
    from hetcoll.torch.filters import split_layout

    layout = split_layout(cases.apertus())
    mlps = {ts.module: ts.shared for ts in layout.splits if ts.kind == "mlp"}
    assert mlps == {
        f"model.layers.{k}.mlp": [f"model.layers.{k}.mlp.act_fn.alpha_{s}" for s in "np"]
        for k in range(2)
    }

    class PerUnit(nn.Module):
        def __init__(self, numbers: int, reduce: bool = False) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
            self.scale = nn.Parameter(torch.ones(numbers))
            self.reduce = reduce

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.up(x) * self.scale
            if self.reduce:
                h = h - torch.min(h, -1).values.unsqueeze(-1)
            return self.down(h)

    def split_mlps(model: nn.Module) -> list[list[str]]:
        return [ts.shared for ts in split_layout(model).splits if ts.kind == "mlp"]

    assert split_mlps(PerUnit(1)) == [["scale"]]
    assert split_mlps(PerUnit(16)) == []
    assert split_mlps(PerUnit(1, reduce=True)) == []


class _NormAcrossHeads(nn.Module):
    """Separate q/k/v/o of 2 heads of 4, and a norm over all query features (OLMo 2's
    layout): a rank holding some heads could not apply it."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.head_dim = 2, 4
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))
        self.q_norm = nn.LayerNorm(8)

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.o(self.v(x) * self.k(x) * self.q_norm(self.q(x)))


def test_a_parameter_of_one_number_per_query_head_is_read_at_the_ranks_heads():
    """GPT-OSS's attention sinks (one per query head; as many heads as a head's features, so
    told by their name) are held whole on every rank, their gradients summed, and read at the
    rank's heads, by key/value group or by query head; a rank holding none runs."""
    from hetcoll.torch.filters import split_layout

    layout = split_layout(cases.gpt_oss())
    attentions = [ts for ts in layout.splits if ts.kind == "attention"]
    assert len(attentions) == 2 and not layout.kept
    for ts in attentions:
        assert ts.by_head is not None
        for variant in (ts, ts.by_head):
            assert variant.head_params == [f"{ts.module}.sinks"]
            assert f"{ts.module}.sinks" in variant.shared and variant.empty_fails == ""


def test_weights_an_untraceable_forward_reads_itself_stay_whole():
    """Mamba's mixer, which torch.fx cannot trace, computes ``self.dt_proj.weight @ ...``
    and hands ``x_proj``'s and ``out_proj``'s weights to a fused kernel: its class's code
    shows it, so those layers stay whole (a split crashed in the scan); BLOOM's weight rows
    read on its pretraining's tensor-parallel path and T5's dtype checks are no such reads."""
    from hetcoll.torch.filters import split_layout

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layout = split_layout(cases.mamba())
    mixers = [f"backbone.layers.{k}.mixer" for k in range(2)]
    assert layout.read_directly == [
        f"{m}.{n}" for m in mixers for n in ("x_proj", "dt_proj", "out_proj")
    ]
    assert layout.modes == {f"{m}.in_proj": "gather" for m in mixers}
    for make in (cases.bloom, cases.T5LM):
        assert split_layout(make()).read_directly == []


def _hidden(method: Any) -> Any:
    """A decorator without ``functools.wraps``: its wrapper's code is not the method's."""

    def wrapper(self: Any, x: torch.Tensor) -> torch.Tensor:
        return method(self, x)

    return wrapper


class _ReadsInItsFunctions(nn.Module):
    """A forward torch.fx cannot trace (data-dependent), its class's code reading a child's
    weight whole in a property and in a decorated method."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.d, self.e = (nn.Linear(4, 4) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent: no trace
            x = self.scaled(x)
        return self.e(self.cube(self.p(x)) + self.d(x))

    @property
    def p(self) -> Any:
        return lambda x: x @ self.a.weight

    @staticmethod
    def cube(x: torch.Tensor) -> torch.Tensor:
        return x**3

    @classmethod
    def make(cls) -> _ReadsInItsFunctions:
        return cls()

    @torch.no_grad()  # functools.wraps: its own code is found
    def scaled(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.b.weight)


class _HidesAMethod(nn.Module):
    """An untraceable forward calling a method whose decorator hides its code."""

    def __init__(self) -> None:
        super().__init__()
        self.c, self.e = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            x = x + 1
        return self.e(self.mixed(x))

    @_hidden
    def mixed(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.c.weight


def test_an_untraceable_forwards_class_is_read_function_by_function():
    """The reads of :func:`test_weights_an_untraceable_forward_reads_itself_stay_whole` are
    found in each function of the class read on its own (a property's, a decorated
    method's), as in the class's whole text (whose source is found by parsing its whole
    file); where a decorator hides a method's code, the class's whole text is read: every
    layer read whole stays whole, the others split."""
    from hetcoll.torch.filters import split_layout

    model = nn.Sequential(_ReadsInItsFunctions.make(), _HidesAMethod(), nn.Linear(4, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its forward is untraceable
        layout = split_layout(model)
    assert layout.read_directly == ["0.a", "0.b", "1.c"]
    assert {"0.d", "0.e", "1.e"} <= set(layout.modes)


def test_a_models_repeated_attentions_are_probed_once(monkeypatch):
    """Whether an attention runs on a rank holding none of its heads is probed once per
    class and layout (forwards of copies on the meta device), not once per block: Llama's
    probes are as many at 4 layers as at 2."""
    from transformers.models.llama import modeling_llama

    from hetcoll.torch.filters import split_layout

    forward = modeling_llama.LlamaAttention.forward
    probes = [0]

    def counted(self: Any, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(hidden_states, torch.Tensor) and hidden_states.is_meta:
            probes[0] += 1
        return forward(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", counted)
    seen = []
    for layers in (2, 4):
        model = hf_llama(
            vocab=40, hidden=24, intermediate=40, layers=layers, heads=6, kv_heads=3, positions=32
        )
        probes[0] = 0
        layout = split_layout(model)
        assert len([ts for ts in layout.splits if ts.kind == "attention"]) == layers
        seen.append(probes[0])
    assert seen[0] == seen[1] > 0, seen


def test_containers_without_a_forward_are_not_traced(monkeypatch):
    """A model's nn.ModuleList and nn.ModuleDict have no forward to trace (their parents call
    their children): the layout is read without tracing them, as torch.fx's patching costs
    milliseconds a trace, and the layout is the one with them traced."""
    from torch import fx

    from hetcoll.torch.filters import split_layout

    model = hf_llama(
        vocab=40, hidden=24, intermediate=40, layers=2, heads=6, kv_heads=3, positions=32
    )
    model.model.extra = nn.ModuleDict({"a": nn.Linear(4, 4)})  # called by no one
    trace = fx.Tracer.trace
    roots: list[type] = []

    def counted(self: Any, root: Any, *args: Any, **kwargs: Any) -> Any:
        roots.append(type(root))
        return trace(self, root, *args, **kwargs)

    monkeypatch.setattr(fx.Tracer, "trace", counted)
    layout = split_layout(model)
    assert roots and not {nn.ModuleList, nn.ModuleDict} & set(roots), roots
    assert [ts.kind for ts in layout.splits].count("attention") == 2


@pytest.mark.parametrize("kv_heads", [1, 2, 6])
def test_norm_weights_of_a_row_per_head_are_read_at_the_ranks_heads(kv_heads):
    """Cohere's query and key norms (``use_qk_norm``: a weight row per query head, one per
    key/value head) no longer keep its attention whole: both are held whole on every rank,
    their gradients summed, the query norm's rows read at the rank's query heads and the key
    norm's at its key/value heads (by group, or gathered by query head); under multi-head
    attention both follow the query heads."""
    from hetcoll.torch.filters import split_layout

    layout = split_layout(cases.cohere(kv_heads))
    attentions = [ts for ts in layout.splits if ts.kind == "attention"]
    assert len(attentions) == 2 and not layout.kept
    for ts in attentions:
        q, k = f"{ts.module}.q_norm.weight", f"{ts.module}.k_norm.weight"
        for variant in (ts, ts.by_head) if ts.by_head else (ts,):
            assert {q, k} <= set(variant.shared)
            assert variant.empty_fails == ""  # a rank holding no heads holds no rows
            if kv_heads == 6:
                assert variant.head_params == [q, k] and variant.key_params == []
            else:
                assert variant.head_params == [q] and variant.key_params == [k]


@pytest.mark.parametrize("q_lora", [8, None])
def test_latent_attention_splits_by_heads_its_latents_whole(q_lora):
    """DeepSeek's multi-head latent attention splits by heads: its queries' (q_b_proj, or
    q_proj) and its keys' and values' (kv_b_proj) expansions by heads, o_proj by its input;
    the latent projections and their norms whole on every rank, ahead of the heads (their
    outputs copied, the norms' weights shared); the performance model holds the same heads
    and prices the latents whole."""
    from hetcoll.model import layer_costs
    from hetcoll.model.predict import filter_parallel_schedule
    from hetcoll.torch.filters import split_layout

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # YaRN's settings in a tiny config
        model = cases.deepseek_v3(q_lora)
        layout = split_layout(model)
        costs = layer_costs(model, (7,), dtype=torch.int64)
        shares = filter_shares(model, size=3, speeds=[1.0, 0.5, 0.25])
    attn = "model.layers.1.self_attn."
    ts = next(ts for ts in layout.splits if ts.module == attn[:-1])
    query = "q_b_proj" if q_lora else "q_proj"
    assert (ts.units, ts.width) == (4, 4) and not layout.kept
    assert ts.columns == [(attn + query, (8,)), (attn + "kv_b_proj", (8,))]
    latents = ["kv_a_proj_with_mqa", "kv_a_layernorm"]
    if q_lora:
        latents = ["kv_a_proj_with_mqa", "q_a_proj", "q_a_layernorm", "kv_a_layernorm"]
    assert ts.upstream == [attn + n for n in latents]
    assert ts.shared == [attn + n + ".weight" for n in latents if n.endswith("layernorm")]
    assert ts.fed_by == {
        attn + c: attn + u
        for c, u in (("q_b_proj", "q_a_proj"), ("kv_b_proj", "kv_a_proj_with_mqa"))
        if q_lora or c == "kv_b_proj"
    }
    assert shares[attn + "o_proj"] == [8, 4, 4] and shares[attn + query] == [16, 8, 8]
    assert not any(attn + n in shares for n in latents)
    block = next(b for b in costs.split_blocks if b.module == attn[:-1])
    assert set(latents) <= {n.removeprefix(attn) for n in block.whole}
    # The key/value latent's gradient (8 + 4 float32 features per token of 7) is summed too.
    assert block.sums == ((7 * 12 * 4.0, False),)
    sched = filter_parallel_schedule(costs, _two_devices(3), 4, [1.0, 0.5, 0.25])
    got = sched.detail["shares_per_layer"]
    assert all(got[n] == v for n, v in shares.items() if n.startswith(attn)), got


def test_a_norm_over_all_heads_splits_with_its_projection():
    """OLMo 2's q_norm and k_norm (RMS norms over all query heads' and all key heads'
    features) split with q_proj and k_proj, by key/value group; split by query head, the key
    (whole on every rank) keeps its norm whole, its weight shared. A norm of another formula
    (a LayerNorm, below) keeps the attention whole."""
    from hetcoll.torch.filters import split_layout

    layout = split_layout(cases.olmo2())
    attn = "model.layers.0.self_attn."
    ts = next(ts for ts in layout.splits if ts.module == attn[:-1])
    assert not layout.kept and ts.shared == []
    assert ts.norms == {attn + "q_norm": attn + "q_proj", attn + "k_norm": attn + "k_proj"}
    assert ts.by_head is not None and ts.by_head.norms == {attn + "q_norm": attn + "q_proj"}
    assert attn + "k_norm.weight" in ts.by_head.shared
    # The performance model prices each norm's sums: a float32 number per token each way.
    from hetcoll.model import layer_costs

    costs = layer_costs(cases.olmo2(), (7,), dtype=torch.int64)
    block = next(b for b in costs.split_blocks if b.module == attn[:-1])
    assert block.sums == ((28.0, True), (28.0, False)) * 2


def test_a_parameter_spanning_heads_keeps_the_attention_whole():
    with pytest.warns(UserWarning, match=r"'q_norm\.weight' \(8,\) is neither of one head's size"):
        filter_shares(_NormAcrossHeads(), size=2, speeds=[1.0, 1.0])


def test_a_module_for_each_head_is_seen_at_the_ranks_heads():
    # StableLM's qk_layernorm (stablelm-2-12b): q_layernorm.norms holds a LayerNorm for each
    # query head, k_layernorm.norms one for each key/value head, zipped with the heads its
    # forward is given. Split as they were, a rank's heads met the first norms (logits 7e-5
    # off, the others' norms never trained); then they kept the attention whole. Now each
    # list is held whole, its weights shared, and the forward sees the rank's heads' norms.
    from hetcoll.torch.filters import split_layout
    from hetcoll.torch.filters.head_guards import HeadParameters

    model = cases.stablelm_head_norms()
    attn = "model.layers.0.self_attn"
    ts = next(ts for ts in split_layout(model).splits if ts.module == attn)
    assert ts.head_params == [f"{attn}.q_layernorm.norms"]
    assert ts.key_params == [f"{attn}.k_layernorm.norms"]
    assert f"{attn}.q_layernorm.norms.5.weight" in ts.shared
    attention = model.get_submodule(attn)
    whole, keys = attention.q_layernorm.norms, attention.k_layernorm.norms
    rows = HeadParameters(ts, 1, 1)  # the second key/value group: query heads 2, 3
    rows.place(attention)
    rows.enter(attention, ())
    assert list(attention.q_layernorm.norms) == [whole[2], whole[3]]
    assert list(attention.k_layernorm.norms) == [keys[1]]
    rows.leave(attention, (), None)
    assert attention.q_layernorm.norms is whole and attention.k_layernorm.norms is keys


def test_a_packing_of_its_own_keeps_the_attention_whole():
    # CodeGen's qkv_proj: four blocks of heads, each query, value and key. Split 8 : 8 as
    # GPT-2's three blocks, its logits were 93% off, with no warning.
    with pytest.warns(
        UserWarning,
        match=r"left unsplit by heads.*'transformer\.h\.0\.attn' \(its projections "
        r"\(qkv_proj 64->192, out_proj 64->64\) are not separate or packed",
    ):
        filter_shares(cases.codegen(), size=2, speeds=[1.0, 1.0])


def test_per_head_norms_are_shared_by_the_heads():
    from hetcoll.torch.filters import split_layout

    layout = split_layout(cases.qwen3())
    attn = [ts for ts in layout.splits if ts.kind == "attention"]
    assert len(attn) == 2 and not layout.kept
    assert attn[0].shared == [
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.self_attn.k_norm.weight",
    ]


@pytest.mark.parametrize("make", [cases.llama, cases.EncoderLM])
def test_a_head_nothing_reads_is_no_reason_to_warn(make):
    # Hugging Face's forwards cannot be traced; the one layer left gathering, the LM head,
    # feeds no other split layer, so a trace would not pair it: no warning about tracing.
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        filter_shares(make(), size=2, speeds=[1.0, 0.5])
    assert not [w for w in seen if "could not trace" in str(w.message)]


def test_a_packed_gate_and_up_projection_splits_by_units():
    import transformers

    from hetcoll.torch.filters import split_layout

    config = transformers.Phi3Config(
        vocab_size=40, hidden_size=24, intermediate_size=40, num_hidden_layers=1,
        num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=32,
        pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    layout = split_layout(transformers.Phi3ForCausalLM(config))
    (mlp,) = [ts for ts in layout.splits if ts.kind == "mlp"]
    # Its 80 outputs are two blocks (gate, up) of the 40 units down_proj reads.
    assert mlp.columns == [("model.layers.0.mlp.gate_up_proj", (1, 1))]
    assert mlp.row == "model.layers.0.mlp.down_proj" and mlp.units == 40


def test_sibling_modules_pair_as_one_block():
    # Hugging Face BERT: the attention module holds query, key and value; its output
    # projection is a sibling's, and the MLP spans two sibling modules of the layer.
    from hetcoll.torch.filters import split_layout

    layout = split_layout(cases.bert())
    layer = "bert.encoder.layer.0"
    attn, mlp = sorted(layout.splits, key=lambda ts: ts.kind)[::2]
    assert attn.module == f"{layer}.attention.self" and attn.units == 6
    assert [c for c, _ in attn.columns] == [
        f"{layer}.attention.self.{n}" for n in ("query", "key", "value")
    ]
    assert attn.row == f"{layer}.attention.output.dense"
    assert attn.attrs == {"num_attention_heads": 1, "all_head_size": 4}
    assert mlp.module == layer and mlp.columns == [(f"{layer}.intermediate.dense", (1,))]
    assert mlp.row == f"{layer}.output.dense" and mlp.units == 40
    assert not layout.kept


def test_an_mlp_of_a_layers_own_linears_splits():
    # OPT's fc1 and fc2 are layers of its decoder layer, whose forward fx cannot take as it
    # is (Hugging Face's (*args, **kwargs) checkpointing wrapper): traced called with its
    # hidden states, its attention (given no mask) traced through or kept whole.
    from hetcoll.torch.filters import split_layout

    layout = split_layout(cases.opt())
    mlps = [ts for ts in layout.splits if ts.kind == "mlp"]
    assert [(ts.module, ts.columns, ts.row) for ts in mlps] == [
        (f"model.decoder.layers.{i}", [(f"model.decoder.layers.{i}.fc1", (1,))],
         f"model.decoder.layers.{i}.fc2")
        for i in (0, 1)
    ]  # fmt: skip


class _Branchy(nn.Module):
    """A mixer whose forward branches on its input's values: fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.proj(x) if x.sum() > 0 else -self.proj(x)


class _InlineBlock(nn.Module):
    """A block whose MLP is two of its own layers, beside a mixer fx cannot trace."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = _Branchy()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x, scale):  # type: ignore[no-untyped-def]
        x = x + self.mix(x) * scale
        return x + self.down(torch.relu(self.up(x)))


def test_a_submodule_fx_cannot_trace_is_kept_whole_around_the_mlp():
    from hetcoll.torch.filters import split_layout

    layout = split_layout(_InlineBlock())
    (mlp,) = layout.splits
    assert (mlp.module, mlp.columns, mlp.row, mlp.units) == ("", [("up", (1,))], "down", 16)


def test_query_key_value_packed_under_grouped_query_attention():
    from hetcoll.torch.filters import split_layout

    # Phi-3 cuts qkv_proj's output where its query heads end: three blocks of 2 query heads,
    # one key and one value head of 4 per key/value group; its forward reads the query
    # heads' count from the config, so the rank's module gets its own view of it.
    attn = [ts for ts in split_layout(cases.phi3()).splits if ts.kind == "attention"]
    assert [(ts.columns, ts.row) for ts in attn[:1]] == [
        ([("model.layers.0.self_attn.qkv_proj", (8, 4, 4))], "model.layers.0.self_attn.o_proj")
    ]
    assert attn[0].config == {"num_attention_heads": 2, "num_key_value_heads": 1}
    # Packed group by group (InternLM2's wqkv): one run of 4 heads' features per group.
    (grouped, _) = split_layout(cases.grouped_lm()).splits
    assert grouped.columns == [("blocks.0.wqkv", (16,))] and grouped.units == 3


def test_multi_query_attention_splits_query_heads_beside_a_whole_key_and_value():
    from hetcoll.model import layer_costs
    from hetcoll.torch.filters import filter_modes, split_layout

    # One key/value head, which every query head reads: each rank holds it whole (as
    # Megatron-LM keeps a key/value head no split can divide), so the unit is a query head.
    model = cases.llama_mqa()
    attn = "model.layers.0.self_attn."
    (ts,) = [t for t in split_layout(model).splits if t.module == attn[:-1]]
    assert (ts.units, ts.width, ts.head_dim) == (6, 4, 4)
    assert ts.columns == [(attn + "q_proj", (4,))] and ts.row == attn + "o_proj"
    assert ts.whole == [attn + "k_proj", attn + "v_proj"]
    assert ts.shared == [attn + "k_proj.weight", attn + "v_proj.weight"]
    # A rank's module repeats the key/value head once per query head it holds.
    assert ts.attrs == {"num_key_value_groups": 1}
    assert ts.config == {"num_attention_heads": 1}
    # Whole on every rank: neither split layers nor given shares.
    assert attn + "k_proj" not in filter_modes(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shares = filter_shares(model, size=2, speeds=[1.0, 0.25])
    assert shares[attn + "q_proj"] == shares[attn + "o_proj"] == [20, 4]
    assert attn + "k_proj" not in shares
    with pytest.raises(ValueError, match=r"shares: gives shares for \['model.layers.0.self_"):
        filter_shares(model, size=2, shares={**shares, attn + "k_proj": [4, 0]})
    # The performance model prices them whole on every device, and sums their gradients.
    from hetcoll.model import cluster_from_dict
    from hetcoll.model.predict import filter_parallel_schedule

    costs = layer_costs(model, (7,), dtype=torch.int64)
    block = costs.split_blocks[0]
    assert block.whole == (attn + "k_proj", attn + "v_proj") and block.units == 6
    assert block.shared == (24 * 4, 24 * 4)
    device = {"flops_per_s": 1e12, "mem_bytes_per_s": 1e11, "memory_bytes": 1e12}
    two = cluster_from_dict(
        {
            "devices": {"d": device},
            "links": {"l": {"latency_s": 1e-6, "bytes_per_s": 1e10}},
            "nodes": [{"name": "a", "device": "d", "count": 2, "link": "l"}],
            "network": {"link": "l"},
        }
    )
    sched = filter_parallel_schedule(costs, two, 4, [1.0, 0.25])
    rows = {x.name: i for i, x in enumerate(costs.layers)}
    compute = sched.layers.compute_s
    k, q = compute[rows[attn + "k_proj"]], compute[rows[attn + "q_proj"]]
    assert k[0] == k[1] > 0 and math.isclose(q[0] / q[1], 20 / 4)
    assert sched.detail["units_per_block"][attn[:-1]] == [5, 1]

    # Packed with the query heads (Falcon-7B's query_key_value: 6 query heads, then one key
    # and one value head, of 4): its key and value rows are whole on every rank.
    falcon = cases.falcon()
    attn = "transformer.h.0.self_attention."
    (ts,) = [t for t in split_layout(falcon).splits if t.module == attn[:-1]]
    assert (ts.units, ts.width) == (6, 4) and ts.whole == [] and ts.shared == []
    assert ts.columns == [(attn + "query_key_value", (4, 0, 0))]
    assert ts.whole_features == {attn + "query_key_value": (0, 4, 4)}
    # Its own hidden_size is its query heads' width: the rank's (DBRX cuts at it).
    assert ts.attrs == {"num_heads": 1, "split_size": 4, "hidden_size": 4}
    assert ts.empty_fails == ""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"\[2, 22\] are not whole query heads \(of 4"):
            filter_shares(
                falcon, size=2, shares=[2, 22], layers=[attn + "query_key_value", attn + "dense"]
            )
    costs = layer_costs(falcon, (7,), dtype=torch.int64)
    block = costs.split_blocks[0]
    assert block.whole_features == (8, 0) and block.shared == (8 * 24,)  # no biases
    sched = filter_parallel_schedule(costs, two, 4, [1.0, 0.25])
    rows = {x.name: i for i, x in enumerate(costs.layers)}
    qkv = sched.layers.compute_s[rows[attn + "query_key_value"]]
    assert math.isclose(qkv[0] / qkv[1], (20 + 8) / (4 + 8))


def test_grouped_query_attention_splits_by_query_head_where_its_groups_cannot_follow():
    from hetcoll.model import layer_costs
    from hetcoll.model.predict import filter_parallel_schedule
    from hetcoll.torch.filters import split_layout

    # 2 key/value groups of 3 query heads of 4: split by group, or (by_head) by query head,
    # every rank holding both key/value heads whole and cutting them to its query heads'.
    model = cases.llama_gqa()
    attn = "model.layers.0.self_attn."
    (ts,) = [t for t in split_layout(model).splits if t.module == attn[:-1]]
    assert (ts.units, ts.width) == (2, 12) and ts.by_head is not None
    alt = ts.by_head
    assert (alt.units, alt.width, alt.kv_groups) == (6, 4, 2)
    assert alt.columns == [(attn + "q_proj", (4,))] and alt.row == attn + "o_proj"
    assert alt.whole == [attn + "k_proj", attn + "v_proj"]
    assert alt.shared == [attn + "k_proj.weight", attn + "v_proj.weight"]
    # A rank's module reads one key/value head per query head it holds.
    assert alt.fixed == {"num_key_value_groups": 1}
    assert alt.config == {"num_attention_heads": 1, "num_key_value_heads": 1}
    shares = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for speeds in ([1.0, 1.0], [1.0, 0.25], [1.0, 1.0, 1.0], [1.0, 0.25, 0.25]):
            got = filter_shares(model, size=len(speeds), speeds=speeds)
            shares[tuple(speeds)] = (got[attn + "o_proj"], attn + "k_proj" in got)
        # Shares of whole query heads but not whole groups split by query head (the way to
        # ask for it on 2 ranks).
        by_shares = filter_shares(
            model,
            size=2,
            shares=[20, 4],
            layers=[attn + "q_proj", attn + "k_proj", attn + "v_proj", attn + "o_proj"],
        )
        with pytest.raises(ValueError, match=r"\[22, 2\] are not whole query heads \(of 4"):
            filter_shares(model, size=2, shares=[22, 2], layers=list(by_shares))
        # Too few for either split: the error names the finer one's units.
        with pytest.raises(ValueError, match=r"has 6 query heads \(of 4 features each\), too few"):
            filter_shares(model, size=7, speeds=[1.0] * 7)
    assert by_shares == {attn + "q_proj": [20, 4], attn + "o_proj": [20, 4]}
    assert shares == {
        (1.0, 1.0): ([12, 12], True),  # by group, nothing repeated
        (1.0, 0.25): ([12, 12], True),  # coarse, but by group (Megatron-LM's convention)
        (1.0, 1.0, 1.0): ([8, 8, 8], False),  # 2 groups for 3 ranks: by query head
        (1.0, 0.25, 0.25): ([16, 4, 4], False),
    }
    # The performance model makes the runtime's choice (SplitBlock.resolved) and prices the
    # key and value whole on every device.
    costs = layer_costs(model, (7,), dtype=torch.int64)
    block = costs.split_blocks[0]
    assert block.units == 2 and block.by_head is not None
    assert block.resolved([1.0, 0.25]) is block
    assert block.resolved([1.0, 0.25, 0.25]) is block.by_head
    assert block.resolved([1.0, 0.25], shares={attn + "o_proj": [12, 12]}) is block.by_head
    assert block.resolved([1.0] * 7) is block.by_head  # too few for either: the finer one
    assert block.by_head.whole == (attn + "k_proj", attn + "v_proj")
    sched = filter_parallel_schedule(costs, _two_devices(3), 4, [1.0, 0.25, 0.25])
    rows = {x.name: i for i, x in enumerate(costs.layers)}
    compute = sched.layers.compute_s
    k, q = compute[rows[attn + "k_proj"]], compute[rows[attn + "q_proj"]]
    assert k[0] == k[1] == k[2] > 0 and math.isclose(q[0] / q[1], 16 / 4)
    assert sched.detail["units_per_block"][attn[:-1]] == [4, 1, 1]


@settings(max_examples=12, deadline=None)
@given(st.lists(st.sampled_from([1.0, 0.75, 0.5, 0.3, 0.25, 0.1]), min_size=2, max_size=4))
def test_the_model_splits_grouped_query_attention_as_the_runtime(speeds):
    """The performance model's split of each block (SplitBlock.resolved, then its shares) is
    the one filter_parallel makes, by group or by query head, at any speeds."""
    from hetcoll.model.predict import filter_parallel_schedule

    costs = _gqa_costs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = filter_shares(cases.llama_gqa(), size=len(speeds), speeds=speeds)
    cluster = _two_devices(len(speeds))
    sched = filter_parallel_schedule(costs, cluster, 4, speeds)
    want = {k: v for k, v in sched.detail["shares_per_layer"].items() if ".layers." in k}
    assert {k: v for k, v in got.items() if ".layers." in k} == want


@settings(max_examples=10, deadline=None)
@given(st.lists(st.sampled_from([1.0, 0.75, 0.5, 0.3, 0.25, 0.1]), min_size=2, max_size=4))
def test_the_model_splits_experts_as_the_runtime(speeds):
    """The performance model holds each device's hidden units of every expert as
    filter_parallel does, and prices the experts' work and weights by them."""
    from hetcoll.model.predict import filter_parallel_schedule

    costs = _mixtral_costs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = filter_shares(cases.mixtral(), size=len(speeds), speeds=speeds)
    sched = filter_parallel_schedule(costs, _two_devices(len(speeds)), 4, speeds)
    want = sched.detail["shares_per_layer"]
    experts = "model.layers.0.mlp.experts"
    assert got[experts] == want[experts] == got["model.layers.1.mlp.experts"]
    assert sched.detail["modes"][experts] == "split-input"
    row = next(i for i, x in enumerate(costs.layers) if x.name == experts)
    # Its routing weights' gradient (2 float32 numbers per token of 7) is summed too.
    from dataclasses import replace

    from hetcoll.model.predict.splits import SplitCollectives

    block = next(b for b in costs.split_blocks if b.module == experts)
    assert block.sums == ((7 * 2 * 4.0, False),)
    sums = SplitCollectives(costs, _two_devices(len(speeds)))
    with_sums = sums.block_sums_s(4, [row], False, block)
    without = sums.block_sums_s(4, [row], False, replace(block, sums=()))
    assert with_sums[0] == without[0]
    extra = sums.allreduce_s(7 * 2 * 4.0 * 4) + sums.copy_s(7 * 2 * 4.0 * 4)
    assert math.isclose(with_sums[1] - without[1], extra)
    compute = sched.layers.compute_s[row]
    assert all(
        math.isclose(compute[d] / compute[0], got[experts][d] / got[experts][0])
        for d in range(len(speeds))
    ), (compute, got[experts])


@functools.cache
def _mixtral_costs() -> Any:
    from hetcoll.model import layer_costs

    return layer_costs(cases.mixtral(), (7,), dtype=torch.int64)


@functools.cache
def _gqa_costs() -> Any:
    from hetcoll.model import layer_costs

    return layer_costs(cases.llama_gqa(), (7,), dtype=torch.int64)


def _two_devices(count: int = 2) -> Any:
    from hetcoll.model import cluster_from_dict

    device = {"flops_per_s": 1e12, "mem_bytes_per_s": 1e11, "memory_bytes": 1e12}
    return cluster_from_dict(
        {
            "devices": {"d": device},
            "links": {"l": {"latency_s": 1e-6, "bytes_per_s": 1e10}},
            "nodes": [{"name": "a", "device": "d", "count": count, "link": "l"}],
            "network": {"link": "l"},
        }
    )


def test_an_attention_that_cannot_run_without_heads_gives_every_rank_a_group():
    # Falcon's grouped layout divides by the rank's key/value head count: a rank holding none
    # would raise there alone while the others wait in the reduction. With empty_blocks the
    # split still gives every rank one of its 3 groups (of 2 query heads of 4: 8 features)...
    got = filter_shares(cases.falcon_gqa(), size=2, speeds=[1.0, 0.1], empty_blocks=True)
    assert got["transformer.h.0.self_attention.dense"] == [16, 8]
    # ... and says why where it cannot.
    with pytest.raises(
        ValueError,
        match=r"too few for 4 ranks .*\(attention "
        r"'transformer.h.0.self_attention' cannot run on a rank holding none of "
        r"its heads: ZeroDivisionError",
    ):
        filter_shares(cases.falcon_gqa(), size=4, speeds=[1.0, 0.1, 0.1, 0.1], empty_blocks=True)
    # Llama's runs on empty tensors: a rank may hold none.
    got = filter_shares(cases.llama(), size=2, speeds=[1.0, 0.1], empty_blocks=True)
    assert got["model.layers.0.self_attn.o_proj"] == [24, 0]
    # The performance model and planner split them alike.
    from hetcoll.model import layer_costs

    blocks = layer_costs(cases.falcon_gqa(), (7,), dtype=torch.int64).split_blocks
    assert [(b.kind, b.empty) for b in blocks[:2]] == [("attention", False), ("mlp", True)]
    assert blocks[0].shares([1.0, 0.1], empty=True) == [2, 1]


@given(
    b=st.integers(1, 4),
    h=st.integers(1, 4),
    n=st.integers(1, 6),
    d=st.integers(1, 5),
    pattern=st.integers(0, 3),
)
def test_an_empty_reshape_infers_what_it_would_with_heads(b, h, n, d, pattern):
    from hetcoll.torch.filters.head_guards import fill_empty_reshape

    # How attentions reshape around their heads; with the rank's heads 0, -1 is as with h.
    def case(heads: int) -> tuple[list[int], list[int]]:
        return [
            ([b, heads, n, d], [b * heads, -1, d]),  # BLOOM's queries
            ([b * heads, n, n], [b, heads, n, -1]),  # BLOOM's scores
            ([b, n, heads * d], [b, -1, heads, d]),  # OPT's projections
            ([b, n, heads, d], [b, n, -1]),  # merging the heads back
        ][pattern]

    shape, target = case(h)
    want = torch.empty(shape).reshape(target).shape
    empty_shape, empty_target = case(0)
    got = fill_empty_reshape(empty_shape, empty_target)
    i = target.index(-1)
    assert got[i] == (0 if pattern == 3 else want[i]), (got, list(want))
    assert torch.empty(empty_shape).reshape(got).numel() == 0


def test_inputs_per_head_are_cut_to_the_ranks_heads():
    from hetcoll.torch.filters.head_guards import PerHeadInputs
    from hetcoll.torch.filters.heads import TensorSplit

    # 6 heads of 4 in 3 key/value groups of 2; this rank holds groups 1 and 2: heads 2 to 5.
    ts = TensorSplit("attention", "attn", 3, 8, [], "attn.o", head_dim=4)
    cut = PerHeadInputs(ts, 1, 2)
    x = torch.zeros(2, 5, 24)
    alibi = torch.arange(2 * 6 * 5.0).reshape(2 * 6, 1, 5)  # batch x heads rows (BLOOM's)
    bias = torch.randn(2, 6, 5, 5)  # (batch, heads, ...)
    mask = torch.ones(2, 1, 5, 5)  # not per head: left alone
    (args, kwargs) = cut.cut(nn.Identity(), (x, alibi), {"bias": bias, "mask": mask})
    assert args[0] is x and kwargs["mask"] is mask
    assert torch.equal(args[1], alibi.reshape(2, 6, 1, 5)[:, 2:6].reshape(8, 1, 5))
    assert torch.equal(kwargs["bias"], bias[:, 2:6])
    # A learned bias per head would need the other ranks' heads' gradients.
    with pytest.raises(
        ValueError,
        match=r"'attn' is given bias of shape \(2, 6, 5, 5\), .* "
        "needs its gradient",
    ):
        cut.cut(nn.Identity(), (x,), {"bias": bias.requires_grad_()})
    # Unless it is made of tables of a column per head alone, held whole (MPNet's, BEiT's):
    # then their gradients are summed over the ranks.
    table = nn.Embedding(9, 6)
    hidden = nn.Linear(24, 6)
    wide = nn.Parameter(torch.randn(5, 5))
    positional = nn.Parameter(torch.randn(5, 24))  # the hidden states' own parameters
    held = [("table", table.weight), ("wide", wide), ("positional", positional)]
    whole = {id(p): (n, p) for n, p in [*held, *hidden.named_parameters()]}
    summed: list[torch.Tensor] = []
    learned = PerHeadInputs(ts, 1, 2, lambda: (whole, summed.append))
    positions = torch.randint(0, 9, (5, 5))
    bias = table(positions).permute(2, 0, 1).unsqueeze(0).expand(2, 6, 5, 5)
    (_, kwargs) = learned.cut(nn.Identity(), (x,), {"bias": bias})
    assert torch.equal(kwargs["bias"], bias[:, 2:6]) and summed == [table.weight]
    states = hidden(x + positional).transpose(1, 2).unsqueeze(-1).expand(2, 6, 5, 5)
    for made in (states, bias + wide):
        with pytest.raises(ValueError, match="needs its gradient"):
            learned.cut(nn.Identity(), (x,), {"bias": made})


def test_t5_attentions_split_by_heads_reading_their_tables_columns():
    # T5: the first attention of each stack holds the relative position bias of every head
    # (an embedding, one column per head), held whole and read at the rank's heads; it hands
    # what it computes to the others of its class, which hold the same heads as the first.
    # Its MLPs split: reading their output layer's dtype (T5 casts to it) reads no values.
    import transformers

    from hetcoll.torch.filters import split_layout

    config = transformers.T5Config(
        vocab_size=40, d_model=24, d_kv=4, d_ff=40, num_layers=2, num_decoder_layers=2,
        num_heads=6, decoder_start_token_id=0,
    )  # fmt: skip
    layout = split_layout(transformers.T5ForConditionalGeneration(config))
    assert not layout.kept
    attention = {ts.module: ts for ts in layout.splits if ts.kind == "attention"}
    assert len(attention) == 2 + 2 * 2  # encoder self; decoder self and cross
    lead = "encoder.block.0.layer.0.SelfAttention"
    for stack in ("encoder", "decoder"):
        first = attention[f"{stack}.block.0.layer.0.SelfAttention"]
        table = f"{first.module}.relative_attention_bias"
        assert first.tables == [table] and first.shared == [f"{table}.weight"]
    assert attention[lead].heads_with == ""
    assert {ts.heads_with for n, ts in attention.items() if n != lead} == {lead}
    assert all(not ts.tables for n, ts in attention.items() if ".block.1." in n)
    mlp = {n: m for n, m in layout.modes.items() if "DenseReluDense" in n}
    assert mlp["encoder.block.1.layer.1.DenseReluDense.wi"] == "split-output"
    assert mlp["encoder.block.1.layer.1.DenseReluDense.wo"] == "split-input"


def test_attentions_of_a_class_one_of_which_stays_whole_stay_whole():
    # The first attention of the class holds a parameter spanning heads (a scale of every
    # query feature): it stays whole for its layout, and the others of its class with it (the
    # same code may hand them what it computes for every head).
    from hetcoll.torch.filters import split_layout

    class Scaled(cases._OldStyleAttention):
        def __init__(self, scaled: bool) -> None:
            super().__init__(packed=False)
            self.scale = nn.Parameter(torch.ones(24)) if scaled else None

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return super().forward(x if self.scale is None else x * self.scale)

    first = iter([True, False])
    layout = split_layout(cases.ResidualLM(lambda: Scaled(next(first))))
    assert not [ts for ts in layout.splits if ts.kind == "attention"]
    assert "'scale' (24,)" in layout.kept["blocks.0"]
    assert layout.kept["blocks.1"].startswith("'blocks.0', of its class Scaled, stays whole")


def test_a_config_view_keeps_its_own_counts_and_shares_the_rest():
    import copy
    import pickle

    import transformers

    from hetcoll.torch.filters import ConfigView

    base = transformers.LlamaConfig(hidden_size=24, num_attention_heads=6, num_key_value_heads=3)
    view = ConfigView(base, {"num_attention_heads": 2})
    assert view.num_attention_heads == 2 and view.num_key_value_heads == 3
    base._attn_implementation = "eager"  # a later change to the shared config reaches it
    assert view._attn_implementation == "eager"
    view.num_key_value_heads = 1  # not its own: written through
    assert base.num_key_value_heads == 1 and base.num_attention_heads == 6
    assert ConfigView(view, {"num_key_value_heads": 1})._base is base  # one level
    for twin in (copy.deepcopy(view), pickle.loads(pickle.dumps(view))):
        assert twin.num_attention_heads == 2 and twin._base is not base
        assert twin.hidden_size == base.hidden_size


def test_empty_blocks_lets_a_slow_rank_hold_no_heads():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # One head and two ranks: too few unless a rank may hold none.
        too_few = r"has 1 key/value groups .*too few for 2 ranks.*empty_blocks=True"
        with pytest.raises(ValueError, match=too_few):
            filter_shares(cases.one_head(), size=2, speeds=[1.0, 1.0])
        one = filter_shares(cases.one_head(), size=2, speeds=[1.0, 1.0], empty_blocks=True)
        slow = filter_shares(cases.llama(), size=2, speeds=[1.0, 0.1], empty_blocks=True)
        kept = filter_shares(cases.llama(), size=2, speeds=[1.0, 0.1])
        with pytest.raises(TypeError, match="empty_blocks: must be True or False"):
            filter_shares(cases.llama(), size=2, speeds=[1.0, 1.0], empty_blocks=1)
    attn = "model.layers.0.self_attn."
    assert one[attn + "q_proj"] == [24, 0] and one[attn + "k_proj"] == [24, 0]
    # At 10:1 a whole group of 3 is too much for the slow rank: it gets none, and its MLP share
    # stays in proportion; without empty_blocks it keeps one group.
    assert slow[attn + "o_proj"] == [24, 0] and kept[attn + "o_proj"] == [16, 8]
    assert slow["model.layers.0.mlp.down_proj"] == [37, 3]  # hetcoll.split(40, [1, 0.1])


def test_split_traffic_refuses_what_it_cannot_count():
    from hetcoll.torch import split_traffic

    with pytest.raises(TypeError, match=r"model: must be a torch\.nn\.Module"):
        split_traffic("model")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="model: has no split layers"):
        split_traffic(nn.Linear(2, 2))


def test_a_timed_split_needs_speeds():
    ids = cases.batch(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="sample: balances a split by speeds"):
            filter_shares(cases.llama(), size=2, shares=[12, 12], sample={"input_ids": ids})
        timed = filter_shares(
            cases.llama(), size=2, speeds=[1.0, 0.1], empty_blocks=True, sample={"input_ids": ids}
        )
        # Multi-query attention: its key and value, whole on every rank, count as work every
        # rank repeats; the query heads split whole.
        mqa = filter_shares(
            cases.llama_mqa(), size=2, speeds=[1.0, 0.25], sample={"input_ids": ids}
        )
    assert sum(timed["model.layers.0.mlp.down_proj"]) == 40
    o_proj = mqa["model.layers.0.self_attn.o_proj"]
    assert sum(o_proj) == 24 and all(v % 4 == 0 and v > 0 for v in o_proj)
    assert "model.layers.0.self_attn.k_proj" not in mqa


@pytest.mark.parametrize(
    "make", [cases.llama, cases.gpt2, cases.EncoderLM, cases.llama_mqa, cases.llama_gqa]
)
def test_per_layer_shares_round_trip_by_heads(make):
    """``filter_shares``' dict given back as ``shares=`` splits the same way, by heads and
    hidden units (torch's attention named alone, its output projection following)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        by_speed = filter_shares(make(), size=3, speeds=[1.0, 0.1, 0.5], empty_blocks=True)
        back = filter_shares(make(), size=3, shares=by_speed, empty_blocks=True)
        alone = {k: v for k, v in by_speed.items() if not k.endswith("out_proj")}
        again = filter_shares(make(), size=3, shares=alone, empty_blocks=True)
        # A rank holding no heads needs empty_blocks (Llama's 2 groups: 3 ranks need it).
        with pytest.raises(ValueError, match=r"at least one (per rank|each)\W.*empty_blocks=T"):
            filter_shares(make(), size=3, shares=by_speed)
    assert back == by_speed and again == by_speed
    assert any(0 in v for v in by_speed.values())


def test_linear_subclasses_split_when_they_compute_what_linear_does():
    """An nn.Linear subclass is split like nn.Linear when its traced forward is nn.Linear's
    computation and it holds nothing else; otherwise it stays replicated."""
    from torch.nn.modules.linear import NonDynamicallyQuantizableLinear
    from transformers.models.falcon.modeling_falcon import FalconLinear

    from hetcoll.torch.filters.chains import computes_linear, linear_features

    class Doubled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    class WithBuffer(nn.Linear):
        def __init__(self) -> None:
            super().__init__(4, 3)
            self.register_buffer("scale", torch.ones(1))

    class Transposed(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight.t()  # ignores its bias

    same = [
        FalconLinear(4, 3),
        FalconLinear(4, 3, bias=False),
        NonDynamicallyQuantizableLinear(4, 3),
    ]
    other = [Doubled(4, 3), WithBuffer(), Transposed(4, 3), Transposed(4, 3, bias=False)]
    assert all(computes_linear(m) and linear_features(m) == (4, 3) for m in same)
    assert [computes_linear(m) for m in other] == [False, False, False, True]
    assert linear_features(other[0]) is None


@given(
    heads=st.integers(0, 8),
    head_dim=st.integers(1, 8),
    lead=st.lists(st.integers(1, 5), min_size=1, max_size=3),
    minus_one=st.booleans(),
)
def test_a_packing_is_read_as_its_reshape_says(heads, head_dim, lead, minus_one):
    """How an attention reads its packed query/key/value projection (the split's probe and
    the first-forward check): GPT-2-style blocks (``(..., 3, heads, d)``, ``(..., 3, heads *
    d)``) read as blocks, head by head (``(..., heads, 3, d)``, ``(..., heads, 3 * d)``) as
    heads, except where the two read alike (3 heads, spelled out): undecided."""
    from hetcoll.torch.filters.head_guards import packing_read

    packed = len(lead) + 1  # the projection's output: lead dims, then 3 x heads x head_dim
    h = -1 if minus_one else heads
    ambiguous = heads == 3 and not minus_one  # (3, 3, d): either reading
    blocked = [[*lead, 3, h, head_dim], [*lead, 3, -1 if minus_one else heads * head_dim]]
    by_head = [[*lead, h, 3, head_dim], [*lead, h, 3 * head_dim]]
    for shape in blocked:
        assert packing_read(shape, packed, heads, head_dim) == (None if ambiguous else "blocks")
    for shape in by_head:
        assert packing_read(shape, packed, heads, head_dim) == (None if ambiguous else "heads")
    assert packing_read([*lead, 3 * heads * head_dim], packed, heads, head_dim) is None


@given(
    shares=st.lists(st.integers(0, 4), min_size=1, max_size=4),
    layout=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), min_size=1, max_size=3),
)
def test_runs_with_whole_entries_cover_the_tensor_once_besides_them(shares, layout):
    """``split_runs`` with ``whole``: every split entry on exactly one rank, every whole entry
    on every rank, and ``whole_positions`` says where those sit in each rank's tensor."""
    from hetcoll.torch.filters.layers import split_runs, whole_positions

    blocks, whole = tuple(b for b, _ in layout), tuple(w for _, w in layout)
    total = sum(shares) * sum(blocks) + sum(whole)
    kept = set()  # the whole entries, by position in the full tensor
    start = 0
    for b, w in layout:
        start += sum(shares) * b
        kept.update(range(start, start + w))
        start += w
    seen = [0] * total
    for r in range(len(shares)):
        entries = [i for a, n in split_runs(shares, r, blocks, whole) for i in range(a, a + n)]
        for i in entries:
            seen[i] += 1
        mine = whole_positions(shares, r, blocks, whole)
        assert [entries[k] for k in mine] == sorted(kept)
        assert len(entries) == shares[r] * sum(blocks) + sum(whole)
    assert all(seen[i] == (len(shares) if i in kept else 1) for i in range(total))


def test_a_layer_keeping_whole_rows_checks_them():
    """Checked before any group is needed (Falcon's gloo cases run such layers)."""
    from hetcoll.torch.filters import FilterParallelLinear

    full = nn.Linear(8, 32)
    with pytest.raises(ValueError, match=r"whole: must be one integer >= 0 per block \(3\)"):
        FilterParallelLinear.from_module(
            full, [6], None, mode="split-output", blocks=(4, 0, 0), whole=(0, 4)
        )
    with pytest.raises(ValueError, match=r"blocks: must be integers >= 1"):
        FilterParallelLinear.from_module(full, [6], None, mode="split-output", blocks=(4, 0, 0))
    with pytest.raises(ValueError, match=r"do not divide out_features \(32\) less the 8 whole"):
        FilterParallelLinear.from_module(
            full, [6], None, mode="split-output", blocks=(5, 0, 0), whole=(0, 4, 4)
        )
    with pytest.raises(ValueError, match="only split-output layers split whole units"):
        FilterParallelLinear.from_module(full, [32], None, blocks=(4, 0, 0), whole=(0, 4, 4))


def test_swin_attentions_read_their_scales_and_bias_tables_at_the_ranks_heads():
    # Swin v2: logit_scale (heads x 1 x 1) and continuous_position_bias_mlp (an MLP of its
    # own, 2 -> 512 -> heads, on a constant table) stayed whole: "its parameter
    # 'logit_scale' (3, 1, 1) is neither of one head's size nor a number".
    from hetcoll.torch.filters import split_layout

    layout = split_layout(cases.swinv2())
    attentions = [ts for ts in layout.splits if ts.kind == "attention"]
    assert len(attentions) == 2 and not layout.kept
    for ts in attentions:
        assert ts.tables == [f"{ts.module}.continuous_position_bias_mlp"]
        assert ts.head_params == [f"{ts.module}.logit_scale"]
        assert ts.heads_with == ""  # each holds its own table: no heads handed over
        # The MLP's layers are no split's: whole on every rank, their gradients summed.
        assert not any(n.startswith(ts.tables[0]) for n in layout.modes)
        assert f"{ts.tables[0]}.0.weight" in ts.shared
    # Swin's: a child called without inputs, its output's heads its second dimension.
    layout = split_layout(cases.swin())
    attentions = [ts for ts in layout.splits if ts.kind == "attention"]
    assert len(attentions) == 2 and not layout.kept
    for ts in attentions:
        assert ts.tables == [f"{ts.module}.relative_position_bias"]
        assert ts.table_dims == {ts.tables[0]: 1}


def test_latent_attention_with_lora_splits_with_its_adapters():
    """PEFT's "all-linear" on DeepSeek-V3: the latent attention splits by heads with its
    wrapped projections (q_b_proj, kv_b_proj and o_proj split with their adapters, the wrapped
    latent projections whole on every rank ahead of them), as the performance model prices
    it; its experts, which PEFT wraps with LoRA on their parameters (``ParamWrapper``, one
    per parameter), split by hidden units with their adapters (they stayed whole: a slice met
    their adapters), and the cost model prices that split."""
    from hetcoll.model import layer_costs
    from hetcoll.torch.filters import split_layout

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # YaRN's settings in a tiny config
        model = cases._with_lora(cases.deepseek_v3(), "all-linear")
        layout = split_layout(model)
        costs = layer_costs(model, (7,), dtype=torch.int64)
        shares = filter_shares(model, size=3, speeds=[1.0, 0.5, 0.25])
    attn = "base_model.model.model.layers.1.self_attn."
    ts = next(ts for ts in layout.splits if ts.module == attn[:-1])
    assert ts.adapted == [attn + n for n in ("q_b_proj", "kv_b_proj", "o_proj")]
    assert ts.upstream == [
        attn + n for n in ("kv_a_proj_with_mqa", "q_a_proj", "q_a_layernorm", "kv_a_layernorm")
    ]
    # Named by the wrappers' paths, as the runtime names them.
    assert shares[attn + "o_proj"] == [8, 4, 4] and shares[attn + "q_b_proj"] == [16, 8, 8]
    experts = "base_model.model.model.layers.1.mlp.experts"
    assert layout.whole_experts == {}
    split = next(ts for ts in layout.splits if ts.kind == "experts")
    assert split.module == f"{experts}.base_layer.base_layer"
    # down_proj's A holds its hidden units (columns), gate_up_proj's B (rows); the other
    # factors whole on every rank, their gradients summed.
    assert split.param_adapters == {experts: "lora_A", f"{experts}.base_layer": "lora_B"}
    assert split.shared == [
        f"{experts}.lora_B.default.weight", f"{experts}.base_layer.lora_A.default.weight"
    ]  # fmt: skip
    assert any(b.kind == "experts" for b in costs.split_blocks)
    block = next(b for b in costs.split_blocks if b.module == attn[:-1])
    assert block.units == 4 and block.layers == tuple(ts.adapted), block
    assert attn + "kv_a_proj_with_mqa" in block.whole, block
