"""Predicted time and memory of one training step for a model on a cluster at given shares.

Three strategies, each evaluated with the terms of :mod:`hetcoll.model.terms`:

- data parallel (:func:`data_parallel`): device d trains ``shares[d]`` samples of the batch, then
  the gradients are summed by a ring allreduce in DDP-style buckets that overlap the backward pass;
- filter parallel (:func:`filter_parallel`): every conv / linear layer's filters are split over
  the devices, in the modes :func:`hetcoll.torch.filter_parallel` picks (:func:`filter_modes`):
  consecutive layers pair up as split-output -> split-input (one allreduce of partial outputs),
  the others gather their outputs (allgatherv); input gradients are summed (allreduce) in the
  backward pass;
- pipeline (:func:`pipeline`): contiguous stages of layers on the devices in order, GPipe
  or 1F1B micro-batches, with the bubble;
- expert parallel (:func:`expert_parallel`): data parallelism whose mixture-of-experts layers
  hold whole experts per device, the routed tokens exchanged by all-to-all;
- any :class:`hetcoll.Plan` (:func:`predict_plan`): replicas of any shape, each a pipeline of
  one-rank or filter-split stages over uneven micro-batches, as
  :func:`hetcoll.torch.parallelize` runs it; the pipeline above is one such plan.

Every prediction carries the breakdown of the step on its critical path (compute, memory stalls,
kernel overheads, exposed communication, optimizer, bubble - they add up to the step time), the
bytes each device holds, and whether that fits (infeasible plans are kept and marked, so the
planner can say why a strategy lost). Everything is vectorised over devices: a 1,024-device
cluster costs a few numpy calls per strategy.

The package: :mod:`.prediction` (what every predictor returns), :mod:`.timing` (layers on
devices), :mod:`.data`, :mod:`.experts`, :mod:`.filters`, :mod:`.plans` and :mod:`.pipelines`
(one module per strategy); any plan is laid out in costed layers (:mod:`.layout`), its alike
replicas grouped (:mod:`.classes`) and its step laid out (:mod:`.schedule`) of its stages' work
(:mod:`.work`).
Its modules share their private names; every name is importable from here.
"""

from __future__ import annotations

from hetcoll.model.predict.data import (
    DataParallelSchedule,
    balanced_batch_shares,
    data_parallel,
    data_parallel_schedule,
    ddp_buckets,
    even_batch_shares,
)
from hetcoll.model.predict.data import (
    _data_parallel_plan as _data_parallel_plan,
)
from hetcoll.model.predict.experts import (
    ExpertParallelSchedule,
    Loads,
    checked_loads,
    expert_parallel,
    expert_parallel_schedule,
)
from hetcoll.model.predict.filters import (
    FILTER_MODES,
    FilterParallelSchedule,
    filter_modes,
    filter_parallel,
    filter_parallel_schedule,
    stage_split,
    time_balanced_shares,
)
from hetcoll.model.predict.filters import (
    _check_modes as _check_modes,
)
from hetcoll.model.predict.filters import (
    _filter_parallel_plan as _filter_parallel_plan,
)
from hetcoll.model.predict.pipelines import (
    _boundary_bytes as _boundary_bytes,
)
from hetcoll.model.predict.pipelines import (
    _pipeline_plan as _pipeline_plan,
)
from hetcoll.model.predict.pipelines import (
    _pipeline_units as _pipeline_units,
)
from hetcoll.model.predict.pipelines import (
    chain_stages,
    pipeline,
    pipeline_stages,
)
from hetcoll.model.predict.plans import (
    ExpertPlanSchedule,
    StagesSpec,
    expert_plan_schedule,
    predict_plan,
    predict_stages,
)
from hetcoll.model.predict.prediction import (
    DDP_BUCKET_BYTES,
    DDP_FIRST_BUCKET_BYTES,
    Prediction,
)
from hetcoll.model.predict.prediction import (
    _get_plan as _get_plan,
)
from hetcoll.model.predict.prediction import (
    _set_plan as _set_plan,
)
from hetcoll.model.predict.schedule import PlanSchedule, plan_schedule
from hetcoll.model.predict.splits import blocks_need_empty, splits_loss
from hetcoll.model.predict.timing import (
    _ARRAYS as _ARRAYS,
)
from hetcoll.model.predict.timing import (
    LayerSeconds,
    check_costs_and_cluster,
    compute_seconds,
)
from hetcoll.model.predict.timing import (
    _channel_padding as _channel_padding,
)
from hetcoll.model.predict.timing import (
    _check_shares as _check_shares,
)
from hetcoll.model.predict.timing import (
    _DeviceArrays as _DeviceArrays,
)
from hetcoll.model.predict.timing import (
    _kernel_table as _kernel_table,
)
from hetcoll.model.predict.timing import (
    _KernelTable as _KernelTable,
)
from hetcoll.model.predict.timing import (
    _layer_times as _layer_times,
)
from hetcoll.model.predict.timing import (
    _memory_common as _memory_common,
)
from hetcoll.model.predict.timing import (
    _new_device_arrays as _new_device_arrays,
)

__all__ = [
    "DDP_BUCKET_BYTES",
    "DDP_FIRST_BUCKET_BYTES",
    "FILTER_MODES",
    "DataParallelSchedule",
    "ExpertParallelSchedule",
    "ExpertPlanSchedule",
    "FilterParallelSchedule",
    "LayerSeconds",
    "Loads",
    "PlanSchedule",
    "Prediction",
    "StagesSpec",
    "balanced_batch_shares",
    "blocks_need_empty",
    "chain_stages",
    "check_costs_and_cluster",
    "checked_loads",
    "compute_seconds",
    "data_parallel",
    "data_parallel_schedule",
    "ddp_buckets",
    "even_batch_shares",
    "expert_parallel",
    "expert_parallel_schedule",
    "expert_plan_schedule",
    "filter_modes",
    "filter_parallel",
    "filter_parallel_schedule",
    "pipeline",
    "pipeline_stages",
    "plan_schedule",
    "predict_plan",
    "predict_stages",
    "splits_loss",
    "stage_split",
    "time_balanced_shares",
]
