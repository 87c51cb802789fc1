"""The experts of a plan whose replicas run stages (:class:`StagedExperts`): each experts layer
holds, on its stage's rank of every replica, that replica's whole experts, and at every
micro-batch's forward and backward the stage's ranks of all replicas exchange the routed
tokens, as :func:`hetcoll.torch.parallelize` runs a plan with ``experts``. The plan's
simulated schedule (:func:`~hetcoll.model.predict.schedule.layout_schedule`) takes its
stages' work from here: the experts layers at the tokens routed to each replica's experts, the
exchanges as collectives its stage's ranks meet at, and what each rank holds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetcoll.model.costs import ExpertsBlock, ModelCosts
from hetcoll.model.hardware import Cluster
from hetcoll.model.predict.classes import cluster_facts
from hetcoll.model.predict.experts import (
    Loads,
    Placement,
    checked_loads,
    exchange_seconds,
    fractions,
    placement,
)
from hetcoll.model.predict.layout import ReplicaLayout
from hetcoll.model.predict.timing import LayerSeconds, _layer_times, device_arrays
from hetcoll.plan import expert_form


@dataclass(frozen=True)
class _Placed:
    """One experts layer: its costed rows, its stage, experts and routed share per replica."""

    block: ExpertsBlock
    rows: tuple[int, ...]
    stage: int
    #: Each replica's expert indices.
    held: list[list[int]]
    frac: np.ndarray
    param_bytes: float
    gradient_bytes: float


class StagedExperts:
    """The experts of ``replicas`` (laid out, alike in stages and micro-batches) placed by
    ``experts`` (experts per replica, one list or by module path) and loaded by ``loads``
    (:func:`~hetcoll.model.predict.expert_parallel`'s arguments)."""

    def __init__(
        self,
        costs: ModelCosts,
        cluster: Cluster,
        replicas: Sequence[ReplicaLayout],
        experts: Placement,
        loads: Loads | None = None,
    ) -> None:
        if not costs.experts:
            raise ValueError("costs: the model holds no experts layer expert parallelism places")
        checked = checked_loads(costs, loads)
        # (A Plan with experts has checked its replicas: one rank a stage, the same stages and
        # as many micro-batches in each.)
        first = replicas[0]
        self.costs, self.replicas = costs, list(replicas)
        self.itemsize = costs.activation_itemsize or costs.itemsize
        names = [x.name for x in costs.layers]
        self.placed: list[_Placed] = []
        for block in costs.experts:
            rows = tuple(i for i, name in enumerate(names) if block.holds(name))
            stage = next(
                (s for s, st in enumerate(first.stages) if st.lo <= rows[0] and rows[-1] < st.hi),
                None,
            )
            if stage is None:
                raise ValueError(f"plan: the experts of {block.module!r} lie across two stages")
            held = placement(block, experts, len(replicas))
            self.placed.append(
                _Placed(
                    block,
                    rows,
                    stage,
                    held,
                    fractions(block, held, checked),
                    float(sum(costs.layers[i].param_bytes for i in rows)),
                    float(sum(costs.layers[i].gradient_bytes for i in rows)),
                )
            )
        self.rows = frozenset(i for p in self.placed for i in p.rows)
        # Each stage's exchanges run on the ring of its ranks in every replica.
        self._links = {
            s: cluster.subset(sorted({rep.stages[s].ranks[0] for rep in replicas})).ring_link()
            for s in {p.stage for p in self.placed}
        }
        micro = np.array([rep.micro for rep in replicas], dtype=np.float64)  # (replicas, m)
        self._micro = micro
        self._exchange = {
            (e, k): exchange_seconds(
                p.block, micro[:, k], p.frac, self._links[p.stage], self.itemsize
            )
            for e, p in enumerate(self.placed)
            for k in range(micro.shape[1])
        }
        first_of_kind = cluster_facts(cluster).first_of_kind
        self._kinds = device_arrays(cluster.devices).columns(first_of_kind)
        self._n_kinds = len(first_of_kind)
        self._times: dict[float, LayerSeconds] = {}

    @property
    def participants(self) -> int:
        """Ranks meeting at each exchange: one per replica."""
        return len(self.replicas)

    def experts_of(self) -> dict[str, list[int] | list[list[int]]]:
        """Each experts layer's experts per replica, by module path (counts where they lie in
        runs in expert order, else each replica's indices)."""
        return {p.block.module: expert_form(p.held) for p in self.placed}

    @property
    def exchange_s(self) -> float:
        """Seconds of a step's exchanges, forward and backward, over every experts layer (a
        rank takes part in its own stage's)."""
        return float(sum(counts + 4.0 * a2a for counts, a2a in self._exchange.values()))

    def _at(self, tokens: float) -> LayerSeconds:
        hit = self._times.get(tokens)
        if hit is None:
            hit = _layer_times(self.costs, self._kinds, np.full(self._n_kinds, tokens))
            self._times[tokens] = hit
        return hit

    def _routed(self, e: int, r: int, k: int) -> LayerSeconds:
        """The layers' times at the samples whose routed tokens replica r's experts of layer
        e receive in micro-batch k (every replica's, by its experts' share)."""
        return self._at(float(self._micro[:, k].sum() * self.placed[e].frac[r]))

    def owned_delta(self, s: int, r: int) -> tuple[float, float]:
        """Parameter bytes, and bytes of those that train, replica r's rank of stage s does
        not hold: the others' experts."""
        parts = [(p, 1.0 - len(p.held[r]) / p.block.experts) for p in self.placed if p.stage == s]
        return (
            -sum(p.param_bytes * f for p, f in parts),
            -sum(p.gradient_bytes * f for p, f in parts),
        )

    def causes_delta(self, s: int, r: int, k: int, kind: int, own: LayerSeconds) -> np.ndarray:
        """The compute, memory and overhead seconds micro-batch k's experts layers take on
        replica r's rank of stage s (a device of ``kind``) beyond its own samples' (``own``)."""
        out = np.zeros(3)
        for e, p in enumerate(self.placed):
            if p.stage != s:
                continue
            at, rows = self._routed(e, r, k), list(p.rows)
            for i, name in enumerate(("compute_s", "memory_s", "overhead_s")):
                out[i] += float(
                    getattr(at, name)[rows, kind].sum() - getattr(own, name)[rows, kind].sum()
                )
        return out

    def pieces(
        self, s: int, r: int, k: int, op: str, pieces: Sequence[tuple[Any, ...]], kind: int
    ) -> list[tuple[Any, ...]]:
        """A one-rank stage's forward (``op`` "F") or backward ("B") of micro-batch k as the
        schedule runs it: its experts layers at their routed tokens, each between two
        exchanges with the stage's ranks of every replica - ``("collective", ("experts",
        stage, layer, micro-batch, op, 0 or 1), seconds)`` pieces, the same name on every
        replica."""
        here = {e: p for e, p in enumerate(self.placed) if p.stage == s}
        if not here:
            return list(pieces)
        opens = {p.rows[0] if op == "F" else p.rows[-1]: e for e, p in here.items()}
        closes = {p.rows[-1] if op == "F" else p.rows[0]: e for e, p in here.items()}
        row_of = {i: e for e, p in here.items() for i in p.rows}
        out: list[tuple[Any, ...]] = []

        def add(part: tuple[Any, ...]) -> None:
            if out and out[-1][0] == "compute":
                out[-1] = ("compute", out[-1][1] + part[1], (*out[-1][2], part))
            else:
                out.append(("compute", part[1], (part,)))

        for piece in pieces:
            if piece[0] != "compute":
                out.append(piece)
                continue
            for layer, seconds, direction in piece[2]:
                if layer in opens:
                    # The counts' exchange opens each forward.
                    e = opens[layer]
                    counts, a2a = self._exchange[e, k]
                    first = counts + a2a if op == "F" else a2a
                    out.append(("collective", ("experts", s, e, k, op, 0), first))
                if layer in row_of:
                    at = self._routed(row_of[layer], r, k)
                    seconds = float((at.forward_s if op == "F" else at.backward_s)[layer, kind])
                add((layer, seconds, direction))
                if layer in closes:
                    e = closes[layer]
                    out.append(("collective", ("experts", s, e, k, op, 1), self._exchange[e, k][1]))
        return out
