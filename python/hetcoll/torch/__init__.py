"""PyTorch integration: balanced data parallelism (speed probe, sampler, exact sample-weighted
gradient averaging for DDP and for MPI, rebalancing) and emulated heterogeneity for trying it on
one machine; filter (model) parallelism with uneven, speed-proportional channel splits."""

from hetcoll.torch.emulate import EmulatedSpeed
from hetcoll.torch.filter_parallel import (
    FilterParallelBatchNorm1d,
    FilterParallelBatchNorm2d,
    FilterParallelConv2d,
    FilterParallelLinear,
    filter_parallel,
    gather_gradients,
    gather_state_dict,
    set_emulated_speed,
)
from hetcoll.torch.hooks import WeightedAllreduceState, weighted_allreduce_hook
from hetcoll.torch.mpi import DistributedOptimizer, broadcast_parameters
from hetcoll.torch.rebalance import Rebalancer
from hetcoll.torch.sampler import BalancedSampler
from hetcoll.torch.speed import SpeedFit, gather_speeds, measure_speed

__all__ = [
    "BalancedSampler",
    "DistributedOptimizer",
    "EmulatedSpeed",
    "FilterParallelBatchNorm1d",
    "FilterParallelBatchNorm2d",
    "FilterParallelConv2d",
    "FilterParallelLinear",
    "Rebalancer",
    "SpeedFit",
    "WeightedAllreduceState",
    "broadcast_parameters",
    "filter_parallel",
    "gather_gradients",
    "gather_speeds",
    "gather_state_dict",
    "measure_speed",
    "set_emulated_speed",
    "weighted_allreduce_hook",
]
