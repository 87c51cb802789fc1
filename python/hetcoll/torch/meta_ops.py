"""Ops run on the meta device where this torch's meta kernel refuses what its real kernels take.

hetcoll learns shapes by running a model's blocks on the meta device: a plan's stage outputs,
the costs' counts. Torch 2.11's meta kernel of ``aten._grouped_mm``, which Hugging Face's
mixtures of experts run by default, takes bfloat16 only (its CUDA kernel's rule then), where its
CPU kernel takes float32 and float16 too, as a newer torch's meta kernel does: a float32 model
of experts ran on the CPU and could not be planned. :func:`made_outputs` gives such an op's
outputs as the newer meta kernel makes them, and :func:`meta_ops` is the context in which every
op of a meta run goes through it (no context at all on a torch whose meta kernels take
everything, so no cost there). The real run decides what really runs: these are shapes only.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: The dtypes the real kernels of ``aten._grouped_mm`` take.
_GROUPED_MM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.cache
def _meta_grouped_mm_takes(dtype: torch.dtype) -> bool:
    """Whether this torch's meta kernel of ``aten._grouped_mm`` runs on ``dtype``."""
    a = torch.empty((8, 16), dtype=dtype, device="meta")
    b = torch.empty((2, 16, 8), dtype=dtype, device="meta")
    offs = torch.empty((2,), dtype=torch.int32, device="meta")
    try:
        torch.ops.aten._grouped_mm.default(a, b, offs)
    except RuntimeError:
        return False
    return True


def _grouped_mm_outputs(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | None:
    """The output of ``aten._grouped_mm`` on meta operands of a dtype this torch's meta kernel
    refuses, made as a newer torch's meta kernel makes it (its last dimension padded to 16
    bytes on builds with CUDA); None where the meta kernel runs, or where the operands are not
    a layout the op takes (the op then says why)."""
    if mat_a.device.type != "meta" or mat_a.dtype not in _GROUPED_MM_DTYPES:
        return None
    if mat_b.dtype != mat_a.dtype or _meta_grouped_mm_takes(mat_a.dtype):
        return None
    if {mat_a.dim(), mat_b.dim()} - {2, 3}:
        return None
    if (mat_a.dim() == 2 or mat_b.dim() == 2) and offs is None:
        return None
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        size = [offs.shape[0], mat_a.shape[0], mat_b.shape[1]]  # type: ignore[union-attr]
    elif mat_a.shape[-1] != mat_b.shape[-2]:
        return None
    elif mat_a.dim() == 2:
        size = [mat_a.shape[0], mat_b.shape[-1]]
    elif mat_b.dim() == 2:
        size = [mat_a.shape[1], mat_b.shape[1]]
    else:
        size = [mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1]]
    dtype = out_dtype or mat_a.dtype
    if torch.version.cuda is None:
        return torch.empty(size, dtype=dtype, device="meta")
    align = 16 // dtype.itemsize
    padded = -(-size[-1] // align) * align
    stride = [size[1] * padded, padded, 1] if len(size) == 3 else [padded, 1]
    return torch.empty_strided(size, stride, dtype=dtype, device="meta")


#: The ops whose meta outputs are made here where this torch's meta kernel refuses them.
_MADE = {torch.ops.aten._grouped_mm.default: _grouped_mm_outputs}


def made_outputs(func: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """The outputs of ``func(*args, **kwargs)`` on the meta device where this torch's meta
    kernel refuses them and its real kernels take them; None where the op is to run."""
    make = _MADE.get(func)
    return None if make is None else make(*args, **kwargs)


def needed() -> bool:
    """Whether any op's meta kernel on this torch refuses what its real kernels take."""
    return not all(_meta_grouped_mm_takes(dtype) for dtype in _GROUPED_MM_DTYPES)


class _MetaOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        made = made_outputs(func, args, kwargs)
        return func(*args, **kwargs) if made is None else made


@contextlib.contextmanager
def meta_ops() -> Iterator[None]:
    """A run on the meta device with :func:`made_outputs` standing in for the meta kernels
    this torch lacks (nothing is entered where it lacks none)."""
    if not needed():
        yield
        return
    with _MetaOps():
        yield
