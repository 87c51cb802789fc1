"""The planner: which strategy, which split, how fast - and how that changes along seed 003's five
axes (batch size, device FLOP/s, memory bandwidth, link bandwidth, cluster size).

:func:`plan` evaluates every candidate (data parallel with balanced and with even shares, filter
parallel with balanced filters, pipelines of a few micro-batch counts) and ranks them: feasible
plans first, fastest first. :func:`sweep` re-plans along one axis.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hetcoll.model import predict
from hetcoll.model.costs import ModelCosts
from hetcoll.model.hardware import Cluster
from hetcoll.model.predict import Prediction

PIPELINE_MICRO_BATCHES = (1, 2, 4, 8, 16, 32)


def _infeasible(strategy: str, batch: int, num_devices: int, unit: str, reason: str) -> Prediction:
    return Prediction(
        strategy,
        [0] * num_devices,
        unit,
        float("inf"),
        {},
        [0.0] * num_devices,
        False,
        reason,
        batch,
    )


def _device_speeds(costs: ModelCosts, cluster: Cluster, batch: int) -> list[float]:
    """Effective FLOP/s of each device on this model at ``batch`` samples (roofline included),
    for splitting filters in proportion to speed."""
    flops = costs.forward_flops(batch) + costs.backward_flops(batch)
    out = []
    cache: dict[str, float] = {}
    for d in cluster.devices:
        if d.name not in cache:
            cache[d.name] = flops / max(predict.compute_seconds(costs, d, batch), 1e-30)
        out.append(cache[d.name])
    return out


def plan(
    costs: ModelCosts,
    cluster: Cluster,
    batch: int,
    *,
    optimizer_state_copies: int = 1,
    micro_batches: Sequence[int] = PIPELINE_MICRO_BATCHES,
) -> list[Prediction]:
    """Every candidate plan for one step of ``batch`` samples, best first (feasible before
    infeasible, then by predicted step time).

    >>> best = plan(costs, cluster, 256)[0]  # doctest: +SKIP
    >>> best.strategy, best.shares, best.step_s  # doctest: +SKIP
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch: must be an integer >= 1, got {batch!r}")
    p = cluster.num_devices
    out: list[Prediction] = []
    s = optimizer_state_copies
    try:
        shares = predict.balanced_batch_shares(costs, cluster, batch, optimizer_state_copies=s)
        out.append(
            predict.data_parallel(
                costs, cluster, shares, strategy="data parallel, balanced", optimizer_state_copies=s
            )
        )
    except ValueError as e:
        out.append(_infeasible("data parallel, balanced", batch, p, "samples", str(e)))
    out.append(
        predict.data_parallel(
            costs,
            cluster,
            predict.even_batch_shares(batch, p),
            strategy="data parallel, even",
            optimizer_state_copies=s,
        )
    )
    if p > 1:
        speeds = _device_speeds(costs, cluster, batch)
        out.append(
            predict.filter_parallel(
                costs,
                cluster,
                batch,
                speeds,
                strategy="filter parallel, balanced",
                optimizer_state_copies=s,
            )
        )
        for m in micro_batches:
            if m <= batch:
                out.append(
                    predict.pipeline(
                        costs,
                        cluster,
                        batch,
                        m,
                        strategy=f"pipeline, {m} micro-batches",
                        optimizer_state_copies=s,
                    )
                )
    out.sort(key=lambda x: (not x.feasible, x.step_s))
    return out


SWEEP_AXES = ("batch", "flops", "mem_bw", "link_bw", "nodes")
_FACTORS = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)


@dataclass
class SweepPoint:
    """One point of a sweep: the axis value and the best plan of each strategy family there."""

    value: float
    best: dict[str, Prediction]


def _family(strategy: str) -> str:
    return strategy.split(",")[0] if strategy.startswith("pipeline") else strategy


def sweep(
    costs: ModelCosts,
    cluster: Cluster,
    batch: int,
    axis: str,
    values: Sequence[float] | None = None,
    *,
    optimizer_state_copies: int = 1,
) -> list[SweepPoint]:
    """Plan at each value of ``axis``: ``batch`` (samples), ``flops`` / ``mem_bw`` / ``link_bw``
    (factors applied to every device or link), ``nodes`` (the first k nodes, or the first k
    devices of a single-node cluster). Default values: powers of two around the given point.
    """
    if axis not in SWEEP_AXES:
        raise ValueError(f"axis: expected one of {SWEEP_AXES}, got {axis!r}")
    if values is None:
        if axis == "batch":
            values = [max(1, int(batch * f)) for f in _FACTORS]
        elif axis == "nodes":
            n = len(cluster.nodes) if len(cluster.nodes) > 1 else cluster.num_devices
            values = sorted({min(n, 2**k) for k in range(0, n.bit_length() + 1)})
        else:
            values = list(_FACTORS)
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
        elif len(cluster.nodes) > 1:
            c = Cluster(
                cluster.nodes[: int(v)], cluster.network if int(v) > 1 else None, cluster.source
            )
        else:
            c = cluster.first_devices(int(v))
        best: dict[str, Prediction] = {}
        for pred in plan(costs, c, b, optimizer_state_copies=optimizer_state_copies):
            fam = _family(pred.strategy)
            if pred.feasible and fam not in best:
                best[fam] = pred
        points.append(SweepPoint(float(v), best))
    return points


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
