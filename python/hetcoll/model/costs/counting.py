"""Counting a model's ops on the meta device: a dispatch mode that gives every aten op's FLOPs
(torch's formulas) and bytes to the module call running it, and the kernels of a layer no
formula describes, made from its counts."""

from __future__ import annotations

import bisect
import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hetcoll.model.costs.records import _COUNT_BATCH, LOSS_LAYER, Kernel, ModelInput
from hetcoll.torch import meta_ops
from hetcoll.torch.replay import tensor_attributes_kept, tensors_replaced, wants_values

# Ops that allocate or alias without moving data, and ops that only write their output.
_NO_BYTES = frozenset(
    {
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "detach",
        "alias",
        "lift_fresh",
        "_unsafe_view",
        "_to_copy_meta_noop",
    }
)
_WRITE_ONLY = frozenset(
    {
        "zeros",
        "zeros_like",
        "ones",
        "ones_like",
        "full",
        "full_like",
        "new_zeros",
        "new_ones",
        "new_full",
        "fill_",
        "zero_",
        "scalar_tensor",
    }
)
# Ops that only move, select or fill data: no element-wise FLOP (see ``_OpCounter``).
#: Ops whose output's length is a count of what they find in their input (a mask's true
#: elements): the tokens routed to an expert, where the input grows with the batch.
_SELECTS = frozenset(
    {"nonzero", "argwhere", "masked_select", "_unique2", "unique_dim", "unique_consecutive"}
)

_MOVES = frozenset(
    {
        "copy_",
        "_to_copy",
        "clone",
        "contiguous",
        "cat",
        "stack",
        "repeat",
        "index",
        "_unsafe_index",
        "index_select",
        "index_put",
        "index_put_",
        "gather",
        "scatter",
        "embedding",
        "slice_scatter",
        "select_scatter",
        "select_backward",
        "slice_backward",
        "masked_fill",
        "masked_fill_",
        "where",
        "tril",
        "triu",
        "constant_pad_nd",
        "arange",
        "lift_fresh_copy",
        "expand_copy",
        "view_copy",
        "split_with_sizes_copy",
        "unbind_copy",
    }
)
# The autograd engine gives AccumulateGrad nodes this sequence number: they belong to no op.
_NO_SEQUENCE = 2**64 - 1


def _grouped_mm_flops(a: torch.Tensor, b: torch.Tensor, *args: Any, out_val: Any, **kw: Any) -> int:
    """``aten._grouped_mm``: a matmul per group of rows (or columns, or of the contraction),
    groups given by offsets: what Hugging Face's mixture-of-experts layers run by default
    (``experts_implementation="grouped_mm"``), every routed token through its experts.
    torch's FLOP formulas have none. Two 2-D operands split the contraction (the weights'
    gradient): each group contracts its own slice of it; otherwise every output element is
    one dot product of ``a``'s last dimension."""
    if a.dim() == 2 and b.dim() == 2:
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2 * out_val.numel() * a.shape[-1]


#: FLOP formulas of the ops torch's ``flop_registry`` lacks, in its calling convention.
_OWN_FLOPS: dict[Any, Callable[..., int]] = {torch.ops.aten._grouped_mm: _grouped_mm_flops}


def _computation_dtype(dtype: torch.dtype) -> torch.dtype:
    # What torch's decompositions compute half-precision batch norms in.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _batch_norm_outputs(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The outputs ``aten.native_batch_norm`` gives a contiguous meta input in training (the
    output like the input; the saved mean and inverse deviation, one value per channel, in
    the computation dtype), or None: the op itself then runs. On the meta device the op runs
    torch's Python decomposition, milliseconds a call (running statistics untouched: meta
    tensors hold no values)."""
    if not (training and input.device.type == "meta" and input.dim() >= 2):
        return None
    if not input.is_contiguous() or input.numel() <= input.shape[1]:
        return None  # (one value per channel: the op raises, dividing by n - 1)
    saved = torch.empty((input.shape[1],), dtype=_computation_dtype(input.dtype), device="meta")
    return torch.empty_like(input), saved, torch.empty_like(saved)


def _batch_norm_backward_outputs(
    grad_out: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    save_mean: torch.Tensor | None,
    save_invstd: torch.Tensor | None,
    train: bool,
    eps: float,
    output_mask: list[bool],
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
    """The outputs of ``aten.native_batch_norm_backward`` on contiguous meta tensors in
    training (the input's gradient like the input; the weight's and the bias's, where
    ``output_mask`` asks for them, one value per channel in the weight's dtype), or None."""
    if not (train and input.device.type == "meta" and input.dim() >= 2):
        return None
    if not (input.is_contiguous() and grad_out.is_contiguous() and grad_out.shape == input.shape):
        return None
    if input.numel() <= input.shape[1]:
        return None  # (as for the forward: the op itself says what it makes of that)
    dtype = weight.dtype if weight is not None else input.dtype
    per_channel = [
        torch.empty((input.shape[1],), dtype=dtype, device="meta") if wanted else None
        for wanted in output_mask[1:3]
    ]
    return torch.empty_like(input), per_channel[0], per_channel[1]


#: Ops whose outputs on the meta device are made here rather than by running them (each
#: function returns None where it does not know them).
_META_OUTPUTS: dict[Any, Any] = {
    torch.ops.aten.native_batch_norm.default: _batch_norm_outputs,
    torch.ops.aten.native_batch_norm_backward.default: _batch_norm_backward_outputs,
}


def _run(func: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """``func(*args, **kwargs)``, or the outputs :data:`_META_OUTPUTS` gives for it, or those
    :func:`hetcoll.torch.meta_ops.made_outputs` makes where this torch's meta kernel refuses
    the op: the same shapes, strides and dtypes, so the same counts."""
    if func is torch.ops.aten.embedding.default and not _integral(args[1]):
        # The CPU and CUDA kernels refuse such indices; torch 2.11's meta kernel does not.
        raise RuntimeError(
            "Expected tensor for argument #1 'indices' to have one of the following scalar "
            f"types: Long, Int; but got {args[1].dtype} instead (embedding)"
        )
    made = _META_OUTPUTS.get(func)
    out = None if made is None else made(*args, **kwargs)
    if out is None:
        out = meta_ops.made_outputs(func, args, kwargs)
    return func(*args, **kwargs) if out is None else out


def _integral(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


class _MetaOutputs(TorchDispatchMode):
    """Runs every op through :func:`_run`: a meta run of a model without its batch norms'
    decompositions."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return _run(func, args, kwargs or {})


def _tensor_bytes(t: torch.Tensor) -> float:
    """Bytes an op reads or writes of ``t``: its elements, or its storage when that is smaller
    (a broadcast ``expand`` reads its few elements once)."""
    nbytes = t.numel() * t.element_size()
    try:
        return float(min(nbytes, t.untyped_storage().nbytes()))
    except (RuntimeError, NotImplementedError):
        return float(nbytes)


def per_sample_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """One sample's part of a tensor of the counting batch: its first dimension that holds
    ``_COUNT_BATCH`` samples (the batch need not lead: a sequence-first layer's input is
    ``(seq, batch, features)``, and rows flattened from batch and sequence hold ``seq`` per
    sample) divided by the batch; a tensor without one (a constant) drops its first."""
    for i, n in enumerate(shape):
        if n > 0 and n % _COUNT_BATCH == 0:
            per = n // _COUNT_BATCH
            return (*shape[:i], *((per,) if per > 1 else ()), *shape[i + 1 :])
    return tuple(shape[1:])


@dataclass
class _Call:
    """One costed layer as the trace meets it: a leaf module's call, or a run of ops that a
    module's own ``forward`` does between its children's calls (a residual add, attention's
    matmuls in a parent's code)."""

    name: str
    module: nn.Module
    leaf: bool
    in_shape: tuple[int, ...] = ()
    out_shape: tuple[int, ...] = ()
    needs_input_grad: bool = False
    # [forward, backward] x [matmul-class FLOPs, their per-sample bytes, their fixed bytes,
    # per-sample bytes of every other op, their fixed bytes, matmul-class FLOPs of ops none
    # of whose tensors grows with the batch (a position table's projection, run once per
    # forward)], for the whole traced batch
    counts: list[list[float]] = field(default_factory=lambda: [[0.0] * 6, [0.0] * 6])
    #: Matmul-class FLOPs of the traced batch that gradient checkpointing's recompute ran in
    #: its backward (within ``counts[1][0]``): work a layer's formula does not hold.
    recomputed_flops: float = 0.0
    #: Whether a leaf's input grows with the batch (a layer run on a constant table, Swin
    #: v2's position-bias MLP, does not: its formula per sample would not hold).
    input_grows: bool = True
    #: The input's rows are routed tokens (a dimension the data decided): no whole samples.
    routed: bool = False
    #: Per-sample shapes are unknown for runs of ops: bytes of the first tensor the run reads
    #: and of the last one it writes stand for its input and output.
    first_in_bytes: float = -1.0
    last_out_bytes: float = 0.0
    #: The parameters (names) whose first use is in this call.
    params: list[str] = field(default_factory=list)
    #: [forward, backward] element-wise FLOPs of the traced batch (``_OpCounter``).
    elementwise_flops: list[float] = field(default_factory=lambda: [0.0, 0.0])
    #: [forward, backward]: the tensors its ops allocate (outputs that are none of their
    #: inputs), as {(bytes per sample, fixed bytes): how many}.
    allocations: list[dict[tuple[float, float], int]] = field(default_factory=lambda: [{}, {}])
    #: [forward, backward] x [matmul-class ops, every other op that runs a kernel] (views and
    #: allocations without data run none): each pays a device's fixed cost per kernel.
    launches: list[list[int]] = field(default_factory=lambda: [[0, 0], [0, 0]])


class _OpCounter(TorchDispatchMode):
    """Counts every aten op of a forward and backward pass: FLOPs by
    ``torch.utils.flop_counter``'s formulas (the ops ``FlopCounterMode`` counts), bytes read and
    written from the tensors' sizes, and apart from those the element-wise FLOPs of every other
    arithmetic op (softmax, masks, RoPE's multiplies, norms, activations, residual adds): one
    per element of the op's largest floating tensor, ops that only move data (copies, casts,
    indexing, ``where``, ``masked_fill``: ``_MOVES``) none; each op goes to the
    innermost module call running it (forward) or to the call whose forward op made the autograd
    node running it (backward: nodes are matched by their sequence numbers)."""

    def __init__(self, param_names: dict[int, str]) -> None:
        super().__init__()
        self.calls: list[_Call] = []
        # Module calls being run: [name, module, its leaf call or its current run of ops].
        self.stack: list[list[Any]] = []
        self.param_names = param_names
        self.param_seen: set[int] = set()
        self._pending: list[tuple[torch.Tensor, int]] = []
        self._node_seq: list[int] = []
        self._node_call: list[int] = []
        self.unattributed_bytes = 0.0
        #: Whether the model was counted with its eager attention (see ``_trace``).
        self.eager_attention = False
        #: Counted without the attention mask the inputs name (see ``_trace``).
        self.mask_left_out = False
        #: Sizes the data decides that grow with the batch: the counts of what an op that
        #: selects elements (:data:`_SELECTS`) found in a tensor that grows with it (the
        #: tokens routed to an expert by an eager loop over experts), not multiples of the
        #: counting batch.
        self.routed_sizes: set[int] = set()
        #: How deep the module calls gradient checkpointing recomputes in the backward nest.
        self.recomputing = 0

    def grows(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s size grows with the batch: a multiple of the counting batch's
        samples, or a dimension the data decided (:attr:`routed_sizes`)."""
        return t.numel() % _COUNT_BATCH == 0 or any(n in self.routed_sizes for n in t.shape)

    def enter(self, name: str, module: nn.Module, args: tuple) -> None:
        leaf = not any(True for _ in module.children())
        call = None
        if torch._C._current_graph_task_id() != -1:
            # Called inside the backward: gradient checkpointing recomputing its forward. No
            # layer of its own: its ops are backward work of the layer whose node runs them.
            self.stack.append([name, module, None, True])
            self.recomputing += 1
            return
        if leaf:
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            call = _Call(name, module, True)
            if x is not None:
                call.in_shape = per_sample_shape(x.shape)
                call.needs_input_grad = bool(x.requires_grad)
                call.input_grows = self.grows(x)
                call.routed = any(n in self.routed_sizes for n in x.shape)
            self.calls.append(call)
        self.stack.append([name, module, call])

    def enter_code(self, name: str, module: nn.Module) -> None:
        """Ops outside any module of the model (the loss), counted as ``name``'s own ops."""
        self.stack.append([name, module, None])

    def leave(self, output: object) -> None:
        frame = self.stack.pop()
        if len(frame) > 3:  # a recomputed call's
            self.recomputing -= 1
            return
        call = frame[2]
        if call is not None and call.leaf:
            y = output[0] if isinstance(output, (tuple, list)) and output else output
            if isinstance(y, torch.Tensor):
                call.out_shape = per_sample_shape(y.shape)

    def _forward_call(self) -> int | None:
        if not self.stack:
            return None
        frame = self.stack[-1]
        call = frame[2]
        if call is None or (not call.leaf and self.calls[-1] is not call):
            call = _Call(frame[0], frame[1], False)
            frame[2] = call
            self.calls.append(call)
        return len(self.calls) - 1

    def _flush(self) -> None:
        # The previous op's outputs carry their autograd node by now.
        for t, index in self._pending:
            node = t.grad_fn
            if node is not None:
                seq = node._sequence_nr()
                if not self._node_seq or seq > self._node_seq[-1]:
                    self._node_seq.append(seq)
                    self._node_call.append(index)
        self._pending.clear()

    def finish_forward(self) -> None:
        self._flush()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        from torch.utils.flop_counter import flop_registry

        kwargs = kwargs or {}
        self._flush()
        packet = func._overloadpacket
        # Unlike FlopCounterMode, no op is decomposed: a fused kernel (batch norm) moves the
        # bytes of its inputs and outputs, not of its decomposition's intermediates; only
        # batch norm decomposes on the models tested, into no matmul (the FLOPs agree).
        out = _run(func, args, kwargs)
        node = torch._C._current_autograd_node()
        backward = node is not None
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if backward:
            seq = node._sequence_nr()
            at = bisect.bisect_right(self._node_seq, seq) - 1
            index = self._node_call[at] if seq != _NO_SEQUENCE and at >= 0 else None
        else:
            # Once each, though an op may take a tensor twice (registering PEFT's
            # parametrization at each forward passes the wrapped weight twice to one op).
            fresh = list(
                {
                    id(t): t
                    for t in inputs
                    if id(t) in self.param_names and id(t) not in self.param_seen
                }.values()
            )
            name = packet.__name__
            costly = not (func.is_view or name in _NO_BYTES)
            index = self._forward_call() if costly or fresh else None
            if index is not None:
                for t in fresh:
                    self.param_seen.add(id(t))
                    self.calls[index].params.append(self.param_names[id(t)])
                self._pending.extend((t, index) for t in outputs)
        name = packet.__name__
        selects = name in _SELECTS or (
            name == "index" and any(t.dtype == torch.bool for t in inputs[1:])
        )
        if selects and inputs and self.grows(inputs[0]):
            self.routed_sizes.update(n for t in outputs for n in t.shape[:1] if n > 1)
        if func.is_view or name in _NO_BYTES:
            return out
        if name in _WRITE_ONLY:
            moved = outputs
        elif packet is torch.ops.aten.embedding and len(inputs) >= 2:
            # A lookup reads the rows it gathers (as many bytes as it writes), not the table.
            moved = [inputs[1], *outputs, *outputs]
        else:
            moved = [*{id(t): t for t in inputs}.values(), *outputs]
        per_sample = fixed = 0.0
        grown = [self.grows(t) for t in moved]
        for t, grows in zip(moved, grown, strict=True):
            if grows:
                per_sample += _tensor_bytes(t)
            else:
                fixed += _tensor_bytes(t)
        if index is None:
            self.unattributed_bytes += per_sample + fixed
            return out
        call = self.calls[index]
        c = call.counts[1 if backward else 0]
        made = call.allocations[1 if backward else 0]
        given = {id(t) for t in inputs}
        for t in outputs:
            if id(t) not in given:
                n = _tensor_bytes(t)
                size = (n / _COUNT_BATCH, 0.0) if self.grows(t) else (0.0, n)
                made[size] = made.get(size, 0) + 1
        formula = flop_registry.get(packet) or _OWN_FLOPS.get(packet)
        flops = formula(*args, **kwargs, out_val=out) if formula is not None else 0
        at = 1 if flops else 3
        if not flops and name not in _MOVES and name not in _WRITE_ONLY:
            # An arithmetic op: one FLOP per element of its largest floating tensor (a
            # reduction reads more than it writes), counted where it grows with the batch.
            big = max(
                (t for t in (*inputs, *outputs) if t.is_floating_point()),
                key=lambda t: t.numel(),
                default=None,
            )
            if big is not None and self.grows(big):
                call.elementwise_flops[1 if backward else 0] += big.numel()
        if flops and not any(grown):
            c[5] += flops  # the same whatever the batch: once a step
        else:
            c[0] += flops
            if backward and self.recomputing:
                call.recomputed_flops += flops
        call.launches[1 if backward else 0][0 if flops else 1] += 1
        c[at] += per_sample
        c[at + 1] += fixed
        if not backward:
            # Only tensors that grow with the batch stand for the layer's input and output.
            if call.first_in_bytes < 0 and inputs and self.grows(inputs[0]):
                call.first_in_bytes = _tensor_bytes(inputs[0])
            if outputs and self.grows(outputs[0]):
                call.last_out_bytes = _tensor_bytes(outputs[0])
        return out


def _trace(
    model: nn.Module,
    inputs: Sequence[ModelInput],
    batch: int,
    loss: Callable[[Any], torch.Tensor] | None = None,
) -> _OpCounter:
    """Run ``model`` forward and backward on meta tensors for ``batch`` samples of ``inputs``
    (one positional input or keyword inputs), counting every op (:class:`_OpCounter`); with
    ``loss``, the backward starts from ``loss(output)``, whose ops are the call
    :data:`LOSS_LAYER` (else from zero gradients of every output). A
    forward that reads its inputs' values (Hugging Face's check for packed sequences when no
    attention mask is given), or that makes tensors of its own on the CPU (a causal mask built
    without ``device=``), cannot run on the meta device: it is counted on a real run of zeros
    (valid token ids, zero weights) on the CPU instead, which holds the model's weights and
    that batch's activations in memory.

    A Hugging Face model attending through ``F.scaled_dot_product_attention`` (its default,
    ``"sdpa"``) reads the attention mask's values, to leave a mask of no padding out: where
    that stops the meta run, the model is counted there again with its eager attention (the
    same matmuls and softmax, written out; ``eager_attention`` on the counter), and its own
    implementation is set back after. An encoder's bidirectional mask is read for its values
    in either implementation (to leave out a mask of no padding): where it still stops the
    meta run, the model is counted without the ``attention_mask`` input (``mask_left_out``):
    what it runs for a mask of no padding, the one the count's inputs are, save the masks'
    own few element-wise passes of eager attention."""
    meta = torch.device("meta")
    try:
        return _count(model, inputs, batch, meta, loss)
    except _NeedsValues as first:
        e = first
        with _eager_attention(model) as switched:
            if switched:
                try:
                    counter = _count(model, inputs, batch, meta, loss)
                    counter.eager_attention = True
                    return counter
                except _NeedsValues as again:
                    e = again
        unmasked = [x for x in inputs if x.name != "attention_mask"]
        if unmasked and len(unmasked) < len(inputs):
            try:
                counter = _count(model, unmasked, batch, meta, loss)
                counter.mask_left_out = True
                return counter
            except (_NeedsValues, ValueError):
                # Not the mask's values that stopped it (a forward that needs its mask, or
                # makes tensors on the CPU): the real run below, with every input.
                pass
        cause = str(e.__cause__).splitlines()[0] if e.__cause__ is not None else "values"
        named = {x.name for x in inputs}
        hint = (
            " (a Hugging Face model given its attention_mask among the inputs runs there: "
            '{"input_ids": ..., "attention_mask": ...}, or --input '
            "input_ids=N,attention_mask=N)"
            if "attention_mask" not in named
            else ""
        )
        warnings.warn(
            f"layer_costs: {type(model).__name__}'s forward does not run on the meta device "
            f"({cause}){hint}; counted by a real run of {batch} samples on the CPU instead, "
            "which is slow for a large model and must fit in this machine's memory",
            stacklevel=3,
        )
        return _count(model, inputs, batch, torch.device("cpu"), loss)


class _NeedsValues(Exception):
    pass


@contextlib.contextmanager
def _eager_attention(model: nn.Module) -> Iterator[bool]:
    """``model`` (a Hugging Face model whose attention is not eager) with its attention set to
    the eager implementation, and set back after; yields whether it was switched."""
    config = getattr(model, "config", None)
    own = getattr(config, "_attn_implementation", None)
    switch = getattr(model, "set_attn_implementation", None)
    if own in (None, "eager") or not callable(switch):
        yield False
        return
    # Each sub-model's own, set back as it was: switching back with the model's would give
    # every sub-model the model's (DETR's ResNet backbone refuses sdpa).
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    owns = [(c, getattr(c, "_attn_implementation", None)) for c in configs.values()]
    switch("eager")
    try:
        yield getattr(config, "_attn_implementation", None) == "eager"
    finally:
        for c, value in owns:
            with contextlib.suppress(AttributeError, TypeError, ValueError):
                c._attn_implementation = value


class _LossError(Exception):
    pass


class _Loss(nn.Module):
    """What the loss's ops are attributed to (it owns no parameters)."""


def _output_tensors(value: object, depth: int = 3) -> list[torch.Tensor]:
    """The tensors of a forward's output: its pytree's (tuples, lists, dicts, Hugging Face's
    ``ModelOutput``); where it has none, those an object of another kind holds as attributes
    (``types.SimpleNamespace(logits=...)``, a user's dataclass), a few levels down. (Not
    beside tensors: a key/value cache in a ``ModelOutput`` is no output to start from.)"""
    leaves = tree_flatten(value)[0]
    out = [t for t in leaves if isinstance(t, torch.Tensor)]
    if out or not depth:
        return out
    for leaf in leaves:
        if hasattr(leaf, "__dict__") and not isinstance(leaf, nn.Module | type):
            out += _output_tensors(dict(vars(leaf)), depth - 1)
    return out


def _loss_value(
    counter: _OpCounter, loss: Callable[[Any], torch.Tensor], y: object
) -> torch.Tensor:
    counter.enter_code(LOSS_LAYER, _Loss())
    try:
        value = loss(y)
    except (RuntimeError, ValueError, TypeError, IndexError, AttributeError) as e:
        if wants_values(e):
            raise
        raise _LossError(f"loss: fails on the model's output: {type(e).__name__}: {e}") from e
    finally:
        counter.stack.pop()
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.requires_grad:
        raise _LossError(
            "loss: must return one number that depends on the model's output (a tensor of one "
            f"element with a gradient), got {type(value).__name__}"
            + (f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else "")
        )
    counter.finish_forward()
    return value


@contextlib.contextmanager
def _holding(model: nn.Module, state: dict[str, torch.Tensor]) -> Iterator[None]:
    """``model`` holding ``state``'s tensors (by parameter or buffer name) in place of its
    own while the context lasts, every module holding a tied one alike (as
    ``torch.func.functional_call`` does, but for the backward too)."""
    own: dict[str, torch.Tensor] = dict(model.named_parameters())
    own.update(model.named_buffers())
    by_id = {id(own[k]): t for k, t in state.items() if k in own}
    with tensors_replaced(model, lambda t, _: by_id.get(id(t))):
        yield


def _count(
    model: nn.Module,
    inputs: Sequence[ModelInput],
    batch: int,
    device: torch.device,
    loss: Callable[[Any], torch.Tensor] | None,
) -> _OpCounter:
    from hetcoll.model.costs.inputs import example_batch

    def on(v: torch.Tensor) -> torch.Tensor:
        return (torch.empty_like if device.type == "meta" else torch.zeros_like)(v, device=device)

    state = {k: on(v).requires_grad_(v.requires_grad) for k, v in model.named_parameters()}
    param_names = {id(v): k for k, v in state.items()}
    state.update({k: on(v) for k, v in model.named_buffers()})
    counter = _OpCounter(param_names)
    handles = []
    for name, mod in model.named_modules():
        label = name or type(mod).__name__

        def pre(m: nn.Module, args: tuple, _label: str = label) -> None:
            counter.enter(_label, m, args)

        def post(m: nn.Module, args: tuple, out: object) -> None:
            counter.leave(out)

        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post, always_call=True))
    args, kwargs = example_batch(inputs, batch, str(device))
    was_training = model.training
    model.train()
    try:
        # The model holds the counting tensors through the backward too: gradient
        # checkpointing recomputes its forward there, on the tensors it holds then.
        with counter, tensor_attributes_kept(model), _holding(model, state):
            y = model(*args, **kwargs)
            counter.finish_forward()
            if loss is not None:
                torch.autograd.backward(_loss_value(counter, loss, y))
            else:
                outs = [t for t in _output_tensors(y) if t.requires_grad]
                if outs:
                    torch.autograd.backward(outs, [torch.zeros_like(t) for t in outs])
    except _LossError as e:
        raise ValueError(str(e)) from None
    except (
        RuntimeError,
        ValueError,
        TypeError,
        IndexError,
        KeyError,
        AssertionError,  # a model's own check of its inputs (torchvision's detection targets)
        NotImplementedError,
    ) as e:
        # A forward that reads values, or makes a tensor on the CPU itself (a mask built
        # without device=) and meets the meta ones: counted on the CPU instead.
        if device.type == "meta" and wants_values(e):
            raise _NeedsValues from e
        what = ", ".join(
            f"{x.name + '=' if x.name else ''}{'x'.join(map(str, x.shape))} {x.dtype}"
            for x in inputs
        )
        raise ValueError(f"input_shape: the model does not accept samples of {what}: {e}") from e
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return counter


def _counted_kernels(call: _Call) -> tuple[list[Kernel], list[Kernel]]:
    """Kernels of a layer no formula describes, from its op counts: per direction one
    matmul-class kernel (the FLOPs FlopCounterMode counts: matmuls, convolutions, attention) and
    one element-wise kernel (every other op, costed by the bytes it moves), each standing for
    as many kernel launches as the ops it sums (a transformer block's own code runs hundreds of
    small ops a pass, each paying the device's fixed cost per kernel whatever its size)."""
    out: tuple[list[Kernel], list[Kernel]] = ([], [])
    for d, (kernels, suffix) in enumerate(zip(out, ("", "-grad"))):
        flops, mm, mm_fixed, ew, ew_fixed, flops_fixed = call.counts[d]
        flops_ps, mm_ps, ew_ps = flops / _COUNT_BATCH, mm / _COUNT_BATCH, ew / _COUNT_BATCH
        mm_launches, ew_launches = call.launches[d]
        if flops_ps or flops_fixed or mm_ps or mm_fixed or mm_launches:
            kernels.append(
                Kernel(
                    "matmul" + suffix,
                    flops_ps,
                    bytes_per_sample=mm_ps,
                    bytes_fixed=mm_fixed,
                    launches=max(mm_launches, 1),
                    flops_fixed=flops_fixed,
                )
            )
        if ew_ps or ew_fixed or ew_launches:
            kernels.append(
                Kernel(
                    "ops" + suffix,
                    0.0,
                    bytes_per_sample=ew_ps,
                    bytes_fixed=ew_fixed,
                    elementwise=True,
                    launches=max(ew_launches, 1),
                )
            )
    return out
