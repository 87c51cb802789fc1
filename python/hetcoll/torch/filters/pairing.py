"""The modes filter parallelism gives a model's layers, by both of its pairing rules: a chain's
split-output -> split-input pairs (:func:`~.chains.plan_modes`) and, among the layers that rule
would gather, the attentions split by heads and MLPs by hidden units
(:func:`~.tensor_split.plan_tensor_splits`); and mixtures of experts by each expert's hidden
units (:func:`~.experts.experts_split`). :func:`split_layout` is the one place they combine:
:func:`~.convert.filter_parallel` splits by it and :func:`filter_modes` reports it (as does the
performance model, through the costs it reads off a model). It reads module types, attributes
and traced graphs only (and probe forwards: of meta copies, and of small copies of an experts
module), so a model on the meta device works."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from torch import nn

from hetcoll.torch.filters.chains import (
    Traced,
    channel_units,
    choose_layers,
    experts_adapters,
    inside_unknown_adapters,
    lora_base,
    plan_modes,
)
from hetcoll.torch.filters.experts import experts_layout, experts_split
from hetcoll.torch.filters.heads import TensorSplit
from hetcoll.torch.filters.tensor_split import plan_tensor_splits


@dataclass
class SplitLayout:
    """How filter parallelism splits the chosen layers of a model.

    ``modes``: each split layer's mode by module name (``"gather"``, ``"split-output"``,
    ``"split-input"``; an ``nn.MultiheadAttention`` split by heads appears under its own name,
    split-output); ``feeds``: for each split-input layer of a chain pair, the layer whose
    shares it takes and its input features per channel; ``batchnorms``: each BatchNorm split
    with the layer it follows; ``splits``: the attentions and MLPs split by heads and hidden
    units, and the mixtures of experts by each expert's hidden units (kind ``"experts"``, the
    experts module its own row, split-input); ``kept``: the attentions left whole, by name,
    with why; ``read_directly``: the chosen layers left whole because a traced forward reads
    their parameters itself (functional code, as torchvision Swin's attention: a split would
    hand it a slice); ``whole_experts``: the experts modules left whole, by name, with why;
    ``units``: the channels a pair's shares must be multiples of, by its split-output layer,
    where a grouped convolution between them (among the ``batchnorms``) takes whole groups."""

    modes: dict[str, str]
    feeds: dict[str, tuple[str, int]]
    batchnorms: dict[str, str]
    splits: list[TensorSplit]
    kept: dict[str, str]
    read_directly: list[str]
    whole_experts: dict[str, str] = field(default_factory=dict)
    units: dict[str, int] = field(default_factory=dict)


def split_layout(
    model: nn.Module,
    chosen: Sequence[str] | None = None,
    *,
    avoid_gathers: bool = True,
    tensor_splits: bool = True,
    mha: bool | Collection[str] = True,
    untraced: list[str] | None = None,
    traced_cache: dict[tuple[int, str], Traced | str] | None = None,
    experts: Sequence[str] | None = None,
    ranks: int = 1,
) -> SplitLayout:
    """The layout of a split of ``chosen`` (default: the layers :func:`~.chains.choose_layers`
    picks, without its warnings): chain pairs first,
    then, with ``tensor_splits`` and ``avoid_gathers``, the attentions (with ``mha`` torch's
    ``nn.MultiheadAttention`` too: all, or those a collection names) and MLPs among the layers
    left gathering, and the mixtures of experts ``experts`` names (default: all of the
    model's) by hidden units; a layer whose parameters a traced forward reads itself stays
    whole (``read_directly``). ``untraced``, ``traced_cache`` and ``ranks`` (a grouped
    convolution of fewer groups breaks a pair) as for :func:`~.chains.plan_modes`."""
    if chosen is None:
        chosen = choose_layers(model, None, dict(model.named_modules()), warn=False)
    cache: dict[tuple[int, str], Traced | str] = {} if traced_cache is None else traced_cache
    found: list[str] = []
    seen: list[str] = []  # untraced modules, reported once the modes are final
    modes, feeds, bns = plan_modes(
        model, list(chosen), avoid_gathers, seen, cache, found, ranks=ranks
    )
    read_directly = [n for n in chosen if n in found]
    if read_directly:  # the modes again without them (the traces cached)
        chosen = [n for n in chosen if n not in read_directly]
        seen = []
        modes, feeds, bns = plan_modes(model, chosen, avoid_gathers, seen, cache, ranks=ranks)
    if untraced is not None:
        untraced.extend(seen)
    splits: list[TensorSplit] = []
    kept: dict[str, str] = {}
    if avoid_gathers and tensor_splits:
        gathered = [n for n in chosen if modes[n] == "gather"]
        splits, kept = plan_tensor_splits(
            model, gathered + _adapted_layers(model, chosen, gathered), mha=bool(mha)
        )
        if not isinstance(mha, bool):
            splits = [ts for ts in splits if ts.kind != "mha" or ts.module in mha]
        for ts in splits:
            modes.update({c: "split-output" for c, _ in ts.columns})
            modes[ts.row] = "split-input"
            # Held whole on every rank, or inside a LoRA wrapper (split with it).
            for n in ts.held_whole(list(modes)) + ts.inner(list(modes)):
                modes.pop(n, None)
                feeds.pop(n, None)
    whole_experts: dict[str, str] = {}
    named = dict(model.named_modules())
    # Experts inside a PEFT wrapper stay whole with it, unless each wrapper is LoRA on one of
    # the parameters the split slices (ParamWrapper): its adapters split with them.
    wrapped = inside_unknown_adapters(named)
    for name in named if experts is None else experts:
        adapters: dict[str, str] | None = {}
        if name in wrapped and experts_layout(named[name]) is not None:  # no probe for it
            adapters = experts_adapters(named, name)
            if adapters is None:
                whole_experts[name] = wrapped[name]
                continue
        split = experts_split(name, named[name])
        if isinstance(split, TensorSplit) and avoid_gathers and tensor_splits:
            split.param_adapters = adapters or {}
            for wrapper, factor in split.param_adapters.items():  # the other factor: whole
                whole = "lora_A" if factor == "lora_B" else "lora_B"
                held = named[f"{wrapper}.{whole}"]
                split.shared += [f"{wrapper}.{whole}.{a}.weight" for a, _ in held.named_children()]
            splits.append(split)
            modes[name] = "split-input"  # its partial outputs summed over the ranks
        elif split is not None:
            whole_experts[name] = split if isinstance(split, str) else "avoid_gathers=False"
    units = channel_units(bns, named)
    return SplitLayout(modes, feeds, bns, splits, kept, read_directly, whole_experts, units)


def _adapted_layers(model: nn.Module, chosen: Sequence[str], gathered: Sequence[str]) -> list[str]:
    """PEFT's LoRA wrappers (:func:`~.chains.lora_base`) among the modules of ``model`` whose
    base layer gathers and whose adapters are all chosen (as by default: every linear
    layer), which an attention or MLP split by heads or hidden units may split as one
    projection, its adapters with it."""
    picked, gathers = set(chosen), set(gathered)
    out = []
    for name, m in model.named_modules():
        if lora_base(m) is None or f"{name}.base_layer" not in gathers:
            continue
        adapters = [f"{name}.{n}" for n, x in m.named_modules() if type(x) is nn.Linear]
        if all(a in picked for a in adapters) and name not in gathers:
            out.append(name)
    return out


def filter_modes(
    model: nn.Module, layers: Sequence[str] | None = None, *, avoid_gathers: bool = True
) -> dict[str, str]:
    """The mode :func:`filter_parallel` gives each layer it splits when split by speeds, by
    module name: ``"gather"``, ``"split-output"`` or ``"split-input"`` (the layers of an
    attention split by heads or an MLP by hidden units included: :func:`split_layout`). A
    grouped convolution between a pair counts as split by whole groups; on more ranks than
    its groups it stays whole and the pair gathers (:func:`split_layout` with ``ranks``).
    :func:`hetcoll.model.predict.filter_modes` reads it off the costs.

    >>> filter_modes(nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 2)))
    {'0': 'split-output', '2': 'split-input'}
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: must be a torch.nn.Module, got {type(model).__name__}")
    chosen = choose_layers(model, layers, dict(model.named_modules()), warn=False)
    return split_layout(model, chosen, avoid_gathers=avoid_gathers, mha=layers is None).modes
