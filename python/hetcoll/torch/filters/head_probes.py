"""Probe forwards of an attention, on copies of it on the meta device, where the module's
attributes alone cannot say how it runs split: how its packed query/key/value projection's
output is read (:func:`probe_packing`), and whether it runs on a rank holding none of its heads
(:func:`runs_without_heads`), or some (:func:`runs_with_some_heads`), and whether it cuts its
heads into parts it may combine (:func:`cuts_heads`); :class:`FirstForwardCheck` looks again
at the first forward, on the forward's own inputs."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from hetcoll.collectives.autograd import never_traced_methods
from hetcoll.torch.filters.chains import projection_features
from hetcoll.torch.filters.head_guards import (
    EmptyHeads,
    HeadColumns,
    HeadParameters,
    KeyValueOfHeads,
    OpWatch,
    PerHeadInputs,
    packing_read,
    reshaped_to,
)
from hetcoll.torch.filters.heads import TensorSplit
from hetcoll.torch.filters.layers import ChannelSplit, split_runs, take_runs
from hetcoll.torch.replay import meta_copy


def rms_norm_eps(m: nn.Module) -> float | None:
    """The epsilon of ``m`` where it is an RMS norm over its input's last dimension, as Hugging
    Face's are (``weight * x / sqrt(mean(x^2) + eps)``, its epsilon ``variance_epsilon`` or
    ``eps``), told by a probe forward of a copy holding a random weight on random rows (float32,
    CPU); else None (a norm of another formula: Gemma's ``1 + weight``, a LayerNorm; a norm
    split already, whose forward would sum over its ranks)."""
    if isinstance(m, ChannelSplit):
        return None
    weight = getattr(m, "weight", None)
    eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or not isinstance(eps, float):
        return None
    if [n for n, _ in m.named_parameters()] != ["weight"]:
        return None
    g = torch.Generator().manual_seed(0)
    w = torch.randn(weight.shape, generator=g)
    x = torch.randn(3, weight.shape[0], generator=g)
    want = w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    try:
        with torch.no_grad():
            got = torch.func.functional_call(m, {"weight": w}, (x,))
    except Exception:  # whatever its own forward raises on a plain tensor
        return None
    ok = isinstance(got, torch.Tensor) and got.shape == want.shape
    return eps if ok and torch.allclose(got, want, rtol=1e-5, atol=1e-6) else None


def required_inputs(m: nn.Module) -> int | None:
    """How many arguments ``m``'s forward requires (None where its signature cannot be
    read)."""
    import inspect

    try:
        params = inspect.signature(m.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in positional and p.default is p.empty for p in params)


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
        sizes = list(args[1]) if isinstance(args[1], (list, tuple)) else args[1]
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


class _PackingProbe(OpWatch):
    def __init__(self, heads: int, head_dim: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim, self.kv_heads = heads, head_dim, kv_heads
        self.read: str | None = None

    def decide(self, func: Any, args: Any, kwargs: Any) -> None:
        shape = reshaped_to(func, args, kwargs)
        h, kv, d = self.heads, self.kv_heads, self.head_dim
        if shape is not None and kv == h:
            self.read = packing_read(shape, args[0].dim(), h, d)
        elif (
            shape is not None and len(shape) == args[0].dim() + 1 and shape[-2:] == [h + 2 * kv, d]
        ):
            # Every query head, then the key heads, then the value heads (Falcon-7B's
            # multi-query view(batch, seq, heads + 2, head_dim)): three blocks.
            self.read = "blocks"
        elif shape is not None:
            per_group = h // kv + 2
            ok = shape[-1] in (per_group * d, d)
            self.read = grouped_read(shape, args[0].dim(), kv, per_group) if ok else None
        else:
            self.read = _cut_read(func, args, kwargs, h, kv, d)
        raise _Probed


def probe_inputs(module: nn.Module, layer: nn.Module, hidden: int) -> tuple[Any, ...] | None:
    """The arguments of a probe forward of ``module``: one token of zeros of ``hidden``
    features (on ``layer``'s device, in its dtype; the meta device works), ``None`` for every
    other input its forward requires; None where ``layer`` holds no parameter or the
    forward's signature cannot be read."""
    weight = next(layer.parameters(), None)
    required = required_inputs(module)
    if weight is None or required is None:
        return None
    x = torch.zeros(1, 1, hidden, device=weight.device, dtype=weight.dtype)
    return (x, *[None] * max(required - 1, 0))


def probe_packing(
    attention: nn.Module, column: str, hidden: int, heads: int, head_dim: int, kv_heads: int = 0
) -> str | None:
    """How ``attention``'s forward reads its packed query/key/value projection ``column``, seen
    on one probe forward: ``"heads"`` head by head, ``"groups"`` key/value group by group
    (:func:`~.head_guards.packing_read`, :func:`grouped_read`), ``"blocks"`` as query, key and
    value blocks (cut where the query heads end: :func:`_cut_read`; or, with as many key/value
    heads as query heads, reshaped so), ``"other"`` reshaped to a layout of its own (neither,
    with as many key/value heads as query heads). The probe: a single token of zeros as its
    first input (on the projection's device, in its dtype; a model on the meta device works),
    ``None`` for every other input it requires, stopped at the first op on the projection's
    output, with no gradient. None when that forward fails before it (it needs an input the
    probe lacks) or the first op tells nothing: with as many key/value heads as query heads,
    the first real forward then checks (:class:`~.head_guards.PackedLayoutGuard`).
    ``kv_heads``: 0 for ``heads``."""
    layer = attention.get_submodule(column)
    token = probe_inputs(attention, layer, hidden)
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


def applied_after(attention: nn.Module, row: str, hidden: int) -> set[str]:
    """The children of ``attention`` its forward first calls after its output projection
    ``row`` (a norm of the residual sum after it, inside the attention: ALBERT's
    ``LayerNorm``), seen on one probe forward (:func:`probe_inputs`: a token of zeros, no
    gradient); empty where the forward fails on the probe's inputs."""
    layer = attention.get_submodule(row)
    token = probe_inputs(attention, layer, hidden)
    if token is None:
        return set()
    order: list[str] = []
    handles = [
        child.register_forward_pre_hook(lambda m, args, n=n: order.append(n))
        for n, child in attention.named_children()
    ]
    try:
        with torch.no_grad():
            attention.forward(*token)
    except Exception:  # the probe lacks an input the forward needs: nothing known
        return set()
    finally:
        for h in handles:
            h.remove()
    if row not in order:
        return set()
    before = set(order[: order.index(row) + 1])
    return {n for n in order if n not in before}


class _Count(TorchFunctionMode):
    """Counts the torch ops a forward runs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _token(attention: nn.Module, ts: TensorSplit) -> tuple[Any, ...] | None:
    """A probe forward's arguments for ``attention`` (split as ``ts``): :func:`probe_inputs`
    at the width its first column reads (the block's input, or where a column reads a latent,
    the row's output width); None where they cannot be made."""
    prefix = f"{ts.module}." if ts.module else ""
    first = attention.get_submodule(ts.columns[0][0].removeprefix(prefix))
    hidden = projection_features(first)
    size = None if hidden is None else hidden[0]
    if ts.fed_by and ts.row.startswith(prefix):  # a column reads a latent: the row's width
        out = projection_features(attention.get_submodule(ts.row.removeprefix(prefix)))
        size = None if out is None else out[1]
    return None if size is None else probe_inputs(attention, first, size)


def _probe_run(
    attention: nn.Module,
    ts: TensorSplit,
    held: int | None,
    inputs: tuple[Any, Any] | None = None,
    watch: TorchFunctionMode | None = None,
) -> tuple[bool, int, str]:
    """One probe forward of (a copy of) ``attention``: on ``inputs`` (args, kwargs), or its
    first input one token of zeros and ``None`` for every other input it requires; no
    gradient, stopped when its output projection is called or its forward returns; with
    ``held`` units (None: unsplit), as on a rank holding that many of its heads, the first
    (its columns' outputs cut to them, its head counts theirs, inputs per head cut to them;
    none under :class:`~.head_guards.EmptyHeads`); under ``watch`` too, where given. Returns
    whether it got there, how many torch ops it ran, and the exception if not."""
    prefix = f"{ts.module}." if ts.module else ""
    token = _token(attention, ts)
    if token is None:
        return True, 0, ""
    handles = []
    if ts.row.startswith(prefix):
        row = attention.get_submodule(ts.row.removeprefix(prefix))
        handles.append(row.register_forward_pre_hook(_stop))
    if held is not None:
        for name, blocks in ts.columns:
            layer = attention.get_submodule(name.removeprefix(prefix))
            # What the rank's layer computes: its units' features, and those every rank
            # holds (multi-query key and value rows packed with the query heads).
            shares = [held, ts.units - held]
            kept = split_runs(shares, 0, blocks, ts.whole_features.get(name, ()))
            handles.append(layer.register_forward_hook(partial(_emptied, kept)))
        for name in ts.tables:
            table = attention.get_submodule(name.removeprefix(prefix))
            handles.append(HeadColumns(ts, 0, held, name).install(table))
        for name in ts.whole if ts.kv_groups else ():
            layer = attention.get_submodule(name.removeprefix(prefix))
            handles.append(KeyValueOfHeads(ts, 0, held).install(layer))
        ts.hold(attention, held)
    if inputs is None:
        inputs = (token, {})
    else:
        inputs = _without_caches(inputs)
        if held is not None:
            inputs = PerHeadInputs(ts, 0, held).cut(attention, *inputs) or inputs
    count = _Count()
    modes: list[TorchFunctionMode] = [count, EmptyHeads(ts.packed())] if held == 0 else [count]
    if watch is not None:
        modes.append(watch)
    # The forward is called, not the module (its own hooks would stop the probe): the rank's
    # rows of its per-head parameters are put in place around it here.
    rows = HeadParameters(ts, 0, held) if held is not None else None
    if rows is not None:
        rows.place(attention)
    try:
        with torch.no_grad():
            for mode in modes:
                mode.__enter__()
            if rows is not None:
                rows.enter(attention, ())
            try:
                attention.forward(*inputs[0], **inputs[1])
            finally:
                if rows is not None:
                    rows.leave(attention, (), None)
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


def _is_cache(value: Any) -> bool:
    """A key/value cache (Hugging Face's ``Cache``: ``update`` and ``get_seq_length``), which a
    forward appends to: a probe given the model's own would grow it."""
    return callable(getattr(value, "update", None)) and callable(
        getattr(value, "get_seq_length", None)
    )


def _without_caches(inputs: tuple[Any, Any]) -> tuple[Any, Any]:
    """``inputs`` (args, kwargs) with any key/value cache among them replaced by ``None``: a
    probe neither reads nor grows the cache of the forward it copies its inputs from (the
    model's, under Hugging Face's default ``use_cache=True``)."""
    args, kwargs = inputs
    return (
        tuple(None if _is_cache(a) else a for a in args),
        {k: None if _is_cache(v) else v for k, v in kwargs.items()},
    )


def _stop(module: nn.Module, args: Any) -> None:
    raise _Probed


def _emptied(kept: list[tuple[int, int]], module: nn.Module, args: Any, output: Any) -> Any:
    return take_runs(output, -1, kept) if isinstance(output, torch.Tensor) else output


def runs_without_heads(
    attention: nn.Module, ts: TensorSplit, inputs: tuple[Any, Any] | None = None
) -> str | None:
    """Why ``attention`` (split as ``ts``) cannot run its forward on a rank holding none of
    its heads, or None. Two probe forwards of copies of it (:func:`_probe_run`), one as the
    unsplit module, one as such a rank's, each on one token of zeros with ``None`` for its
    other required inputs (or ``inputs``, its args and kwargs): the heads' absence is to blame
    where the second fails before the first gets as far (Falcon's ``num_heads //
    num_kv_heads`` divides by zero). Where both fail alike (an input the probe lacks), it
    cannot tell: None. Both run on copies on the meta device
    (:func:`~hetcoll.torch.replay.meta_copy`)."""
    return _held_probe(attention, ts, 0, inputs)[0]


def runs_with_some_heads(
    attention: nn.Module, ts: TensorSplit, held: int = 1, inputs: tuple[Any, Any] | None = None
) -> tuple[str | None, bool]:
    """Why ``attention`` (split as ``ts``) cannot run its forward on a rank holding some of
    its heads (``held`` units of them), or None, as :func:`runs_without_heads`; and whether
    the probes could tell (else both failed alike, on an input they lack: the first forward
    looks again, :class:`FirstForwardCheck`). Hugging Face's LED decoder attention reshapes
    its heads' output to its input's width (``embed_dim`` read off the hidden states), which
    no rank holding part of its heads has."""
    if ts.units < 2 or ts.norms:  # (the probe does not split a norm over all heads)
        return None, True
    return _held_probe(attention, ts, held, inputs)


#: The torch functions that cut a tensor into pieces along one dimension, each with the
#: position of its ``dim`` argument.
_CUTS = {
    torch.chunk: 2, torch.Tensor.chunk: 2, torch.split: 2, torch.Tensor.split: 2,
    torch.tensor_split: 2, torch.Tensor.tensor_split: 2, torch.unbind: 1, torch.Tensor.unbind: 1,
}  # fmt: skip


class _HeadCuts(TorchFunctionMode):
    """Notes the first op of a forward that cuts a tensor of heads into parts of several
    heads along its heads: a dimension of one of ``counts`` (the attention's query and
    key/value head counts) before the last, which holds whole heads of ``head_dim``, no other
    of them as large. DiffLlama's ``torch.chunk(value_states, 2, dim=1)`` combines the heads
    of one half with the other's. A cut into single heads (StableLM's norm per head) keeps
    each head to itself."""

    def __init__(self, counts: set[int], head_dim: int) -> None:
        super().__init__()
        self.counts, self.head_dim = counts, head_dim
        self.found: str | None = None

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        at = _CUTS.get(func)
        if self.found is not None or at is None or not args:
            return out
        t = args[0]
        dim = args[at] if len(args) > at else kwargs.get("dim", 0)
        if not isinstance(t, torch.Tensor) or not isinstance(dim, int) or t.dim() < 2:
            return out
        if not -t.dim() <= dim < t.dim():
            return out
        dim %= t.dim()
        size, leading = t.shape[dim], list(t.shape[:-1])
        pieces = len(out) if isinstance(out, (tuple, list)) else 1
        if (
            dim < t.dim() - 1
            and t.shape[-1] % self.head_dim == 0
            and size in self.counts
            and leading.count(size) == 1
            and 1 < pieces < size
        ):
            name = getattr(func, "__name__", str(func))
            self.found = f"{name} of its {size} heads into {pieces} (dim {dim})"
        return out


def cuts_heads(
    attention: nn.Module, ts: TensorSplit, inputs: tuple[Any, Any] | None = None
) -> tuple[str | None, bool]:
    """What cuts ``attention``'s heads into parts along its heads in a probe forward of a copy
    of it on the meta device (:class:`_HeadCuts`), or None; and whether the probe ran its
    forward as far as its output projection (else an input it lacks stopped it first). A
    forward that combines the parts (DiffLlama's differential attention, head ``h`` with head
    ``h + heads / 2``) computes other numbers on a rank's heads than on all of them. On
    ``inputs`` (args, kwargs), or one token of zeros, ``None`` for its other required inputs
    but Hugging Face's rotary ``position_embeddings``, given as zeros of one ``head_dim``."""
    import inspect

    kv = 1 if ts.by_query_head() else ts.units  # (units: key/value groups, or heads)
    counts = {ts.heads(), kv} - {0, 1}
    if not counts:
        return None, True
    if inputs is None:
        token = _token(attention, ts)
        try:
            names = list(inspect.signature(attention.forward).parameters)
        except (TypeError, ValueError):
            return None, False
        if token is None:
            return None, False
        args, kwargs = list(token), {}
        if "position_embeddings" in names:
            row = torch.zeros(1, 1, ts.head_dim, device=token[0].device, dtype=token[0].dtype)
            if names.index("position_embeddings") < len(args):
                args[names.index("position_embeddings")] = (row, row)
            else:
                kwargs["position_embeddings"] = (row, row)
        inputs = (tuple(args), kwargs)
    watch = _HeadCuts(counts, ts.head_dim)
    ran = _probe_run(meta_copy(attention), ts, None, inputs=inputs, watch=watch)[0]
    return watch.found, ran


def _held_probe(
    attention: nn.Module, ts: TensorSplit, held: int, inputs: tuple[Any, Any] | None
) -> tuple[str | None, bool]:
    """Why a probe forward of ``attention`` holding ``held`` units fails before the unsplit
    one gets as far, or None; and whether that could be told: not where both fail alike (an
    input the probe lacks, where the ops before it may be fewer on fewer heads)."""
    whole = _probe_run(meta_copy(attention), ts, None, inputs=inputs)
    part = _probe_run(meta_copy(attention), ts, held, inputs=inputs)
    if part[0]:
        return None, True
    if not whole[0] and (whole[1] <= part[1] or whole[2] == part[2]):
        return None, False
    return part[2], True


def check_empty_heads(
    model: nn.Module, splits: Sequence[TensorSplit], inputs: tuple[Any, Any]
) -> None:
    """Where the probe at the split could not tell (``empty_fails`` ""), whether the
    attentions of ``splits`` run on a rank holding none of their heads, on the inputs the
    model's own forward hands them: one forward of a meta copy of ``model`` on ``inputs``
    (args and kwargs, meta tensors) records each class's first such attention's inputs,
    stopped once it has them all, then :func:`runs_without_heads` probes it with them; where
    it cannot run so (BLOOM's, given its ``alibi``), every attention of its class gets the
    reason. What the performance model
    reads before any rank runs, so a plan gives such an attention a key/value group on every
    rank. A forward that does not run on the meta device tells nothing: they stay as they
    are."""
    todo = [ts for ts in splits if ts.kind == "attention" and not ts.empty_fails]
    if not todo:
        return
    named = dict(model.named_modules())
    first: dict[type, TensorSplit] = {}
    for ts in todo:
        first.setdefault(type(named[ts.module]), ts)
    copy = meta_copy(model)
    copies = dict(copy.named_modules())
    seen: dict[str, tuple[Any, Any]] = {}

    def record(name: str) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            seen.setdefault(name, (tuple(args), dict(kwargs)))
            if len(seen) == len(first):
                raise _Probed  # every class's inputs are in: the rest of the forward is not run

        return hook

    handles = [
        copies[ts.module].register_forward_pre_hook(record(ts.module), with_kwargs=True)
        for ts in first.values()
    ]
    try:
        with torch.no_grad():
            copy(*inputs[0], **inputs[1])
    except (
        _Probed,
        RuntimeError,
        TypeError,
        ValueError,
        IndexError,
        NotImplementedError,
        AttributeError,
    ):
        pass
    finally:
        for h in handles:
            h.remove()
    for cls, ts in first.items():
        why = seen.get(ts.module) and runs_without_heads(named[ts.module], ts, seen[ts.module])
        if why:
            for other in todo:
                if type(named[other.module]) is cls:
                    other.empty_fails = why


def _on_meta(args: Any, kwargs: Any) -> tuple[Any, Any]:
    """A forward's inputs ``(args, kwargs)`` with each tensor an empty one on the meta device."""
    from torch.utils import _pytree as pytree

    def meta(v: Any) -> Any:
        return torch.empty_like(v, device="meta") if isinstance(v, torch.Tensor) else v

    return pytree.tree_map(meta, (tuple(args), dict(kwargs)))  # type: ignore[no-any-return]


# Probes on the meta device, once: nothing torch.compile should trace (a small Llama's took it
# 18 s of a 47 s compiled step).
@never_traced_methods("check")
class FirstForwardCheck:
    """At an attention's first forward, what the probes at the split could not tell (an input
    they lack stopped them), on the forward's own inputs this time. Whether it runs on a rank
    holding some of its heads, as each rank holding ``counts`` of its units does
    (:func:`runs_with_some_heads`: Hugging Face BigBird's full attention, chosen for a short
    sequence, reshapes its heads' output to every head's width); whether it cuts its heads
    into parts (:func:`cuts_heads`); and, where a rank holds none of its heads, whether it
    runs so (:func:`runs_without_heads`: BLOOM's, given no ``alibi`` at the split). Every rank
    checks alike (their inputs to a split attention are the same), on a copy of the unsplit
    module on the meta device, before the block runs: a forward failing on one rank alone
    would leave the others waiting in the block's reduction; here all raise ``ValueError``."""

    def __init__(self, ts: TensorSplit, attention: nn.Module, counts: Sequence[int]) -> None:
        self.ts, self.counts = ts, list(counts)
        # Before the split replaces its layers.
        self.meta: nn.Module | None = meta_copy(attention)
        self.handle: Any = None

    @staticmethod
    def needed(ts: TensorSplit, counts: Sequence[int]) -> bool:
        """Whether an attention split as ``ts`` at ``counts`` has anything to check."""
        return ts.kind == "attention" and (0 in counts or ts.cut_unseen or ts.parts_unseen)

    def install(self, attention: nn.Module) -> None:
        self.handle = attention.register_forward_pre_hook(
            self.check, with_kwargs=True, prepend=True
        )

    def check(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        self.handle.remove()
        unsplit, self.meta = self.meta, None
        if unsplit is None:
            return
        ts, inputs = self.ts, _on_meta(args, kwargs)
        name = repr(ts.module)
        if ts.parts_unseen:
            for held in sorted(set(self.counts) - {0, ts.units}):
                why = runs_with_some_heads(unsplit, ts, held, inputs)[0]
                if why is not None:
                    raise ValueError(
                        f"filter_parallel: attention {name} cannot run on a rank holding "
                        f"{held} of its {ts.units} units of heads, as rank "
                        f"{self.counts.index(held)} does ({why}); leave its layers out "
                        "(layers=...)"
                    )
        why = cuts_heads(unsplit, ts, inputs)[0] if ts.cut_unseen else None
        if why is not None:
            raise ValueError(
                f"filter_parallel: attention {name} cuts its heads into parts ({why}), which "
                "its forward may combine: split by heads, a rank's heads are not the unsplit "
                "attention's parts; leave its layers out (layers=...)"
            )
        why = runs_without_heads(unsplit, ts, inputs) if 0 in self.counts else None
        if why is not None:
            raise ValueError(
                f"filter_parallel: attention {name} cannot run on a rank holding "
                f"none of its heads, as rank {self.counts.index(0)} does ({why}); give every "
                "rank at least one key/value group (empty_blocks=False, or shares), or leave "
                "its layers out (layers=...)"
            )
