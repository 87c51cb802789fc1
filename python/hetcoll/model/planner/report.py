"""What a plan search tells its reader: :class:`SearchReport` (what the search did),
:func:`explain` (why a plan takes its time: its bottleneck term), :func:`plot_plans` (predicted
step time by plan) and :func:`strategy_family` (the family a strategy's name belongs to)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hetcoll.model.hardware import Cluster
from hetcoll.model.predict import Prediction


@dataclass
class SearchReport:
    """What :func:`plan`'s search did: ``costed`` candidates; ``pruned``, per family, those a
    bound skipped uncosted; ``skipped``, per family, why it was not searched (the model
    does not allow it); ``placement_comparison``, when node-wise plans were searched, seed
    002's table for their devices: per strategy its bytes per step, load balance (the slowest
    device's work time over the ideal, 1.0 is perfect) and predicted step."""

    costed: int = 0
    pruned: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    placement_comparison: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "costed": self.costed,
            "pruned": self.pruned,
            "skipped": self.skipped,
            "placement_comparison": self.placement_comparison,
        }

    def prune(self, family: str) -> None:
        self.pruned[family] = self.pruned.get(family, 0) + 1


def explain(pred: Prediction, cluster: Cluster) -> dict[str, Any]:
    """Why ``pred`` takes the time it does: the largest term on its critical path (its
    breakdown's compute, memory stalls and kernel overheads together as the critical device's
    compute; exposed communication; the pipeline bubble; the optimizer step), with the device
    or the collective it is. Returns ``{"term", "seconds", "share", "device", "text"}``.

    >>> explain(plan(costs, cluster, 512)[0], cluster)["text"]  # doctest: +SKIP
    'compute of device 0 (a100-sxm4-40gb): 5.9 ms of the 8.8 ms step (67 %)'
    """
    if not isinstance(pred, Prediction):
        raise TypeError(f"pred: must be a Prediction, got {type(pred).__name__}")
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster: must be a Cluster, got {type(cluster).__name__}")
    b = pred.breakdown
    parts = {
        "compute": b.get("compute", 0.0) + b.get("memory", 0.0) + b.get("overhead", 0.0),
        "communication": b.get("communication", 0.0),
        "bubble": b.get("bubble", 0.0),
        "optimizer": b.get("optimizer", 0.0),
    }
    if not pred.feasible or not math.isfinite(pred.step_s) or pred.step_s <= 0:
        return {
            "term": "infeasible",
            "seconds": 0.0,
            "share": 0.0,
            "device": None,
            "text": pred.reason or "no step",
        }
    term = max(parts, key=lambda k: parts[k])
    seconds = parts[term]
    d = pred.detail.get("critical_device")
    if d is not None and not 0 <= d < cluster.num_devices:
        raise ValueError(
            f"cluster: has {cluster.num_devices} devices, but pred's critical device is {d} "
            "(give the cluster pred was planned on)"
        )
    where = f"device {d} ({cluster.devices[d].name})" if d is not None else "the slowest device"
    strategy = pred.strategy
    if term == "compute":
        stalls = b.get("memory", 0.0) / seconds if seconds > 0 else 0.0
        what = f"compute of {where}" + (
            f", {stalls:.0%} of it memory stalls" if stalls >= 0.2 else ""
        )
    elif term == "communication":
        if strategy.startswith("data parallel"):
            what = "the gradient allreduce (the part the backward does not hide)"
        elif strategy.startswith("filter parallel"):
            what = "the filter-split layers' collectives (partial sums and gathers)"
        elif strategy.startswith("node-wise"):
            what = f"feature maps sent between devices, waited for by {where}"
        elif pred.detail.get("gradient_allreduce_s", 0.0) >= 0.5 * seconds:
            what = "the gradient allreduce across replicas"
        else:
            what = f"the split stages' collectives on {where}"
    elif term == "bubble":
        what = f"the pipeline bubble: {where} waits for other stages"
    else:
        what = "the optimizer step"
    share = seconds / pred.step_s
    text = (
        f"{what}: {_seconds_text(seconds)} of the {_seconds_text(pred.step_s)} step ({share:.0%})"
    )
    return {"term": term, "seconds": seconds, "share": share, "device": d, "text": text}


def _seconds_text(x: float) -> str:
    return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"


def plot_plans(ranked: Sequence[Prediction], path: str, title: str = "", top: int = 24) -> None:
    """Predicted step time of the ``top`` best plans of ``ranked`` (as :func:`plan` returns
    them), one bar each, best at the top, infeasible ones hatched, as a PNG (matplotlib,
    Agg)."""
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"top: must be an integer >= 1, got {top!r}")
    if any(not isinstance(x, Prediction) for x in ranked):
        raise TypeError("ranked: must hold Predictions (as plan returns them)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [x for x in ranked if math.isfinite(x.step_s)][:top]
    if not shown:
        raise ValueError("ranked: no plan with a finite step time to plot")
    fig, ax = plt.subplots(figsize=(8.0, 1.2 + 0.28 * len(shown)))
    y = np.arange(len(shown))[::-1]
    families = sorted({strategy_family(x.strategy) for x in shown})
    colours = {f: plt.get_cmap("tab10")(i % 10) for i, f in enumerate(families)}
    for yi, x in zip(y, shown):
        ax.barh(
            yi,
            x.step_s * 1e3,
            color=colours[strategy_family(x.strategy)],
            hatch="" if x.feasible else "//",
            edgecolor="black" if not x.feasible else None,
        )
    ax.set_yticks(
        y,
        [x.strategy if len(x.strategy) <= 70 else x.strategy[:67] + "..." for x in shown],
        fontsize=7,
    )
    ax.set_xlabel("predicted step time (ms)")
    ax.set_xlim(0, max(x.step_s for x in shown) * 1e3 * 1.05)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[f]) for f in families]
    ax.legend(handles, families, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(title or "predicted step time by plan (hatched: infeasible)", fontsize=9)
    ax.grid(True, axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def strategy_family(strategy: str) -> str:
    """The strategy without its micro-batches, device subset or replica shapes."""
    if strategy.startswith(("pipeline", "asymmetric", "replicated pipeline", "node-wise")):
        return strategy.split(",")[0]
    return re.sub(r", \d+ of \d+ devices$", "", strategy)
