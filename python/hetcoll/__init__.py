"""hetcoll: balanced collective training on workers of unequal speed.

Decide who does how much (:func:`split`), combine uneven work exactly (:func:`weighted_sum`,
and the collectives and PyTorch integration in submodules), and predict before running.
"""

from hetcoll._core import __version__, finish_times, split
from hetcoll.kernels import num_threads, weighted_sum

__all__ = [
    "__version__",
    "finish_times",
    "num_threads",
    "split",
    "weighted_sum",
]
