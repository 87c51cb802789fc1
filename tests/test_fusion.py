"""Fusion buffers: pack/unpack against a float64 reference, for numpy and torch, every dtype."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hetcoll import fusion

NUMPY_DTYPES = [np.float32, np.float64, np.float16]
TORCH_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SHAPES = [(3, 4), (0,), (1,), (7,), (2, 0, 3), (), (65537,), (5, 1, 2)]


def _arrays(dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(dtype) for s in SHAPES]


def _rounded(x64: np.ndarray, dtype) -> np.ndarray:
    """float64 reference rounded once to the storage type (what a single rounding gives)."""
    return x64.astype(dtype)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.25, -3.0, 1 / 3])
def test_numpy_pack_unpack_match_float64_reference(dtype, scale):
    arrays = _arrays(dtype)
    flat = fusion.pack(arrays, scale=scale)
    assert isinstance(flat, np.ndarray) and flat.ndim == 1 and flat.dtype == dtype
    ref = np.concatenate([a.astype(np.float64).ravel() for a in arrays]) * scale
    if dtype != np.float64:
        # the contract: scaled in float32 (the accumulator of 32- and 16-bit types), rounded once
        ref = np.concatenate([a.astype(np.float32).ravel() for a in arrays]) * np.float32(scale)
    np.testing.assert_array_equal(flat, _rounded(ref, dtype))
    back = [np.full_like(a, np.nan) for a in arrays]
    fusion.unpack(flat, back, scale=1.0)
    for b, f in zip(back, np.split(flat, np.cumsum([a.size for a in arrays])[:-1])):
        np.testing.assert_array_equal(b.ravel(), f)


def test_scale_one_is_an_exact_copy_including_nan_payloads():
    a = np.array([np.nan, -0.0, np.inf, 1e-45], np.float32)
    bits = a.view(np.uint32).copy()
    bits[0] = 0x7FC00123  # a NaN with a payload
    a = bits.view(np.float32)
    flat = fusion.pack([a])
    np.testing.assert_array_equal(flat.view(np.uint32), bits)


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_torch_round_trip_with_scales(dtype):
    torch.manual_seed(0)
    ts = [torch.randn(s, dtype=torch.float32).to(dtype) for s in SHAPES]
    flat = fusion.pack(ts, scale=0.5)
    assert isinstance(flat, torch.Tensor) and flat.dtype == dtype and flat.dim() == 1
    ref = torch.cat([t.float().reshape(-1) for t in ts]) * 0.5
    assert torch.equal(flat, ref.to(dtype))
    originals = [t.clone() for t in ts]
    fusion.unpack(flat, ts, scale=2.0)
    for t, o in zip(ts, originals):
        assert torch.equal(t, o)  # 0.5 and 2.0 are exact in every float type


def test_out_is_filled_and_returned():
    arrays = _arrays(np.float64)
    total = sum(a.size for a in arrays)
    out = np.empty(total)
    assert fusion.pack(arrays, scale=2.0, out=out) is out
    np.testing.assert_array_equal(out, 2.0 * np.concatenate([a.ravel() for a in arrays]))
    t_out = torch.empty(total, dtype=torch.float64)
    fusion.pack([torch.from_numpy(a) for a in arrays], out=t_out)
    np.testing.assert_array_equal(t_out.numpy(), out / 2.0)


def test_unpack_into_views_of_a_larger_buffer():
    # Parameters of a model are often views into one storage; unpack must write through them.
    storage = np.zeros(10)
    views = [storage[0:3], storage[5:9].reshape(2, 2)]
    fusion.unpack(np.arange(7.0), views, scale=-1.0)
    np.testing.assert_array_equal(storage, [0, -1, -2, 0, 0, -3, -4, -5, -6, 0])


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=6),
    scale=st.floats(-8, 8, allow_nan=False),
    seed=st.integers(0, 2**16),
)
def test_pack_is_scaled_concatenation_property(sizes, scale, seed):
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(n) for n in sizes]
    flat = fusion.pack(arrays, scale=scale)
    np.testing.assert_array_equal(flat, np.concatenate(arrays) * scale)
    back = [np.empty(n) for n in sizes]
    fusion.unpack(flat, back, scale=1.0)
    for b, a in zip(back, arrays):
        np.testing.assert_array_equal(b, a * scale)


def test_bad_input_names_the_argument():
    a = np.ones(3, np.float32)
    with pytest.raises(TypeError, match="arrays"):
        fusion.pack(a)
    with pytest.raises(TypeError, match="arrays"):
        fusion.pack(5)
    with pytest.raises(ValueError, match="arrays"):
        fusion.pack([])
    with pytest.raises(TypeError, match=r"arrays\[1\]"):
        fusion.pack([a, np.ones(2)])
    with pytest.raises(TypeError, match=r"arrays\[0\]"):
        fusion.pack([np.ones(3, np.int32)])
    with pytest.raises(ValueError, match=r"arrays\[0\]: must be C-contiguous"):
        fusion.pack([np.ones((4, 4), np.float32)[:, ::2]])
    with pytest.raises(ValueError, match="out"):
        fusion.pack([a], out=np.empty(4, np.float32))
    with pytest.raises(TypeError, match="out"):
        fusion.pack([a], out=np.empty(3))
    with pytest.raises(ValueError, match="scale"):
        fusion.pack([a], scale=float("nan"))
    with pytest.raises(TypeError, match="scale"):
        fusion.pack([a], scale="2")
    with pytest.raises(ValueError, match="flat"):
        fusion.unpack(np.ones(2, np.float32), [a])
    with pytest.raises(TypeError, match="flat"):
        fusion.unpack([1.0, 2.0, 3.0], [a])
    with pytest.raises(ValueError, match=r"arrays\[0\]: overlaps"):
        fusion.pack([a[:2]], out=a[1:])
    frozen = np.zeros(3, np.float32)
    frozen.flags.writeable = False  # once reported as overlapping flat
    with pytest.raises(ValueError, match=r"^arrays\[1\]: is read-only; unpack writes into it"):
        fusion.unpack(np.ones(6, np.float32), [np.zeros(3, np.float32), frozen])
    with pytest.raises(ValueError, match=r"^scale: must be finite, got 1358"):
        fusion.pack([a], scale=2**1100)
    with pytest.raises(TypeError, match=r"arrays\[1\]"):
        fusion.pack([torch.ones(2), torch.ones(2, dtype=torch.bfloat16)])
