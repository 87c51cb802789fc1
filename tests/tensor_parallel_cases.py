"""Tensor-parallel cases (attention split by heads, MLPs by hidden units) that run inside every
rank of a real gloo job: Hugging Face Llama (grouped-query attention, rotary embeddings, a
gated MLP) and GPT-2 (``Conv1D``, query/key/value packed in ``c_attn``), built from configs
with eager attention, split by :func:`hetcoll.torch.filter_parallel` at uneven speeds and
trained beside the unsplit model in float64: logits, loss, every gradient, the parameters after
SGD-momentum and Adam steps agree to 1e-10 relative; the gathered state dict has the unsplit
model's keys; a checkpoint loads into another split; the bytes moved per step are counted.
"""

from __future__ import annotations

import contextlib
import copy
import re
import warnings
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from hetcoll import CollectiveMismatchError
from hetcoll.collectives import allreduce
from hetcoll.comm import agree, wrap
from hetcoll.torch import (
    filter_parallel,
    gather_gradients,
    gather_state_dict,
    split_traffic,
)
from hetcoll.torch.filters import (
    FilterParallelDoRA,
    FilterParallelEmbedding,
    FilterParallelExperts,
    FilterParallelLayer,
    FilterParallelRMSNorm,
    filter_shares,
    gather_optimizer_state_dict,
    load_full_optimizer_state_dict,
    load_full_state_dict,
)
from hetcoll.torch.transport import CountingCommunicator

from lm_common import PLAIN, hf_falcon, hf_gpt2, hf_llama, hf_mixtral, hf_t5

TOL = 1e-10
VOCAB = 40
SEQ = 7
SPEEDS = [1.0, 0.5, 0.25, 0.75]
#: Uneven speeds for :func:`llama_gqa` and :func:`qwen2`: their 2 key/value groups split 1 : 1
#: on 2 ranks, and are too few for 3, where they split by query head.
GQA_SPEEDS = [1.0, 0.25, 0.25]


def llama(kv_heads: int = 3) -> nn.Module:
    return hf_llama(
        vocab=VOCAB, hidden=24, intermediate=40, layers=2, heads=6, kv_heads=kv_heads, positions=32
    )


def llama_mqa() -> nn.Module:
    """:func:`llama` under multi-query attention: one key/value head, which every rank holds
    and computes whole (its gradient summed over the ranks), its 6 query heads split one by
    one."""
    return llama(kv_heads=1)


def llama_gqa() -> nn.Module:
    """:func:`llama` with 2 key/value groups of 3 query heads: too few for 3 ranks, so it
    splits by query head there, its key and value whole on every rank."""
    return llama(kv_heads=2)


def one_head() -> nn.Module:
    """:func:`llama` with one attention head (of 24 features): one unit to split."""
    return hf_llama(
        vocab=VOCAB, hidden=24, intermediate=40, layers=2, heads=1, kv_heads=1, positions=32
    )


def cached_llama() -> nn.Module:
    """:func:`llama` with Hugging Face's default ``use_cache=True``: its forward hands every
    attention a key/value cache, which the probe of whether a rank holding no heads runs
    (at the first forward) must neither read nor grow."""
    model = llama()
    model.config.use_cache = True
    return model


def gpt2() -> nn.Module:
    return hf_gpt2(vocab=VOCAB, hidden=24, layers=2, heads=6, positions=32)


def _hf(model: str, config: str, **kw: Any) -> nn.Module:
    import transformers

    settings = {
        "vocab_size": VOCAB, "hidden_size": 24, "intermediate_size": 40, "num_hidden_layers": 2,
        "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 4,
        "max_position_embeddings": 32, "use_cache": False, "attn_implementation": "eager",
        "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0,
    }  # fmt: skip
    cfg = getattr(transformers, config)(**{**settings, **kw})
    return getattr(transformers, model)(cfg)


def qwen2() -> nn.Module:
    """Hugging Face Qwen2 in Qwen2-0.5B's layout: 14 query heads in 2 key/value groups of 7
    (too few for 3 ranks: split by query head there), biases on the query, key and
    value projections (the whole key and value's summed over the ranks)."""
    return _hf(
        "Qwen2ForCausalLM", "Qwen2Config", num_attention_heads=14, num_key_value_heads=2,
        hidden_size=56,
    )  # fmt: skip


def stablelm_head_norms(kv_heads: int = 3) -> nn.Module:
    """Hugging Face StableLM with ``qk_layernorm`` (stablelm-2-12b's layout): a LayerNorm for
    each query head and each key/value head (of ``kv_heads``), in lists its forward zips with
    the heads it is given."""
    return _hf(
        "StableLmForCausalLM", "StableLmConfig", qk_layernorm=True, use_parallel_residual=True,
        num_key_value_heads=kv_heads,
    )  # fmt: skip


def _cohere_in_its_dtype() -> None:
    """Hugging Face's Cohere computes its LayerNorms and its rotary embedding in float32
    whatever the model's dtype; in these cases (worker processes) both run in the model's
    dtype, the same formulas, so a float64 split is checked against the unsplit model at
    1e-10, not at float32's rounding."""
    import transformers.models.cohere.modeling_cohere as cohere

    def norm(self: Any, x: torch.Tensor) -> torch.Tensor:
        centred = x - x.mean(-1, keepdim=True)
        variance = centred.pow(2).mean(-1, keepdim=True)
        return self.weight * (centred * torch.rsqrt(variance + self.variance_epsilon))

    def rotary(q: Any, k: Any, cos: Any, sin: Any, unsqueeze_dim: int = 1) -> Any:
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        turn = cohere.rotate_half
        return q * cos + turn(q) * sin, k * cos + turn(k) * sin

    cohere.CohereLayerNorm.forward = norm
    cohere.apply_rotary_pos_emb = rotary


def cohere(kv_heads: int = 2) -> nn.Module:
    """Hugging Face Cohere with ``use_qk_norm`` (Command R+'s layout): a LayerNorm weight of
    a row per query head (``q_norm``, heads x head size) and per key/value head (``k_norm``),
    random so that a rank meeting another head's row would show; 2 key/value groups (by group
    on 2 ranks, by query head on 3, each query head's key row gathered), or 1 (multi-query:
    the key's row whole on every rank)."""
    _cohere_in_its_dtype()
    model = _hf("CohereForCausalLM", "CohereConfig", use_qk_norm=True, num_key_value_heads=kv_heads)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    return model


def electra() -> nn.Module:
    """Hugging Face ELECTRA's generator: embeddings narrower than the hidden states, so
    ``embeddings_project`` (and ``generator_predictions.dense``) are split layers inside the
    network gathering their outputs, which ``loss_parallel=True`` keeps split until the next
    layer reads them whole; its head tied to its token embedding."""
    return _masked_lm("ElectraForMaskedLM", "ElectraConfig")


def _masked_lm(model: str, config: str) -> nn.Module:
    """A BERT-family masked language model of Hugging Face's (``model`` and ``config`` by
    class name): embeddings of 16 features under 24 hidden, 2 layers of 6 heads."""
    import transformers

    cfg = getattr(transformers, config)(
        vocab_size=VOCAB, embedding_size=16, hidden_size=24, num_hidden_layers=2,
        num_attention_heads=6, intermediate_size=40, max_position_embeddings=32,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **PLAIN,
    )  # fmt: skip
    return getattr(transformers, model)(cfg)


def albert() -> nn.Module:
    """Hugging Face ALBERT: one layer shared by its 2 layers (called twice per forward), its
    attention's output projection followed by a norm of the residual sum inside the
    attention module (``LayerNorm``: it runs on the whole output, so the heads split)."""
    return _masked_lm("AlbertForMaskedLM", "AlbertConfig")


def mpnet() -> nn.Module:
    """Hugging Face MPNet: its relative-position bias (one embedding of a column per head, at
    the encoder, its output handed to every layer's attention) is learned outside the split
    attentions."""
    return _masked_lm("MPNetForMaskedLM", "MPNetConfig")


class ImageOnIds(nn.Module):
    """A Hugging Face image classifier (``classifier``, of ``SEQ * VOCAB`` classes) run on a
    ``size`` x ``size`` image made of the token ids (a fixed projection), its classes read as
    a logit per token: :func:`loss_of`'s language-model loss."""

    def __init__(self, classifier: nn.Module, size: int) -> None:
        super().__init__()
        self.classifier, self.size = classifier, size
        self.register_buffer("pixels", torch.randn(SEQ * VOCAB, 3 * size * size))

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        onehot = nn.functional.one_hot(input_ids, VOCAB).to(self.pixels.dtype).flatten(1)
        image = (onehot @ self.pixels).reshape(len(input_ids), 3, self.size, self.size)
        logits = self.classifier(pixel_values=image).logits
        return SimpleNamespace(logits=logits.reshape(len(input_ids), SEQ, VOCAB))


def beit() -> nn.Module:
    """Hugging Face BEiT: a relative-position bias table of a column per head in each layer,
    outside its attention, its output handed to the attention as its mask."""
    import transformers

    cfg = transformers.BeitConfig(
        hidden_size=24, num_hidden_layers=2, num_attention_heads=6, intermediate_size=40,
        image_size=14, patch_size=7, num_channels=3, use_relative_position_bias=True,
        use_mean_pooling=True, layer_scale_init_value=0.1, drop_path_rate=0.0,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=SEQ * VOCAB,
        attn_implementation="eager",
    )  # fmt: skip
    return ImageOnIds(transformers.BeitForImageClassification(cfg), 14)


def swin() -> nn.Module:
    """Hugging Face Swin: each attention adds a bias per head from a table of a column per
    head, looked up at the window's positions by a child module called without inputs
    (``relative_position_bias``: 1 x heads x window x window)."""
    import transformers

    cfg = transformers.SwinConfig(
        image_size=16, patch_size=2, num_channels=3, embed_dim=12, depths=[1, 1],
        num_heads=[3, 6], window_size=4, drop_path_rate=0.0, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=SEQ * VOCAB, attn_implementation="eager",
    )  # fmt: skip
    return ImageOnIds(transformers.SwinForImageClassification(cfg), 16)


def swinv2() -> nn.Module:
    """Hugging Face Swin v2: each attention scales its cosine scores by a learned number per
    head (``logit_scale``, heads x 1 x 1) and adds a bias per head made by an MLP of its own
    on a constant table of coordinates (``continuous_position_bias_mlp``: 2 -> 512 -> heads)."""
    import transformers

    cfg = transformers.Swinv2Config(
        image_size=16, patch_size=2, num_channels=3, embed_dim=12, depths=[1, 1],
        num_heads=[3, 6], window_size=4, drop_path_rate=0.0, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=SEQ * VOCAB,
    )  # fmt: skip
    return ImageOnIds(transformers.Swinv2ForImageClassification(cfg), 16)


def mamba() -> nn.Module:
    """Hugging Face Mamba: no attention; its mixer's forward, which torch.fx cannot trace,
    reads ``self.dt_proj.weight`` itself (and, on its fused kernels' path, ``x_proj``'s and
    ``out_proj``'s): those stay whole, its ``in_proj`` splits (gathering its output)."""
    import transformers

    config = transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=24, state_size=8, num_hidden_layers=2, expand=2,
        conv_kernel=4, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.MambaForCausalLM(config)


def dbrx() -> nn.Module:
    """Hugging Face DBRX: query, key and value packed in three blocks (``Wqkv``, Phi-3's
    layout, 3 key/value groups of 2 query heads), clamped (``clip_qkv``) before they are cut
    apart at its ``hidden_size`` (the query heads' width: a rank's own); its experts,
    stacked in 2-D weights (``mlp.w1``: experts x hidden units by features), split by hidden
    units (20: not in steps of 8, so by speed)."""
    import transformers

    config = transformers.DbrxConfig(
        d_model=24, n_heads=6, n_layers=2, max_seq_len=32, vocab_size=VOCAB,
        attn_config={"kv_n_heads": 3, "clip_qkv": 8.0, "rope_theta": 10000.0},
        ffn_config={"ffn_hidden_size": 20, "moe_num_experts": 4, "moe_top_k": 2},
        resid_pdrop=0.0, emb_pdrop=0.0, **PLAIN,
    )  # fmt: skip
    return transformers.DbrxForCausalLM(config)


def mpt() -> nn.Module:
    """Hugging Face MPT with ALiBi: ``position_bias`` of ``(heads, 1, keys)``, computed
    outside the attention, given to each block. 3 heads: as many as the test batch's rows."""
    import transformers

    config = transformers.MptConfig(
        vocab_size=VOCAB, d_model=24, n_heads=3, n_layers=2, expansion_ratio=2,
        max_seq_len=32, resid_pdrop=0.0, emb_pdrop=0.0,
        attn_config={"attn_pdrop": 0, "alibi": True}, **PLAIN,
    )  # fmt: skip
    return transformers.MptForCausalLM(config)


def codegen() -> nn.Module:
    """Hugging Face CodeGen: its qkv_proj packs four blocks of heads (``mp_num``), each its
    heads' query, value and key, which its forward reads by reshaping to ``(..., 4, -1)``."""
    import transformers

    config = transformers.CodeGenConfig(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=16, rotary_dim=2, n_positions=32,
        n_ctx=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
    )  # fmt: skip
    return transformers.CodeGenForCausalLM(config)


def mixtral(implementation: str = "eager") -> nn.Module:
    """Hugging Face Mixtral: 4 experts of 40 hidden units (5 steps of 8) in each block, 2 per
    token, run by ``implementation``."""
    return hf_mixtral(
        vocab=VOCAB, hidden=16, layers=2, heads=4, kv_heads=2, experts=4, intermediate=40,
        implementation=implementation,
    )  # fmt: skip


def qwen2_moe() -> nn.Module:
    """Hugging Face Qwen2-MoE: routed experts beside a shared expert (a gated MLP, split by
    hidden units as Llama's) scaled by a gate of one output (replicated)."""
    return _hf(
        "Qwen2MoeForCausalLM", "Qwen2MoeConfig", moe_intermediate_size=32,
        shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
        experts_implementation="eager",
    )  # fmt: skip


def gpt_oss() -> nn.Module:
    """Hugging Face GPT-OSS: experts with biases, their gate and up rows interleaved and their
    weights transposed, a clamped gate; an attention with a learned sink per query head (as
    many heads as a head's features, 4; in 2 key/value groups, so by query head on 3 ranks),
    read at the rank's heads."""
    return _hf(
        "GptOssForCausalLM", "GptOssConfig", num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        experts_implementation="eager",
    )  # fmt: skip


def deepseek_v3(q_lora: int | None = 8, dense: int = 1) -> nn.Module:
    """Hugging Face DeepSeek-V3: multi-head latent attention (keys and values expanded per
    head from a latent of 8, queries from their own latent of ``q_lora``, or from ``q_proj``
    with None, as DeepSeek-V2-Lite's), ``dense`` dense first blocks (of 2), then routed
    experts of 32 hidden units beside a shared expert."""
    return _hf(
        "DeepseekV3ForCausalLM", "DeepseekV3Config", num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=q_lora, kv_lora_rank=8, qk_nope_head_dim=4,
        qk_rope_head_dim=4, v_head_dim=4, moe_intermediate_size=32, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        first_k_dense_replace=dense, experts_implementation="eager",
    )  # fmt: skip


def olmo2() -> nn.Module:
    """Hugging Face OLMo 2: an RMS norm over all query heads' features (``q_norm``) and one
    over all key heads' (``k_norm``), split with their projections, each rank's sum of
    squares summed with the others'."""
    return _hf("Olmo2ForCausalLM", "Olmo2Config")


def olmoe() -> nn.Module:
    """Hugging Face OLMoE: OLMo 2's attention norms beside a mixture of 4 experts of 32 hidden
    units."""
    return _hf(
        "OlmoeForCausalLM", "OlmoeConfig", intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, experts_implementation="eager",
    )  # fmt: skip


def qwen3() -> nn.Module:
    """Hugging Face Qwen3: a norm over the head dimension on each query and key head
    (``q_norm``, ``k_norm``), one weight shared by every head: each rank's gradient of it is
    its own heads' part."""
    return _hf("Qwen3ForCausalLM", "Qwen3Config")


def gemma() -> nn.Module:
    """Hugging Face Gemma: a gated MLP whose activation is ``F.gelu(x, approximate="tanh")``
    (an option's name among the elementwise op's arguments), its head tied to the embedding."""
    return _hf("GemmaForCausalLM", "GemmaConfig", hidden_activation="gelu_pytorch_tanh")


def neox() -> nn.Module:
    """Hugging Face GPT-NeoX (Pythia's architecture): query, key and value packed head by head
    in ``query_key_value`` (viewed as ``(..., -1, 3 * head_size)``), its head size in
    ``head_size`` and its head count in its config alone; partial rotary embeddings."""
    import transformers

    cfg = transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=6, max_position_embeddings=32, hidden_dropout=0.0,
        attention_dropout=0.0, use_cache=False, attn_implementation="eager", bos_token_id=0,
        eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.GPTNeoXForCausalLM(cfg)


def falcon() -> nn.Module:
    """Hugging Face Falcon: its projections are ``FalconLinear``, an ``nn.Linear`` subclass
    computing ``x @ weight.T + bias`` itself; multi-query attention packed in one projection
    (q heads then one k and one v head: Falcon-7B's), its head tied to the embedding."""
    return hf_falcon(vocab=VOCAB, hidden=24, layers=2, heads=6)


def bigcode() -> nn.Module:
    """Hugging Face GPT-BigCode (StarCoder's and SantaCoder's architecture): multi-query
    attention packed in ``c_attn`` (the query heads, one key and one value head), read as
    ``c_attn(x).unsqueeze(1).split((embed_dim, kv_dim, kv_dim), dim=3)``."""
    import transformers

    cfg = transformers.GPTBigCodeConfig(
        vocab_size=VOCAB, n_embd=24, n_layer=2, n_head=6, n_positions=32, multi_query=True,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **PLAIN,
    )  # fmt: skip
    return transformers.GPTBigCodeForCausalLM(cfg)


def falcon_gqa() -> nn.Module:
    """Hugging Face Falcon's new decoder architecture (Falcon-40B's): grouped-query attention
    (6 query heads in 3 key/value groups) packed group by group in ``query_key_value``, viewed
    as ``(batch, seq, -1, num_heads // num_kv_heads + 2, head_dim)``: a rank holding no group
    would divide by zero there."""
    import transformers

    cfg = transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, num_attention_heads=6,
        num_kv_heads=3, new_decoder_architecture=True, hidden_dropout=0.0,
        attention_dropout=0.0, use_cache=False, attn_implementation="eager", bos_token_id=0,
        eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.FalconForCausalLM(cfg)


def bloom() -> nn.Module:
    """Hugging Face BLOOM: its attention adds ``alibi``, a bias of ``batch x heads`` rows
    computed for every head outside it (cut to the rank's heads); query, key and value packed
    head by head."""
    import transformers

    cfg = transformers.BloomConfig(
        vocab_size=VOCAB, hidden_size=24, n_layer=2, n_head=6, hidden_dropout=0.0,
        attention_dropout=0.0, use_cache=False, attn_implementation="eager", bos_token_id=0,
        eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.BloomForCausalLM(cfg)


class T5LM(nn.Module):
    """Hugging Face T5 (an encoder-decoder) as a model of ids: the encoder and the decoder
    each read the ids. The first self-attention of each stack holds the relative position
    bias of every head (an embedding, a column per head) and hands the bias it computes to
    the other attentions of its stack: each rank reads its heads' columns, and every T5
    attention holds the same heads."""

    def __init__(self) -> None:
        super().__init__()
        self.t5 = hf_t5(vocab=VOCAB, hidden=24, kv=4, ff=40, layers=2, heads=6)

    def forward(self, input_ids: torch.Tensor) -> Any:
        return self.t5(input_ids=input_ids, decoder_input_ids=input_ids)


def opt() -> nn.Module:
    """Hugging Face OPT: its MLP is no module of its own, ``fc1`` and ``fc2`` are layers of
    the decoder layer, whose forward sits behind Hugging Face's ``(*args, **kwargs)``
    checkpointing wrapper; biased q/k/v/out projections; its head tied to the embedding."""
    import transformers

    cfg = transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=24, ffn_dim=40, num_hidden_layers=2,
        num_attention_heads=6, word_embed_proj_dim=24, max_position_embeddings=32,
        dropout=0.0, attention_dropout=0.0, use_cache=False, attn_implementation="eager",
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.OPTForCausalLM(cfg)


def bert() -> nn.Module:
    """Hugging Face BERT: its attention module holds query, key and value alone, the output
    projection is a sibling's (``attention.output.dense``), and its MLP spans two sibling
    modules (``intermediate.dense``, then ``output.dense``); post-norm, tied decoder."""
    import transformers

    cfg = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, num_attention_heads=6,
        intermediate_size=40, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="eager", pad_token_id=0,
    )  # fmt: skip
    return transformers.BertForMaskedLM(cfg)


class EncoderLM(nn.Module):
    """A user's language model around torch's encoder layers (``nn.MultiheadAttention`` with
    its packed ``in_proj_weight``; ReLU feed-forward), a causal and a padding mask."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 24)
        layer = nn.TransformerEncoderLayer(24, 6, 40, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(24, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> Any:
        n = input_ids.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(n, dtype=torch.float64)
        pad = input_ids == 1  # token 1 stands for padding
        h = self.encoder(self.embed(input_ids), mask=causal, src_key_padding_mask=pad)
        return SimpleNamespace(logits=self.head(h))


class _OldStyleAttention(nn.Module):
    """Separate q/k/v/o, reshaped as OPT's and many older attentions are: ``view(batch, -1,
    heads, head_dim)``, and back with ``reshape(batch, seq, -1)`` - on a rank holding no heads
    both are reshapes of empty tensors with an ambiguous ``-1``. With ``packed``, query, key
    and value come from one projection packed head by head (BLOOM's layout)."""

    def __init__(self, packed: bool = False) -> None:
        super().__init__()
        self.num_heads, self.head_dim = 6, 4
        if packed:
            self.qkv = nn.Linear(24, 72)
        else:
            # No key bias: its gradient is rounding noise (a shift of every score of a query).
            self.q, self.v = nn.Linear(24, 24), nn.Linear(24, 24)
            self.k = nn.Linear(24, 24, bias=False)
        self.o = nn.Linear(24, 24)
        self.packed = packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        if self.packed:
            q, k, v = self.qkv(x).view(b, n, self.num_heads, 3, self.head_dim).unbind(3)
        else:
            q, k, v = (
                f(x).view(b, -1, self.num_heads, self.head_dim) for f in (self.q, self.k, self.v)
            )
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) / 2.0, dim=-1) @ v
        return self.o(att.transpose(1, 2).reshape(b, n, -1))


class _GroupedPacked(nn.Module):
    """Grouped-query attention (6 query heads in 3 key/value groups of 4) with query, key and
    value packed group by group in one projection, each group's 2 query heads, key head and
    value head together: InternLM2's ``wqkv``, viewed as ``(batch, seq, -1, 2 + 2, head)``."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = 6, 3, 4
        self.wqkv = nn.Linear(24, 48, bias=False)
        self.wo = nn.Linear(24, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        qkv = self.wqkv(x).view(b, n, -1, 4, self.head_dim)
        q = qkv[..., :2, :].reshape(b, n, -1, self.head_dim).transpose(1, 2)
        k, v = (qkv[..., i, :].repeat_interleave(2, dim=2).transpose(1, 2) for i in (2, 3))
        att = torch.softmax(q @ k.transpose(-1, -2) / 2.0, dim=-1) @ v
        return self.wo(att.transpose(1, 2).reshape(b, n, -1))


def grouped_lm() -> nn.Module:
    """:class:`ResidualLM` of :class:`_GroupedPacked` blocks."""
    return ResidualLM(_GroupedPacked)


def phi3() -> nn.Module:
    """Hugging Face Phi-3: query, key and value packed in ``qkv_proj`` under grouped-query
    attention (cut where the query heads end, at ``self.config.num_attention_heads *
    head_dim``: read from the config shared by every layer), registered after ``o_proj``;
    gate and up packed in ``gate_up_proj``."""
    return _hf("Phi3ForCausalLM", "Phi3Config")


class ResidualLM(nn.Module):
    """Two residual blocks made by ``block`` between an embedding and a head; with ``keep``,
    each block is also given a tensor of ones (a block that needs a second input)."""

    def __init__(self, block: Any, keep: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 24)
        self.blocks = nn.ModuleList(block() for _ in range(2))
        self.head = nn.Linear(24, VOCAB)
        self.keep = keep

    def forward(self, input_ids: torch.Tensor) -> Any:
        h = self.embed(input_ids)
        ones = h.new_ones(*h.shape[:2], 1)
        for block in self.blocks:
            h = h + (block(h, ones) if self.keep else block(h))
        return SimpleNamespace(logits=self.head(h))


def old_style_lm(packed: bool = False) -> nn.Module:
    """:class:`ResidualLM` of :class:`_OldStyleAttention` blocks."""
    return ResidualLM(lambda: _OldStyleAttention(packed))


class _KeptAttention(_OldStyleAttention):
    """:class:`_OldStyleAttention` packed head by head, scaling its input by a second input
    it requires: a forward of the attention alone on one token cannot run."""

    def __init__(self) -> None:
        super().__init__(packed=True)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x * keep)


def kept_lm() -> nn.Module:
    """:class:`ResidualLM` of :class:`_KeptAttention` blocks."""
    return ResidualLM(_KeptAttention, keep=True)


class _GateUp(nn.Module):
    """A gated MLP whose gate and up projections are one packed layer (Phi-3's
    ``gate_up_proj``), cut in two along its features."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Linear(24, 80)
        self.down = nn.Linear(40, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(nn.functional.silu(gate) * up)


def gate_up_lm() -> nn.Module:
    """:class:`ResidualLM` of :class:`_GateUp` blocks."""
    return ResidualLM(_GateUp)


def attention_weights(group: Any) -> int:
    """A bare ``nn.MultiheadAttention`` (sequence first, cross-attention, a 3-D mask per head)
    returns the same output and attention weights split as whole, averaged or per head."""
    p = wrap(group).size
    torch.manual_seed(3)
    ref = nn.MultiheadAttention(12, 6, dtype=torch.float64)
    q = torch.randn(5, 2, 12, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(4, 2, 12, dtype=torch.float64, requires_grad=True)
    mask = torch.randn(2 * 6, 5, 4, dtype=torch.float64)
    model = nn.Sequential()
    model.add_module("mha", copy.deepcopy(ref))
    split = filter_parallel(model, group=group, speeds=SPEEDS[:p]).mha
    checked = 0
    for average in (True, False):
        want, want_w = ref(q, kv, kv, attn_mask=mask, average_attn_weights=average)
        got, got_w = split(q, kv, kv, attn_mask=mask, average_attn_weights=average)
        close(got, want, "mha output")
        close(got_w, want_w, "mha weights")
        gq, gkv = torch.autograd.grad(want.sum(), (q, kv))
        sq, skv = torch.autograd.grad(got.sum(), (q, kv))
        close(sq, gq, "mha query gradient")
        close(skv, gkv, "mha key/value gradient")
        checked += 1
    return checked


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / max(float(b.abs().max()), 1e-30))


#: Separate key projections' biases (BERT's, OPT's, MPNet's; in PEFT's wrapper too): see
#: :func:`close`.
KEY_BIASES = (
    "key.bias", "k_proj.bias", "attn.k.bias", "key.base_layer.bias", "k_proj.base_layer.bias"
)  # fmt: skip


#: The tolerance :func:`close` holds to (:func:`tolerance` widens it for a model computing
#: some of its float64 steps in float32).
_tol = [TOL]


@contextlib.contextmanager
def tolerance(tol: float) -> Iterator[None]:
    """:func:`close` at ``tol`` inside: a mixture of experts' router takes its softmax in
    float32 whatever the model's dtype (Hugging Face's), so its float64 results agree to
    about 1e-9, not 1e-10."""
    _tol.append(tol)
    try:
        yield
    finally:
        _tol.pop()


def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape, (what, tuple(a.shape), tuple(b.shape))
    tol = _tol[-1]
    if what.endswith(KEY_BIASES):
        # A key bias moves no attention score (softmax ignores a shift per query): its
        # gradient is rounding noise (~1e-18), and so are the updates from it, which differ
        # between any two summation orders: bounded absolutely, far below any real gradient.
        assert float((a - b).abs().max()) <= tol, (what, float((a - b).abs().max()))
        return
    if what.endswith("in_proj_bias") and "gradient" not in what:
        # The key bias (the middle third) moves no attention score (softmax ignores a shift
        # per query): its gradient is rounding noise (~1e-18), which Adam scales to updates of
        # ~1e-12 that differ between any two summation orders. Compare query and value biases.
        a, b = torch.cat([a.chunk(3)[0], a.chunk(3)[2]]), torch.cat([b.chunk(3)[0], b.chunk(3)[2]])
    assert rel(a, b) <= tol, (what, rel(a, b))


def batch(step: int, rows: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(1, VOCAB, (rows, SEQ), generator=g)


def loss_of(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=ids).logits
    loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    return logits, loss


def split_copy(
    ref: nn.Module,
    group: Any,
    speeds: list[float],
    empty_blocks: bool = False,
    by_shares: bool = False,
) -> nn.Module:
    """``ref`` split at ``speeds``; with ``by_shares`` through the per-layer shares
    ``filter_shares`` gives for them (the same split, by explicit shares)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if by_shares:
            shares = filter_shares(ref, size=len(speeds), speeds=speeds, empty_blocks=empty_blocks)
            split = filter_parallel(
                copy.deepcopy(ref), group=group, shares=shares, empty_blocks=empty_blocks
            )
        else:
            split = filter_parallel(
                copy.deepcopy(ref), group=group, speeds=speeds, empty_blocks=empty_blocks
            )
    unsplit = [str(w.message) for w in seen if "left unsplit by heads" in str(w.message)]
    assert not unsplit, unsplit
    return split


def modes(model: nn.Module) -> dict[str, str]:
    return {n: m.mode for n, m in model.named_modules() if isinstance(m, FilterParallelLayer)}


def same_state(split: nn.Module, ref: nn.Module, what: str) -> dict[str, torch.Tensor]:
    """The split model's gathered state dict: the unsplit model's keys, in its order, and
    values; returned."""
    full = gather_state_dict(split, dst=None)
    want = ref.state_dict()
    assert full is not None and list(full) == list(want), list(full or {})[:6]
    for n, t in want.items():
        close(full[n], t, f"{what}: {n}")
    return full


def equals_unsplit(
    group: Any,
    make: Any,
    optimizer: str,
    steps: int = 3,
    speeds: list[float] | None = None,
    empty: bool | None = None,
) -> nn.Module:
    """Train the split and the unsplit model side by side; return the split (its
    :func:`modes`, its shares, and the traffic it counts for itself are read from it: a second
    split at the same speeds would only repeat the analysis). With ``speeds`` (default:
    :data:`SPEEDS`), split with ``empty_blocks=True`` (or ``empty``), so a slow rank may hold
    none of a block's heads or units."""
    p = wrap(group).size
    empty = speeds is not None if empty is None else empty
    speeds = SPEEDS[:p] if speeds is None else speeds
    torch.manual_seed(0)
    ref = make().double()
    split = split_copy(ref, group, speeds, empty)

    def opt_of(m: nn.Module) -> torch.optim.Optimizer:
        if optimizer == "sgd":
            return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.Adam(m.parameters(), lr=1e-2)

    opt_ref, opt_split = opt_of(ref), opt_of(split)
    for step in range(steps):
        ids = batch(step)
        logits_ref, loss_ref = loss_of(ref, ids)
        logits, loss = loss_of(split, ids)
        close(logits, logits_ref, f"step {step}: logits")
        close(loss, loss_ref, f"step {step}: loss")
        loss_ref.backward()
        loss.backward()
        grads = gather_gradients(split, dst=None)
        want = {n: q.grad for n, q in ref.named_parameters() if q.grad is not None}
        assert grads is not None and set(grads) == set(want), sorted(set(grads) ^ set(want))
        for n, g in want.items():
            close(grads[n], g, f"step {step}: gradient of {n}")
        opt_ref.step()
        opt_split.step()
        opt_ref.zero_grad()
        opt_split.zero_grad()
    full = same_state(split, ref, f"after {steps} steps")

    # A checkpoint resumes on another split (the speeds reversed; with empty_blocks given as
    # per-layer shares): model and optimizer state.
    opt_full = gather_optimizer_state_dict(split, opt_split, dst=None)
    other = split_copy(make().double(), group, speeds[::-1], empty, by_shares=empty)
    load_full_state_dict(other, full)
    opt_other = opt_of(other)
    assert opt_full is not None
    load_full_optimizer_state_dict(other, opt_other, opt_full)
    ids = batch(steps)
    _, loss_ref = loss_of(ref, ids)
    _, loss = loss_of(other, ids)
    close(loss, loss_ref, "resumed loss")
    loss_ref.backward()
    loss.backward()
    opt_ref.step()
    opt_other.step()
    same_state(other, ref, "resumed step")
    return split


def gqa_heads_by_shares(group: Any) -> list[int]:
    """Grouped-query attention split by query head through per-layer shares naming its query
    and output projections alone (``filter_shares``' form of that split), the last rank
    holding no query head (``empty_blocks``) but computing the whole key and value: loss and
    every gradient equal the unsplit model's. Returns the first attention's heads per rank."""
    p = wrap(group).size
    torch.manual_seed(0)
    ref = llama_gqa().double()
    heads = [6 - (p - 2)] + [1] * (p - 2) + [0]
    shares: dict[str, list[int]] = {}
    for name, _ in ref.named_modules():
        if name.endswith(("q_proj", "o_proj")):
            shares[name] = [4 * h for h in heads]
        elif name.endswith(("gate_proj", "up_proj", "down_proj")):
            shares[name] = [40 - 4 * (p - 1)] + [4] * (p - 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        split = filter_parallel(copy.deepcopy(ref), group=group, shares=shares, empty_blocks=True)
    one_step_equal(split, ref, batch(0), "")
    return list(split.get_submodule("model.layers.0.self_attn.q_proj").shares)


def one_step_equal(split: nn.Module, ref: nn.Module, ids: torch.Tensor, what: str) -> None:
    """One forward and backward of ``split`` on ``ids`` gives the unsplit ``ref``'s logits and
    every gradient (gathered); ``what`` prefixes the failures' names."""
    logits_ref, loss_ref = loss_of(ref, ids)
    logits, loss = loss_of(split, ids)
    close(logits, logits_ref, f"{what}logits")
    loss_ref.backward()
    loss.backward()
    grads = gather_gradients(split, dst=None)
    assert grads is not None
    for n, q in ref.named_parameters():
        assert q.grad is not None
        close(grads[n], q.grad, f"{what}gradient of {n}")


def empty_blocks(group: Any) -> dict[str, list[int]]:
    """A rank too slow for a whole key/value group (``empty_blocks=True``) holds no heads of
    each attention and few MLP units, runs its blocks on empty tensors and joins their
    reductions: training, gathered state and a checkpoint resumed on the reversed split all
    equal the unsplit model, for every layout. Returns each model's first attention's shares."""
    p = wrap(group).size
    speeds = [1.0, 0.1, 0.5, 0.75][:p]
    shares: dict[str, list[int]] = {}
    models = (
        ("llama", llama),
        ("llama_cached", cached_llama),
        ("llama_mqa", llama_mqa),
        ("falcon", falcon),
        ("gpt2", gpt2),
        ("encoder", EncoderLM),
        ("old", old_style_lm),
        ("neox", neox),
        ("t5", T5LM),
        ("cohere", lambda: cohere(kv_heads=3)),
    )
    for name, make in models:
        split = equals_unsplit(group, make, "adam", steps=2, speeds=speeds)
        traffic(group, make, 24, speeds, own=split)
        first = next(
            m for m in split.modules() if isinstance(m, FilterParallelLayer) and m.mode != "gather"
        )
        shares[name] = list(first.shares)
    return shares


def time_balanced(group: Any) -> dict[str, list[int]]:
    """``sample=`` balances each split by time: the work every rank repeats around the splits
    (norms, embeddings) counts at each rank's speed, so no rank holds more of a block than by
    speed alone; the split is the same on every rank (the ranks' mean timings) and trains
    like the unsplit model. Returns Llama's first MLP's shares, timed and by speed alone."""
    p = wrap(group).size
    torch.manual_seed(0)
    ref = llama().double()
    ids = batch(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        split = filter_parallel(
            copy.deepcopy(ref),
            group=group,
            speeds=SPEEDS[:p],
            empty_blocks=True,
            sample={"input_ids": ids},
        )
        plain = filter_shares(copy.deepcopy(ref), size=p, speeds=SPEEDS[:p], empty_blocks=True)
    one_step_equal(split, ref, ids, "time-balanced ")
    mlp = "model.layers.0.mlp.down_proj"
    timed = list(dict(split.named_modules())[mlp].shares)
    return {"timed": timed, "by speed": plain[mlp]}


def experts(group: Any) -> dict[str, Any]:
    """Mixtures of experts split by each expert's hidden units (with their attentions by heads,
    a shared expert by hidden units) train as the unsplit model, resume on another split, and
    hold the hidden units their speeds give: Mixtral by its eager loop and by batched_mm in
    float64, GPT-OSS's biased, interleaved and transposed experts, Qwen2-MoE's shared expert,
    DeepSeek-V3's beside its latent attention (split by heads, V2-Lite's layout too), OLMoE's
    beside an attention normalised over all its heads (split with them); Mixtral
    by Hugging Face's default kernel, grouped_mm (float32 alone), to 1e-5. Returns each
    model's experts' hidden units per rank, and the latent attention's heads per rank."""
    p = wrap(group).size
    out: dict[str, Any] = {}
    # DeepSeek's router scores in float32 too, whose rounding Adam's normalised steps
    # magnify (4e-8 in the first step's gradients, 2e-5 after two Adam steps): SGD there.
    # OLMoE's attention norms (over all query heads, and all key heads) run in float32 too,
    # each rank's sum of squares added to the others': 1e-7 in the first step's logits, 2e-6
    # after three steps (with a larger epsilon, which hides the sums' rounding, 1e-12).
    models = {
        "mixtral": (mixtral, "adam", 1e-6),
        "batched_mm": (lambda: mixtral("batched_mm"), "adam", 1e-6),
        "gpt_oss": (gpt_oss, "adam", 1e-6),
        "qwen2_moe": (qwen2_moe, "adam", 1e-6),
        "deepseek_v3": (deepseek_v3, "sgd", 1e-6),
        "olmoe": (olmoe, "sgd", 1e-5),
        # PEFT's LoRA on the experts' parameters (ParamWrapper): its factors split with
        # them. Mixtral under "all-linear" (its router wrapped too: SGD, as DeepSeek's);
        # GPT-OSS's transposed, interleaved layout by target_parameters.
        "mixtral_lora": (mixtral_lora, "sgd", 1e-5),
        "gpt_oss_lora": (gpt_oss_lora, "sgd", 1e-6),
    }
    for name, (make, optimizer, tol) in models.items():
        with tolerance(tol):  # the router's softmax runs in float32
            split = equals_unsplit(group, make, optimizer, steps=2)
        out[name] = sorted(
            {tuple(m.shares) for m in split.modules() if isinstance(m, FilterParallelExperts)}
        )
    # Latent attention with its queries from q_proj (DeepSeek-V2-Lite's layout), a rank too
    # slow for a head holding none (empty_blocks).
    v2_lite = lambda: deepseek_v3(q_lora=None)  # noqa: E731
    slow = [1.0, 0.5, 0.05][:p]
    with tolerance(1e-6):
        split = equals_unsplit(group, v2_lite, "sgd", steps=2, speeds=slow, empty=True)
    out["latent_heads"] = list(split.get_submodule("model.layers.1.self_attn.o_proj").shares)
    torch.manual_seed(0)
    ref = mixtral("grouped_mm")
    split = split_copy(ref, group, SPEEDS[:p])
    with tolerance(1e-5):
        for step in range(2):
            one_step_equal(split, ref, batch(step), f"grouped_mm step {step}: ")
            ref.zero_grad()
            split.zero_grad()
    out["grouped_mm"] = sorted(
        {tuple(m.shares) for m in split.modules() if isinstance(m, FilterParallelExperts)}
    )
    # The split modules' own constructors name what is wrong, before any collective.
    comm = wrap(group)
    errors = 0
    for kind, text, call in (
        (ValueError, "module: cannot split its experts", lambda: nn.Linear(2, 2)),
        (ValueError, "shares: must be", lambda: mixtral().model.layers[0].mlp.experts),
    ):
        try:
            FilterParallelExperts.convert(call(), [1] * p, comm)
        except kind as e:
            assert text in str(e), str(e)
            errors += 1
    for kind, text, norm in (
        (TypeError, "norm: must hold a 1-D weight", nn.Linear(4, 4)),
        (ValueError, "shares: [1, 1, 1] units", olmo2().model.layers[0].self_attn.q_norm),
    ):
        try:
            FilterParallelRMSNorm.from_module(norm, 1e-6, [1] * p, comm)
        except kind as e:
            assert text.replace("[1, 1, 1]", str([1] * p)) in str(e), str(e)
            errors += 1
    out["errors"] = errors
    # Emulated speeds slow a rank's own work on its hidden units, not the experts' reduction
    # (the unsplit experts module, holding its weights above an activation, whole).
    from hetcoll.lab.emulate import delay_points

    experts = [m for m in split.modules() if isinstance(m, FilterParallelExperts)]
    points = {id(m) for m in delay_points(split)}
    assert all(id(e.local) in points and id(e) not in points for e in experts)
    whole = [m for m in ref.modules() if type(m).__name__ == "MixtralExperts"]
    assert whole and all(id(m) in {id(d) for d in delay_points(ref)} for m in whole)
    return out


def sdpa_float32(group: Any) -> int:
    """With Hugging Face's default attention (torch's scaled_dot_product_attention) in float32,
    the split Llama and GPT-2 give the unsplit logits and gradients to 1e-5 relative."""
    p = wrap(group).size
    checked = 0
    for make in (llama, gpt2):
        torch.manual_seed(0)
        ref = make()
        ref.config._attn_implementation = "sdpa"
        split = split_copy(ref, group, SPEEDS[:p])
        ids = batch(0)
        logits_ref, loss_ref = loss_of(ref, ids)
        logits, loss = loss_of(split, ids)
        assert rel(logits, logits_ref) <= 1e-5, rel(logits, logits_ref)
        loss_ref.backward()
        loss.backward()
        grads = gather_gradients(split, dst=None)
        assert grads is not None
        for n, q in ref.named_parameters():
            assert q.grad is not None and rel(grads[n], q.grad) <= 1e-5, (n, rel(grads[n], q.grad))
        checked += 1
    return checked


def traffic(
    group: Any,
    make: Any,
    hidden: int,
    speeds: list[float] | None = None,
    empty: bool | None = None,
    own: nn.Module | None = None,
) -> dict[str, int]:
    """Bytes per kind of one forward and backward: two reductions of batch x sequence x
    hidden per block forward (attention, MLP) and two backward (their inputs' gradients; a
    cross-attention's keys and values reduce the encoder states' too, and the gradients of
    T5's per-head tables and of multi-query attention's whole key and value are summed);
    besides, a layer left in gather mode (Llama's untied head) gathers its logits forward and
    reduces its input's gradient backward. With ``speeds`` (``empty_blocks=True``), a block
    held by one rank alone broadcasts from it instead: it sends the buffer to each other rank,
    which send nothing (``empty`` overrides it). ``own``: a split of ``make()`` at the same
    speeds made without a counter (:func:`equals_unsplit`'s, trained already: what it moves
    does not depend on its values), whose own count must agree; default: a new one."""
    p = wrap(group).size
    empty = speeds is not None if empty is None else empty
    speeds = SPEEDS[:p] if speeds is None else speeds
    torch.manual_seed(0)
    model = make().double()
    counts: dict[str, int] = {}
    comm = CountingCommunicator(wrap(group), counts)
    split = filter_parallel(model, group=comm, speeds=speeds, empty_blocks=empty)
    ids = batch(0, rows=2)
    # What one reduction of batch x sequence x hidden float64 costs here: the ring's
    # 2 (p-1)/p of the buffer. The split model's forward agrees on its inputs once (one
    # agreement of one field), and its reductions then skip their own checks.
    comm.kind = "probe"
    allreduce(torch.zeros(ids.numel() * hidden, dtype=torch.float64), comm, check=False)
    reduction = counts.pop("probe")
    assert reduction >= 2 * (p - 1) / p * ids.numel() * hidden * 8 - 1
    comm.kind = "probe"
    agree(comm, {"one field": 0})
    agreement = counts.pop("probe")
    counts.clear()
    comm.kind = "activations"
    _, loss = loss_of(split, ids)
    comm.kind = "gradients"
    loss.backward()
    blocks, gathered, gathers = 0, 0, 0
    for m in split.modules():
        if isinstance(m, FilterParallelLayer) and m.mode == "split-input":
            holders = [r for r, n in enumerate(m.shares) if n > 0]
            if len(holders) > 1:
                blocks += reduction
            elif holders == [m.rank]:
                blocks += (p - 1) * ids.numel() * hidden * 8
        if isinstance(m, FilterParallelLayer) and m.mode == "gather":
            gathered += (p - 1) * ids.numel() * m.shares[m.rank] * 8  # its logits' slice
            gathers += 1
    # Besides (T5): each cross-attention reduces the gradient of the encoder's states its keys
    # and values read (as many tokens here; a sole holder broadcasts it, as a block's sum),
    # and the per-head tables' gradients are summed.
    cross = 0
    for n, m in split.named_modules():
        if n.endswith("EncDecAttention"):
            holders = [r for r, u in enumerate(m.get_submodule("o").shares) if u > 0]
            if len(holders) > 1:
                cross += reduction
            elif holders == [m.get_submodule("o").rank]:
                cross += (p - 1) * ids.numel() * hidden * 8
    # Multi-query attention's key and value projections, whole on every rank, have their
    # gradients summed alike, as have Cohere's query and key norms (a row per head).
    # Falcon-7B's packs them with its query heads: the rows every rank holds are summed.
    tables = 0
    for n, m in split.named_modules():
        whole_kv = n.endswith(("k_proj", "v_proj")) and not isinstance(m, FilterParallelLayer)
        head_rows = n.endswith(("q_norm", "k_norm")) and m.weight.dim() == 2
        summed = []
        if n.endswith("relative_attention_bias") or whole_kv or head_rows:
            summed = [q.numel() for q in m.parameters()]
        elif isinstance(m, FilterParallelLayer) and getattr(m, "whole", ()):
            per_row = m.weight.numel() // m.weight.shape[m.weight_out_dim]
            summed = [sum(m.whole) * per_row] + ([sum(m.whole)] if m.bias is not None else [])
        for numel in summed:  # what summing a gradient sends
            comm.kind = "probe"
            allreduce(torch.zeros(numel, dtype=torch.float64), comm, check=False)
            tables += counts.pop("probe")
    assert counts["activations"] == agreement + blocks + gathered, (counts, blocks)
    # The sums start by agreeing on which of those parameters are frozen (one check).
    checked = agreement if tables else 0
    assert counts["gradients"] == blocks + gathers * reduction + cross + tables + checked, (
        counts,
        blocks,
    )
    # A split made without a counter counts for itself: split_traffic reports the last
    # forward and backward (each forward starts the count again; checkpoints are not counted).
    if own is None:
        torch.manual_seed(0)
        own = filter_parallel(make().double(), group=group, speeds=speeds, empty_blocks=empty)
    for _ in range(2):
        _, loss = loss_of(own, ids)
        loss.backward()
    gather_state_dict(own, dst=None)
    assert split_traffic(own) == counts, (split_traffic(own), counts)
    return counts


def bad_input(group: Any) -> int:
    """Each mistake raises the same error on every rank, before any collective."""
    p = wrap(group).size
    checked = 0

    def raises(text: str, fn: Any) -> None:
        nonlocal checked
        try:
            fn()
        except ValueError as e:
            assert text in str(e), (text, str(e))
            checked += 1
            return
        raise AssertionError(f"no ValueError ({text})")

    attn = [f"model.layers.0.self_attn.{n}_proj" for n in "qkvo"]
    warnings.simplefilter("ignore")
    # Fewer key/value groups than ranks (one head).
    raises(
        "attention 'model.layers.0.self_attn' has 1 key/value groups",
        lambda: filter_parallel(one_head(), group=group, speeds=SPEEDS[:p]),
    )
    # Multi-query attention splits by query head (of 4 features): shares of parts of one.
    off = [4] * (p - 1) + [24 - 4 * (p - 1)]
    off[0] -= 2
    off[-1] += 2
    raises(
        "are not whole query heads (of 4 features each) of attention 'model.layers.0.self_attn'",
        lambda: filter_parallel(llama_mqa(), group=group, shares=off, layers=attn[::3]),
    )
    # Shares of the query heads' features that are not whole heads (of 4): neither whole
    # groups (of 2 heads x 4 = 8) nor whole query heads, by which it splits otherwise.
    off = [8] * (p - 1) + [24 - 8 * (p - 1)]
    off[0] -= 2
    off[-1] += 2
    raises(
        "are not whole query heads (of 4 features each) of attention 'model.layers.0.self_attn'",
        lambda: filter_parallel(llama(), group=group, shares=off, layers=attn),
    )
    bad = [8] * (p - 1) + [24 - 8 * (p - 1)]
    bad[0] -= 4
    bad[-1] += 4
    # Per-layer shares (a dict) of an attention's output projection that are not whole
    # groups; its query projection's shares must follow the output's.
    per_layer = filter_shares(llama(), size=p, speeds=SPEEDS[:p])
    o_proj, q_proj = attn[3], attn[0]
    raises(
        f"shares[{o_proj!r}]: {bad} are not whole key/value groups",
        lambda: filter_parallel(llama(), group=group, shares={**per_layer, o_proj: bad}),
    )
    moved = list(per_layer[q_proj])
    moved[0], moved[1] = moved[0] + 8, moved[1] - 8
    raises(
        f"layer {q_proj!r} feeds {o_proj!r}",
        lambda: filter_parallel(llama(), group=group, shares={**per_layer, q_proj: moved}),
    )
    # A sample the model cannot run: every rank raises (the group is still usable after).
    raises(
        "sample: the model's forward on it failed",
        lambda: filter_parallel(llama(), group=group, speeds=SPEEDS[:p], sample="not ids"),
    )
    # Query, key and value packed head by head where a forward of the attention alone cannot
    # tell (it needs a second input), so the split takes three blocks: the first forward
    # raises on every rank, before any reduction.
    kept = filter_parallel(kept_lm(), group=group, speeds=SPEEDS[:p])
    raises("attention 'blocks.0' packs query, key and value head by head", lambda: kept(batch(0)))
    # BLOOM's attention cannot run without heads (its alibi, cut to none, against empty
    # scores), which the probe at the split cannot show (it lacks alibi): its first forward
    # raises on every rank, before any reduction.
    slow = [1.0] + [0.01] * (p - 1)
    split_bloom = filter_parallel(bloom(), group=group, speeds=slow, empty_blocks=True)
    raises(
        "attention 'transformer.h.0.self_attention' cannot run on a rank holding none of its "
        "heads, as rank 1 does",
        lambda: split_bloom(input_ids=batch(0)),
    )
    # T5's attentions are handed the position bias of their heads by the first of their
    # class: shares that give one of them other heads raise.
    t5 = filter_shares(T5LM(), size=p, speeds=SPEEDS[:p])
    other = "t5.decoder.block.1.layer.0.SelfAttention"
    moved_head = {}
    for n, step in (("q", 4), ("k", 4), ("v", 4), ("o", 4)):
        heads = list(t5[f"{other}.{n}"])
        heads[0], heads[1] = heads[0] - step, heads[1] + step
        moved_head[f"{other}.{n}"] = heads
    raises(
        f"attention {other!r} is handed inputs for its heads by "
        "'t5.encoder.block.0.layer.0.SelfAttention' (of its class), so it must hold the same "
        "heads",
        lambda: filter_parallel(T5LM(), group=group, shares={**t5, **moved_head}),
    )
    # A multiple_of that whole heads cannot meet: 5, against 8-feature groups or 4-feature
    # query heads of 24 features (3 would be met by query heads on 2 ranks, 12 each); named
    # by the finer split, the query heads'.
    raises(
        "multiple_of: 5 cannot be met by whole query heads (of 4 features each)",
        lambda: filter_parallel(
            llama(), group=group, speeds=SPEEDS[:p], layers=attn, multiple_of=5
        ),
    )
    return checked


def loss_parallel(group: Any) -> dict[str, Any]:
    """``filter_parallel(..., loss_parallel=True)``: the untied heads of Llama and the encoder
    LM return their logits split by vocabulary (``SplitOutput``), as do GPT-2's and
    ELECTRA's tied ones (ELECTRA's split layers inside the network too, read whole by the
    next); ``F.cross_entropy`` of them (padded targets ignored; mean, sum and per row)
    equals the unsplit model's loss, and two Adam steps its gradients and parameters, in
    float64 to 1e-10, with fewer bytes sent than gathering the logits; any other op gathers
    them whole. Hugging Face's own loss (labels) upcasts the logits to float32 and agrees to
    float32 precision. Against a brute-force oracle, random logits split over the ranks (a
    rank may hold no classes) give ``F.cross_entropy``'s loss and gradient."""
    from hetcoll.torch.filters.split_output import SplitOutput

    p = wrap(group).size
    comm = wrap(group)
    out: dict[str, Any] = {}
    models = (("llama", llama), ("encoder", EncoderLM), ("gpt2", gpt2), ("electra", electra))
    for name, make in models:
        torch.manual_seed(0)
        ref = make().double()
        split = filter_parallel(
            copy.deepcopy(ref), group=group, speeds=SPEEDS[:p], loss_parallel=True
        )
        if name == "gpt2":
            # A head tied to its token embedding: both split by vocabulary, still one parameter.
            head, embedding = split.get_output_embeddings(), split.get_input_embeddings()
            assert isinstance(head, FilterParallelLayer), type(head).__name__
            assert isinstance(embedding, FilterParallelEmbedding), type(embedding).__name__
            assert head.weight is embedding.weight and head.mode == "gather"
            assert head.weight.shape[0] == head.shares[head.rank] < VOCAB
            # A token outside the vocabulary raises on every rank, as the unsplit lookup does.
            try:
                split(input_ids=torch.tensor([[1, VOCAB]]))
            except IndexError as e:
                assert f"token ids must lie in [0, {VOCAB})" in str(e), str(e)
            else:
                raise AssertionError("no IndexError for a token outside the vocabulary")
        opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
        opt = torch.optim.Adam(split.parameters(), lr=1e-2)
        for step, reduction in enumerate(("mean", "sum", "none")):
            ids = batch(step)
            target = ids[:, 1:].clone()
            target[0, : step + 1] = -100  # padding, ignored
            losses = []
            for model in (ref, split):
                logits = model(input_ids=ids).logits
                loss = nn.functional.cross_entropy(
                    logits[:, :-1].reshape(-1, VOCAB), target.reshape(-1), reduction=reduction
                )
                losses.append((logits, loss))
            (logits_ref, loss_ref), (logits, loss) = losses
            assert isinstance(logits, SplitOutput) and logits.shape == logits_ref.shape
            assert not isinstance(loss, SplitOutput)
            close(loss, loss_ref, f"{name} step {step}: loss ({reduction})")
            close(logits, logits_ref, f"{name} step {step}: logits (gathered)")
            weights = torch.linspace(0.5, 1.5, loss.numel(), dtype=torch.float64)
            (loss_ref * weights.view_as(loss_ref)).sum().backward()
            (loss * weights.view_as(loss)).sum().backward()
            grads = gather_gradients(split, dst=None)
            assert grads is not None
            for n, q in ref.named_parameters():
                close(grads[n], q.grad, f"{name} step {step}: gradient of {n}")
            for o in (opt_ref, opt):
                o.step()
                o.zero_grad()
        same_state(split, ref, f"{name} after 3 steps")
        # The bytes: a forward and its loss, split and gathered (the same model, no loss_parallel).
        sent = {}
        for flag in (True, False):
            counts: dict[str, int] = {}
            counting = CountingCommunicator(wrap(group), counts)
            torch.manual_seed(0)
            m = filter_parallel(
                make().double(), group=counting, speeds=SPEEDS[:p], loss_parallel=flag
            )
            counting.kind = "activations"
            _, loss = loss_of(m, batch(0))
            sent[flag] = counts["activations"]
        if name in ("gpt2", "electra"):
            continue  # unsplit without the option, its tied head gathers nothing
        assert sent[True] < sent[False], sent
        out[name] = "fewer bytes"  # the same on every rank (what each sends differs)

    # GPT-2 with PEFT's LoRA on its token embedding (lora.Embedding reads the whole one): the
    # embedding and its tied head stay whole, the rest splits, as the unsplit model trains.
    def lora_embedding() -> nn.Module:
        return _trained_whole(_with_lora(gpt2(), ["c_attn", "wte"], fan_in_fan_out=True))

    torch.manual_seed(0)
    ref = lora_embedding().double()
    split = filter_parallel(copy.deepcopy(ref), group=group, speeds=SPEEDS[:p], loss_parallel=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, split)]
    for step in range(2):
        one_step_equal(split, ref, batch(step), f"LoRA embedding step {step}: ")
        for o in opts:
            o.step()
            o.zero_grad()
    whole = ("base_model.model.lm_head", "base_model.model.transformer.wte.base_layer")
    out["lora_embedding"] = [type(split.get_submodule(n)).__name__ for n in whole] + [
        sum(isinstance(m, FilterParallelLayer) for m in split.modules())
    ]
    # Hugging Face's loss from labels (float32 inside, whatever the logits' dtype).
    torch.manual_seed(0)
    ref = llama().double()
    split = filter_parallel(copy.deepcopy(ref), group=group, speeds=SPEEDS[:p], loss_parallel=True)
    ids = batch(0)
    labels = ids.clone()
    labels[1, :4] = -100
    want, got = ref(input_ids=ids, labels=labels).loss, split(input_ids=ids, labels=labels).loss
    assert abs(float(got) - float(want)) <= 1e-6 * abs(float(want)), (float(got), float(want))
    # The oracle: random logits, split by random shares (zeros too), every reduction.
    g = torch.Generator().manual_seed(7)
    checked = 0
    for _ in range(6):
        rows, classes = (
            int(torch.randint(1, 9, (1,), generator=g)),
            int(torch.randint(p, 12, (1,), generator=g)),
        )
        cuts = sorted(torch.randint(0, classes + 1, (p - 1,), generator=g).tolist())
        shares = [b - a for a, b in zip([0, *cuts], [*cuts, classes], strict=True)]
        whole = torch.randn(rows, classes, dtype=torch.float64, generator=g) * 4
        target = torch.randint(0, classes, (rows,), generator=g)
        target[torch.rand(rows, generator=g) < 0.3] = -100
        offset = sum(shares[: comm.rank])
        for reduction in ("mean", "sum", "none"):
            w = whole.clone().requires_grad_()
            piece = whole[:, offset : offset + shares[comm.rank]].clone().requires_grad_()
            want = nn.functional.cross_entropy(w, target, reduction=reduction)
            got = nn.functional.cross_entropy(
                SplitOutput.of(piece, comm, shares), target, reduction=reduction
            )
            if bool((target == -100).all()) and reduction == "mean":
                assert torch.isnan(got) and torch.isnan(want)
                continue
            close(got, want, f"oracle loss {shares} {reduction}")
            want.sum().backward()
            got.sum().backward()
            assert piece.grad is not None and w.grad is not None
            if shares[comm.rank]:  # a rank holding no classes has no gradient to compare
                mine = w.grad[:, offset : offset + shares[comm.rank]]
                close(piece.grad, mine, f"oracle grad {shares}")
            checked += 1
    # Under bf16 autocast, as torch's, the loss of half-precision logits comes in float32.
    w = torch.randn(10, 8, generator=g)
    x, target = torch.randn(5, 8, generator=g), torch.randint(0, 10, (5,), generator=g)
    shares = [10 - 2 * (p - 1)] + [2] * (p - 1)
    offset = sum(shares[: comm.rank])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = nn.functional.cross_entropy(x @ w.T, target)
        piece = x @ w[offset : offset + shares[comm.rank]].T
        got = nn.functional.cross_entropy(SplitOutput.of(piece, comm, shares), target)
    assert got.dtype == want.dtype == torch.float32, (got.dtype, want.dtype)
    assert abs(float(got) - float(want)) <= 1e-5 * abs(float(want)), (float(got), float(want))
    checked += 1
    out["oracle"] = checked
    # Sums of two split outputs: split alike, piece by piece (still split); split otherwise,
    # of their whole tensors. Either way the whole sum and its gradients.
    a, b = (torch.randn(3, 10, dtype=torch.float64, generator=g) for _ in range(2))
    alike = [10 - 2 * (p - 1)] + [2] * (p - 1)
    for other in (alike, alike[::-1]):
        pieces = []
        for whole, shares in ((a, alike), (b, other)):
            at = sum(shares[: comm.rank])
            pieces.append(whole[:, at : at + shares[comm.rank]].clone().requires_grad_())
        x, y = SplitOutput.of(pieces[0], comm, alike), SplitOutput.of(pieces[1], comm, other)
        total = x + y * 0.5
        assert isinstance(total, SplitOutput) == (other == alike), (other, type(total))
        got = total.whole() if isinstance(total, SplitOutput) else total
        close(got, a + b * 0.5, f"sum split as {alike} and {other}")
        got.pow(2).sum().backward()
        for piece, shares, scale in ((pieces[0], alike, 1.0), (pieces[1], other, 0.5)):
            at = sum(shares[: comm.rank])
            want = 2 * (a + b * 0.5)[:, at : at + shares[comm.rank]] * scale
            close(piece.grad, want, f"gradient of a piece split as {shares}")
        out["oracle"] += 1
    # A target outside the classes: the same error on every rank, before any exchange.
    try:
        nn.functional.cross_entropy(
            SplitOutput.of(torch.zeros(2, 1 + comm.rank), comm, [1 + r for r in range(p)]),
            torch.tensor([0, 999]),
        )
    except ValueError as e:
        assert "target: class 999 outside" in str(e), str(e)
        out["oracle"] += 1
    return out


def layouts(group: Any, models: Any) -> dict[str, Any]:
    """Each model of ``(name, make)`` pairs split by heads and units equals it unsplit: the
    layers left gathering (``NAME_gathers``) and the split layers (``NAME_split``), by name;
    the shares of its experts modules split by hidden units (``NAME_experts``), if any."""
    out: dict[str, Any] = {}
    for name, make in models:
        split = equals_unsplit(group, make, "adam", steps=2)
        got = modes(split)
        out[f"{name}_gathers"] = sorted(n for n, m in got.items() if m == "gather")
        out[f"{name}_split"] = sum(m != "gather" for m in got.values())
        experts = [m.shares for m in split.modules() if isinstance(m, FilterParallelExperts)]
        if experts:
            out[f"{name}_experts"] = experts
    return out


def apertus() -> nn.Module:
    """Hugging Face Apertus: an MLP of up and down projections around xIELU, an activation
    of two learnt numbers (``alpha_p``, ``alpha_n``: one-element parameters) and two
    one-element buffers, applied to every hidden unit alike."""
    return _hf("ApertusForCausalLM", "ApertusConfig")


def diffllama() -> nn.Module:
    """Hugging Face DiffLlama (the Differential Transformer): each attention cuts its 4
    key/value heads in two halves (``torch.chunk(value_states, 2, dim=1)``) and subtracts one
    half's outputs from the other's, head ``h`` paired with head ``h + 2``."""
    return _hf(
        "DiffLlamaForCausalLM", "DiffLlamaConfig", hidden_size=32, num_attention_heads=8,
        num_key_value_heads=4,
    )  # fmt: skip


class _KeptHeads(_OldStyleAttention):
    """:class:`_OldStyleAttention` of separate q/k/v/o (6 heads of 4) that scales its input
    by a second input it requires, so that no probe forward at the split runs it."""

    def heads(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Each head's output, ``(batch, heads, seq, head_dim)``."""
        b, n, _ = x.shape
        x = x * keep
        q, k, v = (
            f(x).view(b, n, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v)
        )
        return torch.softmax(q @ k.transpose(-1, -2) / 2.0, dim=-1) @ v


class _KeptDifferential(_KeptHeads):
    """A differential attention: its heads' outputs cut in two halves (dim 1), each half less
    half the other's."""

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        one, two = self.heads(x, keep).chunk(2, dim=1)
        att = torch.cat([one - 0.5 * two, two - 0.5 * one], dim=1)
        return self.o(att.transpose(1, 2).reshape(*x.shape[:2], -1))


def kept_differential_lm() -> nn.Module:
    """:class:`ResidualLM` of :class:`_KeptDifferential` blocks."""
    return ResidualLM(_KeptDifferential, keep=True)


class _KeptWidth(_KeptHeads):
    """An attention that reshapes its heads' output to its input's width, as Hugging Face
    LED's decoder attention does: it cannot run on a rank holding part of its heads."""

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.o(self.heads(x, keep).transpose(1, 2).reshape(x.shape))


def differential(group: Any) -> dict[str, Any]:
    """:func:`diffllama` split: split by heads, a rank's heads would pair among themselves
    (at equal speeds on 2 ranks, heads 0 and 1 where the unsplit model pairs 0 with 2: other
    logits). Its attentions stay whole, named in the warning, their layers gathering; its
    MLPs split; one step equals the unsplit model's. Returns the layers by mode, the
    attentions the warning names, and what the first forward of
    :func:`kept_differential_lm`'s split raises."""
    torch.manual_seed(0)
    ref = diffllama().double()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        split = filter_parallel(copy.deepcopy(ref), group=group, speeds=SPEEDS[: wrap(group).size])
    one_step_equal(split, ref, batch(0), "diffllama: ")
    named = [str(w.message) for w in seen if "cuts its heads into parts" in str(w.message)]
    got = modes(split)
    # Where the probe at the split cannot run the attention, its first forward looks again,
    # on its own inputs: every rank raises there, before the block runs.
    kept = kept_differential_lm()
    raised = []
    for lm in (kept, ResidualLM(_KeptWidth, keep=True)):
        # (Even heads on every rank: the differential one runs on them, pairing them wrongly.)
        split = filter_parallel(lm.double(), group=group, speeds=[1.0] * wrap(group).size)
        try:
            loss_of(split, batch(0))
            raised.append("")
        except ValueError as e:
            raised.append(str(e))
    return {
        "gathers": sum(m == "gather" for m in got.values()),
        "split": sum(m != "gather" for m in got.values()),
        "named": re.findall(r"'(model\.layers\.\d\.self_attn)' \(its forward cuts", "".join(named)),
        "first forward": raised,
    }


def architectures(group: Any) -> dict[str, Any]:
    """The other architectures' layouts (:func:`layouts`): each splits on any ranks as the
    models of :func:`run_all` do (the 3-rank job runs them, uneven); OLMo 2 to float32's
    rounding."""
    packed = lambda: old_style_lm(packed=True)  # noqa: E731 - head by head, as BLOOM's
    # OLMo 2's norms over all query (and all key) heads compute in float32 whatever the
    # model's dtype, as Hugging Face's RMS norms do: the ranks' sums of squares, summed in
    # another order than one rank's, agree to about 1e-7 (Adam's steps to about 1e-6).
    with tolerance(1e-5):
        out = layouts(group, (("olmo2", olmo2),))
    return (
        out
        | layouts(
            group,
            (
                ("qwen3", qwen3),
                ("gemma", gemma),
                ("gate_up", gate_up_lm),
                ("neox", neox),
                ("packed", packed),
                ("falcon", falcon),
                ("opt", opt),
                ("bert", bert),
                ("bloom", bloom),
                ("t5", T5LM),
                ("bigcode", bigcode),
                ("mpt", mpt),
                ("cohere_mqa", lambda: cohere(kv_heads=1)),
                ("mamba", mamba),
                ("dbrx", dbrx),
                ("albert", albert),
                ("stablelm_gqa", lambda: stablelm_head_norms(kv_heads=2)),
                ("mpnet", mpnet),
                ("beit", beit),
                ("swinv2", swinv2),
                ("swin", swin),
                ("apertus", apertus),
            ),
        )
        | {"diffllama": differential(group)}
    )


def run_all(group: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, make in (("llama", llama), ("gpt2", gpt2), ("encoder", EncoderLM)):
        for optimizer in ("sgd", "adam"):
            split = equals_unsplit(group, make, optimizer)
        got = modes(split)
        gathers = sorted(n for n, m in got.items() if m == "gather")
        out[f"{name}_gathers"] = gathers
        out[f"{name}_split"] = sum(m != "gather" for m in got.values())
        traffic(group, make, 24, own=split)
    # Grouped-query attention packed: by group on 2 ranks, by query head on 3.
    out.update(
        layouts(
            group,
            (
                ("phi3", phi3),
                ("grouped", grouped_lm),
                ("falcon_gqa", falcon_gqa),
                ("cohere", cohere),
                ("stablelm", stablelm_head_norms),
            ),
        )
    )
    gqa_speeds = GQA_SPEEDS[: wrap(group).size]
    gqa = {}
    for name, make in (("llama_gqa", llama_gqa), ("qwen2", qwen2)):
        gqa[name] = equals_unsplit(group, make, "adam", steps=2, speeds=gqa_speeds, empty=False)
        got = modes(gqa[name])
        out[f"{name}_gathers"] = sorted(n for n, m in got.items() if m == "gather")
        out[f"{name}_split"] = sum(m != "gather" for m in got.values())
        q_proj = gqa[name].get_submodule("model.layers.0.self_attn.q_proj")
        out[f"{name}_heads"] = list(q_proj.shares)
    traffic(group, llama_gqa, 24, gqa_speeds, empty=False, own=gqa["llama_gqa"])
    out["llama_gqa_empty"] = gqa_heads_by_shares(group)
    out["empty_blocks"] = empty_blocks(group)
    out["time_balanced"] = time_balanced(group)
    out["mha_weights"] = attention_weights(group)
    out["sdpa_float32"] = sdpa_float32(group)
    out["errors"] = bad_input(group)
    out["loss_parallel"] = loss_parallel(group)
    out["dropout"] = dropout(group)
    out["traces"] = traces(group)
    out["lora"] = lora_heads(group)
    return out


def traces(group: Any) -> dict[str, int]:
    """The most times :func:`filter_parallel` traces (torch.fx, for the runs of its modules)
    any one module of each model: the plan's traces are made once and read again."""
    from torch import fx

    trace = fx.Tracer.trace
    ours: set[int] = set()  # the ids of the modules of the model being split
    counts: dict[int, int] = {}

    def counted(self: Any, root: Any, *args: Any, **kwargs: Any) -> Any:
        if type(self) is fx.Tracer and id(root) in ours:  # the runs' tracer
            counts[id(root)] = counts.get(id(root), 0) + 1
        return trace(self, root, *args, **kwargs)

    most: dict[str, int] = {}
    fx.Tracer.trace = counted  # type: ignore[method-assign]
    try:
        for name, make in (("llama", llama), ("t5", T5LM), ("swin", swin)):
            model = make()
            ours.clear()
            ours.update(id(m) for m in model.modules())
            counts.clear()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                filter_parallel(model, group=group, speeds=SPEEDS[: wrap(group).size])
            most[name] = max(counts.values())
    finally:
        fx.Tracer.trace = trace  # type: ignore[method-assign]
    return most


def _with_lora(
    model: nn.Module, targets: list[str] | str, dropout: float = 0.0, **kw: Any
) -> nn.Module:
    """``model`` with PEFT's LoRA adapters (rank 4) on ``targets``, their B matrices drawn (PEFT
    starts them at zero, which would hide a wrong split of the adapters' path)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=dropout, **kw)
    lora = get_peft_model(model, config)
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if ".lora_B." in n:
                p.normal_(0.0, 0.2)
    return lora


def _trained_whole(model: nn.Module) -> nn.Module:
    """``model`` with every parameter trainable: the base layers' gradients checked too."""
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def llama_lora() -> nn.Module:
    """:func:`llama` with adapters on its seven projections, every weight trainable."""
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return _trained_whole(_with_lora(llama(), targets))


def gpt2_lora() -> nn.Module:
    """:func:`gpt2` with adapters on its packed query/key/value projection and both output
    projections (Conv1D base layers, ``fan_in_fan_out``; a bias on each ``lora_B``), its
    MLP's first layer bare; every weight trainable."""
    return _trained_whole(
        _with_lora(gpt2(), ["c_attn", "c_proj"], fan_in_fan_out=True, lora_bias=True)
    )


def mixtral_lora() -> nn.Module:
    """:func:`mixtral` under PEFT's ``"all-linear"``: LoRA on its attentions' projections and
    on its experts' and router's parameters (``ParamWrapper``), every weight trainable."""
    return _trained_whole(_with_lora(mixtral(), "all-linear"))


def gpt_oss_lora() -> nn.Module:
    """:func:`gpt_oss` with LoRA on its query projections and its experts' parameters
    (``target_parameters``: stored transposed, gate and up rows interleaved)."""
    parameters = ["experts.gate_up_proj", "experts.down_proj"]
    return _trained_whole(_with_lora(gpt_oss(), ["q_proj"], target_parameters=parameters))


def llama_dora() -> nn.Module:
    """:func:`llama` with DoRA on its query, value and both output projections (base frozen),
    the adapters' dropout a ``nn.Dropout`` of p = 0: PEFT's DoRA then recomputes the base
    output on the dropped input, as with any p, and the unsplit model draws the same masks."""
    model = _with_lora(llama(), ["q_proj", "v_proj", "o_proj", "down_proj"], use_dora=True)
    for wrapper in model.modules():
        drops = getattr(wrapper, "lora_dropout", None)
        if isinstance(drops, nn.ModuleDict) and isinstance(wrapper, nn.Module):
            for a in list(drops):
                drops[a] = nn.Dropout(0.0)
    return model


def gpt2_dora() -> nn.Module:
    """:func:`gpt2` with DoRA on its packed query/key/value projection and both output
    projections (Conv1D base layers, ``fan_in_fan_out``), every weight trainable."""
    return _trained_whole(
        _with_lora(gpt2(), ["c_attn", "c_proj"], fan_in_fan_out=True, use_dora=True)
    )


def falcon_dora() -> nn.Module:
    """:func:`falcon` under PEFT's ``"all-linear"`` DoRA: multi-query attention packed with
    its queries, the key and value rows (and their magnitudes) whole on every rank."""
    return _trained_whole(_with_lora(falcon(), "all-linear", use_dora=True))


def lora_heads(group: Any) -> dict[str, Any]:
    """PEFT's LoRA wrappers split with their attentions by heads and MLPs by hidden units:
    Llama (every projection wrapped) and GPT-2 (its packed projection's adapter split in the
    same three blocks; an MLP of a bare column and a wrapped row) train as the unsplit model,
    every gradient (base weights trainable too) and Adam/SGD state equal in float64, and
    resume on another split (Llama's by per-layer shares, a slow rank allowed none of a
    block's heads); only the language model's head gathers. (More layouts and PEFT's own
    switches: :func:`lora_more`, on 2 ranks.)"""
    out: dict[str, Any] = {}
    # Llama with empty_blocks (a slow rank may hold none of a block's heads) and resumed on
    # the split filter_shares names by module path, its wrappers' paths.
    for name, make, optimizer in (("llama", llama_lora, "adam"), ("gpt2", gpt2_lora, "sgd")):
        split = equals_unsplit(group, make, optimizer, steps=2, empty=name == "llama")
        out[f"{name}_gathers"] = sorted(n for n, m in modes(split).items() if m == "gather")
    return out


def lora_more(group: Any) -> dict[str, Any]:
    """More of PEFT's LoRA under a split by heads (the 2-rank job's), each as the unsplit
    model: with every linear layer wrapped, Phi-3, Falcon-7B, GPT-NeoX, Qwen3 and a
    multi-query Llama (their gathering layers, by name); DoRA on Llama (its dropout active),
    GPT-2 and Falcon-7B, split with its layers (each DoRA layer's mode, by model and
    projection; Falcon's gathering layers). A LoRA
    fine-tuning (base frozen) with dropout on the adapters' inputs: the whole tensors stay the
    same on every rank step after step (a column's dropout draws every rank's mask; a row's,
    on the rank's slice, the rank's own, the common stream left in step), as do the adapters
    every rank holds whole; its adapters, gathered and saved as PEFT saves them, load into
    the unsplit model (:func:`_saved_adapters_load_unsplit`); disabled, merged and unmerged,
    the split model computes what the unsplit one does (:func:`_disabled_and_merged`)."""
    out: dict[str, Any] = {}
    # PEFT's "all-linear" (every linear layer but the head) on other layouts: Phi-3's packed
    # query/key/value and gate/up, Falcon-7B's multi-query attention packed with its queries
    # (the key and value rows whole on every rank), GPT-NeoX's head-by-head packing, Qwen3's
    # per-head query/key norms; Llama under multi-query attention, split by query head, its
    # wrapped key and value projections whole on every rank (their adapters summed too).
    layouts = (
        ("phi3", phi3), ("falcon", falcon), ("neox", neox), ("qwen3", qwen3),
        ("mqa", llama_mqa),
    )  # fmt: skip
    for name, base in layouts:

        def wrapped(base: Any = base) -> nn.Module:
            return _trained_whole(_with_lora(base(), "all-linear"))

        split = equals_unsplit(group, wrapped, "sgd", steps=1)
        out[f"{name}_gathers"] = [n for n, m in modes(split).items() if m == "gather"]
    out["latent"] = _lora_latent_attention(group)
    # DoRA splits with its layers (it stayed whole: its weight norm reads each output's whole
    # row): Llama's, its adapters' dropout active (the base output recomputed on the dropped
    # input, as PEFT does: dropout of p = 0 here, so the unsplit model draws alike), and GPT-2's
    # (Conv1D base layers, the packed projection's magnitudes in three blocks).
    dora = {}
    for make in (llama_dora, gpt2_dora):
        split = equals_unsplit(group, make, "adam", steps=2)
        dora.update(
            {
                f"{make.__name__} {n.split('.')[-3]}": m.mode
                for n, m in split.named_modules()
                if isinstance(m, FilterParallelDoRA)
            }
        )
    # Falcon-7B's multi-query attention under "all-linear" DoRA: the key and value rows'
    # magnitudes whole on every rank, their gradients summed.
    split = equals_unsplit(group, falcon_dora, "sgd", steps=2)
    out["falcon_dora_gathers"] = [n for n, m in modes(split).items() if m == "gather"]
    out["dora"] = dora
    out["dora alone"] = _dora_alone(group)
    out["dora norm sums"] = _dora_norm_sums(group)
    out["lora head"] = _lora_head(group)
    torch.manual_seed(0)
    tuned = _with_lora(llama(), ["q_proj", "v_proj", "o_proj", "down_proj"], dropout=0.3)
    tuned = filter_parallel(tuned.double(), SPEEDS[: wrap(group).size], group)
    seen: dict[str, torch.Tensor] = {}
    block = tuned.get_submodule("base_model.model.model.layers.0")
    block.register_forward_hook(
        lambda m, i, o: seen.__setitem__("hidden", o[0] if isinstance(o, tuple) else o)
    )
    whole = [
        p for n, p in tuned.named_parameters()
        if p.requires_grad and (".q_proj.lora_A." in n or ".o_proj.lora_B." in n)
    ]  # fmt: skip
    opt = torch.optim.Adam([p for p in tuned.parameters() if p.requires_grad], lr=1e-2)
    torch.manual_seed(5)  # the same seed on every rank
    same = []
    for step in range(3):
        _, loss = loss_of(tuned, batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        same += [_same_on_every_rank(group, seen["hidden"])]
        same += [_same_on_every_rank(group, torch.cat([p.detach().flatten() for p in whole]))]
    out["dropout_same"] = all(same) and len(whole) == 4
    out["input copies"] = _input_copies(group)
    out["saved"] = _saved_adapters_load_unsplit(group, tuned)
    out["disabled and merged"] = _disabled_and_merged(group)
    return out


def _dora_alone(group: Any) -> dict[str, Any]:
    """DoRA on the two layers of a small MLP with biases, the adapters' dropout active: split
    as a chain pair (a column, then a row), and its last layer alone, gathering its output,
    with its adapters split alone too or whole. Each split's output and every gradient are the
    unsplit model's (float64), in training and in evaluation; by split, the modes of its DoRA
    layers where all agree, else what differed."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 12)).double()
    ref = get_peft_model(mlp, LoraConfig(r=4, target_modules=["0", "2"], use_dora=True))
    for wrapper in ref.modules():
        drops = getattr(wrapper, "lora_dropout", None)
        if isinstance(drops, nn.ModuleDict):
            for a in list(drops):
                drops[a] = nn.Dropout(0.0)  # DoRA's dropped-input path, drawing alike
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if ".lora_B." in n:
                p.normal_(0.0, 0.3)
    ref = _trained_whole(ref)
    last = "base_model.model.2."
    splits = {
        "pair": None,
        "gathering": [last + "base_layer", last + "lora_A.default", last + "lora_B.default"],
        "gathering, adapters whole": [last + "base_layer"],
    }
    x = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out: dict[str, Any] = {}
    for name, layers in splits.items():
        split = filter_parallel(copy.deepcopy(ref), SPEEDS[:2], group, layers=layers)
        wrong = []
        for mode in ("train", "eval"):
            for m in (ref, split):
                m.train(mode == "train")
            ref.zero_grad()
            split.zero_grad()
            want, got = ref(x), split(x)
            want.pow(2).sum().backward()
            got.pow(2).sum().backward()
            grads = gather_gradients(split, dst=None)
            assert grads is not None
            wrong += [f"{mode} output"] * (rel(got, want) > TOL)
            wrong += [
                f"{mode} {n}" for n, p in ref.named_parameters() if rel(grads[n], p.grad) > TOL
            ]
        # Merged: a chain pair's slices of B A into its slices of W (its norms as split);
        # a layer split alone, gathering, refuses by name (its slices would not match).
        split.eval()
        try:
            split.merge_adapter()
            ref.merge_adapter()
            wrong += ["merged"] * (rel(split(x), ref(x)) > TOL)
            ref.unmerge_adapter()
        except ValueError as e:
            wrong += [] if "'base_model.model.2' is split alone" in str(e) else [str(e)]
            wrong += [] if name != "pair" else ["merge refused"]
        modes = sorted({m.mode for m in split.modules() if isinstance(m, FilterParallelDoRA)})
        out[name] = wrong or modes
    return out


@contextlib.contextmanager
def _inputs_of(fn: type[torch.autograd.Function]) -> Iterator[list[tuple[Any, ...]]]:
    """The inputs of each forward of autograd function ``fn`` run inside the block."""
    seen: list[tuple[Any, ...]] = []
    forward = fn.forward

    def counted(ctx: Any, *args: Any) -> Any:
        seen.append(args)
        return forward(ctx, *args)

    fn.forward = staticmethod(counted)  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        fn.forward = staticmethod(forward)  # type: ignore[method-assign]


def _input_copies(group: Any) -> int:
    """How many inputs one forward of a split Llama copies to the ranks (each copy's gradient
    summed over the ranks backward), LoRA's dropout on its query, value and both output
    projections, every weight trainable: each input once, though each wrapped projection reads
    its own dropped input between the reads of the one its base layer and the bare key
    projection read."""
    from hetcoll.torch.filters.autograd import CopyToRanks

    torch.manual_seed(0)
    targets = ["q_proj", "v_proj", "o_proj", "down_proj"]
    model = _trained_whole(_with_lora(llama(), targets, dropout=0.3)).double()
    split = filter_parallel(model, SPEEDS[: wrap(group).size], group)
    with _inputs_of(CopyToRanks) as copies:
        _, loss = loss_of(split, batch(0))
    loss.backward()
    return len(copies)


def llama_lora_head() -> nn.Module:
    """:func:`llama` with LoRA on its query and value projections and on its head, every weight
    trainable: the head's wrapper splits alone, outside attentions and MLPs."""
    return _trained_whole(_with_lora(llama(), ["q_proj", "v_proj", "lm_head"]))


def _lora_head(group: Any) -> dict[str, Any]:
    """A LoRA head split alone: trained and resumed on another split as the unsplit model
    (float64); the widths of what one forward gathers (its base layer's and its ``lora_B``'s
    outputs added split, the sum gathered once; ``lora_A``'s adapter rank gathered), and with
    ``loss_parallel`` (the sum kept split through the loss, whose value and gradients are the
    unsplit model's)."""
    from hetcoll.torch.filters.autograd import GatherChannels

    equals_unsplit(group, llama_lora_head, "adam", steps=2)
    out: dict[str, Any] = {}
    speeds = SPEEDS[: wrap(group).size]
    ids = batch(0)
    torch.manual_seed(0)
    ref = llama_lora_head().double()
    _, loss_ref = loss_of(ref, ids)
    loss_ref.backward()
    for kept in (False, True):
        torch.manual_seed(0)
        split = filter_parallel(llama_lora_head().double(), speeds, group, loss_parallel=kept)
        with _inputs_of(GatherChannels) as gathered:
            _, loss = loss_of(split, ids)
        close(loss, loss_ref, f"loss_parallel={kept}: loss")
        loss.backward()
        grads = gather_gradients(split, dst=None)
        assert grads is not None
        for n, q in ref.named_parameters():
            close(grads[n], q.grad, f"loss_parallel={kept}: gradient of {n}")
        # GatherChannels(piece, comm, shares, ...): the whole width, every rank's shares.
        out["loss_parallel" if kept else "gathered"] = [sum(a[2]) for a in gathered]
    # A DoRA head, its dropout active: what one forward gathers, the cost model's too
    # (test_costs_tokens: a DoRA head's gathers).
    torch.manual_seed(0)
    dora = _with_lora(llama(), ["lm_head"], use_dora=True)
    for wrapper in dora.modules():
        drops = getattr(wrapper, "lora_dropout", None)
        if isinstance(drops, nn.ModuleDict) and isinstance(wrapper, nn.Module):
            for a in list(drops):
                drops[a] = nn.Dropout(0.0)
    split = filter_parallel(dora.double(), speeds, group)
    with _inputs_of(GatherChannels) as gathered:
        loss_of(split, ids)
    out["dora"] = [list(g) for g in sorted((sum(a[2]), a[0].dim()) for a in gathered)]
    return out


def _dora_norm_sums(group: Any) -> list[list[int]]:
    """The shapes of the sums over the ranks that one forward of the split
    :func:`llama_dora` makes whatever its batch (the cost model's ``SplitBlock.fixed_sums``):
    each DoRA row's sums of squares of its weight's rows, a number per output feature."""
    from hetcoll.torch.filters.autograd import ReduceSum

    torch.manual_seed(0)
    split = filter_parallel(llama_dora(), SPEEDS[: wrap(group).size], group)
    with _inputs_of(ReduceSum) as summed:
        loss_of(split, batch(0))
    return [list(x.shape) for x, *_ in summed if x.dim() == 1]


@contextlib.contextmanager
def _norms_in_model_dtype(norm: type[nn.Module]) -> Iterator[None]:
    """``norm`` (Hugging Face's RMS norm of one model) computing in its input's dtype: it
    computes in float32 whatever the model's, and a latent attention's norms run whole on
    every rank on their heads' part of the gradient, each part rounded to float32 before the
    sum (1e-7 apart in the first step's gradients). In the model's dtype the split is exact."""
    forward = norm.forward

    def in_dtype(self: Any, h: torch.Tensor) -> torch.Tensor:
        return self.weight * (
            h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        )

    norm.forward = in_dtype  # type: ignore[method-assign]
    try:
        yield
    finally:
        norm.forward = forward  # type: ignore[method-assign]


def _lora_latent_attention(group: Any) -> dict[str, Any]:
    """PEFT's ``"all-linear"`` on DeepSeek-V3: its latent attention split by heads with its
    adapters (the wrapped q_b_proj, kv_b_proj and o_proj split, the wrapped latent
    projections whole on every rank ahead of them), queries from their own latent and from
    q_proj (V2-Lite's), a rank allowed none of the heads (empty_blocks). Equal to the unsplit
    model in float64 with the norms in float64 (:func:`_norms_in_model_dtype`); as Hugging
    Face computes them (float32), to 1e-6 beside its experts, which PEFT wraps with LoRA on
    their parameters (``ParamWrapper``): they split by hidden units with their adapters."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3

    out: dict[str, Any] = {}
    for name, q_lora in (("q_b_proj", 8), ("q_proj", None)):

        def dense(q_lora: int | None = q_lora) -> nn.Module:
            model = deepseek_v3(q_lora=q_lora, dense=2)
            return _trained_whole(_with_lora(model, "all-linear"))

        with _norms_in_model_dtype(modeling_deepseek_v3.DeepseekV3RMSNorm):
            split = equals_unsplit(group, dense, "adam", steps=2, empty=True)
        heads = split.get_submodule(f"base_model.model.model.layers.0.self_attn.{name}")
        out[name] = list(heads.get_submodule("base_layer").shares)

    def experts() -> nn.Module:
        return _trained_whole(_with_lora(deepseek_v3(), "all-linear"))

    with tolerance(1e-6):
        split = equals_unsplit(group, experts, "sgd", steps=1)
    out["experts_split"] = any(isinstance(m, FilterParallelExperts) for m in split.modules())
    return out


def _disabled_and_merged(group: Any) -> list[str]:
    """PEFT's own switches on a split LoRA model compute what they compute unsplit: the base
    model alone under ``disable_adapter()`` (a DPO reference model's forward), the adapters
    merged into the split base layers (``merge_adapter``: each rank's slice of ``B @ A``) and
    unmerged again. Returns the cases that differ."""
    wrong = []
    for make in (llama_lora, gpt2_lora, llama_dora):
        torch.manual_seed(0)
        ref = make().double().eval()
        split = filter_parallel(copy.deepcopy(ref), SPEEDS[: wrap(group).size], group).eval()
        ids = batch(3)
        with torch.no_grad():
            with ref.disable_adapter():
                base = loss_of(ref, ids)[0]  # the logits
            want = loss_of(ref, ids)[0]
            with split.disable_adapter():
                got = {"disabled": (loss_of(split, ids)[0], base)}
            split.merge_adapter()
            got["merged"] = (loss_of(split, ids)[0], want)
            split.unmerge_adapter()
            got["unmerged"] = (loss_of(split, ids)[0], want)
        name = make.__name__
        wrong += [f"{name} {k}" for k, (a, b) in got.items() if rel(a, b) > 1e-10]
        wrong += [f"{name}: the adapters change nothing"] * bool(rel(base, want) < 1e-2)
    return wrong


def _saved_adapters_load_unsplit(group: Any, tuned: nn.Module) -> str:
    """A split LoRA model's adapters, saved as PEFT saves them: ``save_pretrained`` of the split
    model refuses its slices; given the gathered state dict on rank 0 it writes the adapters,
    which load into the unsplit base model in one process (``PeftModel.from_pretrained``) and
    compute the split model's loss. Returns what went wrong, or "loads unsplit"."""
    import shutil
    import tempfile

    import torch.distributed as dist
    from peft import PeftModel

    rank = wrap(group).rank
    where = [tempfile.mkdtemp() if rank == 0 else ""]
    dist.broadcast_object_list(where, src=0)
    try:
        tuned.save_pretrained(where[0])
        return "saved this rank's slices"
    except ValueError as e:
        if "holds this rank's slices" not in str(e):
            return str(e)
    full = gather_state_dict(tuned, dst=0)
    if rank == 0:
        tuned.save_pretrained(where[0], state_dict=full)
    dist.barrier()
    torch.manual_seed(0)  # the base model's weights, as lora_heads made them
    loaded = PeftModel.from_pretrained(llama().double(), where[0]).eval()
    ids = batch(7)
    with torch.no_grad():  # no dropout in evaluation
        want, got = loss_of(loaded, ids)[1].item(), loss_of(tuned.eval(), ids)[1].item()
    same = abs(got - want) <= 1e-10 * abs(want)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(where[0])
    return "loads unsplit" if same else "another loss"


def _same_on_every_rank(group: Any, t: torch.Tensor) -> bool:
    """Whether ``t`` is bitwise the same tensor on every rank."""
    import zlib

    mine = zlib.crc32(t.detach().contiguous().numpy().tobytes())
    rows = wrap(group).allgather_int64(torch.tensor([mine]).numpy(), None)
    return bool((rows == rows[0]).all())


def _deberta_v2(dropout: float) -> nn.Module:
    """Hugging Face DeBERTa-v2 from a tiny config: relative attention (position buckets, both
    position terms, shared keys), ``dropout`` everywhere, float64."""
    import transformers

    cfg = transformers.DebertaV2Config(
        vocab_size=VOCAB, hidden_size=24, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=16, hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout, pad_token_id=0, relative_attention=True,
        position_buckets=8, max_relative_positions=16, pos_att_type=["p2c", "c2p"],
        norm_rel_ebd="layer_norm", share_att_key=True, position_biased_input=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.DebertaV2ForMaskedLM(cfg).double()


def dropout(group: Any) -> dict[str, Any]:
    """Dropout on the rank's heads (BERT's attention probabilities) and on whole tensors (its
    hidden states), and a chain whose pairs drop the rank's channels between their layers and
    whole tensors after: the ranks' copies of whole tensors stay the same, step after step.
    The split parts drew a number of random values that differs per rank, so the next
    dropout on a whole tensor drew other masks on each rank: the ranks' replicated hidden
    states (and then their LayerNorm weights) drifted apart, silently. Ranks seeded apart
    raise on every rank at the forward, naming the generators."""
    import transformers

    size = wrap(group).size
    speeds = [1.0, 0.4, 0.7][:size]
    cfg = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.2,
        attention_probs_dropout_prob=0.2, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    bert = filter_parallel(transformers.BertForMaskedLM(cfg).double(), speeds, group)
    chain = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 12), nn.Dropout(0.3),
        nn.Linear(12, 10), nn.ReLU(), nn.Dropout(0.3), nn.Linear(10, 5),
    ).double()  # fmt: skip
    chain = filter_parallel(chain, speeds, group)
    seen: dict[str, torch.Tensor] = {}
    bert.get_submodule("bert.encoder.layer.1.output.LayerNorm").register_forward_hook(
        lambda m, i, o: seen.__setitem__("hidden", o)
    )
    chain.get_submodule("4").register_forward_hook(lambda m, i, o: seen.__setitem__("chain", o))
    torch.manual_seed(5)  # the same seed on every rank
    ids = torch.randint(1, VOCAB, (4, 8), generator=torch.Generator().manual_seed(0))
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    opt = torch.optim.Adam([*bert.parameters(), *chain.parameters()], lr=1e-2)
    same = []
    for _ in range(3):
        loss = bert(input_ids=ids, labels=ids).loss + chain(x).pow(2).mean()
        same += [
            _same_on_every_rank(group, seen["hidden"]),
            _same_on_every_rank(group, seen["chain"]),
        ]
        loss.backward()
        opt.step()
        opt.zero_grad()
    norms = torch.cat(
        [p.detach().flatten() for n, p in bert.named_parameters() if "LayerNorm" in n]
    )
    torch.manual_seed(wrap(group).rank)  # seeded apart
    try:
        bert(input_ids=ids)
        apart = "no error"
    except CollectiveMismatchError as e:
        apart = str(e).split(" (rank 0")[0]
    bert.eval()
    bert(input_ids=ids)  # no dropout in evaluation: not checked
    # DeBERTa-v2 drops its whole relative-position table inside the attention split by heads
    # (pos_dropout): that mask is every rank's, or the table's gradients differ per rank.
    deberta = filter_parallel(_deberta_v2(dropout=0.2), speeds, group)
    torch.manual_seed(5)
    opt = torch.optim.SGD(deberta.parameters(), lr=0.1)
    for _ in range(2):
        deberta(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    table = deberta.get_parameter("deberta.encoder.rel_embeddings.weight")
    # Ranks on several kinds of device (here the last one says it runs on another kind) draw
    # on the CPU (CpuDraws, in force through the forward): their CPU generators must agree.
    from hetcoll.torch.filters import streams

    bert.train()
    kind, mixed = streams.device_kind, []
    if wrap(group).rank == size - 1:
        streams.device_kind = lambda model: len(streams.DEVICE_KINDS)  # type: ignore[assignment]
    stack = torch.overrides._get_current_function_mode_stack
    bert.get_submodule("bert.encoder.layer.0").register_forward_hook(
        lambda m, i, o: mixed.append(any(isinstance(d, streams.CpuDraws) for d in stack()))
    )
    try:
        torch.manual_seed(5)
        bert(input_ids=ids, labels=ids).loss.backward()
        kinds_same = _same_on_every_rank(group, seen["hidden"])
        torch.manual_seed(wrap(group).rank)
        try:
            bert(input_ids=ids)
            kinds_apart = "no error"
        except CollectiveMismatchError as e:
            kinds_apart = str(e).split(" (rank 0")[0]
    finally:
        streams.device_kind = kind  # type: ignore[assignment]
    return {
        "same": all(same),
        "norms": _same_on_every_rank(group, norms),
        "deberta": _same_on_every_rank(group, table),
        "apart": apart,
        "kinds": {"same": kinds_same, "cpu draws": mixed == [True], "apart": kinds_apart},
        "jitter": _jitter(group),
    }


def _jitter(group: Any) -> dict[str, Any]:
    """Mixtral's router jitter (uniform noise on each block's hidden states in training, a
    draw on a whole tensor): seeded alike, the ranks' blocks see the same noise, their whole
    tensors the same after two steps; seeded apart, every rank raises at the forward, naming
    the generators. Before, it was no draw the check saw: seeded apart, each rank's experts
    ran on other noise, and their sum agreed on every rank, wrong."""
    torch.manual_seed(0)
    model = mixtral()
    for m in model.modules():
        if hasattr(m, "jitter_noise"):
            m.jitter_noise = 0.2
    split = filter_parallel(model.double(), speeds=SPEEDS[: wrap(group).size], group=group)
    torch.manual_seed(5)  # the same seed on every rank
    opt = torch.optim.SGD(split.parameters(), lr=0.1)
    for step in range(2):
        loss_of(split, batch(step))[1].backward()
        opt.step()
        opt.zero_grad()
    norms = torch.cat([p.detach().flatten() for n, p in split.named_parameters() if "norm" in n])
    torch.manual_seed(wrap(group).rank)  # seeded apart
    try:
        loss_of(split, batch(0))
        apart = "no error"
    except CollectiveMismatchError as e:
        apart = str(e).split(" (rank 0")[0]
    return {"same": _same_on_every_rank(group, norms), "apart": apart}


def run_parts(rank: int, world: int, parts: tuple[str, ...]) -> dict[str, Any]:
    """Several parts in one gloo job, each rank's result of each by name: ``"all"``
    (:func:`run_all`), ``"architectures"`` (:func:`architectures`), ``"experts"``
    (:func:`experts`), ``"empty"`` (:func:`empty_blocks`
    alone: on 4 ranks, where Llama's 3 key/value groups need a rank that holds none),
    ``"lora"`` (:func:`lora_more`). One job
    for the parts of one rank count, as each rank's imports (torch, transformers) take
    seconds."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*bos_token_id|.*eos_token_id")
    run = {
        "all": run_all,
        "architectures": architectures,
        "experts": experts,
        "empty": empty_blocks,
        "lora": lora_more,
    }
    return {part: run[part](None) for part in parts}
