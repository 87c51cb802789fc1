"""Tensor parallelism of transformer blocks: which attentions split by heads and which MLPs by
hidden units (:class:`TensorSplit`, :func:`plan_tensor_splits`), Megatron-LM's column/row pairing
found by module attributes and torch.fx graphs. It reads module types, attributes and traced
graphs only, so a model on the meta device works."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from hetcoll.torch.filters.chains import (
    ELEMENTWISE_FUNCTIONS,
    ELEMENTWISE_METHODS,
    ELEMENTWISE_MODULES,
    linear_features,
)
from hetcoll.torch.filters.layers import FilterParallelMultiheadAttention
from hetcoll.torch.filters.split_output import RESHAPES, target_shape


@dataclass
class TensorSplit:
    """An attention split by whole heads (by key/value group under grouped-query attention,
    each query head following its group) or an MLP split by hidden units, paired as Megatron-LM
    pairs them: ``columns`` — the layers reading the block's input, split along their outputs
    ("split-output", one shared copy of the input) — feed ``row``, split along its input
    ("split-input", one sum-reduction of the block's output).

    ``units``: the key/value groups (attention) or hidden units (MLP) the ranks divide;
    ``width``: the row layer's input features per unit; ``columns``: ``(layer, blocks)``, the
    output features per unit of each block the layer's output packs (one block; three for
    query, key and value packed in one layer: ``(rep * head_dim, head_dim, head_dim)``);
    ``attrs``: the module's attributes that count heads (or their features), by their value per
    unit: a rank's module runs with its own counts; ``config``: the same for the head counts
    of its ``config``, which the rank's module sees in a view of its own (:class:`ConfigView`:
    the config itself is shared by every layer); ``empty_fails``: why its forward cannot run
    on a rank holding none of its units ("" where it can, or no probe could tell:
    :func:`runs_without_heads`). ``shared``: the module's other parameters
    (a query/key norm over the head dimension, as Qwen3's and Gemma 3's), every rank holding
    them whole and applying them to its own heads: each rank's gradient is its heads' part,
    summed over the ranks in the backward. ``head_dim``: an attention's head size.
    """

    kind: str
    module: str
    units: int
    width: int
    columns: list[tuple[str, tuple[int, ...]]]
    row: str
    attrs: dict[str, int] = field(default_factory=dict)
    config: dict[str, int] = field(default_factory=dict)
    shared: list[str] = field(default_factory=list)
    head_dim: int = 0
    empty_fails: str = ""

    def heads(self) -> int:
        """An attention's query heads (unsplit); 0 for an MLP."""
        return self.units * self.width // self.head_dim if self.head_dim else 0

    def layers(self) -> list[str]:
        return [c for c, _ in self.columns] + [self.row]

    def features_per_unit(self) -> list[int]:
        """The channels each of :meth:`layers` splits per unit a rank holds: a column's output
        features (every packed block's), the row's input features."""
        return [sum(blocks) for _, blocks in self.columns] + [self.width]

    def packed(self) -> int:
        """How many blocks its most packed column holds (3: query, key and value in one)."""
        return max(len(blocks) for _, blocks in self.columns)

    def hold(self, module: nn.Module, units: int) -> None:
        """Make ``module`` (its :attr:`module`) count the heads of ``units`` units, where it
        counts them: its attributes, and its config's counts in a view of its own
        (:class:`ConfigView`)."""
        for attr, per in self.attrs.items():
            setattr(module, attr, per * units)
        if self.config:
            view: Any = ConfigView(
                module.config, {a: per * units for a, per in self.config.items()}
            )
            module.config = view


def _aligned(dims: Sequence[int], wants: Sequence[int]) -> int | None:
    """How many of ``dims`` (a tensor's sizes, from one end) the sizes ``wants`` of a reshape
    cover, from the same end; None where they do not line up. An empty dimension (heads, 0)
    meets a 0 (heads, or batch x heads) among ``wants``, the sizes before that 0 being part of
    it (``(batch, 0)`` of a ``batch x heads`` dimension); a 0 among ``wants`` covers the sizes
    up to the empty dimension (``batch x heads`` of ``(batch, 0, ...)``)."""
    j = 0
    for d in wants:
        if j < len(dims) and dims[j] == 0:
            j += d == 0  # a 0 meets the empty dimension; any other size is a part of it
            continue
        if d == 0:
            while j < len(dims) and dims[j] != 0:
                j += 1
            if j == len(dims):
                return None
            j += 1
            continue
        product = 1
        while product < d and j < len(dims) and dims[j] != 0:
            product *= dims[j]
            j += 1
        if product != d:
            return None
    return j


def fill_empty_reshape(shape: Sequence[int], target: Sequence[int]) -> list[int]:
    """``target`` (one ``-1``) for a reshape of an empty tensor of ``shape`` whose emptiness is
    a rank's heads (0): ``-1`` takes the sizes the other target sizes leave, lined up from both
    ends (:func:`_aligned`), so it is what it would be with heads; where they do not line up,
    the size the tensor has in its position; 0 where nothing else in the target is.

    >>> fill_empty_reshape([0, 5, 4], [2, 0, 5, -1])  # BLOOM's scores: (batch x heads, q, k)
    [2, 0, 5, 4]
    >>> fill_empty_reshape([2, 0, 5, 4], [0, -1, 4])  # its queries: (batch, heads, q, head)
    [0, 5, 4]
    """
    i = list(target).index(-1)
    left = _aligned(shape, target[:i])
    right = _aligned(list(shape)[::-1], list(target[i + 1 :])[::-1])
    if left is not None and right is not None and left + right <= len(shape):
        size = math.prod(shape[left : len(shape) - right])
    else:
        size = shape[i] if i < len(shape) else 0
    resolved = [size if d == -1 else d for d in target]
    if 0 not in resolved:
        resolved[i] = 0
    return resolved


class EmptyHeads(TorchFunctionMode):
    """The forward of an attention on a rank that holds none of its heads: it runs on empty
    tensors, where two kinds of op need help that torch cannot give an empty dimension.
    - A projection packing query, key and value (GPT-2's ``c_attn``, ``parts`` 3) is split by
      its heads' width, now 0, into ``parts`` pieces, where torch gives one piece of an empty
      dimension: here it gives ``parts`` empty pieces.
    - A reshape with ``-1`` (OPT's ``view(batch, -1, heads, head_dim)``, BLOOM's
      ``reshape(batch * heads, -1, head_dim)``) is ambiguous on an empty tensor: here ``-1``
      takes the size it has where the heads are not 0 (:func:`fill_empty_reshape`).
    Every other op runs as torch runs it. Entered by a forward pre-hook of the attention
    module, left by its forward hook."""

    def __init__(self, parts: int) -> None:
        super().__init__()
        self.parts = parts

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.Tensor.split, torch.split) and args and self.parts > 1:
            t, size = args[0], args[1] if len(args) > 1 else kwargs.get("split_size")
            dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
            if isinstance(size, int) and size == 0 and t.shape[dim] == 0:
                return tuple(t.narrow(dim, 0, 0) for _ in range(self.parts))
        if func in RESHAPES and args and isinstance(args[0], torch.Tensor):
            t = args[0]
            shape = target_shape(args[1:], kwargs)
            if t.numel() == 0 and shape is not None and shape.count(-1) == 1:
                return func(t, fill_empty_reshape(list(t.shape), shape))
        return func(*args, **kwargs)

    def enter(self, module: nn.Module, args: Any) -> None:
        self.__enter__()

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.__exit__(None, None, None)


# Reads of a tensor's metadata (``.shape``, ``.size()``): no use of its values.
_INSPECTIONS = {"__get__", "size", "dim", "numel", "stride", "is_contiguous", "contiguous"}


def packing_read(shape: Sequence[int], packed: int, heads: int, head_dim: int) -> str | None:
    """How a reshape of a ``packed``-dimensional packed query/key/value output to ``shape``
    reads it, for ``heads`` heads of ``head_dim``: ``"heads"`` head by head, one more
    dimension ``(..., heads, 3 * head_dim)`` (GPT-NeoX) or two more ``(..., heads, 3,
    head_dim)`` (BLOOM); ``"blocks"`` as three blocks, ``(..., 3, heads * head_dim)`` or
    ``(..., 3, heads, head_dim)``; None for another reshape, or where both readings coincide
    (3 heads of 3): it cannot tell."""
    h, d = heads, head_dim
    if len(shape) == packed + 1:
        by_head = shape[-2] in (h, -1) and shape[-1] == 3 * d
        blocked = shape[-2] == 3 and shape[-1] in (h * d, -1)
    elif len(shape) == packed + 2:
        by_head = shape[-3] in (h, -1) and list(shape[-2:]) == [3, d]
        blocked = shape[-3] == 3 and shape[-2] in (h, -1) and shape[-1] == d
    else:
        return None
    if by_head == blocked:
        return None
    return "heads" if by_head else "blocks"


class _Watch(TorchFunctionMode):
    """Watches the first op a forward applies to one tensor (a packed projection's output,
    given to :meth:`watch` by that layer's forward hook) and hands ``(func, args, kwargs)`` to
    ``decide``, which may raise to stop the forward there."""

    def __init__(self) -> None:
        super().__init__()
        self.watched: torch.Tensor | None = None
        self.seen = False

    def watch(self, module: nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor) and not self.seen:
            self.watched = output

    def decide(self, func: Any, args: Any, kwargs: Any) -> None:
        raise NotImplementedError

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if (
            self.watched is not None
            and args
            and args[0] is self.watched
            and getattr(func, "__name__", "") not in _INSPECTIONS
        ):
            self.watched, self.seen = None, True  # the first op decides
            self.decide(func, args, kwargs)
        return func(*args, **kwargs)


def _reshaped_to(func: Any, args: Any, kwargs: Any) -> list[int] | None:
    """The shape a reshape of ``args[0]`` asks for (``view``, ``reshape``, ``unflatten``)."""
    if func is torch.Tensor.unflatten and len(args) > 2:
        return [*args[0].shape[: args[1]], *args[2]]
    return target_shape(args[1:], kwargs) if func in RESHAPES else None


class _Probed(Exception):
    """Stops a probe's forward once its packed output's first op is seen."""


def _cut_read(
    func: Any, args: Any, kwargs: Any, heads: int, kv_heads: int, head_dim: int
) -> str | None:
    """``"blocks"`` when ``func(*args)`` cuts a packed query/key/value output along its last
    dimension where the query heads end: ``qkv[..., :heads * head_dim]`` (Phi-3's), or
    ``split`` into the three blocks' widths; else None."""
    t, width = args[0], heads * head_dim
    if func is torch.Tensor.__getitem__ and len(args) > 1:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        last = index[-1] if index else None
        along_last = len(index) == t.dim() or (len(index) == 2 and index[0] is Ellipsis)
        if along_last and isinstance(last, slice) and last.start in (None, 0):
            return "blocks" if last.stop == width and last.step in (None, 1) else None
        return None
    if func in (torch.Tensor.split, torch.split) and len(args) > 1:
        dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
        if dim not in (-1, t.dim() - 1):
            return None
        sizes = args[1]
        blocks = [width, kv_heads * head_dim, kv_heads * head_dim]
        if sizes == blocks or (kv_heads == heads and sizes == width):
            return "blocks"
    return None


def grouped_read(shape: Sequence[int], packed: int, kv_heads: int, per_group: int) -> str | None:
    """``"groups"`` when a reshape of a ``packed``-dimensional output packing query, key and
    value under grouped-query attention to ``shape`` reads it key/value group by group: each
    group's query heads, key head and value head together, ``(..., kv_heads, per_group *
    head_dim)`` or ``(..., kv_heads, per_group, head_dim)`` (InternLM2's ``wqkv``; ``per_group``
    = query heads per group + 2); else None."""
    if len(shape) == packed + 1:
        return "groups" if shape[-2] in (kv_heads, -1) and shape[-1] % per_group == 0 else None
    if len(shape) == packed + 2:
        return "groups" if shape[-3] in (kv_heads, -1) and shape[-2] == per_group else None
    return None


class _PackingProbe(_Watch):
    def __init__(self, heads: int, head_dim: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim, self.kv_heads = heads, head_dim, kv_heads
        self.read: str | None = None

    def decide(self, func: Any, args: Any, kwargs: Any) -> None:
        shape = _reshaped_to(func, args, kwargs)
        h, kv, d = self.heads, self.kv_heads, self.head_dim
        if shape is not None and kv == h:
            self.read = packing_read(shape, args[0].dim(), h, d)
        elif shape is not None:
            per_group = h // kv + 2
            ok = shape[-1] in (per_group * d, d)
            self.read = grouped_read(shape, args[0].dim(), kv, per_group) if ok else None
        else:
            self.read = _cut_read(func, args, kwargs, h, kv, d)
        raise _Probed


def _probe_inputs(module: nn.Module, layer: nn.Module, hidden: int) -> tuple[Any, ...] | None:
    """The arguments of a probe forward of ``module``: one token of zeros of ``hidden``
    features (on ``layer``'s device, in its dtype; the meta device works), ``None`` for every
    other input its forward requires; None where ``layer`` holds no parameter or the
    forward's signature cannot be read."""
    weight = next(layer.parameters(), None)
    required = _required(module)
    if weight is None or required is None:
        return None
    x = torch.zeros(1, 1, hidden, device=weight.device, dtype=weight.dtype)
    return (x, *[None] * max(required - 1, 0))


def probe_packing(
    attention: nn.Module, column: str, hidden: int, heads: int, head_dim: int, kv_heads: int = 0
) -> str | None:
    """How ``attention``'s forward reads its packed query/key/value projection ``column``, seen
    on one probe forward: ``"heads"`` head by head, ``"groups"`` key/value group by group
    (:func:`packing_read`, :func:`grouped_read`), ``"blocks"`` as query, key and value blocks
    (cut where the query heads end: :func:`_cut_read`; or, with as many key/value heads as
    query heads, reshaped so). The probe: a single token of zeros as its first input (on the
    projection's device, in its dtype; a model on the meta device works), ``None`` for every
    other input it requires, stopped at the first op on the projection's output, with no
    gradient. None when that forward fails before it (it needs an input the probe lacks) or
    the first op tells nothing: with as many key/value heads as query heads, the first real
    forward then checks (:class:`PackedLayoutGuard`). ``kv_heads``: 0 for ``heads``."""
    layer = attention.get_submodule(column)
    token = _probe_inputs(attention, layer, hidden)
    if token is None:
        return None
    probe = _PackingProbe(heads, head_dim, kv_heads or heads)
    handle = layer.register_forward_hook(probe.watch)
    try:
        with torch.no_grad(), probe:
            attention.forward(*token)
    except _Probed:
        return probe.read
    except Exception:  # the probe lacks an input the forward needs: undecided
        return None
    finally:
        handle.remove()
    return None


class _Count(TorchFunctionMode):
    """Counts the torch ops a forward runs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _probe_run(
    attention: nn.Module, ts: TensorSplit, empty: bool, inputs: tuple[Any, Any] | None = None
) -> tuple[bool, int, str]:
    """One probe forward of (a copy of) ``attention``: on ``inputs`` (args, kwargs), or its
    first input one token of zeros and ``None`` for every other input it requires; no
    gradient, stopped when its output projection is called or its forward returns; with
    ``empty``, as on a rank holding none of its heads (its columns' outputs emptied, its head
    counts 0, inputs per head cut to none, under :class:`EmptyHeads`). Returns whether it got
    there, how many torch ops it ran, and the exception if not."""
    prefix = f"{ts.module}." if ts.module else ""
    first = attention.get_submodule(ts.columns[0][0].removeprefix(prefix))
    hidden = linear_features(first)
    token = None if hidden is None else _probe_inputs(attention, first, hidden[0])
    if token is None:
        return True, 0, ""
    handles = []
    if ts.row.startswith(prefix):
        row = attention.get_submodule(ts.row.removeprefix(prefix))
        handles.append(row.register_forward_pre_hook(_stop))
    if empty:
        for name, _ in ts.columns:
            layer = attention.get_submodule(name.removeprefix(prefix))
            handles.append(layer.register_forward_hook(_emptied))
        ts.hold(attention, 0)
    if inputs is None:
        inputs = (token, {})
    elif empty:
        inputs = PerHeadInputs(ts, 0, 0).cut(attention, *inputs) or inputs
    count = _Count()
    modes = [count, EmptyHeads(ts.packed())] if empty else [count]
    try:
        with torch.no_grad():
            for mode in modes:
                mode.__enter__()
            try:
                attention.forward(*inputs[0], **inputs[1])
            finally:
                for mode in reversed(modes):
                    mode.__exit__(None, None, None)
    except _Probed:
        return True, count.ops, ""
    except Exception as e:  # where the forward fails tells whether the heads' absence did it
        return False, count.ops, f"{type(e).__name__}: {e}".splitlines()[0]
    finally:
        for h in handles:
            h.remove()
    return True, count.ops, ""


def _stop(module: nn.Module, args: Any) -> None:
    raise _Probed


def _emptied(module: nn.Module, args: Any, output: Any) -> Any:
    return output.narrow(-1, 0, 0) if isinstance(output, torch.Tensor) else output


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` with its parameters and buffers on the meta device, made without
    copying their data (a probe of a large layer costs no memory)."""
    import copy

    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)


def runs_without_heads(
    attention: nn.Module, ts: TensorSplit, inputs: tuple[Any, Any] | None = None
) -> str | None:
    """Why ``attention`` (split as ``ts``) cannot run its forward on a rank holding none of
    its heads, or None. Two probe forwards of copies of it (:func:`_probe_run`), one as the
    unsplit module, one as such a rank's, each on one token of zeros with ``None`` for its
    other required inputs (or ``inputs``, its args and kwargs): the heads' absence is to blame
    where the second fails before the first gets as far (Falcon's ``num_heads //
    num_kv_heads`` divides by zero). Where both fail alike (an input the probe lacks), it
    cannot tell: None. Both run on copies on the meta device (:func:`meta_copy`)."""
    whole = _probe_run(meta_copy(attention), ts, empty=False, inputs=inputs)
    none = _probe_run(meta_copy(attention), ts, empty=True, inputs=inputs)
    if none[0] or (not whole[0] and whole[1] <= none[1]):
        return None
    return none[2]


class EmptyRankCheck:
    """At an attention's first forward, where a rank holds none of its heads: whether its
    forward runs so (:func:`runs_without_heads`), on the forward's own inputs this time, where
    the probe at the split could not tell (BLOOM's, given no ``alibi``). Every rank checks,
    alike (their inputs to a split attention are the same), on a copy of the unsplit module
    on the meta device, before the block runs: a forward failing on that rank alone would
    leave the others waiting in the block's reduction; here all raise ``ValueError``."""

    def __init__(self, ts: TensorSplit, attention: nn.Module, rank: int) -> None:
        self.ts, self.rank = ts, rank
        # Before the split replaces its layers.
        self.meta: nn.Module | None = meta_copy(attention)
        self.handle: Any = None

    def install(self, attention: nn.Module) -> None:
        self.handle = attention.register_forward_pre_hook(
            self.check, with_kwargs=True, prepend=True
        )

    def check(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        from torch.utils import _pytree as pytree

        self.handle.remove()

        def meta(v: Any) -> Any:
            return torch.empty_like(v, device="meta") if isinstance(v, torch.Tensor) else v

        inputs = pytree.tree_map(meta, (tuple(args), dict(kwargs)))
        unsplit, self.meta = self.meta, None
        why = None if unsplit is None else runs_without_heads(unsplit, self.ts, inputs)
        if why is not None:
            raise ValueError(
                f"filter_parallel: attention {self.ts.module!r} cannot run on a rank holding "
                f"none of its heads, as rank {self.rank} does ({why}); give every rank at least "
                "one key/value group (empty_blocks=False, or shares), or leave its layers out "
                "(layers=...)"
            )


class PackedLayoutGuard(_Watch):
    """Checks, on an attention's first forward, that its packed query/key/value projection is
    packed as a split by heads takes it: three blocks, query heads then key heads then value
    heads (GPT-2's ``c_attn``, read with ``split(width, dim=-1)``), where no probe forward at
    the split (:func:`probe_packing`) could tell. A module that packs them head by head
    (BLOOM's and GPT-NeoX's ``query_key_value``, viewed as ``(..., heads, 3, head_dim)``)
    would get a wrong slice on every rank: its first reshape of that output raises
    ``ValueError`` instead, naming the attention, on every rank alike (before any reduction of
    the block). The first op on that output decides; then the guard removes itself."""

    def __init__(self, ts: TensorSplit, units: int) -> None:
        super().__init__()
        self.ts = ts
        self.column, self.head_dim = ts.columns[0][0], ts.head_dim
        self.heads = units * ts.width // self.head_dim  # this rank's query heads
        self.handles: list[Any] = []

    def install(self, attention: nn.Module, column: nn.Module) -> None:
        # Entered before and left after any other mode of the attention (EmptyHeads).
        self.handles = [
            attention.register_forward_pre_hook(self.enter, prepend=True),
            attention.register_forward_hook(self.leave, always_call=True),
            column.register_forward_hook(self.watch),
        ]

    def enter(self, module: nn.Module, args: Any) -> None:
        self.__enter__()

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.__exit__(None, None, None)
        if self.seen:  # decided: later forwards run unwatched
            for h in self.handles:
                h.remove()
        self.watched = None

    def decide(self, func: Any, args: Any, kwargs: Any) -> None:
        shape = _reshaped_to(func, args, kwargs)
        if shape is None:
            return
        if packing_read(shape, args[0].dim(), self.heads, self.head_dim) == "heads":
            self.seen = False  # the next forward checks again
            raise ValueError(
                f"filter_parallel: attention {self.ts.module!r} packs query, key and value "
                f"head by head in {self.column!r} (its forward reshapes that output to "
                f"{tuple(shape)}: heads, then query/key/value), where a split by heads "
                "takes three blocks (query heads, key heads, value heads, as GPT-2's "
                "c_attn), and the split could not tell (a forward of the attention alone, "
                "given one token and no other input, failed); leave its layers out of the "
                "split (layers=...)"
            )


class PerHeadInputs:
    """An attention's inputs that count every head of the unsplit attention, cut to the rank's
    heads before each forward: a tensor of ``batch x heads`` rows (BLOOM's ``alibi``, 3-D) or
    a 4-D one of ``(batch, heads, ...)`` (a bias per head). One that needs a gradient (a
    learned bias, as T5's relative position bias) would need its other heads' gradients from
    the other ranks: it raises ``ValueError`` naming the attention and the input, on every
    rank alike (the ranks agree on the model's input shapes first), before any reduction of
    the block."""

    def __init__(self, ts: TensorSplit, first: int, count: int) -> None:
        self.ts = ts
        self.heads = ts.heads()
        per_unit = ts.width // ts.head_dim if ts.head_dim else 1
        self.lo, self.hi = first * per_unit, (first + count) * per_unit  # the rank's heads

    def install(self, attention: nn.Module) -> None:
        attention.register_forward_pre_hook(self.cut, with_kwargs=True)

    def _cut_one(self, t: torch.Tensor, batch: int, what: str) -> torch.Tensor | None:
        h = self.heads
        rows = t.dim() == 3 and t.shape[0] == batch * h
        if not rows and not (t.dim() == 4 and t.shape[1] == h):
            return None
        if t.requires_grad:
            raise ValueError(
                f"filter_parallel: attention {self.ts.module!r} is given {what} of shape "
                f"{tuple(t.shape)}, which counts all {h} of its heads and needs its gradient "
                "(a learned bias per head), where each rank holds only its own heads after "
                "the split; leave its layers out of the split (layers=...)"
            )
        if rows:
            per_head = t.reshape(batch, h, *t.shape[1:])[:, self.lo : self.hi]
            return per_head.reshape(batch * (self.hi - self.lo), *t.shape[1:])
        return t[:, self.lo : self.hi]

    def cut(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is None:
            first = next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
        if self.heads < 2 or first is None or first.dim() < 1:
            return None
        batch = first.shape[0]

        def cut(value: Any, what: str) -> Any:
            if isinstance(value, torch.Tensor) and value is not first:
                got = self._cut_one(value, batch, what)
                return value if got is None else got
            return value

        new_args = tuple(cut(a, f"argument {i}") for i, a in enumerate(args))
        new_kwargs = {k: cut(v, k) for k, v in kwargs.items()}
        return new_args, new_kwargs


class ConfigView:
    """A split attention's view of the config it shares with every other layer: its own head
    counts (``own``: the rank's, where the unsplit module's forward reads them from the
    config, as Phi-3's ``self.config.num_attention_heads``), everything else read from and
    written to the shared config, so a later change to it (the attention implementation) still
    reaches the module."""

    __slots__ = ("_base", "_own")

    def __init__(self, base: Any, own: dict[str, int]) -> None:
        if isinstance(base, ConfigView):  # a view of a view: one level, the counts updated
            own, base = {**base._own, **own}, base._base
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_own", dict(own))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        own = object.__getattribute__(self, "_own")
        return own[name] if name in own else getattr(object.__getattribute__(self, "_base"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ConfigView.__slots__:  # unpickling
            object.__setattr__(self, name, value)
        elif name in self._own:
            self._own[name] = value
        else:
            setattr(self._base, name, value)

    def __deepcopy__(self, memo: dict[int, Any]) -> ConfigView:
        import copy

        return ConfigView(copy.deepcopy(self._base, memo), self._own)

    def __repr__(self) -> str:
        counts = ", ".join(f"{k}={v}" for k, v in self._own.items())
        return f"ConfigView({counts}) of {type(self._base).__name__}"


# The attributes an attention module counts its heads with, where its implementation keeps
# them (Hugging Face, fairseq-style and timm-style modules): query heads, key/value heads, and
# the width of all query heads together (GPT-2 splits its packed projection by it).
_QUERY_HEADS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
_QUERY_WIDTH = ("split_size", "all_head_size", "inner_dim")
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
    """The column layout (:attr:`TensorSplit.columns`) of an attention's input projections
    ``inputs`` (name, (in, out)), each reading ``hidden`` features: separate query, key and
    value, or the three packed in one layer, as a probe forward of the attention shows it
    read (:func:`probe_packing`); None when they are neither, or packed under grouped-query
    attention in a way the probe cannot tell."""
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


def _attention(name: str, m: nn.Module) -> TensorSplit | str | None:
    """``m`` as an attention split by heads; a reason when it counts heads but its layout is
    not one this rule knows; None when it is no attention (no head counts)."""
    # An attention counts its heads itself (a head size or a head count of its own), reading
    # what it lacks from its config, and holds its projections.
    if _first_int([m], (*_QUERY_HEADS, *_HEAD_DIM)) is None:
        return None
    projs = [(n, f) for n, c in m.named_children() if (f := linear_features(c)) is not None]
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
    # the head dimension) or a number is the same for every head, its gradient summed over the
    # ranks; one that spans heads (a norm over all query features, a weight per head) would
    # need a split of its own.
    projections = {n for n, _ in projs}
    shared = []
    for pn, p in m.named_parameters():
        if pn.split(".", 1)[0] in projections:
            continue
        if tuple(p.shape) not in ((hd,), (1,), ()):
            return (
                f"its parameter {pn!r} {tuple(p.shape)} is neither of one head's size ({hd}) "
                "nor a number, so it may span heads"
            )
        shared.append(pn)
    attrs: dict[str, int] = {}
    own: dict[str, int] = {}
    for names, per_unit in ((_QUERY_HEADS, rep), (_KV_HEADS, 1), (_QUERY_WIDTH, rep * hd)):
        for a in names:
            v = getattr(m, a, None)
            if isinstance(v, int) and not isinstance(v, bool) and v == per_unit * nkv:
                attrs[a] = per_unit
            v = getattr(config, a, None)
            if isinstance(v, int) and not isinstance(v, bool) and v == per_unit * nkv:
                own[a] = per_unit
    prefix = f"{name}." if name else ""
    return TensorSplit(
        "attention",
        name,
        nkv,
        rep * hd,
        [(prefix + c, blocks) for c, blocks in columns],
        prefix + row_name if row_name else "",
        attrs,
        own,
        [prefix + n for n in shared],
        hd,
    )


# Operations that act on each element alone (or with a number): a hidden-unit-split tensor
# passes through them unchanged, so an MLP's activation, gating product and casts keep its
# split.
_BINARY = {
    operator.mul, operator.add, operator.sub, operator.truediv, operator.pow, torch.mul,
    torch.add, torch.sub, torch.div, torch.pow,
}  # fmt: skip
_UNARY = ELEMENTWISE_FUNCTIONS | {
    operator.neg, torch.neg, torch.exp, torch.erf, torch.square, F.sigmoid, F.tanh,
}  # fmt: skip
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


def _required(m: nn.Module) -> int | None:
    """How many arguments ``m``'s forward requires (None where its signature cannot be
    read)."""
    import inspect

    try:
        params = inspect.signature(m.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in positional and p.default is p.empty for p in params)


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
                or linear_features(mod) is not None
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

    dtype = next((p.dtype for p in m.parameters() if p.is_floating_point()), None)
    roots: list[tuple[nn.Module, str]]
    if isinstance(m, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        roots = [(_Method(m, "_ff_block"), "owner.")]  # its forward has fast paths
    else:
        n = _required(m) or 0
        roots = [(m, "")] + ([(_Method(m, "forward", n - 1), "owner.")] if n else [])
    for root, prefix in roots:
        opaque: set[str] = set()
        for _ in range(_OPAQUE + 1):
            tracer = Tracer(opaque)
            try:
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
        return linear_features(named[node.target])

    def elementwise(node: Any) -> bool:
        others = [a for a in list(node.args) + list(node.kwargs.values()) if not _is_node(a)]
        # Numbers, dtypes and an option's name (``F.gelu(x, approximate="tanh")``, Gemma's).
        if not all(isinstance(a, (int, float, str, torch.dtype)) for a in others):
            return False
        if node.op == "call_module":
            return isinstance(named[node.target], ELEMENTWISE_MODULES)
        if node.op == "call_function":
            return node.target in _BINARY or node.target in _UNARY
        if node.op == "call_method":
            return node.target in _ELEMENTWISE_TENSOR_METHODS
        return False

    for row in graph.nodes:
        f = linear(row)
        if f is None or len(row.all_input_nodes) != 1:
            continue
        inner: set[Any] = set()
        columns: dict[Any, int] = {}  # column node -> the blocks its output packs
        todo, ok = [row.all_input_nodes[0]], True
        while todo and ok:
            node = todo.pop()
            if node in inner:
                continue
            inner.add(node)
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
            return TensorSplit(
                "mlp",
                name,
                f[0],
                1,
                [(prefix + c.target, (1,) * columns[c]) for c in ordered],
                prefix + row.target,
            )
    return None


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
        f = linear_features(layer) if layer is not None else None
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
    (:class:`TensorSplit`), among the layers named in ``candidates`` (those the pairing rule
    of :func:`~.chains.plan_modes` would gather), and with ``mha`` torch's ``nn.MultiheadAttention``
    modules; and the attentions it leaves alone, by name, with why.
    It reads module types, attributes and traced graphs only, so a model on the meta device
    works."""
    pool = set(candidates)
    splits: list[TensorSplit] = []
    kept: dict[str, str] = {}
    claimed: set[str] = set()
    by_layout: list[str] = []  # kept whole for their layout (not for the layers chosen)
    for name, m in model.named_modules():
        if name in claimed or any(name.startswith(c + ".") for c in claimed):
            continue
        found: TensorSplit | str | None = _mha(name, m) if mha else None
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
        missing = [n for n in found.layers() if n not in pool and found.kind != "mha"]
        if missing:
            if found.kind == "attention":
                kept[name] = f"its layers {missing} are not split or already paired"
            continue
        splits.append(found)
        claimed.update(found.layers())
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
    for ts in splits:
        if ts.kind == "attention":
            ts.empty_fails = runs_without_heads(named[ts.module], ts) or ""
    return splits, kept
