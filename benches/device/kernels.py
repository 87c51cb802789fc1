"""GPU kernels beside their peers (issue 40, item 5): hetcoll.weighted_sum of K = 4 CUDA tensors
of 2^25 elements (float32, bfloat16) against the ways torch users combine them today, and
against the device's memory bandwidth (a copy), all measured in the same run.

    python benches/device/kernels.py --json OUT/kernels.json

Peers: the ``add_`` chain (``out = w0 a0; out.add_(ai, alpha=wi)``), ``torch._foreach_mul`` then
a sum, and, where torch's jiterator compiles it, one fused element-wise kernel written here (the
library's own fused path, ``hetcoll.kernels.fused_device_kernel``, is one such kernel: measured
into ``out``, which adds a copy, and as a new output). Every entry's result is checked against
float64.
Bandwidth: the copy of one tensor moves 2 N s bytes; a weighted sum at least (K + 1) N s
(``s``: bytes per element), so ``ideal = (K + 1) / 2 * copy time`` and the ratios below are
``time / ideal`` (1.0 = at the memory's speed) and ``time / peer's time``.

Without CUDA it writes ``{"status": "skipped: no CUDA"}`` and exits 0 (the dry run).
Lab code, like everything in benches/: it imports the library, the library never imports it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch

import hetcoll

K = 4
WEIGHTS = [3.0, 5.0, 8.0, 0.5]


def cuda_seconds(fn: Callable[[], object], repeats: int, warmup: int = 2) -> list[float]:
    """Each call's GPU time (CUDA events around it), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def fused_kernel() -> Callable[..., torch.Tensor] | None:
    """A one-pass weighted sum of four tensors compiled by torch's jiterator (float32
    accumulation), or None where it is unavailable."""
    try:
        from torch.cuda.jiterator import _create_jit_fn

        code = (
            "template <typename T> T wsum4(T a, T b, T c, T d, float wa, float wb, float wc, "
            "float wd) { return T(wa * float(a) + wb * float(b) + wc * float(c) + "
            "wd * float(d)); }"
        )
        return _create_jit_fn(code, wa=1.0, wb=1.0, wc=1.0, wd=1.0)  # type: ignore[no-any-return]
    except Exception:  # private API: absent or changed
        return None


def row(dtype: torch.dtype, n: int, repeats: int, fused: Any) -> dict[str, Any]:
    """One dtype's entries, each checked against float64 then timed."""
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(0)
    xs = [torch.randn(n, generator=g, device=dev).to(dtype) for _ in range(K)]
    out = torch.empty_like(xs[0])
    size = xs[0].element_size()
    want = WEIGHTS[0] * xs[0].double()
    for w, x in zip(WEIGHTS[1:], xs[1:]):
        want += w * x.double()
    tol = 1e-5 if dtype == torch.float32 else 1e-2

    def chain() -> torch.Tensor:
        torch.mul(xs[0], WEIGHTS[0], out=out)
        for w, x in zip(WEIGHTS[1:], xs[1:]):
            out.add_(x, alpha=w)
        return out

    def foreach() -> torch.Tensor:
        parts = torch._foreach_mul(xs, WEIGHTS)
        return torch.stack(parts).sum(0)

    entries: dict[str, Callable[[], Any]] = {
        "hetcoll.weighted_sum": lambda: hetcoll.weighted_sum(xs, WEIGHTS, out=out),
        # Without out: the fused kernel's own output, no copy into out.
        "hetcoll.weighted_sum, new output": lambda: hetcoll.weighted_sum(xs, WEIGHTS),
        "add_ chain": chain,
        "_foreach_mul + sum": foreach,
    }
    if fused is not None:
        entries["fused (jiterator)"] = lambda: fused(*xs, wa=3.0, wb=5.0, wc=8.0, wd=0.5)
    dst = torch.empty_like(xs[0])
    copy = statistics.median(cuda_seconds(lambda: dst.copy_(xs[0]), repeats))
    ideal = (K + 1) / 2 * copy
    times: dict[str, float] = {}
    errors: dict[str, str] = {}
    for name, fn in entries.items():
        try:
            got = fn()
            err = float((got.double() - want).abs().max() / want.abs().max())
            if err > tol:
                raise AssertionError(f"relative error {err:.2e} > {tol}")
            times[name] = statistics.median(cuda_seconds(fn, repeats))
        except Exception as e:  # a peer that fails is reported, not fatal
            errors[name] = f"{type(e).__name__}: {e}"[:300]
    ours = times.get("hetcoll.weighted_sum")
    return {
        "dtype": str(dtype).replace("torch.", ""),
        "k": K,
        "n": n,
        "copy_s": copy,
        "copy_bytes_per_s": 2 * n * size / copy,
        "ideal_s": ideal,
        "seconds": times,
        "over_ideal": {k: t / ideal for k, t in times.items()},
        "hetcoll_over_peer": {
            k: ours / t
            for k, t in times.items()
            if ours is not None and not k.startswith("hetcoll.")
        },
        "errors": errors,
    }


def run(n: int, repeats: int) -> dict[str, Any]:
    fused = fused_kernel()
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        rows.append(row(dtype, n, repeats, fused))
        torch.cuda.empty_cache()
    return {
        "status": "ok",
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "repeats": repeats,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, help="where to write the results")
    ap.add_argument("--log2n", type=int, default=25, help="elements per tensor: 2^this")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        result: dict[str, Any] = {"status": "skipped: no CUDA"}
    else:
        result = run(1 << args.log2n, args.repeats)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
