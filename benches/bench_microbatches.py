"""Micro-batches of a few samples against the performance model, on one thread:

    OMP_NUM_THREADS=1 python benches/bench_microbatches.py [--rounds 12] [--json out.json]

One process trains :func:`bench_plans.conv_net` (five convolutions, 3 x 16 x 16 inputs) on a
batch of 21 and of 64 samples, split into 1, 2, 4 and 8 micro-batches whose gradients add up
(what a one-rank stage of a :class:`hetcoll.Plan` runs), and compares each measured step with
the model's (:func:`hetcoll.model.predict_plan` of the one-rank plan) for the device measured
just before it (:func:`hetcoll.lab.calibrate.measure_device`, medians of its probes, as the
validation measures). Peer: the same prediction without the convolutions' own fixed cost per
call (``Device.conv_overhead_s`` unset, so each convolution kernel costs the element-wise
``kernel_overhead_s``, and the convolution rate taken from the whole probe time, as before
the term existed): both predictions come from the same device figures, so the machine's
noise is the same for both.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from bench_plans import CLASSES, SHAPE, conv_net

import hetcoll
import hetcoll.model as model
from hetcoll.lab import calibrate
from hetcoll.lab.validate import validation_cluster

BATCHES = (21, 64)
MICROBATCHES = (1, 2, 4, 8)


def _without_conv_overhead(device: model.Device) -> model.Device:
    """``device`` as measured before the convolution's fixed cost had a term: the probe's whole
    time in the rate, every kernel at ``kernel_overhead_s``."""
    flops, kernels = calibrate.conv_probe_counts()
    probe_s = flops / device.conv_rate + kernels * device.conv_call_s
    return dataclasses.replace(device, conv_overhead_s=0.0, conv_flops_per_s=flops / probe_s)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=12, help="timed steps per configuration")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    calibrate.set_statistic("median")
    costs = model.layer_costs(conv_net(), SHAPE)
    torch.manual_seed(0)
    net = conv_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    x_all = torch.randn(max(BATCHES), *SHAPE, generator=g)
    y_all = torch.randint(0, CLASSES, (max(BATCHES),), generator=g)
    link = model.Link("none", 0.0, 1e9)  # one rank: nothing is sent

    def step(batch: int, m: int) -> None:
        for xs, ys in zip(x_all[:batch].tensor_split(m), y_all[:batch].tensor_split(m)):
            F.cross_entropy(net(xs), ys).backward()
        opt.step()
        opt.zero_grad()

    def predicted(device: model.Device, batch: int, m: int) -> float:
        plan = hetcoll.Plan.from_dict(
            {
                "microbatches": m,
                "schedule": "GPipe",
                "replicas": [{"samples": batch, "stages": [{"ranks": [0], "layers": [0, 15]}]}],
            }
        )
        return model.predict_plan(costs, validation_cluster([device], link), plan).step_s

    keys = [(b, m) for b in BATCHES for m in MICROBATCHES]
    runs: dict[tuple[int, int], list[tuple[float, float, float]]] = {k: [] for k in keys}
    overheads = []
    for r in range(args.rounds + 1):
        device = calibrate.measure_device("this-thread", 4e9, quick=True)
        overheads.append(device.conv_call_s)
        before = _without_conv_overhead(device)
        for b, m in keys:
            step(b, m)  # untimed: the same allocations as the timed one
            t0 = time.perf_counter()
            step(b, m)
            seconds = time.perf_counter() - t0
            if r > 0:  # the first round warms up
                runs[b, m].append((seconds, predicted(device, b, m), predicted(before, b, m)))
    rows: list[dict[str, Any]] = []
    for (b, m), got in runs.items():
        measured = statistics.median(g[0] for g in got)
        rows.append(
            {
                "batch": b,
                "microbatches": m,
                "measured_s": measured,
                "predicted_s": statistics.median(g[1] for g in got),
                "predicted_without_s": statistics.median(g[2] for g in got),
                "measured_s_min": min(g[0] for g in got),
                "measured_s_max": max(g[0] for g in got),
                "runs": got,
            }
        )
    out = {
        "rows": rows,
        "rounds": args.rounds,
        "conv_overhead_s": overheads[1:],
        "input_shape": list(SHAPE),
    }
    print(f"one thread, conv_net on {SHAPE}; medians of {args.rounds} steps")
    print(f"{'batch':>5} {'micro':>5} {'measured ms':>12} {'predicted':>16} {'without term':>16}")
    for row in rows:
        meas, new, old = row["measured_s"], row["predicted_s"], row["predicted_without_s"]
        print(
            f"{row['batch']:>5} {row['microbatches']:>5} {meas * 1e3:>12.1f} "
            f"{new * 1e3:>8.1f} ({new / meas - 1:+4.0%}) {old * 1e3:>8.1f} ({old / meas - 1:+4.0%})"
        )
    print(
        "convolution kernel's fixed cost: median "
        f"{statistics.median(overheads[1:]) * 1e6:.0f} us "
        f"({min(overheads[1:]) * 1e6:.0f}-{max(overheads[1:]) * 1e6:.0f})"
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
