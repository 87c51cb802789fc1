"""Filter parallelism: Conv2d / Linear layers split along their channels, unevenly, across ranks.

Each rank holds only its share of a layer's output channels (filters) — the weights, the bias and
so the optimizer state — and computes only those channels; shares come from :func:`hetcoll.split`
over the ranks' speeds, so a rank twice as fast holds (and computes) twice as many filters.
PyTorch has neither tensor parallelism for convolutions nor arbitrary uneven shards (pytorch
#133221, #144109); this module gives both, on torch.distributed (gloo, NCCL) and on MPI, through
:func:`hetcoll.comm.wrap`.

A split layer runs in one of three modes (seed 000's partitioned/replicated alternation, the
column/row pairing of Megatron-LM):

- ``"gather"``: full input -> local output channels -> allgather of the uneven pieces along the
  channel dimension -> full output on every rank. Backward: the output gradient is the same on
  every rank (everything downstream is replicated), so each rank keeps its slice; the input
  gradients (one partial per rank) are summed by an allreduce.
- ``"split-output"``: as "gather" without the allgather; the output stays channel-split. Only
  used when the next split layer reads it.
- ``"split-input"``: the input is already channel-split (the previous layer's shares); the rank
  holds the matching input-channel columns of the weight, computes a partial result for all
  output channels, and the partial sums are allreduced. The bias (replicated) is added once,
  after the sum. No gather between the two layers.

:func:`filter_parallel` converts the chosen layers of an existing model in place, with the unsplit
model's weights, and pairs consecutive split layers as split-output -> split-input when only
channel-wise modules lie between them (activations, dropout, pooling, BatchNorm, a Flatten
between a conv and a linear layer). A BatchNorm between the pair is split along channels too:
its statistics are per channel, so that is exact and needs no communication. Everything else
stays replicated (and must be fed identical inputs on every rank: seed dropout identically).

>>> model = filter_parallel(DemoNet(), [1.0, 0.25], group)  # doctest: +SKIP
>>> opt = torch.optim.SGD(model.parameters(), lr=0.1)  # any elementwise optimizer  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import warnings
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm

import hetcoll
from hetcoll.collectives import allgatherv, allreduce
from hetcoll.comm import Communicator, agree, deadline, wrap
from hetcoll.torch.state_dicts import (
    Part,
    check_full_optimizer_state_dict,
    check_full_state_dict,
    check_optimizer,
    local_optimizer_state_dict,
    named_optimizer_state,
    state_kind,
)

__all__ = [
    "ELEMENTWISE_MODULES",
    "MODES",
    "SPATIAL_MODULES",
    "FilterParallelBatchNorm1d",
    "FilterParallelBatchNorm2d",
    "FilterParallelConv2d",
    "FilterParallelLinear",
    "LocalConv2d",
    "LocalLinear",
    "filter_modes",
    "filter_parallel",
    "filter_shares",
    "gather_gradients",
    "gather_optimizer_state_dict",
    "gather_state_dict",
    "load_full_optimizer_state_dict",
    "load_full_state_dict",
    "split_tensors",
]

MODES = ("gather", "split-output", "split-input")


# -- argument checks (all local: they run before any collective) ----------------------------------


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check_shares(shares: object, total: int, size: int, argument: str, what: str) -> list[int]:
    """``shares`` as a list of positive ints, one per rank, summing to ``total``."""
    if isinstance(shares, (str, bytes)) or not isinstance(shares, Sequence):
        raise TypeError(f"{argument}: must be a sequence of integers, got {type(shares).__name__}")
    if not all(_is_int(s) for s in shares):
        raise TypeError(f"{argument}: shares must be integers, got {list(shares)!r}")
    out = [int(s) for s in shares]
    if len(out) != size:
        raise ValueError(
            f"{argument}: has {len(out)} shares but the group has {size} ranks (one per rank)"
        )
    for r, s in enumerate(out):
        if s < 1:
            raise ValueError(
                f"{argument}: rank {r} has a share of {s}; every rank needs at least one channel"
            )
    if sum(out) != total:
        raise ValueError(f"{argument}: shares sum to {sum(out)} but {what} has {total} channels")
    return out


def _speeds_to_shares(
    speeds: Sequence[Any], total: int, size: int, multiple_of: int, argument: str, what: str
) -> list[int]:
    if len(speeds) != size:
        raise ValueError(
            f"{argument}: has {len(speeds)} speeds but the group has {size} ranks (one per rank)"
        )
    if total < size * multiple_of:
        raise ValueError(
            f"{argument}: {what} has {total} channels, too few for {size} ranks with at least "
            f"{multiple_of} each; leave it out (layers=...)"
        )
    try:
        return hetcoll.split(
            total, [float(s) for s in speeds], multiple_of=multiple_of, minimum=multiple_of
        )
    except ValueError as e:
        raise ValueError(f"{argument}: {what}: {e}") from e


def _check_choice(shares: object, speeds: object, multiple_of: object) -> None:
    if (shares is None) == (speeds is None):
        raise ValueError("shares, speeds: give exactly one of them")
    if not _is_int(multiple_of) or multiple_of < 1:  # type: ignore[operator]
        raise ValueError(f"multiple_of: must be an integer >= 1, got {multiple_of!r}")


def _resolve(
    shares: Sequence[int] | None,
    speeds: Sequence[float] | None,
    multiple_of: int,
    total: int,
    size: int,
    what: str,
) -> list[int]:
    if speeds is not None:
        return _speeds_to_shares(speeds, total, size, int(multiple_of), "speeds", what)
    return _check_shares(shares, total, size, "shares", what)


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode: must be one of {MODES}, got {mode!r}")


def _check_conv(conv: nn.Conv2d, argument: str) -> None:
    if not isinstance(conv, nn.Conv2d):
        raise TypeError(f"{argument}: must be a torch.nn.Conv2d, got {type(conv).__name__}")
    if conv.groups != 1:
        raise ValueError(
            f"{argument}: is a grouped convolution (groups={conv.groups}); filter parallelism "
            "splits groups=1 convolutions only"
        )
    if conv.transposed:
        raise ValueError(f"{argument}: transposed convolutions are not supported")


def _check_linear(linear: nn.Linear, argument: str) -> None:
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"{argument}: must be a torch.nn.Linear, got {type(linear).__name__}")


def _check_timeout(timeout: float | None) -> None:
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0
    ):
        raise ValueError(f"timeout: must be a number of seconds > 0 or None, got {timeout!r}")


# -- the communication, as autograd functions -----------------------------------------------------


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


class _CopyToRanks(torch.autograd.Function):
    """Identity forward on a replicated input; backward sums the ranks' partial input gradients
    (each rank's filters contribute their own part of dL/dx)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, timeout: float | None) -> Any:
        ctx.comm, ctx.timeout = comm, timeout
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        g = grad.contiguous().clone()
        allreduce(g, ctx.comm, timeout=ctx.timeout)
        return g, None, None


class _ReduceSum(torch.autograd.Function):
    """Allreduce of the partial sums forward; identity backward (the output gradient is
    replicated, and each rank's partial depends only on its own input slice)."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, comm: Communicator, timeout: Any) -> Any:
        out = partial.detach().clone(memory_format=torch.contiguous_format)
        allreduce(out, comm, timeout=timeout)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return grad, None, None


class _GatherChannels(torch.autograd.Function):
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
        # Pieces join along axis 0 in every engine: move the channel dimension there.
        moved = y.detach().movedim(dim, 0).contiguous()
        if y.device.type != "cpu":
            out = allgatherv(moved, comm, timeout=timeout)
        else:
            out = torch.empty((sum(counts), *moved.shape[1:]), dtype=y.dtype)
            row = moved[0].numel() * moved.element_size()
            comm.iallgatherv(_bytes(moved), _bytes(out), [c * row for c in counts]).wait(
                deadline(timeout)
            )
        return out.movedim(0, dim).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return grad.narrow(ctx.dim, ctx.offset, ctx.count), None, None, None, None, None


# -- the split modules ----------------------------------------------------------------------------


class _ChannelSplit:
    """What every split module knows: its ranks, its shares, and which tensors are split.

    ``split_spec()`` maps a parameter or buffer name to ``(dim, unit)``: along ``dim`` rank r holds
    ``shares[r] * unit`` entries starting at ``offsets[r] * unit``; unnamed tensors are replicated.
    """

    comm: Communicator
    rank: int
    shares: list[int]
    offset: int

    def _set_split(self, comm: Communicator, shares: list[int]) -> None:
        self.comm = comm
        self.rank = comm.rank
        self.shares = list(shares)
        self.offset = sum(shares[: comm.rank])

    def split_spec(self) -> dict[str, tuple[int, int]]:
        raise NotImplementedError

    def _slice_full(self, state_dict: dict[str, Any], prefix: str) -> None:
        """A full (unsplit) tensor in a state dict being loaded becomes this rank's slice."""
        total = sum(self.shares)
        for name, (dim, unit) in self.split_spec().items():
            t = state_dict.get(prefix + name)
            if isinstance(t, torch.Tensor) and t.dim() > dim and t.shape[dim] == total * unit:
                count = self.shares[self.rank] * unit
                if count != total * unit:
                    state_dict[prefix + name] = t.narrow(dim, self.offset * unit, count)

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        self._slice_full(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args)  # type: ignore[misc]


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


class FilterParallelLayer(_ChannelSplit, nn.Module):
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

    # Dimensions the input must have (None: any); checked locally, before any collective, so a
    # wrong input raises on every rank instead of leaving the ranks' collectives mismatched.
    input_dims: int | None = None

    def _local_in(self) -> int:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
            y = _ReduceSum.apply(self.local(x, self.weight, None), self.comm, self.timeout)
            if self.bias is not None:
                shape = [1] * y.dim()
                shape[self.dim] = -1
                y = y + self.bias.view(shape)
            return y
        if x.requires_grad:
            x = _CopyToRanks.apply(x, self.comm, self.timeout)
        y = self.local(x, self.weight, self.bias)
        if self.mode == "split-output":
            return y
        return _GatherChannels.apply(y, self.comm, self.shares, self.offset, self.dim, self.timeout)

    def split_spec(self) -> dict[str, tuple[int, int]]:
        if self.mode == "split-input":
            return {"weight": (1, self._unit())}
        spec = {"weight": (0, 1)}
        if self.bias is not None:
            spec["bias"] = (0, 1)
        return spec

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
                w = weight.narrow(1, self.offset * unit, shares[comm.rank] * unit)
                b = bias
            else:
                w = weight.narrow(0, self.offset, shares[comm.rank])
                b = None if bias is None else bias.narrow(0, self.offset, shares[comm.rank])
            self.weight = nn.Parameter(w.clone(), requires_grad=weight.requires_grad)
            self.bias = None if b is None else nn.Parameter(b.clone(), b.requires_grad)

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
        _check_mode(mode)
        _check_timeout(timeout)
        if groups != 1:
            raise ValueError(
                f"groups: is {groups}; filter parallelism splits groups=1 convolutions only"
            )
        _check_choice(shares, speeds, multiple_of)
        comm = wrap(group)
        split_total = in_channels if mode == "split-input" else out_channels
        counts = _resolve(shares, speeds, multiple_of, split_total, comm.size, "the layer")
        super().__init__()
        full = nn.Conv2d(
            in_channels,
            out_channels,
            kernel_size,
            stride,
            padding,
            dilation,
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
        _check_conv(conv, "conv")
        _check_mode(mode)
        _check_timeout(timeout)
        _check_choice(shares, speeds, multiple_of)
        comm = wrap(group)
        total = conv.in_channels if mode == "split-input" else conv.out_channels
        counts = _resolve(shares, speeds, multiple_of, total, comm.size, "conv")
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
        _check_mode(mode)
        _check_timeout(timeout)
        unit = _check_unit(in_features, in_features_per_channel)
        _check_choice(shares, speeds, multiple_of)
        comm = wrap(group)
        total = in_features // unit if mode == "split-input" else out_features
        counts = _resolve(shares, speeds, multiple_of, total, comm.size, "the layer")
        super().__init__()
        full = nn.Linear(in_features, out_features, bias, device=device, dtype=dtype)
        self._from_linear(full, comm, counts, mode, unit, timeout)

    @classmethod
    def from_module(
        cls,
        linear: nn.Linear,
        shares: Sequence[int] | None = None,
        group: Any = None,
        *,
        speeds: Sequence[float] | None = None,
        multiple_of: int = 1,
        mode: str = "gather",
        in_features_per_channel: int = 1,
        timeout: float | None = None,
    ) -> FilterParallelLinear:
        """This rank's part of an existing ``linear`` (its weights are copied, not shared).

        >>> FilterParallelLinear.from_module(nn.Linear(64, 37), [29, 7, 1], group)  # doctest: +SKIP
        """
        _check_linear(linear, "linear")
        _check_mode(mode)
        _check_timeout(timeout)
        unit = _check_unit(linear.in_features, in_features_per_channel)
        _check_choice(shares, speeds, multiple_of)
        comm = wrap(group)
        total = linear.in_features // unit if mode == "split-input" else linear.out_features
        counts = _resolve(shares, speeds, multiple_of, total, comm.size, "linear")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._from_linear(linear, comm, counts, mode, unit, timeout)
        return self

    def _from_linear(
        self,
        linear: nn.Linear,
        comm: Communicator,
        counts: list[int],
        mode: str,
        unit: int,
        timeout: float | None,
    ) -> None:
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.in_features_per_channel = unit
        self.dim = -1
        self.local = LocalLinear()
        self._adopt(linear.weight, linear.bias, comm, counts, mode, timeout)

    def _unit(self) -> int:
        return self.in_features_per_channel

    def _local_in(self) -> int:
        return self.shares[self.rank] * self.in_features_per_channel

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, " + super().extra_repr()


def _check_unit(in_features: int, unit: object) -> int:
    if not _is_int(unit) or int(unit) < 1:  # type: ignore[call-overload]
        raise ValueError(f"in_features_per_channel: must be an integer >= 1, got {unit!r}")
    if in_features % int(unit):  # type: ignore[call-overload]
        raise ValueError(
            f"in_features_per_channel: {unit} does not divide in_features ({in_features})"
        )
    return int(unit)  # type: ignore[call-overload]


class _SplitBatchNorm(_ChannelSplit):
    """Channels ``[offset, offset + share)`` of a BatchNorm: its statistics and affine map are
    per channel, so the split is exact and needs no communication."""

    def split_spec(self) -> dict[str, tuple[int, int]]:
        names = ("weight", "bias", "running_mean", "running_var")
        return {n: (0, 1) for n in names if getattr(self, n, None) is not None}

    @classmethod
    def from_module(cls, bn: _BatchNorm, shares: Sequence[int], group: Any = None) -> Any:
        """This rank's channels of ``bn`` (a BatchNorm1d / BatchNorm2d of ``sum(shares)``
        features).

        >>> FilterParallelBatchNorm2d.from_module(nn.BatchNorm2d(37), [29, 7, 1])  # doctest: +SKIP
        """
        comm = wrap(group)
        counts = _check_shares(shares, bn.num_features, comm.size, "shares", "the BatchNorm")
        off, n = sum(counts[: comm.rank]), counts[comm.rank]
        w = bn.weight
        new: Any = cls(  # type: ignore[call-arg]
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
        new.train(bn.training)
        return new


class FilterParallelBatchNorm2d(_SplitBatchNorm, nn.BatchNorm2d):
    """This rank's channels of a ``BatchNorm2d`` that follows a split conv layer."""


class FilterParallelBatchNorm1d(_SplitBatchNorm, nn.BatchNorm1d):
    """This rank's features of a ``BatchNorm1d`` that follows a split linear layer (2-D
    input)."""


# -- converting a model ---------------------------------------------------------------------------

#: Modules that act on each channel (or element) on its own, so a channel-split tensor can pass
#: through them unchanged: nothing needs gathering before them (the filter-parallel pairing rule
#: and the owners stages of hetcoll.torch.placement both read this list) ...
ELEMENTWISE_MODULES = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Tanh,
    nn.Sigmoid,
    nn.Hardtanh,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Softplus,
    nn.Identity,
    nn.Dropout,
)
#: ... and those that do so on 2-D feature maps (after a convolution).
SPATIAL_MODULES = (
    nn.MaxPool2d,
    nn.AvgPool2d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveMaxPool2d,
    nn.Dropout2d,
)


Chain = list[tuple[str, nn.Module]]


def _chains(
    module: nn.Module,
    prefix: str = "",
    untraced: list[str] | None = None,
    traced_cache: dict[tuple[int, str], list[Chain] | str] | None = None,
) -> Iterator[Chain]:
    """Runs of modules known to feed each other in order, and nothing else: the children of
    plain nn.Sequential containers (nested ones flattened), and inside a module with its own
    forward the runs torch.fx finds in its traced graph (:func:`_traced_chains`). A module whose
    forward cannot be traced breaks a run — its dataflow is unknown — and its insides are
    searched for runs of their own; its name goes to ``untraced``. ``traced_cache``: traces
    already made of these modules, by (module id, prefix), to read and add to (one caller
    asking about the same unchanged modules several times)."""
    if _is_plain_sequential(module):
        chain: Chain = []
        inner: Chain = []
        _flatten(module, prefix, chain, inner)
        yield chain
        for name, m in inner:
            yield from _chains(m, name, untraced, traced_cache)
        return
    if next(module.children(), None) is None:
        return
    if traced_cache is None:
        traced = _traced_chains(module, prefix)
    else:
        key = (id(module), prefix)
        if key not in traced_cache:
            traced_cache[key] = _traced_chains(module, prefix)
        traced = traced_cache[key]
    if isinstance(traced, list):
        yield from traced
        return
    if untraced is not None:
        untraced.append(f"{prefix or type(module).__name__} ({traced})")
    for name, child in module.named_children():
        yield from _chains(child, f"{prefix}.{name}" if prefix else name, untraced, traced_cache)


# Functions and tensor methods a traced forward may call on a channel-split tensor, as the
# module that does the same (one instance each: the pairing rule reads only their types).
_RELU, _POOL, _FLATTEN = nn.ReLU(), nn.MaxPool2d(1), nn.Flatten()
_ELEMENTWISE_FUNCTIONS = {
    F.relu, F.relu6, F.leaky_relu, F.elu, F.selu, F.celu, F.gelu, F.silu, F.mish, F.hardtanh,
    F.hardswish, F.hardsigmoid, F.softplus, F.dropout, torch.relu, torch.tanh, torch.sigmoid,
}  # fmt: skip
_SPATIAL_FUNCTIONS = {
    F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d, F.adaptive_max_pool2d, F.dropout2d,
    torch.max_pool2d,
}  # fmt: skip
_ELEMENTWISE_METHODS = {"relu", "relu_", "tanh", "sigmoid"}


def _as_module(node: Any, named: dict[str, nn.Module]) -> nn.Module | None:
    """The module a traced node stands for in the pairing rule, or None when it is none of the
    channel-wise operations the rule knows (that breaks a run)."""
    if node.op == "call_module":
        return named[node.target]
    args = list(node.args[1:]) + list(node.kwargs.values())
    if node.op == "call_function":
        if node.target in _ELEMENTWISE_FUNCTIONS:
            return _RELU
        if node.target in _SPATIAL_FUNCTIONS:
            return _POOL
        if node.target is torch.flatten and args in ([1], [1, -1]):
            return _FLATTEN
    if node.op == "call_method":
        if node.target in _ELEMENTWISE_METHODS:
            return _RELU
        if node.target == "flatten" and args in ([1], [1, -1]):
            return _FLATTEN
    return None


def _has_state(m: nn.Module) -> bool:
    return any(True for _ in m.parameters()) or any(True for _ in m.buffers())


def _traced_chains(module: nn.Module, prefix: str) -> list[Chain] | str:
    """The runs of :func:`_chains` in ``module``'s forward, read off its torch.fx graph: a run
    continues from one operation to the next while the next is the only user of the first's
    output and reads nothing else, so a channel-split tensor between them is seen by no one
    else. A module with parameters or buffers called from more than one place breaks runs (it
    would need two modes); a stateless one (a ReLU used twice) does not.
    Returns why when the forward cannot be traced (data-dependent control flow, say)."""
    from torch import fx

    try:
        graph = fx.Tracer().trace(module)
    except Exception as e:  # fx raises many kinds on untraceable code; the reason is reported
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
    named = dict(module.named_modules())
    calls: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1

    def element(node: Any) -> tuple[str, nn.Module] | None:
        if node.op == "call_module" and calls[node.target] > 1 and _has_state(named[node.target]):
            return None
        m = _as_module(node, named)
        if m is None:
            return None
        name = node.target if node.op == "call_module" else f"<{node.name}>"
        return (f"{prefix}.{name}" if prefix else name), m

    chains: list[Chain] = []
    seen: set[Any] = set()
    for node in graph.nodes:
        chain: Chain = []
        while node not in seen and (el := element(node)) is not None:
            seen.add(node)
            chain.append(el)
            users = list(node.users)
            if len(users) != 1 or users[0].all_input_nodes != [node]:
                break
            node = users[0]
        if chain:
            chains.append(chain)
    return chains


def _is_plain_sequential(m: nn.Module) -> bool:
    return isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward


def _flatten(
    seq: nn.Module,
    prefix: str,
    chain: list[tuple[str, nn.Module]],
    inner: list[tuple[str, nn.Module]],
) -> None:
    for name, child in seq.named_children():
        full = f"{prefix}.{name}" if prefix else name
        if _is_plain_sequential(child):
            _flatten(child, full, chain, inner)
        else:
            chain.append((full, child))
            if next(child.children(), None) is not None:
                inner.append((full, child))


def _channels(m: nn.Module) -> int:
    return m.out_channels if isinstance(m, nn.Conv2d) else m.out_features  # type: ignore[return-value]


def filter_modes(
    model: nn.Module, layers: Sequence[str] | None = None, *, avoid_gathers: bool = True
) -> dict[str, str]:
    """The mode :func:`filter_parallel` gives each layer it splits, by module name:
    ``"gather"``, ``"split-output"`` or ``"split-input"``. This is the one place the pairing
    rule lives; :func:`hetcoll.model.predict.filter_modes` asks it too. It only reads module
    types and sizes, so a model on the meta device works.

    >>> filter_modes(nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 2)))
    {'0': 'split-output', '2': 'split-input'}
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: must be a torch.nn.Module, got {type(model).__name__}")
    chosen = _choose(model, layers, dict(model.named_modules()), warn=False)
    return _plan(model, chosen, avoid_gathers)[0]


def chain_filter_modes(chain: Sequence[tuple[str, nn.Module]]) -> list[dict[str, str]]:
    """``filter_modes(nn.Sequential(OrderedDict(chain[lo:])))`` for every ``lo``: the modes of
    a filter-split stage running from each layer of a chain of named layers to its end, each
    module's forward traced once for all of them (the chain is read, not changed).

    >>> chain = [("a", nn.Linear(8, 6)), ("b", nn.ReLU()), ("c", nn.Linear(6, 2))]
    >>> chain_filter_modes(chain)
    [{'a': 'split-output', 'c': 'split-input'}, {'c': 'gather'}, {'c': 'gather'}]
    """
    traced: dict[tuple[int, str], list[Chain] | str] = {}
    out = []
    for lo in range(len(chain)):
        model = nn.Sequential(OrderedDict(chain[lo:]))
        chosen = _choose(model, None, dict(model.named_modules()), warn=False)
        out.append(_plan(model, chosen, True, traced_cache=traced)[0])
    return out


def _plan(
    model: nn.Module,
    chosen: list[str],
    avoid_gathers: bool,
    untraced: list[str] | None = None,
    traced_cache: dict[tuple[int, str], list[Chain] | str] | None = None,
) -> tuple[dict[str, str], dict[str, tuple[str, int]], dict[str, str]]:
    """Modes of the chosen layers; for each split-input layer the layer whose shares it takes
    and its in_features_per_channel; for each BatchNorm to split, the layer it follows. The
    modules whose forwards could not be traced go to ``untraced`` (:func:`_chains`, as does
    ``traced_cache``)."""
    modes = {name: "gather" for name in chosen}
    feeds: dict[str, tuple[str, int]] = {}
    bns: dict[str, str] = {}
    if not avoid_gathers:
        return modes, feeds, bns
    for chain in _chains(model, untraced=untraced, traced_cache=traced_cache):
        prev: tuple[str, nn.Module] | None = None
        flattened = False
        pending: list[str] = []
        for name, m in chain:
            if name in modes:
                unit = _pairs(prev, m, flattened) if prev is not None else None
                if prev is not None and unit is not None:
                    modes[prev[0]], modes[name] = "split-output", "split-input"
                    feeds[name] = (prev[0], unit)
                    bns.update({b: prev[0] for b in pending})
                    prev = None
                else:
                    prev = (name, m)
                flattened, pending = False, []
                continue
            if prev is None:
                continue
            conv = isinstance(prev[1], nn.Conv2d)
            if isinstance(m, ELEMENTWISE_MODULES) or (
                conv and not flattened and isinstance(m, SPATIAL_MODULES)
            ):
                continue
            bn_type = nn.BatchNorm2d if conv else nn.BatchNorm1d
            if type(m) is bn_type and not flattened and m.num_features == _channels(prev[1]):
                pending.append(name)
                continue
            flat = isinstance(m, nn.Flatten) and m.start_dim == 1 and m.end_dim == -1
            if conv and not flattened and flat:
                flattened = True
                continue
            prev, pending = None, []  # anything else needs the full tensor
    return modes, feeds, bns


def _pairs(prev: tuple[str, nn.Module], m: nn.Module, flattened: bool) -> int | None:
    """in_features_per_channel if ``m`` can read ``prev``'s channel-split output, else None."""
    p = prev[1]
    if isinstance(p, nn.Conv2d):
        if isinstance(m, nn.Conv2d) and not flattened and m.in_channels == p.out_channels:
            return 1
        if isinstance(m, nn.Linear) and flattened and m.in_features % p.out_channels == 0:
            return m.in_features // p.out_channels
        return None
    if isinstance(m, nn.Linear) and m.in_features == p.out_features:  # type: ignore[union-attr]
        return 1
    return None


# Layers with parameters that filter parallelism does not split: named in a warning, so a
# model that stays (partly) replicated says so.
_REPLICATED_KINDS = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.RNNBase,
    nn.MultiheadAttention,
    nn.Bilinear,
)


def _why_kept(m: nn.Module) -> str:
    if isinstance(m, nn.Conv2d) and not isinstance(m, nn.ConvTranspose2d) and m.groups != 1:
        return f", groups={m.groups}"
    return ""


def _tied(model: nn.Module) -> dict[str, str]:
    """Modules whose own parameters another module also holds (tied weights, or one module
    registered under two names), by name, each with what it shares: ``"weight shared with
    'emb'"``. Splitting such a module would give it a slice of its own and untie the rest."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for n, m in model.named_modules(remove_duplicate=False):
        for pname, p in m.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((n, pname))
    tied: dict[str, str] = {}
    for holders in owners.values():
        if len(holders) < 2:
            continue
        for n, pname in holders:
            others = ", ".join(repr(o) for o, _ in holders if o != n) or f"{n!r} itself"
            tied.setdefault(n, f"{pname} shared with {others}")
    return tied


def _choose(
    model: nn.Module,
    layers: Sequence[str] | None,
    named: dict[str, nn.Module],
    *,
    warn: bool = True,
) -> list[str]:
    tied = _tied(model)
    if layers is None:
        chosen, kept = [], []
        for n, m in named.items():
            if n in tied and isinstance(m, (nn.Linear, nn.Conv2d)):
                kept.append(f"{n!r} ({type(m).__name__}, {tied[n]}: a split would untie them)")
            elif type(m) is nn.Linear or (type(m) is nn.Conv2d and m.groups == 1):
                chosen.append(n)
            elif isinstance(m, _REPLICATED_KINDS) and any(True for _ in m.parameters()):
                kept.append(f"{n!r} ({type(m).__name__}{_why_kept(m)})")
        if kept and warn:
            warnings.warn(
                "filter_parallel: left replicated (every rank computes them whole): "
                + ", ".join(kept),
                UserWarning,
                stacklevel=4,
            )
        if not chosen and warn:
            warnings.warn(
                f"filter_parallel: {type(model).__name__} has no Conv2d (groups=1) or Linear "
                "layer it can split; it runs unchanged on every rank",
                UserWarning,
                stacklevel=4,
            )
        return chosen
    if isinstance(layers, str) or not isinstance(layers, Sequence):
        raise TypeError(f"layers: must be a sequence of module names, got {type(layers).__name__}")
    for name in layers:
        if name not in named:
            raise ValueError(f"layers: the model has no module named {name!r}")
        if not isinstance(named[name], (nn.Conv2d, nn.Linear)):
            raise ValueError(
                f"layers: {name!r} is a {type(named[name]).__name__}; only Conv2d and Linear "
                "layers can be split"
            )
        if name in tied:
            raise ValueError(
                f"layers: {name!r} cannot be split: {tied[name]}, and a split layer holds only "
                "its slice, which would untie them (leave it out of layers: it then stays "
                "replicated)"
            )
    if len(set(layers)) != len(layers):
        raise ValueError("layers: names a module more than once")
    order = list(named)
    return sorted(layers, key=order.index)


def filter_shares(
    model: nn.Module,
    shares_or_speeds: Sequence[float] | Sequence[int] | Mapping[str, Sequence[int]] | None = None,
    size: int | None = None,
    *,
    speeds: Sequence[float] | None = None,
    shares: Sequence[int] | Mapping[str, Sequence[int]] | None = None,
    layers: Sequence[str] | None = None,
    multiple_of: int = 1,
    avoid_gathers: bool = True,
) -> dict[str, list[int]]:
    """The channels per rank :func:`filter_parallel` gives each layer it splits on ``size``
    ranks, by module name (split-input layers take the shares of the layer feeding them). Local:
    every argument check of :func:`filter_parallel` runs here, with the same errors, so a caller
    can check a split on ranks outside it.

    >>> model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 2))
    >>> filter_shares(model, size=2, speeds=[2, 1])
    {'0': [4, 2], '2': [4, 2]}
    """
    if size is None:
        raise TypeError("size: required (the number of ranks)")
    if not _is_int(size) or size < 1:
        raise ValueError(f"size: must be an integer >= 1, got {size!r}")
    value, argument = _split_argument(shares_or_speeds, speeds, shares)
    return _shares(model, value, argument, lambda: int(size), layers, multiple_of, avoid_gathers)


def _split_argument(shares_or_speeds: Any, speeds: Any, shares: Any) -> tuple[Any, str]:
    """The one split given, and the name of its argument: ``speeds=`` (numbers, integers read
    as speeds too), ``shares=`` (integers, or a dict of them per layer) or the positional
    ``shares_or_speeds``, whose integers are shares and whose floats are speeds: ambiguous, so
    integers there get a DeprecationWarning."""
    given = [
        n
        for n, v in (("shares_or_speeds", shares_or_speeds), ("speeds", speeds), ("shares", shares))
        if v is not None
    ]
    if len(given) != 1:
        raise TypeError(
            "speeds, shares: give exactly one, by keyword: speeds=[...] (one per rank, each "
            "layer split in proportion) or shares=[...] (channels per rank, or a dict of them "
            "per layer)" + (f"; got {', '.join(given)}" if given else "")
        )
    if speeds is not None:
        if isinstance(speeds, (str, bytes, Mapping)) or not isinstance(speeds, Sequence):
            raise TypeError(
                f"speeds: must be a sequence of numbers, one per rank, got {type(speeds).__name__}"
            )
        if any(isinstance(v, (bool, np.bool_)) for v in speeds):
            raise TypeError("speeds: booleans are not speeds")
        try:
            return [float(v) for v in speeds], "speeds"
        except (TypeError, ValueError):
            raise TypeError(f"speeds: must be numbers, got {list(speeds)!r}") from None
    if shares is not None:
        if isinstance(shares, Mapping):
            return shares, "shares"
        if isinstance(shares, (str, bytes)) or not isinstance(shares, Sequence):
            raise TypeError(
                "shares: must be a sequence of integers (channels per rank) or a dict of them "
                f"per layer, got {type(shares).__name__}"
            )
        if not all(_is_int(v) for v in shares):
            raise TypeError(
                f"shares: must be integers (speeds go to speeds=), got {list(shares)!r}"
            )
        return shares, "shares"
    if (
        isinstance(shares_or_speeds, Sequence)
        and not isinstance(shares_or_speeds, (str, bytes))
        and shares_or_speeds
        and all(_is_int(v) for v in shares_or_speeds)
    ):
        warnings.warn(
            "filter_parallel: integers in shares_or_speeds are read as channel shares, where "
            "hetcoll.split reads them as speeds; say which with shares= or speeds= (the "
            "positional form goes in a later release)",
            DeprecationWarning,
            stacklevel=3,
        )
    return shares_or_speeds, "shares_or_speeds"


def _shares(
    model: nn.Module,
    shares_or_speeds: Any,
    argument: str,
    size_of: Callable[[], int],
    layers: Sequence[str] | None,
    multiple_of: int,
    avoid_gathers: bool,
) -> dict[str, list[int]]:
    """:func:`filter_shares`, asking for the group size only once the arguments are checked."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: must be a torch.nn.Module, got {type(model).__name__}")
    if not _is_int(multiple_of) or multiple_of < 1:
        raise ValueError(f"multiple_of: must be an integer >= 1, got {multiple_of!r}")
    named = dict(model.named_modules())
    per_layer: Mapping[str, Any] | None = None
    if isinstance(shares_or_speeds, Mapping):
        per_layer = shares_or_speeds
        if layers is None:
            layers = list(per_layer)
        missing = [k for k in per_layer if k not in layers]
        if missing:
            raise ValueError(f"{argument}: names layers not in layers: {missing}")
    elif isinstance(shares_or_speeds, (str, bytes)) or not isinstance(shares_or_speeds, Sequence):
        raise TypeError(
            f"{argument}: must be a sequence (speeds or shares, one per rank) or a dict "
            f"of shares per layer, got {type(shares_or_speeds).__name__}"
        )
    elif any(isinstance(s, (bool, np.bool_)) for s in shares_or_speeds):
        raise TypeError(f"{argument}: booleans are neither speeds nor shares")
    chosen = _choose(model, layers, named)
    for name in chosen:
        m = named[name]
        if isinstance(m, nn.Conv2d):
            _check_conv(m, f"layers: {name!r}")
    untraced: list[str] = []
    modes, feeds, _ = _plan(model, chosen, avoid_gathers, untraced)
    if untraced and any(mode == "gather" for mode in modes.values()):
        warnings.warn(
            "filter_parallel: could not trace the forward of "
            + "; ".join(untraced)
            + ", so the layers split inside gather their whole outputs after each "
            "(mode 'gather') unless an nn.Sequential shows what feeds what; modes: "
            + ", ".join(f"{n!r} {m}" for n, m in modes.items()),
            UserWarning,
            stacklevel=4,
        )
    size = size_of() if chosen else 1

    shares: dict[str, list[int]] = {}
    for name in chosen:
        what = f"layer {name!r}"
        total = _channels(named[name])
        if per_layer is not None:
            if modes[name] == "split-input":
                continue  # it reads the channels of the layer feeding it: checked below
            if name not in per_layer:
                raise ValueError(f"{argument}: gives no shares for {what}")
            shares[name] = _check_shares(per_layer[name], total, size, argument, what)
        elif argument != "speeds" and all(_is_int(s) for s in shares_or_speeds):  # type: ignore[union-attr]
            if modes[name] != "split-input":
                shares[name] = _check_shares(shares_or_speeds, total, size, argument, what)
        elif modes[name] != "split-input":
            shares[name] = _speeds_to_shares(
                shares_or_speeds,  # type: ignore[arg-type]
                total,
                size,
                int(multiple_of),
                argument,
                what,
            )
    for name, (src, _) in feeds.items():
        shares[name] = shares[src]
        given = None if per_layer is None else per_layer.get(name)
        if given is not None and [int(s) for s in given] != shares[src]:
            raise ValueError(
                f"{argument}: layer {name!r} reads the channels of {src!r}, so its "
                f"shares must be {src!r}'s ({shares[src]}), got {list(given)!r}"
            )
    return {name: shares[name] for name in chosen if name in shares}


def filter_parallel(
    model: nn.Module,
    shares_or_speeds: Sequence[float] | Sequence[int] | Mapping[str, Sequence[int]] | None = None,
    group: Any = None,
    *,
    speeds: Sequence[float] | None = None,
    shares: Sequence[int] | Mapping[str, Sequence[int]] | None = None,
    layers: Sequence[str] | None = None,
    multiple_of: int = 1,
    avoid_gathers: bool = True,
    timeout: float | None = None,
) -> nn.Module:
    """Split the Conv2d / Linear layers of ``model`` across the ranks of ``group``, in place;
    return ``model``.

    Give the split by keyword, exactly one of: ``speeds=`` — numbers, one per rank (integers
    too, as :func:`hetcoll.split` reads them), each layer split with :func:`hetcoll.split`
    (``multiple_of``, at least ``multiple_of`` channels per rank); ``shares=`` — integers, one
    per rank, the same channels for every split layer, or a dict from layer name to shares (the
    layers then default to its keys). The positional ``shares_or_speeds`` (floats: speeds,
    integers: shares) still works; with integers it warns, being ambiguous. ``layers`` names
    the modules to split (default: every
    ``nn.Conv2d`` with ``groups=1`` and ``nn.Linear``). Modes are chosen so a split layer feeding
    another through channel-wise modules only (inside an ``nn.Sequential``) skips the gather:
    split-output then split-input; a BatchNorm between them is split too. ``avoid_gathers=False``
    gathers after every split layer. A layer that shares a parameter with another module (tied
    weights, as a language model's head with its embedding, or one module registered under two
    names) stays replicated and is named in a ``UserWarning``, as PyTorch users expect ties to
    hold: a split layer would hold a slice of its own and untie them; naming it in ``layers``
    raises ``ValueError`` naming both. Every rank must pass the same arguments and the same
    model; all checks run before the one collective (an agreement check on the plan, which
    raises :class:`hetcoll.CollectiveMismatchError` on every rank if ranks disagree).

    The result trains with any optimizer whose update is elementwise (SGD, Adam, AdamW,
    RMSprop, ...) exactly as the unsplit model would; global-norm clipping would see only the
    local slice. :func:`gather_state_dict` and :func:`gather_optimizer_state_dict` rebuild the
    unsplit model's state dict and optimizer state; :func:`load_full_state_dict` and
    :func:`load_full_optimizer_state_dict` load them into any split of the model (another
    number of ranks, other speeds): a checkpoint that resumes elsewhere.

    >>> model = filter_parallel(DemoNet(), [1.0, 0.25], None)  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: must be a torch.nn.Module, got {type(model).__name__}")
    _check_timeout(timeout)
    value, argument = _split_argument(shares_or_speeds, speeds, shares)
    per_layer = _shares(
        model, value, argument, lambda: wrap(group).size, layers, multiple_of, avoid_gathers
    )
    comm = wrap(group)
    named = dict(model.named_modules())
    chosen = list(per_layer)
    modes, feeds, bns = _plan(model, chosen, avoid_gathers)

    _agree_on_plan(comm, chosen, modes, per_layer, timeout)

    for name in chosen:
        m = named[name]
        if isinstance(m, nn.Conv2d):
            new: nn.Module = FilterParallelConv2d.from_module(
                m, per_layer[name], comm, mode=modes[name], timeout=timeout
            )
        else:
            unit = feeds[name][1] if name in feeds else 1
            new = FilterParallelLinear.from_module(
                m,
                per_layer[name],
                comm,
                mode=modes[name],
                in_features_per_channel=unit,
                timeout=timeout,
            )
        _replace(model, name, new)
    for name, src in bns.items():
        bn = named[name]
        cls = (
            FilterParallelBatchNorm2d
            if isinstance(bn, nn.BatchNorm2d)
            else FilterParallelBatchNorm1d
        )
        _replace(model, name, cls.from_module(bn, per_layer[src], comm))  # type: ignore[arg-type]
    return model


def _agree_on_plan(
    comm: Communicator,
    chosen: list[str],
    modes: dict[str, str],
    shares: dict[str, list[int]],
    timeout: float | None,
) -> None:
    # One fingerprint of the whole plan: ranks that disagree anywhere raise on every rank.
    fingerprint = zlib.crc32(repr([(n, modes[n], shares[n]) for n in chosen]).encode())
    what = "filter_parallel's layers, modes and shares (same model and arguments needed)"
    agree(comm, {what: fingerprint}, deadline(timeout))


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, new)


# -- state dicts ----------------------------------------------------------------------------------


def _gather(
    model: nn.Module, values: dict[str, torch.Tensor], dst: int | None, argument: str
) -> dict[str, torch.Tensor] | None:
    """Full tensors from ``values`` (keys as in ``model.state_dict()``), split ones gathered.

    Every rank's slices travel in one allgatherv of bytes: the shares say how long each rank's
    piece of each tensor is, so no sizes need exchanging first.
    """
    split: dict[str, tuple[_ChannelSplit, int, int]] = {}
    for mname, m in model.named_modules():
        if isinstance(m, _ChannelSplit):
            for pname, (dim, unit) in m.split_spec().items():
                split[f"{mname}.{pname}" if mname else pname] = (m, dim, unit)
    comms = {id(m.comm): m.comm for m, _, _ in split.values()}
    if len(comms) > 1:
        raise ValueError(f"{argument}: split modules on different process groups")
    comm = next(iter(comms.values()), None)
    size = comm.size if comm is not None else 1
    if dst is not None and (not _is_int(dst) or not 0 <= dst < size):
        raise ValueError(f"dst: must be a rank in [0, {size}) or None, got {dst!r}")
    keep = comm is None or dst is None or comm.rank == dst
    pieces = []  # (key, dim, rows per rank, row shape, dtype, bytes per row)
    local = []
    for key, t in values.items():
        if key in split:
            m, dim, unit = split[key]
            moved = t.detach().cpu().movedim(dim, 0).contiguous()
            row = moved.shape[1:]
            row_bytes = moved[0].numel() * moved.element_size()
            pieces.append((key, dim, [s * unit for s in m.shares], row, t.dtype, row_bytes))
            local.append(moved.reshape(-1).view(torch.uint8))
    full: dict[str, torch.Tensor] = {}
    if comm is not None and pieces:
        per_rank = [sum(rows[r] * rb for _, _, rows, _, _, rb in pieces) for r in range(size)]
        out = torch.empty(sum(per_rank), dtype=torch.uint8)
        comm.iallgatherv(torch.cat(local).numpy(), out.numpy(), per_rank).wait(None)
        if keep:
            start = [sum(per_rank[:r]) for r in range(size)]
            for key, dim, rows, row, dtype, rb in pieces:
                parts = []
                for r in range(size):
                    n = rows[r] * rb
                    parts.append(out[start[r] : start[r] + n].view(dtype).view(rows[r], *row))
                    start[r] += n
                full[key] = torch.cat(parts).movedim(0, dim).contiguous()
    if not keep:
        return None
    return {k: full[k] if k in full else t.detach().clone() for k, t in values.items()}


def split_tensors(model: nn.Module) -> dict[str, tuple[torch.Tensor, int, int]]:
    """This rank's slices of split parameters and buffers: ``{name: (tensor, dim, start)}``,
    the tensor holding the full tensor's entries ``start ..`` along ``dim`` (names as in
    ``model.state_dict()``). Tensors that are not split are left out: they are whole on every
    rank.

    >>> split_tensors(nn.Linear(2, 2))
    {}
    """
    state = model.state_dict(keep_vars=True)
    return {k: (state[k], p.dim, p.start) for k, p in _parts(model).items() if not p.whole}


def gather_state_dict(model: nn.Module, *, dst: int | None = 0) -> dict[str, torch.Tensor] | None:
    """The state dict of the unsplit model: split parameters and buffers gathered from every
    rank; keys as in the original model. Returned on rank ``dst`` (None elsewhere), or on every
    rank with ``dst=None``. Every rank must call it (one allgatherv of all the slices; gathered
    tensors are on the CPU).

    >>> full = gather_state_dict(model)  # doctest: +SKIP
    >>> unsplit.load_state_dict(full)  # on rank 0  # doctest: +SKIP
    """
    return _gather(model, model.state_dict(), dst, "model")


def gather_gradients(model: nn.Module, *, dst: int | None = 0) -> dict[str, torch.Tensor] | None:
    """``{name: full gradient}`` for every parameter with a gradient, split ones gathered (as
    :func:`gather_state_dict`). For checking against the unsplit model.

    >>> grads = gather_gradients(model, dst=None)  # doctest: +SKIP
    """
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return _gather(model, grads, dst, "model")


# -- checkpoints: the unsplit model's state, and back into any split ------------------------------


def _parts(model: nn.Module) -> dict[str, Part]:
    """Every state-dict entry of ``model`` by name: where this rank's tensor sits in the
    unsplit model's (a channel slice for split ones, the whole tensor otherwise)."""
    state = model.state_dict(keep_vars=True)
    parts = {k: Part(tuple(t.shape)) for k, t in state.items()}
    for mname, m in model.named_modules():
        if isinstance(m, _ChannelSplit):
            for pname, (dim, unit) in m.split_spec().items():
                key = f"{mname}.{pname}" if mname else pname
                local = state[key]
                shape = list(local.shape)
                shape[dim] = sum(m.shares) * unit
                parts[key] = Part(tuple(shape), dim, m.offset * unit, int(local.shape[dim]))
    return parts


def _split_comm(model: nn.Module) -> Communicator | None:
    comms = {id(m.comm): m.comm for m in model.modules() if isinstance(m, _ChannelSplit)}
    if len(comms) > 1:
        raise ValueError("model: split modules on different process groups")
    return next(iter(comms.values()), None)


def gather_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, dst: int | None = 0
) -> dict[str, Any] | None:
    """The unsplit model's optimizer state: ``optimizer``'s state with every split tensor
    gathered from the ranks (SGD's momentum, Adam's moments: state shaped as its parameter is
    split as the parameter is), keyed by the parameter names of the original model, as
    torch.distributed.checkpoint's full optimizer state dict and FSDP's
    ``full_optim_state_dict`` are: ``{"state": {name: {...}}, "param_groups": [{..., "params":
    [names]}]}`` (:mod:`hetcoll.torch.state_dicts`). Returned on rank ``dst`` (None elsewhere),
    or on every rank with ``dst=None``. Collective, as :func:`gather_state_dict`: every rank
    calls it with its optimizer over ``model.parameters()``; ranks whose optimizer state
    differs in layout raise :class:`hetcoll.CollectiveMismatchError`, all of them.
    :func:`load_full_optimizer_state_dict` loads the result into any split of the model.

    >>> full = gather_optimizer_state_dict(model, opt, dst=None)  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: must be a torch.nn.Module, got {type(model).__name__}")
    comm = _split_comm(model)
    size = comm.size if comm is not None else 1
    if dst is not None and (not _is_int(dst) or not 0 <= dst < size):
        raise ValueError(f"dst: must be a rank in [0, {size}) or None, got {dst!r}")
    names: dict[int, str | None] = {id(p): n for n, p in model.named_parameters()}
    failure: BaseException | None = None
    state: dict[str, dict[str, Any]] = {}
    groups: list[tuple[dict[str, Any], list[str]]] = []
    try:
        state, groups = named_optimizer_state(optimizer, names)
    except (TypeError, ValueError) as e:
        failure = e
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    layout = [
        (n, f, state_kind(v, shapes[n]), str(getattr(v, "dtype", type(v).__name__)))
        for n, entries in state.items()
        for f, v in entries.items()
    ]
    if comm is not None:
        fields = {
            "the optimizer state's names, fields and dtypes": zlib.crc32(repr(layout).encode()),
            "the optimizer's param groups": zlib.crc32(repr(groups).encode()),
        }
        agree(comm, fields, failure=failure)
    elif failure is not None:
        raise failure
    full: dict[str, dict[str, Any]] = {n: {} for n in state}
    for field in dict.fromkeys(f for _, f, kind, _ in layout if kind == "sliced"):
        values = {n: state[n][field] for n, f, kind, _ in layout if f == field and kind == "sliced"}
        gathered = _gather(model, values, dst, "model")
        if gathered is not None:
            for n, t in gathered.items():
                full[n][field] = t
    if comm is not None and dst is not None and comm.rank != dst:
        return None
    for n, f, kind, _ in layout:
        if kind != "sliced":
            v = state[n][f]
            full[n][f] = v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
    return {
        "state": {n: {f: full[n][f] for f in state[n]} for n in state},
        "param_groups": [{**hyper, "params": listed} for hyper, listed in groups],
    }


def load_full_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load the unsplit model's ``state_dict`` (:func:`gather_state_dict`'s, or a plain
    model's) into ``model``, split or not: each rank keeps its slice of every split tensor,
    whatever split wrote the checkpoint. Local (no communication); keys and shapes are checked
    first, against the unsplit model, and a mismatch raises naming ``state_dict``.

    >>> model = filter_parallel(Net(), speeds=new_speeds)  # doctest: +SKIP
    >>> load_full_state_dict(model, ckpt["model"])  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: must be a torch.nn.Module, got {type(model).__name__}")
    check_full_state_dict(state_dict, {k: p.shape for k, p in _parts(model).items()})
    model.load_state_dict(state_dict)  # split modules slice full tensors (_ChannelSplit)


def load_full_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]
) -> None:
    """Load a full optimizer state dict (:func:`gather_optimizer_state_dict`'s, or
    :meth:`hetcoll.torch.Parallel.full_optimizer_state_dict`'s) into ``optimizer``, built over
    ``model.parameters()`` with the same param groups: each rank takes its slice of every split
    parameter's state, whatever split wrote it, and the saved hyperparameters. Local (no
    communication); names and shapes are checked first, against the unsplit model.

    >>> load_full_optimizer_state_dict(model, opt, ckpt["optimizer"])  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: must be a torch.nn.Module, got {type(model).__name__}")
    check_optimizer(optimizer)
    parts = _parts(model)
    params = dict(model.named_parameters())
    check_full_optimizer_state_dict(state_dict, {n: parts[n].shape for n in params})
    held: dict[int, tuple[str, Part] | None] = {id(p): (n, parts[n]) for n, p in params.items()}
    optimizer.load_state_dict(local_optimizer_state_dict(optimizer, state_dict, held))
