"""What the default agreement check costs: hetcoll.allreduce with ``check=True`` (the default)
against ``check=False``, same buffers, 2 ranks, on MPI and gloo.

    python benches/bench_check.py --json check.json

For each engine and buffer size (float32, "auto"), every repeat times a loop of k back-to-back
calls of each variant after a barrier (the slowest rank's time, k calls moving about 4 MiB,
1 <= k <= 200), the two variants in alternating order; the ratio is the median over repeats
of the paired ratio checked / unchecked. Ranks share the host's cores: compare the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

SIZES = [64, 4 << 10, 256 << 10, 16 << 20]  # bytes


def _measure(native: Any, barrier: Any, slowest: Any, repeats: int) -> list[dict[str, Any]]:
    import hetcoll

    rows = []
    for nbytes in SIZES:
        buf = np.ones(nbytes // 4, np.float32)
        k = max(1, min(200, (4 << 20) // nbytes))
        for check in (True, False):  # warm-up: windows, scratch, connections
            hetcoll.allreduce(buf, native, check=check)
        times: dict[bool, list[float]] = {True: [], False: []}
        for rep in range(repeats):
            for check in (True, False) if rep % 2 else (False, True):
                barrier()
                t0 = time.perf_counter()
                for _ in range(k):
                    hetcoll.allreduce(buf, native, check=check)
                times[check].append(slowest((time.perf_counter() - t0) / k))
        ratios = [a / b for a, b in zip(times[True], times[False])]
        rows.append(
            {
                "bytes": nbytes,
                "calls_per_repeat": k,
                "checked_s": statistics.median(times[True]),
                "unchecked_s": statistics.median(times[False]),
                "ratio": statistics.median(ratios),
            }
        )
    return rows


def _gloo_worker(rank: int, world: int, repeats: int) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    def slowest(t: float) -> float:
        x = torch.tensor([t], dtype=torch.float64)
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return float(x.item())

    return _measure(None, dist.barrier, slowest, repeats)


def _mpi_worker(repeats: int) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rows = _measure(comm, comm.Barrier, lambda t: comm.allreduce(t, op=MPI.MAX), repeats)
    if comm.Get_rank() == 0:
        print(json.dumps(rows), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--mpi-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mpi_worker:
        _mpi_worker(args.repeats)
        return
    from hetcoll import launch

    result: dict[str, Any] = {"ranks": 2, "dtype": "float32", "algorithm": "auto"}
    proc = launch.mpiexec(2, [__file__, "--mpi-worker", "--repeats", str(args.repeats)])
    result["mpi"] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["gloo"] = launch.spawn(_gloo_worker, 2, args.repeats, timeout=600)[0]
    for engine in ("mpi", "gloo"):
        for row in result[engine]:
            print(
                f"{engine:5s} {row['bytes']:>9d} B  checked {row['checked_s'] * 1e6:9.1f} us  "
                f"unchecked {row['unchecked_s'] * 1e6:9.1f} us  ratio {row['ratio']:.3f}",
                file=sys.stderr,
            )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
