"""Score runs of bench_collectives.py against the collectives' three targets, run by run and pooled.

    python benches/bench_collectives.py --json run1.json      # as many runs as you like
    python benches/score_collectives.py run1.json run2.json ... [--plot pooled.png]

The targets: hetcoll's weighted allreduce ("auto") within 1.1x of the engine's unweighted allreduce
from 1 MiB, every engine and rank count; the ring within 1/0.9 of MPI_Allreduce's time from
16 MiB; allgatherv ("auto") on gloo within 1.5x of an all_gather of equal pieces, same total bytes.

Per run, a cell meets a target when its ratio in that run's table does (the median, over the
run's repeats, of the paired ratio within a repeat). Over all the runs given, each cell's paired
ratios are pooled, and the pooled median comes with a 95% two-level bootstrap interval (2000
resamples, seeded; each draws runs, then repeats within them, so the interval carries the spread
between runs too): "met" when the whole interval is within the limit, "missed" when the whole
interval is beyond it, else "open" (the runs cannot tell). For the weighted target two more
columns, pooled the same way: the engine's call timed again (how far a cell moves by chance
alone) and hetcoll's native allreduce without a weight (what calling through hetcoll costs before
any weighting).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_collectives import KIB, size_label

RESAMPLES = 2000


@dataclass(frozen=True)
class Target:
    """One target: ``name``'s time over ``peer``'s at most ``limit``, in the cells of
    ``engines`` from ``min_bytes``. ``controls`` are more operations shown against ``peer``,
    pooled alike."""

    title: str
    name: str
    peer: str
    limit: float
    engines: tuple[str, ...] = ("mpi", "gloo")
    min_bytes: int = 0
    controls: tuple[tuple[str, str], ...] = ()

    def covers(self, engine: str, nbytes: int) -> bool:
        return engine in self.engines and nbytes >= self.min_bytes


TARGETS = (
    Target(
        "weighted allreduce (auto) / engine allreduce",
        "auto_w",
        "engine",
        1.1,
        min_bytes=KIB * KIB,
        controls=(("engine again", "engine_again"), ("native unweighted", "native")),
    ),
    Target(
        "ring (weighted) / MPI_Allreduce",
        "ring_w",
        "engine",
        1 / 0.9,
        engines=("mpi",),
        min_bytes=16 * KIB * KIB,
    ),
    Target(
        "allgatherv (auto) / all_gather, gloo",
        "allgatherv_auto",
        "allgather",
        1.5,
        engines=("gloo",),
    ),
)


def paired(times: dict[str, list[float]], name: str, peer: str) -> list[float]:
    """``name``'s time over ``peer``'s within each repeat."""
    return [t / u for t, u in zip(times[name], times[peer], strict=True)]


def median_interval(
    runs: list[list[float]], seed: int = 0, level: float = 0.95
) -> tuple[float, float, float]:
    """The median of every run's ratios pooled, and a two-level percentile bootstrap interval
    around it: each resample draws as many runs as there are, with replacement, then each drawn
    run's ratios, with replacement, so the interval carries the spread between runs (a host's
    slow or fast spell lasting a whole run) as well as within them."""
    runs = [r for r in runs if r]
    if not runs:
        raise ValueError("runs: no ratios; a cell needs at least one repeat")
    rng = random.Random(seed)
    medians = []
    for _ in range(RESAMPLES):
        drawn: list[float] = []
        for run in rng.choices(runs, k=len(runs)):
            drawn += rng.choices(run, k=len(run))
        medians.append(statistics.median(drawn))
    medians.sort()
    tail = (1 - level) / 2
    lo = medians[int(tail * RESAMPLES)]
    hi = medians[min(RESAMPLES - 1, int((1 - tail) * RESAMPLES))]
    return statistics.median(x for run in runs for x in run), lo, hi


def _met(row: dict[str, Any], target: Target) -> bool:
    """Whether one run's cell meets ``target``: the run's own ratio, as its table shows it."""
    times = row["seconds_per_call"]
    return statistics.median(paired(times, target.name, target.peer)) <= target.limit


def verdict(lo: float, hi: float, limit: float) -> str:
    if hi <= limit:
        return "met"
    if lo > limit:
        return "missed"
    return "open"


def load(paths: list[Path]) -> list[list[dict[str, Any]]]:
    """Each file's results (one per engine and rank count), as bench_collectives.py wrote them."""
    runs = []
    for path in paths:
        try:
            results = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"runs: cannot read {path}: {e}") from e
        if not isinstance(results, list) or not all(
            isinstance(r, dict) and {"engine", "ranks", "rows"} <= r.keys() for r in results
        ):
            raise ValueError(f"runs: {path} is not a bench_collectives.py --json file")
        runs.append(results)
    return runs


@dataclass
class Cell:
    """One target cell over all the runs: an engine, a rank count and a size, with its row in
    every run that has it."""

    engine: str
    ranks: int
    nbytes: int
    rows: list[dict[str, Any]]
    _pooled: dict[tuple[str, str], tuple[float, float, float]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def pooled(self, name: str, peer: str) -> tuple[float, float, float]:
        """:func:`median_interval` of ``name`` over ``peer``, one row per run (bootstrapped
        once per cell and pair: the report and the plot ask for the same)."""
        if (name, peer) not in self._pooled:
            self._pooled[name, peer] = median_interval(
                [paired(row["seconds_per_call"], name, peer) for row in self.rows]
            )
        return self._pooled[name, peer]


def cells(
    runs: list[list[dict[str, Any]]], target: Target
) -> tuple[list[Cell], list[tuple[int, int]]]:
    """The cells ``target`` covers, sorted by engine, rank count and size, and per run how
    many of them it meets, of how many it has."""
    if not runs:
        raise ValueError("runs: give at least one bench_collectives.py --json file")
    found: dict[tuple[str, int, int], Cell] = {}
    per_run = []
    for results in runs:
        met = scored = 0
        for result in results:
            for row in result["rows"]:
                if target.covers(result["engine"], row["bytes"]):
                    key = (result["engine"], result["ranks"], row["bytes"])
                    found.setdefault(key, Cell(*key, [])).rows.append(row)
                    met += _met(row, target)
                    scored += 1
        per_run.append((met, scored))
    return [found[key] for key in sorted(found)], per_run


def score(runs: list[list[dict[str, Any]]], plot_path: Path | None = None) -> str:
    """The report: per target, each cell's runs that met it and its pooled ratio; with
    ``plot_path``, also :func:`plot` of the same cells."""
    by_target = [(target, *cells(runs, target)) for target in TARGETS]
    lines = [f"{len(runs)} run(s); pooled ratios: median [95% bootstrap interval]"]
    for target, found, per_run in by_target:
        lines += [
            f"\n{target.title} <= {target.limit:.3g}x\n",
            "| engine | p | size | runs met | pooled | verdict |"
            + "".join(f" {title}, pooled |" for title, _ in target.controls),
            "|---|---:|---:|---:|---:|---|" + "---:|" * len(target.controls),
        ]
        for cell in found:
            met = sum(_met(row, target) for row in cell.rows)
            m, lo, hi = cell.pooled(target.name, target.peer)
            line = (
                f"| {cell.engine} | {cell.ranks} | {size_label(cell.nbytes)} "
                f"| {met} of {len(cell.rows)} "
                f"| {m:.2f}x [{lo:.2f}, {hi:.2f}] | {verdict(lo, hi, target.limit)} |"
            )
            for _, name in target.controls:
                c, clo, chi = cell.pooled(name, target.peer)
                line += f" {c:.2f}x [{clo:.2f}, {chi:.2f}] |"
            lines.append(line)
        lines.append("\ncells met, run by run: " + ", ".join(f"{met} of {n}" for met, n in per_run))
    if plot_path is not None:
        plot([(target, found) for target, found, _ in by_target], len(runs), plot_path)
    return "\n".join(lines)


def plot(by_target: list[tuple[Target, list[Cell]]], n_runs: int, path: Path) -> None:
    """One panel per target: each engine and rank count's pooled ratio against the size, with
    its 95% interval as error bars, and the target's limit as a dashed line (PNG, matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(by_target), figsize=(5.2 * len(by_target), 4.2), squeeze=False)
    for ax, (target, found) in zip(axes[0], by_target, strict=True):
        series: dict[tuple[str, int], list[Cell]] = {}
        for cell in found:
            series.setdefault((cell.engine, cell.ranks), []).append(cell)
        tally = {"met": 0, "open": 0, "missed": 0}
        for (engine, ranks), line in series.items():
            x = [cell.nbytes for cell in line]
            pooled = [cell.pooled(target.name, target.peer) for cell in line]
            y = [m for m, _, _ in pooled]
            err = [[m - lo for m, lo, _ in pooled], [hi - m for m, _, hi in pooled]]
            ax.errorbar(x, y, yerr=err, marker="o", ms=4, capsize=3, label=f"{engine}, p={ranks}")
            for _, lo, hi in pooled:
                tally[verdict(lo, hi, target.limit)] += 1
        ax.axhline(target.limit, color="k", ls="--", lw=1, label=f"limit {target.limit:.3g}x")
        ax.set_xscale("log", base=2)
        sizes = sorted({cell.nbytes for cell in found})
        ax.set_xticks(sizes, [size_label(n) for n in sizes], rotation=45, fontsize=8)
        ax.minorticks_off()
        ax.set_xlabel("buffer size")
        ax.set_ylabel(f"time / {target.peer}'s time")
        counts = ", ".join(f"{n} {word}" for word, n in tally.items() if n)
        ax.set_title(f"{target.title}\n{counts} (of {len(found)})", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"pooled over {n_runs} run(s): median, 95% two-level bootstrap interval")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="bench_collectives.py --json files")
    parser.add_argument("--plot", type=Path, help="also draw the pooled ratios into this PNG")
    args = parser.parse_args()
    print(score(load(args.runs), args.plot))
    if args.plot:
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
