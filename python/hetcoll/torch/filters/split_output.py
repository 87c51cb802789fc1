"""A split layer's output kept split along its last dimension until an op needs it whole
(:class:`SplitOutput`), and the op that never does: the cross-entropy of logits split by
vocabulary across ranks (:class:`SplitCrossEntropy`, Megatron-LM's vocabulary-parallel loss,
over uneven shares). What a language model's head gathers, batch x sequence x vocabulary, is
the largest tensor a tensor-parallel step moves; its loss needs three numbers per row."""

from __future__ import annotations

import inspect
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F
from torch.utils import _pytree as pytree

from hetcoll.collectives.autograd import exchanging
from hetcoll.comm import Communicator, agree, deadline
from hetcoll.torch.filters.autograd import AgreedForward, GatherChannels, needs_check


@dataclass
class _Split:
    """Where a :class:`SplitOutput`'s pieces are: this rank's ``shares[rank]`` features of
    the last dimension start at ``offset``; ``agreed``: the split model's agreed forward."""

    comm: Communicator
    shares: list[int]
    offset: int
    timeout: float | None
    agreed: AgreedForward | None

    @property
    def total(self) -> int:
        return sum(self.shares)

    def check(self, what: str, shape: tuple[int, ...]) -> None:
        """Outside the model's agreed forward, the ranks agree on the shape about to be
        exchanged first (a mismatch raises on every rank instead of hanging)."""
        if needs_check(self.agreed):
            agree(self.comm, {what: zlib.crc32(repr(shape).encode())}, deadline(self.timeout))


class SplitOutput(torch.Tensor):
    """The output of a layer split along its last dimension (a language model's head, split
    by vocabulary), kept as this rank's piece of it.

    It reports the whole tensor's ``shape`` and ``size()``, and passes through, still split,
    what leaves the last dimension alone: ``view`` / ``reshape`` keeping it last (asked for at
    its whole size), indexing the other dimensions, ``float()`` / ``to(dtype)`` /
    ``contiguous()`` / ``detach()``, arithmetic with numbers (a logit soft-cap), and sums with
    another split output of its shape split alike (a LoRA head's base and adapter outputs).
    ``F.cross_entropy`` of it (class dimension last, no class weights or label smoothing)
    runs split (:class:`SplitCrossEntropy`): per row, one exchange of three numbers per rank
    instead of the rows' logits. Any other op first gathers it whole (an allgather, its
    gradient sliced back), then runs as on any tensor: the results are always the unsplit
    model's. Every rank must therefore use it alike, the same ops in the same order, as it
    uses the model; :meth:`whole` gathers it explicitly."""

    _split: _Split

    @staticmethod
    def of(
        local: torch.Tensor,
        comm: Communicator,
        shares: list[int],
        timeout: float | None = None,
        agreed: AgreedForward | None = None,
    ) -> SplitOutput:
        """``local``, this rank's ``shares[comm.rank]`` features of the last dimension, as
        a :class:`SplitOutput` (``agreed``: the split model's agreed forward, in which its
        exchanges skip their own agreement check)."""
        if not isinstance(local, torch.Tensor) or local.dim() < 1:
            raise TypeError(f"local: must be a tensor of at least one dimension, got {local!r}")
        if not isinstance(comm, Communicator):
            raise TypeError(f"comm: must be a hetcoll.comm.Communicator, got {type(comm).__name__}")
        if isinstance(shares, (str, bytes)) or not isinstance(shares, Sequence):
            raise TypeError(f"shares: must be a list of integers, one per rank, got {shares!r}")
        if len(shares) != comm.size or any(
            isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 0 for x in shares
        ):
            raise ValueError(
                f"shares: must be {comm.size} integers >= 0 (one per rank), got {shares!r}"
            )
        if shares[comm.rank] != local.shape[-1]:  # once a gloo failure, or a negative shape
            raise ValueError(
                f"shares: this rank's share, {shares[comm.rank]}, must be local's last "
                f"dimension, {local.shape[-1]}"
            )
        deadline(timeout)  # checked here, not at the first exchange
        shares = [int(x) for x in shares]
        offset = sum(shares[: comm.rank])
        return SplitOutput._wrap(local, _Split(comm, shares, offset, timeout, agreed))

    def __new__(cls, *args: Any, **kwargs: Any) -> SplitOutput:
        raise TypeError("SplitOutput: build one with SplitOutput.of(local, comm, shares)")

    @staticmethod
    def _wrap(local: torch.Tensor, split: _Split) -> SplitOutput:
        with torch._C.DisableTorchFunctionSubclass():
            out = local.as_subclass(SplitOutput)
        out._split = split
        return out

    def local(self) -> torch.Tensor:
        """This rank's piece, a plain tensor (attached to the autograd graph)."""
        with torch._C.DisableTorchFunctionSubclass():
            return self.as_subclass(torch.Tensor)

    def whole(self) -> torch.Tensor:
        """The whole tensor, gathered from every rank (every rank must call it); gathered
        once, the same tensor for every later use (every rank uses it alike)."""
        gathered = self.__dict__.get("_gathered")
        if gathered is not None:
            return gathered  # type: ignore[no-any-return]
        piece = self.local()
        s = self._split
        s.check("the split output's shape", tuple(self._whole_shape()))
        with torch._C.DisableTorchFunctionSubclass():
            gathered = GatherChannels.apply(piece, s.comm, s.shares, s.offset, -1, s.timeout)
        self.__dict__["_gathered"] = gathered
        return gathered  # type: ignore[no-any-return]

    def _whole_shape(self) -> torch.Size:
        with torch._C.DisableTorchFunctionSubclass():
            shape = list(self.as_subclass(torch.Tensor).shape)
        shape[-1] = self._split.total
        return torch.Size(shape)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        _check_made(self)
        shape = tuple(self._whole_shape())
        return f"SplitOutput(shape={shape}, piece={tuple(self.local().shape)})"

    def __format__(self, spec: str) -> str:
        return format(repr(self), spec)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        first = next(
            (a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, SplitOutput)), None
        )
        if first is None:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        _check_made(first)
        handled = _split_op(first, func, args, kwargs)
        if handled is not _WHOLE:
            return handled

        def whole(a: Any) -> Any:
            return a.whole() if isinstance(a, SplitOutput) else a

        args, kwargs = pytree.tree_map(whole, (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _check_made(t: SplitOutput) -> None:
    """A tensor made a SplitOutput some other way than :meth:`SplitOutput.of` (``as_subclass``)
    knows no split: named, not an AttributeError from every op."""
    if getattr(t, "_split", None) is None:
        raise TypeError("SplitOutput: build one with SplitOutput.of(local, comm, shares)")


_WHOLE = object()  # the op needs the whole tensor
# Attributes read off the piece as they are (a device, a dtype, a flag).
_METADATA = {
    "dtype", "device", "requires_grad", "grad_fn", "is_leaf", "layout", "is_cuda", "is_cpu",
    "is_meta", "ndim", "is_sparse", "is_quantized", "is_nested", "_version", "output_nr",
    "_base", "names", "retains_grad", "is_mps", "is_xpu",
}  # fmt: skip
_KEEPING = {
    torch.Tensor.float, torch.Tensor.double, torch.Tensor.half, torch.Tensor.bfloat16,
    torch.Tensor.contiguous, torch.Tensor.detach, torch.Tensor.clone, torch.Tensor.to,
    torch.Tensor.type_as,
}  # fmt: skip
_WITH_NUMBERS = {
    torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.Tensor.__truediv__,
    torch.Tensor.__add__, torch.Tensor.__radd__, torch.Tensor.__sub__, torch.Tensor.__rsub__,
    torch.Tensor.__neg__, torch.Tensor.mul, torch.Tensor.div, torch.Tensor.add,
    torch.Tensor.sub, torch.Tensor.tanh, torch.tanh, torch.mul, torch.div, torch.add,
    torch.sub, torch.neg, torch.Tensor.neg,
}  # fmt: skip
#: The reshapes :func:`target_shape` reads (a split output keeps its split through them).
RESHAPES = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape}
#: Sums of two split outputs split alike (a LoRA head's base output and its adapters'), piece
#: by piece.
_PIECEWISE = {
    torch.Tensor.__add__, torch.Tensor.__radd__, torch.Tensor.add, torch.add,
    torch.Tensor.__sub__, torch.Tensor.__rsub__, torch.Tensor.sub, torch.sub,
}  # fmt: skip


def _split_op(t: SplitOutput, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """``func(*args, **kwargs)`` on ``t`` kept split where the op allows it, else _WHOLE."""
    name = getattr(func, "__name__", "")
    if name == "__get__":
        attribute = getattr(getattr(func, "__self__", None), "__name__", "")
        if attribute == "shape":
            return t._whole_shape()
        if attribute in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        return _WHOLE
    if func is torch.Tensor.size:
        shape = t._whole_shape()
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        return shape if dim is None else shape[dim]
    if func is torch.Tensor.numel:
        return t._whole_shape().numel()
    if func in (torch.Tensor.dim, torch.Tensor.ndimension):
        return t.local().dim()
    s = t._split
    if args and args[0] is t:
        piece = t.local()
        rest = args[1:]
        if func in _KEEPING and not any(
            isinstance(a, torch.Tensor) and func is not torch.Tensor.type_as
            for a in pytree.tree_leaves((rest, kwargs))
        ):
            with torch._C.DisableTorchFunctionSubclass():
                return SplitOutput._wrap(func(piece, *rest, **kwargs), s)
        if func in RESHAPES:
            asked = target_shape(rest, kwargs)
            if asked and asked[-1] == s.total:
                local = [*asked[:-1], s.shares[s.comm.rank]]
                with torch._C.DisableTorchFunctionSubclass():
                    return SplitOutput._wrap(func(piece, local), s)
            return _WHOLE
        if func is torch.Tensor.__getitem__ and len(rest) == 1 and _keeps_last(rest[0], piece):
            with torch._C.DisableTorchFunctionSubclass():
                return SplitOutput._wrap(piece[rest[0]], s)
        if func in _WITH_NUMBERS and all(
            isinstance(a, (int, float)) and not isinstance(a, bool)
            for a in pytree.tree_leaves((rest, kwargs))
        ):
            with torch._C.DisableTorchFunctionSubclass():
                return SplitOutput._wrap(func(piece, *rest, **kwargs), s)
        if func in _PIECEWISE and not kwargs and len(rest) == 1 and _split_alike(t, rest[0]):
            with torch._C.DisableTorchFunctionSubclass():
                return SplitOutput._wrap(func(piece, rest[0].local()), s)
    if func is F.cross_entropy:
        return _cross_entropy(t, args, kwargs)
    return _WHOLE


def _split_alike(t: SplitOutput, other: Any) -> bool:
    """Whether ``other`` is a split output of ``t``'s shape split as ``t`` is (the same group,
    every rank's piece at the same place): their sum, piece by piece, is their whole sum's."""
    if not isinstance(other, SplitOutput) or getattr(other, "_split", None) is None:
        return False
    a, b = t._split, other._split
    return (
        a.comm is b.comm
        and list(a.shares) == list(b.shares)
        and a.offset == b.offset
        and t._whole_shape() == other._whole_shape()
    )


def target_shape(rest: Any, kwargs: dict[str, Any]) -> list[int] | None:
    """The shape a ``view`` / ``reshape`` call asks for, from its arguments after the tensor
    (``view(2, -1)`` or ``view((2, -1))``); None for anything else (a dtype view)."""
    shape = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)) else rest
    shape = kwargs.get("shape", kwargs.get("size", shape))
    if not shape or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        return None
    return list(shape)


def _keeps_last(index: Any, piece: torch.Tensor) -> bool:
    """Whether ``piece[index]`` leaves the last dimension whole and last: the index names no
    more dimensions than the others (or a full slice for the last, after ``...``), adds none
    (``None``), and indexes with slices, integers and tensors only."""
    entries = list(index) if isinstance(index, tuple) else [index]
    if any(e is None or isinstance(e, (list, bool)) for e in entries):
        return False
    if not all(isinstance(e, (slice, int, torch.Tensor)) or e is Ellipsis for e in entries):
        return False

    def full(e: Any) -> bool:
        return isinstance(e, slice) and e == slice(None)

    if Ellipsis in entries:
        tail = entries[entries.index(Ellipsis) + 1 :]
        return not tail or full(tail[-1])
    consumed = sum(
        e.dim() if isinstance(e, torch.Tensor) and e.dtype == torch.bool else 1 for e in entries
    )
    if consumed == piece.dim() and full(entries[-1]):
        consumed -= 1
    return consumed < piece.dim()


_CROSS_ENTROPY = inspect.signature(F.cross_entropy)


def _cross_entropy(t: SplitOutput, args: Any, kwargs: dict[str, Any]) -> Any:
    try:
        bound = _CROSS_ENTROPY.bind(*args, **kwargs)
    except TypeError:
        return _WHOLE
    bound.apply_defaults()
    a = bound.arguments
    target = a["target"]
    if (
        a["input"] is not t
        or t.local().dim() != 2
        or not isinstance(target, torch.Tensor)
        or isinstance(target, SplitOutput)
        or target.dim() != 1
        or target.dtype not in (torch.int64, torch.int32)
        or a["weight"] is not None
        or a["size_average"] is not None
        or a["reduce"] is not None
        or a["label_smoothing"] != 0.0
        or a["reduction"] not in ("mean", "sum", "none")
    ):
        return _WHOLE
    piece = t.local()
    with torch._C.DisableTorchFunctionSubclass():
        return SplitCrossEntropy.apply(
            piece, target.to(piece.device), t._split, int(a["ignore_index"]), a["reduction"]
        )


@exchanging
class SplitCrossEntropy(torch.autograd.Function):
    """Cross-entropy of logits split by class (vocabulary) across ranks, the targets whole on
    every rank, as ``F.cross_entropy(logits, target, ignore_index=..., reduction=...)`` of the
    whole logits. Per row, each rank finds its piece's maximum ``m_r``, the sum ``s_r`` of
    ``exp(x - m_r)`` and, for the rank holding the target class, its logit; one allgather of
    those three numbers per row gives every rank ``M = max m_r``, ``S = sum s_r exp(m_r -
    M)`` and the loss ``M + log S - x_target``. Backward needs no communication: the gradient
    of this rank's piece is its softmax minus the target's one-hot, scaled as the reduction
    scales. Statistics in float64 for float64 logits, else float32."""

    @staticmethod
    def forward(
        ctx: Any,
        piece: torch.Tensor,
        target: torch.Tensor,
        split: _Split,
        ignore_index: int,
        reduction: str,
    ) -> Any:
        acc = torch.float64 if piece.dtype == torch.float64 else torch.float32
        x = piece.detach().to(acc)
        rows, width = x.shape
        if target.shape[0] != rows:
            raise ValueError(
                f"target: {target.shape[0]} targets for {rows} rows of logits (split by class)"
            )
        valid = target != ignore_index
        bad = valid & ((target < 0) | (target >= split.total))
        if bool(bad.any()):
            raise ValueError(
                f"target: class {int(target[bad][0])} outside [0, {split.total}) (the logits' "
                f"classes; ignore_index {ignore_index})"
            )
        inside = valid & (target >= split.offset) & (target < split.offset + width)
        if width:
            m = x.max(dim=1).values
            e = torch.exp(x - m[:, None])  # kept for the backward: the piece's softmax, scaled
            s = e.sum(dim=1)
            at = (target - split.offset).clamp(0, width - 1).to(torch.int64)
            picked = x.gather(1, at[:, None]).squeeze(1)
        else:  # a rank holding no classes: nothing to add
            e = x
            m = torch.full((rows,), -torch.inf, dtype=acc, device=x.device)
            s = torch.zeros(rows, dtype=acc, device=x.device)
            at = torch.zeros(rows, dtype=torch.int64, device=x.device)
            picked = torch.zeros(rows, dtype=acc, device=x.device)
        mine = torch.stack([m, s, torch.where(inside, picked, torch.zeros_like(picked))])
        split.check("the split cross-entropy's rows", (rows,))
        every = GatherChannels.apply(
            mine[None], split.comm, [1] * split.comm.size, split.comm.rank, 0, split.timeout
        )
        big = every[:, 0].max(dim=0).values
        total = (every[:, 1] * torch.exp(every[:, 0] - big)).sum(dim=0)
        target_logit = every[:, 2].sum(dim=0)  # the one holder's, zeros elsewhere
        per_row = torch.where(valid, big + torch.log(total) - target_logit, torch.zeros_like(big))
        count = valid.sum()
        # softmax(x) = exp(x - m) * exp(m - M) / S: the backward rescales e, row by row.
        ctx.save_for_backward(e, torch.exp(m - big) / total, valid, inside, at)
        ctx.reduction, ctx.dtype = reduction, piece.dtype
        ctx.count = int(count)
        # Under autocast torch computes the loss of half-precision logits in float32, and
        # returns it so; without, in the logits' dtype.
        low = piece.dtype in (torch.float16, torch.bfloat16)
        out = torch.float32 if low and torch.is_autocast_enabled(piece.device.type) else piece.dtype
        if reduction == "none":
            return per_row.to(out)
        loss = per_row.sum()
        if reduction == "mean":
            loss = loss / count
        return loss.to(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        e, scale, valid, inside, at = ctx.saved_tensors
        g = e * scale[:, None]
        if e.shape[1]:
            rows = torch.nonzero(inside).squeeze(1)
            g[rows, at[rows]] -= 1.0
        g = g * valid[:, None]
        if ctx.reduction == "none":
            g = g * grad.to(g.dtype)[:, None]
        elif ctx.reduction == "mean":
            g = g * (grad.to(g.dtype) / ctx.count)
        else:
            g = g * grad.to(g.dtype)
        return g.to(ctx.dtype), None, None, None, None
