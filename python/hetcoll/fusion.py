"""Fusion buffers: many gradient tensors packed into one flat buffer, scaled, and back.

A collective pays its latency once per call, so the data-parallel path packs every gradient
into one flat buffer, reduces it once and unpacks it. The scale (a sample weight, ``1 / N``)
is applied during the copy in Rust, multi-threaded with the GIL released, so no separate
scaling pass touches memory. ``scale=1`` is an exact copy; otherwise 16-bit types are scaled
in float32 and rounded once.

>>> import numpy as np
>>> from hetcoll import fusion
>>> grads = [np.ones((2, 2), np.float32), np.arange(3, dtype=np.float32)]
>>> flat = fusion.pack(grads, scale=0.5)
>>> flat
array([0.5, 0.5, 0.5, 0.5, 0. , 0.5, 1. ], dtype=float32)
>>> fusion.unpack(flat, grads, scale=2.0)
>>> grads[1]
array([0., 1., 2.], dtype=float32)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

from hetcoll import _core
from hetcoll.errors import finite_number
from hetcoll.kernels import (
    check_dtype,
    check_writable,
    is_tensor,
    mark_written,
    numpy_view,
)

__all__ = ["pack", "unpack"]

Array = TypeVar("Array")


def _views(arrays: Any) -> tuple[list[Any], list[np.ndarray], bool | None]:
    """The arrays as a list, their zero-copy numpy views, and whether they hold bfloat16 bits."""
    if isinstance(arrays, (np.ndarray, str, bytes)) or is_tensor(arrays):
        raise TypeError("arrays: must be a sequence of arrays, not a single array")
    try:
        arrays = list(arrays)
    except TypeError:
        raise TypeError(
            f"arrays: must be a sequence of arrays, got {type(arrays).__name__}"
        ) from None
    views: list[np.ndarray] = []
    bf16: bool | None = None
    for i, a in enumerate(arrays):
        v, b = numpy_view(a, f"arrays[{i}]")
        check_dtype(v, b, f"arrays[{i}]")
        if views and (b != bf16 or v.dtype != views[0].dtype):
            raise TypeError(f"arrays[{i}]: dtype differs from arrays[0]'s")
        bf16 = b
        views.append(v)
    return arrays, views, bf16


def pack(arrays: Sequence[Array], *, scale: float = 1.0, out: Array | None = None) -> Array:
    """The flat 1-D concatenation of ``arrays`` (each C-contiguous, any shape), times ``scale``.

    ``arrays`` are numpy arrays or CPU torch tensors of one dtype (float32, float64, float16, or
    bfloat16 tensors). ``out``, when given, must hold exactly their total number of elements in
    that dtype and must not overlap them; when omitted, a new 1-D array of the kind of
    ``arrays[0]`` (numpy or torch) is returned.

    >>> import numpy as np
    >>> pack([np.array([1.0, 2.0]), np.array([[3.0]])], scale=2.0)
    array([2., 4., 6.])
    """
    value = finite_number(scale, "scale")
    arrays, views, bf16 = _views(arrays)
    check_writable([] if out is None else [(out, "out")])
    result: Any = out
    if result is None:
        if not arrays:
            raise ValueError("arrays: must hold at least one array when out is not given")
        total = sum(v.size for v in views)
        first = arrays[0]
        if is_tensor(first):
            import torch

            result = torch.empty(total, dtype=first.dtype)
        else:
            result = np.empty(total, dtype=views[0].dtype)
    out_view, out_bf16 = numpy_view(result, "out")
    if bf16 is not None and out_bf16 != bf16:
        raise TypeError("out: dtype differs from the arrays'")
    _core.pack_into(views, out_view, scale=value, bfloat16=out_bf16)
    mark_written(result)
    return result  # type: ignore[no-any-return]


def unpack(flat: Array, arrays: Sequence[Array], *, scale: float = 1.0) -> None:
    """Write ``scale * flat[o_i : o_i + arrays[i].size]`` into each of ``arrays``, in place.

    The inverse of :func:`pack`: ``o_i`` is the total size of ``arrays[:i]``, and ``flat`` must
    hold exactly the arrays' total number of elements, in their dtype, without overlapping them
    (nor may the arrays overlap each other). Arrays that require grad are refused in grad mode
    and written tensors have their version counter bumped, as for :func:`hetcoll.weighted_sum`.

    >>> import numpy as np
    >>> a, b = np.zeros(1), np.zeros(2)
    >>> unpack(np.array([1.0, 2.0, 3.0]), [a, b], scale=-1.0)
    >>> b
    array([-2., -3.])
    """
    value = finite_number(scale, "scale")
    flat_view, flat_bf16 = numpy_view(flat, "flat")
    arrays, views, bf16 = _views(arrays)
    if bf16 is not None and flat_bf16 != bf16:
        raise TypeError("flat: dtype differs from the arrays'")
    check_writable([(a, f"arrays[{i}]") for i, a in enumerate(arrays)])
    _core.unpack_from(flat_view, views, scale=value, bfloat16=flat_bf16)
    for a in arrays:
        mark_written(a)
