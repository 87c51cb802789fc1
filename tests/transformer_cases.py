"""Transformers through plans, inside every rank of a real 4-rank job (gloo through launch.spawn,
or MPI): Hugging Face GPT-2 (its head tied to its embedding), Llama (grouped-query attention,
rotary embeddings passed beside the hidden states) and T5 (an encoder-decoder), built from
configs with eager attention,
and a user's language model around ``torch.nn.TransformerEncoderLayer`` (a position table
between its blocks, a padding mask as a keyword input). Each is cut between its blocks
(``model_layers``), fed keyword inputs ``{"input_ids", "attention_mask"}`` with padded labels
(-100), and trained a few SGD-momentum steps under pipelines with uneven stages and
micro-batches, asymmetric replicas and a stage split over two ranks; losses and
``full_state_dict()`` must equal one process averaging over the valid tokens of the same global
batches: 1e-10 relative in float64, except Llama where rows are split (its rotary embedding
computes cos/sin in float32: one process's full batch and the token-weighted sum of its
sub-batches already differ by ~1e-7; see REFERENCES.md), compared at 1e-6.
"""

from __future__ import annotations

import copy
import functools
import re
import warnings
from functools import partial
from typing import Any

import torch
from plan_cases import three_replicas
from torch import nn

from hetcoll import Plan
from hetcoll.collectives import allreduce
from hetcoll.comm import agree, wrap
from hetcoll.torch import parallelize
from hetcoll.torch.filters import FilterParallelExperts, FilterParallelLayer, filter_shares
from hetcoll.torch.layers import model_layers

from lm_common import PLAIN, hf_falcon, hf_gpt2, hf_llama, hf_mixtral, hf_t5

TOL = 1e-10
VOCAB = 48
SEQ = 9


def gpt2() -> nn.Module:
    return hf_gpt2(vocab=VOCAB, hidden=16, layers=4, heads=4, positions=32)


def llama(kv_heads: int = 2) -> nn.Module:
    return hf_llama(
        vocab=VOCAB, hidden=16, intermediate=24, layers=4, heads=4, kv_heads=kv_heads, positions=32
    )


def falcon() -> nn.Module:
    """Falcon-7B's layout: multi-query attention packed in one projection (the query heads,
    then one key and one value head, which a split stage's ranks hold whole)."""
    return hf_falcon(vocab=VOCAB, hidden=16, layers=4, heads=4)


def mixtral(implementation: str = "eager") -> nn.Module:
    """A mixture of experts (Hugging Face Mixtral): 4 experts of 40 hidden units, 2 per token.
    A stage split over several ranks splits its attention by heads and its experts by hidden
    units."""
    return hf_mixtral(
        vocab=VOCAB, hidden=16, layers=4, heads=4, kv_heads=2, experts=4, intermediate=40,
        implementation=implementation,
    )  # fmt: skip


def mixtral_grouped_mm() -> nn.Module:
    """:func:`mixtral` run by ``grouped_mm`` (Hugging Face's default: float32 and 16-bit
    only), whose experts run on the meta device."""
    return mixtral("grouped_mm")


def deepseek() -> nn.Module:
    """Hugging Face DeepSeek-V3: multi-head latent attention (4 heads), a dense first block,
    then experts of 32 hidden units (2 of 4 per token) beside a shared expert."""
    import transformers

    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=8, kv_lora_rank=8,
        qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4, moe_intermediate_size=32,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        first_k_dense_replace=1, experts_implementation="eager", max_position_embeddings=32,
        **PLAIN,
    )  # fmt: skip
    return transformers.DeepseekV3ForCausalLM(config)


def mamba() -> nn.Module:
    """Hugging Face Mamba: a state-space model, no attention (its selective scan in torch's
    ops); its head casts the logits to float32."""
    import transformers

    config = transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=16, state_size=8, num_hidden_layers=4, expand=2,
        conv_kernel=4, use_mamba_kernels=False,
        **{k: v for k, v in PLAIN.items() if k != "attn_implementation"},
    )  # fmt: skip
    return transformers.MambaForCausalLM(config)


def jamba() -> nn.Module:
    """Hugging Face Jamba: Mamba mixers and attentions in turn (grouped-query, 2 key/value
    groups), each attention's block with experts (2 of 4 per token), each mixer's with a
    dense MLP; its router and norms compute in float32."""
    import transformers

    config = transformers.JambaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
        use_mamba_kernels=False, experts_implementation="eager", **PLAIN,
    )  # fmt: skip
    return transformers.JambaForCausalLM(config)


def deberta() -> nn.Module:
    """Hugging Face DeBERTa-v2: disentangled attention reading a relative position table
    (``deberta.encoder.rel_embeddings``) that no forward calls, its weight read by the
    encoder's own code: no block, its parameters on every stage."""
    import transformers

    config = transformers.DebertaV2Config(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=24, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        max_position_embeddings=32, relative_attention=True, position_buckets=8,
        max_relative_positions=16, pos_att_type=["p2c", "c2p"], pad_token_id=0,
    )  # fmt: skip
    return transformers.DebertaV2ForMaskedLM(config)


def albert() -> nn.Module:
    """Hugging Face ALBERT: one layer group whose weights every layer shares, called once
    per layer (3), so the encoder around it is one block; its head's decoder tied to the
    token embedding."""
    import transformers

    config = transformers.AlbertConfig(
        vocab_size=VOCAB, embedding_size=8, hidden_size=16, num_hidden_layers=3,
        num_attention_heads=4, intermediate_size=24, max_position_embeddings=32,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0,
    )  # fmt: skip
    return transformers.AlbertForMaskedLM(config)


def funnel() -> nn.Module:
    """Hugging Face Funnel: its encoder's blocks a ModuleList of ModuleLists (two layers
    each), which its forward iterates, never calls: their layers are the blocks."""
    import transformers

    config = transformers.FunnelConfig(
        vocab_size=VOCAB, block_sizes=[2, 2], num_decoder_layers=1, d_model=16, n_head=4,
        d_head=4, d_inner=24, hidden_dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, max_position_embeddings=32, pad_token_id=0,
    )  # fmt: skip
    return transformers.FunnelForMaskedLM(config)


class Llava(nn.Module):
    """Hugging Face Llava (a CLIP vision tower of 2 layers, its projector and a Llama of 2)
    on token batches: an image made of the ids (a fixed projection) takes the 4 image tokens
    put before them, and the logits of the text are read. Llava picks its vision feature out
    of the hidden states Hugging Face records with hooks on the tower's layers (the second to
    last, by default)."""

    IMAGE_TOKENS = 4

    def __init__(self) -> None:
        super().__init__()
        import transformers

        text = transformers.LlamaConfig(
            vocab_size=VOCAB + 1, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, **PLAIN,
        )  # fmt: skip
        vision = transformers.CLIPVisionConfig(
            hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
            image_size=16, patch_size=8, num_channels=3, projection_dim=16,
        )  # fmt: skip
        config = transformers.LlavaConfig(
            text_config=text, vision_config=vision, image_token_id=VOCAB,
            vision_feature_layer=-2, vision_feature_select_strategy="default",
        )  # fmt: skip
        config._attn_implementation = "eager"
        self.inner = transformers.LlavaForConditionalGeneration(config)
        self.register_buffer("pixels", torch.randn(SEQ * VOCAB, 3 * 16 * 16))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        rows, k = len(input_ids), self.IMAGE_TOKENS
        onehot = nn.functional.one_hot(input_ids, VOCAB).to(self.pixels.dtype).flatten(1)
        image = (onehot @ self.pixels).reshape(rows, 3, 16, 16)
        ids = torch.cat([torch.full((rows, k), VOCAB, dtype=input_ids.dtype), input_ids], 1)
        mask = torch.cat([torch.ones_like(attention_mask[:, :k]), attention_mask], 1)
        out = self.inner(input_ids=ids, attention_mask=mask, pixel_values=image)
        return out.logits[:, k:, :VOCAB]


def after_projector(n: int, cut: int = 6) -> dict[str, Any]:
    """Two replicas of two stages: Llava's vision tower and projector (its first 6 layers),
    then its language model, 2 micro-batches each (or cut before layer ``cut``)."""
    stages = [[0, cut], [cut, n]]
    return {
        "microbatches": 2,
        "schedule": "1F1B",
        "replicas": [
            {"samples": 4, "stages": [{"ranks": [r], "layers": s} for r, s in zip(ranks, stages)]}
            for ranks in ([0, 1], [2, 3])
        ],
    }


class T5(nn.Module):
    """Hugging Face T5, an encoder-decoder, on keyword inputs: the encoder reads the ids under
    the padding mask, the decoder reads them too (its cross-attentions the encoder's output).
    Its blocks (registration order) include a tied embedding no block calls (``t5.shared``)
    and each stack's dropout, called before its first block and after its last norm: code
    between blocks, which every stage runs. The first self-attention of each stack holds the
    relative position bias of every head and hands it to the others."""

    def __init__(self) -> None:
        super().__init__()
        self.t5 = hf_t5(vocab=VOCAB, hidden=16, kv=4, ff=24, layers=2, heads=4)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        return self.t5(
            input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=input_ids
        )


class MBart(nn.Module):
    """Hugging Face MBart in a user's module, which brings no example inputs of its own:
    each stack's ``layernorm_embedding`` is registered after its layers but called before
    them. The blocks are in call order by the example inputs of the model inside (its
    ``dummy_inputs``, those the wrapper's forward takes); in registration order no cut inside
    a stack could run ("a block with parameters out of call order")."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        config = transformers.MBartConfig(
            vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=24,
            decoder_ffn_dim=24, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
            activation_dropout=0.0, use_cache=False, pad_token_id=0, attn_implementation="eager",
        )  # fmt: skip
        self.mbart = transformers.MBartForConditionalGeneration(config)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        return self.mbart(
            input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=input_ids
        )


class EncoderLM(nn.Module):
    """A user's own language model: embedding, a learned position table (a parameter outside
    every block), torch's encoder layers with a causal and a padding mask, a head."""

    def __init__(self, layers: int = 4, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.positions = nn.Parameter(torch.randn(1, 32, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[1]
        h = self.embed(input_ids) + self.positions[:, :n]
        causal = nn.Transformer.generate_square_subsequent_mask(n, dtype=h.dtype)
        h = self.encoder(h, mask=causal, src_key_padding_mask=attention_mask == 0, is_causal=True)
        return self.head(h)


def logits_of(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.logits


def lm_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, the mean over the valid (not -100) labels."""
    logits = logits_of(output)[:, :-1]
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
    )


def valid_tokens(labels: torch.Tensor) -> int:
    return int((labels[:, 1:] != -100).sum())


def batches(batch: int, steps: int) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """Token batches whose rows have different lengths (padding at the end, masked, labels
    -100 there), so that micro-batches hold different numbers of valid tokens."""
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        ids = torch.randint(1, VOCAB, (batch, SEQ), generator=g)
        lengths = torch.randint(2, SEQ + 1, (batch,), generator=g)
        mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
        labels = ids.masked_fill(mask == 0, -100)
        out.append(({"input_ids": ids * mask, "attention_mask": mask}, labels))
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / max(float(b.abs().max()), 1e-30))


def reference(
    model: nn.Module, data: list[Any], lr: float, clip: float | None = None
) -> tuple[list[float], dict[str, Any]]:
    """One process, the whole batch; with ``clip``, each step's gradients clipped to that
    norm (torch's; it must clip)."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for x, y in data:
        loss = lm_loss(model(**x), y)
        loss.backward()
        if clip is not None:
            assert torch.nn.utils.clip_grad_norm_(model.parameters(), clip) > clip
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, model.state_dict()


def equals_one_process(
    group: Any,
    make: Any,
    plan: Plan,
    *,
    tol: float = TOL,
    steps: int = 2,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float64,
    clip: float | None = None,
    traffic: bool = True,
    scaler: Any = None,
    compiled: type[nn.Module] | None = None,
    evaluated: bool = False,
) -> dict[str, int]:
    """``plan`` trains ``make()`` (in ``dtype``) like one process on the CPU; with ``device``
    this rank's part of the model lives there (a GPU rank beside CPU ranks); with ``clip``,
    both clip each step's gradients to that norm (:meth:`Parallel.clip_grad_norm_`); with
    ``traffic``, a split stage's bytes are checked (:func:`split_stage`: each split layer
    called once per forward); with ``scaler``, the plan scales its losses by it (unscaled
    before the clip; a power of two: the same numbers in float64); with ``compiled``, the
    modules of that class among the plan's are each compiled after parallelize (their
    ``compile()``, torch's regional compilation); with ``evaluated``, the plan first evaluates
    the first batch under ``torch.inference_mode()`` (its loss one process's)."""
    torch.manual_seed(0)
    model = make().to(dtype)
    data = batches(plan.batch, steps)
    want_losses, want_state = reference(model, data, 0.1, clip)
    if device is not None:
        model = copy.deepcopy(model).to(device)
    par = parallelize(model, plan, loss_fn=lm_loss, items=valid_tokens, group=group)
    for m in par.modules() if compiled is not None else ():
        if isinstance(m, compiled):
            m.compile(backend="aot_eager")
    if evaluated:  # the untrained model's loss (no dropout: eval() changes nothing)
        par.eval()
        with torch.inference_mode():
            loss = par.step(*data[0])
        assert abs(loss - want_losses[0]) <= tol * abs(want_losses[0]), (loss, want_losses[0])
        par.train()
    opt = torch.optim.SGD(par.parameters(), lr=0.1, momentum=0.9)
    for (x, y), want in zip(data, want_losses, strict=True):
        loss = par.step(x, y, scaler=scaler)
        assert abs(loss - want) <= tol * abs(want), (loss, want)
        if scaler is not None:
            scaler.unscale_(opt)
        if clip is not None:
            assert par.clip_grad_norm_(clip) > clip
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
    split_stage(par, traffic)
    if device is not None:
        assert all(p.device == device for p in par.parameters())
    got = par.full_state_dict()
    assert list(got) == list(want_state), (list(got)[:5], list(want_state)[:5])
    for k, v in want_state.items():
        if k.endswith(("key_proj.bias", "attention.key.bias", "k_head.bias", "attn.k_proj.bias")):
            # A bias on the keys moves no attention score (softmax ignores a shift per query:
            # DeBERTa's pos_key_proj, ALBERT's key, Funnel's k_head, CLIP's k_proj): its
            # gradient and updates
            # are rounding noise (~1e-18),
            # which differ between any two summation orders: bounded absolutely.
            assert float((got[k].cpu() - v).abs().max()) <= tol, k
        elif v.is_floating_point():
            assert rel(got[k].cpu(), v) <= tol, (k, rel(got[k].cpu(), v))
        else:
            assert torch.equal(got[k].cpu(), v), k
    return par.traffic()


def split_stage(par: Any, traffic: bool = True) -> None:
    """On a rank of a stage split over several ranks, every attention is split by heads and
    every MLP by hidden units, paired (no layer of a block gathers its output; only the head,
    outside the blocks, may); with ``traffic``, the last step's bytes are those of a
    reduction per split block and micro-batch each way."""
    if par.place is None:
        return
    i, j = par.place
    if len(par.plan.replicas[i].stages[j].ranks) < 2:
        return
    modes = {n: m.mode for n, m in par.stage.named_modules() if isinstance(m, FilterParallelLayer)}
    attentions = (".attn", ".self_attn", ".self_attention", ".SelfAttention", ".EncDecAttention")
    heads = [
        n
        for n, m in par.stage.named_modules()
        if n.endswith(attentions) or (n.endswith(".attention") and hasattr(m, "query"))
    ]
    # Outside the blocks' attentions and MLPs: the head, ALBERT's projection of its
    # embeddings and its masked-LM head's dense layer; a Mamba mixer's projections, whose
    # weights its forward reads itself (they gather).
    outside = ("lm_head", "head", "embedding_hidden_mapping_in", "predictions.dense")
    outside += tuple(f".mamba.{p}" for p in ("in_proj", "x_proj", "out_proj"))
    # A mixer's block (Jamba's) has an MLP or experts beside it, as an attention's has.
    mixers = [n for n, _ in par.stage.named_modules() if n.endswith(".mamba")]
    assert heads and all(m != "gather" for n, m in modes.items() if not n.endswith(outside)), modes
    # A mixture of experts' experts split by each expert's hidden units on the stage's ranks:
    # its block has one pair of layers for its attention, one more only beside a shared
    # expert (DeepSeek's), and the experts module.
    # (The innermost module, where PEFT's LoRA on their parameters wraps them.)
    experts = [
        m
        for n, m in par.stage.named_modules()
        if re.search(r"\.(mlp|feed_forward)\.experts(\.base_layer)*$", n)
        and not hasattr(m, "base_layer")
    ]
    assert all(isinstance(e, FilterParallelExperts) for e in experts), experts
    shared = [n for n in modes if ".shared_expert" in n and modes[n] == "split-input"]
    # A decoder's cross-attention (T5's) shares its block's MLP: one pair more, not two.
    cross = [n for n in heads if n.endswith(".EncDecAttention")]
    rows = 2 * len(heads) + len(mixers) - len(experts) + len(shared) - len(cross)
    # (A LoRA row's adapter splits along its input beside its base layer: counted once.)
    split_rows = [n for n, m in modes.items() if m == "split-input" and ".lora_A." not in n]
    assert len(split_rows) == rows, modes
    if par.plan.replicas[i].stages[j].empty_blocks:  # a slow rank holds none of some block
        rows = [m for m in par.stage.modules() if getattr(m, "mode", "") == "split-input"]
        assert rows and any(0 in m.shares for m in rows), modes
    if par.plan.replicas[i].stages[j].loss_parallel:
        # The head's logits stay split by vocabulary through the loss (a tied head with its
        # embedding): nothing gathers them, so no gather is counted below.
        from hetcoll.torch.filters import FilterParallelEmbedding

        # (A tied head the plan's shares leave out stays replicated: none gathers then.)
        heads_of = [m for m in par.stage.modules() if getattr(m, "mode", "") == "gather"]
        assert all(m.split_output for m in heads_of), modes
        tied = [m for m in par.stage.modules() if isinstance(m, FilterParallelEmbedding)]
        assert all(any(h.weight is e.weight for h in heads_of) for e in tied)
        return
    if not traffic:
        return
    # The last step's bytes: per micro-batch, two reductions of rows x SEQ x hidden per block
    # forward (attention, MLP) and two backward (their inputs' gradients); the head, when it is
    # split (not tied), gathers its logits forward and reduces its input's gradient backward.
    # One reduction's cost is measured here on the stage's counting communicator: what its
    # algorithm sends without the agreement check, which the split model makes once per
    # forward (a micro-batch's) on its inputs instead of once per reduction.
    traffic = par.traffic()
    comm = par._stage_comm
    dtype = next(par.stage.parameters()).dtype  # the model's: what its reductions send
    item = torch.empty((), dtype=dtype).element_size()
    p = comm.size
    heads_out = [m for m in par.stage.modules() if isinstance(m, FilterParallelLayer)]
    gathers = [m for m in heads_out if m.mode == "gather"]
    hidden = next(m for m in heads_out if m.mode == "split-input").out_features
    forward = backward = 0
    comm.kind = "probe"
    agree(comm, {"one field": 0})
    agreement = comm.counts.pop("probe")
    rows_in = [m for m in heads_out if m.mode == "split-input"]
    # Multi-query attention's key and value, whole on every rank of the stage (their own
    # projections, or rows packed with the query heads): their gradients are summed over its
    # ranks in each micro-batch's backward.
    whole_kv = [
        q.numel()
        for n, m in par.stage.named_modules()
        if n.endswith(("k_proj", "v_proj")) and not isinstance(m, FilterParallelLayer)
        for q in m.parameters()
    ]
    for m in heads_out:
        if getattr(m, "whole", ()):
            per_row = m.weight.numel() // m.weight.shape[m.weight_out_dim]
            whole_kv += [sum(m.whole) * per_row] + ([sum(m.whole)] if m.bias is not None else [])
    # A latent attention's (DeepSeek's) latent norms, whole on every rank ahead of its heads:
    # their weights' gradients are summed too.
    latent = [
        par.stage.get_submodule(n)
        for n in heads
        if hasattr(par.stage.get_submodule(n), "kv_a_proj_with_mqa")
    ]
    whole_kv += [
        q.numel()
        for a in latent
        for norm in ("q_a_layernorm", "kv_a_layernorm")
        if hasattr(a, norm)
        for q in getattr(a, norm).parameters()
    ]
    # T5's tables of a position bias per head (replicated, each rank reading its heads'
    # columns): their gradients are summed too.
    whole_kv += [
        m.weight.numel()
        for n, m in par.stage.named_modules()
        if n.endswith(".relative_attention_bias")
    ]
    for n in whole_kv:
        comm.kind = "probe"
        allreduce(torch.zeros(n, dtype=dtype), comm, check=False)
        backward += comm.counts.pop("probe") * len(par.plan.microbatch_sizes(i))
    if whole_kv:  # each backward's sums start by agreeing on which of them are frozen
        backward += agreement * len(par.plan.microbatch_sizes(i))
    for rows in par.plan.microbatch_sizes(i):
        comm.kind = "probe"
        allreduce(torch.zeros(rows * SEQ * hidden, dtype=dtype), comm, check=False)
        reduction = comm.counts.pop("probe")
        # A block held by one rank alone (empty_blocks) broadcasts from it instead: it sends
        # the buffer to each other rank, they send nothing.
        blocks = 0
        for m in rows_in:
            holders = [r for r, s in enumerate(m.shares) if s > 0]
            if len(holders) > 1:
                blocks += reduction
            elif holders == [m.rank]:
                blocks += (p - 1) * rows * SEQ * hidden * item
        # Each experts module sums its output forward, and the gradients of its hidden states
        # and of its routing weights (top_k per token, float32: the routers') backward.
        blocks += len(experts) * reduction
        for e in experts:
            comm.kind = "probe"
            weights = torch.zeros(rows * SEQ * e.config.num_experts_per_tok)
            allreduce(weights, comm, check=False)
            backward += comm.counts.pop("probe")
        # A latent attention copies no hidden states: the gradients of its latent
        # projections' outputs are summed instead.
        for a in latent:
            backward -= reduction
            for proj in ("q_a_proj", "kv_a_proj_with_mqa"):
                if hasattr(a, proj):
                    comm.kind = "probe"
                    out = getattr(a, proj).out_features
                    allreduce(torch.zeros(rows * SEQ * out, dtype=dtype), comm, check=False)
                    backward += comm.counts.pop("probe")
        forward += agreement + blocks
        # A cross-attention's keys and values read the encoder's output: its gradient summed
        # (broadcast from a rank holding all its heads).
        for name in cross:
            key = par.stage.get_submodule(f"{name}.k")
            holders = [r for r, s in enumerate(key.shares) if s > 0]
            if len(holders) > 1:
                backward += reduction
            elif holders == [key.rank]:
                backward += (p - 1) * rows * SEQ * hidden * item
        forward += sum((p - 1) * rows * SEQ * m.shares[m.rank] * item for m in gathers)
        backward += blocks + len(gathers) * reduction
    assert traffic["activations"] == forward, (traffic, forward)
    assert traffic["gradients"] == backward, (traffic, backward)


def pipeline_4(n: int, cuts: list[int] | None = None) -> dict[str, Any]:
    """Four uneven stages over ``n`` layers (cut at ``cuts``, default after 2, n / 2 and n -
    2), three uneven micro-batches (3, 2, 2), 1F1B."""
    cuts = [0, *(cuts or [2, n // 2, n - 2]), n]
    return {
        "microbatches": 3,
        "schedule": "1F1B",
        "replicas": [
            {
                "samples": 7,
                "stages": [{"ranks": [r], "layers": [cuts[r], cuts[r + 1]]} for r in range(4)],
            }
        ],
    }


def hybrid(n: int, empty_blocks: bool = False, cut: int = 3) -> dict[str, Any]:
    """A 2-stage pipeline replica (cut after ``cut`` layers) beside a stage split over two
    ranks: asymmetric replicas, GPipe. With ``empty_blocks`` the split stage's second rank is
    too slow (0.1) for a whole key/value group or head: it holds none."""
    split: dict[str, Any] = {"ranks": [2, 3], "speeds": [1.0, 0.5], "layers": [0, n]}
    if empty_blocks:
        split.update(speeds=[1.0, 0.1], empty_blocks=True)
    return {
        "microbatches": 2,
        "schedule": "GPipe",
        "replicas": [
            {
                "samples": 4,
                "stages": [{"ranks": [1], "layers": [0, cut]}, {"ranks": [0], "layers": [cut, n]}],
            },
            {
                "samples": 3,
                "stages": [split],
            },
        ],
    }


def split_three(n: int) -> dict[str, Any]:
    """A stage split over ranks 0, 1 and 2 (speeds 1 : 1 : 0.5) beside a whole-model replica on
    rank 3: more ranks than Llama's 2 key/value groups, so its attention splits by query
    head."""
    return {
        "replicas": [
            {
                "samples": 5,
                "stages": [{"ranks": [0, 1, 2], "speeds": [1.0, 1.0, 0.5], "layers": [0, n]}],
            },
            {"samples": 2, "stages": [{"ranks": [3], "layers": [0, n]}]},
        ]
    }


def planned_split(group: Any, make: Any) -> str:
    """The planner's best plan with a stage split over several ranks, for four devices of
    speeds 1 : 1 : 0.5 : 0.1, trains ``make()`` like one process; returns its strategy.
    (:class:`EncoderLM` makes its causal mask on the CPU in its forward: its costs are counted
    on a CPU run.)"""
    from hetcoll.model import cluster_from_dict, layer_costs, plan

    model = make()
    costs = layer_costs(model, {"input_ids": (SEQ,), "attention_mask": (SEQ,)}, dtype=torch.int64)
    cluster = cluster_from_dict(
        {
            "devices": {
                f"d{i}": {
                    "flops_per_s": 1e10 * s,
                    "mem_bytes_per_s": 1e10 * s,
                    "memory_bytes": 1e10,
                }
                for i, s in enumerate((1.0, 1.0, 0.5, 0.1))
            },
            "links": {"l": {"latency_s": 1e-5, "bytes_per_s": 1e9}},
            "nodes": [{"name": f"n{i}", "device": f"d{i}", "link": "l"} for i in range(4)],
            "network": {"link": "l"},
        }
    )
    for p in plan(costs, cluster, 7, prune=False):
        if not (p.feasible and p.has_plan):
            continue
        chosen = p.to_plan()
        if any(len(st.ranks) > 1 for r in chosen.replicas for st in r.stages):
            # A language model's last stage split over several devices keeps its logits split
            # through the loss (the planner writes loss_parallel there, and only there).
            assert all(
                st.loss_parallel == (len(st.ranks) > 1 and st is r.stages[-1])
                for r in chosen.replicas
                for st in r.stages
            ), chosen.to_dict()
            tol = 1e-6 if make in (llama, mixtral) else TOL
            equals_one_process(group, make, chosen, tol=tol)
            return p.strategy
    raise AssertionError("the planner offers no plan with a split stage")


def hybrid_by_shares(make: Any, n: int) -> dict[str, Any]:
    """:func:`hybrid` with ``empty_blocks``, its split stage given by shares per module path
    (what ``filter_shares`` gives at speeds 1 : 0.1) instead of speeds."""
    plan = hybrid(n, empty_blocks=True)
    stage = plan["replicas"][1]["stages"][0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shares = filter_shares(make(), size=2, speeds=stage.pop("speeds"), empty_blocks=True)
    stage["shares"] = shares
    return plan


class OutOfOrder(nn.Module):
    """Registers ``late`` before ``early`` but calls ``early`` first (a residual around both,
    so it is not a chain): model_layers lists ``late, early``."""

    def __init__(self) -> None:
        super().__init__()
        self.late = nn.Linear(4, 3)
        self.early = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.late(self.early(x) + x)


class Branches(nn.Module):
    """Decides between blocks on the values of a block's output."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a[0](x)
        return self.a[1](h if h.sum() > 0 else -h)


def bad_input(group: Any) -> int:
    """Each mistake raises the same error on every rank; returns how many were checked."""
    checked = 0

    def raises(kind: type[BaseException], text: str, fn: Any) -> None:
        nonlocal checked
        try:
            fn()
        except kind as e:
            assert text in str(e), (text, str(e))
            checked += 1
            return
        raise AssertionError(f"no {kind.__name__} ({text})")

    two = {
        "replicas": [
            {
                "samples": 4,
                "stages": [{"ranks": [0, 1], "layers": [0, 1]}, {"ranks": [2], "layers": [1, 2]}],
            }
        ]
    }
    ce = nn.CrossEntropyLoss()
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randint(0, 3, (4,))
    par = parallelize(OutOfOrder().double(), two, loss_fn=ce, group=group)
    raises(
        ValueError, "reads the output of block 'early', which a later stage", lambda: par.step(x, y)
    )
    par = parallelize(Branches().double(), two, loss_fn=ce, group=group)
    raises(ValueError, "reads the values of block 'a.0'", lambda: par.step(x, y))
    chain = {
        "replicas": [
            {
                "samples": 4,
                "stages": [{"ranks": [0, 1], "layers": [0, 3], "empty_blocks": True}],
            }
        ]
    }
    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    raises(
        ValueError,
        "empty_blocks: Sequential is a chain of layers",
        lambda: parallelize(seq, chain, loss_fn=ce, group=group),
    )
    torch.manual_seed(0)
    model = gpt2().double()
    n = 9  # wte, wpe, drop, h.0 .. h.3, ln_f, lm_head
    plan = Plan.from_dict(pipeline_4(n))
    owners = {
        "replicas": [
            {"samples": 2, "stages": [{"ranks": [0, 1], "layers": [0, n], "owners": {"3": [0, 1]}}]}
        ]
    }
    raises(
        ValueError,
        "owners name layers of a chain",
        lambda: parallelize(model, owners, loss_fn=lm_loss, group=group),
    )
    # Shares by module path that are not whole heads (GPT-2's 4 heads of 4 features), and
    # shares by module path for a chain of layers.
    by_path = hybrid_by_shares(gpt2, n)
    split = by_path["replicas"][1]["stages"][0]
    split["shares"]["transformer.h.0.attn.c_proj"] = [15, 1]
    raises(
        ValueError,
        "shares['transformer.h.0.attn.c_proj']: [15, 1] are not whole",
        lambda: parallelize(model, by_path, loss_fn=lm_loss, group=group),
    )
    stage = {"ranks": [0, 1], "layers": [0, 3], "shares": {"0.weight": [5, 3]}}
    named = {"replicas": [{"samples": 4, "stages": [stage]}]}
    raises(
        ValueError,
        "shares: names layers by module path; Sequential is a chain",
        lambda: parallelize(seq, named, loss_fn=ce, group=group),
    )
    # A split stage with more ranks than the encoder's heads: refused on every rank, the
    # idle one too, before any transfer.
    n = len(model_layers(EncoderLM()))
    three = {
        "replicas": [
            {
                "samples": 4,
                "stages": [{"ranks": [0, 1, 2], "speeds": [1.0, 1.0, 0.5], "layers": [0, n]}],
            }
        ]
    }
    raises(
        ValueError,
        "plan.replicas[0].stages[0]: speeds: attention 'encoder.layers.0.self_attn' has 2 "
        "heads (of 8 features each), too few for 3 ranks",
        lambda: parallelize(EncoderLM().double(), three, loss_fn=lm_loss, group=group),
    )
    ((inputs, labels),) = batches(7, 1)
    # A batch of other rows than the plan's, where a rank sends nothing a step: data
    # parallelism (its check after the backward), and a rank's own replica beside a pipeline
    # (its check before the step's end; rank 3 idle).
    layers = len(model_layers(model))
    alone = [{"samples": 2, "stages": [{"ranks": [r], "layers": [0, layers]}]} for r in range(4)]
    pipeline = [{"ranks": [1], "layers": [0, 4]}, {"ranks": [2], "layers": [4, layers]}]
    for replicas in (alone, [alone[0], {"samples": 6, "stages": pipeline}]):
        par = parallelize(model, {"replicas": replicas}, loss_fn=lm_loss, group=group)
        raises(
            ValueError,
            "the plan's replicas take 8 samples a step",
            lambda par=par: par.step(inputs, labels),
        )
    par = parallelize(model, plan, loss_fn=lm_loss, items=valid_tokens, group=group)
    ragged = dict(inputs, attention_mask=inputs["attention_mask"][:6])
    raises(ValueError, "its tensors must agree on dim 0", lambda: par.step(ragged, labels))
    raises(
        TypeError, "inputs: must be a tensor or a dict of tensors", lambda: par.step([1, 2], labels)
    )
    empty = torch.full_like(labels, -100)
    raises(ValueError, "items: the batch has no items", lambda: par.step(inputs, empty))
    par = parallelize(model, plan, loss_fn=lm_loss, items=lambda y: 0.5, group=group)
    raises(ValueError, "it must return an integer >= 0", lambda: par.step(inputs, labels))
    return checked


def rows_are_the_wrong_weight(group: Any) -> bool:
    """Without ``items``, micro-batches are weighted by rows: with uneven padding that is not
    the mean over the batch's valid tokens (so the exact cases above can fail)."""
    torch.manual_seed(0)
    model = gpt2().double()
    data = batches(7, 1)
    (want,), _ = reference(model, data, 0.1)
    n = 9
    par = parallelize(model, pipeline_4(n), loss_fn=lm_loss, group=group)
    got = par.step(*data[0])
    return abs(got - want) > 1e-4 * abs(want)


def vit() -> nn.Module:
    """torchvision's ViT, small: a class token and a position table outside every block."""
    from torchvision.models import VisionTransformer

    return VisionTransformer(
        image_size=8,
        patch_size=4,
        num_layers=3,
        num_heads=2,
        hidden_dim=8,
        mlp_dim=16,
        num_classes=5,
    )


def split_first(n: int) -> dict[str, Any]:
    """A replica of one stage split over ranks 0 and 1 (the slow one holding no heads where
    the model lets it), beside a 2-stage pipeline replica: the checkpoint's tensors come from
    the split stage."""
    split = {"ranks": [0, 1], "speeds": [1.0, 0.1], "layers": [0, n], "empty_blocks": True}
    return {
        "microbatches": 2,
        "replicas": [
            {"samples": 4, "stages": [split]},
            {
                "samples": 3,
                "stages": [{"ranks": [2], "layers": [0, 3]}, {"ranks": [3], "layers": [3, n]}],
            },
        ],
    }


def resumes_on_another_plan(
    group: Any, make: Any = None, plans: tuple[dict[str, Any], dict[str, Any]] | None = None
) -> bool:
    """A checkpoint of GPT-2 (its head tied to its embedding, in different stages) taken under
    one plan — weights and Adam's state, gathered whole — resumes under another (other cuts,
    a replica), and training goes on as if uninterrupted. ``make`` and ``plans``: another
    model, and the plans it is checkpointed under and resumed under."""
    make = gpt2 if make is None else make
    plans = (pipeline_4(9), hybrid(9)) if plans is None else plans
    torch.manual_seed(0)
    model = make().double()
    data = batches(7, 4)

    def adam(params: Any) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=0.01)

    one = copy.deepcopy(model)
    opt = adam(one.parameters())
    for x, y in data:
        lm_loss(one(**x), y).backward()
        opt.step()
        opt.zero_grad()
    first = parallelize(model, plans[0], loss_fn=lm_loss, items=valid_tokens, group=group)
    opt = adam(first.parameters())
    for x, y in data[:2]:
        first.step(x, y)
        opt.step()
        opt.zero_grad()
    weights, state = first.full_state_dict(), first.full_optimizer_state_dict(opt)
    second = parallelize(
        make().double(), plans[1], loss_fn=lm_loss, items=valid_tokens, group=group
    )
    opt = adam(second.parameters())
    second.load_full_state_dict(weights)
    second.load_full_optimizer_state_dict(opt, state)
    for x, y in data[2:]:
        second.step(x, y)
        opt.step()
        opt.zero_grad()
    got = second.full_state_dict()
    return all(rel(got[k], v) <= TOL for k, v in one.state_dict().items() if v.is_floating_point())


def under_autocast(group: Any) -> bool:
    """GPT-2 in float32 through a 4-stage pipeline under CPU bf16 autocast: what crosses the
    cuts travels in the probe's float32 (autocast computed it in bf16), gradients the same way
    back; the loss within bf16's rounding of one process under autocast."""
    torch.manual_seed(0)
    model = gpt2()
    ((x, y),) = batches(7, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = float(lm_loss(copy.deepcopy(model)(**x), y))
        par = parallelize(model, pipeline_4(9), loss_fn=lm_loss, items=valid_tokens, group=group)
        got = par.step(x, y)
    grads = [p.grad for p in par.parameters() if p.grad is not None]
    return (
        abs(got - want) <= 2e-2 * abs(want)
        and bool(grads)
        and all(bool(torch.isfinite(g).all()) for g in grads)
    )


def thawed(group: Any) -> dict[str, bool]:
    """Llama's embeddings frozen when parallelize built the plan, thawed after its first step
    (a warm-up's end). Beside a trainable block on their stage (pipeline cut after
    ``model.layers.0``) they train as one process trains them. Alone on the first stage of a
    pipeline, whose output then required no gradient, no gradient crosses the cut back to
    them: the step after the thaw raises on every rank, naming the block whose output needs
    one now (it trained silently wrong: the embeddings were given no gradient)."""
    torch.manual_seed(0)
    model = llama().double()
    n = _layers(llama)
    data = batches(7, 2)

    def thaw(m: nn.Module, trains: bool) -> None:
        for name, p in m.named_parameters():
            if name == "model.embed_tokens.weight":
                p.requires_grad_(trains)

    one = copy.deepcopy(model)
    thaw(one, False)
    opt = torch.optim.SGD(one.parameters(), lr=0.1)
    for step, (x, y) in enumerate(data):
        thaw(one, step > 0)
        lm_loss(one(**x), y).backward()
        opt.step()
        opt.zero_grad()
    out = {}
    for name, cuts in (("beside a block", [3, 5, 6]), ("raised", None)):
        frozen = copy.deepcopy(model)
        thaw(frozen, False)
        plan = Plan.from_dict(pipeline_4(n, cuts))
        par = parallelize(frozen, plan, loss_fn=lm_loss, items=valid_tokens, group=group)
        opt = torch.optim.SGD(par.parameters(), lr=0.1)
        said = ""
        try:
            for step, (x, y) in enumerate(data):
                thaw(par, step > 0)
                par.step(x, y)
                opt.step()
                opt.zero_grad()
        except ValueError as e:
            said = str(e)
        if cuts is not None:
            got = par.full_state_dict()
            out[name] = not said and all(
                rel(got[k], v) <= 1e-6 for k, v in one.state_dict().items()
            )
        else:
            out[name] = "block 'model.embed_tokens'" in said or (
                wrap(group).rank != 0 and "on other ranks" in said
            )
    return out


def checkpointed(group: Any) -> bool:
    """GPT-2 under Hugging Face's gradient checkpointing (``gradient_checkpointing_enable``,
    reentrant, its default, and not) through a pipeline beside a split stage equals one
    process. Each block's forward runs again in the backward, and on the split stage's ranks
    its reductions with it (more bytes than without); a pipeline's sends do not repeat."""
    plan = Plan.from_dict(hybrid(_layers(gpt2)))
    plain = equals_one_process(group, gpt2, plan, traffic=False)
    runs = []
    for reentrant in (True, False):

        def make(reentrant: bool = reentrant) -> nn.Module:
            model = gpt2()
            model.gradient_checkpointing_enable({"use_reentrant": reentrant})
            return model

        runs.append(equals_one_process(group, make, plan, traffic=False))
    if wrap(group).rank in plan.replicas[1].stages[0].ranks:
        sent = [t["activations"] + t["gradients"] for t in (plain, *runs)]
        return all(s > sent[0] for s in sent[1:])
    return all(t == plain for t in runs)


def compiled_blocks(group: Any) -> dict[str, Any]:
    """Llama's decoder layers compiled after parallelize (each one's ``compile()``) under the
    hybrid plan (a pipeline beside a split stage) train like one process, torch.compile's
    graphs made on every rank holding one (a plan routes each block's call around its compiled
    one); compiled before, ``parallelize`` warns that the stage's copies of them run
    uncompiled. Returns whether graphs were made, and the warning's start."""
    from torch._dynamo.utils import counters
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    plan = Plan.from_dict(hybrid(_layers(llama)))
    counters.clear()
    equals_one_process(group, llama, plan, compiled=LlamaDecoderLayer)
    graphs = counters["stats"]["unique_graphs"] > 0
    model = llama()
    model.model.layers[0].compile(backend="aot_eager")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        parallelize(model, plan, loss_fn=lm_loss, group=group)
    said = [str(w.message)[:60] for w in seen if "compile" in str(w.message)]
    return {"graphs": graphs, "warned": said}


def gpt2_lora() -> nn.Module:
    """GPT-2 with PEFT's LoRA adapters (rank 4) on its attentions' and MLPs' projections: the
    base weights frozen, as a LoRA fine-tuning freezes them."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)
    return get_peft_model(gpt2(), config)


def llama_lora() -> nn.Module:
    """Llama with PEFT's LoRA adapters (rank 4) on its attentions' four projections and its
    MLPs' gate and down projections (the up projections frozen, without adapters)."""
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
    return get_peft_model(llama(), LoraConfig(r=4, lora_alpha=8, target_modules=targets))


def mixtral_lora() -> nn.Module:
    """Mixtral under PEFT's ``"all-linear"``: LoRA on its projections and on its experts' and
    router's parameters (``ParamWrapper``), the base weights frozen."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(mixtral(), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))


def lora(group: Any) -> dict[str, Any]:
    """A LoRA fine-tuning (:func:`gpt2_lora`) through a pipeline beside two whole-model
    replicas (:func:`plan_cases.three_replicas`, cut after the embeddings) equals one process,
    and the replicas sum the adapters' gradients alone: the frozen base weights cost the step
    no bytes (DDP's rule). A base weight unfrozen after parallelize raises on every rank,
    naming it where it is held (its gradient would be summed nowhere). Through a stage split
    over two ranks (:func:`hybrid`), a Llama's attentions split by heads and MLPs by hidden
    units with PEFT's wrapped projections (base layers and adapters; an MLP of wrapped and bare
    projections): the one process's numbers too; so is a Mixtral's, its experts split by
    hidden units with PEFT's LoRA on their parameters (to the router's float32)."""
    equals_one_process(
        group, llama_lora, Plan.from_dict(hybrid(_layers(llama_lora))), traffic=False
    )
    mixtral_plan = Plan.from_dict(hybrid(_layers(mixtral_lora)))
    equals_one_process(group, mixtral_lora, mixtral_plan, traffic=False, tol=1e-5)
    plan = Plan.from_dict(three_replicas(_layers(gpt2_lora), 3))
    traffic = equals_one_process(group, gpt2_lora, plan, traffic=False)
    model = gpt2_lora()
    adapters = 8 * sum(p.numel() for p in model.parameters() if p.requires_grad)  # float64
    # Every adapter is in a block, after the pipeline's cut: summed over ranks 0, 2 and 3 (a
    # ring's 2 (k - 1) / k of the buffer each); rank 1 holds the frozen embeddings alone.
    held = wrap(group).rank != 1
    summed = traffic["allreduce"] == (round(2 * 2 / 3 * adapters) if held else 0)
    par = parallelize(model.double(), plan, loss_fn=lm_loss, items=valid_tokens, group=group)
    name = "base_model.model.transformer.h.3.mlp.c_fc.weight"  # frozen, untargeted
    for held_name, p in par.named_parameters():
        if held_name == name:
            p.requires_grad_(True)
    ((x, y),) = batches(plan.batch, 1)
    said = ""
    try:
        par.step(x, y)
    except ValueError as e:
        said = str(e)
    return {
        "summed adapters alone": summed,
        "thawed": "frozen (requires_grad False) when parallelize built the plan" in said,
        "named where held": (name in said) == held,
    }


def scaled(group: Any) -> bool:
    """GPT-2 through a pipeline beside a stage split by heads, its losses scaled by a
    ShardedGradScaler (float16 training's loss scaling; the split attentions' reductions carry
    scaled gradients), unscaled before a clip by the whole model's norm: equals one process,
    unscaled, in float64. Each rank's scale grew alike (every 2 steps without an overflow)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    scaler = ShardedGradScaler(device="cpu", init_scale=2.0**8, growth_interval=2)
    plan = Plan.from_dict(hybrid(_layers(gpt2)))
    equals_one_process(group, gpt2, plan, clip=0.05, scaler=scaler)
    return scaler.get_scale() == 2.0**9


class SharedActivation(nn.Module):
    """One activation module called between every pair of blocks (a common way to write a
    model): it is code between blocks, run by every stage."""

    def __init__(self) -> None:
        super().__init__()
        self.flat = nn.Flatten()
        self.layers = nn.ModuleList([nn.Linear(192, 16), nn.Linear(16, 16), nn.Linear(16, 5)])
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.flat(x)
        for layer in self.layers[:-1]:
            x = self.act(layer(x))
        return self.layers[-1](x)


def hybrid_loss_split(n: int) -> dict[str, Any]:
    """:func:`hybrid` with its split stage's loss split by vocabulary (``loss_parallel``)."""
    plan = hybrid(n)
    plan["replicas"][1]["stages"][0]["loss_parallel"] = True
    return plan


@functools.cache
def _layers(make: Any) -> int:
    """How many layers ``make()``'s model is cut into (counted once per model)."""
    return len(model_layers(make()))


def _equal(make: Any, cut: Any, tol: float = TOL, sent: bool = False, **kwargs: Any) -> Any:
    """A case: ``make()`` under the plan ``cut(n)`` (``n``: its layers) equals one process;
    with ``sent``, every rank but the last also sent activations (a pipeline)."""

    def case(group: Any) -> bool:
        t = equals_one_process(group, make, Plan.from_dict(cut(_layers(make))), tol=tol, **kwargs)
        return not sent or t["activations"] > 0 or wrap(group).rank == 3

    return case


def _falcon_resumes(group: Any) -> bool:
    # Its checkpoint, gathered from a split stage (the slow rank holding none of the query
    # heads, the key and value rows all the same), resumes on another split.
    n = _layers(falcon)
    return resumes_on_another_plan(group, falcon, (split_first(n), hybrid(n)))


def _images(make: Any, plan: dict[str, Any]) -> Any:
    """A case: an image model (a tensor input, rows as items) under ``plan``."""

    def case(group: Any) -> bool:
        from plan_cases import equals_one_process as images_equal_one_process

        images_equal_one_process(group, make, Plan.from_dict(plan), (3, 8, 8))
        return True

    return case


#: Every case by name: a function of the group, giving what the tests expect of it.
CASES: dict[str, Any] = {}
for _name, _make in (("gpt2", gpt2), ("llama", llama), ("encoder", EncoderLM)):
    _tol = 1e-6 if _name == "llama" else TOL
    # Evaluated under inference_mode before it trains, through a pipeline and beside a split
    # stage: its training steps' micro-batches, of the evaluation's shapes, carried no
    # gradient back across the cuts (the probe made under inference_mode, where no output
    # requires one, was kept for them).
    CASES[f"{_name}_pipeline"] = _equal(_make, pipeline_4, _tol, sent=True, evaluated=True)
    # Clipped by the whole model's norm: a pipeline replica (GPT-2's head tied to its
    # embedding across its stages) beside a split stage.
    CASES[f"{_name}_hybrid"] = _equal(_make, hybrid, _tol, clip=0.05, evaluated=True)
    if _name != "encoder":
        CASES[f"{_name}_empty_blocks"] = _equal(_make, partial(hybrid, empty_blocks=True), _tol)
        CASES[f"{_name}_by_shares"] = _equal(_make, partial(hybrid_by_shares, _make), _tol)
        CASES[f"{_name}_loss_parallel"] = _equal(_make, hybrid_loss_split, _tol)
    CASES[f"{_name}_planned_split"] = lambda group, make=_make: bool(planned_split(group, make))
# An encoder-decoder: through a pipeline (the encoder's output crossing to the decoder's
# stage), a pipeline beside a split stage, its slow rank holding no heads (each rank's
# backward reaches the position-bias table at another point: its gradient is summed after
# the backward, on every rank alike), and the planner's own plan with a split stage.
CASES["t5_pipeline"] = _equal(T5, pipeline_4, sent=True)
CASES["t5_hybrid"] = _equal(T5, hybrid)
CASES["t5_empty_blocks"] = _equal(T5, partial(hybrid, empty_blocks=True))
CASES["t5_planned_split"] = lambda group: bool(planned_split(group, T5))
CASES.update(
    {
        # Multi-query attention: a split stage holds its key and value whole on each rank
        # (their own projections, or rows packed with the query heads), and the data-parallel
        # replicas sum their gradients once.
        "llama_mqa_empty_blocks": _equal(
            partial(llama, kv_heads=1), partial(hybrid, empty_blocks=True), 1e-6
        ),
        # Grouped-query attention on a stage of more ranks than its key/value groups (Llama's
        # 2, 3 ranks): split by query head, its key and value whole on each rank.
        "llama_gqa_three_ranks": _equal(llama, split_three, 1e-6),
        # A mixture of experts, whose routing (a loop over the experts its tokens reach) cannot
        # run on the meta device: through a pipeline and a stage split over three ranks.
        "mixtral_pipeline": _equal(mixtral, pipeline_4, 1e-6),
        "mixtral_three_ranks": _equal(mixtral, split_three, 1e-6),
        # Its split stage given by shares per module path (the experts' hidden units among
        # them), and the planner's own plan with a split stage (its shares balanced by
        # predicted time).
        "mixtral_by_shares": _equal(mixtral, partial(hybrid_by_shares, mixtral), 1e-6),
        "mixtral_planned_split": lambda group: bool(planned_split(group, mixtral)),
        # DeepSeek-V3: its latent attention split by heads (the latents whole on every rank),
        # its experts by hidden units, beside a dense block and shared experts.
        "deepseek_pipeline": _equal(deepseek, pipeline_4, 1e-6),
        "deepseek_three_ranks": _equal(deepseek, split_three, 1e-6),
        # The same model as Hugging Face runs it by default, in float32 (a tolerance: its sums
        # run in another order).
        "mixtral_grouped_mm": _equal(mixtral_grouped_mm, split_three, 1e-5, dtype=torch.float32),
        "falcon_hybrid": _equal(falcon, hybrid),
        # A state-space model through a pipeline: the scan's state stays inside each block.
        "mamba_pipeline": _equal(mamba, pipeline_4, 1e-6, sent=True),
        # Mixers, attentions and experts in turn, beside a split stage: its attentions split
        # by heads, its experts and MLPs by hidden units, its mixers' projections gathering.
        # (Its bytes are not counted: split_stage's count of them knows no mixer, whose
        # projections read and sum its wider inner states.)
        "jamba_hybrid": _equal(jamba, hybrid, 1e-6, traffic=False),
        # A module no forward calls whose weight the code between blocks reads, through a
        # pipeline (it failed: the table was a block of the last stage).
        "deberta_pipeline": _equal(deberta, pipeline_4, sent=True),
        # One layer group called once per layer: its encoder is one block, through a
        # pipeline (its head tied to the embedding of the other stage) and a split stage (it
        # ran under no plan: the group was a block called three times).
        # (Its one layer, called three times, makes its reductions three times per forward,
        # which split_stage's count of bytes does not model.)
        "albert_hybrid": _equal(albert, partial(hybrid, cut=2), traffic=False),
        # Blocks inside a ModuleList of ModuleLists, through a pipeline (a stage holding none
        # of them crashed: the stand-in for a list was iterated).
        "funnel_pipeline": _equal(funnel, pipeline_4, sent=True),
        # Cut inside each stack, after its first layer (MBart's layernorm_embedding before).
        "mbart_pipeline": _equal(MBart, partial(pipeline_4, cuts=[4, 10, 12]), sent=True),
        # A vision-language model cut after its vision tower: the language model's stage
        # picks the vision feature out of what Hugging Face's hooks record on the tower's
        # layers, which it does not hold (its stand-ins record alike; it raised IndexError).
        "llava_after_projector": _equal(Llava, after_projector),
        # Cut inside its language model (after its first layer): the layers of the first
        # stage read the rotary embedding, a block registered last (the wrapper brings no
        # example inputs to order them) that reads the hidden states for their dtype alone: the
        # stage computes it itself (it raised: "reads the output of block ... rotary_emb,
        # which a later stage holds").
        "llava_inside_language_model": _equal(Llava, partial(after_projector, cut=8)),
        "falcon_resumes": _falcon_resumes,
        # An image transformer: a tensor input, rows as items (conv_proj, encoder.dropout, its
        # three encoder layers, encoder.ln, heads).
        "vit_hybrid": _images(vit, hybrid(7)),
        "shared_activation": _images(
            SharedActivation,
            {
                "microbatches": 2,
                "replicas": [
                    {
                        "samples": 7,
                        "stages": [
                            {"ranks": [r], "layers": [lo, hi]}
                            for r, (lo, hi) in enumerate([(0, 2), (2, 3), (3, 4), (4, 5)])
                        ],
                    }
                ],
            },
        ),
        "rows_wrong": rows_are_the_wrong_weight,
        "resumes": resumes_on_another_plan,
        "autocast": under_autocast,
        "checkpointed": checkpointed,
        "thawed": thawed,
        "compiled_blocks": compiled_blocks,
        "scaled": scaled,
        "lora": lora,
        "errors": bad_input,
    }
)

#: What the MPI job runs of these cases (``run_all(group, "backend")``): every kind of exchange
#: between ranks the plans make (pipeline sends, a split stage's gathers and sums, the loss
#: split over a stage, experts' tokens, a checkpoint gathered and resumed, autocast, bad input
#: raising on every rank), on GPT-2, Mixtral and Falcon. The other models split by the same
#: runtime whichever backend carries its messages: the gloo job runs every case.
BACKEND = (
    "gpt2_pipeline",
    "gpt2_hybrid",
    "gpt2_empty_blocks",
    "gpt2_by_shares",
    "gpt2_loss_parallel",
    "gpt2_planned_split",
    "mixtral_pipeline",
    "mixtral_three_ranks",
    "falcon_resumes",
    "rows_wrong",
    "autocast",
    "errors",
    "lora",  # PEFT's wrapped projections split by heads on MPI too
)


def run_all(group: Any, part: str = "all") -> dict[str, Any]:
    """Each case's result by name: every case (``part="all"``), or :data:`BACKEND`."""
    assert wrap(group).size == 4 and part in ("all", "backend")
    warnings.simplefilter("ignore")  # filter_parallel names the tied head it keeps whole
    return {name: CASES[name](group) for name in (CASES if part == "all" else BACKEND)}


def run_torch(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    return run_all(None)
