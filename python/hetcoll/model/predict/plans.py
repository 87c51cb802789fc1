"""Any :class:`hetcoll.Plan`, predicted: :func:`predict_plan` of a plan, and
:func:`predict_stages` of the replicas the planner describes (the plan built only when read).
Both lay the plan out (:mod:`.layout`), group its alike replicas (:mod:`.classes`) and time the
laid-out step (:mod:`.schedule`, whose stages' work is :mod:`.work`'s)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetcoll.model.costs import ModelCosts
from hetcoll.model.hardware import Cluster, Link
from hetcoll.model.predict.classes import cluster_facts, node_link_ids, ring_link_of, unique_rows
from hetcoll.model.predict.experts import (
    ExpertParallelSchedule,
    Loads,
    Placement,
    expert_parallel_schedule,
)
from hetcoll.model.predict.filters import time_balanced_shares
from hetcoll.model.predict.layout import ReplicaLayout, StageLayout, plan_layout, stage_layout
from hetcoll.model.predict.prediction import Prediction
from hetcoll.model.predict.schedule import layout_schedule
from hetcoll.model.predict.splits import blocks_need_empty, splits_loss
from hetcoll.model.predict.staged_experts import StagedExperts
from hetcoll.model.predict.timing import LayerSeconds, check_costs_and_cluster, device_arrays
from hetcoll.plan import ExpertsHeld, Plan, microbatch_sizes

#: Replicas as the planner lays them out before building their plan: samples, and per stage
#: its ranks, plan layers ``(first, end)`` and the ranks' speeds (None: one rank, or equal).
#: The ranks are a tuple (one replica) or an integer array of one row per replica (copies
#: alike but for their ranks: a 10,240-device plan is a few such entries).
StagesSpec = tuple[
    int,
    tuple[tuple[tuple[int, ...] | np.ndarray, tuple[int, int], tuple[float, ...] | None], ...],
]


def predict_stages(
    costs: ModelCosts,
    cluster: Cluster,
    replicas: Sequence[StagesSpec],
    microbatches: int,
    schedule: str,
    *,
    optimizer_state_copies: int = 1,
    strategy: str = "plan",
) -> Prediction:
    """:func:`predict_plan` of the plan ``replicas`` describe, costed from the description: the
    plan itself is built (and checked) only when the prediction's ``plan`` is first read. For
    the planner, which costs many large plans and shows a few. Raises ``ValueError`` (naming
    ``replicas``) where the runtime would refuse a stage."""
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches: must be an integer >= 1, got {microbatches!r}")
    if schedule not in ("GPipe", "1F1B"):
        raise ValueError(f"schedule: must be 'GPipe' or '1F1B', got {schedule!r}")
    if not replicas:
        raise ValueError("replicas: must hold at least one replica")
    entries = []
    for i, (samples, stages) in enumerate(replicas):
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise ValueError(f"replicas[{i}]: samples must be an integer >= 1, got {samples!r}")
        if not stages:
            raise ValueError(f"replicas[{i}]: has no stages")
        blocks = [np.atleast_2d(np.asarray(r, dtype=np.int64)) for r, _, _ in stages]
        if len({len(x) for x in blocks}) != 1 or min(x.size for x in blocks) == 0:
            raise ValueError(f"replicas[{i}]: every stage needs ranks, as many rows each")
        entries.append((samples, stages, blocks))
    costs.check_plan_layers()
    # Entries of one template (samples, and per stage its size, layers and speeds) are laid
    # out once; within a template, the replicas whose ranks sit on the same kinds of device
    # and send over the same links are one class, found with numpy over every member's ranks
    # at once.
    templates: dict[tuple[Any, ...], list[int]] = {}
    for i, (samples, stages, blocks) in enumerate(entries):
        shape = (
            samples,
            tuple((x.shape[1], tuple(lay), sp) for x, (_, lay, sp) in zip(blocks, stages)),
        )
        templates.setdefault(shape, []).append(i)
    dev_kind = device_arrays(cluster.devices).kind
    node_of = cluster_facts(cluster).node_of
    node_link = node_link_ids(cluster)
    n_links = int(node_link.max()) + 1
    link_ids: dict[Link, int] = {}
    between: dict[int, int] = {}

    def link_id(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        # The link between devices a and b (arrays) depends on whether they share a node and
        # on their nodes' links only: one link_between per distinct case, each case (same
        # node, a's node's link, b's) one integer, numbered in the order of those triples.
        na, nb = node_of[a], node_of[b]
        cases = ((na == nb) * n_links + node_link[na]) * n_links + node_link[nb]
        unique, first, inverse = np.unique(cases, return_index=True, return_inverse=True)
        ids = []
        for key, f in zip(unique.tolist(), first.tolist()):
            if key not in between:
                link = cluster.link_between(int(a[f]), int(b[f]))
                between[key] = link_ids.setdefault(link, len(link_ids))
            ids.append(between[key])
        return np.asarray(ids, dtype=np.int64)[inverse.reshape(-1)]

    def ring_id(block: np.ndarray) -> np.ndarray:
        # A split stage's ring: its node's link when its ranks share a node, else worked out.
        nodes = node_of[block]
        one = (nodes == nodes[:, :1]).all(axis=1)
        out = np.empty(len(block), dtype=np.int64)
        for r in np.flatnonzero(~one):
            link = ring_link_of(cluster, block[r], node_link)
            out[r] = link_ids.setdefault(link, len(link_ids))
        if one.any():
            # Per distinct node link, its id among link_ids (several ranks on the node: a link).
            first = nodes[one, 0]
            kinds, at = np.unique(node_link[first], return_index=True)
            table = np.zeros(int(node_link.max()) + 1, dtype=np.int64)
            for nl, i in zip(kinds.tolist(), at.tolist()):
                inside = cluster.nodes[int(first[i])].link
                assert inside is not None
                table[nl] = link_ids.setdefault(inside, len(link_ids))
            out[one] = table[node_link[first]]
        return out

    classes: list[tuple[ReplicaLayout, np.ndarray]] = []
    laid_of: dict[tuple[Any, ...], list[StageLayout]] = {}  # per template, its stages laid out
    for template, members in templates.items():
        samples = template[0]
        i = members[0]
        stages = entries[i][1]
        sizes_of = [x.shape[1] for x in entries[i][2]]
        laid = []
        for j, (_, layers, speeds) in enumerate(stages):
            where = f"replicas[{i}].stages[{j}]"
            last = j + 1 == len(stages)
            first_ranks = tuple(entries[i][2][j][0].tolist())
            span = (int(layers[0]), int(layers[1]))
            parts = speeds if speeds is not None else (1.0,) * len(first_ranks)
            named = None
            if len(first_ranks) > 1 and costs.plan_cut == "blocks":
                # A transformer's split stage, balanced by predicted time on its devices.
                try:
                    named = time_balanced_shares(
                        costs,
                        cluster.subset(list(first_ranks)),
                        max(1, samples // microbatches),
                        parts,
                        layers=span,
                    )
                except ValueError:
                    named = None  # nothing to balance: by speeds
            empty = len(first_ranks) > 1 and (
                any(0 in v for v in named.values())
                if named is not None
                else blocks_need_empty(costs, *span, parts)
            )
            laid.append(
                stage_layout(
                    costs,
                    first_ranks,
                    span,
                    last,
                    speeds,
                    None,
                    where,
                    empty,
                    named,
                    splits_loss(costs),
                )
            )
        laid_of[template] = laid
        ranks_of = np.vstack([np.hstack(entries[x][2]) for x in members])
        signature = [dev_kind[ranks_of]]
        col, starts = 0, []
        for size in sizes_of:
            starts.append(col)
            col += size
        for j, size in enumerate(sizes_of):
            lead = ranks_of[:, starts[j]]
            for k in (j - 1, j + 1):
                if 0 <= k < len(stages):
                    for c in range(starts[k], starts[k] + sizes_of[k]):
                        signature.append(link_id(lead, ranks_of[:, c])[:, None])
            if size > 1:  # the ring of a split stage's collectives
                block = ranks_of[:, starts[j] : starts[j] + size]
                signature.append(ring_id(block)[:, None])
        first, inverse = unique_rows(np.hstack(signature))
        sizes = tuple(microbatch_sizes(samples, microbatches))
        for c, f in enumerate(first):
            rows = ranks_of[inverse == c]
            rep_ranks = ranks_of[f].tolist()
            rep_stages = []
            for j, st in enumerate(laid):
                picked = tuple(rep_ranks[starts[j] : starts[j] + len(st.ranks)])
                rep_stages.append(
                    StageLayout(
                        picked,
                        st.lo,
                        st.hi,
                        st.out_bytes_per_sample,
                        st.parts,
                        st.modes,
                        st.layer_shares,
                        st.empty_blocks,
                        st.loss_parallel,
                    )
                )
            # The class's first row is the replica simulated for it.
            rows = np.vstack([ranks_of[f][None, :], rows[(rows != ranks_of[f]).any(axis=1)]])
            classes.append((ReplicaLayout(samples, sizes, tuple(rep_stages)), rows))
    pred = layout_schedule(
        costs,
        cluster,
        [rep for rep, _ in classes],
        schedule,
        optimizer_state_copies,
        strategy,
        classes,
    ).prediction()

    def template_of(samples: int, blocks: list[np.ndarray], stages: Any) -> tuple[Any, ...]:
        # The entry's template, as keyed above.
        return (
            samples,
            tuple((x.shape[1], tuple(lay), sp) for x, (_, lay, sp) in zip(blocks, stages)),
        )

    def split_of(speeds: Any, st: StageLayout) -> dict[str, Any]:
        # How a stage splits: by speeds, or by a transformer's shares per module path (the
        # only shares these stages are laid out with).
        out: dict[str, Any] = {}
        if st.layer_shares is not None:
            out["shares"] = {k: list(v) for k, v in st.layer_shares.items()}
        elif speeds is not None:
            out["speeds"] = list(speeds)
        if st.empty_blocks:
            out["empty_blocks"] = True
        if st.loss_parallel:
            out["loss_parallel"] = True
        return out

    def build() -> Plan:
        return Plan.from_dict(
            {
                "microbatches": microbatches,
                "schedule": schedule,
                "replicas": [
                    {
                        "samples": samples,
                        "stages": [
                            {
                                "ranks": block[row].tolist(),
                                "layers": list(layers),
                                **split_of(speeds, st),
                            }
                            for block, (_, layers, speeds), st in zip(
                                blocks, stages, laid_of[template_of(samples, blocks, stages)]
                            )
                        ],
                    }
                    for samples, stages, blocks in entries
                    for row in range(len(blocks[0]))
                ],
            }
        )

    pred.plan_factory = build
    return pred


def predict_plan(
    costs: ModelCosts,
    cluster: Cluster,
    plan: Plan,
    *,
    optimizer_state_copies: int = 1,
    strategy: str = "plan",
    loads: Loads | None = None,
) -> Prediction:
    """One step of ``plan`` (device i = rank i) as :func:`hetcoll.torch.parallelize` runs it.

    Each replica cuts its samples into the plan's micro-batches (uneven when they do not
    divide) and runs them through its stages under the plan's schedule (GPipe or 1F1B). A
    one-rank stage computes its layers (the terms :func:`data_parallel` uses); a stage over
    several ranks is the filter-parallel step of its layers on those ranks
    (:func:`filter_parallel_schedule`, modes as the runtime pairs the stage's layers: see
    :meth:`ModelCosts.stage_filter_modes`), ranks in lock step between its collectives. A
    stage's first rank sends its output to every rank of the next stage, and the gradient
    back, over the link between them (:func:`terms.point_to_point_seconds`; non-blocking,
    one message after another on the sender's link). Then the parameters held by several
    replicas are summed (one ring allreduce of full-size buffers per set of holders), every
    rank sums the loss (one float), and each device updates what it holds. The schedule's
    dependency graph is simulated event by event (:func:`terms.schedule_finish_seconds`), not
    a closed formula. Idle devices compute nothing; they join the loss allreduce.

    ``shares`` are the samples of each device's replica (0: idle); ``breakdown``: the busiest
    device's compute, memory stalls, kernel overheads and collectives, the optimizer, and
    the rest (``bubble``: waiting for other stages and ranks). Raises ``ValueError`` when the
    plan does not fit the model (layer count, a split the runtime refuses) or the cluster.

    A plan whose replicas hold whole experts (its ``experts``; replicas of one rank a stage)
    is simulated as any plan, each stage holding experts layers running them at the tokens
    routed to its replica's experts, between exchanges with the same stage of every replica
    (:class:`~hetcoll.model.predict.staged_experts.StagedExperts`); its ranks hold their own
    experts, and the replicas sum the other parameters' gradients only. For replicas of one
    stage that is :func:`expert_plan_schedule`'s step (the expert-parallel step of each
    micro-batch, one after another). ``loads``: each experts layer's routed tokens per expert,
    by module path (:func:`hetcoll.torch.expert_loads`' counts from a run), which its
    experts' work follows; each expert alike without (or for a layer it does not name).

    >>> predict_plan(costs, cluster, Plan.load("plan.json")).step_s  # doctest: +SKIP
    """
    check_costs_and_cluster(costs, cluster)
    # Replicas that run alike are simulated once (the same step: :func:`layout_schedule`).
    layout = plan_layout(costs, cluster, plan)
    staged = (
        None
        if plan.experts is None
        else StagedExperts(costs, cluster, layout, plan.experts, loads=loads)
    )
    pred = layout_schedule(
        costs, cluster, layout, plan.schedule, optimizer_state_copies, strategy, experts=staged
    ).prediction()
    pred.plan = plan
    return pred


@dataclass(frozen=True)
class ExpertPlanSchedule:
    """The step of a plan with ``experts`` laid out (:func:`expert_plan_schedule` builds it,
    :meth:`prediction` times it): one expert-parallel pass per micro-batch, every replica
    running each at its micro-batch's samples (the devices meet at every pass's exchanges),
    then the replicated gradients summed once, in one buffer, and the optimizer. Under the
    plan's ``schedule`` "GPipe" every micro-batch's forward runs before the first backward,
    so every micro-batch's activations (``saved_per_sample`` bytes a sample) live at once;
    under "1F1B" one micro-batch's."""

    passes: tuple[ExpertParallelSchedule, ...]
    schedule: str = "1F1B"
    saved_per_sample: float = 0.0

    def prediction(self) -> Prediction:
        """The passes one after another on each device, then the sum and the update (the
        last pass's); memory is the largest pass's, and under GPipe the other micro-batches'
        activations too."""
        t: np.ndarray | None = None
        done = np.zeros(0)
        layers: LayerSeconds | None = None
        for one in self.passes:
            t, done = one.timeline(t)
            layers = one.layers if layers is None else layers + one.layers
        assert t is not None and layers is not None  # a plan has a micro-batch at least
        return self.passes[-1].finish(
            t,
            done,
            layers,
            sum(one.exchange_s for one in self.passes),
            np.sum([one.shares for one in self.passes], axis=0),
            self._memory_bytes(),
            next((one.reason for one in self.passes if one.reason), ""),
            microbatches=len(self.passes),
        )

    def _memory_bytes(self) -> np.ndarray:
        largest = np.max([one.memory_bytes for one in self.passes], axis=0)
        if self.schedule != "GPipe":
            return np.asarray(largest)
        rows = np.array([one.shares for one in self.passes], dtype=np.float64)
        return np.asarray(largest + (rows.sum(axis=0) - rows.max(axis=0)) * self.saved_per_sample)


def _by(held: ExpertsHeld, order: list[int]) -> ExpertsHeld:
    """A layer's placement per replica (counts or each one's expert indices) in ``order``."""
    listed: list[Any] = list(held)
    return [listed[i] for i in order]


def expert_plan_schedule(
    costs: ModelCosts,
    cluster: Cluster,
    plan: Plan,
    *,
    optimizer_state_copies: int = 1,
    strategy: str = "plan",
) -> ExpertPlanSchedule:
    """The step of a plan with ``experts`` laid out in closed form: for each micro-batch, the
    expert-parallel step's forward and backward
    (:func:`~hetcoll.model.predict.expert_parallel_schedule`) of the plan's ranks, in
    increasing order (the others idle), each at its replica's samples in that micro-batch
    (:meth:`hetcoll.Plan.microbatch_sizes`); then its gradients summed in one buffer, as
    the runtime sums them. Its step is :func:`predict_plan`'s simulation's (less the loss's
    allreduce; tested), in a form whose passes a caller can re-time layer by layer (the lab's
    emulation model does). Replicas of one stage only: other shapes raise ``ValueError``."""
    if plan.experts is None:
        raise ValueError("plan: places no experts (its experts field is empty)")
    if len(plan.replicas[0].stages) > 1:
        raise ValueError(
            "plan: predict_plan prices expert parallelism over replicas of one stage; this "
            f"plan has {len(plan.replicas[0].stages)} stages per replica"
        )
    ranks = [r.stages[0].ranks[0] for r in plan.replicas]
    if max(ranks) >= cluster.num_devices:
        raise ValueError(
            f"plan: names rank {max(ranks)} but the cluster has {cluster.num_devices} devices"
        )
    order = sorted(range(len(ranks)), key=ranks.__getitem__)
    given = plan.experts
    experts: Placement = (
        {path: _by(held, order) for path, held in given.items()}
        if isinstance(given, Mapping)
        else _by(given, order)
    )
    sizes = [plan.microbatch_sizes(i) for i in order]
    on = cluster.subset(sorted(ranks))
    return ExpertPlanSchedule(
        tuple(
            expert_parallel_schedule(
                costs,
                on,
                [mine[k] for mine in sizes],
                experts,
                overlap=False,
                optimizer_state_copies=optimizer_state_copies,
                first_bucket_bytes=math.inf,
                bucket_bytes=math.inf,
                strategy=strategy,
            )
            for k in range(plan.microbatches)
        ),
        plan.schedule,
        costs.saved_bytes_per_sample(),
    )
