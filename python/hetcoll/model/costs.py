"""Per-layer costs of a torch model for one input shape: FLOPs, parameters, activation and gradient
bytes, forward and backward, as the kernels the performance model times.

Nothing runs on real data: the model is traced once on the ``meta`` device (shapes only, no
memory, no arithmetic) with a hook on every leaf module. Convolutions and linear layers become
GEMMs as in seed 003 / PyDTNN (``conv = im2col + GEMM`` forward; two GEMMs + col2im backward);
normalisation, activation and pooling layers become memory-bound element-wise kernels; any other
leaf module is counted by ``torch.utils.flop_counter.FlopCounterMode`` on meta tensors.

Every kernel is linear in the batch: ``flops = flops_per_sample * b`` and
``bytes = bytes_per_sample * b + bytes_fixed`` (weights do not grow with the batch). The part of
the bytes that belongs to the layer's output channels (filters) is kept apart, so filter-parallel
predictions can scale it with a device's share of the filters.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

# Traced batch: 2, not 1, because batch norm in training mode refuses one sample.
_TRACE_BATCH = 2


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
    # Element-wise layer kernels (normalisation, activation, pooling) run at the device's
    # element-wise bandwidth; GEMMs and data movement (im2col) at its memory bandwidth.
    elementwise: bool = False
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
    import bisect

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
            outputs_per_sample,
            filter_bytes_per_sample=2 * outputs_per_sample * item,
            scales_with_filters=True,
        )
    )
    bwd.append(
        Kernel(
            "bias-grad",
            outputs_per_sample,
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
                    float(kk * g * n),
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


# Element-wise layers: (forward flops per output element, forward passes over memory,
# backward flops per element, backward passes). A pass is one read or write of the tensor.
# Batch norm in training reads x twice (statistics, then normalise) and writes y; its backward
# reads dy and x twice and writes dx. Activations read and write once; their backward reads dy
# and the saved tensor and writes dx.
_ELEMENTWISE: dict[type[nn.Module], tuple[float, float, float, float]] = {
    nn.BatchNorm1d: (8.0, 3.0, 12.0, 5.0),
    nn.BatchNorm2d: (8.0, 3.0, 12.0, 5.0),
    nn.BatchNorm3d: (8.0, 3.0, 12.0, 5.0),
    nn.LayerNorm: (8.0, 3.0, 12.0, 5.0),
    nn.GroupNorm: (8.0, 3.0, 12.0, 5.0),
    nn.ReLU: (1.0, 2.0, 1.0, 3.0),
    nn.ReLU6: (2.0, 2.0, 1.0, 3.0),
    nn.LeakyReLU: (2.0, 2.0, 2.0, 3.0),
    nn.GELU: (8.0, 2.0, 12.0, 3.0),
    nn.SiLU: (4.0, 2.0, 6.0, 3.0),
    nn.Sigmoid: (4.0, 2.0, 3.0, 3.0),
    nn.Tanh: (4.0, 2.0, 3.0, 3.0),
    nn.Dropout: (2.0, 3.0, 1.0, 3.0),
    nn.Softmax: (5.0, 3.0, 4.0, 3.0),
    nn.LogSoftmax: (5.0, 3.0, 4.0, 3.0),
}
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
                    in_elems,
                    bytes_per_sample=(in_elems + out_elems) * item,
                    elementwise=True,
                )
            ],
            [
                Kernel(
                    "pool-grad",
                    in_elems,
                    bytes_per_sample=(in_elems + 2 * out_elems) * item,
                    elementwise=True,
                )
            ],
        )
    for t, (ff, fp, bf, bp) in _ELEMENTWISE.items():
        if type(mod) is t or isinstance(mod, t):
            return (
                [
                    Kernel(
                        t.__name__.lower(),
                        ff * out_elems,
                        bytes_per_sample=fp * out_elems * item,
                        elementwise=True,
                    )
                ],
                [
                    Kernel(
                        t.__name__.lower() + "-grad",
                        bf * out_elems,
                        bytes_per_sample=bp * out_elems * item,
                        elementwise=True,
                    )
                ],
            )
    return None


def _counted_kernels(
    mod: nn.Module,
    in_shape: tuple[int, ...],
    in_elems: int,
    out_elems: int,
    param_bytes: float,
    needs_input_grad: bool,
    item: int,
    dtype: torch.dtype,
) -> tuple[list[Kernel], list[Kernel]]:
    """A leaf module of unknown kind: FLOPs counted by FlopCounterMode on meta tensors (forward
    and backward separately), bytes = input + output (+ weights) per pass."""
    from torch.func import functional_call
    from torch.utils.flop_counter import FlopCounterMode

    params = {
        k: torch.empty_like(v, device="meta").requires_grad_(v.requires_grad)
        for k, v in mod.named_parameters()
    }
    buffers = {k: torch.empty_like(v, device="meta") for k, v in mod.named_buffers()}
    x = torch.empty((_TRACE_BATCH, *in_shape), device="meta", dtype=dtype)
    x.requires_grad_(needs_input_grad)
    fwd_count = FlopCounterMode(display=False)
    with fwd_count:
        y = functional_call(mod, {**params, **buffers}, (x,))
    bwd_flops = 0
    out = y[0] if isinstance(y, (tuple, list)) else y
    if isinstance(out, torch.Tensor) and out.requires_grad:
        bwd_count = FlopCounterMode(display=False)
        with bwd_count:
            out.sum().backward()
        bwd_flops = bwd_count.get_total_flops()
    per = float(_TRACE_BATCH)
    io = (in_elems + out_elems) * item
    return (
        [
            Kernel(
                "counted",
                fwd_count.get_total_flops() / per,
                bytes_per_sample=io,
                bytes_fixed=param_bytes,
            )
        ],
        [
            Kernel(
                "counted-grad",
                bwd_flops / per,
                bytes_per_sample=2 * io,
                bytes_fixed=2 * param_bytes,
            )
        ],
    )


def layer_costs(
    model: nn.Module,
    input_shape: Sequence[int] | str,
    *,
    dtype: torch.dtype = torch.float32,
    conv_algorithm: str = "implicit-gemm",
) -> ModelCosts:
    """Per-layer costs of ``model`` for one sample of ``input_shape`` (no batch dimension).

    ``conv_algorithm``: ``"implicit-gemm"`` (PyTorch's oneDNN / cuDNN kernels: no column
    matrix in memory) or ``"im2col"`` (PyDTNN's explicit im2col / col2im, seed 003).

    The model is traced on the meta device: no real memory is allocated and no arithmetic runs,
    so a billion-parameter model costs the same to describe as a small one. Only leaf modules
    are layers; arithmetic a ``forward`` does outside any leaf module (a residual ``x + y``)
    is not counted - its FLOPs, if any, are reported in ``notes``.

    >>> from torch import nn
    >>> c = layer_costs(nn.Linear(4, 3), (4,))
    >>> c.forward_flops(batch=1), c.params
    (27.0, 15)
    """
    from torch.func import functional_call
    from torch.utils.flop_counter import FlopCounterMode

    from hetcoll.torch.filters import filter_modes

    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if conv_algorithm not in ("implicit-gemm", "im2col"):
        raise ValueError(
            f"conv_algorithm: expected 'implicit-gemm' or 'im2col', got {conv_algorithm!r}"
        )
    shape = parse_shape(input_shape) if isinstance(input_shape, str) else tuple(input_shape)
    if not shape or any(not isinstance(s, int) or s < 1 for s in shape):
        raise ValueError(f"input_shape: expected positive integer sizes, got {input_shape!r}")
    item = torch.empty((), dtype=dtype).element_size()

    records: list[tuple[str, nn.Module, tuple[int, ...], tuple[int, ...], bool]] = []

    def hook(name: str):  # type: ignore[no-untyped-def]
        def record(mod: nn.Module, args: tuple, out: object) -> None:
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            y = out[0] if isinstance(out, (tuple, list)) else out
            if x is None or not isinstance(y, torch.Tensor):
                raise ValueError(
                    f"model: layer {name!r} ({type(mod).__name__}) does not map a tensor to a "
                    "tensor; only such leaf modules can be costed"
                )
            records.append(
                (name, mod, tuple(x.shape[1:]), tuple(y.shape[1:]), bool(x.requires_grad))
            )

        return record

    leaves = [(n, m) for n, m in model.named_modules() if not list(m.children())]
    handles = [m.register_forward_hook(hook(n or type(m).__name__)) for n, m in leaves]
    params = {
        k: torch.empty_like(v, device="meta").requires_grad_(v.requires_grad)
        for k, v in model.named_parameters()
    }
    buffers = {k: torch.empty_like(v, device="meta") for k, v in model.named_buffers()}
    x = torch.empty((_TRACE_BATCH, *shape), device="meta", dtype=dtype)
    was_training = model.training
    model.train()
    total = FlopCounterMode(display=False)
    try:
        with total:
            functional_call(model, {**params, **buffers}, (x,))
    except (RuntimeError, ValueError, TypeError) as e:
        if str(e).startswith("model:"):
            raise
        raise ValueError(f"input_shape: the model does not accept samples of {shape}: {e}") from e
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)

    layers: list[LayerCost] = []
    for name, mod, in_s, out_s, needs_grad in records:
        n_params = sum(p.numel() for p in mod.parameters(recurse=False))
        p_bytes = float(sum(p.numel() * p.element_size() for p in mod.parameters(recurse=False)))
        in_e, out_e = _numel(in_s), _numel(out_s)
        filters, groups = 0, 1
        ks: tuple[list[Kernel], list[Kernel]] | None
        if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and not isinstance(
            mod, nn.modules.conv._ConvTransposeNd
        ):
            ks = _conv_kernels(mod, in_s, out_s, needs_grad, item, conv_algorithm == "im2col")
            filters, groups = mod.out_channels, mod.groups
        elif isinstance(mod, nn.Linear):
            ks = _linear_kernels(mod, in_s, needs_grad, item)
            filters = mod.out_features
        else:
            ks = _elementwise_kernels(mod, in_e, out_e, item)
            if ks is None:
                ks = _counted_kernels(mod, in_s, in_e, out_e, p_bytes, needs_grad, item, dtype)
        # What autograd keeps for backward: the layer's input (views keep nothing).
        saved = 0.0 if isinstance(mod, _VIEWS) else float(in_e * item)
        layers.append(
            LayerCost(
                name=name,
                kind=type(mod).__name__,
                params=n_params,
                param_bytes=p_bytes,
                in_bytes_per_sample=float(in_e * item),
                out_bytes_per_sample=float(out_e * item),
                saved_bytes_per_sample=saved,
                filters=filters,
                forward=tuple(ks[0]),
                backward=tuple(ks[1]),
                groups=groups,
            )
        )
    notes: list[str] = []
    counted = sum(x.forward_flops(_TRACE_BATCH) for x in layers)
    # FlopCounterMode only sees matmul-like ops; if it finds more than our GEMM layers, some
    # arithmetic happens outside leaf modules.
    gemm_flops_seen = float(total.get_total_flops())
    gemm_flops_ours = sum(
        k.flops(_TRACE_BATCH)
        for x in layers
        for k in x.forward
        if k.name.startswith(("gemm", "counted"))
    )
    if gemm_flops_seen > 1.01 * gemm_flops_ours:
        notes.append(
            f"{(gemm_flops_seen - gemm_flops_ours) / _TRACE_BATCH:.4g} matmul FLOPs per sample run "
            "outside leaf modules and are not costed"
        )
    if not layers or counted == 0:
        notes.append("no costed layers found")
    if len(set(id(m) for _, m, *_ in records)) < len(records):
        notes.append("some modules run more than once per step; each call is a layer")
    buffer_bytes = float(sum(b.numel() * b.element_size() for b in model.buffers()))
    # A bare leaf model is one layer named after its type (see ``hook`` above).
    modes = tuple((n or type(model).__name__, m) for n, m in filter_modes(model).items())
    costs = ModelCosts(tuple(layers), shape, item, tuple(notes), buffer_bytes, modes)
    return _with_plan_layers(costs, model, dtype)


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
    of = []
    for layer in costs.layers:
        head = layer.name.split(".", 1)[0]
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
