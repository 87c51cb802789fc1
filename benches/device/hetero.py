"""Real heterogeneity (issue 40, item 4): one GPU rank beside CPU ranks, in one gloo group,
training the demo CNN (hetcoll.lab's DemoNet on 8x8 images; synthetic data of that shape, so
that the device needs no scikit-learn).

    python benches/device/hetero.py --cluster OUT/cluster.toml --json OUT/hetero.json

For each configuration (1 GPU rank + C CPU ranks, C in ``--cpu-ranks``), in one job:

1. every rank measures its own training step (:func:`hetcoll.torch.measure_speed`, forward,
   backward and SGD step) and the fits are exchanged (:func:`hetcoll.torch.gather_speeds`);
2. the GPU alone: rank 0 trains on the whole global batch, the others wait;
3. balanced: shares from :func:`hetcoll.split` of the measured fits, each rank's batches from
   :class:`hetcoll.torch.BalancedSampler`, DDP with :func:`hetcoll.torch.register_weighted_hook`;
4. equal: the global batch split evenly, plain DDP (its mean averaging), what DDP users do;

each timed over ``--steps`` steps after ``--warmup`` (barriers around, the GPU synchronized).
The balanced step is then taken apart (:func:`step_parts`): each rank's own step without the
allreduce (DDP's ``no_sync``), and the allreduce of a gradient-sized buffer alone, with the GPU
rank's on the GPU (as DDP gives gloo its bucket) and with every rank's in host memory. Last,
a message's hop between the GPU rank and a CPU rank (:func:`hop_seconds`), as a pipeline's
boundary crosses it, beside the same hop from host memory.
The parent then predicts each of the three steps with the performance model: the CPU ranks'
device and the gloo link from ``hetcoll model calibrate`` on this machine (``--cluster``), the
GPU's from a measurement here (:func:`measure_gpu`: float32 GEMM and convolution FLOP/s, copy
bandwidth, per-kernel time), the costs from :func:`hetcoll.model.layer_costs` of DemoNet.

Without CUDA (the dry run) rank 0 is a CPU rank like the others, the JSON says
``"status": "skipped: no CUDA (dry run, rank 0 on the CPU)"`` and its figures mean nothing.
Lab code, like everything in benches/: it imports the library, the library never imports it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import hetcoll
from hetcoll import launch

SHAPE = (1, 8, 8)
CLASSES = 10
LR = 0.05


def demo_model() -> nn.Module:
    from hetcoll.lab.demo_ranks import DemoNet

    torch.manual_seed(0)
    return DemoNet()


def demo_pool(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, *SHAPE, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def sync_gpu(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def probe_sizes(batch: int) -> list[int]:
    """The batch sizes a rank's speed probe times: from one row, where a CPU rank beside a GPU
    works (a few rows a step, mostly its step's fixed cost), up to the global batch, where the
    GPU works; :func:`hetcoll.torch.measure_speed`'s fit ``a + c b`` interpolates over them.
    The first GPU run probed from ``batch // 8`` up: there a CPU rank's fixed cost was below
    the fit's noise and read 0 on most CPU ranks, and the split gave them a few rows each,
    whose fixed cost outlasted the GPU's whole step."""
    return sorted({1, 2, 4, max(1, batch // 8), max(1, batch // 2), batch})


def speeds_here(
    dev: torch.device, xd: torch.Tensor, yd: torch.Tensor, batch: int, probe_s: float
) -> list[Any]:
    """Every rank's fit of the demo CNN's training step (forward, backward, SGD) on batches of
    up to ``batch`` rows of ``xd``/``yd`` (on ``dev``), probed for at most ``probe_s`` seconds
    (:func:`hetcoll.torch.measure_speed`), exchanged (:func:`hetcoll.torch.gather_speeds`)."""
    from hetcoll.torch import gather_speeds, measure_speed

    n = len(xd)

    def make_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = (torch.arange(b) % n).to(dev)
        return xd[idx], yd[idx]

    fit = measure_speed(
        demo_model().to(dev),
        make_batch,
        nn.functional.cross_entropy,
        batch_sizes=probe_sizes(batch),
        warmup=2,
        time_budget=probe_s,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=LR),
    )
    return list(gather_speeds(fit))


def _timed(
    dev: torch.device, step: Any, batches: list[Any], warmup: int, own: bool = False
) -> float:
    """Seconds per step of ``step(batch)`` over ``batches[warmup:]``, between barriers (the
    slowest rank's); with ``own``, this rank's own: started together, each rank timing itself
    without waiting for the others."""
    import torch.distributed as dist

    for b in batches[:warmup]:
        step(b)
    sync_gpu(dev)
    dist.barrier()
    t0 = time.perf_counter()
    for b in batches[warmup:]:
        step(b)
    sync_gpu(dev)
    if not own:
        dist.barrier()
    seconds = (time.perf_counter() - t0) / max(1, len(batches) - warmup)
    if own:
        dist.barrier()
    return seconds


def step_parts(
    dev: torch.device, ddp: Any, local_step: Any, batches: list[Any], warmup: int
) -> dict[str, Any]:
    """Where a data-parallel step's time goes: every rank's own step without the gradients'
    allreduce (``local_step`` under ``ddp.no_sync()``), and the allreduce alone of a float32
    buffer of the gradients' size, timed between barriers: with this rank's buffer on its
    device (the GPU rank's on the GPU, staged through host memory by gloo, as DDP's bucket
    is) and with every rank's in host memory. Every rank calls it; each gets every rank's
    figures."""
    import torch.distributed as dist

    with ddp.no_sync():
        own = _timed(dev, local_step, batches, warmup, own=True)
    local = [0.0] * dist.get_world_size()
    dist.all_gather_object(local, own)
    numel = sum(p.numel() for p in ddp.module.parameters())
    rounds = list(range(len(batches)))
    reduced = {}
    for where, on in (("allreduce_s", dev), ("allreduce_host_s", torch.device("cpu"))):
        buf = torch.zeros(numel, device=on)
        reduced[where] = _timed(dev, lambda _, buf=buf: dist.all_reduce(buf), rounds, warmup)
    return {"local_s": local, "gradient_bytes": 4 * numel, **reduced}


#: The messages :func:`hop_seconds` times (bytes): a few floats, a micro-batch's boundary
#: activations, a whole batch's.
HOP_BYTES = (4096, 262144, 4194304)


def hop_seconds(dev: torch.device, rounds: int, warmup: int) -> list[dict[str, Any]] | None:
    """One message's seconds between rank 0 and rank 1 (half a ping-pong round trip, the median
    of ``rounds``), for each of :data:`HOP_BYTES`: from rank 0's device as the runtime sends a
    boundary (copied to host memory, sent; received into host memory, copied to the device:
    ``device_s``) and from host memory (``host_s``). Rank 0 gets the figures; every rank
    calls it (the others wait at its barriers)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    cpu = torch.device("cpu")
    rows = []
    for nbytes in HOP_BYTES:
        row: dict[str, Any] = {"bytes": nbytes}
        for name, on in (("device_s", dev), ("host_s", cpu)):
            times: list[float] = []
            if rank in (0, 1):
                t = torch.zeros(nbytes // 4, device=on if rank == 0 else cpu)
                host = torch.empty(nbytes // 4)
                for i in range(warmup + rounds):
                    sync_gpu(dev)
                    t0 = time.perf_counter()
                    if rank == 0:
                        dist.send(t.to(cpu), 1)
                        dist.recv(host, 1)
                        t.copy_(host)
                        sync_gpu(dev)
                    else:
                        dist.recv(host, 0)
                        dist.send(host, 0)
                    if i >= warmup:
                        times.append((time.perf_counter() - t0) / 2)
            row[name] = statistics.median(times) if times else None
            dist.barrier()
        rows.append(row)
    return rows if rank == 0 else None


def rank_main(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """One rank of a configuration; rank 0 returns the measurements."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hetcoll.torch import BalancedSampler, register_weighted_hook

    gpu = rank == 0 and cfg["cuda"]
    dev = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        strict_fp32()
    batch, warmup, steps = cfg["batch"], cfg["warmup"], cfg["steps"]
    n = batch * (warmup + steps)
    x, y = demo_pool(n)
    xd, yd = x.to(dev), y.to(dev)  # the GPU rank's data lives on the GPU, as a loader would put it
    loss_fn = nn.functional.cross_entropy

    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=LR)

    # 1. Each rank's own speed.
    fits = speeds_here(dev, xd, yd, batch, cfg["probe_s"])
    out: dict[str, Any] = {
        "devices": ["cuda" if (r == 0 and cfg["cuda"]) else "cpu" for r in range(world)],
        "speeds": [
            {"rank": r, "samples_per_s": f.samples_per_s, "latency_s": f.latency_s}
            for r, f in enumerate(fits)
        ],
    }

    # 2. The GPU (rank 0) alone, on the whole global batch.
    step_s: dict[str, float] = {}
    if rank == 0:
        model = demo_model().to(dev)
        opt = sgd(model.parameters())

        def alone(b: int) -> None:
            rows = slice(b * batch, (b + 1) * batch)
            opt.zero_grad()
            loss_fn(model(xd[rows]), yd[rows]).backward()
            opt.step()

        step_s["gpu_alone"] = _timed(dev, alone, list(range(warmup + steps)), warmup)
    else:
        _timed(dev, lambda b: None, [], 0)

    # 3 and 4. Balanced (measured shares, weighted hook) and equal (plain DDP).
    speeds = [f.samples_per_s for f in fits]
    latency = [f.latency_s for f in fits]
    shares = {
        "balanced": hetcoll.split(batch, speeds, latency=latency, minimum=1),
        "equal": hetcoll.split(batch, [1.0] * world),
    }
    for name, share in shares.items():
        model = demo_model().to(dev)
        ddp = DDP(model, device_ids=[0] if gpu else None)
        if name == "balanced":
            register_weighted_hook(ddp)
        opt = sgd(ddp.parameters())
        sampler = BalancedSampler(range(n), share, rank, shuffle=False)
        batches = [torch.as_tensor(idx, dtype=torch.long) for idx in sampler.batch_sampler()]

        def train(idx: torch.Tensor, ddp: Any = ddp, opt: Any = opt) -> None:
            opt.zero_grad()
            i = idx.to(dev)
            loss_fn(ddp(xd[i]), yd[i]).backward()
            opt.step()

        step_s[name] = _timed(dev, train, batches, warmup)
        if name == "balanced":
            out["balanced_parts"] = step_parts(dev, ddp, train, batches, warmup)
        del ddp
    dist.barrier()
    hops = hop_seconds(dev, steps, warmup) if world > 1 else None
    if rank != 0:
        return None
    out["hops"] = hops
    out["shares"] = shares
    out["step_s"] = step_s
    out["samples_per_s"] = {k: batch / v for k, v in step_s.items()}
    return out


def _gpu_seconds(fn: Any, repeats: int, dev: torch.device | None = None) -> float:
    """The best of ``repeats`` timed calls of ``fn``, the device synchronized after each."""
    dev = dev or torch.device("cuda", 0)
    fn()
    sync_gpu(dev)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync_gpu(dev)
        times.append(time.perf_counter() - t0)
    return min(times)


def strict_fp32() -> None:
    """float32 as float32 on the GPU (TF32 off for matmuls and convolutions): what
    :func:`measure_gpu` measures and the model's fp32 rates mean; every GPU rank runs so."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


class _Views(nn.Module):
    """Eight rounds of views (view, transpose, unsqueeze, squeeze) of a [1, 4] tensor: ops
    that launch no kernel, which the cost model does not count."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(8):
            x = x.view(1, 2, 2).transpose(1, 2).unsqueeze(0).squeeze(0).transpose(1, 2)
            x = x.reshape(1, 4)
        return x


class _CountViews(TorchDispatchMode):
    """Counts the view ops a run dispatches."""

    def __init__(self) -> None:
        super().__init__()
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.views += bool(func.is_view)
        return func(*args, **(kwargs or {}))


def _view_seconds(depth: int, dev: torch.device) -> float:
    """Host seconds of one view op in a training step on ``dev`` (synchronized): a chain of
    ``depth`` tiny linear + ReLU layers with :class:`_Views` after each, against the chain
    alone, over the views the second adds (forward and backward). Not a field of the model's
    Device: what the first GPU run's plans suggested the model misses (the LM ran 879 view ops
    a step beside 765 kernels)."""
    from hetcoll.lab.calibrate import tiny_chain

    x = torch.randn(1, 4, device=dev)
    runs = []
    for with_views in (False, True):
        layers = list(tiny_chain(depth))
        if with_views:
            layers = [m for layer in layers for m in (layer, _Views())]
        model = nn.Sequential(*layers).to(dev)

        def step(model: nn.Module = model) -> None:
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()

        step()
        count = _CountViews()
        with count:
            step()
        runs.append((_gpu_seconds(step, 20, dev), count.views))
    (plain_s, plain_views), (views_s, views) = runs
    return max(0.0, views_s - plain_s) / max(1, views - plain_views)


def host_copy_rates(dev: torch.device) -> dict[str, float | None]:
    """Bytes a second of copies between ``dev``'s memory and the host's, each way: from and
    into pageable host memory (a CUDA tensor's ``.cpu()``, and a host tensor's ``.to(dev)``),
    and pinned (page-locked, where ``dev`` is a GPU; None otherwise). A GPU rank's tensors take
    these copies around every collective gloo or MPI runs for it (its gradients, its stage's
    activations), which the performance model does not price: the figures say what they cost.
    64 MiB each way on a GPU (4 MiB on the CPU, the dry run's)."""
    n = (16 if dev.type == "cuda" else 1) << 20  # float32 elements
    on_dev = torch.ones(n, device=dev)
    rates: dict[str, float | None] = {}
    for pinned in (False, True):
        kind = "pinned" if pinned else "pageable"
        if pinned and dev.type != "cuda":
            rates[f"{kind}_to_host_bytes_per_s"] = rates[f"{kind}_from_host_bytes_per_s"] = None
            continue
        host = torch.empty(n, pin_memory=pinned)
        to_host = _gpu_seconds(lambda host=host: host.copy_(on_dev), 5, dev)
        from_host = _gpu_seconds(lambda host=host: on_dev.copy_(host), 5, dev)
        rates[f"{kind}_to_host_bytes_per_s"] = 4 * n / to_host
        rates[f"{kind}_from_host_bytes_per_s"] = 4 * n / from_host
    return rates


def measure_gpu(dev: torch.device | None = None) -> dict[str, Any]:
    """The GPU's figures for :class:`hetcoll.model.Device`, float32 (:func:`strict_fp32`):
    GEMM 4096^3 and a copy of 256 MiB; the convolutions' rate and ``kernel_overhead_s`` and
    ``conv_overhead_s`` as ``hetcoll model calibrate`` measures the CPU's
    (:mod:`hetcoll.lab.calibrate`), here on the GPU, synchronized: a training step of 24 tiny
    linear + ReLU layers per kernel the cost model counts (launch, dispatch and autograd: what
    an eager step pays per kernel); the intercept of a 3x3 64-channel convolution's forward +
    weight gradient at 1, 2 and 4 samples of 8x8 per counted kernel; its FLOPs (as the model
    counts them) on 256 samples of 16x16 over its time less those fixed costs; and
    ``step_overhead_s``, a step's own fixed cost, as
    :func:`hetcoll.lab.calibrate.measure_step_overhead_s` measures it, on this device
    (``step_probes``: the probe at its depth and at four times it, each step and residual).
    ``launch_s``:
    one tiny kernel's time in a chain of 200 (launch alone; not a field of the model's Device);
    ``view_s``: a view op's host seconds in a training step (:func:`_view_seconds`);
    ``host_copy``: copies to and from the host (:func:`host_copy_rates`). ``dev``: the GPU
    (default ``cuda:0``; another device runs the same probes, for tests)."""
    import numpy as np

    from hetcoll.lab.calibrate import (
        STEP_PROBE_DEPTH,
        conv_probe_counts,
        step_overhead_from,
        step_probe_seconds,
        tiny_chain,
    )
    from hetcoll.model import Device, layer_costs

    dev = dev or torch.device("cuda", 0)
    cuda = dev.type == "cuda"
    strict_fp32()
    n = 4096 if cuda else 256
    a = torch.randn(n, n, device=dev)
    gemm = _gpu_seconds(lambda: a @ a, 5, dev)
    big = torch.empty((64 if cuda else 4) << 20, device=dev)  # 256 MiB of float32 on the GPU
    dst = torch.empty_like(big)
    copy_s = _gpu_seconds(lambda: dst.copy_(big), 5, dev)
    tiny = torch.zeros(1, device=dev)
    chain = 200

    def launches() -> None:
        for _ in range(chain):
            tiny.add_(1.0)

    launch_s = _gpu_seconds(launches, 3, dev) / chain
    depth = 24
    costs = layer_costs(tiny_chain(depth), (4,))
    kernels = sum(k.launches for x in costs.layers for k in (*x.forward, *x.backward))
    model = tiny_chain(depth).to(dev)
    x1 = torch.randn(1, 4, device=dev)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x1).sum().backward()

    kernel_s = _gpu_seconds(step, 20, dev) / kernels
    view_s = _view_seconds(depth, dev)
    probe = nn.Conv2d(64, 64, 3, padding=1, bias=False).to(dev)

    def conv_step(b: int, size: int) -> Any:
        xs = torch.randn(b, 64, size, size, device=dev)
        grad = torch.ones(b, 64, size, size, device=dev)

        def run() -> None:
            probe.zero_grad(set_to_none=True)
            probe(xs).backward(grad)

        return run

    batches = (1, 2, 4)
    times = [_gpu_seconds(conv_step(b, 8), 10, dev) for b in batches]
    _, intercept = np.polyfit(batches, times, 1)
    conv_overhead_s = max(float(intercept), 0.0) / conv_probe_counts(1, 8)[1]
    # The rate as calibrate measures it: forward + weight gradient (an input without
    # gradient), the FLOPs the cost model counts, the kernels' fixed cost taken off first.
    maps = 256 if cuda else 8
    conv_s = _gpu_seconds(conv_step(maps, 16), 5, dev)
    flops, conv_kernels = conv_probe_counts(maps, 16)
    conv_rate = flops / max(conv_s - conv_kernels * conv_overhead_s, 0.5 * conv_s)
    figures: dict[str, Any] = {
        "flops_per_s": 2 * n**3 / gemm,
        "conv_flops_per_s": conv_rate,
        "mem_bytes_per_s": 2 * big.numel() * 4 / copy_s,
        "memory_bytes": float(torch.cuda.get_device_properties(dev).total_memory if cuda else 8e9),
        "kernel_overhead_s": kernel_s,
        "conv_overhead_s": conv_overhead_s,
    }
    # The step's fixed cost as calibrate measures the CPU's: a rank of its own on this device.
    gpu = Device("gpu", **figures)
    out = {
        "name": torch.cuda.get_device_name(dev) if cuda else str(dev),
        **figures,
        "launch_s": launch_s,
        "view_s": view_s,
        "host_copy": host_copy_rates(dev),
    }
    try:  # the scripts' figures do not depend on it: a failure is noted, not raised
        # The probe at the model's depth and at four times it: the residuals' difference is
        # what each layer adds beyond the model's kernels (the runtime's per-layer work, the
        # optimizer's per-tensor calls), which the fixed term spreads over the probe's layers.
        probes = []
        for depth in (STEP_PROBE_DEPTH, 4 * STEP_PROBE_DEPTH):
            step_s = step_probe_seconds(depth, where=str(dev))
            residual = step_overhead_from(step_s, gpu, depth)
            probes.append({"depth": depth, "step_s": step_s, "residual_s": residual})
        out["step_probes"] = probes
        out["step_overhead_s"] = probes[0]["residual_s"]
    except Exception as e:
        out["step_overhead_error"] = f"{type(e).__name__}: {e}"[:2000]
    return out


def real_cluster(
    cluster_path: str | None, gpu: dict[str, Any] | None, world: int
) -> tuple[Any, Any, str | None]:
    """The performance model's view of this machine's ranks: ``(cluster, alone, why_not)``.
    Rank 0 the GPU (``gpu``: :func:`measure_gpu`'s figures) and ranks 1.. the CPU rank of
    ``hetcoll model calibrate``'s file, all joined by its gloo link; ``alone``: rank 0 by
    itself. Without a GPU (the dry run) every rank is the calibrated CPU rank. ``why_not``
    says why there is no cluster (no calibration file), else None."""
    from hetcoll.model import Cluster, Device, Node, load_cluster

    if not cluster_path or not os.path.exists(cluster_path):
        return None, None, f"skipped: no calibration file ({cluster_path})"
    calibrated = load_cluster(cluster_path)
    cpu_node = calibrated.nodes[0]
    link = cpu_node.link or calibrated.ring_link()
    cpu = cpu_node.device
    if gpu is not None:
        known = {f.name for f in dataclasses.fields(Device)} - {"name"}
        figures = {k: v for k, v in gpu.items() if k in known}
        first = Device("gpu", **figures)
        nodes = [Node("gpu", first, 1)]
        if world > 1:
            nodes.append(Node("cpu", cpu, world - 1, link if world > 2 else None))
        return Cluster(nodes, link if world > 1 else None), Cluster([Node("gpu", first, 1)]), None
    return (
        Cluster([Node("cpu", cpu, world, link if world > 1 else None)]),
        Cluster([Node("cpu", cpu, 1)]),
        None,
    )


def without_step_overhead(cluster: Any) -> Any:
    """``cluster`` with every device's ``step_overhead_s`` 0: what the model predicted before
    it had the term (and what it predicts for loops other than hetcoll's runtime)."""
    from hetcoll.model import Cluster

    return Cluster(
        [
            dataclasses.replace(n, device=dataclasses.replace(n.device, step_overhead_s=0.0))
            for n in cluster.nodes
        ],
        cluster.network,
    )


def predict(
    cluster_path: str | None, gpu: dict[str, Any] | None, row: dict[str, Any], batch: int
) -> dict[str, Any]:
    """The performance model's step for the three runs of ``row``."""
    from hetcoll.model import layer_costs
    from hetcoll.model import predict_data_parallel as data_parallel

    cluster, alone, why_not = real_cluster(cluster_path, gpu, len(row["devices"]))
    if why_not is not None:
        return {"status": why_not}
    # DDP's loop and the plain one are not hetcoll's runtime, whose step's fixed cost
    # Device.step_overhead_s is: their predictions leave it out.
    cluster, alone = without_step_overhead(cluster), without_step_overhead(alone)
    costs = layer_costs(demo_model(), SHAPE)
    runs = {
        name: data_parallel(costs, cluster, row["shares"][name]) for name in ("balanced", "equal")
    }
    predicted = {name: p.step_s for name, p in runs.items()}
    predicted["gpu_alone"] = data_parallel(costs, alone, [batch]).step_s
    balanced = runs["balanced"]
    link = cluster.network or cluster.nodes[-1].link  # the dry run's: its one node's
    hops = [
        {"bytes": h["bytes"], "link_s": link.latency_s + h["bytes"] / link.bytes_per_s}
        for h in row.get("hops") or []
        if link is not None
    ]
    return {
        "status": "ok",
        "step_s": predicted,
        "error": {k: predicted[k] / row["step_s"][k] - 1 for k in predicted},
        # The model's balanced step by part, beside step_parts' measured ones.
        "balanced_parts": {
            "breakdown": balanced.breakdown,
            "compute_s": list(balanced.detail["compute_s_per_device"]),
            "allreduce_s": balanced.detail["allreduce_s"],
            "critical_device": balanced.detail["critical_device"],
        },
        # The model's seconds for each of row's hops: the gloo link's latency and bandwidth.
        "hops": hops,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, help="where to write the results")
    ap.add_argument("--cluster", help="hetcoll model calibrate's file (CPU ranks, gloo link)")
    ap.add_argument("--cpu-ranks", type=int, nargs="+", default=[3, 7])
    ap.add_argument("--batch", type=int, default=1024, help="the global batch")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--probe-s", type=float, default=3.0, help="each rank's speed probe budget")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per configuration")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    started = time.perf_counter()
    result: dict[str, Any] = {
        "status": "ok" if cuda else "skipped: no CUDA (dry run, rank 0 on the CPU)",
        "cuda": cuda,
        "model": "DemoNet (hetcoll.lab.demo_ranks), 1x8x8 inputs, SGD",
        "batch": args.batch,
        "warmup": args.warmup,
        "steps": args.steps,
        "cpu_threads_per_rank": 1,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "hetcoll": hetcoll.__file__,
        "gpu": None,
        "configurations": [],
    }
    if cuda:
        result["gpu"] = measure_gpu()
        torch.cuda.empty_cache()  # the ranks get the GPU's memory back
    for c in args.cpu_ranks:
        cfg = {
            "cuda": cuda,
            "batch": args.batch,
            "warmup": args.warmup,
            "steps": args.steps,
            "probe_s": args.probe_s,
        }
        t0 = time.perf_counter()
        row: dict[str, Any] = {"cpu_ranks": c, "gpu_ranks": 1 if cuda else 0}
        try:
            ranks = launch.spawn(rank_main, 1 + c, cfg, timeout=args.timeout, threads_per_rank=1)
            row.update(ranks[0])
            rate = row["samples_per_s"]
            row["balanced_over_equal"] = rate["balanced"] / rate["equal"]
            row["balanced_over_gpu_alone"] = rate["balanced"] / rate["gpu_alone"]
            total = sum(s["samples_per_s"] for s in row["speeds"])
            row["balanced_over_sum_of_speeds"] = rate["balanced"] / total
            row["prediction"] = predict(args.cluster, result["gpu"], row, args.batch)
            row["status"] = "ok"
        except Exception as e:  # one configuration failing leaves the others measured
            row["status"] = f"failed: {type(e).__name__}: {e}"[:2000]
            row["traceback"] = traceback.format_exc()[-4000:]
        row["seconds"] = time.perf_counter() - t0
        result["configurations"].append(row)
        with open(args.json, "w") as f:  # after each configuration: a timeout keeps the rest
            json.dump(result, f, indent=1)
    result["seconds"] = time.perf_counter() - started
    errors = [
        abs(e)
        for row in result["configurations"]
        for e in row.get("prediction", {}).get("error", {}).values()
    ]
    if errors:
        result["prediction_error"] = {"median": statistics.median(errors), "worst": max(errors)}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1, default=str))
    failed = [r for r in result["configurations"] if r["status"] != "ok"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
