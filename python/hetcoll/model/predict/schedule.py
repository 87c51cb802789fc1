"""One step of a plan laid out as every device's program (:class:`PlanSchedule`): the stages'
work in the schedule's order (GPipe or 1F1B), the sends between stages, the gradient sums over
each set of replicas holding a layer and the loss's allreduce, one replica of each class of
alike replicas simulated (:func:`layout_schedule`; :func:`plan_schedule` lays out every
replica). :meth:`PlanSchedule.prediction` times it."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetcoll.model import terms
from hetcoll.model.costs import ModelCosts
from hetcoll.model.hardware import Cluster, Device, Link
from hetcoll.model.predict.classes import (
    cluster_facts,
    flat_ranks,
    node_link_ids,
    replica_classes,
    ring_link_of,
)
from hetcoll.model.predict.layout import ReplicaLayout, StageLayout, plan_layout
from hetcoll.model.predict.prediction import Prediction
from hetcoll.model.predict.staged_experts import StagedExperts
from hetcoll.model.predict.timing import (
    LayerSeconds,
    _layer_times,
    device_arrays,
    memory_shortfall,
)
from hetcoll.model.predict.work import MEMO_ENTRIES, StageWork, memo_of, stage_work
from hetcoll.plan import Plan


@dataclass(frozen=True)
class PlanSchedule:
    """One step of a plan laid out as programs (what :func:`predict_plan` times).

    ``programs[x]`` lists the operations device ``program_devices[x]`` runs, in the order the
    runtime runs them, as :func:`hetcoll.model.terms.schedule_finish_seconds` reads them; each
    ``("compute", s, parts)`` carries ``parts``, the ``(layer, seconds, "F" or "B")`` it is made
    of (``layer`` indexes ``costs.layers``; forward or backward), so that a caller can re-time
    the work layer by layer. Devices of replicas that run alike share one replica's programs
    (``copy_of[d]``: the device whose figures device d takes; :func:`plan_schedule` lays every
    replica out); idle devices have none (they wait in the loss's allreduce).
    ``collectives``: each collective's participants and seconds. Per device: ``causes``, the
    compute, memory and overhead seconds of its layers; ``state_bytes`` / ``activation_bytes``,
    what it holds; ``update_s``, its optimizer step; ``samples``, its replica's samples (0:
    idle). :meth:`prediction` times the programs; a caller that times them otherwise (on other
    hardware, say) passes each program's finish time and seconds in collectives.

    >>> plan_schedule(costs, cluster, Plan.load("plan.json")).prediction().step_s  # doctest: +SKIP
    """

    programs: list[list[tuple[Any, ...]]]
    collectives: dict[object, tuple[int, float]]
    causes: np.ndarray  # (3, devices)
    state_bytes: np.ndarray
    activation_bytes: np.ndarray
    update_s: np.ndarray
    samples: list[int]
    devices: tuple[Device, ...]
    schedule: str
    strategy: str
    detail: dict[str, Any]
    program_devices: tuple[int, ...]
    copy_of: np.ndarray

    def prediction(
        self,
        finish_s: Sequence[float] | None = None,
        collective_s: Sequence[float] | None = None,
    ) -> Prediction:
        """The step: the programs timed by
        :func:`~hetcoll.model.terms.schedule_finish_seconds`, or ``finish_s`` (when each
        program ends) and ``collective_s`` (its seconds inside collectives) timed by the
        caller, then each device's optimizer update."""
        if finish_s is None or collective_s is None:
            finish_s, collective_s = terms.schedule_finish_seconds(self.programs, self.collectives)
        n_dev = len(self.devices)
        # Every rank leaves the loss's allreduce at the same moment; an idle rank spends its
        # step in it.
        finish = np.full(n_dev, float(finish_s[0]) if len(finish_s) else 0.0)
        in_collectives = np.full(n_dev, float(self.detail["loss_allreduce_s"]))
        for x, d in enumerate(self.program_devices):
            finish[d] = finish_s[x]
            in_collectives[d] = collective_s[x]
        finish, in_collectives = finish[self.copy_of], in_collectives[self.copy_of]
        update = self.update_s
        end = finish + update
        step = float(end.max())
        busy = self.causes.sum(axis=0)
        crit = int(np.argmax(busy))
        breakdown = {
            "compute": float(self.causes[0, crit]),
            "memory": float(self.causes[1, crit]),
            "overhead": float(self.causes[2, crit]),
            "communication": float(in_collectives[crit]),
            "optimizer": float(update.max()),
        }
        breakdown["bubble"] = max(0.0, step - sum(breakdown.values()))
        mem = self.state_bytes + self.activation_bytes
        reason = memory_shortfall(mem, self.devices)
        return Prediction(
            self.strategy,
            list(self.samples),
            "samples of its replica",
            step,
            breakdown,
            mem.tolist(),
            not reason,
            reason,
            int(self.detail["batch"]),
            {
                **{k: v for k, v in self.detail.items() if k != "batch"},
                "critical_device": crit,
            },
        )


def plan_schedule(
    costs: ModelCosts,
    cluster: Cluster,
    plan: Plan,
    *,
    optimizer_state_copies: int = 1,
    strategy: str = "plan",
) -> PlanSchedule:
    """One step of ``plan`` laid out as every device's program (:class:`PlanSchedule`; no
    replica shares another's), as :func:`predict_plan` simulates it; raises as
    :func:`predict_plan` does."""
    layout = plan_layout(costs, cluster, plan)
    return layout_schedule(
        costs, cluster, layout, plan.schedule, optimizer_state_copies, strategy, group=False
    )


def loss_allreduce_seconds(cluster: Cluster) -> float:
    """The step's loss summed over every rank of the group, as :meth:`Parallel.step
    <hetcoll.torch.parallel.Parallel.step>` sums it (one float64 ring allreduce). A
    data-parallel plan whose one gradient sum covers every rank pays none: its step carries
    the loss in that sum (:func:`layout_schedule`)."""
    link = cluster_facts(cluster).ring_link
    slowest = float(device_arrays(cluster.devices).mem_bytes_per_s.min())
    return float(
        terms.ring_allreduce_seconds(
            8.0,
            cluster.num_devices,
            link.latency_s,
            link.bytes_per_s,
            slowest,
            8,
            call_s=link.call_of("allreduce"),
        )
    )


def layout_schedule(
    costs: ModelCosts,
    cluster: Cluster,
    replicas: Sequence[ReplicaLayout],
    schedule: str,
    state_copies: int,
    strategy: str,
    classes: Sequence[tuple[ReplicaLayout, np.ndarray]] | None = None,
    *,
    group: bool = True,
    experts: StagedExperts | None = None,
) -> PlanSchedule:
    """Lay out one step of the plan (:func:`plan_schedule`).

    Replicas that run alike (:func:`replica_classes`; ``classes``: already grouped, as
    (replica, every member's ranks); ``group=False``: every replica its own class) are laid
    out once: the gradient sums and the loss's allreduce are timed over all their holders, but
    only one replica of each class has programs, and the others copy its figures. That is the
    same step (the copies would reach every collective at the same moment), at the cost of the
    distinct replicas only: a 10,240-device plan of a few kinds of replica simulates a few.

    ``experts``: the plan's experts (:class:`StagedExperts`, of ``replicas`` in order): its
    stages holding experts layers run them at their routed tokens between exchanges with the
    same stage of every other replica (so every replica is laid out), each rank holds its own
    experts, and the replicas sum only the other parameters' gradients."""
    from hetcoll.torch.parallel import schedule_order

    devices = cluster.devices
    n_dev = len(devices)
    dev = device_arrays(devices)
    memo = memo_of(costs, cluster)
    cache = memo.times
    facts = cluster_facts(cluster)
    first_of_kind = facts.first_of_kind
    kinds = dev.columns(first_of_kind)

    def times(b: int) -> tuple[LayerSeconds, np.ndarray]:
        # Every layer's times at b samples on each kind of device (columns), and each
        # device's kind.
        if b not in cache:
            cache[b] = _layer_times(costs, kinds, np.full(len(first_of_kind), b))
        return cache[b], dev.kind

    def memoised_work(stage: StageLayout, b: int) -> StageWork:
        # A stage's work depends on its layers and split, the kinds of its devices, the ring
        # its collectives cross (a split stage), the micro-batch and the optimizer: stages
        # alike in those share it, within a search and across its candidates.
        if len(stage.ranks) == 1:
            key: tuple[Any, ...] = (stage.lo, stage.hi, int(dev.kind[stage.ranks[0]]), b)
            sub = cluster
        else:
            sub = cluster.subset(list(stage.ranks))
            ring = sub.ring_link()
            assert stage.modes is not None
            key = (
                stage.lo,
                stage.hi,
                tuple(int(dev.kind[d]) for d in stage.ranks),
                b,
                ring.latency_s,
                ring.bytes_per_s,
                stage.parts,
                tuple(stage.modes.items()),
                None
                if stage.layer_shares is None
                else tuple((k, tuple(v)) for k, v in stage.layer_shares.items()),
            )
        key += (state_copies,)
        hit = memo.work.get(key)
        if hit is None:
            hit = stage_work(costs, cluster, stage, b, times, state_copies, sub)
            if len(memo.work) >= MEMO_ENTRIES:
                memo.work.clear()
            memo.work[key] = hit
        return hit

    if experts is not None or (classes is None and not group):
        classes = [(rep, np.array([flat_ranks(rep)])) for rep in replicas]
    elif classes is None:
        classes = replica_classes(cluster, replicas, dev.kind)
    link_of: dict[tuple[int, int], Link] = {}  # the link of each send, looked up once
    local: dict[int, int] = {}  # simulated device -> its program
    for rep, _ in classes:
        for st in rep.stages:
            for d in st.ranks:
                local[d] = len(local)
    programs: list[list[tuple[Any, ...]]] = [[] for _ in local]
    collectives: dict[object, tuple[int, float]] = {}
    causes = np.zeros((3, n_dev))
    state = np.zeros(n_dev)
    activations = np.zeros(n_dev)
    update = np.zeros(n_dev)
    for r, (rep, _) in enumerate(classes):
        n_st, m = len(rep.stages), len(rep.micro)
        for s, stage in enumerate(rep.stages):
            work = {b: memoised_work(stage, b) for b in sorted(set(rep.micro))}
            any_work = work[rep.micro[0]]
            order = schedule_order(schedule, s, n_st, m)
            # Activations kept at once: every micro-batch under GPipe; under 1F1B the forwards
            # a stage runs ahead of its first backward, plus one.
            ahead = m if schedule == "GPipe" else min(n_st - s, m)
            kept = sum(sorted(rep.micro, reverse=True)[:ahead])
            lead = stage.ranks[0]
            prev = rep.stages[s - 1] if s > 0 else None
            nxt = rep.stages[s + 1] if s + 1 < n_st else None
            # Each forward adds its micro-batch's causes (forward and backward) to the stage's
            # devices, in the schedule's order: all ranks at once (the same additions).
            columns = list(stage.ranks)
            acc = causes[:, columns]
            for op, k in order:
                if op == "F":
                    acc += work[rep.micro[k]].causes
                    if experts is not None:
                        own = times(rep.micro[k])[0]
                        acc += experts.causes_delta(s, r, k, int(dev.kind[lead]), own)[:, None]
            causes[:, columns] = acc
            for j, d in enumerate(stage.ranks):
                state[d] = any_work.state_bytes[j]
                update[d] = any_work.update_s[j]
                if experts is not None:
                    # A rank holds its replica's experts only (one rank a stage).
                    layers = costs.layers[stage.lo : stage.hi]
                    less, less_trained = experts.owned_delta(s, r)
                    owned = sum(x.param_bytes for x in layers) + less
                    trained = sum(x.gradient_bytes for x in layers) + less_trained
                    state[d] = float(terms.training_state_bytes(owned, trained, state_copies))
                    update[d] = float(
                        terms.step_update_seconds(
                            trained,
                            dev.mem_bytes_per_s[d],
                            state_copies,
                            dev.step_overhead_s[d],
                        )
                    )
                activations[d] = any_work.saved_per_sample * kept
                prog = programs[local[d]]
                for op, k in order:
                    w = work[rep.micro[k]]
                    if op == "F":
                        if prev is not None:
                            prog.append(("recv", ("act", r, s, k, d)))
                        pieces = w.forward[j]
                    else:
                        if nxt is not None:
                            prog.append(("recv", ("grad", r, s, k, d)))
                        pieces = w.backward[j]
                    if experts is not None:
                        pieces = experts.pieces(s, r, k, op, pieces, int(dev.kind[d]))
                    for piece in pieces:
                        if piece[0] == "compute":
                            if prog and prog[-1][0] == "compute":
                                last = prog[-1]
                                prog[-1] = ("compute", last[1] + piece[1], last[2] + piece[2])
                            else:
                                prog.append(piece)
                        elif piece[1][0] == "experts":
                            # An exchange with this stage's rank of every replica.
                            assert experts is not None
                            collectives[piece[1]] = (experts.participants, piece[2])
                            prog.append(("collective", piece[1]))
                        else:
                            key = (r, s, k, op, piece[1])
                            collectives[key] = (len(stage.ranks), piece[2])
                            prog.append(("collective", key))
                    if d != lead:
                        continue
                    to, kind, nbytes = (
                        (nxt, "act", stage.out_bytes_per_sample)
                        if op == "F"
                        else (prev, "grad", prev.out_bytes_per_sample if prev else 0.0)
                    )
                    if to is None:
                        continue
                    at = s + 1 if op == "F" else s - 1
                    sends = []
                    for e in to.ranks:
                        if (d, e) not in link_of:
                            link_of[d, e] = cluster.link_between(d, e)
                        link = link_of[d, e]
                        sends.append(
                            (
                                (kind, r, at, k, e),
                                link.latency_s,
                                nbytes * rep.micro[k] / link.bytes_per_s,
                            )
                        )
                    prog.append(("send", tuple(sends)))
                prog.append(("wait_sends",))
    # Every other replica's devices copy those of the replica simulated for it.
    source = np.arange(n_dev)
    samples_of = np.zeros(n_dev, dtype=np.int64)
    for rep, members in classes:
        source[members.ravel()] = np.broadcast_to(members[0], members.shape).ravel()
        samples_of[members.ravel()] = rep.samples
    causes, state, activations, update = (
        causes[:, source],
        state[source],
        activations[source],
        update[source],
    )
    # Gradients of parameters held in several replicas: one allreduce of full-size buffers per
    # set of holders, in layer order. Layers between the same stage boundaries share holders.
    groups: dict[tuple[int, ...], list[Any]] = {}
    if sum(len(members) for _, members in classes) > 1:
        node_link = node_link_ids(cluster)
        cuts = sorted({x for rep, _ in classes for st in rep.stages for x in (st.lo, st.hi)})
        for a, b in itertools.pairwise(cuts):
            parts, taking_part = [], []
            for rep, members in classes:
                col = 0
                for st in rep.stages:
                    if st.lo <= a < st.hi:
                        parts.append(members[:, col : col + len(st.ranks)].ravel())
                        taking_part += [local[d] for d in st.ranks]
                    col += len(st.ranks)
            mask = np.zeros(n_dev, dtype=bool)  # (np.unique of the parts, without a sort)
            mask[np.concatenate(parts)] = True
            held = np.flatnonzero(mask)
            nbytes = sum(
                costs.layers[i].gradient_bytes
                for i in range(a, b)
                if experts is None or i not in experts.rows
            )
            if nbytes <= 0:
                continue
            holders = tuple(held.tolist())
            if holders in groups:
                groups[holders][0] += nbytes
            else:
                groups[holders] = [nbytes, held, taking_part, node_link]
    reduce_s = 0.0
    for g, (nbytes, held, taking_part, node_link) in enumerate(groups.values()):
        link = ring_link_of(cluster, held, node_link)
        seconds = float(
            terms.ring_allreduce_seconds(
                nbytes,
                len(held),
                link.latency_s,
                link.bytes_per_s,
                float(dev.mem_bytes_per_s[held].min()),
                costs.itemsize,
                call_s=link.call_of("allreduce"),
            )
        )
        collectives[("sum", g)] = (len(taking_part), seconds)
        reduce_s += seconds
        for x in taking_part:
            programs[x].append(("collective", ("sum", g)))
        state[held] += nbytes  # the full-size buffer the gradients are summed in
    # The loss, summed over every rank of the group; idle ranks join it at once. Data
    # parallelism whose one gradient sum covers every device carries it in that sum instead
    # (Parallel.step: each rank's step fields in a slot after the gradients; a larger model's
    # batch check runs beside its forwards): no collective of its own.
    one_sum = (
        experts is None
        and len(groups) == 1
        and len(next(iter(groups))) == n_dev
        and all(len(rep.stages) == 1 and len(rep.stages[0].ranks) == 1 for rep, _ in classes)
    )
    loss_s = 0.0 if one_sum else loss_allreduce_seconds(cluster)
    if not one_sum:
        collectives["loss"] = (len(programs), loss_s)
        for prog in programs:
            prog.append(("collective", "loss"))
    return PlanSchedule(
        programs,
        collectives,
        causes,
        state,
        activations,
        update,
        samples_of.tolist(),
        tuple(devices),
        schedule,
        strategy,
        {
            "batch": sum(rep.samples * len(members) for rep, members in classes),
            "schedule": schedule,
            "micro_batches": max(len(rep.micro) for rep, _ in classes),
            "replicas": sum(len(members) for _, members in classes),
            "stages": max(len(rep.stages) for rep, _ in classes),
            "idle_devices": np.flatnonzero(samples_of == 0).tolist(),
            "gradient_allreduce_s": reduce_s,
            "loss_allreduce_s": loss_s,
            "simulated_replicas": len(classes),
            **(
                {"experts": experts.experts_of(), "all_to_all_s": experts.exchange_s}
                if experts is not None
                else {}
            ),
        },
        tuple(local),
        source,
    )
