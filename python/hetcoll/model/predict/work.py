"""A stage's work on one micro-batch size (:func:`stage_work`, :class:`StageWork`): per rank
its forward and backward as compute and collective pieces, the causes of its compute, the
bytes it holds and its optimizer step; and the memo (:class:`Memo`, :func:`memo_of`) in which
the predictions of one model on one cluster share the layers' times and the stages' work."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from hetcoll.model import terms
from hetcoll.model.costs import ModelCosts
from hetcoll.model.hardware import Cluster
from hetcoll.model.predict.filters import filter_parallel_schedule
from hetcoll.model.predict.layout import StageLayout
from hetcoll.model.predict.timing import LayerSeconds


@dataclass
class Memo:
    """What the predictions of one model on one cluster share: each layer's times per
    micro-batch size on each kind of device (``times``) and the stages' work (``work``), which
    the planner's candidates repeat (the same layers on the same kind of device at the same
    micro-batch, under both schedules)."""

    times: dict[int, LayerSeconds] = field(default_factory=dict)
    work: dict[tuple[Any, ...], StageWork] = field(default_factory=dict)


#: The memos of the last few (costs, cluster) pairs, by identity (both are frozen), least
#: recently used first out; each holds at most ``MEMO_ENTRIES`` stages' work.
_MEMOS: dict[tuple[int, int], tuple[ModelCosts, Cluster, Memo]] = {}
MEMO_ENTRIES = 4096


def memo_of(costs: ModelCosts, cluster: Cluster) -> Memo:
    """The :class:`Memo` of ``costs`` on ``cluster`` (a new one the first time the pair is
    seen); the caller clears its ``work`` when it holds ``MEMO_ENTRIES`` stages."""
    key = (id(costs), id(cluster))
    hit = _MEMOS.pop(key, None)
    if hit is None or hit[0] is not costs or hit[1] is not cluster:
        hit = (costs, cluster, Memo())
        if len(_MEMOS) >= 4:
            _MEMOS.pop(next(iter(_MEMOS)))
    _MEMOS[key] = hit
    return hit[2]


@dataclass
class StageWork:
    """One stage's work on one micro-batch size, per rank of the stage: forward and backward
    as ("compute", s, ((layer, s, "F" or "B"), ...)) and ("collective", layer, s) pieces,
    the causes of its compute (compute, memory, overhead seconds), bytes of its weights,
    gradients and optimizer state, activation bytes it keeps per sample, and its optimizer
    step."""

    forward: list[list[tuple[Any, ...]]]
    backward: list[list[tuple[Any, ...]]]
    causes: np.ndarray  # (3, ranks)
    state_bytes: np.ndarray
    saved_per_sample: float
    update_s: np.ndarray


def stage_work(
    costs: ModelCosts,
    cluster: Cluster,
    stage: StageLayout,
    batch: int,
    times: Any,
    state_copies: int,
    subset: Cluster | None = None,
) -> StageWork:
    """The work of ``stage`` at ``batch`` samples (``subset``: ``cluster.subset`` of a split
    stage's ranks, when the caller has it already). Shared by the stages alike (the caller's
    memo): read only."""
    lo, hi = stage.lo, stage.hi
    if len(stage.ranks) == 1:
        d = stage.ranks[0]
        lt, column = times(batch)  # per kind of device, and each device's kind
        c = column[d]
        owned = float(sum(x.param_bytes for x in costs.layers[lo:hi]))
        trained = float(sum(x.gradient_bytes for x in costs.layers[lo:hi]))
        device = cluster.devices[d]
        fwd_s, bwd_s = lt.forward_s[lo:hi, c], lt.backward_s[lo:hi, c]
        fwd_parts = tuple((lo + i, float(t), "F") for i, t in enumerate(fwd_s))
        bwd_parts = tuple((hi - 1 - i, float(t), "B") for i, t in enumerate(bwd_s[::-1]))
        return StageWork(
            [[("compute", float(fwd_s.sum()), fwd_parts)]],
            [[("compute", float(bwd_s.sum()), bwd_parts)]],
            np.array(
                [
                    [lt.compute_s[lo:hi, c].sum()],
                    [lt.memory_s[lo:hi, c].sum()],
                    [lt.overhead_s[lo:hi, c].sum()],
                ]
            ),
            np.array([float(terms.training_state_bytes(owned, trained, state_copies))]),
            float(sum(x.saved_bytes_per_sample for x in costs.layers[lo:hi])),
            np.array(
                [
                    float(
                        terms.step_update_seconds(
                            trained, device.mem_bytes_per_s, state_copies, device.step_overhead_s
                        )
                    )
                ]
            ),
        )
    assert stage.modes is not None
    sub = replace(
        costs,
        layers=costs.layers[lo:hi],
        filter_modes=tuple(stage.modes.items()),
        plan_layers=(),
        plan_layer_of=(),
        plan_out_bytes=(),
        plan_layer_kinds=(),
        stage_modes=(),
        split_blocks=tuple(
            b for b in costs.split_blocks if any(b.contains(x.name) for x in costs.layers[lo:hi])
        ),
    )
    sched = filter_parallel_schedule(
        sub,
        subset if subset is not None else cluster.subset(stage.ranks),
        batch,
        stage.parts,
        modes=stage.modes,
        optimizer_state_copies=state_copies,
        layer_shares=stage.layer_shares,
        empty_blocks=stage.empty_blocks,
        loss_parallel=stage.loss_parallel,
    )
    fwd, bwd, lt = [], [], sched.layers
    f_comm = sched.forward_collective_s.tolist()
    b_comm = sched.backward_collective_s.tolist()

    def pieces(seconds: list[float], comm: list[float], layers: range, op: str) -> list[Any]:
        # The layers' compute between two collectives as one piece (summed in layer order,
        # as the simulation would add them, its layers' parts kept), each collective a piece
        # of its own.
        out: list[tuple[Any, ...]] = []
        for i in layers:
            part = ((lo + i, seconds[i], op),)
            if out and out[-1][0] == "compute":
                out[-1] = ("compute", out[-1][1] + seconds[i], out[-1][2] + part)
            else:
                out.append(("compute", seconds[i], part))
            if comm[i] > 0:
                out.append(("collective", (op, i), comm[i]))
        return out

    forward_s, backward_s = lt.forward_s.T.tolist(), lt.backward_s.T.tolist()
    for j in range(len(stage.ranks)):
        fwd.append(pieces(forward_s[j], f_comm, range(hi - lo), "F"))
        bwd.append(pieces(backward_s[j], b_comm, range(hi - lo - 1, -1, -1), "B"))
    saved = sub.saved_bytes_per_sample()
    return StageWork(
        fwd,
        bwd,
        np.stack([lt.compute_s.sum(axis=0), lt.memory_s.sum(axis=0), lt.overhead_s.sum(axis=0)]),
        sched.memory_bytes - batch * saved,
        saved,
        sched.update_s,
    )
