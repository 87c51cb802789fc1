"""Saving a plan whose replicas cut tensors differently through torch.distributed.checkpoint.

Every rank's state dict marks its slices with where they sit in the unsplit tensors
(:mod:`hetcoll.torch.filters.shards`), so DCP writes one unsplit model. A plan's replicas each
hold the whole model, and where they cut a tensor differently (a pipeline beside a stage split
over two ranks) their pieces overlap, which DCP's default planner refuses ("overlapping
chunks"). The ranks of every replica after the first flag their tensors as copies
(:data:`~hetcoll.torch.filters.shards.COPY`: all but their own experts), and
:class:`ReplicaSavePlanner` leaves those out: the first replica writes the model, each
replica its experts. Loading needs nothing of it: ``dcp.load`` reads into any layout.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch.distributed.checkpoint import DefaultSavePlanner

from hetcoll.torch.filters.checks import check_flag
from hetcoll.torch.filters.shards import COPY


class ReplicaSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, leaving out the tensors a rank holds as copies of what
    another rank writes (a plan's replicas after the first): pass it to ``dcp.save`` (or
    ``dcp.async_save``) on every rank where a plan's replicas have different shapes.
    Anything unflagged is planned as the default planner plans it, so it saves any other
    state dict alike.

    >>> model_sd, optim_sd = get_state_dict(par, opt, options=options)  # doctest: +SKIP
    >>> dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path,
    ...          planner=ReplicaSavePlanner())  # doctest: +SKIP
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # DCP's flags, checked: any value once passed, read by its truth ('no' flattened).
        bound = inspect.signature(DefaultSavePlanner.__init__).bind(self, *args, **kwargs)
        for name, value in list(bound.arguments.items())[1:]:
            if not (value is None and name == "dedup_replicated_tensors"):
                check_flag(value, name)
        super().__init__(*args, **kwargs)

    def set_up_planner(
        self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self.state_dict = {k: v for k, v in self.state_dict.items() if not getattr(v, COPY, False)}
