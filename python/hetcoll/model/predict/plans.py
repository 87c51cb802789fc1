"""Any :class:`hetcoll.Plan`: its layout checked against the model, the stages' work, alike
replicas grouped, the laid-out step (:class:`PlanSchedule`, :func:`plan_schedule`) and its
prediction (:func:`predict_plan`, :func:`predict_stages`)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from hetcoll.model import terms
from hetcoll.model.costs import ModelCosts
from hetcoll.model.hardware import Cluster, Device, Link
from hetcoll.model.predict.filters import filter_parallel_schedule, stage_split
from hetcoll.model.predict.prediction import Prediction
from hetcoll.model.predict.timing import (
    LayerSeconds,
    _layer_times,
    device_arrays,
    memory_shortfall,
)
from hetcoll.plan import Plan, microbatch_sizes


@dataclass(frozen=True)
class _StageLayout:
    """A stage as the simulation needs it: devices, costed layers ``[lo, hi)``, the bytes per
    sample it sends the next stage, and how a filter-split stage splits."""

    ranks: tuple[int, ...]
    lo: int
    hi: int
    out_bytes_per_sample: float
    parts: tuple[float, ...] = ()
    modes: Mapping[str, str] | None = None
    layer_shares: Mapping[str, Sequence[int]] | None = None


@dataclass(frozen=True)
class _ReplicaLayout:
    samples: int
    micro: tuple[int, ...]
    stages: tuple[_StageLayout, ...]


def _plan_layout(costs: ModelCosts, cluster: Cluster, plan: Plan) -> list[_ReplicaLayout]:
    """The plan in costed layers, checked against the model and the cluster."""
    if not isinstance(plan, Plan):
        raise TypeError(f"plan: must be a hetcoll.Plan, got {type(plan).__name__}")
    costs.check_plan_layers()
    n_layers = len(costs.plan_layers)
    if plan.num_layers != n_layers:
        raise ValueError(
            f"plan: its stages cover {plan.num_layers} layers but the model has {n_layers} "
            f"({', '.join(costs.plan_layers)})"
        )
    missing = [r for r in plan.ranks if r >= cluster.num_devices]
    if missing:
        raise ValueError(
            f"plan: names rank {missing[0]} but the cluster has {cluster.num_devices} devices"
        )
    out = []
    # Stages alike but for their ranks are checked and laid out once (and so share their
    # modes: _ReplicaKeys knows them alike).
    built: dict[tuple[Any, ...], _StageLayout] = {}
    for i, replica in enumerate(plan.replicas):
        stages = []
        for j, stage in enumerate(replica.stages):
            where = f"plan.replicas[{i}].stages[{j}]"
            if stage.owners is not None:
                raise ValueError(
                    f"{where}: places channels by owners; predict_plan does not model such "
                    "stages yet (hetcoll.model.predict_placement predicts a one-stage one)"
                )
            last = j + 1 == len(replica.stages)
            shares = (
                None
                if stage.shares is None
                else tuple(sorted((k, tuple(v)) for k, v in stage.shares.items()))
            )
            key = (len(stage.ranks), tuple(stage.layers), last, stage.speeds, shares)
            if key not in built:
                built[key] = _stage_layout(
                    costs, stage.ranks, stage.layers, last, stage.speeds, stage.shares, where
                )
            b = built[key]
            stages.append(
                _StageLayout(
                    tuple(stage.ranks),
                    b.lo,
                    b.hi,
                    b.out_bytes_per_sample,
                    b.parts,
                    b.modes,
                    b.layer_shares,
                )
            )
        out.append(_ReplicaLayout(replica.samples, tuple(plan.microbatch_sizes(i)), tuple(stages)))
    return out


def _stage_layout(
    costs: ModelCosts,
    ranks: Sequence[int],
    layers: tuple[int, int],
    last: bool,
    speeds: Sequence[float] | None,
    shares: Mapping[int, Sequence[int]] | None,
    where: str,
) -> _StageLayout:
    """A stage over plan layers ``layers`` on ``ranks``, checked as the runtime checks it."""
    first, end = layers
    lo, hi = costs.plan_range(first, end)
    sent = 0.0 if last else costs.plan_out_bytes[end - 1]
    p = len(ranks)
    if p == 1:
        return _StageLayout(tuple(ranks), lo, hi, sent)
    modes, named = stage_split(costs, first, end, p, shares, where)
    parts = speeds if speeds is not None else (1.0,) * p
    return _StageLayout(tuple(ranks), lo, hi, sent, tuple(parts), modes, named)


#: Replicas as the planner lays them out before building their plan: samples, and per stage
#: its ranks, plan layers ``(first, end)`` and the ranks' speeds (None: one rank, or equal).
#: The ranks are a tuple (one replica) or an integer array of one row per replica (copies
#: alike but for their ranks: a 10,240-device plan is a few such entries).
StagesSpec = tuple[
    int,
    tuple[tuple[tuple[int, ...] | np.ndarray, tuple[int, int], tuple[float, ...] | None], ...],
]


def predict_stages(
    costs: ModelCosts,
    cluster: Cluster,
    replicas: Sequence[StagesSpec],
    microbatches: int,
    schedule: str,
    *,
    optimizer_state_copies: int = 1,
    strategy: str = "plan",
) -> Prediction:
    """:func:`predict_plan` of the plan ``replicas`` describe, costed from the description: the
    plan itself is built (and checked) only when the prediction's ``plan`` is first read. For
    the planner, which costs many large plans and shows a few. Raises ``ValueError`` (naming
    ``replicas``) where the runtime would refuse a stage."""
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches: must be an integer >= 1, got {microbatches!r}")
    if schedule not in ("GPipe", "1F1B"):
        raise ValueError(f"schedule: must be 'GPipe' or '1F1B', got {schedule!r}")
    if not replicas:
        raise ValueError("replicas: must hold at least one replica")
    entries = []
    for i, (samples, stages) in enumerate(replicas):
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise ValueError(f"replicas[{i}]: samples must be an integer >= 1, got {samples!r}")
        if not stages:
            raise ValueError(f"replicas[{i}]: has no stages")
        blocks = [np.atleast_2d(np.asarray(r, dtype=np.int64)) for r, _, _ in stages]
        if len({len(x) for x in blocks}) != 1 or min(x.size for x in blocks) == 0:
            raise ValueError(f"replicas[{i}]: every stage needs ranks, as many rows each")
        entries.append((samples, stages, blocks))
    costs.check_plan_layers()
    # Entries of one template (samples, and per stage its size, layers and speeds) are laid
    # out once; within a template, the replicas whose ranks sit on the same kinds of device
    # and send over the same links are one class, found with numpy over every member's ranks
    # at once.
    templates: dict[tuple[Any, ...], list[int]] = {}
    for i, (samples, stages, blocks) in enumerate(entries):
        shape = (
            samples,
            tuple((x.shape[1], tuple(lay), sp) for x, (_, lay, sp) in zip(blocks, stages)),
        )
        templates.setdefault(shape, []).append(i)
    dev_kind = device_arrays(cluster.devices).kind
    node_of = _cluster_facts(cluster).node_of
    node_link = _node_link_ids(cluster)
    n_links = int(node_link.max()) + 1
    link_ids: dict[Link, int] = {}
    between: dict[int, int] = {}

    def link_id(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        # The link between devices a and b (arrays) depends on whether they share a node and
        # on their nodes' links only: one link_between per distinct case, each case (same
        # node, a's node's link, b's) one integer, numbered in the order of those triples.
        na, nb = node_of[a], node_of[b]
        cases = ((na == nb) * n_links + node_link[na]) * n_links + node_link[nb]
        unique, first, inverse = np.unique(cases, return_index=True, return_inverse=True)
        ids = []
        for key, f in zip(unique.tolist(), first.tolist()):
            if key not in between:
                link = cluster.link_between(int(a[f]), int(b[f]))
                between[key] = link_ids.setdefault(link, len(link_ids))
            ids.append(between[key])
        return np.asarray(ids, dtype=np.int64)[inverse.reshape(-1)]

    def ring_id(block: np.ndarray) -> np.ndarray:
        # A split stage's ring: its node's link when its ranks share a node, else worked out.
        nodes = node_of[block]
        one = (nodes == nodes[:, :1]).all(axis=1)
        out = np.empty(len(block), dtype=np.int64)
        for r in np.flatnonzero(~one):
            link = _ring_link_of(cluster, block[r], node_link)
            out[r] = link_ids.setdefault(link, len(link_ids))
        if one.any():
            # Per distinct node link, its id among link_ids (several ranks on the node: a link).
            first = nodes[one, 0]
            kinds, at = np.unique(node_link[first], return_index=True)
            table = np.zeros(int(node_link.max()) + 1, dtype=np.int64)
            for nl, i in zip(kinds.tolist(), at.tolist()):
                inside = cluster.nodes[int(first[i])].link
                assert inside is not None
                table[nl] = link_ids.setdefault(inside, len(link_ids))
            out[one] = table[node_link[first]]
        return out

    classes: list[tuple[_ReplicaLayout, np.ndarray]] = []
    for (samples, _), members in templates.items():
        i = members[0]
        stages = entries[i][1]
        sizes_of = [x.shape[1] for x in entries[i][2]]
        laid = []
        for j, (_, layers, speeds) in enumerate(stages):
            where = f"replicas[{i}].stages[{j}]"
            last = j + 1 == len(stages)
            first_ranks = tuple(entries[i][2][j][0].tolist())
            span = (int(layers[0]), int(layers[1]))
            laid.append(_stage_layout(costs, first_ranks, span, last, speeds, None, where))
        ranks_of = np.vstack([np.hstack(entries[x][2]) for x in members])
        signature = [dev_kind[ranks_of]]
        col, starts = 0, []
        for size in sizes_of:
            starts.append(col)
            col += size
        for j, size in enumerate(sizes_of):
            lead = ranks_of[:, starts[j]]
            for k in (j - 1, j + 1):
                if 0 <= k < len(stages):
                    for c in range(starts[k], starts[k] + sizes_of[k]):
                        signature.append(link_id(lead, ranks_of[:, c])[:, None])
            if size > 1:  # the ring of a split stage's collectives
                block = ranks_of[:, starts[j] : starts[j] + size]
                signature.append(ring_id(block)[:, None])
        first, inverse = _unique_rows(np.hstack(signature))
        sizes = tuple(microbatch_sizes(samples, microbatches))
        for c, f in enumerate(first):
            rows = ranks_of[inverse == c]
            rep_ranks = ranks_of[f].tolist()
            rep_stages = []
            for j, st in enumerate(laid):
                picked = tuple(rep_ranks[starts[j] : starts[j] + len(st.ranks)])
                rep_stages.append(
                    _StageLayout(
                        picked,
                        st.lo,
                        st.hi,
                        st.out_bytes_per_sample,
                        st.parts,
                        st.modes,
                        st.layer_shares,
                    )
                )
            # The class's first row is the replica simulated for it.
            rows = np.vstack([ranks_of[f][None, :], rows[(rows != ranks_of[f]).any(axis=1)]])
            classes.append((_ReplicaLayout(samples, sizes, tuple(rep_stages)), rows))
    pred = _layout_schedule(
        costs,
        cluster,
        [rep for rep, _ in classes],
        schedule,
        optimizer_state_copies,
        strategy,
        classes,
    ).prediction()

    def build() -> Plan:
        return Plan.from_dict(
            {
                "microbatches": microbatches,
                "schedule": schedule,
                "replicas": [
                    {
                        "samples": samples,
                        "stages": [
                            {
                                "ranks": block[row].tolist(),
                                "layers": list(layers),
                                **({"speeds": list(speeds)} if speeds is not None else {}),
                            }
                            for block, (_, layers, speeds) in zip(blocks, stages)
                        ],
                    }
                    for samples, stages, blocks in entries
                    for row in range(len(blocks[0]))
                ],
            }
        )

    pred.plan_factory = build
    return pred


@dataclass
class _Memo:
    """What the predictions of one model on one cluster share: each layer's times per
    micro-batch size on each kind of device (``times``) and the stages' work (``work``), which
    the planner's candidates repeat (the same layers on the same kind of device at the same
    micro-batch, under both schedules)."""

    times: dict[int, LayerSeconds] = field(default_factory=dict)
    work: dict[tuple[Any, ...], _StageWork] = field(default_factory=dict)


#: The memos of the last few (costs, cluster) pairs, by identity (both are frozen), least
#: recently used first out; each holds at most ``_MEMO_ENTRIES`` stages' work.
_MEMOS: dict[tuple[int, int], tuple[ModelCosts, Cluster, _Memo]] = {}
_MEMO_ENTRIES = 4096


def _memo(costs: ModelCosts, cluster: Cluster) -> _Memo:
    key = (id(costs), id(cluster))
    hit = _MEMOS.pop(key, None)
    if hit is None or hit[0] is not costs or hit[1] is not cluster:
        hit = (costs, cluster, _Memo())
        if len(_MEMOS) >= 4:
            _MEMOS.pop(next(iter(_MEMOS)))
    _MEMOS[key] = hit
    return hit[2]


@dataclass
class _StageWork:
    """One stage's work on one micro-batch size, per rank of the stage: forward and backward
    as ("compute", s, ((layer, s, "F" or "B"), ...)) and ("collective", layer, s) pieces,
    the causes of its compute (compute, memory, overhead seconds), bytes of its weights,
    gradients and optimizer state, activation bytes it keeps per sample, and its optimizer
    step."""

    forward: list[list[tuple[Any, ...]]]
    backward: list[list[tuple[Any, ...]]]
    causes: np.ndarray  # (3, ranks)
    state_bytes: np.ndarray
    saved_per_sample: float
    update_s: np.ndarray


def _stage_work(
    costs: ModelCosts,
    cluster: Cluster,
    stage: _StageLayout,
    batch: int,
    times: Any,
    state_copies: int,
    subset: Cluster | None = None,
) -> _StageWork:
    """The work of ``stage`` at ``batch`` samples (``subset``: ``cluster.subset`` of a split
    stage's ranks, when the caller has it already). Shared by the stages alike (the caller's
    memo): read only."""
    lo, hi = stage.lo, stage.hi
    if len(stage.ranks) == 1:
        d = stage.ranks[0]
        lt, column = times(batch)  # per kind of device, and each device's kind
        c = column[d]
        owned = float(sum(x.param_bytes for x in costs.layers[lo:hi]))
        mem_bw = cluster.devices[d].mem_bytes_per_s
        fwd_s, bwd_s = lt.forward_s[lo:hi, c], lt.backward_s[lo:hi, c]
        fwd_parts = tuple((lo + i, float(t), "F") for i, t in enumerate(fwd_s))
        bwd_parts = tuple((hi - 1 - i, float(t), "B") for i, t in enumerate(bwd_s[::-1]))
        return _StageWork(
            [[("compute", float(fwd_s.sum()), fwd_parts)]],
            [[("compute", float(bwd_s.sum()), bwd_parts)]],
            np.array(
                [
                    [lt.compute_s[lo:hi, c].sum()],
                    [lt.memory_s[lo:hi, c].sum()],
                    [lt.overhead_s[lo:hi, c].sum()],
                ]
            ),
            np.array([owned * (2 + state_copies)]),
            float(sum(x.saved_bytes_per_sample for x in costs.layers[lo:hi])),
            np.array([float(terms.optimizer_update_seconds(owned, mem_bw, state_copies))]),
        )
    assert stage.modes is not None
    sub = replace(
        costs,
        layers=costs.layers[lo:hi],
        filter_modes=tuple(stage.modes.items()),
        plan_layers=(),
        plan_layer_of=(),
        plan_out_bytes=(),
        plan_layer_kinds=(),
        stage_modes=(),
    )
    sched = filter_parallel_schedule(
        sub,
        subset if subset is not None else cluster.subset(stage.ranks),
        batch,
        stage.parts,
        modes=stage.modes,
        optimizer_state_copies=state_copies,
        layer_shares=stage.layer_shares,
    )
    fwd, bwd, lt = [], [], sched.layers
    f_comm = sched.forward_collective_s.tolist()
    b_comm = sched.backward_collective_s.tolist()

    def pieces(seconds: list[float], comm: list[float], layers: range, op: str) -> list[Any]:
        # The layers' compute between two collectives as one piece (summed in layer order,
        # as the simulation would add them, its layers' parts kept), each collective a piece
        # of its own.
        out: list[tuple[Any, ...]] = []
        for i in layers:
            part = ((lo + i, seconds[i], op),)
            if out and out[-1][0] == "compute":
                out[-1] = ("compute", out[-1][1] + seconds[i], out[-1][2] + part)
            else:
                out.append(("compute", seconds[i], part))
            if comm[i] > 0:
                out.append(("collective", (op, i), comm[i]))
        return out

    forward_s, backward_s = lt.forward_s.T.tolist(), lt.backward_s.T.tolist()
    for j in range(len(stage.ranks)):
        fwd.append(pieces(forward_s[j], f_comm, range(hi - lo), "F"))
        bwd.append(pieces(backward_s[j], b_comm, range(hi - lo - 1, -1, -1), "B"))
    saved = sub.saved_bytes_per_sample()
    return _StageWork(
        fwd,
        bwd,
        np.stack([lt.compute_s.sum(axis=0), lt.memory_s.sum(axis=0), lt.overhead_s.sum(axis=0)]),
        sched.memory_bytes - batch * saved,
        saved,
        sched.update_s,
    )


class _ReplicaKeys:
    """What a replica's simulated step depends on (:meth:`key`): its samples and
    micro-batches, and per stage its layers and split, the kinds of device it runs on, the
    links its stage's collectives and its sends cross. Replicas with equal keys run alike
    (their ranks aside). Kinds and links are small integers, looked up once per device kind
    and per pair of nodes (hashing a Device or a Link per rank would cost more than the
    simulation it saves); a stage's split is named by the identity of its modes and shares,
    which stages built alike share (equal identity implies equal content)."""

    def __init__(self, cluster: Cluster, kind: np.ndarray) -> None:
        self.cluster = cluster
        self.nodes = cluster.node_of_device
        self.kind = kind.tolist()
        self.ids: dict[Link, int] = {}
        self.links: dict[tuple[int, int], int] = {}
        self.rings: dict[tuple[bool, frozenset[Link]], int] = {}

    def _id(self, link: Link) -> int:
        return self.ids.setdefault(link, len(self.ids))

    def link(self, a: int, b: int) -> int:
        pair = (self.nodes[a], self.nodes[b])
        if pair not in self.links:
            self.links[pair] = self._id(self.cluster.link_between(a, b))
        return self.links[pair]

    def ring(self, ranks: tuple[int, ...]) -> int:
        # A ring over these ranks crosses the network when they span nodes, and the link of
        # every node holding two of them or more (Cluster.subset(...).ring_link()).
        count: dict[int, int] = {}
        for d in ranks:
            count[self.nodes[d]] = count.get(self.nodes[d], 0) + 1
        nodes = self.cluster.nodes
        inside = frozenset(
            link for n, c in count.items() if c > 1 and (link := nodes[n].link) is not None
        )
        shape = (len(count) > 1, inside)
        if shape not in self.rings:
            self.rings[shape] = self._id(self.cluster.subset(list(ranks)).ring_link())
        return self.rings[shape]

    def key(self, rep: _ReplicaLayout) -> tuple[Any, ...]:
        key: list[Any] = [rep.samples, rep.micro]
        kind = self.kind
        for s, st in enumerate(rep.stages):
            nxt = rep.stages[s + 1].ranks if s + 1 < len(rep.stages) else ()
            prev = rep.stages[s - 1].ranks if s > 0 else ()
            lead = st.ranks[0]
            key.append(
                (
                    st.lo,
                    st.hi,
                    st.out_bytes_per_sample,
                    st.parts,
                    id(st.modes),
                    id(st.layer_shares),
                    tuple(kind[d] for d in st.ranks),
                    self.ring(st.ranks) if len(st.ranks) > 1 else None,
                    tuple(self.link(lead, e) for e in nxt),
                    tuple(self.link(lead, e) for e in prev),
                )
            )
        return tuple(key)


def _flat_ranks(rep: _ReplicaLayout) -> list[int]:
    return [d for st in rep.stages for d in st.ranks]


def _replica_classes(
    cluster: Cluster, replicas: Sequence[_ReplicaLayout], kind: np.ndarray
) -> list[tuple[_ReplicaLayout, np.ndarray]]:
    """The replicas grouped by :class:`_ReplicaKeys`: each group's first replica, and every
    member's ranks (a row each, the first replica's first, in its stages' order)."""
    keys = _ReplicaKeys(cluster, kind)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for r, rep in enumerate(replicas):
        groups.setdefault(keys.key(rep), []).append(r)
    return [
        (replicas[members[0]], np.array([_flat_ranks(replicas[r]) for r in members]))
        for members in groups.values()
    ]


def _ring_link_of(cluster: Cluster, ranks: np.ndarray, node_link: np.ndarray) -> Link:
    """``cluster.subset(ranks).ring_link()`` without building the subset: the ring crosses the
    link of each node holding two or more of ``ranks`` and the network when they span nodes,
    so a few nodes stand for all (``node_link``: an id per node, equal for equal links)."""
    nodes = _cluster_facts(cluster).node_of[ranks] if len(ranks) else np.zeros(0, int)
    counts = np.bincount(nodes, minlength=len(cluster.nodes))
    present = np.flatnonzero(counts)
    shared = np.flatnonzero(counts >= 2)
    _, first = np.unique(node_link[shared], return_index=True)
    picked = [replace(cluster.nodes[n], count=2) for n in shared[first]]
    if len(present) > 1 and len(picked) < 2:
        others = [n for n in present[:3] if n not in set(shared[first].tolist())]
        picked += [replace(cluster.nodes[n], count=1) for n in others[: 2 - len(picked)]]
    if not picked:
        return Link("local", 0.0, math.inf)
    return Cluster(picked, cluster.network if len(picked) > 1 else None).ring_link()


_NODE_LINKS: dict[int, tuple[Sequence[Any], np.ndarray]] = {}


@dataclass(frozen=True)
class _ClusterFacts:
    """What the predictors read of a cluster for every candidate, worked out once:
    ``node_of``, each device's node (an array); ``first_of_kind``, the first device of each
    kind (:func:`device_arrays`); ``ring_link``, ``cluster.ring_link()``."""

    node_of: np.ndarray
    first_of_kind: np.ndarray
    ring_link: Link


_FACTS: dict[int, tuple[Cluster, _ClusterFacts]] = {}


def _cluster_facts(cluster: Cluster) -> _ClusterFacts:
    """:class:`_ClusterFacts` of ``cluster`` (cached for the last few clusters, by identity:
    a cluster is frozen)."""
    hit = _FACTS.pop(id(cluster), None)
    if hit is None or hit[0] is not cluster:
        _, first = np.unique(device_arrays(cluster.devices).kind, return_index=True)
        hit = (
            cluster,
            _ClusterFacts(np.asarray(cluster.node_of_device), first, cluster.ring_link()),
        )
        if len(_FACTS) >= 16:
            _FACTS.pop(next(iter(_FACTS)))
    _FACTS[id(cluster)] = hit
    return hit[1]


def _unique_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(rows, axis=0, return_index=True, return_inverse=True)`` without its
    unique rows: the index of each distinct row's first occurrence, in the rows' sorted
    order, and each row's number among them. The same numbers, from one integer per row
    (the rows of non-negative integers read as digits, renumbered in order whenever the
    next digit would overflow int64) rather than a sort of structured rows, several times
    faster on a cluster's ranks.

    >>> _unique_rows(np.array([[1, 0], [0, 5], [1, 0]]))
    (array([1, 0]), array([1, 0, 1]))
    """
    rows = np.asarray(rows)
    if (
        rows.ndim != 2
        or not rows.size
        or rows.dtype.kind not in "iu"
        or rows.min() < 0
        or rows.max() >= 2**31
    ):
        _, first, inverse = np.unique(rows, axis=0, return_index=True, return_inverse=True)
        return first, inverse.reshape(-1)
    code = np.zeros(len(rows), dtype=np.int64)
    top = 1  # code < top
    for col in rows.T.astype(np.int64):
        base = int(col.max()) + 1
        if top * base >= 2**62:
            _, code = np.unique(code, return_inverse=True)  # same order, dense
            code, top = code.reshape(-1).astype(np.int64), int(code.max()) + 1
        code = code * base + col
        top *= base
    _, first, inverse = np.unique(code, return_index=True, return_inverse=True)
    return first, inverse.reshape(-1)


def _node_link_ids(cluster: Cluster) -> np.ndarray:
    """An id per node of ``cluster``, equal for nodes with equal links (cached per node list)."""
    hit = _NODE_LINKS.get(id(cluster.nodes))
    if hit is not None and hit[0] is cluster.nodes:
        return hit[1]
    by_id: dict[int, int] = {}
    ids: dict[Any, int] = {}
    out = np.array(
        [
            by_id[id(n.link)]
            if id(n.link) in by_id
            else by_id.setdefault(id(n.link), ids.setdefault(n.link, len(ids)))
            for n in cluster.nodes
        ]
    )
    if len(_NODE_LINKS) >= 16:
        _NODE_LINKS.pop(next(iter(_NODE_LINKS)))
    _NODE_LINKS[id(cluster.nodes)] = (cluster.nodes, out)
    return out


@dataclass(frozen=True)
class PlanSchedule:
    """One step of a plan laid out as programs (what :func:`predict_plan` times).

    ``programs[x]`` lists the operations device ``program_devices[x]`` runs, in the order the
    runtime runs them, as :func:`hetcoll.model.terms.schedule_finish_seconds` reads them; each
    ``("compute", s, parts)`` carries ``parts``, the ``(layer, seconds, "F" or "B")`` it is made
    of (``layer`` indexes ``costs.layers``; forward or backward), so that a caller can re-time
    the work layer by layer. Devices of replicas that run alike share one replica's programs
    (``copy_of[d]``: the device whose figures device d takes; :func:`plan_schedule` lays every
    replica out); idle devices have none (they wait in the loss's allreduce).
    ``collectives``: each collective's participants and seconds. Per device: ``causes``, the
    compute, memory and overhead seconds of its layers; ``state_bytes`` / ``activation_bytes``,
    what it holds; ``update_s``, its optimizer step; ``samples``, its replica's samples (0:
    idle). :meth:`prediction` times the programs; a caller that times them otherwise (on other
    hardware, say) passes each program's finish time and seconds in collectives.

    >>> plan_schedule(costs, cluster, Plan.load("plan.json")).prediction().step_s  # doctest: +SKIP
    """

    programs: list[list[tuple[Any, ...]]]
    collectives: dict[object, tuple[int, float]]
    causes: np.ndarray  # (3, devices)
    state_bytes: np.ndarray
    activation_bytes: np.ndarray
    update_s: np.ndarray
    samples: list[int]
    devices: tuple[Device, ...]
    schedule: str
    strategy: str
    detail: dict[str, Any]
    program_devices: tuple[int, ...]
    copy_of: np.ndarray

    def prediction(
        self,
        finish_s: Sequence[float] | None = None,
        collective_s: Sequence[float] | None = None,
    ) -> Prediction:
        """The step: the programs timed by
        :func:`~hetcoll.model.terms.schedule_finish_seconds`, or ``finish_s`` (when each
        program ends) and ``collective_s`` (its seconds inside collectives) timed by the
        caller, then each device's optimizer update."""
        if finish_s is None or collective_s is None:
            finish_s, collective_s = terms.schedule_finish_seconds(self.programs, self.collectives)
        n_dev = len(self.devices)
        # Every rank leaves the loss's allreduce at the same moment; an idle rank spends its
        # step in it.
        finish = np.full(n_dev, float(finish_s[0]) if len(finish_s) else 0.0)
        in_collectives = np.full(n_dev, float(self.detail["loss_allreduce_s"]))
        for x, d in enumerate(self.program_devices):
            finish[d] = finish_s[x]
            in_collectives[d] = collective_s[x]
        finish, in_collectives = finish[self.copy_of], in_collectives[self.copy_of]
        update = self.update_s
        end = finish + update
        step = float(end.max())
        busy = self.causes.sum(axis=0)
        crit = int(np.argmax(busy))
        breakdown = {
            "compute": float(self.causes[0, crit]),
            "memory": float(self.causes[1, crit]),
            "overhead": float(self.causes[2, crit]),
            "communication": float(in_collectives[crit]),
            "optimizer": float(update.max()),
        }
        breakdown["bubble"] = max(0.0, step - sum(breakdown.values()))
        mem = self.state_bytes + self.activation_bytes
        reason = memory_shortfall(mem, self.devices)
        return Prediction(
            self.strategy,
            list(self.samples),
            "samples of its replica",
            step,
            breakdown,
            mem.tolist(),
            not reason,
            reason,
            int(self.detail["batch"]),
            {
                **{k: v for k, v in self.detail.items() if k != "batch"},
                "critical_device": crit,
            },
        )


def plan_schedule(
    costs: ModelCosts,
    cluster: Cluster,
    plan: Plan,
    *,
    optimizer_state_copies: int = 1,
    strategy: str = "plan",
) -> PlanSchedule:
    """One step of ``plan`` laid out as every device's program (:class:`PlanSchedule`; no
    replica shares another's), as :func:`predict_plan` simulates it; raises as
    :func:`predict_plan` does."""
    layout = _plan_layout(costs, cluster, plan)
    return _layout_schedule(
        costs, cluster, layout, plan.schedule, optimizer_state_copies, strategy, group=False
    )


def _layout_schedule(
    costs: ModelCosts,
    cluster: Cluster,
    replicas: Sequence[_ReplicaLayout],
    schedule: str,
    state_copies: int,
    strategy: str,
    classes: Sequence[tuple[_ReplicaLayout, np.ndarray]] | None = None,
    *,
    group: bool = True,
) -> PlanSchedule:
    """Lay out one step of the plan (:func:`plan_schedule`).

    Replicas that run alike (:class:`_ReplicaKeys`; ``classes``: already grouped, as
    (replica, every member's ranks); ``group=False``: every replica its own class) are laid
    out once: the gradient sums and the loss's allreduce are timed over all their holders, but
    only one replica of each class has programs, and the others copy its figures. That is the
    same step (the copies would reach every collective at the same moment), at the cost of the
    distinct replicas only: a 10,240-device plan of a few kinds of replica simulates a few."""
    from hetcoll.torch.parallel import schedule_order

    devices = cluster.devices
    n_dev = len(devices)
    dev = device_arrays(devices)
    memo = _memo(costs, cluster)
    cache = memo.times
    facts = _cluster_facts(cluster)
    first_of_kind = facts.first_of_kind
    kinds = dev.columns(first_of_kind)

    def times(b: int) -> tuple[LayerSeconds, np.ndarray]:
        # Every layer's times at b samples on each kind of device (columns), and each
        # device's kind.
        if b not in cache:
            cache[b] = _layer_times(costs, kinds, np.full(len(first_of_kind), b))
        return cache[b], dev.kind

    def stage_work(stage: _StageLayout, b: int) -> _StageWork:
        # A stage's work depends on its layers and split, the kinds of its devices, the ring
        # its collectives cross (a split stage), the micro-batch and the optimizer: stages
        # alike in those share it, within a search and across its candidates.
        if len(stage.ranks) == 1:
            key: tuple[Any, ...] = (stage.lo, stage.hi, int(dev.kind[stage.ranks[0]]), b)
            sub = cluster
        else:
            sub = cluster.subset(list(stage.ranks))
            ring = sub.ring_link()
            assert stage.modes is not None
            key = (
                stage.lo,
                stage.hi,
                tuple(int(dev.kind[d]) for d in stage.ranks),
                b,
                ring.latency_s,
                ring.bytes_per_s,
                stage.parts,
                tuple(stage.modes.items()),
                None
                if stage.layer_shares is None
                else tuple((k, tuple(v)) for k, v in stage.layer_shares.items()),
            )
        key += (state_copies,)
        hit = memo.work.get(key)
        if hit is None:
            hit = _stage_work(costs, cluster, stage, b, times, state_copies, sub)
            if len(memo.work) >= _MEMO_ENTRIES:
                memo.work.clear()
            memo.work[key] = hit
        return hit

    if classes is None and not group:
        classes = [(rep, np.array([_flat_ranks(rep)])) for rep in replicas]
    elif classes is None:
        classes = _replica_classes(cluster, replicas, dev.kind)
    link_of: dict[tuple[int, int], Link] = {}  # the link of each send, looked up once
    local: dict[int, int] = {}  # simulated device -> its program
    for rep, _ in classes:
        for st in rep.stages:
            for d in st.ranks:
                local[d] = len(local)
    programs: list[list[tuple[Any, ...]]] = [[] for _ in local]
    collectives: dict[object, tuple[int, float]] = {}
    causes = np.zeros((3, n_dev))
    state = np.zeros(n_dev)
    activations = np.zeros(n_dev)
    update = np.zeros(n_dev)
    for r, (rep, _) in enumerate(classes):
        n_st, m = len(rep.stages), len(rep.micro)
        for s, stage in enumerate(rep.stages):
            work = {b: stage_work(stage, b) for b in sorted(set(rep.micro))}
            any_work = work[rep.micro[0]]
            order = schedule_order(schedule, s, n_st, m)
            # Activations kept at once: every micro-batch under GPipe; under 1F1B the forwards
            # a stage runs ahead of its first backward, plus one.
            ahead = m if schedule == "GPipe" else min(n_st - s, m)
            kept = sum(sorted(rep.micro, reverse=True)[:ahead])
            lead = stage.ranks[0]
            prev = rep.stages[s - 1] if s > 0 else None
            nxt = rep.stages[s + 1] if s + 1 < n_st else None
            # Each forward adds its micro-batch's causes (forward and backward) to the stage's
            # devices, in the schedule's order: all ranks at once (the same additions).
            columns = list(stage.ranks)
            acc = causes[:, columns]
            for op, k in order:
                if op == "F":
                    acc += work[rep.micro[k]].causes
            causes[:, columns] = acc
            for j, d in enumerate(stage.ranks):
                state[d] = any_work.state_bytes[j]
                update[d] = any_work.update_s[j]
                activations[d] = any_work.saved_per_sample * kept
                prog = programs[local[d]]
                for op, k in order:
                    w = work[rep.micro[k]]
                    if op == "F":
                        if prev is not None:
                            prog.append(("recv", ("act", r, s, k, d)))
                        pieces = w.forward[j]
                    else:
                        if nxt is not None:
                            prog.append(("recv", ("grad", r, s, k, d)))
                        pieces = w.backward[j]
                    for piece in pieces:
                        if piece[0] == "compute":
                            if prog and prog[-1][0] == "compute":
                                last = prog[-1]
                                prog[-1] = ("compute", last[1] + piece[1], last[2] + piece[2])
                            else:
                                prog.append(piece)
                        else:
                            key = (r, s, k, op, piece[1])
                            collectives[key] = (len(stage.ranks), piece[2])
                            prog.append(("collective", key))
                    if d != lead:
                        continue
                    to, kind, nbytes = (
                        (nxt, "act", stage.out_bytes_per_sample)
                        if op == "F"
                        else (prev, "grad", prev.out_bytes_per_sample if prev else 0.0)
                    )
                    if to is None:
                        continue
                    at = s + 1 if op == "F" else s - 1
                    sends = []
                    for e in to.ranks:
                        if (d, e) not in link_of:
                            link_of[d, e] = cluster.link_between(d, e)
                        link = link_of[d, e]
                        sends.append(
                            (
                                (kind, r, at, k, e),
                                link.latency_s,
                                nbytes * rep.micro[k] / link.bytes_per_s,
                            )
                        )
                    prog.append(("send", tuple(sends)))
                prog.append(("wait_sends",))
    # Every other replica's devices copy those of the replica simulated for it.
    source = np.arange(n_dev)
    samples_of = np.zeros(n_dev, dtype=np.int64)
    for rep, members in classes:
        source[members.ravel()] = np.broadcast_to(members[0], members.shape).ravel()
        samples_of[members.ravel()] = rep.samples
    causes, state, activations, update = (
        causes[:, source],
        state[source],
        activations[source],
        update[source],
    )
    # Gradients of parameters held in several replicas: one allreduce of full-size buffers per
    # set of holders, in layer order. Layers between the same stage boundaries share holders.
    groups: dict[tuple[int, ...], list[Any]] = {}
    if sum(len(members) for _, members in classes) > 1:
        node_link = _node_link_ids(cluster)
        cuts = sorted({x for rep, _ in classes for st in rep.stages for x in (st.lo, st.hi)})
        for a, b in itertools.pairwise(cuts):
            parts, taking_part = [], []
            for rep, members in classes:
                col = 0
                for st in rep.stages:
                    if st.lo <= a < st.hi:
                        parts.append(members[:, col : col + len(st.ranks)].ravel())
                        taking_part += [local[d] for d in st.ranks]
                    col += len(st.ranks)
            mask = np.zeros(n_dev, dtype=bool)  # (np.unique of the parts, without a sort)
            mask[np.concatenate(parts)] = True
            held = np.flatnonzero(mask)
            nbytes = sum(costs.layers[i].param_bytes for i in range(a, b))
            if nbytes <= 0:
                continue
            holders = tuple(held.tolist())
            if holders in groups:
                groups[holders][0] += nbytes
            else:
                groups[holders] = [nbytes, held, taking_part, node_link]
    reduce_s = 0.0
    for g, (nbytes, held, taking_part, node_link) in enumerate(groups.values()):
        link = _ring_link_of(cluster, held, node_link)
        seconds = float(
            terms.ring_allreduce_seconds(
                nbytes,
                len(held),
                link.latency_s,
                link.bytes_per_s,
                float(dev.mem_bytes_per_s[held].min()),
                costs.itemsize,
            )
        )
        collectives[("sum", g)] = (len(taking_part), seconds)
        reduce_s += seconds
        for x in taking_part:
            programs[x].append(("collective", ("sum", g)))
        state[held] += nbytes  # the full-size buffer the gradients are summed in
    # The loss, summed over every rank of the group (one float64); idle ranks join it at once.
    link = facts.ring_link
    loss_s = float(
        terms.ring_allreduce_seconds(
            8.0, n_dev, link.latency_s, link.bytes_per_s, float(dev.mem_bytes_per_s.min()), 8
        )
    )
    collectives["loss"] = (len(programs), loss_s)
    for prog in programs:
        prog.append(("collective", "loss"))
    return PlanSchedule(
        programs,
        collectives,
        causes,
        state,
        activations,
        update,
        samples_of.tolist(),
        tuple(devices),
        schedule,
        strategy,
        {
            "batch": sum(rep.samples * len(members) for rep, members in classes),
            "schedule": schedule,
            "micro_batches": max(len(rep.micro) for rep, _ in classes),
            "replicas": sum(len(members) for _, members in classes),
            "stages": max(len(rep.stages) for rep, _ in classes),
            "idle_devices": np.flatnonzero(samples_of == 0).tolist(),
            "gradient_allreduce_s": reduce_s,
            "loss_allreduce_s": loss_s,
            "simulated_replicas": len(classes),
        },
        tuple(local),
        source,
    )


def predict_plan(
    costs: ModelCosts,
    cluster: Cluster,
    plan: Plan,
    *,
    optimizer_state_copies: int = 1,
    strategy: str = "plan",
) -> Prediction:
    """One step of ``plan`` (device i = rank i) as :func:`hetcoll.torch.parallelize` runs it.

    Each replica cuts its samples into the plan's micro-batches (uneven when they do not
    divide) and runs them through its stages under the plan's schedule (GPipe or 1F1B). A
    one-rank stage computes its layers (the terms :func:`data_parallel` uses); a stage over
    several ranks is the filter-parallel step of its layers on those ranks
    (:func:`filter_parallel_schedule`, modes as the runtime pairs the stage's layers: see
    :meth:`ModelCosts.stage_filter_modes`), ranks in lock step between its collectives. A
    stage's first rank sends its output to every rank of the next stage, and the gradient
    back, over the link between them (:func:`terms.point_to_point_seconds`; non-blocking,
    one message after another on the sender's link). Then the parameters held by several
    replicas are summed (one ring allreduce of full-size buffers per set of holders), every
    rank sums the loss (one float), and each device updates what it holds. The schedule's
    dependency graph is simulated event by event (:func:`terms.schedule_finish_seconds`), not
    a closed formula. Idle devices compute nothing; they join the loss allreduce.

    ``shares`` are the samples of each device's replica (0: idle); ``breakdown``: the busiest
    device's compute, memory stalls, kernel overheads and collectives, the optimizer, and
    the rest (``bubble``: waiting for other stages and ranks). Raises ``ValueError`` when the
    plan does not fit the model (layer count, a split the runtime refuses) or the cluster.

    >>> predict_plan(costs, cluster, Plan.load("plan.json")).step_s  # doctest: +SKIP
    """
    # Replicas that run alike are simulated once (the same step: :func:`_layout_schedule`).
    layout = _plan_layout(costs, cluster, plan)
    pred = _layout_schedule(
        costs, cluster, layout, plan.schedule, optimizer_state_copies, strategy
    ).prediction()
    pred.plan = plan
    return pred
