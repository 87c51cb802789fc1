"""What a micro-batch costs beyond its share of the work, on this host: the expert-parallel
plan of ``bench_expert_parallel.py`` (Mixtral in the LM example's shape, 2 gloo ranks, rows
and experts by speeds 1 : 0.25) run by :func:`hetcoll.torch.parallelize` in 1, 2 and 4
micro-batches, without emulation and under :func:`hetcoll.lab.emulate.slow_down`, against
what the performance model predicts for each (:func:`hetcoll.model.predict.predict_plan`,
this machine measured first, :mod:`hetcoll.lab.calibrate`).

    OMP_NUM_THREADS=1 python benches/probe_passes.py [--steps 8] [--json out.json]

Prints each step's median (the slower rank's) and, per extra micro-batch, the measured and the
predicted extra seconds: what a pass costs whatever its rows (Python and dispatch in each
layer's forward and backward, the experts' exchanges), which the model prices as its kernels'
launch overheads and the link's latency and fixed cost per collective call. Then the
collectives' own fixed cost: a small all-to-all and allreduce (64 floats) on the same 2 gloo
ranks, against what the model prices each at on the link
:func:`hetcoll.lab.calibrate.measure_gloo_link` measures (its latency, one way, and its fixed
cost per call).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import warnings
from typing import Any

import torch

from hetcoll import launch

SPEEDS = (1.0, 0.25)
BATCH = 32
PASSES = (1, 2, 4)


def _rank(rank: int, world: int, steps: int) -> dict[str, Any]:
    from bench_tensor_parallel import lm_example, make_model

    from hetcoll.lab.emulate import slow_down
    from hetcoll.model.planner.experts import expert_parallel_plan
    from hetcoll.torch import parallelize
    from hetcoll.torch.expert_parallel import find_experts
    from hetcoll.torch.layers import model_layers

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    ex = lm_example()
    torch.manual_seed(0)
    model = make_model("mixtral", 256)
    ids = torch.randint(0, 256, (BATCH, ex.SEQ), generator=torch.Generator().manual_seed(1))
    out: dict[str, Any] = {}
    for emulated in (False, True):
        for m in PASSES:
            plan = expert_parallel_plan(
                BATCH, SPEEDS, find_experts(model), len(model_layers(model)), m
            )
            par = parallelize(copy.deepcopy(model), plan, loss_fn=ex.lm_loss)
            assert par.stage is not None
            if emulated:
                slow_down(par.stage, SPEEDS[rank])
            opt = torch.optim.SGD(par.parameters(), lr=1e-3)
            times = []
            for _ in range(steps + 1):  # the first warms up
                start = time.perf_counter()
                opt.zero_grad()
                par.step({"input_ids": ids}, ids)
                opt.step()
                times.append(time.perf_counter() - start)
            out[f"{'emulated' if emulated else 'plain'} {m}"] = statistics.median(times[1:])
    return out


def _collectives(rank: int, world: int, calls: int = 200) -> dict[str, float]:
    """Seconds per call of a small all-to-all and allreduce, back to back (median of 5)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    x = torch.zeros(64)
    ops = {
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty(64), x),
        "all_reduce": lambda: dist.all_reduce(x),
    }
    out = {}
    for name, op in ops.items():
        for _ in range(calls // 4):
            op()
        rounds = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                op()
            rounds.append((time.perf_counter() - start) / calls)
        out[name] = statistics.median(rounds)
    return out


def predicted() -> dict[int, float]:
    """The model's step for each number of micro-batches (the emulation not modelled: the
    plain runs' peer)."""
    from bench_tensor_parallel import machine

    from hetcoll.lab.validate import validation_cluster
    from hetcoll.model.planner.experts import expert_parallel_plan
    from hetcoll.model.predict import predict_plan

    costs, device, link = machine("mixtral", 256)
    cluster = validation_cluster([device] * len(SPEEDS), link)
    layers = [(block.module, block.experts) for block in costs.experts]
    return {
        m: predict_plan(
            costs, cluster, expert_parallel_plan(BATCH, SPEEDS, layers, len(costs.plan_layers), m)
        ).step_s
        for m in PASSES
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8, help="timed steps per configuration")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    guesses = predicted()
    ranks = launch.spawn(_rank, len(SPEEDS), args.steps, timeout=1800)
    measured = {k: max(r[k] for r in ranks) for k in ranks[0]}
    print(f"{'micro-batches':>13} {'plain (ms)':>11} {'emulated (ms)':>14} {'predicted (ms)':>15}")
    for m in PASSES:
        print(
            f"{m:>13} {measured[f'plain {m}'] * 1e3:11.1f} "
            f"{measured[f'emulated {m}'] * 1e3:14.1f} {guesses[m] * 1e3:15.1f}"
        )
    last = PASSES[-1]
    extra = {
        kind: (measured[f"{kind} {last}"] - measured[f"{kind} 1"]) / (last - 1)
        for kind in ("plain", "emulated")
    }
    model = (guesses[last] - guesses[1]) / (last - 1)
    print(
        f"each extra micro-batch: {extra['plain'] * 1e3:.1f} ms plain, "
        f"{extra['emulated'] * 1e3:.1f} ms emulated, {model * 1e3:.1f} ms predicted"
    )
    from hetcoll.lab.calibrate import measure_gloo_link
    from hetcoll.model import terms

    calls = launch.spawn(_collectives, len(SPEEDS), timeout=600)[0]
    link = measure_gloo_link().link("gloo-local")
    p = len(SPEEDS)
    priced = {
        "all_to_all_single": terms.all_to_all_seconds(
            256.0, p, link.latency_s, link.bytes_per_s, link.call_s
        ),
        "all_reduce": terms.ring_allreduce_seconds(
            256.0, p, link.latency_s, link.bytes_per_s, float("inf"), call_s=link.call_s
        ),
    }
    for name, seconds in calls.items():
        print(
            f"{name}: {seconds * 1e6:.0f} us a call; the model prices it at "
            f"{priced[name] * 1e6:.0f} us (link latency {link.latency_s * 1e6:.0f} us, "
            f"{link.call_s * 1e6:.0f} us a call)"
        )
    result = {
        "measured_s": measured,
        "predicted_s": guesses,
        "extra_pass_s": extra,
        "collective_call_s": calls,
        "priced_call_s": priced,
        "link_latency_s": link.latency_s,
        "link_call_s": link.call_s,
    }
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({**result, "predicted_extra_pass_s": model}, fh, indent=1)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
