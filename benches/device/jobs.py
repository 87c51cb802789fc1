"""What plans.py and lm.py share: running a list of plans on every rank of one job, each
measured and (on rank 0) predicted, the results file rewritten after each plan so that a
timeout keeps what was measured; and launching that job from the parent.

Lab code, like everything in benches/: it imports the library, the library never imports it.
"""

from __future__ import annotations

import json
import statistics
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from hetcoll import launch


def write_results(path: str, result: dict[str, Any]) -> None:
    """``result`` as JSON at ``path``, with the median and worst relative error of the
    predictions made so far (``prediction_error``)."""
    errors = [
        abs(r["prediction"]["error"])
        for r in result["configurations"]
        if r["status"] == "ok" and r.get("prediction", {}).get("status") == "ok"
    ]
    if errors:
        result["prediction_error"] = {
            "median": statistics.median(errors),
            "worst": max(errors),
            "count": len(errors),
        }
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def run_configurations(
    rank: int,
    result: dict[str, Any],
    runs: Mapping[str, tuple[str, dict[str, Any]]],
    measure: Callable[[dict[str, Any]], dict[str, Any]],
    predict: Callable[[dict[str, Any], float], dict[str, Any]],
    path: str,
    summarize: Callable[[dict[str, Any]], None] = lambda result: None,
) -> dict[str, Any] | None:
    """Every rank runs each plan of ``runs`` (name -> (kind, plan dict)) with ``measure(plan)``
    (its figures, ``step_s`` among them); a plan the runtime refuses (on every rank) is
    recorded as failed and the others still run. Rank 0 predicts each measured plan with
    ``predict(plan, step_s)`` (a failure to predict is a result too), appends the row,
    ``summarize(result)`` and rewrites ``path``. Returns ``result`` on rank 0, else None."""
    for name, (kind, plan) in runs.items():
        t0 = time.perf_counter()
        row: dict[str, Any] = {"name": name, "kind": kind, "plan": plan}
        try:
            row.update(measure(plan))
            row["status"] = "ok"
        except Exception as e:
            row["status"] = f"failed: {type(e).__name__}: {e}"[:2000]
            row["traceback"] = traceback.format_exc()[-4000:]
        dist.barrier()
        if rank == 0:
            if row["status"] == "ok":
                try:
                    row["prediction"] = predict(plan, row["step_s"])
                except Exception as e:
                    row["prediction"] = {"status": f"failed: {type(e).__name__}: {e}"[:2000]}
            row["seconds"] = time.perf_counter() - t0
            result["configurations"].append(row)
            summarize(result)
            write_results(path, result)
    return result if rank == 0 else None


def run_job(
    rank_main: Callable[..., Any],
    world: int,
    cfg: dict[str, Any],
    timeout: float,
    result: dict[str, Any],
    path: str,
    line: Callable[[dict[str, Any]], str],
    started: float,
) -> int:
    """Launch ``rank_main(rank, world, cfg)`` on ``world`` ranks; rank 0's result, or what it
    wrote to ``path`` before the job failed, is written back with the job's status and the
    seconds since ``started`` (a :func:`time.perf_counter` value), printed (``line(row)`` a
    configuration) and judged: 0 when the job and every configuration succeeded, else 1."""
    try:
        result = launch.spawn(rank_main, world, cfg, timeout=timeout, threads_per_rank=1)[0]
    except Exception as e:  # what rank 0 wrote before the failure stays in the file
        try:
            with open(path) as f:
                result = json.load(f)
        except (OSError, json.JSONDecodeError):
            pass
        result["status"] = f"failed: {type(e).__name__}: {e}"[:2000]
    result["seconds"] = time.perf_counter() - started
    write_results(path, result)
    print(json.dumps({k: v for k, v in result.items() if k != "configurations"}, default=str))
    for r in result["configurations"]:
        print(line(r))
    failed = [r for r in result["configurations"] if r["status"] != "ok"]
    return 1 if failed or result["status"].startswith("failed") else 0
