"""Expert parallelism (:func:`hetcoll.torch.expert_parallel`): data parallelism whose
mixture-of-experts layers hold whole experts per device, the routed tokens sent to their
experts' devices and back. The laid-out step (:class:`ExpertParallelSchedule`) and its
prediction (:func:`expert_parallel`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from hetcoll.errors import shown
from hetcoll.model import terms
from hetcoll.model.costs import ExpertsBlock, ModelCosts
from hetcoll.model.hardware import Cluster, Link
from hetcoll.model.predict.data import buckets_end, samples_prediction, timed_buckets
from hetcoll.model.predict.prediction import DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES, Prediction
from hetcoll.model.predict.timing import (
    LayerSeconds,
    _check_shares,
    _layer_times,
    _memory_common,
    check_costs_and_cluster,
    device_arrays,
    memory_shortfall,
)
from hetcoll.plan import ExpertsHeld, expert_form, expert_indices

#: Experts per device (counts, or each device's expert indices: :data:`hetcoll.plan.ExpertsHeld`):
#: one placement for every experts layer, or a dict by experts module path.
Placement = ExpertsHeld | Mapping[str, ExpertsHeld]


@dataclass(frozen=True)
class ExpertParallelSchedule:
    """One expert-parallel step laid out, before its devices are timed against each other
    (:func:`expert_parallel_schedule` builds it, :meth:`prediction` times it).

    ``shares``: samples per device; ``experts``: each experts layer's experts per device;
    ``layers``: per layer and device, the layers outside the experts at the device's samples,
    an experts layer's at the tokens its experts receive; ``groups``: each experts layer's
    first and last costed layer, with the seconds of its exchanges, forward before and after
    its experts run and backward likewise (every device waits for the others at each);
    ``update_s``: each device's optimizer step (its replicated parameters and its experts);
    ``buckets``: DDP's buckets of the replicated parameters' gradients, as in
    :class:`~hetcoll.model.predict.DataParallelSchedule`; ``memory_bytes`` and ``reason`` as
    in :class:`Prediction`."""

    strategy: str
    shares: np.ndarray
    experts: dict[str, list[int] | list[list[int]]]
    layers: LayerSeconds
    groups: list[tuple[int, int, float, float, float, float]]
    update_s: np.ndarray
    buckets: list[tuple[int, float]]
    overlap: bool
    memory_bytes: np.ndarray
    reason: str

    def timeline(self, start: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The forward and backward from ``start`` (each device's clock; zeros): each device's
        clock at the end of its backward, and when each layer's backward ended on each device.
        The devices meet at every experts layer's exchanges."""
        lt, n = self.layers, self.layers.forward_s.shape[0]
        first = {g[0]: g for g in self.groups}
        last = {g[1]: g for g in self.groups}
        t = np.zeros(lt.forward_s.shape[1]) if start is None else np.array(start, dtype=float)
        for i in range(n):
            if i in first:
                t[:] = t.max() + first[i][2]
            t = t + lt.forward_s[i]
            if i in last:
                t[:] = t.max() + last[i][3]
        done = np.zeros_like(lt.backward_s)
        for i in range(n - 1, -1, -1):
            if i in last:
                t[:] = t.max() + last[i][4]
            t = t + lt.backward_s[i]
            if i in first:
                t[:] = t.max() + first[i][5]
            done[i] = t
        return t, done

    @property
    def exchange_s(self) -> float:
        """The seconds of every experts layer's exchanges, forward and backward."""
        return float(sum(g[2] + g[3] + g[4] + g[5] for g in self.groups))

    def prediction(self) -> Prediction:
        """The step: each device's forward, its devices meeting at every experts layer's
        exchanges; the backward likewise, the buckets' allreduces overlapping it (as DDP's do)
        or after it; then the optimizer."""
        t, done = self.timeline()
        return self.finish(
            t, done, self.layers, self.exchange_s, self.shares, self.memory_bytes, self.reason
        )

    def finish(
        self,
        t: np.ndarray,
        done: np.ndarray,
        layers: LayerSeconds,
        exchange_s: float,
        shares: np.ndarray,
        memory_bytes: np.ndarray,
        reason: str,
        **detail: object,
    ) -> Prediction:
        """The step whose backward ended at ``t`` (``done``: each layer's, as
        :meth:`timeline` gives them): the buckets' allreduces, then the optimizer. ``layers``,
        ``exchange_s``, ``shares``, ``memory_bytes`` and ``reason``: the whole step's (every
        pass's), for the prediction's breakdown and record; ``detail`` joins its detail."""
        busy = float(t.max())
        end = buckets_end(self.buckets, done.max(axis=1), busy, self.overlap)
        opt = self.update_s
        slowest = int(np.argmax(t + opt))
        step = max(busy, end) + float(opt.max())
        return samples_prediction(
            self.strategy,
            shares,
            step,
            layers.breakdown(slowest, float(opt[slowest]), step),
            memory_bytes,
            reason,
            {
                "all_to_all_s": exchange_s,
                "allreduce_s": float(sum(c for _, c in self.buckets)),
                "buckets": len(self.buckets),
                "experts": {name: list(held) for name, held in self.experts.items()},
                "critical_device": slowest,
                **detail,
            },
        )


def placement(block: ExpertsBlock, experts: Placement, devices: int) -> list[list[int]]:
    """``block``'s experts on each of ``devices`` (devices or replicas): each one's expert
    indices, checked."""
    held = experts.get(block.module) if isinstance(experts, Mapping) else experts
    if held is None:
        raise ValueError(f"experts: names no placement for {block.module!r}")
    where = f"experts[{block.module!r}]" if isinstance(experts, Mapping) else "experts"
    try:
        placed = expert_indices(held, devices, where, experts=block.experts, of="device")
    except ValueError as e:
        raise ValueError(f"{e} (experts of {block.module!r})") from None
    return [list(h) for h in placed]


#: Each experts layer's routed tokens per expert, by module path, as checked by
#: :func:`checked_loads`.
Loads = Mapping[str, Sequence[float] | np.ndarray]


def checked_loads(
    costs: ModelCosts, loads: Loads | None, where: str = "loads"
) -> dict[str, np.ndarray] | None:
    """``loads`` (each experts layer's routed tokens per expert, by module path: what
    :func:`hetcoll.torch.expert_loads` or an ``ExpertRebalancer``'s ``loads`` hold) checked
    against the model's experts layers (``costs.experts``): a ``ValueError`` naming ``where``
    for a path that is no experts layer, or counts that are not one finite number >= 0 per
    expert. A layer it leaves out, or whose counts are all 0, counts each expert alike (it is
    left out of the result)."""
    if loads is None:
        return None
    if not isinstance(loads, Mapping):
        raise ValueError(
            f"{where}: must map experts module paths to token counts, got {type(loads).__name__}"
        )
    sizes = {block.module: block.experts for block in costs.experts}
    out: dict[str, np.ndarray] = {}
    for path, counts in loads.items():
        if path not in sizes:
            known = ", ".join(repr(m) for m in list(sizes)[:16]) or "none"
            known += f", ... ({len(sizes)} in all)" if len(sizes) > 16 else ""
            raise ValueError(
                f"{where}: {shown(path)} is no experts layer of the model (they are: {known})"
            )
        try:
            load = np.asarray(counts, dtype=np.float64)
        except (TypeError, ValueError):
            load = np.full(0, np.nan)
        if load.shape != (sizes[path],) or not np.isfinite(load).all() or (load < 0).any():
            raise ValueError(
                f"{where}: {path!r} needs {sizes[path]} finite numbers >= 0 (one per expert), "
                f"got {shown(counts)}"
            )
        if load.sum() > 0:
            out[path] = load
    return out


def fractions(
    block: ExpertsBlock, held: list[list[int]], loads: Mapping[str, np.ndarray] | None
) -> np.ndarray:
    """The share of the layer's routed tokens each device's experts (``held``: each one's
    expert indices) receive: their loads' (``loads`` as :func:`checked_loads` gives them; each
    expert alike without)."""
    load = np.ones(block.experts)
    if loads is not None and block.module in loads:
        load = loads[block.module]
    return np.array([load[list(h)].sum() for h in held]) / load.sum()


def exchange_seconds(
    block: ExpertsBlock, rows: np.ndarray, frac: np.ndarray, link: Link, itemsize: int
) -> tuple[float, float]:
    """An experts layer's exchanges among devices each sending the routed tokens of ``rows``
    samples, whose experts receive ``frac`` of every device's: the counts' exchange opening
    each forward, and one all-to-all of routed rows - the busiest device's out or in, over
    ``link``, after a message to each other device and the link's fixed cost per call (two
    forward, after the counts and back; two backward)."""
    p = len(rows)
    routed = block.routed_bytes_per_sample(itemsize)
    sent = rows * routed * (1.0 - frac)
    received = (float(rows.sum()) - rows) * routed * frac
    busiest = float(np.maximum(sent, received).max()) if p else 0.0
    call = link.call_of("all_to_all")
    a2a = float(terms.all_to_all_seconds(busiest, p, link.latency_s, link.bytes_per_s, call))
    counts = float(terms.all_to_all_seconds(0.0, p, link.latency_s, 1.0, call))
    return counts, a2a


def expert_parallel_schedule(
    costs: ModelCosts,
    cluster: Cluster,
    shares: Sequence[int],
    experts: Placement,
    *,
    loads: Loads | None = None,
    overlap: bool = True,
    optimizer_state_copies: int = 1,
    first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES,
    bucket_bytes: float = DDP_BUCKET_BYTES,
    strategy: str = "expert parallel",
) -> ExpertParallelSchedule:
    """The step :func:`expert_parallel` predicts, laid out (arguments as there)."""
    check_costs_and_cluster(costs, cluster)
    if not costs.experts:
        raise ValueError("costs: the model holds no experts layer expert parallelism places")
    checked = checked_loads(costs, loads)
    devices = cluster.devices
    p = len(devices)
    b = _check_shares(shares, p)
    dev = device_arrays(devices)
    lt = _layer_times(costs, dev, b)
    arrays = [a.copy() for a in (lt.forward_s, lt.backward_s, lt.compute_s, lt.memory_s)]
    arrays.append(lt.overhead_s.copy())
    link = cluster.ring_link()
    item = costs.activation_itemsize or costs.itemsize
    total = float(b.sum())
    names = [x.name for x in costs.layers]
    placed: dict[str, list[int] | list[list[int]]] = {}
    groups: list[tuple[int, int, float, float, float, float]] = []
    expert_bytes, expert_trained = np.zeros(p), np.zeros(p)
    timed: dict[tuple[float, ...], LayerSeconds] = {}
    for block in costs.experts:
        held = placement(block, experts, p)
        placed[block.module] = expert_form(held)
        frac = fractions(block, held, checked)
        rows = [i for i, name in enumerate(names) if block.holds(name)]
        # The experts' work: the tokens routed to them, from every device, as samples (timed
        # once per distinct share: layers placed and loaded alike share it).
        key = tuple(frac.tolist())
        if key not in timed:
            timed[key] = _layer_times(costs, dev, total * frac)
        at = timed[key]
        for mine, theirs in zip(
            arrays,
            (at.forward_s, at.backward_s, at.compute_s, at.memory_s, at.overhead_s),
            strict=True,
        ):
            mine[rows] = theirs[rows]
        counts, a2a = exchange_seconds(block, b, frac, link, item)
        groups.append((rows[0], rows[-1], counts + a2a, a2a, a2a, a2a))
        share = np.array([len(h) for h in held]) / block.experts
        expert_bytes += sum(costs.layers[i].param_bytes for i in rows) * share
        expert_trained += sum(costs.layers[i].gradient_bytes for i in rows) * share
    layers = LayerSeconds(*arrays)
    held_names = {n for n in names if any(b.holds(n) for b in costs.experts)}
    replicated = replace(
        costs,
        layers=tuple(
            replace(x, param_bytes=0.0, frozen_bytes=0.0) if x.name in held_names else x
            for x in costs.layers
        ),
    )
    buckets = timed_buckets(replicated, cluster, b, first_bucket_bytes, bucket_bytes)
    own = replicated.gradient_bytes + expert_trained
    update = terms.step_update_seconds(
        own, dev.mem_bytes_per_s, optimizer_state_copies, dev.step_overhead_s
    )
    memory = (
        _memory_common(replicated, optimizer_state_copies)
        + replicated.gradient_bytes  # DDP's bucket copy of the replicated gradients
        + terms.training_state_bytes(expert_bytes, expert_trained, optimizer_state_copies)
        + b * costs.saved_bytes_per_sample()
    )
    return ExpertParallelSchedule(
        strategy,
        b,
        placed,
        layers,
        groups,
        np.asarray(update, dtype=np.float64),
        buckets,
        overlap,
        memory,
        memory_shortfall(memory, devices),
    )


def expert_parallel(
    costs: ModelCosts,
    cluster: Cluster,
    shares: Sequence[int],
    experts: Placement,
    *,
    loads: Loads | None = None,
    overlap: bool = True,
    optimizer_state_copies: int = 1,
    first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES,
    bucket_bytes: float = DDP_BUCKET_BYTES,
    strategy: str = "expert parallel",
) -> Prediction:
    """One expert-parallel step, as :func:`hetcoll.torch.expert_parallel` with DDP and the
    weighted hook runs it: device d trains on ``shares[d]`` samples; each experts layer
    (``costs.experts``) holds ``experts[d]`` whole experts on device d (one list for every
    layer, or a dict by module path), whose work is the tokens the router sends them from
    every device (in proportion to their ``loads``, each expert's routed tokens, by module
    path; each expert alike without), and opens with an exchange of counts, then one
    all-to-all of the routed tokens forward and one back, the same two backward; every device
    waits for the others at each. The replicated parameters' gradients are allreduced in DDP's
    buckets (``overlap`` as in :func:`~hetcoll.model.predict.data_parallel`); each device
    updates them and its own experts.

    >>> expert_parallel(costs, cluster, [26, 6], [7, 1]).step_s  # doctest: +SKIP
    """
    return expert_parallel_schedule(
        costs,
        cluster,
        shares,
        experts,
        loads=loads,
        overlap=overlap,
        optimizer_state_copies=optimizer_state_copies,
        first_bucket_bytes=first_bucket_bytes,
        bucket_bytes=bucket_bytes,
        strategy=strategy,
    ).prediction()
