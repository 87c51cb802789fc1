"""hetcoll.model: the performance model and planner.

Per-layer costs of a torch model (:func:`layer_costs`), a hardware description read from TOML
(:func:`load_cluster`), predicted step time and memory of data-, filter- and pipeline-parallel
training at given shares (:func:`predict_data_parallel`, :func:`predict_filter_parallel`,
:func:`predict_pipeline`), of any :class:`hetcoll.Plan` (:func:`predict_plan`), node-wise
placements from the hypergraph partitioner (:func:`hypergraph_plan`, their bytes and step time
:func:`placement_traffic`, :func:`predict_placement`), and the planner that ranks them
(:func:`plan`, :func:`sweep`). Calibration and validation on this machine live in
:mod:`hetcoll.lab.calibrate` and :mod:`hetcoll.lab.validate`.

Names are imported on first use, so ``hetcoll`` commands that do not plan never import torch.

>>> from hetcoll.model import layer_costs, load_cluster, plan, networks  # doctest: +SKIP
>>> costs = layer_costs(networks.build("cnn", (3, 32, 32)), (3, 32, 32))  # doctest: +SKIP
>>> plan(costs, load_cluster("examples/clusters/a100_v100_cpu.toml"), 512)[0]  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hetcoll.model import networks, terms
    from hetcoll.model.costs import Kernel, LayerCost, ModelCosts, layer_costs, parse_shape
    from hetcoll.model.hardware import (
        Cluster,
        Device,
        Link,
        Node,
        cluster_from_dict,
        load_cluster,
    )
    from hetcoll.model.hypergraph import (
        NetworkHypergraph,
        PartitionReport,
        network_hypergraph,
        partition_report,
    )
    from hetcoll.model.placement import (
        PlacementPrediction,
        hypergraph_plan,
        placement_traffic,
        predict_placement,
    )
    from hetcoll.model.planner import plan, sweep
    from hetcoll.model.predict import (
        Prediction,
        balanced_batch_shares,
        even_batch_shares,
        predict_plan,
    )
    from hetcoll.model.predict import data_parallel as predict_data_parallel
    from hetcoll.model.predict import filter_parallel as predict_filter_parallel
    from hetcoll.model.predict import pipeline as predict_pipeline

_WHERE = {
    "networks": "hetcoll.model.networks",
    "terms": "hetcoll.model.terms",
    "Kernel": "hetcoll.model.costs",
    "LayerCost": "hetcoll.model.costs",
    "ModelCosts": "hetcoll.model.costs",
    "layer_costs": "hetcoll.model.costs",
    "parse_shape": "hetcoll.model.costs",
    "Cluster": "hetcoll.model.hardware",
    "Device": "hetcoll.model.hardware",
    "Link": "hetcoll.model.hardware",
    "Node": "hetcoll.model.hardware",
    "cluster_from_dict": "hetcoll.model.hardware",
    "load_cluster": "hetcoll.model.hardware",
    "hypergraph_plan": "hetcoll.model.placement",
    "placement_traffic": "hetcoll.model.placement",
    "predict_placement": "hetcoll.model.placement",
    "PlacementPrediction": "hetcoll.model.placement",
    "plan": "hetcoll.model.planner",
    "sweep": "hetcoll.model.planner",
    "Prediction": "hetcoll.model.predict",
    "balanced_batch_shares": "hetcoll.model.predict",
    "predict": "hetcoll.model.predict",
    "predict_data_parallel": "hetcoll.model.predict",
    "even_batch_shares": "hetcoll.model.predict",
    "predict_filter_parallel": "hetcoll.model.predict",
    "predict_pipeline": "hetcoll.model.predict",
    "predict_plan": "hetcoll.model.predict",
    "NetworkHypergraph": "hetcoll.model.hypergraph",
    "PartitionReport": "hetcoll.model.hypergraph",
    "network_hypergraph": "hetcoll.model.hypergraph",
    "partition_report": "hetcoll.model.hypergraph",
}

__all__ = [
    "Cluster",
    "Device",
    "Kernel",
    "LayerCost",
    "Link",
    "ModelCosts",
    "NetworkHypergraph",
    "Node",
    "PartitionReport",
    "PlacementPrediction",
    "Prediction",
    "balanced_batch_shares",
    "cluster_from_dict",
    "even_batch_shares",
    "hypergraph_plan",
    "layer_costs",
    "load_cluster",
    "network_hypergraph",
    "networks",
    "parse_shape",
    "partition_report",
    "placement_traffic",
    "plan",
    "predict",
    "predict_data_parallel",
    "predict_filter_parallel",
    "predict_pipeline",
    "predict_placement",
    "predict_plan",
    "sweep",
    "terms",
]


#: Renamed so they no longer collide with the runtime's hetcoll.torch.filter_parallel; the old
#: names warn for one release.
_RENAMED = {
    "data_parallel": "predict_data_parallel",
    "filter_parallel": "predict_filter_parallel",
    "pipeline": "predict_pipeline",
}


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        import warnings

        new = _RENAMED[name]
        warnings.warn(
            f"hetcoll.model.{name} is now hetcoll.model.{new}; the old name goes in the next "
            "release",
            DeprecationWarning,
            stacklevel=2,
        )
        return __getattr__(new)
    if name not in _WHERE:
        raise AttributeError(f"module 'hetcoll.model' has no attribute {name!r}")
    module = importlib.import_module(_WHERE[name])
    # predict_data_parallel is predict.data_parallel; predict_plan is predict.predict_plan
    attr = name if hasattr(module, name) else name.removeprefix("predict_")
    value = module if _WHERE[name].endswith("." + name) else getattr(module, attr)
    globals()[name] = value
    return value
