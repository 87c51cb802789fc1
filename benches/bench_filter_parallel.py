"""Filter parallelism on two ranks of emulated speeds 1 and 0.25, a conv-heavy CNN, one run:

    python benches/bench_filter_parallel.py [--batches 4 32] [--steps 20] [--json out.json]

1. Step time (forward, backward, SGD step; median over steps of the slowest rank; the
   strategies take turns step by step) of the
   speed-proportional split (:func:`hetcoll.split` over the speeds) against the even split that
   torch.chunk / Mesh-TensorFlow would use, same model, same global batch.
2. Filter parallel (speed-proportional) against data parallel with balanced batches (shares from
   :func:`hetcoll.split`, exact sample-weighted gradient averaging by one fused
   :func:`hetcoll.allreduce`), same model and global batch, at each batch size.
3. Bytes of parameters and of Adam's optimizer state on each rank, against the unsplit model.

Heterogeneity is *emulated* the same way for every strategy: a rank sleeps ``(1/speed - 1)``
times its measured local compute (filter parallel: the split layers, forward and backward, see
:func:`hetcoll.lab.emulate.slow_down_filter_parallel`; data parallel: the forward and backward
of its batch). Ranks share the machine's cores (gloo over loopback), so compare the ratios.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hetcoll
from hetcoll import launch
from hetcoll.lab.emulate import slow_down_filter_parallel
from hetcoll.torch import filter_parallel
from hetcoll.torch.filters import FilterParallelLayer

SPEEDS = (1.0, 0.25)


def conv_net() -> nn.Sequential:
    """3x3 and 5x5 convolutions of 64-256 filters on 3 x 16 x 16 inputs: ~0.5 GFLOP per sample
    forward, >99% of it in the convolutions, so compute outweighs the activations moved."""
    return nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(64, 256, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(256, 256, 5, padding=2),
        nn.ReLU(),
        nn.Conv2d(256, 256, 5, padding=2),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(256, 10),
    )


def _batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(b)
    return torch.randn(b, 3, 16, 16, generator=g), torch.randint(0, 10, (b,), generator=g)


def take_turns(steps_of: dict[str, Any], steps: int, warmup: int = 2) -> dict[str, list[float]]:
    """Every strategy's timed steps (seconds, the slowest rank's), the strategies taking
    turns step by step (so a change in the machine's load hits them alike), after ``warmup``
    untimed rounds. Collective: every rank runs it with the same strategies."""
    times: dict[str, list[float]] = {name: [] for name in steps_of}
    for i in range(warmup + steps):
        for name, step in steps_of.items():
            dist.barrier()
            t0 = time.perf_counter()
            step()
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if i >= warmup:
                times[name].append(float(t))
    return times


def quartiles(times: list[float]) -> dict[str, float]:
    """The median step and its quartiles, as the results files record them."""
    ts = sorted(times)
    return {
        "step_s": statistics.median(ts),
        "step_s_q1": ts[len(ts) // 4],
        "step_s_q3": ts[(3 * len(ts)) // 4],
    }


def _timed(steps: dict[str, Any], repeats: int, warmup: int = 2) -> dict[str, float]:
    """Median over ``repeats`` of the slowest rank's step time (seconds), per strategy
    (:func:`take_turns`)."""
    return {name: statistics.median(ts) for name, ts in take_turns(steps, repeats, warmup).items()}


def _filter_step(speeds: list[float], speed: float, b: int):
    torch.manual_seed(0)
    model = filter_parallel(conv_net(), speeds=speeds)
    slow_down_filter_parallel(model, speed)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = _batch(b)

    def step() -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    shares = [list(m.shares) for m in model.modules() if isinstance(m, FilterParallelLayer)]
    return step, shares


def _grad(p: nn.Parameter) -> torch.Tensor:
    """``p.grad``, which the backward just before has filled: every parameter of
    :func:`conv_net` takes part in the loss."""
    if p.grad is None:
        raise RuntimeError(f"a parameter of shape {tuple(p.shape)} has no gradient after backward")
    return p.grad


def _data_step(rank: int, speed: float, b: int):
    torch.manual_seed(0)
    model = conv_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    shares = hetcoll.split(b, list(SPEEDS), minimum=1)
    x, y = _batch(b)
    lo = sum(shares[:rank])
    xs, ys = x[lo : lo + shares[rank]], y[lo : lo + shares[rank]]
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))

    def step() -> None:
        opt.zero_grad()
        t0 = time.perf_counter()
        nn.functional.cross_entropy(model(xs), ys).backward()
        time.sleep((1.0 / speed - 1.0) * (time.perf_counter() - t0))
        torch.cat([_grad(p).reshape(-1) for p in params], out=flat)
        hetcoll.allreduce(flat, None, weight=shares[rank] / b)  # exact sample-weighted mean
        off = 0
        for p in params:
            _grad(p).copy_(flat[off : off + p.numel()].view_as(p))
            off += p.numel()
        opt.step()

    return step, shares


def _memory(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    full = conv_net()
    split = filter_parallel(copy.deepcopy(full), speeds=list(SPEEDS))
    out: dict[str, Any] = {}
    for name, m in (("unsplit", full), ("filter parallel", split)):
        opt = torch.optim.Adam(m.parameters())
        m(_batch(2)[0]).sum().backward()
        opt.step()
        params = sum(p.numel() * p.element_size() for p in m.parameters())
        state = sum(
            t.numel() * t.element_size()
            for s in opt.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        )
        out[name] = {"param_bytes": params, "adam_state_bytes": state}
    out["shares"] = [list(m.shares) for m in split.modules() if isinstance(m, FilterParallelLayer)]
    return out


def _rank(rank: int, world: int, batches: list[int], steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    speed = SPEEDS[rank]
    res: dict[str, Any] = {"memory": _memory(rank), "batches": {}}
    for b in batches:
        even, even_shares = _filter_step([1.0] * world, speed, b)
        prop, prop_shares = _filter_step(list(SPEEDS), speed, b)
        data, data_shares = _data_step(rank, speed, b)
        row: dict[str, Any] = _timed(
            {
                "filter, even split": even,
                "filter, speed-proportional": prop,
                "data, balanced batches": data,
            },
            steps,
        )
        row["shares"] = {"even": even_shares, "proportional": prop_shares, "data": data_shares}
        res["batches"][b] = row
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[4, 32])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per strategy")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    results = launch.spawn(_rank, len(SPEEDS), args.batches, args.steps, timeout=1800)
    print(f"Emulated heterogeneity: 2 ranks, speeds {SPEEDS[0]:g} and {SPEEDS[1]:g}, gloo")
    print(f"{'global batch':>12} {'strategy':<28} {'step (ms)':>10} {'vs even split':>14}")
    for b in args.batches:
        row = results[0]["batches"][b]
        even = row["filter, even split"]
        for name in ("filter, even split", "filter, speed-proportional", "data, balanced batches"):
            print(f"{b:>12} {name:<28} {row[name] * 1e3:10.1f} {even / row[name]:13.2f}x")
        ratio = row["data, balanced batches"] / row["filter, speed-proportional"]
        print(f"{'':>12} filter (proportional) vs data parallel: {ratio:.2f}x faster")
        print(f"{'':>12} shares (conv1..fc): {row['shares']['proportional']}")
    print("Memory per rank (bytes): parameters, Adam state")
    for r, res in enumerate(results):
        mem = res["memory"]
        f, u = mem["filter parallel"], mem["unsplit"]
        print(
            f"  rank {r} (speed {SPEEDS[r]:g}): {f['param_bytes']:,} / {u['param_bytes']:,} "
            f"({f['param_bytes'] / u['param_bytes']:.1%}), "
            f"{f['adam_state_bytes']:,} / {u['adam_state_bytes']:,} "
            f"({f['adam_state_bytes'] / u['adam_state_bytes']:.1%})"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return {"results": results}


if __name__ == "__main__":
    main(sys.argv[1:])
