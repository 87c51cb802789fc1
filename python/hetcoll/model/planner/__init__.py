"""The planner: which strategy, which split, how fast - and how that changes along seed 003's five
axes (batch size, device FLOP/s, memory bandwidth, link bandwidth, cluster size).

:func:`plan` costs every candidate of its space and ranks them, feasible plans first, fastest
first; :func:`explain` says why a plan takes its time (its bottleneck term); :func:`plot_plans`
draws predicted step time by plan; :func:`sweep` re-plans along one axis.

The package, one purpose a module, each importing only those below it: :mod:`.sweeps` (the
axes), then :mod:`.search` (:func:`plan`: the space and how it is searched fast, described
there), then :mod:`.placements` (seed 002's node-wise plans as candidates) and
:mod:`.experts` (expert parallelism's candidates), then
:mod:`.rates` (how fast each device trains the model), :mod:`.subsets` (the device sets the
search tries) and :mod:`.report` (:class:`SearchReport`, :func:`explain`, :func:`plot_plans`).
Every public name is importable from here.
"""

from __future__ import annotations

from hetcoll.model.planner.placements import (
    OWNERS_MAX_DEVICES,
    OWNERS_MAX_VERTICES,
    OWNERS_MICRO_BATCHES,
)
from hetcoll.model.planner.report import SearchReport, explain, plot_plans
from hetcoll.model.planner.search import (
    ASYMMETRIC_MAX_DEVICES,
    ASYMMETRIC_MICRO_BATCHES,
    HYBRID_GROUP_SIZES,
    HYBRID_MICRO_PER_STAGE,
    HYBRID_STAGES,
    HYBRID_WORK_BUDGET,
    MAX_MICRO_BATCHES,
    PIPELINE_MICRO_BATCHES,
    plan,
)
from hetcoll.model.planner.subsets import SUBSET_FULL_SEARCH_MAX_DEVICES
from hetcoll.model.planner.sweeps import SWEEP_AXES, SweepPoint, plot_sweep, sweep

__all__ = [
    "ASYMMETRIC_MAX_DEVICES",
    "ASYMMETRIC_MICRO_BATCHES",
    "HYBRID_GROUP_SIZES",
    "HYBRID_MICRO_PER_STAGE",
    "HYBRID_STAGES",
    "HYBRID_WORK_BUDGET",
    "MAX_MICRO_BATCHES",
    "OWNERS_MAX_DEVICES",
    "OWNERS_MAX_VERTICES",
    "OWNERS_MICRO_BATCHES",
    "PIPELINE_MICRO_BATCHES",
    "SUBSET_FULL_SEARCH_MAX_DEVICES",
    "SWEEP_AXES",
    "SearchReport",
    "SweepPoint",
    "explain",
    "plan",
    "plot_plans",
    "plot_sweep",
    "sweep",
]
