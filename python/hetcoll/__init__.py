"""hetcoll: balanced collective training on workers of unequal speed.

Decide who does how much (:func:`split`), combine uneven work exactly (:func:`weighted_sum`,
and the collectives and PyTorch integration in submodules), and predict before running.
"""

from hetcoll import comm, fusion
from hetcoll._core import (
    __version__,
    chain_stage_times,
    finish_times,
    km1,
    partition_chain,
    partition_hypergraph,
    partition_items,
    refine_items,
    split,
)
from hetcoll.collectives import allgatherv, allreduce
from hetcoll.errors import CollectiveMismatchError, CollectiveTimeout
from hetcoll.kernels import num_threads, weighted_sum
from hetcoll.plan import Plan

__all__ = [
    "CollectiveMismatchError",
    "CollectiveTimeout",
    "Plan",
    "__version__",
    "allgatherv",
    "allreduce",
    "chain_stage_times",
    "comm",
    "finish_times",
    "fusion",
    "km1",
    "num_threads",
    "partition_chain",
    "partition_hypergraph",
    "partition_items",
    "refine_items",
    "split",
    "weighted_sum",
]
