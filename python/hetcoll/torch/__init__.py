"""PyTorch integration: balanced data parallelism (speed probe, sampler, exact sample- or
token-weighted gradient averaging for DDP, for MPI and, on the loss, for FSDP and other engines
that average; rebalancing), filter (model)
parallelism with uneven, speed-proportional channel splits (transformers: attention by heads,
MLPs by hidden units), and expert parallelism (whole experts per rank, by speed and load).
Emulated heterogeneity, for trying these on one machine, is lab code: :mod:`hetcoll.lab.emulate`.
"""

from typing import TYPE_CHECKING

from hetcoll.torch.batches import BatchCounter, item_total, item_weights
from hetcoll.torch.clipping import clip_grad_norm_
from hetcoll.torch.expert_parallel import (
    ExpertParallelExperts,
    expert_assignment,
    expert_loads,
    expert_parallel,
    expert_shares,
    is_rank_local,
    leave_to_ranks,
    place_experts,
    rank_local_parameters,
)
from hetcoll.torch.expert_rebalance import (
    ExpertRebalanceEvent,
    ExpertRebalancer,
    placement_time,
    refined_placement,
)
from hetcoll.torch.filters import (
    FilterParallelBatchNorm1d,
    FilterParallelBatchNorm2d,
    FilterParallelConv1D,
    FilterParallelConv2d,
    FilterParallelDepthwiseConv2d,
    FilterParallelGroupedConv2d,
    FilterParallelLinear,
    FilterParallelMultiheadAttention,
    SplitOutput,
    filter_parallel,
    filter_shares,
    gather_gradients,
    gather_optimizer_state_dict,
    gather_state_dict,
    load_full_optimizer_state_dict,
    load_full_state_dict,
    split_traffic,
)
from hetcoll.torch.hooks import (
    WeightedAllreduceState,
    register_weighted_hook,
    weighted_allreduce_hook,
)
from hetcoll.torch.layers import model_layers
from hetcoll.torch.loss_scaling import GroupGradScaler
from hetcoll.torch.optimizer import DistributedOptimizer, broadcast_parameters
from hetcoll.torch.parallel import Parallel, parallelize
from hetcoll.torch.rebalance import Rebalancer
from hetcoll.torch.sampler import BalancedSampler
from hetcoll.torch.speed import SpeedFit, gather_speeds, measure_speed
from hetcoll.torch.step_timer import StepTimer
from hetcoll.torch.weighing import weigh_loss

if TYPE_CHECKING:  # loaded on use (below): it imports torch.distributed.checkpoint (~0.5 s)
    from hetcoll.torch.dcp_planner import ReplicaSavePlanner

__all__ = [
    "BalancedSampler",
    "BatchCounter",
    "DistributedOptimizer",
    "ExpertParallelExperts",
    "ExpertRebalanceEvent",
    "ExpertRebalancer",
    "FilterParallelBatchNorm1d",
    "FilterParallelBatchNorm2d",
    "FilterParallelConv1D",
    "FilterParallelConv2d",
    "FilterParallelDepthwiseConv2d",
    "FilterParallelGroupedConv2d",
    "FilterParallelLinear",
    "FilterParallelMultiheadAttention",
    "GroupGradScaler",
    "Parallel",
    "Rebalancer",
    "ReplicaSavePlanner",
    "SpeedFit",
    "SplitOutput",
    "StepTimer",
    "WeightedAllreduceState",
    "broadcast_parameters",
    "clip_grad_norm_",
    "expert_assignment",
    "expert_loads",
    "expert_parallel",
    "expert_shares",
    "filter_parallel",
    "filter_shares",
    "gather_gradients",
    "gather_optimizer_state_dict",
    "gather_speeds",
    "gather_state_dict",
    "is_rank_local",
    "item_total",
    "item_weights",
    "leave_to_ranks",
    "load_full_optimizer_state_dict",
    "load_full_state_dict",
    "measure_speed",
    "model_layers",
    "parallelize",
    "place_experts",
    "placement_time",
    "rank_local_parameters",
    "refined_placement",
    "register_weighted_hook",
    "split_traffic",
    "weigh_loss",
    "weighted_allreduce_hook",
]


#: Deprecated for one release: emulated heterogeneity is lab code now. Old name -> (lab
#: module, its name there); loaded on first use, so importing hetcoll.torch loads no lab code.
_MOVED_TO_THE_LAB = {
    "EmulatedSpeed": ("hetcoll.lab.emulate", "EmulatedSpeed"),
    "set_emulated_speed": ("hetcoll.lab.emulate", "slow_down_filter_parallel"),
}


def __getattr__(name: str) -> object:
    if name == "ReplicaSavePlanner":
        from hetcoll.torch.dcp_planner import ReplicaSavePlanner

        return ReplicaSavePlanner
    if name in _MOVED_TO_THE_LAB:
        import importlib
        import warnings

        module, new = _MOVED_TO_THE_LAB[name]
        warnings.warn(
            f"hetcoll.torch.{name} moved to {module}.{new}; the old name goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(module), new)
    raise AttributeError(f"module 'hetcoll.torch' has no attribute {name!r}")
