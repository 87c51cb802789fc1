"""The main job (lab code): a small CNN on scikit-learn's bundled digits, trained on local
ranks of unequal (emulated) speed, unbalanced and balanced (see :mod:`hetcoll.lab.demo_config`
for the command and what it shows). Ranks run on gloo (DDP and the weighted comm hook) or MPI
(the MPI ``DistributedOptimizer``); rank 0 returns the report that :func:`format_table` and
:func:`plot` present.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import tempfile
from typing import Any

import torch

import hetcoll
from hetcoll.lab.demo_config import DemoConfig
from hetcoll.lab.demo_ranks import (
    DemoNet,
    Engine,
    Gloo,
    Mpi,
    load_digits,
    probe,
    rank_rows,
    train_data_parallel,
)
from hetcoll.lab.filter_demo import run_rank as run_filter_rank

__all__ = ["DemoConfig", "DemoNet", "format_table", "load_digits", "plot", "run", "summary_rows"]


def run_rank(engine: Engine, cfg: DemoConfig) -> dict[str, Any] | None:
    """Both runs on this rank; rank 0 returns the report."""
    if cfg.strategy == "filter":
        return run_filter_rank(engine, cfg)
    torch.set_num_threads(1)
    fits, real = probe(engine, cfg)
    speeds = [f.samples_per_s for f in fits]
    latency = [f.latency_s for f in fits]
    plans = {
        "unbalanced": hetcoll.split(cfg.global_batch, [1.0] * engine.world),
        "balanced": hetcoll.split(cfg.global_batch, speeds, latency=latency, minimum=1),
    }
    runs = [train_data_parallel(engine, cfg, name, plans[name], real, fits) for name in cfg.runs]
    if engine.rank != 0:
        return None
    balanced = plans["balanced"]
    ideal = sum(b / f.predict(b) for b, f in zip(balanced, fits))
    return {
        "config": dataclasses.asdict(cfg),
        "emulated": True,
        "ranks": rank_rows(cfg, fits),
        "ideal_samples_per_s": ideal,
        "predicted_balanced_step_s": max(f.predict(b) for b, f in zip(balanced, fits)),
        "runs": {r.name: dataclasses.asdict(r) for r in runs},
    }


def _gloo_rank(rank: int, world: int, cfg: DemoConfig) -> dict[str, Any] | None:
    return run_rank(Gloo(rank, world), cfg)


# -- the launcher and the report ------------------------------------------------------------------


def run(cfg: DemoConfig) -> dict[str, Any]:
    """Launch the ranks (gloo processes, or mpiexec for ``backend="mpi"``); return the report."""
    cfg.validate()
    from hetcoll.launch import mpiexec, spawn

    if cfg.strategy == "plan":
        from hetcoll.lab.plan_demo import run as run_plan

        return run_plan(cfg)
    if cfg.backend == "gloo":
        return spawn(_gloo_rank, cfg.world_size, cfg, timeout=1800)[0]
    with tempfile.TemporaryDirectory(prefix="hetcoll-demo-") as tmp:
        path = os.path.join(tmp, "report.json")
        argv = ["-m", "hetcoll.lab.demo", "--mpi-rank", json.dumps(dataclasses.asdict(cfg)), path]
        mpiexec(cfg.world_size, argv, timeout=1800, capture=False)
        with open(path) as f:
            return json.load(f)


def _mpi_main(config_json: str, path: str) -> None:
    report = run_rank(Mpi(), DemoConfig.from_dict(json.loads(config_json)))
    if report is not None:
        with open(path, "w") as f:
            json.dump(report, f)


def _in_run_ideal(run_: dict[str, Any]) -> float:
    """Sum over ranks of each rank's own speed in this run: its samples over the seconds it
    spent computing them (forward and backward until its gradients were ready, and on DDP the
    optimizer's update; no waiting, no averaging), epoch 1 left out."""
    timed = run_["epochs"][1:] or run_["epochs"]
    if "rank_samples" not in timed[0]:  # runs that do not record it (the filter strategy)
        return float("nan")
    ranks = len(timed[0]["rank_samples"])
    return sum(
        sum(e["rank_samples"][r] for e in timed) / sum(e["rank_compute_seconds"][r] for e in timed)
        for r in range(ranks)
    )


def summary_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per run: seconds per epoch, samples/s, share of the ideal, final loss/accuracy.
    Epoch 1 is left out of the timing (warm-up).

    Two ideals, both the sum of the ranks' own speeds at the balanced shares: from the speed
    probe before training (``ideal_samples_per_s``), and from each rank's own compute time in
    the balanced run itself (``in_run_ideal_samples_per_s``; on a shared machine whose speed
    drifts within a minute, the probe's moment can be faster or slower than the run's)."""
    rows = []
    ideal = report["ideal_samples_per_s"]
    runs = report["runs"]
    in_run = _in_run_ideal(runs["balanced"]) if "balanced" in runs else float("nan")
    for name, run_ in runs.items():
        timed = run_["epochs"][1:] or run_["epochs"]
        secs = sum(e["train_seconds"] for e in timed)
        samples = sum(e["samples"] for e in timed)
        last = run_["epochs"][-1]
        rows.append(
            {
                "run": name,
                "shares": run_["shares"],
                "seconds_per_epoch": secs / len(timed),
                "samples_per_s": samples / secs,
                "ideal_samples_per_s": ideal,
                "fraction_of_ideal": samples / secs / ideal,
                "in_run_ideal_samples_per_s": in_run,
                "fraction_of_in_run_ideal": samples / secs / in_run,
                "test_loss": last["test_loss"],
                "test_accuracy": last["test_accuracy"],
            }
        )
    return rows


def format_table(report: dict[str, Any]) -> str:
    rows = summary_rows(report)
    in_run = not math.isnan(rows[0]["in_run_ideal_samples_per_s"])
    lines = [
        "Emulated heterogeneity: rank speeds "
        + ", ".join(f"{r['emulated_speed']:g}" for r in report["ranks"])
        + " (measured "
        + ", ".join(f"{r['measured_samples_per_s']:.0f}" for r in report["ranks"])
        + " samples/s)",
        f"{'run':<11} {'shares':<12} {'s/epoch':>8} {'samples/s':>10} {'ideal':>8} "
        f"{'of ideal':>9}"
        + (f" {'in-run':>7} {'of it':>6}" if in_run else "")
        + f" {'loss':>7} {'accuracy':>9}",
    ]
    for r in rows:
        lines.append(
            f"{r['run']:<11} {','.join(map(str, r['shares'])):<12} {r['seconds_per_epoch']:8.2f} "
            f"{r['samples_per_s']:10.0f} {r['ideal_samples_per_s']:8.0f} "
            f"{r['fraction_of_ideal']:8.0%}"
            + (
                f" {r['in_run_ideal_samples_per_s']:7.0f} {r['fraction_of_in_run_ideal']:5.0%}"
                if in_run
                else ""
            )
            + f" {r['test_loss']:7.3f} {r['test_accuracy']:9.2%}"
        )
    by = {r["run"]: r for r in rows}
    if "plan" in by and "unbalanced" in by:
        chosen = report["chosen"]
        lines.append(
            f"plan: {chosen['strategy']} (predicted {chosen['predicted_step_s'] * 1e3:.1f} ms a "
            f"step); plan / even data parallel throughput: "
            f"{by['plan']['samples_per_s'] / by['unbalanced']['samples_per_s']:.2f}x"
        )
    if "balanced" in by and "unbalanced" in by:
        # The spread a user sees from run to run: the same ratio epoch by epoch.
        per_epoch = [
            b["samples_per_s"] / u["samples_per_s"]
            for b, u in zip(
                report["runs"]["balanced"]["epochs"], report["runs"]["unbalanced"]["epochs"]
            )
        ]
        spread = f" (epochs: {min(per_epoch):.2f}-{max(per_epoch):.2f}x)" if per_epoch else ""
        lines.append(
            f"balanced / unbalanced throughput: "
            f"{by['balanced']['samples_per_s'] / by['unbalanced']['samples_per_s']:.2f}x{spread}; "
            f"accuracy difference: "
            f"{100 * (by['balanced']['test_accuracy'] - by['unbalanced']['test_accuracy']):+.1f}"
            " points"
        )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    """Throughput and test accuracy against wall time, both runs, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, run_ in report["runs"].items():
        t = [e["wall_seconds"] for e in run_["epochs"]]
        ax1.plot(t, [e["samples_per_s"] for e in run_["epochs"]], marker="o", label=name)
        ax2.plot(t, [100 * e["test_accuracy"] for e in run_["epochs"]], marker="o", label=name)
    ax1.axhline(report["ideal_samples_per_s"], ls="--", c="gray", label="ideal (sum of speeds)")
    ax1.set(xlabel="training wall time (s)", ylabel="samples / s", title="throughput per epoch")
    ax2.set(xlabel="training wall time (s)", ylabel="test accuracy (%)", title="accuracy")
    speeds = ", ".join(f"{r['emulated_speed']:g}" for r in report["ranks"])
    fig.suptitle(f"hetcoll demo: {len(report['ranks'])} ranks, emulated speeds {speeds}")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--mpi-rank":
        _mpi_main(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: hetcoll demo (this module's entry point is for mpiexec workers)")
