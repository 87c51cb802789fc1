"""Timing every layer on every device: the kernel table, the devices as arrays (one column per kind
of device), roofline times per layer (:class:`LayerSeconds`), and the memory checks every
predictor shares."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hetcoll.model import terms
from hetcoll.model.costs import ModelCosts
from hetcoll.model.hardware import FRESH_PAGES_BYTES, PRECISIONS, Cluster, Device


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
    launches: np.ndarray  # kernel launches each row stands for (Kernel.launches)
    flops_fixed: np.ndarray  # FLOPs once a step on a device with samples (Kernel.flops_fixed)
    num_layers: int
    onehot: np.ndarray  # (layers, kernels): 1 where the kernel belongs to the layer
    # The tensors the layers' ops allocate (LayerCost.allocations), one row each.
    alloc_forward: np.ndarray
    alloc_ps: np.ndarray
    alloc_fixed: np.ndarray
    alloc_count: np.ndarray
    alloc_layer: np.ndarray


#: The tables of the last few costs, by identity (hashing a ModelCosts hashes every layer:
#: the lru_cache below pays that on every call, the planner makes hundreds).
_TABLES: dict[int, tuple[ModelCosts, _KernelTable]] = {}


def _kernel_table(costs: ModelCosts) -> _KernelTable:
    hit = _TABLES.get(id(costs))
    if hit is not None and hit[0] is costs:
        return hit[1]
    table = _costs_kernel_table(costs)
    if len(_TABLES) >= 16:
        _TABLES.pop(next(iter(_TABLES)))
    _TABLES[id(costs)] = (costs, table)
    return table


@functools.lru_cache(maxsize=128)
def _costs_kernel_table(costs: ModelCosts) -> _KernelTable:
    rows: list[
        tuple[
            int,
            bool,
            float,
            float,
            float,
            float,
            float,
            bool,
            bool,
            bool,
            bool,
            int,
            int,
            int,
            float,
        ]
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
                        k.launches,
                        k.flops_fixed,
                    )
                )
    cols = list(zip(*rows)) if rows else [()] * 15
    onehot = np.zeros((len(costs.layers), len(rows)))
    onehot[np.asarray(cols[0], dtype=np.int64), np.arange(len(rows))] = 1.0
    allocs = [
        (i, d == 0, ps, fixed, n)
        for i, layer in enumerate(costs.layers)
        for d, made in enumerate(layer.allocations)
        for ps, fixed, n in made
    ]
    acols = list(zip(*allocs)) if allocs else [()] * 5
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
        launches=np.asarray(cols[13], dtype=np.float64),
        flops_fixed=np.asarray(cols[14], dtype=np.float64),
        num_layers=len(costs.layers),
        onehot=onehot,
        alloc_forward=np.asarray(acols[1], dtype=bool),
        alloc_ps=np.asarray(acols[2], dtype=np.float64),
        alloc_fixed=np.asarray(acols[3], dtype=np.float64),
        alloc_count=np.asarray(acols[4], dtype=np.float64),
        alloc_layer=np.asarray(acols[0], dtype=np.int64),
    )


@dataclass(frozen=True)
class _DeviceArrays:
    flops_per_s: np.ndarray
    conv_flops_per_s: np.ndarray
    mem_bytes_per_s: np.ndarray
    elementwise_bytes_per_s: np.ndarray
    pool_bytes_per_s: np.ndarray
    overhead_s: np.ndarray
    conv_overhead_s: np.ndarray
    memory_bytes: np.ndarray
    conv_channel_block: np.ndarray
    # Per precision: each device's matmul speed-up over fp32, and the devices without a peak.
    speedup: dict[str, np.ndarray]
    missing_peak: dict[str, tuple[str, ...]]
    #: Each device's kind: the index of its Device among the distinct ones (equal devices time
    #: alike, so a cluster of 10,240 devices in two kinds is timed as two columns).
    kind: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    #: Bytes/s of a fresh large tensor's first write (Device.first_touch_bytes_per_s; 0: none).
    first_touch_bytes_per_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    #: Fixed host seconds of each training step (Device.step_overhead_s; 0: none).
    step_overhead_s: np.ndarray = field(default_factory=lambda: np.zeros(0))

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
            self.conv_overhead_s[index],
            self.memory_bytes[index],
            self.conv_channel_block[index],
            {p: v[index] for p, v in self.speedup.items()},
            self.missing_peak,
            self.kind[index],
            self.first_touch_bytes_per_s[index],
        )


#: The arrays of the last few device lists used (a cluster's ``devices`` is one tuple for its
#: life; the planner asks for the same one hundreds of times), least recently used first out.
_ARRAYS: dict[int, tuple[Sequence[Device], _DeviceArrays]] = {}
#: Those of short device lists, by the identity of each device: the planner costs many
#: filter-split stages of a few devices, each a new subset of the cluster holding the same
#: device objects (kept here, so that their identities stay theirs).
_SHORT: dict[tuple[int, ...], tuple[tuple[Device, ...], _DeviceArrays]] = {}


def device_arrays(devices: Sequence[Device]) -> _DeviceArrays:
    if isinstance(devices, tuple) and len(devices) <= 64:
        key = tuple(map(id, devices))
        short = _SHORT.get(key)
        if short is None:
            if len(_SHORT) >= 256:
                _SHORT.pop(next(iter(_SHORT)))
            short = _SHORT[key] = (devices, _new_device_arrays(devices))
        return short[1]
    hit = _ARRAYS.get(id(devices))
    if hit is not None and hit[0] is devices:
        _ARRAYS[id(devices)] = _ARRAYS.pop(id(devices))  # now the most recently used
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
        per_device([d.conv_call_s for d in unique]),
        per_device([d.memory_bytes for d in unique]),
        per_device([float(d.conv_channel_block) for d in unique]),
        {p: per_device([d.matmul_speedup(p) for d in unique]) for p in PRECISIONS},
        {
            p: tuple(sorted({d.name for d in unique if d.peak_flops_per_s(p) <= 0}))
            for p in PRECISIONS
        },
        kind,
        per_device([d.first_touch_bytes_per_s for d in unique]),
        per_device([d.step_overhead_s for d in unique]),
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

    def __add__(self, other: LayerSeconds) -> LayerSeconds:
        """Both steps' times, layer by layer and device by device (a step of several passes:
        micro-batches)."""
        return LayerSeconds(
            self.forward_s + other.forward_s,
            self.backward_s + other.backward_s,
            self.compute_s + other.compute_s,
            self.memory_s + other.memory_s,
            self.overhead_s + other.overhead_s,
        )

    def breakdown(self, device: int, optimizer_s: float, step_s: float) -> dict[str, float]:
        """Device ``device``'s step by cause: its layers' compute, memory stalls and kernel
        overheads, its optimizer step, and the rest of ``step_s`` as exposed communication
        (waits included)."""
        out = {
            "compute": float(self.compute_s[:, device].sum()),
            "memory": float(self.memory_s[:, device].sum()),
            "overhead": float(self.overhead_s[:, device].sum()),
            "communication": 0.0,
            "optimizer": float(optimizer_s),
        }
        out["communication"] = max(0.0, step_s - sum(out.values()))
        return out

    def columns(self, index: np.ndarray) -> LayerSeconds:
        """The devices ``index`` (an integer array) of these, in that order: the times of
        devices timed once per kind, spread back to every device."""
        return LayerSeconds(
            self.forward_s[:, index],
            self.backward_s[:, index],
            self.compute_s[:, index],
            self.memory_s[:, index],
            self.overhead_s[:, index],
        )


def _layer_times(
    costs: ModelCosts,
    dev: _DeviceArrays,
    batch: np.ndarray,
    filter_fraction: np.ndarray | None = None,
    channel_fraction: np.ndarray | None = None,
    split_input: np.ndarray | None = None,
    fixed_fraction: np.ndarray | None = None,
) -> LayerSeconds:
    """Roofline time of every layer on every device for per-device batches ``batch`` (and, for
    filter parallelism, per-layer-and-device filter fractions ``filter_fraction``, fractions
    ``channel_fraction`` of the channels a layer's per-sample work covers, the layers
    ``split_input`` whose fraction is of their input channels, and fractions
    ``fixed_fraction`` of a layer's work whatever the batch and its filters: a DoRA layer's
    on its weight)."""
    # Devices of one kind with the same work time alike: time each distinct column once.
    batch = np.asarray(batch)
    fractions = (filter_fraction, channel_fraction, fixed_fraction)
    if len(batch) > 8 and len(dev.kind) == len(batch) and all(f is None for f in fractions):
        # The common case, one number per column: kind and batch as one integer.
        code = dev.kind * (int(batch.max()) + 1) + batch.astype(np.int64)
        _, first, inverse = np.unique(code, return_index=True, return_inverse=True)
        if len(first) < len(batch):
            lt = _layer_times(costs, dev.columns(first), batch[first], None, None, split_input)
            return lt.columns(inverse.reshape(-1))
    elif len(batch) > 8 and len(dev.kind) == len(batch):
        rows = [dev.kind, batch]
        for f in fractions:
            if f is not None:
                rows += list(f)
        _, first, inverse = np.unique(
            np.stack([np.asarray(r, dtype=np.float64) for r in rows]),
            axis=1,
            return_index=True,
            return_inverse=True,
        )
        if len(first) < len(batch):
            lt = _layer_times(
                costs,
                dev.columns(first),
                batch[first],
                None if filter_fraction is None else filter_fraction[:, first],
                None if channel_fraction is None else channel_fraction[:, first],
                split_input,
                None if fixed_fraction is None else fixed_fraction[:, first],
            )
            return lt.columns(inverse.reshape(-1))
    t = _kernel_table(costs)
    n_dev = len(batch)
    b = batch[None, :].astype(np.float64)
    if channel_fraction is not None:
        b = b * channel_fraction[t.layer, :]
    phi = np.ones((len(t.layer), n_dev)) if filter_fraction is None else filter_fraction[t.layer, :]
    fixed = np.ones((len(t.layer), n_dev)) if fixed_fraction is None else fixed_fraction[t.layer, :]
    scales = t.scales[:, None]
    flops = (
        t.flops_ps[:, None] * b + t.flops_fixed[:, None] * (b > 0) * np.where(scales, 1.0, fixed)
    ) * np.where(scales, phi, 1.0)
    moved = (t.bytes_ps[:, None] + phi * t.fbytes_ps[:, None]) * b + (
        fixed * t.bytes_fixed[:, None] + phi * t.fbytes_fixed[:, None]
    )
    # A kernel runs on a device only if the device has work for it (samples and, for split
    # kernels, filters; for a share of work whatever the batch, some of it).
    runs = (b > 0) & np.where(scales, phi > 0, True) & (fixed > 0)
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
    # Every launch has a fixed cost; convolution kernels one of their own (set-up, weight
    # reorders).
    ovh = np.where(
        runs,
        np.where(t.conv[:, None], dev.conv_overhead_s[None, :], dev.overhead_s[None, :])
        * t.launches[:, None],
        0.0,
    )
    total = terms.roofline_seconds(work, moved, rate, bandwidth)
    total = np.where(runs, total + ovh, 0.0)

    def per_layer(x: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        rows = x if mask is None else x * mask[:, None]
        return t.onehot @ rows  # type: ignore[no-any-return]

    touch_f, touch_b = _first_touch_seconds(t, dev, batch, filter_fraction, channel_fraction)
    return LayerSeconds(
        per_layer(total, t.forward) + touch_f,
        per_layer(total, ~t.forward) + touch_b,
        per_layer(comp),
        per_layer(np.maximum(mem - comp, 0.0)) + touch_f + touch_b,
        per_layer(ovh),
    )


def _first_touch_seconds(
    t: _KernelTable,
    dev: _DeviceArrays,
    batch: np.ndarray,
    filter_fraction: np.ndarray | None,
    channel_fraction: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Per layer and device, (forward, backward) seconds of first writes to the fresh pages of
    the tensors its ops allocate above :data:`FRESH_PAGES_BYTES`, on devices that pay them
    (``first_touch_bytes_per_s`` > 0: CPUs). A split layer's tensors are its share's."""
    zero = np.zeros((t.num_layers, len(batch)))
    rate = dev.first_touch_bytes_per_s
    if not t.alloc_ps.size or not (rate > 0).any():
        return zero, zero
    b = np.broadcast_to(batch[None, :].astype(np.float64), (len(t.alloc_ps), len(batch)))
    if channel_fraction is not None:
        b = b * channel_fraction[t.alloc_layer, :]
    if filter_fraction is not None:
        b = b * filter_fraction[t.alloc_layer, :]
    size = t.alloc_ps[:, None] * b + t.alloc_fixed[:, None]
    pays = (size > FRESH_PAGES_BYTES) & (rate[None, :] > 0) & (batch[None, :] > 0)
    seconds = np.where(pays, t.alloc_count[:, None] * size / np.where(rate > 0, rate, 1.0), 0.0)
    forward, backward = zero.copy(), zero.copy()
    np.add.at(forward, t.alloc_layer, seconds * t.alloc_forward[:, None])
    np.add.at(backward, t.alloc_layer, seconds * ~t.alloc_forward[:, None])
    return forward, backward


def _check_shares(shares: Sequence[int], num_devices: int, argument: str = "shares") -> np.ndarray:
    if isinstance(shares, (str, bytes)) or not isinstance(shares, (Sequence, np.ndarray)):
        raise ValueError(f"{argument}: expected a sequence of integers >= 0, got {shares!r}")
    if len(shares) != num_devices:
        raise ValueError(
            f"{argument}: expected {num_devices} values (one per device), got {len(shares)}"
        )
    huge = False
    for s in shares:  # 2**70 once overflowed int64
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0:
            raise ValueError(f"{argument}: expected integers >= 0, got {s!r}")
        huge = huge or s > terms.MAX_SAMPLES
    # Each share fits int64 unless huge: the total is the array's, not a second pass in Python
    # over up to 65,536 devices for every candidate the planner prices (summed in int64, exact,
    # where float64's sum shows it cannot wrap).
    out = None if huge else np.asarray(shares, dtype=np.int64)
    if out is None or out.sum(dtype=np.float64) > 2.0**62 or int(out.sum()) > terms.MAX_SAMPLES:
        raise ValueError(f"{argument}: expected a total of at most 2**53, got {sum(shares)}")
    return out


def check_costs_and_cluster(costs: object, cluster: object) -> None:
    """``TypeError`` naming ``costs`` or ``cluster`` when either is of another type: the
    predictors' first two arguments (None once raised AttributeError deep inside)."""
    if not isinstance(costs, ModelCosts):
        raise TypeError(
            f"costs: must be a hetcoll.model.ModelCosts (from layer_costs), got "
            f"{type(costs).__name__}"
        )
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster: must be a hetcoll.model.Cluster, got {type(cluster).__name__}")


def _memory_common(costs: ModelCosts, state_copies: int) -> float:
    return float(terms.training_state_bytes(costs.param_bytes, costs.gradient_bytes, state_copies))


def memory_shortfall(mem: np.ndarray, devices: Sequence[Any]) -> str:
    """Why a plan does not fit ('' when it does): the first device whose memory ``mem[d]``
    (bytes) exceeds its capacity."""
    capacity = device_arrays(devices).memory_bytes if len(devices) > 64 else None
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


def compute_seconds(costs: ModelCosts, device: Device, batch: int) -> float:
    """Forward + backward seconds of the whole model on one device at ``batch`` samples."""
    dev = device_arrays((device,))
    lt = _layer_times(costs, dev, np.array([batch]))
    return float(lt.forward_s.sum() + lt.backward_s.sum())


def linear_fit(costs: ModelCosts, dev: _DeviceArrays, b_ref: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-device t(b) ~ a + c b through the predicted compute times at b_ref and 2 b_ref."""
    n = len(dev.flops_per_s)
    t1 = _layer_times(costs, dev, np.full(n, b_ref))
    t2 = _layer_times(costs, dev, np.full(n, 2 * b_ref))
    y1 = t1.forward_s.sum(0) + t1.backward_s.sum(0)
    y2 = t2.forward_s.sum(0) + t2.backward_s.sum(0)
    c = np.maximum((y2 - y1) / b_ref, 1e-30)
    a = np.maximum(y1 - c * b_ref, 0.0)
    return a, c
