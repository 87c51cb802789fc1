"""The experts of a :class:`~hetcoll.torch.parallel.Parallel` whose plan places them (its
``experts``): their routed tokens, and their placement changed while training runs, the plan
following. :class:`PlanExperts` is the part of ``Parallel`` that does it.

A plan's experts are per replica, in the plan's replica order; each stage holding experts
exchanges tokens on a group of its own, of that stage's rank in every replica, numbered in
increasing rank order. These methods take and give placements in replica order, as the plan
does, and are collective over the plan's whole group, idle ranks and ranks of stages without
experts too, so that every rank's ``plan`` stays the same.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from hetcoll.comm import Communicator, deadline
from hetcoll.plan import Plan, experts_field
from hetcoll.torch.expert_parallel import (
    ExpertParallelExperts,
    Loads,
    Placement,
    Shares,
    agreed_placement,
    experts_placement,
    move_experts,
)
from hetcoll.torch.transport import CountingCommunicator, Transport


class PlanExperts:
    """The experts methods of :class:`~hetcoll.torch.parallel.Parallel` (which sets the
    attributes below when :func:`~hetcoll.torch.parallel.parallelize` builds it)."""

    plan: Plan
    stage: nn.Module | None
    _tr: Transport
    #: The plan's experts modules: path, experts, and the stage (index in every replica)
    #: holding them; empty without the plan's ``experts``.
    _experts_layers: list[tuple[str, int, int]]

    def _held_experts(self) -> dict[str, ExpertParallelExperts]:
        """This rank's experts modules, by path (none on an idle rank or a stage without)."""
        if self.stage is None:
            return {}
        held = dict(self.stage.named_modules())
        return {
            path: m
            for path, _, _ in self._experts_layers
            if isinstance(m := held.get(path), ExpertParallelExperts)
        }

    def _check_has_experts(self) -> None:
        if not self._experts_layers:
            raise ValueError("plan: places no experts (its experts field is empty)")

    @property
    def experts_comm(self) -> Communicator:
        """The communicator the experts methods are collective over: the plan's whole group
        (its traffic uncounted)."""
        return CountingCommunicator.uncounted(self._tr.comm)

    @property
    def experts_placement(self) -> Placement:
        """Each experts module's experts per replica (in the plan's replica order: each
        replica's expert indices), by path: the plan's ``experts``, as last placed."""
        self._check_has_experts()
        return experts_placement(
            [(path, n) for path, n, _ in self._experts_layers],
            len(self.plan.replicas),
            shares=self.plan.experts,
            where="plan.experts",
        )

    def expert_loads(self, *, timeout: float | None = None) -> dict[str, list[int]]:
        """Each experts module's routed tokens per expert since the previous call (or the
        start), every replica's summed, by path: :meth:`place_experts`' ``loads``. Collective
        over the plan's whole group (one all-gather); the counts start again from zero."""
        self._check_has_experts()
        here = self._held_experts()
        sizes = [n for _, n, _ in self._experts_layers]
        cuts = np.cumsum([0, *sizes])
        mine = np.zeros(cuts[-1], dtype=np.int64)
        for k, (path, _, _) in enumerate(self._experts_layers):
            if path in here:  # every replica's rank of the stage counts its own tokens
                mine[cuts[k] : cuts[k + 1]] = here[path].routed.numpy()
                here[path].routed.zero_()
        total = self.experts_comm.allgather_int64(mine, deadline(timeout)).sum(axis=0)
        return {
            path: [int(x) for x in total[cuts[k] : cuts[k + 1]]]
            for k, (path, _, _) in enumerate(self._experts_layers)
        }

    def place_experts(
        self,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        speeds: Sequence[float] | None = None,
        shares: Shares | None = None,
        loads: Loads | None = None,
        capacity: Sequence[int] | None = None,
    ) -> Placement:
        """Place the plan's experts on its replicas again, in place, as
        :func:`hetcoll.torch.place_experts` places a model's: exactly one of ``speeds=`` (one
        per replica, in the plan's order; with ``loads``, :meth:`expert_loads`, and
        ``capacity``) or ``shares=`` (experts per replica, counts or each replica's expert
        indices: one placement for every layer, or a dict by path). Only the experts that
        change replica move, each within its stage's group, with their gradients and
        ``optimizer``'s state. ``plan`` then names the new placement (on every rank).
        Collective over the plan's whole group, every rank with the same arguments. Returns
        each layer's experts per replica (their indices), by path."""
        self._check_has_experts()
        replicas = self.plan.replicas
        placed = agreed_placement(
            self.experts_comm,
            [(path, n) for path, n, _ in self._experts_layers],
            len(replicas),
            speeds=speeds,
            shares=shares,
            loads=loads,
            capacity=capacity,
            of="replica",
            optimizer=optimizer,
        )
        here = self._held_experts()
        moves = []
        for path, _, j in self._experts_layers:
            if path in here:  # the stage's group numbers its replicas by their rank there
                by_rank = sorted(range(len(replicas)), key=lambda r: replicas[r].stages[j].ranks[0])
                moves.append((path, here[path], [placed[path][r] for r in by_rank]))
        move_experts(moves, optimizer)
        self.plan = Plan.from_dict({**self.plan.to_dict(), "experts": experts_field(placed)})
        return placed
