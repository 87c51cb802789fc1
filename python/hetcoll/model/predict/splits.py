"""The pieces of a filter-split step the schedule (:mod:`.filters`) is built from: what its
collectives cost (:class:`SplitCollectives`), and a transformer's attentions and MLPs split by
heads and hidden units (:class:`~hetcoll.model.costs.SplitBlock`): which blocks a split holds
(:func:`split_blocks`), the costed layers each one spans (:func:`block_spans`), its units per
device (:func:`block_units`), the checks of a blocks model's split stage
(:func:`blocks_stage_split`) and whether its speeds leave a device none
(:func:`blocks_need_empty`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hetcoll.model import terms
from hetcoll.model.costs import ModelCosts, SplitBlock, split_input_partners
from hetcoll.model.hardware import Cluster
from hetcoll.model.predict.timing import device_arrays


@dataclass(frozen=True)
class SplitCollectives:
    """What a filter-split step's collectives cost on ``cluster``'s ring: each works on a copy
    of its tensor (the layers keep autograd's intact), at the slowest device's rates."""

    costs: ModelCosts
    cluster: Cluster

    def allreduce_s(self, nbytes: float) -> float:
        dev = device_arrays(self.cluster.devices)
        link = self.cluster.ring_link()
        return float(
            terms.ring_allreduce_seconds(
                nbytes,
                self.cluster.num_devices,
                link.latency_s,
                link.bytes_per_s,
                float(dev.mem_bytes_per_s.min()),
                self.costs.itemsize,
                call_s=link.call_of("hetcoll_allreduce"),
            )
        )

    def broadcast_s(self, nbytes: float) -> float:
        link = self.cluster.ring_link()
        n = self.cluster.num_devices
        return float(
            terms.broadcast_seconds(
                nbytes, n, link.latency_s, link.bytes_per_s, link.call_of("broadcast")
            )
        )

    def copy_s(self, nbytes: float) -> float:
        dev = device_arrays(self.cluster.devices)
        return float(terms.copy_seconds(nbytes, float(dev.elementwise_bytes_per_s.min())))

    def block_sums_s(
        self, batch: int, rows: Sequence[int], alone: bool, block: SplitBlock
    ) -> tuple[float, float]:
        """Seconds of a split block's two sums: of its output after its last layer's forward,
        of its input's gradient after its first layer's backward (``rows``: its costed layers),
        each an allreduce on a copy; broadcast from its one holder instead when ``alone`` (the
        other devices' partial sums are zero). The backward adds an allreduce of each
        parameter the block's heads share (``block.shared``), on every split; each way adds
        the block's other sums (``block.sums``, per sample; ``block.fixed_sums``, per
        forward), each an allreduce on a copy."""
        first, last = self.costs.layers[min(rows)], self.costs.layers[max(rows)]
        total = self.broadcast_s if alone else self.allreduce_s
        out = last.out_bytes_per_sample * batch
        grad = first.in_bytes_per_sample * batch
        shared = sum(self.allreduce_s(n * self.costs.itemsize) for n in block.shared)
        other = [
            sum(
                self.allreduce_s(b * batch) + self.copy_s(b * batch)
                for b, forward in block.sums
                if forward == way
            )
            + sum(
                self.allreduce_s(b) + self.copy_s(b)
                for b, forward in block.fixed_sums
                if forward == way
            )
            for way in (True, False)
        ]
        forward_s = total(out) + self.copy_s(out) + other[0]
        return forward_s, total(grad) + self.copy_s(grad) + shared + other[1]


def split_blocks(costs: ModelCosts, modes: Mapping[str, str]) -> list[SplitBlock]:
    """The attentions and MLPs ``modes`` split by heads and hidden units: a grouped-query
    attention's split by query head (:attr:`~hetcoll.model.costs.SplitBlock.by_head`) where
    ``modes`` split its query and output projections alone."""
    out = []
    for b in costs.split_blocks:
        for variant in (b, b.by_head):
            if variant is not None and all(
                modes.get(n) in ("split-output", "split-input") for n in variant.layers
            ):
                out.append(variant)
                break
    return out


def block_spans(costs: ModelCosts, blocks: Sequence[SplitBlock]) -> dict[int, int]:
    """Costed layer -> the block of ``blocks`` it runs in: from the block's first split
    layer's call to its last one's, inside its module (an encoder layer's MLP is named after
    the layer, which holds its attention too)."""
    block_of: dict[int, int] = {}
    for k, b in enumerate(blocks):
        at = [i for i, x in enumerate(costs.layers) if b.layer_at(x.name) is not None]
        for i in range(min(at), max(at) + 1) if at else ():
            if b.contains(costs.layers[i].name):
                block_of.setdefault(i, k)
    return block_of


def block_units(
    block: SplitBlock,
    speeds: Sequence[float],
    empty: bool,
    layer_shares: Mapping[str, Sequence[int]] | None = None,
) -> list[int]:
    """The units of ``block`` per device, as the runtime splits them: from ``layer_shares``
    where they name its layers, else by speeds. ``ValueError`` (naming ``parts``) where speeds
    cannot split it (fewer units than devices, without ``empty``)."""
    given = None if layer_shares is None else block.units_of(layer_shares)
    if given is not None:
        return given
    empty = empty and block.empty
    if block.units < len(speeds) and not empty:
        raise ValueError(
            f"parts: {block.kind} {block.module!r} has {block.units} units (heads, key/value "
            f"groups or hidden units), too few for {len(speeds)} devices with at least one "
            + (
                "each (empty_blocks=True lets a device hold none)"
                if block.empty
                else "each (its forward cannot run on a device holding none of its heads)"
            )
        )
    return block.shares(speeds, empty=empty)


def blocks_stage_split(
    costs: ModelCosts,
    first: int,
    end: int,
    ranks: int,
    shares: Mapping[int, Sequence[int]] | None,
    where: str,
    empty_blocks: bool,
    named_shares: Mapping[str, Sequence[int]] | None,
) -> tuple[dict[str, str], dict[str, list[int]] | None]:
    """:func:`~.filters.stage_split` of a blocks model: the modes of the stage's layers in the whole
    model's split (the runtime splits a copy of the model holding the stage's blocks), and
    with ``named_shares`` the layers they name, checked as the runtime checks them."""
    if shares is not None:
        raise ValueError(
            f"{where}.shares: a stage of a model cut into blocks (its forward no chain of "
            "layers: a transformer's) names its layers by module path (filter_shares' dict), "
            "not by layer index"
        )
    modes = costs.stage_filter_modes(first, end)
    if named_shares is not None:
        return _named_split(costs, modes, ranks, named_shares, where, empty_blocks)
    if not modes:
        raise ValueError(
            f"{where}: has {ranks} ranks but its blocks hold no attention, MLP or Linear to split"
        )
    for grouped in costs.split_blocks:
        block = grouped.by_head or grouped  # a grouped-query attention splits by query head
        if grouped.layers[0] in modes and block.units < ranks and not empty_blocks:
            raise ValueError(
                f"{where}: {block.kind} {block.module!r} has {block.units} units (heads, "
                f"key/value groups or hidden units), too few for {ranks} ranks with at least "
                "one each (empty_blocks: true lets a rank hold none)"
            )
    in_blocks = {n for b in costs.split_blocks for n in b.layers}
    by_name = {x.name: x for x in costs.layers}
    for name, mode in modes.items():
        if name not in in_blocks and mode == "gather" and by_name[name].filters < ranks:
            raise ValueError(
                f"{where}: layer {name!r} has {by_name[name].filters} channels, too few for "
                f"{ranks} ranks with at least 1 each"
            )
    return modes, None


def _named_split(
    costs: ModelCosts,
    modes: Mapping[str, str],
    ranks: int,
    named: Mapping[str, Sequence[int]],
    where: str,
    empty: bool,
) -> tuple[dict[str, str], dict[str, list[int]]]:
    """The split a blocks stage's shares by module path make: an attention or MLP whose every
    layer is named (torch's attention: its own name) splits by whole units, its projections
    following its output's shares; a pair of the pairing rule named with the same shares
    (T5's MLP) splits as a pair; any other named layer gathers (as the runtime gathers a
    projection named without the rest of its block); nothing else splits."""
    given = {n: [int(v) for v in s] for n, s in named.items()}
    least = 0 if empty else 1
    out: dict[str, str] = {}
    for grouped in costs.split_blocks:
        block = grouped.resolved([1.0] * ranks, shares=given)  # by query head, as named
        layers = block.layers
        if not (
            layers[0] in modes
            and (all(n in given for n in layers) or (block.kind == "mha" and layers[0] in given))
        ):
            continue
        # Whole units in the output projection's shares (or torch's packed q, k and v's) ...
        k = len(layers) - 1 if layers[-1] in given else 0
        values, per = given[layers[k]], block.per_unit[k]
        if (
            len(values) != ranks
            or sum(values) != block.units * per
            or any(v % per or v < least * per for v in values)
        ):
            raise ValueError(
                f"{where}.shares[{layers[k]!r}]: {values} are not whole units of {per} "
                f"features of {block.kind} {block.module!r} ({block.units} units"
                + (", none negative)" if empty else ", at least one per rank)")
            )
        # ... which every other projection named follows.
        want = block.layer_shares([v // per for v in values])
        for n in layers:
            if n in given and given[n] != want[n]:
                raise ValueError(
                    f"{where}.shares[{n!r}]: feeds {layers[-1]!r}, so its shares must be "
                    f"{want[n]}, got {given[n]}"
                )
        out.update({n: modes[n] for n in layers})
    by_name = {x.name: x for x in costs.layers}
    for name, after in split_input_partners(modes).items():
        # A pair of the pairing rule (a split-output layer and the split-input layer reading
        # its channels, as T5's MLP), both named with the same shares, splits as a pair.
        if (
            name in given
            and name not in out
            and after not in out
            and given.get(after) == given[name]
        ):
            values = given[name]
            if len(values) != ranks or sum(values) != by_name[name].filters or min(values) < 1:
                raise ValueError(
                    f"{where}.shares[{name!r}]: needs {ranks} shares >= 1 summing to its "
                    f"{by_name[name].filters} channels, got {values}"
                )
            out[name], out[after] = "split-output", "split-input"
    for name, values in given.items():
        if name in out:
            continue
        # A layer named alone (not every layer of its attention or MLP) gathers its output.
        if name not in modes or by_name.get(name) is None or by_name[name].filters <= 0:
            raise ValueError(f"{where}.shares[{name!r}]: names no Linear layer of the stage")
        if len(values) != ranks or sum(values) != by_name[name].filters or min(values) < 1:
            raise ValueError(
                f"{where}.shares[{name!r}]: needs {ranks} shares >= 1 summing to its "
                f"{by_name[name].filters} channels, got {values}"
            )
        out[name] = "gather"
    if not out:
        raise ValueError(f"{where}.shares: names no layer of the stage to split")
    return out, given


def splits_loss(costs: ModelCosts) -> bool:
    """Whether the planner keeps the output of a replica's last stage split over several
    devices split through the loss (a plan stage's ``loss_parallel``): for a language model
    (a model cut into blocks), whose head's logits are the largest tensor a split stage would
    otherwise gather; a chain model's classifier gathers its few classes."""
    return costs.plan_cut == "blocks"


def blocks_need_empty(costs: ModelCosts, first: int, end: int, speeds: Sequence[float]) -> bool:
    """Whether a split stage over plan layers ``[first, end)`` of a blocks model at ``speeds``
    needs ``empty_blocks`` to split as its speeds say: an attention or MLP of the stage has
    fewer units than ranks, or its split in proportion leaves a rank none. (A split that
    leaves no rank empty is the same either way.) False for a chain model."""
    if costs.plan_cut != "blocks":
        return False
    modes = costs.stage_filter_modes(first, end)
    blocks = [b.resolved(speeds) for b in costs.split_blocks if b.layers[0] in modes]
    return any(b.units < len(speeds) or 0 in b.shares(speeds, empty=True) for b in blocks)
