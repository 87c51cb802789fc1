"""`hetcoll plan` end to end on a ResNet-18 at 224x224 (torchvision's, costed on the meta device)
on 1,024 and 10,240 devices, against its named peer in the same run: `python -c "import torch"`
(issue 28 part 3: within 1.5 s of torch's import on 1,024 devices, within 3 s on 10,240). Each
round runs both commands in fresh processes, alternating; the JSON holds every round, the
medians and the spread, and the planner's own time (its "planned in N ms" line). The text
output is timed (what a user reads); `--json` adds the figures of every device of every
candidate (megabytes at 10,240 devices).

Timed as a user runs it: the subprocesses may write bytecode (PYTHONDONTWRITEBYTECODE is taken
out of their environment: a user's Python caches hetcoll's modules as .pyc after the first
run), and one untimed run of each command comes before the rounds, so that every round reads
compiled modules rather than compiling hetcoll's from source.

    OMP_NUM_THREADS=1 python benches/bench_planspace.py --rounds 5 \
        --json benches/results/raw/planspace.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = {
    1024: (ROOT / "examples" / "clusters" / "a100_v100_1024.toml", 8192),
    10240: (ROOT / "examples" / "clusters" / "a100_v100_10240.toml", 81920),
}
MODEL = ("torchvision.models:resnet18", "3x224x224")


#: The subprocesses' environment: this one's, bytecode writing allowed (see the docstring).
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def _wall(cmd: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=ENV)
    return time.perf_counter() - t0, done.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    py = sys.executable
    out: dict[str, object] = {"model": MODEL[0], "input": MODEL[1], "cases": {}}
    torch_cmd = [py, "-c", "import torch"]
    # What any run of this model pays before hetcoll does anything: torch, torchvision, and
    # torch._dynamo, which torch's meta kernels import on their first call.
    floor_cmd = [py, "-c", "import torch, torchvision, torch._dynamo"]
    for devices, (cluster, batch) in CASES.items():
        cmd = [py, "-m", "hetcoll.cli", "plan", "--model", MODEL[0], "--input", MODEL[1]]
        cmd += ["--cluster", str(cluster), "--batch", str(batch)]
        for warm_up in (torch_cmd, floor_cmd, cmd):  # untimed: writes the .pyc files
            _wall(warm_up)
        rows: list[dict[str, float | str]] = []
        figures: list[dict[str, float]] = []  # each round's numbers (all but "best"), summarised
        for _ in range(args.rounds):
            torch_s, _ = _wall(torch_cmd)
            floor_s, _ = _wall(floor_cmd)
            plan_s, stdout = _wall(cmd)
            head = re.search(r"planned in (\d+) ms: (\d+) plans ranked, (\d+) pruned", stdout)
            best = re.search(r"^best: (.*?): ", stdout, re.MULTILINE)
            assert head and best, stdout[:400]
            figures.append(
                {
                    "torch_import_s": torch_s,
                    "hetcoll_plan_s": plan_s,
                    "over_torch_s": plan_s - torch_s,
                    "imports_s": floor_s,
                    "over_imports_s": plan_s - floor_s,
                    "planning_s": int(head.group(1)) / 1e3,
                    "plans": int(head.group(2)),
                    "pruned": int(head.group(3)),
                }
            )
            rows.append(figures[-1] | {"best": best.group(1)})
            print(devices, rows[-1], flush=True)
        summary = {
            k: {
                "median": statistics.median(f[k] for f in figures),
                "min": min(f[k] for f in figures),
                "max": max(f[k] for f in figures),
            }
            for k in (
                "torch_import_s",
                "imports_s",
                "hetcoll_plan_s",
                "over_torch_s",
                "over_imports_s",
                "planning_s",
            )
        }
        out["cases"][str(devices)] = {"batch": batch, "rounds": rows, "summary": summary}  # type: ignore[index]
    out["load_average"] = os.getloadavg()
    out["bytecode"] = "written (PYTHONDONTWRITEBYTECODE unset), one warm-up run per command"
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
