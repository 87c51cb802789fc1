"""How much of the ring allreduce's time is its Python protocol loop, segment by segment.

    python benches/ring_overhead.py --engines mpi gloo --mib 1 4 16 64 --segment-kib 64 256 1024

Two ranks, float32, weighted, the pipelined ring (``algorithm="ring"`` with ``segment_bytes``).
For each engine, buffer size and segment size it reports:

- the time of one call, ``hetcoll.allreduce`` as users call it (median over repeats of the
  slowest rank's time, each call after a barrier);
- the same call's time split into parts, measured on every rank in separate instrumented calls
  of the ring itself: **reduce**, the Rust ``weighted_sum`` kernel (GIL released); **post**,
  ``isend``/``irecv`` (hetcoll.comm's wrapper and the engine binding's call); **wait**,
  ``Request.wait`` (waiting for the data, and the engine's completion bookkeeping); **loop**,
  everything else in the ring's own Python (schedule indexing, numpy views, lists, closures),
  less the instrumentation's own calibrated cost. Only "loop" is what moving the loop into Rust
  could remove: the engines' point-to-point calls are Python objects (mpi4py, torch.distributed),
  which a Rust loop would still have to call back into Python for;
- per received segment message: the loop's and the posts' microseconds.

``--profile MIB SEGMENT_KIB`` also prints rank 0's cProfile of 10 such calls (self time per
function), a cross-check of the "loop" column with another tool.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np

KIB = 1024


class _Clock:
    """Accumulated nanoseconds per part, and the number of timed calls (for the calibration)."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = {"reduce": 0, "schedule": 0, "post": 0, "wait": 0}
        self.calls: dict[str, int] = dict.fromkeys(self.ns, 0)
        self.messages = 0

    def timed(self, part: str, fn: Any) -> Any:
        clock = time.perf_counter_ns
        ns = self.ns

        calls = self.calls

        def call(*args: Any, **kwargs: Any) -> Any:
            calls[part] += 1
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                ns[part] += clock() - t0

        return call


class _TimedRequest:
    def __init__(self, req: Any, wait: Any) -> None:
        self._req = req
        self.wait = wait

    @classmethod
    def make(cls, clock: _Clock, req: Any) -> _TimedRequest:
        return cls(req, clock.timed("wait", req.wait))


def _instrument(c: Any, clock: _Clock) -> None:
    """Time ``c``'s point-to-point calls and the requests they return (instance attributes)."""
    isend, irecv = type(c).isend, type(c).irecv
    post_send = clock.timed("post", lambda *a: isend(c, *a))
    post_recv = clock.timed("post", lambda *a: irecv(c, *a))

    def timed_isend(*a: Any) -> Any:
        return _TimedRequest.make(clock, post_send(*a))

    def timed_irecv(*a: Any) -> Any:
        clock.messages += 1
        return _TimedRequest.make(clock, post_recv(*a))

    c.isend, c.irecv = timed_isend, timed_irecv


def _wrapper_cost_ns(clock_calls: int = 200_000) -> float:
    """What one timed request adds outside the timed regions (the wrappers' calls, the clock
    reads, the accumulation, the request wrapper: a post and its wait): it would land in "loop",
    so it is subtracted from it (half of it for each timed kernel call)."""
    clock = _Clock()
    req = types.SimpleNamespace(wait=lambda deadline: None)
    f = clock.timed("post", lambda *a: req)

    def wrapped(*a: Any) -> Any:
        return _TimedRequest.make(clock, f(*a))

    def plain(*a: Any) -> Any:
        return req

    best = []
    for fn in (wrapped, plain):
        t0 = time.perf_counter_ns()
        for _ in range(clock_calls):
            fn(1, 2, 3).wait(None)
        best.append((time.perf_counter_ns() - t0) / clock_calls)
    return best[0] - best[1]


def measure(kind: str, sizes_mib: list[int], segments_kib: list[int], repeats: int) -> Any:
    """Run on both ranks; returns this rank's rows."""
    import hetcoll
    from hetcoll import _core
    from hetcoll.collectives import ring
    from hetcoll.comm import wrap

    comm: Any
    barrier: Any
    if kind == "mpi":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        barrier = comm.Barrier
    else:
        import torch.distributed as dist

        comm = None
        barrier = dist.barrier
    c = wrap(comm)
    p, r = c.size, c.rank
    w = (r + 1) / (p * (p + 1) / 2)
    per_wrap = _wrapper_cost_ns()
    rows = []
    for mib in sizes_mib:
        buf = np.ones(mib * KIB * KIB // 4, np.float32)
        counts = _core.split(buf.size, [1.0] * p)
        for seg_kib in segments_kib:
            seg = seg_kib * KIB
            hetcoll.allreduce(buf, comm, weight=w, algorithm="ring", segment_bytes=seg)  # warm-up
            plain = []
            for _ in range(repeats):
                barrier()
                t0 = time.perf_counter_ns()
                hetcoll.allreduce(buf, comm, weight=w, algorithm="ring", segment_bytes=seg)
                plain.append(time.perf_counter_ns() - t0)
            # The same ring, instrumented: called directly on a timed communicator, with the
            # module's Rust bindings replaced by timed ones for the duration.
            ti = copy.copy(c)  # instrumented per call; ``c`` stays as hetcoll.allreduce finds it
            parts = []
            saved = ring._core
            try:
                for _ in range(repeats):
                    clock = _Clock()
                    _instrument(ti, clock)
                    ring._core = types.SimpleNamespace(  # type: ignore[assignment]
                        weighted_sum_into=clock.timed("reduce", _core.weighted_sum_into),
                        ring_schedule=clock.timed("schedule", _core.ring_schedule),
                    )
                    segment = max(1, seg // buf.itemsize)
                    barrier()
                    t0 = time.perf_counter_ns()
                    ring._ring(ti, buf, False, w, counts, segment, None)
                    total = time.perf_counter_ns() - t0
                    n = clock.calls
                    wrappers = n["post"] * per_wrap + (n["reduce"] + n["schedule"]) * per_wrap / 2
                    loop = total - sum(clock.ns.values()) - wrappers
                    parts.append(
                        dict(total=total, loop=loop, messages=clock.messages - 1, **clock.ns)
                    )
            finally:
                ring._core = saved
            med = {k: statistics.median(x[k] for x in parts) for k in parts[0]}
            rows.append(
                dict(
                    mib=mib,
                    segment_kib=seg_kib,
                    call_ms=statistics.median(plain) / 1e6,
                    parts_ms={k: v / 1e6 for k, v in med.items() if k != "messages"},
                    messages=int(med["messages"]),
                    wrapper_ns=per_wrap,
                )
            )
    return rows


def _profile(kind: str, mib: int, seg_kib: int) -> str:
    """Rank 0's cProfile of 10 ring calls (on every rank; rank 0 reports)."""
    import hetcoll

    comm: Any
    if kind == "mpi":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    else:
        comm = None
    buf = np.ones(mib * KIB * KIB // 4, np.float32)
    prof = cProfile.Profile()
    for i in range(11):  # the first call warms up, unprofiled
        if i == 1:
            prof.enable()
        hetcoll.allreduce(buf, comm, weight=0.5, algorithm="ring", segment_bytes=seg_kib * KIB)
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:14]
    lines = ["| function | calls per ring call | self µs per ring call |", "|---|---:|---:|"]
    for (path, line, name), (_, ncalls, tottime, _, _) in top:
        where = f"{Path(path).name}:{line}({name})" if line else name
        lines.append(f"| `{where}` | {ncalls / 10:g} | {tottime / 10 * 1e6:.1f} |")
    return "\n".join(lines)


def _slowest(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each row with the slowest rank's call time and the parts of the rank that spent the
    most in its loop."""
    rows = []
    for same in zip(*per_rank, strict=True):
        worst = max(same, key=lambda x: x["parts_ms"]["loop"])
        rows.append({**worst, "call_ms": max(x["call_ms"] for x in same)})
    return rows


def _table(kind: str, rows: list[dict[str, Any]]) -> str:
    lines = [
        f"\n{kind}, two ranks: ring call time and its parts (ms), per-message µs\n",
        "| size | segment | messages | call | ring (timed) | reduce | post | wait | loop "
        "| loop share | loop µs/msg | post µs/msg |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for x in rows:
        q, n = x["parts_ms"], max(1, x["messages"])
        lines.append(
            f"| {x['mib']} MiB | {x['segment_kib']} KiB | {x['messages']} | {x['call_ms']:.2f} "
            f"| {q['total']:.2f} | {q['reduce']:.2f} | {q['post']:.2f} | {q['wait']:.2f} "
            f"| {q['loop']:.3f} "
            f"| {q['loop'] / q['total']:.1%} | {q['loop'] * 1e3 / n:.1f} "
            f"| {q['post'] * 1e3 / n:.1f} |"
        )
    lines += ["", "loop time = a + b · messages, least squares over the segment sizes:", ""]
    lines += ["| size | a: per call (µs) | b: per message (µs) |", "|---:|---:|---:|"]
    for mib in sorted({x["mib"] for x in rows}):
        same = [x for x in rows if x["mib"] == mib]
        if len({x["messages"] for x in same}) < 2:
            continue
        b, a = np.polyfit([x["messages"] for x in same], [x["parts_ms"]["loop"] for x in same], 1)
        lines.append(f"| {mib} MiB | {a * 1e3:.1f} | {b * 1e3:.2f} |")
    return "\n".join(lines)


def _gloo_rank(rank: int, world: int, args: dict[str, Any]) -> Any:
    out = measure("gloo", args["mib"], args["segment_kib"], args["repeats"])
    prof = _profile("gloo", *args["profile"]) if args["profile"] else ""
    return out, prof


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", nargs="+", default=["mpi", "gloo"], choices=["mpi", "gloo"])
    parser.add_argument("--mib", nargs="+", type=int, default=[1, 4, 16, 64])
    parser.add_argument("--segment-kib", nargs="+", type=int, default=[64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--profile", nargs=2, type=int, metavar=("MIB", "SEGMENT_KIB"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--mpi-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HETCOLL_NUM_THREADS", "1")
    opts = dict(
        mib=args.mib, segment_kib=args.segment_kib, repeats=args.repeats, profile=args.profile
    )
    if args.mpi_worker:
        from mpi4py import MPI

        rows = measure("mpi", args.mib, args.segment_kib, args.repeats)
        prof = _profile("mpi", *args.profile) if args.profile else ""
        gathered = MPI.COMM_WORLD.gather((rows, prof))
        if gathered is not None:
            print("RESULT " + json.dumps(gathered), flush=True)
        return
    from hetcoll import launch

    results = {}
    for engine in args.engines:
        if engine == "mpi":
            cmd = [str(Path(__file__).resolve()), "--mpi-worker", "--repeats", str(args.repeats)]
            cmd += ["--mib", *map(str, args.mib), "--segment-kib", *map(str, args.segment_kib)]
            if args.profile:
                cmd += ["--profile", *map(str, args.profile)]
            proc = launch.mpiexec(2, cmd, timeout=3600)
            line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
            per_rank = json.loads(line[len("RESULT ") :])
        else:
            per_rank = launch.spawn(_gloo_rank, 2, opts, timeout=3600)
        rows = _slowest([rows for rows, _ in per_rank])
        results[engine] = rows
        print(_table(engine, rows), flush=True)
        if args.profile:
            print(f"\n{engine}, rank 0, cProfile of 10 calls:\n{per_rank[0][1]}", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
