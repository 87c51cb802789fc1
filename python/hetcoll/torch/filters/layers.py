"""The split modules: what every split module knows of its ranks and shares
(:class:`ChannelSplit`), the rank's own computation (:class:`LocalConv2d`,
:class:`LocalLinear`, :class:`LocalConv1D`), the filter-parallel Conv2d, Linear and Hugging
Face ``Conv1D`` layers around it, the BatchNorms that follow them, split along the same
channels, and :class:`SharedCopy` (one input copied once to the several layers reading it: an
attention's query, key and value projections, a gated MLP's gate and up)."""

from __future__ import annotations

import copy
import math
import warnings
import weakref
from collections.abc import Sequence
from typing import Any, Self

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from hetcoll.collectives.autograd import never_traced_methods
from hetcoll.comm import Communicator, wrap
from hetcoll.torch.filters.autograd import (
    AgreedForward,
    CopyToRanks,
    GatherChannels,
    ReduceSum,
    SumEachWay,
    in_compiled_forward,
    needs_check,
    sole_holder,
)
from hetcoll.torch.filters.checks import (
    check_choice,
    check_conv,
    check_flag,
    check_linear,
    check_mode,
    check_shares,
    check_timeout,
    is_int,
    resolve_shares,
    speeds_argument,
)
from hetcoll.torch.filters.head_guards import attention
from hetcoll.torch.filters.shards import Marks, register_marking
from hetcoll.torch.filters.split_output import SplitOutput


def split_runs(
    shares: Sequence[int], rank: int, blocks: Sequence[int], whole: Sequence[int] = ()
) -> list[tuple[int, int]]:
    """Where rank ``rank``'s entries sit along a split dimension, as ``(start, length)`` runs:
    the dimension holds one block per entry of ``blocks`` (one, or query, key and value packed
    in one layer), block b of ``sum(shares) * blocks[b]`` entries, split alike: rank r holds
    ``shares[r] * blocks[b]`` of each; then, with ``whole``, ``whole[b]`` entries every rank
    holds (multi-query attention's key and value packed with its query heads).

    >>> split_runs([2, 1], 1, (4, 4, 4))
    [(8, 4), (20, 4), (32, 4)]
    >>> split_runs([2, 1], 1, (8, 4, 4))  # 2 query heads of 4 per key/value group
    [(16, 8), (32, 4), (44, 4)]
    >>> split_runs([2, 1], 1, (4, 0, 0), (0, 4, 4))  # 3 query heads, one key and value head
    [(8, 4), (12, 4), (16, 4)]
    """
    total, before = sum(shares), sum(shares[:rank])
    runs, start = [], 0
    for b, width in enumerate(blocks):
        if width:
            runs.append((start + before * width, shares[rank] * width))
        start += total * width
        if whole and whole[b]:
            runs.append((start, whole[b]))
            start += whole[b]
    return runs


def whole_positions(
    shares: Sequence[int], rank: int, blocks: Sequence[int], whole: Sequence[int]
) -> list[int]:
    """Where the entries every rank holds (:func:`split_runs`' ``whole``) sit in rank
    ``rank``'s tensor along the split dimension.

    >>> whole_positions([2, 1], 1, (4, 0, 0), (0, 4, 4))
    [4, 5, 6, 7, 8, 9, 10, 11]
    """
    out: list[int] = []
    at = 0
    for b, width in enumerate(blocks):
        at += shares[rank] * width
        if whole and whole[b]:
            out.extend(range(at, at + whole[b]))
            at += whole[b]
    return out


def set_attribute(module: nn.Module, name: str, value: Any) -> None:
    """``module``'s attribute ``name`` (dotted: a descendant's) set to ``value``: a split
    layer in place of the model's, a split parameter, a rank's count of hidden units."""
    owner, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(owner) if owner else module, leaf, value)


def take_runs(t: torch.Tensor, dim: int, runs: list[tuple[int, int]]) -> torch.Tensor:
    """The entries of ``t`` along ``dim`` in ``runs`` (:func:`split_runs`), joined."""
    if len(runs) == 1:
        return t.narrow(dim, runs[0][0], runs[0][1])
    return torch.cat([t.narrow(dim, a, n) for a, n in runs], dim)


class ChannelSplit:
    """What every split module knows: its ranks, its shares, and which tensors are split.

    ``split_spec()`` maps a parameter or buffer name to ``(dim, blocks)``: along ``dim`` the
    full tensor holds one block per entry of ``blocks``, of which rank r holds
    ``shares[r] * blocks[b]`` entries starting at ``offsets[r] * blocks[b]`` into block b
    (:func:`split_runs`); unnamed tensors are replicated. ``whole_spec()`` names those whose
    blocks end in entries every rank holds: ``whole[b]`` after block b's split ones.
    """

    comm: Communicator
    rank: int
    shares: list[int]
    offset: int
    #: The unsplit tensors' entries in rank order (rank 0's, then rank 1's, ...) where the
    #: ranks hold them out of order (whole experts placed anywhere: split specs of one block
    #: without entries every rank holds); None where rank r holds the run from ``offset``.
    order: tuple[int, ...] | None = None
    #: The split model's agreed forward (set by filter_parallel; None: each reduction checks).
    agreed: AgreedForward | None = None

    def _set_split(self, comm: Communicator, shares: list[int]) -> None:
        self.comm = comm
        self.rank = comm.rank
        self.shares = list(shares)
        self.offset = sum(shares[: comm.rank])
        _SPLIT_MODULES.add(self)
        register_marking(self)

    def split_spec(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        raise NotImplementedError

    def whole_spec(self) -> dict[str, tuple[int, ...]]:
        return {}

    def held_index(self) -> torch.Tensor:
        """The entries this rank holds of an unsplit tensor split along one block (the
        :attr:`order` of its rank's run), in the order it holds them."""
        order = range(sum(self.shares)) if self.order is None else self.order
        lo = self.offset
        return torch.tensor(order[lo : lo + self.shares[self.rank]], dtype=torch.long)

    def _slice_full(self, state_dict: dict[str, Any], prefix: str) -> None:
        """A full (unsplit) tensor in a state dict being loaded becomes this rank's slice."""
        total = sum(self.shares)
        kept = self.whole_spec()
        for name, (dim, blocks) in self.split_spec().items():
            t = state_dict.get(prefix + name)
            whole = kept.get(name, ())
            full = total * sum(blocks) + sum(whole)
            alone = self.shares[self.rank] == total
            if isinstance(t, torch.Tensor) and hasattr(t, "global_offsets"):
                marks = self.shard_marks(name)
                t = state_dict[prefix + name] = marks.loaded("state_dict", repr(prefix + name), t)
            if isinstance(t, torch.Tensor) and t.dim() > dim and t.shape[dim] == full and not alone:
                if self.order is not None:
                    state_dict[prefix + name] = t.index_select(dim, self.held_index().to(t.device))
                    continue
                runs = split_runs(self.shares, self.rank, blocks, whole)
                state_dict[prefix + name] = take_runs(t, dim, runs)

    def shard_marks(self, name: str) -> Marks:
        """Where this rank's slice of split tensor ``name`` sits in the unsplit tensor: its
        runs of entries, in the rank's order; the entries every rank holds
        (:meth:`whole_spec`) are runs of their own, alike on every rank (DCP writes them
        once)."""
        dim, blocks = self.split_spec()[name]
        whole = self.whole_spec().get(name, ())
        key = (name, dim, blocks, whole, tuple(self.shares), self.rank, self.order)
        cache: dict[str, tuple[Any, Marks]] = self.__dict__.setdefault("_shard_marks", {})
        if name in cache and cache[name][0] == key:  # every state dict asks: kept per split
            return cache[name][1]
        length = sum(self.shares) * sum(blocks) + sum(whole)
        if self.order is not None:
            marks = Marks.of_index(dim, self.held_index().tolist(), length)
        else:
            runs, at = [], 0
            for start, n in split_runs(self.shares, self.rank, blocks, whole):
                if n:
                    runs.append((start, at, n))
                at += n
            marks = Marks(dim, tuple(runs), length)
        cache[name] = (key, marks)
        return marks

    def param_marks(self) -> list[tuple[torch.Tensor, Marks]]:
        """Each split tensor this module holds, with its marks (:mod:`.shards`)."""
        out = []
        for name in self.split_spec():
            t = getattr(self, name, None)
            if isinstance(t, torch.Tensor):
                out.append((t, self.shard_marks(name)))
        return out

    def mark_shards(self, name: str, t: torch.Tensor) -> bool:
        """Mark ``t`` (this rank's slice of split tensor ``name``) with where it sits in the
        unsplit tensor (:class:`~.shards.Marks`): ``dcp.save`` then writes every rank's
        slices as shards of the one unsplit tensor, and ``dcp.load`` reads into any split of
        it the entries each rank holds. False, marking nothing, where ``t`` is not shaped as
        this rank's slice."""
        return self.shard_marks(name).mark(t)

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)  # type: ignore[misc]
        if keep_vars:  # the parameters themselves: not marked (they would keep the marks)
            return
        for name in self.split_spec():
            t = destination.get(prefix + name)
            if isinstance(t, torch.Tensor):
                self.mark_shards(name, t)

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        self._slice_full(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args)  # type: ignore[misc]


#: Every split module alive in this process (weakly): clipping finds a parameter's split here.
_SPLIT_MODULES: weakref.WeakSet[ChannelSplit] = weakref.WeakSet()


def split_modules() -> list[ChannelSplit]:
    """Every split module alive in this process (of any model)."""
    return list(_SPLIT_MODULES)


def split_comms(model: nn.Module) -> list[Communicator]:
    """The communicators of ``model``'s split modules, each once."""
    comms = {id(m.comm): m.comm for m in model.modules() if isinstance(m, ChannelSplit)}
    return list(comms.values())


class SharedCopy:
    """The copy of one replicated input to the ranks (:class:`CopyToRanks`: its gradient
    summed over the ranks) shared by the split layers that read it, so a tensor read by an
    attention's query, key and value projections (a gated MLP's gate and up) costs one
    reduction backward, not one per layer. It remembers the last few tensors it copied (by
    identity) and their copies until a copy's backward has run: LoRA wrappers with dropout
    read the input and each its own dropped input in turn, and the input read again after a
    dropped one is still the one copy."""

    #: How many of the latest inputs it remembers (an attention's input and its three
    #: projections' dropped inputs).
    REMEMBERED = 4

    def __init__(self, comm: Communicator, timeout: float | None, root: int | None = None) -> None:
        self.comm, self.timeout = comm, timeout
        #: The one rank whose layers read the input (:func:`~.autograd.sole_holder`), if one.
        self.root = root
        self.agreed: AgreedForward | None = None
        self._copies: list[tuple[weakref.ref[torch.Tensor], torch.Tensor]] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, SplitOutput):  # as FilterParallelLayer.forward
            x = x.whole()
        for seen, y in self._copies:
            if seen() is x:
                return y
        y = CopyToRanks.apply(x, self.comm, self.timeout, self, needs_check(self.agreed), self.root)
        self._copies = [*self._copies, (weakref.ref(x), y)][-self.REMEMBERED :]
        return y  # type: ignore[no-any-return]

    def read_copy(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """A forward pre-hook handing a layer held whole on every rank (multi-query
        attention's key and value projections) the copy in place of its input: its part of
        the input's gradient is summed over the ranks with the split layers'."""
        if args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
            return (self(args[0]), *args[1:])
        return None

    def clear(self) -> None:
        self._copies = []

    def __deepcopy__(self, memo: dict[int, Any]) -> SharedCopy:
        c = type(self)(self.comm, self.timeout, self.root)
        c.agreed = copy.deepcopy(self.agreed, memo)  # the copied model's, not this one's
        return c


class ReadAsIs(SharedCopy):
    """The ``shared_input`` of a split-output layer whose input needs no copy of its own: it
    is copied already, or computed whole on every rank from a copy (a LoRA column's
    ``lora_B`` reading its ``lora_A``'s output: each rank's part of its gradient flows back
    into that copy, summed there, and into ``lora_A``'s weight, summed with the whole
    parameters). Read as is (:meth:`__call__`)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x


class UpstreamCopy(ReadAsIs):
    """The copy to the ranks of the output of a layer every rank runs whole ahead of split
    layers (:attr:`~.heads.TensorSplit.upstream`: a latent attention's latent projection),
    made by a forward hook on that layer (:meth:`output`), its gradient summed over the ranks
    in the backward; the split layers it feeds (through a norm, say) take it as their
    ``shared_input`` and read their input as is: it is copied already."""

    def output(self, module: nn.Module, args: Any, output: Any) -> Any:
        if isinstance(output, torch.Tensor) and output.requires_grad:
            return SharedCopy.__call__(self, output)
        return None


class FilterParallelRMSNorm(ChannelSplit, nn.Module):
    """An RMS norm over the features of a split layer's whole output (OLMo 2's ``q_norm`` over
    every query head), holding this rank's features (its weight's slice, as the layer's
    output is split: ``blocks``): each rank's sum of squares, summed over the ranks
    (:class:`~.autograd.SumEachWay`: a number per token each way), gives the whole mean, with
    which each rank normalises its own features. Computes ``weight * (x / rms(x))`` in
    float32, as Hugging Face's RMS norms do. Only :meth:`from_module` builds one."""

    weight: nn.Parameter
    eps: float
    features: int
    timeout: float | None = None
    blocks: tuple[int, ...] = (1,)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # nn.Module's constructor built a norm of no split (an AttributeError at its first use).
        raise TypeError("FilterParallelRMSNorm: build one with FilterParallelRMSNorm.from_module")

    def split_spec(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        return {"weight": (0, self.blocks)}

    @classmethod
    def from_module(
        cls,
        norm: nn.Module,
        eps: float,
        shares: Sequence[int],
        group: Any = None,
        *,
        blocks: Sequence[int] = (1,),
        timeout: float | None = None,
    ) -> FilterParallelRMSNorm:
        """This rank's features of ``norm`` (an RMS norm of epsilon ``eps`` whose 1-D weight
        holds ``sum(shares) * sum(blocks)`` features), split as :func:`split_runs` says."""
        weight = getattr(norm, "weight", None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
            raise TypeError("norm: must hold a 1-D weight parameter")
        try:  # a bool, a string, None or an int past float's range is no epsilon
            e = math.nan if isinstance(eps, (bool, np.bool_, str)) else float(eps)
        except (TypeError, ValueError, OverflowError):
            e = math.nan
        if not (math.isfinite(e) and e >= 0):
            raise ValueError(f"eps: must be a finite number >= 0, got {eps!r}")
        if (
            isinstance(blocks, (str, bytes))
            or not isinstance(blocks, Sequence)
            or not blocks
            or not all(is_int(b) and b >= 0 for b in blocks)
            or not sum(blocks)
        ):
            raise ValueError(f"blocks: must be integers >= 0, not all 0, got {blocks!r}")
        check_timeout(timeout)
        if isinstance(shares, (str, bytes)) or not isinstance(shares, Sequence):
            raise TypeError(f"shares: must be a sequence of integers, got {type(shares).__name__}")
        if not all(is_int(u) and u >= 0 for u in shares):
            raise ValueError(f"shares: must be integers >= 0, got {list(shares)!r}")
        comm = wrap(group)
        units = [int(u) for u in shares]
        if sum(units) * sum(blocks) != weight.shape[0] or len(units) != comm.size:
            raise ValueError(
                f"shares: {units} units of {tuple(blocks)} features do not split the norm's "
                f"{weight.shape[0]} features over {comm.size} ranks"
            )
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._set_split(comm, units)
        self.eps, self.features, self.timeout = e, int(weight.shape[0]), timeout
        self.blocks = tuple(int(b) for b in blocks)
        with torch.no_grad():
            local = take_runs(weight, 0, split_runs(units, comm.rank, self.blocks)).clone()
        self.weight = nn.Parameter(local, requires_grad=weight.requires_grad)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.weight.shape[0]:
            raise ValueError(
                f"input: this rank's norm holds {self.weight.shape[0]} features, got shape "
                f"{tuple(x.shape)}"
            )
        dtype = x.dtype
        h = x.to(torch.float32)
        squares = SumEachWay.apply(h.pow(2).sum(-1, keepdim=True), self.comm, self.timeout)
        h = h * torch.rsqrt(squares / self.features + self.eps)
        return (self.weight * h).to(dtype)  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        return f"{self.features}, eps={self.eps}, shares={self.shares}, rank={self.rank}"


class LocalConv2d(nn.Module):
    """The computation a rank of a :class:`FilterParallelConv2d` does on its own: the
    convolution of its input with its slice of the weight, ``local(x, weight, bias)``. It holds
    no parameters (the layer does); see :attr:`FilterParallelLayer.local`."""

    def __init__(
        self,
        stride: tuple[int, ...],
        padding: Any,
        dilation: tuple[int, ...],
        padding_mode: str,
        reversed_padding: Any,
    ) -> None:
        super().__init__()
        self.stride, self.padding, self.dilation = stride, padding, dilation
        self.padding_mode = padding_mode
        self._reversed_padding_repeated_twice = reversed_padding

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: Any) -> torch.Tensor:
        if self.padding_mode != "zeros":
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            return F.conv2d(x, weight, bias, self.stride, 0, self.dilation)
        return F.conv2d(x, weight, bias, self.stride, self.padding, self.dilation)


class LocalLinear(nn.Module):
    """The computation a rank of a :class:`FilterParallelLinear` does on its own,
    ``local(x, weight, bias)``; no parameters (see :attr:`FilterParallelLayer.local`)."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: Any) -> torch.Tensor:
        return F.linear(x, weight, bias)


# Under torch.compile its forward runs as it is, never traced: each exchanges with the other
# ranks around one local layer, so the graph breaks there anyway, and traced it would be
# compiled once per weight shape (past torch.compile's recompile limit of 8, run as it is).
@never_traced_methods("forward")
class FilterParallelLayer(ChannelSplit, nn.Module):
    """Shared forward of the split Conv2d and Linear (``dim`` is their channel dimension).

    ``local``: the child module that does this rank's own computation, called as
    ``local(x, weight, bias)`` between the layer's collectives. Module hooks on it (forward and
    full backward hooks: the weight and bias are among its inputs) see the local compute alone,
    without the communication, for a profiler, a timer or an emulation (``hetcoll.lab``).
    """

    mode: str
    dim: int
    timeout: float | None
    weight: nn.Parameter
    bias: nn.Parameter | None
    local: nn.Module
    # Output channels per share of each block the output packs (one block of 1 channel; a
    # head's width when whole heads are split; three when query, key and value share a layer),
    # each block split alike.
    blocks: tuple[int, ...] = (1,)
    # Output channels after each block's split ones that every rank holds (() for none):
    # multi-query attention's key and value head packed with its query heads.
    whole: tuple[int, ...] = ()
    # The copy of the input shared with the other layers reading it (None: its own).
    shared_input: SharedCopy | None = None
    # The weight's output and input dimensions (a Conv1D stores its weight transposed).
    weight_out_dim: int = 0
    weight_in_dim: int = 1

    # A gathering layer whose output stays split along its last dimension until an op needs it
    # whole (filter_parallel's loss_parallel: a language model's head, its loss split too; a
    # LoRA head's base layer and lora_B, added split). Under torch.compile, whose guards fail
    # on the split output's reported shape, it gathers its output instead, and says so once.
    split_output: bool = False
    warned_compiled: bool = False

    # Dimensions the input must have (None: any); checked locally, before any collective, so a
    # wrong input raises on every rank instead of leaving the ranks' collectives mismatched.
    input_dims: int | None = None

    # This rank's slice's shape, as split; a weight of another shape was replaced afterwards.
    _weight_shape: tuple[int, ...] | None = None

    def _local_in(self) -> int:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, SplitOutput):
            # An earlier layer's output kept split (loss_parallel=True on a layer inside the
            # network, as ELECTRA's embeddings_project): whole before the autograd functions
            # here, which take a tensor's own shape, the piece's, not the one it reports.
            x = x.whole()
        if self._weight_shape is not None and self.weight.shape != self._weight_shape:
            # Replaced after the split (weights tied afterwards: model.tie_weights(), head.weight
            # = embedding.weight), with the ranks' collectives then of mismatched sizes.
            raise ValueError(
                f"weight: this rank's {type(self).__name__} holds a slice of shape "
                f"{self._weight_shape}, and its weight was replaced by one of shape "
                f"{tuple(self.weight.shape)} after filter_parallel; tie or replace weights "
                "before splitting (filter_parallel keeps ties it finds)"
            )
        if self.input_dims is not None and x.dim() != self.input_dims:
            raise ValueError(
                f"input: a filter-parallel {type(self).__name__} takes batched {self.input_dims}-D "
                f"input (N, C, H, W), got shape {tuple(x.shape)}; add the batch dimension "
                "(x.unsqueeze(0)) for one sample"
            )
        if self.mode == "split-input":
            want = self._local_in()
            if x.dim() == 0 or x.shape[self.dim] != want:
                raise ValueError(
                    f"input: this split-input layer expects {want} channels along dim "
                    f"{self.dim} on rank {self.rank} (its slice of the previous layer's output), "
                    f"got shape {tuple(x.shape)}"
                )
            y = ReduceSum.apply(
                self.local(x, self.weight, None),
                self.comm,
                self.timeout,
                needs_check(self.agreed),
                sole_holder(self.shares),
            )
            if self.bias is not None:
                shape = [1] * y.dim()
                shape[self.dim] = -1
                y = y + self.bias.view(shape)
            return y
        y = self.local(self.copied_input(x), self.weight, self.bias)
        if self.mode == "split-output":
            return y
        if self.split_output and self.dim == -1:
            # Under torch.compile of the whole model the output is gathered (this forward runs
            # as it is, never traced: a split output it returned would reach the compiled code
            # around it). Compiled block by block, the head runs eagerly and keeps it split.
            if not in_compiled_forward(self.agreed):
                return SplitOutput.of(y, self.comm, self.shares, self.timeout, self.agreed)
            said = self.agreed if self.agreed is not None else self  # once a split model
            if not said.warned_compiled:
                said.warned_compiled = True
                warnings.warn(
                    "filter_parallel: the model is compiled whole (torch.compile), so an output "
                    "it keeps split (loss_parallel's logits, a LoRA head's base and adapter "
                    "outputs) is gathered; compile its blocks instead (block.compile() for each "
                    "decoder layer) to keep it split",
                    stacklevel=2,
                )
        return GatherChannels.apply(y, self.comm, self.shares, self.offset, self.dim, self.timeout)

    def copied_input(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as this split-output or gathering layer reads it: where it needs a gradient,
        its copy to the ranks (shared with the layers reading the same input), whose
        gradient is summed over the ranks in the backward."""
        if not x.requires_grad:
            return x
        if self.shared_input is not None:
            return self.shared_input(x)
        return CopyToRanks.apply(  # type: ignore[no-any-return]
            x, self.comm, self.timeout, None, needs_check(self.agreed), sole_holder(self.shares)
        )

    def split_spec(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        if self.mode == "split-input":
            return {"weight": (self.weight_in_dim, (self._unit(),))}
        spec = {"weight": (self.weight_out_dim, self.blocks)}
        if self.bias is not None:
            spec["bias"] = (0, self.blocks)
        return spec

    def whole_spec(self) -> dict[str, tuple[int, ...]]:
        if self.mode != "split-output" or not self.whole:
            return {}
        return dict.fromkeys(self.split_spec(), self.whole)

    def _unit(self) -> int:
        return 1

    def _adopt(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        comm: Communicator,
        shares: list[int],
        mode: str,
        timeout: float | None,
    ) -> None:
        """Keep this rank's slice of ``weight`` / ``bias`` (copies: the full tensors can go)."""
        self._set_split(comm, shares)
        self.mode = mode
        self.timeout = timeout
        unit = self._unit()
        with torch.no_grad():
            if mode == "split-input":
                w = weight.narrow(self.weight_in_dim, self.offset * unit, shares[comm.rank] * unit)
                b = bias
            else:
                runs = split_runs(shares, comm.rank, self.blocks, self.whole)
                w = take_runs(weight, self.weight_out_dim, runs)
                b = None if bias is None else take_runs(bias, 0, runs)
            self.weight = nn.Parameter(w.clone(), requires_grad=weight.requires_grad)
            self.bias = (
                None if b is None or bias is None else nn.Parameter(b.clone(), bias.requires_grad)
            )
        self._weight_shape = tuple(self.weight.shape)  # this rank's slice, checked at forwards

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, shares={self.shares}, rank={self.rank}"


class FilterParallelConv2d(FilterParallelLayer):
    """A ``torch.nn.Conv2d`` (``groups=1``) whose output channels are split across ranks.

    ``shares`` (ints, one per rank of ``group``, each >= 1, summing to ``out_channels``) or
    ``speeds`` (one per rank; shares from :func:`hetcoll.split` with ``multiple_of``) say how
    many filters each rank holds. In ``mode="split-input"`` the shares are instead those of the
    previous layer's output — this layer's ``in_channels`` — and the rank holds the matching
    input-channel columns of every filter. ``group`` is anything :func:`hetcoll.comm.wrap` takes.
    The full layer is initialised as ``nn.Conv2d`` would be (so ranks must share the seed), then
    only the local slice is kept; :meth:`from_module` splits an existing layer instead. Every
    rank must pass the same batched input (or, in split-input mode, its own slice); an
    unbatched (C, H, W) input raises ``ValueError``. ``timeout`` (seconds) bounds each
    collective.

    >>> conv = FilterParallelConv2d(3, 37, 3, speeds=[1.0, 0.25], group=None)  # doctest: +SKIP
    """

    input_dims = 4  # unbatched (C, H, W) input would gather along H

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] | str = 0,
        dilation: int | tuple[int, int] = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        *,
        shares: Sequence[int] | None = None,
        speeds: Sequence[float] | None = None,
        multiple_of: int = 1,
        group: Any = None,
        mode: str = "gather",
        timeout: float | None = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        # Each argument named here, before torch builds the layer: torch took True as 1 and
        # [] as a kernel (failing at the forward), and named none of them.
        in_channels = _check_size(in_channels, "in_channels")
        out_channels = _check_size(out_channels, "out_channels")
        kernel = _check_pair(kernel_size, "kernel_size")
        strides = _check_pair(stride, "stride")
        pad = _check_padding(padding, strides)
        dilations = _check_pair(dilation, "dilation")
        if not is_int(groups) or groups != 1:
            raise ValueError(
                f"groups: is {groups!r}; filter parallelism splits groups=1 convolutions only"
            )
        bias = check_flag(bias, "bias")
        if not isinstance(padding_mode, str) or padding_mode not in _PADDING_MODES:
            raise ValueError(f"padding_mode: must be one of {_PADDING_MODES}, got {padding_mode!r}")
        check_mode(mode)
        check_timeout(timeout)
        check_choice(shares, speeds, multiple_of)
        if speeds is not None:
            speeds_argument(speeds)
        comm = wrap(group)
        split_total = in_channels if mode == "split-input" else out_channels
        counts = resolve_shares(shares, speeds, multiple_of, split_total, comm.size, "the layer")
        super().__init__()
        full = nn.Conv2d(
            in_channels,
            out_channels,
            kernel,
            strides,
            pad,
            dilations,
            1,
            bias,
            padding_mode,  # type: ignore[arg-type]
            device=device,
            dtype=dtype,
        )
        self._from_conv(full, comm, counts, mode, timeout)

    @classmethod
    def from_module(
        cls,
        conv: nn.Conv2d,
        shares: Sequence[int] | None = None,
        group: Any = None,
        *,
        speeds: Sequence[float] | None = None,
        multiple_of: int = 1,
        mode: str = "gather",
        timeout: float | None = None,
    ) -> FilterParallelConv2d:
        """This rank's part of an existing ``conv`` (its weights are copied, not shared).

        >>> FilterParallelConv2d.from_module(nn.Conv2d(3, 37, 3), [29, 7, 1])  # doctest: +SKIP
        """
        check_conv(conv, "conv")
        check_mode(mode)
        check_timeout(timeout)
        check_choice(shares, speeds, multiple_of)
        if speeds is not None:
            speeds_argument(speeds)
        comm = wrap(group)
        total = conv.in_channels if mode == "split-input" else conv.out_channels
        counts = resolve_shares(shares, speeds, multiple_of, total, comm.size, "conv")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._from_conv(conv, comm, counts, mode, timeout)
        return self

    def _from_conv(
        self,
        conv: nn.Conv2d,
        comm: Communicator,
        counts: list[int],
        mode: str,
        timeout: float | None,
    ) -> None:
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.kernel_size, self.stride = conv.kernel_size, conv.stride
        self.padding, self.dilation = conv.padding, conv.dilation
        self.padding_mode = conv.padding_mode
        self.dim = 1
        self.local = LocalConv2d(
            conv.stride,
            conv.padding,
            conv.dilation,
            conv.padding_mode,
            conv._reversed_padding_repeated_twice,
        )
        self._adopt(conv.weight, conv.bias, comm, counts, mode, timeout)

    def _local_in(self) -> int:
        return self.shares[self.rank]

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}, padding={self.padding}, " + super().extra_repr()
        )


class FilterParallelLinear(FilterParallelLayer):
    """A ``torch.nn.Linear`` whose output features are split across ranks.

    Same contract as :class:`FilterParallelConv2d` (the channel dimension is the last one). In
    ``mode="split-input"`` the shares are over the previous layer's channels and
    ``in_features_per_channel`` input features belong to each of them (a conv's H*W when a
    Flatten lies between; 1 after a linear layer).

    >>> fc = FilterParallelLinear(128, 10, speeds=[1.0, 0.25], group=None)  # doctest: +SKIP
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        shares: Sequence[int] | None = None,
        speeds: Sequence[float] | None = None,
        multiple_of: int = 1,
        group: Any = None,
        mode: str = "gather",
        in_features_per_channel: int = 1,
        timeout: float | None = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        # Named here, before torch builds the layer (True was a layer of 1 feature, any bias
        # was read as true or false, and 2.5 out_features reached the shares' check).
        in_features = _check_size(in_features, "in_features")
        out_features = _check_size(out_features, "out_features")
        bias = check_flag(bias, "bias")
        check_mode(mode)
        check_timeout(timeout)
        unit = _check_unit(in_features, in_features_per_channel)
        check_choice(shares, speeds, multiple_of)
        if speeds is not None:
            speeds_argument(speeds)
        comm = wrap(group)
        total = in_features // unit if mode == "split-input" else out_features
        counts = resolve_shares(shares, speeds, multiple_of, total, comm.size, "the layer")
        super().__init__()
        full = nn.Linear(in_features, out_features, bias, device=device, dtype=dtype)
        self._from_linear(full, comm, counts, mode, unit, timeout)

    @classmethod
    def from_module(
        cls,
        linear: nn.Module,
        shares: Sequence[int] | None = None,
        group: Any = None,
        *,
        speeds: Sequence[float] | None = None,
        multiple_of: int = 1,
        mode: str = "gather",
        in_features_per_channel: int = 1,
        blocks: Sequence[int] = (1,),
        whole: Sequence[int] = (),
        shared_input: SharedCopy | None = None,
        timeout: float | None = None,
    ) -> Self:
        """This rank's part of an existing ``linear`` (its weights are copied, not shared).

        Whole heads: with ``blocks`` the shares count units, each of ``blocks[b]`` output
        features of block b the output packs: ``(head_dim,)`` for a projection of heads,
        ``(head_dim,) * 3`` for query, key and value packed in one layer, ``(rep * head_dim,
        head_dim, head_dim)`` for them packed under grouped-query attention (a unit: a
        key/value group); each block is split alike, so a rank holds its units of each.
        ``whole``: the output features after each block's split ones that every rank holds
        and computes (multi-query attention packed in one layer, as Falcon-7B's: blocks
        ``(head_dim, 0, 0)``, whole ``(0, head_dim, head_dim)``); their gradients are each
        rank's part, which the caller sums over the ranks. ``shared_input``: the copy of the
        input shared with the other layers reading it (:class:`SharedCopy`: one reduction of
        the input gradient for all of them).

        >>> FilterParallelLinear.from_module(nn.Linear(64, 37), [29, 7, 1], group)  # doctest: +SKIP
        """
        in_features, out_features = cls._check_module(linear)
        check_mode(mode)
        check_timeout(timeout)
        unit = _check_unit(in_features, in_features_per_channel)
        widths, kept = _check_blocks(blocks, whole)
        per_unit = sum(widths)
        if mode != "split-input" and (out_features - sum(kept)) % per_unit:
            raise ValueError(
                f"blocks: units of {list(widths)} features do not divide out_features "
                f"({out_features})" + (f" less the {sum(kept)} whole" if kept else "")
            )
        if mode != "split-output" and (widths != (1,) or kept):
            raise ValueError("blocks: only split-output layers split whole units")
        # Only a split-output layer reads a shared copy of its input: another mode dropped it.
        if shared_input is not None and not isinstance(shared_input, SharedCopy):
            raise TypeError(
                f"shared_input: must be a SharedCopy or None, got {type(shared_input).__name__}"
            )
        if shared_input is not None and mode != "split-output":
            raise ValueError(
                f"shared_input: only split-output layers read a shared copy, got mode {mode!r}"
            )
        check_choice(shares, speeds, multiple_of)
        if speeds is not None:
            speeds_argument(speeds)
        comm = wrap(group)
        split_in = mode == "split-input"
        total = in_features // unit if split_in else (out_features - sum(kept)) // per_unit
        # A paired layer may hold nothing on a rank (an attention's heads or an MLP's units
        # all elsewhere): its reduction still counts that rank in.
        counts = resolve_shares(
            shares, speeds, multiple_of, total, comm.size, "linear", empty=mode != "gather"
        )
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.blocks, self.whole = widths, kept
        if mode == "split-output":
            self.shared_input = shared_input
        self._from_linear(linear, comm, counts, mode, unit, timeout)
        return self

    @staticmethod
    def _check_module(linear: Any) -> tuple[int, int]:
        check_linear(linear, "linear")
        return linear.in_features, linear.out_features

    def _from_linear(
        self,
        linear: Any,
        comm: Communicator,
        counts: list[int],
        mode: str,
        unit: int,
        timeout: float | None,
    ) -> None:
        self.in_features, self.out_features = self._check_module(linear)
        self.in_features_per_channel = unit
        self.dim = -1
        self.local = self._local_module()
        self._adopt(linear.weight, linear.bias, comm, counts, mode, timeout)

    @staticmethod
    def _local_module() -> nn.Module:
        return LocalLinear()

    def _unit(self) -> int:
        return self.in_features_per_channel

    def _local_in(self) -> int:
        return self.shares[self.rank] * self.in_features_per_channel

    def extra_repr(self) -> str:
        extra = ""
        if self.mode == "split-output" and self.blocks != (1,):
            extra = f", blocks={self.blocks}"
        if self.mode == "split-output" and self.whole:
            extra += f", whole={self.whole}"
        return f"{self.in_features}, {self.out_features}, " + super().extra_repr() + extra


def is_conv1d(m: object) -> bool:
    """Whether ``m`` is a Hugging Face ``Conv1D`` (GPT-2's linear layer, its weight stored
    transposed: (in, out)), known by its structure: ``nf`` output and ``nx`` input features, a
    weight of shape (nx, nf) and a bias of nf, no children."""
    if not isinstance(m, nn.Module) or type(m).__name__ != "Conv1D":
        return False
    nf, nx = getattr(m, "nf", None), getattr(m, "nx", None)
    # Read from _parameters: under torch.fx tracing, attribute access yields proxies.
    w, b = m._parameters.get("weight"), m._parameters.get("bias")
    return (
        is_int(nf)
        and is_int(nx)
        and isinstance(w, torch.Tensor)
        and tuple(w.shape) == (nx, nf)
        and (b is None or (isinstance(b, torch.Tensor) and tuple(b.shape) == (nf,)))
        and next(m.children(), None) is None
    )


class LocalConv1D(nn.Module):
    """The computation a rank of a :class:`FilterParallelConv1D` does on its own,
    ``local(x, weight, bias)`` with the weight stored (in, out), as Hugging Face's Conv1D."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: Any) -> torch.Tensor:
        flat = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # x may be empty: no -1
        y = flat @ weight if bias is None else torch.addmm(bias, flat, weight)
        return y.view(*x.shape[:-1], weight.shape[1])


class FilterParallelConv1D(FilterParallelLinear):
    """A Hugging Face ``Conv1D`` (GPT-2's linear layer, weight stored (in, out)) split as
    :class:`FilterParallelLinear`; only :meth:`from_module` builds one.

    >>> FilterParallelConv1D.from_module(gpt2_block.mlp.c_fc, [48, 16], group)  # doctest: +SKIP
    """

    weight_out_dim = 1
    weight_in_dim = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("FilterParallelConv1D: build one with FilterParallelConv1D.from_module")

    @staticmethod
    def _check_module(linear: Any) -> tuple[int, int]:
        if not is_conv1d(linear):
            raise TypeError(f"conv: must be a Hugging Face Conv1D, got {type(linear).__name__}")
        return int(linear.nx), int(linear.nf)

    @staticmethod
    def _local_module() -> nn.Module:
        return LocalConv1D()


def _check_blocks(blocks: Any, whole: Any = ()) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``blocks`` (output features per unit of each block) and ``whole`` (features after
    each block's that every rank holds; () for none) as tuples, checked: with ``whole``, a
    block may split none (0) where it holds whole ones."""
    for name, value in (("blocks", blocks), ("whole", whole)):
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise TypeError(f"{name}: must be a sequence of integers, got {value!r}")
    widths, kept = tuple(blocks), tuple(whole)
    if kept and (len(kept) != len(widths) or any(not is_int(w) or int(w) < 0 for w in kept)):
        raise ValueError(
            f"whole: must be one integer >= 0 per block ({len(widths)}), got {list(kept)!r}"
        )
    least = 0 if kept else 1
    if (
        not widths
        or any(not is_int(w) or int(w) < least for w in widths)
        or sum(int(w) for w in widths) < 1
        or any(int(w) + int(k) < 1 for w, k in zip(widths, kept, strict=False))
    ):
        raise ValueError(
            f"blocks: must be integers >= {least} (at least one), each block holding some "
            f"features, got {list(widths)!r}"
        )
    return tuple(int(w) for w in widths), tuple(int(k) for k in kept)


def _check_unit(in_features: int, unit: object) -> int:
    if not is_int(unit) or int(unit) < 1:  # type: ignore[call-overload]
        raise ValueError(f"in_features_per_channel: must be an integer >= 1, got {unit!r}")
    if in_features % int(unit):  # type: ignore[call-overload]
        raise ValueError(
            f"in_features_per_channel: {unit} does not divide in_features ({in_features})"
        )
    return int(unit)  # type: ignore[call-overload]


#: The largest size, kernel, stride, padding or dilation a layer takes: torch holds them in C
#: ints (2**70 overflowed inside ``torch.empty``).
_MAX_SIZE = 2**31 - 1

#: The padding modes ``nn.Conv2d`` takes.
_PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


def _check_size(value: object, argument: str, least: int = 1, what: str = "an integer") -> int:
    """``value`` an integer in ``[least, 2**31 - 1]`` (a numpy integer too, a bool not: True
    was once a layer of 1 feature), as an int; ``what`` it must be, for the message."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{argument}: must be {what} >= {least}, got {value!r}")
    if not least <= value <= _MAX_SIZE:
        shown = repr(value) if abs(int(value)) < 2**64 else "an integer past 2**64"  # 10**5000
        raise ValueError(f"{argument}: must be {what} >= {least} and <= 2**31 - 1, got {shown}")
    return int(value)


def _check_pair(value: object, argument: str, least: int = 1) -> tuple[int, int]:
    """A convolution's ``kernel_size``, ``stride``, ``padding`` or ``dilation``: an integer
    ``>= least`` or two of them (height, width), as torch takes them, as a pair of ints (``[]``
    and 0 once built a layer whose forward failed inside torch)."""
    what = "an integer or a pair of integers"
    if not isinstance(value, (tuple, list)):
        n = _check_size(value, argument, least, what)
        return n, n
    if len(value) != 2:
        raise ValueError(f"{argument}: must be {what} >= {least}, got {value!r}")
    h, w = (_check_size(v, argument, least, what) for v in value)
    return h, w


def _check_padding(padding: object, stride: tuple[int, int]) -> str | tuple[int, int]:
    """``padding`` as ``nn.Conv2d`` takes it: ``'same'`` (stride 1 only), ``'valid'``, or
    an integer >= 0 or two."""
    if isinstance(padding, str):
        if padding not in ("same", "valid"):
            raise ValueError(
                "padding: must be 'same', 'valid', an integer >= 0 or a pair of them, "
                f"got {padding!r}"
            )
        if padding == "same" and stride != (1, 1):
            raise ValueError(f"padding: 'same' needs stride 1, got stride {stride}")
        return padding
    return _check_pair(padding, "padding", 0)


class FilterParallelEmbedding(ChannelSplit, nn.Module):
    """An ``nn.Embedding`` split by vocabulary: this rank holds rows ``[offset, offset +
    share)`` of the table. Every rank looks up the tokens it holds (zeros for the others), and
    one sum over the ranks gives every rank the whole lookup (each token's row comes from one
    rank: the sum is exact). Backward needs no exchange: each rank's rows get their tokens'
    gradients. The weight may be a split head's (:func:`filter_parallel` ties a language
    model's head and its token embedding this way, both split by vocabulary alike).

    >>> FilterParallelEmbedding.from_module(nn.Embedding(50, 8), [30, 20], group)  # doctest: +SKIP
    """

    weight: nn.Parameter
    timeout: float | None = None
    num_embeddings: int
    embedding_dim: int
    padding_idx: int | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # nn.Module's constructor built a table of no split (an AttributeError at its first use).
        raise TypeError(
            "FilterParallelEmbedding: build one with FilterParallelEmbedding.from_module"
        )

    def split_spec(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        return {"weight": (0, (1,))}

    @classmethod
    def from_module(
        cls,
        embedding: nn.Module,
        shares: Sequence[int],
        group: Any = None,
        *,
        weight: nn.Parameter | None = None,
        timeout: float | None = None,
    ) -> FilterParallelEmbedding:
        """This rank's rows of ``embedding`` (copied), or ``weight``, an existing parameter
        holding them (a split head's, to stay tied to it)."""
        if type(embedding) is not nn.Embedding:
            raise TypeError(
                f"embedding: must be a torch.nn.Embedding, got {type(embedding).__name__}"
            )
        if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
            raise ValueError(
                "embedding: max_norm, scale_grad_by_freq and sparse embeddings cannot be split"
            )
        check_timeout(timeout)
        comm = wrap(group)
        counts = check_shares(
            shares, embedding.num_embeddings, comm.size, "shares", "the embedding"
        )
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._set_split(comm, counts)
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx = embedding.padding_idx
        self.timeout = timeout
        n = counts[comm.rank]
        if weight is None:
            with torch.no_grad():
                local = embedding.weight.narrow(0, self.offset, n).clone()
            weight = nn.Parameter(local, requires_grad=embedding.weight.requires_grad)
        elif tuple(weight.shape) != (n, embedding.embedding_dim):
            raise ValueError(
                f"weight: must hold this rank's {n} rows of {embedding.embedding_dim}, got "
                f"shape {tuple(weight.shape)}"
            )
        self.weight = weight
        return self

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype not in (torch.int64, torch.int32) or ids.is_floating_point():
            raise TypeError(f"input: token ids must be int64 or int32, got {ids.dtype}")
        if ids.numel():
            low, high = (int(v) for v in torch.aminmax(ids))
            if low < 0 or high >= self.num_embeddings:
                raise IndexError(
                    f"input: token ids must lie in [0, {self.num_embeddings}), got [{low}, {high}]"
                )
        lo, n = self.offset, self.shares[self.rank]
        w = self.weight
        if n:
            inside = (ids >= lo) & (ids < lo + n)
            pad = self.padding_idx
            local_pad = pad - lo if pad is not None and lo <= pad < lo + n else None
            rows = F.embedding(torch.where(inside, ids - lo, 0), w, local_pad)
            part = rows.masked_fill(~inside.unsqueeze(-1), 0.0)
        else:  # no rows here: nothing to add
            part = w.new_zeros((*ids.shape, self.embedding_dim))
        return ReduceSum.apply(
            part, self.comm, self.timeout, needs_check(self.agreed), sole_holder(self.shares)
        )

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, shares={self.shares}, rank={self.rank}"
        )


class _SplitBatchNorm(ChannelSplit):
    """Channels ``[offset, offset + share)`` of a BatchNorm: its statistics and affine map are
    per channel, so the split is exact and needs no communication. Only :meth:`from_module`
    builds one."""

    #: The BatchNorm it splits (a BatchNorm1d's split once took a BatchNorm2d).
    _kind: type[_BatchNorm]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # The BatchNorm's own constructor built a layer of no split (no shares: an
        # AttributeError at its first state dict).
        name = type(self).__name__
        raise TypeError(f"{name}: build one with {name}.from_module")

    def split_spec(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        names = ("weight", "bias", "running_mean", "running_var")
        return {n: (0, (1,)) for n in names if getattr(self, n, None) is not None}

    @classmethod
    def from_module(cls, bn: _BatchNorm, shares: Sequence[int], group: Any = None) -> Any:
        """This rank's channels of ``bn`` (a BatchNorm1d / BatchNorm2d of ``sum(shares)``
        features).

        >>> FilterParallelBatchNorm2d.from_module(nn.BatchNorm2d(37), [29, 7, 1])  # doctest: +SKIP
        """
        if not isinstance(bn, cls._kind):
            raise TypeError(f"bn: must be a torch.nn.{cls._kind.__name__}, got {type(bn).__name__}")
        comm = wrap(group)
        counts = check_shares(shares, bn.num_features, comm.size, "shares", "the BatchNorm")
        off, n = sum(counts[: comm.rank]), counts[comm.rank]
        w = bn.weight
        new: Any = cls.__new__(cls)
        cls._kind.__init__(  # the BatchNorm's own constructor: this class's refuses
            new,
            n,
            bn.eps,
            bn.momentum,
            bn.affine,
            bn.track_running_stats,
            device=w.device if w is not None else None,
            dtype=w.dtype if w is not None else None,
        )
        new._set_split(comm, counts)
        with torch.no_grad():
            for name in ("weight", "bias", "running_mean", "running_var"):
                src = getattr(bn, name, None)
                if src is not None:
                    getattr(new, name).copy_(src.narrow(0, off, n))
            if bn.num_batches_tracked is not None:
                new.num_batches_tracked.copy_(bn.num_batches_tracked)
        for name in ("weight", "bias"):  # a frozen BatchNorm stays frozen
            if getattr(bn, name, None) is not None:
                getattr(new, name).requires_grad_(getattr(bn, name).requires_grad)
        new.train(bn.training)
        return new


class FilterParallelBatchNorm2d(_SplitBatchNorm, nn.BatchNorm2d):
    """This rank's channels of a ``BatchNorm2d`` that follows a split conv layer."""

    _kind = nn.BatchNorm2d


class FilterParallelBatchNorm1d(_SplitBatchNorm, nn.BatchNorm1d):
    """This rank's features of a ``BatchNorm1d`` that follows a split linear layer (2-D
    input)."""

    _kind = nn.BatchNorm1d


class FilterParallelGroupedConv2d(ChannelSplit, nn.Conv2d):
    """Channels ``[offset, offset + share)`` of a grouped ``Conv2d`` (``groups`` > 1, as many
    channels in as out) that follows a split conv layer, ``share`` a multiple of each group's
    channels: each group's output channels read its own input channels alone, so a slice of
    whole groups is exact and needs no communication (ResNeXt's and RegNet's 3x3 convolution
    between their 1x1 convolutions). Only :meth:`from_module` builds one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # nn.Conv2d's constructor built a layer of no split (an AttributeError at its first
        # state dict).
        name = type(self).__name__
        raise TypeError(f"{name}: build one with {name}.from_module")

    def split_spec(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        return {n: (0, (1,)) for n in ("weight", "bias") if getattr(self, n, None) is not None}

    @classmethod
    def _check(cls, conv: nn.Conv2d) -> None:
        if not (conv.groups > 1 and conv.in_channels == conv.out_channels):
            raise ValueError(
                f"conv: a grouped convolution of whole groups per rank has groups > 1 and as "
                f"many channels in as out, got groups {conv.groups}, {conv.in_channels} in, "
                f"{conv.out_channels} out"
            )

    @classmethod
    def from_module(cls, conv: nn.Conv2d, shares: Sequence[int], group: Any = None) -> Any:
        """This rank's channels of ``conv``, a grouped convolution of ``sum(shares)``
        channels in and out, each share a multiple of its groups' channels.

        >>> FilterParallelGroupedConv2d.from_module(  # doctest: +SKIP
        ...     nn.Conv2d(32, 32, 3, groups=8), [24, 8])
        """
        if not isinstance(conv, nn.Conv2d):
            raise TypeError(f"conv: must be a torch.nn.Conv2d, got {type(conv).__name__}")
        cls._check(conv)
        comm = wrap(group)
        channels = conv.out_channels
        what = f"the {'depthwise' if conv.groups == channels else 'grouped'} Conv2d"
        counts = check_shares(shares, channels, comm.size, "shares", what)
        width = channels // conv.groups
        if any(c % width for c in counts):
            raise ValueError(
                f"shares: must be multiples of the {width} channels of each of {what}'s "
                f"{conv.groups} groups (each rank runs whole groups), got {counts}"
            )
        off, n = sum(counts[: comm.rank]), counts[comm.rank]
        new = cls.__new__(cls)
        nn.Conv2d.__init__(
            new,
            n,
            n,
            conv.kernel_size,  # type: ignore[arg-type]
            conv.stride,  # type: ignore[arg-type]
            conv.padding,  # type: ignore[arg-type]
            conv.dilation,  # type: ignore[arg-type]
            groups=n // width,  # whole groups, at least one (check_shares: no share of 0)
            bias=conv.bias is not None,
            padding_mode=conv.padding_mode,
            device=conv.weight.device,
            dtype=conv.weight.dtype,
        )
        new._set_split(comm, counts)
        with torch.no_grad():
            new.weight = nn.Parameter(
                conv.weight.narrow(0, off, n).clone(), requires_grad=conv.weight.requires_grad
            )
            if conv.bias is not None:
                new.bias = nn.Parameter(
                    conv.bias.narrow(0, off, n).clone(), requires_grad=conv.bias.requires_grad
                )
        new.train(conv.training)
        return new


class FilterParallelDepthwiseConv2d(FilterParallelGroupedConv2d):
    """Channels ``[offset, offset + share)`` of a depthwise ``Conv2d`` (``groups`` = in = out
    channels) that follows a split conv layer: each output channel reads its own input
    channel alone, so the split is exact and needs no communication (MobileNet's 3x3
    convolution between its 1x1 expansion and projection). Only :meth:`from_module` builds
    one."""

    @classmethod
    def _check(cls, conv: nn.Conv2d) -> None:
        if not conv.groups == conv.in_channels == conv.out_channels:
            raise ValueError(
                f"conv: a depthwise convolution has groups = in = out channels, got groups "
                f"{conv.groups}, {conv.in_channels} in, {conv.out_channels} out"
            )


class FilterParallelMultiheadAttention(ChannelSplit, nn.Module):
    """This rank's heads of a ``torch.nn.MultiheadAttention`` (query, key and value packed in
    ``in_proj_weight``, each split by whole heads alike; ``out_proj`` a split-input
    :class:`FilterParallelLinear` reading them): the same call and results as the unsplit
    module, one sum-reduction forward (and one of the input's gradient backward). Attention
    weights, when asked for, are summed over the ranks' heads (averaged) or gathered (per
    head). ``num_heads`` is this rank's; ``_qkv_same_embed_dim`` is False so torch's fused
    fast paths, which would read the local weights as whole, are never taken.
    Only :meth:`from_module` builds one.
    """

    in_proj_weight: nn.Parameter
    in_proj_bias: nn.Parameter | None
    out_proj: FilterParallelLinear
    embed_dim: int
    head_dim: int
    total_heads: int
    num_heads: int
    dropout: float
    batch_first: bool
    kdim: int
    vdim: int
    timeout: float | None
    shared_input: SharedCopy
    _qkv_same_embed_dim: bool
    add_zero_attn: bool
    bias_k: None
    bias_v: None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "FilterParallelMultiheadAttention: build one with "
            "FilterParallelMultiheadAttention.from_module"
        )

    @staticmethod
    def why_not(mha: nn.MultiheadAttention) -> str | None:
        """Why ``mha`` cannot be split by heads (None: it can)."""
        if not isinstance(mha, nn.MultiheadAttention):
            raise TypeError(f"mha: must be a torch.nn.MultiheadAttention, got {type(mha).__name__}")
        if not mha._qkv_same_embed_dim:
            return "its keys or values have their own sizes (kdim, vdim)"
        if mha.bias_k is not None or mha.add_zero_attn:
            return "it adds a bias or zeros to the keys (add_bias_kv, add_zero_attn)"
        if mha.in_proj_weight is None:
            return "it has no packed in_proj_weight"
        return None

    @classmethod
    def from_module(
        cls,
        mha: nn.MultiheadAttention,
        shares: Sequence[int],
        group: Any = None,
        *,
        timeout: float | None = None,
    ) -> FilterParallelMultiheadAttention:
        """This rank's heads of ``mha``: ``shares`` heads per rank, summing to its
        ``num_heads``.

        >>> FilterParallelMultiheadAttention.from_module(layer.self_attn, [3, 1])  # doctest: +SKIP
        """
        why = cls.why_not(mha)  # checks it is one
        if why is not None:
            raise ValueError(f"mha: cannot be split by heads: {why}")
        check_timeout(timeout)
        comm = wrap(group)
        counts = check_shares(
            shares, mha.num_heads, comm.size, "shares", "the attention", empty=True
        )
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._set_split(comm, counts)
        self.timeout = timeout
        self.embed_dim, self.head_dim = mha.embed_dim, mha.head_dim
        self.total_heads, self.num_heads = mha.num_heads, counts[comm.rank]
        self.dropout, self.batch_first = mha.dropout, mha.batch_first
        self.kdim, self.vdim = mha.kdim, mha.vdim
        self._qkv_same_embed_dim = False  # torch's fused paths would read local weights whole
        self.bias_k = self.bias_v = None
        self.add_zero_attn = False
        runs = split_runs(counts, comm.rank, (mha.head_dim,) * 3)
        with torch.no_grad():
            w = mha.in_proj_weight
            self.in_proj_weight = nn.Parameter(take_runs(w, 0, runs).clone(), w.requires_grad)
            b = mha.in_proj_bias
            self.in_proj_bias = (
                None if b is None else nn.Parameter(take_runs(b, 0, runs).clone(), b.requires_grad)
            )
        self.out_proj = FilterParallelLinear.from_module(
            mha.out_proj,
            counts,
            comm,
            mode="split-input",
            in_features_per_channel=mha.head_dim,
            timeout=timeout,
        )
        self.shared_input = SharedCopy(comm, timeout, sole_holder(counts))
        self.train(mha.training)
        return self

    def split_spec(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        blocks: tuple[int, tuple[int, ...]] = (0, (self.head_dim,) * 3)
        spec = {"in_proj_weight": blocks}
        if self.in_proj_bias is not None:
            spec["in_proj_bias"] = blocks
        return spec

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batched = query.dim() == 3
        if not batched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif self.batch_first:  # work in (L, N, E), as torch's multi_head_attention_forward
            moved: dict[int, torch.Tensor] = {}
            query, key, value = (
                moved.setdefault(id(t), t.transpose(0, 1)) for t in (query, key, value)
            )
        tgt, n, _ = query.shape
        src = key.shape[0]
        h, hd = self.num_heads, self.head_dim
        copies = {}
        for t in (query, key, value):
            if id(t) not in copies:
                copies[id(t)] = self.shared_input(t) if t.requires_grad else t
        wq, wk, wv = self.in_proj_weight.chunk(3)
        bq = bk = bv = None
        if self.in_proj_bias is not None:
            bq, bk, bv = self.in_proj_bias.chunk(3)
        q = F.linear(copies[id(query)], wq, bq).view(tgt, n, h, hd).permute(1, 2, 0, 3)
        k = F.linear(copies[id(key)], wk, bk).view(src, n, h, hd).permute(1, 2, 0, 3)
        v = F.linear(copies[id(value)], wv, bv).view(src, n, h, hd).permute(1, 2, 0, 3)
        mask = self._mask(attn_mask, key_padding_mask, is_causal, n, tgt, src, q.dtype)
        dropout = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            scores = (q * hd**-0.5) @ k.transpose(-2, -1)
            if mask is not None:
                scores = scores + mask
            probs = torch.softmax(scores, dim=-1)
            out = F.dropout(probs, dropout) @ v if dropout > 0 else probs @ v
            if average_attn_weights:
                summed = ReduceSum.apply(
                    probs.sum(1), self.comm, self.timeout, needs_check(self.agreed)
                )
                weights = summed / self.total_heads
            else:
                weights = GatherChannels.apply(
                    probs.contiguous(), self.comm, self.shares, self.offset, 1, self.timeout
                )
            if not batched:
                weights = weights.squeeze(0)
        else:
            out = attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        out = out.permute(2, 0, 1, 3).reshape(tgt, n, h * hd)
        y = self.out_proj(out)
        if not batched:
            return y.squeeze(1), weights
        return (y.transpose(0, 1) if self.batch_first else y), weights

    def _mask(
        self,
        attn_mask: torch.Tensor | None,
        key_padding_mask: torch.Tensor | None,
        is_causal: bool,
        n: int,
        tgt: int,
        src: int,
        dtype: torch.dtype,
    ) -> torch.Tensor | None:
        """The additive mask of this rank's heads, (N or 1, heads, L, S), as torch merges
        ``attn_mask`` (2-D, or 3-D per batch and head) and ``key_padding_mask``."""

        def additive(m: torch.Tensor) -> torch.Tensor:
            if m.dtype == torch.bool:
                return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(
                    m, float("-inf")
                )
            return m.to(dtype)

        mask = None
        if attn_mask is None and is_causal:
            attn_mask = torch.ones(tgt, src, dtype=torch.bool).triu(1)
        if attn_mask is not None:
            mask = additive(attn_mask)
            if mask.dim() == 2:
                mask = mask.view(1, 1, tgt, src)
            else:  # (N * all heads, L, S): this rank's heads
                mask = mask.view(n, self.total_heads, tgt, src).narrow(
                    1, self.offset, self.num_heads
                )
        if key_padding_mask is not None:
            pad = additive(key_padding_mask).view(n, 1, 1, src)
            mask = pad if mask is None else mask + pad
        return mask

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, shares={self.shares}, rank={self.rank}"
