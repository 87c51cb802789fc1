"""How much the same job's first split varies from launch to launch: the demo's speed probe
(:func:`hetcoll.lab.demo_ranks.probe`, the real model timed once, then the emulated one) on two
gloo ranks with *emulated* speeds, repeated, and the split :func:`hetcoll.split` makes of it.

    python benches/probe_spread.py --speeds 1,0.3 --batch 256 --launches 5

Prints, per launch, each rank's fitted samples/s and fixed cost, the real speeds the emulation
scales, the first split and the probe's seconds; then the spread of the fast rank's share over
the launches (max - min, in samples and as a fraction of the batch). ``--json PATH`` writes the
same as JSON. To compare two versions under the same load, alternate single launches of each
(``--launches 1``, each with its own ``PYTHONPATH``); a busy host can be made with one more
CPU-bound process (``python -c "while True: pass"``) beside the two ranks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import hetcoll
from hetcoll.launch import spawn


def _rank(rank: int, world: int, speeds: tuple[float, ...], batch: int) -> dict[str, Any]:
    import torch

    from hetcoll.lab.demo_config import DemoConfig
    from hetcoll.lab.demo_ranks import Gloo, probe

    torch.set_num_threads(1)
    cfg = DemoConfig(speeds=speeds, global_batch=batch, progress=False)
    t0 = time.perf_counter()
    engine = Gloo(rank, world)
    fits, real = probe(engine, cfg)
    seconds = time.perf_counter() - t0
    reals = engine.allgather(real)
    shares = hetcoll.split(
        batch,
        [f.samples_per_s for f in fits],
        latency=[f.latency_s for f in fits],
        minimum=1,
    )
    return {
        "shares": shares,
        "samples_per_s": [f.samples_per_s for f in fits],
        "latency_s": [f.latency_s for f in fits],
        "probe_seconds": seconds,
        "real_samples_per_s": [f.samples_per_s for f in reals],
        "real_latency_s": [f.latency_s for f in reals],
        "points": [f.points for f in fits],
        "real_points": [f.points for f in reals],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--speeds", default="1,0.3")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--launches", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    speeds = tuple(float(s) for s in args.speeds.split(","))
    runs = []
    for i in range(args.launches):
        out = spawn(_rank, len(speeds), speeds, args.batch, timeout=900)[0]
        runs.append(out)
        fits = ", ".join(
            f"{s:8.0f}/s + {1e3 * a:6.2f} ms"
            for s, a in zip(out["samples_per_s"], out["latency_s"])
        )
        real = ", ".join(f"{s:6.0f}/s" for s in out["real_samples_per_s"])
        print(
            f"launch {i + 1}: split {out['shares']}  fits [{fits}]  (real speeds [{real}]) "
            f"probe {out['probe_seconds']:.1f} s",
            flush=True,
        )
    first = [r["shares"][0] for r in runs]
    spread = max(first) - min(first)
    print(
        f"rank 0's share over {len(runs)} launches: min {min(first)}, median "
        f"{statistics.median(first):g}, max {max(first)}; spread {spread} samples "
        f"({spread / args.batch:.1%} of the batch)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"speeds": speeds, "batch": args.batch, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
