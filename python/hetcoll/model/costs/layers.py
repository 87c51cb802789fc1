""":func:`layer_costs`: a model's layers costed - the formulas of :mod:`.formulas` where a layer
has one, its counted ops (:mod:`.counting`) elsewhere - and the top-level layers a plan counts."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hetcoll.model.costs.counting import _counted_kernels, _MetaOutputs, _trace
from hetcoll.model.costs.formulas import (
    _VIEWS,
    _conv_kernels,
    _elementwise_kernels,
    _linear_kernels,
)
from hetcoll.model.costs.inputs import activation_dtype, example_batch, model_inputs
from hetcoll.model.costs.losses import resolve_loss
from hetcoll.model.costs.records import (
    _COUNT_BATCH,
    _TRACE_BATCH,
    LOSS_LAYER,
    ExpertsBlock,
    Kernel,
    LayerCost,
    ModelCosts,
    SplitBlock,
    _numel,
    split_input_partners,
)
from hetcoll.model.hardware import check_precision

if TYPE_CHECKING:
    from hetcoll.torch.filters import TensorSplit


def layer_costs(
    model: nn.Module,
    input_shape: Sequence[int] | str | Mapping[str, Any] | torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
    conv_algorithm: str = "implicit-gemm",
    precision: str = "fp32",
    loss: str | Callable[[Any], torch.Tensor] | None = None,
) -> ModelCosts:
    """Per-layer costs of ``model`` for one sample of ``input_shape`` (no batch dimension).

    ``input_shape``: what the forward takes (:mod:`hetcoll.model.costs.inputs`): the shape of
    one sample of its one positional input (``(3, 32, 32)``, ``"3x32x32"``, ``(512,)``), of
    ``dtype`` (default ``torch.float32``; ``torch.int64`` for token ids); an example batch (a
    tensor); or a dict of keyword inputs, each a shape (of ``dtype``), a ``(shape, dtype)`` pair
    or an example batch, e.g. ``{"input_ids": (512,), "attention_mask": (512,)}`` with
    ``dtype=torch.int64``. Bytes are counted in the activations' dtype: a floating input's,
    else the model's parameters'.
    ``conv_algorithm``: ``"implicit-gemm"`` (PyTorch's oneDNN / cuDNN kernels: no column
    matrix in memory) or ``"im2col"`` (PyDTNN's explicit im2col / col2im, seed 003).
    ``precision``: the training precision (:meth:`ModelCosts.at_precision`).
    ``loss``: the loss each step ends with, costed as the last layer
    (:data:`~hetcoll.model.costs.records.LOSS_LAYER`, with the last plan layer): ``None`` (none:
    the backward starts from the outputs), ``"cross-entropy"`` (of the output's logits, classes
    last: a classifier's or a language model's) or a function of the model's output returning
    the batch's loss (e.g. a shifted next-token cross-entropy, targets made inside). At a
    vocabulary of thousands a language model's loss costs more than its blocks.

    The model runs forward and backward on the meta device (shapes only: no memory is
    allocated and no arithmetic runs, so a billion-parameter model costs the same to describe as
    a small one) under a dispatch mode that counts every aten op, once, for a batch of
    ``_COUNT_BATCH``. A layer is a leaf module's call, or a run of ops a module's own
    ``forward`` does between its children's calls (a residual add, the matmuls of an attention
    written in ``forward``): nothing the step runs is left out. Convolutions, linear layers and
    the element-wise layers of ``_ELEMENTWISE`` keep their kernel formulas (im2col, GEMMs, bias,
    the bytes a filter split divides); every other layer is costed from its ops' counts.

    >>> from torch import nn
    >>> c = layer_costs(nn.Linear(4, 3), (4,))
    >>> c.forward_flops(batch=1), c.params
    (24.0, 15)
    >>> c = layer_costs(nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 100)), (16,),
    ...                 dtype=torch.int64)
    >>> c.forward_flops(batch=1), c.plan_layers
    (25600.0, ('0', '1'))
    >>> c = layer_costs(nn.Linear(4, 3), (4,), loss="cross-entropy")
    >>> [x.name for x in c.layers], c.loss
    (['Linear', '(loss)'], 'cross-entropy')
    """
    from hetcoll.torch.filters import (
        check_empty_heads,
        linear_features,
        split_layout,
        vocabulary_ties,
    )

    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if conv_algorithm not in ("implicit-gemm", "im2col"):
        raise ValueError(
            f"conv_algorithm: expected 'implicit-gemm' or 'im2col', got {conv_algorithm!r}"
        )
    check_precision(precision)
    loss_name, loss_fn = resolve_loss(loss)
    inputs = model_inputs(input_shape, dtype)
    shape = inputs[0].shape
    item = torch.empty((), dtype=activation_dtype(model, inputs)).element_size()

    counter = _trace(model, inputs, _COUNT_BATCH, loss_fn)
    param_of = dict(model.named_parameters())

    layers: list[LayerCost] = []
    notes: list[str] = []
    for c2 in counter.calls:
        mod = c2.module
        owned = [param_of[n] for n in c2.params if n in param_of]
        n_params = sum(p.numel() for p in owned)
        p_bytes = float(sum(p.numel() * p.element_size() for p in owned))
        frozen = float(sum(p.numel() * p.element_size() for p in owned if not p.requires_grad))
        in_s, out_s = c2.in_shape, c2.out_shape
        in_e, out_e = _numel(in_s), _numel(out_s)
        filters, groups = 0, 1
        ks: tuple[list[Kernel], list[Kernel]] | None = None
        # A formula per sample where the layer's input grows with the batch; a layer run on a
        # constant table (Swin v2's position-bias MLP) keeps its counted ops, once a step.
        if c2.leaf and in_s and out_s and c2.input_grows:
            if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and not isinstance(
                mod, nn.modules.conv._ConvTransposeNd
            ):
                filters, groups = mod.out_channels, mod.groups
                if in_e % mod.in_channels == 0 and out_e % mod.out_channels == 0:
                    ks = _conv_kernels(
                        mod, in_s, out_s, c2.needs_input_grad, item, conv_algorithm == "im2col"
                    )  # else (a shape the trace could not read per sample): its counted ops
            elif isinstance(mod, nn.Linear) or linear_features(mod) is not None:
                # nn.Linear and its subclasses; Hugging Face's Conv1D (GPT-2's projections).
                features = (
                    (mod.in_features, mod.out_features)
                    if isinstance(mod, nn.Linear)
                    else linear_features(mod)
                )
                assert features is not None
                ks = _linear_kernels(mod, features, in_s, c2.needs_input_grad, item)
                filters = features[1]
            else:
                ks = _elementwise_kernels(mod, in_e, out_e, item)
        if ks is not None:
            # The formulas' matmul FLOPs against the ops actually counted.
            formula = sum(k.flops_per_sample for k in ks[0] if k.name.startswith("gemm"))
            counted = c2.counts[0][0] / _COUNT_BATCH
            if abs(formula - counted) > 0.01 * max(formula, counted):
                notes.append(
                    f"layer {c2.name!r}: formula {formula:.4g} matmul FLOPs per sample, "
                    f"ops counted {counted:.4g}"
                    + (" (routed rows: the ops counted kept)" if c2.routed else "")
                )
                if c2.routed:  # an expert's share of the tokens holds no whole samples
                    ks = None
        if ks is not None:
            ks = _with_traced_launches(ks, c2.launches)
            if c2.recomputed_flops:  # gradient checkpointing's recompute, run by its backward
                ks[1].append(Kernel("recompute", c2.recomputed_flops / _COUNT_BATCH, launches=0))
            in_b, out_b = float(in_e * item), float(out_e * item)
            saved = 0.0 if isinstance(mod, _VIEWS) else in_b
        else:
            ks = _counted_kernels(c2)
            if c2.leaf and in_s and out_s and c2.input_grows:
                in_b, out_b = float(in_e * item), float(out_e * item)
            else:
                in_b = max(c2.first_in_bytes, 0.0) / _COUNT_BATCH
                out_b = c2.last_out_bytes / _COUNT_BATCH
            saved = in_b
        layers.append(
            LayerCost(
                name=c2.name,
                kind=(
                    "loss"
                    if c2.name == LOSS_LAYER
                    else type(mod).__name__
                    if c2.leaf
                    else f"{type(mod).__name__}.forward"
                ),
                params=n_params,
                param_bytes=p_bytes,
                frozen_bytes=frozen,
                in_bytes_per_sample=in_b,
                out_bytes_per_sample=out_b,
                saved_bytes_per_sample=saved,
                filters=filters,
                forward=tuple(ks[0]),
                backward=tuple(ks[1]),
                groups=groups,
                own_ops=not c2.leaf,
                elementwise_flops_per_sample=(
                    c2.elementwise_flops[0] / _COUNT_BATCH,
                    c2.elementwise_flops[1] / _COUNT_BATCH,
                ),
                allocations=tuple(
                    tuple(sorted((ps, fixed, n) for (ps, fixed), n in made.items()))
                    for made in c2.allocations
                ),
            )
        )
    if counter.eager_attention:
        notes.append(
            "attention counted in its eager implementation: the model's own (sdpa) reads the "
            "attention mask's values, which the meta device has not"
        )
    if counter.mask_left_out:
        notes.append(
            "counted without the attention_mask: the model reads its values (to skip a mask of "
            "no padding), which the meta device has not; a mask of no padding costs the same"
        )
    unused = set(param_of) - {n for c in counter.calls for n in c.params}
    if unused:
        notes.append(
            f"{len(unused)} parameters are not used by the forward pass: held, as weights "
            "without gradients, by the layer of the module they belong to"
        )
        layers = _holding_unused(
            layers, {n: param_of[n] for n in sorted(unused)}, type(model).__name__
        )
    if not layers or sum(x.forward_flops(1) for x in layers) == 0:
        notes.append("no costed layers found")
    leaves = [id(c.module) for c in counter.calls if c.leaf]
    if len(set(leaves)) < len(leaves):
        notes.append("some modules run more than once per step; each call is a layer")
    buffer_bytes = float(sum(b.numel() * b.element_size() for b in model.buffers()))
    # A bare leaf model is one layer named after its type (see ``_trace``).
    # The split filter_parallel(model, speeds=...) makes: chain pairs, attentions and MLPs.
    layout = split_layout(model)
    # Attentions that cannot run on a rank without heads, as the model's forward calls them.
    check_empty_heads(model, layout.splits, example_batch(inputs, _TRACE_BATCH, "meta"))
    modes = tuple((n or type(model).__name__, m) for n, m in layout.modes.items())
    blocks = tuple(_split_block(model, ts, layers, item) for ts in layout.splits)
    costs = ModelCosts(
        tuple(layers),
        shape,
        item,
        tuple(notes),
        buffer_bytes,
        modes,
        filter_units=tuple(layout.units.items()),
        inputs=inputs,
        split_blocks=blocks,
        experts=_experts_blocks(model, layers, item),
        loss=loss_name,
        vocabulary_ties=tuple(vocabulary_ties(model).items()),
    )
    costs = _with_plan_layers(costs, model)
    return costs if precision == "fp32" else costs.at_precision(precision)


def _holding_unused(
    layers: list[LayerCost], unused: dict[str, torch.Tensor], root: str
) -> list[LayerCost]:
    """``layers`` with the parameters the forward never reads (Longformer's global-attention
    projections without global tokens, XLNet's segment weights) added to the layer of the
    nearest module that runs (the most leading path components in common, an ancestor before
    a sibling; else the first layer): every device holding that layer holds them, and, never
    given a gradient, they are neither summed nor updated."""
    out = list(layers)
    for name, p in unused.items():
        path = name.split(".")
        owner, best = 0, (0, False)
        for i, x in enumerate(out):
            # (the root's own ops are named after its type)
            theirs = [] if x.own_ops and x.name == root else x.name.split(".")
            common = 0
            for a, b in zip(path, theirs):
                if a != b:
                    break
                common += 1
            key = (common, common == len(theirs))
            if key > best:
                owner, best = i, key
        nbytes = float(p.numel() * p.element_size())
        x = out[owner]
        out[owner] = replace(
            x,
            params=x.params + p.numel(),
            param_bytes=x.param_bytes + nbytes,
            frozen_bytes=x.frozen_bytes + nbytes,
        )
    return out


def _with_traced_launches(
    kernels: tuple[list[Kernel], list[Kernel]], launches: list[list[int]]
) -> tuple[list[Kernel], list[Kernel]]:
    """A formula layer's kernels, the last of each direction standing for the launches the
    trace counted beyond them: a backward's sums of the gradients of an input several layers
    read (a transformer's query, key and value projections), which no formula describes."""
    out: list[list[Kernel]] = []
    for ks, counted in zip(kernels, launches, strict=True):
        surplus = sum(counted) - sum(k.launches for k in ks)
        if ks and surplus > 0:
            ks = [*ks[:-1], replace(ks[-1], launches=ks[-1].launches + surplus)]
        out.append(ks)
    return out[0], out[1]


def _with_plan_layers(costs: ModelCosts, model: nn.Module) -> ModelCosts:
    """``costs`` with the model's layers as a Plan counts them
    (:func:`hetcoll.torch.layers.model_cut`): each costed layer's plan layer, what a stage ending
    at each plan layer sends, and - for a chain - the modes the runtime would give a
    filter-split stage starting at each of them (:func:`_with_blocks` for blocks)."""

    from torch.func import functional_call

    from hetcoll.torch.filters import chain_filter_modes
    from hetcoll.torch.layers import model_cut

    try:
        cut = model_cut(model)
    except (TypeError, ValueError) as e:
        return replace(costs, plan_layers_note=str(e))
    costs = replace(costs, whole_model_layers=len(cut.layers))
    if cut.kind == "blocks":
        return _with_blocks(costs, model, cut.layers)
    chain = cut.layers
    if len(costs.inputs) != 1 or costs.inputs[0].name:
        return replace(
            costs,
            plan_layers_note="a chain of layers takes one positional input, not keyword inputs",
        )
    names = [n for n, _ in chain]
    index = {n: i for i, n in enumerate(names)}
    of: list[int] = []
    for layer in costs.layers:
        head = layer.name.split(".", 1)[0]
        if layer.own_ops and head not in index:
            # The top-level forward's own ops (between its layers) go with the layer before.
            of.append(of[-1] if of else 0)
            continue
        if head not in index:
            return replace(
                costs, plan_layers_note=f"layer {layer.name!r} runs outside the top-level layers"
            )
        of.append(index[head])
    if any(b < a for a, b in itertools.pairwise(of)):
        return replace(costs, plan_layers_note="the top-level layers do not run in order")
    out_bytes = []
    x = example_batch(costs.inputs, _TRACE_BATCH, "meta")[0][0]
    was_training = model.training
    model.train()
    try:
        with torch.no_grad(), _MetaOutputs():
            for name, m in chain:
                state = {
                    k: torch.empty_like(v, device="meta")
                    for k, v in (*m.named_parameters(), *m.named_buffers())
                }
                x = functional_call(m, state, (x,)) if state else m(x)
                if not isinstance(x, torch.Tensor):
                    return replace(
                        costs, plan_layers_note=f"layer {name!r} does not return one tensor"
                    )
                out_bytes.append(float(x[0].numel() * x.element_size()))
    except (RuntimeError, TypeError, ValueError) as e:
        return replace(costs, plan_layers_note=f"the layers do not run one after another: {e}")
    finally:
        model.train(was_training)
    stage_modes = []
    # filter_modes(nn.Sequential(OrderedDict(chain[lo:]))) for every lo, each forward traced once
    for modes in chain_filter_modes(chain):
        partners = split_input_partners(modes)
        stage_modes.append(tuple((n, m, partners.get(n, "")) for n, m in modes.items()))
    return replace(
        costs,
        plan_layers=tuple(names),
        plan_layer_of=tuple(of),
        plan_out_bytes=tuple(out_bytes),
        plan_layer_kinds=tuple(type(m).__name__ for _, m in chain),
        stage_modes=tuple(stage_modes),
    )


def _with_blocks(
    costs: ModelCosts, model: nn.Module, blocks: Sequence[tuple[str, nn.Module]]
) -> ModelCosts:
    """``costs`` mapped onto a blocks model's plan layers (:func:`hetcoll.torch.layers.model_cut`
    ``"blocks"``: a transformer's embeddings, decoder layers, norm and head).

    Each costed layer goes to the block whose module path holds it; the code between blocks
    (masks, position ids, a residual in a parent's ``forward``) to the block before it (the
    first block for code before any). The runtime replays that code on every stage
    (:mod:`hetcoll.torch.replay`), which the costs count once: it is element-wise work on masks
    and ids, small beside the blocks'. What a stage ending at block ``i`` sends is what crosses
    the cut after it, from :func:`hetcoll.torch.replay.probe` (the forward with every block run
    on the meta device): the outputs of blocks up to ``i`` that a later block or the model's
    output reads, except those of parameter-free blocks reading only the inputs (rotary
    embeddings), which every stage recomputes. Stages are whole blocks on one rank each
    (``plan_cut = "blocks"``: no filter split of a transformer block is costed)."""

    from hetcoll.torch.replay import probe_first_that_runs, stage_roles

    names = [n for n, _ in blocks]
    index = {n: i for i, n in enumerate(names)}
    # Modules without parameters held by several blocks, by the name costs know them by (the
    # first): the blocks holding them.
    where: dict[int, list[str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        if not any(True for _ in m.parameters()):
            where.setdefault(id(m), []).append(name)

    def block_of(name: str) -> int | None:
        parts = name.split(".")
        for k in range(len(parts), 0, -1):
            i = index.get(".".join(parts[:k]))
            if i is not None:
                return i
        return None

    holders = {
        paths[0]: {b for b in map(block_of, paths) if b is not None}
        for paths in where.values()
        if len(paths) > 1
    }

    # The meta device first (shapes only); a forward that reads its inputs' values gets zeros
    # on the CPU (valid token ids and positions).
    attempts = []
    for device in ("meta", "cpu"):
        args, kwargs = example_batch(costs.inputs, _TRACE_BATCH, device)
        attempts.append(kwargs or args[0])
    was_training = model.training
    model.train()
    try:
        flow = probe_first_that_runs(model, blocks, attempts)
    except ValueError as e:
        return replace(
            costs,
            plan_layers_note=f"the forward does not run with its blocks on the meta device ({e})",
        )
    finally:
        model.train(was_training)
    of: list[int] = []
    for layer in costs.layers:
        i = block_of(layer.name)
        if i is None and not layer.own_ops:
            return replace(
                costs, plan_layers_note=f"layer {layer.name!r} runs outside the model's blocks"
            )
        if i is None or i in flow.glue:
            # Code between blocks, and blocks without parameters called at several places
            # (one dropout module before and after a stack), which every stage runs as code
            # between blocks: with the block before.
            i = of[-1] if of else 0
        elif of and i < of[-1] and of[-1] in holders.get(layer.name, ()):
            # A module without parameters that several blocks hold (OpenAI GPT's activation,
            # one object in every MLP) is named by its first holder: its call belongs to the
            # block running it.
            i = of[-1]
        of.append(i)
    if any(b < a for a, b in itertools.pairwise(of)):
        return replace(
            costs,
            plan_layers_note=(
                "the model's blocks do not run in the order listed (the order it registers "
                "them; a model bringing example inputs, as Hugging Face's dummy_inputs, is cut "
                "in the order its forward calls them)"
            ),
        )
    n = len(names)
    out_bytes = [0.0] * n
    for k in flow.order:
        for leaf in flow.tensors(k):
            nbytes = math.prod(leaf.shape) * torch.empty((), dtype=leaf.dtype).element_size()
            # A tensor that does not grow with the batch is sent whole with each micro-batch:
            # counted as bytes per sample, an upper bound.
            batched = bool(leaf.shape) and leaf.shape[0] == _TRACE_BATCH
            out_bytes[k] += nbytes / _TRACE_BATCH if batched else float(nbytes)
    free = [not any(True for _ in m.parameters()) for _, m in blocks]
    crossing = []
    for i in range(n - 1):
        # The runtime's own rule for what the first stage of a two-stage cut after block i
        # sends (an impossible cut costs infinitely much: the partition never picks it).
        try:
            roles = stage_roles(
                flow, names, [0] * (i + 1) + [1] * (n - i - 1), 0, free, lambda s: f"stage {s}"
            )
        except ValueError:
            crossing.append(math.inf)
            continue
        crossing.append(sum(out_bytes[j] for j in roles.sends))
    return replace(
        costs,
        plan_layers=tuple(names),
        plan_layer_of=tuple(of),
        plan_out_bytes=(*crossing, out_bytes[-1]),
        plan_layer_kinds=tuple(type(m).__name__ for _, m in blocks),
        stage_modes=(),
        plan_cut="blocks",
    )


def _split_block(
    model: nn.Module, ts: TensorSplit, layers: Sequence[LayerCost], item: int
) -> SplitBlock:
    """``ts`` as the performance model prices it (and its split by query head, where it has
    one), with the block's other sums (:func:`_other_sums`). A LoRA wrapper among its layers
    is priced as its base layer (split as it is), its adapters as whole on every device (an
    adapter rank's worth of features)."""
    costed = [ts.base(n) for n in ts.layers()]
    adapters = [n for n in ts.inner(x.name for x in layers) if n not in costed]
    return SplitBlock(
        ts.module,
        ts.kind,
        ts.units,
        ts.width,
        tuple(ts.layers()),
        tuple(ts.features_per_unit()),
        tuple(model.get_parameter(n).numel() for n in ts.shared) + tuple(_whole_rows(model, ts)),
        not ts.empty_fails,
        ts.heads_with,
        tuple(ts.held_whole(x.name for x in layers)) + tuple(adapters),
        tuple(sum(ts.whole_features.get(n, ())) for n in ts.layers()) if ts.whole_features else (),
        None if ts.by_head is None else _split_block(model, ts.by_head, layers, item),
        _other_sums(model, ts, layers, item),
        tuple(costed) if ts.adapted else (),
        _dora_norm_sums(model, ts, item),
        *_adapters(model, ts),
    )


def _adapters(model: nn.Module, ts: TensorSplit) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The adapters a split of ``ts`` splits with their LoRA wrapper (a column's ``lora_B``,
    the row's ``lora_A``: the runtime's), and the costed layers of each DoRA layer's work
    whatever the batch (its magnitude's layer, and its adapters' calls on an identity
    matrix)."""
    split: list[str] = []
    dora: list[str] = []
    for name in ts.adapted:
        wrapper = model.get_submodule(name)
        factor = "lora_A" if name == ts.row else "lora_B"
        uses = getattr(wrapper, "use_dora", None) or {}
        for a, _ in wrapper.get_submodule(factor).named_children():
            split.append(f"{name}.{factor}.{a}")
            if uses.get(a):
                parts = ("lora_magnitude_vector", "lora_A", "lora_B")
                dora += [f"{name}.{part}.{a}" for part in parts]
    return tuple(split), tuple(dora)


def _experts_blocks(
    model: nn.Module, layers: Sequence[LayerCost], item: int
) -> tuple[ExpertsBlock, ...]:
    """The experts modules expert parallelism places (:func:`hetcoll.torch.expert_parallel.
    experts_modules`), with their tokens per sample: the module's output rows (its last costed
    layer's output bytes over its features)."""
    from hetcoll.torch.expert_parallel import experts_modules
    from hetcoll.torch.filters import ExpertsLayout, experts_layout, stacked_adapters

    last = {x.name: x for x in layers}
    placeable = experts_modules(model)
    named = dict(model.named_modules())
    out = []
    for name, m in model.named_modules():
        row = last.get(name)
        if row is None or placeable.get(name) != "":
            continue
        layout = experts_layout(m)
        features = layout.features if isinstance(layout, ExpertsLayout) else 0
        for attribute in ("hidden_dim", "hidden_size"):
            value = getattr(m, attribute, None)
            features = value if not features and isinstance(value, int) else features
        config = getattr(m, "config", None)
        top_k = getattr(config, "num_experts_per_tok", None)
        if features <= 0 or not isinstance(top_k, int):
            continue
        tokens = row.out_bytes_per_sample / (features * item)
        wrappers = tuple(stacked_adapters(named, name) or ())
        experts = int(m.num_experts)  # type: ignore[arg-type]
        out.append(ExpertsBlock(name, experts, top_k, tokens, features, wrappers))
    return tuple(out)


def _other_sums(
    model: nn.Module, ts: TensorSplit, layers: Sequence[LayerCost], item: int
) -> tuple[tuple[float, bool], ...]:
    """The sums over the ranks a split of ``ts`` makes besides its output's and its input
    gradient's, ``(bytes per sample, forward)``, as the runtime makes them: each split RMS
    norm's sum of squares (float32, a number per token, forward and backward); an experts
    module's routing weights' gradient (float32, ``top_k`` per token, backward); a latent
    attention's latents after the first's (their gradients, backward); a LoRA row's adapters'
    ``lora_A`` outputs (an adapter rank's numbers per token, forward); with the adapters'
    dropout active, a LoRA column's dropped input (its own copy to the ranks, its gradient
    summed backward) and a DoRA row's base output recomputed on its dropped input (forward).
    Tokens per sample: the block's output rows (its last layer's output bytes over its
    features). DoRA's weight norm over a row, whatever the batch, is
    :func:`_dora_norm_sums`'s."""
    from hetcoll.torch.filters import (
        ExpertsLayout,
        experts_layout,
        linear_features,
        projection_features,
    )

    by_name = {x.name: x for x in layers}
    row = by_name.get(ts.base(ts.row))
    module = model.get_submodule(ts.row)
    features = 0
    if ts.kind == "experts":
        layout = experts_layout(module)
        features = layout.features if isinstance(layout, ExpertsLayout) else 0
    else:
        f = projection_features(module)
        features = 0 if f is None else f[1]
    if row is None or features <= 0:
        return ()
    tokens = row.out_bytes_per_sample / (features * item)
    sums: list[tuple[float, bool]] = []
    for _ in ts.norms:
        sums += [(tokens * 4.0, True), (tokens * 4.0, False)]
    if ts.kind == "experts":
        top_k = getattr(getattr(module, "config", None), "num_experts_per_tok", None)
        if isinstance(top_k, int):
            sums.append((tokens * top_k * 4.0, False))
    for column, upstream in ts.fed_by.items():
        f = linear_features(model.get_submodule(upstream))
        if column != ts.columns[0][0] and f is not None:
            sums.append((tokens * f[1] * item, False))
    for name, _ in ts.columns:
        if name in ts.adapted:  # each adapter's dropped input: a copy of its own
            wrapper = model.get_submodule(name)
            f = projection_features(wrapper)
            for _ in _dropped(wrapper):
                sums.append((tokens * (f[0] if f else 0) * item, False))
    if ts.row in ts.adapted:
        for lora_a in module.get_submodule("lora_A").children():
            rank = projection_features(lora_a)  # (in, adapter rank)
            sums.append((tokens * (rank[1] if rank else 0) * item, True))
        dora = getattr(module, "use_dora", None) or {}
        for a in _dropped(module):  # DoRA's base output recomputed on the dropped input
            if dora.get(a):
                sums.append((tokens * features * item, True))
    return tuple(sums)


def _dora_norm_sums(model: nn.Module, ts: TensorSplit, item: int) -> tuple[tuple[float, bool], ...]:
    """The sums a split of ``ts`` makes each forward whatever the batch, ``(bytes, forward)``:
    a DoRA row's sums of squares of each output's row of ``W + s B A`` (a number per output
    feature and enabled DoRA adapter, in the weight's dtype; the norm is detached: none
    backward). A column's norms are its own rows'."""
    from hetcoll.torch.filters import projection_features

    if ts.row not in ts.adapted:
        return ()
    wrapper = model.get_submodule(ts.row)
    f = projection_features(wrapper)
    dora = getattr(wrapper, "use_dora", None) or {}
    # The adapters PEFT's forward runs (``ts.adapted``: enabled, not merged).
    adapters = wrapper.get_submodule("lora_A")
    active = [a for a in getattr(wrapper, "active_adapters", ()) if a in adapters._modules]
    return tuple((float(f[1] * item), True) for a in active if f is not None and dora.get(a))


def _dropped(wrapper: nn.Module) -> list[str]:
    """The adapters of LoRA wrapper ``wrapper`` whose dropout is active in training (any
    ``lora_dropout`` but PEFT's ``nn.Identity`` for none)."""
    drops = getattr(wrapper, "lora_dropout", None)
    if not isinstance(drops, nn.ModuleDict):
        return []
    return [a for a, d in drops.items() if type(d) is not nn.Identity]


def _whole_rows(model: nn.Module, ts: TensorSplit) -> list[int]:
    """The elements of each parameter of ``ts``'s columns that every rank holds whole (the
    key and value rows packed with multi-query attention's query heads), whose gradients are
    summed over the ranks."""
    out = []
    for name, blocks in ts.columns:
        whole = sum(ts.whole_features.get(name, ()))
        if not whole:
            continue
        features = ts.units * sum(blocks) + whole
        for p in model.get_submodule(name).parameters(recurse=False):
            out.append(whole * (p.numel() // features))
    return out
