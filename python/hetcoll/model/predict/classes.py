"""Replica classes: replicas that run alike (the same samples, layers and splits on the same
kinds of device over the same links) grouped so that one of each class is simulated
(:func:`replica_classes`), and the facts of a cluster this reads for every candidate, worked out
once: each device's node and kind (:func:`cluster_facts`), an id per kind of node link
(:func:`node_link_ids`), the link a ring over some ranks crosses (:func:`ring_link_of`) and
distinct rows numbered in numpy (:func:`unique_rows`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from hetcoll.model.hardware import Cluster, Link
from hetcoll.model.predict.layout import ReplicaLayout
from hetcoll.model.predict.timing import device_arrays


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

    def key(self, rep: ReplicaLayout) -> tuple[Any, ...]:
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


def flat_ranks(rep: ReplicaLayout) -> list[int]:
    """The replica's ranks, stage after stage."""
    return [d for st in rep.stages for d in st.ranks]


def replica_classes(
    cluster: Cluster, replicas: Sequence[ReplicaLayout], kind: np.ndarray
) -> list[tuple[ReplicaLayout, np.ndarray]]:
    """The replicas grouped by :class:`_ReplicaKeys`: each group's first replica, and every
    member's ranks (a row each, the first replica's first, in its stages' order)."""
    keys = _ReplicaKeys(cluster, kind)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for r, rep in enumerate(replicas):
        groups.setdefault(keys.key(rep), []).append(r)
    return [
        (replicas[members[0]], np.array([flat_ranks(replicas[r]) for r in members]))
        for members in groups.values()
    ]


def ring_link_of(cluster: Cluster, ranks: np.ndarray, node_link: np.ndarray) -> Link:
    """``cluster.subset(ranks).ring_link()`` without building the subset: the ring crosses the
    link of each node holding two or more of ``ranks`` and the network when they span nodes,
    so a few nodes stand for all (``node_link``: an id per node, equal for equal links)."""
    nodes = cluster_facts(cluster).node_of[ranks] if len(ranks) else np.zeros(0, int)
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
class ClusterFacts:
    """What the predictors read of a cluster for every candidate, worked out once:
    ``node_of``, each device's node (an array); ``first_of_kind``, the first device of each
    kind (:func:`device_arrays`); ``ring_link``, ``cluster.ring_link()``."""

    node_of: np.ndarray
    first_of_kind: np.ndarray
    ring_link: Link


_FACTS: dict[int, tuple[Cluster, ClusterFacts]] = {}


def cluster_facts(cluster: Cluster) -> ClusterFacts:
    """:class:`ClusterFacts` of ``cluster`` (cached for the last few clusters, by identity:
    a cluster is frozen)."""
    hit = _FACTS.pop(id(cluster), None)
    if hit is None or hit[0] is not cluster:
        _, first = np.unique(device_arrays(cluster.devices).kind, return_index=True)
        hit = (
            cluster,
            ClusterFacts(np.asarray(cluster.node_of_device), first, cluster.ring_link()),
        )
        if len(_FACTS) >= 16:
            _FACTS.pop(next(iter(_FACTS)))
    _FACTS[id(cluster)] = hit
    return hit[1]


def unique_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(rows, axis=0, return_index=True, return_inverse=True)`` without its
    unique rows: the index of each distinct row's first occurrence, in the rows' sorted
    order, and each row's number among them. The same numbers, from one integer per row
    (the rows of non-negative integers read as digits, renumbered in order whenever the
    next digit would overflow int64) rather than a sort of structured rows, several times
    faster on a cluster's ranks.

    >>> unique_rows(np.array([[1, 0], [0, 5], [1, 0]]))
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


def node_link_ids(cluster: Cluster) -> np.ndarray:
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
