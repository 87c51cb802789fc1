"""Mixtures of experts split by hidden units: Hugging Face's experts modules (every expert's
weights stacked in 3-D parameters, ``use_experts_implementation``) divide each expert's hidden
units over the ranks, so a rank's work follows its share whatever the router picks. Which
modules split and how (:func:`experts_layout`, checked by a probe forward:
:func:`experts_split`), and the split module (:class:`FilterParallelExperts`).

A gated expert computes ``down(act(gate(x)) * up(x))``, each hidden unit on its own: a rank
holding some of every expert's hidden units (their rows of ``gate_up_proj``, their columns of
``down_proj``) computes a partial output for every routed token, and the ranks' partial
outputs, each already weighted by the router, sum to the whole module's. One sum-reduction
forward, of the output; backward, one of the hidden states' gradient and one of the routing
weights' (each rank's is its hidden units' part). Megatron-LM splits its experts' MLPs the same
way (expert tensor parallelism); here the shares follow the ranks' speeds."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hetcoll.comm import Communicator
from hetcoll.torch.filters.autograd import CopyToRanks, ReduceSum, needs_check
from hetcoll.torch.filters.heads import TensorSplit
from hetcoll.torch.filters.layers import ChannelSplit, set_attribute, split_runs, take_runs

#: The flags Hugging Face's ``use_experts_implementation`` sets on an experts module. Every
#: transformers 5 release sets ``has_bias`` and ``is_transposed``; the others came later
#: (``has_gate`` in 5.3, ``is_concatenated`` in 5.7, ``has_post_expert_norm`` in 5.20), and
#: before each the layout was what its default says (:func:`experts_flags`).
_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated", "has_post_expert_norm")
_FIRST_FLAGS = ("has_bias", "is_transposed")
_LATER_DEFAULTS = {"has_gate": True, "has_post_expert_norm": False}

#: Attributes an experts module counts each expert's hidden units with.
_COUNTS = ("intermediate_dim", "intermediate_size", "expert_dim", "ffn_hidden_size")

#: Hidden units per share step: Hugging Face's default kernel (``grouped_mm``) needs every
#: weight's strides in multiples of 16 bytes, 8 units of bf16 / fp16 (4 of float32).
ALIGN = 8


@dataclass(frozen=True)
class ExpertsLayout:
    """How an experts module splits by hidden units: ``units``, each expert's hidden units;
    ``params``, each split parameter's ``(dim, blocks)`` as :meth:`ChannelSplit.split_spec`
    gives them (per hidden unit: a gate and an up row, concatenated ``(1, 1)`` or interleaved
    ``(2,)``; one down column); ``counts``, the module's attributes counting the hidden units
    (a rank's module counts its own); ``bias``: the output projection's bias (``""`` for none),
    which every rank holds whole and the first rank alone adds, its gradient summed over the
    ranks; ``features``: what each token's experts read and write (the hidden size)."""

    units: int
    params: dict[str, tuple[int, tuple[int, ...]]]
    counts: tuple[str, ...]
    bias: str = ""
    features: int = 0


def experts_layout(m: nn.Module) -> ExpertsLayout | str | None:
    """``m`` as an experts module split by hidden units; why not where it holds experts (an int
    ``num_experts`` and 3-D parameters) in a layout this rule does not know; None where it
    holds none. It reads the flags Hugging Face's ``use_experts_implementation`` sets
    (transposed, interleaved, biased, gated or not) and the parameters' shapes."""
    experts = getattr(m, "num_experts", None)
    if isinstance(m, FilterParallelExperts) or not isinstance(experts, int):
        return None  # split already (no unsplit experts to split), or no experts
    if not any(p.dim() == 3 for p in m.parameters(False)):
        return _stacked_layout(m, experts)
    flags = experts_flags(m)
    if isinstance(flags, str):
        return flags
    if flags["has_post_expert_norm"]:
        return "a norm of each expert's whole output follows it (has_post_expert_norm)"
    has_gate, is_transposed = flags["has_gate"], flags["is_transposed"]
    first = "gate_up_proj" if has_gate else "up_proj"
    up, down = getattr(m, first, None), getattr(m, "down_proj", None)
    if not (isinstance(up, nn.Parameter) and isinstance(down, nn.Parameter)):
        return f"it has no {first} and down_proj parameters"
    up_dim, down_dim = (2, 1) if is_transposed else (1, 2)
    per = 2 if has_gate else 1
    if up.dim() != 3 or down.dim() != 3 or up.shape[up_dim] % per:
        return f"{first} {tuple(up.shape)} and down_proj {tuple(down.shape)} are not its layout"
    units = up.shape[up_dim] // per
    if down.shape[down_dim] != units or up.shape[0] != down.shape[0]:
        return f"{first} {tuple(up.shape)} and down_proj {tuple(down.shape)} are not its layout"
    blocks: tuple[int, ...] = ((1, 1) if flags["is_concatenated"] else (2,)) if has_gate else (1,)
    params: dict[str, tuple[int, tuple[int, ...]]] = {
        first: (up_dim, blocks),
        "down_proj": (down_dim, (1,)),
    }
    bias = ""
    if flags["has_bias"]:
        up_bias, out_bias = getattr(m, f"{first}_bias", None), getattr(m, "down_proj_bias", None)
        if not (isinstance(up_bias, nn.Parameter) and isinstance(out_bias, nn.Parameter)):
            return f"it has no {first}_bias and down_proj_bias parameters"
        if tuple(up_bias.shape) != (up.shape[0], per * units):
            return f"{first}_bias {tuple(up_bias.shape)} is not its layout"
        params[f"{first}_bias"] = (1, blocks)
        bias = "down_proj_bias"
    others = [n for n, p in m.named_parameters() if n not in params and n != bias]
    if others:
        return f"it holds parameters of no known role: {others}"
    counts = tuple(a for a in _COUNTS if getattr(m, a, None) == units)
    features = int(up.shape[3 - up_dim])  # the expert dimension is 0, the split one up_dim
    return ExpertsLayout(units, params, counts, bias, features)


def experts_flags(m: nn.Module) -> dict[str, bool] | str:
    """The layout flags of ``m``, an experts module with 3-D parameters: its own, and those a
    transformers release before the flag did not set at the value that meant (a gate, no
    norm after each expert; the ``[gate; up]`` halves of ``gate_up_proj`` where its class
    splits them by the default ``_apply_gate``: GptOss's own interleaves them, in the releases
    before ``is_concatenated`` said so). Why not where it is no class of that decorator."""
    flags = {f: getattr(m, f, None) for f in _FLAGS}
    if not all(isinstance(flags[f], bool) for f in _FIRST_FLAGS) or not all(
        v is None or isinstance(v, bool) for v in flags.values()
    ):
        return (
            "its parameters are not laid out as Hugging Face's use_experts_implementation "
            "describes them"
        )
    for f, before in _LATER_DEFAULTS.items():
        if flags[f] is None:
            flags[f] = before
    if flags["is_concatenated"] is None:
        gate = getattr(type(m), "_apply_gate", None)
        if (getattr(gate, "__module__", None), getattr(gate, "__name__", None)) != (
            "transformers.integrations.moe",
            "_default_apply_gate",
        ):
            return (
                "its class splits gate_up_proj by an _apply_gate of its own, and it has no "
                "is_concatenated flag to say how (transformers before 5.7)"
            )
        flags["is_concatenated"] = True
    return {f: bool(v) for f, v in flags.items()}


def _stacked_layout(m: nn.Module, experts: int) -> ExpertsLayout | str | None:
    """``m`` as experts whose weights a child holds stacked in 2-D, every expert's hidden
    units one run of rows of each (DBRX's ``mlp.w1``, ``mlp.v1``, ``mlp.w2``: experts x hidden
    units by features, each viewed as experts x hidden units x features), its count of them
    an attribute the forward views them by; why not where it holds such weights otherwise;
    None where it holds none (no parameters of its own, all in children not torch's own
    layers: a router's weight is its own, an expert's ``nn.Linear`` splits by its rule)."""
    params = dict(m.named_parameters())
    if not params or list(m.parameters(False)):
        return None
    owners = {n.rpartition(".")[0] for n in params}
    if any(type(m.get_submodule(o)).__module__.startswith("torch.") for o in owners):
        return None
    shapes = {tuple(p.shape) for p in params.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        return None
    rows, features = next(iter(shapes))
    if rows % experts or rows == experts:
        return None
    units = rows // experts
    counts = tuple(
        f"{o}.{a}" if o else a
        for o in sorted({"", *owners})
        for a in _COUNTS
        if getattr(m.get_submodule(o), a, None) == units
    )
    if not any("." not in a for a in counts):
        return (
            f"its experts' weights {sorted(params)} are stacked in 2-D, with no attribute of "
            f"its own ({', '.join(_COUNTS)}) counting each expert's {units} hidden units"
        )
    spec = (0, (1,) * experts)
    return ExpertsLayout(units, dict.fromkeys(params, spec), counts, "", features)


def experts_split(name: str, m: nn.Module) -> TensorSplit | str | None:
    """``m`` (at ``name``) as a split by hidden units (:class:`~.heads.TensorSplit` of kind
    ``"experts"``: its units are :data:`ALIGN` hidden units where each expert's hidden units
    come in such steps), once a probe forward of small copies shows that two halves of its
    hidden units add up to the whole (:func:`_separable`); why not, or None where ``m`` holds
    no experts (:func:`experts_layout`)."""
    layout = experts_layout(m)
    if not isinstance(layout, ExpertsLayout):
        return layout
    # One probe per class, layout, kernel and activation (a model's blocks share them).
    config = getattr(m, "config", None)
    key = (
        type(m),
        repr(layout),
        getattr(config, "_experts_implementation", None),
        repr(list(m.children())),
    )
    if key not in _probed:
        _probed[key] = _separable(m, layout)
    why = _probed[key]
    if why:
        return why
    width = ALIGN if layout.units % ALIGN == 0 else 1
    return TensorSplit(
        "experts",
        name,
        layout.units // width,
        width,
        [],
        name,
        shared=[f"{name}.{layout.bias}"] if layout.bias else [],
        empty_fails="its forward runs on no hidden units in no kernel (Hugging Face's "
        "grouped_mm, DBRX's view by their count)",
    )


_probed: dict[tuple[Any, ...], str] = {}


def _separable(m: nn.Module, layout: ExpertsLayout) -> str:
    """ "" where a copy of ``m`` holding ``2 * ALIGN`` hidden units of random weights computes,
    on random routed tokens, what two copies holding half of them each (:func:`split_runs`'
    slices, the output bias on the first) sum to, in float32 on the CPU, with ``m``'s own
    forward and kernel; else why not (a norm of the whole output, an expert added whole: work
    no share of the hidden units can do)."""
    g = torch.Generator().manual_seed(0)
    experts = int(m.num_experts)  # type: ignore[arg-type]
    full: dict[str, torch.Tensor] = {}
    for n, p in m.named_parameters():
        shape = list(p.shape)
        if n in layout.params:
            dim, blocks = layout.params[n]
            shape[dim] = 2 * ALIGN * sum(blocks)
        full[n] = torch.randn(shape, generator=g) / 4
    tokens, top_k = 6, min(2, experts)
    x = torch.randn(tokens, layout.features, generator=g)
    index = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)

    def run(shares: list[int], rank: int) -> torch.Tensor:
        held = {}
        for n, t in full.items():
            if n in layout.params:
                dim, blocks = layout.params[n]
                t = take_runs(t, dim, split_runs(shares, rank, blocks))
            elif n == layout.bias and rank:
                t = torch.zeros_like(t)
            held[n] = t.contiguous()
        c = _holding(m, held)
        for a in layout.counts:
            set_attribute(c, a, shares[rank])
        out = type(m).forward(c, x, index, weights)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"its forward returns a {type(out).__name__}, not a tensor")
        return out

    try:
        with torch.no_grad():
            whole = run([2 * ALIGN], 0)
            halves = run([ALIGN, ALIGN], 0) + run([ALIGN, ALIGN], 1)
    except Exception as e:  # whatever the module's own forward raises
        return f"a probe forward of a copy holding part of its hidden units failed ({e})"
    if halves.shape != whole.shape or not torch.allclose(halves, whole, rtol=1e-4, atol=1e-5):
        return "parts of its hidden units do not add up to its output (a probe forward)"
    return ""


def _holding(m: nn.Module, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """A shallow copy of ``m`` holding ``tensors`` as its parameters, by name (a child's
    dotted), its children that hold some copied alike; ``m`` is left as it is."""
    c = copy.copy(m)
    c.__dict__["_parameters"] = {n: nn.Parameter(t) for n, t in tensors.items() if "." not in n}
    c.__dict__["_modules"] = dict(m._modules)
    nested: dict[str, dict[str, torch.Tensor]] = {}
    for n, t in tensors.items():
        if "." in n:
            first, rest = n.split(".", 1)
            nested.setdefault(first, {})[rest] = t
    for first, inner in nested.items():
        c._modules[first] = _holding(m.get_submodule(first), inner)
    return c


class LocalExperts(nn.Module):
    """The computation a rank of a :class:`FilterParallelExperts` does on its own, between its
    collectives: ``local(compute, *args, **kwargs)`` calls ``compute`` (the experts module's
    own forward, on its hidden units). No parameters; module hooks on it see the rank's own
    work alone, as :attr:`~.layers.FilterParallelLayer.local`'s do."""

    def forward(self, compute: Any, *args: Any, **kwargs: Any) -> Any:
        return compute(*args, **kwargs)


class FilterParallelExperts(ChannelSplit):
    """An experts module holding this rank's hidden units of every expert: the module's own
    class and forward (any of Hugging Face's kernels), on its slices, between a copy of its
    floating-point inputs to the ranks (the hidden states and routing weights: their gradients
    summed) and a sum of its output over the ranks. The output projection's bias, held whole,
    is added by the first rank alone. Made by :meth:`convert`, which gives the module a class
    deriving from this and its own, made once per experts class."""

    timeout: float | None
    local: LocalExperts
    _layout: ExpertsLayout

    def split_spec(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        return dict(self._layout.params)

    @staticmethod
    def convert(
        module: nn.Module,
        shares: list[int],
        comm: Communicator,
        *,
        timeout: float | None = None,
    ) -> nn.Module:
        """``module`` (an experts module :func:`experts_layout` splits) made to hold this rank's
        ``shares[rank]`` hidden units of every expert, in place; returned. Its other
        parameters stay whole."""
        layout = experts_layout(module)
        if not isinstance(layout, ExpertsLayout):
            raise ValueError(f"module: cannot split its experts by hidden units ({layout})")
        if sum(shares) != layout.units or len(shares) != comm.size or min(shares) < 1:
            raise ValueError(
                f"shares: must be {comm.size} counts >= 1 summing to its {layout.units} hidden "
                f"units, got {shares}"
            )
        with torch.no_grad():
            for n, (dim, blocks) in layout.params.items():
                p = module.get_parameter(n)
                local = take_runs(p, dim, split_runs(shares, comm.rank, blocks)).clone()
                set_attribute(module, n, nn.Parameter(local, requires_grad=p.requires_grad))
        for a in layout.counts:
            set_attribute(module, a, shares[comm.rank])
        module.local = LocalExperts()
        module.__class__ = derived_class(FilterParallelExperts, type(module), "FilterParallel")
        split: Any = module
        split._set_split(comm, shares)
        split.timeout = timeout
        split._layout = layout
        return module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        check = needs_check(self.agreed)

        def copied(v: Any) -> Any:
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.requires_grad:
                return CopyToRanks.apply(v, self.comm, self.timeout, None, check)
            return v

        args = tuple(copied(v) for v in args)
        kwargs = {k: copied(v) for k, v in kwargs.items()}
        bias = self._layout.bias
        params: dict[str, Any] = self._parameters  # type: ignore[attr-defined]
        held = params.get(bias) if bias and self.rank else None
        if held is not None:  # added by the first rank alone; its gradient 0 here, then summed
            params[bias] = held * 0
        try:
            out = self.local(super().forward, *args, **kwargs)  # type: ignore[misc]
        finally:
            if held is not None:
                params[bias] = held
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"{type(self).__name__}: its forward returned a {type(out).__name__}, where a "
                "split experts module sums one tensor over the ranks"
            )
        return ReduceSum.apply(out, self.comm, self.timeout, check)

    def extra_repr(self) -> str:
        inner = super().extra_repr()  # type: ignore[misc]
        return f"{inner + ', ' if inner else ''}shares={self.shares}, rank={self.rank}"


#: The derived classes made so far, by (mixin, experts class).
_derived: dict[tuple[type, type], type] = {}


def derived_class(mixin: type, cls: type, prefix: str) -> type:
    """The class deriving from ``mixin`` and an experts module's own class ``cls``, named
    ``prefix + cls.__name__``, made once per pair: what a module's ``__class__`` becomes when
    it is converted in place (:class:`FilterParallelExperts`,
    :class:`hetcoll.torch.expert_parallel.ExpertParallelExperts`)."""
    if (mixin, cls) not in _derived:
        made = type(f"{prefix}{cls.__name__}", (mixin, cls), {})
        made.__module__ = mixin.__module__
        _derived[mixin, cls] = made
    return _derived[mixin, cls]
