"""allgatherv for torch tensors that carry gradients: the gradient of a rank's piece is its
slice of the output gradient summed over ranks (a reduce-scatter with uneven counts)."""

from __future__ import annotations

import functools
import math
import sys
from typing import Any

from hetcoll.collectives._common import _kind
from hetcoll.collectives.gather import _gather
from hetcoll.comm import NOT_GIVEN, Communicator, deadline_or_failure, group_argument, wrap
from hetcoll.comm import deadline as deadline_of
from hetcoll.kernels import numpy_view


def allgatherv_autograd(
    tensor: Any, group: Any = None, *, timeout: float | None = None, comm: Any = NOT_GIVEN
) -> Any:
    """:func:`allgatherv` of a torch tensor, differentiable: the gradient of this rank's piece
    is its slice of the output gradient summed over ranks (reduce-scatter with uneven counts).

    For the filter-parallel layers: each rank computes its share of output channels and every
    rank needs all of them.

    >>> y = allgatherv_autograd(local_out, group)  # doctest: +SKIP
    """
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor: must be a torch tensor, got {type(tensor).__name__}")
    group = group_argument(group, "allgatherv_autograd", comm=comm)
    return _AllgathervFn.apply(tensor, wrap(group), timeout)


def exchanging(cls: Any) -> Any:
    """An autograd function that exchanges between the ranks, run as it is under
    ``torch.compile``: its forward and backward are never traced (the graph breaks around
    them). They move bytes through numpy views and the communicator, which a trace cannot
    see: a traced gather took its output for an alias of its input (torchvision's ViT split
    by ``filter_parallel``, then compiled: "setStorage ... out of bounds")."""
    return never_traced_methods("forward", "backward")(cls)


def never_traced_methods(*names: str) -> Any:
    """A class decorator: the methods ``names`` (plain or static) run as they are under
    ``torch.compile``, each ``torch.compiler.disable``-d, the graph breaking around it (an
    exchange between the ranks, a hook that runs probes or agrees with the other ranks:
    nothing a compiled graph holds, and tracing them costs a compile seconds). Bound to their
    objects as before, so a deep copy of a module holding one as a hook copies (or refuses to
    copy) its object.

    Disabling imports torch.compile's tracer (torch._dynamo, a second on a 2-core host), which
    importing hetcoll.torch should not pay: a class made before it is loaded holds a stand-in
    that runs the method as it is, until :func:`disable_pending` puts the disabled method in
    its place (so that a trace meets the disabled method itself, not a stand-in it would
    compile anew for every type of argument)."""

    def decorate(cls: Any) -> Any:
        for name in names:
            raw = cls.__dict__[name]
            static = isinstance(raw, staticmethod)
            fn = raw.__func__ if static else raw

            def install(method: Any, name: str = name, static: bool = static) -> None:
                setattr(cls, name, staticmethod(method) if static else method)

            if "torch._dynamo" in sys.modules:
                import torch

                install(torch.compiler.disable(fn))
            else:
                _PENDING.append((fn, install))
                install(_until_disabled(fn))
        return cls

    return decorate


#: The methods of :func:`never_traced_methods` made before torch.compile's tracer was loaded,
#: each with what puts it in place once disabled (:func:`disable_pending`).
_PENDING: list[tuple[Any, Any]] = []


def _until_disabled(fn: Any) -> Any:
    """The stand-in for ``fn`` until :func:`disable_pending` runs: ``fn`` as it is while the
    tracer is not loaded; once it is, the disabled ``fn`` (and, outside a trace, every pending
    method put in place)."""
    disabled = None

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal disabled
        if disabled is None:
            if "torch._dynamo" not in sys.modules:
                return fn(*args, **kwargs)
            import torch

            disabled = torch.compiler.disable(fn)
            if not torch.compiler.is_compiling():
                disable_pending()
        return disabled(*args, **kwargs)

    return run


def disable_pending() -> None:
    """Load torch.compile's tracer, and put every never-traced method made before it was
    loaded in its place, disabled (:func:`never_traced_methods`). Called where hetcoll builds what a
    compiled model may run (``filter_parallel``, ``expert_parallel``, ``parallelize``): any
    training run loads the tracer anyway (torch.optim does, at the first optimizer made)."""
    import torch

    while _PENDING:
        fn, install = _PENDING.pop()
        install(torch.compiler.disable(fn))


def _make_function() -> Any:
    import torch

    @exchanging
    class AllgathervFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, tensor: Any, comm: Communicator, timeout: float | None) -> Any:
            # A bad timeout is told to the others in the gather's first round (not on MPI).
            deadline, failure = deadline_or_failure(timeout, comm)
            out, ctx.counts = _gather(tensor.detach(), comm, deadline, failure=failure)
            ctx.comm, ctx.timeout = comm, timeout
            ctx.local_shape = tuple(tensor.shape)
            return out

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            comm: Communicator = ctx.comm
            grad = grad.contiguous()
            row = math.prod(ctx.local_shape[1:])
            deadline = deadline_of(ctx.timeout)
            counts = [n * row for n in ctx.counts]
            device = grad.device
            if device.type != "cpu" and comm.engine != "nccl":
                # gloo, MPI: staged through host memory, as the forward's gather was
                # (hetcoll.collectives.device.stage_on_host), like the group's CPU ranks.
                grad = grad.cpu()
            result = torch.empty(ctx.local_shape, dtype=grad.dtype, device=grad.device)
            if grad.device.type != "cpu":
                import torch.distributed as dist

                from hetcoll.comm import TorchRequest

                work = dist.reduce_scatter(
                    result.view(-1),
                    list(grad.view(-1).split(counts)),
                    group=comm.native,
                    async_op=True,
                )
                TorchRequest(work, "reduce_scatter").wait(deadline)
                return result, None, None
            g_view, bf16 = numpy_view(grad, "grad")
            r_view, _ = numpy_view(result, "grad")
            kind = _kind(g_view, bf16)
            comm.ireduce_scatterv(g_view.reshape(-1), r_view.reshape(-1), counts, kind).wait(
                deadline
            )
            return result.to(device), None, None

    return AllgathervFn


class _Lazy:
    """Defers building the autograd Function until torch is needed (numpy users never load it)."""

    fn: Any = None

    def apply(self, *args: Any) -> Any:
        if self.fn is None:
            self.fn = _make_function()
        return self.fn.apply(*args)


_AllgathervFn = _Lazy()
