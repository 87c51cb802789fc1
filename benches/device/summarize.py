"""OUTDIR/summary.json of a device check (benches/device/run.sh): every step's outcome, the
CUDA tests' counts (from pytest's junit XML), the kernel, heterogeneity, plans and LM results
and the calibration, in one file that ``benches/report.py import device`` reads.

    python benches/device/summarize.py OUTDIR
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

SCHEMA = "hetcoll-device-check 1"


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        return {"status": f"missing: {path.name} ({type(e).__name__})"}


def step_status(rc: int) -> str:
    if rc == 0:
        return "ok"
    if rc in (124, 137):
        return "timed out"
    return f"failed (rc {rc})"


def tests(path: Path, cuda: bool) -> dict[str, Any]:
    """Counts and failing test names from pytest's junit XML."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        return {"status": f"missing: {path.name} ({type(e).__name__})"}
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures = []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
            node = case.find("failure")
            if node is None:
                node = case.find("error")
            message = "" if node is None else node.get("message") or ""
            failures.append({"test": name, "message": message[:500]})
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    if not cuda:
        status = "skipped: no CUDA" if counts["passed"] + counts["failed"] == 0 else "ran"
    else:
        status = "ok" if counts["failed"] == 0 and counts["passed"] > 0 else "failed"
    return {"status": status, **counts, "failures": failures}


def summarize(out: Path) -> dict[str, Any]:
    steps = []
    for line in (out / "steps.jsonl").read_text().splitlines():
        if line.strip():
            s = json.loads(line)
            s["status"] = step_status(int(s["rc"]))
            steps.append(s)
    env = _json(out / "environment.json")
    cuda = bool(env.get("cuda", False))
    cluster = out / "cluster.toml"
    summary = {
        "schema": SCHEMA,
        "cuda": cuda,
        "host": env.get("host", {}),
        "hetcoll": env.get("hetcoll"),
        "steps": steps,
        "seconds": sum(s["seconds"] for s in steps),
        "tests": tests(out / "pytest-cuda.xml", cuda),
        "kernels": _json(out / "kernels.json"),
        "hetero": _json(out / "hetero.json"),
        "plans": _json(out / "plans.json"),
        "lm": _json(out / "lm.json"),
        "calibration": cluster.read_text() if cluster.exists() else None,
    }
    bad = [s["step"] for s in steps if s["status"] != "ok"]
    if bad:
        summary["status"] = "failed: " + ", ".join(bad)
    elif not cuda:
        summary["status"] = "dry run: no CUDA (CUDA parts skipped)"
    else:
        summary["status"] = "ok"
    return summary


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python benches/device/summarize.py OUTDIR", file=sys.stderr)
        return 2
    out = Path(args[0])
    summary = summarize(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    short = {k: summary[k] for k in ("status", "cuda", "seconds")}
    short["steps"] = {s["step"]: f"{s['status']} in {s['seconds']}s" for s in summary["steps"]}
    short["tests"] = {k: summary["tests"].get(k) for k in ("status", "passed", "failed", "skipped")}
    # The model's error and the LM's ratios at a glance (the files hold the rows).
    for part in ("hetero", "plans", "lm"):
        got = summary[part] if isinstance(summary[part], dict) else {}
        short[part] = {
            k: got.get(k) for k in ("status", "prediction_error", "balanced_over", "planner_over")
        }
    print(json.dumps(short, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
