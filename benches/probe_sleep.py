"""What sleeping does to the compute that follows it, on this host: the emulation of a slower
device (:mod:`hetcoll.lab.emulate`) sleeps between a rank's kernels, and its model
(:mod:`hetcoll.lab.predict_emulated`) assumes the kernels then run as fast as back to back.

    OMP_NUM_THREADS=1 python benches/probe_sleep.py [--rounds 5] [--json out.json]

One thread times a chunk of work (six 192 x 192 matmuls; a 3x3, 32-channel convolution on 16
samples of 16 x 16) 150 times back to back, then 150 times each followed by a pause of 0.5,
2 and 8 ms, the pause a ``time.sleep`` (the core is given up, as the emulation does) or a
busy wait (the core is held), rounds alternating. Prints each pattern's median chunk time over
the back-to-back one. On a host whose cores serve other guests while one sleeps (a virtual
machine's vCPU, a shared core), the chunk after a sleep runs slower: a sleeping emulation
then makes a rank slower than its factor says.

The same on the lab's own emulation: the validation's ``cnn`` trained one step (forward and
backward, 8 and 32 samples) back to back, then under :func:`hetcoll.lab.emulate.slow_down` at
speed 0.5 (every layer with parameters sleeps as long as its own forward and backward took);
the step's compute is its time less the time slept. Prints the compute under the emulation
over the back-to-back step: 1.0 if the emulated rank computes as fast as the model assumes.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hetcoll.lab.emulate import SlowDown, delay_points
from hetcoll.model import networks

PAUSES_S = (0.0005, 0.002, 0.008)
CHUNKS = 150


def _chunks() -> dict[str, Callable[[], None]]:
    a, b, out = torch.randn(192, 192), torch.randn(192, 192), torch.empty(192, 192)
    x = torch.randn(16, 32, 16, 16)
    conv = torch.nn.Conv2d(32, 32, 3, padding=1)

    def matmuls() -> None:
        for _ in range(6):
            torch.mm(a, b, out=out)

    def convolution() -> None:
        with torch.no_grad():
            conv(x)

    return {"matmul": matmuls, "convolution": convolution}


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _mean_chunk_s(chunk: Callable[[], None], pause: Callable[[], None] | None) -> float:
    total = 0.0
    for _ in range(CHUNKS):
        t0 = time.perf_counter()
        chunk()
        total += time.perf_counter() - t0
        if pause is not None:
            pause()
    return total / CHUNKS


class _CountingSlowDown(SlowDown):
    """The emulation's slow-down, adding up the seconds it sleeps."""

    slept_s = 0.0

    def sleep(self, seconds: float) -> None:
        t0 = time.perf_counter()
        super().sleep(seconds)
        self.slept_s += time.perf_counter() - t0


def _emulated_step_ratio(batch: int, rounds: int) -> dict[str, Any]:
    """Median step compute under ``slow_down(model, 0.5)`` over the back-to-back step, per round."""
    # The model's first layer has no backward the emulation can time (its input needs no
    # gradient): torch warns, and that layer's backward runs at full speed.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    torch.manual_seed(0)
    model = networks.build("cnn", (3, 32, 32))
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        loss_fn(model(x), y).backward()

    for _ in range(5):
        step()
    ratios = []
    for _ in range(rounds):
        plain = []
        for _ in range(10):
            t0 = time.perf_counter()
            step()
            plain.append(time.perf_counter() - t0)
        slow = _CountingSlowDown(delay_points(model), 0.5)
        compute = []
        for _ in range(10):
            slow.slept_s = 0.0
            t0 = time.perf_counter()
            step()
            compute.append(time.perf_counter() - t0 - slow.slept_s)
        slow.remove()
        ratios.append(statistics.median(compute) / statistics.median(plain))
    return {"ratios": ratios, "ratio": statistics.median(ratios)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out: dict[str, Any] = {"pauses_s": list(PAUSES_S), "rounds": args.rounds, "chunks": {}}
    for name, chunk in _chunks().items():
        for _ in range(50):
            chunk()
        patterns: dict[str, Callable[[], None] | None] = {"back to back": None}
        for s in PAUSES_S:
            patterns[f"sleep {s * 1e3:g} ms"] = functools.partial(time.sleep, s)
            patterns[f"busy wait {s * 1e3:g} ms"] = functools.partial(_spin, s)
        times: dict[str, list[float]] = {p: [] for p in patterns}
        for _ in range(args.rounds):
            for p, pause in patterns.items():
                times[p].append(_mean_chunk_s(chunk, pause))
        base = statistics.median(times["back to back"])
        out["chunks"][name] = {
            p: {"seconds": t, "ratio": statistics.median(t) / base} for p, t in times.items()
        }
        print(f"{name}: back to back {base * 1e6:.0f} us a chunk; after a pause, over that:")
        for p in patterns:
            if p != "back to back":
                print(f"  {p:>18}: {out['chunks'][name][p]['ratio']:.2f}x")
    out["emulation"] = {}
    for batch in (8, 32):
        res = out["emulation"][f"cnn, {batch} samples"] = _emulated_step_ratio(batch, args.rounds)
        print(
            f"cnn step on {batch} samples under slow_down(0.5): its compute is "
            f"{res['ratio']:.2f}x the back-to-back step's (rounds: "
            + ", ".join(f"{r:.2f}" for r in res["ratios"])
            + ")"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
