"""PyTorch integration: balanced data parallelism (speed probe, sampler, exact sample-weighted
gradient averaging for DDP and for MPI, rebalancing) and emulated heterogeneity for trying it on
one machine."""

from hetcoll.torch.emulate import EmulatedSpeed
from hetcoll.torch.hooks import WeightedAllreduceState, weighted_allreduce_hook
from hetcoll.torch.mpi import DistributedOptimizer, broadcast_parameters
from hetcoll.torch.rebalance import Rebalancer
from hetcoll.torch.sampler import BalancedSampler
from hetcoll.torch.speed import SpeedFit, gather_speeds, measure_speed

__all__ = [
    "BalancedSampler",
    "DistributedOptimizer",
    "EmulatedSpeed",
    "Rebalancer",
    "SpeedFit",
    "WeightedAllreduceState",
    "broadcast_parameters",
    "gather_speeds",
    "measure_speed",
    "weighted_allreduce_hook",
]
