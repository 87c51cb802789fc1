"""The kernel formulas of the layers the predictors need the structure of: convolutions and
linear layers as GEMMs (im2col or implicit GEMM, seed 003 / PyDTNN), their biases, and the
memory passes of normalisation, activation and pooling layers."""

from __future__ import annotations

import torch
from torch import nn

from hetcoll.model.costs.records import Kernel, _numel


def _trains(mod: nn.Module, name: str) -> bool:
    """Whether ``mod``'s parameter ``name`` gets a gradient (not a frozen one's)."""
    p = getattr(mod, name, None)
    return isinstance(p, torch.Tensor) and p.requires_grad


def _add_bias(fwd: list[Kernel], bwd: list[Kernel], outputs_per_sample: int, item: int) -> None:
    """The bias of a conv or linear layer: an element-wise add over its outputs (read and write)
    forward, a reduction of the output gradient backward (where the bias trains; the caller
    drops it for a frozen one); both scale with the filters."""
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
    """GEMM forward; weight-gradient GEMM and input-gradient GEMM backward, per sample (of
    ``in_shape`` in, ``out_shape`` out, whatever leads the channels). With
    ``im2col`` the column matrix is materialised (im2col before the forward GEMM, col2im after
    the input-gradient GEMM) as in PyDTNN's ``Conv2D``; without, the convolution is an implicit
    GEMM (oneDNN, cuDNN) that never writes it."""
    g = mod.groups
    # The channels are the layer's own: a sample's shape may lead with more than them (a
    # clip's frames or a block's heads folded into the batch the layer sees: (frames, C, H,
    # W)), each a position more of the GEMM (the caller checks the sizes divide).
    c_in, c_out = mod.in_channels, mod.out_channels
    spatial_in, spatial_out = _numel(in_shape) // c_in, _numel(out_shape) // c_out
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

    def gemm(name: str) -> Kernel:
        # Each of the three GEMMs, per group, m x kk x n b: the columns (or their gradient)
        # per sample, the filters' outputs (or their gradient) per sample, their weights.
        return Kernel(
            name,
            2.0 * m * n * kk * g,
            bytes_per_sample=n * kk * g * item,
            filter_bytes_per_sample=m * n * g * item,
            filter_bytes_fixed=m * kk * g * item,
            scales_with_filters=True,
            conv=True,
            channels=(m, c_in // g),
        )

    fwd.append(gemm("gemm"))  # Y[m, n b] = W[m, kk] X_col[kk, n b]
    bwd: list[Kernel] = []
    if _trains(mod, "weight"):  # a frozen weight gets no gradient
        bwd.append(gemm("gemm-dW"))  # dW[m, kk] = dY[m, n b] X_col^T[n b, kk]
    if needs_input_grad:
        # dX_col[kk, n b] = W^T[kk, m] dY[m, n b], then col2im adds the columns back.
        bwd.append(gemm("gemm-dX"))
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
        if not _trains(mod, "bias"):
            bwd.pop()
    return fwd, bwd


def _as_tuple(x: object) -> tuple[int, ...]:
    if isinstance(x, str):  # padding="same"/"valid": only matters for the im2col test above
        return (0,) if x == "valid" else (1,)
    if isinstance(x, int):
        return (x,)
    return tuple(x)  # type: ignore[arg-type]


def _linear_kernels(
    mod: nn.Module,
    features: tuple[int, int],
    in_shape: tuple[int, ...],
    needs_input_grad: bool,
    item: int,
) -> tuple[list[Kernel], list[Kernel]]:
    """Forward GEMM Y[b r, out] = X[b r, in] W^T; backward dW and dX GEMMs (PyDTNN ``FC``), for
    a layer of ``features`` (in, out): ``nn.Linear``, or Hugging Face's ``Conv1D`` (the same
    product, its weight stored transposed)."""
    rows = _numel(in_shape[:-1])  # rows per sample (1 for a plain [batch, features] input)
    i, o = features

    def gemm(name: str) -> Kernel:
        # Each of the three GEMMs, b r x in x out: the input (or its gradient) per sample, the
        # output's features (or their gradient) per sample, the weight.
        return Kernel(
            name,
            2.0 * rows * o * i,
            bytes_per_sample=rows * i * item,
            filter_bytes_per_sample=rows * o * item,
            filter_bytes_fixed=o * i * item,
            scales_with_filters=True,
        )

    fwd = [gemm("gemm")]
    bwd = [gemm("gemm-dW")] if _trains(mod, "weight") else []  # a frozen weight: no gradient
    if needs_input_grad:
        bwd.append(gemm("gemm-dX"))
    if getattr(mod, "bias", None) is not None:
        _add_bias(fwd, bwd, rows * o, item)
        if not _trains(mod, "bias"):
            bwd.pop()
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
