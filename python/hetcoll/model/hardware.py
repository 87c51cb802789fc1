"""Hardware description for the performance model: devices, links, and clusters that mix them.

A cluster file is a small TOML document (see ``examples/clusters/``)::

    [devices.a100]                 # one rank's compute device
    flops_per_s = 19.5e12          # sustained arithmetic rate, float32 FLOP/s
    mem_bytes_per_s = 1.555e12     # memory bandwidth, bytes/s
    memory_bytes = 40e9            # memory capacity, bytes
    kernel_overhead_s = 5e-6       # optional: fixed cost of launching one kernel, seconds
    elementwise_bytes_per_s = 1e12 # optional: bandwidth element-wise kernels (normalisation,
                                   # softmax, ops outside layers) reach; default mem_bytes_per_s
    pool_bytes_per_s = 1e12        # optional: bandwidth pooling kernels reach; default
                                   # elementwise_bytes_per_s
    conv_flops_per_s = 21e12       # optional: FLOP/s of convolutions' GEMMs; default flops_per_s
    conv_channel_block = 1         # optional: channels a convolution kernel computes at a time
    conv_overhead_s = 5e-6         # optional: fixed cost of one convolution kernel call, seconds
                                   # (on CPUs oneDNN's set-up and weight reorders, ~100 us);
                                   # default kernel_overhead_s
    first_touch_bytes_per_s = 2e9  # optional: CPUs: bytes/s at which a tensor above 32 MiB,
                                   # given new pages at each allocation, is first written
                                   # (page faults, the kernel zeroing them); default 0: none
    step_overhead_s = 4e-4         # optional: fixed host seconds of each training step beyond
                                   # its layers' kernels and its optimizer's memory traffic
                                   # (the runtime's per-step work, the optimizer's call);
                                   # default 0
    tf32_flops_per_s = 156e12      # optional: dense peaks of matmul-class ops at each training
    bf16_flops_per_s = 312e12      #   precision (tensor cores where the datasheet gives them);
    fp16_flops_per_s = 312e12      #   a precision without one is costed at fp32 (a warning)

    [links.nvlink3]
    latency_s = 2e-6               # one-message start-up, seconds (alpha)
    bytes_per_s = 300e9            # one direction, bytes/s (B)
    call_s = 1e-5                  # optional: fixed cost of each collective call beyond its
                                   # messages (the engine's set-up and synchronisation), seconds;
                                   # default 0
    calls_s = { allreduce = 2e-5 } # optional: that cost for a kind of collective (the engine's
                                   # allreduce, allgather, all_to_all, broadcast; hetcoll's own
                                   # hetcoll_allreduce, hetcoll_allgatherv); default call_s

    [[nodes]]                      # a group of identical devices joined by one link
    name = "dgx-a100"
    device = "a100"
    count = 8                      # devices per node
    link = "nvlink3"               # link between devices of this node (needed when count > 1)
    repeat = 1                     # optional: this many identical nodes

    [network]
    link = "hdr200"                # link between nodes (needed when there are several nodes)

Devices are listed in file order (node by node), which is also the order of pipeline stages and
of the ring. Every error raised while reading a file names the file and the field. A file is at
most ``MAX_FILE_BYTES`` long and a regular file (not a device or a pipe); a cluster has at most
``MAX_DEVICES`` devices, so ``count`` and ``repeat`` are bounded too. Every figure is a finite
number; a rate (``*_per_s``) given is at least ``MIN_RATE`` (1 a second) and a fixed cost
(``*_s``) at most ``MAX_FIXED_SECONDS`` (1e6), so that no step's seconds overflow; a Device
or Link made in code holds the same figures.
"""

from __future__ import annotations

import functools
import math
import operator
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hetcoll.errors import shown
from hetcoll.model.files import read_small_file

#: Training precisions, as ``torch.autocast`` runs them (docs/model.md, "Precision"): ``fp32``;
#: ``tf32`` (fp32 tensors, matmuls on tf32 tensor cores); ``bf16`` and ``fp16`` (autocast:
#: matmul-class ops and activations in 16 bits, fp32 master weights, gradients and allreduce).
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")


def check_precision(precision: object, argument: str = "precision") -> str:
    """``precision`` if it is one of :data:`PRECISIONS`, else ``ValueError`` naming ``argument``.

    >>> check_precision("bf16")
    'bf16'
    """
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"{argument}: expected one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 only
    import tomli as tomllib


#: The most devices a cluster may have (``count`` x ``repeat`` summed over nodes): far more than
#: the largest training clusters, small enough that a hostile file cannot exhaust memory.
MAX_DEVICES = 2**16
#: The longest cluster file read: nodes are described by ``count`` and ``repeat``, not listed.
MAX_FILE_BYTES = 2**20
#: The widest channel blocking a convolution kernel may have (oneDNN's is 8 or 16).
MAX_CHANNEL_BLOCK = 1024


#: Tensors larger than this get new pages at every allocation on a CPU (glibc's largest
#: ``mmap`` threshold, 32 MiB on 64-bit Linux): :attr:`Device.first_touch_bytes_per_s`.
FRESH_PAGES_BYTES = 32 * 2**20


@dataclass(frozen=True)
class Device:
    """One rank's compute device.

    ``flops_per_s``: sustained float32 FLOP/s; ``mem_bytes_per_s``: memory bandwidth in bytes/s;
    ``memory_bytes``: capacity in bytes; ``kernel_overhead_s``: fixed seconds per kernel launch;
    ``elementwise_bytes_per_s``: bandwidth non-GEMM kernels reach (normalisation, softmax, the
    ops a model runs outside its layers; 0: same as ``mem_bytes_per_s``; lower on CPUs whose
    normalisation kernels are not bandwidth-bound); plain activations (ReLU and its kin) stream
    at ``mem_bytes_per_s``; ``pool_bytes_per_s``: bandwidth pooling kernels reach (0: the
    element-wise one; on one CPU core here a fifth of it: their window loops, not memory, bound
    them);
    ``conv_flops_per_s``: FLOP/s convolutions reach (0: same as ``flops_per_s``; their kernels,
    oneDNN's or cuDNN's, run at a rate of their own, on one CPU core here 1.2x a square GEMM's).
    ``conv_channel_block``: the channel blocking of those kernels (1: none). oneDNN lays
    channels out in blocks of 16 floats on AVX-512 (8 on AVX2) and computes whole blocks: a
    convolution with 21 filters costs what one with 32 does, and a filter-parallel split that
    leaves a rank a ragged block pays for the padding. Output channels are always padded;
    input channels from one block up (fewer take a kernel of their own).
    ``tf32_flops_per_s``, ``bf16_flops_per_s``, ``fp16_flops_per_s``: dense datasheet peaks of
    matmul-class ops at that precision (0: none; :meth:`matmul_speedup` falls back to fp32).
    ``first_touch_bytes_per_s``: the rate at which a fresh tensor larger than
    :data:`FRESH_PAGES_BYTES` is first written, on top of its kernel (0: none). On Linux a CPU
    allocation that large is mapped afresh every time (glibc's largest ``mmap`` threshold):
    each page faults and is zeroed at its first write, 2.4 GB/s on one core here against 28
    GB/s of a copy, so a language model's 67 MB logits cost 27 ms before any arithmetic;
    smaller tensors reuse freed memory. GPUs' caching allocators pay nothing.
    ``conv_overhead_s``: fixed seconds of each convolution kernel (forward, input gradient,
    weight gradient) beyond its arithmetic (0: ``kernel_overhead_s``). On a CPU core here
    oneDNN spends 100-250 us a call setting up and reordering weights, 10-30 times a small
    element-wise kernel's overhead: what makes micro-batches of a few samples cost more than
    their FLOPs.
    ``step_overhead_s``: fixed seconds each training step costs the device's rank beyond its
    layers' kernels and its optimizer's memory traffic (0: none): the host's work once a step,
    whatever the model - :meth:`hetcoll.torch.Parallel.step`'s batch agreement and
    bookkeeping, the loss's host sync, the optimizer's call. The predictors add it to every
    rank's step beside its optimizer update (their breakdowns' ``"optimizer"``,
    :func:`hetcoll.model.terms.step_update_seconds`). On a GPU, whose kernels are quick, it
    weighs most at small batches. ``hetcoll model calibrate`` measures it
    (:func:`hetcoll.lab.calibrate.measure_step_overhead_s`).

    >>> Device("v100", flops_per_s=15.7e12, mem_bytes_per_s=900e9, memory_bytes=32e9).name
    'v100'
    """

    name: str
    flops_per_s: float
    mem_bytes_per_s: float
    memory_bytes: float
    kernel_overhead_s: float = 0.0
    elementwise_bytes_per_s: float = 0.0
    conv_flops_per_s: float = 0.0
    conv_channel_block: int = 1
    tf32_flops_per_s: float = 0.0
    bf16_flops_per_s: float = 0.0
    fp16_flops_per_s: float = 0.0
    pool_bytes_per_s: float = 0.0
    conv_overhead_s: float = 0.0
    first_touch_bytes_per_s: float = 0.0
    step_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        _check_name(self.name, "Device")
        for attr in _DEVICE_FIGURES:
            _check_figure(getattr(self, attr), f"Device {self.name!r}: {attr}", attr)
        _check_channel_block(self.conv_channel_block, f"Device {self.name!r}: conv_channel_block")

    @property
    def elementwise_rate(self) -> float:
        """Bytes/s of element-wise kernels (``elementwise_bytes_per_s`` or the memory bandwidth)."""
        return self.elementwise_bytes_per_s or self.mem_bytes_per_s

    @property
    def pool_rate(self) -> float:
        """Bytes/s of pooling kernels (``pool_bytes_per_s`` or :attr:`elementwise_rate`)."""
        return self.pool_bytes_per_s or self.elementwise_rate

    @property
    def conv_call_s(self) -> float:
        """Fixed seconds of a convolution kernel (``conv_overhead_s`` or
        ``kernel_overhead_s``)."""
        return self.conv_overhead_s or self.kernel_overhead_s

    @property
    def conv_rate(self) -> float:
        """FLOP/s of convolution GEMMs (``conv_flops_per_s`` or ``flops_per_s``)."""
        return self.conv_flops_per_s or self.flops_per_s

    def peak_flops_per_s(self, precision: str) -> float:
        """The device's matmul peak at ``precision`` (``flops_per_s`` for fp32; 0.0 when the
        file gives none).

        >>> a100 = Device("a100", 19.5e12, 1.555e12, 40e9, bf16_flops_per_s=312e12)
        >>> a100.peak_flops_per_s("bf16")
        312000000000000.0
        """
        check_precision(precision)
        if precision == "fp32":
            return self.flops_per_s
        return float(getattr(self, f"{precision}_flops_per_s"))

    def matmul_speedup(self, precision: str) -> float:
        """How much faster matmul-class ops (GEMMs, convolutions, attention) run at
        ``precision`` than at fp32 on this device: its peak at ``precision`` over
        ``flops_per_s``, applied to the fp32 rates (``flops_per_s``, ``conv_flops_per_s``) so
        a calibrated device keeps its calibration. 1.0 when the device has no peak for it (the
        fp32 fallback, see docs/model.md).

        >>> Device("a100", 19.5e12, 1.555e12, 40e9, bf16_flops_per_s=312e12).matmul_speedup("bf16")
        16.0
        """
        peak = self.peak_flops_per_s(precision)
        return peak / self.flops_per_s if peak > 0 else 1.0


#: The kinds of collective a link's fixed cost per call can name (``Link.calls_s``): the
#: engine's own (DDP's buckets and buffers, a plan's sums and loss, the experts' exchanges), and
#: hetcoll's, which the filter-split layers call (:func:`hetcoll.allreduce`,
#: :func:`hetcoll.allgatherv`: its own algorithms and agreement on the engine's messages).
COLLECTIVE_KINDS = (
    "allreduce",
    "allgather",
    "all_to_all",
    "broadcast",
    "hetcoll_allreduce",
    "hetcoll_allgatherv",
)


@dataclass(frozen=True)
class Link:
    """A network or bus link: ``latency_s`` seconds per message (alpha) and ``bytes_per_s`` in one
    direction (B, so 1/B is beta). ``call_s``: the fixed seconds every collective call costs
    on it beyond its messages - the engine's own work (a call's set-up, the ranks meeting, its
    progress threads waking): a gloo all-to-all of 64 floats between two local ranks takes
    several times the one-way latency of a message. Point-to-point sends, whose ping-pong
    measures ``latency_s``, do not pay it. 0 where unknown (a datasheet's link). ``calls_s``:
    that cost for each kind of collective that has its own (:data:`COLLECTIVE_KINDS`; gloo's
    allreduce of a few floats costs several times its broadcast), as ``(kind, seconds)`` pairs;
    the others cost ``call_s`` (:meth:`call_of`).

    >>> Link("hdr200", latency_s=0.6e-6, bytes_per_s=25e9).bytes_per_s
    25000000000.0
    >>> Link("gloo", 4e-5, 5e9, 3e-4, (("allreduce", 1e-3),)).call_of("broadcast")
    0.0003
    """

    name: str
    latency_s: float
    bytes_per_s: float
    call_s: float = 0.0
    calls_s: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        _check_name(self.name, "Link")
        _check_figure(self.latency_s, f"Link {self.name!r}: latency_s", "latency_s")
        # inf is allowed here (a device talking to itself), never in a file.
        if self.bytes_per_s != math.inf:
            _check_figure(self.bytes_per_s, f"Link {self.name!r}: bytes_per_s", "bytes_per_s")
        _check_figure(self.call_s, f"Link {self.name!r}: call_s", "call_s")
        if not isinstance(self.calls_s, (tuple, list)) or not all(
            isinstance(pair, (tuple, list)) and len(pair) == 2 for pair in self.calls_s
        ):  # a dict once unpacked its keys' letters
            raise ValueError(
                f"Link {self.name!r}: calls_s: must be (kind, seconds) pairs, such as "
                f"(('allreduce', 2e-5),), got {self.calls_s!r}"
            )
        kinds = [kind for kind, _ in self.calls_s]
        for kind, seconds in self.calls_s:
            if kind not in COLLECTIVE_KINDS or kinds.count(kind) > 1:
                raise ValueError(
                    f"Link {self.name!r}: calls_s: {kind!r} must be one of {COLLECTIVE_KINDS}, "
                    "each once"
                )
            _check_figure(seconds, f"Link {self.name!r}: calls_s.{kind}", "call_s")

    @functools.cached_property
    def _calls(self) -> dict[str, float]:
        return dict(self.calls_s)

    def call_of(self, kind: str) -> float:
        """The fixed seconds of one call of a collective of ``kind`` (:data:`COLLECTIVE_KINDS`)."""
        if kind not in COLLECTIVE_KINDS:
            raise ValueError(f"kind: must be one of {COLLECTIVE_KINDS}, got {kind!r}")
        return self._calls.get(kind, self.call_s)


@dataclass(frozen=True)
class Node:
    """``count`` identical devices joined by ``link`` (``None`` when the node has one device)."""

    name: str
    device: Device
    count: int
    link: Link | None = None

    def __post_init__(self) -> None:
        _check_name(self.name, "Node")
        _check_type(self.device, Device, f"Node {self.name!r}: device")
        _check_type(self.link, Link, f"Node {self.name!r}: link", optional=True)
        if (
            not isinstance(self.count, int)
            or isinstance(self.count, bool)
            or not 1 <= self.count <= MAX_DEVICES
        ):
            raise ValueError(
                f"Node {self.name!r}: count must be an integer in 1..{MAX_DEVICES}, "
                f"got {_shown(self.count)}"
            )
        if self.count > 1 and self.link is None:
            raise ValueError(f"Node {self.name!r}: link is required when count > 1")


@dataclass(frozen=True)
class Cluster:
    """Nodes in order, joined by ``network`` (``None`` for a single node).

    >>> d = Device("cpu", 1e11, 2e10, 8e9)
    >>> Cluster([Node("n", d, 2, Link("shm", 1e-6, 5e9))]).num_devices
    2
    """

    nodes: list[Node]
    network: Link | None = None
    source: str = field(default="<memory>", compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.nodes, (list, tuple)):
            raise TypeError(
                f"{self.source}: nodes: must be a list of hetcoll.model.Node, got "
                f"{type(self.nodes).__name__}"
            )
        for i, node in enumerate(self.nodes):
            _check_type(node, Node, f"{self.source}: nodes[{i}]")
        _check_type(self.network, Link, f"{self.source}: network", optional=True)
        if not self.nodes:
            raise ValueError(f"{self.source}: nodes: a cluster needs at least one node")
        if len(self.nodes) > 1 and self.network is None:
            raise ValueError(f"{self.source}: network.link is required with several nodes")
        if self.num_devices > MAX_DEVICES:
            raise ValueError(
                f"{self.source}: nodes: {self.num_devices:,} devices, more than {MAX_DEVICES:,}"
            )

    @functools.cached_property
    def devices(self) -> tuple[Device, ...]:
        """Every device in order (node by node). Computed once: the planner reads it per
        candidate, on clusters of up to 65,536 devices."""
        return tuple(n.device for n in self.nodes for _ in range(n.count))

    @functools.cached_property
    def node_of_device(self) -> tuple[int, ...]:
        """Index of the node holding each device (computed once: :meth:`link_between` reads it
        for every message)."""
        return tuple(i for i, n in enumerate(self.nodes) for _ in range(n.count))

    @functools.cached_property
    def num_devices(self) -> int:
        return sum(n.count for n in self.nodes)

    def link_between(self, a: int, b: int) -> Link:
        """The link a message from device ``a`` to device ``b`` crosses (its slowest hop)."""
        nodes = self.node_of_device
        for name, d in (("a", a), ("b", b)):  # -1 once wrapped round to the last device
            if type(d) is not int or not 0 <= d < len(nodes):  # the check of every message
                _check_device_index(d, name, len(nodes))
        if nodes[a] == nodes[b]:
            link = self.nodes[nodes[a]].link
            if link is None:  # a == b on a one-device node: no transfer at all
                return Link("local", 0.0, math.inf)
            return link
        assert self.network is not None
        return _slowest([self.network, self.nodes[nodes[a]].link, self.nodes[nodes[b]].link])

    def ring_link(self) -> Link:
        """The bottleneck of a ring through every device in order: the largest latency and the
        smallest bandwidth of any link the ring crosses (a ring moves in lock step)."""
        links = [n.link for n in self.nodes if n.count > 1 and n.link is not None]
        if len(self.nodes) > 1 and self.network is not None:
            links.append(self.network)
        if not links:
            return Link("local", 0.0, math.inf)
        return _slowest(links)

    def scaled(
        self,
        *,
        flops: float = 1.0,
        mem_bw: float = 1.0,
        link_bw: float = 1.0,
    ) -> Cluster:
        """The same cluster with every device's FLOP/s, memory bandwidth and every link's
        bandwidth multiplied by the given factors (for the scaling sweeps)."""
        for name, factor in (("flops", flops), ("mem_bw", mem_bw), ("link_bw", link_bw)):
            _check_positive(factor, name)

        def dev(d: Device) -> Device:
            return replace(
                d,
                flops_per_s=d.flops_per_s * flops,
                conv_flops_per_s=d.conv_flops_per_s * flops,
                tf32_flops_per_s=d.tf32_flops_per_s * flops,
                bf16_flops_per_s=d.bf16_flops_per_s * flops,
                fp16_flops_per_s=d.fp16_flops_per_s * flops,
                mem_bytes_per_s=d.mem_bytes_per_s * mem_bw,
                elementwise_bytes_per_s=d.elementwise_bytes_per_s * mem_bw,
                pool_bytes_per_s=d.pool_bytes_per_s * mem_bw,
                first_touch_bytes_per_s=d.first_touch_bytes_per_s * mem_bw,
            )

        def lnk(link: Link | None) -> Link | None:
            return None if link is None else replace(link, bytes_per_s=link.bytes_per_s * link_bw)

        return Cluster(
            [replace(n, device=dev(n.device), link=lnk(n.link)) for n in self.nodes],
            lnk(self.network),
            self.source,
        )

    def subset(self, devices: Sequence[int]) -> Cluster:
        """The cluster of the given devices, in the given order: each run of devices of one
        node becomes a node of the result, with that node's link (so links between them are
        those of the whole cluster).

        >>> d = Device("cpu", 1e11, 2e10, 8e9)
        >>> c = Cluster([Node("a", d, 2, Link("shm", 1e-6, 5e9)), Node("b", d, 1)],
        ...             Link("eth", 1e-5, 1e9))
        >>> [(n.name, n.count) for n in c.subset([2, 0]).nodes], c.subset([1, 0]).ring_link().name
        ([('b', 1), ('a', 1)], 'shm')
        """
        nodes_of = self.node_of_device
        n = self.num_devices
        picked = list(devices)
        if (
            not picked
            or len(set(picked)) != len(picked)
            or any(isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < n for d in picked)
        ):
            raise ValueError(
                f"devices: expected distinct device indices in 0..{n - 1}, got {shown(devices)}"
            )
        runs: list[list[int]] = []
        for d in picked:
            if runs and nodes_of[runs[-1][0]] == nodes_of[d]:
                runs[-1].append(d)
            else:
                runs.append([d])
        nodes = [replace(self.nodes[nodes_of[r[0]]], count=len(r)) for r in runs]
        return Cluster(nodes, self.network if len(nodes) > 1 else None, self.source)

    def first_devices(self, num_devices: int) -> Cluster:
        """The first ``num_devices`` devices of this cluster, node by node (the ``nodes`` sweep)."""
        if num_devices < 1 or num_devices > self.num_devices:
            raise ValueError(
                f"num_devices: must be in 1..{self.num_devices}, got {_shown(num_devices)}"
            )
        nodes, left = [], num_devices
        for n in self.nodes:
            if left == 0:
                break
            take = min(left, n.count)
            nodes.append(replace(n, count=take))
            left -= take
        return Cluster(nodes, self.network if len(nodes) > 1 else None, self.source)


def _slowest(links: Sequence[Link | None]) -> Link:
    real = [x for x in links if x is not None]
    return Link(
        "+".join(x.name for x in real),
        max(x.latency_s for x in real),
        min(x.bytes_per_s for x in real),
        max(x.call_s for x in real),
        # Only the kinds some link names (most clusters' links name none).
        tuple(
            (kind, max(x.call_of(kind) for x in real))
            for kind in COLLECTIVE_KINDS
            if kind in {k for x in real for k, _ in x.calls_s}
        ),
    )


_PEAK_FIELDS = ("tf32_flops_per_s", "bf16_flops_per_s", "fp16_flops_per_s")


def _check_type(value: object, kind: type, what: str, *, optional: bool = False) -> None:
    if not isinstance(value, kind) and not (optional and value is None):
        allowed = f"hetcoll.model.{kind.__name__}" + (" or None" if optional else "")
        raise TypeError(f"{what}: must be a {allowed}, got {type(value).__name__}")


def _check_name(name: object, kind: str) -> None:
    if not isinstance(name, str):
        raise TypeError(f"{kind}: name: must be a str, got {type(name).__name__}")


def _finite(value: float) -> bool:
    """Whether ``value`` is a float the model can compute with: an int past float's range
    (``2**1100``) is not, and ``math.isfinite`` raises OverflowError on it."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _shown(value: object) -> str:
    """``value`` for a message: an int past float's range by its size (its digits could be
    thousands, and past 4,300 ``repr`` itself raises)."""
    if isinstance(value, int) and not _finite(value):
        return f"an integer of {value.bit_length()} bits"
    return repr(value)


def _check_positive(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{what}: must be a number > 0, got {_shown(value)}")
    if not _finite(value):
        raise ValueError(f"{what}: must be finite, got {_shown(value)}")


def _check_nonnegative(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{what}: must be a number >= 0, got {_shown(value)}")
    if not _finite(value):
        raise ValueError(f"{what}: must be finite, got {_shown(value)}")


def _check_device_index(index: object, what: str, num_devices: int) -> None:
    try:
        whole = operator.index(index)  # type: ignore[arg-type]
    except TypeError:
        whole = -1
    if isinstance(index, bool) or not 0 <= whole < num_devices:
        raise ValueError(
            f"{what}: must be a device index in 0..{num_devices - 1}, got {_shown(index)}"
        )


#: The least rate a device's or link's figure may give (per second: FLOP/s, bytes/s): below
#: it, one step's seconds overflow a double (5e-324 FLOP/s once priced every plan at inf).
MIN_RATE = 1.0
#: The most seconds a fixed cost may be (a latency, a kernel's or a call's overhead): 11.6
#: days a call, far past any engine's, and steps of millions of them still finite.
MAX_FIXED_SECONDS = 1e6
# The figures of a Device, each checked by its rule (:func:`_check_figure`).
_DEVICE_FIGURES = (
    "flops_per_s", "mem_bytes_per_s", "memory_bytes", "kernel_overhead_s",
    "elementwise_bytes_per_s", "conv_flops_per_s", "pool_bytes_per_s", "conv_overhead_s",
    "first_touch_bytes_per_s", "step_overhead_s", *_PEAK_FIELDS,
)  # fmt: skip
_REQUIRED_FIGURES = {"flops_per_s", "mem_bytes_per_s", "memory_bytes", "bytes_per_s"}


def _check_figure(value: object, what: str, field: str) -> None:
    """One figure of a device or link, by its ``field``'s rule, in code and in files alike:
    a finite number; > 0 where required (the rates every prediction divides by, the memory),
    else >= 0 (0: none); a rate (``*_per_s``) given is at least :data:`MIN_RATE`, a fixed
    cost (``*_s``) at most :data:`MAX_FIXED_SECONDS`."""
    if field in _REQUIRED_FIGURES:
        _check_positive(value, what)
    else:
        _check_nonnegative(value, what)
    if field.endswith("_per_s") and 0 < value < MIN_RATE:  # type: ignore[operator]
        least = "" if field in _REQUIRED_FIGURES else "0 or "
        raise ValueError(f"{what}: must be {least}at least {MIN_RATE:g} a second, got {value!r}")
    if not field.endswith("_per_s") and field.endswith("_s") and value > MAX_FIXED_SECONDS:  # type: ignore[operator]
        raise ValueError(
            f"{what}: must be at most {MAX_FIXED_SECONDS:g} seconds, got {_shown(value)}"
        )


def _check_channel_block(block: object, what: str) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= MAX_CHANNEL_BLOCK:
        raise ValueError(
            f"{what}: must be an integer in 1..{MAX_CHANNEL_BLOCK}, got {_shown(block)}"
        )


_DEVICE_FIELDS = {
    "flops_per_s",
    "mem_bytes_per_s",
    "memory_bytes",
    "kernel_overhead_s",
    "elementwise_bytes_per_s",
    "pool_bytes_per_s",
    "conv_flops_per_s",
    "conv_channel_block",
    "conv_overhead_s",
    "first_touch_bytes_per_s",
    "step_overhead_s",
    *_PEAK_FIELDS,
}
_LINK_FIELDS = {"latency_s", "bytes_per_s", "call_s", "calls_s"}
_NODE_FIELDS = {"name", "device", "count", "link", "repeat"}


def _number(table: Mapping[str, Any], key: str, where: str, *, required: bool = True) -> Any:
    if key not in table:
        if required:
            raise ValueError(f"{where}.{key}: missing")
        return None
    value = table[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}.{key}: must be a number, got {shown(value)}")
    return value


def _unknown(table: Mapping[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(set(table) - allowed)
    if extra:
        raise ValueError(f"{where}: unknown field {shown(extra[0])} (allowed: {sorted(allowed)})")


def cluster_from_dict(doc: Mapping[str, Any], source: str = "<dict>") -> Cluster:
    """Build a :class:`Cluster` from a parsed TOML document; errors name ``source`` and the field.

    >>> cluster_from_dict({"devices": {"c": {"flops_per_s": 1e11, "mem_bytes_per_s": 2e10,
    ...     "memory_bytes": 8e9}}, "nodes": [{"name": "n", "device": "c", "count": 1}]}).num_devices
    1
    """
    if not isinstance(doc, Mapping):
        raise TypeError(
            f"doc: must be a mapping (a parsed TOML document), got {type(doc).__name__}"
        )
    _unknown(doc, {"devices", "links", "nodes", "network"}, source)
    devices: dict[str, Device] = {}
    links: dict[str, Link] = {}
    raw_devices = doc.get("devices", {})
    if not isinstance(raw_devices, Mapping) or not raw_devices:
        raise ValueError(f"{source}: devices: need at least one [devices.NAME] table")
    for name, t in raw_devices.items():
        where = f"{source}: devices.{name}"
        if not isinstance(t, Mapping):
            raise ValueError(f"{where}: must be a table")
        _unknown(t, _DEVICE_FIELDS, where)
        values = {
            k: _number(t, k, where) for k in ("flops_per_s", "mem_bytes_per_s", "memory_bytes")
        }
        for k, v in values.items():
            _check_figure(v, f"{where}.{k}", k)
        optional = {
            k: _number(t, k, where, required=False) or 0.0
            for k in (
                "kernel_overhead_s",
                "elementwise_bytes_per_s",
                "pool_bytes_per_s",
                "conv_flops_per_s",
                "conv_overhead_s",
                "first_touch_bytes_per_s",
                "step_overhead_s",
                *_PEAK_FIELDS,
            )
        }
        for k, v in optional.items():
            _check_figure(v, f"{where}.{k}", k)
        block = t.get("conv_channel_block", 1)
        _check_channel_block(block, f"{where}.conv_channel_block")
        devices[name] = Device(name, **values, **optional, conv_channel_block=block)
    raw_links = doc.get("links", {})
    if not isinstance(raw_links, Mapping):
        raise ValueError(f"{source}: links: must be a table of [links.NAME] tables")
    for name, t in raw_links.items():
        where = f"{source}: links.{name}"
        if not isinstance(t, Mapping):
            raise ValueError(f"{where}: must be a table")
        _unknown(t, _LINK_FIELDS, where)
        latency, bandwidth = _number(t, "latency_s", where), _number(t, "bytes_per_s", where)
        _check_figure(latency, f"{where}.latency_s", "latency_s")
        _check_figure(bandwidth, f"{where}.bytes_per_s", "bytes_per_s")
        call = _number(t, "call_s", where, required=False)
        if call is not None:
            _check_figure(call, f"{where}.call_s", "call_s")
        kinds = t.get("calls_s", {})
        if not isinstance(kinds, Mapping):
            raise ValueError(f"{where}.calls_s: must be a table of seconds by kind of collective")
        _unknown(kinds, set(COLLECTIVE_KINDS), f"{where}.calls_s")
        for kind in kinds:
            seconds = _number(kinds, kind, f"{where}.calls_s")
            _check_figure(seconds, f"{where}.calls_s.{kind}", "call_s")
        links[name] = Link(
            name, latency, bandwidth, call or 0.0, tuple((k, kinds[k]) for k in sorted(kinds))
        )

    def link_named(value: Any, where: str) -> Link:
        if not isinstance(value, str) or value not in links:
            raise ValueError(
                f"{where}: unknown link {shown(value)} (defined: {shown(sorted(links))})"
            )
        return links[value]

    raw_nodes = doc.get("nodes")
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise ValueError(f"{source}: nodes: need at least one [[nodes]] table")
    nodes: list[Node] = []
    total = 0
    for i, t in enumerate(raw_nodes):
        where = f"{source}: nodes[{i}]"
        if not isinstance(t, Mapping):
            raise ValueError(f"{where}: must be a table")
        _unknown(t, _NODE_FIELDS, where)
        dev = t.get("device")
        if not isinstance(dev, str) or dev not in devices:
            raise ValueError(
                f"{where}.device: unknown device {shown(dev)} (defined: {shown(sorted(devices))})"
            )
        count, repeat = t.get("count", 1), t.get("repeat", 1)
        for key, value in (("count", count), ("repeat", repeat)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}.{key}: must be an integer >= 1, got {shown(value)}")
            if value > MAX_DEVICES:
                raise ValueError(f"{where}.{key}: must be at most {MAX_DEVICES:,}, got {value:,}")
        total += count * repeat  # checked before the repeats are unrolled
        if total > MAX_DEVICES:
            raise ValueError(
                f"{where}.{'repeat' if repeat > 1 else 'count'}: the cluster reaches {total:,} "
                f"devices here, more than {MAX_DEVICES:,}"
            )
        link = link_named(t["link"], f"{where}.link") if "link" in t else None
        if count > 1 and link is None:
            raise ValueError(f"{where}.link: missing (required when count > 1)")
        name = t.get("name", f"node{i}")
        if not isinstance(name, str):
            raise ValueError(f"{where}.name: must be a string, got {shown(name)}")
        nodes.extend(
            Node(name if repeat == 1 else f"{name}[{j}]", devices[dev], count, link)
            for j in range(repeat)
        )
    network = None
    if "network" in doc:
        t = doc["network"]
        if not isinstance(t, Mapping):
            raise ValueError(f"{source}: network: must be a table")
        _unknown(t, {"link"}, f"{source}: network")
        if "link" not in t:
            raise ValueError(f"{source}: network.link: missing")
        network = link_named(t["link"], f"{source}: network.link")
    if len(nodes) > 1 and network is None:
        raise ValueError(f"{source}: network.link: missing (required with several nodes)")
    return Cluster(nodes, network, source)


def load_cluster(path: str | Path) -> Cluster:
    """Read a cluster TOML file (format in this module's docstring).

    >>> load_cluster("examples/clusters/a100_v100_cpu.toml").num_devices  # doctest: +SKIP
    18
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: must be a str or os.PathLike, got {type(path).__name__}")
    p = Path(path)
    data = read_small_file(
        p,
        "a cluster file is a TOML file",
        MAX_FILE_BYTES,
        too_long="; describe identical nodes by count and repeat",
    )
    try:
        doc = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{p}: not UTF-8 text (byte {e.start})") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{p}: not valid TOML: {e}") from None
    except RecursionError:
        raise ValueError(f"{p}: not valid TOML: arrays or tables nested too deeply") from None
    return cluster_from_dict(doc, str(p))


def dumps_cluster(
    cluster: Cluster,
    comments: Mapping[str, str] | None = None,
    extra_links: Sequence[Link] = (),
) -> str:
    """The TOML text of ``cluster`` (repeats unrolled), plus ``extra_links`` the nodes do not use;
    ``comments`` maps a device or link name to a comment line written above its table."""
    comments = comments or {}
    out: list[str] = []
    seen_dev: dict[str, Device] = {}
    seen_link: dict[str, Link] = {}
    for n in cluster.nodes:
        seen_dev.setdefault(n.device.name, n.device)
        if n.link is not None:
            seen_link.setdefault(n.link.name, n.link)
    if cluster.network is not None:
        seen_link.setdefault(cluster.network.name, cluster.network)
    for link in extra_links:
        seen_link.setdefault(link.name, link)
    for d in seen_dev.values():
        if d.name in comments:
            out.append(f"# {comments[d.name]}")
        out += [
            f'[devices."{d.name}"]',
            f"flops_per_s = {d.flops_per_s:.6g}",
            f"mem_bytes_per_s = {d.mem_bytes_per_s:.6g}",
            f"memory_bytes = {d.memory_bytes:.6g}",
            f"kernel_overhead_s = {d.kernel_overhead_s:.6g}",
            f"elementwise_bytes_per_s = {d.elementwise_rate:.6g}",
            f"pool_bytes_per_s = {d.pool_rate:.6g}",
            f"conv_flops_per_s = {d.conv_rate:.6g}",
            f"conv_channel_block = {d.conv_channel_block}",
            f"conv_overhead_s = {d.conv_call_s:.6g}",
            *(
                [f"first_touch_bytes_per_s = {d.first_touch_bytes_per_s:.6g}"]
                if d.first_touch_bytes_per_s > 0
                else []
            ),
            *([f"step_overhead_s = {d.step_overhead_s:.6g}"] if d.step_overhead_s > 0 else []),
            *(f"{k} = {getattr(d, k):.6g}" for k in _PEAK_FIELDS if getattr(d, k) > 0),
            "",
        ]
    for lk in seen_link.values():
        if lk.name in comments:
            out.append(f"# {comments[lk.name]}")
        out += [
            f'[links."{lk.name}"]',
            f"latency_s = {lk.latency_s:.6g}",
            f"bytes_per_s = {lk.bytes_per_s:.6g}",
            *([f"call_s = {lk.call_s:.6g}"] if lk.call_s > 0 else []),
            *(
                [
                    "calls_s = { "
                    + ", ".join(f"{kind} = {seconds:.6g}" for kind, seconds in lk.calls_s)
                    + " }"
                ]
                if lk.calls_s
                else []
            ),
            "",
        ]
    for n in cluster.nodes:
        out += [
            "[[nodes]]",
            f'name = "{n.name}"',
            f'device = "{n.device.name}"',
            f"count = {n.count}",
        ]
        if n.link is not None:
            out.append(f'link = "{n.link.name}"')
        out.append("")
    if cluster.network is not None:
        out += ["[network]", f'link = "{cluster.network.name}"', ""]
    return "\n".join(out)
