"""The planner along seed 003's five axes: :func:`sweep` plans at each value of one axis (batch
size, device FLOP/s, memory bandwidth, link bandwidth, cluster size) and keeps each strategy
family's best plan; :func:`plot_sweep` draws them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hetcoll.model import predict
from hetcoll.model.costs import ModelCosts
from hetcoll.model.hardware import Cluster
from hetcoll.model.planner.report import strategy_family
from hetcoll.model.planner.search import plan
from hetcoll.model.planner.subsets import first_nodes, node_counts
from hetcoll.model.predict import Prediction

SWEEP_AXES = ("batch", "flops", "mem_bw", "link_bw", "nodes")
_FACTORS = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)


@dataclass
class SweepPoint:
    """One point of a sweep: the axis value and the best plan of each strategy family there."""

    value: float
    best: dict[str, Prediction]


def sweep(
    costs: ModelCosts,
    cluster: Cluster,
    batch: int,
    axis: str,
    values: Sequence[float] | None = None,
    *,
    optimizer_state_copies: int = 1,
    precision: str | None = None,
    expert_loads: predict.Loads | None = None,
) -> list[SweepPoint]:
    """Plan at each value of ``axis``: ``batch`` (samples), ``flops`` / ``mem_bw`` / ``link_bw``
    (factors applied to every device or link), ``nodes`` (the first k nodes, or the first k
    devices of a single-node cluster). Default values: powers of two around the given point.
    ``precision`` and ``expert_loads`` as in :func:`plan`.
    """
    predict.check_costs_and_cluster(costs, cluster)
    if precision is not None:
        costs = costs.at_precision(precision)
    if axis not in SWEEP_AXES:
        raise ValueError(f"axis: expected one of {SWEEP_AXES}, got {axis!r}")
    if values is None:
        if axis == "batch":
            values = [max(1, int(batch * f)) for f in _FACTORS]
        elif axis == "nodes":
            values = node_counts(cluster)
        else:
            values = list(_FACTORS)
    values = _axis_values(cluster, axis, values)
    points = []
    for v in values:
        c, b = cluster, batch
        if axis == "batch":
            b = int(v)
        elif axis == "flops":
            c = cluster.scaled(flops=v)
        elif axis == "mem_bw":
            c = cluster.scaled(mem_bw=v)
        elif axis == "link_bw":
            c = cluster.scaled(link_bw=v)
        else:
            c = first_nodes(cluster, int(v))
        best: dict[str, Prediction] = {}
        for pred in plan(
            costs, c, b, optimizer_state_copies=optimizer_state_copies, expert_loads=expert_loads
        ):
            fam = strategy_family(pred.strategy)
            if pred.feasible and fam not in best:
                best[fam] = pred
        points.append(SweepPoint(float(v), best))
    return points


def _axis_values(cluster: Cluster, axis: str, values: object) -> list[float]:
    """``values`` checked against ``axis``: each is the label of the point planned there, so
    one the axis cannot reach is refused (1.9 samples once planned batch 1, labelled 1.9; 5
    nodes of 2 planned the 2)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
        raise ValueError(f"values: must be a non-empty sequence of numbers, got {values!r}")
    most = len(cluster.nodes) if len(cluster.nodes) > 1 else cluster.num_devices
    out: list[float] = []
    for i, v in enumerate(values):
        if axis in ("batch", "nodes"):
            whole = not isinstance(v, bool) and isinstance(v, (int, np.integer))
            if not whole or v < 1 or (axis == "nodes" and v > most):
                what = "nodes" if len(cluster.nodes) > 1 else "devices"
                rule = (
                    f"a count of {what} in 1..{most}"
                    if axis == "nodes"
                    else "an integer batch >= 1"
                )
                raise ValueError(f"values[{i}]: must be {rule}, got {v!r}")
        elif (
            isinstance(v, bool)
            or not isinstance(v, (int, float, np.integer, np.floating))
            or not 0 < v < math.inf
        ):
            raise ValueError(f"values[{i}]: must be a factor > 0, got {v!r}")
        out.append(v)  # type: ignore[arg-type]
    return out


def plot_sweep(points: Sequence[SweepPoint], axis: str, path: str, title: str = "") -> None:
    """Samples/s of each strategy's best plan along the axis, as a PNG (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = sorted({f for pt in points for f in pt.best})
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for fam in families:
        xs = [pt.value for pt in points if fam in pt.best]
        ys = [pt.best[fam].samples_per_s for pt in points if fam in pt.best]
        ax.plot(xs, ys, marker="o", label=fam)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    label = {
        "batch": "batch size (samples)",
        "flops": "device FLOP/s (x given)",
        "mem_bw": "device memory bandwidth (x given)",
        "link_bw": "link bandwidth (x given)",
        "nodes": "cluster size (nodes)",
    }[axis]
    ax.set_xlabel(label)
    ax.set_ylabel("predicted samples / s")
    ax.set_title(title or f"sweep over {axis}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
