"""benches/report.py: results files render to the expected markdown, the same bytes every time,
a malformed file is refused with its name and field, and docs/benchmarks.md is exactly what the
committed results generate. No benchmark runs here."""

from __future__ import annotations

import copy
import importlib.util
import json
import statistics
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_report() -> ModuleType:
    spec = importlib.util.spec_from_file_location("report", ROOT / "benches" / "report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("report", module)
    spec.loader.exec_module(module)
    return module


report = _load_report()

COMMAND = "python -m pytest benches/bench_split.py --results-json benches/results/split.json"


def split_result() -> dict[str, Any]:
    return {
        "schema": 1,
        "benchmark": "split",
        "title": "Split solver at cluster scale",
        "command": COMMAND,
        "when": "2026-05-10T14:03:27+00:00",
        "host": {"cpu": "AMD EPYC", "cpu_flags": ["avx", "fma"], "cores": 2, "torch": "2.5.1"},
        "description": "hetcoll.split vs a Python heap greedy.",
        "notes": ["Medians over rounds."],
        "headlines": [{"figure": "hetcoll.split vs heap greedy", "value": "4,800x faster"}],
        "sections": [
            {
                "title": "split p=10000 total=10^7",
                "peer": "Python heap greedy",
                "columns": [
                    {"name": "entry"},
                    {"name": "median (ms)", "format": "{:,.3f}"},
                    {"name": "rounds"},
                    {"name": "speed vs peer", "format": "ratio"},
                    {"name": "note"},
                ],
                "rows": [
                    ["hetcoll.split", 2.3125, 30, 4812.4, None],
                    ["Python heap greedy", 11128.0, 1, 1.0, "a | b"],
                ],
                "notes": ["exact shares for both"],
            }
        ],
    }


def write(directory: Path, result: dict[str, Any]) -> Path:
    path = directory / f"{result['benchmark']}.json"
    path.write_text(json.dumps(result))
    return path


def test_a_results_file_renders_its_command_run_and_table(tmp_path: Path) -> None:
    write(tmp_path, split_result())
    text = report.generate(tmp_path)
    expected = f"""\
## Split solver at cluster scale

hetcoll.split vs a Python heap greedy.

```bash
{COMMAND}
```

Run: 2026-05-10 14:03 UTC · AMD EPYC (avx, fma), 2 cores · torch 2.5.1.

- Medians over rounds.

### split p=10000 total=10^7

Peer: Python heap greedy.

| entry | median (ms) | rounds | speed vs peer | note |
|---|---:|---:|---:|---|
| hetcoll.split | 2.312 | 30 | 4,812x | – |
| Python heap greedy | 11,128.000 | 1 | 1.00x | a \\| b |

- exact shares for both
"""
    assert expected in text
    assert (
        "| hetcoll.split vs heap greedy | 4,800x faster "
        "| [Split solver at cluster scale](#split-solver-at-cluster-scale) |" in text
    )
    assert "## Collectives tuning" in text


def test_benchmarks_without_results_are_listed_not_rendered(tmp_path: Path) -> None:
    write(tmp_path, split_result())
    text = report.generate(tmp_path)
    missing = text.split("Not yet measured: ", 1)[1].split("\n\n", 1)[0]
    assert "kernels (`make bench-kernels`)" in missing
    assert "split" not in missing
    assert "## Core kernel" not in text
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "## Headlines" not in report.generate(empty)


def test_same_json_gives_the_same_bytes(tmp_path: Path) -> None:
    other = split_result() | {"benchmark": "zeta", "title": "Zeta"}
    write(tmp_path, other)
    write(tmp_path, split_result())
    first = report.generate(tmp_path)
    # Key order and formatting of the JSON do not matter; the expected benchmark comes first.
    reordered = dict(reversed(list(split_result().items())))
    (tmp_path / "split.json").write_text(json.dumps(reordered, indent=4))
    assert report.generate(tmp_path) == first
    assert first.index("## Split solver") < first.index("## Zeta")


def test_ratios_are_never_rounded_to_zero() -> None:
    assert [report.ratio(x) for x in (2.434, 3261.08, 0.61, 0.000307, 0.0)] == [
        "2.43x",
        "3,261x",
        "0.61x",
        "0.00031x",
        "0.00x",
    ]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.pop("command"), "field 'command' is missing"),
        (lambda r: r.update(schema=2), "field 'schema' is 2"),
        (lambda r: r.update(when="yesterday"), "field 'when' is not an ISO 8601 date"),
        (lambda r: r["sections"][0]["rows"][1].pop(), "sections[0].rows[1]: expected a list of 5"),
        (lambda r: r["sections"][0]["columns"][1].pop("name"), "sections[0].columns[1]: field"),
        (lambda r: r["sections"][0]["rows"][0].__setitem__(1, [2]), "cell 'median (ms)' is list"),
        (
            lambda r: r["sections"][0]["columns"][1].update(format="{:d}"),
            "rows[0]: cell 'median (ms)' = 2.3125 does not fit format '{:d}'",
        ),
        (lambda r: r["sections"][0].update(peer=3), "field 'peer' must be str"),
        (lambda r: r.update(benchmark="kernels"), "must be named kernels.json"),
    ],
)
def test_a_malformed_file_names_the_file_and_field(tmp_path: Path, change, message) -> None:
    result = copy.deepcopy(split_result())
    change(result)
    path = tmp_path / "split.json"
    path.write_text(json.dumps(result))
    with pytest.raises(report.ResultError) as e:
        report.generate(tmp_path)
    assert str(path) in str(e.value) and message in str(e.value)


def test_unreadable_json_names_the_file(tmp_path: Path, capsys) -> None:
    (tmp_path / "split.json").write_text("{not json")
    assert report.main(["--results", str(tmp_path), "--output", str(tmp_path / "b.md")]) == 2
    assert "split.json: cannot read it as JSON" in capsys.readouterr().err


def test_check_reports_a_stale_page(tmp_path: Path) -> None:
    write(tmp_path, split_result())
    out = tmp_path / "benchmarks.md"
    args = ["--results", str(tmp_path), "--output", str(out)]
    assert report.main([*args, "--check"]) == 1
    assert report.main(args) == 0
    assert report.main([*args, "--check"]) == 0


def test_filter_parallel_adapter_reads_the_scripts_json(tmp_path: Path) -> None:
    mem = {
        "unsplit": {"param_bytes": 1000, "adam_state_bytes": 2000},
        "filter parallel": {"param_bytes": 800, "adam_state_bytes": 1600},
    }
    times = {"filter, even split": 0.2, "filter, speed-proportional": 0.125}
    row = times | {"data, balanced batches": 0.25, "shares": {"proportional": [[4, 1]]}}
    raw = tmp_path / "raw" / "raw.json"
    raw.parent.mkdir()
    raw.write_text(json.dumps([{"memory": mem, "batches": {"4": row}}, {"memory": mem}]))
    result = report.adapt_filter_parallel([raw], "python benches/bench_filter_parallel.py")
    report.write_result(tmp_path / "filter_parallel.json", result)
    assert result["headlines"][0]["value"] == "1.60x faster"
    assert result["command"].splitlines()[0] == "python benches/bench_filter_parallel.py"
    assert "| 4 | 125.0 | 250.0 | 2.00x | [[4, 1]] |" in report.generate(tmp_path)


def test_tensor_parallel_adapter_reads_the_scripts_json(tmp_path: Path) -> None:
    def row(step: float, fwd: int, bwd: int) -> dict[str, object]:
        return {
            "step_s": step,
            "step_s_q1": step * 0.9,
            "step_s_q3": step * 1.1,
            "bytes": {"activations": fwd, "gradients": bwd},
            "modes": {"split-input": 12},
        }

    r0 = {
        "arch": "llama",
        "batch": 8,
        "seq": 64,
        "paired, speed-proportional": row(0.2, 1000, 800),
        "paired, even split": row(0.3, 1000, 800),
        "gather mode, speed-proportional": row(0.4, 3000, 2400),
        "unsplit, fast rank alone": row(0.25, 0, 0),
    }
    raw = tmp_path / "raw" / "raw.json"
    raw.parent.mkdir()
    raw.write_text(json.dumps([r0, r0]))
    result = report.adapt_tensor_parallel([raw], "python benches/bench_tensor_parallel.py")
    report.write_result(tmp_path / "tensor_parallel.json", result)
    assert [h["value"] for h in result["headlines"]] == ["1.50x faster", "3.00x fewer", "1.25x"]
    text = report.generate(tmp_path)
    assert "| gather mode, speed-proportional | 400.0 | 360.0 | 440.0 | 0.75x |" in text
    assert "| unsplit, fast rank alone | 250.0 | 225.0 | 275.0 | 1.20x |" in text
    assert "| paired, even split | 1,000 | 800 | {'split-input': 12} |" in text
    # A mixture of experts' run is a results file of its own, its headlines its own.
    moe = {**r0, "arch": "mixtral"}
    raw.write_text(json.dumps([moe, moe]))
    result = report.adapt_tensor_parallel([raw], "python benches/bench_tensor_parallel.py")
    assert result["benchmark"] == "tensor_parallel_moe", result["benchmark"]
    assert [h["value"] for h in result["headlines"]] == ["1.50x faster", "1.25x"]


def test_plans_adapter_reads_the_scripts_json(tmp_path: Path) -> None:
    pipeline = {
        "microbatches": 4,
        "schedule": "GPipe",
        "replicas": [
            {
                "samples": 64,
                "stages": [{"ranks": [0], "layers": [0, 7]}, {"ranks": [1, 2], "layers": [7, 15]}],
            }
        ],
    }
    subset = {
        "microbatches": 4,
        "schedule": "1F1B",
        "replicas": [
            {"samples": 43, "stages": [{"ranks": [0], "layers": [0, 15]}]},
            {"samples": 21, "stages": [{"ranks": [1], "layers": [0, 15]}]},
        ],
    }
    common = {"predicted_s": None, "quartiles_s_per_launch": [[0.05, 0.07], [0.05, 0.06]]}
    data = {
        "speeds": [1.0, 0.5, 0.25],
        "batch": 64,
        "microbatches": 4,
        "launches": 2,
        "steps": 30,
        "layer_seconds": [0.01, 0.01],
        "plans": [
            common
            | {
                "name": "pipeline (GPipe)",
                "measured_s": 0.06,
                "measured_s_per_launch": [0.06, 0.06],
                "vs_torch_pipelining": 1.02,
                "torch_schedule": "ScheduleGPipe",
                "torch_s_per_launch": [0.061, 0.0614],
                "vs_torch_per_launch": [1.01, 1.03],
                "plan": pipeline,
            },
            common
            | {
                "name": "device subset",
                "predicted_s": 0.066,
                "measured_s": 0.06,
                "measured_s_per_launch": [0.06, 0.065],
                "vs_torch_pipelining": None,
                "plan": subset,
            },
        ],
    }
    raw = tmp_path / "raw" / "plans.json"
    raw.parent.mkdir()
    raw.write_text(json.dumps(data))
    result = report.adapt_plans([raw], "python benches/bench_plans.py")
    report.write_result(tmp_path / "plans.json", result)
    assert result["headlines"][0]["value"] == "1.02x (runs: 1.01, 1.03)"
    text = report.generate(tmp_path)
    assert (
        "| pipeline (GPipe) | 64 | rank 0: 0-7, ranks 1,2: 7-15 | – | 60.0 | 60.0, 60.0 |" in text
    )
    assert "| device subset | 43 + 21 | rank 0: 0-15 / rank 1: 0-15 | 66.0 | 60.0 |" in text
    assert "| +10.0% | – |" in text
    assert "| pipeline (GPipe) | torch ScheduleGPipe | 60.0 | 61.2 | 1.01, 1.03 | 1.02x |" in text
    del data["plans"][1]["measured_s"]
    raw.write_text(json.dumps(data))
    with pytest.raises(report.ResultError, match=r"plans\[1\]: field 'measured_s' is missing"):
        report.adapt_plans([raw], "python benches/bench_plans.py")


def test_lm_pipeline_adapter_reads_the_scripts_json(tmp_path: Path) -> None:
    def pipe(samples: int, *stages: tuple[int, int, int]) -> dict[str, Any]:
        return {
            "samples": samples,
            "stages": [{"ranks": [r], "layers": [lo, hi]} for r, lo, hi in stages],
        }

    even = {
        "microbatches": 4,
        "schedule": "1F1B",
        "replicas": [pipe(16, (0, 0, 4), (1, 4, 6), (2, 6, 10))],
    }
    by_speed = {
        "microbatches": 4,
        "schedule": "1F1B",
        "replicas": [pipe(16, (0, 0, 6), (1, 6, 10))],
    }
    dp = {
        "microbatches": 1,
        "schedule": "1F1B",
        "replicas": [pipe(10, (0, 0, 10)), pipe(4, (1, 0, 10)), pipe(2, (2, 0, 10))],
    }
    quartiles = [[0.1, 0.12], [0.1, 0.11]]

    def candidate(name: str, runner: str, plan: dict[str, Any], s: float, **more: Any) -> Any:
        return {
            "name": name,
            "runner": runner,
            "plan": plan,
            "measured_s": s,
            "measured_s_per_launch": [s, s + 0.002],
            "quartiles_s_per_launch": quartiles,
            "first_loss": 5.626758,
            **more,
        }

    data = {
        "speeds": [1.0, 0.5, 0.25],
        "batch": 16,
        "microbatches": 4,
        "seq": 64,
        "launches": 2,
        "steps": 15,
        "quick": False,
        "same_pipeline": [
            {
                "schedule": "1F1B",
                "plan": even,
                "hetcoll_s": 0.132,
                "torch_s": 0.141,
                "hetcoll_s_per_launch": [0.132, 0.13],
                "torch_s_per_launch": [0.141, 0.142],
                "hetcoll_quartiles_s_per_launch": quartiles,
                "torch_quartiles_s_per_launch": quartiles,
                "throughput_vs_torch": 1.07,
                "throughput_vs_torch_per_launch": [1.07, 1.09],
                "first_loss": {"hetcoll": 5.0, "torch": 5.0},
            }
        ],
        "heterogeneous": {
            "candidates": [
                candidate("torch pipeline, even cut", "torch", even, 0.246),
                candidate("torch pipeline, cut by speed, ranks 0,1", "torch", by_speed, 0.153),
                candidate(
                    "hetcoll data parallel by speed", "hetcoll", dp, 0.128, planner_chose=True
                ),
            ],
            "best_hetcoll": "hetcoll data parallel by speed",
            "best_torch": "torch pipeline, cut by speed, ranks 0,1",
            "vs_best_torch": 1.19,
            "vs_best_torch_per_launch": [1.19, 1.2],
            "planner_strategy": "data parallel, balanced",
        },
    }
    raw = tmp_path / "raw" / "lm_pipeline.json"
    raw.parent.mkdir()
    raw.write_text(json.dumps(data))
    result = report.adapt_lm_pipeline([raw], "python benches/bench_lm_pipeline.py")
    report.write_result(tmp_path / "lm_pipeline.json", result)
    assert result["headlines"][0]["value"] == "1.07x (runs: 1.07, 1.09)"
    assert result["headlines"][1]["value"] == "1.19x (runs: 1.19, 1.20)"
    text = report.generate(tmp_path)
    assert (
        "| 1F1B | rank 0: 0-4, rank 1: 4-6, rank 2: 6-10 | 132.0 | 141.0 | 132.0, 130.0 "
        "| 141.0, 142.0 | 15.0 | 15.0 | 0.0e+00 | 1.07, 1.09 | 1.07x |" in text
    )
    assert (
        "| torch pipeline, cut by speed, ranks 0,1 (best) | 16 | rank 0: 0-6, rank 1: 6-10 "
        "| 153.0 | 153.0, 155.0 | 15.0 | 5.626758 |" in text
    )
    assert "| hetcoll data parallel by speed (best) (planner) | 10 + 4 + 2 |" in text
    assert "Best torch / best hetcoll: 1.19x (per launch: 1.19, 1.20)" in text
    assert "dry run" not in text
    del data["heterogeneous"]["candidates"][1]["measured_s"]
    raw.write_text(json.dumps(data))
    with pytest.raises(report.ResultError, match=r"candidates\[1\]: field 'measured_s' is missing"):
        report.adapt_lm_pipeline([raw], "python benches/bench_lm_pipeline.py")


def test_model_validate_adapter_reads_the_cli_json(tmp_path: Path) -> None:
    row = {"strategy": "filter", "ranks": 2, "batch": 32, "shares": [3, 1], "speeds": [1, 0.25]}
    row |= {"predicted_s": 0.011, "measured_s": 0.010, "error": 0.1, "avoid_gathers": False}
    row |= {"spread": 0.25, "noise": True}
    data = {
        "results": [row],
        "repeat": 3,
        "median_abs_error": 0.1,
        "worst_abs_error": 0.1,
        "noise_rows": 1,
        "worst_abs_error_beyond_noise": 0.0,
        "by_strategy": {"filter": {"median_abs_error": 0.1, "worst_abs_error": 0.1}},
    }
    raw = tmp_path / "raw" / "validate.json"
    raw.parent.mkdir()
    raw.write_text(json.dumps(data))
    report.write_result(
        tmp_path / "model_validate.json", report.adapt_model_validate([raw], "hetcoll model")
    )
    text = report.generate(tmp_path)
    row_text = "| filter/gather | 2 | 32 | 3,1 | 1,0.25 | 11.0 | 10.0 | +10.0% | 25.0% | noise |"
    assert row_text in text
    assert "median error of 3 runs" in text and "1 of 1 rows are noise" in text
    del row["measured_s"]
    raw.write_text(json.dumps(data))
    with pytest.raises(report.ResultError, match=r"results\[0\]: field 'measured_s' is missing"):
        report.adapt_model_validate([raw], "hetcoll model")


def test_collectives_adapter_pools_the_runs_as_score_collectives_does(tmp_path: Path) -> None:
    def row(nbytes: int, auto: float) -> dict[str, Any]:
        names = ["engine", "engine_again", "native", "native_w", "ring_w", "direct_w", "auto_w"]
        names += ["allgatherv", "allgatherv_ring", "allgatherv_direct", "allgatherv_auto"]
        times = {n: [1.0, 1.0, 1.0] for n in [*names, "allgather"]}
        times["auto_w"] = [auto] * 3
        ratios = {
            f: 1.0
            for f, _ in report._COLLECTIVE_COLUMNS
            if f not in ("shared_weighted", "allgatherv_shared_over_allgather")
        }
        return ratios | {
            "bytes": nbytes,
            "calls": 1,
            "engine_GBps": 1.0,
            "auto_weighted": auto,
            "shared_weighted": None,
            "allgatherv_shared_over_allgather": None,
            "seconds_per_call": times,
        }

    run = [{"engine": "gloo", "ranks": 2, "pingpong_GBps": 2.0, "rows": [row(1 << 20, 1.05)]}]
    raw = tmp_path / "raw" / "run.json"
    raw.parent.mkdir()
    raw.write_text(json.dumps(run))
    result = report.adapt_collectives([raw], "python benches/bench_collectives.py --json run.json")
    report.write_result(tmp_path / "collectives.json", result)
    text = report.generate(tmp_path)
    assert "| gloo | 2 | 1 MiB | 1 of 1 | 1.05x | 1.05x | 1.05x | met | 1.00x | 1.00x |" in text
    assert result["headlines"][0]["value"] == "1 met, 0 open, 0 missed of 1"
    # The ring's target covers MPI from 16 MiB: no cell here, so a note and no empty table.
    assert "### Target: ring" not in text
    assert "Target ring (weighted) / MPI_Allreduce <= 1.11x: no cell in these runs" in text


def test_docs_benchmarks_md_is_generated_from_the_committed_results() -> None:
    assert (ROOT / "docs" / "benchmarks.md").read_text() == report.generate(
        ROOT / "benches" / "results"
    ), "docs/benchmarks.md differs from benches/results/*.json: run `make bench-report`"


def test_readme_headlines_are_the_committed_results() -> None:
    readme = (ROOT / "README.md").read_text()
    results = report.load_all(ROOT / "benches" / "results")
    assert readme == report.with_readme_headlines(readme, results), (
        "README's headline table differs from benches/results/*.json: run `make bench-report`"
    )


def test_readme_without_markers_is_refused() -> None:
    with pytest.raises(report.ResultError, match="README: needs the markers"):
        report.with_readme_headlines("# no table here\n", [])


DEVICE_DRY_RUN = ROOT / "tests" / "data" / "device_summary_dry_run.json"


def test_device_adapter_reads_a_dry_run(tmp_path: Path) -> None:
    """benches/device/run.sh's summary from a machine without CUDA (a real dry run): it imports
    as a valid results file that says so, every CUDA part "skipped: no CUDA", no figures."""
    raw = tmp_path / "raw" / "summary.json"
    raw.parent.mkdir()
    raw.write_text(DEVICE_DRY_RUN.read_text())
    result = report.adapt_device([raw], "bash benches/device/run.sh out/device")
    report.write_result(tmp_path / "device.json", result)
    assert "dry run" in result["title"]
    assert result["headlines"] == []
    assert result["host"]["gpu"].startswith("none")
    text = report.generate(tmp_path)
    assert "| skipped: no CUDA | 0 | 0 | 14 |" in text
    assert "| – | skipped: no CUDA | – | – | – |" in text
    assert "| – | skipped: no CUDA (dry run, rank 0 on the CPU) | – | – | – | – | – | – | – |" in (
        text
    )
    assert "skipped: no CUDA (dry run, rank 0 on the CPU)" in text
    # The plans and the LM example ran on the CPU (their steps are in the table) but show no
    # figure: rank 0 was no GPU.
    assert "| plans | ok |" in text and "| lm | ok |" in text
    assert "| – | skipped: no CUDA | – | – | – | – |" in text
    assert "| skipped: no CUDA | – | – | – | – | – | – |" in text


def test_device_adapter_reads_a_gpu_run(tmp_path: Path) -> None:
    """The same summary shaped as a GPU machine's: per-rank speeds, the three runs' ratios and
    the model's errors come from its numbers, and the headlines name them."""
    data = json.loads(DEVICE_DRY_RUN.read_text())
    data["cuda"] = True
    data["host"]["gpu"] = "NVIDIA H100 80GB HBM3 (79 GiB)"
    data["host"]["packages"] = {"transformers": "5.23.0", "lightning": None}
    config = data["hetero"]["configurations"][0]
    config["devices"][0] = "cuda"
    config["step_s"] = {"gpu_alone": 0.004, "balanced": 0.0032, "equal": 0.05}
    config["balanced_over_equal"] = 0.05 / 0.0032
    config["balanced_over_gpu_alone"] = 0.004 / 0.0032
    config["prediction"] = {
        "status": "ok",
        "step_s": {"balanced": 0.0036, "equal": 0.045, "gpu_alone": 0.004},
        "error": {"balanced": 0.125, "equal": -0.1, "gpu_alone": 0.0},
        "balanced_parts": {"compute_s": [0.001, 0.0017], "allreduce_s": 0.0006},
        "hops": [{"bytes": 4096, "link_s": 4e-5}],
    }
    config["hops"] = [{"bytes": 4096, "device_s": 1e-4, "host_s": 5e-5}]
    config["balanced_parts"] = {
        "local_s": [0.0015, 0.002],
        "gradient_bytes": 431912,
        "allreduce_s": 0.0009,
        "allreduce_host_s": 0.0007,
    }
    data["kernels"] = {
        "status": "ok",
        "rows": [
            {
                "dtype": "float32",
                "copy_bytes_per_s": 2.0e12,
                "ideal_s": 0.00034,
                "seconds": {"hetcoll.weighted_sum": 0.0008, "add_ chain": 0.0008},
                "over_ideal": {"hetcoll.weighted_sum": 2.35, "add_ chain": 2.35},
                "hetcoll_over_peer": {"add_ chain": 1.0},
            }
        ],
    }
    # The plans and the LM runs the dry run measured, with predictions of known errors.
    plans = data["plans"]
    plans["status"] = "ok"
    # Ten plans, or eleven when the split idled a rank: either way median 10%, worst 30%.
    n = len(plans["configurations"])
    assert n in (10, 11)
    plan_errors = [0.05, -0.1, 0.2, 0.08, -0.3, 0.12, 0.02, -0.04, 0.15, 0.1, 0.1][:n]
    for c, e in zip(plans["configurations"], plan_errors):
        c["prediction"] = {"status": "ok", "step_s": c["step_s"] * (1 + e), "error": e}
        # Without the step overhead every plan predicted 20 points shorter.
        c["prediction"]["error_without_step_overhead"] = e - 0.2
    lm = data["lm"]
    lm["status"] = "ok"
    runs = {c["name"]: c for c in lm["configurations"]}
    for name, rate in (
        ("the GPU alone", 20_000.0),
        ("balanced", 26_000.0),
        ("equal split", 5_200.0),
    ):
        runs[name]["tokens_per_s"] = rate
        runs[name]["prediction"] = {"status": "failed: ValueError: no"}
    lm["balanced_over"] = {"equal split": 5.0, "the GPU alone": 1.3}
    plans["planner_over"] = {"the GPU alone": 1.0, "the best other run": 0.97}
    lm["planner_over"] = {"the GPU alone": 1.3, "the best other run": 1.0}
    # Where the GPU alone's step goes: the CNN's run has the breakdown, the LM's failed.
    probes = [
        {"depth": 32, "step_s": 4.0e-3, "residual_s": 1.9e-3},
        {"depth": 8, "step_s": 2.0e-3, "residual_s": 1.1e-3},
    ]
    host_copy = {
        "pageable_to_host_bytes_per_s": 1e10,
        "pageable_from_host_bytes_per_s": 2e10,
        "pinned_to_host_bytes_per_s": 5e10,
        "pinned_from_host_bytes_per_s": 5e10,
    }
    plans["gpu"] = dict(
        plans.get("gpu") or {},
        step_overhead_s=1.1e-3,
        view_s=9.5e-6,
        step_probes=probes,
        host_copy=host_copy,
    )
    plans["gradient_bytes"] = 4e6
    plans["runtime"] = {
        "status": "ok",
        "plan": "the GPU alone",
        "rounds": 15,
        "bare_step_s": 0.0016,
        "plan_step_s": 0.0032,
        "profile_own": [],
        "profile_runtime": [
            {"function": "parallel.py:361(step)", "calls": 15, "own_s": 1e-4, "cumulative_s": 3e-3}
        ],
        "host_syncs": [{"where": "parallel.py:426(step) < jobs.py:205(plan_step)", "syncs": 1}],
    }
    lm["runtime"] = {"status": "failed: RuntimeError: no room"}
    # The CNN's plans ran on the ranks a user starts for each; the LM's in the one job (older).
    for c in plans["configurations"]:
        c["started_ranks"] = 1 + max(
            r for rep in c["plan"]["replicas"] for st in rep["stages"] for r in st["ranks"]
        )
    plans["runtime"]["started_ranks"] = 1
    raw = tmp_path / "raw" / "summary.json"
    raw.parent.mkdir()
    raw.write_text(json.dumps(data))
    result = report.adapt_device([raw], "bash benches/device/run.sh out/device")
    report.write_result(tmp_path / "device.json", result)
    assert "dry run" not in result["title"]
    heads = {h["figure"]: h["value"] for h in result["headlines"]}
    assert heads["1 GPU + 1 CPU ranks: balanced throughput / equal split (DDP), / GPU alone"] == (
        "15.62x / 1.25x"
    )
    assert heads["performance model on a GPU + CPU ranks, median / worst |error|"] == (
        "10.0% / 12.5%"
    )
    assert heads["weighted_sum of 4 CUDA float32 tensors, time / add_ chain's"] == "1.00x"
    plan_head = (
        f"performance model, {n} plans (data-parallel, filter split, pipeline, hybrid) on a GPU "
        "+ CPU ranks, median / worst |error|"
    )
    assert heads[plan_head] == "10.0% / 30.0%"
    assert heads[
        "LM example, 1 GPU + 2 CPU ranks: balanced tokens/s / equal split, / GPU alone"
    ] == ("5.00x / 1.30x")
    planned = "the planner's pick's throughput / the GPU alone's, / the best other plan's"
    assert heads[f"demo CNN, 1 GPU + {plans['cpu_ranks']} CPU ranks: {planned}"] == "1.00x / 0.97x"
    assert heads[f"LM example, 1 GPU + 2 CPU ranks: {planned}"] == "1.30x / 1.00x"
    # Every prediction: the CNN runs' 3 (0.125, 0.1, 0), the plans' and the LM's runs the
    # model predicted (all but the three whose prediction failed above: their dry-run errors).
    lm_errors = [
        abs(c["prediction"]["error"]) for c in runs.values() if c["prediction"]["status"] == "ok"
    ]
    assert len(lm_errors) == len(runs) - 3
    every = sorted([0.125, 0.1, 0.0] + [abs(e) for e in plan_errors] + lm_errors)
    head = (
        f"performance model, every configuration measured on a GPU + CPU ranks ({len(every)}), "
        "median / worst |error|"
    )
    median = (every[(len(every) - 1) // 2] + every[len(every) // 2]) / 2
    assert heads[head] == f"{median:.1%} / {every[-1]:.1%}"
    text = report.generate(tmp_path)
    assert "| 1 | 0 | cuda |" in text
    assert "| 1 | balanced | 3.60 | 3.20 | +12.5% |" in text
    assert "gpu NVIDIA H100 80GB HBM3 (79 GiB)" in text
    assert " · transformers 5.23.0 · " in text and "lightning" not in text.lower()
    # The balanced step (3.20 ms) taken apart: rank 1's own step 2.00 ms, 1.20 ms beyond it.
    assert "| 1 | 3.20 | 2.00 | 1 | 0.90 | 0.70 | 1.20 | 1.70 | 0.60 |" in text
    assert "| 1 | 4,096 | 0.100 | 0.050 | 0.040 | 2.50x |" in text
    first = plans["configurations"][0]
    shares = "+".join(str(r["samples"]) for r in first["plan"]["replicas"])
    assert (
        f"| data-parallel, balanced | data-parallel | {shares} | {first['step_s'] * 1e3:.2f} | "
        f"{first['prediction']['step_s'] * 1e3:.2f} | +5.0% |"
    ) in text
    assert f"Median |error| 10.0%, worst 30.0% over {n} plans" in text
    without = sorted(abs(e - 0.2) for e in plan_errors)
    assert (
        f"Without the step's fixed cost (Device.step_overhead_s): median |error| "
        f"{statistics.median(without):.1%}, worst {without[-1]:.1%}; with it 10.0%, 30.0% "
        f"({n} runs)."
    ) in text
    # balanced / the GPU alone = 26,000 / 20,000; the model's refusal leaves its cells empty.
    assert "| 26,000 | 1.00x | – | – |" in text and "| 20,000 | 1.30x | – | – |" in text
    assert "| demo CNN | 1.60 | 3.20 | 2.00x | 1.10 | 9.5 |" in text
    assert "demo CNN: the runtime's functions by their time a step (cProfile): " in text
    assert "parallel.py:361(step) 3.00 ms" in text and "| LM example | " not in text
    assert (
        "demo CNN: where a plan step made the host wait for the GPU: "
        "parallel.py:426(step) < jobs.py:205(plan_step) (1)."
    ) in text
    # The two step probes: (1.9 - 1.1) ms over 24 more layers.
    assert (
        "demo CNN: the step probe on the GPU, 8 layers 2.00 ms (1.10 ms beyond the model), 32 "
        "layers 4.00 ms (1.90 ms beyond): 33.3 us a layer"
    ) in text
    assert "LM example: failed: RuntimeError: no room." in text
    assert (
        "The GPU alone's plan (on the ranks a user starts for it, as hetcoll plan prints: "
        "rank 0 alone)" in text
    )
    world = 1 + plans["cpu_ranks"]
    fewer = "; ".join(
        f"{c['name']}: {c['started_ranks']}"
        for c in plans["configurations"]
        if c["started_ranks"] < world
    )
    assert "the GPU alone: 1; device subset: GPU + CPU 1: 2" in fewer
    assert (
        "Each plan ran on the ranks a user starts for it: 0 up to the last it names, as "
        "`hetcoll plan` prints the commands; ranks after it were not started (ranks started, "
        f"where fewer than {world}: {fewer})."
    ) in text
    assert "Every plan ran in the one job (an older run.sh)" in text  # the LM's
    # 4 MB to the host at 10 GB/s and back at 20: 0.6 ms; pinned, both ways at 50: 0.16 ms.
    assert (
        "demo CNN: its gradients (4.00 MB) copied to the host and back, as gloo's allreduce "
        "takes a GPU rank's, a step: pageable 0.600 ms (10.0 GB/s to the host, 20.0 GB/s "
        "back); pinned 0.160 ms (50.0 GB/s to the host, 50.0 GB/s back) (not in the model)."
    ) in text


def test_device_adapter_reads_a_summary_without_plans_or_lm(tmp_path: Path) -> None:
    """A summary of the run.sh before the plans and LM steps imports, saying they are absent;
    and before the balanced step's parts (the dry run's configurations have none)."""
    data = json.loads(DEVICE_DRY_RUN.read_text())
    data["cuda"] = True
    del data["plans"], data["lm"]
    raw = tmp_path / "raw" / "summary.json"
    raw.parent.mkdir()
    raw.write_text(json.dumps(data))
    result = report.adapt_device([raw], "bash benches/device/run.sh out/device")
    report.write_result(tmp_path / "device.json", result)
    text = report.generate(tmp_path)
    assert "### Plans on the real devices\n" in text
    assert "| – | not in this summary (an older run.sh) | – | – | – | – |" in text
    assert "| not in this summary (an older run.sh) | – | – | – | – | – | – |" in text
    older = "| – | not in this summary (an older run.sh) | – | – | – | – | – | – | – |"
    assert older in text.split("### Where the balanced step goes")[1]
    older = "| – | not in this summary (an older run.sh) | – | – | – | – |"
    assert older in text.split("### A message between the GPU rank and a CPU rank")[1]


def _load_summarize() -> ModuleType:
    path = ROOT / "benches" / "device" / "summarize.py"
    spec = importlib.util.spec_from_file_location("device_summarize", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_device_summary_names_failed_and_timed_out_steps(tmp_path: Path) -> None:
    """benches/device/summarize.py: a step killed by its timeout (rc 124) and a failing CUDA
    test are named in the summary; a step whose file is missing says so."""
    summarize = _load_summarize()
    (tmp_path / "steps.jsonl").write_text(
        '{"step": "pytest", "rc": 1, "seconds": 30, "limit_s": 140}\n'
        '{"step": "hetero", "rc": 124, "seconds": 170, "limit_s": 170}\n'
    )
    (tmp_path / "environment.json").write_text(json.dumps({"cuda": True, "host": {"cores": 16}}))
    (tmp_path / "pytest-cuda.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_cuda" name="test_a"/>'
        '<testcase classname="tests.test_cuda" name="test_b">'
        '<failure message="AssertionError: 0.5 &gt; 1e-10">trace</failure></testcase>'
        '<testcase classname="tests.test_cuda" name="test_c"><skipped message="no"/></testcase>'
        "</testsuite></testsuites>"
    )
    summary = summarize.summarize(tmp_path)
    assert summary["status"] == "failed: pytest, hetero"
    assert [s["status"] for s in summary["steps"]] == ["failed (rc 1)", "timed out"]
    assert summary["seconds"] == 200
    tests = summary["tests"]
    assert (tests["status"], tests["passed"], tests["failed"], tests["skipped"]) == (
        "failed",
        1,
        1,
        1,
    )
    assert tests["failures"] == [
        {"test": "tests.test_cuda::test_b", "message": "AssertionError: 0.5 > 1e-10"}
    ]
    assert summary["hetero"]["status"].startswith("missing: hetero.json")
    assert summary["plans"]["status"].startswith("missing: plans.json")
    assert summary["lm"]["status"].startswith("missing: lm.json")
    assert summary["calibration"] is None


def test_expert_parallel_adapter_reads_the_scripts_json(tmp_path: Path) -> None:
    def row(step: float, experts: list[int], rows: list[int], guess: float) -> dict[str, object]:
        return {
            "step_s": step,
            "step_s_q1": step * 0.9,
            "step_s_q3": step * 1.1,
            "experts": experts,
            "rows": rows,
            "predicted_s": guess,
            "param_bytes_per_rank": [2048, 1024],
        }

    r0 = {
        "arch": "mixtral",
        "batch": 32,
        "seq": 64,
        "speeds": [1.0, 0.25],
        "experts by speed, rows by speed": row(0.2, [7, 1], [26, 6], 0.1),
        "experts even, rows by speed": row(0.3, [4, 4], [26, 6], 0.15),
        "experts even, rows even": row(0.4, [4, 4], [16, 16], 0.2),
        "experts replicated, rows by speed": row(0.16, [8, 8], [26, 6], 0.08),
        "unsplit, fast rank alone": row(0.15, [8, 0], [32, 0], 0.12),
    }
    raw = tmp_path / "raw" / "raw.json"
    raw.parent.mkdir()
    raw.write_text(json.dumps([r0, r0]))
    result = report.adapt_expert_parallel([raw], "python benches/bench_expert_parallel.py")
    report.write_result(tmp_path / "expert_parallel.json", result)
    assert [h["value"] for h in result["headlines"]] == ["2.00x faster", "0.80x", "0.75x"]
    text = report.generate(tmp_path)
    first = "| experts by speed, rows by speed | 7:1 | 26:6 | 2:1 | 200.0 | 180.0 | 220.0 | 2.00x |"
    assert first in text
    assert "rows by speed, plan" not in text and "Plan: the placement" not in text
    # The placement as a plan (runs from before it lack it): a row of its own, before the
    # fast rank alone, and its note.
    planned = {**r0, "experts by speed, rows by speed, plan": row(0.25, [7, 1], [26, 6], 0.1)}
    raw.write_text(json.dumps([planned]))
    report.write_result(
        tmp_path / "expert_parallel.json",
        report.adapt_expert_parallel([raw], "python benches/bench_expert_parallel.py"),
    )
    text = report.generate(tmp_path)
    plan_row = "| experts by speed, rows by speed, plan | 7:1 | 26:6 | 2:1 | 250.0 |"
    assert plan_row in text and "Plan: the placement" in text
    assert text.index(plan_row) < text.index("| unsplit, fast rank alone | 8:0")
    assert "| experts even, rows even | 400.0 | 200.0 | -50% | 1.00x | 1.00x |" in text
    # A run without predictions (--no-predict) has no predicted table.
    for name in report._EP_STRATEGIES:
        del r0[name]["predicted_s"]  # type: ignore[attr-defined]
    raw.write_text(json.dumps([r0]))
    result = report.adapt_expert_parallel([raw], "python benches/bench_expert_parallel.py")
    assert len(result["sections"]) == 1
    missing = {k: v for k, v in r0.items() if k != "experts even, rows even"}
    raw.write_text(json.dumps([missing]))
    with pytest.raises(report.ResultError, match="experts even, rows even"):
        report.adapt_expert_parallel([raw], "python benches/bench_expert_parallel.py")


def test_fixed_costs_adapter_reads_the_scripts_json(tmp_path: Path) -> None:
    raw = tmp_path / "raw" / "fixed_costs.json"
    raw.parent.mkdir()
    data = {
        "kernel_overhead_s": 4e-6,
        "link": {"latency_s": 5e-5, "bytes_per_s": 5e9, "call_s": 2e-4},
        "launches": [
            {
                "arch": "llama",
                "kernels": 200,
                "launches": 800,
                "real_ops": 790,
                "pass_s": {"2": 0.01, "4": 0.014, "8": 0.022},
                "fixed_s": 0.004,
                "predicted_fixed_s": 0.0032,
                "predicted_fixed_kernels_s": 0.0008,
            }
        ],
        "calls": [
            {
                "collective": "allreduce",
                "measured_s": 1e-3,
                "predicted_s": 4e-4,
                "predicted_one_cost_s": 3e-4,
                "predicted_without_s": 1e-4,
            }
        ],
        "passes": [
            {
                "microbatches": 1,
                "measured_s": 0.1,
                "predicted_s": 0.09,
                "predicted_without_s": 0.08,
            },
            {
                "microbatches": 4,
                "measured_s": 0.19,
                "predicted_s": 0.15,
                "predicted_without_s": 0.086,
            },
        ],
        "speeds": [1.0, 0.25],
        "batch": 32,
        "step_overhead_s": 4.2e-4,
        "steps": [
            {
                "model": "demo CNN",
                "batch": 8,
                "measured_s": 0.004,
                "predicted_s": 0.0042,
                "predicted_without_s": 0.0038,
            }
        ],
    }
    raw.write_text(json.dumps(data))
    result = report.adapt_fixed_costs([raw], "python benches/bench_fixed_costs.py")
    report.write_result(tmp_path / "fixed_costs.json", result)
    text = report.generate(tmp_path)
    assert "| llama | 200 | 800 | 790 | 4.00 | 3.20 | -20% | 0.80 | -80% |" in text
    assert "| allreduce | 1000 | 400 | -60% | 300 | -70% | 100 | -90% |" in text
    assert "| 4 | 190.0 | 150.0 | -21% | 86.0 | -55% |" in text
    # (190 - 100) / 3 measured, (150 - 90) / 3 and (86 - 80) / 3 predicted.
    assert "Each extra micro-batch: measured 30.0 ms, predicted 20.0 ms with the fixed" in text
    assert "by speeds 1 : 0.25" in text and "200 us a call" in text
    assert "| demo CNN | 8 | 4.00 | 4.20 | +5% | 3.80 | -5% |" in text
    assert "The step overhead, 420 us, measured" in text
    del data["steps"]  # a file from before the steps: no such table
    raw.write_text(json.dumps(data))
    result = report.adapt_fixed_costs([raw], "python benches/bench_fixed_costs.py")
    report.write_result(tmp_path / "fixed_costs.json", result)
    assert "a rank alone, its step's own fixed cost" not in report.generate(tmp_path)
    del data["calls"]
    raw.write_text(json.dumps(data))
    with pytest.raises(report.ResultError, match="field 'calls' is missing"):
        report.adapt_fixed_costs([raw], "python benches/bench_fixed_costs.py")
