"""hetcoll.weighted_sum: exact against the same operations in numpy, any thread count, numpy and
torch buffers without copies, clear errors."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import hetcoll

BIG = 3 * (1 << 18) + 12345  # several threads' worth, and a ragged tail


def same_order(arrays, weights, acc_dtype):
    """w0*a0 + w1*a1 + ... evaluated left to right in acc_dtype, as the kernel promises."""
    acc = acc_dtype(weights[0]) * arrays[0].astype(acc_dtype)
    for w, a in zip(weights[1:], arrays[1:]):
        acc = acc + acc_dtype(w) * a.astype(acc_dtype)
    return acc


@settings(max_examples=150, deadline=None)
@given(
    dtype=st.sampled_from([np.float32, np.float64, np.float16]),
    k=st.integers(1, 6),
    shape=hnp.array_shapes(min_dims=1, max_dims=3, max_side=17),
    data=st.data(),
)
def test_bitwise_equal_to_same_order_numpy(dtype, k, shape, data):
    elems = st.floats(-1e3, 1e3, width=16 if dtype == np.float16 else 32)
    arrays = [data.draw(hnp.arrays(dtype, shape, elements=elems)) for _ in range(k)]
    weights = data.draw(st.lists(st.floats(-4, 4, width=32), min_size=k, max_size=k))
    out = hetcoll.weighted_sum(arrays, weights)
    acc = np.float64 if dtype == np.float64 else np.float32
    expected = same_order(arrays, weights, acc).astype(dtype)
    assert out.dtype == dtype and out.shape == shape
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_identical_for_any_thread_count(monkeypatch, dtype):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(BIG).astype(dtype) for _ in range(4)]
    weights = [0.1, -2.5, 3.25, 1e-3]
    results = []
    for threads in ["1", "2", "3", "7"]:
        monkeypatch.setenv("HETCOLL_NUM_THREADS", threads)
        assert hetcoll.num_threads() == int(threads)
        results.append(hetcoll.weighted_sum(arrays, weights))
    for r in results[1:]:
        assert r.tobytes() == results[0].tobytes()
    ref = sum(w * a.astype(np.float64) for w, a in zip(weights, arrays))
    tol = 1e-5 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(results[0], ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("position", [0, 1, 2])
def test_out_may_be_one_of_the_inputs(position):
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(BIG) for _ in range(3)]
    weights = [0.5, 2.0, -1.0]
    expected = same_order(arrays, weights, np.float64)
    out = arrays[position]
    got = hetcoll.weighted_sum(arrays, weights, out=out)
    assert got is out
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_torch_tensors_in_place_without_copies(dtype):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(64, 33, generator=g).to(dtype) for _ in range(3)]
    weights = [3.0, 5.0, 8.0]
    ref = sum(w * t.double() for w, t in zip(weights, tensors))
    # Accumulated in float32 (float64 for float64), rounded once to the storage type.
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    expected = (weights[0] * tensors[0].to(acc) + weights[1] * tensors[1].to(acc)) + weights[
        2
    ] * tensors[2].to(acc)
    expected = expected.to(dtype)
    out = tensors[0]
    ptr = out.data_ptr()
    got = hetcoll.weighted_sum(tensors, weights, out=out)
    assert got is out and out.data_ptr() == ptr and out.dtype == dtype
    assert torch.equal(out, expected)
    tol = {torch.float16: 1e-2, torch.bfloat16: 1e-1}.get(dtype, 1e-5)
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_torch_out_allocated_and_requires_grad_inputs():
    a = torch.ones(5, requires_grad=True)
    b = torch.arange(5.0)
    out = hetcoll.weighted_sum([a, b], [2.0, 1.0])
    assert isinstance(out, torch.Tensor)
    assert torch.equal(out, torch.tensor([2.0, 3.0, 4.0, 5.0, 6.0]))


def test_sixteen_bit_types_accumulate_in_float32():
    a = np.array([2048.0], dtype=np.float16)
    b = np.array([1.0], dtype=np.float16)
    assert hetcoll.weighted_sum([a, b, a], [1.0, 1.0, -1.0])[0] == 1.0


@pytest.mark.parametrize(
    ("arrays", "weights", "kwargs", "exc", "pattern"),
    [
        ([], [], {}, ValueError, "^arrays"),
        (np.ones(3), [1.0], {}, TypeError, "^arrays"),
        ([np.ones(3)], [1.0, 2.0], {}, ValueError, "^weights"),
        ([np.ones(3)], [float("nan")], {}, ValueError, r"^weights\[0\]"),
        # A bool is an int to Python, not a weight (True read as 1.0 before).
        ([np.ones(3)], [True], {}, ValueError, r"^weights\[0\]: must be a number"),
        ([np.ones(3)], np.array([True]), {}, ValueError, r"^weights: must be numbers, got an"),
        ([np.ones(3)], torch.tensor([True]), {}, ValueError, r"^weights: must be numbers, got an"),
        ([np.ones(3), np.ones(4)], [1.0, 1.0], {}, ValueError, r"^arrays\[1\]"),
        ([np.ones((2, 3)), np.ones((3, 2))], [1.0, 1.0], {}, ValueError, r"^arrays\[1\]"),
        ([np.ones(3), np.ones(3, np.float32)], [1.0, 1.0], {}, TypeError, r"^arrays\[1\]"),
        # Integer arrays blame arrays[0], not the out the user never passed (issue 26).
        ([np.ones(3, np.int64)], [1.0], {}, TypeError, r"^arrays\[0\]"),
        ([np.ones(3), np.ones(3, np.int64)], [1.0, 1.0], {}, TypeError, r"^arrays\[1\]"),
        ([np.ones(6)[::2]], [1.0], {}, ValueError, r"^arrays\[0\]"),
        ([np.ones((3, 3)).T], [1.0], {"out": np.ones((3, 3))}, ValueError, r"^arrays\[0\]"),
        ([[1.0, 2.0]], [1.0], {}, TypeError, r"^arrays\[0\]"),
        ([np.ones(3)], [1.0], {"out": np.ones(3)[::1].copy()[:2]}, ValueError, r"^arrays\[0\]"),
        ([torch.ones(3, dtype=torch.int32)], [1.0], {}, TypeError, r"^arrays\[0\]"),
        # Meta tensors hold no values ("overlaps out in memory" before: their addresses are 0).
        ([torch.ones(3, device="meta")] * 2, [1.0, 1.0], {}, TypeError, r"^arrays\[0\].*meta"),
        (
            [torch.ones(3), torch.ones(3, dtype=torch.bfloat16)],
            [1.0, 1.0],
            {},
            TypeError,
            r"^arrays\[1\]",
        ),
        # Named before torch's .numpy() refuses them (its errors named no argument; a lazily
        # negated tensor's was a RuntimeError, which allreduce's ranks did not tell each other).
        ([torch.ones(3).to_sparse()], [1.0], {}, ValueError, r"^arrays\[0\]: must be a dense"),
        (
            [torch.ones(3, dtype=torch.complex64).conj().imag],
            [1.0],
            {},
            ValueError,
            r"^arrays\[0\]: has its negative bit set",
        ),
        (
            [torch.ones(3)],
            [1.0],
            {"out": torch.ones(3, dtype=torch.complex64).conj().imag},
            ValueError,
            r"^out: has its negative bit set",
        ),
    ],
)
def test_bad_input_names_the_argument(arrays, weights, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        hetcoll.weighted_sum(arrays, weights, **kwargs)


def test_read_only_and_overlapping_out_are_refused():
    a = np.ones(8)
    ro = np.ones(8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match=r"^out"):
        hetcoll.weighted_sum([a], [1.0], out=ro)
    base = np.ones(9)
    with pytest.raises(ValueError, match=r"^arrays\[0\]"):
        hetcoll.weighted_sum([base[1:]], [1.0], out=base[:8])


def test_bad_thread_knob(monkeypatch):
    monkeypatch.setenv("HETCOLL_NUM_THREADS", "zero")
    with pytest.raises(ValueError, match="HETCOLL_NUM_THREADS"):
        hetcoll.weighted_sum([np.ones(3)], [1.0])


LOCAL_RANKS_VARS = ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")


def _threads_in_fresh_process(**env: str) -> int:
    unset = ("HETCOLL_NUM_THREADS", *LOCAL_RANKS_VARS)
    clean = {k: v for k, v in os.environ.items() if k not in unset}
    code = "import hetcoll; print(hetcoll.num_threads())"
    out = subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


@pytest.mark.parametrize("var", LOCAL_RANKS_VARS)
def test_ranks_on_one_node_share_its_cores(var):
    alone = _threads_in_fresh_process()
    assert alone >= 1
    for ranks in (2, 3, alone + 1):
        assert _threads_in_fresh_process(**{var: str(ranks)}) == max(1, alone // ranks)
    assert _threads_in_fresh_process(**{var: "2", "HETCOLL_NUM_THREADS": "3"}) == 3
    assert _threads_in_fresh_process(**{var: "not a number"}) == alone


def test_no_sequence_of_arrays_is_named():
    for bad in (None, 3, 2.5):
        with pytest.raises(TypeError, match=r"^arrays: must be a sequence of arrays, got"):
            hetcoll.weighted_sum(bad, [1.0])  # type: ignore[arg-type]
