""":func:`layer_costs`: a model's layers costed - the formulas of :mod:`.formulas` where a layer
has one, its counted ops (:mod:`.counting`) elsewhere - and the top-level layers a plan counts."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn

from hetcoll.model.costs.counting import _counted_kernels, _MetaOutputs, _trace
from hetcoll.model.costs.formulas import (
    _VIEWS,
    _conv_kernels,
    _elementwise_kernels,
    _linear_kernels,
)
from hetcoll.model.costs.records import (
    _COUNT_BATCH,
    _TRACE_BATCH,
    Kernel,
    LayerCost,
    ModelCosts,
    _numel,
    parse_shape,
)
from hetcoll.model.hardware import check_precision


def layer_costs(
    model: nn.Module,
    input_shape: Sequence[int] | str,
    *,
    dtype: torch.dtype = torch.float32,
    conv_algorithm: str = "implicit-gemm",
    precision: str = "fp32",
) -> ModelCosts:
    """Per-layer costs of ``model`` for one sample of ``input_shape`` (no batch dimension).

    ``conv_algorithm``: ``"implicit-gemm"`` (PyTorch's oneDNN / cuDNN kernels: no column
    matrix in memory) or ``"im2col"`` (PyDTNN's explicit im2col / col2im, seed 003).
    ``precision``: the training precision (:meth:`ModelCosts.at_precision`).

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
    """
    from hetcoll.torch.filters import filter_modes

    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if conv_algorithm not in ("implicit-gemm", "im2col"):
        raise ValueError(
            f"conv_algorithm: expected 'implicit-gemm' or 'im2col', got {conv_algorithm!r}"
        )
    check_precision(precision)
    shape = parse_shape(input_shape) if isinstance(input_shape, str) else tuple(input_shape)
    if not shape or any(not isinstance(s, int) or s < 1 for s in shape):
        raise ValueError(f"input_shape: expected positive integer sizes, got {input_shape!r}")
    item = torch.empty((), dtype=dtype).element_size()

    counter = _trace(model, shape, _COUNT_BATCH, dtype)
    param_of = dict(model.named_parameters())

    layers: list[LayerCost] = []
    notes: list[str] = []
    for c2 in counter.calls:
        mod = c2.module
        owned = [param_of[n] for n in c2.params if n in param_of]
        n_params = sum(p.numel() for p in owned)
        p_bytes = float(sum(p.numel() * p.element_size() for p in owned))
        in_s, out_s = c2.in_shape, c2.out_shape
        in_e, out_e = _numel(in_s), _numel(out_s)
        filters, groups = 0, 1
        ks: tuple[list[Kernel], list[Kernel]] | None = None
        if c2.leaf and in_s and out_s:
            if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and not isinstance(
                mod, nn.modules.conv._ConvTransposeNd
            ):
                ks = _conv_kernels(
                    mod, in_s, out_s, c2.needs_input_grad, item, conv_algorithm == "im2col"
                )
                filters, groups = mod.out_channels, mod.groups
            elif isinstance(mod, nn.Linear):
                ks = _linear_kernels(mod, in_s, c2.needs_input_grad, item)
                filters = mod.out_features
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
                )
            in_b, out_b = float(in_e * item), float(out_e * item)
            saved = 0.0 if isinstance(mod, _VIEWS) else in_b
        else:
            ks = _counted_kernels(c2)
            if c2.leaf and in_s and out_s:
                in_b, out_b = float(in_e * item), float(out_e * item)
            else:
                in_b = max(c2.first_in_bytes, 0.0) / _COUNT_BATCH
                out_b = c2.last_out_bytes / _COUNT_BATCH
            saved = in_b
        layers.append(
            LayerCost(
                name=c2.name,
                kind=type(mod).__name__ if c2.leaf else f"{type(mod).__name__}.forward",
                params=n_params,
                param_bytes=p_bytes,
                in_bytes_per_sample=in_b,
                out_bytes_per_sample=out_b,
                saved_bytes_per_sample=saved,
                filters=filters,
                forward=tuple(ks[0]),
                backward=tuple(ks[1]),
                groups=groups,
                own_ops=not c2.leaf,
            )
        )
    unused = set(param_of) - {n for c in counter.calls for n in c.params}
    if unused:
        notes.append(f"{len(unused)} parameters are not used by the forward pass")
    if not layers or sum(x.forward_flops(1) for x in layers) == 0:
        notes.append("no costed layers found")
    leaves = [id(c.module) for c in counter.calls if c.leaf]
    if len(set(leaves)) < len(leaves):
        notes.append("some modules run more than once per step; each call is a layer")
    buffer_bytes = float(sum(b.numel() * b.element_size() for b in model.buffers()))
    # A bare leaf model is one layer named after its type (see ``_trace``).
    modes = tuple((n or type(model).__name__, m) for n, m in filter_modes(model).items())
    costs = ModelCosts(tuple(layers), shape, item, tuple(notes), buffer_bytes, modes)
    costs = _with_plan_layers(costs, model, dtype)
    return costs if precision == "fp32" else costs.at_precision(precision)


def _with_plan_layers(costs: ModelCosts, model: nn.Module, dtype: torch.dtype) -> ModelCosts:
    """``costs`` with the model's top-level layers as a Plan counts them: each costed layer's
    top-level layer, the top-level layers' output bytes (a run on the meta device), and the
    modes the runtime would give a filter-split stage starting at each of them."""
    from dataclasses import replace

    from torch.func import functional_call

    from hetcoll.torch.filters import chain_filter_modes
    from hetcoll.torch.layers import model_layers

    try:
        chain = model_layers(model)
    except (TypeError, ValueError) as e:
        return replace(costs, plan_layers_note=str(e))
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
    x = torch.empty((_TRACE_BATCH, *costs.input_shape), device="meta", dtype=dtype)
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
        keys = list(modes)
        rows = []
        for k, (name, mode) in enumerate(modes.items()):
            # The rule pairs a split-output layer with the next layer it splits.
            partner = ""
            if mode == "split-output" and k + 1 < len(keys) and modes[keys[k + 1]] == "split-input":
                partner = keys[k + 1]
            rows.append((name, mode, partner))
        stage_modes.append(tuple(rows))
    return replace(
        costs,
        plan_layers=tuple(names),
        plan_layer_of=tuple(of),
        plan_out_bytes=tuple(out_bytes),
        plan_layer_kinds=tuple(type(m).__name__ for _, m in chain),
        stage_modes=tuple(stage_modes),
    )
