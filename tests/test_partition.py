"""Partitioners: exact pipeline stages against brute force, the hypergraph partitioner's balance,
determinism and optimality on tiny instances, bad input, and the seed-002 CNN hypergraph."""

from __future__ import annotations

import itertools
import math
import re
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hetcoll

# ---------------------------------------------------------------- partition_chain


def compositions(n: int, p: int):
    """Every way to give n layers to p devices in order, empty stages allowed."""
    for cuts in itertools.combinations_with_replacement(range(n + 1), p - 1):
        bounds = (0, *cuts, n)
        yield [bounds[i + 1] - bounds[i] for i in range(p)]


def python_stage_times(costs, speeds, layers, boundary_bytes=None, bandwidth=None):
    out, at = [], 0
    for d, count in enumerate(layers):
        end = at + count
        if count == 0:
            out.append(0.0)
        else:
            t = math.fsum(costs[at:end]) / speeds[d]
            if boundary_bytes is not None and end < len(costs):
                t += boundary_bytes[end - 1] / bandwidth
            out.append(t)
        at = end
    return out


chain_case = st.integers(1, 7).flatmap(
    lambda n: st.tuples(
        st.lists(st.floats(0, 100, allow_nan=False), min_size=n, max_size=n),
        st.lists(st.floats(0.1, 10), min_size=1, max_size=4),
        st.one_of(
            st.none(), st.lists(st.floats(0, 1000, allow_nan=False), min_size=n - 1, max_size=n - 1)
        ),
    )
)


@settings(max_examples=150, deadline=None)
@given(chain_case)
def test_chain_is_optimal_against_brute_force(case):
    costs, speeds, boundary = case
    bw = 50.0 if boundary is not None else None
    layers = hetcoll.partition_chain(costs, speeds, boundary_bytes=boundary, bandwidth=bw)
    assert len(layers) == len(speeds) and sum(layers) == len(costs)

    def bottleneck(lay):
        return max(
            hetcoll.chain_stage_times(costs, speeds, lay, boundary_bytes=boundary, bandwidth=bw)
        )

    best = min(bottleneck(c) for c in compositions(len(costs), len(speeds)))
    # Same floating-point formula for both: exact equality, no tolerance.
    assert bottleneck(layers) == best
    # And the formula is the documented one.
    assert hetcoll.chain_stage_times(
        costs, speeds, layers, boundary_bytes=boundary, bandwidth=bw
    ) == pytest.approx(
        python_stage_times(costs, speeds, layers, boundary, bw), rel=1e-12, abs=1e-12
    )


def test_chain_examples():
    assert hetcoll.partition_chain([1.0] * 8, [3.0, 1.0]) == [6, 2]
    # More devices than layers: some get none.
    assert hetcoll.partition_chain([1.0, 1.0], [1.0, 1.0, 1.0]) == [1, 1, 0]
    # A cut after layer 0 would cost 100 s of transfer; the solver cuts after layer 1.
    assert hetcoll.partition_chain(
        [1.0] * 4, [1.0, 1.0], boundary_bytes=[100.0, 0.0, 100.0], bandwidth=1.0
    ) == [2, 2]


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"costs": [], "speeds": [1.0]}, "costs"),
        ({"costs": [1.0, float("nan")], "speeds": [1.0]}, "costs[1]"),
        ({"costs": [1.0, -1.0], "speeds": [1.0]}, "costs[1]"),
        ({"costs": [1.0], "speeds": []}, "speeds"),
        ({"costs": [1.0], "speeds": [0.0]}, "speeds[0]"),
        ({"costs": [1.0, 1.0], "speeds": [1.0], "boundary_bytes": [1.0]}, "bandwidth"),
        ({"costs": [1.0, 1.0], "speeds": [1.0], "bandwidth": 1.0}, "boundary_bytes"),
        (
            {"costs": [1.0, 1.0], "speeds": [1.0], "boundary_bytes": [1.0, 2.0], "bandwidth": 1.0},
            "boundary_bytes",
        ),
        (
            {"costs": [1.0, 1.0], "speeds": [1.0], "boundary_bytes": [1.0], "bandwidth": -1},
            "bandwidth",
        ),
        ({"costs": "abc", "speeds": [1.0]}, "costs"),
    ],
)
def test_chain_bad_input_names_the_argument(kwargs, argument):
    costs, speeds = kwargs.pop("costs"), kwargs.pop("speeds")
    with pytest.raises(ValueError, match="^" + re.escape(argument) + ":"):
        hetcoll.partition_chain(costs, speeds, **kwargs)


memory_chain_case = st.integers(1, 6).flatmap(
    lambda n: st.tuples(
        st.lists(st.floats(0, 100, allow_nan=False), min_size=n, max_size=n),
        st.lists(st.floats(0.1, 10), min_size=1, max_size=4),
        st.lists(st.integers(0, 9).map(float), min_size=n, max_size=n),
        st.lists(st.integers(0, 20).map(float), min_size=4, max_size=4),
    )
)


@settings(max_examples=200, deadline=None)
@given(memory_chain_case)
def test_chain_within_memory_against_brute_force(case):
    """With memory limits the stages fit and the bottleneck is the brute-force optimum among the
    placements that fit; when none fits the error says so (and the oracle agrees)."""
    costs, speeds, memory, capacity = case
    capacity = capacity[: len(speeds)]

    def fits(lay):
        at = 0
        for count, cap in zip(lay, capacity, strict=True):
            if math.fsum(memory[at : at + count]) > cap:
                return False
            at += count
        return True

    def bottleneck(lay):
        return max(hetcoll.chain_stage_times(costs, speeds, lay))

    fitting = [c for c in compositions(len(costs), len(speeds)) if fits(c)]
    if not fitting:
        with pytest.raises(ValueError, match=r"^capacity: infeasible"):
            hetcoll.partition_chain(costs, speeds, memory=memory, capacity=capacity)
        return
    layers = hetcoll.partition_chain(costs, speeds, memory=memory, capacity=capacity)
    assert sum(layers) == len(costs) and fits(layers)
    assert bottleneck(layers) == min(bottleneck(c) for c in fitting)


def test_chain_memory_moves_layers_off_a_full_device():
    # The fast device would take 6 of 8 layers but holds only 4 layers' bytes.
    assert hetcoll.partition_chain(
        [1.0] * 8, [3.0, 1.0], memory=[1e9] * 8, capacity=[4e9, 8e9]
    ) == [
        4,
        4,
    ]


@pytest.mark.parametrize(
    ("memory", "capacity", "message"),
    [
        # Total need against total capacity.
        ([2e9, 2e9, 2e9], [3e9, 2.5e9], "the layers need 6000000000 in all, the devices hold"),
        # One layer larger than every device.
        ([1.0, 5.0, 1.0], [4.0, 4.0], "layer 1 needs 5, more than any device holds"),
        # Enough in total, but not in whole layers in order.
        ([2.0, 2.0, 2.0], [3.0, 3.0], "hold at most layers 0..2; layers 2..3 need 2 more"),
    ],
)
def test_chain_memory_infeasible_says_by_how_much(memory, capacity, message):
    with pytest.raises(ValueError, match=r"^capacity: infeasible") as err:
        hetcoll.partition_chain([1.0] * 3, [1.0, 1.0], memory=memory, capacity=capacity)
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"memory": [1.0, 1.0]}, "capacity"),
        ({"capacity": [1.0]}, "memory"),
        ({"memory": [1.0], "capacity": [5.0]}, "memory"),
        ({"memory": [1.0, 1.0], "capacity": [5.0, 5.0]}, "capacity"),
        ({"memory": [1.0, float("nan")], "capacity": [5.0]}, "memory[1]"),
        ({"memory": [1.0, 1.0], "capacity": [-5.0]}, "capacity[0]"),
    ],
)
def test_chain_memory_bad_input_names_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match="^" + re.escape(argument) + ":"):
        hetcoll.partition_chain([1.0, 1.0], [1.0], **kwargs)


# ---------------------------------------------------------------- partition_items


def items_time(loads, speeds, owner):
    """The slowest device's load over its speed (inf where a device of speed 0 holds load)."""
    work = [0.0] * len(speeds)
    for i, d in enumerate(owner):
        work[d] += loads[i]
    return max((w / s if s > 0 else math.inf) if w > 0 else 0.0 for w, s in zip(work, speeds))


def items_brute_force(loads, speeds, capacity=None):
    best = math.inf
    for owner in itertools.product(range(len(speeds)), repeat=len(loads)):
        if capacity is None or all(owner.count(d) <= c for d, c in enumerate(capacity)):
            best = min(best, items_time(loads, speeds, owner))
    return best


@settings(max_examples=150, deadline=None)
@given(
    loads=st.lists(st.one_of(st.just(0.0), st.floats(0.0, 50.0)), min_size=1, max_size=7),
    speeds=st.lists(st.one_of(st.just(1.0), st.floats(0.05, 4.0)), min_size=1, max_size=3),
    capacity=st.none() | st.lists(st.integers(0, 5), min_size=3, max_size=3),
)
def test_items_are_optimal_against_brute_force(loads, speeds, capacity):
    """Any items on any device: the slowest device's time is brute force's best, within each
    device's capacity, proved (the flag), and the same on a second call (deterministic)."""
    capacity = None if capacity is None else capacity[: len(speeds)]
    best = items_brute_force(loads, speeds, capacity)
    if math.isinf(best):
        with pytest.raises(ValueError, match=r"^(capacity|speeds):"):
            hetcoll.partition_items(loads, speeds, capacity=capacity)
        return
    owner, exact = hetcoll.partition_items(loads, speeds, capacity=capacity)
    assert exact and len(owner) == len(loads)
    assert items_time(loads, speeds, owner) <= best * (1 + 1e-9)
    if capacity is not None:
        assert all(owner.count(d) <= c for d, c in enumerate(capacity))
    assert hetcoll.partition_items(loads, speeds, capacity=capacity) == (owner, exact)


@settings(max_examples=100, deadline=None)
@given(
    loads=st.lists(st.floats(0.0, 50.0), min_size=1, max_size=7),
    speeds=st.lists(st.one_of(st.just(1.0), st.floats(0.05, 4.0)), min_size=1, max_size=3),
    gap=st.one_of(st.just(0.0), st.floats(0.0, 0.3)),
)
def test_items_within_a_gap_of_brute_force(loads, speeds, gap):
    """With ``gap``, the answer is proved within that fraction of brute force's best."""
    owner, exact = hetcoll.partition_items(loads, speeds, gap=gap)
    assert exact
    assert items_time(loads, speeds, owner) <= items_brute_force(loads, speeds, None) * (
        1 + gap
    ) * (1 + 1e-9)


def test_a_gap_ends_a_search_that_would_spend_its_budget():
    """64 skewed loads on 8 ranks: unproved in the whole budget, proved at once within 1%."""
    speeds = [1.0, 0.8, 0.6, 0.5, 0.5, 0.3, 0.2, 0.1]
    loads = np.random.default_rng(64).lognormal(0.0, 1.0, 64).tolist()
    lower = max(sum(loads) / sum(speeds), max(loads) / max(speeds))
    _, exact = hetcoll.partition_items(loads, speeds, max_nodes=20_000)
    owner, near = hetcoll.partition_items(loads, speeds, max_nodes=20_000, gap=0.01)
    assert not exact and near
    assert items_time(loads, speeds, owner) <= 1.01 * lower


def test_items_part_hot_items_and_beat_every_contiguous_cut():
    """Two hot items side by side go to different devices, which no cut into runs can do; a
    spent budget returns the greedy bound or better, unproved."""
    loads = [9.0, 9.0, 1.0, 1.0]
    owner, exact = hetcoll.partition_items(loads, [1.0, 1.0])
    assert exact and owner[0] != owner[1] and items_time(loads, [1.0, 1.0], owner) == 10.0
    runs = hetcoll.partition_chain(loads, [1.0, 1.0])
    assert python_stage_times(loads, [1.0, 1.0], runs) == [9.0, 11.0]
    rng = np.random.default_rng(0)
    many = rng.uniform(1.0, 10.0, 64).tolist()
    speeds = [1.0, 0.7, 0.5, 0.5, 0.3, 0.2, 0.2, 0.1]
    owner, exact = hetcoll.partition_items(many, speeds, max_nodes=1)
    assert not exact
    lower = max(sum(many) / sum(speeds), max(many) / max(speeds))
    greedy = items_time(many, speeds, owner)
    assert greedy <= 1.05 * lower
    owner, _ = hetcoll.partition_items(many, speeds)  # the default budget searches further
    assert items_time(many, speeds, owner) <= min(greedy, 1.005 * lower)


@pytest.mark.parametrize(
    ("args", "kwargs", "argument"),
    [
        (([], [1.0]), {}, "loads"),
        (([1.0, float("nan")], [1.0]), {}, "loads[1]"),
        (([1.0], []), {}, "speeds"),
        (([1.0], [-1.0]), {}, "speeds[0]"),
        (([1.0], [1.0]), {"capacity": [1, 1]}, "capacity"),
        (([1.0], [1.0]), {"capacity": [-1]}, "capacity[0]"),
        (([1.0, 1.0], [1.0, 1.0]), {"capacity": [1, 0]}, "capacity"),
        (([1.0, 1.0], [1.0, 0.0]), {"capacity": [1, 5]}, "speeds"),
        (([1.0], [1.0]), {"max_nodes": 0}, "max_nodes"),
        (([1.0], [1.0]), {"max_nodes": 1.5}, "max_nodes"),
        (([1.0], [1.0]), {"gap": -0.5}, "gap"),
        (([1.0], [1.0]), {"gap": float("nan")}, "gap"),
        (([1.0], [1.0]), {"gap": "small"}, "gap"),
        (("ab", [1.0]), {}, "loads"),
    ],
)
def test_items_bad_input_names_the_argument(args, kwargs, argument):
    with pytest.raises(ValueError, match=rf"^{re.escape(argument)}:"):
        hetcoll.partition_items(*args, **kwargs)


def refine_oracle(loads, speeds, owner, capacity=None):
    """refine_items' rule, step by step in plain Python: every move off the slowest device and
    every swap there for a lighter item, in the order ties are broken (item, device, move
    before swaps, item swapped back); the first that leaves the pair lowest, below the
    slowest device's time."""

    def finish(w, s):
        return 0.0 if w <= 0 else (w / s if s > 0 else math.inf)

    owner = list(owner)
    p = len(speeds)
    room = capacity or [math.inf] * p
    for _ in range(2 * len(loads) + 2):
        work = [sum(w for w, o in zip(loads, owner, strict=True) if o == d) for d in range(p)]
        times = [finish(work[d], speeds[d]) for d in range(p)]
        r = times.index(max(times))
        worst = times[r]
        if worst <= 0:
            break
        best = None
        for e in (i for i in range(len(loads)) if owner[i] == r):
            for q in (q for q in range(p) if q != r):
                steps = [None] if owner.count(q) < room[q] else []
                steps += [f for f in range(len(loads)) if owner[f] == q and loads[f] < loads[e]]
                for f in steps:
                    back = 0.0 if f is None else loads[f]
                    pair = max(
                        finish(work[r] - loads[e] + back, speeds[r]),
                        finish(work[q] - back + loads[e], speeds[q]),
                    )
                    if pair < worst and (best is None or pair < best[0]):
                        best = (pair, e, q, f)
        if best is None:
            break
        _, e, q, f = best
        owner[e] = q
        if f is not None:
            owner[f] = r
    return owner


@settings(max_examples=200, deadline=None)
@given(
    loads=st.lists(st.one_of(st.just(0.0), st.integers(1, 9).map(float)), min_size=1, max_size=9),
    speeds=st.lists(st.sampled_from([1.0, 0.5, 0.25, 2.0, 0.0]), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
    limited=st.booleans(),
)
def test_refine_items_follows_its_rule_step_by_step(loads, speeds, seed, limited):
    """The Rust local search takes exactly the steps its rule names (a plain Python oracle),
    so every rank refining one placement gets the same; never slower than where it started.
    (Loads and speeds are exact in binary: the oracle sums them in another order.)"""
    rng = np.random.default_rng(seed)
    owner = [int(d) for d in rng.integers(0, len(speeds), len(loads))]
    capacity = None
    if limited:
        capacity = [owner.count(d) + int(rng.integers(0, 2)) for d in range(len(speeds))]
    got = hetcoll.refine_items(loads, speeds, owner, capacity=capacity)
    assert got == refine_oracle(loads, speeds, owner, capacity)
    assert items_time(loads, speeds, got) <= items_time(loads, speeds, owner)


@pytest.mark.parametrize(
    ("args", "kwargs", "argument"),
    [
        (([], [1.0], []), {}, "loads"),
        (([float("inf")], [1.0], [0]), {}, "loads[0]"),
        (([1.0], [], [0]), {}, "speeds"),
        (([1.0], [-2.0], [0]), {}, "speeds[0]"),
        (([1.0, 1.0], [1.0], [0]), {}, "owner"),
        (([1.0], [1.0], [1]), {}, "owner[0]"),
        (([1.0], [1.0], [-1]), {}, "owner[0]"),
        (([1.0], [1.0], [0.5]), {}, "owner[0]"),
        (([1.0], [1.0], [0]), {"capacity": [1, 1]}, "capacity"),
        (([1.0], [1.0], [0]), {"capacity": [-1]}, "capacity[0]"),
    ],
)
def test_refine_items_bad_input_names_the_argument(args, kwargs, argument):
    with pytest.raises(ValueError, match=rf"^{re.escape(argument)}:"):
        hetcoll.refine_items(*args, **kwargs)


# ---------------------------------------------------------------- partition_hypergraph / km1


def python_km1(nets, parts, weights=None):
    return sum(
        (1.0 if weights is None else weights[e]) * (len({int(parts[v]) for v in net}) - 1)
        for e, net in enumerate(nets)
    )


def caps(vw, targets, eps):
    total = float(np.sum(vw))
    return [(1 + eps) * t * total for t in targets]


def is_balanced(parts, vw, targets, eps):
    w = np.bincount(parts, weights=vw, minlength=len(targets))
    return all(w[b] <= c for b, c in enumerate(caps(vw, targets, eps)))


def brute_force(n, nets, vw, nw, targets, eps):
    k, best = len(targets), math.inf
    for assignment in itertools.product(range(k), repeat=n):
        parts = np.array(assignment)
        if is_balanced(parts, vw, targets, eps):
            best = min(best, python_km1(nets, parts, nw))
    return best


tiny = st.integers(4, 8).flatmap(
    lambda n: st.tuples(
        st.just(n),
        st.lists(
            st.lists(st.integers(0, n - 1), min_size=2, max_size=4, unique=True),
            min_size=1,
            max_size=10,
        ),
        st.lists(st.integers(1, 3), min_size=n, max_size=n),
        st.integers(2, 3),
        st.integers(0, 2),
        st.integers(0, 3),
    )
)


@settings(max_examples=80, deadline=None)
@given(tiny)
def test_hypergraph_balanced_deterministic_and_bounded_by_brute_force(case):
    n, nets, vw, k, skew, seed = case
    nw = [1.0 + (e % 3) for e in range(len(nets))]
    shares = [1.0 + skew if b == 0 else 1.0 for b in range(k)]
    targets = [s / sum(shares) for s in shares]
    eps = 0.2
    optimum = brute_force(n, nets, np.array(vw, float), nw, targets, eps)
    kwargs = {"vertex_weights": vw, "net_weights": nw, "epsilon": eps, "seed": seed}
    if math.isinf(optimum):
        with pytest.raises(ValueError):
            hetcoll.partition_hypergraph(n, nets, targets, **kwargs)
        return
    parts = hetcoll.partition_hypergraph(n, nets, targets, **kwargs)
    assert parts.dtype == np.int64 and parts.shape == (n,)
    assert is_balanced(parts, np.array(vw, float), targets, eps)
    assert np.array_equal(parts, hetcoll.partition_hypergraph(n, nets, targets, **kwargs))
    got = hetcoll.km1(nets, parts, nw)
    assert got == python_km1(nets, parts, nw)
    assert got >= optimum


def test_hypergraph_finds_the_optimum_on_most_tiny_instances():
    rng = np.random.default_rng(3)
    optimal = total = 0
    for _ in range(60):
        n, m = int(rng.integers(5, 8)), int(rng.integers(3, 10))
        nets = [
            rng.choice(n, size=int(rng.integers(2, 4)), replace=False).tolist() for _ in range(m)
        ]
        vw = rng.integers(1, 3, size=n).astype(float)
        targets = [0.5, 0.25, 0.25] if rng.random() < 0.5 else [0.5, 0.5]
        best = brute_force(n, nets, vw, None, targets, 0.25)
        if math.isinf(best):
            continue
        parts = hetcoll.partition_hypergraph(n, nets, targets, vertex_weights=vw, epsilon=0.25)
        total += 1
        optimal += hetcoll.km1(nets, parts) == best
    assert total >= 40
    assert optimal >= 0.75 * total, f"optimal on {optimal}/{total}"


def test_hypergraph_separates_two_communities_with_unequal_targets():
    # A 6-clique-ish community and a 3-vertex one, joined by one net: targets 2/3 and 1/3.
    big = [[a, b] for a in range(6) for b in range(a + 1, 6)]
    small = [[6, 7], [7, 8], [6, 8]]
    parts = hetcoll.partition_hypergraph(9, [*big, *small, [5, 6]], [2 / 3, 1 / 3], epsilon=0.0)
    assert hetcoll.km1([*big, *small, [5, 6]], parts) == 1.0
    assert len(set(parts[:6].tolist())) == 1 and len(set(parts[6:].tolist())) == 1


def test_hypergraph_on_a_grid_is_balanced_for_every_k_and_target_mix():
    side = 30
    nets = [[r * side + c, r * side + c + 1] for r in range(side) for c in range(side - 1)]
    nets += [[r * side + c, (r + 1) * side + c] for r in range(side - 1) for c in range(side)]
    n = side * side
    for k in (2, 3, 4, 8):
        for targets in ([1 / k] * k, [s / sum(range(1, k + 1)) for s in range(1, k + 1)]):
            parts = hetcoll.partition_hypergraph(n, nets, targets, epsilon=0.03, seed=1)
            assert is_balanced(parts, np.ones(n), targets, 0.03)
            # A grid has cuts of about side * (blocks boundary); a random split cuts ~all edges.
            assert hetcoll.km1(nets, parts) < 0.25 * len(nets)


def test_hypergraph_releases_the_gil():
    side = 120
    nets = [[r * side + c, r * side + c + 1] for r in range(side) for c in range(side - 1)]
    nets += [[r * side + c, (r + 1) * side + c] for r in range(side - 1) for c in range(side)]
    done = threading.Event()
    ticks = 0

    def work():
        hetcoll.partition_hypergraph(side * side, nets, [0.25] * 4)
        done.set()

    thread = threading.Thread(target=work)
    thread.start()
    start = time.perf_counter()
    while not done.is_set():
        ticks += 1
        time.sleep(0.001)
    thread.join()
    elapsed = time.perf_counter() - start
    # Python kept running while Rust worked: at least a tick per 10 ms of the call.
    assert elapsed > 0 and ticks >= elapsed / 0.01 * 0.5


@pytest.mark.parametrize(
    ("args", "kwargs", "argument"),
    [
        ((3, [[0, 3]], [0.5, 0.5]), {}, r"nets\[0\]"),
        ((3, [[0, -1]], [0.5, 0.5]), {}, r"nets\[0\]"),
        ((3, [[0, 1], []], [0.5, 0.5]), {}, r"nets\[1\]"),
        ((3, [[1, 1]], [0.5, 0.5]), {}, r"nets\[0\]"),
        ((3, [[0, 1.5]], [0.5, 0.5]), {}, r"nets\[0\]"),
        ((3, 5, [0.5, 0.5]), {}, "nets"),
        (
            (3, [[0, 1]], [0.5, 0.5]),
            {"vertex_weights": [1, float("nan"), 1]},
            r"vertex_weights\[1\]",
        ),
        ((3, [[0, 1]], [0.5, 0.5]), {"vertex_weights": [1, 1]}, "vertex_weights"),
        ((3, [[0, 1]], [0.5, 0.5]), {"net_weights": [-1.0]}, r"net_weights\[0\]"),
        ((3, [[0, 1]], [0.5, 0.5]), {"net_weights": [1.0, 1.0]}, "net_weights"),
        ((3, [[0, 1]], [0.5, 0.6]), {}, "targets"),
        ((3, [[0, 1]], [1.0, 0.0]), {}, r"targets\[1\]"),
        ((3, [[0, 1]], []), {}, "targets"),
        ((3, [[0, 1]], [0.25] * 4), {}, "targets"),
        ((3, [[0, 1]], [0.5, 0.5]), {"epsilon": -0.1}, "epsilon"),
        ((3, [[0, 1]], [0.5, 0.5]), {"epsilon": float("nan")}, "epsilon"),
        ((-1, [[0, 1]], [0.5, 0.5]), {}, "num_vertices"),
        ((3, [[0, 1]], [0.5, 0.5]), {"seed": -1}, "seed"),
        # No balanced partition: one vertex outweighs the larger block, or no slack at all.
        ((3, [[0, 1]], [0.5, 0.5]), {"vertex_weights": [10, 1, 1]}, "vertex_weights"),
        ((3, [[0, 1]], [0.5, 0.5]), {"epsilon": 0.0}, "targets"),
        ((0, [[0, 1]], [0.5, 0.5]), {}, r"nets\[0\]"),
        ((3, [[0, 1]], [True, 0.5]), {}, r"targets\[0\]"),
    ],
)
def test_hypergraph_bad_input_names_the_argument(args, kwargs, argument):
    with pytest.raises(ValueError, match=rf"^{argument}:"):
        hetcoll.partition_hypergraph(*args, **kwargs)


def test_a_vertex_out_of_range_names_the_count_and_a_bool_is_no_number():
    with pytest.raises(ValueError, match=r"^nets\[0\]: vertex id 0 .*\(num_vertices is 0\)"):
        hetcoll.partition_hypergraph(0, [[0, 1]], [0.5, 0.5])
    with pytest.raises(ValueError, match=r"^targets\[0\]: must be a number, got True"):
        hetcoll.partition_hypergraph(3, [[0, 1]], [True, 0.5])


def test_km1_against_python_and_bad_input():
    rng = np.random.default_rng(0)
    nets = [rng.choice(50, size=int(rng.integers(2, 6)), replace=False) for _ in range(40)]
    parts = rng.integers(0, 4, size=50)
    w = rng.random(40)
    assert hetcoll.km1(nets, parts, w) == pytest.approx(python_km1(nets, parts, w), rel=1e-12)
    assert hetcoll.km1([[0, 1, 2]], [0, 1, 1]) == 1.0
    with pytest.raises(ValueError, match=r"^nets\[0\]: .*parts has 2 entries, one per vertex"):
        hetcoll.km1([[0, 5]], [0, 1])
    with pytest.raises(ValueError, match=r"^net_weights:"):
        hetcoll.km1([[0, 1]], [0, 1], [1.0, 2.0])
    with pytest.raises(ValueError, match=r"^parts\[0\]"):
        hetcoll.km1([[0, 1]], [-1, 1])


# ---------------------------------------------------------------- the seed-002 CNN hypergraph

torch = pytest.importorskip("torch")


def small_cnn():
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, groups=2),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(16 * 6 * 6, 10),
    )


def test_network_hypergraph_counts_flops_and_bytes():
    from hetcoll.model import network_hypergraph

    h = network_hypergraph(small_cnn(), (3, 16, 16))
    assert h.num_vertices == 8 + 16 + 10
    assert [(c) for _, _, c in h.layers] == [8, 16, 10]
    # FLOPs per sample: conv1 filter 2*3*9*16*16, conv2 (2 groups) 2*4*9*6*6, neuron 2*576.
    assert h.vertex_weights[:8].tolist() == [2 * 3 * 9 * 256] * 8
    assert h.vertex_weights[8:24].tolist() == [2 * 4 * 9 * 36] * 16
    assert h.vertex_weights[24:].tolist() == [2 * 576] * 10
    # Nets: conv1's 8 maps (pooled to 8x8) go to the 8 filters of their group; conv2's 16 maps
    # (6x6) go to all 10 neurons. The input is everywhere and has no net.
    assert len(h.nets) == 8 + 16
    assert sorted(h.nets[0].tolist()) == [0, *range(8, 16)]
    assert sorted(h.nets[5].tolist()) == [5, *range(16, 24)]
    assert h.net_weights[:8].tolist() == [64 * 4] * 8
    assert h.net_weights[8:].tolist() == [36 * 4] * 16
    assert h.parameter_bytes == 4 * sum(p.numel() for p in small_cnn().parameters())


def test_partition_report_volumes_follow_the_model():
    from hetcoll.model import partition_report

    speeds, batch = [3.0, 1.0], 16
    report = partition_report(small_cnn(), (3, 16, 16), speeds, batch_size=batch)
    by_name = {s.name: s for s in report.strategies}
    # Even split: conv1's filters 0-3 feed group 0 of conv2 (filters 0-7), which stays on device 0,
    # so conv1's maps never cross; conv2's 16 maps (6x6 floats) go to neurons on both devices.
    even = by_name["even filter split"]
    assert even.bytes_per_step == 2 * batch * 16 * 36 * 4
    assert by_name["speed-proportional split"].imbalance < even.imbalance
    dp = by_name["data parallel"]
    params = sum(p.numel() for p in small_cnn().parameters())
    assert dp.bytes_per_step == 2 * (2 - 1) * 4 * params
    hyper = by_name["hypergraph partition"]
    assert hyper.bytes_per_step <= even.bytes_per_step
    assert hyper.imbalance <= 1.03 + 1e-9  # each block within (1 + epsilon) of its target
    assert "hypergraph partition" in report.table()


def test_network_hypergraph_rejects_what_it_cannot_model():
    from hetcoll.model import network_hypergraph

    class Residual(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Conv2d(3, 4, 3, padding=1)
            self.b = torch.nn.Conv2d(4, 4, 3, padding=1)
            self.c = torch.nn.Conv2d(8, 4, 1)

        def forward(self, x):
            y = self.a(x)
            return self.c(torch.cat([y, self.b(y)], dim=1))

    with pytest.raises(ValueError, match=r"^model:"):
        network_hypergraph(Residual(), (3, 8, 8))
    with pytest.raises(ValueError, match=r"^input_shape:"):
        network_hypergraph(small_cnn(), (3, 0, 16))
    with pytest.raises(ValueError, match=r"^input_shape:"):
        network_hypergraph(small_cnn(), (5, 16, 16))
    with pytest.raises(ValueError, match=r"^model:"):
        network_hypergraph(torch.nn.Sequential(torch.nn.ReLU()), (3, 4, 4))


def test_network_hypergraph_reads_a_float64_model():
    """It fed float32 zeros to every model, so a float64 model failed and the error blamed
    input_shape (issue 26)."""
    from hetcoll.model import network_hypergraph

    net = small_cnn()
    expected = network_hypergraph(net, (3, 16, 16))
    h = network_hypergraph(net.double(), (3, 16, 16))
    assert h.num_vertices == expected.num_vertices
    assert np.array_equal(h.vertex_weights, expected.vertex_weights)
    mixed = small_cnn()
    mixed[0].double()
    with pytest.raises(ValueError, match=r"^model: parameters and buffers mix"):
        network_hypergraph(mixed, (3, 16, 16))
    with pytest.raises(ValueError, match=r"^input_shape"):
        network_hypergraph(net, (4, 16, 16))


# ---------------------------------------------------------------- memory capacity of blocks


def grid_nets(rows: int, cols: int) -> list[list[int]]:
    nets = []
    for r in range(rows):
        for c in range(cols):
            if c + 1 < cols:
                nets.append([r * cols + c, r * cols + c + 1])
            if r + 1 < rows:
                nets.append([r * cols + c, (r + 1) * cols + c])
    return nets


@pytest.mark.parametrize("k", [2, 4])
def test_hypergraph_memory_capacity_is_respected(k):
    """A 24x48 grid whose left half needs 3x the memory: the cheapest balanced cuts hold too much
    memory in some block; with capacities every block fits, balance holds, same result twice."""
    rows, cols = 24, 48
    n = rows * cols
    memory = np.array([3.0 if v % cols < cols // 2 else 1.0 for v in range(n)])
    nets = grid_nets(rows, cols)
    targets = [1 / k] * k
    capacity = [memory.sum() / k * 1.03] * k
    free = hetcoll.partition_hypergraph(n, nets, targets, seed=3)
    assert np.any(np.bincount(free, weights=memory, minlength=k) > capacity)
    parts = hetcoll.partition_hypergraph(
        n, nets, targets, vertex_memory=memory, capacity=capacity, seed=3
    )
    used = np.bincount(parts, weights=memory, minlength=k)
    assert np.all(used <= capacity), used
    weights = np.bincount(parts, minlength=k)
    assert np.all(weights <= 1.03 * n / k), weights
    again = hetcoll.partition_hypergraph(
        n, nets, targets, vertex_memory=memory, capacity=capacity, seed=3
    )
    assert np.array_equal(parts, again)


@pytest.mark.parametrize(
    ("memory", "capacity", "k", "message"),
    [
        ([3.0, 1.0, 1.0, 1.0], [3.0, 2.5], 2, "the vertices need 6 in all, the blocks hold 5.5"),
        ([3.0, 1.0, 1.0, 1.0], [2.5, 2.5, 2.5], 3, "vertex 0 needs 3, more than any block"),
    ],
)
def test_hypergraph_memory_infeasible_says_by_how_much(memory, capacity, k, message):
    with pytest.raises(ValueError, match=r"^capacity: infeasible") as err:
        hetcoll.partition_hypergraph(
            4, [[0, 1], [2, 3], [1, 2]], [1 / k] * k, vertex_memory=memory, capacity=capacity
        )
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"vertex_memory": [1.0] * 4}, "capacity"),
        ({"capacity": [4.0, 4.0]}, "vertex_memory"),
        ({"vertex_memory": [1.0] * 3, "capacity": [4.0, 4.0]}, "vertex_memory"),
        ({"vertex_memory": [1.0, -1.0, 1.0, 1.0], "capacity": [4.0, 4.0]}, "vertex_memory[1]"),
        ({"vertex_memory": [1.0] * 4, "capacity": [4.0]}, "capacity"),
        ({"vertex_memory": [1.0] * 4, "capacity": [4.0, float("inf")]}, "capacity[1]"),
    ],
)
def test_hypergraph_memory_bad_input_names_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match="^" + re.escape(argument) + ":"):
        hetcoll.partition_hypergraph(4, [[0, 1], [2, 3], [1, 2]], [0.5, 0.5], **kwargs)
