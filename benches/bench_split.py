"""hetcoll.split at cluster scale vs a straightforward Python heap greedy (one unit at a time,
the textbook exact method), both on 10,000 ranks and a total of 10^7, in the same run.

    make bench-split      # writes benches/results/split.json

Lab code, like everything in benches/: it imports the library, the library never imports it.
"""

from __future__ import annotations

import heapq
import random

import hetcoll

P, TOTAL = 10_000, 10**7
GROUP = f"split p={P} total=10^7"


def instance():
    rng = random.Random(0)
    return [rng.uniform(0.5, 20.0) for _ in range(P)], [rng.uniform(0, 0.01) for _ in range(P)]


def python_heap_greedy(total, speeds, latency):
    shares = [0] * len(speeds)
    heap = [(a + 1 / s, i) for i, (a, s) in enumerate(zip(latency, speeds))]
    heapq.heapify(heap)
    for _ in range(total):
        _, i = heapq.heappop(heap)
        shares[i] += 1
        heapq.heappush(heap, (latency[i] + (shares[i] + 1) / speeds[i], i))
    return shares


def test_hetcoll_split(benchmark, record):
    speeds, latency = instance()
    shares = benchmark.pedantic(
        hetcoll.split, args=(TOTAL, speeds), kwargs={"latency": latency}, rounds=30
    )
    record(benchmark, GROUP, "hetcoll.split (Rust, exact)", headline=True)
    assert sum(shares) == TOTAL


def test_python_heap_greedy(benchmark, record):
    speeds, latency = instance()
    shares = benchmark.pedantic(python_heap_greedy, args=(TOTAL, speeds, latency), rounds=1)
    record(benchmark, GROUP, "Python heap greedy (exact, O(B log p))", peer=True)
    assert shares == hetcoll.split(TOTAL, speeds, latency=latency)
