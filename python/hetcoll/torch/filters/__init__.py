"""Filter parallelism: Conv2d / Linear layers split along their channels, unevenly, across ranks.

Each rank holds only its share of a layer's output channels (filters) — the weights, the bias and
so the optimizer state — and computes only those channels; shares come from :func:`hetcoll.split`
over the ranks' speeds, so a rank twice as fast holds (and computes) twice as many filters.
PyTorch has neither tensor parallelism for convolutions nor arbitrary uneven shards (pytorch
#133221, #144109); this package gives both, on torch.distributed (gloo, NCCL) and on MPI, through
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

Transformers get the same pairing by another rule (:class:`~.heads.TensorSplit`): an
attention split by whole heads (by key/value group under grouped-query attention; Hugging Face
Llama-style q/k/v/o, GPT-2's packed ``Conv1D`` ``c_attn``, torch's ``nn.MultiheadAttention``) and
an MLP by hidden units (read off its torch.fx graph), the layers reading the block's input
split-output (one shared copy of the input: :class:`SharedCopy`), the one mapping back
split-input: one sum-reduction per attention and per MLP forward, one of the input's gradient
backward. A mixture of experts (Hugging Face's experts modules) splits by each expert's hidden
units: one sum-reduction of its output forward, whatever the router picks.

>>> model = filter_parallel(DemoNet(), [1.0, 0.25], group)  # doctest: +SKIP
>>> opt = torch.optim.SGD(model.parameters(), lr=0.1)  # any elementwise optimizer  # doctest: +SKIP

The package, each module importing only those named before it: :mod:`.checks` (argument
checks, speeds into shares), :mod:`.autograd` (the layers' communication as autograd functions),
:mod:`.split_output` (a gathering layer's output kept split until an op needs it whole, and
the cross-entropy of logits split by vocabulary), :mod:`.layers` (the split modules; their
state dicts mark each slice where it sits in the unsplit tensor, as torch.distributed.checkpoint's
shards), :mod:`.shards` (the optimizer state of split parameters marked alike),
:mod:`.dora` (PEFT's DoRA magnitudes and weight norm split with their layer:
:class:`FilterParallelDoRA`), :mod:`.chains` (which layers split, and the chain pairing
rule), :mod:`.heads` (the record of a block split by heads or hidden units, and how a rank's
module holds its share),
:mod:`.head_guards` (what a split attention runs with: per-head inputs cut, empty ranks, a
packed layout checked), :mod:`.head_probes` (probe forwards on meta copies: how a packed
projection is read, whether a rank without heads runs), :mod:`.tensor_split` (which
attentions split by heads and which MLPs by hidden units: :func:`plan_tensor_splits`),
:mod:`.experts` (mixtures of experts split by each expert's hidden units:
:class:`FilterParallelExperts`), :mod:`.pairing` (the two rules combined: :func:`split_layout`,
:func:`filter_modes`), :mod:`.timing` (splits balanced by time),
:mod:`.convert` (:func:`filter_parallel`,
:func:`filter_shares`, :func:`split_traffic`) and :mod:`.state` (gathering a split model's
state dict, gradients and optimizer state, and loading full ones back). Every name other
code uses is importable from here.
"""

from __future__ import annotations

from hetcoll.torch.filters.chains import (
    ELEMENTWISE_MODULES,
    SPATIAL_MODULES,
    groups_for_every_rank,
    linear_features,
    projection_features,
    stacked_adapters,
    summed_before_gathering,
    vocabulary_ties,
)
from hetcoll.torch.filters.chains import (
    chain_filter_modes as chain_filter_modes,
)
from hetcoll.torch.filters.checks import MODES
from hetcoll.torch.filters.convert import filter_parallel, filter_shares, split_traffic
from hetcoll.torch.filters.dora import FilterParallelDoRA
from hetcoll.torch.filters.experts import ExpertsLayout, FilterParallelExperts, experts_layout
from hetcoll.torch.filters.head_probes import check_empty_heads
from hetcoll.torch.filters.heads import ConfigView, TensorSplit
from hetcoll.torch.filters.layers import (
    FilterParallelBatchNorm1d,
    FilterParallelBatchNorm2d,
    FilterParallelConv1D,
    FilterParallelConv2d,
    FilterParallelDepthwiseConv2d,
    FilterParallelEmbedding,
    FilterParallelGroupedConv2d,
    FilterParallelLinear,
    FilterParallelMultiheadAttention,
    FilterParallelRMSNorm,
    LocalConv1D,
    LocalConv2d,
    LocalLinear,
    SharedCopy,
    UpstreamCopy,
)
from hetcoll.torch.filters.layers import (
    FilterParallelLayer as FilterParallelLayer,
)
from hetcoll.torch.filters.pairing import SplitLayout, filter_modes, split_layout
from hetcoll.torch.filters.split_output import SplitCrossEntropy, SplitOutput
from hetcoll.torch.filters.state import (
    gather_gradients,
    gather_optimizer_state_dict,
    gather_state_dict,
    load_full_optimizer_state_dict,
    load_full_state_dict,
    split_tensors,
)
from hetcoll.torch.filters.tensor_split import plan_tensor_splits

__all__ = [
    "ELEMENTWISE_MODULES",
    "MODES",
    "SPATIAL_MODULES",
    "ConfigView",
    "ExpertsLayout",
    "FilterParallelBatchNorm1d",
    "FilterParallelBatchNorm2d",
    "FilterParallelConv1D",
    "FilterParallelConv2d",
    "FilterParallelDepthwiseConv2d",
    "FilterParallelDoRA",
    "FilterParallelEmbedding",
    "FilterParallelExperts",
    "FilterParallelGroupedConv2d",
    "FilterParallelLinear",
    "FilterParallelMultiheadAttention",
    "FilterParallelRMSNorm",
    "LocalConv1D",
    "LocalConv2d",
    "LocalLinear",
    "SharedCopy",
    "SplitCrossEntropy",
    "SplitLayout",
    "SplitOutput",
    "TensorSplit",
    "UpstreamCopy",
    "check_empty_heads",
    "experts_layout",
    "filter_modes",
    "filter_parallel",
    "filter_shares",
    "gather_gradients",
    "gather_optimizer_state_dict",
    "gather_state_dict",
    "groups_for_every_rank",
    "linear_features",
    "load_full_optimizer_state_dict",
    "load_full_state_dict",
    "plan_tensor_splits",
    "projection_features",
    "split_layout",
    "split_tensors",
    "split_traffic",
    "stacked_adapters",
    "summed_before_gathering",
    "vocabulary_ties",
]
