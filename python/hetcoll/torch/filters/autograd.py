"""The communication of a filter-parallel layer, as autograd functions: the copy of a
replicated input to the ranks (its gradient summed), the sum of split-input partial results,
and the allgather of uneven channel slices (its gradient sliced, no communication). On a
counting communicator, what a forward sends counts as ``"activations"`` and what a backward
sends as ``"gradients"``."""

from __future__ import annotations

import weakref
import zlib
from typing import Any

import numpy as np
import torch

from hetcoll.collectives import allgatherv, allreduce
from hetcoll.collectives.autograd import exchanging
from hetcoll.comm import Communicator, agree, deadline
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
        #: Whether the model's latest forward ran inside a call torch.compile made.
        self.compiled = False
        #: Whether a layer has warned that compiled, it gathers an output it keeps split.
        self.warned_compiled = False

    @property
    def active(self) -> bool:
        return self.depth > 0

    def note_compiled(self, *_: Any) -> None:
        """A forward pre-hook of the split model, traced by torch.compile like the model's own
        code: notes whether this forward runs inside a compiled call. The split layers' forward
        runs as it is, never traced, where ``torch.compiler.is_compiling()`` is False with
        compiled code around it."""
        self.compiled = torch.compiler.is_compiling()


def needs_check(agreed: AgreedForward | None) -> bool:
    """Whether a reduction must run its own agreement check (no agreed forward is running)."""
    return agreed is None or not agreed.active


def in_compiled_forward(agreed: AgreedForward | None) -> bool:
    """Whether a split layer runs inside a call torch.compile made: traced now, or run as it
    is within one, as its forward is (:meth:`AgreedForward.note_compiled`)."""
    return torch.compiler.is_compiling() or (agreed is not None and agreed.compiled)


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
    nonzero part (in an agreed forward, on an engine that moves host memory: a GPU rank's
    tensor goes through the host), else :func:`hetcoll.allreduce`. The choice rests on what
    every rank of the group shares (the split, the engine), never on this rank's device: a GPU
    rank beside CPU ranks that took the reduction while they broadcast would wait for ever."""
    if root is None or check or comm.size == 1 or comm.engine == "nccl":
        allreduce(t, comm, timeout=timeout, check=check)
        return
    host = t if t.device.type == "cpu" else t.cpu()
    comm.ibroadcast(_bytes(host), root).wait(deadline(timeout))
    if host is not t:
        t.copy_(host)


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


class GradientSums:
    """The gradients of the parameters every rank of a split model holds whole but applies
    to its own heads only (a query/key norm over the head dimension inside an attention split
    by heads, T5's table of a position bias per head, the key and value rows every rank holds
    of a layer packing them with its split query heads): each rank's gradient is its heads'
    part, and their sum over the ranks is what every rank accumulates, as the unsplit model
    would.

    The sums are made once a backward has run, all of them, in the order the parameters were
    added, on every rank alike: a hook on each parameter (``Tensor.register_hook``) keeps the
    rank's part and hands autograd zeros in its place, and one callback queued for the end of
    the backward (by the first hook, or the first of the split layers' backward on the same
    communicator to run: :func:`queue_gradient_sums`) sums every part over the ranks and adds
    it to the parameter's gradient (exact: the gradient is its previous value plus the sum, as
    a hook returning the sum would make it). One per communicator (:meth:`of`), so that the
    split models sharing one make their sums in one order.

    Summing where each rank's backward reaches each gradient would not do: the ranks' graphs
    differ where a rank holds no heads of an attention (it runs on empty tensors), so one rank
    may reach a table's gradient before another rank's sum of an input's gradient, and each
    would wait for the other for ever (T5's position bias, its slow rank holding no heads). A
    parameter whose hook did not run on a rank adds zeros there. With ``rows`` (``(dim,
    positions)``) only those entries along ``dim`` are summed, the rest being the rank's
    own. The sums land in ``.grad`` only: ``torch.autograd.grad`` returns zeros for the parts
    summed (the ranks still exchange them, every rank alike).

    A frozen parameter (``requires_grad`` False) is neither exchanged nor given a gradient: a
    fine-tuning run's frozen key and value projections cost nothing. Every rank must freeze
    alike (as DDP also needs): each backward's sums start with one small exchange that raises
    :class:`~hetcoll.CollectiveMismatchError` on every rank where they differ. One frozen
    when it is added has no hooks (torch refuses them); unfrozen later, its gradient would be
    this rank's part alone, so the backward raises ``RuntimeError`` instead."""

    def __init__(self, comm: Communicator, timeout: float | None) -> None:
        # Weak references: the registry (kept by the communicator) keeps neither alive.
        self.comm, self.timeout = weakref.ref(comm), timeout
        self.params: list[weakref.ref[torch.Tensor]] = []
        #: Per parameter: (dim, the rows' index) of the entries summed, None for all.
        self.rows: list[tuple[int, torch.Tensor] | None] = []
        self.parts: dict[int, torch.Tensor] = {}
        #: Per parameter: whether its hooks are registered (not while it was frozen).
        self.hooked: list[bool] = []
        #: The parameters whose gradient this backward accumulated (not ``autograd.grad``'s).
        self.accumulated: set[int] = set()
        self.queued = False

    @classmethod
    def of(cls, comm: Communicator, timeout: float | None) -> GradientSums:
        """The sums of the split models on ``comm`` (made at the first call)."""
        sums = _GRADIENT_SUMS.get(comm)
        if sums is None:
            sums = _GRADIENT_SUMS[comm] = cls(comm, timeout)
        return sums

    @staticmethod
    def trained(comm: Communicator) -> set[int]:
        """The ``id`` of every live parameter requiring a gradient whose gradient the split
        models on ``comm`` sum after each backward (none where no split made sums on it)."""
        sums = _GRADIENT_SUMS.get(comm)
        if sums is None:
            return set()
        return {id(p) for ref in sums.params if (p := ref()) is not None and p.requires_grad}

    def queue(self) -> None:
        """Have this backward end with the sums (once; none where no parameter was added)."""
        if self.params and not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)

    def add(self, param: torch.Tensor, rows: tuple[int, list[int]] | None = None) -> None:
        """Sum ``param``'s gradient over the ranks after each backward (``rows``: only those
        entries along a dimension)."""
        self.params.append(weakref.ref(param))
        self.rows.append(None if rows is None else (rows[0], torch.tensor(rows[1])))
        self.hooked.append(param.requires_grad)
        if param.requires_grad:
            param.register_hook(_KeepPart(self, len(self.params) - 1))
            param.register_post_accumulate_grad_hook(_Accumulated(self, len(self.params) - 1))

    def add_once(self, param: torch.Tensor) -> None:
        """:meth:`add` ``param`` (all its entries) unless it is added already."""
        if not any(ref() is param for ref in self.params):
            self.add(param)

    def keep(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        """The hook of parameter ``index``: keep this rank's part, give autograd zeros there."""
        rows = self.rows[index]
        if rows is None:
            part, left = grad.detach().clone(), torch.zeros_like(grad)
        else:
            dim, at = rows
            at = at.to(grad.device)
            part = grad.detach().index_select(dim, at)
            left = grad.clone().index_fill_(dim, at, 0)
        previous = self.parts.get(index)
        self.parts[index] = part if previous is None else previous + part
        self.queue()
        return left

    def flush(self) -> None:
        """At the end of a backward: every parameter's parts summed over the ranks, in order,
        and added to its gradient."""
        self.queued = False
        parts, self.parts = self.parts, {}
        accumulated, self.accumulated = self.accumulated, set()
        comm = self.comm()
        if comm is None:
            return
        live = [ref() for ref in self.params]
        if all(p is None for p in live):  # their models are gone (on every rank)
            return
        CountingCommunicator.count_as(comm, "gradients")
        # Ranks that froze differently would sum different parameters (a wait for ever, or
        # sums of unrelated gradients): one small exchange, and every rank raises instead.
        frozen = np.array([p is not None and not p.requires_grad for p in live], bool)
        agree(
            comm,
            {
                "the parameters held whole that are frozen (requires_grad False)": int(
                    frozen.sum()
                ),
                "which of the parameters held whole are frozen (crc32)": zlib.crc32(
                    np.packbits(frozen).tobytes()
                ),
            },
            deadline(self.timeout),
        )
        for index, (param, rows) in enumerate(zip(live, self.rows, strict=True)):
            if param is None:  # its model is gone (on every rank)
                continue
            if param.requires_grad and not self.hooked[index]:
                raise RuntimeError(
                    f"model: a parameter of shape {tuple(param.shape)} that the split holds "
                    "whole on every rank, its gradients summed over the ranks, was frozen "
                    "(requires_grad=False) when the model was split and has been unfrozen "
                    "since: its gradient would be this rank's part alone. Unfreeze it before "
                    "splitting the model (freezing after the split is fine)"
                )
            if not param.requires_grad:
                continue  # frozen on every rank: nothing to sum
            part = parts.get(index)
            if part is None:  # not reached on this rank: it adds nothing
                shape = list(param.shape)
                if rows is not None:
                    shape[rows[0]] = len(rows[1])
                part = torch.zeros(shape, dtype=param.dtype, device=param.device)
            part = part.contiguous()
            # Its length is the parameter's (or its rows'), the same on every rank (the plan
            # agreed on it).
            _sum_over_ranks(part, comm, self.timeout, check=False, root=None)
            if index in parts and index not in accumulated:
                continue  # a backward that accumulates nothing (torch.autograd.grad)
            with torch.no_grad():
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                if rows is None:
                    param.grad.add_(part)
                else:
                    dim, at = rows
                    param.grad.index_add_(dim, at.to(part.device), part)


#: Each communicator's :class:`GradientSums` (gone with the communicator).
_GRADIENT_SUMS: weakref.WeakKeyDictionary[Communicator, GradientSums] = weakref.WeakKeyDictionary()


def queue_gradient_sums(comm: Communicator) -> None:
    """Called by every split layer's backward on ``comm``: the backward ends with the sums of
    the whole parameters' gradients (:class:`GradientSums`), on every rank, whether or not a
    rank's backward reached those parameters."""
    sums = _GRADIENT_SUMS.get(comm)
    if sums is not None:
        sums.queue()


class _Accumulated:
    """A parameter's post-accumulation hook for :class:`GradientSums`: its gradient went to
    ``.grad`` in this backward."""

    def __init__(self, sums: GradientSums, index: int) -> None:
        self.sums, self.index = sums, index

    def __call__(self, param: torch.Tensor) -> None:
        self.sums.accumulated.add(self.index)


class _KeepPart:
    """A parameter's hook for :class:`GradientSums` (an object rather than a closure)."""

    def __init__(self, sums: GradientSums, index: int) -> None:
        self.sums, self.index = sums, index

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        return self.sums.keep(self.index, grad)


@exchanging
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
        queue_gradient_sums(ctx.comm)
        if ctx.owner is not None:  # a SharedCopy: its copy is used up
            ctx.owner.clear()
        g = _summed(grad, ctx.comm, ctx.timeout, "gradients", ctx.check, ctx.root)
        return g, None, None, None, None, None


@exchanging
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
        ctx.comm = comm
        return _summed(partial, comm, timeout, "activations", check, root)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        queue_gradient_sums(ctx.comm)
        return grad, None, None, None, None


@exchanging
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
        queue_gradient_sums(ctx.comm)
        return _summed(grad, ctx.comm, ctx.timeout, "gradients"), None, None


@exchanging
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
        ctx.offset, ctx.count, ctx.dim, ctx.comm = offset, y.shape[dim], dim, comm
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
        # Where the channels' move back is no move (one sample; dim 0), contiguous() returns
        # the view itself, which autograd forbids an in-place op after the layer to modify
        # (ReLU(inplace=True)); detached, it is a tensor of its own (no copy: out is ours).
        return out.movedim(0, dim).contiguous().detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        queue_gradient_sums(ctx.comm)
        return grad.narrow(ctx.dim, ctx.offset, ctx.count), None, None, None, None, None
