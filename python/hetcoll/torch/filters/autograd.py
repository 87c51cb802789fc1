"""The communication of a filter-parallel layer, as autograd functions: the copy of a
replicated input to the ranks (its gradient summed), the sum of split-input partial results,
and the allgather of uneven channel slices (its gradient sliced, no communication). On a
counting communicator, what a forward sends counts as ``"activations"`` and what a backward
sends as ``"gradients"``."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hetcoll.collectives import allgatherv, allreduce
from hetcoll.comm import Communicator, deadline
from hetcoll.torch.transport import CountingCommunicator


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


class AgreedForward:
    """Marks the forward of a split model whose inputs every rank has just agreed on
    (:func:`hetcoll.torch.filter_parallel` hooks one agreement onto the model's forward). Its
    layers' reductions then skip their own agreement check (one more exchange per reduction):
    with the inputs and the split agreed, every reduction of that forward, and of its
    backward, has the same length on every rank. Outside such a forward (a layer called on its
    own) each reduction checks, as :func:`hetcoll.allreduce` does by default."""

    def __init__(self) -> None:
        self.depth = 0

    @property
    def active(self) -> bool:
        return self.depth > 0


def needs_check(agreed: AgreedForward | None) -> bool:
    """Whether a reduction must run its own agreement check (no agreed forward is running)."""
    return agreed is None or not agreed.active


def sole_holder(shares: list[int]) -> int | None:
    """The one rank holding every unit of a split (the others hold none), else None: the sum
    of the ranks' partial results is then that rank's, so a broadcast from it replaces the
    reduction (a third to a half of its time on gloo)."""
    holders = [r for r, s in enumerate(shares) if s > 0]
    return holders[0] if len(holders) == 1 else None


def _sum_over_ranks(
    t: torch.Tensor, comm: Communicator, timeout: float | None, check: bool, root: int | None
) -> None:
    """``t <- sum over ranks of t`` in place: a broadcast from ``root`` when only it holds a
    nonzero part (in an agreed forward, on the CPU), else :func:`hetcoll.allreduce`."""
    if root is not None and not check and t.device.type == "cpu" and comm.size > 1:
        comm.ibroadcast(_bytes(t), root).wait(deadline(timeout))
    else:
        allreduce(t, comm, timeout=timeout, check=check)


def _summed(
    t: torch.Tensor,
    comm: Communicator,
    timeout: float | None,
    kind: str,
    check: bool = False,
    root: int | None = None,
) -> torch.Tensor:
    """A contiguous copy of ``t`` summed over the ranks (:func:`_sum_over_ranks`), what it
    sends counted as ``kind`` (``"activations"`` forward, ``"gradients"`` backward): the
    autograd functions' collectives work on copies, so autograd's tensors stay intact."""
    out = t.detach().clone(memory_format=torch.contiguous_format)
    CountingCommunicator.count_as(comm, kind)
    _sum_over_ranks(out, comm, timeout, check, root)
    return out


class SumGradient:
    """A hook on a parameter every rank holds whole but applies to its own heads only (a
    query/key norm over the head dimension inside an attention split by heads): each rank's
    gradient is its heads' part, the hook returns their sum over the ranks, which every rank
    then accumulates, as the unsplit model would. Registered with ``Tensor.register_hook``, it
    runs once per backward, before accumulation, in the same place of every rank's backward
    (the ranks run the same graph). An object rather than a closure, as a copied model's
    hooks must be. With ``rows`` (``(dim, positions)``) only those entries along ``dim`` are
    summed, the rest being the rank's own: the key and value rows every rank holds of a layer
    packing them with its split query heads."""

    def __init__(
        self,
        comm: Communicator,
        timeout: float | None,
        rows: tuple[int, list[int]] | None = None,
    ) -> None:
        self.comm, self.timeout = comm, timeout
        # (dim, the rows' index), built once rather than at every backward.
        self.rows = None if rows is None else (rows[0], torch.tensor(rows[1], dtype=torch.long))

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        g = grad.contiguous().clone()
        CountingCommunicator.count_as(self.comm, "gradients")
        # Its length is the parameter's (or its rows'), the same on every rank (the plan
        # agreed on it).
        if self.rows is None:
            _sum_over_ranks(g, self.comm, self.timeout, check=False, root=None)
            return g
        dim, index = self.rows
        index = index.to(g.device)
        part = g.index_select(dim, index).contiguous()
        _sum_over_ranks(part, self.comm, self.timeout, check=False, root=None)
        return g.index_copy_(dim, index, part)


class CopyToRanks(torch.autograd.Function):
    """Identity forward on a replicated input; backward sums the ranks' partial input gradients
    (each rank's filters contribute their own part of dL/dx)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        comm: Communicator,
        timeout: float | None,
        owner: Any = None,
        check: bool = True,
        root: int | None = None,
    ) -> Any:
        # The backward's reduction checks as the forward did: its length is the input's.
        ctx.comm, ctx.timeout, ctx.owner, ctx.check = comm, timeout, owner, check
        ctx.root = root
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        if ctx.owner is not None:  # a SharedCopy: its copy is used up
            ctx.owner.clear()
        g = _summed(grad, ctx.comm, ctx.timeout, "gradients", ctx.check, ctx.root)
        return g, None, None, None, None, None


class ReduceSum(torch.autograd.Function):
    """Allreduce of the partial sums forward; identity backward (the output gradient is
    replicated, and each rank's partial depends only on its own input slice)."""

    @staticmethod
    def forward(
        ctx: Any,
        partial: torch.Tensor,
        comm: Communicator,
        timeout: Any,
        check: bool = True,
        root: int | None = None,
    ) -> Any:
        return _summed(partial, comm, timeout, "activations", check, root)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return grad, None, None, None, None


class SumEachWay(torch.autograd.Function):
    """Allreduce of partial sums forward, whose total each rank then uses in its own way (a
    norm's sum of squares over features split across the ranks, each rank normalising its
    own): the total's gradient is each rank's part, so the backward sums it too."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, comm: Communicator, timeout: Any) -> Any:
        ctx.comm, ctx.timeout = comm, timeout
        return _summed(partial, comm, timeout, "activations")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return _summed(grad, ctx.comm, ctx.timeout, "gradients"), None, None


class GatherChannels(torch.autograd.Function):
    """Allgather of uneven channel slices along ``dim``; backward keeps this rank's slice of
    the (replicated) output gradient — no communication."""

    @staticmethod
    def forward(
        ctx: Any,
        y: torch.Tensor,
        comm: Communicator,
        counts: list[int],
        offset: int,
        dim: int,
        timeout: float | None,
    ) -> Any:
        ctx.offset, ctx.count, ctx.dim = offset, y.shape[dim], dim
        CountingCommunicator.count_as(comm, "activations")
        # Pieces join along axis 0 in every engine: move the channel dimension there.
        moved = y.detach().movedim(dim, 0).contiguous()
        if y.device.type != "cpu" and comm.engine == "nccl":
            out = allgatherv(moved, comm, timeout=timeout)
        else:
            # Host memory (gloo, MPI): a CUDA rank stages its slice through the host, so that
            # it takes the same exchange as the group's CPU ranks.
            moved = moved.cpu()
            out = torch.empty((sum(counts), *moved.shape[1:]), dtype=y.dtype)
            row = moved[0].numel() * moved.element_size()
            comm.iallgatherv(_bytes(moved), _bytes(out), [c * row for c in counts]).wait(
                deadline(timeout)
            )
            out = out.to(y.device)
        return out.movedim(0, dim).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return grad.narrow(ctx.dim, ctx.offset, ctx.count), None, None, None, None, None
