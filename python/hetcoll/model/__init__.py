"""hetcoll.model: the performance model and planner.

(Created by the partitioner branch with only its own names; the performance-model branch owns
this file and adds the rest.)
"""

from hetcoll.model.hypergraph import (
    NetworkHypergraph,
    PartitionReport,
    network_hypergraph,
    partition_report,
)

__all__ = ["NetworkHypergraph", "PartitionReport", "network_hypergraph", "partition_report"]
