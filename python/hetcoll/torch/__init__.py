"""PyTorch integration: balanced data parallelism (speed probe, sampler, exact sample-weighted
gradient averaging for DDP and for MPI, rebalancing) and filter (model) parallelism with uneven,
speed-proportional channel splits. Emulated heterogeneity, for trying these on one machine, is
lab code: :mod:`hetcoll.lab.emulate`."""

from hetcoll.torch.filters import (
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
from hetcoll.torch.optimizer import DistributedOptimizer, broadcast_parameters
from hetcoll.torch.parallel import Parallel, parallelize
from hetcoll.torch.rebalance import Rebalancer
from hetcoll.torch.sampler import BalancedSampler
from hetcoll.torch.speed import SpeedFit, gather_speeds, measure_speed

__all__ = [
    "BalancedSampler",
    "DistributedOptimizer",
    "FilterParallelBatchNorm1d",
    "FilterParallelBatchNorm2d",
    "FilterParallelConv2d",
    "FilterParallelLinear",
    "Parallel",
    "Rebalancer",
    "SpeedFit",
    "WeightedAllreduceState",
    "broadcast_parameters",
    "filter_parallel",
    "gather_gradients",
    "gather_speeds",
    "gather_state_dict",
    "measure_speed",
    "parallelize",
    "set_emulated_speed",
    "weighted_allreduce_hook",
]


def __getattr__(name: str) -> object:
    # Deprecated for one release: emulated heterogeneity is lab code now.
    if name == "EmulatedSpeed":
        import importlib
        import warnings

        warnings.warn(
            "hetcoll.torch.EmulatedSpeed moved to hetcoll.lab.emulate.EmulatedSpeed; the old "
            "name goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module("hetcoll.lab.emulate").EmulatedSpeed
    raise AttributeError(f"module 'hetcoll.torch' has no attribute {name!r}")
