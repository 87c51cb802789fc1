"""The seed-002 hypergraph of a CNN, and what partitioning it buys against simpler splits.

Node-wise model parallelism (seed 002) gives every device a set of *filters* (conv output
channels) and *neurons* (linear outputs). :func:`network_hypergraph` builds the hypergraph of that
decision:

- one vertex per filter / neuron, weighted by the FLOPs it costs per sample in the forward pass
  (``2 * C_in/groups * k_h * k_w * H_out * W_out`` for a filter, ``2 * in_features`` for a neuron);
- one net per feature map (a filter's output channel, a neuron's output) connecting its producer
  to every filter / neuron of the next layer that reads it, weighted by the map's size in bytes
  per sample *where it is read* (after any pooling, which is per channel and done by the
  producer before sending).

A partition's connectivity-minus-one (``km1``) is then exactly the bytes per sample that producers
send to the other devices reading their maps in the forward pass; the backward pass sends as many
bytes of activation gradients back. :func:`partition_report` compares, for given device speeds,
the hypergraph partition with the even and the speed-proportional filter split of every layer and
with data parallelism.

What the model counts, and what it does not:

- FLOPs of convolutions and linear layers only (activations, pooling, normalisation are cheap and
  per channel: they run where their channel lives); bias additions are ignored.
- Communication *volume* (bytes summed over all senders), not time: no latency, no overlap, no
  critical path. A partition that gives whole layers to different devices moves few bytes but
  serialises the devices unless the batch is pipelined; the report shows balance of total work,
  not this dependency.
- The network input is taken to be present on every device (like the data in data parallelism)
  and is not a net. Data parallelism's volume is a ring allreduce of the gradients,
  ``2 (p - 1) * parameter bytes`` in total per step.
- The network is read as a chain of its leaf modules in execution order; branches (residual
  additions, concatenations) are not modelled, and layers other than Conv2d / Linear that hold
  parameters (e.g. BatchNorm's per-channel scale) are treated as per-channel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

import hetcoll

if TYPE_CHECKING:
    import torch

__all__ = ["NetworkHypergraph", "PartitionReport", "network_hypergraph", "partition_report"]


@dataclass
class NetworkHypergraph:
    """Vertices are filters / neurons (FLOPs per sample), nets are feature maps (bytes per sample).

    ``layers`` lists ``(module name, first vertex, vertex count)`` per Conv2d / Linear layer;
    ``parameter_bytes`` is the size of all trainable parameters (what data parallelism allreduces).
    """

    num_vertices: int
    nets: list[np.ndarray]
    vertex_weights: np.ndarray
    net_weights: np.ndarray
    layers: list[tuple[str, int, int]]
    parameter_bytes: int
    bytes_per_element: int = 4


def _trace(model: torch.nn.Module, shape: tuple[int, ...], calls: list[Any]) -> None:
    """One forward pass of one sample of ``shape`` in the model's own dtype (float64 models
    used to be fed float32 zeros and blame ``input_shape``): on the meta device first (no memory,
    no arithmetic), on real zeros on the model's device if meta cannot run it (a
    forward that reads values). A failure then is the shape's."""
    import torch
    from torch.func import functional_call

    tensors = [*model.parameters(), *model.buffers()]
    dtypes = {t.dtype for t in tensors if t.is_floating_point()}
    if len(dtypes) > 1:
        raise ValueError(
            f"model: parameters and buffers mix floating-point dtypes {sorted(map(str, dtypes))}"
        )
    dtype = dtypes.pop() if dtypes else torch.get_default_dtype()
    device = tensors[0].device if tensors else torch.device("cpu")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            try:
                meta = {
                    k: torch.empty_like(v, device="meta")
                    for k, v in [*model.named_parameters(), *model.named_buffers()]
                }
                x = torch.empty((1, *shape), dtype=dtype, device="meta")
                functional_call(model, meta, (x,))
                return
            except Exception:
                calls.clear()  # the partial trace of the failed attempt
            try:
                model(torch.zeros((1, *shape), dtype=dtype, device=device))
            except Exception as exc:  # the user's model rejected the shape
                raise ValueError(
                    f"input_shape: the model's forward pass failed on {shape} ({dtype}): {exc}"
                ) from exc
    finally:
        model.train(was_training)


def network_hypergraph(
    model: torch.nn.Module,
    input_shape: tuple[int, ...],
    *,
    bytes_per_element: int = 4,
    max_vertices: int | None = None,
) -> NetworkHypergraph:
    """The seed-002 hypergraph of ``model`` for inputs of ``input_shape`` (one sample, no batch).

    Runs one forward pass in the model's dtype, on the meta device where the model allows it, to
    read every layer's shapes. Raises ``ValueError`` naming ``model`` for a model it cannot read
    as a chain of layers (or whose parameters mix dtypes), ``input_shape`` for a bad shape, and
    ``max_vertices`` where the input's channels or the filters and neurons outnumber it
    (checked before any list of them is built: 10**11 input features once filled the memory).

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(),
    ...                           torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2))
    >>> h = network_hypergraph(net, (3, 8, 8))
    >>> h.num_vertices, len(h.nets), int(h.vertex_weights[0]), int(h.net_weights[0])
    (6, 4, 1944, 144)
    """
    import torch

    from hetcoll.model.costs.inputs import sample_shape  # imports torch

    shape = sample_shape(input_shape)
    if (
        isinstance(bytes_per_element, bool)
        or not isinstance(bytes_per_element, int)
        or not 1 <= bytes_per_element <= 64
    ):  # NaN once weighted every net NaN
        raise ValueError(
            f"bytes_per_element: must be an integer in 1..64, got {bytes_per_element!r}"
        )
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: must be a torch.nn.Module, got {type(model).__name__}")
    if max_vertices is not None and (
        isinstance(max_vertices, bool) or not isinstance(max_vertices, int) or max_vertices < 1
    ):
        raise ValueError(f"max_vertices: must be an integer >= 1 or None, got {max_vertices!r}")

    calls: list[tuple[str, torch.nn.Module, tuple[int, ...], tuple[int, ...]]] = []
    handles = []
    for name, module in model.named_modules():
        if next(module.children(), None) is not None:
            continue

        def hook(mod: Any, inputs: Any, output: Any, name: str = name) -> None:
            if inputs and isinstance(inputs[0], torch.Tensor) and isinstance(output, torch.Tensor):
                calls.append((name, mod, tuple(inputs[0].shape), tuple(output.shape)))

        handles.append(module.register_forward_hook(hook))
    try:
        _trace(model, shape, calls)
    finally:
        for h in handles:
            h.remove()

    if max_vertices is not None:
        filters = sum(
            mod.out_channels if isinstance(mod, torch.nn.Conv2d) else mod.out_features
            for _, mod, _, _ in calls
            if isinstance(mod, torch.nn.Conv2d | torch.nn.Linear)
        )
        if max(filters, shape[0]) > max_vertices:
            raise ValueError(
                f"max_vertices: the model has {filters:,} filters and neurons on an input of "
                f"{shape[0]:,} channels, more than {max_vertices:,}"
            )
    vertex_weights: list[float] = []
    nets: list[np.ndarray] = []
    net_weights: list[float] = []
    layers: list[tuple[str, int, int]] = []
    # The maps flowing out of the last layer: producer vertex per channel (None: the input) and
    # elements per channel per sample; always len(producers) * per_channel == previous_numel.
    producers: list[int | None] = [None] * shape[0]
    per_channel = math.prod(shape[1:])
    previous_numel = math.prod(shape)

    for name, mod, in_shape, out_shape in calls:
        in_numel = math.prod(in_shape[1:])
        if in_numel != previous_numel:
            raise ValueError(
                f"model: {name or type(mod).__name__} reads {in_numel} values per sample but the "
                f"previous layer produced {previous_numel}; only chains of layers are supported "
                "(no residual or concatenating branches)"
            )
        out_numel = math.prod(out_shape[1:])
        if isinstance(mod, torch.nn.Conv2d):
            channels = in_shape[1]
            if channels != len(producers):
                producers, per_channel = _regroup(
                    producers, per_channel, channels, name, max_vertices
                )
            first = len(vertex_weights)
            g = mod.groups
            out_c, in_c = mod.out_channels, mod.in_channels
            kh, kw = mod.kernel_size
            h_out, w_out = out_shape[2], out_shape[3]
            flops = 2.0 * (in_c // g) * kh * kw * h_out * w_out
            vertex_weights.extend([flops] * out_c)
            in_per_group, out_per_group = in_c // g, out_c // g
            for c, p in enumerate(producers):
                group = c // in_per_group
                readers = np.arange(
                    first + group * out_per_group, first + (group + 1) * out_per_group
                )
                _add_net(nets, net_weights, p, readers, per_channel * bytes_per_element)
            layers.append((name, first, out_c))
            producers = list(range(first, first + out_c))
            per_channel = h_out * w_out
        elif isinstance(mod, torch.nn.Linear):
            features = in_shape[-1]
            rows = in_numel // features  # leading dims (tokens) share the weights
            first = len(vertex_weights)
            vertex_weights.extend([2.0 * features * rows] * mod.out_features)
            readers = np.arange(first, first + mod.out_features)
            for p in producers:
                _add_net(nets, net_weights, p, readers, per_channel * bytes_per_element)
            layers.append((name, first, mod.out_features))
            producers = list(range(first, first + mod.out_features))
            per_channel = rows
        elif isinstance(mod, torch.nn.Conv1d | torch.nn.Conv3d | torch.nn.ConvTranspose2d):
            raise ValueError(f"model: layer {name} ({type(mod).__name__}) is not supported")
        else:
            # Per-channel layers (activations, pooling, normalisation, dropout, flatten): the
            # channel stays with its producer, only its size per sample changes.
            if len(out_shape) >= 3 and out_shape[1] == len(producers):
                per_channel = math.prod(out_shape[2:])
            elif out_numel % len(producers) == 0:
                per_channel = out_numel // len(producers)
            else:
                producers, per_channel = _regroup(
                    producers, per_channel, out_numel, name, max_vertices
                )
        previous_numel = out_numel

    if not layers:
        raise ValueError("model: has no Conv2d or Linear layer")
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return NetworkHypergraph(
        num_vertices=len(vertex_weights),
        nets=nets,
        vertex_weights=np.asarray(vertex_weights, dtype=np.float64),
        net_weights=np.asarray(net_weights, dtype=np.float64),
        layers=layers,
        parameter_bytes=params * bytes_per_element,
        bytes_per_element=bytes_per_element,
    )


def _add_net(nets: list, weights: list, producer: int | None, readers: np.ndarray, nbytes: int):
    """A net from ``producer`` to ``readers``; maps of the input (no producer) are everywhere."""
    if producer is None:
        return
    nets.append(np.concatenate(([producer], readers)).astype(np.int64))
    weights.append(float(nbytes))


def _regroup(
    producers: list, per_channel: int, channels: int, name: str, most: int | None = None
) -> tuple[list, int]:
    """The same values seen as ``channels`` maps (e.g. a reshape): each new map's producer is the
    producer of its first value; only exact refinements of the old grouping are supported (and
    at most ``most`` maps, checked before their list is built)."""
    if most is not None and channels > most:
        raise ValueError(f"max_vertices: layer {name} reads {channels:,} maps, more than {most:,}")
    total = len(producers) * per_channel
    if total % channels or ((total // channels) and per_channel % (total // channels)):
        raise ValueError(f"model: cannot follow the channels into layer {name}")
    size = total // channels
    return [producers[(i * size) // per_channel] for i in range(channels)], size


@dataclass
class Strategy:
    """One way to share the work: bytes moved per step and balance of the work."""

    name: str
    bytes_per_step: float
    imbalance: float
    note: str = ""


@dataclass
class PartitionReport:
    """Communication volume per training step (forward + backward, all senders) and load balance
    (slowest device's time over the ideal time, 1.0 is perfect) of each strategy."""

    speeds: list[float]
    batch_size: int
    strategies: list[Strategy] = field(default_factory=list)

    def table(self) -> str:
        """A plain-text table; volume also relative to data parallelism."""
        dp = next((s.bytes_per_step for s in self.strategies if s.name == "data parallel"), None)
        lines = [
            f"speeds {self.speeds}, batch {self.batch_size}",
            f"{'strategy':<32} {'MB/step':>10} {'vs DP':>7} {'imbalance':>10}  note",
        ]
        for s in self.strategies:
            rel = f"{s.bytes_per_step / dp:7.3f}" if dp else f"{'':>7}"
            lines.append(
                f"{s.name:<32} {s.bytes_per_step / 1e6:10.3f} {rel} {s.imbalance:10.3f}  {s.note}"
            )
        return "\n".join(lines)


def partition_report(
    model: torch.nn.Module | NetworkHypergraph,
    input_shape: tuple[int, ...] | None,
    speeds: list[float],
    *,
    batch_size: int = 64,
    epsilon: float = 0.03,
    seed: int = 0,
) -> PartitionReport:
    """Compare node-wise splits of ``model`` over devices of ``speeds`` (FLOP/s, relative is fine).

    Strategies: the hypergraph partition (targets proportional to speed), every layer's filters
    split evenly, every layer's filters split in proportion to speed (``hetcoll.split``), and data
    parallelism (samples split in proportion to speed, gradients allreduced).

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
    ...                           torch.nn.Linear(8 * 6 * 6, 4))
    >>> r = partition_report(net, (3, 8, 8), [2.0, 1.0], batch_size=8)
    >>> [s.name for s in r.strategies][0]
    'hypergraph partition'
    """
    if isinstance(model, NetworkHypergraph):
        h = model
    elif input_shape is None:
        raise ValueError("input_shape: is required when model is a torch module")
    else:
        h = network_hypergraph(model, input_shape)
    speeds = [float(s) for s in speeds]
    if not speeds or any(not math.isfinite(s) or s <= 0 for s in speeds):
        raise ValueError(f"speeds: must be finite and > 0, got {speeds}")
    if batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
    k = len(speeds)
    total_speed = sum(speeds)
    targets = [s / total_speed for s in speeds]
    report = PartitionReport(speeds=speeds, batch_size=batch_size)
    flops = h.vertex_weights

    def imbalance(parts: np.ndarray) -> float:
        load = np.bincount(parts, weights=flops, minlength=k)
        ideal = float(flops.sum()) / total_speed
        return float(max(load[b] / speeds[b] for b in range(k)) / ideal) if ideal > 0 else 1.0

    def volume(parts: np.ndarray) -> float:
        # Forward maps plus backward gradients of the same size, for every sample.
        return 2.0 * batch_size * hetcoll.km1(h.nets, parts, h.net_weights)

    if k <= h.num_vertices:
        parts = hetcoll.partition_hypergraph(
            h.num_vertices,
            h.nets,
            targets,
            vertex_weights=h.vertex_weights,
            net_weights=h.net_weights,
            epsilon=epsilon,
            seed=seed,
        )
        report.strategies.append(
            Strategy("hypergraph partition", volume(parts), imbalance(parts), f"eps={epsilon}")
        )
    for name, weights in [("even filter split", [1.0] * k), ("speed-proportional split", speeds)]:
        parts = np.empty(h.num_vertices, dtype=np.int64)
        for _, first, count in h.layers:
            shares = hetcoll.split(count, weights)
            parts[first : first + count] = np.repeat(np.arange(k), shares)
        report.strategies.append(Strategy(name, volume(parts), imbalance(parts), "every layer"))
    shares = hetcoll.split(batch_size, speeds)
    per_sample = float(flops.sum())
    ideal = batch_size * per_sample / total_speed
    dp_imbalance = max(b * per_sample / s for b, s in zip(shares, speeds)) / ideal
    report.strategies.append(
        Strategy(
            "data parallel",
            2.0 * (k - 1) * h.parameter_bytes,
            dp_imbalance,
            f"samples {shares}, ring allreduce",
        )
    )
    return report
