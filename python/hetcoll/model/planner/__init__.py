"""The planner (:mod:`.search`); every name is importable from here."""

from __future__ import annotations

from hetcoll.model.planner.search import (
    ASYMMETRIC_MAX_DEVICES,
    ASYMMETRIC_MICRO_BATCHES,
    HYBRID_GROUP_SIZES,
    HYBRID_MICRO_PER_STAGE,
    HYBRID_STAGES,
    HYBRID_WORK_BUDGET,
    MAX_MICRO_BATCHES,
    OWNERS_MAX_DEVICES,
    OWNERS_MAX_VERTICES,
    OWNERS_MICRO_BATCHES,
    PIPELINE_MICRO_BATCHES,
    SUBSET_FULL_SEARCH_MAX_DEVICES,
    SWEEP_AXES,
    SearchReport,
    SweepPoint,
    explain,
    plan,
    plot_plans,
    plot_sweep,
    sweep,
)

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
