"""Weighted allreduce and allgatherv against the engines' own collectives, same buffers, one run.

    python benches/bench_collectives.py --engines mpi gloo --ranks 2 4 --max-mib 256

For each engine (MPI through mpi4py/MPICH, torch.distributed gloo), each rank count and each buffer
size (float32, 4 KiB .. max), every rank times each operation after a barrier, and the time of a
repeat is the slowest rank's. A repeat of an operation is a loop of k back-to-back calls, as the
OSU micro-benchmarks and nccl-tests time theirs: k calls move about ``--loop-mib`` MiB (default 16;
1 <= k <= 64; fewer if the loop would last over 40 ms); ``--loop-mib 0`` times single calls. In a
loop, the ranks' skew leaving the barrier and a late wake-up after it are spread over k calls
instead of landing on one, and the calls follow each other as a training step's collectives do. The
operations take turns within each repeat, in an order shuffled anew every repeat, and a ratio is
the median over repeats of the two operations' ratio within the repeat (paired: a slow spell of the
host longer than a repeat cancels out). Printed per size: algorithmic bandwidth N / t of the
engine's allreduce (MPI_Allreduce / dist.all_reduce, median over repeats), and times relative to it
of the same call timed again as another operation (the cell's noise), of hetcoll's weighted
allreduce as "auto" picks it, of the native allreduce unweighted and weighted (weight fused into a
Rust pre-scale), of the weighted direct exchange, of the weighted ring and (MPI) of the weighted
allreduce through shared memory on the node ("shared"); the ring lower bound
2(p-1)/p * N / B with B from a ping-pong between ranks 0 and 1, and the ring's time over that
bound. Then allgatherv of pieces of different lengths (rank r holds r+1 shares) against an
all_gather of equal pieces with the same total bytes ("auto", native, ring, direct and, on MPI,
shared), both into an output allocated once (``out=``, as all_gather_into_tensor and
MPI_Allgather take one). Ranks share the machine's cores, so absolute figures are those of one
host (shared memory transport); compare the ratios. ``--json`` keeps every repeat's times;
``benches/score_collectives.py`` scores several runs' files against the targets, pooled.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

KIB = 1024
#: A timed loop stops short of ``--loop-mib`` when it would take longer than this.
LOOP_SECONDS = 0.04


def _sizes(max_mib: int) -> list[int]:
    sizes, s = [], 4 * KIB
    while s <= max_mib * KIB * KIB:
        sizes.append(s)
        s *= 4
    return sizes


def size_label(nbytes: int) -> str:
    """A table's size column: KiB below 1 MiB, else MiB."""
    return f"{nbytes // KIB} KiB" if nbytes < KIB * KIB else f"{nbytes // (KIB * KIB)} MiB"


def _repeats(nbytes: int, calls: int) -> int:
    # On a shared host a burst of load can slow a third of one cell's repeats: enough repeats
    # that the median stays out of it (fewer below 1 MiB, where each repeat is a loop of many
    # calls). From 1 MiB, where the targets start and a loop holds 16 calls or fewer, 80: with
    # 40, the 95% bootstrap interval of the engine's call against itself spanned up to 0.3 on
    # either side of the median (two gloo ranks at 1 MiB).
    if nbytes > 16 * KIB * KIB:
        return 15 if nbytes <= 64 * KIB * KIB else 7
    return 80 if calls == 1 or nbytes >= KIB * KIB else 40


class _Engine:
    """The raw engine calls the benchmark compares against."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        if kind == "mpi":
            from mpi4py import MPI

            self.MPI = MPI
            self.native: Any = MPI.COMM_WORLD
            self.rank, self.size = self.native.Get_rank(), self.native.Get_size()
        else:
            import torch.distributed as dist

            self.dist = dist
            self.native = None
            self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def barrier(self) -> None:
        if self.kind == "mpi":
            self.native.Barrier()
        else:
            self.dist.barrier()

    def slowest(self, seconds: float) -> float:
        if self.kind == "mpi":
            return float(self.native.allreduce(seconds, op=self.MPI.MAX))
        import torch

        t = torch.tensor([seconds], dtype=torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t.item())

    def allreduce(self, buf: np.ndarray) -> None:
        if self.kind == "mpi":
            self.native.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
        else:
            import torch

            self.dist.all_reduce(torch.from_numpy(buf))

    def allgather(self, piece: np.ndarray, out: np.ndarray) -> None:
        if self.kind == "mpi":
            self.native.Allgather(piece, out)
        else:
            import torch

            self.dist.all_gather_into_tensor(torch.from_numpy(out), torch.from_numpy(piece))

    def pingpong_bytes_per_s(self, nbytes: int = 16 * KIB * KIB, repeats: int = 5) -> float:
        buf = np.zeros(nbytes // 4, np.float32)
        times = []
        for _ in range(repeats):
            self.barrier()
            t0 = time.perf_counter()
            if self.rank == 0:
                self._send(buf, 1)
                self._recv(buf, 1)
            elif self.rank == 1:
                self._recv(buf, 0)
                self._send(buf, 0)
            times.append(self.slowest(time.perf_counter() - t0 if self.rank < 2 else 0.0))
        return nbytes / (statistics.median(times) / 2)

    def _send(self, buf: np.ndarray, dest: int) -> None:
        if self.kind == "mpi":
            self.native.Send(buf, dest=dest)
        else:
            import torch

            self.dist.send(torch.from_numpy(buf), dest)

    def _recv(self, buf: np.ndarray, source: int) -> None:
        if self.kind == "mpi":
            self.native.Recv(buf, source=source)
        else:
            import torch

            self.dist.recv(torch.from_numpy(buf), source)


def _calls_per_loop(
    e: _Engine, engine: Callable[[], object], nbytes: int, loop_bytes: int, loop_seconds: float
) -> int:
    """Back-to-back calls per timed loop: enough to move ``loop_bytes`` in all, between 1 and
    64, and fewer if that many engine allreduces would take longer than ``loop_seconds`` (from
    the slowest rank's median of three calls, so the same on every rank)."""
    calls = max(1, min(64, loop_bytes // nbytes))
    if calls > 1:
        times = []
        for _ in range(3):
            e.barrier()
            t0 = time.perf_counter()
            engine()
            times.append(e.slowest(time.perf_counter() - t0))
        calls = max(1, min(calls, int(loop_seconds / statistics.median(times))))
    return calls


def _times(
    e: _Engine, fns: dict[str, Callable[[], object]], repeats: int, calls: int
) -> dict[str, list[float]]:
    """Each operation's time per call in every repeat: the slowest rank's loop of ``calls``
    back-to-back calls, divided by ``calls``. Operations take turns within a repeat, so a burst
    of load from elsewhere on the host hits them alike, in an order shuffled anew for every
    repeat (alike on every rank): an operation's time depends on the one before it (what it
    left in the caches), and no pair should always meet."""
    for fn in fns.values():
        fn()  # warm-up: connections, page faults, scratch buffers
    order = random.Random(0)
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        order.shuffle(names)
        for name in names:
            fn = fns[name]
            e.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append(e.slowest(time.perf_counter() - t0) / calls)
    return times


def _ratio(times: dict[str, list[float]], name: str, peer: str) -> float:
    """``name``'s time over ``peer``'s: the median over repeats of the ratio within a repeat.
    Both ran within the same repeat, a few milliseconds apart, so a slow spell of the host that
    lasts longer than one repeat (other tenants' load, ranks sharing a core until the scheduler
    moves one) cancels out of the ratio instead of landing on one operation's median."""
    return statistics.median(t / u for t, u in zip(times[name], times[peer], strict=True))


def _operations(
    e: _Engine,
    comm: Any,
    buf: np.ndarray,
    w: float,
    piece_v: np.ndarray,
    out_v: np.ndarray,
    piece_eq: np.ndarray,
    out_eq: np.ndarray,
) -> dict[str, Callable[[], object]]:
    # Results typed `object`: hetcoll's calls return their array, the engine's return None, and
    # the timing discards both.
    import hetcoll

    shared = (
        {
            "shared_w": lambda: hetcoll.allreduce(buf, comm, weight=w, algorithm="shared"),
            "allgatherv_shared": lambda: hetcoll.allgatherv(
                piece_v, comm, out=out_v, algorithm="shared"
            ),
        }
        if e.kind == "mpi"
        else {}
    )
    return shared | {
        "engine": lambda: e.allreduce(buf),
        # The same engine call timed again: how far one cell's figures move by chance alone.
        "engine_again": lambda: e.allreduce(buf),
        "native": lambda: hetcoll.allreduce(buf, comm, algorithm="native"),
        "native_w": lambda: hetcoll.allreduce(buf, comm, weight=w, algorithm="native"),
        "ring_w": lambda: hetcoll.allreduce(buf, comm, weight=w, algorithm="ring"),
        "direct_w": lambda: hetcoll.allreduce(buf, comm, weight=w, algorithm="direct"),
        "auto_w": lambda: hetcoll.allreduce(buf, comm, weight=w),
        "allgatherv": lambda: hetcoll.allgatherv(piece_v, comm, out=out_v, algorithm="native"),
        "allgatherv_ring": lambda: hetcoll.allgatherv(piece_v, comm, out=out_v, algorithm="ring"),
        "allgatherv_direct": lambda: hetcoll.allgatherv(
            piece_v, comm, out=out_v, algorithm="direct"
        ),
        "allgatherv_auto": lambda: hetcoll.allgatherv(piece_v, comm, out=out_v),
        "allgather": lambda: e.allgather(piece_eq, out_eq),
    }


def measure(kind: str, max_mib: int, loop_mib: int = 16) -> dict[str, Any]:
    """Run on every rank; rank 0's return value holds the table rows."""
    e = _Engine(kind)
    comm = e.native
    p, r = e.size, e.rank
    bandwidth = e.pingpong_bytes_per_s()
    rows = []
    for nbytes in _sizes(max_mib):
        n = nbytes // 4
        buf = np.ones(n, np.float32)
        # Weights differ by rank and sum to 1, so repeated weighted calls keep the values as
        # they are; the unweighted calls multiply them by p, so the buffer soon holds inf. Values
        # do not change the timings: an in-place Rust scale of 4 MiB took 73 µs on ones, inf and
        # subnormals alike on this host.
        w = (r + 1) / (p * (p + 1) / 2)
        unit = max(1, n // (p * (p + 1) // 2))
        piece_v = np.ones(unit * (r + 1), np.float32)  # rank q holds q+1 shares
        total = unit * p * (p + 1) // 2
        piece_eq = np.ones(total // p, np.float32)  # equal pieces, same total bytes
        out_eq = np.empty(total // p * p, np.float32)
        out_v = np.empty(unit * p * (p + 1) // 2, np.float32)
        ops = _operations(e, comm, buf, w, piece_v, out_v, piece_eq, out_eq)
        ops["engine"]()  # warm-up before sizing the loop
        calls = _calls_per_loop(e, ops["engine"], nbytes, loop_mib * KIB * KIB, LOOP_SECONDS)
        t = _times(e, ops, _repeats(nbytes, calls), calls)
        t_engine = statistics.median(t["engine"])
        lower = 2 * (p - 1) / p * nbytes / bandwidth
        rows.append(
            dict(
                bytes=nbytes,
                calls=calls,
                engine_GBps=nbytes / t_engine / 1e9,
                engine_again=_ratio(t, "engine_again", "engine"),
                native=_ratio(t, "native", "engine"),
                native_weighted=_ratio(t, "native_w", "engine"),
                ring_weighted=_ratio(t, "ring_w", "engine"),
                direct_weighted=_ratio(t, "direct_w", "engine"),
                shared_weighted=_ratio(t, "shared_w", "engine") if "shared_w" in t else None,
                auto_weighted=_ratio(t, "auto_w", "engine"),
                ring_over_bound=statistics.median(t["ring_w"]) / lower,
                allgatherv_over_allgather=_ratio(t, "allgatherv", "allgather"),
                allgatherv_ring_over_allgather=_ratio(t, "allgatherv_ring", "allgather"),
                allgatherv_direct_over_allgather=_ratio(t, "allgatherv_direct", "allgather"),
                allgatherv_auto_over_allgather=_ratio(t, "allgatherv_auto", "allgather"),
                allgatherv_shared_over_allgather=(
                    _ratio(t, "allgatherv_shared", "allgather") if "shared_w" in t else None
                ),
                seconds_per_call=t,
            )
        )
    return dict(engine=kind, ranks=p, pingpong_GBps=bandwidth / 1e9, rows=rows)


def _gloo_rank(rank: int, world: int, max_mib: int, loop_mib: int) -> dict[str, Any]:
    return measure("gloo", max_mib, loop_mib)


def _table(result: dict[str, Any]) -> str:
    peer = "MPI_Allreduce" if result["engine"] == "mpi" else "dist.all_reduce"
    gather = "MPI_Allgather" if result["engine"] == "mpi" else "all_gather"
    lines = [
        f"\n{result['engine']}, p = {result['ranks']}, ping-pong B = "
        f"{result['pingpong_GBps']:.2f} GB/s; times relative to {peer} (lower is better)\n",
        f"| size | calls per loop | {peer} GB/s | {peer} again | weighted (auto) | native "
        f"| native weighted | direct weighted | ring weighted | shared weighted "
        f"| ring / lower bound | allgatherv (auto) / {gather} | native | ring | direct | shared |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        b = row["bytes"]
        size = size_label(b)
        shared, gather_shared = (
            "–" if x is None else f"{x:.2f}x"
            for x in (row["shared_weighted"], row["allgatherv_shared_over_allgather"])
        )
        lines.append(
            f"| {size} | {row['calls']} | {row['engine_GBps']:.3f} | {row['engine_again']:.2f}x "
            f"| {row['auto_weighted']:.2f}x "
            f"| {row['native']:.2f}x | {row['native_weighted']:.2f}x "
            f"| {row['direct_weighted']:.2f}x | {row['ring_weighted']:.2f}x | {shared} "
            f"| {row['ring_over_bound']:.2f}x | {row['allgatherv_auto_over_allgather']:.2f}x "
            f"| {row['allgatherv_over_allgather']:.2f}x "
            f"| {row['allgatherv_ring_over_allgather']:.2f}x "
            f"| {row['allgatherv_direct_over_allgather']:.2f}x | {gather_shared} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", nargs="+", default=["mpi", "gloo"], choices=["mpi", "gloo"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--max-mib", type=int, default=256)
    parser.add_argument(
        "--loop-mib",
        type=int,
        default=16,
        help="time loops of back-to-back calls moving about this many MiB; 0 times single calls",
    )
    parser.add_argument(
        "--json", type=Path, help="also write every repeat's times, per engine and rank count"
    )
    parser.add_argument("--mpi-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    # One kernel thread per rank: the ranks already fill the cores, and a rank's extra thread
    # would compete with the peers it waits for.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HETCOLL_NUM_THREADS", "1")
    if args.mpi_worker:
        result = measure("mpi", args.max_mib, args.loop_mib)
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_rank() == 0:
            print("RESULT " + json.dumps(result), flush=True)
        return
    from hetcoll import launch

    results = []
    for engine in args.engines:
        for p in args.ranks:
            if engine == "mpi":
                proc = launch.mpiexec(
                    p,
                    [
                        str(Path(__file__).resolve()),
                        "--mpi-worker",
                        "--max-mib",
                        str(args.max_mib),
                        "--loop-mib",
                        str(args.loop_mib),
                    ],
                    timeout=3600,
                )
                line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
                result = json.loads(line[len("RESULT ") :])
            else:
                result = launch.spawn(_gloo_rank, p, args.max_mib, args.loop_mib, timeout=3600)[0]
            print(_table(result), flush=True)
            results.append(result)
    if args.json is not None:
        args.json.write_text(json.dumps(results))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
