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
  micro-batches, with the bubble.

Every prediction carries the breakdown of the step on its critical path (compute, memory stalls,
kernel overheads, exposed communication, optimizer, bubble - they add up to the step time), the
bytes each device holds, and whether that fits (infeasible plans are kept and marked, so the
planner can say why a strategy lost). Everything is vectorised over devices: a 1,024-device
cluster costs a few numpy calls per strategy.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import hetcoll
from hetcoll.model import terms
from hetcoll.model.costs import ModelCosts
from hetcoll.model.hardware import Cluster, Device

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

    @property
    def samples_per_s(self) -> float:
        return self.batch / self.step_s if self.step_s > 0 and math.isfinite(self.step_s) else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "shares": self.shares,
            "share_unit": self.share_unit,
            "step_s": self.step_s,
            "samples_per_s": self.samples_per_s,
            "breakdown_s": self.breakdown,
            "memory_bytes": self.memory_bytes,
            "feasible": self.feasible,
            "reason": self.reason,
            "batch": self.batch,
            **({"detail": self.detail} if self.detail else {}),
        }


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
    conv: np.ndarray  # True for convolution GEMMs (arithmetic at the convolution FLOP rate)
    channels_out: np.ndarray  # convolutions: output and input channels of one group
    channels_in: np.ndarray
    num_layers: int
    onehot: np.ndarray  # (layers, kernels): 1 where the kernel belongs to the layer


@functools.lru_cache(maxsize=16)
def _kernel_table(costs: ModelCosts) -> _KernelTable:
    rows: list[tuple[int, bool, float, float, float, float, float, bool, bool, bool, int, int]] = []
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
                        k.conv,
                        *k.channels,
                    )
                )
    cols = list(zip(*rows)) if rows else [()] * 12
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
        conv=np.asarray(cols[9], dtype=bool),
        channels_out=np.asarray(cols[10], dtype=np.float64),
        channels_in=np.asarray(cols[11], dtype=np.float64),
        num_layers=len(costs.layers),
        onehot=onehot,
    )


@dataclass(frozen=True)
class _DeviceArrays:
    flops_per_s: np.ndarray
    conv_flops_per_s: np.ndarray
    mem_bytes_per_s: np.ndarray
    elementwise_bytes_per_s: np.ndarray
    overhead_s: np.ndarray
    memory_bytes: np.ndarray
    conv_channel_block: np.ndarray


def _device_arrays(devices: Sequence[Device]) -> _DeviceArrays:
    return _DeviceArrays(
        np.array([d.flops_per_s for d in devices]),
        np.array([d.conv_rate for d in devices]),
        np.array([d.mem_bytes_per_s for d in devices]),
        np.array([d.elementwise_rate for d in devices]),
        np.array([d.kernel_overhead_s for d in devices]),
        np.array([d.memory_bytes for d in devices]),
        np.array([float(d.conv_channel_block) for d in devices]),
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
        t.gemm[:, None], dev.mem_bytes_per_s[None, :], dev.elementwise_bytes_per_s[None, :]
    )
    rate = np.where(t.conv[:, None], dev.conv_flops_per_s[None, :], dev.flops_per_s[None, :])
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
    for d, need in enumerate(mem):
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

    >>> from hetcoll.model import layer_costs, networks, hardware  # doctest: +SKIP
    >>> data_parallel(costs, cluster, [48, 16]).step_s  # doctest: +SKIP
    """
    return data_parallel_schedule(
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
            self.detail,
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

    >>> filter_parallel(costs, cluster, 64, [1.0, 0.5]).step_s  # doctest: +SKIP
    """
    return filter_parallel_schedule(
        costs,
        cluster,
        batch,
        parts,
        modes=modes,
        optimizer_state_copies=optimizer_state_copies,
        strategy=strategy,
    ).prediction()


def pipeline(
    costs: ModelCosts,
    cluster: Cluster,
    batch: int,
    micro_batches: int,
    *,
    layers_per_device: Sequence[int] | None = None,
    optimizer_state_copies: int = 1,
    strategy: str = "pipeline",
) -> Prediction:
    """One GPipe step: ``batch`` in ``micro_batches`` micro-batches through contiguous stages
    (``layers_per_device``, default: the exact chain partition on the devices' speeds for this
    model); each stage hands its output forward and the gradient back over the link to the next
    non-empty device. Step = (m + S - 1) x slowest stage + optimizer; the bubble is the S - 1.
    """
    devices = cluster.devices
    n_dev, n_layers = len(devices), len(costs.layers)
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches: must be an integer >= 1, got {micro_batches!r}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < micro_batches:
        raise ValueError(
            f"batch: must be an integer >= micro_batches ({micro_batches}), got {batch!r}"
        )
    micro = math.ceil(batch / micro_batches)
    dev = _device_arrays(devices)
    lt = _layer_times(costs, dev, np.full(n_dev, micro))
    per_layer_dev = lt.forward_s + lt.backward_s  # (layers, devices), one micro-batch
    if layers_per_device is None:
        layer_flops = [x.forward_flops(micro) + x.backward_flops(micro) for x in costs.layers]
        total_flops = max(sum(layer_flops), 1e-30)
        speeds = [total_flops / max(float(per_layer_dev[:, d].sum()), 1e-30) for d in range(n_dev)]
        link = cluster.ring_link()
        bandwidth = link.bytes_per_s if math.isfinite(link.bytes_per_s) else None
        boundary = [2 * x.out_bytes_per_sample * micro for x in costs.layers[:-1]]
        layers_per_device = hetcoll.partition_chain(
            layer_flops,
            speeds,
            boundary_bytes=boundary if bandwidth else None,
            bandwidth=bandwidth,
        )
    counts = _check_shares(layers_per_device, n_dev, "layers_per_device")
    if int(counts.sum()) != n_layers:
        raise ValueError(
            f"layers_per_device: must sum to {n_layers} layers, got {int(counts.sum())}"
        )
    starts = np.concatenate([[0], np.cumsum(counts)])
    stages = [d for d in range(n_dev) if counts[d] > 0]
    stage_s, hand_s = {}, {}
    for k, d in enumerate(stages):
        lo, hi = int(starts[d]), int(starts[d + 1])
        stage_s[d] = float(per_layer_dev[lo:hi, d].sum())
        hand_s[d] = 0.0
        if k + 1 < len(stages):
            link_k = cluster.link_between(d, stages[k + 1])
            # activation forward, its gradient backward
            hand_s[d] = 2 * float(
                terms.point_to_point_seconds(
                    costs.layers[hi - 1].out_bytes_per_sample * micro,
                    link_k.latency_s,
                    link_k.bytes_per_s,
                )
            )
    slowest = max(stages, key=lambda d: stage_s[d] + hand_s[d])
    slow_s = stage_s[slowest] + hand_s[slowest]
    n_st = len(stages)
    param_bytes = np.zeros(n_dev)
    saved = np.zeros(n_dev)
    for d in stages:
        lo, hi = int(starts[d]), int(starts[d + 1])
        param_bytes[d] = sum(x.param_bytes for x in costs.layers[lo:hi])
        saved[d] = sum(x.saved_bytes_per_sample for x in costs.layers[lo:hi])
    opt = np.asarray(
        terms.optimizer_update_seconds(param_bytes, dev.mem_bytes_per_s, optimizer_state_copies)
    )
    step = float(terms.pipeline_seconds(slow_s, n_st, micro_batches)) + float(opt.max())
    lo, hi = int(starts[slowest]), int(starts[slowest + 1])
    m = micro_batches
    breakdown = {
        "compute": m * float(lt.compute_s[lo:hi, slowest].sum()),
        "memory": m * float(lt.memory_s[lo:hi, slowest].sum()),
        "overhead": m * float(lt.overhead_s[lo:hi, slowest].sum()),
        "communication": m * hand_s[slowest],
        "bubble": float(terms.pipeline_bubble_seconds(slow_s, n_st)),
        "optimizer": float(opt.max()),
    }
    # GPipe keeps every micro-batch's activations until its backward.
    mem = param_bytes * (2 + optimizer_state_copies) + saved * micro * micro_batches
    reason = _memory_shortfall(mem, devices)
    return Prediction(
        strategy,
        [int(x) for x in counts],
        "layers",
        step,
        breakdown,
        [float(x) for x in mem],
        not reason,
        reason,
        batch,
        {"micro_batches": micro_batches, "stages": n_st},
    )
