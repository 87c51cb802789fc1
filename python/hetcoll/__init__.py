"""hetcoll: balanced collective training on workers of unequal speed.

Decide who does how much (:func:`split`), combine uneven work exactly (:func:`weighted_sum`,
and the collectives and PyTorch integration in submodules), and predict before running.
"""

from hetcoll import comm, fusion
from hetcoll._core import __version__, finish_times, split
from hetcoll.collectives import allgatherv, allreduce
from hetcoll.errors import CollectiveMismatchError, CollectiveTimeout
from hetcoll.kernels import num_threads, weighted_sum

__all__ = [
    "CollectiveMismatchError",
    "CollectiveTimeout",
    "__version__",
    "allgatherv",
    "allreduce",
    "comm",
    "finish_times",
    "fusion",
    "num_threads",
    "split",
    "weighted_sum",
]
