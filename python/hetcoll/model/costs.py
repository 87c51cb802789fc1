"""Per-layer costs of a torch model for one input shape: FLOPs, parameters, activation and gradient
bytes, forward and backward, as the kernels the performance model times.

Nothing runs on real data: the model runs forward and backward on the ``meta`` device (shapes
only, no memory, no arithmetic) under a dispatch mode that counts every aten op - FLOPs by
``torch.utils.flop_counter``'s formulas, bytes read and written from the tensors' sizes - and
gives each op to the module call running it (backward ops to the call whose forward made their
autograd node). A layer is a leaf module's call or the ops a module's own ``forward`` runs
between its children (a residual add, attention written in ``forward``), so nothing is left out.
Convolutions and linear layers keep their GEMM formulas as in seed 003 / PyDTNN
(``conv = im2col + GEMM`` forward; two GEMMs + col2im backward) and normalisation, activation and
pooling layers their memory passes, because the predictors need their structure (bytes a filter
split divides, channels); every other layer is costed from its counted ops. A FLOP is a
multiply-add of a matmul-class op, as FlopCounterMode counts; element-wise work is costed by the
bytes it moves.

Every kernel is linear in the batch: ``flops = flops_per_sample * b`` and
``bytes = bytes_per_sample * b + bytes_fixed`` (weights do not grow with the batch). The part of
the bytes that belongs to the layer's output channels (filters) is kept apart, so filter-parallel
predictions can scale it with a device's share of the filters.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hetcoll.model.hardware import check_precision

# Traced batch: 2, not 1, because batch norm in training mode refuses one sample.
_TRACE_BATCH = 2
# Batch of the op-counting run (meta tensors: the size costs nothing). A prime no layer's size
# is likely to be a multiple of: a tensor whose element count it divides grows with the batch
# (activations, their gradients), any other is read or written once a step (weights, their
# gradients, position embeddings), so one run tells per-sample bytes from fixed ones.
_COUNT_BATCH = 1009


@dataclass(frozen=True)
class Kernel:
    """One kernel of a layer, linear in the batch ``b`` and the filter fraction ``phi``.

    flops(b, phi) = flops_per_sample * b * (phi if scales_with_filters else 1)
    bytes(b, phi) = (bytes_per_sample + phi * filter_bytes_per_sample) * b
                    + bytes_fixed + phi * filter_bytes_fixed
    """

    name: str
    flops_per_sample: float
    bytes_per_sample: float = 0.0
    bytes_fixed: float = 0.0
    filter_bytes_per_sample: float = 0.0
    filter_bytes_fixed: float = 0.0
    scales_with_filters: bool = False
    # Element-wise layer kernels (normalisation, softmax, counted ops) run at the device's
    # element-wise bandwidth, pooling kernels (``pool``) at its pooling bandwidth; GEMMs, data
    # movement (im2col) and plain activations at its memory bandwidth.
    elementwise: bool = False
    pool: bool = False
    # A convolution's GEMM: its arithmetic runs at the device's convolution FLOP rate, on
    # channels padded to the device's channel block: ``channels`` = (output, input) channels
    # of one group.
    conv: bool = False
    channels: tuple[int, int] = (0, 0)

    def flops(self, batch: float, filter_fraction: float = 1.0) -> float:
        f = self.flops_per_sample * batch
        return f * filter_fraction if self.scales_with_filters else f

    def moved_bytes(self, batch: float, filter_fraction: float = 1.0) -> float:
        return (
            (self.bytes_per_sample + filter_fraction * self.filter_bytes_per_sample) * batch
            + self.bytes_fixed
            + filter_fraction * self.filter_bytes_fixed
        )


@dataclass(frozen=True)
class LayerCost:
    """Costs of one leaf module. Bytes are for ``itemsize``-byte elements (float32: 4).

    ``filters``: output channels a filter-parallel split can divide (0: the layer is
    replicated). ``saved_bytes_per_sample``: activation memory kept for the backward pass.
    """

    name: str
    kind: str
    params: int
    param_bytes: float
    in_bytes_per_sample: float
    out_bytes_per_sample: float
    saved_bytes_per_sample: float
    filters: int
    forward: tuple[Kernel, ...]
    backward: tuple[Kernel, ...]
    #: Groups of a convolution (1 for every other layer): the runtime splits groups=1 only.
    groups: int = 1
    #: True for the ops a module's own ``forward`` runs between its children's calls (``kind``
    #: is then ``Type.forward``); False for a leaf module's call.
    own_ops: bool = False

    @property
    def gradient_bytes(self) -> float:
        """Bytes of this layer's weight gradients (what data parallelism allreduces)."""
        return self.param_bytes

    def forward_flops(self, batch: float) -> float:
        return sum(k.flops(batch) for k in self.forward)

    def backward_flops(self, batch: float) -> float:
        return sum(k.flops(batch) for k in self.backward)


@dataclass(frozen=True)
class ModelCosts:
    """Every leaf layer of a model in execution order, for samples of ``input_shape``."""

    layers: tuple[LayerCost, ...]
    input_shape: tuple[int, ...]
    itemsize: int
    notes: tuple[str, ...] = field(default=())
    #: Bytes of the module's buffers (BatchNorm running statistics), which DDP broadcasts from
    #: rank 0 before every forward.
    buffer_bytes: float = 0.0
    #: The mode :func:`hetcoll.torch.filter_parallel` would give each layer it splits (name,
    #: mode), read off the model by the runtime's own pairing rule; layers absent stay replicated.
    filter_modes: tuple[tuple[str, str], ...] = ()
    #: The model's layers as a :class:`hetcoll.Plan` counts them
    #: (:func:`hetcoll.torch.layers.model_layers`: an ``nn.Sequential``'s children, or the
    #: top-level calls of a traced forward), by name; empty when the model is not such a chain
    #: (``plan_layers_note`` says why).
    plan_layers: tuple[str, ...] = ()
    #: For each of ``layers``, the index in ``plan_layers`` of the top-level layer it runs in
    #: (non-decreasing: the top-level layers run in order).
    plan_layer_of: tuple[int, ...] = ()
    #: Bytes per sample of each plan layer's output: what a pipeline stage ending there sends.
    plan_out_bytes: tuple[float, ...] = ()
    #: Module type of each plan layer (``Call`` for a function traced out of a forward).
    plan_layer_kinds: tuple[str, ...] = ()
    #: For each first plan layer ``lo``: the modes the runtime's pairing rule gives a filter-split
    #: stage running from ``lo`` to the last layer, as (layer name, mode, the name of a
    #: split-output layer's split-input partner or ""). The rule pairs left to right, so a
    #: stage ending earlier has the same modes but gathers where the partner lies beyond its
    #: end (:meth:`stage_filter_modes`).
    stage_modes: tuple[tuple[tuple[str, str, str], ...], ...] = ()
    plan_layers_note: str = ""
    #: The training precision these costs are for (:data:`hetcoll.model.hardware.PRECISIONS`):
    #: the predictors run matmul-class kernels at the devices' peak for it.
    precision: str = "fp32"
    #: Bytes of one element the kernels read and write and the stages send (activations, and
    #: the 16-bit weight copies autocast makes): 2 under bf16 / fp16, else ``itemsize``.
    #: Parameters, gradients, optimizer state and the gradient allreduce stay ``itemsize``.
    activation_itemsize: int = 0

    def at_precision(self, precision: str) -> ModelCosts:
        """These costs for training at ``precision`` (``"fp32"``, ``"tf32"``, ``"bf16"``,
        ``"fp16"``; autocast semantics, docs/model.md "Precision"): every byte a kernel moves
        and every activation a stage sends scaled to the precision's element size; parameter
        and gradient bytes unchanged.

        >>> from torch import nn
        >>> c = layer_costs(nn.Linear(4, 3), (4,))
        >>> c.at_precision("bf16").layers[0].out_bytes_per_sample, c.layers[0].out_bytes_per_sample
        (6.0, 12.0)
        """
        from dataclasses import replace

        check_precision(precision)
        act = 2 if precision in ("bf16", "fp16") else self.itemsize
        f = act / (self.activation_itemsize or self.itemsize)

        def kernel(k: Kernel) -> Kernel:
            return replace(
                k,
                bytes_per_sample=k.bytes_per_sample * f,
                bytes_fixed=k.bytes_fixed * f,
                filter_bytes_per_sample=k.filter_bytes_per_sample * f,
                filter_bytes_fixed=k.filter_bytes_fixed * f,
            )

        layers = tuple(
            replace(
                x,
                in_bytes_per_sample=x.in_bytes_per_sample * f,
                out_bytes_per_sample=x.out_bytes_per_sample * f,
                saved_bytes_per_sample=x.saved_bytes_per_sample * f,
                forward=tuple(kernel(k) for k in x.forward),
                backward=tuple(kernel(k) for k in x.backward),
            )
            for x in self.layers
        )
        return replace(
            self,
            layers=layers,
            plan_out_bytes=tuple(b * f for b in self.plan_out_bytes),
            precision=precision,
            # 0: the same as ``itemsize``, as costs are built.
            activation_itemsize=0 if act == self.itemsize else act,
        )

    def plan_range(self, first: int, end: int) -> tuple[int, int]:
        """The half-open range of ``layers`` that plan layers ``[first, end)`` hold.

        >>> from torch import nn
        >>> c = layer_costs(nn.Sequential(nn.Linear(4, 3), nn.Flatten(), nn.Linear(3, 2)), (4,))
        >>> c.plan_range(0, 2), c.plan_range(2, 3)
        ((0, 2), (2, 3))
        """
        self.check_plan_layers()
        if not 0 <= first < end <= len(self.plan_layers):
            raise ValueError(
                f"layers: [{first}, {end}) is not a range of the model's "
                f"{len(self.plan_layers)} layers"
            )
        return _bisect(self.plan_layer_of, first), _bisect(self.plan_layer_of, end)

    def check_plan_layers(self) -> None:
        """Raise ``ValueError`` (saying why) when the model's layers cannot be cut as a Plan
        cuts them."""
        if not self.plan_layers:
            raise ValueError(
                "costs: the model's top-level layers are unknown"
                + (f" ({self.plan_layers_note})" if self.plan_layers_note else "")
                + "; plans need a model hetcoll.torch.layers.model_layers can cut"
            )

    def stage_filter_modes(self, first: int, end: int) -> dict[str, str]:
        """The mode of every layer a filter-split stage over plan layers ``[first, end)``
        splits (name -> "gather" / "split-output" / "split-input"), as
        :func:`hetcoll.torch.parallelize` builds the stage (the runtime's pairing rule on an
        ``nn.Sequential`` of those layers).

        >>> from torch import nn
        >>> c = layer_costs(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)), (4,))
        >>> c.stage_filter_modes(0, 3), c.stage_filter_modes(0, 2)
        ({'0': 'split-output', '2': 'split-input'}, {'0': 'gather'})
        """
        self.check_plan_layers()
        lo, hi = self.plan_range(first, end)
        names = {x.name for x in self.layers[lo:hi]}
        return {
            name: "gather" if mode == "split-output" and partner not in names else mode
            for name, mode, partner in self.stage_modes[first]
            if name in names
        }

    def stage_filter_pairs(self, first: int, end: int) -> dict[str, str]:
        """The split-output -> split-input pairs of :meth:`stage_filter_modes`, by name."""
        lo, hi = self.plan_range(first, end)
        names = {x.name for x in self.layers[lo:hi]}
        return {
            name: partner
            for name, mode, partner in self.stage_modes[first]
            if mode == "split-output" and name in names and partner in names
        }

    @property
    def params(self) -> int:
        return sum(x.params for x in self.layers)

    @property
    def param_bytes(self) -> float:
        return sum(x.param_bytes for x in self.layers)

    def forward_flops(self, batch: float) -> float:
        return sum(x.forward_flops(batch) for x in self.layers)

    def backward_flops(self, batch: float) -> float:
        return sum(x.backward_flops(batch) for x in self.layers)

    def saved_bytes_per_sample(self) -> float:
        return sum(x.saved_bytes_per_sample for x in self.layers)

    def table(self) -> str:
        """A per-layer text table (GFLOP per sample, forward / backward; params; bytes)."""
        rows = [
            f"{'layer':<24} {'kind':<12} {'params':>10} {'fwd MFLOP':>10} {'bwd MFLOP':>10} "
            f"{'act KiB':>9} {'grad KiB':>9}"
        ]
        for x in self.layers:
            rows.append(
                f"{x.name[:24]:<24} {x.kind[:12]:<12} {x.params:>10} "
                f"{x.forward_flops(1) / 1e6:>10.3f} {x.backward_flops(1) / 1e6:>10.3f} "
                f"{x.out_bytes_per_sample / 1024:>9.1f} {x.gradient_bytes / 1024:>9.1f}"
            )
        rows.append(
            f"{'total':<24} {'':<12} {self.params:>10} {self.forward_flops(1) / 1e6:>10.3f} "
            f"{self.backward_flops(1) / 1e6:>10.3f}"
        )
        return "\n".join(rows)


def _bisect(sorted_ints: Sequence[int], value: int) -> int:
    """The first index whose value is >= ``value``."""
    return bisect.bisect_left(sorted_ints, value)


def parse_shape(text: str) -> tuple[int, ...]:
    """``"3x32x32"`` -> ``(3, 32, 32)`` (one sample, no batch dimension).

    >>> parse_shape("3x32x32")
    (3, 32, 32)
    """
    try:
        shape = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"input: expected sizes like 3x32x32, got {text!r}") from None
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"input: every size must be >= 1, got {text!r}")
    return shape


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _add_bias(fwd: list[Kernel], bwd: list[Kernel], outputs_per_sample: int, item: int) -> None:
    """The bias of a conv or linear layer: an element-wise add over its outputs (read and write)
    forward, a reduction of the output gradient backward; both scale with the filters."""
    fwd.append(
        Kernel(
            "bias",
            0.0,
            filter_bytes_per_sample=2 * outputs_per_sample * item,
            scales_with_filters=True,
        )
    )
    bwd.append(
        Kernel(
            "bias-grad",
            0.0,
            filter_bytes_per_sample=outputs_per_sample * item,
            scales_with_filters=True,
        )
    )


def _conv_kernels(
    mod: nn.Conv2d | nn.Conv1d | nn.Conv3d,
    in_shape: tuple[int, ...],
    out_shape: tuple[int, ...],
    needs_input_grad: bool,
    item: int,
    im2col: bool,
) -> tuple[list[Kernel], list[Kernel]]:
    """GEMM forward; weight-gradient GEMM and input-gradient GEMM backward, per sample. With
    ``im2col`` the column matrix is materialised (im2col before the forward GEMM, col2im after
    the input-gradient GEMM) as in PyDTNN's ``Conv2D``; without, the convolution is an implicit
    GEMM (oneDNN, cuDNN) that never writes it."""
    g = mod.groups
    c_in, spatial_in = in_shape[0], _numel(in_shape[1:])
    c_out, spatial_out = out_shape[0], _numel(out_shape[1:])
    kk = (c_in // g) * _numel(mod.kernel_size)  # GEMM inner dimension of one group
    m = c_out // g  # filters of one group
    n = spatial_out  # output positions of one sample
    trivial = all(k == 1 for k in mod.kernel_size) and all(s == 1 for s in mod.stride)
    trivial = trivial and all(p == 0 for p in _as_tuple(mod.padding))
    trivial = trivial or not im2col
    fwd: list[Kernel] = []
    col_bytes = kk * g * n * item  # the column matrix of one sample
    if not trivial:
        fwd.append(Kernel("im2col", 0.0, bytes_per_sample=c_in * spatial_in * item + col_bytes))
    # Forward GEMM, per group: Y[m, n b] = W[m, kk] X_col[kk, n b].
    fwd.append(
        Kernel(
            "gemm",
            2.0 * m * n * kk * g,
            bytes_per_sample=n * kk * g * item,
            filter_bytes_per_sample=m * n * g * item,
            filter_bytes_fixed=m * kk * g * item,
            scales_with_filters=True,
            conv=True,
            channels=(m, c_in // g),
        )
    )
    bwd: list[Kernel] = []
    # dW[m, kk] = dY[m, n b] X_col^T[n b, kk]
    bwd.append(
        Kernel(
            "gemm-dW",
            2.0 * m * kk * n * g,
            bytes_per_sample=n * kk * g * item,
            filter_bytes_per_sample=m * n * g * item,
            filter_bytes_fixed=m * kk * g * item,
            scales_with_filters=True,
            conv=True,
            channels=(m, c_in // g),
        )
    )
    if needs_input_grad:
        # dX_col[kk, n b] = W^T[kk, m] dY[m, n b], then col2im adds the columns back.
        bwd.append(
            Kernel(
                "gemm-dX",
                2.0 * kk * n * m * g,
                bytes_per_sample=n * kk * g * item,
                filter_bytes_per_sample=m * n * g * item,
                filter_bytes_fixed=m * kk * g * item,
                scales_with_filters=True,
                conv=True,
                channels=(m, c_in // g),
            )
        )
        if not trivial:
            bwd.append(
                Kernel(
                    "col2im",
                    0.0,
                    bytes_per_sample=col_bytes + c_in * spatial_in * item,
                )
            )
    if mod.bias is not None:
        _add_bias(fwd, bwd, c_out * n, item)
    return fwd, bwd


def _as_tuple(x: object) -> tuple[int, ...]:
    if isinstance(x, str):  # padding="same"/"valid": only matters for the im2col test above
        return (0,) if x == "valid" else (1,)
    if isinstance(x, int):
        return (x,)
    return tuple(x)  # type: ignore[arg-type]


def _linear_kernels(
    mod: nn.Linear,
    in_shape: tuple[int, ...],
    needs_input_grad: bool,
    item: int,
) -> tuple[list[Kernel], list[Kernel]]:
    """Forward GEMM Y[b r, out] = X[b r, in] W^T; backward dW and dX GEMMs (PyDTNN ``FC``)."""
    rows = _numel(in_shape[:-1])  # rows per sample (1 for a plain [batch, features] input)
    i, o = mod.in_features, mod.out_features
    fwd = [
        Kernel(
            "gemm",
            2.0 * rows * o * i,
            bytes_per_sample=rows * i * item,
            filter_bytes_per_sample=rows * o * item,
            filter_bytes_fixed=o * i * item,
            scales_with_filters=True,
        )
    ]
    bwd = [
        Kernel(
            "gemm-dW",
            2.0 * o * i * rows,
            bytes_per_sample=rows * i * item,
            filter_bytes_per_sample=rows * o * item,
            filter_bytes_fixed=o * i * item,
            scales_with_filters=True,
        )
    ]
    if needs_input_grad:
        bwd.append(
            Kernel(
                "gemm-dX",
                2.0 * rows * i * o,
                bytes_per_sample=rows * i * item,
                filter_bytes_per_sample=rows * o * item,
                filter_bytes_fixed=o * i * item,
                scales_with_filters=True,
            )
        )
    if mod.bias is not None:
        _add_bias(fwd, bwd, rows * o, item)
    return fwd, bwd


# Element-wise layers: (forward passes over memory, backward passes). A pass is one read or
# write of the tensor. Batch norm in training reads x twice (statistics, then normalise) and
# writes y; its backward reads dy and x twice and writes dx. Activations read and write once;
# their backward reads dy and the saved tensor and writes dx. Their FLOPs count as zero: a FLOP
# here is a multiply-add of a matmul-class op (what FlopCounterMode counts); element-wise
# kernels are memory-bound and costed by the bytes they move (so are a bias add and col2im).
_ELEMENTWISE: dict[type[nn.Module], tuple[float, float]] = {
    nn.BatchNorm1d: (3.0, 5.0),
    nn.BatchNorm2d: (3.0, 5.0),
    nn.BatchNorm3d: (3.0, 5.0),
    nn.LayerNorm: (3.0, 5.0),
    nn.GroupNorm: (3.0, 5.0),
    nn.ReLU: (2.0, 3.0),
    nn.ReLU6: (2.0, 3.0),
    nn.LeakyReLU: (2.0, 3.0),
    nn.Hardtanh: (2.0, 3.0),
    nn.GELU: (2.0, 3.0),
    nn.SiLU: (2.0, 3.0),
    nn.Sigmoid: (2.0, 3.0),
    nn.Tanh: (2.0, 3.0),
    nn.Dropout: (3.0, 3.0),
    nn.Softmax: (3.0, 3.0),
    nn.LogSoftmax: (3.0, 3.0),
}
# Activations that compare or clamp each element: one pass over memory (the others - GELU,
# SiLU, ... - compute a transcendental per element and run at the element-wise rate). Measured
# on one CPU core: ReLU streams at the copy bandwidth, batch norm at a fifth of it.
_STREAMING = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.Hardtanh)
# Pooling reads its input once and writes its output once (and scatters back in backward).
_POOLING = (
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AvgPool3d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool2d,
)
# Views: no data moves.
_VIEWS = (nn.Flatten, nn.Identity, nn.Unflatten)


def _elementwise_kernels(
    mod: nn.Module, in_elems: int, out_elems: int, item: int
) -> tuple[list[Kernel], list[Kernel]] | None:
    if isinstance(mod, _VIEWS):
        return [], []
    if isinstance(mod, _POOLING):
        return (
            [
                Kernel(
                    "pool",
                    0.0,
                    bytes_per_sample=(in_elems + out_elems) * item,
                    elementwise=True,
                    pool=True,
                )
            ],
            [
                Kernel(
                    "pool-grad",
                    0.0,
                    bytes_per_sample=(in_elems + 2 * out_elems) * item,
                    elementwise=True,
                    pool=True,
                )
            ],
        )
    for t, (fp, bp) in _ELEMENTWISE.items():
        if type(mod) is t or isinstance(mod, t):
            ew = not isinstance(mod, _STREAMING)
            return (
                [
                    Kernel(
                        t.__name__.lower(),
                        0.0,
                        bytes_per_sample=fp * out_elems * item,
                        elementwise=ew,
                    )
                ],
                [
                    Kernel(
                        t.__name__.lower() + "-grad",
                        0.0,
                        bytes_per_sample=bp * out_elems * item,
                        elementwise=ew,
                    )
                ],
            )
    return None


# Ops that allocate or alias without moving data, and ops that only write their output.
_NO_BYTES = frozenset(
    {
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "detach",
        "alias",
        "lift_fresh",
        "_unsafe_view",
        "_to_copy_meta_noop",
    }
)
_WRITE_ONLY = frozenset(
    {
        "zeros",
        "zeros_like",
        "ones",
        "ones_like",
        "full",
        "full_like",
        "new_zeros",
        "new_ones",
        "new_full",
        "fill_",
        "zero_",
        "scalar_tensor",
    }
)
# The autograd engine gives AccumulateGrad nodes this sequence number: they belong to no op.
_NO_SEQUENCE = 2**64 - 1


def _tensor_bytes(t: torch.Tensor) -> float:
    """Bytes an op reads or writes of ``t``: its elements, or its storage when that is smaller
    (a broadcast ``expand`` reads its few elements once)."""
    nbytes = t.numel() * t.element_size()
    try:
        return float(min(nbytes, t.untyped_storage().nbytes()))
    except (RuntimeError, NotImplementedError):
        return float(nbytes)


@dataclass
class _Call:
    """One costed layer as the trace meets it: a leaf module's call, or a run of ops that a
    module's own ``forward`` does between its children's calls (a residual add, attention's
    matmuls in a parent's code)."""

    name: str
    module: nn.Module
    leaf: bool
    in_shape: tuple[int, ...] = ()
    out_shape: tuple[int, ...] = ()
    needs_input_grad: bool = False
    # [forward, backward] x [matmul-class FLOPs, their per-sample bytes, their fixed bytes,
    # per-sample bytes of every other op, their fixed bytes], for the whole traced batch
    counts: list[list[float]] = field(default_factory=lambda: [[0.0] * 5, [0.0] * 5])
    #: Per-sample shapes are unknown for runs of ops: bytes of the first tensor the run reads
    #: and of the last one it writes stand for its input and output.
    first_in_bytes: float = -1.0
    last_out_bytes: float = 0.0
    #: The parameters (names) whose first use is in this call.
    params: list[str] = field(default_factory=list)


class _OpCounter(TorchDispatchMode):
    """Counts every aten op of a forward and backward pass: FLOPs by
    ``torch.utils.flop_counter``'s formulas (the ops ``FlopCounterMode`` counts), bytes read and
    written from the tensors' sizes; each op goes to the
    innermost module call running it (forward) or to the call whose forward op made the autograd
    node running it (backward: nodes are matched by their sequence numbers)."""

    def __init__(self, param_names: dict[int, str]) -> None:
        super().__init__()
        self.calls: list[_Call] = []
        # Module calls being run: [name, module, its leaf call or its current run of ops].
        self.stack: list[list[Any]] = []
        self.param_names = param_names
        self.param_seen: set[int] = set()
        self._pending: list[tuple[torch.Tensor, int]] = []
        self._node_seq: list[int] = []
        self._node_call: list[int] = []
        self.unattributed_bytes = 0.0

    def enter(self, name: str, module: nn.Module, args: tuple) -> None:
        leaf = not any(True for _ in module.children())
        call = None
        if leaf:
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            call = _Call(name, module, True)
            if x is not None:
                call.in_shape = tuple(x.shape[1:])
                call.needs_input_grad = bool(x.requires_grad)
            self.calls.append(call)
        self.stack.append([name, module, call])

    def leave(self, output: object) -> None:
        frame = self.stack.pop()
        call = frame[2]
        if call is not None and call.leaf:
            y = output[0] if isinstance(output, (tuple, list)) and output else output
            if isinstance(y, torch.Tensor):
                call.out_shape = tuple(y.shape[1:])

    def _forward_call(self) -> int | None:
        if not self.stack:
            return None
        frame = self.stack[-1]
        call = frame[2]
        if call is None or (not call.leaf and self.calls[-1] is not call):
            call = _Call(frame[0], frame[1], False)
            frame[2] = call
            self.calls.append(call)
        return len(self.calls) - 1

    def _flush(self) -> None:
        # The previous op's outputs carry their autograd node by now.
        for t, index in self._pending:
            node = t.grad_fn
            if node is not None:
                seq = node._sequence_nr()
                if not self._node_seq or seq > self._node_seq[-1]:
                    self._node_seq.append(seq)
                    self._node_call.append(index)
        self._pending.clear()

    def finish_forward(self) -> None:
        self._flush()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        from torch.utils.flop_counter import flop_registry

        kwargs = kwargs or {}
        self._flush()
        packet = func._overloadpacket
        # Unlike FlopCounterMode, no op is decomposed: a fused kernel (batch norm) moves the
        # bytes of its inputs and outputs, not of its decomposition's intermediates; only
        # batch norm decomposes on the models tested, into no matmul (the FLOPs agree).
        out = func(*args, **kwargs)
        node = torch._C._current_autograd_node()
        backward = node is not None
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if backward:
            seq = node._sequence_nr()
            at = bisect.bisect_right(self._node_seq, seq) - 1
            index = self._node_call[at] if seq != _NO_SEQUENCE and at >= 0 else None
        else:
            fresh = [
                t for t in inputs if id(t) in self.param_names and id(t) not in self.param_seen
            ]
            name = packet.__name__
            costly = not (func.is_view or name in _NO_BYTES)
            index = self._forward_call() if costly or fresh else None
            if index is not None:
                for t in fresh:
                    self.param_seen.add(id(t))
                    self.calls[index].params.append(self.param_names[id(t)])
                self._pending.extend((t, index) for t in outputs)
        name = packet.__name__
        if func.is_view or name in _NO_BYTES:
            return out
        moved = outputs if name in _WRITE_ONLY else [*{id(t): t for t in inputs}.values(), *outputs]
        per_sample = fixed = 0.0
        for t in moved:
            if t.numel() % _COUNT_BATCH == 0:
                per_sample += _tensor_bytes(t)
            else:
                fixed += _tensor_bytes(t)
        if index is None:
            self.unattributed_bytes += per_sample + fixed
            return out
        call = self.calls[index]
        c = call.counts[1 if backward else 0]
        flops = (
            flop_registry[packet](*args, **kwargs, out_val=out) if packet in flop_registry else 0
        )
        at = 1 if flops else 3
        c[0] += flops
        c[at] += per_sample
        c[at + 1] += fixed
        if not backward:
            # Only tensors that grow with the batch stand for the layer's input and output.
            if call.first_in_bytes < 0 and inputs and inputs[0].numel() % _COUNT_BATCH == 0:
                call.first_in_bytes = _tensor_bytes(inputs[0])
            if outputs and outputs[0].numel() % _COUNT_BATCH == 0:
                call.last_out_bytes = _tensor_bytes(outputs[0])
        return out


def _trace(model: nn.Module, shape: tuple[int, ...], batch: int, dtype: torch.dtype) -> _OpCounter:
    """Run ``model`` forward and backward on meta tensors for ``batch`` samples of ``shape``,
    counting every op (:class:`_OpCounter`)."""
    from torch.func import functional_call

    state = {
        k: torch.empty_like(v, device="meta").requires_grad_(v.requires_grad)
        for k, v in model.named_parameters()
    }
    param_names = {id(v): k for k, v in state.items()}
    state.update({k: torch.empty_like(v, device="meta") for k, v in model.named_buffers()})
    counter = _OpCounter(param_names)
    handles = []
    for name, mod in model.named_modules():
        label = name or type(mod).__name__

        def pre(m: nn.Module, args: tuple, _label: str = label) -> None:
            counter.enter(_label, m, args)

        def post(m: nn.Module, args: tuple, out: object) -> None:
            counter.leave(out)

        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post, always_call=True))
    x = torch.empty((batch, *shape), device="meta", dtype=dtype)
    was_training = model.training
    model.train()
    try:
        with counter:
            y = functional_call(model, state, (x,))
            counter.finish_forward()
            outs = [
                t for t in tree_flatten(y)[0] if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            if outs:
                torch.autograd.backward(outs, [torch.empty_like(t) for t in outs])
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        raise ValueError(f"input_shape: the model does not accept samples of {shape}: {e}") from e
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return counter


def _counted_kernels(call: _Call) -> tuple[list[Kernel], list[Kernel]]:
    """Kernels of a layer no formula describes, from its op counts: per direction one
    matmul-class kernel (the FLOPs FlopCounterMode counts: matmuls, convolutions, attention) and
    one element-wise kernel (every other op, costed by the bytes it moves)."""
    out: tuple[list[Kernel], list[Kernel]] = ([], [])
    for d, (kernels, suffix) in enumerate(zip(out, ("", "-grad"))):
        flops, mm, mm_fixed, ew, ew_fixed = call.counts[d]
        flops_ps, mm_ps, ew_ps = flops / _COUNT_BATCH, mm / _COUNT_BATCH, ew / _COUNT_BATCH
        if flops_ps or mm_ps or mm_fixed:
            kernels.append(
                Kernel("matmul" + suffix, flops_ps, bytes_per_sample=mm_ps, bytes_fixed=mm_fixed)
            )
        if ew_ps or ew_fixed:
            kernels.append(
                Kernel(
                    "ops" + suffix,
                    0.0,
                    bytes_per_sample=ew_ps,
                    bytes_fixed=ew_fixed,
                    elementwise=True,
                )
            )
    return out


def layer_costs(
    model: nn.Module,
    input_shape: Sequence[int] | str,
    *,
    dtype: torch.dtype = torch.float32,
    conv_algorithm: str = "implicit-gemm",
    precision: str = "fp32",
) -> ModelCosts:
    """Per-layer costs of ``model`` for one sample of ``input_shape`` (no batch dimension).

    ``conv_algorithm``: ``"implicit-gemm"`` (PyTorch's oneDNN / cuDNN kernels: no column
    matrix in memory) or ``"im2col"`` (PyDTNN's explicit im2col / col2im, seed 003).
    ``precision``: the training precision (:meth:`ModelCosts.at_precision`).

    The model runs forward and backward on the meta device (shapes only: no memory is
    allocated and no arithmetic runs, so a billion-parameter model costs the same to describe as
    a small one) under a dispatch mode that counts every aten op, once, for a batch of
    ``_COUNT_BATCH``. A layer is a leaf module's call, or a run of ops a module's own
    ``forward`` does between its children's calls (a residual add, the matmuls of an attention
    written in ``forward``): nothing the step runs is left out. Convolutions, linear layers and
    the element-wise layers of ``_ELEMENTWISE`` keep their kernel formulas (im2col, GEMMs, bias,
    the bytes a filter split divides); every other layer is costed from its ops' counts.

    >>> from torch import nn
    >>> c = layer_costs(nn.Linear(4, 3), (4,))
    >>> c.forward_flops(batch=1), c.params
    (24.0, 15)
    """
    from hetcoll.torch.filters import filter_modes

    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if conv_algorithm not in ("implicit-gemm", "im2col"):
        raise ValueError(
            f"conv_algorithm: expected 'implicit-gemm' or 'im2col', got {conv_algorithm!r}"
        )
    check_precision(precision)
    shape = parse_shape(input_shape) if isinstance(input_shape, str) else tuple(input_shape)
    if not shape or any(not isinstance(s, int) or s < 1 for s in shape):
        raise ValueError(f"input_shape: expected positive integer sizes, got {input_shape!r}")
    item = torch.empty((), dtype=dtype).element_size()

    counter = _trace(model, shape, _COUNT_BATCH, dtype)
    param_of = dict(model.named_parameters())

    layers: list[LayerCost] = []
    notes: list[str] = []
    for c2 in counter.calls:
        mod = c2.module
        owned = [param_of[n] for n in c2.params if n in param_of]
        n_params = sum(p.numel() for p in owned)
        p_bytes = float(sum(p.numel() * p.element_size() for p in owned))
        in_s, out_s = c2.in_shape, c2.out_shape
        in_e, out_e = _numel(in_s), _numel(out_s)
        filters, groups = 0, 1
        ks: tuple[list[Kernel], list[Kernel]] | None = None
        if c2.leaf and in_s and out_s:
            if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and not isinstance(
                mod, nn.modules.conv._ConvTransposeNd
            ):
                ks = _conv_kernels(
                    mod, in_s, out_s, c2.needs_input_grad, item, conv_algorithm == "im2col"
                )
                filters, groups = mod.out_channels, mod.groups
            elif isinstance(mod, nn.Linear):
                ks = _linear_kernels(mod, in_s, c2.needs_input_grad, item)
                filters = mod.out_features
            else:
                ks = _elementwise_kernels(mod, in_e, out_e, item)
        if ks is not None:
            # The formulas' matmul FLOPs against the ops actually counted.
            formula = sum(k.flops_per_sample for k in ks[0] if k.name.startswith("gemm"))
            counted = c2.counts[0][0] / _COUNT_BATCH
            if abs(formula - counted) > 0.01 * max(formula, counted):
                notes.append(
                    f"layer {c2.name!r}: formula {formula:.4g} matmul FLOPs per sample, "
                    f"ops counted {counted:.4g}"
                )
            in_b, out_b = float(in_e * item), float(out_e * item)
            saved = 0.0 if isinstance(mod, _VIEWS) else in_b
        else:
            ks = _counted_kernels(c2)
            if c2.leaf and in_s and out_s:
                in_b, out_b = float(in_e * item), float(out_e * item)
            else:
                in_b = max(c2.first_in_bytes, 0.0) / _COUNT_BATCH
                out_b = c2.last_out_bytes / _COUNT_BATCH
            saved = in_b
        layers.append(
            LayerCost(
                name=c2.name,
                kind=type(mod).__name__ if c2.leaf else f"{type(mod).__name__}.forward",
                params=n_params,
                param_bytes=p_bytes,
                in_bytes_per_sample=in_b,
                out_bytes_per_sample=out_b,
                saved_bytes_per_sample=saved,
                filters=filters,
                forward=tuple(ks[0]),
                backward=tuple(ks[1]),
                groups=groups,
                own_ops=not c2.leaf,
            )
        )
    unused = set(param_of) - {n for c in counter.calls for n in c.params}
    if unused:
        notes.append(f"{len(unused)} parameters are not used by the forward pass")
    if not layers or sum(x.forward_flops(1) for x in layers) == 0:
        notes.append("no costed layers found")
    leaves = [id(c.module) for c in counter.calls if c.leaf]
    if len(set(leaves)) < len(leaves):
        notes.append("some modules run more than once per step; each call is a layer")
    buffer_bytes = float(sum(b.numel() * b.element_size() for b in model.buffers()))
    # A bare leaf model is one layer named after its type (see ``_trace``).
    modes = tuple((n or type(model).__name__, m) for n, m in filter_modes(model).items())
    costs = ModelCosts(tuple(layers), shape, item, tuple(notes), buffer_bytes, modes)
    costs = _with_plan_layers(costs, model, dtype)
    return costs if precision == "fp32" else costs.at_precision(precision)


def _with_plan_layers(costs: ModelCosts, model: nn.Module, dtype: torch.dtype) -> ModelCosts:
    """``costs`` with the model's top-level layers as a Plan counts them: each costed layer's
    top-level layer, the top-level layers' output bytes (a run on the meta device), and the
    modes the runtime would give a filter-split stage starting at each of them."""
    from dataclasses import replace

    from torch.func import functional_call

    from hetcoll.torch.filters import filter_modes
    from hetcoll.torch.layers import model_layers

    try:
        chain = model_layers(model)
    except (TypeError, ValueError) as e:
        return replace(costs, plan_layers_note=str(e))
    names = [n for n, _ in chain]
    index = {n: i for i, n in enumerate(names)}
    of: list[int] = []
    for layer in costs.layers:
        head = layer.name.split(".", 1)[0]
        if layer.own_ops and head not in index:
            # The top-level forward's own ops (between its layers) go with the layer before.
            of.append(of[-1] if of else 0)
            continue
        if head not in index:
            return replace(
                costs, plan_layers_note=f"layer {layer.name!r} runs outside the top-level layers"
            )
        of.append(index[head])
    if any(b < a for a, b in itertools.pairwise(of)):
        return replace(costs, plan_layers_note="the top-level layers do not run in order")
    out_bytes = []
    x = torch.empty((_TRACE_BATCH, *costs.input_shape), device="meta", dtype=dtype)
    was_training = model.training
    model.train()
    try:
        with torch.no_grad():
            for name, m in chain:
                state = {
                    k: torch.empty_like(v, device="meta")
                    for k, v in (*m.named_parameters(), *m.named_buffers())
                }
                x = functional_call(m, state, (x,)) if state else m(x)
                if not isinstance(x, torch.Tensor):
                    return replace(
                        costs, plan_layers_note=f"layer {name!r} does not return one tensor"
                    )
                out_bytes.append(float(x[0].numel() * x.element_size()))
    except (RuntimeError, TypeError, ValueError) as e:
        return replace(costs, plan_layers_note=f"the layers do not run one after another: {e}")
    finally:
        model.train(was_training)
    stage_modes = []
    for lo in range(len(chain)):
        modes = filter_modes(nn.Sequential(OrderedDict(chain[lo:])))
        keys = list(modes)
        rows = []
        for k, (name, mode) in enumerate(modes.items()):
            # The rule pairs a split-output layer with the next layer it splits.
            partner = ""
            if mode == "split-output" and k + 1 < len(keys) and modes[keys[k + 1]] == "split-input":
                partner = keys[k + 1]
            rows.append((name, mode, partner))
        stage_modes.append(tuple(rows))
    return replace(
        costs,
        plan_layers=tuple(names),
        plan_layer_of=tuple(of),
        plan_out_bytes=tuple(out_bytes),
        plan_layer_kinds=tuple(type(m).__name__ for _, m in chain),
        stage_modes=tuple(stage_modes),
    )
