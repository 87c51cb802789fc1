"""Fused kernels on numpy arrays and CPU torch tensors, without copies; on CUDA tensors, one
fused kernel compiled at first use by torch's jiterator, else torch's own ops.

The Rust kernels take numpy buffers; this module hands them zero-copy numpy views of torch
tensors (bfloat16 as its raw 16-bit patterns, which numpy has no type for) and gives back the
caller's own object. Tensors on another device (CUDA) stay there: :func:`weighted_sum` sums
them on that device, under the same argument rules.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable, Sequence
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
        # Refused by name before .numpy(), whose own errors name no argument; a RuntimeError
        # (a nested tensor's, a lazily negated one's) also escaped the collectives' argument
        # checks, so the rank left without telling its peers, which then hung.
        check_dense(x, argument)
        if x.is_neg():
            raise ValueError(
                f"{argument}: has its negative bit set (a lazy negation, as x.conj().imag "
                "gives), which numpy cannot view; pass x.resolve_neg()"
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


def check_dense(t: Any, argument: str) -> None:
    """Refuse a tensor whose memory is not one plain strided array (sparse, mkldnn, nested),
    naming ``argument``: numpy cannot view it."""
    import torch

    if t.layout is not torch.strided or t.is_nested:
        what = "a nested tensor" if t.is_nested else t.layout
        raise ValueError(f"{argument}: must be a dense (strided) tensor, got {what}")


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
    if not hasattr(arrays, "__iter__"):
        raise TypeError(f"arrays: must be a sequence of arrays, got {type(arrays).__name__}")
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


#: The most arrays one fused device kernel sums (torch's jiterator takes up to 8 inputs).
FUSED_MAX_ARRAYS = 8


def fused_source(k: int, accumulator: str) -> str:
    """The CUDA source (a jiterator functor) of one element of a weighted sum of ``k`` arrays
    of one type ``T``: ``s = w0 a0``, then ``s += wi ai`` in order, in ``accumulator`` (``float``
    or ``double``), rounded once into ``T``."""
    params = [f"T a{i}" for i in range(k)] + [f"{accumulator} w{i}" for i in range(k)]
    body = [f"{accumulator} s = w0 * {accumulator}(a0);"]
    body += [f"s += w{i} * {accumulator}(a{i});" for i in range(1, k)]
    return (
        f"template <typename T> T hetcoll_weighted_sum_{k}_{accumulator}({', '.join(params)}) "
        f"{{ {' '.join(body)} return T(s); }}"
    )


@functools.cache
def fused_device_kernel(k: int, accumulator: str) -> Callable[..., Any] | None:
    """The jiterator function summing ``k`` CUDA tensors with weights ``w0=..., w1=...``
    (:func:`fused_source`; NVRTC compiles it at its first call for each dtype, and torch caches
    it), or None where this torch has no jiterator (a private, beta API) or ``k`` is more than
    it takes."""
    if not 1 <= k <= FUSED_MAX_ARRAYS:
        return None
    try:
        from torch.cuda.jiterator import _create_jit_fn
    except ImportError:
        return None
    weights = {f"w{i}": 0.0 for i in range(k)}  # their defaults; each call passes its own
    return cast(Callable[..., Any], _create_jit_fn(fused_source(k, accumulator), **weights))


#: (k, dtype) pairs whose fused kernel failed to compile here: summed by the add_ chain.
_FUSED_FAILED: set[tuple[int, Any]] = set()


def _fused_device_sum(arrays: Sequence[Any], weights: Sequence[float]) -> Any:
    """``sum_i weights[i] * arrays[i]`` in one pass over CUDA tensors (a new tensor), or None
    where no fused kernel serves them (too many arrays, no jiterator, or a kernel that did not
    compile here: said once, in a warning)."""
    import torch

    dtype = arrays[0].dtype
    k = len(arrays)
    kernel = fused_device_kernel(k, "double" if dtype == torch.float64 else "float")
    if kernel is None or (k, dtype) in _FUSED_FAILED:
        return None
    try:
        return kernel(*arrays, **{f"w{i}": w for i, w in enumerate(weights)})
    except RuntimeError as e:  # NVRTC missing or refusing the source: the chain still sums
        _FUSED_FAILED.add((k, dtype))
        warnings.warn(
            f"hetcoll.weighted_sum: the fused CUDA kernel for {k} {dtype} arrays did not compile "
            f"({str(e)[:300]}); summing them with torch's add_ chain instead",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def weighted_sum_device(arrays: Sequence[Any], weights: Sequence[float], *, out: Any = None) -> Any:
    """:func:`weighted_sum` of torch tensors on one non-CPU device, with weighted_sum's argument
    rules (the weights checked by the Rust kernel's own rules; one shape and dtype;
    C-contiguous; ``out`` one of ``arrays`` or disjoint from them; not differentiable, as
    :func:`weighted_sum` says). The sum starts at ``w_j a_j`` (``j``: the array ``out`` is,
    when it is one of them, else 0) and adds ``w_i a_i`` for the others in order, in float32
    for 16-bit types (rounded once into ``out``) and in the tensors' own type otherwise.

    On CUDA, up to :data:`FUSED_MAX_ARRAYS` arrays are summed in one pass by a kernel torch's
    jiterator compiles at its first use (:func:`fused_device_kernel`), copied into ``out`` when
    one is given; otherwise, and where that would move more memory than the chain (one or two
    arrays of 32 or 64 bits summed into ``out``), by torch's ``add_`` chain: ``out = w_j a_j``,
    then ``out += w_i a_i`` (``add_`` with ``alpha``), one pass per array, into a float32
    accumulator for 16-bit types."""
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
    named = [(a, f"arrays[{i}]") for i, a in enumerate(arrays)]
    named += [] if out is None else [(out, "out")]
    for a, name in named:
        if a.dtype != first.dtype:
            raise TypeError(f"{name}: dtype {a.dtype} does not match arrays[0]'s {first.dtype}")
        if a.shape != first.shape:
            raise ValueError(
                f"{name}: has shape {tuple(a.shape)} but arrays[0] has shape {tuple(first.shape)}"
            )
        if not a.is_contiguous():
            raise ValueError(f"{name}: must be C-contiguous")
    same = -1
    if out is not None:
        start, end = out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()
        for i, a in enumerate(arrays):
            lo = a.data_ptr()
            hi = lo + a.numel() * a.element_size()
            if lo == start and hi == end and same < 0:
                same = i  # in-place accumulation: out is this array
            elif a.numel() and out.numel() and lo < end and start < hi:
                raise ValueError(f"arrays[{i}]: overlaps out in memory")
    j = max(same, 0)
    order = [j] + [i for i in range(len(arrays)) if i != j]
    wide = first.dtype in (torch.float16, torch.bfloat16)
    with torch.no_grad():
        # One pass reads k arrays and writes one; into out it is one more pass (a copy), which
        # for one or two arrays of 32 or 64 bits moves as much as the chain or more.
        if first.device.type == "cuda" and (wide or out is None or len(arrays) > 2):
            summed = _fused_device_sum([arrays[i].detach() for i in order], [w[i] for i in order])
            if summed is not None:
                if out is None:
                    return summed
                out.detach().copy_(summed)
                return out
        target = (
            out
            if out is not None
            else torch.empty_like(first, memory_format=torch.contiguous_format)
        )
        t = target.detach()
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
