"""Hostile input at the Rust boundary (issue 26): every public function that reaches the Rust
core either succeeds or raises ValueError/TypeError naming the argument; never a Rust
PanicException (a BaseException that escapes ``except Exception``), never a hang.

The hypothesis properties run briefly here; ``make fuzz`` sets ``HETCOLL_FUZZ_EXAMPLES`` to run
them with many more examples (and the Rust property tests with ``PROPTEST_CASES``).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import hetcoll
from hetcoll import _core, fusion

EXAMPLES = int(os.environ.get("HETCOLL_FUZZ_EXAMPLES", "40"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Anything a user might pass as a number: huge and negative ints, NaN, infinities, subnormals,
# extremes, bools, strings, None.
hostile_int = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, 2**53, 2**53 + 1, 2**63, 2**64 - 1, 2**64, -1]),
)
hostile_float = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, 0.0, -0.0]),
    st.floats(min_value=0.1, max_value=10.0),
)
hostile_scalar = st.one_of(hostile_int, hostile_float, st.sampled_from([True, None, "1", b"1"]))
hostile_list = st.one_of(
    st.lists(hostile_float, max_size=5),
    st.lists(hostile_int, max_size=5),
    st.lists(hostile_scalar, max_size=4),
    hostile_scalar,
)


SPLIT_ARGS = ("total", "speeds", "latency", "capacity", "multiple_of", "minimum")


@pytest.mark.timeout(60)
@FUZZ
@given(
    total=hostile_int,
    speeds=hostile_list,
    latency=st.one_of(st.none(), hostile_list),
    capacity=st.one_of(st.none(), hostile_list),
    multiple_of=st.one_of(st.none(), hostile_int),
    minimum=st.one_of(st.none(), hostile_int),
)
def test_split_never_panics(total, speeds, latency, capacity, multiple_of, minimum):
    kwargs = {
        k: v
        for k, v in dict(
            latency=latency, capacity=capacity, multiple_of=multiple_of, minimum=minimum
        ).items()
        if v is not None
    }
    try:
        shares = hetcoll.split(total, speeds, **kwargs)
    except (ValueError, TypeError) as e:
        assert re.match(rf"^({'|'.join(SPLIT_ARGS)})\b", str(e)), str(e)
        return
    assert sum(shares) == total
    assert len(shares) == len(speeds)


@pytest.mark.timeout(60)
@FUZZ
@given(
    costs=hostile_list,
    speeds=hostile_list,
    boundary_bytes=st.one_of(st.none(), hostile_list),
    bandwidth=st.one_of(st.none(), hostile_scalar),
)
def test_partition_chain_never_panics(costs, speeds, boundary_bytes, bandwidth):
    try:
        layers = hetcoll.partition_chain(
            costs, speeds, boundary_bytes=boundary_bytes, bandwidth=bandwidth
        )
    except (ValueError, TypeError) as e:
        names = ("costs", "speeds", "boundary_bytes", "bandwidth")
        assert re.match(rf"^({'|'.join(names)})\b", str(e)), str(e)
        return
    assert sum(layers) == len(costs)


@pytest.mark.timeout(60)
@FUZZ
@given(
    loads=hostile_list,
    speeds=hostile_list,
    capacity=st.one_of(st.none(), hostile_list),
    max_nodes=st.one_of(st.none(), hostile_scalar),
    gap=st.one_of(st.none(), hostile_scalar),
)
def test_partition_items_never_panics(loads, speeds, capacity, max_nodes, gap):
    given = dict(capacity=capacity, max_nodes=max_nodes, gap=gap)
    kwargs = {k: v for k, v in given.items() if v is not None}
    if isinstance(max_nodes, int) and not isinstance(max_nodes, bool) and max_nodes > 10**5:
        kwargs["max_nodes"] = 10**5  # a budget is the caller's to spend: keep the run short
    try:
        owner, exact = hetcoll.partition_items(loads, speeds, **kwargs)
    except (ValueError, TypeError) as e:
        names = ("loads", "speeds", "capacity", "max_nodes", "gap")
        assert re.match(rf"^({'|'.join(names)})\b", str(e)), str(e)
        return
    assert len(owner) == len(loads) and all(0 <= d < len(speeds) for d in owner)
    assert isinstance(exact, bool)


@pytest.mark.timeout(60)
@FUZZ
@given(
    loads=hostile_list,
    speeds=hostile_list,
    owner=hostile_list,
    capacity=st.one_of(st.none(), hostile_list),
)
def test_refine_items_never_panics(loads, speeds, owner, capacity):
    try:
        got = hetcoll.refine_items(loads, speeds, owner, capacity=capacity)
    except (ValueError, TypeError) as e:
        names = ("loads", "speeds", "owner", "capacity")
        assert re.match(rf"^({'|'.join(names)})\b", str(e)), str(e)
        return
    assert len(got) == len(loads) and all(0 <= d < len(speeds) for d in got)


@pytest.mark.timeout(60)
@FUZZ
@given(
    num_vertices=st.one_of(st.integers(0, 12), hostile_int),
    nets=st.one_of(
        st.lists(st.lists(st.one_of(st.integers(-2, 14), hostile_scalar), max_size=4), max_size=6),
        hostile_scalar,
    ),
    targets=hostile_list,
    epsilon=st.one_of(st.none(), hostile_float),
    seed=st.one_of(st.none(), hostile_int),
)
# More vertices than memory holds (about 640 GiB to partition): refused by name, where the
# allocation once aborted the process or had the system kill it.
@example(num_vertices=2**32 - 1, nets=[[0, 1]], targets=[0.5, 0.5], epsilon=None, seed=None)
def test_partition_hypergraph_never_panics(num_vertices, nets, targets, epsilon, seed):
    names = ("num_vertices", "nets", "targets", "vertex_weights", "net_weights", "epsilon", "seed")
    try:
        parts = hetcoll.partition_hypergraph(
            num_vertices, nets, targets, epsilon=epsilon, seed=seed
        )
    except (ValueError, TypeError) as e:
        assert re.match(rf"^({'|'.join(names)})\b", str(e)), str(e)
        return
    assert len(parts) == num_vertices
    assert hetcoll.km1(nets, parts) >= 0


def misaligned(n: int, dtype: type = np.float64) -> np.ndarray:
    """A writable array of ``n`` elements one byte off its natural alignment."""
    size = np.dtype(dtype).itemsize
    return np.frombuffer(bytearray(n * size + 1), dtype=dtype, offset=1)


buffers = st.sampled_from(["f64", "f32", "f16", "i64", "misaligned", "strided", "bf16", "empty"])


def make(kind: str, n: int):
    return {
        "f64": lambda: np.arange(n, dtype=np.float64),
        "f32": lambda: np.arange(n, dtype=np.float32),
        "f16": lambda: np.arange(n, dtype=np.float16),
        "i64": lambda: np.arange(n, dtype=np.int64),
        "misaligned": lambda: misaligned(n),
        "strided": lambda: np.arange(2 * n, dtype=np.float64)[::2],
        "bf16": lambda: torch.arange(n, dtype=torch.bfloat16),
        "empty": lambda: np.empty(0),
    }[kind]()


@pytest.mark.timeout(60)
@FUZZ
@given(
    kinds=st.lists(buffers, min_size=1, max_size=3),
    out=st.one_of(st.none(), buffers),
    n=st.integers(0, 5),
    weights=st.lists(hostile_float, min_size=0, max_size=4),
)
def test_kernels_never_panic(kinds, out, n, weights):
    arrays = [make(k, n) for k in kinds]
    kwargs = {} if out is None else {"out": make(out, n)}
    for fn, args, names in [
        (hetcoll.weighted_sum, (arrays, weights), ("arrays", "weights", "out")),
        (fusion.pack, (arrays,), ("arrays", "out")),
        (fusion.unpack, (kwargs.get("out", np.zeros(n * len(arrays))), arrays), ("flat", "arrays")),
    ]:
        try:
            fn(*args, **(kwargs if fn is not fusion.unpack else {}))
        except (ValueError, TypeError) as e:
            assert re.match(rf"^({'|'.join(names)})\b", str(e)), str(e)


# The findings of issue 26, each failing before its fix.


@pytest.mark.timeout(30)
def test_split_of_the_largest_total():
    """Was a PanicException: the level counts overflowed u64 and the greedy's heap ran dry."""
    shares = hetcoll.split(2**64 - 1, [1.0, 2.0])
    assert sum(shares) == 2**64 - 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("total", "speeds", "latency"),
    [
        (10**18, [1e308, 1e-300], None),  # the slow rank's finish time overflows to inf
        (10**15, [1.0, 1.0], [1e300, 1e300]),  # every finish time rounds to the latency
        (10**15, [5e-324, 1.0], None),  # a subnormal speed
    ],
)
def test_split_with_extreme_speeds_ends(total, speeds, latency):
    """Used to spin with the GIL released (Ctrl-C ignored): the greedy walked one unit at a
    time through runs of equal finish times."""
    shares = hetcoll.split(total, speeds, latency=latency)
    assert sum(shares) == total


@pytest.mark.parametrize("fn", ["weighted_sum", "pack", "unpack"])
def test_misaligned_buffers_are_refused_by_name(fn):
    """A float64 view at an odd byte offset was a PanicException (and undefined behaviour had
    it reached the kernel)."""
    bad = misaligned(5)
    with pytest.raises(ValueError, match=r"^arrays\[0\]: is not aligned"):
        if fn == "weighted_sum":
            hetcoll.weighted_sum([bad], [1.0])
        elif fn == "pack":
            fusion.pack([bad])
        else:
            fusion.unpack(np.ones(5), [bad])
    with pytest.raises(ValueError, match=r"^out: is not aligned"):
        hetcoll.weighted_sum([np.ones(5)], [1.0], out=misaligned(5))


def test_misaligned_integer_arrays_take_the_generic_path():
    nets = [misaligned(2, np.int64)]
    nets[0][:] = [0, 1]
    parts = misaligned(2, np.int64)
    parts[:] = [0, 1]
    assert hetcoll.km1(nets, parts) == 1.0


def test_ring_schedule_refuses_a_schedule_that_does_not_fit():
    """Segment usize::MAX overflowed (a panic in debug, an endless loop in release), and a tiny
    segment over a huge count tried to allocate terabytes (an abort)."""
    with pytest.raises(ValueError, match=r"^segment"):
        _core.ring_schedule([2**40, 1], 0, 1)
    steps = _core.ring_schedule([3, 1], 0, 2**64 - 1)
    assert steps == [(True, [(3, 4)], [(0, 3)]), (False, [(0, 3)], [(3, 4)])]


# Aliasing and autograd: refused as torch refuses them.


def test_weighted_sum_refuses_overlapping_torch_views():
    x = torch.arange(10.0)
    with pytest.raises(ValueError, match=r"^arrays\[0\]: overlaps out"):
        hetcoll.weighted_sum([x[1:6]], [1.0], out=x[0:5])
    assert torch.equal(x, torch.arange(10.0))  # nothing written


def test_weighted_sum_refuses_frombuffer_aliases():
    raw = bytearray(np.arange(6.0).tobytes())
    a = np.frombuffer(raw, dtype=np.float64)[1:5]
    out = np.frombuffer(raw, dtype=np.float64)[0:4]  # another object over the same bytes
    with pytest.raises(ValueError, match=r"^arrays\[0\]: overlaps out"):
        hetcoll.weighted_sum([a], [2.0], out=out)


def test_weighted_sum_still_accumulates_in_place():
    x = torch.ones(4)
    y = torch.full((4,), 2.0)
    assert hetcoll.weighted_sum([x, y], [1.0, 1.0], out=x) is x
    assert torch.equal(x, torch.full((4,), 3.0))
    v = torch.ones(8)
    hetcoll.weighted_sum([v[:4], v[4:]], [1.0, 1.0], out=v[:4])  # disjoint halves of one tensor
    assert torch.equal(v[:4], torch.full((4,), 2.0))


def test_unpack_refuses_overlaps_with_flat_and_between_arrays():
    x = torch.zeros(6)
    with pytest.raises(ValueError, match=r"^flat: overlaps arrays\[0\]"):
        fusion.unpack(x[:3], [x[2:5]])
    with pytest.raises(ValueError, match=r"^arrays\[1\]: overlaps arrays\[0\]"):
        fusion.unpack(torch.ones(6), [x[0:3], x[2:5]])


def test_out_that_requires_grad_is_refused_like_torch():
    leaf = torch.ones(3, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"^out: requires grad"):
        hetcoll.weighted_sum([torch.ones(3)], [1.0], out=leaf)
    tracked = torch.ones(3, requires_grad=True) * 2
    with pytest.raises(RuntimeError, match=r"^out: requires grad"):
        hetcoll.weighted_sum([torch.ones(3)], [1.0], out=tracked)
    with pytest.raises(RuntimeError, match=r"^arrays\[0\]: requires grad"):
        fusion.unpack(torch.ones(3), [leaf])
    with torch.no_grad():  # as for torch's in-place ops, no_grad allows it
        hetcoll.weighted_sum([torch.full((3,), 5.0)], [1.0], out=leaf)
    assert torch.equal(leaf.detach(), torch.full((3,), 5.0))


def test_out_saved_for_backward_makes_backward_raise():
    """weighted_sum wrote through a numpy view, so autograd never saw the write and the
    gradient used the overwritten value silently; torch's own in-place ops bump the version."""
    x = torch.ones(3, requires_grad=True)
    w = torch.full((3,), 2.0)  # saved by the multiplication for x's gradient
    loss = (x * w).sum()
    hetcoll.weighted_sum([torch.full((3,), 7.0)], [1.0], out=w)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    x2 = torch.ones(3, requires_grad=True)
    flat = torch.full((3,), 2.0)
    loss2 = (x2 * flat).sum()
    fusion.pack([torch.zeros(3)], out=flat)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss2.backward()


def _solver_threads() -> int:
    """Threads of this process named as the bindings name a solver's (Linux: /proc)."""
    tasks = Path("/proc/self/task")
    return sum((t / "comm").read_text().strip() == "hetcoll-solver" for t in tasks.iterdir())


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux's /proc")
@pytest.mark.timeout(60)
def test_ctrl_c_interrupts_a_long_partition_at_once():
    """Ctrl-C during a partition of seconds raises KeyboardInterrupt at once, not when the
    partitioner is done (the work runs on a thread of its own; this one checks signals every
    50 ms without the GIL)."""
    import _thread
    import signal
    import threading

    rng = np.random.default_rng(0)
    n = 50_000
    sizes = rng.integers(2, 6, size=75_000)
    pins = rng.integers(0, n, size=int(sizes.sum()))
    nets = [np.unique(x) for x in np.split(pins, np.cumsum(sizes)[:-1])]
    # Python's own Ctrl-C handler, whatever an earlier test in this process installed.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.1, _thread.interrupt_main)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            hetcoll.partition_hypergraph(n, nets, [0.25] * 4)
    finally:
        timer.join()
        signal.signal(signal.SIGINT, previous)
    # Raised while the partitioner still runs (its thread is alive), not after it ended. Then
    # wait for it, so it takes no core from the tests that follow.
    assert _solver_threads() >= 1
    while _solver_threads():
        time.sleep(0.05)
    # The interrupted run leaves the module usable.
    assert list(hetcoll.partition_hypergraph(4, [[0, 1], [2, 3]], [0.5, 0.5])) in (
        [0, 0, 1, 1],
        [1, 1, 0, 0],
    )
