"""Run a :class:`~hetcoll.plan.Plan`: replicas of any shape × pipeline stages × channel splits.

:func:`parallelize` keeps on each rank only its stage's layers (its channel slice of them in a
filter-split stage, its own channels in an owners stage: :mod:`hetcoll.torch.placement`);
:meth:`Parallel.step` runs one global batch through every replica's micro-batches under the
plan's schedule and combines the gradients exactly.

Why it is exact: each micro-batch's loss is the mean over its rows, scaled by rows / batch, so
the gradients summed over micro-batches and replicas are the gradient of the global batch's mean
loss, whatever the sizes. A parameter a replica holds on one rank contributes its gradient; one
split over a stage's ranks contributes each rank's slice, placed where it belongs in the full
tensor; the sum over replicas then reaches every holder, who keeps its own slice.

What is not exact: layers whose output for a row depends on other rows of the batch. BatchNorm
in training mode normalises each micro-batch by that micro-batch's statistics (and updates its
running statistics once per micro-batch), as torch.distributed.pipelining and DDP do; with one
replica and one micro-batch it is exact. Put such models in ``eval()`` mode, or use GroupNorm /
LayerNorm, when results must equal one process.

The schedule is hetcoll's own rather than torch.distributed.pipelining's: that library sizes
every receive buffer from the first micro-batch (uneven micro-batches are unsupported,
pytorch #126600), runs one rank per stage, and leaves the weighting of unequal replicas to the
user — the three things a heterogeneous plan needs (see docs/architecture.md).
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
import warnings
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np
import torch
from torch import nn
from torch.utils import _pytree as pytree

from hetcoll.collectives.autograd import disable_pending
from hetcoll.comm import agree, fingerprint, start_agreement, wrap, wrap_or_raise
from hetcoll.plan import Plan, Stage
from hetcoll.torch.batches import (
    Items,
    count_items_of,
    counted,
    item_weights,
    items_argument,
)
from hetcoll.torch.clipping import checked_max_norm, scale_to_norm, squares, summed_squares
from hetcoll.torch.expert_parallel import (
    ExpertParallelExperts,
    experts_placement,
    experts_wrappers,
    find_experts,
    placed_parameters,
)
from hetcoll.torch.filters import (
    filter_parallel,
    filter_shares,
    split_layout,
)
from hetcoll.torch.filters.chains import choose_layers
from hetcoll.torch.filters.shards import register_marking, track_optimizers
from hetcoll.torch.layers import model_cut
from hetcoll.torch.loss_scaling import (
    GROUP,
    SCALE_FIELDS,
    SHARDED,
    scale_fields,
    scaler_status,
    scales_agree,
)
from hetcoll.torch.meta_ops import meta_ops
from hetcoll.torch.parallel_checkpoint import (
    PlanCheckpoints,
    keyed_as_the_model,
    keyed_as_the_stage,
    named_as_the_model_in_errors,
)
from hetcoll.torch.parallel_experts import PlanExperts
from hetcoll.torch.placement import (
    Block,
    OwnersStage,
    StepIO,
    check_block_shapes,
    owners_blocks,
)
from hetcoll.torch.replaced import record_replaced
from hetcoll.torch.replay import (
    Flow,
    StageRoles,
    StandIn,
    compiled_call,
    install_output_recorders,
    meta_copy,
    output_recorders,
    probe,
    replay,
    stage_roles,
    tensor_attributes_kept,
)
from hetcoll.torch.stage_inputs import StageInput
from hetcoll.torch.state_dicts import (
    Part,
    few_names,
)
from hetcoll.torch.transport import (
    CountingCommunicator,
    Inbox,
    Transport,
    as_bytes,
    from_bytes,
    transport,
)

__all__ = ["TRAFFIC_KINDS", "Parallel", "parallelize", "schedule_order"]

TRAFFIC_KINDS = ("activations", "gradients", "outputs", "allreduce")
_TAG_ACTIVATION = 7100
_TAG_GRADIENT = 7101


def schedule_order(
    schedule: str, stage: int, num_stages: int, microbatches: int
) -> list[tuple[str, int]]:
    """The order in which a stage runs its micro-batches' forwards ``("F", k)`` and backwards
    ``("B", k)``: GPipe runs every forward, then every backward; 1F1B runs
    ``num_stages - stage - 1`` forwards ahead, then alternates, so a stage holds at most that
    many micro-batches' activations.

    >>> schedule_order("1F1B", 0, 2, 3)
    [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('B', 2)]
    """
    if schedule == "GPipe":
        return [("F", k) for k in range(microbatches)] + [("B", k) for k in range(microbatches)]
    if schedule != "1F1B":
        raise ValueError(f"schedule: must be 'GPipe' or '1F1B', got {schedule!r}")
    warmup = min(num_stages - stage - 1, microbatches)
    order = [("F", k) for k in range(warmup)]
    for k in range(microbatches - warmup):
        order += [("F", warmup + k), ("B", k)]
    order += [("B", k) for k in range(microbatches - warmup, microbatches)]
    return order


@dataclass
class _Piece:
    """Where this rank's copy of one model parameter sits in a reduction's flat buffer."""

    param: torch.Tensor  # this rank's tensor
    offset: int  # where the full parameter starts in the buffer
    part: Part  # where this rank's tensor sits in the full parameter
    contributes: bool  # whether this rank's gradient counts for its replica

    def _full(self, buffer: torch.Tensor) -> torch.Tensor:
        shape = self.part.shape
        return buffer[self.offset : self.offset + math.prod(shape)].view(shape)

    def put(self, buffer: torch.Tensor, t: torch.Tensor) -> None:
        """Place this rank's ``t`` where it belongs in the buffer."""
        self.part.put(self._full(buffer), t)

    def take(self, buffer: torch.Tensor) -> torch.Tensor:
        """This rank's part of the buffer (a copy on the parameter's device, in its dtype)."""
        return self.part.take(self._full(buffer)).to(self.param.device, self.param.dtype, copy=True)

    def summed_any(self, buffer: torch.Tensor) -> torch.Tensor:
        """Whether the whole parameter's sum holds a non-zero entry (a 0-d bool tensor, read
        later: one read for a reduction's pieces). The whole parameter's, not this rank's part:
        every holder decides alike."""
        return self._full(buffer).any()


@dataclass
class _Reduction:
    """Parameters held in several replicas by the same ranks: summed in one buffer."""

    sub: Any  # the holders' sub-group
    pieces: list[_Piece]
    buffer: torch.Tensor  # full-size, reused every step (with room for ``head`` before)
    size: int  # number of holders
    #: Elements before the gradients: where a data-parallel step's sum carries each rank's step
    #: fields (:meth:`Parallel._step_summed`), in the part it sums last; 0 elsewhere.
    head: int = 0
    dense: bool = field(init=False)
    numel: int = field(init=False)  # the gradients' elements

    def __post_init__(self) -> None:
        # Whole parameters, each counted, filling the buffer end to end in order (a
        # data-parallel replica's): their gradients are the buffer's concatenation.
        at = self.head
        dense = True
        for piece in self.pieces:
            dense = dense and piece.part.whole and piece.contributes and piece.offset == at
            at = piece.offset + piece.param.numel()
        self.numel = self.buffer.numel() - self.head
        self.dense = dense and at == self.buffer.numel()

    def gradients(self) -> list[torch.Tensor] | None:
        """The pieces' gradients where they are the buffer's concatenation: dense (above), every
        parameter trained and given a gradient by this rank's backward, contiguous, in the
        buffer's dtype and all on one device. None otherwise: the general road places each
        piece (and zeros where one is missing) and decides on missing ones from the sum."""
        if not self.dense:
            return None
        grads: list[torch.Tensor] = []
        for piece in self.pieces:
            g = piece.param.grad
            if (
                g is None
                or not piece.param.requires_grad
                or g.dtype != self.buffer.dtype
                or (grads and g.device != grads[0].device)
                or g.layout != torch.strided
                or not g.is_contiguous()
            ):
                return None
            grads.append(g)
        return grads

    def match_dtype(self) -> None:
        """A forward may convert its own weights (Switch Transformers' router casts its
        classifier to float32 at each call): the sum runs in a dtype exact for every piece,
        as the holders see them alike."""
        dtype = functools.reduce(torch.promote_types, (q.param.dtype for q in self.pieces))
        if dtype != self.buffer.dtype:
            self.buffer = torch.zeros(self.buffer.numel(), dtype=dtype, device=self.buffer.device)

    def front(self) -> torch.Tensor:
        """The buffer's gradients (after its ``head``)."""
        return self.buffer[self.head :]

    def fill(self) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """This rank's gradients into the buffer, before the sum: returns the flat tensor that
        holds them (:meth:`front`, or a copy beside it on another device) and the gradients
        where they are its concatenation (:meth:`gradients`), else None."""
        self.match_dtype()
        front = self.front()
        grads = self.gradients()
        if grads is None:
            front.zero_()
            for piece in self.pieces:
                g = piece.param.grad
                if piece.contributes and piece.param.requires_grad and g is not None:
                    piece.put(self.buffer, g)
            return front, None
        # One concatenation into the buffer and one copy back into the gradients, not a copy,
        # a check and a fresh tensor per parameter (a GPU rank on gloo: one transfer each way,
        # not one per parameter).
        views = [g.view(-1) for g in grads]
        if grads[0].device == front.device:
            return torch.cat(views, out=front), grads
        flat = torch.cat(views)
        front.copy_(flat)
        return flat, grads

    def unpack(self, flat: torch.Tensor, grads: list[torch.Tensor] | None) -> None:
        """After the sum: each held parameter's ``.grad`` takes its part (``flat`` and
        ``grads`` from :meth:`fill`). A parameter this rank gave a gradient takes the sum; one
        it gave none takes it only if the sum holds a non-zero entry (read once for the
        reduction)."""
        if grads is not None:
            front = self.front()
            if flat.data_ptr() != front.data_ptr():
                flat.copy_(front)
            parts = flat.split([g.numel() for g in grads])
            sums = [t.view_as(g) for t, g in zip(parts, grads, strict=True)]
            torch._foreach_copy_(grads, sums)
            return
        trained = [piece for piece in self.pieces if piece.param.requires_grad]
        unsure = [piece for piece in trained if piece.param.grad is None]
        found = torch.stack([p.summed_any(self.buffer) for p in unsure]).tolist() if unsure else []
        reached = {id(p) for p, any_sum in zip(unsure, found, strict=True) if any_sum}
        for piece in trained:
            if piece.param.grad is not None or id(piece) in reached:
                piece.param.grad = piece.take(self.buffer)


class _Buckets:
    """A larger data-parallel step's gradients' sum (:class:`_Reduction` ``r``, its fields'
    slots in its head) in buckets started during the last backward, as DDP's buckets are: from
    the buffer's end (the last layers, whose gradients come first) to its start, the first
    bucket about ``FIRST_BUCKET_BYTES``, the others ``BUCKET_BYTES``. A hook on each parameter
    (``register_post_accumulate_grad_hook``) copies its gradient into its place once the
    backward has given it; a bucket whose parameters are all in starts its sum, in order. The
    last bucket (the head's, with the first layers) starts after the backward, once the
    rank's fields are known (:meth:`finish`), so a rank whose backward raised still starts
    every bucket, with zeros where it has no gradient, and its flag."""

    def __init__(self, r: _Reduction, tr: Transport) -> None:
        self.r, self.tr = r, tr
        order = sorted(range(len(r.pieces)), key=lambda i: r.pieces[i].offset, reverse=True)
        self.buckets: list[list[int]] = [[]]
        size, limit = 0, FIRST_BUCKET_BYTES
        itemsize = r.buffer.element_size()
        for i in order:
            if size >= limit:
                self.buckets.append([])
                size, limit = 0, BUCKET_BYTES
            self.buckets[-1].append(i)
            size += r.pieces[i].param.numel() * itemsize
        # Each bucket's span of the buffer: from its lowest piece to the next bucket's start
        # (the last one from the head on).
        starts = [min(r.pieces[i].offset for i in b) for b in self.buckets]
        starts[-1] = 0
        ends = [r.buffer.numel(), *starts[:-1]]
        self.spans = list(zip(starts, ends, strict=True))
        self.bucket_of = {
            id(r.pieces[i].param): (b, i) for b, ids in enumerate(self.buckets) for i in ids
        }
        self.armed = self.was_armed = False
        self.check: Callable[[], Any] | None = None
        self.error: BaseException | None = None
        self.ready: set[int] = set()
        self.waiting: list[int] = []
        self.started = 0
        self.handles: list[Any] = []
        for piece in r.pieces:
            piece.param.register_post_accumulate_grad_hook(self._given)

    def reset(self, check: Callable[[], Any]) -> None:
        """At a step's start: ``check`` waits for its batch's check (:func:`start_agreement`),
        before its first sum."""
        self.armed, self.was_armed, self.check, self.error = False, False, check, None
        self.ready = set()
        self.waiting = [len(b) for b in self.buckets]
        self.started, self.handles = 0, []

    def arm(self) -> None:
        """Before the step's last backward (after its last forward, which may convert weights:
        the sum's dtype matched here): its gradients' sums start as they come."""
        self.r.match_dtype()
        self.armed = self.was_armed = True

    def _given(self, param: torch.Tensor) -> None:
        if not self.armed:
            return
        b, i = self.bucket_of[id(param)]
        if i in self.ready:
            return
        piece = self.r.pieces[i]
        if param.grad is not None and piece.param.requires_grad:
            piece.put(self.r.buffer, param.grad)
        else:
            self._zero(i)
        self.ready.add(i)
        self.waiting[b] -= 1
        while self.started < len(self.buckets) - 1 and self.waiting[self.started] == 0:
            if not self._checked():
                return
            self._start(self.started)

    def _zero(self, i: int) -> None:
        piece = self.r.pieces[i]
        self.r.buffer[piece.offset : piece.offset + piece.param.numel()].zero_()

    def _checked(self) -> bool:
        """The batch's check, waited for before the first sum starts (the same moment in
        every rank's sequence of collectives: before any bucket); its error kept for
        :meth:`finish` (raised there on every rank alike), not raised inside the backward."""
        if self.check is not None:
            check, self.check = self.check, None
            try:
                check()
            except BaseException as e:
                self.error = e
                self.armed = False
        return self.error is None

    def _start(self, b: int) -> None:
        lo, hi = self.spans[b]
        self.handles.append(self.tr.iallreduce(self.r.buffer[lo:hi]))
        self.started += 1

    def finish(self, failed: bool, write_head: Callable[[torch.Tensor], None]) -> None:
        """After the rank's work (``failed``: it raised): the buckets not started yet start,
        in order, each parameter not given by the backward placed as it is (zeros where it
        has no gradient, or where the work failed), the head written by ``write_head`` before
        the last; then every sum is waited for. Raises the batch check's error (every rank
        alike, before any sum started) instead."""
        self.armed = False
        self._checked()
        if self.error is not None:
            raise self.error
        if not self.was_armed:
            self.r.match_dtype()  # no backward armed the step: its sum's dtype matched here
        for b in range(self.started, len(self.buckets)):
            for i in self.buckets[b]:
                if i in self.ready:
                    continue
                g = self.r.pieces[i].param.grad
                if failed or g is None or not self.r.pieces[i].param.requires_grad:
                    self._zero(i)
                else:
                    self.r.pieces[i].put(self.r.buffer, g)
            if b == len(self.buckets) - 1:
                write_head(self.r.buffer[: self.r.head])
            self._start(b)
        self.tr.wait(self.handles)
        self.handles = []


def _fingerprint(model: nn.Module) -> int:
    """The model's state names, shapes and dtypes, and which parameters are frozen (they are in
    no gradient sum: :func:`_plan_reductions`), as a number every rank compares."""
    rows = [(k, tuple(v.shape), str(v.dtype)) for k, v in model.state_dict().items()]
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    return zlib.crc32(repr((rows, frozen)).encode())


def _device(model: nn.Module) -> torch.device:
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


class Parallel(PlanCheckpoints, PlanExperts, nn.Module):
    """This rank's part of a model run under a :class:`~hetcoll.plan.Plan` (made by
    :func:`parallelize`). ``parameters()`` are this rank's: any optimizer with an elementwise
    update (SGD, Adam, ...) steps them as the unsplit model's. An idle rank holds one empty
    placeholder parameter, so the same training code runs on every rank (a zero gradient
    every training step: :meth:`~PlanCheckpoints.hold_nothing`). Its ``state_dict()``,
    ``named_parameters()``, ``named_buffers()`` and ``named_modules()`` name tensors and
    layers as the unsplit model does.

    Checkpoints hold the unsplit model's state, so that training resumes under another plan
    (other ranks, other speeds): :meth:`full_state_dict` and :meth:`full_optimizer_state_dict`
    save, :meth:`load_full_state_dict` and :meth:`load_full_optimizer_state_dict` load
    (:mod:`hetcoll.torch.state_dicts`)."""

    def __init__(self) -> None:  # built by parallelize
        super().__init__()
        self.plan: Plan
        self.rank: int
        self.place: tuple[int, int] | None
        self.stage: nn.Module | None = None
        self._loss_fn: Callable[[Any, Any], torch.Tensor]
        self._tr: Transport
        self._device: torch.device
        self._layers_meta: list[nn.Module]
        self._state_layout: list[tuple[str, int, tuple[int, ...], torch.dtype]]
        self._unheld: dict[str, torch.Tensor] = {}  # a chain's state outside its layers
        self._param_names: list[str]  # the model's parameters, in its order
        self._stage_comm: CountingCommunicator | None = None  # a split stage's sub-group
        self._blocks: dict[tuple[int, int], list[Block]] = {}  # owners stages' blocks
        self._reductions: list[_Reduction] = []
        # A larger data-parallel step's bucketed sum (made at its first step), and during a
        # step what its last backward calls first (that sum's arming).
        self._buckets: _Buckets | None = None
        self._last_backward: Callable[[], None] | None = None
        # This rank's copies of the parameters several stages hold that were frozen when the plan
        # was built: in no sum (_plan_reductions), so none may train.
        self._unsummed_frozen: list[tuple[str, torch.Tensor]] = []
        # A blocks model's step: this rank's blocks whose output a later stage reads and that
        # requires a gradient now where the probe's did not (parameters frozen when the plan
        # was built train now): no gradient comes back to it across the cut.
        self._thawed_cuts: list[str] = []
        self._traffic: dict[str, int] = dict.fromkeys(TRAFFIC_KINDS, 0)
        self._shapes: dict[tuple[Any, ...], list[tuple[torch.Size, torch.dtype]]] = {}
        self._items: Items | None = None
        # Without ``items`` a step's weights depend on its plan alone: made once per plan
        # (a plan is replaced, never changed, where its experts move).
        self._row_weights: tuple[Plan, list[list[float]]] | None = None
        self._scaler: Any = None  # during a step that scales its losses: the step's scaler
        # A blocks model (hetcoll.torch.replay): its block names, each replica's stage of every
        # block, which blocks hold no parameters, the probes by micro-batch shape, the model
        # copy a probe runs (this rank's stage, or an idle rank's copy without blocks) and the
        # blocks on the meta device.
        self._kind = "chain"
        self._names: list[str] = []
        self._stage_of: list[list[int]] = []
        self._parameter_free: list[bool] = []
        self._flows: dict[Any, Flow] = {}
        self._skeleton: list[nn.Module] = []  # in a list: not a submodule
        self._meta_blocks: list[nn.Module] = []
        # Canonical parameter names of tied aliases (a head tied to its embedding), and the
        # layer whose stage writes each state-dict entry into a full checkpoint.
        self._alias: dict[str, str] = {}
        self._home: dict[str, int] = {}
        # Expert parallelism (the plan's ``experts``): the experts' parameter names (each
        # rank holds its own experts: summed over no replicas, gathered from every replica),
        # and whether this rank's stage holds experts (its forwards exchange tokens).
        self._experts_names: frozenset[str] = frozenset()
        self._experts_here = False
        self._experts_layers: list[tuple[str, int, int]] = []
        # Its state dicts are keyed by the unsplit model's names, whatever the plan.
        self.register_state_dict_post_hook(keyed_as_the_model)
        self.register_load_state_dict_pre_hook(keyed_as_the_stage)
        self.register_load_state_dict_post_hook(named_as_the_model_in_errors)

    # -- public ----------------------------------------------------------------------------------

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """``nn.Module.named_parameters`` under the unsplit model's names, as its state dict
        keys them: a head tied to its embedding by the model's one name for both (with
        ``remove_duplicate``), an idle rank's placeholder by the name of the parameter it
        holds none of (:meth:`hold_nothing`). Without ``recurse``, also this rank's tied
        parameters whose stage holds them under another name only: torch.distributed.
        checkpoint, which reads each module's own parameters, then knows them by both."""
        lead = f"{prefix}." if prefix else ""
        params = self._own_members(lambda m: m._parameters.items(), recurse, remove_duplicate)
        for name, p in params:
            yield lead + self._model_name(name, remove_duplicate), p
        if not recurse:
            for name, p in self._tied_elsewhere():
                yield lead + name, p

    def named_modules(
        self, memo: set[nn.Module] | None = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Module]]:
        """``nn.Module.named_modules`` with this rank's layers under the unsplit model's names
        (``transformer.h.0.attn``, as :meth:`named_parameters` names their parameters and
        :meth:`get_submodule` finds them): hooks registered by a layer's name reach it on
        whichever rank holds it. The plan's own modules keep theirs: ``stage`` (this rank's
        stage, holding its layers) and the loss function's."""
        lead = f"{prefix}." if prefix else ""
        inner = f"{lead}stage."
        for name, m in super().named_modules(memo, prefix, remove_duplicate):
            yield (lead + name.removeprefix(inner) if name.startswith(inner) else name), m

    def get_submodule(self, target: str) -> nn.Module:
        """``nn.Module.get_submodule``, by the unsplit model's names too (a layer of this
        rank's stage, as :meth:`named_parameters` names its parameters)."""
        try:
            return super().get_submodule(target)
        except AttributeError:
            if self.stage is None or not target:
                raise
            return self.stage.get_submodule(target)

    def get_parameter(self, target: str) -> nn.Parameter:
        """``nn.Module.get_parameter``, by the names :meth:`named_parameters` gives too."""
        for name, p in self.named_parameters():
            if name == target:
                return p
        return super().get_parameter(target)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``nn.Module.named_buffers`` under the unsplit model's names."""
        lead = f"{prefix}." if prefix else ""
        for name, b in self._own_members(lambda m: m._buffers.items(), recurse, remove_duplicate):
            yield lead + self._model_name(name, False), b

    def _held_parameters(self) -> list[nn.Parameter]:
        """Each parameter of this module's tree once, unnamed: what a step sets aside and
        restores, without :meth:`parameters`' walk of every name (it names each as the model
        does), which costs a step several times more."""
        held: dict[nn.Parameter, None] = {}
        modules: list[nn.Module] = [self]
        while modules:
            m = modules.pop()
            for p in m._parameters.values():
                if p is not None:
                    held.setdefault(p)
            modules.extend(c for c in m._modules.values() if c is not None)
        return list(held)

    def _own_members(
        self, members: Callable[[nn.Module], Any], recurse: bool, remove_duplicate: bool
    ) -> Iterator[tuple[str, Any]]:
        """``members`` of each module of this module's own tree (``stage.``...), as
        ``nn.Module.named_parameters`` walks it (each tensor once with ``remove_duplicate``):
        :meth:`_model_name` names them as the model does."""
        seen: set[Any] = set()
        walk = nn.Module.named_modules(self, remove_duplicate=remove_duplicate)
        for path, module in walk if recurse else [("", self)]:
            for key, t in members(module):
                if t is None or t in seen:
                    continue
                if remove_duplicate:
                    seen.add(t)
                yield (f"{path}.{key}" if path else key), t

    def forward(self, *args: Any) -> Any:
        raise TypeError(
            "Parallel runs a whole training step: call par.step(inputs, targets) (collective)"
        )

    def traffic(self) -> dict[str, int]:
        """Bytes this rank sent in the last :meth:`step`, by kind: ``"activations"`` (stage
        outputs forward, a filter-split stage's gathers, an owners stage's feature maps to the
        ranks reading them), ``"gradients"`` (activation gradients backward, a split stage's
        partial-sum reductions, an owners stage's gradient slices to the maps' owners),
        ``"outputs"`` (an owners stage's last-layer outputs gathered at its lead, and their
        gradients sent back) and ``"allreduce"`` (the gradient combination across replicas; a
        collective counts the ``2 (p-1)/p`` of its buffer a ring sends)."""
        return dict(self._traffic)

    def clip_grad_norm_(self, max_norm: float, *, timeout: float | None = None) -> torch.Tensor:
        """After :meth:`step`, clip this rank's gradients to the 2-norm ``max_norm`` of the
        whole model's gradient, as ``torch.nn.utils.clip_grad_norm_`` clips one process's: the
        step's sums leave every holder of a tensor its whole gradient, so each tensor's piece
        counts once, at the rank a full checkpoint takes it from (replica 0's stage holding
        its layer, a split stage's slices and its lead's whole tensors, every replica's own
        experts); the squares are summed over the plan's group, and every rank scales by the
        same ``max_norm / (norm + 1e-6)`` where that is below 1 (``inf``: measure only).
        Collective: every rank, idle ones too. Returns the norm before clipping (float64)."""
        failure: ValueError | None = None
        try:
            limit = checked_max_norm(max_norm)
        except ValueError as e:  # raised on every rank, after the exchange
            failure, limit = e, 0.0
        pieces = []  # each tensor's piece once, where a full checkpoint takes it
        if self.place is not None:
            for name, (t, part) in self._parts().items():
                grad = t.grad if isinstance(t, nn.Parameter) else None
                taken = self.place[0] == 0 or name in self._experts_names
                if grad is not None and taken and self._counts(name, part):
                    pieces.append(grad)
        comm = CountingCommunicator.uncounted(self._tr.comm)
        norm = math.sqrt(summed_squares(comm, squares(pieces), limit, failure, timeout))
        scale_to_norm([q.grad for q in self.parameters() if q.grad is not None], norm, limit)
        return torch.tensor(norm, dtype=torch.float64)

    def step(
        self, inputs: Any, targets: Any, *, scaler: torch.amp.GradScaler | None = None
    ) -> float:
        """Forward and backward of the global batch (the same ``inputs`` and ``targets`` on
        every rank, ``plan.batch`` rows each), gradients combined across replicas into this
        rank's parameters' ``.grad`` (accumulated onto what is there, as ``backward`` does).
        ``inputs`` is a tensor, or for a blocks model (:func:`hetcoll.torch.layers.model_cut`)
        a dict of the forward's keyword arguments (``{"input_ids": ids, "attention_mask":
        mask}``); ``targets`` a tensor or a dict of tensors. Both are cut into micro-batches
        along dim 0. Returns the batch's mean loss (over its items: :func:`parallelize`'s
        ``items``) on every rank. Collective over the group. A step that raises before its
        gradients' sums (a batch the ranks disagree on, a rank whose loss raises) leaves every
        ``.grad`` as it was before it.

        Evaluation: ``par.eval()``, then ``with torch.no_grad(): loss = par.step(x, y)`` on
        every rank (a rank evaluating while others train raises
        :class:`~hetcoll.CollectiveMismatchError` on every rank): the batch's loss, every
        ``.grad`` left as it was. The batch is still ``plan.batch`` rows; each replica
        normalises by its own BatchNorm running statistics (:meth:`full_state_dict` holds the
        first replica's). Any other batch: :meth:`full_state_dict` into the unsplit model.

        Loss scaling (float16 autocast): ``scaler`` a
        :class:`~hetcoll.torch.GroupGradScaler` over the plan's group (either engine), or
        on torch.distributed torch's
        :class:`~torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler` over it, alike
        on every rank (``device`` this rank's device type). The step scales each
        micro-batch's loss before its backward and leaves the gradients scaled; then, as with
        any GradScaler, ``scaler.step(optimizer)`` and ``scaler.update()`` on every rank (and
        ``scaler.unscale_(optimizer)`` before :meth:`clip_grad_norm_`). Its ``unscale_`` sums
        the ranks' overflow flags, so every rank skips the steps any rank's gradients
        overflowed in. The returned loss is unscaled. A plain GradScaler raises: it decides from
        its own rank's gradients, and a plan's stages hold different ones. Ranks whose scales
        differ (a pipeline's stages would unscale what another scaled) raise ``ValueError`` on
        every rank at the step's end."""
        scaling, why_not = scaler_status(scaler, self._tr.comm)
        # Reset in place: a split stage's CountingCommunicator holds this dict and counts into it.
        self._traffic.update(dict.fromkeys(TRAFFIC_KINDS, 0))
        if self._tr.size > 1 and _sends_nothing(self.plan):
            # (A group of one rank sends nothing either way: the step below skips its check
            # and its sum there, with less host work than an agreement's.)
            return self._step_alone(inputs, targets, scaler, scaling, why_not)
        checked = self._check_batch(inputs, targets, scaling, why_not)
        try:
            weights = self._microbatch_weights(targets)
        except BaseException:
            checked()
            raise
        if self._blocks:  # owners stages' shape rules, checked on every rank alike
            checked()
            for (i, j), blocks in self._blocks.items():
                check_block_shapes(
                    blocks,
                    inputs.dim(),
                    self._boundaries(inputs, 1),
                    f"plan.replicas[{i}].stages[{j}]",
                )
        try:
            scale = self._start_scaling(scaler, scaling)
        except BaseException:
            checked()
            raise
        try:
            return self._step(inputs, targets, checked, weights, scale)
        finally:
            self._scaler = None

    def _start_scaling(
        self, scaler: torch.amp.GradScaler | None, scaling: int
    ) -> torch.Tensor | None:
        """The step's loss scale (a tensor, not read), where it scales its losses: on every
        rank, one that computes no loss too, on this rank's device (where ``unscale_`` looks
        for it); the step's micro-batches then scale by ``scaler`` (:meth:`_scaled`)."""
        if scaler is None or scaling not in (SHARDED, GROUP) or not torch.is_grad_enabled():
            return None
        scale = scaler.scale(torch.ones((), dtype=torch.float32, device=self._device))
        self._scaler = scaler
        return scale

    def _set_aside(self) -> dict[nn.Parameter, torch.Tensor | None]:
        """This rank's held parameters' gradients before the step, each ``.grad`` cleared: the
        step's own gradients are summed alone, then added to these (:meth:`_gradients_summed`)
        or, where it raises first, dropped for these (:func:`_put_back`)."""
        kept: dict[nn.Parameter, torch.Tensor | None] = {}
        for p in self._held_parameters():
            kept[p] = p.grad
            p.grad = None
        return kept

    def _step_fields(self, local: torch.Tensor | None, scale: torch.Tensor | None) -> torch.Tensor:
        """What every rank learns at a step's end, as a float64 tensor on this rank's device
        (gathered there, then moved or read once: a CUDA rank's one sync of the step): its
        loss, how many parameters left out of the sums as frozen now train (and blocks whose
        outputs need a gradient no later stage sends back: :attr:`_thawed_cuts`), its scale's
        fields (:func:`scale_fields`; zeros where the step does not scale), whose sum tells
        whether every rank scaled by the same factor."""
        thawed = sum(p.requires_grad for _, p in self._unsummed_frozen) + len(self._thawed_cuts)
        return torch.cat(
            [
                torch.zeros(1, dtype=torch.float64, device=self._device)
                if local is None
                else local.reshape(1).to(self._device, torch.float64),
                torch.full((1,), thawed, dtype=torch.float64, device=self._device),
                torch.zeros(SCALE_FIELDS, dtype=torch.float64, device=self._device)
                if scale is None
                else scale_fields(scale).to(self._device),
            ]
        )

    def _step(
        self,
        inputs: Any,
        targets: Any,
        checked: Callable[[], None],
        weights: list[list[float]],
        scale: torch.Tensor | None,
    ) -> float:
        """:meth:`step` after its batch check started: ``scale`` the loss scale (a tensor, not
        read) where the step scales its losses."""
        kept: dict[nn.Parameter, torch.Tensor | None] = {}
        if self.place is not None:
            kept = self._set_aside()
            try:
                local = self._run(inputs, targets, checked, weights)
            except BaseException:
                _put_back(kept)
                raise
        else:
            if self._kind == "blocks":
                try:
                    self._probe_idle(inputs)
                except BaseException:
                    checked()
                    raise
            checked()
            local = None
        # The step's fields: every rank learns them in one sum over the group, started before
        # the gradients' sums so that it runs beside them (on their own sub-groups), and
        # raises.
        total = self._step_fields(local, scale).to(self._wire_device())
        summing = self._tr.iallreduce(total)
        self._gradients_summed(kept)
        self._tr.wait([summing])
        loss, thawed_anywhere, *scales = total.tolist()
        self._raise_flags(thawed_anywhere, scales)
        return loss

    def _step_alone(
        self,
        inputs: Any,
        targets: Any,
        scaler: torch.amp.GradScaler | None,
        scaling: int,
        why_not: str | None,
    ) -> float:
        """:meth:`step` for a plan whose ranks send nothing before the gradients' sums (every
        replica one rank, no experts: data parallelism), over several ranks. Where one sum
        covers every rank's gradients, the step's fields ride in it (:meth:`_step_summed`):
        every step of a small model is that one collective; a larger model's training step
        checks its batch beside its forwards first. Otherwise the batch's check, the loss's
        sum and the step's flags go in one allgather after this rank's forwards and
        backwards, then the gradients' sums. Either way a rank whose own work raised joins
        them with its error, so that every rank raises; a batch the ranks agree on but the
        plan does not take computes nothing and raises on every rank."""
        fields, bad_batch = self._batch_fields(inputs, targets, scaling, why_not)
        summed = self._reductions[0] if len(self._reductions) == 1 else None
        if summed is not None and summed.head:
            if summed.numel * summed.buffer.element_size() <= ONE_COLLECTIVE_BYTES:
                return self._step_summed(inputs, targets, scaler, scaling, fields, bad_batch)
            if bad_batch is None and torch.is_grad_enabled():
                check = start_agreement(
                    self._tr.comm, fields, values=np.zeros(_STEP_VALUES, dtype=np.int64)
                )
                return self._step_bucketed(inputs, targets, scaler, scaling, fields, check)
        kept, words, failure = self._try_work(inputs, targets, scaler, scaling, bad_batch)
        values = words.cpu().numpy()  # the step's one read
        try:
            # The same collective as the other road's check (start_agreement, as many values):
            # ranks that took different roads (one in no_grad) meet in it and raise.
            rows = start_agreement(self._tr.comm, fields, failure=failure, values=values)()
        except BaseException:
            _put_back(kept)
            raise
        if bad_batch is not None:
            raise bad_batch  # the same on every rank: the fields it follows from agree
        self._gradients_summed(kept)
        return self._step_result(rows)

    def _step_work(
        self, inputs: Any, targets: Any, scaler: torch.amp.GradScaler | None, scaling: int
    ) -> tuple[dict[nn.Parameter, torch.Tensor | None], torch.Tensor]:
        """This rank's forwards and backwards of a data-parallel step: the gradients it set
        aside (:meth:`_set_aside`; on an error, put back before it raises) and its step fields
        (:meth:`_step_fields`) as int64 words on its device, not read: the loss as its float64
        bits, the rest as they are (integers)."""
        kept: dict[nn.Parameter, torch.Tensor | None] = {}
        local = scale = None
        try:
            weights = self._microbatch_weights(targets)
            scale = self._start_scaling(scaler, scaling)
            if self.place is not None:
                kept = self._set_aside()
                local = self._run(inputs, targets, _nothing_to_wait_for, weights)
            elif self._kind == "blocks":
                self._probe_idle(inputs)
            fields = self._step_fields(local, scale)
        except BaseException:
            _put_back(kept)
            raise
        finally:
            self._scaler = None
        return kept, torch.cat([fields[:1].view(torch.int64), fields[1:].to(torch.int64)])

    def _try_work(
        self,
        inputs: Any,
        targets: Any,
        scaler: torch.amp.GradScaler | None,
        scaling: int,
        bad_batch: BaseException | None,
    ) -> tuple[dict[nn.Parameter, torch.Tensor | None], torch.Tensor, Exception | None]:
        """:meth:`_step_work`, or nothing for a batch the plan does not take (``bad_batch``):
        its set-aside gradients, its fields (zeros where it did no work) and its error, kept to
        be told to every rank by the step's collective rather than raised here."""
        failure: Exception | None = None
        if bad_batch is None:
            try:
                kept, words = self._step_work(inputs, targets, scaler, scaling)
                return kept, words, None
            except Exception as e:
                failure = e
        return {}, torch.zeros(_STEP_VALUES, dtype=torch.int64, device=self._device), failure

    def _step_result(self, rows: np.ndarray) -> float:
        """The batch's loss from every rank's step fields (:meth:`_step_work`, one row per
        rank, summed in rank order), after raising where their flags say so."""
        loss = float(np.ascontiguousarray(rows[:, 0]).view(np.float64).sum())
        self._raise_flags(int(rows[:, 1].sum()), rows[:, 2:].sum(axis=0).tolist())
        return loss

    def _step_summed(
        self,
        inputs: Any,
        targets: Any,
        scaler: torch.amp.GradScaler | None,
        scaling: int,
        fields: dict[str, int],
        bad_batch: BaseException | None,
    ) -> float:
        """A small model's data-parallel step: one collective, as DDP's. Its gradients' sum
        carries, before the gradients, each rank's step fields in a slot of its own
        (:func:`_write_slot`): every rank learns every rank's loss, flags, whether its work
        raised and the fingerprint of its batch's fields (:func:`~hetcoll.comm.fingerprint`).
        An evaluation step sums zeros for the gradients, so that a rank evaluating beside
        training ones meets them there. A rank whose work raised joins the sum with zeros and
        its flag; on a failure or a mismatch every rank puts its gradients back and raises
        (told by one agreement)."""
        r = self._reductions[0]
        kept, words, failure = self._try_work(inputs, targets, scaler, scaling, bad_batch)
        training = torch.is_grad_enabled()
        flat, grads = r.buffer, None
        try:
            if training and failure is None and bad_batch is None:
                flat, grads = r.fill()
            else:  # zeros, in the dtype the others sum in
                r.match_dtype()
                r.buffer.zero_()
            slots = r.buffer[: r.head]
            _write_slot(slots, self._tr.rank, failure is not None, fingerprint(fields), words)
            self._tr.allreduce(r.buffer, r.sub)
            failed, digests, rows = _read_slots(slots, self._tr.size)
        except BaseException:
            _put_back(kept)
            raise
        if failed.any() or (digests != digests[0]).any():
            self._raise_told(kept, fields, failure)
        if bad_batch is not None:
            raise bad_batch  # the same on every rank: the fields it follows from agree
        if training:
            self._count_sum(r)
            r.unpack(flat, grads)
        _add_back(kept)
        return self._step_result(rows)

    def _raise_told(
        self,
        kept: dict[nn.Parameter, torch.Tensor | None],
        fields: dict[str, int],
        failure: BaseException | None,
    ) -> NoReturn:
        """After a step's sum told that a rank's work raised, or that the ranks' batches
        differ: every held parameter's gradient put back (``kept``), then one agreement on
        ``fields`` with this rank's ``failure`` raises on every rank (the failing one its
        own error, the others one naming it; or the fields the ranks disagree on)."""
        _put_back(kept)
        agree(self._tr.comm, fields, failure=failure)
        raise AssertionError("a rank's failure was told but not raised")  # pragma: no cover

    def _step_bucketed(
        self,
        inputs: Any,
        targets: Any,
        scaler: torch.amp.GradScaler | None,
        scaling: int,
        fields: dict[str, int],
        check: Callable[[], np.ndarray],
    ) -> float:
        """A larger model's data-parallel training step: its batch's check (``check``, started
        before its forwards, :func:`start_agreement`) runs beside its forwards, and its
        gradients' sum in buckets started during its last backward (:class:`_Buckets`), the
        step's fields in the slots of the last (as :meth:`_step_summed`'s, less the
        fingerprint: the check compared it). Its evaluation steps take the allgather road
        (the same collective as the check), so that a rank evaluating beside training ones
        meets them there."""
        r = self._reductions[0]
        if self._buckets is None:
            self._buckets = _Buckets(r, self._tr)
        buckets = self._buckets
        buckets.reset(check)
        self._last_backward = buckets.arm
        try:
            kept, words, failure = self._try_work(inputs, targets, scaler, scaling, None)
        finally:
            self._last_backward = None

        def write_head(slots: torch.Tensor) -> None:
            _write_slot(slots, self._tr.rank, failure is not None, 0, words)

        try:
            buckets.finish(failure is not None, write_head)
            failed, _, rows = _read_slots(r.buffer[: r.head], self._tr.size)
        except BaseException:
            _put_back(kept)
            raise
        if failed.any():
            self._raise_told(kept, fields, failure)
        self._count_sum(r)
        grads, front = r.gradients(), r.front()
        if grads is not None and grads[0].device != front.device:
            front = torch.empty_like(front, device=grads[0].device)  # filled by unpack
        r.unpack(front, grads)
        _add_back(kept)
        return self._step_result(rows)

    def _probe_idle(self, inputs: Any) -> None:
        """On an idle rank of a blocks model: the probe the working ranks run on the step's
        first micro-batch, so that it raises the same errors they do."""
        self._flow(_rows(inputs, slice(0, self.plan.microbatch_sizes(0)[0])))

    def _gradients_summed(self, kept: dict[nn.Parameter, torch.Tensor | None]) -> None:
        """After a step's forwards and backwards: the replicas' gradients summed
        (:meth:`_combine`), added to what each held parameter had before the step (``kept``);
        an idle rank's placeholder given its zero gradient."""
        if self.place is not None:
            if torch.is_grad_enabled():  # on every rank alike: the batch's check agreed on it
                self._combine()
            _add_back(kept)
        idle = self._parameters.get("idle")
        if idle is not None and torch.is_grad_enabled():
            # The placeholder steps with the model (a zero gradient every training step), so its
            # optimizer state counts the steps the parameter it stands for took: an Adam
            # placeholder's ``step`` is written beside that parameter's (hold_nothing).
            idle.grad = torch.zeros_like(idle)

    def _raise_flags(self, thawed_anywhere: float, scales: list[float]) -> None:
        """Raise, on every rank alike, where the step's summed fields (:meth:`_step_fields`)
        say the ranks scaled by different factors or a parameter left out of every sum trains
        now."""
        if not scales_agree(scales, self._tr.size):
            raise ValueError(
                "scaler: the ranks' loss scales differ, so a stage would unscale gradients "
                "another scaled by another factor: give every rank the same scaler settings "
                "(init_scale, growth and backoff) and call scaler.step and scaler.update on "
                "every rank each step"
            )
        if thawed_anywhere:
            thawed = [n for n, p in self._unsummed_frozen if p.requires_grad]
            if thawed:
                raise ValueError(
                    "parameters held by several stages were frozen (requires_grad False) when "
                    "parallelize built the plan, so their gradients are summed over no replica "
                    f"or stage, and now they require gradients ({', '.join(thawed)}): unfreeze "
                    "them before parallelize, or parallelize again"
                )
            if not self._thawed_cuts:
                raise ValueError(
                    "parameters frozen (requires_grad False) when parallelize built the plan "
                    "require gradients now, on other ranks, and the plan carries none to them "
                    "(summed over no replica or stage, or sent back across no cut): unfreeze "
                    "them before parallelize, or parallelize again"
                )
            assert self.place is not None  # only a stage's blocks find _thawed_cuts
            blocks = ", ".join(f"block {b!r}" for b in self._thawed_cuts)
            raise ValueError(
                "parameters were frozen (requires_grad False) when parallelize built the plan, "
                f"so the output of {blocks} ({self._where(self.place[0])(self.place[1])}) "
                "required no gradient and the later stages reading it send none back; it "
                "requires one now: unfreeze them before parallelize, or parallelize again"
            )

    def extra_repr(self) -> str:
        if self.place is None:
            return f"rank={self.rank}, idle"
        i, j = self.place
        s = self.plan.replicas[i].stages[j]
        return f"rank={self.rank}, replica={i}, stage={j}, layers={list(s.layers)}"

    # -- a step -----------------------------------------------------------------------------------

    def _batch_fields(
        self, inputs: Any, targets: Any, scaling: int, why_not: str | None
    ) -> tuple[dict[str, int], BaseException | None]:
        """What every rank must agree on about a step's batch, and what is wrong with it on this
        rank, if anything: an error that follows from those fields, so the same on every rank
        once they agree."""
        keyed = self._kind == "blocks"
        rows_in, why_in = _batch_rows(inputs, "inputs", keyed)
        rows_t, why_t = _batch_rows(targets, "targets", True)
        fields = {
            "the number of input rows": rows_in,
            "the number of target rows": rows_t,
            "the input's shape": zlib.crc32(repr(_signature(inputs, 1)).encode()),
            # An evaluation step (eval(), no_grad) on every rank or on none.
            "the plan's mode (1: train(), 0: eval())": int(self.training),
            "gradients (1: enabled, 0: no_grad or inference_mode)": int(torch.is_grad_enabled()),
            "loss scaling (0: no scaler, 1: a ShardedGradScaler, 2: a scaler that cannot run, "
            "3: a GroupGradScaler)": scaling,
        }
        if why_not is not None:
            return fields, TypeError(why_not)
        for why in (why_in, why_t):
            if why is not None:
                return fields, why
        for name, rows in (("inputs", rows_in), ("targets", rows_t)):
            if rows != self.plan.batch:
                return fields, ValueError(
                    f"{name}: the plan's replicas take {self.plan.batch} samples a step "
                    f"({' + '.join(str(r.samples) for r in self.plan.replicas)}), got "
                    f"{rows} rows"
                )
        return fields, None

    def _check_batch(
        self, inputs: Any, targets: Any, scaling: int, why_not: str | None
    ) -> Callable[[], None]:
        """Start checking with every rank that the batch is the plan's and the same shape
        everywhere (:meth:`_batch_fields`): one small allgather, not waited for. The returned
        function waits for it (once) and raises the same error on every rank. Until it has
        returned a rank may compute but must not communicate: a replica's first stage runs its
        first forwards meanwhile, so the check costs the step nothing when the ranks reach it
        at different moments."""
        fields, bad_batch = self._batch_fields(inputs, targets, scaling, why_not)
        started = start_agreement(self._tr.comm, fields)
        done = False

        def wait() -> None:
            nonlocal done
            if done:
                return
            done = True
            started()
            if bad_batch is not None:
                raise bad_batch

        return wait

    def _boundaries(self, inputs: torch.Tensor, rows: int) -> list[tuple[torch.Size, torch.dtype]]:
        """Shape and dtype after every layer for a micro-batch of ``rows``, from a run on the
        meta device (no memory, no compute)."""
        key = (tuple(inputs.shape[1:]), inputs.dtype, rows)
        if key not in self._shapes:
            x = torch.empty((rows, *inputs.shape[1:]), dtype=inputs.dtype, device="meta")
            out: list[tuple[torch.Size, torch.dtype]] = []
            with torch.no_grad(), meta_ops():
                for layer in self._layers_meta:
                    x = layer(x)
                    if not isinstance(x, torch.Tensor):
                        raise ValueError(
                            f"model: layer {len(out)} returns a {type(x).__name__}; stage "
                            "boundaries must carry one tensor"
                        )
                    out.append((x.shape, x.dtype))
            self._shapes[key] = out
        return self._shapes[key]

    def _run(
        self, inputs: Any, targets: Any, checked: Callable[[], None], weights: list[list[float]]
    ) -> torch.Tensor | None:
        """This rank's forwards and backwards of the step; ``checked`` waits for the batch
        check (:meth:`_check_batch`) and is called before anything is sent or received.
        Returns its micro-batches' losses summed (:func:`_summed_loss`) where it computes them
        (a replica's last stage's lead), else None."""
        assert self.place is not None and self.stage is not None
        i, j = self.place
        plan, tr = self.plan, self._tr
        replica = plan.replicas[i]
        stage = replica.stages[j]
        first, last = j == 0, j == len(replica.stages) - 1
        lead = self.rank == stage.ranks[0]
        prev = replica.stages[j - 1] if not first else None
        nxt = replica.stages[j + 1] if not last else None
        sizes = plan.microbatch_sizes(i)
        start = sum(r.samples for r in plan.replicas[:i])
        offsets = [start + sum(sizes[:k]) for k in range(len(sizes))]
        comm = self._stage_comm
        wire = self._wire_device()
        sends: list[Any] = []
        saved: dict[int, tuple[StageInput | None, torch.Tensor]] = {}
        loss_sum: torch.Tensor | None = None

        def send(t: torch.Tensor, to: list[int], tag: int, kind: str, dtype: Any = None) -> None:
            checked()
            t = t.detach().to(wire, dtype=dtype).contiguous()
            for r in to:
                sends.append(tr.isend(t, r, tag))
                self._traffic[kind] += t.numel() * t.element_size()

        def set_kind(kind: str) -> None:
            if comm is not None:
                comm.kind = kind

        # The ranks that read the next stage's input (all of its ranks, or an owners stage's
        # first-block owners) and those that send back its gradient (summed in rank order).
        readers = self._input_readers(i, j + 1) if nxt is not None else []
        grad_sources = readers if (i, j + 1) in self._blocks else readers[:1]
        schedule = self._schedule(i)
        if stage.owners is not None:
            return self._run_owners(
                inputs, targets, checked, offsets, sizes, readers, grad_sources, weights[i]
            )
        if self._kind == "blocks":
            return self._run_blocks(inputs, targets, checked, offsets, sizes, weights[i])

        # A single-rank first stage computes its first forwards while the batch check is in
        # flight; every other stage communicates from its first forward on (a stage holding
        # experts exchanges tokens in it).
        if not (first and comm is None and not self._experts_here):
            checked()
        ops = list(schedule_order(schedule, j, len(replica.stages), len(sizes)))
        last_backward = _last_of(ops, "B")

        def messages(n: int) -> list[tuple[torch.Tensor, int, int]]:
            op, k = ops[n]
            if op == "F" and prev is not None:
                shape, dtype = self._boundaries(inputs, sizes[k])[stage.layers[0] - 1]
                return [
                    (torch.empty(shape, dtype=dtype, device=wire), prev.ranks[0], _TAG_ACTIVATION)
                ]
            if op == "B" and not last:
                shape, dtype = self._boundaries(inputs, sizes[k])[stage.layers[1] - 1]
                return [
                    (torch.empty(shape, dtype=dtype, device=wire), r, _TAG_GRADIENT)
                    for r in grad_sources
                ]
            return []

        inbox = Inbox(tr, len(ops), messages, checked)
        try:
            for n, (op, k) in enumerate(ops):
                rows = slice(offsets[k], offsets[k] + sizes[k])
                got = inbox.take(n)
                if op == "F":
                    set_kind("activations")
                    if first:
                        x = inputs[rows].to(self._device)
                        x_in: StageInput | None = None
                    else:
                        x_in = StageInput(got[0].to(self._device))
                        x = x_in.tensor
                    y = self.stage(x)
                    if last:
                        loss = self._loss(y, _rows(targets, rows), weights[i][k])
                        loss_sum = _summed_loss(loss_sum, loss)
                        saved[k] = (x_in, self._scaled(loss))
                    else:
                        if lead:
                            # On the wire in the boundary's own dtype (the receiver's
                            # buffer), whatever autocast computed it in.
                            out_dtype = self._boundaries(inputs, sizes[k])[stage.layers[1] - 1][1]
                            send(y, readers, _TAG_ACTIVATION, "activations", out_dtype)
                        saved[k] = (x_in, y)
                else:
                    set_kind("gradients")
                    x_in, y = saved.pop(k)
                    if last:
                        if n == last_backward and self._last_backward is not None:
                            self._last_backward()
                        if y.requires_grad:
                            y.backward()
                    else:
                        grad = self._gradient_sum(got)
                        if y.requires_grad:
                            torch.autograd.backward(y, grad)
                    if x_in is not None and lead:
                        assert prev is not None
                        send(x_in.grad(), self._output_ranks(i, j - 1), _TAG_GRADIENT, "gradients")
        except BaseException:
            checked()  # a batch the ranks disagree on raises that, the same on every rank
            raise
        checked()
        tr.wait(sends)
        return loss_sum if last and lead else None

    def _loss(self, output: Any, targets: Any, weight: float) -> torch.Tensor:
        """A micro-batch's loss scaled by its share of the batch's items; a micro-batch without
        items contributes nothing (its mean loss is undefined) and is not backpropagated, but
        where experts sit on the stage: its backward still meets the other replicas' at the
        experts' exchanges, carrying zeros."""
        if weight == 0.0:
            if self._experts_here:
                leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
                return sum((t.sum() * 0.0 for t in leaves if t.requires_grad), torch.zeros(()))
            return torch.zeros((), dtype=torch.float64)
        on_device = (  # a tensor, the common case, without a tree's walk
            self._on_device(targets)
            if isinstance(targets, torch.Tensor)
            else pytree.tree_map(self._on_device, targets)
        )
        loss = self._loss_fn(output, on_device)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(
                "loss_fn: must return a one-element tensor (the micro-batch's mean loss)"
            )
        return loss * weight

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """What a micro-batch's backward starts from: its loss, times the step's loss scale
        where it has a scaler."""
        return loss if self._scaler is None else self._scaler.scale(loss)

    def _on_device(self, t: Any) -> Any:
        return t.to(self._device) if isinstance(t, torch.Tensor) else t

    def _microbatch_weights(self, targets: Any) -> list[list[float]]:
        """Each replica's micro-batches' shares of the batch's items, by hetcoll's one weight
        rule (:func:`hetcoll.torch.batches.item_weights`): ``items(targets)`` of the
        micro-batch over the batch's (rows when ``items`` is None). The same on every rank
        (every rank holds the batch), so a bad count raises on every rank."""
        if self._items is None and self._row_weights is not None:
            plan, weights = self._row_weights
            if plan is self.plan:
                return weights
        sizes = [self.plan.microbatch_sizes(i) for i in range(len(self.plan.replicas))]
        if self._items is None:
            counts = [counted(n) for row in sizes for n in row]
        else:
            # Every micro-batch's count at once: a GPU's counts are read in one transfer.
            starts = list(itertools.accumulate((n for row in sizes for n in row), initial=0))
            spans = list(itertools.pairwise(starts))
            counts = count_items_of(self._items, [_rows(targets, slice(*s)) for s in spans])
            for (a, b), c in zip(spans, counts):
                if c.failure is not None:
                    raise ValueError(
                        f"items: for rows {a}:{b} of the batch: {c.failure}"
                    ) from c.failure
            if sum(c.value for c in counts) == 0:
                raise ValueError("items: the batch has no items (items(targets) is 0)")
        flat = item_weights(np.array([c.exchanged for c in counts], np.int64)).tolist()
        out, at = [], 0
        for row in sizes:
            out.append(flat[at : at + len(row)])
            at += len(row)
        if self._items is None:
            self._row_weights = (self.plan, out)
        return out

    def _flow(self, inputs: Any) -> Flow:
        """The probe (:func:`hetcoll.torch.replay.probe`) of a micro-batch of this shape, and
        every stage's roles checked, the same on every rank. Kept per shape, and apart for
        steps under ``torch.inference_mode()``: there nothing requires a gradient, its probe's
        ``enable_grad`` notwithstanding, so its outputs' ``requires_grad`` (what a training
        step sends back across a cut) would all be False for the training steps after it."""
        key = (_signature(inputs, 0), torch.is_inference_mode_enabled())
        if key not in self._flows:
            model = self.stage if self.stage is not None else self._skeleton[0]
            with torch.no_grad(), tensor_attributes_kept(model):  # the step runs it, once
                flow = probe(
                    model, self._names, self._meta_blocks, pytree.tree_map(self._on_device, inputs)
                )
            for i, stage_of in enumerate(self._stage_of):
                for j in range(max(stage_of) + 1):
                    stage_roles(
                        flow, self._names, stage_of, j, self._parameter_free, self._where(i)
                    )
            self._flows[key] = flow
        return self._flows[key]

    def _roles(self, flow: Flow, replica: int, stage: int) -> StageRoles:
        """A stage's roles for the blocks (:func:`hetcoll.torch.replay.stage_roles`), kept
        with the probe they come from."""
        key = (replica, stage)
        if key not in flow.roles:
            stage_of, free = self._stage_of[replica], self._parameter_free
            flow.roles[key] = stage_roles(
                flow, self._names, stage_of, stage, free, self._where(replica)
            )
        return flow.roles[key]

    def _where(self, replica: int) -> Callable[[int], str]:
        return lambda j: f"plan.replicas[{replica}].stages[{j}]"

    def _run_blocks(
        self,
        inputs: Any,
        targets: Any,
        checked: Callable[[], None],
        offsets: list[int],
        sizes: list[int],
        weights: list[float],
    ) -> torch.Tensor | None:
        """:meth:`_run` for a blocks model: each micro-batch's forward replays the model around
        the stage's blocks (:func:`hetcoll.torch.replay.replay`); the outputs of blocks a later
        stage reads go to that stage's ranks, their gradients come back."""
        assert self.place is not None and self.stage is not None
        i, j = self.place
        replica = self.plan.replicas[i]
        stage = replica.stages[j]
        last = j == len(replica.stages) - 1
        lead = self.rank == stage.ranks[0]
        stage_of = self._stage_of[i]
        tr, wire, comm = self._tr, self._wire_device(), self._stage_comm
        sends: list[Any] = []
        saved: dict[int, tuple[dict[int, list[StageInput]], Any, StageRoles, Flow]] = {}
        loss_sum: torch.Tensor | None = None

        def send(t: torch.Tensor, to: list[int], tag: int, kind: str) -> None:
            checked()
            t = t.detach().to(wire).contiguous()
            for r in to:
                sends.append(tr.isend(t, r, tag))
                self._traffic[kind] += t.numel() * t.element_size()

        def set_kind(kind: str) -> None:
            if comm is not None:
                comm.kind = kind

        def tensors(value: Any) -> list[torch.Tensor]:
            return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]

        if not (j == 0 and comm is None and not self._experts_here):  # as in _run
            checked()
        ops = list(schedule_order(self._schedule(i), j, len(replica.stages), len(sizes)))
        last_backward = _last_of(ops, "B")
        probes: dict[int, tuple[Any, Flow, StageRoles]] = {}
        # Under no_grad (an evaluation step, on every rank: the batch's check) no input
        # carries a gradient (StageInput), so none travels back.
        gradients = torch.is_grad_enabled()
        self._thawed_cuts = []

        def probed(k: int) -> tuple[Any, Flow, StageRoles]:
            """Micro-batch ``k``'s inputs, probe and roles, looked up once for its forward,
            its backward and the receives posted ahead of them."""
            if k not in probes:
                batch_in = _rows(inputs, slice(offsets[k], offsets[k] + sizes[k]))
                flow = self._flow(batch_in)
                probes[k] = (batch_in, flow, self._roles(flow, i, j))
            return probes[k]

        def messages(n: int) -> list[tuple[torch.Tensor, int, int]]:
            op, k = ops[n]
            _, flow, roles = probed(k)
            out = []
            if op == "F":
                for b in roles.receives:
                    source = replica.stages[stage_of[b]].ranks[0]
                    for leaf in flow.tensors(b):
                        buf = torch.empty(leaf.shape, dtype=leaf.dtype, device=wire)
                        out.append((buf, source, _TAG_ACTIVATION))
            elif not last and gradients:
                for b, readers in roles.sends.items():
                    for leaf in flow.tensors(b):
                        if leaf.requires_grad:
                            for s in readers:
                                buf = torch.empty(leaf.shape, dtype=leaf.dtype, device=wire)
                                out.append((buf, replica.stages[s].ranks[0], _TAG_GRADIENT))
            return out

        inbox = Inbox(tr, len(ops), messages, checked)
        try:
            for n, (op, k) in enumerate(ops):
                rows = slice(offsets[k], offsets[k] + sizes[k])
                got = iter(inbox.take(n))  # this operation's messages, in order
                if op == "F":
                    set_kind("activations")
                    batch_in, flow, roles = probed(k)
                    received: dict[int, list[StageInput]] = {
                        b: [
                            StageInput(next(got).to(self._device), leaf.requires_grad)
                            for leaf in flow.tensors(b)
                        ]
                        for b in roles.receives
                    }
                    output, captured = replay(
                        self.stage,
                        self._names,
                        pytree.tree_map(self._on_device, batch_in),
                        flow,
                        roles,
                        {
                            b: flow.rebuild(b, [s.tensor for s in ins])
                            for b, ins in received.items()
                        },
                        self._device,
                    )
                    if last:
                        loss = self._loss(output, _rows(targets, rows), weights[k])
                        loss_sum = _summed_loss(loss_sum, loss)
                        saved[k] = (received, self._scaled(loss), roles, flow)
                    else:
                        for b in roles.sends if gradients else ():
                            # Gradients cross a cut where the probe's output required one
                            # (what the meta blocks' parameters required when the plan was
                            # built): an output that requires one only now gets none; the
                            # step's end raises, on every rank (_raise_flags).
                            stale = zip(flow.tensors(b), tensors(captured[b]), strict=True)
                            if self._names[b] not in self._thawed_cuts and any(
                                t.requires_grad and not leaf.requires_grad for leaf, t in stale
                            ):
                                self._thawed_cuts.append(self._names[b])
                        if lead:  # in the probe's dtypes, whatever autocast computed them in
                            for b, readers in roles.sends.items():
                                for leaf, t in zip(
                                    flow.tensors(b), tensors(captured[b]), strict=True
                                ):
                                    t = t.to(leaf.dtype)
                                    for s in readers:
                                        send(
                                            t,
                                            list(replica.stages[s].ranks),
                                            _TAG_ACTIVATION,
                                            "activations",
                                        )
                        saved[k] = (received, captured, roles, flow)
                else:
                    set_kind("gradients")
                    received, y, roles, flow = saved.pop(k)
                    if last:
                        if n == last_backward and self._last_backward is not None:
                            self._last_backward()
                        if y.requires_grad:
                            y.backward()
                    else:
                        outs, grads = [], []
                        for b, readers in roles.sends.items():
                            for leaf, t in zip(flow.tensors(b), tensors(y[b]), strict=True):
                                if not (leaf.requires_grad and gradients):
                                    continue
                                total = self._gradient_sum([next(got) for _ in readers])
                                if t.requires_grad:
                                    outs.append(t)
                                    grads.append(total)
                        if outs:
                            grads = [g.to(t.dtype) for t, g in zip(outs, grads, strict=True)]
                            torch.autograd.backward(outs, grads)
                    if lead:
                        for b, inputs_of_b in received.items():
                            to = list(replica.stages[stage_of[b]].ranks)
                            for inbound in inputs_of_b:
                                if inbound.requires_grad:
                                    send(inbound.grad(), to, _TAG_GRADIENT, "gradients")
        except BaseException:
            checked()
            raise
        checked()  # a stage that sent and received nothing has not waited for it yet
        tr.wait(sends)
        return loss_sum if last and lead else None

    def _schedule(self, replica: int) -> str:
        """The plan's schedule, or GPipe for a replica holding an owners stage (whose ranks
        run every forward before any backward: see :mod:`hetcoll.torch.placement`)."""
        if any(
            (replica, j) in self._blocks for j in range(len(self.plan.replicas[replica].stages))
        ):
            return "GPipe"
        return self.plan.schedule

    def _input_readers(self, replica: int, stage: int) -> list[int]:
        """The ranks that receive a stage's input: its first block's owners in an owners
        stage, else every rank of the stage."""
        if (replica, stage) in self._blocks:
            return self._blocks[replica, stage][0].owner_ranks
        return list(self.plan.replicas[replica].stages[stage].ranks)

    def _output_ranks(self, replica: int, stage: int) -> list[int]:
        """The ranks that take the gradient of a stage's output: every rank of a stage
        (a filter-split stage's ranks each backpropagate), an owners stage's lead only."""
        ranks = self.plan.replicas[replica].stages[stage].ranks
        return [ranks[0]] if (replica, stage) in self._blocks else list(ranks)

    def _gradient_sum(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Gradients of one output received from its readers, summed in the readers'
        (increasing rank) order on this rank's device, in the dtype they travelled in (under
        autocast the boundary's own, not the 16-bit one the output was computed in: autograd
        casts it back)."""
        # The received buffers are this step's own: the first one holds the sum (no zeros).
        total = parts[0].to(self._device)
        for part in parts[1:]:
            total += part.to(self._device)
        return total

    def _recv_sum(
        self, like: torch.Tensor, sources: list[int], tag: int, dtype: Any = None
    ) -> torch.Tensor:
        """A tensor shaped as ``like`` received from each of ``sources`` (all in flight at
        once) and summed as :meth:`_gradient_sum` sums, in ``dtype`` (default ``like``'s)."""
        dtype = like.dtype if dtype is None else dtype
        bufs = [torch.empty(like.shape, dtype=dtype, device=self._wire_device()) for _ in sources]
        self._tr.wait([self._tr.irecv(b, r, tag) for b, r in zip(bufs, sources, strict=True)])
        return self._gradient_sum(bufs)

    def _run_owners(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        checked: Callable[[], None],
        offsets: list[int],
        sizes: list[int],
        readers: list[int],
        grad_sources: list[int],
        weights: list[float],
    ) -> torch.Tensor | None:
        """:meth:`_run` for an owners stage (:class:`hetcoll.torch.placement.OwnersStage`)."""
        assert self.place is not None and isinstance(self.stage, OwnersStage)
        i, j = self.place
        replica = self.plan.replicas[i]
        stage = replica.stages[j]
        first, last = j == 0, j == len(replica.stages) - 1
        tr, wire = self._tr, self._wire_device()
        prev = replica.stages[j - 1] if not first else None
        sends: list[Any] = []
        loss_sum: torch.Tensor | None = None

        def rows(m: int) -> slice:
            return slice(offsets[m], offsets[m] + sizes[m])

        def send(t: torch.Tensor, to: int, tag: int, kind: str) -> None:
            t = t.detach().to(wire).contiguous()
            sends.append(tr.isend(t, to, tag))
            self._traffic[kind] += t.numel() * t.element_size()

        def stage_input(m: int) -> torch.Tensor:
            if first:
                return inputs[rows(m)].to(self._device)
            assert prev is not None
            shape, dtype = self._boundaries(inputs, sizes[m])[stage.layers[0] - 1]
            buf = torch.empty(shape, dtype=dtype, device=wire)
            tr.recv(buf, prev.ranks[0], _TAG_ACTIVATION)
            return buf.to(self._device)

        def input_grad(m: int, g: torch.Tensor) -> None:
            for r in self._output_ranks(i, j - 1):
                send(g, r, _TAG_GRADIENT, "gradients")

        def finish(m: int, out: torch.Tensor) -> torch.Tensor:
            if not last:
                for r in readers:
                    send(out, r, _TAG_ACTIVATION, "activations")
                return out
            nonlocal loss_sum
            loss = self._loss(out, _rows(targets, rows(m)), weights[m])
            loss_sum = _summed_loss(loss_sum, loss)
            return self._scaled(loss)

        def output_grad(m: int, end: torch.Tensor) -> torch.Tensor | None:
            return None if last else self._recv_sum(end, grad_sources, _TAG_GRADIENT)

        io = StepIO(
            micro_batches=len(sizes),
            input_dim=inputs.dim(),
            boundary=lambda m: self._boundaries(inputs, sizes[m]),
            stage_input=stage_input,
            input_grad=None if first else input_grad,
            finish=finish,
            output_grad=output_grad,
            send=send,
            recv=tr.recv,
            device=self._device,
            wire=wire,
        )
        checked()
        self.stage.run(io)
        tr.wait(sends)
        return loss_sum if last and self.rank == stage.ranks[0] else None

    def _combine(self) -> None:
        """Sum the replicas' gradients: one flat buffer per set of holders and dtype. A
        parameter frozen when the plan was built is in no buffer (as DDP's buckets leave it
        out). One frozen since (``requires_grad`` False now; every rank freezes alike, as DDP
        needs) adds nothing and is given no gradient, as one process gives it none: a zero
        gradient would have an optimizer's weight decay move it. So is one whose
        sum is all zeros and that had none (no replica's backward reached it: an expert given
        no tokens in any replica, whose gradient one process leaves None, as DDP leaves a
        parameter unused on every rank); one that had a gradient (zeros, after
        ``zero_grad(set_to_none=False)``) gets the sum."""
        for r in self._reductions:
            flat, grads = r.fill()
            self._tr.allreduce(r.buffer, r.sub)
            self._count_sum(r)
            r.unpack(flat, grads)

    def _count_sum(self, r: _Reduction) -> None:
        """The bytes a ring allreduce of ``r``'s gradients moves per rank (not a step's fields
        beside them: an agreement's bytes are not counted either)."""
        self._traffic["allreduce"] += round(
            2 * (r.size - 1) / r.size * r.numel * r.buffer.element_size()
        )


def _sends_nothing(plan: Plan) -> bool:
    """Whether no rank sends anything during a step of ``plan`` before the gradients' sums:
    every replica one stage of one rank, and no experts (whose forwards exchange tokens)."""
    return plan.experts is None and all(
        len(r.stages) == 1 and len(r.stages[0].ranks) == 1 for r in plan.replicas
    )


def _put_back(kept: dict[nn.Parameter, torch.Tensor | None]) -> None:
    """A step that raised before its gradients' sums leaves each held parameter the gradient
    it had before the step (``kept``), not the step's partial one: a caller that catches the
    error and steps on accumulates no part of the failed step."""
    for p, g in kept.items():
        p.grad = g


def _add_back(kept: dict[nn.Parameter, torch.Tensor | None]) -> None:
    """After a step's gradients' sums: each held parameter's gradient from before the step
    (``kept``, :meth:`Parallel._set_aside`) added to the step's, as ``backward`` accumulates."""
    for p, g in kept.items():
        if g is not None:
            p.grad = g if p.grad is None else p.grad + g


def _last_of(ops: list[tuple[str, int]], op: str) -> int:
    """The index of a schedule's last ``op`` (-1 if none)."""
    return max((n for n, (o, _) in enumerate(ops) if o == op), default=-1)


def _nothing_to_wait_for() -> None:
    """The batch check's wait where the check comes after the step's own work
    (:meth:`Parallel._step_alone`)."""


#: A data-parallel step's fields per rank (:meth:`Parallel._step_work`): the loss's float64
#: bits, the count of thawed parameters summed over no replica, the loss scale's fields.
_STEP_VALUES = 2 + SCALE_FIELDS
#: A rank's slot before the gradients in a data-parallel step's sum: its failure flag, its
#: batch's fingerprint and its fields, 8 bytes each, one byte per element.
_SLOT = 8 * (2 + _STEP_VALUES)
#: Dtypes in which a byte (0 to 255) is exact, and exact plus zeros: the sum of the slots,
#: each written by one rank, is every rank's bytes.
_SLOT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Gradients up to this size (1 MiB, DDP's first bucket) are summed in every data-parallel
#: step, an evaluation's zeros too, with the step's fields beside them: one collective a
#: step, where a gloo sum of that size costs about a collective's latency (a millisecond
#: between two local ranks) and a check of its own would cost another. Larger ones check
#: their batch beside the forwards and sum only when training.
ONE_COLLECTIVE_BYTES = 1 << 20
#: A larger one's sum in buckets started during the backward (:class:`_Buckets`), of DDP's
#: sizes: the first (the last layers') about 1 MiB, then 25 MiB.
FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20


def _write_slot(
    slots: torch.Tensor, rank: int, failed: bool, digest: int, words: torch.Tensor
) -> None:
    """This rank's slot of ``slots`` (the sum's head: :data:`_SLOT` elements per rank) holds
    its failure flag, its batch's fingerprint and its step fields (``words``, int64) as bytes,
    every other slot zeros: written where ``words`` are, without reading them (a CUDA rank's
    step reads once, after the sum)."""
    head = torch.tensor([int(failed), digest], dtype=torch.int64).to(words.device)
    mine = torch.cat([head, words]).view(torch.uint8)
    slots.zero_()
    at = rank * _SLOT
    slots[at : at + _SLOT].copy_(mine)


def _read_slots(slots: torch.Tensor, ranks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every rank's failure flag, fingerprint and fields from the summed ``slots`` (one
    read)."""
    raw = slots.to("cpu", torch.uint8).numpy().reshape(ranks, _SLOT // 8, 8)
    words = np.ascontiguousarray(raw).view(np.int64).reshape(ranks, 2 + _STEP_VALUES)
    return words[:, 0], words[:, 1], words[:, 2:]


def _summed_loss(total: torch.Tensor | None, loss: torch.Tensor) -> torch.Tensor:
    """``total`` plus a micro-batch's loss, in float64 where the loss is: a step sums its
    micro-batches' losses without reading them (on a CUDA rank a read makes the host wait for
    the forward before it queues the backward) and reads the sum once, at its end. The same
    float64 sum, in the same order, as adding the losses read one by one."""
    x = loss.detach().reshape(()).to(torch.float64)
    return x if total is None else total + x


def _layer_of(name: str, layer_names: list[str]) -> int | None:
    """The layer holding a state-dict entry (its module path starts with the layer's name), or
    None for one outside every layer (a blocks model's parameters between its blocks)."""
    best = None
    for k, layer in enumerate(layer_names):
        if name.startswith(layer + ".") and (best is None or len(layer) > len(layer_names[best])):
            best = k
    return best


def _rows(value: Any, rows: slice) -> Any:
    """The rows of a tensor, or of every tensor of a dict (other values kept)."""
    if isinstance(value, torch.Tensor):  # the common case, without a tree's walk
        return value[rows]
    return pytree.tree_map(lambda t: t[rows] if isinstance(t, torch.Tensor) else t, value)


def _batch_rows(value: Any, name: str, keyed: bool) -> tuple[int, BaseException | None]:
    """The rows of a batch's inputs or targets (a tensor, or when ``keyed`` a dict of
    tensors agreeing on dim 0), or -1 and the error to raise."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return -1, ValueError(f"{name}: a 0-dim tensor has no rows to split")
        return int(value.shape[0]), None
    if keyed and isinstance(value, Mapping) and value:
        rows = {}
        for key, t in value.items():
            if not isinstance(key, str) or not isinstance(t, torch.Tensor) or t.dim() == 0:
                return -1, TypeError(
                    f"{name}: a dict of tensors with rows (keyword name -> tensor), got "
                    f"{key!r}: {type(t).__name__}"
                )
            rows[key] = int(t.shape[0])
        if len(set(rows.values())) > 1:
            return -1, ValueError(
                f"{name}: its tensors must agree on dim 0 (the rows split into micro-batches), "
                f"got {rows}"
            )
        return next(iter(rows.values())), None
    kinds = "a tensor or a dict of tensors" if keyed else "a tensor (a chain model's one input)"
    return -1, TypeError(f"{name}: must be {kinds}, got {type(value).__name__}")


def _signature(value: Any, skip: int) -> Any:
    """Shapes (less their first ``skip`` dims) and dtypes of a batch's tensors."""
    leaves, spec = pytree.tree_flatten(value)
    return (
        str(spec),
        tuple(
            (tuple(t.shape[skip:]), str(t.dtype)) if isinstance(t, torch.Tensor) else repr(t)
            for t in leaves
        ),
    )


def parallelize(
    model: nn.Module,
    plan: Plan | Mapping[str, Any],
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    items: Items | None = None,
    group: Any = None,
) -> Parallel:
    """Run ``model`` under ``plan`` on the ranks of ``group`` (an mpi4py communicator, a
    torch.distributed process group, or None: torch's default group). Collective: every rank
    passes the same plan and a model of the same structure; rank 0's weights are used, as
    DDP does. ``plan``'s ranks index the group; ranks in no stage are idle. ``loss_fn(output,
    targets)`` gets the model's output as the model returns it (a Hugging Face ``ModelOutput``
    included) and returns the mean loss over a micro-batch's items; ``items(targets)`` counts
    them (default: rows, as torch's losses average by default; a language model's loss
    averages its valid tokens: ``items=lambda y: (y != -100).sum()``, or ``y[:, 1:]`` where it
    shifts its labels, as a causal LM's does; on a GPU, return the count as that tensor, not
    ``int()`` of it: a step counts every micro-batch of every replica, and reads the GPU's
    counts at once, where ``int()`` makes the host wait for the GPU at each). The loss must be
    that mean: a sum (or a mean over anything but what ``items`` counts) trains silently
    wrong. Micro-batches and replicas are weighted by their items, so every step is the
    gradient of the mean over all items of the global batch. Parameters frozen
    (``requires_grad`` False) when it is called are in no gradient sum across stages, as DDP
    leaves them out of its buckets (a LoRA fine-tuning sums its adapters alone): make one
    trainable later and the next step raises on every rank; call it again instead.

    The model is cut into layers by :func:`hetcoll.torch.layers.model_layers`; each rank keeps
    a copy of its stage's layers only (``model`` itself is not changed). A chain's stage runs
    its layers in order; a blocks model's stage runs the model's forward around its blocks
    (:mod:`hetcoll.torch.replay`), its parameters outside every block on every stage (their
    gradients summed, as a head tied to its embedding is). A stage with several ranks splits
    its Conv2d / Linear channels among them with :func:`hetcoll.torch.filter_parallel` (by its
    ``speeds``, or its ``shares``), or, given ``owners``, keeps each rank's own channels
    (:mod:`hetcoll.torch.placement`). With the plan's ``experts``, each mixture-of-experts
    layer holds, on each replica's rank of its stage, the whole experts the plan gives that
    replica, and sends every routed token to its expert's replica and back
    (:func:`hetcoll.torch.expert_parallel`'s layer, the replicas' losses weighing the rows).

    >>> plan = Plan.load("plan.json")  # doctest: +SKIP
    >>> par = parallelize(net, plan, loss_fn=nn.CrossEntropyLoss())  # doctest: +SKIP
    >>> opt = torch.optim.SGD(par.parameters(), lr=0.1, momentum=0.9)  # doctest: +SKIP
    >>> loss = par.step(x, y); opt.step(); opt.zero_grad()  # doctest: +SKIP
    """
    disable_pending()  # what a compiled model runs of the plan's exchanges, never traced
    # A rank's bad argument is told to the others in the agreement below (they raise at once).
    failure: Exception | None = None
    try:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(plan, Mapping):
            plan = Plan.from_dict(plan)
        if not isinstance(plan, Plan):
            raise TypeError(f"plan: must be a hetcoll.Plan or its dict, got {type(plan).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn: must be callable, got {type(loss_fn).__name__}")
        items = items_argument(items)
    except (TypeError, ValueError) as e:
        failure = e
    wrap_or_raise(group, failure)
    tr = transport(group)
    if failure is not None:
        agree(tr.comm, {}, failure=failure)  # raises here, a mismatch on the others
    assert isinstance(plan, Plan)  # else failure: agree raised
    # Ranks that disagree on the plan or the model raise here, all of them, before any transfer.
    plan_print = zlib.crc32(repr(plan.to_dict()).encode())
    model_print = _fingerprint(model)
    agree(
        tr.comm,
        {
            "the plan": plan_print,
            "the model's parameter names, shapes and dtypes, and which are frozen": model_print,
        },
    )
    compiled = [n for n, m in model.named_modules() if compiled_call(m) is not None]
    if compiled:
        warnings.warn(
            f"parallelize: {few_names(compiled)} compiled in place (module.compile()) run "
            "uncompiled under the plan: its stages hold copies, which torch does not compile; "
            "compile them after parallelize instead (each decoder layer among the returned "
            "model's modules(), say)",
            stacklevel=2,
        )
    # Checks that depend on the plan and the model only: the same verdict on every rank.
    cut = model_cut(model)
    layers = cut.layers
    names = [n for n, _ in layers]
    if plan.num_layers != len(layers):
        raise ValueError(
            f"plan: its stages cover {plan.num_layers} layers but the model has {len(layers)} "
            f"({', '.join(names)})"
        )
    missing = [r for r in plan.ranks if r >= tr.size]
    if missing:
        raise ValueError(f"plan: names rank {missing[0]} but the group has {tr.size} ranks")
    split_args: dict[tuple[int, int], Any] = {}
    blocks: dict[tuple[int, int], list[Block]] = {}
    for i, j, stage in plan.stages():
        where = f"plan.replicas[{i}].stages[{j}]"
        if cut.kind == "chain" and stage.empty_blocks:
            raise ValueError(
                f"{where}.empty_blocks: {type(model).__name__} is a chain of layers, split by "
                "channels; only a model cut between blocks has attention and MLP blocks to leave "
                "empty on a rank"
            )
        if cut.kind == "blocks" and (stage.owners is not None or stage.shares is not None):
            raise ValueError(
                f"{where}: {'owners' if stage.owners is not None else 'shares'} name layers of a "
                f"chain by index; {type(model).__name__} is cut between blocks (give a split "
                "stage speeds, or shares by module path as filter_shares gives them)"
            )
        if cut.kind == "chain" and stage.named_shares is not None:
            raise ValueError(
                f"{where}.shares: names layers by module path; {type(model).__name__} is a chain "
                "of layers, whose shares name them by layer index"
            )
        if stage.owners is not None:
            blocks[i, j] = owners_blocks(layers, stage, where)
        elif len(stage.ranks) > 1:
            if cut.kind == "chain":
                split_args[i, j] = _stage_split(layers, stage, where)
            else:
                _check_blocks_split(layers, stage, where)
                split_args[i, j] = {}

    experts = _plan_experts(model, plan, names)

    par = Parallel()
    par.plan, par.rank, par._tr = plan, tr.rank, tr
    par.place = plan.place(tr.rank)
    par._loss_fn = loss_fn
    par._items = items
    par._blocks = blocks
    par._device = _device(model)
    par._kind = cut.kind
    par._names = names
    state = model.state_dict()
    par._home = {k: _layer_of(k, names) or 0 for k in state}
    par._state_layout = [(k, par._home[k], tuple(v.shape), v.dtype) for k, v in state.items()]
    # A chain's state outside its layers (a module its forward never calls: GoogLeNet's aux
    # heads in eval) is on no stage and never trains: kept as it is for the full state.
    par._unheld = {
        k: v.detach().cpu().clone()
        for k, v in state.items()
        if cut.kind == "chain" and _layer_of(k, names) is None
    }
    par._param_names = [n for n, _ in model.named_parameters()]
    canonical = {id(p): n for n, p in model.named_parameters()}
    par._alias = {
        n: canonical[id(p)]
        for n, p in model.named_parameters(remove_duplicate=False)
        if canonical[id(p)] != n
    }
    if cut.kind == "chain":
        par._layers_meta = [copy.deepcopy(m).to("meta") for _, m in layers]
    else:
        install_output_recorders(model)
        par._meta_blocks = [meta_copy(m) for _, m in layers]
        par._parameter_free = [next(m.parameters(), None) is None for _, m in layers]
        par._stage_of = [
            [
                next(s for s, st in enumerate(r.stages) if st.layers[0] <= k < st.layers[1])
                for k in range(len(layers))
            ]
            for r in plan.replicas
        ]

    # Rank 0's weights for everyone (one broadcast of the packed state dict).
    flat = (
        torch.cat([as_bytes(v) for v in state.values()])
        if state
        else torch.empty(0, dtype=torch.uint8)
    )
    flat = flat.to(par._wire_device())
    tr.broadcast(flat, 0)
    weights: dict[str, torch.Tensor] = {}
    at = 0
    host = flat.cpu()
    for k, v in state.items():
        n = v.numel() * v.element_size()
        weights[k] = from_bytes(host[at : at + n], v.dtype, v.shape)
        at += n

    # Sub-groups, every rank creating each in the same order: the split stages, then the sets
    # of ranks that hold a parameter in several replicas.
    subs = {key: tr.subgroup(plan.replicas[key[0]].stages[key[1]].ranks) for key in split_args}
    # The experts' exchanges: one group per stage holding experts, of that stage's rank in
    # every replica (numbered in increasing rank order).
    experts_subs = {
        j: tr.subgroup(sorted(r.stages[j].ranks[0] for r in plan.replicas))
        for j in sorted({j for j, _ in experts.values()})
    }
    par._experts_names = frozenset(n for path in experts for n in placed_parameters(model, path))
    par._experts_layers = [(path, sum(map(len, held)), j) for path, (j, held) in experts.items()]
    if par.place is not None:
        i, j = par.place
        stage = plan.replicas[i].stages[j]
        lo, hi = stage.layers
        if cut.kind == "chain":
            module: nn.Module = nn.Sequential(
                OrderedDict((n, copy.deepcopy(m)) for n, m in layers[lo:hi])
            )
        else:
            module = _stage_copy(model, layers, par._meta_blocks, lo, hi)
        module.load_state_dict({k: weights[k] for k in module.state_dict()})
        module.to(par._device)
        if (i, j) in blocks:
            # This rank's channels only: the full copy above is dropped once they are cut out.
            loaded = list(layers)
            loaded[lo:hi] = list(module.named_children())
            owned = OwnersStage(loaded, blocks[i, j], tr.rank, stage.ranks[0]).to(par._device)
            if next(owned.parameters(), None) is None:
                par.hold_nothing()  # it owns no channel with weights
            par.stage = owned
        elif (i, j) in split_args:
            counting = CountingCommunicator(wrap(subs[i, j]), par._traffic)
            par._stage_comm = counting
            # The sub-group numbers the stage's ranks in increasing order; the plan lists them
            # in its own order.
            order = [stage.ranks.index(r) for r in sorted(stage.ranks)]
            if cut.kind == "chain":
                shares = {n: [s[k] for k in order] for n, s in split_args[i, j].items()}
                filter_parallel(
                    module, group=counting, shares=shares, loss_parallel=stage.loss_parallel
                )
            elif stage.named_shares is not None:
                filter_parallel(
                    module,
                    group=counting,
                    shares={n: [s[k] for k in order] for n, s in stage.named_shares.items()},
                    empty_blocks=stage.empty_blocks,
                    loss_parallel=stage.loss_parallel,
                )
            else:
                speeds = list(stage.speeds) if stage.speeds is not None else [1.0] * len(order)
                filter_parallel(
                    module,
                    group=counting,
                    speeds=[speeds[k] for k in order],
                    empty_blocks=stage.empty_blocks,
                    loss_parallel=stage.loss_parallel,
                )
        if j in experts_subs:
            # This stage's experts: each replica's rank holds its own, its share of the plan's.
            counting = CountingCommunicator(wrap(experts_subs[j]), par._traffic)
            by_rank = sorted(
                range(len(plan.replicas)), key=lambda r: plan.replicas[r].stages[j].ranks[0]
            )
            for path, (at, held) in experts.items():
                if at == j:
                    ExpertParallelExperts.convert(
                        module.get_submodule(path),
                        [held[r] for r in by_rank],
                        counting,
                        combine="sum",
                        wrappers=experts_wrappers(module, path),
                    )
            par._experts_here = True
        if par.stage is None:
            par.stage = module
            if next(module.parameters(), None) is None:  # a stage of parameter-free layers
                par.hold_nothing()
    else:
        par.hold_nothing()
        if cut.kind == "blocks":  # to probe micro-batches as the working ranks do
            par._skeleton = [_stage_copy(model, layers, par._meta_blocks, 0, 0)]
    _plan_reductions(par, plan, names, model, cut.kind)
    register_marking(par)  # its placeholder's marks, its copies (PlanCheckpoints)
    record_replaced(model.parameters(), par.parameters(), "parallelize")
    track_optimizers()
    return par


def _plan_experts(
    model: nn.Module, plan: Plan, names: list[str]
) -> dict[str, tuple[int, list[list[int]]]]:
    """The plan's ``experts`` on ``model``: each experts module's path, the stage holding its
    layer (the same in every replica) and its experts per replica; empty without
    ``experts``. ``ValueError`` naming ``plan.experts`` where they do not fit the model."""
    if plan.experts is None:
        return {}
    placed = experts_placement(
        find_experts(model), len(plan.replicas), shares=plan.experts, where="plan.experts"
    )
    out = {}
    stages = plan.replicas[0].stages
    for path, held in placed.items():
        layer = _layer_of(path + ".", names)
        if layer is None:
            raise ValueError(
                f"plan.experts: the experts of {path!r} lie outside the model's layers "
                f"({', '.join(names)}); expert parallelism places the experts of a layer"
            )
        out[path] = (
            next(j for j, st in enumerate(stages) if st.layers[0] <= layer < st.layers[1]),
            held,
        )
    return out


def _stage_copy(
    model: nn.Module,
    layers: list[tuple[str, nn.Module]],
    meta_blocks: list[nn.Module],
    lo: int,
    hi: int,
) -> nn.Module:
    """A copy of a blocks model for the stage holding blocks ``lo:hi``: those blocks, the
    blocks without parameters and everything between blocks are copied; every other block is
    a :class:`~hetcoll.torch.replay.StandIn` (its weights are not copied)."""
    memo: dict[int, Any] = {
        id(m): StandIn(n, meta_blocks[k], output_recorders(m))
        for k, (n, m) in enumerate(layers)
        if not lo <= k < hi and next(m.parameters(), None) is not None
    }
    return copy.deepcopy(model, memo)


def _stage_split(
    layers: list[tuple[str, nn.Module]], stage: Stage, where: str
) -> dict[str, list[int]]:
    """The per-layer shares filter_parallel gets for a multi-rank stage (checked here, on
    every rank, so a split that cannot work fails everywhere before any transfer)."""
    lo, hi = stage.layers
    module = nn.Sequential(OrderedDict(layers[lo:hi]))
    p = len(stage.ranks)
    try:
        if stage.shares is not None:
            named = {names: m for names, m in layers}
            per_layer = {}
            for index, shares in stage.shares.items():
                name, m = layers[index]
                if type(m) not in (nn.Conv2d, nn.Linear):
                    raise ValueError(
                        f"shares: layer {index} ({name!r}) is a {type(named[name]).__name__}; "
                        "shares name Conv2d or Linear layers of the stage"
                    )
                per_layer[name] = list(shares)
            shares_of = filter_shares(module, size=p, shares=per_layer)
        else:
            speeds = list(stage.speeds) if stage.speeds is not None else [1.0] * p
            # Every splittable layer of the stage, named: the plan splits them all, so one too
            # thin for the stage's ranks is an error here, not a layer left whole. Those whose
            # parameters the forward reads itself (Swin's attention: F.linear(x, qkv.weight))
            # stay whole, as filter_parallel keeps them and the planner prices them.
            chosen = choose_layers(module, None, dict(module.named_modules()), warn=False)
            direct = set(split_layout(module, chosen).read_directly)
            chosen = [n for n in chosen if n not in direct]
            shares_of = filter_shares(module, size=p, speeds=speeds, layers=chosen)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
    if not shares_of:
        raise ValueError(f"{where}: has {p} ranks but its layers hold no Conv2d or Linear to split")
    # Every split layer, the split-input ones too (with their feeder's shares): filter_parallel
    # splits only the layers a shares dict names, so leaving those out would keep them whole
    # on every rank and turn their feeders' mode into "gather".
    return shares_of


def _check_blocks_split(layers: list[tuple[str, nn.Module]], stage: Stage, where: str) -> None:
    """The checks filter_parallel makes of a blocks model's split stage (too few heads for its
    ranks, say), made on every rank before any transfer, so that a split that cannot work
    fails everywhere: on the stage's blocks, held under their own names."""
    lo, hi = stage.layers
    holder = nn.Module()
    for path, m in layers[lo:hi]:
        parent = holder
        *outer, last = path.split(".")
        for name in outer:
            if name not in parent._modules:
                parent.add_module(name, nn.Module())
            parent = parent._modules[name]  # type: ignore[assignment]
        parent.add_module(last, m)
    p = len(stage.ranks)
    speeds = list(stage.speeds) if stage.speeds is not None else [1.0] * p
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # filter_parallel warns on the stage's ranks
            if stage.named_shares is not None:
                shares = {n: list(v) for n, v in stage.named_shares.items()}
                filter_shares(holder, size=p, shares=shares, empty_blocks=stage.empty_blocks)
            else:
                filter_shares(holder, size=p, speeds=speeds, empty_blocks=stage.empty_blocks)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def _plan_reductions(
    par: Parallel, plan: Plan, names: list[str], model: nn.Module, kind: str
) -> None:
    """Which parameters are summed over which ranks, and this rank's piece of each: those held
    by several stages (several replicas; a blocks model's parameters outside its blocks and
    parameters tied across stages)."""
    uses: dict[str, set[int]] = {}  # the layers that hold each parameter
    if kind == "chain":
        for n, _ in model.named_parameters():
            uses[n] = {_layer_of(n, names) or 0}
    else:
        canonical = {id(p): n for n, p in model.named_parameters()}
        for k, (_, m) in enumerate((n, model.get_submodule(n)) for n in names):
            for p in m.parameters():
                uses.setdefault(canonical[id(p)], set()).add(k)
        for n in canonical.values():
            uses.setdefault(n, set(range(len(names))))  # between blocks: every stage
    local = {n: tp for n, tp in par._parts().items() if isinstance(tp[0], nn.Parameter)}
    groups: dict[tuple[tuple[int, ...], torch.dtype], list[str]] = {}
    for n, p in model.named_parameters():
        if n in par._experts_names:
            continue  # each rank holds its own experts: nothing to sum
        holding = [
            (i, j)
            for i, replica in enumerate(plan.replicas)
            for j, s in enumerate(replica.stages)
            if any(s.layers[0] <= layer < s.layers[1] for layer in uses[n])
        ]
        if len(holding) < 2:
            continue  # held by one stage: nothing to sum
        if not p.requires_grad:
            # Frozen now, as DDP leaves it out of its buckets: in no sum (a LoRA fine-tuning's
            # frozen base weights cost a step no bytes). Should it train later, the step says so.
            if n in local:
                par._unsummed_frozen.append((n, local[n][0]))
            continue
        holders = tuple(sorted({r for i, j in holding for r in plan.replicas[i].stages[j].ranks}))
        groups.setdefault((holders, p.dtype), []).append(n)
    # Data parallelism whose gradients are one sum over every rank: the step's fields ride in
    # it (Parallel._step_summed), in slots before the gradients.
    fields_beside = (
        len(groups) == 1 and _sends_nothing(plan) and par._tr.size > 1 and par.place is not None
    )
    for (ranks, dtype), members in groups.items():
        sub = par._tr.subgroup(list(ranks))
        if par.rank not in ranks:
            continue
        head = 0
        if fields_beside and len(ranks) == par._tr.size and dtype in _SLOT_DTYPES:
            head = _SLOT * par._tr.size
        pieces, at = [], head
        for n in members:
            shape = tuple(model.get_parameter(n).shape)
            if n in local:  # in an owners stage, a rank may own none of a layer's channels
                t, part = local[n]
                pieces.append(_Piece(t, at, part, par._contributes(n, part)))
            at += math.prod(shape)
        buffer = torch.zeros(at, dtype=dtype, device=par._wire_device())
        par._reductions.append(_Reduction(sub, pieces, buffer, len(ranks), head))
