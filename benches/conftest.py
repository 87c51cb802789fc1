"""Benchmark plumbing: every benchmark records its median under a group, and the session ends
with one table per group giving each entry's ratio against the group's named peer, all measured
in the same run. With ``--results-json benches/results/NAME.json`` the same tables, the
``figure()`` figures and the run's date and host are also written as a results file, which
``benches/report.py`` renders into docs/benchmarks.md. `make bench` runs them.

This is lab code: the benchmarks import the library, never the reverse.
"""

from __future__ import annotations

import os
import shlex
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from report import RATIO, SCHEMA, host_info, now, ratio, write_result

os.environ.setdefault("OMP_NUM_THREADS", "1")


@dataclass
class Entry:
    median_s: float
    iqr_s: float
    rounds: int
    bytes_moved: float | None
    note: str
    headline: bool


_RESULTS: dict[str, dict[str, Entry]] = defaultdict(dict)
_PEERS: dict[str, str] = {}
_FIGURES: dict[str, list[tuple[str, str]]] = defaultdict(list)
_FIGURE_HEADLINES: list[dict[str, str]] = []
_NOT_MEASURED: list[str] = []
_DOCS: dict[str, str] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("hetcoll benchmarks")
    group.addoption(
        "--results-json",
        metavar="PATH",
        help="also write the ratio tables and figures as a results file for benches/report.py "
        "(the benchmark's name is the file's stem)",
    )
    group.addoption(
        "--results-title", metavar="TEXT", help="the benchmark's heading in docs/benchmarks.md"
    )


@dataclass
class Rounds:
    """Seconds a call of each run took, a figure per timed round (``interleaved()``)."""

    times: dict[str, list[float]]

    def median(self, key: str) -> float:
        return statistics.median(self.times[key])

    def spread(self, num: str, den: str) -> str:
        """The quartiles of the rounds' ratios ``num / den``."""
        ratios = sorted(a / b for a, b in zip(self.times[num], self.times[den], strict=True))
        return f"rounds' ratios {ratios[len(ratios) // 4]:.2f}-{ratios[3 * len(ratios) // 4]:.2f}"


@pytest.fixture(scope="module")
def one_rank() -> Any:
    """A torch.distributed group of this process alone (gloo, an in-memory store), for a
    module's benchmarks of a one-rank plan."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def interleaved() -> Callable[..., Rounds]:
    """interleaved(runs, *, rounds, steps, warmup): each of ``runs`` (``(name, callable)``
    pairs) timed ``steps`` calls at a time, round by round in the same process, their order
    reversed every other round (either first, in turn); the first ``warmup`` rounds are
    dropped."""

    def _interleaved(
        runs: list[tuple[str, Callable[[], Any]]], *, rounds: int, steps: int, warmup: int
    ) -> Rounds:
        times: dict[str, list[float]] = {key: [] for key, _ in runs}
        for r in range(rounds):
            for key, run in runs if r % 2 else runs[::-1]:
                t0 = time.perf_counter()
                for _ in range(steps):
                    run()
                if r >= warmup:
                    times[key].append((time.perf_counter() - t0) / steps)
        return Rounds(times)

    return _interleaved


@pytest.fixture
def figure() -> Callable[..., None]:
    """figure(group, name, text, *, headline=False): a derived figure (a ratio, a fraction) for
    the final report; ``headline`` also puts it into docs/benchmarks.md's headline table."""

    def _figure(group: str, name: str, text: str, *, headline: bool = False) -> None:
        _FIGURES[group].append((name, text))
        if headline:
            _FIGURE_HEADLINES.append({"figure": f"{group}: {name}", "value": text})

    return _figure


@pytest.fixture
def record() -> Callable[..., None]:
    """record(benchmark, group, name, *, peer=False, bytes_moved=None, note="", headline=False)
    after a run. ``peer`` names the group's peer; ``headline`` puts this entry's comparison with
    the peer into docs/benchmarks.md's headline table."""

    def _record(
        benchmark: Any,
        group: str,
        name: str,
        *,
        peer: bool = False,
        bytes_moved: float | None = None,
        note: str = "",
        headline: bool = False,
    ) -> None:
        s = benchmark.stats.stats
        _RESULTS[group][name] = Entry(s.median, s.iqr, s.rounds, bytes_moved, note, headline)
        if peer:
            _PEERS[group] = name

    return _record


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and module.__name__ not in _DOCS:
            _DOCS[module.__name__] = _description(module.__doc__ or "")


def _description(doc: str) -> str:
    """A module docstring's paragraphs up to its first indented (command) block, as markdown."""
    kept = []
    for para in doc.strip().split("\n\n"):
        if para.startswith((" ", "\t")):
            break
        text = ""
        for line in para.splitlines():
            line = line.strip()
            text += ("\n" if line.startswith("- ") and text else " " if text else "") + line
        kept.append(text)
    return "\n\n".join(kept).replace("``", "`")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and report.when in ("setup", "call"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _NOT_MEASURED.append(f"Not measured: `{report.nodeid}` ({reason}).")
    elif report.failed:
        _NOT_MEASURED.append(f"Failed in this run ({report.when}): `{report.nodeid}`.")


def _speed(entries: dict[str, Entry], peer: str | None, name: str) -> float | None:
    """The peer's median over the entry's: > 1 means the entry is faster than the peer."""
    return entries[peer].median_s / entries[name].median_s if peer in entries else None


def results(config: pytest.Config) -> dict[str, Any]:
    """This session's tables and figures as a results file (see benches/report.py)."""
    path = Path(config.getoption("results_json"))
    sections: list[dict[str, Any]] = []
    headlines: list[dict[str, str]] = list(_FIGURE_HEADLINES)
    for group, entries in _RESULTS.items():
        peer = _PEERS.get(group)
        gbs = any(e.bytes_moved for e in entries.values())
        columns = [
            {"name": "entry"},
            {"name": "median (ms)", "format": "{:,.3f}"},
            {"name": "IQR (ms)", "format": "{:,.3f}"},
            {"name": "rounds"},
            *([{"name": "GB/s", "format": "{:.2f}"}] if gbs else []),
            *([{"name": "speed vs peer (peer time / time)", "format": RATIO}] if peer else []),
            {"name": "note"},
        ]
        rows = []
        for name, e in entries.items():
            speed = _speed(entries, peer, name)
            rows.append(
                [
                    name,
                    e.median_s * 1e3,
                    e.iqr_s * 1e3,
                    e.rounds,
                    *([e.bytes_moved / e.median_s / 1e9 if e.bytes_moved else None] if gbs else []),
                    *([speed] if peer else []),
                    e.note,
                ]
            )
            if e.headline and speed is not None and peer is not None and name != peer:
                fast, slow = (name, peer) if speed >= 1 else (peer, name)
                value = f"{ratio(max(speed, 1 / speed))} faster"
                if entries[fast].note and entries[slow].note:
                    value += f" ({entries[fast].note} vs {entries[slow].note})"
                headlines.append({"figure": f"{fast} vs {slow}", "value": value})
        notes = [f"{name}: {text}" for name, text in _FIGURES.get(group, [])]
        if peer is None:
            notes.append("No peer recorded in this group: times only.")
        sections.append(
            {"title": group, "peer": peer, "columns": columns, "rows": rows, "notes": notes}
        )
    for group, figures in _FIGURES.items():
        if group not in _RESULTS:
            sections.append(
                {
                    "title": group,
                    "columns": [{"name": "figure"}, {"name": "value"}],
                    "rows": [[name, text] for name, text in figures],
                }
            )
    args = shlex.join(config.invocation_params.args)
    return {
        "schema": SCHEMA,
        "benchmark": path.stem,
        "title": config.getoption("results_title") or path.stem,
        "command": f"python -m pytest {args}",
        "when": now(),
        "host": host_info(),
        "description": "\n\n".join(d for d in _DOCS.values() if d),
        "notes": [
            # Only where entries were timed: a file of figures alone states its own ratios.
            *(
                [
                    "Times: pytest-benchmark's median over rounds; ratios: the peer's median over "
                    "the entry's, both from this run (> 1: faster than the peer)."
                ]
                if _RESULTS
                else []
            ),
            *_NOT_MEASURED,
        ],
        "headlines": headlines,
        "sections": sections,
    }


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    if config.getoption("results_json") and (_RESULTS or _FIGURES):
        write_result(config.getoption("results_json"), results(config))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    tr = terminalreporter
    for group, rows in _FIGURES.items():
        tr.write_sep("-", group)
        for name, text in rows:
            tr.write_line(f"{name:<56} {text}")
    for group, entries in _RESULTS.items():
        peer = _PEERS.get(group)
        tr.write_sep("-", f"{group} (ratios: peer time / entry time; >1 means faster than peer)")
        tr.write_line(f"{'entry':<44} {'median':>11} {'GB/s':>8} {'vs ' + (peer or '-'):>24}")
        for name, e in entries.items():
            gbs = f"{e.bytes_moved / e.median_s / 1e9:8.2f}" if e.bytes_moved else f"{'':>8}"
            speed = _speed(entries, peer, name)
            ratio = f"{speed:23.2f}x" if speed is not None else f"{'':>24}"
            tr.write_line(f"{name:<44} {e.median_s * 1e3:9.3f}ms {gbs} {ratio} {e.note}")
    path = tr.config.getoption("results_json")
    if path:
        tr.write_line(f"results: {path}" if _RESULTS or _FIGURES else "results: nothing measured")
