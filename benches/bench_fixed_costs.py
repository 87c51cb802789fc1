"""What a step costs whatever its size, measured on this host against the performance model
(docs/model.md, "Fixed costs"), with and without its two fixed-cost terms:

- **kernel launches**: the LM example's decoders (Mixtral, Llama, GPT-2; ``bench_tensor_parallel``'s
  shapes) on one thread - the kernels ``layer_costs`` counts, the launches it counts
  (``Kernel.launches``), the ops a real forward and backward dispatches that launch a kernel,
  and a pass's fixed cost: the intercept of its forward and backward timed at 2, 4 and 8
  samples, against the launches (and the kernels, as before) at the calibrated cost per kernel;
- **collective calls**: small collectives (64 floats) between two local gloo ranks, called
  back to back in ranks of their own, against what the model prices each at on the link
  :func:`hetcoll.lab.calibrate.measure_gloo_link` calibrated just before (its own such
  calls): with its kind's fixed cost per call (``Link.call_of``), with one cost for every
  kind (``Link.call_s``: the median) and without;
- **passes**: ``bench_expert_parallel.py``'s expert-parallel plan (Mixtral, 2 gloo ranks, rows
  and experts by speeds 1 : 0.25, no emulation) run by :func:`hetcoll.torch.parallelize` in
  1, 2 and 4 micro-batches, against :func:`hetcoll.model.predict.predict_plan` with both
  terms and with neither, from the same device and link figures.

    OMP_NUM_THREADS=1 python benches/bench_fixed_costs.py [--steps 8] [--json out.json]
    python benches/report.py import fixed-costs out.json --command "..."
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import warnings
from dataclasses import replace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hetcoll import launch

SPEEDS = (1.0, 0.25)
BATCH = 32
PASSES = (1, 2, 4)
ARCHS = ("mixtral", "llama", "gpt2")
#: Samples a pass is timed at; its fixed cost is the straight line's intercept through them.
INTERCEPT_BATCHES = (2, 4, 8)


class _Launched(TorchDispatchMode):
    """Counts the ops of a real run that launch a kernel: not views, not bare allocations."""

    FREE = frozenset(
        {"empty", "empty_like", "empty_strided", "detach", "alias", "lift_fresh", "_unsafe_view"}
    )

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if not func.is_view and func._overloadpacket.__name__ not in self.FREE:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _one_launch(costs: Any) -> Any:
    """``costs`` as the model counted them before launches: one per summed kernel."""

    def kernels(ks: Any) -> tuple[Any, ...]:
        return tuple(replace(k, launches=1) for k in ks)

    return replace(
        costs,
        layers=tuple(
            replace(x, forward=kernels(x.forward), backward=kernels(x.backward))
            for x in costs.layers
        ),
    )


def launches(device: Any, rounds: int = 7) -> list[dict[str, Any]]:
    """Each decoder's kernels, launches and real ops, and a pass's fixed cost measured and
    predicted (at ``device``'s cost per kernel)."""
    from bench_tensor_parallel import lm_example, make_model

    import hetcoll.model as hm

    ex = lm_example()
    out = []
    for arch in ARCHS:
        torch.manual_seed(0)
        model = make_model(arch, 256)
        costs = hm.layer_costs(model, (ex.SEQ,), dtype=torch.int64, loss=ex.costed_loss)
        kernels = sum(len(x.forward) + len(x.backward) for x in costs.layers)
        counted = sum(k.launches for x in costs.layers for k in (*x.forward, *x.backward))

        def step(rows: int, model: Any = model) -> None:
            ids = torch.randint(0, 256, (rows, ex.SEQ), generator=torch.Generator().manual_seed(1))
            model.zero_grad(set_to_none=True)
            ex.lm_loss(model(input_ids=ids), ids).backward()

        step(INTERCEPT_BATCHES[0])
        run = _Launched()
        with run:
            step(INTERCEPT_BATCHES[0])
        timed = {}
        for rows in INTERCEPT_BATCHES:
            times = []
            for _ in range(rounds):
                start = time.perf_counter()
                step(rows)
                times.append(time.perf_counter() - start)
            timed[rows] = statistics.median(times)
        lo, hi = INTERCEPT_BATCHES[0], INTERCEPT_BATCHES[-1]
        slope = (timed[hi] - timed[lo]) / (hi - lo)
        out.append(
            {
                "arch": arch,
                "kernels": kernels,
                "launches": counted,
                "real_ops": run.count,
                "pass_s": timed,
                "fixed_s": timed[lo] - slope * lo,
                "predicted_fixed_s": counted * device.kernel_overhead_s,
                "predicted_fixed_kernels_s": kernels * device.kernel_overhead_s,
            }
        )
    return out


def calls(fit: Any) -> list[dict[str, Any]]:
    """Each collective's seconds a call, timed in ranks of their own after the calibration,
    against the model's price of it on the link ``fit`` calibrated, with its kind's fixed cost
    per call, with one cost for every kind and without (2 ranks, 256 bytes)."""
    from hetcoll.lab.calibrate import gloo_calls
    from hetcoll.model import terms

    link, p, n = fit.link("gloo-local"), 2, 256.0

    def priced(name: str, call_s: float) -> float:
        lat, bw = link.latency_s, link.bytes_per_s
        if name in ("allreduce", "hetcoll_allreduce"):
            return float(terms.ring_allreduce_seconds(n, p, lat, bw, float("inf"), call_s=call_s))
        if name in ("allgather", "hetcoll_allgatherv"):
            return float(terms.ring_allgatherv_seconds(n, p, lat, bw, call_s))
        if name == "all_to_all":
            return float(terms.all_to_all_seconds(n, p, lat, bw, call_s))
        return float(terms.broadcast_seconds(n, p, lat, bw, call_s))

    measured = launch.spawn(gloo_calls, 2, timeout=600)[0]
    return [
        {
            "collective": name,
            "measured_s": measured[name],
            "calibrated_s": seconds,
            "predicted_s": priced(name, link.call_of(name)),
            "predicted_one_cost_s": priced(name, link.call_s),
            "predicted_without_s": priced(name, 0.0),
        }
        for name, seconds in fit.calls_s
    ]


def _rank(rank: int, world: int, steps: int) -> dict[int, float]:
    from bench_tensor_parallel import lm_example, make_model

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
    out = {}
    for m in PASSES:
        plan = expert_parallel_plan(BATCH, SPEEDS, find_experts(model), len(model_layers(model)), m)
        par = parallelize(copy.deepcopy(model), plan, loss_fn=ex.lm_loss)
        opt = torch.optim.SGD(par.parameters(), lr=1e-3)
        times = []
        for _ in range(steps + 1):  # the first warms up
            start = time.perf_counter()
            opt.zero_grad()
            par.step({"input_ids": ids}, ids)
            opt.step()
            times.append(time.perf_counter() - start)
        out[m] = statistics.median(times[1:])
    return out


def passes(costs: Any, device: Any, link: Any, steps: int) -> list[dict[str, Any]]:
    """The plan's step at each number of micro-batches, measured (the slower rank's median)
    and predicted with both fixed-cost terms and with neither."""
    from hetcoll.lab.validate import validation_cluster
    from hetcoll.model.planner.experts import expert_parallel_plan
    from hetcoll.model.predict import predict_plan

    layers = [(block.module, block.experts) for block in costs.experts]
    both = validation_cluster([device] * len(SPEEDS), link)
    neither = validation_cluster([device] * len(SPEEDS), replace(link, call_s=0.0, calls_s=()))
    before = _one_launch(costs)
    ranks = launch.spawn(_rank, len(SPEEDS), steps, timeout=1800)
    out = []
    for m in PASSES:
        plan = expert_parallel_plan(BATCH, SPEEDS, layers, len(costs.plan_layers), m)
        out.append(
            {
                "microbatches": m,
                "measured_s": max(r[m] for r in ranks),
                "predicted_s": predict_plan(costs, both, plan).step_s,
                "predicted_without_s": predict_plan(before, neither, plan).step_s,
            }
        )
    return out


#: One rank's whole-model steps (``steps``): the demo CNN at these batches, the LM example's
#: Llama at these rows, each under parallelize with plain SGD.
STEP_BATCHES = {"demo CNN": (1, 8, 32), "Llama": (2, 8)}


def _step_model(name: str) -> tuple[Any, Any, Any, Any]:
    """(model, its inputs of a number of rows, their targets, the loss function) for one of
    STEP_BATCHES."""
    from bench_tensor_parallel import lm_example, make_model

    from hetcoll.lab.demo_ranks import DemoNet

    torch.manual_seed(0)
    if name == "demo CNN":
        return (
            DemoNet(),
            lambda rows: torch.randn(rows, 1, 8, 8, generator=torch.Generator().manual_seed(1)),
            lambda rows: torch.arange(rows) % 10,
            torch.nn.functional.cross_entropy,
        )
    ex = lm_example()

    def ids(rows: int) -> Any:
        return torch.randint(0, 256, (rows, ex.SEQ), generator=torch.Generator().manual_seed(1))

    return make_model("llama", 256), lambda rows: {"input_ids": ids(rows)}, ids, ex.lm_loss


def _whole(rows: int, layers: int) -> dict[str, Any]:
    return {"replicas": [{"samples": rows, "stages": [{"ranks": [0], "layers": [0, layers]}]}]}


def _steps_rank(rank: int, world: int, steps: int) -> dict[str, dict[int, float]]:
    """A rank alone: the median of ``steps`` steps (zero_grad, ``par.step``, SGD) of each model
    of STEP_BATCHES at each batch, after two untimed."""
    from hetcoll.torch import parallelize
    from hetcoll.torch.layers import model_layers

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    out: dict[str, dict[int, float]] = {}
    for name, batches in STEP_BATCHES.items():
        model, inputs, targets, loss = _step_model(name)
        out[name] = {}
        for rows in batches:
            plan = _whole(rows, len(model_layers(model)))
            par = parallelize(copy.deepcopy(model), plan, loss_fn=loss)
            opt = torch.optim.SGD(par.parameters(), lr=1e-3)
            x, y = inputs(rows), targets(rows)
            times = []
            for _ in range(steps + 2):
                start = time.perf_counter()
                opt.zero_grad()
                par.step(x, y)
                opt.step()
                times.append(time.perf_counter() - start)
            out[name][rows] = statistics.median(times[2:])
    return out


def whole_steps(device: Any, steps: int) -> list[dict[str, Any]]:
    """Each model of STEP_BATCHES, a rank alone, measured and predicted with the device's
    step overhead (``Device.step_overhead_s``, calibrated on the step probe) and without."""
    from bench_tensor_parallel import lm_example

    import hetcoll.model as hm
    from hetcoll.plan import Plan

    measured = launch.spawn(_steps_rank, 1, steps, timeout=1800)[0]
    with_it = hm.Cluster([hm.Node("rank", device, 1)])
    without = hm.Cluster([hm.Node("rank", replace(device, step_overhead_s=0.0), 1)])
    ex = lm_example()
    out = []
    for name, batches in STEP_BATCHES.items():
        model, _, _, _ = _step_model(name)
        if name == "demo CNN":
            costs = hm.layer_costs(model, (1, 8, 8), loss="cross-entropy")
        else:
            costs = hm.layer_costs(model, (ex.SEQ,), dtype=torch.int64, loss=ex.costed_loss)
        for rows in batches:
            plan = Plan.from_dict(_whole(rows, len(costs.plan_layers)))
            out.append(
                {
                    "model": name,
                    "batch": rows,
                    "measured_s": measured[name][rows],
                    "predicted_s": hm.predict_plan(
                        costs, with_it, plan, optimizer_state_copies=0
                    ).step_s,
                    "predicted_without_s": hm.predict_plan(
                        costs, without, plan, optimizer_state_copies=0
                    ).step_s,
                }
            )
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8, help="timed steps per number of passes")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from bench_tensor_parallel import lm_example, make_model

    import hetcoll.model as hm
    from hetcoll.lab import calibrate

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    device = calibrate.measure_device("rank", 4e9, quick=True)
    device = replace(device, step_overhead_s=calibrate.measure_step_overhead_s(device))
    fit = calibrate.measure_gloo_link()
    ex = lm_example()
    costs = hm.layer_costs(
        make_model("mixtral", 256), (ex.SEQ,), dtype=torch.int64, loss=ex.costed_loss
    )
    rows = {
        "launches": launches(device),
        "calls": calls(fit),
        "passes": passes(costs, device, fit.link("gloo-local"), args.steps),
        "steps": whole_steps(device, args.steps * 4),
    }
    result: dict[str, Any] = {
        **rows,
        "kernel_overhead_s": device.kernel_overhead_s,
        "step_overhead_s": device.step_overhead_s,
        "link": {
            "latency_s": fit.latency_s,
            "bytes_per_s": fit.bytes_per_s,
            "call_s": fit.call_s,
        },
        "speeds": list(SPEEDS),
        "batch": BATCH,
    }
    print(f"kernel overhead {device.kernel_overhead_s * 1e6:.1f} us; link {fit.describe()}")
    for row in rows["launches"]:
        print(
            f"{row['arch']:>8}: {row['kernels']} kernels, {row['launches']} launches, "
            f"{row['real_ops']} ops run; fixed cost of a pass {row['fixed_s'] * 1e3:.2f} ms, "
            f"predicted {row['predicted_fixed_s'] * 1e3:.2f} ms "
            f"({row['predicted_fixed_kernels_s'] * 1e3:.2f} ms by kernels)"
        )
    for row in rows["calls"]:
        print(
            f"{row['collective']:>10}: {row['measured_s'] * 1e6:.0f} us a call, priced "
            f"{row['predicted_s'] * 1e6:.0f} us (at one cost for every kind "
            f"{row['predicted_one_cost_s'] * 1e6:.0f} us, without "
            f"{row['predicted_without_s'] * 1e6:.0f} us)"
        )
    for row in rows["passes"]:
        print(
            f"{row['microbatches']} micro-batches: {row['measured_s'] * 1e3:.1f} ms, predicted "
            f"{row['predicted_s'] * 1e3:.1f} ms ({row['predicted_without_s'] * 1e3:.1f} ms "
            "without the fixed costs)"
        )
    for row in rows["steps"]:
        print(
            f"{row['model']}, {row['batch']} a step alone: {row['measured_s'] * 1e3:.2f} ms, "
            f"predicted {row['predicted_s'] * 1e3:.2f} ms "
            f"({row['predicted_without_s'] * 1e3:.2f} ms without the step's fixed cost)"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
