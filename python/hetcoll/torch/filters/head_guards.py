"""What a split attention runs with on each rank (installed by :func:`~.convert.filter_parallel`
on the rank's module): per-head inputs cut to its heads (:class:`PerHeadInputs`), a rank
holding no heads run on empty tensors (:class:`EmptyHeads`), grouped-query attention's key
and value cut to the rank's query heads (:class:`KeyValueOfHeads`), and a check that a packed
projection's output is read as its layout was found (:class:`PackedLayoutGuard`, on
:class:`OpWatch`, which sees the torch calls a forward makes)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from hetcoll.torch.filters.heads import TensorSplit
from hetcoll.torch.filters.split_output import RESHAPES, target_shape


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


#: Scaled dot-product attention's tensor arguments, by name.
_QKV = ("query", "key", "value")


def attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """``F.scaled_dot_product_attention(query, key, value, *args, **kwargs)``, and over no
    heads (a rank holding none) the product of the empty tensors instead: the output's shape
    and the inputs' graph without the kernel, which ends the process on some torch versions
    (2.11's CPU kernel divides by the heads: a SIGFPE)."""
    if query.numel() == 0 or key.numel() == 0:
        return torch.matmul(torch.matmul(query, key.transpose(-2, -1)), value)
    return F.scaled_dot_product_attention(query, key, value, *args, **kwargs)


class EmptyHeads(TorchFunctionMode):
    """The forward of an attention on a rank that holds none of its heads: it runs on empty
    tensors, where two kinds of op need help that torch cannot give an empty dimension.
    - A projection packing query, key and value (GPT-2's ``c_attn``, ``parts`` 3) is split by
      its heads' width, now 0, into ``parts`` pieces, where torch gives one piece of an empty
      dimension: here it gives ``parts`` empty pieces.
    - A reshape with ``-1`` (OPT's ``view(batch, -1, heads, head_dim)``, BLOOM's
      ``reshape(batch * heads, -1, head_dim)``) is ambiguous on an empty tensor: here ``-1``
      takes the size it has where the heads are not 0 (:func:`fill_empty_reshape`).
    - Scaled dot-product attention over no heads ends the process on some torch versions:
      here it is :func:`attention`.
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
        if func is F.scaled_dot_product_attention:
            q, k, v = (args[i] if len(args) > i else kwargs.pop(n) for i, n in enumerate(_QKV))
            return attention(q, k, v, *args[3:], **kwargs)
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
    ``(..., 3, heads, head_dim)``; ``"other"`` for a reshape to more dimensions that is
    neither (CodeGen's ``(..., 4, -1)``: four blocks of heads, each its heads' query, value
    and key; or a rank's multi-query view, its heads beside one key and value head); None for
    a reshape that adds none, or where both readings coincide (3 heads of 3): it cannot
    tell."""
    h, d = heads, head_dim
    if len(shape) == packed + 1:
        by_head = shape[-2] in (h, -1) and shape[-1] == 3 * d
        blocked = shape[-2] == 3 and shape[-1] in (h * d, -1)
    elif len(shape) == packed + 2:
        by_head = shape[-3] in (h, -1) and list(shape[-2:]) == [3, d]
        blocked = shape[-3] == 3 and shape[-2] in (h, -1) and shape[-1] == d
    else:
        return "other" if len(shape) > packed else None
    if by_head == blocked:
        return None if by_head else "other"
    return "heads" if by_head else "blocks"


#: Ops bounding each element by numbers, which keep a packed output's layout as it was.
_CLAMPS = {
    torch.clamp, torch.clip, torch.Tensor.clamp, torch.Tensor.clip, torch.Tensor.clamp_,
    torch.Tensor.clip_,
}  # fmt: skip


class OpWatch(TorchFunctionMode):
    """Watches the first op a forward applies to one tensor (a packed projection's output,
    given to :meth:`watch` by that layer's forward hook) and hands ``(func, args, kwargs)`` to
    ``decide``, which may raise to stop the forward there. A new dimension before the features
    (GPT-BigCode's ``c_attn(x).unsqueeze(1)``) and a clamp by numbers (DBRX's ``clip_qkv``) are
    followed: the op after them decides."""

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
            if func in (torch.Tensor.unsqueeze, torch.unsqueeze):
                dim = args[1] if len(args) > 1 else kwargs.get("dim")
                if isinstance(dim, int) and -args[0].dim() - 1 <= dim < args[0].dim():
                    self.watched = func(*args, **kwargs)  # the features still last
                    return self.watched
            if func in _CLAMPS and all(
                not isinstance(a, torch.Tensor) for a in (*args[1:], *kwargs.values())
            ):
                # Each feature bounded alike (DBRX's clip_qkv): the layout is the next op's.
                self.watched = func(*args, **kwargs)
                return self.watched
            self.watched, self.seen = None, True  # the first op decides
            self.decide(func, args, kwargs)
        return func(*args, **kwargs)


def reshaped_to(func: Any, args: Any, kwargs: Any) -> list[int] | None:
    """The shape a reshape of ``args[0]`` asks for (``view``, ``reshape``, ``unflatten``)."""
    if func is torch.Tensor.unflatten and len(args) > 2:
        return [*args[0].shape[: args[1]], *args[2]]
    return target_shape(args[1:], kwargs) if func in RESHAPES else None


class PackedLayoutGuard(OpWatch):
    """Checks, on an attention's first forward, that its packed query/key/value projection is
    packed as a split by heads takes it: three blocks, query heads then key heads then value
    heads (GPT-2's ``c_attn``, read with ``split(width, dim=-1)``), where no probe forward at
    the split (:func:`~.head_probes.probe_packing`) could tell. A module that packs them head
    by head (BLOOM's and GPT-NeoX's ``query_key_value``, viewed as ``(..., heads, 3, head_dim)``)
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
        shape = reshaped_to(func, args, kwargs)
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


class HeadColumns:
    """A per-head table's output (:attr:`TensorSplit.tables` ``name``: an embedding, one
    column per query head, as T5's relative position bias) cut to the rank's query heads,
    along its dimension of heads (:attr:`TensorSplit.table_dims`, default the last); the
    table itself stays whole on every rank, its gradient summed over them."""

    def __init__(self, ts: TensorSplit, first: int, count: int, name: str) -> None:
        per_unit = ts.width // ts.head_dim if ts.head_dim else 1
        self.lo, self.hi = first * per_unit, (first + count) * per_unit
        self.dim = ts.table_dims.get(name, -1)

    def install(self, table: nn.Module) -> Any:
        return table.register_forward_hook(self.cut)

    def cut(self, module: nn.Module, args: Any, output: Any) -> Any:
        return output.narrow(self.dim, self.lo, self.hi - self.lo)


class HeadParameters:
    """An attention's parameters of a number or a row per head (:attr:`TensorSplit.head_params`
    and :attr:`TensorSplit.key_params`: GPT-OSS's attention sinks, Cohere's query and key
    norms), held whole on every rank and seen by its forward at the heads the rank's module
    computes: for each forward the module holds the rank's part of each (the gradient of the
    whole parameter flows through it: the rank's is its heads' part, summed over the ranks as
    every shared parameter's), the whole parameter back after it.

    A query head's rows are the rank's query heads (a view); a key/value head's are its
    key/value groups' (a view), or, split by query head (:class:`KeyValueOfHeads`), the key
    head each of its query heads reads (gathered), or all of them where every rank computes
    the one key head whole (multi-query attention). A list of a module per head (StableLM's
    ``q_layernorm.norms``, which its forward zips with the heads it is given) is seen as the
    list of the rank's heads' modules, picked alike."""

    def __init__(self, ts: TensorSplit, first: int, count: int) -> None:
        per_unit = ts.width // ts.head_dim if ts.head_dim else 1
        lo, hi = first * per_unit, (first + count) * per_unit
        prefix = f"{ts.module}." if ts.module else ""
        self.parts: dict[str, slice | torch.Tensor | None] = {
            n.removeprefix(prefix): slice(lo, hi) for n in ts.head_params
        }
        keys: slice | torch.Tensor | None
        if ts.kv_groups:
            keys = torch.tensor(key_heads(ts, first, count), dtype=torch.long)
        elif ts.by_query_head():
            keys = None  # the key head every rank holds whole
        else:
            keys = slice(first, first + count)
        self.parts.update({n.removeprefix(prefix): keys for n in ts.key_params})
        #: Each part's holder and parameter name, read off the attention once (:meth:`install`).
        self.places: list[tuple[nn.Module, str, slice | torch.Tensor]] = []
        self.held: list[tuple[nn.Module, str, Any]] = []
        #: Each list of a module per head (StableLM's ``q_layernorm.norms``): its holder, its
        #: name, and the list of the rank's heads' modules its forward sees instead.
        self.lists: list[tuple[nn.Module, str, nn.ModuleList]] = []

    def install(self, attention: nn.Module) -> list[Any]:
        self.place(attention)
        return [
            attention.register_forward_pre_hook(self.enter),
            attention.register_forward_hook(self.leave, always_call=True),
        ]

    def place(self, attention: nn.Module) -> None:
        """Find each part's holder in ``attention`` (the rank's parts of a whole-held key are
        none: left out); a list of a module per head gets the list of the rank's."""
        self.places = []
        self.lists = []
        for n, part in self.parts.items():
            if part is None:
                continue
            path, _, leaf = n.rpartition(".")
            owner = attention.get_submodule(path)
            whole = owner._modules.get(leaf)
            if isinstance(whole, nn.ModuleList):
                heads = list(whole)
                picked = heads[part] if isinstance(part, slice) else [heads[int(i)] for i in part]
                self.lists.append((owner, leaf, nn.ModuleList(picked)))
            else:
                self.places.append((owner, leaf, part))

    def enter(self, module: nn.Module, args: Any) -> None:
        for owner, leaf, mine in self.lists:
            self.held.append((owner, leaf, owner._modules[leaf]))
            owner._modules[leaf] = mine
        for k, (owner, leaf, part) in enumerate(self.places):
            whole = owner._parameters[leaf]
            assert whole is not None
            self.held.append((owner, leaf, whole))
            if isinstance(part, torch.Tensor):
                if part.device != whole.device:
                    part = part.to(whole.device)
                    self.places[k] = (owner, leaf, part)
                owner._parameters[leaf] = whole.index_select(0, part)  # type: ignore[assignment]
            else:
                owner._parameters[leaf] = whole[part]  # type: ignore[assignment]

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        for owner, leaf, whole in self.held:
            if isinstance(whole, nn.Module):
                owner._modules[leaf] = whole
            else:
                owner._parameters[leaf] = whole
        self.held.clear()


def key_heads(ts: TensorSplit, first: int, count: int) -> list[int]:
    """Grouped-query attention split by query head (:attr:`TensorSplit.kv_groups`): the
    key/value head each of the query heads ``first .. first + count`` reads, in their order."""
    per_group = ts.heads() // ts.kv_groups
    return [h // per_group for h in range(first, first + count)]


class KeyValueOfHeads:
    """Grouped-query attention split by query head (:attr:`TensorSplit.kv_groups`): the output
    of its key or value projection, which every rank computes whole (every key/value head),
    cut to the head each of the rank's query heads reads, in their order: one key/value head
    per query head, a head repeated where several of the rank's query heads share it. The
    rank's module then reads them one per query head (``num_key_value_groups`` 1); the
    gradient of a repeated head adds up through the cut, and the ranks' are summed."""

    def __init__(self, ts: TensorSplit, first: int, count: int) -> None:
        hd = ts.head_dim
        self.index = torch.tensor(
            [k * hd + j for k in key_heads(ts, first, count) for j in range(hd)],
            dtype=torch.long,
        )

    def install(self, layer: nn.Module) -> Any:
        return layer.register_forward_hook(self.cut)

    def cut(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.index.device != output.device:
            self.index = self.index.to(output.device)
        return output.index_select(-1, self.index)


def per_head_tables(
    t: torch.Tensor, heads: int, whole: dict[int, tuple[str, nn.Parameter]]
) -> list[tuple[str, nn.Parameter]] | None:
    """The parameters ``t`` is computed from, by name, where every one is a table of a row or
    column per head (a dimension of ``heads``) among ``whole`` (the model's parameters every
    rank holds whole, by id) and ``t`` reads no other tensor that needs a gradient: a learned
    bias per head made of its tables alone (MPNet's relative-position bias, one embedding at
    the encoder for every layer; BEiT's table of a column per head). None otherwise (a bias
    computed from the hidden states, a parameter without a dimension per head)."""
    found: dict[int, tuple[str, nn.Parameter]] = {}
    # The nodes seen, held: torch may wrap a node in a new Python object at each
    # `next_functions`, and a dropped wrapper's id is free for the next (torch 2.11 then
    # stopped the walk after two nodes).
    seen: dict[int, Any] = {}
    stack = [t.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen[id(fn)] = fn
        if len(seen) > 10_000:  # a graph this deep is not a table's lookup
            return None
        leaf = getattr(fn, "variable", None)  # AccumulateGrad: a tensor that needs a gradient
        if leaf is not None:
            if id(leaf) not in whole or heads not in leaf.shape:
                return None
            found[id(leaf)] = whole[id(leaf)]
            continue
        stack.extend(f for f, _ in fn.next_functions)
    return sorted(found.values(), key=lambda x: x[0]) or None


class PerHeadInputs:
    """An attention's inputs that count every head of the unsplit attention, cut to the rank's
    heads before each forward: a tensor of ``batch x heads`` rows (BLOOM's ``alibi``, 3-D), a
    3-D one of ``(heads, ...)`` (MPT's ``position_bias``, the batch's rows alike) or a 4-D one
    of ``(batch, heads, ...)`` (a bias per head).

    One that needs a gradient (a learned bias) has, on each rank, its heads' part of the
    gradient: where it is computed from tables of a row or column per head alone
    (:func:`per_head_tables`: MPNet's and BEiT's relative-position biases, made outside the
    attention and handed to it), every rank computes it whole from those tables, held whole,
    and their gradients are summed over the ranks after each backward (``shared``: registered
    once, at the first forward, alike on every rank). Any other raises ``ValueError`` naming
    the attention and the input, on every rank alike (the ranks agree on the model's input
    shapes first), before any reduction of the block. One that comes from an attention of its
    class holding its heads alike (:attr:`TensorSplit.heads_with`: T5's position bias,
    computed from a table held whole, its gradient summed) is handed over already cut (or
    whole, where the rank holds every head)."""

    def __init__(
        self,
        ts: TensorSplit,
        first: int,
        count: int,
        shared: Callable[[], tuple[dict[int, tuple[str, nn.Parameter]], Callable[..., None]]]
        | None = None,
    ) -> None:
        self.ts = ts
        self.heads = ts.heads()
        per_unit = ts.width // ts.head_dim if ts.head_dim else 1
        self.lo, self.hi = first * per_unit, (first + count) * per_unit  # the rank's heads
        #: The model's parameters held whole (by id) and what sums a parameter's gradient over
        #: the ranks, asked for at the first learned bias (after the whole model's split).
        self.shared = shared
        self.held: tuple[dict[int, tuple[str, nn.Parameter]], Callable[..., None]] | None = None

    def install(self, attention: nn.Module) -> None:
        attention.register_forward_pre_hook(self.cut, with_kwargs=True)

    def _cut_one(self, t: torch.Tensor, batch: int, what: str) -> torch.Tensor | None:
        h = self.heads
        rows = t.dim() == 3 and t.shape[0] == batch * h
        # MPT's position_bias: (heads, 1, keys), for every row of the batch alike. Where the
        # batch has as many rows as there are heads, only its name tells it from a tensor of
        # rows (Llama's rotary cos and sin: (batch, tokens, head_dim)).
        heads_first = (
            t.dim() == 3 and t.shape[0] == h and (batch != h or "bias" in what or "alibi" in what)
        )
        if not rows and not heads_first and not (t.dim() == 4 and t.shape[1] == h):
            return None
        tables = None
        if t.requires_grad and not self.ts.heads_with and self.shared is not None:
            if self.held is None:  # once: the model's parameters every rank holds whole
                self.held = self.shared()
            whole, add = self.held
            tables = per_head_tables(t, h, whole)
            for _, table in tables or ():
                add(table)
        if t.requires_grad and not self.ts.heads_with and tables is None:
            raise ValueError(
                f"filter_parallel: attention {self.ts.module!r} is given {what} of shape "
                f"{tuple(t.shape)}, which counts all {h} of its heads and needs its gradient "
                "(a learned bias per head), where each rank holds only its own heads after "
                "the split; leave its layers out of the split (layers=...)"
            )
        if rows:
            per_head = t.reshape(batch, h, *t.shape[1:])[:, self.lo : self.hi]
            return per_head.reshape(batch * (self.hi - self.lo), *t.shape[1:])
        if heads_first:
            return t[self.lo : self.hi]
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
