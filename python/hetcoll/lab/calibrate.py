"""Measure this machine for the performance model: GEMM FLOP/s, memory bandwidth and per-kernel
overhead of a rank (one thread) while the node's other ranks measure too, and the latency and
bandwidth of the link between two local ranks through gloo (:func:`hetcoll.launch.spawn`) and
MPI (:func:`hetcoll.launch.mpiexec`).

The result is a cluster file (one node of as many one-thread ranks as there are cores) that
``hetcoll plan`` and ``hetcoll model validate`` read like any hand-written one.

Run as ``python -m hetcoll.lab.calibrate`` under ``mpiexec -n 2`` it does the MPI ping-pong
and times small collectives, and prints the times as JSON (that is how
:func:`measure_mpi_link` runs it).
"""

from __future__ import annotations

import functools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from hetcoll.model.hardware import Cluster, Device, Link, Node, dumps_cluster

PING_PONG_BYTES = (8, 1024, 64 * 1024, 1024 * 1024, 8 * 1024 * 1024, 32 * 1024 * 1024)


# How repeated timings are summarised: "best" (the machine's capability, what `calibrate` writes)
# or "median" (the machine as loaded right now, what the validation predicts with, since its
# ranks share the cores with each other and with whatever else runs).
_STATISTIC: dict[str, Callable[[list[float]], float]] = {"best": min, "median": statistics.median}
_statistic = "best"


def set_statistic(name: str) -> None:
    """Summarise repeated timings by ``"best"`` (default) or ``"median"``."""
    global _statistic
    if name not in _STATISTIC:
        raise ValueError(f"name: expected 'best' or 'median', got {name!r}")
    _statistic = name


def _best_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """``repeats`` timed calls summarised by the current statistic (see :func:`set_statistic`)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(_STATISTIC[_statistic](times))


def measure_gemm_flops_per_s(size: int = 384, repeats: int = 7) -> float:
    """float32 FLOP/s of a ``size`` x ``size`` torch matmul on this thread: 2 n^3 / best time.

    >>> measure_gemm_flops_per_s() > 1e8  # doctest: +SKIP
    True
    """
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    out = torch.empty(size, size)
    t = _best_seconds(lambda: torch.mm(a, b, out=out), repeats, warmup=2)
    return 2.0 * size**3 / t


#: The convolution probe's batch and map size (:func:`measure_conv_flops_per_s`).
CONV_PROBE_BATCH, CONV_PROBE_SIZE = 16, 16


def measure_conv_flops_per_s(
    batch: int = CONV_PROBE_BATCH, repeats: int = 5, overhead_s: float = 0.0
) -> float:
    """float32 FLOP/s convolutions reach on this thread: forward + weight gradient of a 3x3,
    64 -> 64 channel convolution on [batch, 64, 16, 16] (an input without gradient, as the
    cost model counts a first layer), the FLOPs counted by the cost model itself (so the rate
    and the accounting agree). ``overhead_s``: each kernel's fixed seconds
    (:func:`measure_conv_overhead_s`), taken off the time first, so that the model's rate plus
    its overheads add back up to what was measured.

    >>> measure_conv_flops_per_s() > 1e8  # doctest: +SKIP
    True
    """
    t = _best_seconds(_conv_step(batch, CONV_PROBE_SIZE), repeats, warmup=1)
    flops, kernels = conv_probe_counts(batch, CONV_PROBE_SIZE)
    # (A noisy intercept never takes more than half of the time.)
    return flops / max(t - kernels * overhead_s, 0.5 * t)


def measure_conv_overhead_s(repeats: int = 5) -> float:
    """Fixed seconds of one convolution kernel call on this thread (oneDNN's set-up and
    weight reorders: :attr:`hetcoll.model.Device.conv_overhead_s`): the same convolution as
    :func:`measure_conv_flops_per_s` on 8x8 maps, timed at 1, 2 and 4 samples; the intercept
    of the straight line through the three times, per kernel the cost model counts.

    >>> measure_conv_overhead_s() >= 0  # doctest: +SKIP
    True
    """
    batches = (1, 2, 4)
    times = [_best_seconds(_conv_step(b, 8), repeats, warmup=1) for b in batches]
    _, intercept = np.polyfit(batches, times, 1)
    return max(float(intercept), 0.0) / conv_probe_counts(1, 8)[1]


def _conv_step(batch: int, size: int) -> Callable[[], None]:
    import torch
    from torch import nn

    conv = nn.Conv2d(64, 64, 3, padding=1, bias=False)
    x = torch.randn(batch, 64, size, size)
    grad = torch.ones(batch, 64, size, size)

    def step() -> None:
        conv.zero_grad(set_to_none=True)
        conv(x).backward(grad)

    return step


@functools.lru_cache(maxsize=8)
def conv_probe_counts(
    batch: int = CONV_PROBE_BATCH, size: int = CONV_PROBE_SIZE
) -> tuple[float, int]:
    """FLOPs and kernels the cost model counts for the convolution probe on ``batch`` samples
    of ``size`` x ``size`` maps (by default :func:`measure_conv_flops_per_s`'s: with the rate
    and the overhead it measured, the probe's time)."""
    from torch import nn

    from hetcoll.model.costs import layer_costs

    costs = layer_costs(nn.Conv2d(64, 64, 3, padding=1, bias=False), (64, size, size))
    kernels = [k for layer in costs.layers for k in (*layer.forward, *layer.backward)]
    return float(sum(k.flops(batch) for k in kernels)), sum(k.launches for k in kernels)


#: oneDNN's channel block per vector instruction set torch dispatches to (its blocked layouts
#: nChw16c on AVX-512, nChw8c on AVX2): a 64 -> 21 channel convolution computes 32 channels.
CHANNEL_BLOCKS = {"AVX512": 16, "AVX2": 8}


def conv_channel_block() -> int:
    """The channel block of this machine's convolution kernels: by the vector instruction set
    torch uses on this CPU (:data:`CHANNEL_BLOCKS`; 1 without oneDNN or on another one).
    Timing probes of ragged channel counts on this shared host were too noisy to tell the
    block apart (64 output channels took 1.3-2.7x the time of 48 between runs).

    >>> conv_channel_block() in (1, 8, 16)
    True
    """
    import torch

    if not torch.backends.mkldnn.is_available():
        return 1
    return CHANNEL_BLOCKS.get(torch.backends.cpu.get_cpu_capability(), 1)


def measure_mem_bytes_per_s(nbytes: int = 64 * 1024 * 1024, repeats: int = 5) -> float:
    """Memory bandwidth in bytes/s: a float32 tensor copy reads and writes ``nbytes`` each."""
    import torch

    n = nbytes // 4
    src, dst = torch.ones(n), torch.empty(n)
    t = _best_seconds(lambda: dst.copy_(src), repeats, warmup=1)
    return 2.0 * nbytes / t


def measure_first_touch_bytes_per_s(nbytes: int = 64 * 1024 * 1024, repeats: int = 5) -> float:
    """Bytes/s of the first write to a fresh tensor of ``nbytes`` (above
    :data:`~hetcoll.model.hardware.FRESH_PAGES_BYTES`: new pages at every allocation on a CPU):
    filling a new tensor, less filling one already written; 0.0 where it costs nothing
    measurable (the memory is reused)."""
    import torch

    n = nbytes // 4
    dst = torch.empty(n)
    dst.fill_(0.0)
    fresh = _best_seconds(lambda: torch.full((n,), 1.0), repeats, warmup=1)
    reused = _best_seconds(lambda: dst.fill_(1.0), repeats, warmup=1)
    extra = fresh - reused
    return nbytes / extra if extra > 0.1 * reused else 0.0


def tiny_chain(depth: int) -> Any:
    """``depth`` linear + ReLU layers of 4 features: a model whose training step is next to
    all fixed costs (the probes of :func:`measure_kernel_overhead_s` and
    :func:`measure_step_overhead_s`)."""
    from torch import nn

    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(4, 4), nn.ReLU()]
    return nn.Sequential(*layers)


def measure_kernel_overhead_s(depth: int = 24, repeats: int = 20) -> float:
    """Seconds per kernel of a training step with next to no arithmetic: forward + backward of a
    chain of ``depth`` tiny linear + ReLU layers on one sample (:func:`tiny_chain`), divided by
    the number of kernels the cost model counts for it (dispatch, autograd and allocation, per
    kernel)."""
    import torch

    model = tiny_chain(depth)
    x = torch.randn(1, 4)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()

    t = _best_seconds(step, repeats, warmup=3)
    return t / _kernel_count(depth)


@functools.lru_cache(maxsize=4)
def _kernel_count(depth: int) -> int:
    from hetcoll.model.costs import layer_costs

    costs = layer_costs(tiny_chain(depth), (4,))
    return sum(k.launches for x in costs.layers for k in (*x.forward, *x.backward))


#: The step probe's depth (:func:`measure_step_overhead_s`): linear + ReLU layers.
STEP_PROBE_DEPTH = 8


def step_probe_plan(depth: int) -> dict[str, Any]:
    """The step probe's plan: the whole chain on rank 0, one sample, one micro-batch."""
    stage = {"ranks": [0], "layers": [0, 2 * depth]}
    return {"microbatches": 1, "schedule": "GPipe", "replicas": [{"samples": 1, "stages": [stage]}]}


def step_probe_loss(out: Any) -> Any:
    """The probe's loss as the cost model takes it (its target made inside)."""
    from torch import nn

    return nn.functional.mse_loss(out, out.new_zeros(out.shape))


def _step_probe_rank(rank: int, world: int, depth: int, steps: int, device: str) -> list[float]:
    """One rank alone (:func:`hetcoll.launch.spawn`): each timed step's seconds of the probe
    under :func:`hetcoll.torch.parallelize` - ``par.step``, the SGD step, ``zero_grad``, the
    device synchronized - after a tenth as many untimed."""
    import torch
    from torch import nn

    from hetcoll.torch import parallelize

    dev = torch.device(device)
    torch.manual_seed(0)
    model = tiny_chain(depth).to(dev)
    par = parallelize(model, step_probe_plan(depth), loss_fn=nn.functional.mse_loss)
    opt = torch.optim.SGD(par.parameters(), lr=1e-3)
    x, target = torch.randn(1, 4, device=dev), torch.zeros(1, 4, device=dev)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    warmup = max(2, steps // 10)
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        par.step(x, target)
        opt.step()
        opt.zero_grad()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def measure_step_overhead_s(device: Device, *, where: str = "cpu", steps: int = 200) -> float:
    """The fixed host seconds of a training step that ``device``'s other figures leave out
    (:attr:`hetcoll.model.Device.step_overhead_s`): a rank alone (its own process, one thread)
    trains a chain of :data:`STEP_PROBE_DEPTH` tiny linear + ReLU layers on one sample under
    :func:`hetcoll.torch.parallelize`, with SGD, on ``where`` (``"cpu"``, ``"cuda:0"``); its
    step, the current statistic of ``steps`` (:func:`set_statistic`), goes to
    :func:`step_overhead_from`. A step of that probe is next to all fixed costs: those of its
    kernels, which ``kernel_overhead_s`` prices, and those of the step itself - the runtime's
    batch agreement and bookkeeping, the loss's host sync, the optimizer's call."""
    if not isinstance(device, Device):
        raise TypeError(f"device: must be a hetcoll.model.Device, got {type(device).__name__}")
    return step_overhead_from(step_probe_seconds(where=where, steps=steps), device)


def step_probe_seconds(
    depth: int = STEP_PROBE_DEPTH, *, where: str = "cpu", steps: int = 200
) -> float:
    """The step probe's step (:func:`measure_step_overhead_s`) with ``depth`` layers, measured:
    the current statistic (:func:`set_statistic`) of ``steps`` steps of a rank alone, in its
    own process, on ``where``. At two depths, the residuals (:func:`step_overhead_from`) tell
    a step's fixed cost from what each layer adds that the model does not price."""
    import torch

    from hetcoll import launch

    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth: must be an integer >= 1, got {depth!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps: must be an integer >= 1, got {steps!r}")
    if not isinstance(where, str):
        raise TypeError(f'where: must be a device name ("cpu", "cuda:0"), got {where!r}')
    try:
        kind = torch.device(where).type
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"where: not a torch device, {where!r} ({e})") from None
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"where: a CPU or a CUDA device, got {where!r}")
    times = launch.spawn(_step_probe_rank, 1, depth, steps, where, timeout=120.0 + steps)[0]
    return float(_STATISTIC[_statistic](times))


def step_overhead_from(step_s: float, device: Device, depth: int = STEP_PROBE_DEPTH) -> float:
    """The step probe's (:func:`measure_step_overhead_s`, of ``depth`` layers) measured
    ``step_s`` less what :func:`hetcoll.model.predict_plan` predicts for it on ``device``
    without a step overhead, at least 0: with it as ``device``'s ``step_overhead_s``, the
    model predicts the probe's step as measured.

    >>> step_overhead_from(0.0, Device("d", 1e9, 1e9, 1e9))
    0.0
    """
    from hetcoll.model import layer_costs, predict_plan
    from hetcoll.plan import Plan

    costs = layer_costs(tiny_chain(depth), (4,), loss=step_probe_loss)
    alone = Cluster([Node("probe", replace(device, step_overhead_s=0.0), 1)])
    predicted = predict_plan(costs, alone, Plan.from_dict(step_probe_plan(depth))).step_s
    return max(0.0, step_s - predicted)


def measure_elementwise_bytes_per_s(batch: int = 16, repeats: int = 5) -> float:
    """Bytes/s the element-wise layers of a CNN that the model costs at the element-wise rate
    reach on this thread: forward + backward of batch norm on a [batch, 32, 32, 32] tensor,
    the bytes counted by the cost model itself (so the rate and the accounting agree).
    (ReLU streams at the copy bandwidth and pooling has a rate of its own:
    :func:`measure_pool_bytes_per_s`.)"""
    from torch import nn

    return _layer_bytes_per_s(nn.BatchNorm2d(32), batch, repeats)


def measure_pool_bytes_per_s(batch: int = 16, repeats: int = 5) -> float:
    """Bytes/s pooling reaches on this thread: forward + backward of 2x2 max pooling on a
    [batch, 32, 32, 32] tensor, the bytes counted by the cost model."""
    from torch import nn

    return _layer_bytes_per_s(nn.MaxPool2d(2), batch, repeats)


def _layer_bytes_per_s(layer: Any, batch: int, repeats: int) -> float:
    import torch

    x = torch.randn(batch, 32, 32, 32, requires_grad=True)
    # A dense output gradient, as the next layer's backward hands it over (``.sum()``'s
    # would be a broadcast view, which sends batch norm's backward down a path 3-5x slower).
    grad = torch.ones_like(layer(x))

    def step() -> None:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).backward(grad)

    t = _best_seconds(step, repeats, warmup=1)
    return _layer_bytes(type(layer).__name__, batch) / t


@functools.lru_cache(maxsize=8)
def _layer_bytes(kind: str, batch: int) -> float:
    """Bytes the cost model counts for forward + backward of the layer ``kind`` (batch norm,
    max pooling) on ``batch`` samples of [32, 32, 32]."""
    from torch import nn

    from hetcoll.model.costs import layer_costs

    layer = nn.BatchNorm2d(32) if kind == "BatchNorm2d" else nn.MaxPool2d(2)
    costs = layer_costs(nn.Sequential(layer), (32, 32, 32))
    return float(
        sum(
            k.moved_bytes(batch)
            for layer in costs.layers
            for k in (*layer.forward, *layer.backward)
        )
    )


def measure_device(
    name: str,
    memory_bytes: float,
    *,
    quick: bool = False,
    before: Callable[[], object] = lambda: None,
) -> Device:
    """Every per-rank figure of this machine as a :class:`Device`, measured on one thread (as
    each rank runs: the caller's thread count is restored after). Measured at torch's default
    of every core instead, a GEMM here runs 1.6-1.9x and an element-wise kernel 1.5-2x faster
    than on the one thread a rank has, and every prediction from it comes out as much too
    fast. ``before``: called before each probe (a barrier, where ranks measure in step:
    :func:`measure_node_device`)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure_device(name, memory_bytes, quick, before)
    finally:
        torch.set_num_threads(threads)


def _measure_device(
    name: str, memory_bytes: float, quick: bool, before: Callable[[], object] = lambda: None
) -> Device:
    """The probes of :func:`measure_device`, each after ``before()`` (a barrier, where several
    ranks measure in step: :func:`measure_node_device`)."""
    r = 3 if quick else 7

    def probe(measure: Callable[..., Any], **kwargs: Any) -> Any:
        before()
        return measure(**kwargs)

    conv_overhead_s = probe(measure_conv_overhead_s, repeats=r)
    return Device(
        name,
        flops_per_s=probe(measure_gemm_flops_per_s, repeats=r),
        conv_flops_per_s=probe(measure_conv_flops_per_s, repeats=r, overhead_s=conv_overhead_s),
        conv_overhead_s=conv_overhead_s,
        mem_bytes_per_s=probe(
            measure_mem_bytes_per_s, nbytes=(16 if quick else 64) * 1024 * 1024, repeats=r
        ),
        memory_bytes=memory_bytes,
        kernel_overhead_s=probe(measure_kernel_overhead_s, repeats=10 if quick else 20),
        elementwise_bytes_per_s=probe(measure_elementwise_bytes_per_s, repeats=r),
        pool_bytes_per_s=probe(measure_pool_bytes_per_s, repeats=r),
        conv_channel_block=conv_channel_block(),
        first_touch_bytes_per_s=probe(measure_first_touch_bytes_per_s, repeats=r),
    )


def slowest_device(devices: Sequence[Device], name: str | None = None) -> Device:
    """One device as slow as the slowest of ``devices`` in every figure the model uses: each
    rate their least and each fixed cost their greatest, an optional figure read as the model
    reads it (``elementwise_bytes_per_s`` 0: the memory bandwidth; a first touch's rate 0: no
    cost; a precision's peak 0: fp32, so 0 unless every device has one), the memory and the
    channel block the first's. What a node of ranks that each measured their own figures is,
    for a step that waits for its slowest rank. ``name``: the result's (default: the first's).

    >>> a = Device("a", flops_per_s=2e9, mem_bytes_per_s=1e9, memory_bytes=1e9)
    >>> b = Device("b", flops_per_s=1e9, mem_bytes_per_s=3e9, memory_bytes=1e9)
    >>> d = slowest_device([a, b])
    >>> (d.name, d.flops_per_s, d.mem_bytes_per_s)
    ('a', 1000000000.0, 1000000000.0)
    """
    if isinstance(devices, Device) or not isinstance(devices, Sequence) or not devices:
        raise ValueError(f"devices: need a non-empty sequence of Device, got {devices!r}")
    for i, d in enumerate(devices):
        if not isinstance(d, Device):
            raise TypeError(f"devices[{i}]: must be a Device, got {type(d).__name__}")

    touches = [d.first_touch_bytes_per_s for d in devices if d.first_touch_bytes_per_s > 0]
    peaks = {
        attr: min(getattr(d, attr) for d in devices)
        for attr in ("tf32_flops_per_s", "bf16_flops_per_s", "fp16_flops_per_s")
    }
    first = devices[0]
    return replace(
        first,
        name=first.name if name is None else name,
        flops_per_s=min(d.flops_per_s for d in devices),
        mem_bytes_per_s=min(d.mem_bytes_per_s for d in devices),
        elementwise_bytes_per_s=min(d.elementwise_rate for d in devices),
        pool_bytes_per_s=min(d.pool_rate for d in devices),
        conv_flops_per_s=min(d.conv_rate for d in devices),
        first_touch_bytes_per_s=min(touches, default=0.0),
        kernel_overhead_s=max(d.kernel_overhead_s for d in devices),
        conv_overhead_s=max(d.conv_call_s for d in devices),
        step_overhead_s=max(d.step_overhead_s for d in devices),
        **peaks,
    )


def _spread(devices: Sequence[Device]) -> str:
    """The ranks' GEMM, convolution and copy rates, least to greatest, for a comment."""

    def rates(attr: str) -> str:
        values = sorted(getattr(d, attr) / 1e9 for d in devices)
        return f"{values[0]:.3g}-{values[-1]:.3g}"

    return (
        f"GEMM {rates('flops_per_s')} GFLOP/s, convolutions {rates('conv_rate')} GFLOP/s, "
        f"copy {rates('mem_bytes_per_s')} GB/s over the ranks"
    )


def _device_rank(rank: int, world: int, name: str, memory_bytes: float, quick: bool) -> Device:
    """One rank of :func:`measure_node_device`: its own figures, every probe in step with the
    other ranks' (a barrier before each)."""
    import torch.distributed as dist

    return measure_device(name, memory_bytes, quick=quick, before=dist.barrier)


def measure_node_device(
    name: str, memory_bytes: float, ranks: int, *, quick: bool = False
) -> tuple[Device, list[Device]]:
    """The device of a node whose ``ranks`` one-thread ranks train side by side: each rank
    measures :func:`measure_device`'s figures at the same time as the others (every probe in
    step), and the node's device is the slowest rank's in every figure
    (:func:`slowest_device`), since a step waits for its slowest rank. Returns that device and
    each rank's own. At most as many ranks as there are cores measure (beyond them the ranks
    share cores, which the model's shared-cores timeline prices itself); one measures in this
    process.

    A rank alone measures what no rank has once its node is busy: on the GPU machine's 16
    cores, three one-thread CPU ranks training side by side ran the demo CNN at 2,410 to 3,362
    samples/s where a lone rank's figures predicted 3,073 for all of them, and the slowest set
    the step (docs/model.md)."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks: must be an integer >= 1, got {ranks!r}")
    n = min(ranks, len(os.sched_getaffinity(0)))
    if n == 1:
        own = [measure_device(name, memory_bytes, quick=quick)]
    else:
        from hetcoll.launch import spawn

        own = spawn(_device_rank, n, name, memory_bytes, quick, timeout=300.0)
    return slowest_device(own, name), own


@dataclass(frozen=True)
class LinkFit:
    """alpha-beta fit of one-way message times: ``latency_s + bytes / bytes_per_s``; and the
    fixed cost of a collective call beyond its messages (``call_s``,
    :func:`fit_call_seconds`), from the seconds a call of each small collective took
    (``calls_s``)."""

    latency_s: float
    bytes_per_s: float
    sizes_bytes: tuple[int, ...]
    one_way_s: tuple[float, ...]
    call_s: float = 0.0
    calls_s: tuple[tuple[str, float], ...] = ()

    def link(self, name: str) -> Link:
        """The performance model's :class:`~hetcoll.model.hardware.Link` of this fit: each
        probed kind of collective at its own fixed cost per call (:func:`call_excess`), any
        other at the median of them."""
        own = call_excess(dict(self.calls_s), self.latency_s) if self.calls_s else {}
        return Link(name, self.latency_s, self.bytes_per_s, self.call_s, tuple(sorted(own.items())))

    def describe(self) -> str:
        """What was measured, for a cluster file's comment."""
        one_way = ", ".join(f"{n}B:{t:.3g}" for n, t in zip(self.sizes_bytes, self.one_way_s))
        calls = ", ".join(f"{name}:{t:.3g}" for name, t in self.calls_s)
        return (
            f"one-way seconds {one_way}; seconds a call of {CALL_PROBE_ELEMENTS} floats, back "
            f"to back: {calls}"
        )


#: float32 elements of the small collectives whose calls time an engine's fixed cost per call.
CALL_PROBE_ELEMENTS = 64
#: Message latencies the model charges each probed collective on ``p`` ranks (a ring
#: allreduce's ``2(p-1)``, an allgather's and an all-to-all's ``p-1``, a binomial broadcast's
#: ``ceil(log2 p)``: :mod:`hetcoll.model.terms`).
CALL_PROBE_LATENCIES: dict[str, Callable[[int], int]] = {
    "allreduce": lambda p: 2 * (p - 1),
    "allgather": lambda p: p - 1,
    "all_to_all": lambda p: p - 1,
    "broadcast": lambda p: math.ceil(math.log2(p)),
    "hetcoll_allreduce": lambda p: 2 * (p - 1),
    "hetcoll_allgatherv": lambda p: p - 1,
}


def call_excess(
    calls_s: Mapping[str, float], latency_s: float, num_ranks: int = 2
) -> dict[str, float]:
    """Each probed collective's (:data:`CALL_PROBE_LATENCIES`) fixed seconds a call beyond its
    messages: its call's seconds less the message latencies the model already charges it, at
    least 0 (its bytes are negligible).

    >>> call_excess({"allreduce": 5e-4, "broadcast": 2e-5}, 5e-5)
    {'allreduce': 0.0004, 'broadcast': 0.0}
    """
    if num_ranks < 2:
        raise ValueError(f"num_ranks: a collective call needs at least 2 ranks, got {num_ranks}")
    if not calls_s:
        raise ValueError("calls_s: no collective was timed")
    return {
        name: round(max(0.0, t - CALL_PROBE_LATENCIES[name](num_ranks) * latency_s), 9)
        for name, t in calls_s.items()
    }


def fit_call_seconds(calls_s: Mapping[str, float], latency_s: float, num_ranks: int = 2) -> float:
    """The fixed seconds of a collective call beyond its messages, for the kinds not probed:
    the median over the probed collectives of :func:`call_excess`.

    >>> fit_call_seconds({"allreduce": 5e-4, "allgather": 3e-4, "all_to_all": 3e-4,
    ...                   "broadcast": 2e-4}, 5e-5)
    0.00025
    """
    excess = call_excess(calls_s, latency_s, num_ranks)
    return round(float(statistics.median(excess.values())), 9)


def call_seconds(ops: Mapping[str, Callable[[], object]], calls: int = 100) -> dict[str, float]:
    """Seconds per call of each collective, called back to back by every rank: the median of
    5 rounds of ``calls`` calls, after a quarter round to warm up.

    >>> call_seconds({"nothing": lambda: None}, calls=0)
    Traceback (most recent call last):
    ...
    ValueError: calls: must be an integer >= 1, got 0
    """
    if isinstance(calls, bool) or not isinstance(calls, int) or calls < 1:
        raise ValueError(f"calls: must be an integer >= 1, got {calls!r}")
    out = {}
    for name, op in ops.items():
        for _ in range(calls // 4):
            op()
        rounds = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                op()
            rounds.append((time.perf_counter() - start) / calls)
        out[name] = statistics.median(rounds)
    return out


def fit_alpha_beta(sizes_bytes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """(latency_s, bytes_per_s) of ``t = latency + n / bandwidth``: latency is the fastest
    message of at most 1 KiB (start-up only), bandwidth the least-squares slope of the messages
    of at least 1 MiB with that latency fixed (the sizes gradient buckets have).

    >>> fit_alpha_beta([8, 2**20, 2**21], [1e-6, 1e-6 + 2**20 / 1e9, 1e-6 + 2**21 / 1e9])
    (1e-06, 1000000000.0)
    """
    n = np.asarray(sizes_bytes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    small, large = n <= 1024, n >= 1024 * 1024
    if not small.any() or not large.any():
        raise ValueError("sizes_bytes: need messages of at most 1 KiB and of at least 1 MiB")
    alpha = float(t[small].min())
    x, y = n[large], np.maximum(t[large] - alpha, 1e-12)
    beta = float((x * y).sum() / (x * x).sum())
    return alpha, round(1.0 / beta, 6)


def _ping_pong(
    rank: int,
    sizes: Sequence[int],
    repeats: int,
    make_buffer: Callable[[int], Any],
    barrier: Callable[[], Any],
    send: Callable[[Any, int], Any],
    recv: Callable[[Any, int], Any],
) -> list[float]:
    """One-way seconds per message size between ranks 0 and 1 (half the best round trip after
    two warm-up rounds), whatever engine ``barrier``/``send``/``recv`` belong to."""
    out = []
    for size in sizes:
        buf = make_buffer(max(1, size // 4))
        times = []
        for i in range(repeats + 2):
            barrier()
            t0 = time.perf_counter()
            if rank == 0:
                send(buf, 1)
                recv(buf, 1)
            elif rank == 1:
                recv(buf, 0)
                send(buf, 0)
            if i >= 2:
                times.append((time.perf_counter() - t0) / 2)
        out.append(min(times))
    return out


def _gloo_ping_pong(
    rank: int, world: int, sizes: Sequence[int], repeats: int
) -> tuple[list[float], dict[str, float]]:
    import torch
    import torch.distributed as dist

    warm = torch.zeros(1)
    for _ in range(5):  # the first messages of a gloo pair pay for connection set-up
        if rank == 0:
            dist.send(warm, 1)
            dist.recv(warm, 1)
        elif rank == 1:
            dist.recv(warm, 0)
            dist.send(warm, 0)
    times = _ping_pong(
        rank, sizes, repeats, lambda n: torch.zeros(n), dist.barrier, dist.send, dist.recv
    )
    return times, gloo_calls(rank, world)


def gloo_calls(rank: int, world: int) -> dict[str, float]:
    """Seconds a call of each probed collective (:data:`CALL_PROBE_LATENCIES`) of
    ``CALL_PROBE_ELEMENTS`` floats on the current torch.distributed group, called back to back
    (:func:`call_seconds`); every rank calls it (a rank function for
    :func:`hetcoll.launch.spawn`)."""
    import torch
    import torch.distributed as dist

    import hetcoll

    x = torch.zeros(CALL_PROBE_ELEMENTS)
    gathered = torch.empty(CALL_PROBE_ELEMENTS * world)
    return call_seconds(
        {
            "allreduce": lambda: dist.all_reduce(x),
            "allgather": lambda: dist.all_gather_into_tensor(gathered, x),
            "all_to_all": lambda: dist.all_to_all_single(torch.empty_like(x), x),
            "broadcast": lambda: dist.broadcast(x, 0),
            # As the filter-split layers call them, inside their agreed forward.
            "hetcoll_allreduce": lambda: hetcoll.allreduce(x, check=False),
            "hetcoll_allgatherv": lambda: hetcoll.allgatherv(x),
        }
    )


def _fit(sizes: Sequence[int], times: Sequence[float], calls: Mapping[str, float]) -> LinkFit:
    alpha, bw = fit_alpha_beta(sizes, times)
    return LinkFit(
        alpha,
        bw,
        tuple(sizes),
        tuple(times),
        fit_call_seconds(calls, alpha),
        tuple(sorted(calls.items())),
    )


def measure_gloo_link(sizes: Sequence[int] = PING_PONG_BYTES, repeats: int = 9) -> LinkFit:
    """Ping-pong between two local gloo ranks, one-way time fitted to alpha-beta; then small
    collectives called back to back, for the fixed cost of a call (:func:`fit_call_seconds`)."""
    from hetcoll.launch import spawn

    times, calls = spawn(_gloo_ping_pong, 2, list(sizes), repeats, timeout=120.0)[0]
    return _fit(sizes, times, calls)


def gloo_allreduce_seconds(
    rank: int,
    world: int,
    sizes: Sequence[int],
    repeats: int,
    *,
    idle_s: float = 0.0,
    allreduce: Callable[[Any], object] | None = None,
) -> list[float]:
    """Median seconds of a gloo ``all_reduce`` of each size over the current process group
    (every rank calls it; the slowest rank's view is what the caller should keep).

    ``idle_s``: every rank sleeps this long between the barrier and the allreduce, as ranks
    compute between a training step's collectives; on a virtual machine a message to a process
    that went idle costs more than one to a process still running after the barrier.
    ``allreduce``: the in-place sum to time on a float32 tensor (default
    ``torch.distributed.all_reduce``; e.g. ``hetcoll.allreduce`` for what hetcoll's own layers
    call)."""
    import torch
    import torch.distributed as dist

    if allreduce is None:
        allreduce = dist.all_reduce
    out = []
    for size in sizes:
        buf = torch.zeros(max(1, size // 4))
        times = []
        for i in range(repeats + 1):
            dist.barrier()
            if idle_s > 0:
                time.sleep(idle_s)
            t0 = time.perf_counter()
            allreduce(buf)
            if i >= 1:
                times.append(time.perf_counter() - t0)
        out.append(statistics.median(times))
    return out


def fit_ring_allreduce(
    num_ranks: int, sizes_bytes: Sequence[int], seconds: Sequence[float]
) -> tuple[float, float]:
    """Effective (latency_s, bytes_per_s) of a link from measured allreduce times, inverting the
    ring model ``2(p-1) alpha + 2(p-1)/p n / B`` (reduction folded into B): alpha from the
    smallest message, B from the largest.

    >>> fit_ring_allreduce(2, [0, 2**20], [2e-6, 2e-6 + 2**20 / 1e9])
    (1e-06, 1000000000.0)
    """
    p = num_ranks
    if p < 2:
        raise ValueError(f"num_ranks: a ring needs at least 2 ranks, got {p}")
    i_small, i_large = int(np.argmin(sizes_bytes)), int(np.argmax(sizes_bytes))
    alpha = seconds[i_small] / (2 * (p - 1))
    rest = max(seconds[i_large] - seconds[i_small], 1e-12)
    bw = 2 * (p - 1) / p * (sizes_bytes[i_large] - sizes_bytes[i_small]) / rest
    return float(alpha), round(float(bw), 6)


#: Seconds of compute per rank in the lock-step stretches that measure the OS scheduler's time
#: slice (:func:`lockstep_stretch_seconds`); the first, nothing, measures the bare collective.
TIME_SLICE_WORKS_S = (0.0, 0.001, 0.002, 0.004, 0.008, 0.016)


def _spin(iterations: int) -> int:
    total = 0
    for i in range(iterations):
        total += i
    return total


def spin_rate() -> float:
    """Iterations per second of the busy loop :func:`lockstep_stretch_seconds` computes."""
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        _spin(100_000)
        times.append(time.perf_counter() - t0)
    return 100_000 / min(times)


def lockstep_stretch_seconds(
    iterations_per_s: float,
    works_s: Sequence[float] = TIME_SLICE_WORKS_S,
    repeats: int = 3,
    nbytes: int = 0,
) -> list[float]:
    """Seconds of one lock-step stretch of the current process group for each of ``works_s``:
    every rank computes that long (a busy loop at ``iterations_per_s``, :func:`spin_rate`),
    then joins a one-element ``all_reduce`` (``nbytes`` > 0: a :func:`hetcoll.allreduce` of
    that many bytes); median over ``repeats`` of the mean of 8 stretches. With more ranks
    than cores, :func:`fit_time_slice` and :func:`fit_wake_seconds` read the scheduler's time
    slice and the wake-up cost off these (every rank calls this; they all see the same
    stretches)."""
    import torch
    import torch.distributed as dist

    token = torch.zeros(max(1, nbytes // 4))
    if nbytes:
        import hetcoll

        collective: Callable[[Any], object] = hetcoll.allreduce
    else:
        collective = dist.all_reduce
    out = []
    for work in works_s:
        iterations = int(work * iterations_per_s)
        runs = []
        for _ in range(repeats):
            collective(token)
            t0 = time.perf_counter()
            for _ in range(8):
                _spin(iterations)
                collective(token)
            runs.append((time.perf_counter() - t0) / 8)
        out.append(statistics.median(runs))
    return out


def _lockstep_base(works_s: Sequence[float], stretches_s: Sequence[float]) -> float:
    """The stretch with no work (the bare collective), after checking the figures' shape."""
    if len(works_s) != len(stretches_s) or len(works_s) < 2 or works_s[0] != 0.0:
        raise ValueError(
            "works_s, stretches_s: need equally many figures, at least two, the first for no work"
        )
    return float(stretches_s[0])


def fit_time_slice(
    ranks: int, cores: int, works_s: Sequence[float], stretches_s: Sequence[float]
) -> float:
    """The scheduler time slice (seconds; 0: processor sharing) that best explains measured
    lock-step stretches of ``ranks`` ranks on ``cores`` cores (:func:`lockstep_stretch_seconds`):
    ``works_s[0]`` must be 0 (the bare collective, added to every prediction); the slice
    minimises the squared log error of :func:`terms.shared_cores_makespan_seconds` over the
    rest, on a grid from 0.2 ms to 50 ms.

    >>> from hetcoll.model import terms
    >>> works = TIME_SLICE_WORKS_S
    >>> meas = [1e-4 + terms.shared_cores_makespan_seconds([[("cpu", w)]] * 3, 2, 0.006)
    ...         for w in works]
    >>> round(fit_time_slice(3, 2, works, meas), 3)
    0.006
    """
    from hetcoll.model import terms

    base = _lockstep_base(works_s, stretches_s)
    grid = [0.0, *np.geomspace(2e-4, 5e-2, 61)]

    def loss(q: float) -> float:
        err = 0.0
        for w, m in zip(works_s[1:], stretches_s[1:]):
            t = base + terms.shared_cores_makespan_seconds([[("cpu", w)]] * ranks, cores, q)
            err += float(np.log(t / m)) ** 2
        return err

    best = min(grid, key=loss)
    return round(float(best), 6)


def fit_wake_seconds(
    ranks: int,
    cores: int,
    works_s: Sequence[float],
    stretches_s: Sequence[float],
    time_slice_s: float,
) -> float:
    """What a lock-step stretch costs beyond the bare collective and the round-robin makespan of
    its compute (:func:`fit_time_slice`'s model at ``time_slice_s``): the median excess over the
    stretches with work, at least 0. With more ranks than cores the ranks that reach a
    collective first sleep, and waking them (and the engine's progress threads, which need a
    core too) costs this much per collective.

    >>> from hetcoll.model import terms
    >>> works = TIME_SLICE_WORKS_S
    >>> meas = [1e-4 + (w > 0) * 1e-3 + terms.shared_cores_makespan_seconds(
    ...     [[("cpu", w)]] * 3, 2, 0.004) for w in works]
    >>> round(fit_wake_seconds(3, 2, works, meas, 0.004), 6)
    0.001
    """
    from hetcoll.model import terms

    base = _lockstep_base(works_s, stretches_s)
    excess = [
        m - base - terms.shared_cores_makespan_seconds([[("cpu", w)]] * ranks, cores, time_slice_s)
        for w, m in zip(works_s[1:], stretches_s[1:])
    ]
    return round(max(0.0, float(statistics.median(excess))), 7)


def _mpi_ping_pong(
    sizes: Sequence[int], repeats: int
) -> tuple[list[float], dict[str, float]] | None:
    from mpi4py import MPI

    import hetcoll

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    out = _ping_pong(
        rank,
        sizes,
        repeats,
        lambda n: np.zeros(n, dtype=np.float32),
        comm.Barrier,
        comm.Send,
        comm.Recv,
    )
    x = np.zeros(CALL_PROBE_ELEMENTS, dtype=np.float32)
    into = np.empty(CALL_PROBE_ELEMENTS * comm.Get_size(), dtype=np.float32)
    calls = call_seconds(
        {
            "allreduce": lambda: comm.Allreduce(MPI.IN_PLACE, x),
            "allgather": lambda: comm.Allgather(x, into),
            "all_to_all": lambda: comm.Alltoall(x, np.empty_like(x)),
            "broadcast": lambda: comm.Bcast(x, 0),
            "hetcoll_allreduce": lambda: hetcoll.allreduce(x, comm, check=False),
            "hetcoll_allgatherv": lambda: hetcoll.allgatherv(x, comm),
        }
    )
    return (out, calls) if rank == 0 else None


def measure_mpi_link(sizes: Sequence[int] = PING_PONG_BYTES, repeats: int = 9) -> LinkFit:
    """Ping-pong between two local MPI ranks (``mpiexec -n 2``); one-way time fitted to
    alpha-beta."""
    from pathlib import Path

    from hetcoll.launch import mpiexec, mpiexec_path

    # The MPI library of the `mpich` wheel sits in <venv>/lib next to mpiexec; a Python whose
    # own prefix lacks it (a venv layered on another) finds it only through the loader path.
    lib = str(Path(mpiexec_path()).resolve().parent.parent / "lib")
    env = {
        "LD_LIBRARY_PATH": os.pathsep.join(x for x in (lib, os.environ.get("LD_LIBRARY_PATH")) if x)
    }
    proc = mpiexec(
        2,
        ["-m", "hetcoll.lab.calibrate", json.dumps({"sizes": list(sizes), "repeats": repeats})],
        timeout=120.0,
        env=env,
    )
    line = [x for x in proc.stdout.splitlines() if x.startswith("{")][-1]
    found = json.loads(line)
    return _fit(sizes, found["one_way_s"], found["calls_s"])


def _memory_per_rank_bytes(ranks: int) -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 / ranks
    except OSError:
        pass
    return 4e9


def calibrate(
    *,
    ranks: int | None = None,
    links: Sequence[str] = ("gloo", "mpi"),
    transport: str = "gloo",
    progress: Callable[[str], None] | None = None,
) -> Calibration:
    """Measure this machine: a one-node cluster of ``ranks`` one-thread ranks (default: one per
    core) joined by the ``transport`` link, every measured link, and comments describing each
    measurement.
    """
    say = progress or (lambda s: None)
    ranks = ranks or os.cpu_count() or 1
    if transport not in links:
        raise ValueError(
            f"transport: must be one of the measured links {list(links)}, got {transport!r}"
        )
    say(
        "device (GEMM, convolution, copy, kernel overhead, element-wise layers), "
        "on the node's ranks at once (at most one per core) ..."
    )
    device, own = measure_node_device("this-machine-1-thread", _memory_per_rank_bytes(ranks), ranks)
    say(
        f"  {device.flops_per_s / 1e9:.2f} GFLOP/s (convolutions "
        f"{device.conv_rate / 1e9:.2f}), {device.mem_bytes_per_s / 1e9:.2f} GB/s, "
        f"{device.kernel_overhead_s * 1e6:.1f} us/kernel "
        f"({device.conv_call_s * 1e6:.0f} us/convolution kernel), element-wise "
        f"{device.elementwise_rate / 1e9:.2f} GB/s, pooling {device.pool_rate / 1e9:.2f} GB/s, "
        "convolution channel block "
        f"{device.conv_channel_block}, first touch of a fresh 64 MiB tensor "
        f"{device.first_touch_bytes_per_s / 1e9:.2f} GB/s"
    )
    if len(own) > 1:
        say(f"  (the slowest of {len(own)} ranks; {_spread(own)})")
    say("a training step's fixed cost (a tiny model under parallelize, one rank) ...")
    device = replace(device, step_overhead_s=measure_step_overhead_s(device))
    say(f"  {device.step_overhead_s * 1e6:.0f} us a step")
    comments = {
        device.name: "measured by `hetcoll model calibrate`, "
        + (
            f"{len(own)} one-thread ranks at once, each figure the slowest rank's ({_spread(own)})"
            if len(own) > 1
            else "one thread"
        )
        + ": torch.mm 384^3 float32; "
        "3x3 64-channel convolution forward/backward (its fixed cost per call: the intercept "
        "over 1, 2 and 4 samples of 8x8 maps); channel block of torch's instruction set; "
        "copy of 64 MiB; per-kernel overhead of a tiny training step; batch norm, and max "
        "pooling, forward/backward; a fresh 64 MiB tensor's fill against a written one's; a "
        "training step of 8 tiny layers under parallelize against the model's prediction",
    }
    measured: dict[str, Link] = {}
    for name in links:
        say(f"{name} ping-pong, then small collectives ...")
        fit = measure_gloo_link() if name == "gloo" else measure_mpi_link()
        link = fit.link(f"{name}-local")
        measured[name] = link
        comments[link.name] = (
            f"measured: {name} ping-pong and small collectives between 2 local ranks, "
            + fit.describe()
        )
        each = ", ".join(f"{kind} {seconds * 1e6:.0f}" for kind, seconds in link.calls_s)
        say(
            f"  latency {link.latency_s * 1e6:.1f} us, {link.bytes_per_s / 1e9:.2f} GB/s, "
            f"a collective call {link.call_s * 1e6:.0f} us ({each})"
        )
    if transport not in measured:
        raise ValueError(f"transport: {transport!r} was not measured")
    node = Node("this-machine", device, ranks, measured[transport] if ranks > 1 else None)
    cluster = Cluster([node], None, "<calibrated>")
    return Calibration(cluster, list(measured.values()), comments)


@dataclass(frozen=True)
class Calibration:
    """What :func:`calibrate` measured: the cluster, every link, and a comment per entry."""

    cluster: Cluster
    links: list[Link]
    comments: dict[str, str]

    def to_toml(self) -> str:
        """The cluster file text, with the links the cluster does not use appended."""
        text = "# Written by `hetcoll model calibrate` on this machine.\n"
        text += dumps_cluster(self.cluster, self.comments, self.links)
        return text


if __name__ == "__main__":  # the MPI side of measure_mpi_link, under mpiexec -n 2
    cfg = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    result = _mpi_ping_pong(cfg.get("sizes", PING_PONG_BYTES), cfg.get("repeats", 9))
    if result is not None:
        print(json.dumps({"one_way_s": result[0], "calls_s": result[1]}), flush=True)
