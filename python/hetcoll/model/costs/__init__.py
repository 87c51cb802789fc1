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
bytes it moves; the other arithmetic ops' FLOPs (norms, softmax, masks, RoPE) are counted apart
(``LayerCost.elementwise_flops_per_sample``).

A model's inputs may be a float sample shape, token ids (a shape and ``torch.int64``), example
tensors or a dict of keyword inputs (:mod:`hetcoll.model.costs.inputs`).

Every kernel is affine in the batch: ``flops = flops_per_sample * b + flops_fixed`` (work on
tensors that do not grow with the batch, once a step) and
``bytes = bytes_per_sample * b + bytes_fixed`` (weights do not grow with the batch). The part of
the bytes that belongs to the layer's output channels (filters) is kept apart, so filter-parallel
predictions can scale it with a device's share of the filters.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hetcoll.model.costs.layers import layer_costs
    from hetcoll.model.costs.records import (
        ExpertsBlock,
        Kernel,
        LayerCost,
        ModelCosts,
        ModelInput,
        SplitBlock,
        parse_shape,
    )

# Imported on first use: ``layer_costs`` imports torch (a second), while the records and the
# names of losses do not, so the command line parses its flags without it.
__all__ = [
    "ExpertsBlock",
    "Kernel",
    "LayerCost",
    "ModelCosts",
    "ModelInput",
    "SplitBlock",
    "layer_costs",
    "parse_shape",
    "split_input_partners",
]
_WHERE = {
    name: "hetcoll.model.costs.layers" if name == "layer_costs" else "hetcoll.model.costs.records"
    for name in __all__
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
