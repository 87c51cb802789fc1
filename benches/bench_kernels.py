"""hetcoll.weighted_sum vs the ways PyTorch and numpy users combine K buffers today.

K = 4 buffers of 2^25 float32 (128 MiB each), one run, the same thread count for every
multi-threaded entry (HETCOLL_NUM_THREADS and torch.set_num_threads both = all cores). Effective
bandwidth counts the minimum traffic, (K+1)*N*4 bytes; the memcpy of one buffer moves 2*N*4.

    make bench-kernels    # writes benches/results/kernels.json

Lab code, like everything in benches/: it imports the library, the library never imports it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import hetcoll

K, N = 4, 1 << 25
THREADS = os.cpu_count() or 1
GROUP = f"weighted_sum K={K} N=2^25 float32, {THREADS} threads"
ROUNDS = dict(rounds=15, iterations=1, warmup_rounds=2)


@pytest.fixture(scope="module")
def buffers():
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(N, dtype=np.float32) for _ in range(K)]
    weights = [3.0, 5.0, 8.0, 0.5]
    out = np.zeros(N, np.float32)
    return arrays, weights, out


@pytest.fixture(autouse=True)
def same_threads(monkeypatch):
    monkeypatch.setenv("HETCOLL_NUM_THREADS", str(THREADS))
    torch.set_num_threads(THREADS)


def test_hetcoll(benchmark, record, buffers):
    arrays, weights, out = buffers
    benchmark.pedantic(hetcoll.weighted_sum, args=(arrays, weights), kwargs={"out": out}, **ROUNDS)
    record(benchmark, GROUP, "hetcoll.weighted_sum", bytes_moved=(K + 1) * N * 4, headline=True)
    expected = sum(np.float32(w) * a for w, a in zip(weights, arrays))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_numpy_expression(benchmark, record, buffers):
    arrays, weights, out = buffers

    def run():
        np.multiply(arrays[0], np.float32(weights[0]), out=out)
        for w, a in zip(weights[1:], arrays[1:]):
            out.__iadd__(np.float32(w) * a)

    benchmark.pedantic(run, **ROUNDS)
    record(benchmark, GROUP, "numpy out=w0*a0; out += wi*ai", bytes_moved=(K + 1) * N * 4)


def test_torch_mul_add_chain(benchmark, record, buffers):
    arrays, weights, out = buffers
    ts = [torch.from_numpy(a) for a in arrays]
    o = torch.from_numpy(out)

    def run():
        torch.mul(ts[0], weights[0], out=o)
        for w, t in zip(weights[1:], ts[1:]):
            o.add_(t, alpha=w)

    benchmark.pedantic(run, **ROUNDS)
    # The peer: how a PyTorch user combines weighted buffers today.
    record(
        benchmark, GROUP, "torch mul + add_(alpha=) chain", peer=True, bytes_moved=(K + 1) * N * 4
    )


def test_torch_mv_stacked(benchmark, record, buffers):
    arrays, weights, out = buffers
    stacked = torch.from_numpy(np.stack(arrays))  # [K, N], stacked once outside the timing
    w = torch.tensor(weights, dtype=torch.float32)
    o = torch.from_numpy(out)
    benchmark.pedantic(lambda: torch.mv(stacked.T, w, out=o), **ROUNDS)
    record(benchmark, GROUP, "torch.mv on stacked [K, N]", bytes_moved=(K + 1) * N * 4)


def test_memcpy_one_buffer(benchmark, record, buffers):
    arrays, _, out = buffers
    benchmark.pedantic(np.copyto, args=(out, arrays[0]), **ROUNDS)
    record(
        benchmark,
        GROUP,
        "memcpy of one buffer (numpy copyto)",
        bytes_moved=2 * N * 4,
        note="(bandwidth reference)",
    )
