"""Which devices the planner tries a plan on: the kinds of device fastest first, the device
subsets (the fastest kinds, the strongest node, the first nodes), the groups of a node's devices
a filter-split stage runs on, and the first k nodes (the points of ``sweep(..., "nodes")``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hetcoll.model.hardware import Cluster

#: On clusters of up to this many devices, the planner tries the first 1, 2, 4, ... nodes (or
#: devices) too, with every strategy on each subset; on larger ones, fewer subsets with the
#: balanced data- and filter-parallel splits only.
SUBSET_FULL_SEARCH_MAX_DEVICES = 64


def device_tiers(cluster: Cluster, speeds: Sequence[float]) -> list[list[int]]:
    """Devices grouped by kind (equal :class:`Device`), fastest kind first."""
    kinds: dict[Any, list[int]] = {}
    for d, device in enumerate(cluster.devices):
        kinds.setdefault(device, []).append(d)
    return sorted(kinds.values(), key=lambda ds: (-speeds[ds[0]], ds[0]))


def device_subsets(
    cluster: Cluster, tiers: list[list[int]], speeds: Sequence[float]
) -> list[list[int]]:
    """Device subsets worth trying (a few, deterministic): the fastest k kinds of device for
    every k short of all, the node with the most compute, and on clusters of up to
    ``SUBSET_FULL_SEARCH_MAX_DEVICES`` devices the first 1, 2, 4, ... nodes and the first
    node's first 1, 2, 4, ... devices (the devices of a single node): the subsets
    ``sweep(..., "nodes")`` plans on."""
    p = cluster.num_devices
    out: list[list[int]] = []
    for k in range(1, len(tiers)):
        out.append(sorted(d for t in tiers[:k] for d in t))
    if p <= SUBSET_FULL_SEARCH_MAX_DEVICES:
        for v in node_counts(cluster):
            out.append(list(range(first_nodes(cluster, v).num_devices)))
        if len(cluster.nodes) > 1:  # the first node's first devices: the sweep's first point
            first = cluster.nodes[0].count
            out += [list(range(2**k)) for k in range(first.bit_length()) if 2**k < first]
    if len(cluster.nodes) > 1:
        by_node: dict[int, list[int]] = {}
        for d, node in enumerate(cluster.node_of_device):
            by_node.setdefault(node, []).append(d)
        best = max(by_node.values(), key=lambda ds: (sum(speeds[d] for d in ds), -ds[0]))
        out.append(best)
    seen: set[tuple[int, ...]] = set()
    unique = []
    for keep in out:
        if 0 < len(keep) < p and tuple(keep) not in seen:
            seen.add(tuple(keep))
            unique.append(keep)
    return unique


def node_groups(
    cluster: Cluster, devices: Sequence[int], g: int
) -> dict[Any, list[tuple[int, ...]]]:
    """Groups of ``g`` consecutive devices of one node among ``devices``, by kind of device
    (fastest kind first is the caller's order), each node's leftover devices left out."""
    by_node: dict[int, list[int]] = {}
    nodes = cluster.node_of_device
    for d in devices:
        by_node.setdefault(nodes[d], []).append(d)
    out: dict[Any, list[tuple[int, ...]]] = {}
    for node in sorted(by_node):
        ds = by_node[node]
        kind = cluster.devices[ds[0]]
        for i in range(0, len(ds) - g + 1, g):
            out.setdefault(kind, []).append(tuple(ds[i : i + g]))
    return out


def node_counts(cluster: Cluster) -> list[int]:
    """The ``nodes`` sweep's points: 1, 2, 4, ... nodes and all of them (devices, on one node)."""
    n = len(cluster.nodes) if len(cluster.nodes) > 1 else cluster.num_devices
    return sorted({min(n, 2**k) for k in range(0, n.bit_length() + 1)})


def first_nodes(cluster: Cluster, k: int) -> Cluster:
    """The first ``k`` nodes of ``cluster`` (its first ``k`` devices when it has one node)."""
    if len(cluster.nodes) > 1:
        return Cluster(cluster.nodes[:k], cluster.network if k > 1 else None, cluster.source)
    return cluster.first_devices(k)
