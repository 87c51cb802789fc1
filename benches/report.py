"""docs/benchmarks.md from the benchmarks' JSON: one results file per benchmark, one generator.

This is lab code: the benchmarks live beside the library and may import it; the library never
imports them. Every benchmark writes ``benches/results/<name>.json`` in the format below (the
pytest-benchmark suites through ``benches/conftest.py --results-json``, ``compare_partitioners.py``
through ``--json``); the scripts that keep their own JSON (``bench_collectives.py``,
``bench_filter_parallel.py``, ``bench_plans.py``, ``bench_lm_pipeline.py``, ``hetcoll model
validate --json``) are converted by the adapters here (``report.py import KIND RAW...``).
Then ``report.py`` renders every results file into docs/benchmarks.md, the same bytes for the
same JSON.

    python benches/report.py                      # write docs/benchmarks.md
    python benches/report.py --check              # exit 1 if docs/benchmarks.md is stale
    python benches/report.py import collectives RAW.json [RAW2.json ...] --command "..."

A results file (``SCHEMA`` 1)::

    {"schema": 1, "benchmark": "split", "title": "Split solver at cluster scale",
     "command": "python -m pytest benches/bench_split.py --results-json benches/results/split.json",
     "when": "2026-05-10T14:03:00+00:00",
     "host": {"cpu": "AMD EPYC", "cores": 2, "torch": "2.5.1", "python": "3.11.7"},
     "description": "...", "notes": ["..."],
     "headlines": [{"figure": "hetcoll.split vs a Python heap greedy", "value": "4,800x faster"}],
     "sections": [{"title": "split p=10000 total=10^7", "peer": "Python heap greedy",
                   "columns": [{"name": "entry"}, {"name": "median (ms)", "format": "{:,.3f}"}],
                   "rows": [["hetcoll.split", 2.31], ["Python heap greedy", 11300.2]],
                   "notes": ["..."]}]}

Cells are numbers, strings, booleans or null; a column's ``format`` (a ``str.format`` template,
default ``"{}"``, or ``"ratio"``: 2 decimals, fewer digits from 100, 2 significant below 0.1,
then ``x``) renders its numbers. ``command`` is the shell command (one per line) that
produced the figures, run from the repository root with the project's virtualenv active.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = 1
BENCHES = Path(__file__).resolve().parent
ROOT = BENCHES.parent
RESULTS = BENCHES / "results"
OUTPUT = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
README_START = "<!-- headlines:start (benches/report.py writes this table) -->"
README_END = "<!-- headlines:end -->"

#: The benchmarks docs/benchmarks.md expects, in its order: results file stem, and the make
#: target that writes it. Results files of other names follow, sorted by name.
EXPECTED: tuple[tuple[str, str], ...] = (
    ("kernels", "bench-kernels"),
    ("split", "bench-split"),
    ("partition", "bench-partition"),
    ("partitioners", "bench-partitioners"),
    ("planner", "bench-planner"),
    ("data_parallel", "bench-data-parallel"),
    ("collectives", "bench-collectives"),
    ("filter_parallel", "bench-filter-parallel"),
    ("model_validate", "bench-model-validate"),
    ("microbatches", "bench-microbatches"),
    ("plans", "bench-plans"),
    ("planspace", "bench-planspace"),
    ("placement", "bench-placement"),
    ("device", "device-check"),
    ("lm_pipeline", "bench-lm-pipeline"),
)

Cell = str | int | float | bool | None
#: The column format of ratios: see :func:`ratio`.
RATIO = "ratio"


def ratio(x: float) -> str:
    """A ratio for a table: ``2.43x``, ``3,261x``, ``0.00031x`` (never rounded to zero)."""
    if x >= 100:
        return f"{x:,.0f}x"
    if x >= 0.1 or x == 0:
        return f"{x:.2f}x"
    return f"{x:.2g}x"


class ResultError(ValueError):
    """A results file that does not follow the format: the message names the file and field."""


@dataclass(frozen=True)
class Column:
    name: str
    format: str = "{}"

    def render(self, cell: Cell) -> str:
        if cell is None:
            return "–"
        if isinstance(cell, bool):
            return "yes" if cell else "no"
        if isinstance(cell, str):
            return cell
        if isinstance(cell, float) and not math.isfinite(cell):
            return str(cell)
        if self.format == RATIO:
            return ratio(cell)
        return self.format.format(cell)


@dataclass(frozen=True)
class Section:
    title: str
    peer: str | None
    columns: tuple[Column, ...]
    rows: tuple[tuple[Cell, ...], ...]
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Headline:
    figure: str
    value: str


@dataclass(frozen=True)
class Result:
    """One benchmark's run, as read from ``benches/results/<benchmark>.json``."""

    benchmark: str
    title: str
    command: str
    when: str
    host: dict[str, Any]
    sections: tuple[Section, ...]
    description: str = ""
    notes: tuple[str, ...] = ()
    headlines: tuple[Headline, ...] = ()


# ---------------------------------------------------------------------------------------------
# Writing results: the host, the date, one file per benchmark.


def host_info() -> dict[str, Any]:
    """The machine and software a run measured: CPU model and vector flags (from
    /proc/cpuinfo), core count, Python, numpy and torch versions, the repository's commit and
    the thread-count variables the benchmarks honour."""
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                cpu = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    host: dict[str, Any] = {
        "cpu": cpu,
        "cpu_flags": [f for f in ("avx", "fma", "avx2", "avx512f") if f in flags],
        "cores": os.cpu_count(),
        "python": platform.python_version(),
    }
    for module in ("numpy", "torch"):
        try:
            host[module] = __import__(module).__version__
        except ImportError:
            host[module] = None
    host["commit"] = _commit()
    host["env"] = {
        k: os.environ[k] for k in ("OMP_NUM_THREADS", "HETCOLL_NUM_THREADS") if k in os.environ
    }
    return host


def _commit() -> str | None:
    """The checkout's short commit, with ``-dirty`` when tracked files differ from it."""
    try:

        def git(*args: str) -> str:
            return subprocess.run(
                ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True, timeout=30
            ).stdout.strip()

        dirty = git("status", "--porcelain", "--untracked-files=no")
        return git("rev-parse", "--short", "HEAD") + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def now() -> str:
    """The current time, ISO 8601 in UTC to the second."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def write_result(path: Path | str, result: dict[str, Any]) -> None:
    """Check ``result`` against the format, then write it as ``path`` (indented JSON)."""
    path = Path(path)
    parse(result, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------------------------------------
# Reading results: every field checked, errors naming the file and the field.


def _field(
    obj: Any, key: str, kind: type | tuple[type, ...], where: str, optional: bool = False
) -> Any:
    if not isinstance(obj, dict):
        raise ResultError(f"{where}: expected an object, got {type(obj).__name__}")
    if key not in obj:
        if optional:
            return None
        raise ResultError(f"{where}: field '{key}' is missing")
    value = obj[key]
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ResultError(f"{where}: field '{key}' must be {names}, got {type(value).__name__}")
    return value


def _strings(obj: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    items = _field(obj, key, list, where, optional=True) or []
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise ResultError(f"{where}: field '{key}[{i}]' must be str")
    return tuple(items)


def parse(data: Any, where: str) -> Result:
    """``data`` (a results file's JSON) as a :class:`Result`; ``where`` names the file."""
    schema = _field(data, "schema", int, where)
    if schema != SCHEMA:
        raise ResultError(f"{where}: field 'schema' is {schema}; this generator reads {SCHEMA}")
    sections = []
    for i, s in enumerate(_field(data, "sections", list, where)):
        at = f"{where}: sections[{i}]"
        columns = []
        for j, c in enumerate(_field(s, "columns", list, at)):
            cat = f"{at}.columns[{j}]"
            columns.append(
                Column(_field(c, "name", str, cat), _field(c, "format", str, cat, True) or "{}")
            )
        rows = []
        for r, row in enumerate(_field(s, "rows", list, at)):
            rat = f"{at}.rows[{r}]"
            if not isinstance(row, list) or len(row) != len(columns):
                got = f"{len(row)} cells" if isinstance(row, list) else type(row).__name__
                raise ResultError(f"{rat}: expected a list of {len(columns)} cells, got {got}")
            for col, cell in zip(columns, row):
                if cell is not None and not isinstance(cell, (str, int, float, bool)):
                    raise ResultError(f"{rat}: cell '{col.name}' is {type(cell).__name__}")
                try:
                    col.render(cell)
                except (ValueError, TypeError, IndexError, KeyError) as e:
                    raise ResultError(
                        f"{rat}: cell '{col.name}' = {cell!r} does not fit format "
                        f"{col.format!r}: {e}"
                    ) from e
            rows.append(tuple(row))
        sections.append(
            Section(
                _field(s, "title", str, at),
                _field(s, "peer", str, at, optional=True),
                tuple(columns),
                tuple(rows),
                _strings(s, "notes", at),
            )
        )
    headlines = []
    for i, h in enumerate(_field(data, "headlines", list, where, optional=True) or []):
        at = f"{where}: headlines[{i}]"
        headlines.append(Headline(_field(h, "figure", str, at), _field(h, "value", str, at)))
    when = _field(data, "when", str, where)
    try:
        dt.datetime.fromisoformat(when)
    except ValueError as e:
        raise ResultError(f"{where}: field 'when' is not an ISO 8601 date: {when!r}") from e
    return Result(
        benchmark=_field(data, "benchmark", str, where),
        title=_field(data, "title", str, where),
        command=_field(data, "command", str, where),
        when=when,
        host=_field(data, "host", dict, where),
        sections=tuple(sections),
        description=_field(data, "description", str, where, optional=True) or "",
        notes=_strings(data, "notes", where),
        headlines=tuple(headlines),
    )


def load(path: Path) -> Result:
    """Read and check one results file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ResultError(f"{path}: cannot read it as JSON: {e}") from e
    result = parse(data, str(path))
    if result.benchmark != path.stem:
        raise ResultError(
            f"{path}: field 'benchmark' is {result.benchmark!r}; the file must be named "
            f"{result.benchmark}.json"
        )
    return result


def load_all(directory: Path) -> list[Result]:
    """Every ``*.json`` directly in ``directory``, expected benchmarks first, then by name."""
    order = {name: i for i, (name, _) in enumerate(EXPECTED)}
    paths = sorted(directory.glob("*.json"), key=lambda p: (order.get(p.stem, len(order)), p.name))
    return [load(p) for p in paths]


# ---------------------------------------------------------------------------------------------
# Rendering: markdown, deterministic.

PREAMBLE = """\
Every figure here comes from a benchmark in `benches/`, run by the command printed beside its
table, and is read from that run's JSON in `benches/results/`. How they are measured:

- **Against a named peer, in the same run.** A table's ratios compare each entry with the peer
  named above it (another library's call, a textbook implementation, the engine's own
  collective, the unbalanced run), measured in the same process or launch, interleaved where
  the benchmark says so. Absolute times are those of one host; compare the ratios.
- **Medians of repeats.** Times are medians over rounds (pytest-benchmark) or over repeats of
  the slowest rank; a ratio of two medians unless the benchmark's notes say it is paired.
- **A shared, noisy host.** The runs below were made on a small machine (its CPU, core count
  and software are given with each benchmark) shared with other jobs: figures move by several
  percent from run to run, more where ranks outnumber cores.
- **Emulated heterogeneity.** Workers of unequal speed are *emulated* on one host: a rank of
  speed f sleeps (1/f - 1) times its own measured compute. No figure here comes from a real
  mixed cluster.

Commands run from the repository root with the project's virtualenv (`make build`) active;
`make bench` runs them all and regenerates this page, `make bench-report` only regenerates it.
"""


def tuning(results: Sequence[Result]) -> str:
    """The section the collectives' private tuning table points to."""
    measured = [r for r in results if r.benchmark == "collectives"]
    where = (
        f"[{measured[0].title}](#{slug(measured[0].title)}) above"
        if measured
        else "the collectives benchmark (`make bench-collectives`; not yet measured here)"
    )
    return f"""\
The collectives' private tuning table (`hetcoll.collectives._tuning`: the crossover sizes
between algorithms and the ring's segment sizes, per engine) is justified by the sizes at which
each algorithm starts to win in the per-size tables of {where}, and, until those tables carry
the history of runs behind each constant, by each constant's provenance in
[docs/collectives.md, "Tuning table"](collectives.md#tuning-table) and the tables of its
["Benchmark"](collectives.md#benchmark). A change to a crossover should come with a run of
`make bench-collectives` whose figures show it.
"""


def slug(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _date(when: str) -> str:
    t = dt.datetime.fromisoformat(when)
    if t.tzinfo is not None:
        t = t.astimezone(dt.timezone.utc)
        return t.strftime("%Y-%m-%d %H:%M UTC")
    return t.strftime("%Y-%m-%d %H:%M")


def host_line(result: Result) -> str:
    """The run's date and host in one line: CPU, cores, versions, commit, thread variables."""
    h = dict(result.host)
    parts = [_date(result.when)]
    cpu = str(h.pop("cpu", "unknown CPU"))
    flags = h.pop("cpu_flags", None)
    cores = h.pop("cores", None)
    cpu += f" ({', '.join(flags)})" if flags else ""
    cpu += f", {cores} cores" if cores is not None else ""
    parts.append(cpu)
    for key, label in (("torch", "torch"), ("numpy", "numpy"), ("python", "Python")):
        value = h.pop(key, None)
        if value is not None:
            parts.append(f"{label} {value}")
    packages = h.pop("packages", None)  # a device run's: name -> version (None: not installed)
    if isinstance(packages, dict):
        parts += [f"{k} {packages[k]}" for k in sorted(packages) if packages[k] is not None]
    commit = h.pop("commit", None)
    if commit:
        parts.append(f"commit {commit}")
    env = h.pop("env", None)
    parts += [f"{k}={env[k]}" for k in sorted(env)] if isinstance(env, dict) else []
    parts += [f"{k} {h[k]}" for k in sorted(h) if h[k] is not None]
    return " · ".join(parts)


def table(section: Section) -> list[str]:
    numeric = [
        any(
            isinstance(row[i], (int, float)) and not isinstance(row[i], bool)
            for row in section.rows
        )
        for i in range(len(section.columns))
    ]
    lines = [
        "| " + " | ".join(_cell(c.name) for c in section.columns) + " |",
        "|" + "|".join("---:" if n else "---" for n in numeric) + "|",
    ]
    for row in section.rows:
        cells = (_cell(c.render(v)) for c, v in zip(section.columns, row))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render(results: Sequence[Result], missing: Sequence[tuple[str, str]] = ()) -> str:
    """docs/benchmarks.md for ``results``; ``missing`` lists (benchmark, make target) pairs
    with no results yet."""
    out = [
        "# Benchmarks",
        "",
        "<!-- Generated by benches/report.py from benches/results/*.json; do not edit by hand."
        " `make bench-report` regenerates it. -->",
        "",
        PREAMBLE,
    ]
    if missing:
        out += [
            "Not yet measured: "
            + ", ".join(f"{name} (`make {target}`)" for name, target in missing)
            + ".",
            "",
        ]
    if any(r.headlines for r in results):
        out += ["## Headlines", "", *headline_table(results), ""]
    for r in results:
        out += [f"## {r.title}", ""]
        if r.description:
            out += [r.description, ""]
        out += ["```bash", r.command, "```", "", f"Run: {host_line(r)}.", ""]
        out += [f"- {note}" for note in r.notes]
        out += [""] if r.notes else []
        for s in r.sections:
            out += [f"### {s.title}", ""]
            if s.peer:
                out += [f"Peer: {s.peer}.", ""]
            out += [*table(s), ""]
            out += [f"- {note}" for note in s.notes]
            out += [""] if s.notes else []
    out += ["## Collectives tuning", "", tuning(results)]
    return "\n".join(out).rstrip("\n") + "\n"


def headline_table(results: Sequence[Result], link_prefix: str = "") -> list[str]:
    """Every result's headline figures as one markdown table, each linked to its section
    (``link_prefix``: the page the anchors are on, e.g. ``docs/benchmarks.md`` from README)."""
    out = ["| figure | value | benchmark |", "|---|---|---|"]
    out += [
        f"| {_cell(h.figure)} | {_cell(h.value)} "
        f"| [{_cell(r.title)}]({link_prefix}#{slug(r.title)}) |"
        for r in results
        for h in r.headlines
    ]
    return out


def with_readme_headlines(readme: str, results: Sequence[Result]) -> str:
    """``readme`` with the text between its headline markers replaced by the headline table,
    so README's figures are the same ones docs/benchmarks.md shows (one source: the JSON)."""
    start, end = readme.find(README_START), readme.find(README_END)
    if start < 0 or end < start:
        raise ResultError(f"README: needs the markers {README_START} and {README_END}")
    table = "\n".join(headline_table(results, "docs/benchmarks.md"))
    return readme[: start + len(README_START)] + "\n" + table + "\n" + readme[end:]


def generate(directory: Path = RESULTS) -> str:
    results = load_all(directory)
    have = {r.benchmark for r in results}
    return render(results, [(name, target) for name, target in EXPECTED if name not in have])


# ---------------------------------------------------------------------------------------------
# Adapters: the JSON of scripts that keep their own format, as results files.


def _result(
    benchmark: str,
    title: str,
    command: str,
    raw: Sequence[Path],
    sections: list[dict[str, Any]],
    *,
    description: str = "",
    notes: Iterable[str] = (),
    headlines: Iterable[tuple[str, str]] = (),
    kind: str | None = None,
) -> dict[str, Any]:
    """A results file for an adapter: ``command`` (the script's run), then the import line
    (``kind``: the adapter's name, by default the benchmark's); the date is the newest raw
    file's, the host the importing machine's (said in the notes)."""
    mtime = max(p.stat().st_mtime for p in raw)
    kind = benchmark.replace("_", "-") if kind is None else kind
    imported = "python benches/report.py import " + kind + " "
    imported += " ".join(_relative(p) for p in raw)
    return {
        "schema": SCHEMA,
        "benchmark": benchmark,
        "title": title,
        "command": command.strip() + "\n" + imported,
        "when": dt.datetime.fromtimestamp(mtime, dt.timezone.utc).isoformat(timespec="seconds"),
        "host": host_info(),
        "description": description,
        "notes": [
            *notes,
            "Date: the raw file's; host: the machine that imported it (the same one under "
            "`make bench`).",
        ],
        "headlines": [{"figure": f, "value": v} for f, v in headlines],
        "sections": sections,
    }


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _col(name: str, fmt: str = "{}") -> dict[str, str]:
    return {"name": name, "format": fmt} if fmt != "{}" else {"name": name}


def _raw_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ResultError(f"{path}: cannot read it as {what} JSON: {e}") from e


def _need(obj: Any, key: str, where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise ResultError(f"{where}: field '{key}' is missing")
    return obj[key]


#: bench_collectives.py's per-size row fields, as its own table shows them.
_COLLECTIVE_COLUMNS = (
    ("engine_again", "{engine} again"),
    ("auto_weighted", "weighted (auto)"),
    ("native", "native"),
    ("native_weighted", "native weighted"),
    ("direct_weighted", "direct weighted"),
    ("ring_weighted", "ring weighted"),
    ("shared_weighted", "shared weighted"),
    ("ring_over_bound", "ring / lower bound"),
    ("allgatherv_auto_over_allgather", "allgatherv (auto) / {gather}"),
    ("allgatherv_over_allgather", "allgatherv native"),
    ("allgatherv_ring_over_allgather", "allgatherv ring"),
    ("allgatherv_direct_over_allgather", "allgatherv direct"),
    ("allgatherv_shared_over_allgather", "allgatherv shared"),
)


#: bench_collectives.py's operation names, for the peers of score_collectives.py's targets.
_OPERATIONS = {
    "engine": "the engine's allreduce (`MPI_Allreduce`, `dist.all_reduce`)",
    "allgather": "the engine's allgather of equal pieces, same total bytes",
}


def adapt_collectives(raw: Sequence[Path], command: str) -> dict[str, Any]:
    """``bench_collectives.py --json`` files (one per run) as a results file: per engine and
    rank count, each size's ratios (the median over runs of each run's figure), then the three
    targets of ``score_collectives.py``, its pooled medians and bootstrap intervals."""
    sys.path.insert(0, str(BENCHES))
    import score_collectives as sc

    try:
        runs = sc.load(list(raw))
    except ValueError as e:
        raise ResultError(str(e)) from e
    configs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for path, results in zip(raw, runs):
        for i, res in enumerate(results):
            key = (res["engine"], res["ranks"])
            configs.setdefault(key, []).append({"path": path, "at": i, **res})
    sections = []
    for (engine, ranks), per_run in sorted(configs.items()):
        peer = "MPI_Allreduce" if engine == "mpi" else "dist.all_reduce"
        gather = "MPI_Allgather" if engine == "mpi" else "all_gather"
        by_size: dict[int, list[dict[str, Any]]] = {}
        for res in per_run:
            for j, row in enumerate(res["rows"]):
                where = f"{res['path']}: [{res['at']}].rows[{j}]"
                by_size.setdefault(_need(row, "bytes", where), []).append(row)
                for field, _ in _COLLECTIVE_COLUMNS:
                    _need(row, field, where)

        def median(rows: list[dict[str, Any]], field: str) -> float | None:
            values = [row[field] for row in rows if row[field] is not None]
            return statistics.median(values) if values else None

        rows = [
            [
                sc.size_label(nbytes),
                median(rows, "calls"),
                median(rows, "engine_GBps"),
                *(median(rows, field) for field, _ in _COLLECTIVE_COLUMNS),
            ]
            for nbytes, rows in sorted(by_size.items())
        ]
        pingpong = statistics.median(res["pingpong_GBps"] for res in per_run)
        sections.append(
            {
                "title": f"{engine}, p = {ranks}: time relative to {peer} (lower is better)",
                "peer": f"`{peer}` on the same buffer (allgatherv: `{gather}` of equal pieces, "
                "same total bytes), paired within each repeat",
                "columns": [
                    _col("size"),
                    _col("calls per loop", "{:g}"),
                    _col(f"{peer} GB/s", "{:.3f}"),
                    *(
                        _col(name.format(engine=peer, gather=gather), RATIO)
                        for _, name in _COLLECTIVE_COLUMNS
                    ),
                ],
                "rows": rows,
                "notes": [
                    f"{len(per_run)} run(s); each ratio is the median over runs of the run's "
                    "median over repeats of the paired ratio within a repeat.",
                    f"Ping-pong bandwidth between ranks 0 and 1: {pingpong:.2f} GB/s; the ring's "
                    "lower bound is 2(p-1)/p · N / B.",
                ],
            }
        )
    headlines, notes = [], []
    for target in sc.TARGETS:
        found, per_run_met = sc.cells(runs, target)
        if not found:
            notes.append(
                f"Target {target.title} <= {target.limit:.3g}x: no cell in these runs (it "
                f"covers {', '.join(target.engines)} from {sc.size_label(target.min_bytes)})."
            )
            continue
        tally = {"met": 0, "open": 0, "missed": 0}
        rows = []
        for cell in found:
            m, lo, hi = cell.pooled(target.name, target.peer)
            verdict = sc.verdict(lo, hi, target.limit)
            tally[verdict] += 1
            met = sum(sc._met(row, target) for row in cell.rows)
            line: list[Cell] = [
                cell.engine,
                cell.ranks,
                sc.size_label(cell.nbytes),
                f"{met} of {len(cell.rows)}",
                m,
                lo,
                hi,
                verdict,
            ]
            for _, name in target.controls:
                line.append(cell.pooled(name, target.peer)[0])
            rows.append(line)
        counts = ", ".join(f"{n} {word}" for word, n in tally.items())
        headlines.append((f"{target.title} <= {target.limit:.3g}x", f"{counts} of {len(found)}"))
        sections.append(
            {
                "title": f"Target: {target.title} <= {target.limit:.3g}x",
                "peer": f"{_OPERATIONS.get(target.peer, target.peer)} in the same repeat "
                "(paired ratios)",
                "columns": [
                    _col("engine"),
                    _col("p", "{}"),
                    _col("size"),
                    _col("runs met"),
                    _col("pooled", RATIO),
                    _col("95% low", RATIO),
                    _col("95% high", RATIO),
                    _col("verdict"),
                    *(_col(f"{title}, pooled", RATIO) for title, _ in target.controls),
                ],
                "rows": rows,
                "notes": [
                    f"Cells: {counts}. Met when the whole 95% two-level bootstrap interval "
                    "(runs, then repeats) is within the limit, missed when it is all beyond, "
                    "open when the runs cannot tell.",
                    "Cells met, run by run: "
                    + ", ".join(f"{met} of {n}" for met, n in per_run_met)
                    + ".",
                ],
            }
        )
    return _result(
        "collectives",
        "Collectives: weighted allreduce and allgatherv",
        command,
        raw,
        sections,
        description=(
            "hetcoll's weighted allreduce and allgatherv against the engines' own collectives "
            "(MPI through mpi4py/MPICH, torch.distributed gloo), all ranks on one host, buffers "
            "of float32 from 4 KiB; each operation timed in loops of back-to-back calls, the "
            "operations taking turns in an order shuffled every repeat. Scored against the "
            "targets by `benches/score_collectives.py`."
        ),
        notes=notes,
        headlines=headlines,
    )


_STRATEGIES = ("filter, even split", "filter, speed-proportional", "data, balanced batches")


def _rank_results(raw: Sequence[Path], kind: str, script: str) -> tuple[Path, list[Any]]:
    """The one ``script --json`` file of an import of ``kind``: its path and its list of one
    result per rank (rank 0's step times the slowest rank's)."""
    if len(raw) != 1:
        raise ResultError(f"{kind}: give one {script} --json file")
    path = raw[0]
    data = _raw_json(path, f"{script} --json")
    if not isinstance(data, list) or not data:
        raise ResultError(f"{path}: expected a list with one result per rank")
    return path, data


def adapt_filter_parallel(raw: Sequence[Path], command: str) -> dict[str, Any]:
    """A ``bench_filter_parallel.py --json`` file (a list with one result per rank, rank 0's
    step times the slowest rank's) as a results file."""
    path, data = _rank_results(raw, "filter-parallel", "bench_filter_parallel.py")
    batches = _need(data[0], "batches", f"{path}: [0]")
    steps, versus, headlines = [], [], []
    for b in sorted(batches, key=int):
        row = batches[b]
        where = f"{path}: [0].batches.{b}"
        times = {name: _need(row, name, where) for name in _STRATEGIES}
        even = times["filter, even split"]
        steps += [[int(b), name, times[name] * 1e3, even / times[name]] for name in _STRATEGIES]
        prop, data_s = times["filter, speed-proportional"], times["data, balanced batches"]
        shares = _need(_need(row, "shares", where), "proportional", f"{where}.shares")
        versus.append([int(b), prop * 1e3, data_s * 1e3, data_s / prop, str(shares)])
        headlines.append(
            (
                f"filter parallel, speed-proportional vs even split, batch {b}",
                f"{even / prop:.2f}x faster",
            )
        )
    memory = []
    for r, res in enumerate(data):
        mem = _need(res, "memory", f"{path}: [{r}]")
        f = _need(mem, "filter parallel", f"{path}: [{r}].memory")
        u = _need(mem, "unsplit", f"{path}: [{r}].memory")
        memory.append(
            [
                r,
                f["param_bytes"],
                f["param_bytes"] / u["param_bytes"],
                f["adam_state_bytes"],
                f["adam_state_bytes"] / u["adam_state_bytes"],
            ]
        )
    return _result(
        "filter_parallel",
        "Filter parallelism",
        command,
        raw,
        [
            {
                "title": "Step time: speed-proportional split vs the even split",
                "peer": "the even split torch.chunk / Mesh-TensorFlow would use, same model and "
                "global batch",
                "columns": [
                    _col("global batch", "{}"),
                    _col("strategy"),
                    _col("step (ms)", "{:.1f}"),
                    _col("speed vs even split (even / time)", RATIO),
                ],
                "rows": steps,
                "notes": [
                    "Median over steps of the slowest rank's step (forward, backward, SGD "
                    "step); the strategies take turns step by step."
                ],
            },
            {
                "title": "Filter parallel vs data parallel with balanced batches",
                "peer": "data parallel, batches split by hetcoll.split, gradients averaged by "
                "one weighted hetcoll.allreduce",
                "columns": [
                    _col("global batch", "{}"),
                    _col("filter, proportional (ms)", "{:.1f}"),
                    _col("data parallel (ms)", "{:.1f}"),
                    _col("speed vs data parallel (data / filter)", RATIO),
                    _col("filter shares per layer"),
                ],
                "rows": versus,
            },
            {
                "title": "Memory per rank",
                "peer": "the unsplit model on one rank",
                "columns": [
                    _col("rank", "{}"),
                    _col("parameter bytes", "{:,}"),
                    _col("of unsplit", "{:.1%}"),
                    _col("Adam state bytes", "{:,}"),
                    _col("of unsplit", "{:.1%}"),
                ],
                "rows": memory,
            },
        ],
        description=(
            "Filter parallelism on two gloo ranks of emulated speeds (`SPEEDS` in "
            "`benches/bench_filter_parallel.py`), a conv-heavy CNN: every rank computes its "
            "share of each layer's filters on the whole batch; heterogeneity is emulated the "
            "same way for every strategy."
        ),
        headlines=headlines,
    )


_TP_STRATEGIES = (
    "paired, speed-proportional",
    "paired, even split",
    "gather mode, speed-proportional",
)
_TP_ALONE = "unsplit, fast rank alone"
_TP_TIMED = "paired, time-balanced"
_TP_PLANNED = "paired, planned"
_TP_LOSS = "paired, speed-proportional, loss split"


def _bytes_of(row: Mapping[str, Any]) -> int:
    """A tensor-parallel strategy's bytes per step, forward and backward."""
    b = row.get("bytes", {})
    return int(b.get("activations", 0)) + int(b.get("gradients", 0))


def _predicted_section(
    rows: Mapping[str, Mapping[str, Any]], peer: str, peer_label: str, note: str
) -> list[dict[str, Any]]:
    """The table of the performance model's steps against the measured ones, for the
    strategies whose rows have a ``predicted_s`` (none: no table), each strategy's speed
    against ``peer``'s measured and predicted (``peer_label`` names it in the columns)."""
    measured_peer = rows[peer]["step_s"]
    predicted_peer = rows[peer].get("predicted_s")
    guesses = [
        [
            name,
            row["step_s"] * 1e3,
            row["predicted_s"] * 1e3,
            row["predicted_s"] / row["step_s"] - 1.0,
            measured_peer / row["step_s"],
            predicted_peer / row["predicted_s"] if predicted_peer else None,
        ]
        for name, row in rows.items()
        if isinstance(row.get("predicted_s"), (int, float))
    ]
    if not guesses:
        return []
    return [
        {
            "title": "Predicted against measured step (the performance model, emulation modelled)",
            "peer": "the measured step of the same strategy, in the same run",
            "columns": [
                _col("strategy"),
                _col("measured (ms)", "{:.1f}"),
                _col("predicted (ms)", "{:.1f}"),
                _col("error (predicted / measured - 1)", "{:+.0%}"),
                _col(f"measured speed vs {peer_label}", RATIO),
                _col(f"predicted speed vs {peer_label}", RATIO),
            ],
            "rows": guesses,
            "notes": [note],
        }
    ]


def adapt_tensor_parallel(raw: Sequence[Path], command: str) -> dict[str, Any]:
    """A ``bench_tensor_parallel.py --json`` file (a list with one result per rank, rank 0's
    step times the slowest rank's) as a results file."""
    path, data = _rank_results(raw, "tensor-parallel", "bench_tensor_parallel.py")
    r0 = data[0]
    rows = {name: _need(r0, name, f"{path}: [0]") for name in _TP_STRATEGIES}
    # Results from before they were measured lack them.
    for optional in (_TP_TIMED, _TP_PLANNED, _TP_LOSS, _TP_ALONE):
        if optional in r0:
            rows[optional] = r0[optional]
    even = _need(rows["paired, even split"], "step_s", f"{path}: [0].paired, even split")
    prop = rows["paired, speed-proportional"]
    gather = rows["gather mode, speed-proportional"]
    where = f"{path}: [0]"
    steps, traffic = [], []
    for name, row in rows.items():
        t = _need(row, "step_s", f"{where}.{name}")
        q1, q3 = _need(row, "step_s_q1", f"{where}.{name}"), _need(row, "step_s_q3", f"{where}")
        steps.append([name, t * 1e3, q1 * 1e3, q3 * 1e3, even / t])
        b = _need(row, "bytes", f"{where}.{name}")
        traffic.append(
            [name, b.get("activations", 0), b.get("gradients", 0), str(row.get("modes", ""))]
        )
    pb, gb = _bytes_of(prop), _bytes_of(gather)
    arch = r0.get("arch", "?")
    what = f"{arch}, batch {r0.get('batch', '?')} x {r0.get('seq', '?')}"
    # A mixture of experts (--arch mixtral) is a results file of its own.
    moe = arch == "mixtral"
    # The example's byte vocabulary is the main run; a run at another vocabulary (--vocab) is
    # a results file of its own, its headline the split loss's.
    vocab = r0.get("vocab", 256)
    other_vocab = vocab != 256
    if other_vocab:
        what += f", vocabulary {vocab}"
    # The performance model's steps, where the run has them (runs before it do not).
    predictions = _predicted_section(
        rows,
        "paired, even split",
        "even split",
        "hetcoll.model.predict's filter-parallel step of the split (attentions by key/value "
        "groups, MLPs by hidden units), on this machine's device and gloo link measured in the "
        "same run (hetcoll.lab.calibrate), each rank's layers with parameters slowed to its "
        "emulated speed as slow_down slows them (hetcoll.lab.predict_emulated.filter_parallel, "
        "slowed='parameters'). The time-balanced split is not predicted (its split follows the "
        "ranks' timings).",
    )
    headlines = [
        (
            "tensor parallel, speed-proportional vs even head split",
            f"{even / prop['step_s']:.2f}x faster",
        ),
        ("tensor parallel, paired vs gather mode: bytes per step", f"{gb / max(pb, 1):.2f}x fewer"),
        *(
            [
                (
                    "tensor parallel, time-balanced vs even head split",
                    f"{even / rows[_TP_TIMED]['step_s']:.2f}x faster",
                )
            ]
            if _TP_TIMED in rows
            else []
        ),
        *(
            [
                (
                    "tensor parallel, planned (predicted-time-balanced) vs even head split",
                    f"{even / rows[_TP_PLANNED]['step_s']:.2f}x faster",
                )
            ]
            if _TP_PLANNED in rows
            else []
        ),
        *(
            [
                (
                    "tensor parallel, loss split by vocabulary vs gathered logits "
                    f"(speed-proportional, vocabulary {vocab})",
                    f"speed {prop['step_s'] / rows[_TP_LOSS]['step_s']:.2f}x, bytes "
                    f"{pb / max(_bytes_of(rows[_TP_LOSS]), 1):.2f}x fewer",
                )
            ]
            if _TP_LOSS in rows
            else []
        ),
        *(
            [
                (
                    "tensor parallel, speed-proportional split vs the unsplit model on the "
                    "fast rank alone",
                    f"{rows[_TP_ALONE]['step_s'] / prop['step_s']:.2f}x",
                )
            ]
            if _TP_ALONE in rows
            else []
        ),
    ]
    if other_vocab:
        headlines = [h for h in headlines if "loss split" in h[0]]
    # A LoRA or DoRA fine-tuning (--arch llama-lora, llama-dora) is a results file of its
    # own: its wrapped projections split with their blocks against gather mode (each base
    # layer and adapter a layer of its own, as they split before the wrappers were known).
    adapters = {"llama-lora": "LoRA", "llama-dora": "DoRA"}.get(arch)
    if adapters:
        headlines = [
            (
                f"{adapters} fine-tuning (PEFT adapters on every projection) at emulated "
                "speeds 1:0.25, split by heads vs layer by layer (gather mode): bytes per step",
                f"{gb / max(pb, 1):.2f}x fewer",
            ),
            (
                f"{adapters} fine-tuning at emulated speeds 1:0.25, split by heads vs layer by "
                "layer (gather mode): step time",
                f"{gather['step_s'] / prop['step_s']:.2f}x faster",
            ),
        ]
    if moe:
        headlines = [
            (
                "mixture of experts (Mixtral) at emulated speeds 1:0.25, experts by hidden "
                "units: speed-proportional vs even split",
                f"{even / prop['step_s']:.2f}x faster",
            ),
            *[
                (
                    "mixture of experts (Mixtral) at emulated speeds 1:0.25, "
                    + h[0].removeprefix("tensor parallel, "),
                    h[1],
                )
                for h in headlines
                if "fast rank alone" in h[0]
            ],
        ]
    return _result(
        "tensor_parallel"
        + (f"_vocab{vocab}" if other_vocab else "")
        + ("_moe" if moe else "")
        + (f"_{adapters.lower()}" if adapters else ""),
        (
            "Tensor parallelism of a mixture of experts"
            if moe
            else f"Tensor parallelism of a {adapters} fine-tuning"
            if adapters
            else "Tensor parallelism of a decoder"
        )
        + (f", vocabulary {vocab}" if other_vocab else ""),
        command,
        raw,
        [
            {
                "title": f"Step time: speed-proportional vs even head split ({what})",
                "peer": "the even split Megatron-LM, DTensor and DeepSpeed AutoTP use (the same "
                "code at equal speeds), gather mode (every Linear gathers its output), and the "
                "unsplit model on the fast rank alone (no tensor parallelism)",
                "columns": [
                    _col("strategy"),
                    _col("step (ms)", "{:.1f}"),
                    _col("q1 (ms)", "{:.1f}"),
                    _col("q3 (ms)", "{:.1f}"),
                    _col("speed vs even split (even / time)", RATIO),
                ],
                "rows": steps,
                "notes": [
                    "Median and quartiles over steps of the slowest rank's step (forward, "
                    "backward, SGD step); the strategies take turns step by step.",
                    "Loss split: filter_parallel(..., loss_parallel=True), the head's logits "
                    "kept split by vocabulary through F.cross_entropy (SplitOutput).",
                ],
            },
            {
                "title": "Bytes sent per step by this rank",
                "peer": "gather mode",
                "columns": [
                    _col("strategy"),
                    _col("forward bytes", "{:,}"),
                    _col("backward bytes", "{:,}"),
                    _col("split layers by mode"),
                ],
                "rows": traffic,
            },
            *predictions,
        ],
        description=(
            "Attention split by heads and MLPs by hidden units (`filter_parallel`) on two gloo "
            "ranks of emulated speeds (`SPEEDS` in `benches/bench_tensor_parallel.py`), the LM "
            "example's decoder"
            + (
                f" as a {adapters} fine-tuning (PEFT's adapters of rank 8 on its seven "
                "projections, the base frozen: each wrapper split with its block, its adapters "
                "with it"
                + ("; DoRA's magnitudes and weight norms too" if adapters == "DoRA" else "")
                + ")"
                if adapters
                else ""
            )
            + "; heterogeneity is emulated the same way for every strategy."
            if not moe
            else "Attention split by heads and each expert's hidden units (`filter_parallel`: "
            "`FilterParallelExperts`) on two gloo ranks of emulated speeds (`SPEEDS` in "
            "`benches/bench_tensor_parallel.py`), Hugging Face Mixtral in the LM example's "
            "shape (8 experts of 176 hidden units per block, 2 per token, `grouped_mm`); "
            "heterogeneity is emulated the same way for every strategy (gather mode leaves the "
            "experts whole)."
        ),
        headlines=headlines,
        kind="tensor-parallel",
    )


#: bench_expert_parallel.py's strategies, in its order; the even placement is the peer.
_EP_STRATEGIES = (
    "experts by speed, rows by speed",
    "experts even, rows by speed",
    "experts even, rows even",
    "experts replicated, rows by speed",
    "unsplit, fast rank alone",
)
_EP_EVEN = "experts even, rows even"
#: The placement by speed as a plan run by parallelize, in one micro-batch and in 4 (runs
#: from before them lack them).
_EP_PLANNED = "experts by speed, rows by speed, plan"
_EP_MICRO = "experts by speed, rows by speed, plan, 4 micro-batches"
#: The router favouring two experts: placed by speed (the peer) and by measured loads (runs
#: from before it lack it).
_EP_SKEWED = ("skewed router: experts by speed", "skewed router: experts by load")


def _skewed_router_section(r0: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    """bench_expert_parallel.py's skewed router: the experts by speed against by the loads
    measured in the run, measured and predicted at those loads (none in runs before it)."""
    skew = r0.get("skewed router")
    if skew is None:
        return []
    peer = _need(_need(r0, _EP_SKEWED[0], where), "step_s", f"{where}.{_EP_SKEWED[0]}")
    guess_peer = r0[_EP_SKEWED[0]].get("predicted_s")
    rows = []
    for name in _EP_SKEWED:
        row = _need(r0, name, where)
        t = _need(row, "step_s", f"{where}.{name}")
        first = next(iter(_need(skew, "placements", where)[name].values()))
        held = " | ".join(",".join(map(str, h)) or "-" for h in first)
        guess = row.get("predicted_s")
        rows.append(
            [
                name.removeprefix("skewed router: "),
                held,
                t * 1e3,
                row["step_s_q1"] * 1e3,
                row["step_s_q3"] * 1e3,
                peer / t,
                None if guess is None else guess * 1e3,
                None if guess is None else guess / t - 1.0,
                None if guess is None or guess_peer is None else guess_peer / guess,
            ]
        )
    layer, loads = next(iter(_need(skew, "loads", where).items()))
    total = sum(loads) or 1
    shares = ", ".join(f"{100 * x / total:.0f}%" for x in loads)
    return [
        {
            "title": "A router favouring two experts: placed by speed vs by measured loads",
            "peer": "the experts placed by speed (runs in expert order), rows by speed",
            "columns": [
                _col("experts placed"),
                _col("each rank's experts (first layer)"),
                _col("step (ms)", "{:.1f}"),
                _col("q1 (ms)", "{:.1f}"),
                _col("q3 (ms)", "{:.1f}"),
                _col("speed vs by speed", RATIO),
                _col("predicted (ms)", "{:.1f}"),
                _col("error (predicted / measured - 1)", "{:+.0%}"),
                _col("predicted speed vs by speed", RATIO),
            ],
            "rows": rows,
            "notes": [
                f"Every router's logits get +{skew.get('bias')} on experts "
                f"{', '.join(map(str, skew.get('hot', [])))}; the loads measured in one "
                f"forward of the batch ({layer}: {shares} of the tokens' picks, expert 0 "
                "first) place the experts by `expert_parallel(..., loads=)` (any experts on "
                "any rank), and price both placements (`expert_parallel_schedule(..., "
                "loads=)`, emulation modelled as above).",
            ],
        }
    ]


def adapt_expert_parallel(raw: Sequence[Path], command: str) -> dict[str, Any]:
    """A ``bench_expert_parallel.py --json`` file (a list with one result per rank, rank 0's
    step times the slowest rank's) as a results file."""
    path, data = _rank_results(raw, "expert-parallel", "bench_expert_parallel.py")
    r0 = data[0]
    where = f"{path}: [0]"
    names = list(_EP_STRATEGIES)
    for planned in (_EP_PLANNED, _EP_MICRO):
        if planned in r0:
            names.insert(-1, planned)
    rows = {name: _need(r0, name, where) for name in names}
    even = _need(rows[_EP_EVEN], "step_s", f"{where}.{_EP_EVEN}")
    steps = []
    for name, row in rows.items():
        t = _need(row, "step_s", f"{where}.{name}")
        q1, q3 = _need(row, "step_s_q1", f"{where}.{name}"), _need(row, "step_s_q3", where)
        held = ":".join(str(n) for n in _need(row, "experts", f"{where}.{name}"))
        share = ":".join(str(n) for n in _need(row, "rows", f"{where}.{name}"))
        # Runs from before it was measured lack it.
        kib = ":".join(f"{b / 1024:.0f}" for b in row.get("param_bytes_per_rank", [])) or "-"
        steps.append([name, held, share, kib, t * 1e3, q1 * 1e3, q3 * 1e3, even / t])
    predictions = _predicted_section(
        rows,
        _EP_EVEN,
        "even",
        "hetcoll.model.predict.expert_parallel_schedule (replicated experts and the fast rank "
        "alone: data_parallel_schedule; the plan: expert_plan_schedule) on this machine's "
        "device and gloo link measured in the same run (hetcoll.lab.calibrate), each rank's "
        "layers with parameters slowed to its emulated speed as slow_down slows them "
        "(hetcoll.lab.predict_emulated.slowed_by_parameters).",
    )
    speeds = ":".join(f"{s:g}" for s in r0.get("speeds", []))
    by_speed = rows["experts by speed, rows by speed"]["step_s"]
    head = f"expert parallelism (Mixtral) at emulated speeds {speeds}"
    return _result(
        "expert_parallel",
        "Expert parallelism of a mixture of experts",
        command,
        raw,
        [
            {
                "title": "Step time: experts placed by speed vs evenly (Mixtral, batch "
                f"{r0.get('batch', '?')} x {r0.get('seq', '?')})",
                "peer": "the even placement DeepSpeed-MoE and Megatron-LM use, with even rows "
                "(their data parallelism too); the same code given shares",
                "columns": [
                    _col("strategy"),
                    _col("experts per rank"),
                    _col("rows per rank"),
                    _col("parameters per rank (KiB)"),
                    _col("step (ms)", "{:.1f}"),
                    _col("q1 (ms)", "{:.1f}"),
                    _col("q3 (ms)", "{:.1f}"),
                    _col("speed vs even (even / time)", RATIO),
                ],
                "rows": steps,
                "notes": [
                    "Median and quartiles over steps of the slowest rank's step (forward, "
                    "backward, SGD step); the strategies take turns step by step.",
                    "Replicated: every rank holds all 8 experts (plain data parallelism, twice "
                    "the experts' memory, no all-to-all).",
                    *(
                        [
                            "Plan: the placement by speed as a `Plan` with `experts` (the "
                            "planner's balanced expert-parallel candidate) run by `parallelize`: "
                            "its gradients summed after the backward, not in DDP's buckets."
                        ]
                        if _EP_PLANNED in rows
                        else []
                    ),
                    *(
                        [
                            "4 micro-batches: the same plan run in 4 passes (a quarter of the "
                            "activations held, four times the exchanges); predicted by "
                            "expert_plan_schedule's one pass per micro-batch."
                        ]
                        if _EP_MICRO in rows
                        else []
                    ),
                ],
            },
            *predictions,
            *_skewed_router_section(r0, where),
        ],
        description=(
            "Whole experts placed on data-parallel ranks (`expert_parallel`) on two gloo ranks "
            "of emulated speeds (`SPEEDS` in `benches/bench_expert_parallel.py`), Hugging Face "
            "Mixtral in the LM example's shape (8 experts of 176 hidden units per block, 2 per "
            "token, `grouped_mm`), DDP with the weighted hook; heterogeneity is emulated the "
            "same way for every strategy."
        ),
        headlines=[
            (f"{head}: experts and rows by speed vs even", f"{even / by_speed:.2f}x faster"),
            (
                f"{head}: experts by speed vs replicated experts (data parallel)",
                f"{rows['experts replicated, rows by speed']['step_s'] / by_speed:.2f}x",
            ),
            (
                f"{head}: experts by speed vs the unsplit model on the fast rank alone",
                f"{rows['unsplit, fast rank alone']['step_s'] / by_speed:.2f}x",
            ),
            *(
                [
                    (
                        f"{head}, a router favouring two experts: experts by measured loads "
                        "vs by speed",
                        f"{r0[_EP_SKEWED[0]]['step_s'] / r0[_EP_SKEWED[1]]['step_s']:.2f}x faster",
                    )
                ]
                if "skewed router" in r0
                else []
            ),
        ],
    )


def adapt_model_validate(raw: Sequence[Path], command: str) -> dict[str, Any]:
    """A ``hetcoll model validate --json`` output as a results file."""
    if len(raw) != 1:
        raise ResultError("model-validate: give one `hetcoll model validate --json` output")
    path = raw[0]
    data = _raw_json(path, "hetcoll model validate --json")
    rows = []
    for i, r in enumerate(_need(data, "results", str(path))):
        where = f"{path}: results[{i}]"
        strategy = _need(r, "strategy", where)
        if strategy != "data" and not r.get("avoid_gathers", True):
            strategy += "/gather"
        rows.append(
            [
                strategy,
                _need(r, "ranks", where),
                _need(r, "batch", where),
                ",".join(str(s) for s in _need(r, "shares", where)),
                ",".join(f"{s:g}" for s in _need(r, "speeds", where)),
                _need(r, "predicted_s", where) * 1e3,
                _need(r, "measured_s", where) * 1e3,
                _need(r, "error", where),
                _need(r, "spread", where),
                "noise" if _need(r, "noise", where) else "",
            ]
        )
    summary = [
        [s, v["median_abs_error"], v["worst_abs_error"]]
        for s, v in sorted(_need(data, "by_strategy", str(path)).items())
    ]
    med = _need(data, "median_abs_error", str(path))
    worst = _need(data, "worst_abs_error", str(path))
    summary.append(["all rows", med, worst])
    repeat = _need(data, "repeat", str(path))
    noisy = _need(data, "noise_rows", str(path))
    beyond = _need(data, "worst_abs_error_beyond_noise", str(path))
    spread_note = (
        f"Each row: the run of median error of {repeat} runs of the configuration, in rounds; "
        "spread = the range of the runs' errors."
        if repeat > 1
        else "Spread: the interquartile range of the row's steps over their median."
    )
    return _result(
        "model_validate",
        "Performance model: predicted vs measured steps",
        command,
        raw,
        [
            {
                "title": "Predicted vs measured step time",
                "peer": "the step time measured in the same run (error = predicted / measured - 1)",
                "columns": [
                    _col("strategy"),
                    _col("ranks", "{}"),
                    _col("batch", "{}"),
                    _col("shares"),
                    _col("speeds"),
                    _col("predicted (ms)", "{:.1f}"),
                    _col("measured (ms)", "{:.1f}"),
                    _col("error", "{:+.1%}"),
                    _col("spread", "{:.1%}"),
                    _col("noise"),
                ],
                "rows": rows,
                "notes": [
                    spread_note,
                    "noise: the row's own measurements vary by more than its error, so its "
                    "error says nothing about the model.",
                ],
            },
            {
                "title": "Error summary",
                "columns": [
                    _col("strategy"),
                    _col("median |error|", "{:.1%}"),
                    _col("worst |error|", "{:.1%}"),
                ],
                "rows": summary,
                "notes": [
                    "Targets: median |error| <= 12%, worst <= 30%.",
                    f"{noisy} of {len(rows)} rows are noise; worst |error| of the others: "
                    f"{beyond:.1%}.",
                ],
            },
        ],
        description=(
            "`hetcoll model validate` trains a built-in model for real on gloo (data parallel "
            "with DDP, filter parallel with `hetcoll.torch.filter_parallel`, plans - "
            "pipelines, hybrids, a device subset - with `hetcoll.torch.parallelize`), emulated "
            "speeds, and compares each configuration's predicted step time with the measured "
            "one. "
            "Details: [docs/model.md](model.md)."
        ),
        headlines=[
            (
                "performance model, median / worst |error| (targets 12% / 30%)",
                f"{med:.1%} / {worst:.1%}",
            )
        ],
    )


def _stages(plan: dict[str, Any], where: str) -> tuple[str, str]:
    """A plan's samples per replica and its stages, for a table: ``"43 + 21"`` and
    ``"rank 0: layers 0-15 / rank 1: 0-8, rank 2: 8-15"`` (replicas split by ``/``)."""
    replicas = _need(plan, "replicas", where)
    samples = " + ".join(str(_need(r, "samples", where)) for r in replicas)
    parts = []
    for r in replicas:
        stages = []
        for s in _need(r, "stages", where):
            ranks, (lo, hi) = _need(s, "ranks", where), _need(s, "layers", where)
            who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ",".join(map(str, ranks))
            stages.append(f"{who}: {lo}-{hi}")
        parts.append(", ".join(stages))
    return samples, " / ".join(parts)


def adapt_plans(raw: Sequence[Path], command: str) -> dict[str, Any]:
    """A ``bench_plans.py --json`` file (its launches' medians per plan, and torch's for the
    pipeline) as a results file."""
    if len(raw) != 1:
        raise ResultError("plans: give one bench_plans.py --json file")
    path = raw[0]
    data = _raw_json(path, "bench_plans.py --json")
    speeds = ":".join(f"{s:g}" for s in _need(data, "speeds", str(path)))
    ranks = len(_need(data, "speeds", str(path)))
    batch = _need(data, "batch", str(path))
    microbatches = _need(data, "microbatches", str(path))
    launches = _need(data, "launches", str(path))
    steps = _need(data, "steps", str(path))
    layer_ms = sum(_need(data, "layer_seconds", str(path))) * 1e3
    hosts = data.get("shared_cores") or []  # absent from files before the fitted wake-up cost
    rows, versus, headlines = [], [], []
    for i, row in enumerate(_need(data, "plans", str(path))):
        where = f"{path}: plans[{i}]"
        name = _need(row, "name", where)
        samples, stages = _stages(_need(row, "plan", where), f"{where}.plan")
        measured = _need(row, "measured_s", where)
        predicted = _need(row, "predicted_s", where)
        planner = row.get("planner_s")  # absent from files before the emulation-aware one
        per_launch = _need(row, "measured_s_per_launch", where)
        iqr = statistics.median(q3 - q1 for q1, q3 in _need(row, "quartiles_s_per_launch", where))
        vs = _need(row, "vs_torch_pipelining", where)
        rows.append(
            [
                name,
                samples,
                stages,
                predicted * 1e3 if predicted is not None else None,
                measured * 1e3,
                ", ".join(f"{m * 1e3:.1f}" for m in per_launch),
                iqr * 1e3,
                predicted / measured - 1 if predicted is not None else None,
                planner / measured - 1 if planner is not None else None,
                vs,
            ]
        )
        if vs is None:
            continue
        peer = _need(row, "torch_schedule", where)
        torch_s = _need(row, "torch_s_per_launch", where)
        ratios = _need(row, "vs_torch_per_launch", where)
        versus.append(
            [
                name,
                f"torch {peer}",
                statistics.median(per_launch) * 1e3,
                statistics.median(torch_s) * 1e3,
                ", ".join(f"{r:.2f}" for r in ratios),
                vs,
            ]
        )
        headlines.append(
            (
                f"{name}, {ranks} ranks at emulated speeds {speeds}: torch.distributed."
                f"pipelining's step / hetcoll's",
                f"{vs:.2f}x (runs: {', '.join(f'{r:.2f}' for r in ratios)})",
            )
        )
    return _result(
        "plans",
        "Plans: pipelines, asymmetric replicas, filter-split stages, device subsets",
        command,
        raw,
        [
            {
                "title": "Step time by plan",
                "peer": "the pipeline's stages and micro-batches under "
                "torch.distributed.pipelining, same schedule, in the same launch (last column)",
                "columns": [
                    _col("plan"),
                    _col("samples per replica"),
                    _col("stages (ranks: layers; replicas split by /)"),
                    _col("predicted (ms)", "{:.1f}"),
                    _col("measured (ms)", "{:.1f}"),
                    _col("launches (ms)"),
                    _col("IQR within a launch (ms)", "{:.1f}"),
                    _col("error", "{:+.1%}"),
                    _col("planner's error", "{:+.1%}"),
                    _col("vs torch.distributed.pipelining (torch / hetcoll)", RATIO),
                ],
                "rows": rows,
                "notes": [
                    f"Measured: the median over {launches} launch(es) of each launch's median "
                    f"over {steps} steps of the slowest rank's step (forward, backward, SGD "
                    "step), the configurations taking turns in an order shuffled every step; "
                    "IQR: the median over launches of the steps' interquartile range.",
                    "Predicted: the model's step for the emulated cluster as the emulation "
                    "runs it (`hetcoll.lab.predict_emulated.parallel_plan`: "
                    "`hetcoll.model.predict_plan`'s laid-out step with the sleeps of the "
                    "layers with parameters, and the ranks sharing the host's cores); error = "
                    "predicted / measured - 1. Planner's error: the same for what the planner "
                    "itself predicts, each rank a device slowed to its speed, on a core of its "
                    "own.",
                    *(
                        [
                            "The host's shared cores as each launch fitted them (lock-step "
                            "stretches, `hetcoll.lab.validate.shared_cores_of`): wake-up cost "
                            "per collective "
                            + ", ".join(f"{h['wake_s'] * 1e3:.2f}" for h in hosts)
                            + " ms."
                        ]
                        if hosts
                        else []
                    ),
                ],
            },
            {
                "title": "Against torch.distributed.pipelining",
                "peer": "`PipelineStage` + `ScheduleGPipe` / `Schedule1F1B` on the same "
                "stages, micro-batches and emulated speeds, in the same launch",
                "columns": [
                    _col("hetcoll plan"),
                    _col("peer"),
                    _col("hetcoll (ms)", "{:.1f}"),
                    _col("torch (ms)", "{:.1f}"),
                    _col("torch / hetcoll, per launch"),
                    _col("torch / hetcoll, median", RATIO),
                ],
                "rows": versus,
                "notes": [
                    "A ratio of each launch's two medians; > 1: hetcoll's step is faster. "
                    "torch.distributed.pipelining needs equal micro-batches, so the batch "
                    "divides evenly here."
                ],
            },
        ],
        description=(
            f"`hetcoll.torch.parallelize` running four kinds of `hetcoll.Plan` on {ranks} gloo "
            f"ranks of emulated speeds {speeds}: a global batch of {batch} in {microbatches} "
            "micro-batches of a 15-layer CNN (`conv_net` in `benches/bench_plans.py`, "
            f"{layer_ms:.0f} ms forward + backward per micro-batch on one core, the sum of its "
            "layers' best times). Pipeline: one rank per stage, "
            "stages cut by `hetcoll.partition_chain` over the layers' measured times and the "
            "speeds; asymmetric replicas: rank 0 holds the whole model beside a 2-stage "
            "pipeline of the slower ranks, the batch split by the replicas' throughputs; "
            "filter-split stage: the slower ranks split the second stage's channels by their "
            "speeds; device subset: the slowest rank idle, the others data-parallel replicas. "
            "Each rank slows its own stage with `hetcoll.lab.emulate.slow_down` (torch's "
            "stages alike)."
        ),
        headlines=headlines,
    )


def adapt_planspace(raw: Sequence[Path], command: str) -> dict[str, Any]:
    """A ``bench_planspace.py --json`` file (every round of ``hetcoll plan`` and of ``import
    torch`` in fresh processes, per cluster size) as a results file."""
    if len(raw) != 1:
        raise ResultError("planspace: give one bench_planspace.py --json output")
    path = raw[0]
    data = _raw_json(path, "bench_planspace.py --json")
    model = f"{_need(data, 'model', str(path))} at {_need(data, 'input', str(path))}"
    rows = []
    over: dict[str, float] = {}
    beyond: dict[str, float] = {}
    for devices, case in sorted(_need(data, "cases", str(path)).items(), key=lambda x: int(x[0])):
        where = f"{path}: cases[{devices}]"
        summary = _need(case, "summary", where)
        rounds = _need(case, "rounds", where)

        def fig(key: str, summary: Any = summary, where: str = where) -> Any:
            return _need(summary, key, where)

        over[devices] = fig("over_torch_s")["median"]
        beyond[devices] = fig("over_imports_s")["median"]
        rows.append(
            [
                int(devices),
                _need(case, "batch", where),
                len(rounds),
                fig("torch_import_s")["median"],
                fig("imports_s")["median"],
                fig("hetcoll_plan_s")["median"],
                fig("over_torch_s")["median"],
                f"{fig('over_torch_s')['min']:.2f}-{fig('over_torch_s')['max']:.2f}",
                fig("over_imports_s")["median"],
                fig("planning_s")["median"],
                f"{fig('planning_s')['min']:.2f}-{fig('planning_s')['max']:.2f}",
                rounds[-1]["plans"],
                rounds[-1]["pruned"],
                rounds[-1]["best"],
            ]
        )
    load = data.get("load_average")
    return _result(
        "planspace",
        "Planner: hetcoll plan end to end on 1,024 and 10,240 devices",
        command,
        raw,
        [
            {
                "title": f"hetcoll plan, {model}",
                "peer": "`python -c 'import torch'` in a fresh process, same round",
                "columns": [
                    _col("devices", "{:,}"),
                    _col("batch", "{:,}"),
                    _col("rounds"),
                    _col("import torch (s)", "{:.2f}"),
                    _col("import torch, torchvision, torch._dynamo (s)", "{:.2f}"),
                    _col("hetcoll plan (s)", "{:.2f}"),
                    _col("over torch (s)", "{:.2f}"),
                    _col("over torch, min-max"),
                    _col("over the three imports (s)", "{:.2f}"),
                    _col("search (s)", "{:.2f}"),
                    _col("search, min-max"),
                    _col("plans ranked"),
                    _col("pruned"),
                    _col("best plan"),
                ],
                "rows": rows,
                "notes": [
                    "Medians over rounds. `over torch` = the command's wall time minus torch's "
                    "import in the same round: importing torchvision, building the model on the "
                    "meta device and costing it (whose first meta convolution imports "
                    "torch._dynamo), the search, and the output. `over the three imports` takes "
                    "off torchvision's and torch._dynamo's imports too (a fresh process "
                    "importing all three, same round): what hetcoll itself spends. `search` is "
                    "the planner's own time (its `planned in` line). Targets (issue 28): over "
                    "torch <= 1.5 s on 1,024 devices, <= 3 s on 10,240.",
                    *(
                        [
                            "Load average (1, 5, 15 min) at the end of the run: "
                            + ", ".join(f"{x:.2f}" for x in load)
                            + " (2 cores, shared with other jobs)."
                        ]
                        if load
                        else []
                    ),
                ],
            }
        ],
        description=(
            "`hetcoll plan` with the larger space (replicated pipelines, both schedules, "
            "subsets, asymmetric replicas) on the 1,024-GPU example cluster and its 10x "
            "copy. Details: [docs/model.md](model.md#planner-speed)."
        ),
        # No README headline: the README's table is the lead's to extend (its test compares
        # it with every results file's headlines).
        notes=[
            "Time over the imports any meta-device costing of this model makes (torch, "
            "torchvision, torch._dynamo), 1,024 / 10,240 devices: "
            + " / ".join(f"{beyond[k]:.2f} s" for k in sorted(beyond, key=int))
            + " (targets 1.5 s / 3 s); over torch's import alone: "
            + " / ".join(f"{over[k]:.2f} s" for k in sorted(over, key=int))
            + "."
        ],
    )


def adapt_microbatches(raw: Sequence[Path], command: str) -> dict[str, Any]:
    """A ``bench_microbatches.py --json`` file (one thread's steps at 1-8 micro-batches, the
    model's predictions with and without the convolutions' fixed cost) as a results file."""
    if len(raw) != 1:
        raise ResultError("microbatches: give one bench_microbatches.py --json file")
    path = raw[0]
    data = _raw_json(path, "bench_microbatches.py --json")
    rows = []
    errors: dict[str, list[float]] = {"with": [], "without": []}
    for i, row in enumerate(_need(data, "rows", str(path))):
        where = f"{path}: rows[{i}]"
        measured = _need(row, "measured_s", where)
        new, old = _need(row, "predicted_s", where), _need(row, "predicted_without_s", where)
        errors["with"].append(abs(new / measured - 1))
        errors["without"].append(abs(old / measured - 1))
        rows.append(
            [
                _need(row, "batch", where),
                _need(row, "microbatches", where),
                measured * 1e3,
                f"{_need(row, 'measured_s_min', where) * 1e3:.1f}-"
                f"{_need(row, 'measured_s_max', where) * 1e3:.1f}",
                new * 1e3,
                new / measured - 1,
                old * 1e3,
                old / measured - 1,
            ]
        )
    overheads = _need(data, "conv_overhead_s", str(path))
    shape = "x".join(str(n) for n in _need(data, "input_shape", str(path)))
    summary = (
        "median |error| with the convolutions' fixed cost "
        f"{statistics.median(errors['with']):.1%} (worst {max(errors['with']):.1%}), without "
        f"{statistics.median(errors['without']):.1%} (worst {max(errors['without']):.1%})"
    )
    return _result(
        "microbatches",
        "Performance model: micro-batches of a few samples",
        command,
        raw,
        [
            {
                "title": f"One thread, bench_plans.conv_net at {shape}, "
                f"{_need(data, 'rounds', str(path))} steps a row",
                "peer": "the same prediction without the convolutions' fixed cost per call "
                "(every kernel at the element-wise overhead), from the same device figures",
                "columns": [
                    _col("batch"),
                    _col("micro-batches"),
                    _col("measured (ms)", "{:.1f}"),
                    _col("measured, min-max (ms)"),
                    _col("predicted (ms)", "{:.1f}"),
                    _col("error", "{:+.1%}"),
                    _col("without the term (ms)", "{:.1f}"),
                    _col("error without", "{:+.1%}"),
                ],
                "rows": rows,
                "notes": [
                    "Medians over steps; each step predicted from the device measured just "
                    "before it (medians of its probes). error = predicted / measured - 1.",
                    "Convolution kernel's fixed cost as measured before each step: median "
                    f"{statistics.median(overheads) * 1e6:.0f} us "
                    f"({min(overheads) * 1e6:.0f}-{max(overheads) * 1e6:.0f}).",
                    summary + ".",
                ],
            }
        ],
        description=(
            "A one-rank stage's step at 1, 2, 4 and 8 micro-batches against "
            "`hetcoll.model.predict_plan`: what the convolutions' fixed cost per call "
            "(`Device.conv_overhead_s`) adds to the model. Details: "
            "[docs/model.md](model.md#micro-batches-of-a-few-samples)."
        ),
        notes=[summary.capitalize() + "."],
    )


def adapt_fixed_costs(raw: Sequence[Path], command: str) -> dict[str, Any]:
    """A ``bench_fixed_costs.py --json`` file (kernel launches of a pass, collective calls,
    passes of an expert-parallel plan; each against the model with and without its
    fixed-cost terms) as a results file."""
    if len(raw) != 1:
        raise ResultError("fixed-costs: give one bench_fixed_costs.py --json file")
    path = raw[0]
    data = _raw_json(path, "bench_fixed_costs.py --json")
    where = str(path)

    def err(predicted: float, measured: float) -> float:
        return predicted / measured - 1

    def against(measured: float, *predicted: float, scale: float = 1e3) -> list[float]:
        """The measured figure, then each prediction and its error, scaled (seconds to ms)."""
        out = [measured * scale]
        for p in predicted:
            out += [p * scale, err(p, measured)]
        return out

    launch_rows = []
    for i, row in enumerate(_need(data, "launches", where)):
        at = f"{where}: launches[{i}]"
        fixed = _need(row, "fixed_s", at)
        new, old = _need(row, "predicted_fixed_s", at), _need(row, "predicted_fixed_kernels_s", at)
        launch_rows.append(
            [
                _need(row, "arch", at),
                _need(row, "kernels", at),
                _need(row, "launches", at),
                _need(row, "real_ops", at),
                *against(fixed, new, old),
            ]
        )
    call_rows = []
    for i, row in enumerate(_need(data, "calls", where)):
        at = f"{where}: calls[{i}]"
        measured = _need(row, "measured_s", at)
        new, old = _need(row, "predicted_s", at), _need(row, "predicted_without_s", at)
        one = _need(row, "predicted_one_cost_s", at)
        call_rows.append(
            [_need(row, "collective", at), *against(measured, new, one, old, scale=1e6)]
        )
    pass_rows, steps = [], []
    for i, row in enumerate(_need(data, "passes", where)):
        at = f"{where}: passes[{i}]"
        m = _need(row, "microbatches", at)
        measured = _need(row, "measured_s", at)
        new, old = _need(row, "predicted_s", at), _need(row, "predicted_without_s", at)
        steps.append((m, measured, new, old))
        pass_rows.append([m, *against(measured, new, old)])
    (m0, *first), (m1, *last) = steps[0], steps[-1]
    extra = [(b - a) / (m1 - m0) * 1e3 for a, b in zip(first, last, strict=True)]
    whole_rows = []
    for i, row in enumerate(data.get("steps", [])):
        at = f"{where}: steps[{i}]"
        measured = _need(row, "measured_s", at)
        new, old = _need(row, "predicted_s", at), _need(row, "predicted_without_s", at)
        whole_rows.append(
            [_need(row, "model", at), _need(row, "batch", at), *against(measured, new, old)]
        )
    link = _need(data, "link", where)
    overhead = _need(data, "kernel_overhead_s", where)
    speeds = " : ".join(f"{x:g}" for x in _need(data, "speeds", where))
    per_pass = (
        f"Each extra micro-batch: measured {extra[0]:.1f} ms, predicted {extra[1]:.1f} ms "
        f"with the fixed costs, {extra[2]:.1f} ms without."
    )
    return _result(
        "fixed_costs",
        "Performance model: fixed costs of a pass",
        command,
        raw,
        [
            {
                "title": "Kernel launches: a decoder's forward and backward on one thread",
                "peer": "the measured fixed cost of a pass (the intercept of its forward and "
                "backward timed at 2, 4 and 8 samples); the model by launches and, as before, "
                "by summed kernels",
                "columns": [
                    _col("model"),
                    _col("kernels counted"),
                    _col("launches counted"),
                    _col("ops a real run launches"),
                    _col("fixed cost, measured (ms)", "{:.2f}"),
                    _col("by launches (ms)", "{:.2f}"),
                    _col("error", "{:+.0%}"),
                    _col("by kernels (ms)", "{:.2f}"),
                    _col("error by kernels", "{:+.0%}"),
                ],
                "rows": launch_rows,
                "notes": [
                    f"The LM example's shapes (bench_tensor_parallel.make_model, vocabulary "
                    f"256), costed with its loss; cost per kernel calibrated here: "
                    f"{overhead * 1e6:.1f} us. Ops a real run launches: those that are not "
                    "views or bare allocations (GPT-2's formulas count each bias as a kernel "
                    "of its own).",
                ],
            },
            {
                "title": "Collective calls: 64 floats between two local gloo ranks",
                "peer": "the same calls timed back to back in ranks of their own, after the "
                "calibration; the model on the calibrated link with each kind's fixed cost per "
                "call (Link.call_of), with one cost for every kind (Link.call_s) and without",
                "columns": [
                    _col("collective"),
                    _col("measured (us)", "{:.0f}"),
                    _col("priced (us)", "{:.0f}"),
                    _col("error", "{:+.0%}"),
                    _col("one cost for every kind (us)", "{:.0f}"),
                    _col("error, one cost", "{:+.0%}"),
                    _col("without the call's cost (us)", "{:.0f}"),
                    _col("error without", "{:+.0%}"),
                ],
                "rows": call_rows,
                "notes": [
                    f"The link as hetcoll.lab.calibrate measures it: one-way latency "
                    f"{link['latency_s'] * 1e6:.0f} us, {link['bytes_per_s'] / 1e9:.2f} GB/s, "
                    f"{link['call_s'] * 1e6:.0f} us a call of any kind (the median over these "
                    "four of each call's excess over the latencies the model charges it), each "
                    "of these at its own excess.",
                ],
            },
            {
                "title": "Passes: the expert-parallel plan in micro-batches",
                "peer": "the model with both fixed-cost terms and with neither, from the same "
                "device and link figures",
                "columns": [
                    _col("micro-batches"),
                    _col("measured (ms)", "{:.1f}"),
                    _col("predicted (ms)", "{:.1f}"),
                    _col("error", "{:+.0%}"),
                    _col("without the fixed costs (ms)", "{:.1f}"),
                    _col("error without", "{:+.0%}"),
                ],
                "rows": pass_rows,
                "notes": [
                    f"bench_expert_parallel.py's plan: Mixtral, 2 gloo ranks, rows and experts "
                    f"by speeds {speeds} (no emulation: both ranks at full speed), batch "
                    f"{_need(data, 'batch', where)}; the slower rank's median step.",
                    per_pass,
                ],
            },
            *(
                [
                    {
                        "title": "Steps: a rank alone, its step's own fixed cost",
                        "peer": "the model with the device's step overhead "
                        "(Device.step_overhead_s) and without it, from the same device figures",
                        "columns": [
                            _col("model"),
                            _col("batch"),
                            _col("measured (ms)", "{:.2f}"),
                            _col("predicted (ms)", "{:.2f}"),
                            _col("error", "{:+.0%}"),
                            _col("without the step's fixed cost (ms)", "{:.2f}"),
                            _col("error without", "{:+.0%}"),
                        ],
                        "rows": whole_rows,
                        "notes": [
                            "Each model whole on one rank under hetcoll.torch.parallelize, plain "
                            "SGD: the median step (zero_grad, par.step, the optimizer's step); the "
                            "demo CNN (hetcoll.lab.demo_ranks.DemoNet) in samples, the LM "
                            "example's Llama (vocabulary 256) in rows. The step overhead, "
                            f"{_need(data, 'step_overhead_s', where) * 1e6:.0f} us, measured "
                            "by hetcoll.lab.calibrate.measure_step_overhead_s just before: a "
                            "step of 8 tiny linear + ReLU layers less the model's prediction of "
                            "it (neither model here).",
                        ],
                    }
                ]
                if whole_rows
                else []
            ),
        ],
        description=(
            "What a step costs whatever its size, against the performance model with and "
            "without its fixed-cost terms: a kernel launch for every op a layer runs "
            "(`Kernel.launches`), a fixed cost per collective call (`Link.call_s`) and a "
            "step's own (`Device.step_overhead_s`). "
            "Details: [docs/model.md](model.md#fixed-costs-kernel-launches-and-collective-calls)."
        ),
        notes=[per_pass],
    )


#: What a device summary's table says of figures its run.sh did not yet measure.
OLDER_RUN = "not in this summary (an older run.sh)"


def _ms(seconds: Any) -> float | None:
    return None if seconds is None else float(seconds) * 1e3


def adapt_device(raw: Sequence[Path], command: str) -> dict[str, Any]:
    """A device check's ``summary.json`` (``benches/device/run.sh OUTDIR``) as a results file:
    the CUDA tests' counts, each rank's measured speed, the balanced split against the equal
    split and the GPU alone, the performance model's predictions against the measured steps,
    and weighted_sum on CUDA tensors against torch's peers and a copy. The host record is the
    GPU machine's, as the summary recorded it. A dry run (no CUDA) imports with every CUDA part
    marked skipped and "dry run" in its title: not a result to publish."""
    if len(raw) != 1:
        raise ResultError("device: give one summary.json of benches/device/run.sh")
    path = raw[0]
    where = str(path)
    data = _raw_json(path, "benches/device/run.sh summary")
    if _need(data, "schema", where) != "hetcoll-device-check 1":
        raise ResultError(f"{where}: field 'schema' is not 'hetcoll-device-check 1'")
    cuda = bool(_need(data, "cuda", where))
    host = _need(data, "host", where)
    if not isinstance(host, dict):
        raise ResultError(f"{where}: field 'host' is not an object")
    steps = _need(data, "steps", where)
    sections: list[dict[str, Any]] = [
        {
            "title": "The check's steps",
            "columns": [_col("step"), _col("status"), _col("seconds"), _col("limit (s)")],
            "rows": [
                [
                    _need(st, "step", f"{where}: steps[{i}]"),
                    _need(st, "status", f"{where}: steps[{i}]"),
                    _need(st, "seconds", f"{where}: steps[{i}]"),
                    _need(st, "limit_s", f"{where}: steps[{i}]"),
                ]
                for i, st in enumerate(steps)
            ],
            "notes": [f"Overall: {_need(data, 'status', where)}."],
        }
    ]
    tests = _need(data, "tests", where)
    failures = tests.get("failures", []) if isinstance(tests, dict) else []
    sections.append(
        {
            "title": "CUDA tests (`pytest -m cuda tests/test_cuda.py`)",
            "columns": [_col("status"), _col("passed"), _col("failed"), _col("skipped")],
            "rows": [
                [_need(tests, k, f"{where}: tests") for k in ("status",)]
                + [tests.get(k) for k in ("passed", "failed", "skipped")]
            ],
            "notes": [f"Failed: {f['test']}: {f['message']}" for f in failures],
        }
    )
    headlines: list[tuple[str, str]] = []
    hetero = _need(data, "hetero", where)
    speed_rows, run_rows, model_rows = [], [], []
    # A dry run's configurations ran rank 0 on the CPU: nothing of them is shown.
    measured = hetero.get("configurations", []) if cuda and isinstance(hetero, dict) else []
    for i, c in enumerate(measured):
        at = f"{where}: hetero.configurations[{i}]"
        cpus = _need(c, "cpu_ranks", at)
        if _need(c, "status", at) != "ok":
            run_rows.append([cpus, c["status"], None, None, None, None, None, None, None])
            continue
        devices = _need(c, "devices", at)
        for s in _need(c, "speeds", at):
            r = s["rank"]
            speed_rows.append([cpus, r, devices[r], s["samples_per_s"], _ms(s["latency_s"])])
        step = _need(c, "step_s", at)
        shares = _need(c, "shares", at)
        run_rows.append(
            [
                cpus,
                ",".join(str(n) for n in shares["balanced"]),
                _ms(step["balanced"]),
                _ms(step["equal"]),
                _ms(step["gpu_alone"]),
                _need(c, "balanced_over_equal", at),
                _need(c, "balanced_over_gpu_alone", at),
                _need(c, "balanced_over_sum_of_speeds", at),
                sum(s["samples_per_s"] for s in c["speeds"]),
            ]
        )
        pred = c.get("prediction", {})
        for run in ("balanced", "equal", "gpu_alone"):
            if pred.get("status") == "ok":
                model_rows.append(
                    [cpus, run, _ms(pred["step_s"][run]), _ms(step[run]), pred["error"][run]]
                )
        if cuda:
            headlines.append(
                (
                    f"1 GPU + {cpus} CPU ranks: balanced throughput / equal split (DDP), "
                    "/ GPU alone",
                    f"{ratio(c['balanced_over_equal'])} / {ratio(c['balanced_over_gpu_alone'])}",
                )
            )
    skipped = "skipped: no CUDA" if not cuda else "no configuration measured"
    status = hetero.get("status", skipped) if isinstance(hetero, dict) else skipped
    batch = hetero.get("batch") if isinstance(hetero, dict) else None
    gpu_note = [f"GPU figures the model used: {hetero.get('gpu')}."] if cuda else []
    sections.append(
        {
            "title": "Each rank's measured speed (`hetcoll.torch.measure_speed`)",
            "columns": [
                _col("CPU ranks"),
                _col("rank"),
                _col("device"),
                _col("samples/s", "{:,.0f}"),
                _col("fixed cost (ms)", "{:.2f}"),
            ],
            "rows": speed_rows or [[None, None, status, None, None]],
            "notes": [
                "The demo CNN's training step (forward, backward, SGD), one thread per CPU "
                "rank; fit t(b) = fixed cost + b / speed."
            ],
        }
    )
    sections.append(
        {
            "title": f"Balanced split vs the equal split and the GPU alone (global batch {batch})",
            "peer": "in the same job: the equal split with plain DDP (its mean averaging), and "
            "the GPU rank alone on the whole batch",
            "columns": [
                _col("CPU ranks"),
                _col("balanced shares"),
                _col("balanced step (ms)", "{:.2f}"),
                _col("equal step (ms)", "{:.2f}"),
                _col("GPU alone (ms)", "{:.2f}"),
                _col("balanced / equal", RATIO),
                _col("balanced / GPU alone", RATIO),
                _col("balanced / sum of speeds", "{:.1%}"),
                _col("sum of speeds (samples/s)", "{:,.0f}"),
            ],
            "rows": run_rows or [[None, status, None, None, None, None, None, None, None]],
            "notes": [
                "Throughput ratios (samples/s); balanced: hetcoll.split of the measured fits, "
                "BalancedSampler, DDP with the weighted hook. Targets (issue 40): balanced >= "
                "the GPU alone, and >= 90% of the sum of the ranks' measured speeds.",
                *gpu_note,
            ],
        }
    )
    errors = [abs(r[4]) for r in model_rows]
    model_notes = [
        "error = predicted / measured - 1. CPU device and gloo link: `hetcoll model "
        "calibrate` on the same machine; GPU: measured by benches/device/hetero.py."
    ]
    if errors:
        med, worst = statistics.median(errors), max(errors)
        model_notes.append(f"Median |error| {med:.1%}, worst {worst:.1%} over {len(errors)} rows.")
        if cuda:
            headlines.append(
                (
                    "performance model on a GPU + CPU ranks, median / worst |error|",
                    f"{med:.1%} / {worst:.1%}",
                )
            )
    sections.append(
        {
            "title": "Performance model: predicted vs measured step",
            "peer": "the step measured in the same job",
            "columns": [
                _col("CPU ranks"),
                _col("run"),
                _col("predicted (ms)", "{:.2f}"),
                _col("measured (ms)", "{:.2f}"),
                _col("error", "{:+.1%}"),
            ],
            "rows": model_rows or [[None, status, None, None, None]],
            "notes": model_notes,
        }
    )
    sections.append(_device_balanced_parts(measured, status))
    sections.append(_device_hops(measured, status))
    plan_rows, plan_errors, plan_notes = _device_plans(data.get("plans"), cuda, where)
    plans = data.get("plans") if isinstance(data.get("plans"), dict) else {}
    sections.append(
        {
            "title": "Plans on the real devices"
            + (
                f": 1 GPU + {plans['cpu_ranks']} CPU ranks, global batch {plans['batch']}"
                if "cpu_ranks" in plans and "batch" in plans
                else ""
            ),
            "peer": "the step measured in the same job",
            "columns": [
                _col("plan"),
                _col("kind"),
                _col("samples per replica"),
                _col("measured (ms)", "{:.2f}"),
                _col("predicted (ms)", "{:.2f}"),
                _col("error", "{:+.1%}"),
            ],
            "rows": plan_rows,
            "notes": plan_notes,
        }
    )
    if cuda and plan_errors:
        headlines.append(
            (
                f"performance model, {len(plan_errors)} plans (data-parallel, filter split, "
                "pipeline, hybrid) on a GPU + CPU ranks, median / worst |error|",
                f"{statistics.median(plan_errors):.1%} / {max(plan_errors):.1%}",
            )
        )
    lm_rows, lm_notes, lm_heads = _device_lm(data.get("lm"), cuda, where)
    headlines.extend(lm_heads)
    lm = data.get("lm") if isinstance(data.get("lm"), dict) else {}
    if cuda:
        headlines.extend(_planner_headline(plans, "demo CNN"))
        headlines.extend(_planner_headline(lm, "LM example"))
    sections.append(
        {
            "title": "The LM example (examples/train_lm.py's Llama)"
            + (
                f": 1 GPU + {lm['cpu_ranks']} CPU ranks, global batch {lm['batch']} rows of "
                f"{lm.get('seq')} bytes"
                if "cpu_ranks" in lm and "batch" in lm
                else ""
            ),
            "peer": "in the same job: the equal split (what DDP does) and the GPU rank alone",
            "columns": [
                _col("run"),
                _col("rows per replica"),
                _col("step (ms)", "{:.2f}"),
                _col("tokens/s", "{:,.0f}"),
                _col("balanced / run", RATIO),
                _col("predicted (ms)", "{:.2f}"),
                _col("error", "{:+.1%}"),
            ],
            "rows": lm_rows,
            "notes": lm_notes,
        }
    )
    if cuda:
        runtime = _device_runtime({"demo CNN": plans, "LM example": lm})
        if runtime is not None:
            sections.append(runtime)
    every = errors + plan_errors + [abs(r[6]) for r in lm_rows if isinstance(r[6], float)]
    if cuda and every:
        headlines.append(
            (
                f"performance model, every configuration measured on a GPU + CPU ranks "
                f"({len(every)}), median / worst |error|",
                f"{statistics.median(every):.1%} / {max(every):.1%}",
            )
        )
    kernels = _need(data, "kernels", where)
    kernel_rows = []
    for row in kernels.get("rows", []) if isinstance(kernels, dict) else []:
        for name, seconds in row["seconds"].items():
            kernel_rows.append(
                [
                    row["dtype"],
                    name,
                    _ms(seconds),
                    row["over_ideal"][name],
                    row["hetcoll_over_peer"].get(name),
                ]
            )
        if cuda and row["dtype"] == "float32" and "add_ chain" in row["hetcoll_over_peer"]:
            headlines.append(
                (
                    "weighted_sum of 4 CUDA float32 tensors, time / add_ chain's",
                    ratio(row["hetcoll_over_peer"]["add_ chain"]),
                )
            )
    copy_notes = [
        f"{row['dtype']}: a copy of one tensor moves {row['copy_bytes_per_s'] / 1e9:,.0f} GB/s; "
        f"ideal = (K + 1) / 2 copies = {row['ideal_s'] * 1e3:.2f} ms."
        for row in (kernels.get("rows", []) if isinstance(kernels, dict) else [])
    ]
    sections.append(
        {
            "title": "weighted_sum of 4 CUDA tensors of 2^25 elements",
            "peer": "torch's add_ chain and _foreach_mul + sum, and the device's copy bandwidth, "
            "same run",
            "columns": [
                _col("dtype"),
                _col("entry"),
                _col("time (ms)", "{:.3f}"),
                _col("time / ideal", RATIO),
                _col("hetcoll / entry", RATIO),
            ],
            "rows": kernel_rows or [[None, kernels.get("status", skipped), None, None, None]],
            "notes": copy_notes,
        }
    )
    title = "A real accelerator: one GPU rank beside CPU ranks"
    if not cuda:
        title += " (dry run without CUDA: no figures)"
    result = _result(
        "device",
        title,
        command,
        raw,
        sections,
        description=(
            "`benches/device/run.sh` on a machine with one GPU (issue 40): the CUDA tests, the "
            "demo CNN trained by 1 GPU rank beside 3 and 7 one-thread CPU ranks over gloo "
            "(real heterogeneity, no emulation), ten or eleven plans of it under parallelize and "
            "the LM example beside 3 CPU ranks, the performance model calibrated on that machine "
            "against every measured step, and the GPU kernels. Details: "
            "benches/device/README.md."
        ),
        notes=["Host: the GPU machine's, as the run recorded it."],
        headlines=headlines,
    )
    result["host"] = host
    result["notes"] = [n for n in result["notes"] if not n.startswith("Date: the raw file's")]
    result["notes"].append("Date: the summary file's.")
    return result


def _samples(plan: Any) -> str:
    """A plan's samples per replica, ``"239+6+6+5"``."""
    reps = plan.get("replicas", []) if isinstance(plan, dict) else []
    return "+".join(str(r.get("samples")) for r in reps)


def _device_balanced_parts(measured: list[dict[str, Any]], status: str) -> dict[str, Any]:
    """The section taking the balanced data-parallel step of each configuration ``measured``
    apart (benches/device/hetero.py's ``step_parts``) beside the model's parts of it."""
    rows: list[list[Any]] = []
    for c in measured:
        parts = c.get("balanced_parts")
        if c.get("status") != "ok" or not isinstance(parts, dict):
            continue
        local = parts["local_s"]
        slowest = max(range(len(local)), key=local.__getitem__)
        step = c["step_s"]["balanced"]
        model = (c.get("prediction") or {}).get("balanced_parts") or {}
        computed = model.get("compute_s")
        rows.append(
            [
                c["cpu_ranks"],
                _ms(step),
                _ms(local[slowest]),
                slowest,
                _ms(parts["allreduce_s"]),
                _ms(parts["allreduce_host_s"]),
                _ms(step - local[slowest]),
                _ms(max(computed)) if computed else None,
                _ms(model["allreduce_s"]) if "allreduce_s" in model else None,
            ]
        )
    if not rows:
        why = status if not measured else OLDER_RUN
        rows = [[None, why, None, None, None, None, None, None, None]]
    return {
        "title": "Where the balanced step goes",
        "peer": "the balanced step measured in the same job, and the model's parts of it",
        "columns": [
            _col("CPU ranks"),
            _col("balanced step (ms)", "{:.2f}"),
            _col("slowest own step (ms)", "{:.2f}"),
            _col("its rank"),
            _col("allreduce, GPU buffer (ms)", "{:.2f}"),
            _col("allreduce, host buffers (ms)", "{:.2f}"),
            _col("step beyond it (ms)", "{:.2f}"),
            _col("model: slowest compute (ms)", "{:.2f}"),
            _col("model: allreduce (ms)", "{:.2f}"),
        ],
        "rows": rows,
        "notes": [
            "Own step: each rank's forward, backward and SGD step under DDP's no_sync (no "
            "allreduce), started together, each timing itself; the slowest rank's. Allreduce: "
            "gloo's of a float32 buffer of the gradients' size alone, between barriers, with "
            "the GPU rank's buffer on the GPU (staged through host memory, as DDP's bucket "
            "is) and with every rank's in host memory. Step beyond it: the balanced step less "
            "the slowest own step, what the exchange and the waits added.",
            "The model's parts: the slowest device's forward and backward "
            "(hetcoll.model.predict_data_parallel's compute_s_per_device) and its allreduce.",
        ],
    }


def _device_hops(measured: list[dict[str, Any]], status: str) -> dict[str, Any]:
    """The section of one message's seconds between the GPU rank and a CPU rank, from the GPU
    and from host memory (benches/device/hetero.py's ``hop_seconds``), beside the model's gloo
    link, for each configuration ``measured``."""
    rows: list[list[Any]] = []
    for c in measured:
        if c.get("status") != "ok" or not c.get("hops"):
            continue
        model = {h["bytes"]: h["link_s"] for h in (c.get("prediction") or {}).get("hops") or []}
        for h in c["hops"]:
            link = model.get(h["bytes"])
            device = h.get("device_s")
            rows.append(
                [
                    c["cpu_ranks"],
                    h["bytes"],
                    _ms(device),
                    _ms(h.get("host_s")),
                    _ms(link),
                    device / link if device is not None and link else None,
                ]
            )
    if not rows:
        why = status if not measured else OLDER_RUN
        rows = [[None, why, None, None, None, None]]
    return {
        "title": "A message between the GPU rank and a CPU rank",
        "peer": "the same message from host memory, and the model's gloo link, in the same job",
        "columns": [
            _col("CPU ranks"),
            _col("bytes", "{:,}"),
            _col("from the GPU (ms)", "{:.3f}"),
            _col("from host memory (ms)", "{:.3f}"),
            _col("model's link (ms)", "{:.3f}"),
            _col("from the GPU / model", RATIO),
        ],
        "rows": rows,
        "notes": [
            "Half a ping-pong's round trip between rank 0 and rank 1 over gloo, the median: from "
            "the GPU as the runtime sends a pipeline's boundary (copied to host memory and "
            "sent; received into host memory and copied back to the GPU), and from host "
            "memory. The model's link: the calibrated gloo link's latency plus bytes over its "
            "bandwidth, what the model prices a boundary's message at."
        ],
    }


def _device_plans(
    plans: Any, cuda: bool, where: str
) -> tuple[list[list[Any]], list[float], list[str]]:
    """benches/device/plans.py's results: a row per plan, the |errors|, the notes."""
    status = OLDER_RUN
    if isinstance(plans, dict):
        status = plans.get("status", status)
    if not cuda or not isinstance(plans, dict):
        skipped = "skipped: no CUDA" if not cuda else status
        return [[None, skipped, None, None, None, None]], [], []
    rows: list[list[Any]] = []
    errors: list[float] = []
    for i, c in enumerate(plans.get("configurations", [])):
        at = f"{where}: plans.configurations[{i}]"
        name = _need(c, "name", at)
        if _need(c, "status", at) != "ok":
            rows.append([name, c["status"], None, None, None, None])
            continue
        pred = c.get("prediction", {})
        ok = pred.get("status") == "ok"
        if ok:
            errors.append(abs(pred["error"]))
        rows.append(
            [
                name,
                _need(c, "kind", at),
                _samples(_need(c, "plan", at)),
                _ms(_need(c, "step_s", at)),
                _ms(pred["step_s"]) if ok else None,
                pred["error"] if ok else None,
            ]
        )
    notes = [
        "Each plan run by `hetcoll.torch.parallelize` (the demo CNN, SGD); a step is the "
        "slowest rank's, the median over the timed steps. Shares from each rank's measured "
        "speed; rank 0 is the GPU. predicted: `hetcoll.model.predict_plan` with the CPU ranks "
        "and the gloo link from `hetcoll model calibrate` on the same machine and the GPU "
        "measured by benches/device/hetero.py; error = predicted / measured - 1."
    ]
    if status != "ok":
        notes.append(f"Status: {status}.")
    speeds = plans.get("speeds", [])
    if speeds:
        notes.append(
            "Measured speeds (samples/s): "
            + ", ".join(f"rank {s['rank']} {s['samples_per_s']:,.0f}" for s in speeds)
            + "."
        )
    if errors:
        notes.append(
            f"Median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%} over "
            f"{len(errors)} plans (targets, issue 40: median <= 12%, worst <= 30%)."
        )
    notes += _without_step_overhead(plans.get("configurations", []))
    notes += _started_note(plans.get("configurations", []))
    if not rows:
        rows.append([None, status, None, None, None, None])
    return rows, errors, notes


def _started_note(configurations: Sequence[Any]) -> list[str]:
    """Which ranks ran each plan: those a user starts for it (rows with ``started_ranks``),
    or, in an older run.sh, every rank of the one job."""
    rows = [c for c in configurations if isinstance(c, dict) and c.get("status") == "ok"]
    if not rows:
        return []
    if all("started_ranks" in c for c in rows):
        most = max(c["started_ranks"] for c in rows)
        fewer = [f"{c['name']}: {c['started_ranks']}" for c in rows if c["started_ranks"] < most]
        return [
            "Each plan ran on the ranks a user starts for it: 0 up to the last it names, as "
            "`hetcoll plan` prints the commands; ranks after it were not started"
            + (f" (ranks started, where fewer than {most}: {'; '.join(fewer)})." if fewer else ".")
        ]
    return [
        "Every plan ran in the one job (an older run.sh): ranks it leaves idle joined its "
        "steps' batch agreement and loss sum."
    ]


def _without_step_overhead(configurations: Sequence[Any]) -> list[str]:
    """A note on the predictions without the devices' step overhead
    (``error_without_step_overhead``, from runs since it is in the model), where they have it."""
    pairs = [
        (abs(p["error"]), abs(p["error_without_step_overhead"]))
        for c in configurations
        if isinstance(c, dict)
        for p in [c.get("prediction") or {}]
        if p.get("status") == "ok" and "error_without_step_overhead" in p
    ]
    if not pairs:
        return []
    with_it, without = zip(*pairs, strict=True)
    return [
        f"Without the step's fixed cost (Device.step_overhead_s): median |error| "
        f"{statistics.median(without):.1%}, worst {max(without):.1%}; with it "
        f"{statistics.median(with_it):.1%}, {max(with_it):.1%} ({len(pairs)} runs)."
    ]


def _staging_note(grad_bytes: Any, rates: Any) -> str | None:
    """What copying a step's gradients from the GPU to the host and back costs at the rates
    hetero.measure_gpu's ``host_copy`` measured (gloo's allreduce of a GPU rank's buckets goes
    through host memory; the performance model does not price it); None without figures."""
    if not grad_bytes or not isinstance(rates, dict):
        return None
    ways = []
    for kind in ("pageable", "pinned"):
        to_host = rates.get(f"{kind}_to_host_bytes_per_s")
        from_host = rates.get(f"{kind}_from_host_bytes_per_s")
        if to_host and from_host:
            seconds = grad_bytes / to_host + grad_bytes / from_host
            ways.append(
                f"{kind} {seconds * 1e3:.3f} ms ({to_host / 1e9:.1f} GB/s to the host, "
                f"{from_host / 1e9:.1f} GB/s back)"
            )
    if not ways:
        return None
    return (
        f"its gradients ({grad_bytes / 1e6:.2f} MB) copied to the host and back, as gloo's "
        f"allreduce takes a GPU rank's, a step: {'; '.join(ways)} (not in the model)."
    )


def _device_runtime(parts: dict[str, Any]) -> dict[str, Any] | None:
    """Where the GPU alone's step goes (plans.py's and lm.py's ``runtime``, with the GPU's
    ``step_overhead_s`` and ``view_s``) as a section; None where no part has it."""
    rows, notes = [], []
    for model, part in parts.items():
        got = part.get("runtime") if isinstance(part, dict) else None
        if not isinstance(got, dict):
            continue
        if got.get("status", "ok") != "ok":
            notes.append(f"{model}: {got['status']}.")
            continue
        gpu = part.get("gpu") or {}
        bare, planned = got["bare_step_s"], got["plan_step_s"]
        rows.append(
            [
                model,
                _ms(bare),
                _ms(planned),
                planned / bare,
                _ms(gpu.get("step_overhead_s")),
                None if gpu.get("view_s") is None else gpu["view_s"] * 1e6,
            ]
        )
        top = ", ".join(
            f"{r['function']} {r['cumulative_s'] * 1e3:.2f} ms" for r in got["profile_runtime"][:6]
        )
        notes.append(f"{model}: the runtime's functions by their time a step (cProfile): {top}.")
        syncs = got.get("host_syncs")
        if syncs is not None:
            where = "; ".join(f"{s['where']} ({s['syncs']})" for s in syncs[:6]) or "none"
            notes.append(f"{model}: where a plan step made the host wait for the GPU: {where}.")
        staging = _staging_note(part.get("gradient_bytes"), gpu.get("host_copy"))
        if staging:
            notes.append(f"{model}: {staging}")
        probes = gpu.get("step_probes") or []
        if len(probes) == 2:
            (a, b) = sorted(probes, key=lambda p: p["depth"])
            per_layer = (b["residual_s"] - a["residual_s"]) / (b["depth"] - a["depth"])
            notes.append(
                f"{model}: the step probe on the GPU, {a['depth']} layers "
                f"{a['step_s'] * 1e3:.2f} ms ({a['residual_s'] * 1e3:.2f} ms beyond the model), "
                f"{b['depth']} layers {b['step_s'] * 1e3:.2f} ms "
                f"({b['residual_s'] * 1e3:.2f} ms beyond): {per_layer * 1e6:.1f} us a layer "
                "that the model does not price and the fixed term spreads over the probe."
            )
    if not rows and not notes:
        return None
    started = {
        got.get("started_ranks")
        for part in parts.values()
        if isinstance(part, dict)
        and isinstance(got := part.get("runtime"), dict)
        and got.get("status", "ok") == "ok"
    }
    ran = (
        "on the ranks a user starts for it, as hetcoll plan prints: rank 0 alone"
        if started == {1}
        else "the CPU ranks idle, in the job"
    )
    return {
        "title": "Where the GPU alone's step goes",
        "peer": "rank 0's bare step (zero_grad, forward, loss, backward, the optimizer; "
        "synchronized), interleaved with the same step under parallelize in the same job",
        "columns": [
            _col("model"),
            _col("bare step (ms)", "{:.2f}"),
            _col("under parallelize (ms)", "{:.2f}"),
            _col("parallelize / bare", RATIO),
            _col("the model's step overhead (ms)", "{:.2f}"),
            _col("a view op (us)", "{:.1f}"),
        ],
        "rows": rows or [[None, None, None, None, None, None]],
        "notes": [
            f"The GPU alone's plan ({ran}); each figure the median of the "
            "rounds, a step the slowest rank's. The model's step overhead: "
            "Device.step_overhead_s as the GPU check measured it (a one-rank parallelize step of "
            "a tiny model less the model's prediction of it); a view op: its host seconds in a "
            "training step (benches/device/hetero.py's view_s; the cost model counts no views).",
            *notes,
        ],
    }


def _planner_headline(part: dict[str, Any], model: str) -> list[tuple[str, str]]:
    """plans.py's or lm.py's ``planner_over`` (the plan hetcoll's planner picks, measured
    beside the others) as a headline, where the run has it."""
    over = part.get("planner_over") or {}
    if "the GPU alone" not in over or "the best other run" not in over:
        return []
    return [
        (
            f"{model}, 1 GPU + {part.get('cpu_ranks')} CPU ranks: the planner's pick's "
            "throughput / the GPU alone's, / the best other plan's",
            f"{ratio(over['the GPU alone'])} / {ratio(over['the best other run'])}",
        )
    ]


def _device_lm(
    lm: Any, cuda: bool, where: str
) -> tuple[list[list[Any]], list[str], list[tuple[str, str]]]:
    """benches/device/lm.py's results: a row per run, the notes, the headlines."""
    status = OLDER_RUN
    if isinstance(lm, dict):
        status = lm.get("status", status)
    if not cuda or not isinstance(lm, dict):
        skipped = "skipped: no CUDA" if not cuda else status
        return [[skipped, None, None, None, None, None, None]], [], []
    runs = {}
    for i, c in enumerate(lm.get("configurations", [])):
        at = f"{where}: lm.configurations[{i}]"
        runs[_need(c, "name", at)] = (c, at)
    balanced = runs.get("balanced", (None, ""))[0]
    top = balanced["tokens_per_s"] if balanced and balanced["status"] == "ok" else None
    rows: list[list[Any]] = []
    for name, (c, at) in runs.items():
        if _need(c, "status", at) != "ok":
            rows.append([name, c["status"], None, None, None, None, None])
            continue
        pred = c.get("prediction", {})
        ok = pred.get("status") == "ok"
        rate = _need(c, "tokens_per_s", at)
        rows.append(
            [
                name,
                _samples(_need(c, "plan", at)),
                _ms(_need(c, "step_s", at)),
                rate,
                top / rate if top else None,
                _ms(pred["step_s"]) if ok else None,
                float(pred["error"]) if ok else None,
            ]
        )
    notes = [
        "Each run by `hetcoll.torch.parallelize` with `items=valid_tokens` (the gradient of "
        "the mean over the batch's valid tokens), AdamW; balanced: `hetcoll.split` of each "
        "rank's measured rows/s; tokens/s: the timed steps' valid tokens over their seconds. "
        f"Data: {lm.get('corpus')}."
    ]
    notes += _without_step_overhead(lm.get("configurations", []))
    notes += _started_note(lm.get("configurations", []))
    if status != "ok":
        notes.append(f"Status: {status}.")
    speeds = lm.get("speeds", [])
    if speeds:
        notes.append(
            "Measured speeds (tokens/s): "
            + ", ".join(f"rank {s['rank']} {s['tokens_per_s']:,.0f}" for s in speeds)
            + f"; balanced / their sum: {lm.get('balanced_over_sum_of_speeds', 0):.1%}."
        )
    heads = []
    over = lm.get("balanced_over", {})
    if "equal split" in over and "the GPU alone" in over:
        heads.append(
            (
                f"LM example, 1 GPU + {lm.get('cpu_ranks')} CPU ranks: balanced tokens/s / "
                "equal split, / GPU alone",
                f"{ratio(over['equal split'])} / {ratio(over['the GPU alone'])}",
            )
        )
    if not rows:
        rows.append([status, None, None, None, None, None, None])
    return rows, notes, heads


def _launch_ms(values: Sequence[float]) -> str:
    return ", ".join(f"{v * 1e3:.1f}" for v in values)


def _iqr_ms(quartiles: Sequence[Sequence[float]]) -> float:
    return statistics.median(q3 - q1 for q1, q3 in quartiles) * 1e3


def adapt_lm_pipeline(raw: Sequence[Path], command: str) -> dict[str, Any]:
    """A ``bench_lm_pipeline.py --json`` file (each configuration's launches' medians: the same
    pipeline under hetcoll and torch.distributed.pipelining, then the heterogeneous
    candidates of both) as a results file."""
    if len(raw) != 1:
        raise ResultError("lm-pipeline: give one bench_lm_pipeline.py --json file")
    path = raw[0]
    where = str(path)
    data = _raw_json(path, "bench_lm_pipeline.py --json")
    speeds = ":".join(f"{s:g}" for s in _need(data, "speeds", where))
    ranks = len(_need(data, "speeds", where))
    batch = _need(data, "batch", where)
    microbatches = _need(data, "microbatches", where)
    seq = _need(data, "seq", where)
    launches = _need(data, "launches", where)
    steps = _need(data, "steps", where)
    quick = bool(data.get("quick"))
    headlines = []
    same_rows = []
    for i, row in enumerate(_need(data, "same_pipeline", where)):
        at = f"{where}: same_pipeline[{i}]"
        schedule = _need(row, "schedule", at)
        ratios = _need(row, "throughput_vs_torch_per_launch", at)
        vs = _need(row, "throughput_vs_torch", at)
        losses = _need(row, "first_loss", at)
        h_loss, t_loss = _need(losses, "hetcoll", at), _need(losses, "torch", at)
        same_rows.append(
            [
                schedule,
                _stages(_need(row, "plan", at), f"{at}.plan")[1],
                _need(row, "hetcoll_s", at) * 1e3,
                _need(row, "torch_s", at) * 1e3,
                _launch_ms(_need(row, "hetcoll_s_per_launch", at)),
                _launch_ms(_need(row, "torch_s_per_launch", at)),
                _iqr_ms(_need(row, "hetcoll_quartiles_s_per_launch", at)),
                _iqr_ms(_need(row, "torch_quartiles_s_per_launch", at)),
                abs(h_loss - t_loss) / abs(t_loss) if t_loss else None,
                ", ".join(f"{r:.2f}" for r in ratios),
                vs,
            ]
        )
        headlines.append(
            (
                f"Llama decoder as a {ranks}-stage {schedule} pipeline, same stages: hetcoll's "
                "throughput / torch.distributed.pipelining's (target >= 0.9x)",
                f"{vs:.2f}x (runs: {', '.join(f'{r:.2f}' for r in ratios)})",
            )
        )
    het = _need(data, "heterogeneous", where)
    best_h, best_t = _need(het, "best_hetcoll", where), _need(het, "best_torch", where)
    cand_rows = []
    for i, row in enumerate(_need(het, "candidates", f"{where}: heterogeneous")):
        at = f"{where}: heterogeneous.candidates[{i}]"
        name = _need(row, "name", at)
        samples, stages = _stages(_need(row, "plan", at), f"{at}.plan")
        best = name in (best_h, best_t)
        cand_rows.append(
            [
                name
                + (" (best)" if best else "")
                + (" (planner)" if row.get("planner_chose") else ""),
                samples,
                stages,
                _need(row, "measured_s", at) * 1e3,
                _launch_ms(_need(row, "measured_s_per_launch", at)),
                _iqr_ms(_need(row, "quartiles_s_per_launch", at)),
                row.get("first_loss"),
            ]
        )
    vs = _need(het, "vs_best_torch", where)
    per = _need(het, "vs_best_torch_per_launch", where)
    headlines.append(
        (
            f"Llama decoder at emulated speeds {speeds}: best torch.distributed.pipelining "
            "pipeline's step / best hetcoll plan's",
            f"{vs:.2f}x (runs: {', '.join(f'{r:.2f}' for r in per)})",
        )
    )
    timing = (
        f"Measured: the median over {launches} launch(es) of each launch's median over {steps} "
        "steps of the slowest rank's step (forward, backward, AdamW step), the configurations "
        "of a table taking turns in an order shuffled every step; IQR: the median over "
        "launches of the steps' interquartile range."
    )
    return _result(
        "lm_pipeline",
        "Language-model pipelines: hetcoll against torch.distributed.pipelining",
        command,
        raw,
        [
            {
                "title": "The same pipeline (ranks of equal speed)",
                "peer": "torch.distributed.pipelining (`PipelineStage` + `Schedule1F1B` / "
                "`ScheduleGPipe`) on the same stages and micro-batches, in the same launch",
                "columns": [
                    _col("schedule"),
                    _col("stages (rank: blocks)"),
                    _col("hetcoll (ms)", "{:.1f}"),
                    _col("torch (ms)", "{:.1f}"),
                    _col("hetcoll launches (ms)"),
                    _col("torch launches (ms)"),
                    _col("hetcoll IQR (ms)", "{:.1f}"),
                    _col("torch IQR (ms)", "{:.1f}"),
                    _col("first loss, relative difference", "{:.1e}"),
                    _col("throughput hetcoll / torch, per launch"),
                    _col("throughput hetcoll / torch, median", RATIO),
                ],
                "rows": same_rows,
                "notes": [
                    timing,
                    "Throughput ratio: torch's step / hetcoll's, of each launch's medians; "
                    ">= 1: hetcoll is at least as fast. First loss: the two sides' loss on the "
                    "first step (the same weights and batch), relative difference.",
                ],
            },
            {
                "title": f"Heterogeneous plans at emulated speeds {speeds}",
                "peer": f"the best of torch.distributed.pipelining's candidates ({best_t})",
                "columns": [
                    _col("candidate"),
                    _col("samples per replica"),
                    _col("stages (rank: blocks; replicas split by /)"),
                    _col("measured (ms)", "{:.1f}"),
                    _col("launches (ms)"),
                    _col("IQR within a launch (ms)", "{:.1f}"),
                    _col("first loss", "{:.6f}"),
                ],
                "rows": cand_rows,
                "notes": [
                    timing,
                    f"Best torch / best hetcoll: {vs:.2f}x (per launch: "
                    f"{', '.join(f'{r:.2f}' for r in per)}). torch's candidates are pipelines "
                    "of one rank per stage with equal micro-batches (its stages written as "
                    "the `hetcoll.Plan` of the same blocks); hetcoll's add asymmetric replicas "
                    "and data parallelism with the batch split by speed; the planner "
                    f"(`hetcoll.model.plan` on the emulated cluster) chose: "
                    f"{het.get('planner_strategy', '?')}.",
                    "Blocks index `hetcoll.torch.layers.model_layers`: 0 embedding, 1 rotary "
                    "embedding, 2.. decoder layers, then norm and head. First loss: every "
                    "candidate's loss on its first step, from the same weights and batch.",
                ],
            },
        ],
        description=(
            "`examples/train_lm.py`'s byte-level Hugging Face Llama (float32, eager "
            f"attention) on {ranks} gloo ranks: a global batch of {batch} rows of {seq} bytes "
            f"(padded rows masked) in {microbatches} micro-batches, each step's loss the mean "
            "over the batch's valid tokens on both sides. hetcoll runs "
            "`hetcoll.torch.parallelize` plans (each stage replays the model's forward around "
            "its blocks); torch runs hand-built `PipelineStage`s carrying hidden states, mask "
            "and rotary cos/sin (its `pipeline()` traces this model, but the stage it builds "
            "cannot run: see `benches/bench_lm_pipeline.py`). Heterogeneity is emulated: "
            "each rank's blocks sleep `(1/speed - 1)` times their own forward and backward "
            "(`hetcoll.lab.emulate.slow_down`), on both sides alike."
        ),
        notes=(["A dry run (`--quick`): too few steps to be a measurement."] if quick else []),
        headlines=headlines,
    )


ADAPTERS: dict[str, Callable[[Sequence[Path], str], dict[str, Any]]] = {
    "planspace": adapt_planspace,
    "microbatches": adapt_microbatches,
    "fixed-costs": adapt_fixed_costs,
    "collectives": adapt_collectives,
    "filter-parallel": adapt_filter_parallel,
    "tensor-parallel": adapt_tensor_parallel,
    "expert-parallel": adapt_expert_parallel,
    "model-validate": adapt_model_validate,
    "plans": adapt_plans,
    "device": adapt_device,
    "lm-pipeline": adapt_lm_pipeline,
}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="results folder")
    ap.add_argument("--output", type=Path, default=OUTPUT, help="markdown file to write")
    ap.add_argument(
        "--readme", type=Path, help=f"also update this README's headline table (e.g. {README.name})"
    )
    ap.add_argument("--check", action="store_true", help="exit 1 if an output is out of date")
    sub = ap.add_subparsers(dest="action")
    imp = sub.add_parser("import", help="convert a script's own JSON into a results file")
    imp.add_argument("kind", choices=sorted(ADAPTERS))
    imp.add_argument("raw", type=Path, nargs="+", help="the script's JSON file(s)")
    imp.add_argument("--command", required=True, help="the command that wrote the raw file(s)")
    args = ap.parse_args(argv)
    try:
        if args.action == "import":
            result = ADAPTERS[args.kind](args.raw, args.command)
            path = args.results / f"{result['benchmark']}.json"
            write_result(path, result)
            print(f"wrote {_relative(path)}")
            return 0
        text = generate(args.results)
        readme = None
        if args.readme is not None:
            readme = with_readme_headlines(args.readme.read_text(), load_all(args.results))
    except ResultError as e:
        print(f"report.py: {e}", file=sys.stderr)
        return 2
    wanted = [(args.output, text)] + ([(args.readme, readme)] if readme is not None else [])
    if args.check:
        stale = [p for p, t in wanted if (p.read_text() if p.exists() else "") != t]
        for path in stale:
            print(f"{_relative(path)} is out of date: run `make bench-report`")
        return 1 if stale else 0
    for path, t in wanted:
        path.write_text(t)
        print(f"wrote {_relative(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
