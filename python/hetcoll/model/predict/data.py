"""Data parallelism: DDP's buckets, the laid-out step (:class:`DataParallelSchedule`), its
prediction, and balanced or even batch shares."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import hetcoll
from hetcoll.model import terms
from hetcoll.model.costs import ModelCosts
from hetcoll.model.hardware import MAX_DEVICES, Cluster
from hetcoll.model.predict.prediction import DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES, Prediction
from hetcoll.model.predict.timing import (
    LayerSeconds,
    _check_shares,
    _layer_times,
    _memory_common,
    check_costs_and_cluster,
    device_arrays,
    linear_fit,
    memory_shortfall,
)
from hetcoll.plan import Plan


def ddp_buckets(
    costs: ModelCosts,
    first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES,
    bucket_bytes: float = DDP_BUCKET_BYTES,
) -> list[tuple[int, float]]:
    """DDP's gradient buckets as (index of the earliest layer in the bucket, bytes): layers in
    reverse order (the order backward produces gradients), a bucket closed once it reaches its
    cap (1 MiB for the first, then 25 MiB). A bucket is ready when its earliest layer's backward
    is done."""
    for name, cap in (("first_bucket_bytes", first_bucket_bytes), ("bucket_bytes", bucket_bytes)):
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
            raise ValueError(
                f"{name}: must be a number of bytes > 0 (inf: one bucket), got {cap!r}"
            )  # NaN once made one bucket
    buckets: list[tuple[int, float]] = []
    size, cap, last = 0.0, first_bucket_bytes, -1
    for i in range(len(costs.layers) - 1, -1, -1):
        g = costs.layers[i].gradient_bytes
        if g <= 0:
            continue
        size += g
        last = i
        if size >= cap:
            buckets.append((last, size))
            size, cap = 0.0, bucket_bytes
    if size > 0:
        buckets.append((last, size))
    return buckets


def timed_buckets(
    costs: ModelCosts,
    cluster: Cluster,
    shares: np.ndarray,
    first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES,
    bucket_bytes: float = DDP_BUCKET_BYTES,
) -> list[tuple[int, float]]:
    """DDP's buckets of ``costs``' gradients (:func:`ddp_buckets`) as (earliest layer, seconds
    of its ring allreduce over the cluster's ring link). Devices given no samples sit the
    step out (a plan would not start them), so the ring runs over the others only."""
    p = max(1, int((np.asarray(shares) > 0).sum()))
    link = cluster.ring_link()
    reduce_bw = float(device_arrays(cluster.devices).mem_bytes_per_s.min())
    call = link.call_of("allreduce")
    return [
        (
            first_layer,
            float(
                terms.ring_allreduce_seconds(
                    nbytes,
                    p,
                    link.latency_s,
                    link.bytes_per_s,
                    reduce_bw,
                    costs.itemsize,
                    call_s=call,
                )
            ),
        )
        for first_layer, nbytes in ddp_buckets(costs, first_bucket_bytes, bucket_bytes)
    ]


@dataclass(frozen=True)
class DataParallelSchedule:
    """One data-parallel step laid out, before its devices are timed against each other:
    what :func:`data_parallel` predicts from (:func:`data_parallel_schedule` builds it,
    :meth:`prediction` times it). Public so that a step can be changed and timed again: a
    device whose backward starts later (``backward_start_s``), slower layers
    (``layers.scaled``); the lab predicts its emulated runs this way
    (:mod:`hetcoll.lab.predict_emulated`).

    ``shares``: samples per device; ``layers``: per layer and device; ``backward_start_s``: when
    each device's backward starts (the end of its forward); ``update_s``: each device's
    optimizer step (0 without samples); ``buckets``: DDP's gradient buckets in the order the
    backward fills them, as (earliest layer, allreduce seconds), each ready once its earliest
    layer's backward is done on every device; ``broadcast_s``: DDP's buffer broadcast opening
    the step; ``overlap``: whether the allreduces overlap the backward; ``memory_bytes`` and
    ``reason`` as in :class:`Prediction`.
    """

    strategy: str
    shares: np.ndarray
    layers: LayerSeconds
    backward_start_s: np.ndarray
    update_s: np.ndarray
    buckets: list[tuple[int, float]]
    broadcast_s: float
    overlap: bool
    memory_bytes: np.ndarray
    reason: str

    def prediction(self) -> Prediction:
        """The step: every device's forward and backward, the bucket allreduces (each starting
        once every device has produced its bucket and the previous one is done, or all after
        the backward without ``overlap``), then the optimizer."""
        lt, start, opt = self.layers, self.backward_start_s, self.update_s
        compute = start + lt.backward_s.sum(axis=0)
        busy = float(compute.max())
        # Backward runs layers last to first: cumulative backward time after layer i's backward.
        bwd_rev_cum = np.cumsum(lt.backward_s[::-1, :], axis=0)[::-1, :]
        ready = (start[None, :] + bwd_rev_cum).max(axis=1)
        end = buckets_end(self.buckets, ready, busy, self.overlap)
        slowest = int(np.argmax(compute + opt))
        step = self.broadcast_s + max(busy, end) + float(opt.max())
        b = self.shares
        return samples_prediction(
            self.strategy,
            b,
            step,
            lt.breakdown(slowest, float(opt[slowest]), step),
            self.memory_bytes,
            self.reason,
            {
                "allreduce_s": float(sum(c for _, c in self.buckets)),
                "broadcast_s": self.broadcast_s,
                "buckets": len(self.buckets),
                "compute_s_per_device": (
                    [float(x) for x in compute] if int((b > 0).sum()) <= 64 else None
                ),
                "critical_device": slowest,
            },
        )


def buckets_end(
    buckets: list[tuple[int, float]], ready_s: np.ndarray, busy_s: float, overlap: bool
) -> float:
    """When DDP's last bucket allreduce ends: each bucket (earliest layer, seconds) starts once
    every device has produced it (``ready_s[layer]``, the latest device's end of that layer's
    backward) and the previous one is done; without ``overlap``, all after the backward
    (``busy_s``)."""
    end = 0.0
    for first_layer, seconds in buckets:
        ready = float(ready_s[first_layer]) if overlap else busy_s
        end = max(end, ready) + seconds
    return end


def samples_prediction(
    strategy: str,
    shares: np.ndarray,
    step_s: float,
    breakdown: dict[str, float],
    memory_bytes: np.ndarray,
    reason: str,
    detail: dict[str, Any],
) -> Prediction:
    """A data-parallel kind of step's :class:`Prediction`: ``shares`` samples per device,
    feasible unless ``reason`` says why not."""
    return Prediction(
        strategy,
        [int(x) for x in shares],
        "samples",
        step_s,
        breakdown,
        [float(x) for x in memory_bytes],
        not reason,
        reason,
        int(shares.sum()),
        detail,
    )


def data_parallel_schedule(
    costs: ModelCosts,
    cluster: Cluster,
    shares: Sequence[int],
    *,
    overlap: bool = True,
    optimizer_state_copies: int = 1,
    first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES,
    bucket_bytes: float = DDP_BUCKET_BYTES,
    strategy: str = "data parallel",
    broadcast_buffers: bool = True,
) -> DataParallelSchedule:
    """The step :func:`data_parallel` predicts, laid out (arguments as there).

    >>> data_parallel_schedule(costs, cluster, [48, 16]).prediction().step_s  # doctest: +SKIP
    """
    check_costs_and_cluster(costs, cluster)
    devices = cluster.devices
    b = _check_shares(shares, len(devices))
    if not b.any():  # once a feasible step of nothing
        raise ValueError(f"shares: no device has samples, got {list(shares)!r}")
    dev = device_arrays(devices)
    lt = _layer_times(costs, dev, b)
    opt = np.where(
        b > 0,
        terms.step_update_seconds(
            costs.gradient_bytes,
            dev.mem_bytes_per_s,
            optimizer_state_copies,
            dev.step_overhead_s,
        ),
        0.0,
    )
    link = cluster.ring_link()
    p = max(1, int((b > 0).sum()))
    buckets = timed_buckets(costs, cluster, b, first_bucket_bytes, bucket_bytes)
    bcast = (
        float(
            terms.broadcast_seconds(
                costs.buffer_bytes, p, link.latency_s, link.bytes_per_s, link.call_of("broadcast")
            )
        )
        if broadcast_buffers and costs.buffer_bytes > 0
        else 0.0
    )
    # + DDP's bucket copy of the gradients
    memory = _memory_common(costs, optimizer_state_copies) + costs.gradient_bytes
    mem = np.where(b > 0, memory + b * costs.saved_bytes_per_sample(), 0.0)
    return DataParallelSchedule(
        strategy,
        b,
        lt,
        lt.forward_s.sum(axis=0),
        opt,
        buckets,
        bcast,
        overlap,
        mem,
        memory_shortfall(mem, devices),
    )


def data_parallel(
    costs: ModelCosts,
    cluster: Cluster,
    shares: Sequence[int],
    *,
    overlap: bool = True,
    optimizer_state_copies: int = 1,
    first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES,
    bucket_bytes: float = DDP_BUCKET_BYTES,
    strategy: str = "data parallel",
    broadcast_buffers: bool = True,
) -> Prediction:
    """One data-parallel step: device d runs forward + backward on ``shares[d]`` samples; the
    gradients are allreduced by a ring in DDP buckets, each starting once every device has
    produced it (``overlap=True``, as DDP does) or all after the backward (``overlap=False``);
    then the optimizer updates every replica. Devices with no samples sit the step out. With
    ``broadcast_buffers`` (DDP's default) the step starts with a broadcast of the module's
    buffers from rank 0. (:func:`data_parallel_schedule` gives the step before it is timed.)

    Its plan (:meth:`Prediction.to_plan`) is one whole-model replica per device with samples.
    :func:`hetcoll.torch.parallelize` sums up to 1 MiB of gradients in one allreduce after the
    backward (no buffer broadcast), and more in DDP-sized buckets started during the last
    backward: :func:`predict_plan` predicts the first, and the second as the first (no
    overlap: an overestimate by up to the sum's time).

    >>> from hetcoll.model import layer_costs, networks, hardware  # doctest: +SKIP
    >>> data_parallel(costs, cluster, [48, 16]).step_s  # doctest: +SKIP
    """
    pred = data_parallel_schedule(
        costs,
        cluster,
        shares,
        overlap=overlap,
        optimizer_state_copies=optimizer_state_copies,
        first_bucket_bytes=first_bucket_bytes,
        bucket_bytes=bucket_bytes,
        strategy=strategy,
        broadcast_buffers=broadcast_buffers,
    ).prediction()
    try:
        costs.whole_model_plan_layers()  # whole-model replicas: no cut to know
        shares = list(pred.shares)
        pred.plan_factory = functools.partial(_data_parallel_plan, costs, shares)
    except ValueError as e:
        pred.plan_note = str(e)
    return pred


def balanced_batch_shares(
    costs: ModelCosts,
    cluster: Cluster,
    batch: int,
    *,
    optimizer_state_copies: int = 1,
    respect_memory: bool = True,
) -> list[int]:
    """Samples per device that minimise the slowest device's compute time, from
    :func:`hetcoll.split` on the model's per-device speed (samples/s) and start-up seconds, and
    capped by what fits in each device's memory.

    Raises ValueError (naming ``batch``) when the batch cannot fit in the cluster's memory.
    """
    check_costs_and_cluster(costs, cluster)
    terms.batch_argument(batch)  # -1 once said "at most -2" samples fit
    if not isinstance(respect_memory, bool):
        raise TypeError(f"respect_memory: must be a bool, got {type(respect_memory).__name__}")
    devices = cluster.devices
    dev = device_arrays(devices)
    a, c = linear_fit(costs, dev, max(1, batch // max(1, len(devices))))
    capacity = None
    if respect_memory:
        fixed = _memory_common(costs, optimizer_state_copies) + costs.gradient_bytes
        per = max(costs.saved_bytes_per_sample(), 1e-9)
        caps = np.floor((dev.memory_bytes - fixed) / per)
        capacity = [int(min(max(x, 0), batch)) for x in caps]
        if sum(capacity) < batch:
            raise ValueError(
                f"batch: {batch} samples do not fit in the cluster's memory "
                f"(at most {sum(capacity)})"
            )
    return hetcoll.split(batch, list(1.0 / c), latency=list(a), capacity=capacity)


def even_batch_shares(batch: int, num_devices: int) -> list[int]:
    """What a framework without balancing does: B // p each, the remainder to the first ranks.

    ``batch`` is an integer >= 0 and ``num_devices`` one >= 1 (bools are not integers): else
    ``ValueError`` naming the argument.

    >>> even_batch_shares(10, 4)
    [3, 3, 2, 2]
    """
    for name, value, least in (("batch", batch, 0), ("num_devices", num_devices, 1)):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{name}: must be an integer >= {least}, got {value!r}")
        if value < least:
            raise ValueError(f"{name}: must be an integer >= {least}, got {value}")
    if num_devices > MAX_DEVICES:  # the list is built: 2**40 of them filled the memory
        raise ValueError(f"num_devices: must be at most {MAX_DEVICES}, got {num_devices}")
    batch, num_devices = int(batch), int(num_devices)
    return [
        batch // num_devices + (1 if r < batch % num_devices else 0) for r in range(num_devices)
    ]


def _data_parallel_plan(costs: ModelCosts, shares: Sequence[int]) -> Plan:
    """One whole-model replica per device with samples."""
    n = costs.whole_model_plan_layers()
    replicas = [
        {"samples": int(b), "stages": [{"ranks": [d], "layers": [0, n]}]}
        for d, b in enumerate(shares)
        if b > 0
    ]
    if not replicas:
        raise ValueError("shares: no device has samples")
    return Plan.from_dict({"microbatches": 1, "schedule": "GPipe", "replicas": replicas})
