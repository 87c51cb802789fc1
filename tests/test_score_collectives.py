"""The benchmark scorer (benches/score_collectives.py) on runs whose ratios are known."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_BENCHES = Path(__file__).resolve().parents[1] / "benches"
sys.path.insert(0, str(_BENCHES))  # the scorer takes its size labels from bench_collectives
_PATH = _BENCHES / "score_collectives.py"
_spec = importlib.util.spec_from_file_location("score_collectives", _PATH)
assert _spec is not None and _spec.loader is not None
score_collectives = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = score_collectives  # dataclasses look their module up
_spec.loader.exec_module(score_collectives)

MIB = 1 << 20


def _row(nbytes: int, auto: float, again: float = 1.0, repeats: int = 40) -> dict:
    engine = [1e-3 * (1 + 0.01 * (i % 5)) for i in range(repeats)]  # paired ratios stay exact
    times = {
        "engine": engine,
        "engine_again": [t * again for t in engine],
        "auto_w": [t * auto for t in engine],
        "native": [t * 1.01 for t in engine],
        "ring_w": [t * 0.5 for t in engine],
        "allgatherv_auto": [t * 1.2 for t in engine],
        "allgather": engine,
    }
    return {"bytes": nbytes, "seconds_per_call": times}


def _run(auto_1mib: float) -> list[dict]:
    rows = [_row(256 << 10, 3.0), _row(MIB, auto_1mib), _row(16 * MIB, 1.0)]
    return [
        {"engine": "gloo", "ranks": 2, "rows": rows},
        {"engine": "mpi", "ranks": 2, "rows": [_row(16 * MIB, 0.9)]},
    ]


def test_cells_scored_per_run_and_pooled() -> None:
    report = score_collectives.score([_run(1.2), _run(1.05)])
    lines = report.splitlines()
    cell = next(x for x in lines if x.startswith("| gloo | 2 | 1 MiB") and "again" not in x)
    # Half the repeats at 1.2x, half at 1.05x: the median is between them, and only the run
    # at 1.05x meets the target.
    assert "| 1 of 2 |" in cell
    assert "| open |" in cell or "| missed |" in cell
    # 256 KiB is below the weighted target's sizes: not scored, though it reads 3x.
    assert not any(x.startswith("| gloo | 2 | 256 KiB") and "3.00x" in x for x in lines)
    sixteen = next(x for x in lines if x.startswith("| gloo | 2 | 16 MiB"))
    assert sixteen.endswith(
        "| 2 of 2 | 1.00x [1.00, 1.00] | met | 1.00x [1.00, 1.00] | 1.01x [1.01, 1.01] |"
    )
    ring = next(x for x in lines if x.startswith("| mpi | 2 | 16 MiB") and "0.50x" in x)
    assert "| met |" in ring
    assert "cells met, run by run: 2 of 3, 3 of 3" in report  # weighted: 1, 16 MiB gloo; mpi


def test_missed_when_every_repeat_is_over() -> None:
    report = score_collectives.score([_run(1.3), _run(1.25)])
    cell = next(x for x in report.splitlines() if x.startswith("| gloo | 2 | 1 MiB"))
    assert "| 0 of 2 |" in cell and "| missed |" in cell


def test_interval_brackets_the_median() -> None:
    ratios = [1.0 + 0.01 * i for i in range(50)]
    m, lo, hi = score_collectives.median_interval([ratios])
    assert lo <= m <= hi and lo > 1.0 and hi < 1.49
    with pytest.raises(ValueError, match="runs"):
        score_collectives.median_interval([[], []])


def test_interval_carries_the_spread_between_runs() -> None:
    # Three runs, each tight, at 1.00x, 1.05x and 1.10x: resampling the repeats alone keeps the
    # median in the middle run's values; drawing runs as well reaches the outer ones.
    runs = [[base + 0.0001 * i for i in range(40)] for base in (1.0, 1.05, 1.1)]
    m, lo, hi = score_collectives.median_interval(runs)
    assert 1.05 <= m < 1.06 and lo < 1.01 and hi > 1.1
    _, lo1, hi1 = score_collectives.median_interval([[x for run in runs for x in run]])
    assert lo1 > 1.04 and hi1 < 1.06


def test_bad_input_names_the_argument(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="runs"):
        score_collectives.score([])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"not": "a run"}))
    with pytest.raises(ValueError, match=r"runs: .*bad\.json"):
        score_collectives.load([bad])
    with pytest.raises(ValueError, match="runs: cannot read"):
        score_collectives.load([tmp_path / "missing.json"])


def test_plot_draws_the_same_cells(tmp_path: Path) -> None:
    runs = [_run(1.2), _run(1.05)]
    png = tmp_path / "pooled.png"
    assert score_collectives.score(runs, png) == score_collectives.score(runs)
    assert png.read_bytes().startswith(b"\x89PNG")
    found, per_run = score_collectives.cells(runs, score_collectives.TARGETS[0])
    assert [(c.engine, c.ranks, c.nbytes) for c in found] == [
        ("gloo", 2, MIB),
        ("gloo", 2, 16 * MIB),
        ("mpi", 2, 16 * MIB),
    ]
    assert per_run == [(2, 3), (3, 3)]
