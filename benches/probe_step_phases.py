"""Where a data-parallel plan's step spends its time: :func:`hetcoll.torch.parallelize` running
one whole-model replica per rank on two gloo ranks (the plan of ``bench_data_parallel``'s
runtime row), each phase of ``Parallel.step`` timed by wrapping it, per step, on each rank.

    python benches/probe_step_phases.py --model tiny --steps 500

Prints each rank's milliseconds a step in: the batch check's start (``_check_batch``), the
micro-batches' weights, the forwards and backwards (``_run``, which waits for the batch
check), the gradients' sums (``_combine``, and within it the transport's blocking
``allreduce``), the start of the loss's sum and the wait for it (``iallreduce``, ``wait``),
the whole ``step``, and the loop (step, SGD step, ``zero_grad``). The wrappers cost each
phase the same few microseconds. To compare two versions of the library under the same
load, alternate launches of each (each with its own ``PYTHONPATH``); the timings of one
launch move 5-10% from launch to launch on a 2-core host.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from hetcoll.launch import spawn

PHASES = ("step", "_check_batch", "_microbatch_weights", "_run", "_combine")
TRANSPORT = ("allreduce", "iallreduce", "wait")


def _rank(rank: int, world: int, model: str, steps: int) -> dict[str, float]:
    import torch
    from bench_data_parallel import hook_model  # the benchmark's models
    from torch import nn

    from hetcoll.torch import model_layers, parallelize

    spent: dict[str, list[float]] = {}

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent.setdefault(name, []).append(time.perf_counter() - t0)

        return run

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4 * world, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (4 * world,), generator=g)
    torch.manual_seed(0)
    net = hook_model(model)
    whole = [0, len(model_layers(net))]
    plan = {
        "replicas": [
            {"samples": 4, "stages": [{"ranks": [r], "layers": whole}]} for r in range(world)
        ]
    }
    par = parallelize(net, plan, loss_fn=nn.functional.cross_entropy)
    for name in PHASES:
        setattr(par, name, timed(name, getattr(par, name)))
    for name in TRANSPORT:
        if hasattr(par._tr, name):  # iallreduce: newer than some versions compared
            setattr(par._tr, name, timed("transport." + name, getattr(par._tr, name)))
    opt = torch.optim.SGD(par.parameters(), lr=0.01)

    def loop() -> None:
        par.step(x, y)
        opt.step()
        opt.zero_grad()

    for _ in range(50):  # warm-up
        loop()
    spent.clear()
    torch.distributed.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        loop()
    out = {name: 1e3 * sum(t) / steps for name, t in spent.items()}
    out["loop"] = 1e3 * (time.perf_counter() - t0) / steps
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("tiny", "demo", "wide"), default="tiny")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    got = spawn(_rank, 2, args.model, args.steps, threads_per_rank=1, timeout=600)
    for rank, phases in enumerate(got):
        print(f"rank {rank}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in phases.items()))
    print(f"loop, median of the ranks: {statistics.median(r['loop'] for r in got):.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "steps": args.steps, "ranks": got}, f, indent=1)


if __name__ == "__main__":
    main()
