"""Collectives over uneven shards: the weighted allreduce and allgatherv, on MPI or torch.

- :func:`allreduce` — in place, ``buf <- sum over ranks r of weight_r * buf_r``, by one of
  :data:`ALGORITHMS`: "ring" (reduce-scatter + allgather over chunks sized by
  :func:`hetcoll.split`, scheduled in Rust, reduced by the Rust ``weighted_sum`` kernel with the
  weight fused in, pipelined segment by segment), "native" (a Rust pre-scale, then the engine's
  allreduce SUM), "direct" (every rank's raw buffer and weight to every other rank in one round,
  then one Rust pass in rank order), "shared" (MPI, every rank on one node: MPI-3 shared-memory
  windows), or "auto" (:func:`choose_algorithm`).
- :func:`allgatherv` — pieces of different lengths along axis 0 (MPI_Allgatherv; on gloo, whose
  all_gather rejects uneven pieces, a speculative first round, all_to_all_single or
  point-to-point messages).
- :func:`allgatherv_autograd` — the same for torch tensors that carry gradients: the gradient
  of a rank's piece is its slice of the output gradient summed over ranks (a reduce-scatter).

Every call takes ``timeout`` (seconds): a dead or silent peer raises
:class:`hetcoll.CollectiveTimeout` instead of hanging. allreduce first compares length, dtype,
algorithm, speeds and segment size across ranks (``check=True``, the default) and raises
:class:`hetcoll.CollectiveMismatchError` on every rank when they differ; allgatherv always does.

One module per capability: :mod:`.dispatch` (allreduce, "auto"), :mod:`.ring`, :mod:`.native`,
:mod:`.direct`, :mod:`.shared`, :mod:`.device` (device tensors), :mod:`.gather` (allgatherv),
:mod:`.speculative` (allgatherv's first round on gloo), :mod:`.autograd`; ``_header``
(allgatherv's header and agreement check), ``_common`` (names, tags, scratch) and ``_tuning``.

The tuning constants (crossover and segment sizes, ``SEGMENT_BYTES`` and the others in
``__all__``) live in the private table :mod:`hetcoll.collectives._tuning`, which the algorithms
read at call time. ``hetcoll.collectives.SEGMENT_BYTES`` reads it, and assigning to it rebinds
the table's entry (so the next call sees it); what each constant is and why it has its value is
in docs/collectives.md, "Tuning table".
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from hetcoll.collectives import _tuning
from hetcoll.collectives._common import ALGORITHMS
from hetcoll.collectives.autograd import allgatherv_autograd
from hetcoll.collectives.device import premul_sum_op
from hetcoll.collectives.direct import direct_allreduce
from hetcoll.collectives.dispatch import allreduce, choose_algorithm
from hetcoll.collectives.gather import allgatherv

if TYPE_CHECKING:  # at run time, properties that read the tuning table (``_Package``)
    from hetcoll.collectives._tuning import (
        BATCHED_GATHER_BYTES,
        DIRECT_BYTES,
        DIRECT_TWO_RANKS_FROM_BYTES,
        GATHER_PERIODS,
        GATHER_RING_CROSSOVER_BYTES,
        NATIVE_HALVES_FROM_BYTES,
        NATIVE_HALVES_TWO_RANKS_FROM_BYTES,
        RING_CROSSOVER_BYTES,
        RING_TWO_RANKS_FROM_BYTES,
        SEGMENT_BYTES,
        SHARED_FROM_BYTES,
        SHARED_GATHER_BELOW_BYTES,
        SHARED_ONE_ROUND_BYTES,
        SHARED_SEGMENT_BYTES,
        SPECULATIVE_GATHER_ENGINES,
        TWO_RANK_SEGMENT_BYTES,
    )

__all__ = [
    "ALGORITHMS",
    "BATCHED_GATHER_BYTES",
    "CHECK_INLINE_BYTES",
    "DIRECT_BYTES",
    "DIRECT_TWO_RANKS_FROM_BYTES",
    "GATHER_PERIODS",
    "GATHER_RING_CROSSOVER_BYTES",
    "NATIVE_HALVES_FROM_BYTES",
    "NATIVE_HALVES_TWO_RANKS_FROM_BYTES",
    "RING_CROSSOVER_BYTES",
    "RING_TWO_RANKS_FROM_BYTES",
    "SEGMENT_BYTES",
    "SHARED_FROM_BYTES",
    "SHARED_GATHER_BELOW_BYTES",
    "SHARED_ONE_ROUND_BYTES",
    "SHARED_SEGMENT_BYTES",
    "SPECULATIVE_GATHER_ENGINES",
    "TWO_RANK_SEGMENT_BYTES",
    "allgatherv",
    "allgatherv_autograd",
    "allreduce",
    "choose_algorithm",
    "direct_allreduce",
    "premul_sum_op",
]

#: The tuning table's names, which this package reads and rebinds in :mod:`._tuning`.
_TUNING = frozenset(name for name in vars(_tuning) if name.isupper())


def __dir__() -> list[str]:
    return sorted({*globals(), *_TUNING})


class _Package(types.ModuleType):
    """This package's module type: each tuning name is a property that reads the table and
    rebinds the table's entry on assignment, so ``hetcoll.collectives.SEGMENT_BYTES = n`` (or
    monkeypatching it, and undoing that) acts on what the algorithms read, as it did when the
    constants lived in this module."""


def _forwarded(name: str) -> property:
    def read(_: types.ModuleType) -> Any:
        return getattr(_tuning, name)

    def rebind(_: types.ModuleType, value: Any) -> None:
        setattr(_tuning, name, value)

    return property(read, rebind, doc=f"``_tuning.{name}``")


for _name in _TUNING:
    setattr(_Package, _name, _forwarded(_name))
del _name
sys.modules[__name__].__class__ = _Package
