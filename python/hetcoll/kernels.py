"""Fused kernels on numpy arrays and CPU torch tensors, without copies; torch's own ops on
device (CUDA) tensors.

The Rust kernels take numpy buffers; this module hands them zero-copy numpy views of torch
tensors (bfloat16 as its raw 16-bit patterns, which numpy has no type for) and gives back the
caller's own object. Tensors on another device (CUDA) stay there: :func:`weighted_sum` runs
torch ops on that device, under the same argument rules.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, TypeVar, cast

import numpy as np

from hetcoll import _core

ArrayT = TypeVar("ArrayT")


def is_tensor(x: object) -> bool:
    """Whether ``x`` is a torch tensor, without importing torch."""
    # Checked without importing torch: most callers of the numpy path never load it.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def numpy_view(x: Any, argument: str) -> tuple[np.ndarray, bool]:
    """A numpy view sharing ``x``'s memory, and whether it holds bfloat16 bit patterns."""
    if isinstance(x, np.ndarray):
        return x, False
    if is_tensor(x):
        import torch

        if x.device.type != "cpu":
            raise TypeError(
                f"{argument}: is on {x.device}; the Rust kernels read host memory (pass a CPU "
                "tensor, or device tensors only: hetcoll.weighted_sum runs those on their device)"
            )
        t = x.detach()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16), True
        if t.dtype not in (torch.float32, torch.float64, torch.float16):
            raise TypeError(
                f"{argument}: dtype {t.dtype} is not supported (float32, float64, float16, "
                "bfloat16)"
            )
        return t.numpy(), False
    raise TypeError(
        f"{argument}: must be a numpy array or a CPU torch tensor, got {type(x).__name__}"
    )


_DTYPES = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16))
"""The numpy dtypes the kernels read (bfloat16 arrives as ``uint16`` bit patterns)."""


def check_dtype(view: np.ndarray, bf16: bool, argument: str) -> None:
    """Refuse a dtype the kernels do not read, naming ``argument`` (before any output exists)."""
    if not bf16 and view.dtype not in _DTYPES:
        raise TypeError(
            f"{argument}: dtype {view.dtype} is not supported (float32, float64, float16, bfloat16)"
        )


def tracked_by_autograd(x: Any) -> bool:
    """Whether writing ``x`` in place is what torch's in-place and ``out=`` ops refuse: in grad
    mode, a tensor that requires grad (hetcoll's kernels are not differentiable)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.is_grad_enabled() and is_tensor(x) and x.requires_grad


def check_writable(written: Sequence[tuple[Any, str]]) -> None:
    """Refuse to write what torch's in-place and ``out=`` ops refuse to write: in grad mode, a
    tensor that requires grad (a leaf, or a result autograd tracks; the kernels are not
    differentiable, so its gradient would be silently wrong). Each pair is ``(buffer, argument
    name)``. Inputs are only read, so they may require grad (the result then does not)."""
    for x, name in written:
        if tracked_by_autograd(x):
            raise RuntimeError(
                f"{name}: requires grad; hetcoll's kernels write it in place and are not "
                "differentiable (torch refuses the same for its out= and in-place ops; write "
                "under torch.no_grad() or into a tensor that does not require grad)"
            )


def mark_written(x: Any) -> None:
    """Bump a written tensor's version counter, as torch's in-place ops do, so that autograd
    raises on backward if it had saved the tensor before hetcoll overwrote it."""
    if is_tensor(x) and not x.is_inference():
        from torch.autograd.graph import increment_version

        increment_version(x)


def weighted_sum(
    arrays: Sequence[ArrayT], weights: Sequence[float], *, out: ArrayT | None = None
) -> ArrayT:
    """``out[k] = sum_i weights[i] * arrays[i][k]`` in one fused, multi-threaded pass.

    ``arrays`` are numpy arrays or CPU torch tensors of one shape and dtype (float32, float64,
    float16, or bfloat16 tensors; 16-bit types accumulate in float32), or torch tensors all on
    one device (CUDA): those are summed there with torch's ops (:func:`weighted_sum_device`),
    never copied to the host. ``out`` may be one of
    ``arrays`` (in-place accumulation) but must not otherwise overlap them (a ``ValueError``
    names the pair); when omitted a new array like ``arrays[0]`` is returned. Like torch's
    ``out=`` ops, it is not differentiable: in grad mode an ``out`` that requires grad raises
    ``RuntimeError``, and ``out``'s version counter is bumped, so autograd raises on backward
    if it had saved ``out``.
    The GIL is released; ``HETCOLL_NUM_THREADS`` sets the thread count (default: the node's
    cores divided among the job's ranks on it, see :func:`num_threads`) and the result is
    bitwise the same for any thread count.

    >>> import numpy as np, hetcoll
    >>> hetcoll.weighted_sum([np.ones(3), np.arange(3.0)], [2.0, 0.5])
    array([2. , 2.5, 3. ])
    """
    if isinstance(arrays, (np.ndarray, str, bytes)) or is_tensor(arrays):
        raise TypeError("arrays: must be a sequence of arrays, not a single array")
    arrays = list(arrays)
    if not arrays:
        raise ValueError("arrays: must hold at least one array")
    head: Any = arrays[0]
    if is_tensor(head) and head.device.type != "cpu":
        return cast(ArrayT, weighted_sum_device(arrays, weights, out=out))
    views = [numpy_view(a, f"arrays[{i}]") for i, a in enumerate(arrays)]
    for i, (v, bf16) in enumerate(views):
        check_dtype(v, bf16, f"arrays[{i}]")
    check_writable([] if out is None else [(out, "out")])
    if out is None:
        first: Any = arrays[0]
        if is_tensor(first):
            import torch

            out = cast(ArrayT, torch.empty_like(first, memory_format=torch.contiguous_format))
        else:
            out = cast(ArrayT, np.empty_like(first, order="C"))
    out_view, out_bf16 = numpy_view(out, "out")
    for i, (_, bf16) in enumerate(views):
        if bf16 != out_bf16:
            kinds = {True: "bfloat16", False: "not bfloat16"}
            raise TypeError(f"arrays[{i}]: is {kinds[bf16]} but out is {kinds[out_bf16]}")
    _core.weighted_sum_into([v for v, _ in views], weights, out_view, bfloat16=out_bf16)
    mark_written(out)
    return out


def weighted_sum_device(arrays: Sequence[Any], weights: Sequence[float], *, out: Any = None) -> Any:
    """:func:`weighted_sum` of torch tensors on one non-CPU device (CUDA), with torch's ops on
    that device: ``out = w_j a_j`` (``j``: the array ``out`` is, when it is one of them, else
    0), then ``out += w_i a_i`` for the others in order (``add_`` with ``alpha``), in float32
    for 16-bit types (a float32 accumulator, rounded once into ``out``) and in the tensors' own
    type otherwise. One pass per array, not one fused pass: it is torch's ``add_`` chain, with
    weighted_sum's argument rules (the weights checked by the Rust kernel's own rules; one
    shape and dtype; C-contiguous; ``out`` one of ``arrays`` or disjoint from them; not
    differentiable, as :func:`weighted_sum` says)."""
    import torch

    first = arrays[0]
    for i, a in enumerate(arrays):
        if is_tensor(a) and a.device.type == "meta":
            raise TypeError(
                f"arrays[{i}]: is on the meta device, which holds shapes but no values to sum "
                "(a model built on it has no weights yet: materialise them first)"
            )
        if not is_tensor(a) or a.device != first.device:
            where = a.device if is_tensor(a) else type(a).__name__
            raise TypeError(
                f"arrays[{i}]: is {where} but arrays[0] is on {first.device}; arrays and out "
                "must all be tensors on one device (move them with .to(device))"
            )
        if a.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            raise TypeError(
                f"arrays[{i}]: dtype {a.dtype} is not supported (float32, float64, float16, "
                "bfloat16)"
            )
    # The weights' rules (count, finiteness, type) are the Rust kernel's, checked on empty
    # buffers so that both paths raise the same errors.
    empty = np.empty(0, np.float64)
    _core.weighted_sum_into([empty] * len(arrays), weights, np.empty(0, np.float64))
    w = [float(x) for x in weights]
    if out is not None and (not is_tensor(out) or out.device != first.device):
        where = out.device if is_tensor(out) else type(out).__name__
        raise TypeError(
            f"out: is {where} but arrays[0] is on {first.device}; arrays and out must all be "
            "tensors on one device"
        )
    check_writable([] if out is None else [(out, "out")])
    target = (
        out if out is not None else torch.empty_like(first, memory_format=torch.contiguous_format)
    )
    named = [(a, f"arrays[{i}]") for i, a in enumerate(arrays)] + [(target, "out")]
    for a, name in named:
        if a.dtype != first.dtype:
            raise TypeError(f"{name}: dtype {a.dtype} does not match arrays[0]'s {first.dtype}")
        if a.shape != first.shape:
            raise ValueError(
                f"{name}: has shape {tuple(a.shape)} but arrays[0] has shape {tuple(first.shape)}"
            )
        if not a.is_contiguous():
            raise ValueError(f"{name}: must be C-contiguous")
    start, end = target.data_ptr(), target.data_ptr() + target.numel() * target.element_size()
    same = -1
    for i, a in enumerate(arrays):
        lo = a.data_ptr()
        hi = lo + a.numel() * a.element_size()
        if lo == start and hi == end and same < 0:
            same = i  # in-place accumulation: out is this array
        elif a.numel() and target.numel() and lo < end and start < hi:
            raise ValueError(f"arrays[{i}]: overlaps out in memory")
    j = max(same, 0)
    order = [j] + [i for i in range(len(arrays)) if i != j]
    with torch.no_grad():
        t = target.detach()
        wide = t.dtype in (torch.float16, torch.bfloat16)
        acc = torch.empty_like(t, dtype=torch.float32) if wide else t
        torch.mul(arrays[j].detach(), w[j], out=acc)
        for i in order[1:]:
            acc.add_(arrays[i].detach(), alpha=w[i])
        if wide:
            t.copy_(acc)
    return target


def num_threads() -> int:
    """Threads the kernels use: ``HETCOLL_NUM_THREADS`` if set, else the node's cores divided
    among the ranks of the job on it, as the launcher announces them (torchrun's
    ``LOCAL_WORLD_SIZE``, MPICH's ``MPI_LOCALNRANKS``, Open MPI's ``OMPI_COMM_WORLD_LOCAL_SIZE``;
    one rank when none is set), at least one. Read once per process."""
    return _core.num_threads()
