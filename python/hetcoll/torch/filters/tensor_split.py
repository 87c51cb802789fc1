"""Tensor parallelism of transformer blocks: which attentions split by heads and which MLPs by
hidden units (:class:`~.heads.TensorSplit`, :func:`plan_tensor_splits`), Megatron-LM's
column/row pairing found by module attributes and torch.fx graphs. It reads module types,
attributes and traced graphs only (and probe forwards on meta copies, :mod:`.head_probes`), so
a model on the meta device works."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from hetcoll.torch.filters.chains import (
    ELEMENTWISE_FUNCTIONS,
    ELEMENTWISE_METHODS,
    ELEMENTWISE_MODULES,
    has_forward,
    linear_features,
    lora_base,
    projection_features,
)
from hetcoll.torch.filters.head_probes import (
    applied_after,
    cuts_heads,
    probe_packing,
    required_inputs,
    rms_norm_eps,
    runs_with_some_heads,
    runs_without_heads,
)
from hetcoll.torch.filters.heads import TensorSplit
from hetcoll.torch.filters.layers import FilterParallelMultiheadAttention
from hetcoll.torch.replay import meta_copy, tensor_attributes_kept

# The attributes an attention module counts its heads with, where its implementation keeps
# them (Hugging Face, fairseq-style and timm-style modules): query heads, key/value heads, and
# the width of all query heads together (GPT-2 splits its packed projection by it).
_QUERY_HEADS = ("num_heads", "num_attention_heads", "n_head", "n_heads", "num_attn_heads")


_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_heads")


_QUERY_WIDTH = ("split_size", "all_head_size", "inner_dim", "embed_dim")

#: The query heads' width under a name the config gives the model's hidden size: the rank's
#: own where the attention itself holds it (DBRX's ``self.hidden_size``, where its forward
#: cuts the packed projection), never in the config's view (every layer's hidden size).
_OWN_QUERY_WIDTH = ("hidden_size",)


_KV_GROUPS = ("num_key_value_groups",)  # query heads per key/value head (Hugging Face's)


_HEAD_DIM = ("head_dim", "head_size")  # GPT-NeoX's


def _first_int(objs: Sequence[Any], names: Sequence[str]) -> int | None:
    for o in objs:
        for n in names:
            v = getattr(o, n, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def _qkv_columns(
    m: nn.Module,
    inputs: list[tuple[str, tuple[int, int]]],
    hidden: int,
    nq: int,
    nkv: int,
    hd: int,
) -> list[tuple[str, tuple[int, ...]]] | None:
    """The column layout (:attr:`~.heads.TensorSplit.columns`) of an attention's input projections
    ``inputs`` (name, (in, out)), each reading ``hidden`` features: separate query, key and
    value, or the three packed in one layer, as a probe forward of the attention shows it
    read (:func:`~.head_probes.probe_packing`); None when they are neither, or packed under
    grouped-query attention in a way the probe cannot tell."""
    if not inputs or any(fin != hidden for _, (fin, _) in inputs):
        return None
    outs_of = sorted(fout for _, (_, fout) in inputs)
    width, rep = nq * hd, nq // nkv
    if outs_of == [(nq + 2 * nkv) * hd]:
        # Query, key and value packed in one projection: three blocks (GPT-2's c_attn,
        # Phi-3's qkv_proj), or head by head (GPT-NeoX's query_key_value) or group by group
        # (InternLM2's wqkv), told apart by a probe forward of the attention.
        packed = inputs[0][0]
        read = probe_packing(m, packed, hidden, nq, hd, nkv)
        if read == "other":
            return None  # a layout of its own (CodeGen's)
        if read == "heads" and nq == nkv:
            return [(packed, (3 * hd,))]
        if read == "groups" and nq != nkv:
            return [(packed, ((rep + 2) * hd,))]
        if read == "blocks" or nq == nkv:  # undecided: the first forward checks
            return [(packed, (rep * hd, hd, hd))]
        return None
    if outs_of == sorted([width, nkv * hd, nkv * hd]):
        q = next(n for n, (_, fout) in inputs if fout == width)
        return [(n, (rep * hd if n == q else hd,)) for n, _ in inputs]
    return None


def _per_head_container(m: nn.Module, param: str, heads: Sequence[int]) -> str | None:
    """The path of the ``ModuleList`` (or ``ModuleDict``) holding parameter ``param`` of
    ``m`` when it has as many modules as one of the ``heads`` counts (a module for each
    head), else None."""
    parts = param.split(".")
    for k in range(1, len(parts) - 1):
        container = m.get_submodule(".".join(parts[:k]))
        n = len(container) if isinstance(container, (nn.ModuleList, nn.ModuleDict)) else 0
        if n > 1 and n in heads:
            return ".".join(parts[:k])
    return None


def _per_head_table(c: nn.Module, nq: int) -> int | None:
    """Where child ``c`` of an attention of ``nq`` query heads makes a table of a part per
    head, the dimension of its output holding the heads; else None. An embedding of ``nq``
    features (T5's relative position bias) or an MLP of linear layers and activations whose
    last layer has ``nq`` outputs (Swin v2's continuous position bias, on a constant table of
    coordinates): the last. A module called without inputs whose every parameter has a
    dimension of ``nq`` (Hugging Face Swin's ``relative_position_bias``, a table of a column
    per head looked up at the window's positions): a probe call of a copy on the meta device
    tells it, the heads second of four dimensions (batch, heads, queries, keys), else last."""
    if nq < 2:
        return None
    if type(c) is nn.Embedding:
        return -1 if c.embedding_dim == nq and c.max_norm is None else None
    if type(c) is nn.Sequential:
        ok = (
            len(c) >= 2
            and type(c[-1]) is nn.Linear
            and c[-1].out_features == nq
            and all(type(x) is nn.Linear or type(x) in ELEMENTWISE_MODULES for x in c)
        )
        return -1 if ok else None
    params = list(c.parameters())
    if not params or any(nq not in p.shape for p in params) or required_inputs(c) != 0:
        return None
    try:
        with torch.no_grad():
            out = meta_copy(c)()
    except Exception:  # whatever its forward raises without inputs
        return None
    if not isinstance(out, torch.Tensor) or nq not in out.shape:
        return None
    if out.dim() == 4 and out.shape[1] == nq:
        return 1
    return -1 if out.shape[-1] == nq else None


def _head_rows(pn: str, p: torch.Tensor, nq: int, nkv: int, hd: int) -> str | None:
    """Whether parameter ``pn`` of an attention of ``nq`` query heads (``nkv`` key/value) of
    ``hd`` features holds a row per head, and of which: ``"query"`` for one row per query head
    (Cohere's ``q_norm.weight``, ``(heads, head_dim)``, scaling ``(..., heads, head_dim)``),
    ``"key"`` for one per key/value head (its ``k_norm.weight``); None for neither. Only a
    child module's parameter (a norm's weight, applied to the heads it is given); where the
    heads are as many as a head's features, only a norm's, told by its name (a square matrix
    over the head's features is no row per head)."""
    parts = pn.split(".")
    if len(parts) < 2 or p.dim() != 2 or p.shape[1] != hd or nq < 2:
        return None
    if p.shape[0] == hd and "norm" not in parts[-2]:
        return None
    if p.shape[0] == nq:
        return "query"
    return "key" if p.shape[0] == nkv else None


def _whole_output_norms(m: nn.Module, columns: list[tuple[str, tuple[int, ...]]]) -> dict[str, str]:
    """The RMS norms of ``m`` over a column's whole output, every head of it together (OLMo 2's
    ``q_norm`` and ``k_norm``), by name, with the column each follows: a child ``<x>_norm``
    (or ``<x>_layernorm``) whose weight is as wide as column ``<x>_proj``'s output (or
    ``<x>``'s), one block of it, and which computes an RMS norm
    (:func:`~.head_probes.rms_norm_eps`). A rank's norm then sums its squares with the other
    ranks' (:class:`~.layers.FilterParallelRMSNorm`)."""
    widths = {}
    for c, blocks in columns:
        layer = m.get_submodule(c)
        f = projection_features(layer)
        if f is not None and len(blocks) == 1:
            widths[c] = f[1]
    out = {}
    for n, child in m.named_children():
        stem = n.removesuffix("_layernorm").removesuffix("_norm")
        if stem == n:
            continue
        col = next((c for c in (f"{stem}_proj", stem) if c in widths), None)
        weight = getattr(child, "weight", None)
        if col is None or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
            continue
        if weight.shape[0] == widths[col] and rms_norm_eps(child) is not None:
            out[n] = col
    return out


def _attention(name: str, m: nn.Module) -> TensorSplit | str | None:
    """``m`` as an attention split by heads; a reason when it counts heads but its layout is
    not one this rule knows; None when it is no attention (no head counts)."""
    # An attention counts its heads itself (a head size or a head count of its own), reading
    # what it lacks from its config, and holds its projections.
    if _first_int([m], (*_QUERY_HEADS, *_HEAD_DIM)) is None:
        return None
    projs = [(n, f) for n, c in m.named_children() if (f := projection_features(c)) is not None]
    if len(projs) < 2:
        return None
    config = getattr(m, "config", None)
    sources = [m] if config is None else [m, config]
    nq = _first_int(sources, _QUERY_HEADS)
    if nq is None:
        return "it has a head size but no head count"
    nkv = _first_int(sources, _KV_HEADS) or nq
    # The output projection reads every query head and maps them back: a layer whose input
    # is the query heads' width (q and o are both hidden -> hidden when the heads fill the
    # hidden size; modules mostly register the input projections first).
    hd = _first_int(sources, _HEAD_DIM)
    if hd is None:
        hidden = projs[-1][1][1]
        if hidden % nq:
            return f"its {nq} heads do not divide its hidden size {hidden}"
        hd = hidden // nq
    width = nq * hd
    if nq % nkv:
        return f"its {nq} query heads are not whole groups of its {nkv} key/value heads"
    rep = nq // nkv
    outs = [i for i, (_, (fin, _)) in enumerate(projs) if fin == width]
    if not outs:
        return f"no projection reads its {nq} heads of {hd} ({width} features)"
    # The output projection: the last registered one that leaves the others a layout of
    # query, key and value (Phi-3 registers o_proj before qkv_proj).
    for k in reversed(outs):
        row_name, (_, hidden) = projs[k]
        inputs = [(n, f) for i, (n, f) in enumerate(projs) if i != k]
        columns = _qkv_columns(m, inputs, hidden, nq, nkv, hd)
        if columns is not None:
            break
    if columns is None and len({fin for _, (fin, _) in projs}) == 1:
        # Query, key and value alone: the output projection is a sibling's (BERT's and
        # ViT's self.output.dense), found in the parent's forward (:func:`_row_after`).
        row_name, hidden = "", projs[0][1][0]
        columns = _qkv_columns(m, projs, hidden, nq, nkv, hd)
    if columns is None:
        if any(fin != hidden for _, (fin, _) in inputs):
            return "a projection reads something other than the hidden states"
        return (
            f"its projections ({', '.join(f'{n} {a}->{b}' for n, (a, b) in projs)}) are not "
            f"separate or packed query/key/value of {nq} heads ({nkv} key/value) of {hd} and "
            "an output projection"
        )
    # Any other parameter is applied to the rank's own heads: one of a head's size (a norm over
    # the head dimension) or a number is the same for every head, and a table of a weight per
    # query head (T5's relative position bias: an embedding, one column per head) is read at
    # the rank's heads' columns, as is a vector of one number per query head (GPT-OSS's
    # attention sinks; where the heads are as many as a head's features, told by Hugging
    # Face's name for them, ``sinks``) or a row per query or key/value head (Cohere's
    # ``q_norm`` and ``k_norm``: :func:`_head_rows`); each held whole, its gradient summed
    # over the ranks. One that spans heads otherwise (a norm over all query features) would
    # need a split of its own. A child the forward calls after the output projection (a
    # norm of the residual sum, ALBERT's LayerNorm) runs on the whole output, the ranks'
    # parts summed: as a layer after the attention, every rank computes it alike.
    projections = {n for n, _ in projs}
    after: list[set[str]] = []

    def after_row() -> set[str]:
        if not after:
            after.append(applied_after(m, row_name, hidden) if row_name else set())
        return after[0]

    table_dims = {n: _per_head_table(c, nq) for n, c in m.named_children()}
    tables = [n for n, d in table_dims.items() if d is not None]
    shared: list[str] = []
    head_params: list[str] = []
    key_params: list[str] = []
    norms = _whole_output_norms(m, columns)
    for pn, p in m.named_parameters():
        if pn.split(".", 1)[0] in projections or pn.split(".", 1)[0] in norms:
            continue
        per_head = _per_head_container(m, pn, (nq, nkv))
        if per_head is not None:
            # StableLM's q_layernorm.norms: a LayerNorm for each head, which its forward zips
            # with the heads it is given: held whole, its forward sees the rank's heads'.
            heads_list = m.get_submodule(per_head)
            if not isinstance(heads_list, nn.ModuleList):
                return (
                    f"its parameter {pn!r} belongs to {per_head!r}, a dict of a module for "
                    "each head, which no rule here picks the rank's heads of"
                )
            by = head_params if len(heads_list) == nq else key_params
            if per_head not in by:
                by.append(per_head)
            shared.append(pn)
            continue
        if "." not in pn and p.dim() > 1 and p.shape[0] == nq > 1 and p[0].numel() == 1:
            # a number per query head, shaped to broadcast over (batch, heads, ...): Swin v2's
            # logit_scale, (heads, 1, 1)
            head_params.append(pn)
            shared.append(pn)
            continue
        if "." not in pn and tuple(p.shape) == (nq,) and nq > 1 and (nq != hd or pn == "sinks"):
            head_params.append(pn)
            shared.append(pn)
            continue
        rows = _head_rows(pn, p, nq, nkv, hd)
        if rows is not None:
            (head_params if rows == "query" else key_params).append(pn)
            shared.append(pn)
            continue
        if pn.split(".", 1)[0] in after_row():
            continue
        if pn.split(".", 1)[0] not in tables and tuple(p.shape) not in ((hd,), (1,), ()):
            return (
                f"its parameter {pn!r} {tuple(p.shape)} is neither of one head's size ({hd}) "
                "nor a number, so it may span heads"
            )
        shared.append(pn)
    prefix = f"{name}." if name else ""

    def split(
        units: int,
        per_query: int,
        columns: list[tuple[str, tuple[int, ...]]],
        whole: Sequence[str] = (),
        whole_features: dict[str, tuple[int, ...]] | None = None,
        kv_groups: int = 0,
    ) -> TensorSplit:
        # The head counts a rank's module runs with, where it keeps them: its query heads
        # (and their features), and its key/value heads: its groups', or, split by query
        # head, one per query head it holds (multi-query: the one every rank holds, which
        # each of its query heads reads, Hugging Face's num_key_value_groups; grouped-query:
        # each query head's own, cut from the whole key and value, one group each).
        counts: list[tuple[tuple[str, ...], int, int]] = [
            (_QUERY_HEADS, nq, per_query),
            (_QUERY_WIDTH, width, per_query * hd),
        ]
        fixed: dict[str, int] = {}
        if units == nkv:
            counts.append((_KV_HEADS, nkv, 1))
        elif kv_groups:
            counts.append((_KV_HEADS, nkv, 1))
            fixed = {a: 1 for a in _KV_GROUPS if getattr(m, a, None) == rep}
        else:
            counts.append((_KV_GROUPS, rep, 1))
        attrs: dict[str, int] = {}
        own: dict[str, int] = {}
        for names, total, per_unit in counts:
            for a in names:
                for obj, into in ((m, attrs), (config, own)):
                    v = getattr(obj, a, None)
                    if isinstance(v, int) and not isinstance(v, bool) and v == total:
                        into[a] = per_unit
        for a in _OWN_QUERY_WIDTH:
            v = vars(m).get(a)
            if isinstance(v, int) and not isinstance(v, bool) and v == width:
                attrs[a] = per_query * hd
        # A norm of a projection held whole on every rank (a key split by query head) is
        # shared as its projection is; the others split with their projection's output.
        whole_norms = {n for n, c in norms.items() if c in whole}
        held = set(shared)
        shared_here = [
            pn
            for pn, _ in m.named_parameters()
            if pn in held or pn.split(".", 1)[0] in whole or pn.split(".", 1)[0] in whole_norms
        ]
        return TensorSplit(
            "attention",
            name,
            units,
            per_query * hd,
            [(prefix + c, blocks) for c, blocks in columns],
            prefix + row_name if row_name else "",
            attrs,
            own,
            [prefix + n for n in shared_here],
            hd,
            tables=[prefix + n for n in tables],
            table_dims={prefix + n: d for n, d in table_dims.items() if d is not None and d != -1},
            head_params=[prefix + n for n in head_params],
            key_params=[prefix + n for n in key_params],
            whole=[prefix + n for n in whole],
            whole_features={prefix + n: f for n, f in (whole_features or {}).items()},
            kv_groups=kv_groups,
            fixed=fixed,
            norms={prefix + n: prefix + c for n, c in norms.items() if n not in whole_norms},
        )

    # Multi-query and grouped-query attention split by query head: the key and value, which
    # the query heads read, are held and computed whole on every rank, as Megatron-LM keeps a
    # key/value head it cannot divide, and the query heads split one by one. Multi-query
    # attention splits so always (its one key/value head is no split); grouped-query
    # attention by key/value group, or so where its groups are too few for the ranks
    # (TensorSplit.by_head).
    if rep > 1 and len(columns) == 3:
        whole = [c for c, blocks in columns if blocks != (rep * hd,)]
        queries: list[tuple[str, tuple[int, ...]]] = [
            (c, (hd,)) for c, _ in columns if c not in whole
        ]
        if nkv == 1:
            return split(nq, 1, queries, whole)
        by_head = split(nq, 1, queries, whole, kv_groups=nkv)
        grouped = split(nkv, rep, columns)
        grouped.by_head = by_head
        return grouped
    if nkv == 1 < nq and columns[0][1] == (rep * hd, hd, hd):
        # Packed with the queries (Falcon-7B's query_key_value): the key and value rows are
        # held whole on every rank, after its query heads' rows.
        return split(nq, 1, [(columns[0][0], (hd, 0, 0))], (), {columns[0][0]: (0, hd, hd)})
    return split(nkv, rep, columns)


#: What a multi-head latent attention (DeepSeek-V2's MLA, in Hugging Face's layout) counts its
#: latent and head sizes with: the keys' and values' latent, the query/key features per head
#: without and with rotary embedding, the value features per head.
_LATENT = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _latent_attention(name: str, m: nn.Module) -> TensorSplit | str | None:
    """``m`` as a multi-head latent attention split by heads; why not where it counts latent
    sizes (:data:`_LATENT`) in a layout this rule does not know; None where it counts none.

    Hugging Face's layout (DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash, MiniCPM3 and more): keys and
    values expanded per head from a latent, ``kv_b_proj(kv_a_layernorm(kv_a_proj_with_mqa(x)))``
    beside one rotary key part every head reads (the rest of ``kv_a_proj_with_mqa``'s output);
    queries per head from ``q_proj(x)`` or from their own latent, ``q_b_proj(q_a_layernorm(
    q_a_proj(x)))``; ``o_proj`` reading every head's values. Split by heads as Megatron-LM
    splits it: ``q_b_proj`` (or ``q_proj``) and ``kv_b_proj`` by heads, ``o_proj`` by its
    input, and the latent projections and their norms held whole on every rank ahead of them
    (:attr:`~.heads.TensorSplit.upstream`), their outputs copied to the ranks (a rank's
    gradient of a latent is its heads' part, summed over the ranks)."""
    dims = [getattr(m, a, None) for a in _LATENT]
    if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
        return None
    kv_rank, nope, rope, v = (int(d) for d in dims)  # type: ignore[arg-type]
    config = getattr(m, "config", None)
    sources = [m] if config is None else [m, config]
    nq = _first_int(sources, _QUERY_HEADS)
    if nq is None:
        return "it has latent sizes but no head count"
    feats = {n: f for n, c in m.named_children() if (f := projection_features(c)) is not None}
    names = dict(m.named_children())
    if not all(n in feats for n in ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj")):
        return "its latent projections are not kv_a_proj_with_mqa, kv_b_proj and o_proj"
    hidden = feats["o_proj"][1]
    qk = nope + rope
    want = {
        "kv_a_proj_with_mqa": (hidden, kv_rank + rope),
        "kv_b_proj": (kv_rank, nq * (nope + v)),
        "o_proj": (nq * v, hidden),
    }
    columns: list[tuple[str, tuple[int, ...]]] = []
    upstream = ["kv_a_proj_with_mqa"]
    fed_by = {"kv_b_proj": "kv_a_proj_with_mqa"}
    if "q_b_proj" in feats and "q_a_proj" in feats:
        q_rank = feats["q_a_proj"][1]
        want.update(q_a_proj=(hidden, q_rank), q_b_proj=(q_rank, nq * qk))
        columns.append(("q_b_proj", (qk,)))
        upstream.append("q_a_proj")
        fed_by["q_b_proj"] = "q_a_proj"
    elif "q_proj" in feats:
        want["q_proj"] = (hidden, nq * qk)
        columns.append(("q_proj", (qk,)))  # reads the block's input: its shared copy
    else:
        return "it has neither q_proj nor q_a_proj and q_b_proj"
    wrong = [f"{n} {feats[n][0]}->{feats[n][1]}" for n, f in want.items() if feats[n] != f]
    if wrong:
        return (
            f"its projections ({', '.join(wrong)}) are not a latent attention's of {nq} heads "
            f"(query/key {nope}+{rope}, value {v} features; key/value latent {kv_rank})"
        )
    columns.append(("kv_b_proj", (nope + v,)))
    # The latents' norms, held whole ahead of the heads too, between the copy of the latent
    # and the columns: each rank's gradient of their weights is its heads' part (a norm's
    # backward is linear in its output's gradient), summed over the ranks.
    for norm, latent in (("q_a_layernorm", "q_a_proj"), ("kv_a_layernorm", "kv_a_proj_with_mqa")):
        if norm in names and latent in upstream:
            upstream.append(norm)
    shared = [pn for pn, _ in m.named_parameters() if pn.split(".", 1)[0].endswith("layernorm")]
    known = set(want) | set(upstream)
    others = [pn for pn, _ in m.named_parameters() if pn.split(".", 1)[0] not in known]
    if others:
        return f"it holds parameters besides its projections and their norms: {others}"
    attrs = {a: 1 for a in _QUERY_HEADS if getattr(m, a, None) == nq}
    own = {a: 1 for a in _QUERY_HEADS if getattr(config, a, None) == nq}
    own.update({a: 1 for a in _KV_HEADS if getattr(config, a, None) == nq})
    prefix = f"{name}." if name else ""
    return TensorSplit(
        "attention",
        name,
        nq,
        v,
        [(prefix + c, blocks) for c, blocks in columns],
        prefix + "o_proj",
        attrs,
        own,
        [prefix + n for n in shared],
        head_dim=v,
        upstream=[prefix + n for n in upstream],
        fed_by={prefix + c: prefix + u for c, u in fed_by.items()},
    )


# Operations that act on each element alone (or with a number): a hidden-unit-split tensor
# passes through them unchanged, so an MLP's activation, gating product and casts keep its
# split.
_BINARY = {
    operator.mul, operator.add, operator.sub, operator.truediv, operator.pow, torch.mul,
    torch.add, torch.sub, torch.div, torch.pow, operator.gt, operator.ge, operator.lt,
    operator.le, torch.where,  # (a choice, element by element, between two)
}  # fmt: skip


_UNARY = ELEMENTWISE_FUNCTIONS | {
    operator.neg, torch.neg, torch.exp, torch.expm1, torch.erf, torch.square, F.sigmoid, F.tanh,
}  # fmt: skip

#: Element-wise where every argument is a tensor (with a number, ``torch.min(x, 1)``, they
#: reduce along a dimension).
_TENSORS_ONLY = {torch.min, torch.max, torch.minimum, torch.maximum}


_ELEMENTWISE_TENSOR_METHODS = ELEMENTWISE_METHODS | {
    "mul", "add", "sub", "div", "pow", "neg", "exp", "erf", "square", "float", "double", "to",
    "type_as",
}  # fmt: skip


class _Method(nn.Module):
    """``owner.<method>(x)`` as a module's forward, to trace one method of a module whose
    forward fx cannot take as it is: torch's encoder layer (its feed-forward block, beside
    fast paths), or a forward behind a ``(*args, **kwargs)`` wrapper (Hugging Face's decoder
    layers, for gradient checkpointing), called with its first input and ``None`` for the
    ``nones`` other inputs it requires (an attention mask)."""

    def __init__(self, owner: nn.Module, method: str, nones: int = 0) -> None:
        super().__init__()
        self.owner = owner
        self.method = method
        self.nones = nones

    def forward(self, x: torch.Tensor) -> Any:
        return getattr(self.owner, self.method)(x, *[None] * self.nones)


#: How many submodules a trace may leave whole because fx cannot trace through them.
_OPAQUE = 6


def _dtype_test(node: Any, root: nn.Module, dtype: torch.dtype | None) -> bool | None:
    """The value of ``node`` where it compares dtypes (``==`` / ``!=`` of a tensor's ``.dtype``
    and a dtype, or another's): a parameter or buffer's own dtype, any other tensor's taken to
    be ``dtype`` (the block's parameters'); None for any other test, or without ``dtype``."""
    import builtins

    if dtype is None or node.op != "call_function" or node.target not in (operator.eq, operator.ne):
        return None

    def dtype_of(a: Any) -> torch.dtype | None:
        if isinstance(a, torch.dtype):
            return a
        if not (_is_node(a) and a.op == "call_function" and a.target is builtins.getattr):
            return None
        if a.args[1] != "dtype":
            return None
        t = a.args[0]
        if _is_node(t) and t.op == "get_attr":
            held = _attribute(root, str(t.target))
            return held.dtype if isinstance(held, torch.Tensor) else None
        return dtype

    sides = [dtype_of(a) for a in node.args[:2]]
    if len(sides) != 2 or None in sides:
        return None
    return (sides[0] == sides[1]) == (node.target is operator.eq)


def _attribute(root: nn.Module, path: str) -> Any:
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


def block_graph(m: nn.Module, whole: Any = None) -> tuple[Any, dict[str, nn.Module]] | None:
    """``m``'s forward as a torch.fx graph, its linear layers (and any module ``whole``
    accepts) kept as calls, with its modules by the names its graph calls them: the
    dataflow between the layers of a block. Where fx cannot trace the forward as it is (a
    ``(*args, **kwargs)`` wrapper, or a submodule with data-dependent code, as an attention
    given no position embeddings), it traces ``m`` called with its first input (``None`` for
    any other it requires, its optional ones left to their defaults), and a
    submodule that fails is kept whole as one call (up to :data:`_OPAQUE` of them): what the
    block does around it is still seen. None when no trace succeeds."""
    from torch import fx

    class Tracer(fx.Tracer):
        def __init__(self, opaque: set[str]) -> None:
            super().__init__()
            self.opaque = opaque
            self.failed: str | None = None

        def is_leaf_module(self, mod: nn.Module, qualname: str) -> bool:
            return (
                qualname in self.opaque
                or projection_features(mod) is not None
                or (whole is not None and whole(mod))
                or super().is_leaf_module(mod, qualname)
            )

        def call_module(self, mod: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
            try:
                return super().call_module(mod, forward, args, kwargs)
            except Exception:
                if self.failed is None:  # the innermost module the failure came through
                    try:
                        self.failed = self.path_of_module(mod)
                    except NameError:  # a module held outside the block
                        self.failed = ""
                raise

        def to_bool(self, obj: Any) -> bool:
            # A test of a tensor's dtype (Hugging Face's `if hidden_states.dtype ==
            # torch.float16` clamps, T5's cast to its weight's dtype) is decided as the block
            # runs in its parameters' dtype; any other test of a traced value still fails.
            decided = _dtype_test(obj.node, self.root, dtype)
            return super().to_bool(obj) if decided is None else decided

    if not has_forward(m):
        return None
    dtype = next((p.dtype for p in m.parameters() if p.is_floating_point()), None)
    roots: list[tuple[nn.Module, str]]
    if isinstance(m, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        roots = [(_Method(m, "_ff_block"), "owner.")]  # its forward has fast paths
    else:
        n = required_inputs(m) or 0
        roots = [(m, "")] + ([(_Method(m, "forward", n - 1), "owner.")] if n else [])
    for root, prefix in roots:
        opaque: set[str] = set()
        for _ in range(_OPAQUE + 1):
            tracer = Tracer(opaque)
            try:
                with tensor_attributes_kept(m):  # a forward storing what it computed
                    graph = tracer.trace(root)
            except Exception:  # fx raises many kinds on untraceable code
                if not tracer.failed or tracer.failed in opaque:
                    break
                opaque.add(tracer.failed)
                continue
            for node in graph.nodes:
                if node.op == "call_module":
                    node.target = node.target.removeprefix(prefix)
            named = {k.removeprefix(prefix): v for k, v in root.named_modules()}
            return graph, named
    return None


def _mha(name: str, m: nn.Module) -> TensorSplit | str | None:
    """torch's ``nn.MultiheadAttention`` (query, key and value packed in ``in_proj_weight``,
    ``out_proj``) split by heads; a reason when it cannot be."""
    if not isinstance(m, nn.MultiheadAttention):
        return None
    why = FilterParallelMultiheadAttention.why_not(m)
    if why is not None:
        return why
    prefix = f"{name}." if name else ""
    return TensorSplit(
        "mha",
        name,
        m.num_heads,
        m.head_dim,
        [(name, (m.head_dim,) * 3)],
        prefix + "out_proj",
        head_dim=m.head_dim,
    )


def _mlp(name: str, m: nn.Module) -> TensorSplit | None:
    """``m`` as an MLP split by hidden units, read off its torch.fx graph (linear layers kept
    whole in it): a layer (the row) whose input is computed from the outputs of other linear
    layers (the columns, each called once, of as many outputs as the row's inputs) through
    elementwise operations alone, those outputs read by nothing else."""
    if not _linear_layers_apart(m):  # no row and column found here
        return None
    traced = block_graph(m)
    if traced is None:  # no MLP is seen here
        return None
    graph, named = traced
    calls: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1

    def linear(node: Any) -> tuple[int, int] | None:
        if node.op != "call_module" or calls[node.target] != 1:
            return None
        return projection_features(named[node.target])

    def elementwise(node: Any) -> bool:
        args = list(node.args) + list(node.kwargs.values())
        others = [a for a in args if not _is_node(a)]
        # Numbers, dtypes and an option's name (``F.gelu(x, approximate="tanh")``, Gemma's).
        if not all(isinstance(a, (int, float, str, torch.dtype)) for a in others):
            return False
        if node.op == "call_module":
            return isinstance(named[node.target], ELEMENTWISE_MODULES)
        if node.op == "call_function":
            if node.target in _TENSORS_ONLY:  # (torch.min(x, 1) reduces; min(x, y) does not)
                return not others
            return node.target in _BINARY or node.target in _UNARY
        if node.op == "call_method":
            return node.target in _ELEMENTWISE_TENSOR_METHODS
        return False

    def scalar(node: Any) -> str | None:
        """The module path of a one-element parameter or buffer ``node`` reads (an
        activation's learnt numbers: Apertus's xIELU), applied to every unit alike."""
        if node.op != "get_attr":
            return None
        t: torch.Tensor
        try:
            t = m.get_parameter(node.target)
        except AttributeError:
            try:
                t = m.get_buffer(node.target)
            except AttributeError:
                return None
        return node.target if t.numel() == 1 else None

    for row in graph.nodes:
        f = linear(row)
        if f is None or len(row.all_input_nodes) != 1:
            continue
        inner: set[Any] = set()
        columns: dict[Any, int] = {}  # column node -> the blocks its output packs
        numbers: list[str] = []  # the one-element parameters and buffers read
        todo, ok = [row.all_input_nodes[0]], True
        while todo and ok:
            node = todo.pop()
            if node in inner:
                continue
            inner.add(node)
            if scalar(node) is not None:
                numbers.append(node.target)
                continue
            g = linear(node)
            packed = _piece_of_packed(node, f[0])
            if g is not None:
                ok = g[1] == f[0]
                columns[node] = 1
            elif packed is not None:
                # One piece of a column's output cut into equal blocks along its features
                # (Phi-3's gate_up_proj(x).chunk(2, dim=-1)): the column packs the blocks.
                cut, column, parts = packed
                g = linear(column)
                if g is not None and parts is None and g[1] % f[0] == 0:
                    parts = g[1] // f[0]
                ok = (
                    g is not None
                    and parts is not None
                    and parts > 1
                    and g[1] == parts * f[0]
                    and columns.get(column, parts) == parts
                )
                inner.update((cut, column))
                columns[column] = parts or 1
            elif elementwise(node):
                todo.extend(node.all_input_nodes)
            else:
                ok = False
        # Nothing outside sees the split tensors: every user of an inner node is inner or row.
        ok = ok and bool(columns) and all(u in inner or u is row for n in inner for u in n.users)
        targets = [c.target for c in columns] + [row.target]
        if ok and all("." in t for t in targets) and len({t.split(".")[0] for t in targets}) == 1:
            continue  # inside one submodule: that module's own MLP, found and named there
        if ok:
            prefix = f"{name}." if name else ""
            ordered = [n for n in graph.nodes if n in columns]
            # A learnt number applies to every rank's units: each rank's gradient its units'
            # part, summed over the ranks.
            learnt = {n for n, p in m.named_parameters() if p.requires_grad}
            return TensorSplit(
                "mlp",
                name,
                f[0],
                1,
                [(prefix + c.target, (1,) * columns[c]) for c in ordered],
                prefix + row.target,
                shared=sorted({prefix + n for n in numbers if n in learnt}),
            )
    return None


def _linear_layers_apart(m: nn.Module) -> bool:
    """Whether ``m``'s linear layers (not ``m`` itself) lie in two of its children at least,
    each child counted with everything inside it. An MLP needs a row and a column; one whose
    layers all lie inside one child is that child's own, which :func:`_mlp` finds and names
    there: in ``m``, nothing to trace for."""
    found: set[str] = set()
    for name, sub in m.named_modules():
        if name and linear_features(sub) is not None:
            found.add(name.split(".")[0])
            if len(found) >= 2:
                return True
    return False


def _piece_of_packed(node: Any, width: int) -> tuple[Any, Any, int | None] | None:
    """``(cut, column, parts)`` when ``node`` is one piece (``getitem``) of a column's output
    ``cut`` into equal blocks of ``width`` features along its last dimension:
    ``chunk(parts, dim=-1)``, or ``split(width, dim=-1)`` (``parts`` None: the column's
    features over ``width``); else None."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return None
    cut = node.args[0]
    if not _is_node(cut) or cut.op not in ("call_method", "call_function"):
        return None
    name = cut.target if cut.op == "call_method" else getattr(cut.target, "__name__", "")
    if name not in ("chunk", "split") or len(cut.all_input_nodes) != 1:
        return None
    args, kwargs = list(cut.args[1:]), dict(cut.kwargs)
    size = args[0] if args else kwargs.get("chunks", kwargs.get("split_size"))
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if dim != -1 or not isinstance(size, int) or isinstance(size, bool):
        return None
    if name == "split" and size != width:
        return None
    return cut, cut.all_input_nodes[0], (size if name == "chunk" else None)


def _is_node(a: Any) -> bool:
    from torch import fx

    return isinstance(a, fx.Node)


def _row_after(
    model: nn.Module, name: str, attention: nn.Module, ts: TensorSplit
) -> TensorSplit | str:
    """``ts`` (an attention of query, key and value alone) with its output projection: the
    linear layer reading all its heads that its parent's forward applies to the attention's
    output (its first, where it returns several), through elementwise ops (a dropout) that
    nothing else reads, as BERT's ``attention.output.dense`` and ViT's; or why none is."""
    width = ts.units * ts.width
    why = f"no layer after it reads its heads ({width} features) alone"
    parent_name, _, child = name.rpartition(".")
    if not child:
        return why
    traced = block_graph(model.get_submodule(parent_name), whole=lambda m: m is attention)
    if traced is None:
        return why + f" in what its parent {parent_name or type(model).__name__!r} does"
    graph, named = traced
    calls = [n for n in graph.nodes if n.op == "call_module" and n.target == child]
    if len(calls) != 1:
        return why
    node = calls[0]
    data = [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
    if len(data) == 1:  # it returns (output, attention weights, ...)
        node = data[0]
    while len(node.users) == 1:
        (user,) = node.users
        if user.all_input_nodes != [node]:
            break
        layer = named[user.target] if user.op == "call_module" else None
        f = projection_features(layer) if layer is not None else None
        if f is not None and f[0] == width:
            ts.row = (f"{parent_name}." if parent_name else "") + user.target
            return ts
        if not (
            isinstance(layer, ELEMENTWISE_MODULES)
            or (user.op == "call_function" and user.target in _UNARY)
        ):
            break
        node = user
    return why


def plan_tensor_splits(
    model: nn.Module, candidates: Sequence[str], *, mha: bool = True
) -> tuple[list[TensorSplit], dict[str, str]]:
    """The attentions and MLPs of ``model`` to split by heads and hidden units
    (:class:`~.heads.TensorSplit`), among the layers named in ``candidates`` (those the pairing rule
    of :func:`~.chains.plan_modes` would gather), and with ``mha`` torch's ``nn.MultiheadAttention``
    modules; and the attentions it leaves alone, by name, with why.
    It reads module types, attributes and traced graphs only, so a model on the meta device
    works."""
    pool = set(candidates)
    splits: list[TensorSplit] = []
    kept: dict[str, str] = {}
    claimed: set[str] = set()
    by_layout: list[str] = []  # kept whole for their layout (not for the layers chosen)
    # Why each attention class cannot run on some heads, and whether the probe could tell.
    partial: dict[type, tuple[str | None, bool]] = {}
    # How each attention class cuts its heads into parts, and whether the probe saw it all.
    cut: dict[type, tuple[str | None, bool]] = {}
    for name, m in model.named_modules():
        if name in claimed or any(name.startswith(c + ".") for c in claimed):
            continue
        found: TensorSplit | str | None = _mha(name, m) if mha else None
        if found is None:
            found = _latent_attention(name, m)
        if found is None:
            found = _attention(name, m)
        if isinstance(found, TensorSplit) and not found.row:
            found = _row_after(model, name, m, found)
        if found is None:
            found = _mlp(name, m)
        if isinstance(found, str):
            kept[name or type(model).__name__] = found
            by_layout.append(name)
            continue
        if found is None:
            continue
        if found.kind == "attention":
            # One probe per class (its attentions run one code): a forward that cannot run on
            # part of its heads (LED's decoder reshapes them to its input's width) stays whole.
            if type(m) not in partial:
                partial[type(m)] = runs_with_some_heads(m, found)
                cut[type(m)] = cuts_heads(m, found)
            why, told = partial[type(m)]
            if why:
                kept[name] = f"its forward fails on a rank holding some of its heads ({why})"
                by_layout.append(name)
                continue
            where, seen = cut[type(m)]
            if where:
                kept[name] = (
                    f"its forward cuts its heads into parts ({where}), which it may "
                    "combine: a rank's heads are not the unsplit attention's parts"
                )
                by_layout.append(name)
                continue
            for variant in (found, found.by_head):
                if variant is not None:
                    variant.cut_unseen, variant.parts_unseen = not seen, not told
        missing = [n for n in found.layers() if n not in pool and found.kind != "mha"]
        if missing and found.by_head and all(n in pool for n in found.by_head.layers()):
            # Its key and value left out (shares naming only its query and output
            # projections, as filter_shares reports a split by query head): split so.
            found, missing = found.by_head, []
        if missing:
            if found.kind == "attention":
                kept[name] = f"its layers {missing} are not split or already paired"
            continue
        for variant in (found, found.by_head):
            if variant is not None:
                _with_adapters(variant, model)
        splits.append(found)
        claimed.update(found.layers() + found.held_whole(pool))
    # Attentions of one class run one code: where one stays whole for its layout (T5's first,
    # holding the relative position bias of every head), the others of its class are handed
    # what it computes for every head, so they stay whole too.
    named = dict(model.named_modules())
    whole: dict[type, str] = {}
    for n in by_layout:
        whole.setdefault(type(named[n]), n)
    for ts in [ts for ts in splits if ts.kind == "attention"]:
        first = whole.get(type(named[ts.module]))
        if first is not None:
            splits.remove(ts)
            kept[ts.module] = (
                f"{first!r}, of its class {type(named[first]).__name__}, stays whole, and may "
                "hand it inputs for every head"
            )
    # Where one of a class holds a per-head table (T5's first attention of each stack), the
    # others are handed what it computes for the heads a rank holds: every attention of the
    # class holds the same heads as the first.
    # (Where every one of a class holds its own table, as Swin v2's, none is handed one.)
    leader: dict[type, str] = {}
    for ts in splits:
        if ts.kind == "attention" and ts.tables:
            leader.setdefault(type(named[ts.module]), ts.module)
    for kind in list(leader):
        if all(x.tables for x in splits if x.kind == "attention" and type(named[x.module]) is kind):
            del leader[kind]
    for ts in splits:
        first = leader.get(type(named[ts.module])) if ts.kind == "attention" else None
        if first is not None and first != ts.module:
            ts.heads_with = first
    # One probe per class and layout, as the probe per class above: a model's blocks repeat.
    probed: dict[tuple[type, str], str] = {}
    for ts in splits:
        for variant in (ts, ts.by_head) if ts.kind == "attention" else ():
            if variant is not None:
                key = (type(named[ts.module]), _relative_layout(variant))
                if key not in probed:
                    probed[key] = runs_without_heads(named[ts.module], variant) or ""
                variant.empty_fails = probed[key]
    return splits, kept


def _with_adapters(ts: TensorSplit, model: nn.Module) -> None:
    """Record the layers of ``ts`` (a split of a module of ``model``) that are PEFT's LoRA
    wrappers (:attr:`~.heads.TensorSplit.adapted`), and the parameters of each column's
    ``lora_A`` among its shared ones: held whole on every rank, each rank's gradient its
    units' part."""
    held = set(ts.shared)
    for layer in ts.layers():
        wrapper = model.get_submodule(layer)
        if lora_base(wrapper) is None:
            continue
        ts.adapted.append(layer)
        if layer == ts.row:
            continue
        for pn, _ in wrapper.get_submodule("lora_A").named_parameters():
            full = f"{layer}.lora_A.{pn}"
            if full not in held:
                ts.shared.append(full)


def _relative_layout(ts: TensorSplit) -> str:
    """``ts`` as text, the names inside its module relative to it (those outside as they are):
    two attentions laid out alike read the same."""
    text = repr(replace(ts, module="", by_head=None, empty_fails=""))
    return text.replace(f"'{ts.module}.", "'") if ts.module else text
