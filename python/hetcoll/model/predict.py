"""Predicted time and memory of one training step for a model on a cluster at given shares.

Three strategies, each evaluated with the terms of :mod:`hetcoll.model.terms`:

- data parallel (:func:`data_parallel`): device d trains ``shares[d]`` samples of the batch, then
  the gradients are summed by a ring allreduce in DDP-style buckets that overlap the backward pass;
- filter parallel (:func:`filter_parallel`): every conv / linear layer's filters are split over
  the devices, in the modes :func:`hetcoll.torch.filter_parallel` picks (:func:`filter_modes`):
  consecutive layers pair up as split-output -> split-input (one allreduce of partial outputs),
  the others gather their outputs (allgatherv); input gradients are summed (allreduce) in the
  backward pass;
- pipeline (:func:`pipeline`): contiguous stages of layers on the devices in order, GPipe
  or 1F1B micro-batches, with the bubble;
- any :class:`hetcoll.Plan` (:func:`predict_plan`): replicas of any shape, each a pipeline of
  one-rank or filter-split stages over uneven micro-batches, as
  :func:`hetcoll.torch.parallelize` runs it; the pipeline above is one such plan.

Every prediction carries the breakdown of the step on its critical path (compute, memory stalls,
kernel overheads, exposed communication, optimizer, bubble - they add up to the step time), the
bytes each device holds, and whether that fits (infeasible plans are kept and marked, so the
planner can say why a strategy lost). Everything is vectorised over devices: a 1,024-device
cluster costs a few numpy calls per strategy.
"""

from __future__ import annotations

import functools
import itertools
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

import hetcoll
from hetcoll.model import terms
from hetcoll.model.costs import ModelCosts
from hetcoll.model.hardware import PRECISIONS, Cluster, Device, Link
from hetcoll.plan import Plan, microbatch_sizes

# torch DDP's defaults: the first bucket is capped at 1 MiB (so communication starts early), the
# others at bucket_cap_mb = 25 MiB.
DDP_FIRST_BUCKET_BYTES = 1024 * 1024
DDP_BUCKET_BYTES = 25 * 1024 * 1024


@dataclass
class Prediction:
    """Predicted step of one strategy at given shares.

    ``shares``: integers per device in ``share_unit`` (samples, filters of the widest split
    layer, or layers). ``breakdown``: seconds on the critical path by cause, summing to
    ``step_s``. ``memory_bytes``: what each device holds; ``feasible`` is False when any device
    holds more than its memory, or the plan cannot run at all (``reason`` says which).
    """

    strategy: str
    shares: list[int]
    share_unit: str
    step_s: float
    breakdown: dict[str, float]
    memory_bytes: list[float]
    feasible: bool
    reason: str = ""
    batch: int = 0
    detail: dict[str, Any] = field(default_factory=dict)
    #: The :class:`hetcoll.Plan` this prediction is for (what :func:`hetcoll.torch.parallelize`
    #: runs), or None with ``plan_note`` saying why the runtime cannot run it. (Not compared:
    #: two predictions are equal when their figures are.)
    plan: Plan | None = field(default=None, compare=False)
    plan_note: str = field(default="", compare=False)
    #: Builds ``plan`` when it is first read, for a candidate whose plan was costed from its
    #: layout (a plan of 10,240 replicas takes longer to build and check than to cost).
    plan_factory: Callable[[], Plan] | None = field(default=None, compare=False, repr=False)

    @property
    def samples_per_s(self) -> float:
        return self.batch / self.step_s if self.step_s > 0 and math.isfinite(self.step_s) else 0.0

    @property
    def has_plan(self) -> bool:
        """Whether the runtime can run this prediction's plan (built or not yet built)."""
        return self.plan_factory is not None or self.__dict__.get("_plan") is not None

    def to_plan(self) -> Plan:
        """The plan to hand to :func:`hetcoll.torch.parallelize` (device i = rank i);
        ``ValueError`` when there is none (``plan_note`` says why).

        >>> best = hetcoll.model.plan(costs, cluster, 256)[0]  # doctest: +SKIP
        >>> best.to_plan().save("plan.json")  # doctest: +SKIP
        """
        if self.plan is None:
            raise ValueError(
                f"{self.strategy}: no plan the runtime can run"
                + (f": {self.plan_note}" if self.plan_note else "")
            )
        return self.plan

    def to_json(self, *, with_plan: bool = True, per_device: bool = True) -> dict[str, Any]:
        """The prediction as JSON; ``with_plan=False`` leaves the plan out, ``per_device=False``
        gives the largest memory (``max_memory_bytes``) and the devices used instead of the
        figures of every device (megabytes for many candidates on 10,240 devices)."""
        plan = self.plan if with_plan else None
        devices: dict[str, Any] = (
            {"shares": self.shares, "memory_bytes": self.memory_bytes}
            if per_device
            else {
                "devices_used": sum(1 for x in self.shares if x),
                "max_memory_bytes": max(self.memory_bytes, default=0.0),
            }
        )
        return {
            "strategy": self.strategy,
            **devices,
            "share_unit": self.share_unit,
            "step_s": self.step_s,
            "samples_per_s": self.samples_per_s,
            "breakdown_s": self.breakdown,
            "feasible": self.feasible,
            "reason": self.reason,
            "batch": self.batch,
            **({"detail": self.detail} if self.detail else {}),
            **({"plan": plan.to_dict()} if plan is not None else {}),
        }


def _get_plan(self: Prediction) -> Plan | None:
    built: Plan | None = self.__dict__.get("_plan")
    if built is None and self.plan_factory is not None:
        built = self.__dict__["_plan"] = self.plan_factory()
    return built


def _set_plan(self: Prediction, value: Plan | None) -> None:
    self.__dict__["_plan"] = value


# ``plan`` reads as a field and is built on first read when only its factory was given.
setattr(Prediction, "plan", property(_get_plan, _set_plan))  # noqa: B010


@dataclass(frozen=True)
class _KernelTable:
    """Every kernel of a model as flat arrays (one row per kernel), for vectorised timing."""

    layer: np.ndarray  # layer index of each kernel
    forward: np.ndarray  # True for forward kernels
    flops_ps: np.ndarray
    bytes_ps: np.ndarray
    bytes_fixed: np.ndarray
    fbytes_ps: np.ndarray
    fbytes_fixed: np.ndarray
    scales: np.ndarray
    gemm: np.ndarray  # True for GEMM-class kernels (memory at mem_bytes_per_s), else element-wise
    pool: np.ndarray  # True for pooling kernels (memory at pool_bytes_per_s)
    conv: np.ndarray  # True for convolution GEMMs (arithmetic at the convolution FLOP rate)
    channels_out: np.ndarray  # convolutions: output and input channels of one group
    channels_in: np.ndarray
    num_layers: int
    onehot: np.ndarray  # (layers, kernels): 1 where the kernel belongs to the layer


@functools.lru_cache(maxsize=128)
def _kernel_table(costs: ModelCosts) -> _KernelTable:
    rows: list[
        tuple[int, bool, float, float, float, float, float, bool, bool, bool, bool, int, int]
    ] = []
    for i, layer in enumerate(costs.layers):
        for fwd, kernels in ((True, layer.forward), (False, layer.backward)):
            for k in kernels:
                rows.append(
                    (
                        i,
                        fwd,
                        k.flops_per_sample,
                        k.bytes_per_sample,
                        k.bytes_fixed,
                        k.filter_bytes_per_sample,
                        k.filter_bytes_fixed,
                        k.scales_with_filters,
                        not k.elementwise,
                        k.pool,
                        k.conv,
                        *k.channels,
                    )
                )
    cols = list(zip(*rows)) if rows else [()] * 13
    onehot = np.zeros((len(costs.layers), len(rows)))
    onehot[np.asarray(cols[0], dtype=np.int64), np.arange(len(rows))] = 1.0
    floats = [np.asarray(c, dtype=np.float64) for c in cols[2:7]]
    return _KernelTable(
        layer=np.asarray(cols[0], dtype=np.int64),
        forward=np.asarray(cols[1], dtype=bool),
        flops_ps=floats[0],
        bytes_ps=floats[1],
        bytes_fixed=floats[2],
        fbytes_ps=floats[3],
        fbytes_fixed=floats[4],
        scales=np.asarray(cols[7], dtype=bool),
        gemm=np.asarray(cols[8], dtype=bool),
        pool=np.asarray(cols[9], dtype=bool),
        conv=np.asarray(cols[10], dtype=bool),
        channels_out=np.asarray(cols[11], dtype=np.float64),
        channels_in=np.asarray(cols[12], dtype=np.float64),
        num_layers=len(costs.layers),
        onehot=onehot,
    )


@dataclass(frozen=True)
class _DeviceArrays:
    flops_per_s: np.ndarray
    conv_flops_per_s: np.ndarray
    mem_bytes_per_s: np.ndarray
    elementwise_bytes_per_s: np.ndarray
    pool_bytes_per_s: np.ndarray
    overhead_s: np.ndarray
    memory_bytes: np.ndarray
    conv_channel_block: np.ndarray
    # Per precision: each device's matmul speed-up over fp32, and the devices without a peak.
    speedup: dict[str, np.ndarray]
    missing_peak: dict[str, tuple[str, ...]]
    #: Each device's kind: the index of its Device among the distinct ones (equal devices time
    #: alike, so a cluster of 10,240 devices in two kinds is timed as two columns).
    kind: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def matmul_speedup(self, precision: str) -> np.ndarray:
        """Each device's :meth:`Device.matmul_speedup` at ``precision``; a ``UserWarning`` names
        each device that falls back to fp32 for want of a peak."""
        for name in self.missing_peak[precision]:
            warnings.warn(
                f"precision: device {name!r} has no {precision} peak ({precision}_flops_per_s); "
                "its matmuls are costed at its fp32 rate",
                UserWarning,
                # Reported at this line, so Python's default filter shows it once per device.
                stacklevel=1,
            )
        return self.speedup[precision]

    def columns(self, index: np.ndarray) -> _DeviceArrays:
        """The devices ``index`` (an integer array) of these, in that order."""
        return _DeviceArrays(
            self.flops_per_s[index],
            self.conv_flops_per_s[index],
            self.mem_bytes_per_s[index],
            self.elementwise_bytes_per_s[index],
            self.pool_bytes_per_s[index],
            self.overhead_s[index],
            self.memory_bytes[index],
            self.conv_channel_block[index],
            {p: v[index] for p, v in self.speedup.items()},
            self.missing_peak,
            self.kind[index],
        )


#: The arrays of the last few device lists (a cluster's ``devices`` is one tuple for its life;
#: the planner asks for the same one hundreds of times).
_ARRAYS: dict[int, tuple[Sequence[Device], _DeviceArrays]] = {}


def _device_arrays(devices: Sequence[Device]) -> _DeviceArrays:
    hit = _ARRAYS.get(id(devices))
    if hit is not None and hit[0] is devices:
        return hit[1]
    arrays = _new_device_arrays(devices)
    if isinstance(devices, tuple):
        if len(_ARRAYS) >= 16:
            _ARRAYS.pop(next(iter(_ARRAYS)))
        _ARRAYS[id(devices)] = (devices, arrays)
    return arrays


def _new_device_arrays(devices: Sequence[Device]) -> _DeviceArrays:
    # Each distinct device is read once (a large cluster holds a few kinds many times over,
    # mostly the same object: those are told apart by identity before they are hashed).
    by_id: dict[int, Device] = {}
    for d in devices:
        by_id.setdefault(id(d), d)
    unique = list(dict.fromkeys(by_id.values()))
    number = {d: i for i, d in enumerate(unique)}
    of_id = {i: number[d] for i, d in by_id.items()}
    kind = np.fromiter((of_id[id(d)] for d in devices), dtype=np.int64, count=len(devices))

    def per_device(values: list[float]) -> np.ndarray:
        return np.asarray(values, dtype=np.float64)[kind]

    return _DeviceArrays(
        per_device([d.flops_per_s for d in unique]),
        per_device([d.conv_rate for d in unique]),
        per_device([d.mem_bytes_per_s for d in unique]),
        per_device([d.elementwise_rate for d in unique]),
        per_device([d.pool_rate for d in unique]),
        per_device([d.kernel_overhead_s for d in unique]),
        per_device([d.memory_bytes for d in unique]),
        per_device([float(d.conv_channel_block) for d in unique]),
        {p: per_device([d.matmul_speedup(p) for d in unique]) for p in PRECISIONS},
        {
            p: tuple(sorted({d.name for d in unique if d.peak_flops_per_s(p) <= 0}))
            for p in PRECISIONS
        },
        kind,
    )


def _channel_padding(
    t: _KernelTable, dev: _DeviceArrays, phi: np.ndarray, split_input: np.ndarray | None
) -> np.ndarray:
    """(kernels, devices): the factor by which each convolution kernel's arithmetic grows
    when its channels, as split on each device (``phi`` of the output channels, or of the input
    channels in ``split_input`` layers), are padded to the device's channel block: output
    channels always, input channels from one block up (:class:`Device`)."""
    block = dev.conv_channel_block[None, :]
    if not t.conv.any() or (block == 1).all():
        return np.ones(phi.shape)
    by_input = (
        np.zeros(len(t.layer), dtype=bool) if split_input is None else split_input[t.layer]
    )[:, None]
    c_out = np.round(t.channels_out[:, None] * np.where(by_input, 1.0, phi))
    c_in = np.round(t.channels_in[:, None] * np.where(by_input, phi, 1.0))
    pad_out = np.ceil(c_out / block) * block
    pad_in = np.where(c_in < block, c_in, np.ceil(c_in / block) * block)
    with np.errstate(divide="ignore", invalid="ignore"):
        factor = (pad_out / c_out) * (pad_in / c_in)
    return np.where(t.conv[:, None] & (c_out > 0) & (c_in > 0), factor, 1.0)


@dataclass(frozen=True)
class LayerSeconds:
    """Seconds per layer (rows) and device (columns) of one step, split by cause:
    ``forward_s`` and ``backward_s`` are the layers' times; ``compute_s`` (FLOPs at the
    device's rate, forward + backward), ``memory_s`` (the roofline's excess of memory-bound
    kernels) and ``overhead_s`` (kernel launches) add up to their sum."""

    forward_s: np.ndarray
    backward_s: np.ndarray
    compute_s: np.ndarray
    memory_s: np.ndarray
    overhead_s: np.ndarray

    def scaled(self, factor: np.ndarray | float) -> LayerSeconds:
        """Every time multiplied by ``factor`` (a number, or an array that broadcasts against
        (layers, devices)): the layers as they run on slower or faster devices.

        >>> LayerSeconds(*[np.ones((2, 1))] * 5).scaled(np.array([[2.0], [1.0]])).forward_s
        array([[2.],
               [1.]])
        """
        return LayerSeconds(
            self.forward_s * factor,
            self.backward_s * factor,
            self.compute_s * factor,
            self.memory_s * factor,
            self.overhead_s * factor,
        )


def _layer_times(
    costs: ModelCosts,
    dev: _DeviceArrays,
    batch: np.ndarray,
    filter_fraction: np.ndarray | None = None,
    channel_fraction: np.ndarray | None = None,
    split_input: np.ndarray | None = None,
) -> LayerSeconds:
    """Roofline time of every layer on every device for per-device batches ``batch`` (and, for
    filter parallelism, per-layer-and-device filter fractions ``filter_fraction``, fractions
    ``channel_fraction`` of the channels a layer's per-sample work covers, and the layers
    ``split_input`` whose fraction is of their input channels)."""
    # Devices of one kind with the same work time alike: time each distinct column once.
    batch = np.asarray(batch)
    if (
        len(batch) > 8
        and len(dev.kind) == len(batch)
        and filter_fraction is None is channel_fraction
    ):
        # The common case, one number per column: kind and batch as one integer.
        code = dev.kind * (int(batch.max()) + 1) + batch.astype(np.int64)
        _, first, inverse = np.unique(code, return_index=True, return_inverse=True)
        if len(first) < len(batch):
            lt = _layer_times(costs, dev.columns(first), batch[first], None, None, split_input)
            inverse = inverse.reshape(-1)
            return LayerSeconds(
                lt.forward_s[:, inverse],
                lt.backward_s[:, inverse],
                lt.compute_s[:, inverse],
                lt.memory_s[:, inverse],
                lt.overhead_s[:, inverse],
            )
    elif len(batch) > 8 and len(dev.kind) == len(batch):
        rows = [dev.kind, batch]
        if filter_fraction is not None:
            rows += list(filter_fraction)
        if channel_fraction is not None:
            rows += list(channel_fraction)
        _, first, inverse = np.unique(
            np.stack([np.asarray(r, dtype=np.float64) for r in rows]),
            axis=1,
            return_index=True,
            return_inverse=True,
        )
        if len(first) < len(batch):
            inverse = inverse.reshape(-1)
            lt = _layer_times(
                costs,
                dev.columns(first),
                batch[first],
                None if filter_fraction is None else filter_fraction[:, first],
                None if channel_fraction is None else channel_fraction[:, first],
                split_input,
            )
            return LayerSeconds(
                lt.forward_s[:, inverse],
                lt.backward_s[:, inverse],
                lt.compute_s[:, inverse],
                lt.memory_s[:, inverse],
                lt.overhead_s[:, inverse],
            )
    t = _kernel_table(costs)
    n_dev = len(batch)
    b = batch[None, :].astype(np.float64)
    if channel_fraction is not None:
        b = b * channel_fraction[t.layer, :]
    phi = np.ones((len(t.layer), n_dev)) if filter_fraction is None else filter_fraction[t.layer, :]
    flops = t.flops_ps[:, None] * b * np.where(t.scales[:, None], phi, 1.0)
    moved = (t.bytes_ps[:, None] + phi * t.fbytes_ps[:, None]) * b + (
        t.bytes_fixed[:, None] + phi * t.fbytes_fixed[:, None]
    )
    # A kernel runs on a device only if the device has work for it (samples and, for split
    # kernels, filters).
    runs = (b > 0) & np.where(t.scales[:, None], phi > 0, True)
    bandwidth = np.where(
        t.gemm[:, None],
        dev.mem_bytes_per_s[None, :],
        np.where(
            t.pool[:, None], dev.pool_bytes_per_s[None, :], dev.elementwise_bytes_per_s[None, :]
        ),
    )
    rate = np.where(t.conv[:, None], dev.conv_flops_per_s[None, :], dev.flops_per_s[None, :])
    if costs.precision != "fp32":
        # Matmul-class kernels run at the precision's peak; element-wise ones stay memory-bound.
        speedup = dev.matmul_speedup(costs.precision)
        rate = rate * np.where(t.gemm[:, None], speedup[None, :], 1.0)
    # Convolutions compute on channels padded to the device's block.
    work = flops * _channel_padding(t, dev, phi, split_input)
    comp = np.where(runs, work / rate, 0.0)
    mem = np.where(runs, moved / bandwidth, 0.0)
    ovh = np.where(runs, np.broadcast_to(dev.overhead_s[None, :], comp.shape), 0.0)
    total = terms.roofline_seconds(work, moved, rate, bandwidth)
    total = np.where(runs, total + ovh, 0.0)

    def per_layer(x: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        rows = x if mask is None else x * mask[:, None]
        return t.onehot @ rows  # type: ignore[no-any-return]

    return LayerSeconds(
        per_layer(total, t.forward),
        per_layer(total, ~t.forward),
        per_layer(comp),
        per_layer(np.maximum(mem - comp, 0.0)),
        per_layer(ovh),
    )


def _check_shares(shares: Sequence[int], num_devices: int, argument: str = "shares") -> np.ndarray:
    if len(shares) != num_devices:
        raise ValueError(
            f"{argument}: expected {num_devices} values (one per device), got {len(shares)}"
        )
    for s in shares:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0:
            raise ValueError(f"{argument}: expected integers >= 0, got {s!r}")
    return np.asarray(shares, dtype=np.int64)


def ddp_buckets(
    costs: ModelCosts,
    first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES,
    bucket_bytes: float = DDP_BUCKET_BYTES,
) -> list[tuple[int, float]]:
    """DDP's gradient buckets as (index of the earliest layer in the bucket, bytes): layers in
    reverse order (the order backward produces gradients), a bucket closed once it reaches its
    cap (1 MiB for the first, then 25 MiB). A bucket is ready when its earliest layer's backward
    is done."""
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


def _memory_common(costs: ModelCosts, state_copies: int) -> float:
    # weights + gradients + optimizer state
    return costs.param_bytes * (2 + state_copies)


def _memory_shortfall(mem: np.ndarray, devices: Sequence[Any]) -> str:
    """Why a plan does not fit ('' when it does): the first device whose memory ``mem[d]``
    (bytes) exceeds its capacity."""
    capacity = _device_arrays(devices).memory_bytes if len(devices) > 64 else None
    if capacity is not None:
        over = np.flatnonzero(np.asarray(mem) > capacity)
        candidates = over[:1].tolist()
    else:
        candidates = range(len(mem))
    for d in candidates:
        need = mem[d]
        if need > devices[d].memory_bytes:
            return (
                f"device {d} ({devices[d].name}) needs {need / 1e9:.3g} GB of "
                f"{devices[d].memory_bytes / 1e9:.3g} GB"
            )
    return ""


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
        end = 0.0
        for first_layer, c in self.buckets:
            ready = float((start + bwd_rev_cum[first_layer, :]).max()) if self.overlap else busy
            end = max(end, ready) + c
        slowest = int(np.argmax(compute + opt))
        step = self.broadcast_s + max(busy, end) + float(opt.max())
        breakdown = {
            "compute": float(lt.compute_s[:, slowest].sum()),
            "memory": float(lt.memory_s[:, slowest].sum()),
            "overhead": float(lt.overhead_s[:, slowest].sum()),
            "communication": 0.0,
            "optimizer": float(opt[slowest]),
        }
        breakdown["communication"] = max(0.0, step - sum(breakdown.values()))
        b = self.shares
        return Prediction(
            self.strategy,
            [int(x) for x in b],
            "samples",
            step,
            breakdown,
            [float(x) for x in self.memory_bytes],
            not self.reason,
            self.reason,
            int(b.sum()),
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
    devices = cluster.devices
    b = _check_shares(shares, len(devices))
    dev = _device_arrays(devices)
    lt = _layer_times(costs, dev, b)
    opt = np.where(
        b > 0,
        terms.optimizer_update_seconds(
            costs.param_bytes, dev.mem_bytes_per_s, optimizer_state_copies
        ),
        0.0,
    )
    link = cluster.ring_link()
    # Devices given no samples sit the step out (a plan would not start them), so the ring
    # runs over the others only.
    p = max(1, int((b > 0).sum()))
    reduce_bw = float(dev.mem_bytes_per_s.min())
    buckets = [
        (
            first_layer,
            float(
                terms.ring_allreduce_seconds(
                    nbytes, p, link.latency_s, link.bytes_per_s, reduce_bw, costs.itemsize
                )
            ),
        )
        for first_layer, nbytes in ddp_buckets(costs, first_bucket_bytes, bucket_bytes)
    ]
    bcast = (
        float(terms.broadcast_seconds(costs.buffer_bytes, p, link.latency_s, link.bytes_per_s))
        if broadcast_buffers and costs.buffer_bytes > 0
        else 0.0
    )
    memory = _memory_common(costs, optimizer_state_copies) + costs.param_bytes  # + DDP bucket copy
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
        _memory_shortfall(mem, devices),
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
    :func:`hetcoll.torch.parallelize` sums its gradients in one allreduce after the backward
    (no buckets, no overlap, no buffer broadcast): :func:`predict_plan` predicts that run.

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
        costs.check_plan_layers()
        if not any(pred.shares):
            raise ValueError("shares: no device has samples")
        shares = list(pred.shares)
        pred.plan_factory = functools.partial(_data_parallel_plan, costs, shares)
    except ValueError as e:
        pred.plan_note = str(e)
    return pred


def compute_seconds(costs: ModelCosts, device: Device, batch: int) -> float:
    """Forward + backward seconds of the whole model on one device at ``batch`` samples."""
    dev = _device_arrays([device])
    lt = _layer_times(costs, dev, np.array([batch]))
    return float(lt.forward_s.sum() + lt.backward_s.sum())


def _linear_fit(costs: ModelCosts, dev: _DeviceArrays, b_ref: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-device t(b) ~ a + c b through the predicted compute times at b_ref and 2 b_ref."""
    n = len(dev.flops_per_s)
    t1 = _layer_times(costs, dev, np.full(n, b_ref))
    t2 = _layer_times(costs, dev, np.full(n, 2 * b_ref))
    y1 = t1.forward_s.sum(0) + t1.backward_s.sum(0)
    y2 = t2.forward_s.sum(0) + t2.backward_s.sum(0)
    c = np.maximum((y2 - y1) / b_ref, 1e-30)
    a = np.maximum(y1 - c * b_ref, 0.0)
    return a, c


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
    devices = cluster.devices
    dev = _device_arrays(devices)
    a, c = _linear_fit(costs, dev, max(1, batch // max(1, len(devices))))
    capacity = None
    if respect_memory:
        fixed = _memory_common(costs, optimizer_state_copies) + costs.param_bytes
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
    """What a framework without balancing does: B // p each, the remainder to the first ranks."""
    return [
        batch // num_devices + (1 if r < batch % num_devices else 0) for r in range(num_devices)
    ]


FILTER_MODES = ("gather", "split-output", "split-input")


def filter_modes(costs: ModelCosts, *, avoid_gathers: bool = True) -> dict[str, str]:
    """The mode of every layer :func:`hetcoll.torch.filter_parallel` splits (name -> "gather",
    "split-output" or "split-input"), as its own pairing rule
    (:func:`hetcoll.torch.filters.filter_modes`) chose them when the costs were read off
    the model: a Conv2d / Linear layer feeding the next one through channel-wise modules only
    (inside an ``nn.Sequential``) becomes split-output, the next split-input (no gather between
    them; the pair's partial sums are allreduced once); every other split layer gathers.
    ``avoid_gathers=False`` gathers after every split layer. Layers absent stay replicated.

    >>> from hetcoll.model import layer_costs, networks
    >>> filter_modes(layer_costs(networks.mlp((8,)), (8,)))
    {'1': 'split-output', '3': 'split-input', '5': 'gather'}
    """
    modes = dict(costs.filter_modes)
    return modes if avoid_gathers else dict.fromkeys(modes, "gather")


def _check_modes(costs: ModelCosts, modes: Mapping[str, str]) -> dict[str, str]:
    if not isinstance(modes, Mapping):
        raise TypeError(f"modes: must be a dict of layer name -> mode, got {type(modes).__name__}")
    by_name = {x.name: x for x in costs.layers}
    out = {}
    for name, mode in modes.items():
        if name not in by_name or by_name[name].filters <= 0:
            raise ValueError(f"modes: {name!r} is not a layer with filters to split")
        if mode not in FILTER_MODES:
            raise ValueError(f"modes: {name!r} has mode {mode!r}; expected one of {FILTER_MODES}")
        out[name] = mode
    return out


@dataclass(frozen=True)
class FilterParallelSchedule:
    """One filter-parallel step laid out, before its devices are timed against each other:
    what :func:`filter_parallel` predicts from (:func:`filter_parallel_schedule` builds it,
    :meth:`prediction` times it). Public so that a step can be changed and timed again (slower
    layers on some devices: ``layers.scaled``); the lab predicts its emulated runs this way
    (:mod:`hetcoll.lab.predict_emulated`).

    ``layers``: per layer and device, each device on its share of the split layers;
    ``split``: per layer, True where the layer's filters are split; ``forward_collective_s`` /
    ``backward_collective_s``: per layer, the collective after its forward / backward (0:
    none); ``update_s``: each device's optimizer step on the parameters it holds; the rest as
    in :class:`Prediction` (``detail``: the modes, shares per layer and number of
    collectives).
    """

    strategy: str
    batch: int
    layers: LayerSeconds
    split: np.ndarray
    forward_collective_s: np.ndarray
    backward_collective_s: np.ndarray
    update_s: np.ndarray
    shares: list[int]
    share_unit: str
    memory_bytes: np.ndarray
    reason: str
    detail: dict[str, Any]

    def order(self) -> list[tuple[int, bool]]:
        """The step's pieces in the order they run: ``(layer, True)`` for every layer's
        forward, first to last, then ``(layer, False)`` for the backwards, last to first."""
        n = len(self.split)
        return [(i, True) for i in range(n)] + [(i, False) for i in range(n)][::-1]

    def prediction(self) -> Prediction:
        """The step in lock step: each stretch between two collectives takes its slowest
        device, then the collective; the last stretch ends with the optimizer."""
        fwd, bwd = self.layers.forward_s, self.layers.backward_s
        fwd_comm, bwd_comm, opt = (
            self.forward_collective_s,
            self.backward_collective_s,
            self.update_s,
        )
        step, stretch = 0.0, np.zeros(len(opt))
        for i, forward in self.order():
            stretch = stretch + (fwd if forward else bwd)[i]
            comm_s = (fwd_comm if forward else bwd_comm)[i]
            if comm_s > 0:
                step += float(stretch.max() + comm_s)
                stretch = np.zeros(len(opt))
        step = float(step + (stretch + opt).max())
        comm = float(fwd_comm.sum() + bwd_comm.sum())
        # Causes on the critical path: each layer's slowest device, scaled to the stretches' total.
        lt = self.layers
        crit = np.argmax(fwd + bwd, axis=1)
        rows = np.arange(len(self.split))
        parts_s = {
            "compute": lt.compute_s[rows, crit],
            "memory": lt.memory_s[rows, crit],
            "overhead": lt.overhead_s[rows, crit],
        }
        busy = sum(float(v.sum()) for v in parts_s.values())
        layers_s = step - comm - float(opt.max())
        scale = layers_s / busy if busy > 0 else 0.0
        breakdown = {k: float(v.sum()) * scale for k, v in parts_s.items()}
        breakdown["communication"] = comm
        breakdown["optimizer"] = float(opt.max())
        return Prediction(
            self.strategy,
            self.shares,
            self.share_unit,
            step,
            breakdown,
            [float(x) for x in self.memory_bytes],
            not self.reason,
            self.reason,
            self.batch,
            {**self.detail, "critical_device": int(np.argmax((fwd + bwd).sum(axis=0) + opt))},
        )


def filter_parallel_schedule(
    costs: ModelCosts,
    cluster: Cluster,
    batch: int,
    parts: Sequence[float],
    *,
    modes: Mapping[str, str] | None = None,
    optimizer_state_copies: int = 1,
    strategy: str = "filter parallel",
    layer_shares: Mapping[str, Sequence[int]] | None = None,
) -> FilterParallelSchedule:
    """The step :func:`filter_parallel` predicts, laid out (arguments as there).

    >>> filter_parallel_schedule(costs, cluster, 64, [1.0, 0.5]).split  # doctest: +SKIP
    """
    devices = cluster.devices
    n_dev = len(devices)
    if len(parts) != n_dev or any(not (float(x) > 0) for x in parts):
        raise ValueError(f"parts: expected {n_dev} positive numbers (one per device)")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch: must be an integer >= 1, got {batch!r}")
    layer_modes = filter_modes(costs) if modes is None else _check_modes(costs, modes)
    if n_dev == 1:
        layer_modes = {}
    dev = _device_arrays(devices)
    n_layers = len(costs.layers)
    phi = np.ones((n_layers, n_dev))  # each device's fraction of the layer's kernels' filters
    chan = np.ones((n_layers, n_dev))  # fraction of the channels a replicated layer runs on
    filters_of: dict[int, list[int]] = {}
    source: tuple[int, np.ndarray] | None = None  # the open split-output layer, its fractions
    for i, layer in enumerate(costs.layers):
        mode = layer_modes.get(layer.name)
        if mode == "split-input":
            if source is None:
                raise ValueError(f"modes: split-input layer {layer.name!r} follows no split-output")
            filters_of[i] = filters_of[source[0]]
            phi[i, :] = source[1]
            source = None
        elif mode is not None:
            if layer_shares is not None and layer.name in layer_shares:
                f = [int(x) for x in layer_shares[layer.name]]
                if len(f) != n_dev or sum(f) != layer.filters or min(f) < 0:
                    raise ValueError(
                        f"layer_shares: {layer.name!r} needs {n_dev} shares summing to "
                        f"{layer.filters}, got {f}"
                    )
            else:
                speeds = [float(x) for x in parts]
                f = hetcoll.split(layer.filters, speeds, minimum=1 if layer.filters >= n_dev else 0)
            filters_of[i] = f
            phi[i, :] = np.asarray(f, dtype=np.float64) / layer.filters
            source = (i, phi[i].copy()) if mode == "split-output" else None
        elif source is not None:
            chan[i, :] = source[1]
    # A replicated layer between a pair runs on the channel slice: as many fewer samples' worth
    # of element-wise work (these kernels are linear in the batch and own no filters).
    by_input = np.array([layer_modes.get(x.name) == "split-input" for x in costs.layers])
    lt = _layer_times(costs, dev, np.full(n_dev, batch), phi, chan, by_input)
    split_rows = np.zeros(n_layers, dtype=bool)
    split_rows[list(filters_of)] = True
    link = cluster.ring_link()
    reduce_bw = float(dev.mem_bytes_per_s.min())

    def allreduce_s(nbytes: float) -> float:
        return float(
            terms.ring_allreduce_seconds(
                nbytes, n_dev, link.latency_s, link.bytes_per_s, reduce_bw, costs.itemsize
            )
        )

    copy_bw = float(dev.elementwise_bytes_per_s.min())

    def copy_s(nbytes: float) -> float:
        return float(terms.copy_seconds(nbytes, copy_bw))

    fwd_comm = np.zeros(n_layers)  # after the layer's forward
    bwd_comm = np.zeros(n_layers)  # after the layer's backward
    for i in filters_of:
        layer, mode = costs.layers[i], layer_modes[costs.layers[i].name]
        # Every allreduce works on a copy of its tensor (the layers keep autograd's intact).
        if mode == "split-input":
            out = layer.out_bytes_per_sample * batch
            fwd_comm[i] = allreduce_s(out) + copy_s(out)
            continue
        if mode == "gather":
            # The channel dimension moves to the front of the local piece and back in the full
            # output (two copies), and the engine's allgatherv takes a contiguous send buffer
            # (on gloo, all_to_all_single: the piece once per rank).
            out = layer.out_bytes_per_sample * batch
            largest = float(phi[i].max()) * out
            fwd_comm[i] = float(
                terms.ring_allgatherv_seconds(largest, n_dev, link.latency_s, link.bytes_per_s)
            ) + copy_s((1 + n_dev) * largest + out)
        if any(k.name == "gemm-dX" for k in layer.backward):
            grad = layer.in_bytes_per_sample * batch
            bwd_comm[i] = allreduce_s(grad) + copy_s(grad)
    # phi is 1 for replicated layers: each device owns its filters' weights and all the rest.
    owned = (np.array([x.param_bytes for x in costs.layers])[:, None] * phi).sum(axis=0)
    opt = np.asarray(
        terms.optimizer_update_seconds(owned, dev.mem_bytes_per_s, optimizer_state_copies)
    )
    mem = owned * (2 + optimizer_state_copies) + batch * costs.saved_bytes_per_sample()
    if not filters_of and n_dev > 1:
        reason = "the model has no conv or linear layer to split"
    else:
        reason = _memory_shortfall(mem, devices)
    widest = max(filters_of, key=lambda i: costs.layers[i].filters) if filters_of else None
    return FilterParallelSchedule(
        strategy,
        batch,
        lt,
        split_rows,
        fwd_comm,
        bwd_comm,
        opt,
        filters_of[widest] if widest is not None else [0] * n_dev,
        f"filters of {costs.layers[widest].name}" if widest is not None else "filters",
        mem,
        reason,
        {
            "split_layers": len(filters_of),
            "modes": {costs.layers[i].name: layer_modes[costs.layers[i].name] for i in filters_of},
            "collectives": int((fwd_comm > 0).sum() + (bwd_comm > 0).sum()),
            "shares_per_layer": {costs.layers[i].name: filters_of[i] for i in filters_of},
        },
    )


def filter_parallel(
    costs: ModelCosts,
    cluster: Cluster,
    batch: int,
    parts: Sequence[float],
    *,
    modes: Mapping[str, str] | None = None,
    optimizer_state_copies: int = 1,
    strategy: str = "filter parallel",
) -> Prediction:
    """One filter-parallel step on the whole ``batch``, as :func:`hetcoll.torch.filter_parallel`
    runs it. Each split layer (``modes``, default :func:`filter_modes`) divides its F filters
    over the devices by :func:`hetcoll.split` in proportion to ``parts`` (speeds or weights, one
    per device; at least one filter each); a split-input layer takes the shares of the
    split-output layer before it, and the channel-wise layers between them run on those shares
    too. Every other layer is replicated. Communication per layer and mode:

    - gather: the output pieces are gathered (allgatherv, forward);
    - gather, split-output: the partial input gradients are summed (allreduce, backward) when
      the layer has an input gradient;
    - split-input: the partial outputs are summed (allreduce, forward).

    Ranks run in lock step between collectives: each stretch between two collectives takes its
    slowest device. No gradient allreduce: each device owns its filters, and replicated layers
    see the same full data everywhere. (:func:`filter_parallel_schedule` gives the step before
    it is timed.)

    Its plan (:meth:`Prediction.to_plan`) is one replica of one stage over every device, split
    by ``parts``, when the runtime splits the same way (every split layer has at least one
    channel per device, and the modes are those of such a stage).

    >>> filter_parallel(costs, cluster, 64, [1.0, 0.5]).step_s  # doctest: +SKIP
    """
    used = filter_modes(costs) if modes is None else _check_modes(costs, modes)
    pred = filter_parallel_schedule(
        costs,
        cluster,
        batch,
        parts,
        modes=used,
        optimizer_state_copies=optimizer_state_copies,
        strategy=strategy,
    ).prediction()
    try:
        pred.plan = _filter_parallel_plan(costs, batch, parts, used)
    except ValueError as e:
        pred.plan_note = str(e)
    return pred


# ---------------------------------------------------------------- plans: any shape


def _data_parallel_plan(costs: ModelCosts, shares: Sequence[int]) -> Plan:
    """One whole-model replica per device with samples."""
    costs.check_plan_layers()
    n = len(costs.plan_layers)
    replicas = [
        {"samples": int(b), "stages": [{"ranks": [d], "layers": [0, n]}]}
        for d, b in enumerate(shares)
        if b > 0
    ]
    if not replicas:
        raise ValueError("shares: no device has samples")
    return Plan.from_dict({"microbatches": 1, "schedule": "GPipe", "replicas": replicas})


def _filter_parallel_plan(
    costs: ModelCosts, batch: int, parts: Sequence[float], modes: Mapping[str, str]
) -> Plan:
    """One replica: one stage over every device, split by ``parts`` as the runtime would."""
    costs.check_plan_layers()
    n, p = len(costs.plan_layers), len(parts)
    stage: dict[str, Any] = {"ranks": list(range(p)), "layers": [0, n]}
    if p > 1:
        if dict(modes) != costs.stage_filter_modes(0, n):
            raise ValueError(
                "the runtime pairs this model's layers differently in a stage (give modes="
                "costs.stage_filter_modes(0, len(costs.plan_layers)))"
            )
        stage_split(costs, 0, n, p, None, "filter parallel")
        stage["speeds"] = [float(x) for x in parts]
    return Plan.from_dict({"microbatches": 1, "replicas": [{"samples": batch, "stages": [stage]}]})


def stage_split(
    costs: ModelCosts,
    first: int,
    end: int,
    ranks: int,
    shares: Mapping[int, Sequence[int]] | None,
    where: str = "stage",
) -> tuple[dict[str, str], dict[str, list[int]] | None]:
    """The modes and explicit shares (by layer name) of a stage over plan layers
    ``[first, end)`` split over ``ranks`` ranks, checked as :func:`hetcoll.torch.parallelize`
    checks them (``ValueError`` naming ``where``): something to split, no grouped
    convolution, at least one channel per rank; ``shares`` (plan layer index -> channels per
    rank) name Conv2d / Linear layers of the stage and sum to their channels.

    With explicit shares only the named layers are split; a pair of the full stage's modes
    stays paired when both are named, else its named layer gathers. (The runtime pairs the
    named layers by its rule; the two differ only when a named layer's neighbour in the full
    pairing is not named but another one could pair with it.)
    """
    modes = costs.stage_filter_modes(first, end)
    lo, hi = costs.plan_range(first, end)
    by_name = {x.name: x for x in costs.layers[lo:hi]}
    if not modes:
        raise ValueError(
            f"{where}: has {ranks} ranks but its layers hold no Conv2d or Linear to split"
        )
    for name in modes:
        if by_name[name].groups != 1:
            raise ValueError(
                f"{where}: layer {name!r} is a grouped convolution (groups="
                f"{by_name[name].groups}); filter parallelism splits groups=1 convolutions only"
            )
    if shares is None:
        for name, mode in modes.items():
            if mode != "split-input" and by_name[name].filters < ranks:
                raise ValueError(
                    f"{where}: layer {name!r} has {by_name[name].filters} channels, too few for "
                    f"{ranks} ranks with at least 1 each"
                )
        return modes, None
    named: dict[str, list[int]] = {}
    for index, per_rank in shares.items():
        kind = costs.plan_layer_kinds[index] if 0 <= index < len(costs.plan_layers) else ""
        if not first <= index < end or kind not in ("Conv2d", "Linear"):
            raise ValueError(
                f"{where}.shares: layer {index} is not a Conv2d or Linear layer of the stage"
            )
        name = costs.plan_layers[index]
        values = [int(v) for v in per_rank]
        if len(values) != ranks or min(values) < 1 or sum(values) != by_name[name].filters:
            raise ValueError(
                f"{where}.shares[{index!r}]: needs {ranks} shares >= 1 summing to layer "
                f"{name!r}'s {by_name[name].filters} channels, got {values}"
            )
        named[name] = values
    pairs = costs.stage_filter_pairs(first, end)
    source = {b: a for a, b in pairs.items()}
    out: dict[str, str] = {}
    for name in named:
        if name in pairs and pairs[name] in named:
            out[name] = "split-output"
        elif name in source and source[name] in named:
            if named[name] != named[source[name]]:
                raise ValueError(
                    f"{where}.shares: layer {name!r} reads the channels of {source[name]!r}, so "
                    f"its shares must be {named[source[name]]}, got {named[name]}"
                )
            out[name] = "split-input"
        else:
            out[name] = "gather"
    return out, {n: v for n, v in named.items() if out[n] != "split-input"}


@dataclass(frozen=True)
class _StageLayout:
    """A stage as the simulation needs it: devices, costed layers ``[lo, hi)``, the bytes per
    sample it sends the next stage, and how a filter-split stage splits."""

    ranks: tuple[int, ...]
    lo: int
    hi: int
    out_bytes_per_sample: float
    parts: tuple[float, ...] = ()
    modes: Mapping[str, str] | None = None
    layer_shares: Mapping[str, Sequence[int]] | None = None


@dataclass(frozen=True)
class _ReplicaLayout:
    samples: int
    micro: tuple[int, ...]
    stages: tuple[_StageLayout, ...]


def _plan_layout(costs: ModelCosts, cluster: Cluster, plan: Plan) -> list[_ReplicaLayout]:
    """The plan in costed layers, checked against the model and the cluster."""
    if not isinstance(plan, Plan):
        raise TypeError(f"plan: must be a hetcoll.Plan, got {type(plan).__name__}")
    costs.check_plan_layers()
    n_layers = len(costs.plan_layers)
    if plan.num_layers != n_layers:
        raise ValueError(
            f"plan: its stages cover {plan.num_layers} layers but the model has {n_layers} "
            f"({', '.join(costs.plan_layers)})"
        )
    missing = [r for r in plan.ranks if r >= cluster.num_devices]
    if missing:
        raise ValueError(
            f"plan: names rank {missing[0]} but the cluster has {cluster.num_devices} devices"
        )
    out = []
    # Stages alike but for their ranks are checked and laid out once (and so share their
    # modes: _ReplicaKeys knows them alike).
    built: dict[tuple[Any, ...], _StageLayout] = {}
    for i, replica in enumerate(plan.replicas):
        stages = []
        for j, stage in enumerate(replica.stages):
            where = f"plan.replicas[{i}].stages[{j}]"
            if stage.owners is not None:
                raise ValueError(
                    f"{where}: places channels by owners; predict_plan does not model such "
                    "stages yet (hetcoll.model.predict_placement predicts a one-stage one)"
                )
            last = j + 1 == len(replica.stages)
            shares = (
                None
                if stage.shares is None
                else tuple(sorted((k, tuple(v)) for k, v in stage.shares.items()))
            )
            key = (len(stage.ranks), tuple(stage.layers), last, stage.speeds, shares)
            if key not in built:
                built[key] = _stage_layout(
                    costs, stage.ranks, stage.layers, last, stage.speeds, stage.shares, where
                )
            b = built[key]
            stages.append(
                _StageLayout(
                    tuple(stage.ranks),
                    b.lo,
                    b.hi,
                    b.out_bytes_per_sample,
                    b.parts,
                    b.modes,
                    b.layer_shares,
                )
            )
        out.append(_ReplicaLayout(replica.samples, tuple(plan.microbatch_sizes(i)), tuple(stages)))
    return out


def _stage_layout(
    costs: ModelCosts,
    ranks: Sequence[int],
    layers: tuple[int, int],
    last: bool,
    speeds: Sequence[float] | None,
    shares: Mapping[int, Sequence[int]] | None,
    where: str,
) -> _StageLayout:
    """A stage over plan layers ``layers`` on ``ranks``, checked as the runtime checks it."""
    first, end = layers
    lo, hi = costs.plan_range(first, end)
    sent = 0.0 if last else costs.plan_out_bytes[end - 1]
    p = len(ranks)
    if p == 1:
        return _StageLayout(tuple(ranks), lo, hi, sent)
    modes, named = stage_split(costs, first, end, p, shares, where)
    parts = speeds if speeds is not None else (1.0,) * p
    return _StageLayout(tuple(ranks), lo, hi, sent, tuple(parts), modes, named)


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
    dev_kind = _device_arrays(cluster.devices).kind
    node_of = np.asarray(cluster.node_of_device)
    node_link = _node_link_ids(cluster)
    link_ids: dict[Link, int] = {}
    between: dict[tuple[int, ...], int] = {}

    def link_id(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        # The link between devices a and b (arrays) depends on whether they share a node and
        # on their nodes' links only: one link_between per distinct case.
        na, nb = node_of[a], node_of[b]
        cases = np.stack([na == nb, node_link[na], node_link[nb]], axis=1)
        unique, first, inverse = np.unique(cases, axis=0, return_index=True, return_inverse=True)
        ids = []
        for case, f in zip(unique.tolist(), first.tolist()):
            key = tuple(case)
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
            link = _ring_link_of(cluster, block[r], node_link)
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

    classes: list[tuple[_ReplicaLayout, np.ndarray]] = []
    for (samples, _), members in templates.items():
        i = members[0]
        stages = entries[i][1]
        sizes_of = [x.shape[1] for x in entries[i][2]]
        laid = []
        for j, (_, layers, speeds) in enumerate(stages):
            where = f"replicas[{i}].stages[{j}]"
            last = j + 1 == len(stages)
            first_ranks = tuple(entries[i][2][j][0].tolist())
            span = (int(layers[0]), int(layers[1]))
            laid.append(_stage_layout(costs, first_ranks, span, last, speeds, None, where))
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
        _, first, inverse = np.unique(
            np.hstack(signature), axis=0, return_index=True, return_inverse=True
        )
        inverse = inverse.reshape(-1)
        sizes = tuple(microbatch_sizes(samples, microbatches))
        for c, f in enumerate(first):
            rows = ranks_of[inverse == c]
            rep_ranks = ranks_of[f].tolist()
            rep_stages = []
            for j, st in enumerate(laid):
                picked = tuple(rep_ranks[starts[j] : starts[j] + len(st.ranks)])
                rep_stages.append(
                    _StageLayout(
                        picked,
                        st.lo,
                        st.hi,
                        st.out_bytes_per_sample,
                        st.parts,
                        st.modes,
                        st.layer_shares,
                    )
                )
            # The class's first row is the replica simulated for it.
            rows = np.vstack([ranks_of[f][None, :], rows[(rows != ranks_of[f]).any(axis=1)]])
            classes.append((_ReplicaLayout(samples, sizes, tuple(rep_stages)), rows))
    pred = _layout_schedule(
        costs,
        cluster,
        [rep for rep, _ in classes],
        schedule,
        optimizer_state_copies,
        strategy,
        classes,
    ).prediction()

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
                                **({"speeds": list(speeds)} if speeds is not None else {}),
                            }
                            for block, (_, layers, speeds) in zip(blocks, stages)
                        ],
                    }
                    for samples, stages, blocks in entries
                    for row in range(len(blocks[0]))
                ],
            }
        )

    pred.plan_factory = build
    return pred


@dataclass
class _StageWork:
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


def _stage_work(
    costs: ModelCosts,
    cluster: Cluster,
    stage: _StageLayout,
    batch: int,
    times: Any,
    state_copies: int,
) -> _StageWork:
    lo, hi = stage.lo, stage.hi
    if len(stage.ranks) == 1:
        d = stage.ranks[0]
        lt, column = times(batch)  # per kind of device, and each device's kind
        c = column[d]
        owned = float(sum(x.param_bytes for x in costs.layers[lo:hi]))
        mem_bw = cluster.devices[d].mem_bytes_per_s
        fwd_s, bwd_s = lt.forward_s[lo:hi, c], lt.backward_s[lo:hi, c]
        fwd_parts = tuple((lo + i, float(t), "F") for i, t in enumerate(fwd_s))
        bwd_parts = tuple((hi - 1 - i, float(t), "B") for i, t in enumerate(bwd_s[::-1]))
        return _StageWork(
            [[("compute", float(fwd_s.sum()), fwd_parts)]],
            [[("compute", float(bwd_s.sum()), bwd_parts)]],
            np.array(
                [
                    [lt.compute_s[lo:hi, c].sum()],
                    [lt.memory_s[lo:hi, c].sum()],
                    [lt.overhead_s[lo:hi, c].sum()],
                ]
            ),
            np.array([owned * (2 + state_copies)]),
            float(sum(x.saved_bytes_per_sample for x in costs.layers[lo:hi])),
            np.array([float(terms.optimizer_update_seconds(owned, mem_bw, state_copies))]),
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
    )
    sched = filter_parallel_schedule(
        sub,
        cluster.subset(stage.ranks),
        batch,
        stage.parts,
        modes=stage.modes,
        optimizer_state_copies=state_copies,
        layer_shares=stage.layer_shares,
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
    return _StageWork(
        fwd,
        bwd,
        np.stack([lt.compute_s.sum(axis=0), lt.memory_s.sum(axis=0), lt.overhead_s.sum(axis=0)]),
        sched.memory_bytes - batch * saved,
        saved,
        sched.update_s,
    )


class _ReplicaKeys:
    """What a replica's simulated step depends on (:meth:`key`): its samples and
    micro-batches, and per stage its layers and split, the kinds of device it runs on, the
    links its stage's collectives and its sends cross. Replicas with equal keys run alike
    (their ranks aside). Kinds and links are small integers, looked up once per device kind
    and per pair of nodes (hashing a Device or a Link per rank would cost more than the
    simulation it saves); a stage's split is named by the identity of its modes and shares,
    which stages built alike share (equal identity implies equal content)."""

    def __init__(self, cluster: Cluster, kind: np.ndarray) -> None:
        self.cluster = cluster
        self.nodes = cluster.node_of_device
        self.kind = kind.tolist()
        self.ids: dict[Link, int] = {}
        self.links: dict[tuple[int, int], int] = {}
        self.rings: dict[tuple[bool, frozenset[Link]], int] = {}

    def _id(self, link: Link) -> int:
        return self.ids.setdefault(link, len(self.ids))

    def link(self, a: int, b: int) -> int:
        pair = (self.nodes[a], self.nodes[b])
        if pair not in self.links:
            self.links[pair] = self._id(self.cluster.link_between(a, b))
        return self.links[pair]

    def ring(self, ranks: tuple[int, ...]) -> int:
        # A ring over these ranks crosses the network when they span nodes, and the link of
        # every node holding two of them or more (Cluster.subset(...).ring_link()).
        count: dict[int, int] = {}
        for d in ranks:
            count[self.nodes[d]] = count.get(self.nodes[d], 0) + 1
        nodes = self.cluster.nodes
        inside = frozenset(
            link for n, c in count.items() if c > 1 and (link := nodes[n].link) is not None
        )
        shape = (len(count) > 1, inside)
        if shape not in self.rings:
            self.rings[shape] = self._id(self.cluster.subset(list(ranks)).ring_link())
        return self.rings[shape]

    def key(self, rep: _ReplicaLayout) -> tuple[Any, ...]:
        key: list[Any] = [rep.samples, rep.micro]
        kind = self.kind
        for s, st in enumerate(rep.stages):
            nxt = rep.stages[s + 1].ranks if s + 1 < len(rep.stages) else ()
            prev = rep.stages[s - 1].ranks if s > 0 else ()
            lead = st.ranks[0]
            key.append(
                (
                    st.lo,
                    st.hi,
                    st.out_bytes_per_sample,
                    st.parts,
                    id(st.modes),
                    id(st.layer_shares),
                    tuple(kind[d] for d in st.ranks),
                    self.ring(st.ranks) if len(st.ranks) > 1 else None,
                    tuple(self.link(lead, e) for e in nxt),
                    tuple(self.link(lead, e) for e in prev),
                )
            )
        return tuple(key)


def _flat_ranks(rep: _ReplicaLayout) -> list[int]:
    return [d for st in rep.stages for d in st.ranks]


def _replica_classes(
    cluster: Cluster, replicas: Sequence[_ReplicaLayout], kind: np.ndarray
) -> list[tuple[_ReplicaLayout, np.ndarray]]:
    """The replicas grouped by :class:`_ReplicaKeys`: each group's first replica, and every
    member's ranks (a row each, the first replica's first, in its stages' order)."""
    keys = _ReplicaKeys(cluster, kind)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for r, rep in enumerate(replicas):
        groups.setdefault(keys.key(rep), []).append(r)
    return [
        (replicas[members[0]], np.array([_flat_ranks(replicas[r]) for r in members]))
        for members in groups.values()
    ]


def _ring_link_of(cluster: Cluster, ranks: np.ndarray, node_link: np.ndarray) -> Link:
    """``cluster.subset(ranks).ring_link()`` without building the subset: the ring crosses the
    link of each node holding two or more of ``ranks`` and the network when they span nodes,
    so a few nodes stand for all (``node_link``: an id per node, equal for equal links)."""
    nodes = np.asarray(cluster.node_of_device)[ranks] if len(ranks) else np.zeros(0, int)
    counts = np.bincount(nodes, minlength=len(cluster.nodes))
    present = np.flatnonzero(counts)
    shared = np.flatnonzero(counts >= 2)
    _, first = np.unique(node_link[shared], return_index=True)
    picked = [replace(cluster.nodes[n], count=2) for n in shared[first]]
    if len(present) > 1 and len(picked) < 2:
        others = [n for n in present[:3] if n not in set(shared[first].tolist())]
        picked += [replace(cluster.nodes[n], count=1) for n in others[: 2 - len(picked)]]
    if not picked:
        return Link("local", 0.0, math.inf)
    return Cluster(picked, cluster.network if len(picked) > 1 else None).ring_link()


_NODE_LINKS: dict[int, tuple[Sequence[Any], np.ndarray]] = {}


def _node_link_ids(cluster: Cluster) -> np.ndarray:
    """An id per node of ``cluster``, equal for nodes with equal links (cached per node list)."""
    hit = _NODE_LINKS.get(id(cluster.nodes))
    if hit is not None and hit[0] is cluster.nodes:
        return hit[1]
    by_id: dict[int, int] = {}
    ids: dict[Any, int] = {}
    out = np.array(
        [
            by_id[id(n.link)]
            if id(n.link) in by_id
            else by_id.setdefault(id(n.link), ids.setdefault(n.link, len(ids)))
            for n in cluster.nodes
        ]
    )
    if len(_NODE_LINKS) >= 16:
        _NODE_LINKS.pop(next(iter(_NODE_LINKS)))
    _NODE_LINKS[id(cluster.nodes)] = (cluster.nodes, out)
    return out


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
        reason = _memory_shortfall(mem, self.devices)
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
    layout = _plan_layout(costs, cluster, plan)
    return _layout_schedule(
        costs, cluster, layout, plan.schedule, optimizer_state_copies, strategy, group=False
    )


def _layout_schedule(
    costs: ModelCosts,
    cluster: Cluster,
    replicas: Sequence[_ReplicaLayout],
    schedule: str,
    state_copies: int,
    strategy: str,
    classes: Sequence[tuple[_ReplicaLayout, np.ndarray]] | None = None,
    *,
    group: bool = True,
) -> PlanSchedule:
    """Lay out one step of the plan (:func:`plan_schedule`).

    Replicas that run alike (:class:`_ReplicaKeys`; ``classes``: already grouped, as
    (replica, every member's ranks); ``group=False``: every replica its own class) are laid
    out once: the gradient sums and the loss's allreduce are timed over all their holders, but
    only one replica of each class has programs, and the others copy its figures. That is the
    same step (the copies would reach every collective at the same moment), at the cost of the
    distinct replicas only: a 10,240-device plan of a few kinds of replica simulates a few."""
    from hetcoll.torch.parallel import schedule_order

    devices = cluster.devices
    n_dev = len(devices)
    dev = _device_arrays(devices)
    cache: dict[int, LayerSeconds] = {}
    _, first_of_kind = np.unique(dev.kind, return_index=True)
    kinds = dev.columns(first_of_kind)

    def times(b: int) -> tuple[LayerSeconds, np.ndarray]:
        # Every layer's times at b samples on each kind of device (columns), and each
        # device's kind.
        if b not in cache:
            cache[b] = _layer_times(costs, kinds, np.full(len(first_of_kind), b))
        return cache[b], dev.kind

    if classes is None and not group:
        classes = [(rep, np.array([_flat_ranks(rep)])) for rep in replicas]
    elif classes is None:
        classes = _replica_classes(cluster, replicas, dev.kind)
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
            work = {
                b: _stage_work(costs, cluster, stage, b, times, state_copies)
                for b in sorted(set(rep.micro))
            }
            any_work = work[rep.micro[0]]
            order = schedule_order(schedule, s, n_st, m)
            # Activations kept at once: every micro-batch under GPipe; under 1F1B the forwards
            # a stage runs ahead of its first backward, plus one.
            ahead = m if schedule == "GPipe" else min(n_st - s, m)
            kept = sum(sorted(rep.micro, reverse=True)[:ahead])
            lead = stage.ranks[0]
            prev = rep.stages[s - 1] if s > 0 else None
            nxt = rep.stages[s + 1] if s + 1 < n_st else None
            for j, d in enumerate(stage.ranks):
                state[d] = any_work.state_bytes[j]
                update[d] = any_work.update_s[j]
                activations[d] = any_work.saved_per_sample * kept
                prog = programs[local[d]]
                for op, k in order:
                    w = work[rep.micro[k]]
                    if op == "F":
                        causes[:, d] += w.causes[:, j]  # forward and backward
                        if prev is not None:
                            prog.append(("recv", ("act", r, s, k, d)))
                        pieces = w.forward[j]
                    else:
                        if nxt is not None:
                            prog.append(("recv", ("grad", r, s, k, d)))
                        pieces = w.backward[j]
                    for piece in pieces:
                        if piece[0] == "compute":
                            if prog and prog[-1][0] == "compute":
                                last = prog[-1]
                                prog[-1] = ("compute", last[1] + piece[1], last[2] + piece[2])
                            else:
                                prog.append(piece)
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
        node_link = _node_link_ids(cluster)
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
            held = np.unique(np.concatenate(parts))
            nbytes = sum(costs.layers[i].param_bytes for i in range(a, b))
            if nbytes <= 0:
                continue
            holders = tuple(held.tolist())
            if holders in groups:
                groups[holders][0] += nbytes
            else:
                groups[holders] = [nbytes, held, taking_part, node_link]
    reduce_s = 0.0
    for g, (nbytes, held, taking_part, node_link) in enumerate(groups.values()):
        link = _ring_link_of(cluster, held, node_link)
        seconds = float(
            terms.ring_allreduce_seconds(
                nbytes,
                len(held),
                link.latency_s,
                link.bytes_per_s,
                float(dev.mem_bytes_per_s[held].min()),
                costs.itemsize,
            )
        )
        collectives[("sum", g)] = (len(taking_part), seconds)
        reduce_s += seconds
        for x in taking_part:
            programs[x].append(("collective", ("sum", g)))
        state[held] += nbytes  # the full-size buffer the gradients are summed in
    # The loss, summed over every rank of the group (one float64); idle ranks join it at once.
    link = cluster.ring_link()
    loss_s = float(
        terms.ring_allreduce_seconds(
            8.0, n_dev, link.latency_s, link.bytes_per_s, float(dev.mem_bytes_per_s.min()), 8
        )
    )
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
        },
        tuple(local),
        source,
    )


def predict_plan(
    costs: ModelCosts,
    cluster: Cluster,
    plan: Plan,
    *,
    optimizer_state_copies: int = 1,
    strategy: str = "plan",
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

    >>> predict_plan(costs, cluster, Plan.load("plan.json")).step_s  # doctest: +SKIP
    """
    # Replicas that run alike are simulated once (the same step: :func:`_layout_schedule`).
    layout = _plan_layout(costs, cluster, plan)
    pred = _layout_schedule(
        costs, cluster, layout, plan.schedule, optimizer_state_copies, strategy
    ).prediction()
    pred.plan = plan
    return pred


def _pipeline_units(costs: ModelCosts) -> list[int]:
    """Where a pipeline may cut, in costed layers: the start of every plan layer that holds a
    costed layer (a plan layer without one, such as a traced ``torch.flatten``, goes with the
    layer before it), or every layer when the model has no plan layers."""
    if not costs.plan_layers:
        return list(range(len(costs.layers) + 1))
    of = costs.plan_layer_of
    cuts = [0] + [i for i in range(1, len(of)) if of[i] != of[i - 1]]
    return [*cuts, len(of)]


def pipeline_stages(
    costs: ModelCosts, cluster: Cluster, batch: int, micro_batches: int
) -> list[int]:
    """Layers per device (costed layers, in device order) of the exact chain partition on
    the devices' speeds for this model (:func:`hetcoll.partition_chain`), at a micro-batch of
    ``ceil(batch / micro_batches)``, cutting only where a :class:`hetcoll.Plan` can (between
    top-level layers)."""
    n_dev = cluster.num_devices
    micro = math.ceil(batch / micro_batches)
    lt = _layer_times(costs, _device_arrays(cluster.devices), np.full(n_dev, micro))
    per_layer_dev = lt.forward_s + lt.backward_s
    cuts = _pipeline_units(costs)
    unit_flops = [
        sum(x.forward_flops(micro) + x.backward_flops(micro) for x in costs.layers[a:b])
        for a, b in itertools.pairwise(cuts)
    ]
    total_flops = max(sum(unit_flops), 1e-30)
    # Devices of one kind have equal columns: each kind's speed computed once.
    kind = _device_arrays(cluster.devices).kind
    _, first = np.unique(kind, return_index=True)
    of_kind = [total_flops / max(float(per_layer_dev[:, d].sum()), 1e-30) for d in first]
    speeds = [of_kind[k] for k in kind.tolist()]
    link = cluster.ring_link()
    bandwidth = link.bytes_per_s if math.isfinite(link.bytes_per_s) else None
    boundary = [2 * _boundary_bytes(costs, b) * micro for b in cuts[1:-1]]
    units = hetcoll.partition_chain(
        unit_flops, speeds, boundary_bytes=boundary if bandwidth else None, bandwidth=bandwidth
    )
    out, at = [], 0
    for u in units:
        out.append(cuts[at + u] - cuts[at])
        at += u
    return out


def chain_stages(
    costs: ModelCosts,
    stage_speeds: Sequence[float],
    micro: int,
    bandwidth: float | None = None,
) -> list[tuple[int, int]]:
    """Plan-layer ranges ``(first, end)`` of pipeline stages of the given speeds (FLOP/s, in
    stage order; a stage of several devices counts their sum), chosen by the exact dynamic
    programme over layer cuts (:func:`hetcoll.partition_chain`: the smallest bottleneck of a
    stage's FLOPs at a micro-batch of ``micro`` over its speed, plus the activations and their
    gradients it sends over ``bandwidth`` bytes/s; None: free links). A stage given no layer
    gets an empty range ``(x, x)``.

    >>> chain_stages(costs, [2e12, 1e12], 32)  # doctest: +SKIP
    [(0, 6), (6, 11)]
    """
    speeds = [float(x) for x in stage_speeds]
    if not speeds or any(not math.isfinite(x) or x <= 0 for x in speeds):
        raise ValueError(f"stage_speeds: must be finite numbers > 0, one per stage, got {speeds}")
    if isinstance(micro, bool) or not isinstance(micro, (int, np.integer)) or micro < 1:
        raise ValueError(f"micro: must be an integer >= 1, got {micro!r}")
    if bandwidth is not None and not (math.isfinite(bandwidth) and bandwidth > 0):
        raise ValueError(f"bandwidth: must be a finite number > 0 or None, got {bandwidth!r}")
    costs.check_plan_layers()
    cuts = _pipeline_units(costs)
    unit_flops = [
        sum(x.forward_flops(micro) + x.backward_flops(micro) for x in costs.layers[a:b])
        for a, b in itertools.pairwise(cuts)
    ]
    boundary = [2 * _boundary_bytes(costs, b) * micro for b in cuts[1:-1]]
    units = hetcoll.partition_chain(
        unit_flops,
        speeds,
        boundary_bytes=boundary if bandwidth else None,
        bandwidth=bandwidth if bandwidth else None,
    )
    of, n = costs.plan_layer_of, len(costs.plan_layers)

    def plan_layer(c: int) -> int:  # the plan layer costed layer c starts (n: the end)
        return 0 if c == 0 else (of[c] if c < len(of) else n)

    out, at = [], 0
    for u in units:
        first = plan_layer(cuts[at])
        end = n if at + u == len(cuts) - 1 else plan_layer(cuts[at + u])
        out.append((first, end) if u else (first, first))
        at += u
    return out


def _boundary_bytes(costs: ModelCosts, cut: int) -> float:
    """Bytes per sample a stage ending before costed layer ``cut`` sends: its plan layer's
    output when the cut is between plan layers, else the last costed layer's."""
    of = costs.plan_layer_of
    if of and 0 < cut < len(of) and of[cut - 1] != of[cut]:
        return costs.plan_out_bytes[of[cut] - 1]
    return costs.layers[cut - 1].out_bytes_per_sample


def pipeline(
    costs: ModelCosts,
    cluster: Cluster,
    batch: int,
    micro_batches: int,
    *,
    layers_per_device: Sequence[int] | None = None,
    optimizer_state_copies: int = 1,
    strategy: str = "pipeline",
    schedule: str = "GPipe",
) -> Prediction:
    """One pipeline step: ``batch`` in ``micro_batches`` near-equal micro-batches through
    contiguous one-device stages (``layers_per_device``, costed layers in device order;
    default :func:`pipeline_stages`), each stage handing its output forward and the gradient
    back to the next non-empty device, under ``schedule`` (GPipe or 1F1B). The step is
    :func:`predict_plan`'s simulation of that plan (devices without layers idle): for equal
    stages and micro-batches on free links, ``(m + S - 1)`` times a stage's forward and
    backward (:func:`terms.pipeline_seconds`). ``shares`` are layers per device.
    """
    devices = cluster.devices
    n_dev, n_layers = len(devices), len(costs.layers)
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches: must be an integer >= 1, got {micro_batches!r}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < micro_batches:
        raise ValueError(
            f"batch: must be an integer >= micro_batches ({micro_batches}), got {batch!r}"
        )
    if schedule not in ("GPipe", "1F1B"):
        raise ValueError(f"schedule: must be 'GPipe' or '1F1B', got {schedule!r}")
    if layers_per_device is None:
        layers_per_device = pipeline_stages(costs, cluster, batch, micro_batches)
    counts = _check_shares(layers_per_device, n_dev, "layers_per_device")
    if int(counts.sum()) != n_layers:
        raise ValueError(
            f"layers_per_device: must sum to {n_layers} layers, got {int(counts.sum())}"
        )
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    used = [d for d in range(n_dev) if counts[d] > 0]
    stages = tuple(
        _StageLayout(
            (d,),
            int(starts[d]),
            int(starts[d + 1]),
            _boundary_bytes(costs, int(starts[d + 1])) if k + 1 < len(used) else 0.0,
        )
        for k, d in enumerate(used)
    )
    q, rem = divmod(batch, micro_batches)
    micro = tuple([q + 1] * rem + [q] * (micro_batches - rem))
    pred = _layout_schedule(
        costs,
        cluster,
        [_ReplicaLayout(batch, micro, stages)],
        schedule,
        optimizer_state_copies,
        strategy,
    ).prediction()
    pred.shares = [int(x) for x in counts]
    pred.share_unit = "layers"
    try:
        pred.plan = _pipeline_plan(costs, stages, batch, micro_batches, schedule)
    except ValueError as e:
        pred.plan_note = str(e)
    return pred


def _pipeline_plan(
    costs: ModelCosts,
    stages: Sequence[_StageLayout],
    batch: int,
    micro_batches: int,
    schedule: str,
) -> Plan:
    costs.check_plan_layers()
    of, n = costs.plan_layer_of, len(costs.plan_layers)
    out = []
    for k, st in enumerate(stages):
        if k + 1 < len(stages) and of[st.hi - 1] == of[st.hi]:
            raise ValueError(
                f"layers_per_device: the stage of device {st.ranks[0]} ends inside top-level "
                f"layer {costs.plan_layers[of[st.hi]]!r}; a plan cuts between top-level layers"
            )
        first = 0 if k == 0 else of[st.lo]
        end = n if k + 1 == len(stages) else of[st.hi]
        out.append({"ranks": list(st.ranks), "layers": [first, end]})
    return Plan.from_dict(
        {
            "microbatches": micro_batches,
            "schedule": schedule,
            "replicas": [{"samples": batch, "stages": out}],
        }
    )
