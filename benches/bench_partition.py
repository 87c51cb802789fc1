"""Partitioners against named peers, in the same run.

- ``hetcoll.partition_chain`` on 10,000 layers x 1,000 devices vs the same probe + bisection
  written with numpy (``searchsorted`` per device, 64 float bisection steps, no transfers).
- ``hetcoll.partition_items`` (any items on any device: the experts of a mixture-of-experts
  layer) on 64 and 256 skewed loads (log-normal, as routed tokens are) over 8 ranks of unequal
  speed vs the greedy schedule written in Python (LPT: heaviest first, each where it finishes
  soonest) and vs the best runs in expert order (``hetcoll.partition_chain``, what placing
  experts in runs gives); each one's slowest rank over the lower bound in the note.
- ``hetcoll.refine_items`` (a placement improved by moves and swaps off its slowest rank: what
  an ``ExpertRebalancer`` weighs beside the best placement) from a random placement of the same
  loads vs the same local search written with numpy (hetcoll's before it moved to Rust, which
  tried swaps on at most 64 items); each one's slowest rank over the lower bound and the items
  moved in the note.
- ``hetcoll.partition_hypergraph`` vs Mt-KaHyPar's default preset (1 thread) on the column-net
  hypergraph of a 10^4 x 10^4 random sparse matrix, k = 4 with heterogeneous targets; km1 of both
  in the note. Skipped when ``mtkahypar`` is not installed (``make bench`` installs it: the
``bench`` dependency group).

    make bench-partition  # writes benches/results/partition.json

The quality table over many instances is ``benches/compare_partitioners.py``.
Lab code, like everything in benches/: it imports the library, the library never imports it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import hetcoll

N, P = 10_000, 1_000
CHAIN = f"partition_chain {N} layers x {P} devices"


def chain_instance():
    rng = np.random.default_rng(0)
    return rng.uniform(1.0, 1000.0, N), rng.uniform(1.0, 100.0, P)


def numpy_probe_bisection(costs: np.ndarray, speeds: np.ndarray) -> list[int]:
    prefix = np.concatenate(([0.0], np.cumsum(costs)))
    n = len(costs)

    def probe(bound: float) -> list[int] | None:
        at, layers = 0, []
        for s in speeds:
            nxt = int(np.searchsorted(prefix, prefix[at] + bound * s, side="right")) - 1
            nxt = max(at, min(n, nxt))
            layers.append(nxt - at)
            at = nxt
        return layers if at == n else None

    lo, hi = 0.0, float(prefix[-1] / speeds.max())
    for _ in range(64):
        mid = (lo + hi) / 2
        if probe(mid) is None:
            lo = mid
        else:
            hi = mid
    layers = probe(hi)
    assert layers is not None  # hi is always feasible: the initial bound covers every layer
    return layers


def bottleneck(costs, speeds, layers):
    return max(hetcoll.chain_stage_times(costs, speeds, layers))


def test_chain_hetcoll(benchmark, record):
    costs, speeds = chain_instance()
    c, s = costs.tolist(), speeds.tolist()
    layers = benchmark.pedantic(hetcoll.partition_chain, args=(c, s), rounds=20)
    record(benchmark, CHAIN, "hetcoll.partition_chain (Rust, exact)", headline=True)
    assert sum(layers) == N


def test_chain_numpy_peer(benchmark, record):
    costs, speeds = chain_instance()
    layers = benchmark.pedantic(numpy_probe_bisection, args=(costs, speeds), rounds=3)
    c, s = costs.tolist(), speeds.tolist()
    exact = bottleneck(c, s, hetcoll.partition_chain(c, s))
    record(
        benchmark,
        CHAIN,
        "numpy probe + bisection",
        peer=True,
        note=f"bottleneck / exact = {bottleneck(c, s, layers) / exact:.9f}",
    )
    assert bottleneck(c, s, layers) >= exact


RANK_SPEEDS = [1.0, 0.8, 0.6, 0.5, 0.5, 0.3, 0.2, 0.1]


def items_instance(n: int) -> list[float]:
    return np.random.default_rng(n).lognormal(0.0, 1.0, n).tolist()


def items_bottleneck(loads: list[float], owner: list[int]) -> float:
    """The slowest rank's load over its speed, over the lower bound (fluid, or the heaviest
    item on the fastest rank)."""
    work = np.zeros(len(RANK_SPEEDS))
    np.add.at(work, owner, loads)
    lower = max(sum(loads) / sum(RANK_SPEEDS), max(loads) / max(RANK_SPEEDS))
    return float((work / np.asarray(RANK_SPEEDS)).max() / lower)


def greedy_items(loads: list[float]) -> list[int]:
    """LPT on uniformly related machines: heaviest first, each on the rank where it ends
    soonest."""
    work = [0.0] * len(RANK_SPEEDS)
    owner = [0] * len(loads)
    for i in sorted(range(len(loads)), key=lambda i: -loads[i]):
        d = min(range(len(work)), key=lambda d: (work[d] + loads[i]) / RANK_SPEEDS[d])
        work[d] += loads[i]
        owner[i] = d
    return owner


def runs_items(loads: list[float]) -> list[int]:
    """The best runs in expert order (what placing experts in runs gives)."""
    layers = hetcoll.partition_chain(loads, RANK_SPEEDS)
    return [d for d, n in enumerate(layers) for _ in range(n)]


@pytest.mark.parametrize("n", [64, 256])
@pytest.mark.parametrize(
    ("name", "solve", "peer"),
    [
        ("hetcoll.partition_items (Rust, branch and bound)", None, False),
        ("greedy LPT (Python)", greedy_items, True),
        ("best runs in expert order (partition_chain)", runs_items, False),
    ],
)
def test_items(benchmark, record, n, name, solve, peer):
    loads = items_instance(n)
    if solve is None:
        owner, exact = benchmark.pedantic(
            hetcoll.partition_items, args=(loads, RANK_SPEEDS), rounds=10
        )
        proved = ", proved optimal" if exact else ""
    else:
        owner, proved = benchmark.pedantic(solve, args=(loads,), rounds=10), ""
    ratio = items_bottleneck(loads, owner)
    group = f"partition_items {n} experts x 8 ranks (log-normal loads)"
    record(benchmark, group, name, peer=peer, note=f"slowest / lower bound = {ratio:.4f}{proved}")
    assert sorted(set(owner)) <= list(range(len(RANK_SPEEDS)))


def numpy_refine(owner: list[int], loads: list[float]) -> list[int]:
    """The local search of ``refine_items`` in numpy: each step moves an item off the slowest
    rank, or swaps it for a lighter one (on at most 64 items), where the pair's larger time
    drops most below the slowest rank's."""
    speed = np.asarray(RANK_SPEEDS)
    load = np.asarray(loads)
    held = [[i for i, d in enumerate(owner) if d == r] for r in range(len(speed))]
    work = np.array([load[h].sum() for h in held])
    for _ in range(2 * len(load) + 2):
        times = work / speed
        r = int(np.argmax(times))
        worst = float(times[r])
        best: tuple[float, int, int, int] | None = None
        for e in held[r]:
            left = (work[r] - load[e]) / speed[r]
            for q in range(len(held)):
                if q == r:
                    continue
                pair = max(left, (work[q] + load[e]) / speed[q])
                if pair < worst and (best is None or pair < best[0]):
                    best = (float(pair), e, q, -1)
                if len(load) > 64 or not held[q]:
                    continue
                lighter = [f for f in held[q] if load[f] < load[e]]
                if not lighter:
                    continue
                f_loads = load[lighter]
                pairs = np.maximum(
                    (work[r] - load[e] + f_loads) / speed[r],
                    (work[q] - f_loads + load[e]) / speed[q],
                )
                k = int(np.argmin(pairs))
                if pairs[k] < worst and (best is None or pairs[k] < best[0]):
                    best = (float(pairs[k]), e, q, lighter[k])
        if best is None:
            break
        _, e, q, f = best
        held[r].remove(e)
        held[q].append(e)
        work[r] -= load[e]
        work[q] += load[e]
        if f >= 0:
            held[q].remove(f)
            held[r].append(f)
            work[q] -= load[f]
            work[r] += load[f]
    out = [0] * len(load)
    for r, h in enumerate(held):
        for i in h:
            out[i] = r
    return out


@pytest.mark.parametrize("n", [64, 256])
@pytest.mark.parametrize(
    ("name", "peer"),
    [("hetcoll.refine_items (Rust)", False), ("the same local search in numpy", True)],
)
def test_refine(benchmark, record, n, name, peer):
    loads = items_instance(n)
    start = np.random.default_rng(n + 1).integers(0, len(RANK_SPEEDS), n).tolist()
    if peer:
        owner = benchmark.pedantic(numpy_refine, args=(start, loads), rounds=5)
    else:
        owner = benchmark.pedantic(
            hetcoll.refine_items, args=(loads, RANK_SPEEDS, start), rounds=20
        )
    moved = sum(a != b for a, b in zip(start, owner, strict=True))
    note = (
        f"slowest / lower bound = {items_bottleneck(loads, owner):.4f} "
        f"(start {items_bottleneck(loads, start):.4f}), {moved} moved"
    )
    group = f"refine_items {n} experts x 8 ranks from a random placement (log-normal loads)"
    record(benchmark, group, name, peer=peer, note=note)
    assert items_bottleneck(loads, owner) <= items_bottleneck(loads, start)


def random_hypergraph(n: int = 10_000, per_row: int = 5):
    import scipy.sparse as sp

    rng = np.random.default_rng(n)
    m = sp.random(n, n, density=per_row / n, format="csc", random_state=rng)
    m = sp.csc_matrix(m + sp.eye(n, format="csc"))
    nets = [m.indices[m.indptr[j] : m.indptr[j + 1]].astype(np.int64) for j in range(n)]
    return n, [e for e in nets if len(e) >= 2]


TARGETS = [0.5, 0.25, 0.125, 0.125]
HYPER = "partition_hypergraph random 10^4, k=4 targets 4:2:1:1"


def test_hypergraph_hetcoll(benchmark, record):
    n, nets = random_hypergraph()
    parts = benchmark.pedantic(hetcoll.partition_hypergraph, args=(n, nets, TARGETS), rounds=3)
    record(
        benchmark,
        HYPER,
        "hetcoll.partition_hypergraph",
        note=f"km1 {hetcoll.km1(nets, parts):.0f}",
        headline=True,
    )
    w = np.bincount(parts, minlength=4)
    assert all(w[b] <= 1.03 * TARGETS[b] * n for b in range(4))


def test_hypergraph_mtkahypar(benchmark, record):
    mtkahypar = pytest.importorskip("mtkahypar")
    n, nets = random_hypergraph()
    mtk = mtkahypar.initialize(1, False)
    ctx = mtk.context_from_preset(mtkahypar.PresetType.DEFAULT)
    ctx.set_partitioning_parameters(4, 0.03, mtkahypar.Objective.KM1)
    ctx.set_individual_target_block_weights([math.floor(1.03 * t * n) for t in TARGETS])
    ctx.logging = False
    mtkahypar.set_seed(0)
    hg = mtk.create_hypergraph(ctx, n, len(nets), [e.tolist() for e in nets])
    phg = benchmark.pedantic(hg.partition, args=(ctx,), rounds=3)
    parts = np.array([phg.block_id(v) for v in range(n)])
    record(
        benchmark,
        HYPER,
        "Mt-KaHyPar default (1 thread)",
        peer=True,
        note=f"km1 {hetcoll.km1(nets, parts):.0f}",
    )
