"""Padded language models and data shared by the token-weighted data-parallel tests (gloo DDP
hook, MPI optimizer, Lightning): Hugging Face GPT-2 from a tiny config (eager attention) and a
decoder of the user's own around ``torch.nn.TransformerEncoder``, in float64; global batches
whose rows hold different numbers of valid labels (the rest -100), cut into uneven shares, and
one process's reference training on the same global batches. Also the builders of Hugging Face
GPT-2, Llama and T5 from a config that every transformer test's models come from (``hf_gpt2``,
``hf_llama``, ``hf_t5``: tests/transformer_cases.py, tests/tensor_parallel_cases.py)."""

from __future__ import annotations

import torch
from torch import nn

VOCAB, SEQ = 29, 8
#: Rows per rank in every step (uneven), for 2 and 3 ranks.
SHARES = {2: [3, 5], 3: [2, 3, 5]}
STEPS, LR, MOMENTUM = 3, 0.2, 0.9


def items(y: torch.Tensor) -> int:
    """What :func:`lm_loss` averages over: the valid (not -100) labels."""
    return int((y != -100).sum())


def lm_loss(out: object, y: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy over the valid labels (``y`` is already aligned with the logits:
    ``y[:, t]`` is the token after position ``t``), written two ways: for GPT-2's output (a
    ``ModelOutput``) as Hugging Face computes it, torch's mean with ``ignore_index``; for plain
    logits (the encoder LM) every position's loss masked by hand,
    ``sum(loss * mask) / mask.sum()``, as Megatron does, whose gradient is NaN on a rank
    without any valid label (what a rank weighing 0 must not send)."""
    if hasattr(out, "logits"):
        return nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten(), ignore_index=-100)
    assert isinstance(out, torch.Tensor)
    mask = y.flatten() != -100  # every position's loss, the padding's masked out
    per_token = nn.functional.cross_entropy(
        out.flatten(0, 1), y.flatten().clamp(min=0), reduction="none"
    )
    return (per_token * mask).sum() / mask.sum()


def hf_gpt2(*, vocab: int, hidden: int, layers: int, heads: int, positions: int) -> nn.Module:
    """Hugging Face GPT-2 from a config (no download): no dropout, no cache, eager attention
    (plain ops: the same numbers on any split of the rows, where SDPA's kernels differ)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab,
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        n_positions=positions,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        attn_implementation="eager",
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


#: What every config here sets: no cache, eager attention (plain ops: the same numbers on
#: any split), special tokens inside the smallest vocabulary.
PLAIN = {
    "use_cache": False,
    "attn_implementation": "eager",
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
}


def hf_llama(
    *,
    vocab: int,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    positions: int,
) -> nn.Module:
    """Hugging Face Llama from a config (no download): grouped-query attention (``kv_heads``
    key/value groups), rotary embeddings, a gated MLP ``intermediate`` wide; no cache, eager
    attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=positions,
        **PLAIN,
    )
    return LlamaForCausalLM(config)


def hf_mixtral(
    *,
    vocab: int,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    experts: int,
    implementation: str = "eager",
    intermediate: int | None = None,
    attention: str = "eager",
) -> nn.Module:
    """Hugging Face Mixtral from a config (no download): a mixture of ``experts`` gated MLPs,
    2 per token, picked by a router, in every block; run by ``implementation``: by default
    the eager one (a loop over the experts its tokens reach), as ``grouped_mm``, Hugging
    Face's default, has no float64; its ``attention`` eager by default (``"sdpa"``: Hugging
    Face's)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or hidden + hidden // 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        num_local_experts=experts,
        num_experts_per_tok=2,
        max_position_embeddings=32,
        experts_implementation=implementation,
        **{**PLAIN, "attn_implementation": attention},
    )
    return MixtralForCausalLM(config)


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    return hf_gpt2(vocab=VOCAB, hidden=16, layers=2, heads=2, positions=SEQ).double()


class EncoderLM(nn.Module):
    """A user's own decoder: token and position embeddings, a causal
    ``nn.TransformerEncoder`` (pre-norm layers) and a linear head, returning the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, 16)
        self.positions = nn.Embedding(SEQ, 16)
        layer = nn.TransformerEncoderLayer(
            16, 2, dim_feedforward=32, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        h = self.tokens(ids) + self.positions(torch.arange(n, device=ids.device))
        mask = nn.Transformer.generate_square_subsequent_mask(n, dtype=h.dtype, device=h.device)
        return self.head(self.blocks(h, mask=mask, is_causal=True))


def encoder_lm() -> nn.Module:
    torch.manual_seed(0)
    return EncoderLM().double()


MODELS = {"gpt2": gpt2, "encoder": encoder_lm}


def global_batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``STEPS`` global batches of ``sum(SHARES[world])`` rows: token ids and their next-token
    labels, each row right-padded after a random number of valid labels (0 to SEQ). In step 1
    the last rank's rows are all padding: it has no valid label (legal: it contributes
    nothing)."""
    g = torch.Generator().manual_seed(7)
    shares = SHARES[world]
    rows = sum(shares)
    out = []
    for step in range(STEPS):
        ids = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
        labels = ids[:, 1:].clone()
        valid = torch.randint(0, SEQ + 1, (rows,), generator=g)
        if step == 1:
            valid[rows - shares[-1] :] = 0
        labels[torch.arange(SEQ)[None, :] >= valid[:, None]] = -100
        out.append((ids[:, :SEQ], labels))
    return out


def rank_rows(world: int, rank: int) -> slice:
    shares = SHARES[world]
    start = sum(shares[:rank])
    return slice(start, start + shares[rank])


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def reference(name: str, world: int) -> list[torch.Tensor]:
    """One process trained on the whole global batches: the loss is the mean over every valid
    label of the global batch."""
    model = MODELS[name]()
    opt = optimizer(model)
    for x, y in global_batches(world):
        opt.zero_grad()
        lm_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def rel_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The largest relative error over the parameters."""
    return max(float((a - b).norm() / max(float(b.norm()), 1e-300)) for a, b in zip(got, want))


def hf_falcon(*, vocab: int, hidden: int, layers: int, heads: int) -> nn.Module:
    """Hugging Face Falcon from a config (no download), Falcon-7B's layout: multi-query
    attention packed in one projection (the query heads, then one key and one value head),
    ``FalconLinear`` projections, rotary embeddings, its head tied to the embedding; no
    cache, eager attention."""
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **PLAIN,
    )
    return FalconForCausalLM(config)


def hf_t5(*, vocab: int, hidden: int, kv: int, ff: int, layers: int, heads: int) -> nn.Module:
    """Hugging Face T5 (an encoder-decoder) from a config (no download): ``layers`` blocks in
    each stack, ``heads`` of ``kv`` features, an MLP of ``ff``; no dropout, no cache, eager
    attention. Built on the current default device (the meta device too)."""
    import transformers

    config = transformers.T5Config(
        vocab_size=vocab, d_model=hidden, d_kv=kv, d_ff=ff, num_layers=layers,
        num_decoder_layers=layers, num_heads=heads, dropout_rate=0.0, use_cache=False,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, attn_implementation="eager",
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)
