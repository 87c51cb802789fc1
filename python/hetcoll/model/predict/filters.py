"""Filter parallelism: the layers' modes (:func:`filter_modes`), the laid-out step
(:class:`FilterParallelSchedule`), its prediction, a transformer's split balanced by predicted
time (:func:`time_balanced_shares`) and a filter-split stage's split (:func:`stage_split`).
Its collectives and a transformer's blocks split by heads are :mod:`.splits`'."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import hetcoll
from hetcoll.model import terms
from hetcoll.model.costs import ModelCosts, split_input_partners
from hetcoll.model.hardware import Cluster
from hetcoll.model.predict.prediction import Prediction
from hetcoll.model.predict.splits import (
    SplitCollectives,
    block_spans,
    block_units,
    blocks_stage_split,
    split_blocks,
)
from hetcoll.model.predict.timing import (
    LayerSeconds,
    _layer_times,
    check_costs_and_cluster,
    device_arrays,
    memory_shortfall,
)
from hetcoll.plan import Plan
from hetcoll.torch.filters import groups_for_every_rank, summed_before_gathering

FILTER_MODES = ("gather", "split-output", "split-input")


def filter_modes(costs: ModelCosts, *, avoid_gathers: bool = True) -> dict[str, str]:
    """The mode of every layer :func:`hetcoll.torch.filter_parallel` splits (name -> "gather",
    "split-output" or "split-input"), as its own pairing rule
    (:func:`hetcoll.torch.filters.filter_modes`) chose them when the costs were read off
    the model: a Conv2d / Linear layer feeding the next one through channel-wise modules only
    (inside an ``nn.Sequential``) becomes split-output, the next split-input (no gather between
    them; the pair's partial sums are allreduced once); every other split layer gathers.
    ``avoid_gathers=False`` gathers after every split layer (mixtures of experts, which no
    gather splits, stay whole then, as the runtime leaves them). Layers absent stay replicated.

    >>> from hetcoll.model import layer_costs, networks
    >>> filter_modes(layer_costs(networks.mlp((8,)), (8,)))
    {'1': 'split-output', '3': 'split-input', '5': 'gather'}
    """
    modes = dict(costs.filter_modes)
    if avoid_gathers:
        return modes
    experts = {b.module for b in costs.split_blocks if b.kind == "experts"}
    # A LoRA wrapper (SplitBlock.costed) gathers as the runtime splits it then: its base layer
    # and each adapter, every one a layer of its own.
    splits = {x.name for x in costs.layers if x.filters > 0}
    inside: dict[str, list[str]] = {}
    for b in costs.split_blocks:
        for n, c in zip(b.layers, b.costed, strict=False):
            inside[n] = [c, *(w for w in b.whole if w.startswith(f"{n}.") and w in splits)]
    return {c: "gather" for n in modes if n not in experts for c in inside.get(n, [n])}


def _dora_gathers(
    costs: ModelCosts, modes: Mapping[str, str]
) -> dict[int, tuple[int, list[list[int]], int]]:
    """Each gathering base layer of PEFT's DoRA wrapper (by index): its DoRA adapters (a
    ``<wrapper>.lora_magnitude_vector.<adapter>`` layer each), the records of each of their
    ``lora_A`` that gathers too (by index: PEFT calls it twice), and how many of them drop
    their input in training (a ``<wrapper>.lora_dropout.<adapter>`` layer of its own, not
    PEFT's ``Identity``)."""
    kinds = {x.name: x.kind for x in costs.layers}
    out = {}
    for i, x in enumerate(costs.layers):
        if modes.get(x.name) != "gather" or not x.name.endswith(".base_layer"):
            continue
        wrapper = x.name[: -len(".base_layer")]
        prefix = f"{wrapper}.lora_magnitude_vector."
        adapters = [n[len(prefix) :] for n in kinds if n.startswith(prefix)]
        if not adapters:
            continue
        weights = [
            [k for k, y in enumerate(costs.layers) if y.name == f"{wrapper}.lora_A.{a}"]
            for a in adapters
            if modes.get(f"{wrapper}.lora_A.{a}") == "gather"
        ]
        dropped = sum(
            kinds.get(f"{wrapper}.lora_dropout.{a}") not in (None, "Identity") for a in adapters
        )
        out[i] = (len(adapters), weights, dropped)
    return out


def _check_modes(costs: ModelCosts, modes: Mapping[str, str]) -> dict[str, str]:
    if not isinstance(modes, Mapping):
        raise TypeError(f"modes: must be a dict of layer name -> mode, got {type(modes).__name__}")
    by_name = {x.name: x for x in costs.layers}
    in_blocks = {n for b in costs.split_blocks for n in b.layers}
    out = {}
    for name, mode in modes.items():
        if name not in in_blocks and (name not in by_name or by_name[name].filters <= 0):
            raise ValueError(f"modes: {name!r} is not a layer with filters to split")
        if mode not in FILTER_MODES:
            raise ValueError(f"modes: {name!r} has mode {mode!r}; expected one of {FILTER_MODES}")
        out[name] = mode
    return out


@dataclass(frozen=True)
class FilterParallelSchedule:
    """One filter-parallel step laid out, before its devices are timed against each other:
    what :func:`filter_parallel` predicts from (:func:`filter_parallel_schedule` builds it,
    :meth:`prediction` times it). Public so that a step can be changed and timed again (slower
    layers on some devices: ``layers.scaled``); the lab predicts its emulated runs this way
    (:mod:`hetcoll.lab.predict_emulated`).

    ``layers``: per layer and device, each device on its share of the split layers;
    ``split``: per layer, True where the layer's filters are split; ``forward_collective_s`` /
    ``backward_collective_s``: per layer, the collective after its forward / backward (0:
    none); ``update_s``: each device's optimizer step on the parameters it holds; the rest as
    in :class:`Prediction` (``detail``: the modes, shares per layer and number of
    collectives).
    """

    strategy: str
    batch: int
    layers: LayerSeconds
    split: np.ndarray
    forward_collective_s: np.ndarray
    backward_collective_s: np.ndarray
    update_s: np.ndarray
    shares: list[int]
    share_unit: str
    memory_bytes: np.ndarray
    reason: str
    detail: dict[str, Any]

    def order(self) -> list[tuple[int, bool]]:
        """The step's pieces in the order they run: ``(layer, True)`` for every layer's
        forward, first to last, then ``(layer, False)`` for the backwards, last to first."""
        n = len(self.split)
        return [(i, True) for i in range(n)] + [(i, False) for i in range(n)][::-1]

    def prediction(self) -> Prediction:
        """The step in lock step: each stretch between two collectives takes its slowest
        device, then the collective; the last stretch ends with the optimizer."""
        fwd, bwd = self.layers.forward_s, self.layers.backward_s
        fwd_comm, bwd_comm, opt = (
            self.forward_collective_s,
            self.backward_collective_s,
            self.update_s,
        )
        step, stretch = 0.0, np.zeros(len(opt))
        for i, forward in self.order():
            stretch = stretch + (fwd if forward else bwd)[i]
            comm_s = (fwd_comm if forward else bwd_comm)[i]
            if comm_s > 0:
                step += float(stretch.max() + comm_s)
                stretch = np.zeros(len(opt))
        step = float(step + (stretch + opt).max())
        comm = float(fwd_comm.sum() + bwd_comm.sum())
        # Causes on the critical path: each layer's slowest device, scaled to the stretches' total.
        lt = self.layers
        crit = np.argmax(fwd + bwd, axis=1)
        rows = np.arange(len(self.split))
        parts_s = {
            "compute": lt.compute_s[rows, crit],
            "memory": lt.memory_s[rows, crit],
            "overhead": lt.overhead_s[rows, crit],
        }
        busy = sum(float(v.sum()) for v in parts_s.values())
        layers_s = step - comm - float(opt.max())
        scale = layers_s / busy if busy > 0 else 0.0
        breakdown = {k: float(v.sum()) * scale for k, v in parts_s.items()}
        breakdown["communication"] = comm
        breakdown["optimizer"] = float(opt.max())
        return Prediction(
            self.strategy,
            self.shares,
            self.share_unit,
            step,
            breakdown,
            [float(x) for x in self.memory_bytes],
            not self.reason,
            self.reason,
            self.batch,
            {**self.detail, "critical_device": int(np.argmax((fwd + bwd).sum(axis=0) + opt))},
        )


def filter_parallel_schedule(
    costs: ModelCosts,
    cluster: Cluster,
    batch: int,
    parts: Sequence[float],
    *,
    modes: Mapping[str, str] | None = None,
    optimizer_state_copies: int = 1,
    strategy: str = "filter parallel",
    layer_shares: Mapping[str, Sequence[int]] | None = None,
    empty_blocks: bool = False,
    loss_parallel: bool = False,
) -> FilterParallelSchedule:
    """The step :func:`filter_parallel` predicts, laid out (arguments as there; ``layer_shares``:
    the channels per device of the layers named, the others split by ``parts``).

    >>> filter_parallel_schedule(costs, cluster, 64, [1.0, 0.5]).split  # doctest: +SKIP
    """
    check_costs_and_cluster(costs, cluster)
    devices = cluster.devices
    n_dev = len(devices)
    if len(parts) != n_dev or any(not (float(x) > 0) for x in parts):
        raise ValueError(f"parts: expected {n_dev} positive numbers (one per device)")
    terms.batch_argument(batch)
    layer_modes = filter_modes(costs) if modes is None else _check_modes(costs, modes)
    names = {x.name: i for i, x in enumerate(costs.layers)}
    # With loss_parallel a head tied to its token embedding splits by vocabulary like an
    # untied one, its embedding by rows alike (when both are in these layers).
    tied = {
        names[emb]: names[head]
        for head, emb in costs.vocabulary_ties
        if loss_parallel and head in names and emb in names and head not in layer_modes
    }
    layer_modes.update({costs.layers[h].name: "gather" for h in tied.values()})
    if n_dev == 1:
        layer_modes = {}
        tied = {}
    dev = device_arrays(devices)
    n_layers = len(costs.layers)
    phi = np.ones((n_layers, n_dev))  # each device's fraction of the layer's kernels' filters
    chan = np.ones((n_layers, n_dev))  # fraction of the channels a replicated layer runs on
    unbatched = np.ones((n_layers, n_dev))  # fraction of a layer's work whatever the batch
    filters_of: dict[int, list[int]] = {}
    split_as: dict[int, str] = {}  # the layer the runtime splits, where not the costed one
    source: tuple[int, np.ndarray] | None = None  # the open split-output layer, its fractions
    speeds = [float(x) for x in parts]
    splits: dict[tuple[int, int], list[int]] = {}  # layers of equal filters split alike
    # Pairs around a grouped convolution split in whole groups; one of fewer groups than the
    # devices needs the full tensor, as the runtime keeps it: the pair around it gathers.
    grouped = dict(costs.filter_units)
    partners = split_input_partners(layer_modes)
    for src, unit in list(grouped.items()):
        fits = groups_for_every_rank(costs.layers[names[src]].filters, unit, n_dev)
        if src in partners and not fits:
            layer_modes[src] = layer_modes[partners[src]] = "gather"
            del grouped[src]
    # The attentions and MLPs split by heads and hidden units (every layer of theirs in the
    # modes): each costed layer inside runs on a device's fraction of the units.
    blocks = [
        b.resolved(speeds, empty=empty_blocks, shares=layer_shares)
        for b in split_blocks(costs, layer_modes)
    ]
    unit_shares = [block_units(b, speeds, empty_blocks, layer_shares) for b in blocks]
    block_of = block_spans(costs, blocks)
    for i, layer in enumerate(costs.layers):
        mode = layer_modes.get(layer.name)
        if i in block_of:
            block, units = blocks[block_of[i]], unit_shares[block_of[i]]
            fraction = np.asarray(units, dtype=np.float64) / block.units
            k = block.layer_at(layer.name)
            if layer.filters > 0 and k is not None:
                split_as[i] = block.layers[k]  # a LoRA wrapper's, for its base layer
                filters_of[i] = block.layer_shares(units)[block.layers[k]]
                phi[i, :] = fraction
                if block.whole_features and block.whole_features[k]:
                    # The features every device computes beside its units' (Falcon-7B's key
                    # and value rows packed with its query heads).
                    fixed = block.whole_features[k]
                    per = np.asarray(units, dtype=np.float64) * block.per_unit[k]
                    phi[i, :] = (per + fixed) / (block.units * block.per_unit[k] + fixed)
            elif layer.name in block.whole:
                # Whole on every device (multi-query key and value, a column's lora_A), but
                # the adapters split with their layer, and DoRA's work on its weight: on the
                # device's share.
                if layer.name in block.split_adapters:
                    phi[i, :] = fraction
                if layer.name in block.dora_work:
                    unbatched[i, :] = fraction
            else:
                chan[i, :] = fraction  # the module's own ops, its activations: per unit
                if block.kind == "experts" and layer.name == block.module:
                    # Each device holds its hidden units of every expert.
                    filters_of[i] = block.layer_shares(units)[layer.name]
                    phi[i, :] = fraction
            continue
        if mode == "split-input":
            if source is None:
                raise ValueError(f"modes: split-input layer {layer.name!r} follows no split-output")
            filters_of[i] = filters_of[source[0]]
            phi[i, :] = source[1]
            source = None
        elif mode is not None and layer.filters > 0:
            # (A call of the layer without outputs of its own, as PEFT's DoRA runs its
            # adapters on an identity matrix for B A, which the split computes from the
            # weights instead, stays as it is.)
            if layer_shares is not None and layer.name in layer_shares:
                f = [int(x) for x in layer_shares[layer.name]]
                if len(f) != n_dev or sum(f) != layer.filters or min(f) < 0:
                    raise ValueError(
                        f"layer_shares: {layer.name!r} needs {n_dev} shares summing to "
                        f"{layer.filters}, got {f}"
                    )
            else:
                unit = grouped.get(layer.name, 1)  # whole groups of a grouped convolution
                if (layer.filters, unit) not in splits:
                    splits[layer.filters, unit] = _by_speed(layer.filters, speeds, unit)
                f = list(splits[layer.filters, unit])
            filters_of[i] = f
            phi[i, :] = np.asarray(f, dtype=np.float64) / layer.filters
            source = (i, phi[i].copy()) if mode == "split-output" else None
        elif source is not None:
            chan[i, :] = source[1]
    # The layer whose output is the model's (the last with filters): with loss_parallel its
    # output is not gathered, and the loss runs on each device's slice of the vocabulary.
    output = max((i for i, x in enumerate(costs.layers) if x.filters > 0), default=-1)
    loss = costs.loss_layer
    split_loss = (
        loss_parallel
        and output in filters_of
        and layer_modes.get(costs.layers[output].name) == "gather"
    )
    if split_loss and loss is not None:
        chan[loss, :] = phi[output]
    # A replicated layer between a pair runs on the channel slice: as many fewer samples' worth
    # of element-wise work (these kernels are linear in the batch and own no filters).
    by_input = np.array([layer_modes.get(x.name) == "split-input" for x in costs.layers])
    lt = _layer_times(costs, dev, np.full(n_dev, batch), phi, chan, by_input, unbatched)
    split_rows = np.zeros(n_layers, dtype=bool)
    split_rows[list(filters_of)] = True
    split_rows[list(block_of)] = True
    link = cluster.ring_link()
    sums = SplitCollectives(costs, cluster)
    allreduce_s, copy_s = sums.allreduce_s, sums.copy_s
    fwd_comm = np.zeros(n_layers)  # after the layer's forward
    bwd_comm = np.zeros(n_layers)  # after the layer's backward
    for k in range(len(blocks)):
        rows = [i for i, b in block_of.items() if b == k]
        if rows:
            alone = sum(1 for u in unit_shares[k] if u > 0) == 1
            fwd_comm[max(rows)], bwd_comm[min(rows)] = sums.block_sums_s(
                batch, rows, alone, blocks[k]
            )
    # A LoRA head's lora_B added to its base layer's output split, the sum gathered once (or
    # kept split through the loss: then neither gathers).
    index = {x.name: i for i, x in enumerate(costs.layers)}
    pairs = summed_before_gathering(layer_modes, list(index)).items()
    summed = {
        index[b]: index[a]
        for b, a in pairs
        if index[b] in filters_of and filters_of[index[b]] == filters_of.get(index[a])
    }
    ungathered = set(summed)  # the lora_B layers; their base layers too where kept split
    if split_loss and output in summed:
        ungathered.add(summed[output])

    def gather_s(out: float, largest_fraction: float) -> float:
        # The channel dimension moves to the front of the local piece and back in the full
        # output (two copies), and the engine's allgatherv takes a contiguous send buffer
        # (on gloo, all_to_all_single: the piece once per rank).
        largest = largest_fraction * out
        return float(
            terms.ring_allgatherv_seconds(
                largest, n_dev, link.latency_s, link.bytes_per_s, link.call_of("hetcoll_allgatherv")
            )
        ) + copy_s((1 + n_dev) * largest + out)

    for i in filters_of:
        if i in block_of:
            continue
        layer, mode = costs.layers[i], layer_modes[costs.layers[i].name]
        # Every allreduce works on a copy of its tensor (the layers keep autograd's intact).
        if mode == "split-input":
            out = layer.out_bytes_per_sample * batch
            fwd_comm[i] = allreduce_s(out) + copy_s(out)
            continue
        if split_loss and i == output:
            # The model's output stays split through the loss (SplitOutput): the split
            # cross-entropy's agreement on its rows (one latency each way) and its allgather
            # of three numbers per row from every device, instead of the logits' gather.
            stats = 3.0 * layer.out_bytes_per_sample * batch / max(layer.filters, 1)
            fwd_comm[i] = (
                2.0 * link.latency_s
                + link.call_of("allgather")
                + float(
                    terms.ring_allgatherv_seconds(
                        stats, n_dev, link.latency_s, link.bytes_per_s, link.call_of("allgather")
                    )
                )
            )
        elif mode == "gather" and i not in ungathered:
            fwd_comm[i] = gather_s(layer.out_bytes_per_sample * batch, float(phi[i].max()))
        if any(k.name == "gemm-dX" for k in layer.backward):
            grad = layer.in_bytes_per_sample * batch
            bwd_comm[i] = allreduce_s(grad) + copy_s(grad)
    # A DoRA layer beside a gathering base layer (a head's) gathers its norms each forward (a
    # number per output feature) and its lora_A's weight where that gathers too (to compute
    # B A), whatever the batch; its dropout active, the base output it recomputes on the
    # dropped input.
    for i, (norms, weights, dropped) in _dora_gathers(costs, layer_modes).items():
        if i in filters_of and i not in block_of:
            layer, most = costs.layers[i], float(phi[i].max())
            fwd_comm[i] += norms * gather_s(layer.filters * costs.itemsize, most)
            for records in weights:  # a lora_A's records: its weight's, its split's
                split = [k for k in records if k in filters_of]
                if split:
                    nbytes = sum(costs.layers[k].param_bytes for k in records)
                    fwd_comm[i] += gather_s(nbytes, float(phi[split[0]].max()))
            fwd_comm[i] += dropped * gather_s(layer.out_bytes_per_sample * batch, most)
    for emb, head in tied.items():
        # Each device looks up the tokens of its rows (zeros for the others), one sum gives
        # every device the whole lookup; it owns its rows of the tied weight.
        out = costs.layers[emb].out_bytes_per_sample * batch
        fwd_comm[emb] = allreduce_s(out) + copy_s(out)
        phi[emb, :] = phi[head]
    # phi is 1 for replicated layers: each device owns its filters' weights and all the rest.
    owned = (np.array([x.param_bytes for x in costs.layers])[:, None] * phi).sum(axis=0)
    trained = (np.array([x.gradient_bytes for x in costs.layers])[:, None] * phi).sum(axis=0)
    opt = np.asarray(
        terms.step_update_seconds(
            trained, dev.mem_bytes_per_s, optimizer_state_copies, dev.step_overhead_s
        )
    )
    mem = np.asarray(terms.training_state_bytes(owned, trained, optimizer_state_copies))
    mem = mem + batch * costs.saved_bytes_per_sample()
    if not filters_of and not block_of and n_dev > 1:
        reason = "the model has no conv or linear layer to split"
    else:
        reason = memory_shortfall(mem, devices)
    widest = max(filters_of, key=lambda i: costs.layers[i].filters) if filters_of else None

    def name(i: int) -> str:
        return split_as.get(i, costs.layers[i].name)

    return FilterParallelSchedule(
        strategy,
        batch,
        lt,
        split_rows,
        fwd_comm,
        bwd_comm,
        opt,
        filters_of[widest] if widest is not None else [0] * n_dev,
        f"filters of {name(widest)}" if widest is not None else "filters",
        mem,
        reason,
        {
            "split_layers": len(filters_of),
            "modes": {name(i): layer_modes[name(i)] for i in filters_of},
            "collectives": int((fwd_comm > 0).sum() + (bwd_comm > 0).sum()),
            "shares_per_layer": {name(i): filters_of[i] for i in filters_of},
            "units_per_block": {b.module: u for b, u in zip(blocks, unit_shares, strict=True)},
        },
    )


def time_balanced_shares(
    costs: ModelCosts,
    cluster: Cluster,
    batch: int,
    parts: Sequence[float],
    *,
    modes: Mapping[str, str] | None = None,
    empty_blocks: bool = True,
    layers: tuple[int, int] | None = None,
) -> dict[str, list[int]]:
    """A transformer's split balanced by predicted time, by module path (what a plan's split
    stage takes as ``shares``, :func:`hetcoll.torch.filters.filter_shares`' form): the model's
    counterpart of ``filter_parallel(sample=...)``. Every device repeats the work outside the
    attentions and MLPs (norms, embeddings, residual adds) at its own speed; that work, an equal
    part before each block's reduction, is :func:`hetcoll.split`'s ``latency`` for the block's
    units, each device's time per unit its own block time. The other split layers (a gathering
    LM head) split by ``parts``, as by speed. ``empty_blocks``: a device may hold no units.
    ``layers``: a stage's plan layers ``(first, end)``, its own work alone (default: the whole
    model; ``modes`` then default to the stage's).

    >>> time_balanced_shares(costs, cluster, 32, [1.0, 0.25])  # doctest: +SKIP
    {'model.layers.0.self_attn.q_proj': [64, 0], ...}
    """
    lo, hi = (0, len(costs.layers)) if layers is None else costs.plan_range(*layers)
    if modes is None:
        layer_modes = filter_modes(costs) if layers is None else costs.stage_filter_modes(*layers)
    else:
        layer_modes = _check_modes(costs, modes)
    n_dev = cluster.num_devices
    if len(parts) != n_dev or any(not (float(x) > 0) for x in parts):
        raise ValueError(f"parts: expected {n_dev} positive numbers (one per device)")
    blocks = [b.resolved(parts, empty=empty_blocks) for b in split_blocks(costs, layer_modes)]
    if not blocks:
        raise ValueError(
            "costs: the model has no attention or MLP split by heads or hidden units to balance"
        )
    span = block_spans(costs, blocks)
    sums = SplitCollectives(costs, cluster)
    lt = _layer_times(costs, device_arrays(cluster.devices), np.full(n_dev, batch))
    seconds = lt.forward_s + lt.backward_s  # each layer whole, on each device
    in_blocks = {n for b in blocks for n in b.layers}
    others = [x.name in layer_modes and x.name not in in_blocks for x in costs.layers]
    # Multi-query attention's key and value projections run whole on every device, as the
    # work around the blocks does.
    whole = {n for b in blocks for n in b.whole}
    repeated = np.array(
        [
            lo <= i < hi and (x.name in whole or not (i in span or others[i]))
            for i, x in enumerate(costs.layers)
        ],
        dtype=bool,
    )
    latency = seconds[repeated].sum(axis=0) / len(blocks)
    by_name = {x.name: x for x in costs.layers}
    out: dict[str, list[int]] = {}
    units_of: dict[str, list[int]] = {}
    for k, b in enumerate(blocks):
        if b.heads_with in units_of:  # handed inputs per head: its heads as that attention's
            units_of[b.module] = units_of[b.heads_with]
            out.update(b.layer_shares(units_of[b.module]))
            continue
        rows = [i for i, kk in span.items() if kk == k]
        per_feature = seconds[[i for i in rows if not repeated[i]]].sum(axis=0) / (
            b.units * b.width
        )
        empty = empty_blocks and b.empty
        if not (per_feature > 0).all():
            units = b.shares(parts, empty=empty)
        else:
            features = hetcoll.split(
                b.units * b.width,
                [float(1.0 / t) for t in per_feature],
                multiple_of=b.width,
                minimum=0 if empty else b.width,
                latency=[float(x) for x in latency],
            )
            units = [f // b.width for f in features]
            if empty and sum(1 for u in units if u > 0) > 1:
                # The whole block on the device that finishes it first, broadcast, against
                # the split and its allreduce: the better of the two.
                total = latency + per_feature * b.units * b.width
                split_s = float(np.max(latency + per_feature * np.asarray(features))) + sum(
                    sums.block_sums_s(batch, rows, False, b)
                )
                alone_s = float(total.min()) + sum(sums.block_sums_s(batch, rows, True, b))
                if alone_s < split_s:
                    units = [b.units if d == int(total.argmin()) else 0 for d in range(n_dev)]
        units_of[b.module] = units
        out.update(b.layer_shares(units))
    partners = split_input_partners(layer_modes)
    unit_of = dict(costs.filter_units)
    for name, mode in layer_modes.items():
        if name not in in_blocks and name not in whole and mode != "split-input":
            unit = unit_of.get(name, 1)
            out[name] = _by_speed(by_name[name].filters, [float(x) for x in parts], unit)
            # Its split-input partner (the pairing rule's: T5's MLP) reads those channels:
            # named with the same shares, as the runtime pairs them only when both are named.
            if name in partners:
                out[partners[name]] = list(out[name])
    return out


def _by_speed(filters: int, speeds: list[float], unit: int = 1) -> list[int]:
    """A layer's channels split in proportion to ``speeds`` (:func:`hetcoll.split`), in
    multiples of ``unit`` channels (a grouped convolution's groups it feeds), at least one
    unit each where there are enough, as the runtime splits it."""
    units = filters // unit
    return [
        u * unit for u in hetcoll.split(units, speeds, minimum=1 if units >= len(speeds) else 0)
    ]


def filter_parallel(
    costs: ModelCosts,
    cluster: Cluster,
    batch: int,
    parts: Sequence[float],
    *,
    modes: Mapping[str, str] | None = None,
    optimizer_state_copies: int = 1,
    strategy: str = "filter parallel",
    empty_blocks: bool = False,
    balance: str = "speed",
    loss_parallel: bool = False,
) -> Prediction:
    """One filter-parallel step on the whole ``batch``, as :func:`hetcoll.torch.filter_parallel`
    runs it. Each split layer (``modes``, default :func:`filter_modes`) divides its F filters
    over the devices by :func:`hetcoll.split` in proportion to ``parts`` (speeds or weights, one
    per device; at least one filter each); a split-input layer takes the shares of the
    split-output layer before it, and the channel-wise layers between them run on those shares
    too. Every other layer is replicated. Communication per layer and mode:

    - gather: the output pieces are gathered (allgatherv, forward);
    - gather, split-output: the partial input gradients are summed (allreduce, backward) when
      the layer has an input gradient;
    - split-input: the partial outputs are summed (allreduce, forward);
    - an attention split by heads or an MLP by hidden units (``costs.split_blocks``): every
      layer inside runs on the device's share of the units, its output is summed once
      forward and its input's gradient once backward (broadcast where one device holds
      every unit: ``empty_blocks``, as the runtime's, lets a device hold none).

    Ranks run in lock step between collectives: each stretch between two collectives takes its
    slowest device. No gradient allreduce: each device owns its filters, and replicated layers
    see the same full data everywhere. (:func:`filter_parallel_schedule` gives the step before
    it is timed.)

    ``loss_parallel``: the layer whose output is the model's (a language model's head), when
    it gathers, keeps its output split through the loss as the runtime's ``loss_parallel``
    does: its gather becomes the split cross-entropy's exchange of three numbers per row.
    (A head tied to its embedding is priced replicated, as without the option.)

    ``balance="time"`` (a transformer): its attentions and MLPs split by predicted time, the
    work every device repeats around them counted (:func:`time_balanced_shares`, a device
    holding none of a block where that is faster), not in proportion to ``parts``.

    Its plan (:meth:`Prediction.to_plan`) is one replica of one stage over every device, split
    by ``parts`` (by time: by those shares, per module path), when the runtime splits the same
    way (every split layer has at least one channel per device, and the modes are those of
    such a stage).

    >>> filter_parallel(costs, cluster, 64, [1.0, 0.5]).step_s  # doctest: +SKIP
    """
    check_costs_and_cluster(costs, cluster)
    if balance not in ("speed", "time"):
        raise ValueError(f"balance: must be 'speed' or 'time', got {balance!r}")
    used = filter_modes(costs) if modes is None else _check_modes(costs, modes)
    named = None
    if balance == "time":
        named = time_balanced_shares(costs, cluster, batch, parts, modes=used)
        empty_blocks = any(0 in v for v in named.values())  # the plan says so where needed
    pred = filter_parallel_schedule(
        costs,
        cluster,
        batch,
        parts,
        modes=used,
        optimizer_state_copies=optimizer_state_copies,
        strategy=strategy,
        empty_blocks=empty_blocks,
        layer_shares=named,
        loss_parallel=loss_parallel,
    ).prediction()
    try:
        pred.plan = _filter_parallel_plan(
            costs, batch, parts, used, empty_blocks, named, loss_parallel
        )
    except ValueError as e:
        pred.plan_note = str(e)
    return pred


def _filter_parallel_plan(
    costs: ModelCosts,
    batch: int,
    parts: Sequence[float],
    modes: Mapping[str, str],
    empty_blocks: bool = False,
    named: Mapping[str, Sequence[int]] | None = None,
    loss_parallel: bool = False,
) -> Plan:
    """One replica: one stage over every device, split by ``parts`` as the runtime would (or
    by ``named`` shares, by module path; ``loss_parallel`` as the stage's)."""
    costs.check_plan_layers()
    n, p = len(costs.plan_layers), len(parts)
    stage: dict[str, Any] = {"ranks": list(range(p)), "layers": [0, n]}
    if p > 1:
        if dict(modes) != costs.stage_filter_modes(0, n):
            raise ValueError(
                "the runtime pairs this model's layers differently in a stage (give modes="
                "costs.stage_filter_modes(0, len(costs.plan_layers)))"
            )
        empty = empty_blocks and costs.plan_cut == "blocks"
        stage_split(costs, 0, n, p, None, "filter parallel", empty, named)
        if named is not None:
            stage["shares"] = {k: list(v) for k, v in named.items()}
        else:
            stage["speeds"] = [float(x) for x in parts]
        if empty:
            stage["empty_blocks"] = True
        if loss_parallel:
            stage["loss_parallel"] = True
    return Plan.from_dict({"microbatches": 1, "replicas": [{"samples": batch, "stages": [stage]}]})


def stage_split(
    costs: ModelCosts,
    first: int,
    end: int,
    ranks: int,
    shares: Mapping[int, Sequence[int]] | None,
    where: str = "stage",
    empty_blocks: bool = False,
    named_shares: Mapping[str, Sequence[int]] | None = None,
) -> tuple[dict[str, str], dict[str, list[int]] | None]:
    """The modes and explicit shares (by layer name) of a stage over plan layers
    ``[first, end)`` split over ``ranks`` ranks, checked as :func:`hetcoll.torch.parallelize`
    checks them (``ValueError`` naming ``where``): something to split, no grouped
    convolution, at least one channel per rank (``empty_blocks``: a transformer block's heads
    or hidden units may leave a rank none); ``shares`` (plan layer index -> channels per
    rank) name Conv2d / Linear layers of the stage and sum to their channels.

    A stage of a model cut into blocks (a transformer) splits as the runtime splits it: its
    attentions by heads, its MLPs by hidden units, any other Linear gathering its output (a
    language model's head); by speeds, or by ``named_shares`` (module path -> channels per
    rank, :func:`hetcoll.torch.filters.filter_shares`' dict: only the layers named split).

    With explicit shares only the named layers are split; a pair of the full stage's modes
    stays paired when both are named, else its named layer gathers. (The runtime pairs the
    named layers by its rule; the two differ only when a named layer's neighbour in the full
    pairing is not named but another one could pair with it.)
    """
    if costs.plan_cut == "blocks":
        return blocks_stage_split(
            costs, first, end, ranks, shares, where, empty_blocks, named_shares
        )
    if named_shares is not None:
        raise ValueError(
            f"{where}.shares: names layers by module path; the model is a chain of layers, whose "
            "shares name them by layer index"
        )
    if empty_blocks:
        raise ValueError(
            f"{where}.empty_blocks: the model is a chain of layers, split by channels with at "
            "least one per rank; empty_blocks is for transformer blocks"
        )
    modes = costs.stage_filter_modes(first, end)
    lo, hi = costs.plan_range(first, end)
    by_name = {x.name: x for x in costs.layers[lo:hi]}
    if not modes:
        raise ValueError(
            f"{where}: has {ranks} ranks but its layers hold no Conv2d or Linear to split"
        )
    for name in modes:
        if by_name[name].groups != 1:
            raise ValueError(
                f"{where}: layer {name!r} is a grouped convolution (groups="
                f"{by_name[name].groups}); filter parallelism splits groups=1 convolutions only"
            )
    if shares is None:
        for name, mode in modes.items():
            if mode != "split-input" and by_name[name].filters < ranks:
                raise ValueError(
                    f"{where}: layer {name!r} has {by_name[name].filters} channels, too few for "
                    f"{ranks} ranks with at least 1 each"
                )
        return modes, None
    index_of: dict[str, int] = {}
    for index in shares:
        kind = costs.plan_layer_kinds[index] if 0 <= index < len(costs.plan_layers) else ""
        if not first <= index < end or kind not in ("Conv2d", "Linear"):
            raise ValueError(
                f"{where}.shares: layer {index} is not a Conv2d or Linear layer of the stage"
            )
        index_of[costs.plan_layers[index]] = index
    pairs = costs.stage_filter_pairs(first, end)
    source = {b: a for a, b in pairs.items()}
    named: dict[str, list[int]] = {}
    for name, index in index_of.items():
        values = [int(v) for v in shares[index]]
        # A split-input layer named with its partner reads the partner's channels (as the
        # runtime takes its shares: the partner's).
        reads = source[name] if source.get(name) in index_of else name
        if len(values) != ranks or min(values) < 1 or sum(values) != by_name[reads].filters:
            raise ValueError(
                f"{where}.shares[{index!r}]: needs {ranks} shares >= 1 summing to layer "
                f"{reads!r}'s {by_name[reads].filters} channels, got {values}"
            )
        named[name] = values
    out: dict[str, str] = {}
    for name in named:
        if name in pairs and pairs[name] in named:
            out[name] = "split-output"
        elif name in source and source[name] in named:
            if named[name] != named[source[name]]:
                raise ValueError(
                    f"{where}.shares: layer {name!r} reads the channels of {source[name]!r}, so "
                    f"its shares must be {named[source[name]]}, got {named[name]}"
                )
            out[name] = "split-input"
        else:
            out[name] = "gather"
    units = dict(costs.filter_units)
    for name, mode in out.items():
        unit = units.get(name, 1)
        if mode == "split-output" and any(v % unit for v in named[name]):
            raise ValueError(
                f"{where}.shares[{index_of[name]!r}]: layer "
                f"{name!r} feeds a grouped convolution, which each rank runs on whole groups, "
                f"so its shares must be multiples of {unit} channels, got {named[name]}"
            )
    return out, {n: v for n, v in named.items() if out[n] != "split-input"}
