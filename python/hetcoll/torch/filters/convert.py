"""Converting a model: :func:`filter_parallel` splits the chosen layers of a model in place,
in the modes the pairing rule gives (:mod:`.chains`; transformer blocks by heads and hidden
units, :mod:`.tensor_split`), after one agreement check on the plan;
:func:`filter_shares` gives the channels per rank it would use, locally."""

from __future__ import annotations

import functools
import math
import types
import warnings
import weakref
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils import _pytree as pytree

from hetcoll.collectives.autograd import disable_pending, never_traced_methods
from hetcoll.comm import (
    Communicator,
    agree,
    deadline,
    deadline_or_failure,
    is_group,
    shared_processes,
    wrap,
    wrap_or_raise,
)
from hetcoll.errors import CollectiveMismatchError
from hetcoll.torch.filters.autograd import AgreedForward, GradientSums, sole_holder
from hetcoll.torch.filters.chains import (
    Traced,
    choose_layers,
    layer_channels,
    layer_in_channels,
    lora_base,
    plan_modes,
    summed_before_gathering,
    vocabulary_ties,
)
from hetcoll.torch.filters.checks import (
    check_conv,
    check_flag,
    check_shares,
    check_timeout,
    is_int,
    speeds_argument,
    speeds_to_shares,
)
from hetcoll.torch.filters.dora import FilterParallelDoRA, is_dora_layer
from hetcoll.torch.filters.experts import ExpertsLayout, FilterParallelExperts, experts_layout
from hetcoll.torch.filters.head_guards import (
    EmptyHeads,
    HeadColumns,
    HeadParameters,
    KeyValueOfHeads,
    PackedLayoutGuard,
    PerHeadInputs,
)
from hetcoll.torch.filters.head_probes import FirstForwardCheck, rms_norm_eps
from hetcoll.torch.filters.heads import TensorSplit
from hetcoll.torch.filters.layers import (
    ChannelSplit,
    FilterParallelBatchNorm1d,
    FilterParallelBatchNorm2d,
    FilterParallelConv1D,
    FilterParallelConv2d,
    FilterParallelDepthwiseConv2d,
    FilterParallelEmbedding,
    FilterParallelGroupedConv2d,
    FilterParallelLayer,
    FilterParallelLinear,
    FilterParallelMultiheadAttention,
    FilterParallelRMSNorm,
    ReadAsIs,
    SharedCopy,
    UpstreamCopy,
    is_conv1d,
    set_attribute,
    split_comms,
    whole_positions,
)
from hetcoll.torch.filters.pairing import SplitLayout, split_layout
from hetcoll.torch.filters.shards import guard_save_pretrained, track_optimizers
from hetcoll.torch.filters.split_output import SplitOutput
from hetcoll.torch.filters.streams import (
    CpuDraws,
    RankStream,
    draws_random,
    generator_states,
    install_rank_streams,
    unequal_generators,
)
from hetcoll.torch.filters.timing import replicated_latencies, sample_seconds
from hetcoll.torch.replaced import record_replaced
from hetcoll.torch.state_dicts import few_names
from hetcoll.torch.transport import CountingCommunicator


def filter_shares(
    model: nn.Module,
    shares_or_speeds: Sequence[float] | Sequence[int] | Mapping[str, Sequence[int]] | None = None,
    size: int | None = None,
    *,
    speeds: Sequence[float] | None = None,
    shares: Sequence[int] | Mapping[str, Sequence[int]] | None = None,
    layers: Sequence[str] | None = None,
    multiple_of: int = 1,
    avoid_gathers: bool = True,
    empty_blocks: bool = False,
    sample: Any = None,
    loss_parallel: bool = False,
) -> dict[str, list[int]]:
    """The channels per rank :func:`filter_parallel` gives each layer it splits on ``size``
    ranks, by module name (split-input layers take the shares of the layer feeding them). Local:
    every argument check of :func:`filter_parallel` runs here, with the same errors, so a caller
    can check a split on ranks outside it (``empty_blocks``, ``sample`` and ``loss_parallel``
    as there, ``sample`` timed on this rank alone).

    >>> model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 2))
    >>> filter_shares(model, size=2, speeds=[2, 1])
    {'0': [4, 2], '2': [4, 2]}
    """
    if size is None:
        raise TypeError("size: required (the number of ranks)")
    if not is_int(size) or size < 1:
        raise ValueError(f"size: must be an integer >= 1, got {size!r}")
    check_flag(loss_parallel, "loss_parallel")
    value, argument = _split_argument(shares_or_speeds, speeds, shares)
    timed = None
    if sample is not None:

        def timed(splits: list[TensorSplit], others: list[str]) -> list[float]:
            seconds, failure = sample_seconds(model, sample, splits, others)
            if failure is not None:
                raise failure
            return seconds

    return _shares(
        model,
        value,
        argument,
        lambda: int(size),
        layers,
        multiple_of,
        avoid_gathers,
        empty_blocks,
        timed,
        loss_parallel,
    )[0]


def _split_argument(shares_or_speeds: Any, speeds: Any, shares: Any) -> tuple[Any, str]:
    """The one split given, and the name of its argument: ``speeds=`` (numbers, integers read
    as speeds too), ``shares=`` (integers, or a dict of them per layer) or the positional
    ``shares_or_speeds``, whose integers are shares and whose floats are speeds: ambiguous, so
    integers there get a DeprecationWarning."""
    given = [
        n
        for n, v in (("shares_or_speeds", shares_or_speeds), ("speeds", speeds), ("shares", shares))
        if v is not None
    ]
    if len(given) != 1:
        raise TypeError(
            "speeds, shares: give exactly one, by keyword: speeds=[...] (one per rank, each "
            "layer split in proportion) or shares=[...] (channels per rank, or a dict of them "
            "per layer)" + (f"; got {', '.join(given)}" if given else "")
        )
    if speeds is not None:
        return speeds_argument(speeds), "speeds"
    if shares is not None:
        if isinstance(shares, Mapping):
            return shares, "shares"
        if isinstance(shares, (str, bytes)) or not isinstance(shares, Sequence):
            raise TypeError(
                "shares: must be a sequence of integers (channels per rank) or a dict of them "
                f"per layer, got {type(shares).__name__}"
            )
        if not all(is_int(v) for v in shares):
            raise TypeError(
                f"shares: must be integers (speeds go to speeds=), got {list(shares)!r}"
            )
        return shares, "shares"
    if (
        isinstance(shares_or_speeds, Sequence)
        and not isinstance(shares_or_speeds, (str, bytes))
        and shares_or_speeds
        and all(is_int(v) for v in shares_or_speeds)
    ):
        warnings.warn(
            "filter_parallel: integers in shares_or_speeds are read as channel shares, where "
            "hetcoll.split reads them as speeds; say which with shares= or speeds= (the "
            "positional form goes in a later release)",
            DeprecationWarning,
            stacklevel=3,
        )
    return shares_or_speeds, "shares_or_speeds"


def _shares(
    model: nn.Module,
    shares_or_speeds: Any,
    argument: str,
    size_of: Callable[[], int],
    layers: Sequence[str] | None,
    multiple_of: int,
    avoid_gathers: bool,
    empty_blocks: bool = False,
    timed: Callable[[list[TensorSplit], list[str]], list[float]] | None = None,
    vocabulary: bool = False,
    traced: dict[tuple[int, str], Traced | str] | None = None,
) -> tuple[dict[str, list[int]], list[tuple[TensorSplit, list[int]]], dict[str, str]]:
    """:func:`filter_shares`, asking for the group size only once the arguments are checked;
    with the attentions and MLPs split by heads and hidden units (each with its units per
    rank) and every layer's mode; with ``vocabulary``, a head tied to its token embedding is
    split too (:func:`~.chains.vocabulary_ties`). ``timed(splits, others)``: the seconds of a
    forward of the unsplit model outside the other split layers, and of each split's own work in it
    (:func:`~.timing.sample_seconds`), to balance the work every rank repeats around the
    splits too. ``traced``: the torch.fx traces of the model's modules
    (:func:`~.chains.plan_modes`'s ``traced_cache``), kept for a caller that reads the
    unchanged model's modes again."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: must be a torch.nn.Module, got {type(model).__name__}")
    if not is_int(multiple_of) or multiple_of < 1:
        raise ValueError(f"multiple_of: must be an integer >= 1, got {multiple_of!r}")
    check_flag(empty_blocks, "empty_blocks")
    check_flag(avoid_gathers, "avoid_gathers")  # None once turned every layer to gathering
    if timed is not None and argument != "speeds":  # once ignored where nothing was timed
        raise ValueError("sample: balances a split by speeds; give speeds=, not shares")
    named = dict(model.named_modules())
    per_layer: Mapping[str, Any] | None = None
    mha: bool | set[str] = layers is None
    named_by = "layers"
    if isinstance(shares_or_speeds, Mapping):
        per_layer = shares_or_speeds
        for key, value in per_layer.items():  # floats were once read as speeds, None raised
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
                raise TypeError(
                    f"{argument}[{key!r}]: must be a sequence of integers (channels per rank), "
                    f"got {value!r}"
                )
            if not all(is_int(v) for v in value):
                raise TypeError(
                    f"{argument}[{key!r}]: must be integers (channels per rank), got {value!r}"
                )
        if layers is None:
            layers = list(per_layer)
            named_by = argument
        missing = [k for k in per_layer if k not in layers]
        if missing:
            raise ValueError(f"{argument}: names layers not in layers: {missing}")
        # torch's attentions named with their shares split by heads (their packed projection
        # is no layer of its own).
        mha = {k for k in per_layer if isinstance(named.get(k), nn.MultiheadAttention)}
        layers = [k for k in layers if k not in mha]
    elif isinstance(shares_or_speeds, (str, bytes)) or not isinstance(shares_or_speeds, Sequence):
        raise TypeError(
            f"{argument}: must be a sequence (speeds or shares, one per rank) or a dict "
            f"of shares per layer, got {type(shares_or_speeds).__name__}"
        )
    elif any(isinstance(s, (bool, np.bool_)) for s in shares_or_speeds):
        raise TypeError(f"{argument}: booleans are neither speeds nor shares")
    # Mixtures of experts named in layers split by hidden units: no Linear of theirs to choose.
    experts = None
    if layers is not None and not isinstance(layers, str) and isinstance(layers, Sequence):
        experts = [n for n in layers if n in named and experts_layout(named[n]) is not None]
        layers = [n for n in layers if n not in experts]
    chosen = choose_layers(
        model, layers, named, warn=False, vocabulary=vocabulary, argument=named_by
    )
    for name in chosen:
        m = named[name]
        if isinstance(m, nn.Conv2d):
            check_conv(m, f"{named_by}: {name!r}")
    cache: dict[tuple[int, str], Traced | str] = {} if traced is None else traced
    untraced: list[str] = []

    ranks = 1  # a grouped convolution of fewer groups breaks a pair (asked only where one is)

    def laid_out(chosen: list[str]) -> SplitLayout:  # the modules it cannot trace to untraced
        untraced.clear()
        return split_layout(
            model,
            chosen,
            avoid_gathers=avoid_gathers,
            mha=mha,
            untraced=untraced,
            traced_cache=cache,
            experts=experts,
            ranks=ranks,
        )

    layout = laid_out(chosen)
    # A grouped convolution between a pair gives each rank whole groups: with fewer groups
    # than ranks it needs the full tensor, and the layout is made again for the ranks.
    grouped = [named[b].groups for b in layout.batchnorms if isinstance(named[b], nn.Conv2d)]
    if grouped:
        ranks = size_of()
        if min(grouped) < ranks:
            layout = laid_out(chosen)

    def need() -> int:  # the channels a layer needs for the ranks (the group asked only then)
        return size_of() * int(multiple_of)

    # Chosen by default, a layer no split can follow stays whole (named in a warning); named
    # in ``layers``, it raises.
    named_in = named_by if layers is not None else None
    whole = _left_whole(layout, named, chosen, named_in, per_layer is None, need)
    if whole:
        chosen = [n for n in chosen if n not in whole]
        if any(n not in layout.read_directly for n in whole):  # the layout changes with them
            layout = laid_out(chosen)
    if layers is None:  # the layers left replicated, but those split per channel
        choose_layers(model, None, named, vocabulary=vocabulary, per_channel=layout.batchnorms)
    modes, feeds = layout.modes, layout.feeds
    splits = [
        _heads_or_groups(ts, shares_or_speeds, argument, size_of, multiple_of, empty_blocks)
        if per_layer is None and ts.by_head is not None
        else ts
        for ts in layout.splits
    ]
    for ts in splits:
        for n in ts.held_whole(chosen):  # held whole on every rank
            modes.pop(n, None)
    # The key and value projections of an attention split by query head (multi-query
    # attention's; grouped-query attention's where its groups are too few), and the layers
    # of its per-head tables: whole on every rank, no split's.
    held_whole = {n: ts.module for ts in splits for n in ts.held_whole(chosen)}
    named_whole = [n for n in per_layer or () if n in held_whole]
    if named_whole:
        raise ValueError(
            f"{argument}: gives shares for {named_whole}, the key/value (or latent) "
            f"projections of attention {held_whole[named_whole[0]]!r}, split by heads, which "
            "every rank holds whole (its heads split); leave them out"
        )
    # The layers inside a LoRA wrapper split as one projection: split with it.
    inner = {n for ts in splits for n in ts.inner(chosen)}
    chosen = [n for n in chosen if n not in held_whole and n not in inner]
    if layout.kept:
        warnings.warn(
            "filter_parallel: attention left unsplit by heads (its layers gather their "
            "outputs): " + "; ".join(f"{n!r} ({why})" for n, why in layout.kept.items()),
            UserWarning,
            stacklevel=4,
        )
    if layout.whole_experts:
        whole_named = [n for n in experts or () if n in layout.whole_experts]
        if whole_named:
            n = whole_named[0]
            raise ValueError(
                f"layers: {n!r} cannot split its experts by hidden units "
                f"({layout.whole_experts[n]}); leave it out"
            )
        warnings.warn(
            "filter_parallel: mixture-of-experts layers left whole on every rank (each rank "
            "runs every expert its tokens reach): "
            + "; ".join(f"{n!r} ({why})" for n, why in layout.whole_experts.items()),
            UserWarning,
            stacklevel=4,
        )
    # The gathering layers a trace could pair: another split layer (outside the heads' and
    # units' splits, and not paired already) reads as many channels as one writes. A language
    # model's head, which nothing reads, gathers whatever a trace would show: no warning for it.
    in_splits = {n for ts in splits for n in ts.layers()}
    alone = [n for n in chosen if n not in in_splits and lora_base(named[n]) is not None]
    if alone:
        raise ValueError(
            f"{named_by}: {alone[0]!r} is PEFT's LoRA wrapper of a linear layer, which splits "
            "with its adapters only as a projection of an attention or MLP split by heads or "
            "hidden units (name every projection of its block); name its base layer "
            f"({alone[0] + '.base_layer'!r}) to split that alone, its adapters replicated"
        )

    def pairable(g: str) -> bool:
        out = layer_channels(named[g])
        return any(
            layer_in_channels(named[r]) == out
            for r, mode in modes.items()
            if r != g and r not in in_splits and mode != "split-input"
        )

    gathering = [n for n, m in modes.items() if m == "gather" and pairable(n)]

    def holds_gathering(entry: str) -> bool:  # an untraced module around a gathering layer
        name = entry.split(" (", 1)[0]
        return name == type(model).__name__ or any(g.startswith(name + ".") for g in gathering)

    untraced = [u for u in untraced if holds_gathering(u)]
    if untraced and gathering:
        warnings.warn(
            "filter_parallel: could not trace the forward of "
            + "; ".join(untraced)
            + ", so the layers split inside gather their whole outputs after each "
            "(mode 'gather') unless an nn.Sequential shows what feeds what (or they form an "
            "attention or MLP split by heads or hidden units); gathering: "
            + ", ".join(f"{n!r} gather" for n in gathering),
            UserWarning,
            stacklevel=4,
        )
    size = size_of() if chosen or splits else 1

    latencies: list[list[float] | None] = [None] * len(splits)
    if timed is not None and not splits:  # once ignored in silence, whatever it was
        warnings.warn(
            "filter_parallel: sample times the work every rank repeats around attentions and "
            "MLPs split by heads or hidden units, and this split has none: it is not run",
            UserWarning,
            stacklevel=4,
        )
    if timed is not None and splits:
        others = [n for n in chosen if n not in in_splits]
        latencies = replicated_latencies(splits, timed(splits, others), shares_or_speeds)
    # A rank holding none of an attention's heads runs its forward on empty tensors. One whose
    # forward cannot (TensorSplit.empty_fails) would fail there alone while the others wait in
    # the block's reduction: with empty_blocks it still gives every rank at least one
    # key/value group.
    no_empty = {ts.module: ts.empty_fails for ts in splits if ts.empty_fails}

    def units_of(ts: TensorSplit, latency: list[float] | None) -> list[int]:
        try:
            return _split_units(
                ts,
                shares_or_speeds if per_layer is None else _row_shares(ts, per_layer),
                argument if per_layer is None else f"{argument}[{_row_key(ts, per_layer)!r}]",
                size,
                int(multiple_of),
                empty_blocks and ts.module not in no_empty,
                latency,
            )
        except ValueError as e:
            if ts.module not in no_empty:
                raise
            held = "hidden units" if ts.kind == "experts" else "heads"
            raise ValueError(
                f"{e} ({ts.kind} {ts.module!r} cannot run on a rank holding none of its "
                f"{held}: {no_empty[ts.module]})"
            ) from None

    units = [(ts, units_of(ts, latency)) for ts, latency in zip(splits, latencies, strict=True)]
    # Attentions handed per-head inputs by the first of their class hold its heads.
    first_of = {ts.module: counts for ts, counts in units}
    for i, (ts, counts) in enumerate(units):
        lead = first_of.get(ts.heads_with) if ts.heads_with else None
        if lead is None or counts == lead:
            continue
        if per_layer is not None:
            raise ValueError(
                f"{argument}: attention {ts.module!r} is handed inputs for its heads by "
                f"{ts.heads_with!r} (of its class), so it must hold the same heads: its "
                f"shares give it {counts} key/value groups per rank against {lead}"
            )
        units[i] = (ts, list(lead))
    shares: dict[str, list[int]] = {}
    for ts, counts in units:
        for name, per_unit in zip(ts.layers(), ts.features_per_unit(), strict=True):
            shares[name] = [u * per_unit for u in counts]
        for c, _ in ts.columns:
            given = None if per_layer is None else per_layer.get(c)
            if given is not None and [int(v) for v in given] != shares[c]:
                raise ValueError(
                    f"{argument}: layer {c!r} feeds {ts.row!r} in {ts.kind} {ts.module!r}, "
                    f"split by whole units alike, so its shares must be {shares[c]} (for "
                    f"{ts.row!r}'s {shares[ts.row]}), got {list(given)!r}"
                )
    for name in chosen:
        if name in in_splits:
            continue
        what = f"layer {name!r}"
        total = layer_channels(named[name])
        if name in feeds:
            continue  # it takes the shares of the layer whose channels it reads: checked below
        unit = layout.units.get(name, 1)  # whole groups of a grouped convolution it feeds
        if per_layer is not None:
            if name not in per_layer:
                raise ValueError(f"{argument}: gives no shares for {what}")
            shares[name] = check_shares(per_layer[name], total, size, argument, what)
            where = f"{argument}[{name!r}]"
        elif argument != "speeds" and all(is_int(s) for s in shares_or_speeds):  # type: ignore[union-attr]
            shares[name] = check_shares(shares_or_speeds, total, size, argument, what)
            where = argument
        else:
            # A unit of whole groups: also a multiple of multiple_of channels where such
            # units still divide the channels among the ranks.
            step = math.lcm(unit, int(multiple_of)) if unit > 1 else 1
            if total % step or total // step < size:
                step = unit
            counts = speeds_to_shares(
                shares_or_speeds,  # type: ignore[arg-type]
                total // step,
                size,
                int(multiple_of) if step == 1 else 1,
                argument,
                what,
            )
            shares[name] = [c * step for c in counts]
            continue
        if any(s % unit for s in shares[name]):
            conv = next(
                b
                for b, src in layout.batchnorms.items()
                if src == name and isinstance(named[b], nn.Conv2d) and named[b].groups > 1
            )
            raise ValueError(
                f"{where}: {what} feeds grouped convolution {conv!r}, which each "
                f"rank runs on whole groups, so its shares must be multiples of {unit} "
                f"channels, got {list(shares[name])}"
            )
    for name, (src, _) in feeds.items():
        shares[name] = shares[src]
        given = None if per_layer is None else per_layer.get(name)
        if given is not None and [int(s) for s in given] != shares[src]:
            what = "reads" if modes[name] == "split-input" else "scales"  # an excitation's
            raise ValueError(
                f"{argument}: layer {name!r} {what} the channels of {src!r}, so its "
                f"shares must be {src!r}'s ({shares[src]}), got {list(given)!r}"
            )
    order = {n: i for i, n in enumerate(named)}
    listed = sorted((n for n in shares if n in set(chosen) | in_splits), key=order.__getitem__)
    return {name: shares[name] for name in listed}, units, modes


def _left_whole(
    layout: SplitLayout,
    named: dict[str, nn.Module],
    chosen: list[str],
    named_in: str | None,
    by_speeds_or_list: bool,
    size_of: Callable[[], int],
) -> list[str]:
    """The chosen layers no split can follow, warned about: those whose parameters a traced
    forward reads itself (:attr:`SplitLayout.read_directly`), and, chosen by default with
    speeds or one list of shares, those of fewer output channels than the ranks need (a gate
    or a router of one output, a regression head). Layers named in an argument (``named_in``:
    ``layers``, or the dict of shares) raise instead, naming it."""
    whole: list[str] = []
    kept: list[str] = []
    if layout.read_directly:
        direct = ", ".join(repr(n) for n in layout.read_directly)
        why = (
            "a traced forward reads their parameters itself (functional code, such as "
            "F.linear(x, layer.weight)), which a split would hand a slice"
        )
        if named_in is not None:
            raise ValueError(f"{named_in}: {direct}: {why}; leave them out")
        whole += layout.read_directly
        kept.append(f"{direct} ({why})")
    if named_in is None and by_speeds_or_list and chosen:
        need = size_of()
        in_splits = {n for ts in layout.splits for n in ts.layers()}
        for n in chosen:
            channels = layer_channels(named[n])
            if n in in_splits or layout.modes.get(n) == "split-input" or channels >= need:
                continue
            whole.append(n)
            kept.append(
                f"{n!r} ({type(named[n]).__name__}, {channels} output channels: fewer than "
                f"{need} for the ranks)"
            )
    if kept:
        warnings.warn(
            "filter_parallel: left replicated (every rank computes them whole): " + ", ".join(kept),
            UserWarning,
            stacklevel=5,
        )
    return whole


def _row_key(ts: TensorSplit, per_layer: Mapping[str, Any]) -> str:
    """The key of a per-layer dict that gives an attention or MLP its shares: its row layer,
    else (torch's attention named alone) its packed projection."""
    return ts.row if ts.row in per_layer else ts.columns[0][0]


def _row_shares(ts: TensorSplit, per_layer: Mapping[str, Any]) -> list[Any]:
    """The row layer's input features per rank a per-layer dict gives an attention or MLP:
    the row's own shares, else (torch's attention named alone) its packed projection's,
    converted."""
    key = _row_key(ts, per_layer)
    if key == ts.row:
        return list(per_layer[ts.row])
    per_unit = ts.features_per_unit()[0]
    return [
        int(v) // per_unit * ts.width if is_int(v) and int(v) % per_unit == 0 else v
        for v in per_layer[key]
    ]


def _split_units(
    ts: TensorSplit,
    shares_or_speeds: Any,
    argument: str,
    size: int,
    multiple_of: int,
    empty: bool,
    latency: list[float] | None = None,
) -> list[int]:
    """The heads' key/value groups (an attention) or hidden units (an MLP) each rank of a
    tensor split holds: from speeds, :func:`hetcoll.split` over the row layer's input features
    in multiples of whole units (and of ``multiple_of``); from shares (the row layer's input
    features per rank), checked to be whole units. Each rank holds at least one unit unless
    ``empty``."""
    if ts.kind == "attention":
        what = f"attention {ts.module!r}"
        noun = f"key/value groups (of {ts.width} query features each)"
        if ts.by_query_head():  # its key and value whole on every rank
            noun = f"query heads (of {ts.width} features each)"
    elif ts.kind == "mha":
        what, noun = f"attention {ts.module!r}", f"heads (of {ts.width} features each)"
    elif ts.kind == "experts":
        what = f"experts {ts.module!r}"
        noun = f"steps of {ts.width} hidden units (of every expert)"
    else:
        what, noun = f"MLP {ts.module!r}", "hidden units"
    total = ts.units * ts.width
    least = 0 if empty else 1
    if ts.units < size and not empty:
        raise ValueError(
            f"{argument}: {what} has {ts.units} {noun}, too few for {size} ranks with at least "
            "one each; give fewer ranks, let a rank hold none (empty_blocks=True), or leave "
            "its layers out (layers=...)"
        )
    if argument != "speeds" and all(is_int(s) for s in shares_or_speeds):
        got = [int(s) for s in shares_or_speeds]
        if len(got) != size:
            raise ValueError(
                f"{argument}: has {len(got)} shares but the group has {size} ranks (one per rank)"
            )
        if sum(got) != total or any(s < least * ts.width or s % ts.width for s in got):
            raise ValueError(
                f"{argument}: {got} are not whole {noun} of {what}: it splits {total} features "
                f"in units of {ts.width}, "
                + ("none negative" if empty else "at least one per rank (empty_blocks=True: none)")
            )
        return [s // ts.width for s in got]
    step = ts.width * multiple_of // math.gcd(ts.width, multiple_of)
    if total % step or total < max(least * size, 1) * step:
        raise ValueError(
            f"multiple_of: {multiple_of} cannot be met by whole {noun} of {what}: its "
            f"{total} features come in units of {ts.width}, so each rank's would be a "
            f"multiple of {step}, which {total} features over {size} ranks cannot be"
        )
    channels = speeds_to_shares(
        shares_or_speeds, total, size, step, argument, what, empty=empty, latency=latency
    )
    return [c // ts.width for c in channels]


def _heads_or_groups(
    ts: TensorSplit,
    shares_or_speeds: Any,
    argument: str,
    size_of: Callable[[], int],
    multiple_of: int,
    empty_blocks: bool,
) -> TensorSplit:
    """A grouped-query attention's split (``ts``, by key/value group) or the same split by query
    head (:attr:`TensorSplit.by_head`): by query head where shares are whole query heads but
    not whole groups, or where its groups cannot split as asked (too few for the ranks, or
    for ``multiple_of``), as Megatron-LM repeats key/value heads only where the ranks
    outnumber them (where neither splits, the query heads' error says why). Groups too coarse
    for uneven speeds still split by group: at 1 : 0.25 on 2 emulated ranks, a split by query
    head measured no faster (see docs/filter_parallel.md), its key and value repeated on every
    rank and their gradients summed. The performance model's rule is the same
    (:meth:`hetcoll.model.costs.SplitBlock.resolved`)."""
    by_head = ts.by_head
    assert by_head is not None
    empty = empty_blocks and not ts.empty_fails
    try:  # the groups' split, by speeds or shares, as the split itself makes it
        _split_units(ts, shares_or_speeds, argument, size_of(), multiple_of, empty)
    except ValueError:
        return by_head
    return ts


def _tell_the_others(group: Any, timeout: float | None, failure: Exception) -> None:
    """Raise this rank's argument error once told to the other ranks in the exchange they
    enter next (the plan's agreement: there they raise at once, a mismatch naming this rank);
    at once where ``group`` is no group (no one to tell)."""
    comm = wrap_or_raise(group, failure)
    try:  # a bad timeout is the error told, waited for without a deadline (on MPI: alone)
        limit, _ = deadline_or_failure(timeout, comm)
    except ValueError:
        raise failure from None
    agree(_counting(comm), {}, limit, failure=failure)  # raises failure


def _counting(comm: Communicator) -> Communicator:
    """``comm`` as filter_parallel's agreements use it, counting its bytes (a
    :class:`CountingCommunicator`, whose gathers are not the plain communicator's: every
    agreement one rank may meet another's in must go through one)."""
    return comm if isinstance(comm, CountingCommunicator) else CountingCommunicator(comm, {})


def filter_parallel(
    model: nn.Module,
    # The older positional split, or the group (as expert_parallel takes it).
    shares_or_speeds: Sequence[float] | Sequence[int] | Mapping[str, Sequence[int]] | Any = None,
    group: Any = None,
    *,
    speeds: Sequence[float] | None = None,
    shares: Sequence[int] | Mapping[str, Sequence[int]] | None = None,
    layers: Sequence[str] | None = None,
    multiple_of: int = 1,
    avoid_gathers: bool = True,
    empty_blocks: bool = False,
    sample: Any = None,
    loss_parallel: bool = False,
    timeout: float | None = None,
) -> nn.Module:
    """Split the Conv2d / Linear layers of ``model`` across the ranks of ``group``, in place;
    return ``model``.

    Give the split by keyword, exactly one of: ``speeds=`` — numbers, one per rank (integers
    too, as :func:`hetcoll.split` reads them), each layer split with :func:`hetcoll.split`
    (``multiple_of``, at least ``multiple_of`` channels per rank); ``shares=`` — integers, one
    per rank, the same channels for every split layer, or a dict from layer name to shares (the
    layers then default to its keys; an attention or MLP whose projections it all names splits
    by whole heads or units, as :func:`filter_shares` reports them). The positional
    ``shares_or_speeds`` (floats: speeds, integers: shares) still works; with integers it
    warns, being ambiguous. ``layers`` names the modules to split (default: every
    ``nn.Conv2d`` with ``groups=1`` and ``nn.Linear``, and every mixture of experts: Hugging
    Face's experts modules, split by each expert's hidden units, :mod:`.experts`; those it
    cannot split are named in a ``UserWarning``). Modes are chosen so a split layer feeding
    another through channel-wise modules only (inside an ``nn.Sequential``) skips the gather:
    split-output then split-input; a BatchNorm between them is split too. ``avoid_gathers=False``
    gathers after every split layer. Attentions split by whole heads (key/value groups; by query
    head, the key and value whole on every rank, under multi-query attention and where a
    grouped-query attention's groups are too few for the ranks; a latent attention's latents
    whole on every rank, ahead of its heads) and MLPs by hidden units; every rank holds at
    least one of each, unless ``empty_blocks=True``: then speeds (or shares) may give a rank
    none of a block's heads or units, as :func:`hetcoll.split`
    gives a rank too slow for one whole key/value group. Such a rank runs the attention on empty
    tensors and only joins its two reductions, and a block may then have fewer heads than the
    group has ranks. ``sample`` (example inputs: a tensor, a tuple of positional inputs or a dict
    of keyword inputs) balances those splits by time instead of by speed alone: every rank
    repeats the work outside them (norms, embeddings, residual adds) at its own speed, which
    the slow rank then also pays for; timed on a few forwards of the unsplit model on
    ``sample`` (the ranks' mean), that work becomes :func:`hetcoll.split`'s ``latency``, and
    the slow rank gets fewer heads and hidden units. A layer that shares a parameter with
    another module (tied
    weights, as a language model's head with its embedding, or one module registered under two
    names) stays replicated and is named in a ``UserWarning``, as PyTorch users expect ties to
    hold: a split layer would hold a slice of its own and untie them; naming it in ``layers``
    raises ``ValueError`` naming both. ``loss_parallel=True``: the split linear layers that
    gather their outputs (a language model's head, split by vocabulary) return them split
    along the last dimension instead, as :class:`~.split_output.SplitOutput`, which
    ``F.cross_entropy`` reduces across the ranks without gathering the logits (three
    numbers per row forward, none backward; Megatron-LM's vocabulary-parallel loss) and any
    other op gathers first: every rank must then use the model's output alike; a head tied to
    its token embedding (an ``nn.Embedding``) is then split too, by vocabulary with its
    embedding (:class:`~.layers.FilterParallelEmbedding`), and they stay tied. Under
    ``torch.compile``, compile the result's blocks (``block.compile()`` for each decoder
    layer) to keep such outputs split: compiled whole, it gathers them (and warns). Every rank
    must pass the same arguments and the same model; all checks run before the one
    collective (an agreement check on the plan, which raises
    :class:`hetcoll.CollectiveMismatchError` on every rank if ranks disagree; with ``sample``,
    the timings are agreed before it). A rank whose own arguments are bad (``sample`` and
    ``timeout`` included) tells the others in the exchange they are in: it raises its own
    ``ValueError`` / ``TypeError`` naming the argument, they a
    :class:`~hetcoll.CollectiveMismatchError` naming that rank and its error (a bad
    ``timeout`` on MPI alone is raised on its rank only: see :func:`hetcoll.allgatherv`).

    The result trains with any optimizer whose update is elementwise (SGD, Adam, AdamW,
    RMSprop, ...) exactly as the unsplit model would; global-norm clipping would see only the
    local slice. :func:`gather_state_dict` and :func:`gather_optimizer_state_dict` rebuild the
    unsplit model's state dict and optimizer state; :func:`load_full_state_dict` and
    :func:`load_full_optimizer_state_dict` load them into any split of the model (another
    number of ranks, other speeds): a checkpoint that resumes elsewhere.

    ``group`` may also come second, as :func:`~hetcoll.torch.expert_parallel` takes it
    (``filter_parallel(model, group, speeds=...)``).

    >>> model = filter_parallel(DemoNet(), speeds=[1.0, 0.25], group=group)  # doctest: +SKIP
    """
    if group is None and is_group(shares_or_speeds):
        group, shares_or_speeds = shares_or_speeds, None  # (model, group, speeds=...)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: must be a torch.nn.Module, got {type(model).__name__}")
    disable_pending()  # what a compiled model runs of the split, never traced
    held = [n for n, m in model.named_modules() if isinstance(m, ChannelSplit)]
    if held:  # the same model on every rank: every rank raises here
        raise ValueError(
            f"model: {held[0]!r} is split across the ranks already (by filter_parallel, or "
            "its experts placed by expert_parallel); give filter_parallel the unsplit model "
            "(a split model's gather_state_dict loads into one)"
        )
    meta = next(
        (n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta), None
    )
    if meta is not None:  # the same model on every rank: every rank raises here
        raise ValueError(
            f"model: {meta!r} is on the meta device; materialise the model first (to_empty, "
            "then initialise or load its weights): each rank keeps its slice of the weights "
            "the model holds when it is split, and a split layer has no reset_parameters "
            "that would initialise it as the unsplit layer"
        )
    try:
        check_timeout(timeout)
        check_flag(loss_parallel, "loss_parallel")
        value, argument = _split_argument(shares_or_speeds, speeds, shares)
    except (TypeError, ValueError) as e:
        _tell_the_others(group, timeout, e)
        raise
    timed = None
    told = False  # an error out of the timings' exchange: every rank raised there already
    if sample is not None:

        def timed(splits: list[TensorSplit], others: list[str]) -> list[float]:
            # Every rank times its own forward, as fractions of it (ranks on different devices
            # compare alike); all use the ranks' mean, so that they split alike (a rank whose
            # forward fails raises here, the others a mismatch). The agreement carries no
            # values, so that its first round is the size of every other agreement's here: a
            # rank that failed before it, or was given no sample, meets it in its own (the
            # plan's, or the one telling its error), and every rank raises.
            nonlocal told
            seconds, failure = sample_seconds(model, sample, splits, others)
            fractions = np.array(seconds, np.float64) / (seconds[0] or 1.0)
            comm = _counting(wrap(group))  # the gathers of the plan's agreement
            try:
                agree(comm, {"sample timings": len(seconds)}, deadline(timeout), failure=failure)
                rows = comm.allgather_int64(fractions.view(np.int64), deadline(timeout))
            except BaseException:
                told = True
                raise
            return [float(x) for x in np.ascontiguousarray(rows).view(np.float64).mean(axis=0)]

    traced: dict[tuple[int, str], Traced | str] = {}  # read again for the modes below
    try:
        per_layer, splits, modes = _shares(
            model,
            value,
            argument,
            lambda: wrap(group).size,
            layers,
            multiple_of,
            avoid_gathers,
            empty_blocks,
            timed,
            loss_parallel,
            traced,
        )
    except (TypeError, ValueError) as e:
        if not told:  # a local error (before the timings, or after them on this rank alone)
            _tell_the_others(group, timeout, e)
        raise
    comm: Communicator = wrap(group)
    # Its own count of the bytes it sends (split_traffic), unless the caller counts them (a
    # plan's split stage, into Parallel.traffic()).
    owned = not isinstance(comm, CountingCommunicator)
    if owned:
        comm = CountingCommunicator(comm, {})
    named = dict(model.named_modules())
    in_splits = {n for ts, _ in splits for n in ts.layers()}
    chosen = list(per_layer)
    chained = [n for n in chosen if n not in in_splits]
    _, feeds, bns = plan_modes(model, chained, avoid_gathers, traced_cache=traced, ranks=comm.size)
    ties = vocabulary_ties(model) if loss_parallel else {}

    shared = [(n, tuple(model.get_parameter(n).shape)) for ts, _ in splits for n in ts.shared]
    _agree_on_plan(comm, chosen, modes, per_layer, shared, timeout)

    sums = GradientSums.of(comm, timeout)  # the whole parameters' gradients, summed per backward
    unsplit = list(model.parameters())
    before = {id(p): tuple(p.shape) for p in unsplit}
    home = weakref.ref(model)

    def held_whole() -> tuple[dict[int, tuple[str, nn.Parameter]], Callable[..., None]]:
        # The parameters the split left as they were (same tensor, same shape), once split.
        m = home()
        assert m is not None  # asked by its own forward
        whole = {
            id(p): (n, p) for n, p in m.named_parameters() if before.get(id(p)) == tuple(p.shape)
        }
        return whole, sums.add_once

    lora_rows: list[nn.Module] = []  # LoRA wrappers split as rows: their dropouts on slices
    for ts, counts in splits:
        if ts.kind == "experts":  # in place: the module keeps its class's forward and kernels
            units = [u * ts.width for u in counts]
            layout = experts_layout(named[ts.module])
            FilterParallelExperts.convert(named[ts.module], units, comm, timeout=timeout)
            for pn in ts.shared:  # the output bias the first rank adds
                sums.add(model.get_parameter(pn))
            for path, factor in ts.param_adapters.items():
                assert isinstance(layout, ExpertsLayout)  # the split found it so
                _split_param_adapters(named[path], factor, layout, units, comm, timeout)
            continue
        if ts.kind == "mha":
            mha = FilterParallelMultiheadAttention.from_module(
                named[ts.module],  # type: ignore[arg-type]
                counts,
                comm,
                timeout=timeout,
            )
            set_attribute(model, ts.module, mha)
            continue
        first_check = None
        if FirstForwardCheck.needed(ts, counts):  # a copy of it, before its split
            first_check = FirstForwardCheck(ts, named[ts.module], counts)
        copy = SharedCopy(comm, timeout, sole_holder(counts))
        upstream = {u: UpstreamCopy(comm, timeout, sole_holder(counts)) for u in ts.fed_by.values()}
        for u, output_copy in upstream.items():  # its output copied, read by the columns as is
            named[u].register_forward_hook(output_copy.output)
        for name, blocks in ts.columns:
            source = upstream[ts.fed_by[name]] if name in ts.fed_by else copy
            whole = ts.whole_features.get(name, ())
            if name not in ts.adapted:
                _split_column(model, name, counts, comm, blocks, whole, source, sums, timeout)
                continue
            # PEFT's LoRA wrapper: its base layer and each lora_B split along their outputs; each
            # lora_A whole (in ts.shared), reading the copy of the input the base layer reads.
            wrapper = named[name]
            _split_column(model, ts.base(name), counts, comm, blocks, whole, source, sums, timeout)
            as_is = ReadAsIs(comm, timeout, sole_holder(counts))
            for a, _ in wrapper.get_submodule("lora_B").named_children():
                _split_column(
                    model, f"{name}.lora_B.{a}", counts, comm, blocks, whole, as_is, sums, timeout
                )
                wrapper.get_submodule(f"lora_A.{a}").register_forward_pre_hook(source.read_copy)
        for name in ts.whole:  # whole on every rank, reading the columns' copy of the input
            named[name].register_forward_pre_hook(copy.read_copy)
        blocks_of = dict(ts.columns)
        for norm, column in ts.norms.items():  # over the column's whole output: split with it
            eps = rms_norm_eps(named[norm])
            assert eps is not None  # the plan found it so
            split_norm = FilterParallelRMSNorm.from_module(
                named[norm], eps, counts, comm, blocks=blocks_of[column], timeout=timeout
            )
            set_attribute(model, norm, split_norm)
        # A LoRA wrapper's base layer and each lora_A split along their inputs; its lora_B
        # whole on every rank, reading lora_A's output summed over the ranks.
        rows = [ts.row]
        if ts.row in ts.adapted:
            adapters = named[ts.row].get_submodule("lora_A").named_children()
            rows = [ts.base(ts.row), *(f"{ts.row}.lora_A.{a}" for a, _ in adapters)]
            lora_rows.append(named[ts.row])
        for name in rows:
            row = model.get_submodule(name)
            set_attribute(
                model,
                name,
                _linear_class(row).from_module(
                    row,
                    counts,
                    comm,
                    mode="split-input",
                    in_features_per_channel=ts.width,
                    timeout=timeout,
                ),
            )
        module = named[ts.module]
        ts.hold(module, counts[comm.rank])  # the rank's module runs with its own head counts
        for pn in ts.shared:
            sums.add(model.get_parameter(pn))
        if ts.kind == "attention":
            first = sum(counts[: comm.rank])
            PerHeadInputs(ts, first, counts[comm.rank], held_whole).install(module)
            for table in ts.tables:
                HeadColumns(ts, first, counts[comm.rank], table).install(named[table])
            if ts.head_params or ts.key_params:
                HeadParameters(ts, first, counts[comm.rank]).install(module)
            for name in ts.whole if ts.kv_groups else ():
                KeyValueOfHeads(ts, first, counts[comm.rank]).install(named[name])
        if first_check is not None:
            first_check.install(module)
        if ts.kind == "attention" and ts.packed() > 1:
            PackedLayoutGuard(ts, counts[comm.rank]).install(
                module, model.get_submodule(ts.columns[0][0])
            )
        if ts.kind == "attention" and counts[comm.rank] == 0:
            empty = EmptyHeads(ts.packed())  # entered after the guard's mode, left before it
            module.register_forward_pre_hook(empty.enter)
            module.register_forward_hook(empty.leave, always_call=True, prepend=True)
    for name in chosen:
        if name in in_splits:
            continue
        m = named[name]
        if isinstance(m, nn.Conv2d):
            new: nn.Module = FilterParallelConv2d.from_module(
                m, per_layer[name], comm, mode=modes[name], timeout=timeout
            )
        else:
            unit = feeds[name][1] if name in feeds else 1
            linear = _linear_class(m).from_module(
                m,
                per_layer[name],
                comm,
                mode=modes[name],
                in_features_per_channel=unit,
                timeout=timeout,
            )
            linear.split_output = loss_parallel and modes[name] == "gather"
            new = linear
            if name in ties:  # its token embedding, split by vocabulary alike, stays tied
                emb = ties[name]
                set_attribute(
                    model,
                    emb,
                    FilterParallelEmbedding.from_module(
                        named[emb], per_layer[name], comm, weight=linear.weight, timeout=timeout
                    ),
                )
        set_attribute(model, name, new)
    for name, src in bns.items():  # per channel: a BatchNorm; a depthwise or grouped conv
        m = named[name]
        split: nn.Module
        if isinstance(m, nn.Conv2d) and m.groups == m.in_channels:
            split = FilterParallelDepthwiseConv2d.from_module(m, per_layer[src], comm)
        elif isinstance(m, nn.Conv2d):  # per group of channels
            split = FilterParallelGroupedConv2d.from_module(m, per_layer[src], comm)
        elif isinstance(m, nn.BatchNorm2d):
            split = FilterParallelBatchNorm2d.from_module(m, per_layer[src], comm)
        else:
            split = FilterParallelBatchNorm1d.from_module(m, per_layer[src], comm)  # type: ignore[arg-type]
        set_attribute(model, name, split)
    # A LoRA head's base layer and adapters: their outputs summed split, gathered once after
    # the wrapper (or kept split through the loss).
    gathering = {n: modes[n] for n in chosen if n not in in_splits}
    pairs = summed_before_gathering(gathering, named).items()
    summed = [base for lora_b, base in pairs if _keep_split(model, lora_b, base)]
    if not loss_parallel:
        for path in dict.fromkeys(base.rsplit(".", 1)[0] for base in summed):
            model.get_submodule(path).register_forward_hook(_gather_whole)
    for path, wrapper in model.named_modules():  # DoRA beside each split base layer
        _split_dora(wrapper, comm, sums)
        _refuse_merging_apart(wrapper, path)
    stream = install_rank_streams(model, comm.rank)
    for wrapper in lora_rows:
        for dropout in wrapper.get_submodule("lora_dropout").children():  # on the rank's slice
            if stream is not None:
                dropout.register_forward_pre_hook(stream.enter_alone)
                dropout.register_forward_hook(stream.leave_alone, always_call=True)
    _agree_per_forward(model, comm, timeout, owned, stream)
    record_replaced(unsplit, model.parameters(), "filter_parallel")
    track_optimizers()
    guard_save_pretrained(model)
    return model


def _split_param_adapters(
    wrapper: nn.Module,
    factor: str,
    layout: ExpertsLayout,
    units: list[int],
    comm: Communicator,
    timeout: float | None,
) -> None:
    """PEFT's LoRA on a parameter of an experts module split by hidden units (``units`` per
    rank, as ``layout`` splits it): its ``factor`` holding the split dimension
    (:func:`~.chains.lora_on_experts`) holds this rank's rows of B or columns of A, as the
    parameter's slice, in a split layer whose weight PEFT reads. The other factor stays whole
    on every rank (among the split's shared parameters: its gradient summed)."""
    _, blocks = layout.params[str(getattr(wrapper, "parameter_name", ""))]
    held = wrapper.get_submodule(factor)
    assert isinstance(held, nn.ModuleDict)
    mode, blocks = ("split-output", blocks) if factor == "lora_B" else ("split-input", (1,))
    for a, layer in list(held.items()):
        held[a] = FilterParallelLinear.from_module(
            layer, units, comm, mode=mode, blocks=blocks, timeout=timeout
        )


def _keep_split(model: nn.Module, lora_b: str, base: str) -> bool:
    """Whether LoRA head layers ``lora_b`` and ``base`` (:func:`~.chains.summed_before_gathering`),
    each gathering along its last dimension, are split alike (the same shares): then both keep
    their outputs split (:class:`~.split_output.SplitOutput`), which the wrapper adds piece by
    piece (compiled, each gathers its own). Split apart (shares given apart), each gathers its
    own."""
    b, a = (model.get_submodule(n) for n in (lora_b, base))
    if not isinstance(a, FilterParallelLinear) or not isinstance(b, FilterParallelLinear):
        return False
    if a.dim != -1 or b.dim != -1 or list(a.shares) != list(b.shares):
        return False
    a.split_output = b.split_output = True
    return True


def _gather_whole(module: nn.Module, args: Any, out: Any) -> Any:
    """A forward hook: ``out`` whole where it is a :class:`~.split_output.SplitOutput`."""
    return out.whole() if isinstance(out, SplitOutput) else out


def _refuse_merging_apart(wrapper: nn.Module, path: str) -> None:
    """Make PEFT's ``merge`` of LoRA wrapper ``wrapper`` raise ``ValueError`` naming it where
    its layers are split alone, gathering (a head's): this rank's slice of ``B @ A`` then
    matches no slice of the base weight (PEFT met mismatched shapes). A wrapper split with its
    attention or MLP merges each rank's slices."""
    parts = [getattr(wrapper, "base_layer", None)]
    for name in ("lora_A", "lora_B"):
        held = getattr(wrapper, name, None)
        parts += list(held.values()) if isinstance(held, nn.ModuleDict) else []
    if not any(isinstance(p, FilterParallelLayer) and p.mode == "gather" for p in parts):
        return
    if not callable(getattr(type(wrapper), "merge", None)):
        return
    refused = functools.partial(_merge_refused, path=path)
    wrapper.merge = types.MethodType(refused, wrapper)  # type: ignore[assignment]


def _merge_refused(wrapper: nn.Module, *args: Any, path: str, **kwargs: Any) -> None:
    raise ValueError(
        f"merge: PEFT's LoRA wrapper {path!r} is split alone, its layers gathering their "
        "outputs each (filter_parallel), so this rank's slice of B @ A is no slice of its "
        "base weight; merge the adapters before splitting, or leave the wrapper's layers out "
        "of the split (layers=)"
    )


def _split_dora(wrapper: nn.Module, comm: Communicator, sums: GradientSums) -> None:
    """PEFT's DoRA layers of ``wrapper`` (a LoRA wrapper) where its base layer is split, split
    with it (:class:`~.dora.FilterParallelDoRA`): a column's magnitudes every rank holds whole
    (key and value rows packed with split query heads) have their gradients summed, as the
    base layer's rows."""
    layers = getattr(wrapper, "lora_magnitude_vector", None)
    base = getattr(wrapper, "base_layer", None)
    if not isinstance(layers, nn.ModuleDict) or not isinstance(base, FilterParallelLayer):
        return
    for a, layer in list(layers.items()):
        if not is_dora_layer(layer):
            continue
        split = FilterParallelDoRA.from_module(layer, base, comm)
        layers[a] = split
        if split.mode == "split-output" and split.whole:
            at = whole_positions(split.shares, comm.rank, split.blocks, split.whole)
            sums.add(split.weight, (0, at))


def _split_column(
    model: nn.Module,
    name: str,
    counts: list[int],
    comm: Communicator,
    blocks: tuple[int, ...],
    whole: tuple[int, ...],
    shared_input: SharedCopy,
    sums: GradientSums,
    timeout: float | None,
) -> None:
    """Layer ``name`` of ``model`` split along its outputs (a column of an attention or MLP
    split by heads or hidden units, ``counts`` units per rank), reading ``shared_input``; the
    rows every rank holds whole (``whole``) have their gradients summed (each rank's its
    heads' part)."""
    layer = model.get_submodule(name)
    column = _linear_class(layer).from_module(
        layer,
        counts,
        comm,
        mode="split-output",
        blocks=blocks,
        whole=whole,
        shared_input=shared_input,
        timeout=timeout,
    )
    set_attribute(model, name, column)
    if column.whole:
        at = whole_positions(counts, comm.rank, column.blocks, column.whole)
        sums.add(column.weight, (column.weight_out_dim, at))
        if column.bias is not None:
            sums.add(column.bias, (0, at))


def split_traffic(model: nn.Module) -> dict[str, int]:
    """Bytes this rank sent through the split layers of ``model``
    (:func:`filter_parallel`) in its last forward and what followed it (its backward), by
    kind, as :meth:`hetcoll.torch.Parallel.traffic` counts them: ``"activations"`` (the
    forward's agreement on its inputs, its sum-reductions and gathers), ``"gradients"`` (the
    backward's reductions of input gradients). A collective counts the ``2 (p-1)/p`` of its
    buffer a ring sends, an allgather ``p - 1`` copies of this rank's piece. A split stage of
    a plan counts into its ``Parallel.traffic()`` instead. Local.

    >>> split_traffic(model)  # doctest: +SKIP
    {'activations': 2101264, 'gradients': 2097152}
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: must be a torch.nn.Module, got {type(model).__name__}")
    comms = split_comms(model)
    if not comms:
        raise ValueError("model: has no split layers (split it with filter_parallel)")
    counting = [c for c in comms if isinstance(c, CountingCommunicator)]
    if not counting:
        raise ValueError(
            "model: its split layers were built one by one, not by filter_parallel, and count "
            "nothing; give them a hetcoll.torch.transport.CountingCommunicator to count"
        )
    counts: dict[str, int] = {"activations": 0, "gradients": 0}
    for comm in counting:
        for kind, n in comm.counts.items():
            counts[kind] = counts.get(kind, 0) + n
    return counts


#: Why the ranks' generators must agree (:func:`~.streams.unequal_generators`).
_GENERATORS = (
    "state in training, the model having dropout or a router's jitter (seed every rank alike, "
    "torch.manual_seed(s) with one s, or set them to 0: random draws on whole tensors must be "
    "the same on every rank)"
)


def _refuse_ddp_over_split(model: nn.Module, comm: Communicator) -> None:
    """Raise where DDP runs this forward of a split model over two ranks of its split (they
    hold parts of one model: DDP copied rank 0's over the others' at its start), or of one that
    holds parameters whole (their gradients summed over the split's ranks after the backward,
    :class:`GradientSums`): DDP would average those gradients before the sums are added, and
    write its average over them (the key and value projections of multi-query attention
    would not train). Every rank runs under DDP alike: every rank raises."""
    ddp = getattr(DistributedDataParallel, "_active_ddp_module", None)
    if ddp is None:
        return
    # DDP over ranks of one split (Accelerate's prepare does it): they hold parts of one
    # model, not replicas; DDP's start broadcast rank 0's parts over the others' already.
    shared = shared_processes(comm, wrap(ddp.process_group)) or []
    if len(shared) > 1:
        raise ValueError(
            f"model: DDP runs over ranks {shared} of one filter_parallel split, which hold "
            "parts of one model, not replicas (DDP copied rank 0's parts over the others' "
            "when it was made); train the split model without DDP (or Accelerate's "
            "prepare), and give DDP replicas over one rank of each split"
        )
    held = GradientSums.trained(comm)
    whole = [n for n, p in model.named_parameters() if id(p) in held]
    if whole:
        raise ValueError(
            f"model: DDP runs a split model whose {few_names(whole)} hold entries every rank "
            "of its split keeps whole, their gradients summed over those ranks once the "
            "backward ends; DDP averages them over its replicas before that, and writes its "
            "average over the sums. Average the replicas after the backward instead: "
            "hetcoll.allreduce of the gradients over the replicas' group"
        )


# Under torch.compile its hooks run as they are: an agreement between the ranks, no graph.
@never_traced_methods("before", "after")
class _AgreeOnInputs:
    """The split model's forward hooks: before each forward, one agreement that every rank
    passes inputs of the same shapes and dtypes, in the same mode (train or eval, gradients
    enabled or not; a mismatch raises
    :class:`hetcoll.CollectiveMismatchError` on every rank); during it, the layers' reductions
    skip their own checks (:class:`AgreedForward`). A split model cannot be deep-copied: its
    copy's hooks refuse, naming what to do instead."""

    def __init__(
        self,
        comm: Communicator,
        agreed: AgreedForward,
        timeout: float | None,
        owned: bool,
        draws: bool,
        stream: RankStream | None,
    ) -> None:
        self.comm, self.agreed, self.timeout, self.owned = comm, agreed, timeout, owned
        self.draws = draws  # the model has dropout: the ranks' generators are checked
        self.stream = stream
        self._cpu_draws: CpuDraws | None = None  # entered for this forward: ranks of kinds

    def __deepcopy__(self, memo: dict[int, Any]) -> _AgreeOnInputs:
        # A copy would exchange on the original's communicator and lose the hooks that sum
        # the gradients of the parameters held whole (a copy trained silently wrong: 0.8 off).
        raise TypeError(
            "model: a model split by filter_parallel cannot be deep-copied (copy.deepcopy, "
            "torch.optim.swa_utils.AveragedModel): for an average or a target network keep "
            "tensors beside the split parameters (torch._foreach_lerp_ of a list of "
            "p.detach().clone()), or split a copy of the unsplit model (gather_state_dict "
            "into it, then filter_parallel)"
        )

    def before(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if not self.agreed.active:  # the outermost call: a nested one is agreed already
            if module.training and torch.is_grad_enabled():
                _refuse_ddp_over_split(module, self.comm)
            if self.owned and isinstance(self.comm, CountingCommunicator):
                self.comm.counts.clear()  # split_traffic: this forward and its backward
            CountingCommunicator.count_as(self.comm, "activations")
            shapes = [
                (tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else type(t).__name__
                for t in pytree.tree_leaves((args, kwargs))
            ]
            # Every rank runs each forward alike: a rank evaluating (eval(), no_grad) while the
            # others train would pair its exchanges with theirs, its split BatchNorm's channels
            # then normalised by the others' batch statistics, without a word.
            fields = {
                "the split model's inputs (shapes and dtypes)": zlib.crc32(repr(shapes).encode()),
                "the split model's mode (1: train(), 0: eval())": int(module.training),
                "gradients (1: enabled, 0: no_grad or inference_mode)": int(
                    torch.is_grad_enabled()
                ),
            }
            # The generators' states where the model has dropout (every rank's model alike,
            # checked at filter_parallel): as many values on every rank.
            states = generator_states(module) if self.draws else []
            got = agree(self.comm, fields, deadline(self.timeout), values=states)
            if self.draws and module.training:
                # Dropout on whole tensors must draw the same masks on every rank, or the
                # ranks' copies of them drift apart: the generators must agree; ranks on
                # several kinds of device draw on the CPU.
                mixed, unequal = unequal_generators(got)
                if unequal is not None:
                    listed = ", ".join(
                        f"rank {q}: {int(row[2 - mixed])}" for q, row in enumerate(got)
                    )
                    raise CollectiveMismatchError(
                        f"ranks disagree on {unequal} {_GENERATORS} ({listed})"
                    )
                if mixed:
                    self._cpu_draws = CpuDraws(self.stream)
                    self._cpu_draws.__enter__()
        self.agreed.depth += 1

    def after(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        self.agreed.depth = max(self.agreed.depth - 1, 0)
        if self.agreed.depth == 0 and self._cpu_draws is not None:
            draws, self._cpu_draws = self._cpu_draws, None
            draws.__exit__(None, None, None)


def _agree_per_forward(
    model: nn.Module,
    comm: Communicator,
    timeout: float | None,
    owned: bool,
    stream: RankStream | None = None,
) -> None:
    """One agreement per forward of ``model`` instead of one per reduction of its split
    layers (:class:`_AgreeOnInputs`; ``owned``: the counts of ``comm`` are the model's own,
    restarted by each forward)."""
    agreed = AgreedForward()
    found = False
    for m in model.modules():
        if isinstance(m, ChannelSplit):
            m.agreed, found = agreed, True
            shared = getattr(m, "shared_input", None)
            if isinstance(shared, SharedCopy):
                shared.agreed = agreed
    if not found:
        return
    model.register_forward_pre_hook(agreed.note_compiled)
    if comm.size == 1:
        return
    hooks = _AgreeOnInputs(comm, agreed, timeout, owned, draws_random(model), stream)
    model.register_forward_pre_hook(hooks.before, with_kwargs=True)
    model.register_forward_hook(hooks.after, with_kwargs=True, always_call=True)


def _agree_on_plan(
    comm: Communicator,
    chosen: list[str],
    modes: dict[str, str],
    shares: dict[str, list[int]],
    shared: list[tuple[str, tuple[int, ...]]],
    timeout: float | None,
) -> None:
    # One fingerprint of the whole plan: ranks that disagree anywhere raise on every rank
    # (``shared``: the parameters whose gradients are summed over the ranks, and their shapes).
    plan = [(n, modes[n], shares[n]) for n in chosen]
    fingerprint = zlib.crc32(repr((plan, shared) if shared else plan).encode())
    what = "filter_parallel's layers, modes and shares (same model and arguments needed)"
    agree(comm, {what: fingerprint}, deadline(timeout))


def _linear_class(m: nn.Module) -> Any:
    return FilterParallelConv1D if is_conv1d(m) else FilterParallelLinear
