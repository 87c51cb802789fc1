"""The Plan: who runs which part of a model, written by the planner and run by the runtime.

A plan is plain data, versioned and JSON-serialisable. Its dictionary form::

    {"version": 1, "microbatches": 4, "schedule": "1F1B",
     "replicas": [
       {"samples": 40, "stages": [{"ranks": [0], "layers": [0, 11]}]},
       {"samples": 24, "stages": [{"ranks": [1], "layers": [0, 5]},
                                  {"ranks": [2, 3], "speeds": [1.0, 0.4], "layers": [5, 11]}]}]}

- ``replicas``: data-parallel replicas, each of any shape. ``samples`` is the replica's share of
  every global batch (the shares sum to the batch).
- ``stages``: a replica's pipeline stages in order. ``layers`` is a half-open range over the
  model's layers (its top-level children, or the top-level calls of its traced graph); a
  replica's stages cover every layer, in order.
- A stage with several ``ranks`` splits its Conv2d / Linear channels among them (filter
  parallelism inside the stage): by ``speeds`` (one per rank; the default is equal speeds) or by
  explicit ``shares`` (``{"<layer index>": [channels per rank, ...]}`` for the layers to split;
  for a model cut into blocks, a transformer, ``{"<module path>": [...]}`` as
  :func:`hetcoll.torch.filters.filter_shares` gives them, heads and hidden units whole).
- Or it places every channel itself (node-wise placement, seed 002): ``owners`` gives, for each
  Conv2d / Linear layer of the stage, ``{"<layer index>": [i, ...]}``, one entry per output
  channel or neuron, each an index into the stage's ``ranks``. The sets are arbitrary (not
  contiguous; a rank may own none of a layer). Each rank keeps only its channels' weights;
  the channel-wise layers after a Conv2d / Linear (activations, BatchNorm, pooling) run where
  their channels live, and each feature map goes once to every rank that reads it. A replica
  with an owners stage runs GPipe (see :mod:`hetcoll.torch.placement`).
- ``microbatches``: how many micro-batches each replica's samples are cut into (uneven when they
  do not divide; a replica with fewer samples runs one sample per micro-batch). ``schedule``:
  ``"GPipe"`` (every forward, then every backward) or ``"1F1B"``.
- ``experts`` (expert parallelism, :func:`hetcoll.torch.expert_parallel`): each replica's
  ranks hold whole experts of the model's mixture-of-experts layers instead of all of them,
  and the routed tokens travel to their experts' replica and back. A list of experts per
  replica (in replica order, every experts layer alike), or ``{"<experts module path>":
  [...], ...}`` naming every experts layer (placements by load differ by layer). A replica
  may hold none of a layer. The replicas then share one shape: the same stages (the same
  layer ranges), each of one rank, and at least ``microbatches`` samples each (every replica
  runs every micro-batch: the experts' exchanges meet there).
- A rank in no stage is idle: it takes part in the collectives of every call and computes nothing.

:func:`hetcoll.torch.parallelize` runs a plan; ``hetcoll plan --out`` writes one.
"""

from __future__ import annotations

import json
import numbers
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

VERSION = 1
SCHEDULES = ("GPipe", "1F1B")

__all__ = [
    "MAX_EXPERTS",
    "SCHEDULES",
    "VERSION",
    "ExpertsHeld",
    "Plan",
    "Replica",
    "Stage",
    "expert_form",
    "expert_indices",
    "expert_runs",
    "experts_field",
    "microbatch_sizes",
]


#: A plan's checked ``experts``: one layer's placement (counts, or each replica's expert
#: indices) for every experts layer, or a dict of them by experts module path.
ExpertsField = (
    tuple[int, ...]
    | tuple[tuple[int, ...], ...]
    | Mapping[str, tuple[int, ...] | tuple[tuple[int, ...], ...]]
)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int(value: object, where: str, *, minimum: int) -> int:
    if not _is_int(value) or value < minimum:  # type: ignore[operator]
        raise ValueError(f"{where}: must be an integer >= {minimum}, got {value!r}")
    return int(value)  # type: ignore[call-overload]


def _is_list(value: object) -> TypeGuard[Sequence[Any]]:
    return not isinstance(value, (str, bytes, Mapping)) and isinstance(value, Sequence)


def _list(value: object, where: str) -> list[Any]:
    if not _is_list(value):
        raise ValueError(f"{where}: must be a list, got {type(value).__name__}")
    return list(value)


def _fields(d: object, where: str, allowed: Sequence[str], required: Sequence[str]) -> None:
    if not isinstance(d, Mapping):
        raise ValueError(f"{where}: must be a dict, got {type(d).__name__}")
    unknown = [k for k in d if k not in allowed]
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r} (fields: {', '.join(allowed)})")
    for k in required:
        if k not in d:
            raise ValueError(f"{where}: missing field {k!r}")


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: ``ranks`` run ``layers`` (half-open), their channels split by
    ``speeds`` or ``shares`` when there are several ranks, or placed one by one by ``owners``
    (layer index -> for each output channel, the index in ``ranks`` of the rank computing it).
    ``empty_blocks``: a split stage's speeds may give a rank none of a transformer block's
    heads or hidden units (:func:`hetcoll.torch.filter_parallel`'s ``empty_blocks``).
    ``named_shares``: the shares of a transformer's split stage, by module path (the JSON's
    ``shares`` with module paths for keys: :func:`hetcoll.torch.filters.filter_shares`' dict,
    attentions and MLPs in whole heads and hidden units). ``loss_parallel``: the last stage of
    a replica, split over several ranks, keeps its output split by vocabulary through the loss
    (:func:`hetcoll.torch.filter_parallel`'s ``loss_parallel``)."""

    ranks: tuple[int, ...]
    layers: tuple[int, int]
    speeds: tuple[float, ...] | None = None
    shares: Mapping[int, tuple[int, ...]] | None = None
    owners: Mapping[int, tuple[int, ...]] | None = None
    empty_blocks: bool = False
    named_shares: Mapping[str, tuple[int, ...]] | None = None
    loss_parallel: bool = False

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "stage") -> Stage:
        _fields(
            d,
            where,
            ("ranks", "layers", "speeds", "shares", "owners", "empty_blocks", "loss_parallel"),
            ("ranks", "layers"),
        )
        ranks = _list(d["ranks"], f"{where}.ranks")
        if not ranks:
            raise ValueError(f"{where}.ranks: must name at least one rank")
        ranks = [_int(r, f"{where}.ranks[{i}]", minimum=0) for i, r in enumerate(ranks)]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"{where}.ranks: names a rank twice: {ranks}")
        layers = _list(d["layers"], f"{where}.layers")
        if len(layers) != 2:
            raise ValueError(f"{where}.layers: must be [first, end), got {layers!r}")
        lo = _int(layers[0], f"{where}.layers[0]", minimum=0)
        hi = _int(layers[1], f"{where}.layers[1]", minimum=lo + 1)
        speeds = shares = owners = None
        given = [k for k in ("speeds", "shares", "owners") if k in d]
        if len(given) > 1:
            raise ValueError(f"{where}: give one of speeds, shares or owners, not {given}")
        if "speeds" in d:
            raw = _list(d["speeds"], f"{where}.speeds")
            if len(raw) != len(ranks):
                raise ValueError(
                    f"{where}.speeds: needs one speed per rank ({len(ranks)}), got {len(raw)}"
                )
            for i, s in enumerate(raw):
                if (
                    isinstance(s, bool)
                    or not isinstance(s, (int, float))
                    or not s <= sys.float_info.max  # inf, NaN, and an int past it (2**2000)
                    or s <= 0
                ):
                    raise ValueError(f"{where}.speeds[{i}]: must be a finite number > 0, got {s!r}")
            speeds = tuple(float(s) for s in raw)
        empty = d.get("empty_blocks", False)
        if not isinstance(empty, bool):
            raise ValueError(f"{where}.empty_blocks: must be true or false, got {empty!r}")
        named = None
        if "shares" in d:
            raw_shares = d["shares"]
            if not isinstance(raw_shares, Mapping) or not raw_shares:
                raise ValueError(
                    f"{where}.shares: must be a non-empty dict from layer index (or, for a "
                    f"transformer, module path) to channels per rank, got {raw_shares!r}"
                )
            by_path = [not _is_index(k) for k in raw_shares]
            if any(by_path) and not all(by_path):
                raise ValueError(
                    f"{where}.shares: names layers by index and by module path; give one kind"
                )
            table: dict[Any, tuple[int, ...]] = {}
            for key, per_rank in raw_shares.items():
                w = f"{where}.shares[{key!r}]"
                if all(by_path):
                    if not isinstance(key, str) or not key.strip() or key != key.strip():
                        raise ValueError(f"{w}: the key must be a layer index or a module path")
                    layer: Any = key
                else:
                    layer = _layer_key(key, w, lo, hi)
                if layer in table:  # "0" and " 0" both read as layer 0
                    raise ValueError(f"{w}: names layer {layer} twice")
                values = _list(per_rank, w)
                if len(values) != len(ranks):
                    raise ValueError(f"{w}: needs one share per rank ({len(ranks)})")
                # By module path, a transformer's heads: a rank may hold none (empty_blocks).
                least = 0 if all(by_path) and empty else 1
                table[layer] = tuple(
                    _int(v, f"{w}[{i}]", minimum=least) for i, v in enumerate(values)
                )
            if all(by_path):
                named = table
            else:
                shares = table
        if "owners" in d:
            owners = _owners(d["owners"], f"{where}.owners", len(ranks), lo, hi)
        if empty and (len(ranks) < 2 or owners is not None):
            raise ValueError(
                f"{where}.empty_blocks: only a stage split over several ranks by speeds or "
                "shares has blocks to leave empty"
            )
        split_loss = d.get("loss_parallel", False)
        if not isinstance(split_loss, bool):
            raise ValueError(f"{where}.loss_parallel: must be true or false, got {split_loss!r}")
        if split_loss and (len(ranks) < 2 or owners is not None):
            raise ValueError(
                f"{where}.loss_parallel: only a stage split over several ranks by speeds or "
                "shares has an output to keep split"
            )
        return cls(tuple(ranks), (lo, hi), speeds, shares, owners, empty, named, split_loss)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"ranks": _listed(self.ranks), "layers": _listed(self.layers)}
        if self.speeds is not None:
            d["speeds"] = _listed(self.speeds)
        if self.shares is not None:
            d["shares"] = _by_layer(self.shares)
        if self.named_shares is not None:
            d["shares"] = _by_layer(self.named_shares)
        if self.owners is not None:
            d["owners"] = _by_layer(self.owners)
        if self.empty_blocks:
            d["empty_blocks"] = True
        if self.loss_parallel:
            d["loss_parallel"] = True
        return d


def _listed(value: Any) -> Any:
    """A list of ``value``'s entries where it is a sequence, else ``value`` as it is: a
    :class:`Stage` built in code writes what it holds, for :meth:`Stage.from_dict` to name
    what is wrong with it."""
    return list(value) if _is_list(value) else value


def _by_layer(table: Any) -> Any:
    """A per-layer dict as JSON writes it (layer-index keys as strings, in order), or
    ``table`` as it is where it is no dict (:func:`_listed`)."""
    if not isinstance(table, Mapping):
        return table
    if all(isinstance(k, int) for k in table):
        return {str(k): _listed(v) for k, v in sorted(table.items())}
    return {k: _listed(v) for k, v in table.items()}


def _is_index(key: object) -> bool:
    """Whether a per-layer dict's key reads as a layer index (JSON keys are strings)."""
    try:
        return str(int(key)) == str(key).strip()  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return False


def _layer_key(key: object, where: str, lo: int, hi: int) -> int:
    """A per-layer dict's key (``shares``, ``owners``): a layer index in the stage's ``[lo, hi)``
    (JSON keys are strings: ``"3"`` is layer 3)."""
    try:
        layer = int(key)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise ValueError(f"{where}: the key must be a layer index") from None
    if str(layer) != str(key).strip() or not lo <= layer < hi:
        raise ValueError(f"{where}: the key must be a layer index in [{lo}, {hi})")
    return layer


def _owners(
    raw: object, where: str, num_ranks: int, lo: int, hi: int
) -> dict[int, tuple[int, ...]]:
    """A stage's ``owners``, checked: layer-index keys in the stage's range, one rank index per
    channel. Whether the keys are exactly the stage's Conv2d / Linear layers and the lengths
    their channel counts depends on the model: :func:`hetcoll.torch.parallelize` checks that."""
    if num_ranks < 2:
        raise ValueError(
            f"{where}: a stage with one rank computes every channel itself and takes no owners"
        )
    if not isinstance(raw, Mapping) or not raw:
        raise ValueError(
            f"{where}: must be a non-empty dict from layer index to the owner of each channel, "
            f"got {raw!r}"
        )
    owners = {}
    for key, per_channel in raw.items():
        w = f"{where}[{key!r}]"
        layer = _layer_key(key, w, lo, hi)
        if layer in owners:
            raise ValueError(f"{w}: names layer {layer} twice")
        values = _list(per_channel, w)
        if not values:
            raise ValueError(f"{w}: needs one owner per channel, got none")
        owners[layer] = tuple(_owner(v, f"{w}[{i}]", num_ranks) for i, v in enumerate(values))
    return owners


def _owner(value: object, where: str, num_ranks: int) -> int:
    if not _is_int(value) or not 0 <= value < num_ranks:  # type: ignore[operator]
        raise ValueError(
            f"{where}: must be an index into the stage's ranks (0 to {num_ranks - 1}), "
            f"got {value!r}"
        )
    return int(value)  # type: ignore[call-overload]


#: One experts layer's placement, per replica (or rank) in order: counts, entry r holding the
#: next ``counts[r]`` experts in expert order; or each one's expert indices, any experts.
ExpertsHeld = Sequence[int] | Sequence[Sequence[int]]


#: The most experts one layer may have: far more than any mixture-of-experts layer holds (the
#: largest published hold about a million); a larger count is a mistake, and placements list
#: every expert's index (a count of 10**12 in a plan file would fill the host's memory).
MAX_EXPERTS = 2**24


def expert_indices(
    held: object,
    ranks: int,
    where: str,
    *,
    experts: int | None = None,
    of: str = "replica",
) -> tuple[tuple[int, ...], ...]:
    """One experts layer's placement (:data:`ExpertsHeld`) as each of ``ranks`` entries' expert
    indices, ascending: counts become runs in expert order (``[2, 1]`` is ``((0, 1), (2,))``);
    indices must name every expert once (``experts`` of them where given, else as many as
    they name). ``ValueError`` naming ``where`` (and ``of``: what one entry is for) where
    ``held`` is no placement.

    >>> expert_indices([2, 1], 2, "shares")
    ((0, 1), (2,))
    >>> expert_indices([[2, 0], [1]], 2, "shares")
    ((0, 2), (1,))
    """
    listed = _list(held, where)
    if len(listed) != ranks:
        raise ValueError(f"{where}: needs one entry per {of} ({ranks}), got {len(listed)}")
    if all(_is_int(v) for v in listed):
        counts = [_int(v, f"{where}[{i}]", minimum=0) for i, v in enumerate(listed)]
        total = sum(counts)
        if total > MAX_EXPERTS:  # before the indices are listed: a count of 10**12 in a file
            raise ValueError(
                f"{where}: places {total} experts, more than {MAX_EXPERTS} (MAX_EXPERTS)"
            )
        if experts is not None and total != experts:
            raise ValueError(
                f"{where}: must be {ranks} ints >= 0 summing to the {experts} experts, got "
                f"{counts} (sum {total})"
            )
        if not total:
            raise ValueError(f"{where}: places no expert")
        cuts = [0]
        for c in counts:
            cuts.append(cuts[-1] + c)
        return tuple(tuple(range(cuts[r], cuts[r + 1])) for r in range(ranks))
    out = []
    for i, v in enumerate(listed):
        if _is_int(v):
            raise ValueError(
                f"{where}: gives counts and expert indices together (entry {i} is {v!r}); give "
                "one count per entry or one list of experts per entry"
            )
        out.append(
            tuple(
                sorted(
                    _int(e, f"{where}[{i}][{k}]", minimum=0)
                    for k, e in enumerate(_list(v, f"{where}[{i}]"))
                )
            )
        )
    named = sorted(e for held_ in out for e in held_)
    total = len(named) if experts is None else experts
    if not named:
        raise ValueError(f"{where}: places no expert")
    if named != list(range(total)):
        twice = sorted({e for e in named if named.count(e) > 1})
        missing = sorted(set(range(total)) - set(named))
        beyond = sorted(e for e in set(named) if e >= total)
        why = (
            f"names expert {twice[0]} twice"
            if twice
            else f"misses expert {missing[0]}"
            if missing
            else f"names expert {beyond[0]}, beyond the {total} experts"
        )
        raise ValueError(f"{where}: must name each of the {total} experts once; {why}")
    return tuple(out)


def expert_runs(placement: Sequence[Sequence[int]]) -> list[int] | None:
    """Experts per entry where ``placement`` (each entry's expert indices, ascending) is runs in
    expert order, entry after entry; else None.

    >>> expert_runs([[0, 1], [2]]), expert_runs([[0, 2], [1]])
    ([2, 1], None)
    """
    flat = [e for held in placement for e in held]
    return [len(held) for held in placement] if flat == list(range(len(flat))) else None


def _experts(raw: object, replicas: tuple[Replica, ...], microbatches: int) -> ExpertsField:
    """A plan's ``experts``, checked: a placement per experts layer (:func:`expert_indices`: a
    list for every layer, or a dict by experts module path), kept in the form given (counts,
    or each replica's experts), on replicas of one shape (the same stages, one rank each,
    every micro-batch run). Whether the paths are the model's experts modules and the
    placements hold their experts depends on the model: :func:`hetcoll.torch.parallelize`
    checks that."""
    where = "plan.experts"

    def layer(values: object, w: str) -> tuple[int, ...] | tuple[tuple[int, ...], ...]:
        placed = expert_indices(values, len(replicas), w)
        counts = expert_runs(placed)
        given_counts = all(_is_int(v) for v in _list(values, w))
        return tuple(counts) if given_counts and counts is not None else placed

    placed: ExpertsField
    if isinstance(raw, Mapping):
        if not raw:
            raise ValueError(f"{where}: must name at least one experts module")
        placed = {}
        for key, values in raw.items():
            if not isinstance(key, str) or not key.strip() or key != key.strip():
                raise ValueError(f"{where}: the key {key!r} must be an experts module's path")
            placed[key] = layer(values, f"{where}[{key!r}]")
    else:
        placed = layer(raw, where)
    first = replicas[0]
    for i, r in enumerate(replicas):
        for j, s in enumerate(r.stages):
            if len(s.ranks) > 1:
                raise ValueError(
                    f"{where}: places whole experts on each replica's ranks; "
                    f"plan.replicas[{i}].stages[{j}] splits over {len(s.ranks)} ranks (give "
                    "every stage one rank)"
                )
        if [s.layers for s in r.stages] != [s.layers for s in first.stages]:
            raise ValueError(
                f"{where}: the replicas must share their stages (the experts of a layer meet "
                f"at its stage); plan.replicas[{i}] runs layers "
                f"{[list(s.layers) for s in r.stages]}, replica 0 "
                f"{[list(s.layers) for s in first.stages]}"
            )
        if r.samples < microbatches:
            raise ValueError(
                f"{where}: every replica runs the plan's {microbatches} micro-batches (the "
                f"experts' exchanges meet at each); plan.replicas[{i}] has {r.samples} samples"
            )
    return placed


@dataclass(frozen=True)
class Replica:
    """A data-parallel replica: ``samples`` rows of every global batch through ``stages``."""

    samples: int
    stages: tuple[Stage, ...]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "replica") -> Replica:
        _fields(d, where, ("samples", "stages"), ("samples", "stages"))
        samples = _int(d["samples"], f"{where}.samples", minimum=1)
        raw = _list(d["stages"], f"{where}.stages")
        if not raw:
            raise ValueError(f"{where}.stages: must hold at least one stage")
        stages = tuple(Stage.from_dict(s, f"{where}.stages[{i}]") for i, s in enumerate(raw))
        if stages[0].layers[0] != 0:
            raise ValueError(f"{where}.stages[0].layers: must start at layer 0")
        for i, stage in enumerate(stages[:-1]):
            if stage.loss_parallel:
                raise ValueError(
                    f"{where}.stages[{i}].loss_parallel: only the last stage of a replica "
                    "computes the loss"
                )
        for i in range(1, len(stages)):
            if stages[i].layers[0] != stages[i - 1].layers[1]:
                raise ValueError(
                    f"{where}.stages[{i}].layers: must start where stage {i - 1} ends "
                    f"(layer {stages[i - 1].layers[1]}), got {list(stages[i].layers)}"
                )
        return cls(samples, stages)

    @property
    def num_layers(self) -> int:
        return self.stages[-1].layers[1]

    def to_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "stages": [s.to_dict() for s in self.stages]}


@dataclass(frozen=True)
class Plan:
    """A parallel plan: replicas × pipeline stages × channel splits (see the module docs).

    >>> plan = Plan.from_dict({"microbatches": 2, "schedule": "GPipe", "replicas": [
    ...     {"samples": 8, "stages": [{"ranks": [0], "layers": [0, 3]},
    ...                               {"ranks": [1], "layers": [3, 5]}]}]})
    >>> plan.batch, plan.ranks, plan.num_layers
    (8, (0, 1), 5)
    """

    replicas: tuple[Replica, ...]
    microbatches: int = 1
    schedule: str = "GPipe"
    #: Experts per replica (:data:`ExpertsHeld`: counts, or each replica's expert indices):
    #: one placement for every experts layer, or a dict by experts module path (None: no
    #: expert parallelism; every rank holds its stages' experts whole).
    experts: ExpertsField | None = None

    def __post_init__(self) -> None:
        # A plan built in code is checked (and normalised) as one read from JSON is; to_dict
        # reads the replicas and stages as objects, so those are checked first.
        _check_objects(self.replicas)
        parsed = Plan.from_dict(self.to_dict())
        for name in ("replicas", "microbatches", "schedule", "experts"):
            object.__setattr__(self, name, getattr(parsed, name))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Plan:
        """The plan a dictionary describes; ``ValueError`` naming the field if it is invalid."""
        _fields(
            d,
            "plan",
            ("version", "microbatches", "schedule", "replicas", "experts"),
            ("replicas",),
        )
        version = d.get("version", VERSION)
        if version != VERSION:
            raise ValueError(f"plan.version: this hetcoll reads version {VERSION}, got {version!r}")
        microbatches = _int(d.get("microbatches", 1), "plan.microbatches", minimum=1)
        schedule = d.get("schedule", "GPipe")
        match = [
            s for s in SCHEDULES if isinstance(schedule, str) and s.lower() == schedule.lower()
        ]
        if not match:
            raise ValueError(f"plan.schedule: must be one of {SCHEDULES}, got {schedule!r}")
        raw = _list(d["replicas"], "plan.replicas")
        if not raw:
            raise ValueError("plan.replicas: must hold at least one replica")
        replicas = tuple(Replica.from_dict(r, f"plan.replicas[{i}]") for i, r in enumerate(raw))
        layers = replicas[0].num_layers
        for i, r in enumerate(replicas):
            if r.num_layers != layers:
                raise ValueError(
                    f"plan.replicas[{i}].stages: cover {r.num_layers} layers, replica 0 covers "
                    f"{layers}"
                )
        seen: dict[int, str] = {}
        for i, r in enumerate(replicas):
            for j, s in enumerate(r.stages):
                for rank in s.ranks:
                    where = f"plan.replicas[{i}].stages[{j}]"
                    if rank in seen:
                        raise ValueError(
                            f"{where}.ranks: rank {rank} is already in {seen[rank]}; a rank runs "
                            "one stage of one replica"
                        )
                    seen[rank] = where
        experts = None
        if "experts" in d:
            experts = _experts(d["experts"], replicas, microbatches)
        plan = object.__new__(cls)
        object.__setattr__(plan, "replicas", replicas)
        object.__setattr__(plan, "microbatches", microbatches)
        object.__setattr__(plan, "schedule", match[0])
        object.__setattr__(plan, "experts", experts)
        return plan

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "version": VERSION,
            "microbatches": self.microbatches,
            "schedule": self.schedule,
            "replicas": [r.to_dict() for r in self.replicas],
        }
        if isinstance(self.experts, Mapping):
            d["experts"] = {k: _plain(v) for k, v in self.experts.items()}
        elif self.experts is not None:
            d["experts"] = _plain(self.experts)
        return d

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Read a plan from a JSON file. ``path``: a str or ``os.PathLike`` (``TypeError``
        otherwise: an int would be read as a file descriptor, and closed); a file that is not
        UTF-8 JSON (or JSON nested or numbers longer than Python reads) raises ``ValueError``
        naming it, an invalid plan ``ValueError`` naming the field."""
        name = _path(path)
        with open(path, encoding="utf-8") as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"path: {name!r} is not JSON: {e}") from None
            except UnicodeDecodeError as e:
                raise ValueError(f"path: {name!r} is not UTF-8 text: {e}") from None
            except ValueError as e:  # an integer longer than int() reads
                raise ValueError(f"path: {name!r} is not JSON a plan can hold: {e}") from None
            except RecursionError:
                raise ValueError(f"path: {name!r} holds JSON nested too deeply to read") from None
        return cls.from_dict(d)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as JSON. ``path``: a str or ``os.PathLike`` (``TypeError``
        otherwise: an int would be written as a file descriptor, and closed)."""
        _path(path)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")

    @property
    def batch(self) -> int:
        """The global batch: the replicas' samples summed."""
        return sum(r.samples for r in self.replicas)

    @property
    def num_layers(self) -> int:
        return self.replicas[0].num_layers

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank with work, in increasing order."""
        return tuple(sorted(r for _, _, s in self.stages() for r in s.ranks))

    def stages(self) -> Iterator[tuple[int, int, Stage]]:
        """``(replica index, stage index, stage)`` for every stage."""
        for i, r in enumerate(self.replicas):
            for j, s in enumerate(r.stages):
                yield i, j, s

    def place(self, rank: int) -> tuple[int, int] | None:
        """``(replica index, stage index)`` of ``rank``, or None if it is idle (in no stage:
        a rank beyond the plan's ranks is idle). ``rank``: an integer >= 0 (``ValueError``
        naming it otherwise)."""
        _index(rank, "rank")
        for i, j, s in self.stages():
            if rank in s.ranks:
                return i, j
        return None

    def microbatch_sizes(self, replica: int) -> list[int]:
        """The replica's micro-batch sizes (:func:`microbatch_sizes` of its samples).
        ``replica``: its index, an integer in ``[0, len(replicas))`` (``ValueError`` naming it
        otherwise)."""
        i = _index(replica, "replica", len(self.replicas))
        return microbatch_sizes(self.replicas[i].samples, self.microbatches)


def _path(path: object) -> str:
    """``path`` as a str for messages; ``TypeError`` naming it unless it is a str or an
    ``os.PathLike`` of one (``open`` reads an int as a file descriptor, and closes it)."""
    name = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if not isinstance(name, str):
        raise TypeError(f"path: must be a str or os.PathLike, got {type(path).__name__}")
    return name


def _index(value: object, name: str, end: int | None = None) -> int:
    """``value``, an integer (not a bool) >= 0 and below ``end`` where given; ``ValueError``
    naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}: must be an integer >= 0, got {value!r}")
    i = int(value)
    if i < 0 or (end is not None and i >= end):
        within = ">= 0" if end is None else f"in [0, {end})"
        raise ValueError(f"{name}: must be an integer {within}, got {i}")
    return i


def _check_objects(replicas: Sequence[Replica]) -> None:
    """``Plan(replicas=...)``'s replicas: a list of :class:`Replica` whose stages are lists of
    :class:`Stage` (what :meth:`Plan.to_dict` reads); ``ValueError`` naming ``replicas``
    otherwise (dicts are what :meth:`Plan.from_dict` reads)."""
    _objects(replicas, Replica, "replicas")
    for i, r in enumerate(replicas):
        _objects(r.stages, Stage, f"replicas[{i}].stages")
        for j, stage in enumerate(r.stages):
            if stage.shares is not None and stage.named_shares is not None:
                raise ValueError(
                    f"replicas[{i}].stages[{j}]: give shares (by layer index) or named_shares "
                    "(by module path), not both"
                )


def _objects(value: object, kind: type, where: str) -> None:
    """``value`` a list of ``kind``; ``ValueError`` naming ``where`` (or its entry) otherwise."""
    hint = " (build a plan from its dict form with Plan.from_dict)"
    if not _is_list(value):
        raise ValueError(
            f"{where}: must be a list of {kind.__name__}, got {type(value).__name__}{hint}"
        )
    for i, x in enumerate(value):
        if not isinstance(x, kind):
            raise ValueError(
                f"{where}[{i}]: must be a {kind.__name__}, got {type(x).__name__}{hint}"
            )


def experts_field(
    placed: Mapping[str, Sequence[int] | Sequence[Sequence[int]]],
) -> list[Any] | dict[str, list[Any]]:
    """A plan's ``experts`` for each experts layer's placement per replica (by module path;
    counts or each replica's expert indices): one placement where every layer is placed
    alike, else the dict by path; each as counts where its experts lie in runs in expert
    order (:func:`expert_runs`), else as indices.

    >>> experts_field({"a": [3, 1], "b": [[0, 1, 2], [3]]})
    [3, 1]
    >>> experts_field({"a": [[0, 2], [1]]})
    [[0, 2], [1]]
    """
    if not isinstance(placed, Mapping):
        raise TypeError(
            f"placed: must be a dict from experts module path to its placement, got "
            f"{type(placed).__name__}"
        )
    for path, held in placed.items():  # counts >= 0 placing some expert, or indices
        expert_indices(held, len(_list(held, f"placed[{path!r}]")), f"placed[{path!r}]")
    forms = {path: expert_form(held) for path, held in placed.items()}
    alike = {repr(f) for f in forms.values()}
    if len(alike) == 1:
        return next(iter(forms.values()))
    return forms


def expert_form(held: Sequence[int] | Sequence[Sequence[int]]) -> list[Any]:
    """One layer's placement as plans and predictions write it: counts where its experts lie
    in runs in expert order (or were given as counts), else each entry's indices, ascending.

    >>> expert_form([[0, 1], [2]]), expert_form([[2, 0], [1]])
    ([2, 1], [[0, 2], [1]])
    """
    listed: list[Any] = list(held)
    if all(_is_int(v) for v in listed):
        return [int(v) for v in listed]
    runs = expert_runs(listed)
    return runs if runs is not None else [sorted(int(e) for e in h) for h in listed]


def _plain(held: tuple[int, ...] | tuple[tuple[int, ...], ...]) -> Any:
    if not _is_list(held):  # a plan built in code: from_dict names what it is
        return held
    return [v if _is_int(v) else _listed(v) for v in held]


def microbatch_sizes(samples: int, microbatches: int) -> list[int]:
    """A replica's micro-batch sizes: its ``samples`` cut into ``microbatches`` near-equal parts
    (the first ones one larger), at most one part per sample. (The planner costs plans it has
    not built yet by this rule.)

    >>> microbatch_sizes(10, 4)
    [3, 3, 2, 2]
    """
    for name, value in (("samples", samples), ("microbatches", microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
    m = min(microbatches, samples)
    q, rem = divmod(samples, m)
    return [q + 1] * rem + [q] * (m - rem)
