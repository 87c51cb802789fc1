"""The performance model: cost terms against hand-computed cases and simulations, layer costs
against torch's own FLOP counter, monotonicity, the planner, bad cluster files, the CLI, and
(on real gloo / MPI processes) calibration and a validation subset."""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hetcoll
from hetcoll.cli import main
from hetcoll.model import (
    Cluster,
    Device,
    Link,
    Node,
    cluster_from_dict,
    layer_costs,
    load_cluster,
    networks,
    plan,
    terms,
)
from hetcoll.model import predict_data_parallel as data_parallel
from hetcoll.model import predict_filter_parallel as filter_parallel
from hetcoll.model import predict_pipeline as pipeline
from hetcoll.model.hardware import COLLECTIVE_KINDS, MAX_CHANNEL_BLOCK
from hetcoll.model.predict import ddp_buckets, even_batch_shares

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "clusters"


# ---------------------------------------------------------------- cost terms, by hand


def test_gemm_terms_by_hand() -> None:
    assert terms.gemm_flops(2, 3, 4) == 48.0
    assert terms.gemm_bytes(2, 3, 4, 4) == (6 + 8 + 12) * 4.0


def test_roofline_compute_and_memory_bound() -> None:
    # 1 GFLOP on 10 GFLOP/s with 1 MB at 1 GB/s: compute-bound, 0.1 s.
    assert float(terms.roofline_seconds(1e9, 1e6, 1e10, 1e9)) == pytest.approx(0.1)
    # Same FLOPs, 1 GB: memory-bound, 1 s; plus a 5 us launch.
    assert float(terms.roofline_seconds(1e9, 1e9, 1e10, 1e9, 5e-6)) == pytest.approx(1.000005)
    # Pure data movement costs its bytes (PyDTNN's min() form would give zero).
    assert float(terms.roofline_seconds(0.0, 2e9, 1e10, 1e9)) == pytest.approx(2.0)


def _simulated_ring_allreduce(n_bytes: float, p: int, alpha: float, bw: float) -> float:
    """The ring step by step: p-1 reduce-scatter and p-1 allgather steps, every rank sending
    one n/p chunk per step to its neighbour at the same time."""
    chunk = n_bytes / p
    clock = 0.0
    for _ in range(2 * (p - 1)):
        clock += alpha + chunk / bw
    return clock


@pytest.mark.parametrize("p", [2, 3, 4, 8, 64])
def test_ring_allreduce_matches_step_by_step_ring(p: int) -> None:
    n, alpha, bw = 8e6, 3e-5, 2e9
    got = float(terms.ring_allreduce_seconds(n, p, alpha, bw, reduce_bytes_per_s=math.inf))
    assert got == pytest.approx(_simulated_ring_allreduce(n, p, alpha, bw))
    # The seed-003 formula written out, reduction term included (3 n bytes at 10 GB/s).
    with_reduce = float(terms.ring_allreduce_seconds(n, p, alpha, bw, 1e10))
    expect = 2 * (p - 1) * alpha + 2 * (p - 1) / p * n / bw + (p - 1) / p * (3 * n / 1e10)
    assert with_reduce == pytest.approx(expect)
    assert float(terms.ring_allreduce_seconds(n, 1, alpha, bw, 1e10)) == 0.0


def test_allgatherv_uneven_pieces_wait_for_the_largest() -> None:
    pieces = [4e6, 1e6, 1e6]
    p, alpha, bw = 3, 1e-5, 1e9
    # Ring step s: rank r forwards piece (r - s) mod p; the step ends when the largest is through.
    clock = sum(alpha + max(pieces[(r - s) % p] for r in range(p)) / bw for s in range(p - 1))
    assert float(terms.ring_allgatherv_seconds(max(pieces), p, alpha, bw)) == pytest.approx(clock)


def test_pipeline_and_optimizer_terms() -> None:
    assert float(terms.pipeline_seconds(2.0, 4, 8)) == 22.0
    assert float(terms.pipeline_bubble_seconds(2.0, 4)) == 6.0
    assert float(terms.optimizer_update_seconds(1e9, 1e9, 2)) == 7.0
    assert float(terms.point_to_point_seconds(1e9, 0.5, 1e9)) == 1.5
    assert float(terms.broadcast_seconds(1e9, 5, 0.5, 1e9)) == 4.5  # 3 rounds of a tree
    assert float(terms.broadcast_seconds(1e9, 1, 0.5, 1e9)) == 0.0


# ---------------------------------------------------------------- layer costs


def test_linear_layer_costs_by_hand() -> None:
    c = layer_costs(nn.Linear(4, 3), (4,))
    (layer,) = c.layers
    assert layer.params == 15 and layer.gradient_bytes == 60.0
    # GEMM 2*1*3*4 = 24; backward: dW GEMM 24 (no dX: the input needs no gradient). The bias
    # add and its gradient move bytes but count no FLOPs, as in FlopCounterMode.
    assert c.forward_flops(1) == 24.0
    assert c.backward_flops(1) == 24.0
    assert [k.name for k in layer.forward] == ["gemm", "bias"]
    assert layer.out_bytes_per_sample == 12.0


def test_conv_layer_costs_by_hand_and_against_torch_flop_counter() -> None:
    from torch.utils.flop_counter import FlopCounterMode

    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 16, 3, stride=2))
    c = layer_costs(model, (3, 32, 32))
    first, second = c.layers
    gemm = next(k for k in first.forward if k.name == "gemm")
    assert gemm.flops(1) == 2 * 8 * (32 * 32) * (3 * 9)  # 2 * filters * positions * C*kh*kw
    assert first.out_bytes_per_sample == 8 * 32 * 32 * 4
    assert [k.name for k in first.backward] == ["gemm-dW", "bias-grad"]  # input needs no grad
    assert "gemm-dX" in [k.name for k in second.backward]
    # torch's FLOP counter, forward and backward, on a real batch of 5.
    x = torch.randn(5, 3, 32, 32)
    fwd, bwd = FlopCounterMode(display=False), FlopCounterMode(display=False)
    with fwd:
        y = model(x)
    with bwd:
        y.sum().backward()
    ours_f = sum(k.flops(5) for layer in c.layers for k in layer.forward if k.name == "gemm")
    ours_b = sum(
        k.flops(5) for layer in c.layers for k in layer.backward if k.name.startswith("gemm")
    )
    assert ours_f == fwd.get_total_flops()
    assert ours_b == bwd.get_total_flops()


def test_grouped_conv_by_hand() -> None:
    # torch's FlopCounterMode counts a grouped conv's weight gradient as if ungrouped (2x for
    # groups=2), so this case is checked by hand only: every GEMM is 2 * (16/2) * 225 * (8/2*9)
    # per group, times 2 groups.
    (layer,) = layer_costs(nn.Conv2d(8, 16, 3, stride=2, groups=2, bias=False), (8, 32, 32)).layers
    per_gemm = 2 * 8 * 15 * 15 * 36 * 2
    assert layer.forward_flops(1) == per_gemm
    assert layer.backward_flops(1) == per_gemm  # dW only: the input needs no gradient


@pytest.mark.parametrize("name", ["cnn", "vgg", "resnet"])
def test_builtin_networks_gemm_flops_agree_with_torch(name: str) -> None:
    from torch.utils.flop_counter import FlopCounterMode

    model = networks.build(name, (3, 32, 32))
    c = layer_costs(model, (3, 32, 32))
    counter = FlopCounterMode(display=False)
    with counter, torch.device("meta"):
        pass
    x = torch.empty(2, 3, 32, 32, device="meta")
    meta = networks.build(name, (3, 32, 32)).to("meta")
    with counter:
        meta(x)
    ours = sum(k.flops(2) for layer in c.layers for k in layer.forward if k.name == "gemm")
    assert ours == counter.get_total_flops()
    assert c.params == sum(p.numel() for p in model.parameters())


class _Gram(nn.Module):
    """A leaf module the cost model has no rule for: x -> x x^T."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ x.transpose(-1, -2)


def test_unknown_leaf_module_is_counted_by_flop_counter() -> None:
    c = layer_costs(nn.Sequential(nn.Linear(8, 8), _Gram()), (4, 8))
    gram = c.layers[1]
    assert gram.kind == "_Gram"
    assert gram.forward_flops(1) == 2 * 4 * 4 * 8
    assert gram.backward_flops(1) > 0


def test_layer_costs_bad_input() -> None:
    with pytest.raises(TypeError, match="model"):
        layer_costs("not a model", (3, 32, 32))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="input"):
        layer_costs(networks.cnn(), "3x0x32")
    with pytest.raises(ValueError, match="input_shape"):
        layer_costs(networks.cnn(), (5, 32, 32))  # conv expects 3 channels
    with pytest.raises(ValueError, match="model"):
        networks.build("nosuchnet", (3, 32, 32))


# ---------------------------------------------------------------- hardware files


def test_example_clusters_load() -> None:
    mixed = load_cluster(EXAMPLES / "a100_v100_cpu.toml")
    assert mixed.num_devices == 18
    assert {d.name for d in mixed.devices} == {"a100-sxm4-40gb", "v100-sxm2-32gb", "epyc-7763-x2"}
    assert mixed.ring_link().bytes_per_s == 25e9  # InfiniBand is the ring's bottleneck
    big = load_cluster(EXAMPLES / "a100_v100_1024.toml")
    assert big.num_devices == 1024


_GOOD = """
[devices.gpu]
flops_per_s = 1e13
mem_bytes_per_s = 1e12
memory_bytes = 1e10

[links.fast]
latency_s = 1e-6
bytes_per_s = 1e11

[[nodes]]
device = "gpu"
count = 2
link = "fast"
"""


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        ("flops_per_s = 1e13", "flops_per_s = -1", "devices.gpu.flops_per_s"),
        ("flops_per_s = 1e13", "", "devices.gpu.flops_per_s"),
        ("memory_bytes = 1e10", 'memory_bytes = "lots"', "devices.gpu.memory_bytes"),
        ("latency_s = 1e-6", "latency_s = -1e-6", "links.fast.latency_s"),
        ("bytes_per_s = 1e11", "bytes_per_s = 0", "links.fast.bytes_per_s"),
        ('link = "fast"', 'link = "slow"', "nodes[0].link"),
        ('link = "fast"', "", "nodes[0].link"),
        ('device = "gpu"', 'device = "tpu"', "nodes[0].device"),
        ("count = 2", "count = 0", "nodes[0].count"),
        ("count = 2", "count = 2\ncolour = 'red'", "colour"),
        ("[devices.gpu]", "[devices.gpu]\nflops = 3", "flops"),
        ("[devices.gpu]", "[devices.gpu]\nconv_flops_per_s = -2", "devices.gpu.conv_flops_per_s"),
        ("[devices.gpu]", "[devices.gpu]\nconv_channel_block = 0", "conv_channel_block"),
        ("[devices.gpu]", "[devices.gpu]\nconv_channel_block = 1.5", "conv_channel_block"),
        ("[devices.gpu]", "[devices.gpu]\nconv_overhead_s = -1e-4", "devices.gpu.conv_overhead_s"),
        ("latency_s = 1e-6", "latency_s = 1e-6\ncall_s = -1e-5", "links.fast.call_s"),
        ("latency_s = 1e-6", "latency_s = 1e-6\ncall_s = 'slow'", "links.fast.call_s"),
        ("latency_s = 1e-6", "latency_s = 1e-6\ncalls_s = { reduce = 1e-5 }", "links.fast.calls_s"),
        ("latency_s = 1e-6", "latency_s = 1e-6\ncalls_s = { allreduce = -1.0 }", "allreduce"),
        ("latency_s = 1e-6", "latency_s = 1e-6\ncalls_s = 3", "links.fast.calls_s"),
    ],
)
def test_bad_cluster_files_name_file_and_field(
    tmp_path: Path, old: str, new: str, field: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(_GOOD.replace(old, new))
    with pytest.raises(ValueError) as e:
        load_cluster(path)
    assert str(path) in str(e.value) and field in str(e.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bytes_per_s": -5.0}, r"^Link 'x': bytes_per_s: must be a number > 0, got -5.0"),
        ({"bytes_per_s": 0}, r"^Link 'x': bytes_per_s: must be a number > 0, got 0"),
        ({"bytes_per_s": float("nan")}, r"^Link 'x': bytes_per_s: must be a number > 0"),
        ({"bytes_per_s": "5e9"}, r"^Link 'x': bytes_per_s: must be a number > 0"),
        ({"bytes_per_s": True}, r"^Link 'x': bytes_per_s: must be a number > 0"),
        ({"latency_s": -1e-6}, r"^Link 'x': latency_s: must be a number >= 0"),
        ({"call_s": float("inf")}, r"^Link 'x': call_s: must be finite"),
    ],
)
def test_a_link_made_in_code_names_its_bad_field(kwargs: dict[str, Any], message: str) -> None:
    """The constructor checks what a cluster file's loader checks (it once checked its
    bandwidth in unreachable code, so a negative one predicted negative seconds)."""
    with pytest.raises(ValueError, match=message):
        Link(**{"name": "x", "latency_s": 1e-6, "bytes_per_s": 5e9, **kwargs})
    # A device talking to itself: an infinite bandwidth, in code only.
    assert Link("local", 0.0, math.inf).bytes_per_s == math.inf


def test_cluster_and_shape_arguments_of_another_type_are_named() -> None:
    with pytest.raises(TypeError, match=r"^path: must be a str or os.PathLike, got NoneType"):
        load_cluster(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^doc: must be a mapping"):
        cluster_from_dict(None)  # type: ignore[arg-type]
    from hetcoll.model.costs.records import parse_shape

    with pytest.raises(TypeError, match=r"^input: must be a str"):
        parse_shape(None)  # type: ignore[arg-type]


def test_bad_cluster_files_syntax_missing_and_network(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(_GOOD)
    assert load_cluster(path).num_devices == 2
    path.write_text(_GOOD + "\n[[nodes]]\ndevice = 'gpu'\n")  # two nodes, no network
    with pytest.raises(ValueError, match=r"c\.toml: network\.link"):
        load_cluster(path)
    path.write_text("[devices.gpu\n")
    with pytest.raises(ValueError, match=r"c\.toml: not valid TOML"):
        load_cluster(path)
    with pytest.raises(ValueError, match=r"nothere\.toml"):
        load_cluster(tmp_path / "nothere.toml")
    # Values of a large file, echoed in part: a device's name, a count, 3,000 devices.
    many = "".join(
        f"[devices.d{i}]\nflops_per_s = 1e12\nmem_bytes_per_s = 1e11\n"
        f"memory_bytes = 1e9\nkernel_overhead_s = 1e-6\n"
        for i in range(3_000)
    )
    for nodes in (f'device = "{"x" * 300_000}"', f"device = 'd0'\ncount = {[1] * 50_000}"):
        path.write_text(f"{many}\n[[nodes]]\n{nodes}\n")
        with pytest.raises(ValueError, match=r"c\.toml: nodes\[0\]\.") as caught:
            load_cluster(path)
        assert len(str(caught.value)) < 1000, len(str(caught.value))


# ---------------------------------------------------------------- predictions


def _cluster(
    devs: list[tuple[float, float]], bw: float = 1e9, lat: float = 1e-5, mem: float = 1e10
) -> Cluster:
    nodes = [Node(f"n{i}", Device(f"d{i}", f, m, mem, 1e-6), 1) for i, (f, m) in enumerate(devs)]
    return Cluster(nodes, Link("net", lat, bw) if len(nodes) > 1 else None)


@pytest.fixture(scope="module")
def cnn_costs():  # type: ignore[no-untyped-def]
    return layer_costs(networks.cnn(), (3, 32, 32))


def test_every_collective_call_pays_the_links_call_cost(cnn_costs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A link's ``call_s`` is paid once by every collective call, whatever its bytes, or its
    kind's own (``calls_s``): DDP's step without overlap pays the allreduce's for each bucket
    and the broadcast's for the buffers; a file carries both and a cluster's ring over several
    links takes the largest of each; point-to-point sends (a pipeline's) pay neither."""
    from hetcoll.model.hardware import dumps_cluster

    call, allreduce = 3e-4, 1e-3
    dev = Device("d", 1e11, 2e10, 1e10, 1e-6)
    plain, costly = (
        Cluster([Node("n", dev, 2, Link("l", 1e-5, 1e9, c, (("allreduce", r),) if c else ()))])
        for c, r in ((0.0, 0.0), (call, allreduce))
    )
    buckets = len(ddp_buckets(cnn_costs))
    assert buckets >= 2 and cnn_costs.buffer_bytes > 0  # one broadcast of the buffers
    a, b = (data_parallel(cnn_costs, c, [16, 16], overlap=False) for c in (plain, costly))
    assert b.step_s - a.step_s == pytest.approx(buckets * allreduce + call, rel=1e-9)
    assert terms.all_to_all_seconds(0.0, 1, 1.0, 1.0, 1.0) == 0.0  # one rank calls nobody
    path = tmp_path / "c.toml"
    path.write_text(dumps_cluster(costly))
    assert "call_s = 0.0003" in path.read_text() and "allreduce = 0.001" in path.read_text()
    assert load_cluster(path).nodes[0].link == costly.nodes[0].link
    assert "call_s" not in dumps_cluster(plain)
    net = Link("net", 1e-5, 1e9, 1e-4, (("broadcast", 2e-3),))
    two = Cluster([Node("a", dev, 2, costly.nodes[0].link), Node("b", dev, 1)], net)
    ring = two.ring_link()
    assert ring.call_s == call and ring.call_of("allreduce") == allreduce
    assert ring.call_of("broadcast") == 2e-3 and ring.call_of("all_to_all") == call
    for bad in ((-1.0, ()), (0.0, (("reduce", 1.0),)), (0.0, (("allreduce", 1.0),) * 2)):
        with pytest.raises(ValueError, match=r"calls?_s"):
            Link("l", 1e-5, 1e9, *bad)
    with pytest.raises(ValueError, match="kind"):
        ring.call_of("reduce")
    # A pipeline's activations and gradients go point to point; its one collective is the
    # step's loss, summed over the ranks as Parallel.step sums it.
    stages = pipeline(cnn_costs, plain, 16, 2).step_s
    assert pipeline(cnn_costs, costly, 16, 2).step_s == pytest.approx(stages + allreduce, rel=1e-9)


def test_a_filter_splits_reductions_pay_hetcolls_own_call_cost(cnn_costs) -> None:  # type: ignore[no-untyped-def]
    """The filter-split layers' reductions go through hetcoll.allreduce: each pays its cost per
    call (``hetcoll_allreduce``), once, in lock step; the engine's allreduce cost is DDP's."""
    dev = Device("d", 1e11, 2e10, 1e10, 1e-6)

    def split(calls_s: tuple[tuple[str, float], ...]) -> Any:
        link = Link("l", 1e-5, 1e9, 0.0, calls_s)
        return filter_parallel(cnn_costs, Cluster([Node("n", dev, 2, link)]), 16, [1.0, 1.0])

    plain, own, engine = (
        split(c) for c in ((), (("hetcoll_allreduce", 1e-3),), (("allreduce", 1e-3),))
    )
    calls = (own.step_s - plain.step_s) / 1e-3
    assert calls >= 2 and calls == pytest.approx(round(calls), abs=1e-6)
    assert engine.step_s == pytest.approx(plain.step_s, rel=1e-12)


def test_data_parallel_with_free_links_exposes_only_the_last_bucket(cnn_costs) -> None:  # type: ignore[no-untyped-def]
    # With free links every bucket but the last (the first layers', ready when the backward
    # ends) hides behind the backward; the last one's reduction (3 n bytes at memory speed,
    # times (p-1)/p) shows, then the update.
    cluster = _cluster([(1e11, 2e10)] * 2, bw=1e30, lat=0.0)
    pred = data_parallel(cnn_costs, cluster, [16, 16])
    from hetcoll.model.predict import compute_seconds

    compute = compute_seconds(cnn_costs, cluster.devices[0], 16)
    update = terms.optimizer_update_seconds(cnn_costs.param_bytes, 2e10)
    last = ddp_buckets(cnn_costs)[-1][1]
    assert pred.step_s == pytest.approx(compute + 0.5 * 3 * last / 2e10 + update, rel=1e-9)
    assert sum(pred.breakdown.values()) == pytest.approx(pred.step_s)


def test_ddp_overlap_hides_communication_and_buckets_follow_ddp(cnn_costs) -> None:  # type: ignore[no-untyped-def]
    buckets = ddp_buckets(cnn_costs)
    assert sum(b for _, b in buckets) == cnn_costs.param_bytes
    assert buckets[0][1] >= 1024 * 1024  # first bucket closes at 1 MiB
    cluster = _cluster([(1e11, 2e10)] * 4, bw=1e9)
    on = data_parallel(cnn_costs, cluster, [16] * 4)
    off = data_parallel(cnn_costs, cluster, [16] * 4, overlap=False)
    assert on.step_s < off.step_s
    assert off.step_s == pytest.approx(
        on.breakdown["compute"]
        + on.breakdown["memory"]
        + on.breakdown["overhead"]
        + on.detail["allreduce_s"]
        + on.detail["broadcast_s"]
        + on.breakdown["optimizer"]
    )


def test_ddp_buffer_broadcast_starts_every_step(cnn_costs) -> None:  # type: ignore[no-untyped-def]
    # The cnn's BatchNorm layers keep running mean and variance (C floats each) and a step count.
    bn = [m for m in networks.cnn().modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert cnn_costs.buffer_bytes == sum(2 * 4 * m.num_features + 8 for m in bn)
    cluster = _cluster([(1e11, 2e10)] * 4, bw=1e8, lat=1e-3)
    on = data_parallel(cnn_costs, cluster, [16] * 4)
    off = data_parallel(cnn_costs, cluster, [16] * 4, broadcast_buffers=False)
    by_hand = 2 * (1e-3 + cnn_costs.buffer_bytes / 1e8)  # a binomial tree over 4 ranks: 2 rounds
    assert on.detail["broadcast_s"] == pytest.approx(by_hand)
    assert on.step_s - off.step_s == pytest.approx(by_hand)
    assert data_parallel(cnn_costs, _cluster([(1e11, 2e10)]), [16]).detail["broadcast_s"] == 0.0


def test_convolutions_compute_channels_padded_to_the_block() -> None:
    from hetcoll.model.predict import _layer_times
    from hetcoll.model.predict.timing import device_arrays

    # Compute-bound devices (no overheads, boundless memory): compute time follows the FLOPs.
    def compute_s(conv: nn.Module, shape: tuple[int, ...], block: int, **kw: object) -> np.ndarray:
        devs = [Device(f"d{i}", 1e9, 1e30, 1e12, conv_channel_block=block) for i in range(2)]
        costs = layer_costs(conv, shape)
        times = _layer_times(costs, device_arrays(devs), np.array([4, 4]), **kw)  # type: ignore[arg-type]
        return times.compute_s.sum(axis=0)  # type: ignore[no-any-return]

    out_split = np.array([[21 / 32, 11 / 32]])
    conv = nn.Conv2d(64, 32, 3, padding=1, bias=False)
    ratio = compute_s(conv, (64, 8, 8), 16, filter_fraction=out_split) / compute_s(
        conv, (64, 8, 8), 1, filter_fraction=out_split
    )
    # 21 filters compute a block of 32, 11 a block of 16.
    assert ratio == pytest.approx([32 / 21, 16 / 11])
    # Split input channels: 21 pad to 32; 11, under one block, take a kernel of their own.
    conv = nn.Conv2d(32, 64, 3, padding=1, bias=False)
    by_input = {"filter_fraction": out_split, "split_input": np.array([True])}
    ratio = compute_s(conv, (32, 8, 8), 16, **by_input) / compute_s(conv, (32, 8, 8), 1, **by_input)
    assert ratio == pytest.approx([32 / 21, 1.0])
    # Unsplit: 3 input channels are not padded, 10 output channels are (to 16).
    conv = nn.Conv2d(3, 10, 3, padding=1, bias=False)
    assert compute_s(conv, (3, 8, 8), 16) / compute_s(conv, (3, 8, 8), 1) == pytest.approx(1.6)
    with pytest.raises(ValueError, match="conv_channel_block"):
        Device("d", 1e9, 1e9, 1e9, conv_channel_block=0)


def test_element_wise_kernels_run_at_their_own_rates() -> None:
    from hetcoll.model.hardware import dumps_cluster
    from hetcoll.model.predict import _layer_times
    from hetcoll.model.predict.timing import device_arrays

    # Memory-bound devices, no overhead: each layer's time is its bytes over its kernels'
    # rate. Batch norm at the element-wise rate, pooling at the pooling rate, ReLU streams at
    # the memory bandwidth (as a copy does).
    mem, ew, pool = 8e10, 2e10, 5e9
    dev = Device("d", 1e30, mem, 1e12, elementwise_bytes_per_s=ew, pool_bytes_per_s=pool)
    costs = layer_costs(nn.Sequential(nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2)), (8, 16, 16))
    rates = [ew, mem, pool]
    lt = _layer_times(costs, device_arrays([dev]), np.array([4]))
    for i, layer in enumerate(costs.layers):
        moved = sum(k.moved_bytes(4) for k in (*layer.forward, *layer.backward))
        assert lt.forward_s[i, 0] + lt.backward_s[i, 0] == pytest.approx(moved / rates[i])
    # Unset, pooling falls back to the element-wise rate, and that to the memory bandwidth.
    assert Device("d", 1e9, mem, 1e9, elementwise_bytes_per_s=ew).pool_rate == ew
    assert Device("d", 1e9, mem, 1e9).pool_rate == mem
    with pytest.raises(ValueError, match="pool_bytes_per_s"):
        Device("d", 1e9, 1e9, 1e9, pool_bytes_per_s=-1.0)
    # The cluster file carries it.
    cluster = Cluster([Node("n", dev, 1)], None)
    text = dumps_cluster(cluster)
    assert "pool_bytes_per_s = 5e+09" in text
    doc = {
        "devices": {"c": {"flops_per_s": 1e11, "mem_bytes_per_s": 2e10, "memory_bytes": 8e9,
                          "pool_bytes_per_s": 3e9}},
        "nodes": [{"name": "n", "device": "c", "count": 1}],
    }  # fmt: skip
    assert cluster_from_dict(doc).devices[0].pool_bytes_per_s == 3e9


def test_convolution_kernels_pay_their_own_fixed_cost() -> None:
    from hetcoll.model.hardware import dumps_cluster
    from hetcoll.model.predict import _layer_times
    from hetcoll.model.predict.timing import device_arrays

    # A conv after a ReLU on the input (no input gradient: forward and weight gradient), then
    # one whose input needs a gradient (forward, input and weight gradients), each with a bias.
    model = nn.Sequential(
        nn.ReLU(), nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.Flatten()
    )
    costs = layer_costs(model, (3, 12, 12))
    kernels = [k for layer in costs.layers for k in (*layer.forward, *layer.backward)]
    conv = sum(k.conv for k in kernels)
    assert conv == 2 + 3
    plain = Device("d", 1e9, 1e9, 1e12, kernel_overhead_s=1e-5)
    slow_conv = Device("d", 1e9, 1e9, 1e12, kernel_overhead_s=1e-5, conv_overhead_s=3e-4)
    for batch in (1, 7):
        a, b = (
            _layer_times(costs, device_arrays([d]), np.array([batch])) for d in (plain, slow_conv)
        )
        # Exactly the convolution kernels' launches cost more, whatever the batch.
        assert b.overhead_s.sum() - a.overhead_s.sum() == pytest.approx(conv * (3e-4 - 1e-5))
        assert (b.forward_s + b.backward_s).sum() - (a.forward_s + a.backward_s).sum() == (
            pytest.approx(conv * (3e-4 - 1e-5))
        )
        assert b.compute_s.sum() == a.compute_s.sum() and b.memory_s.sum() == a.memory_s.sum()
    # Unset, it is the kernel overhead; negative is refused; the cluster file carries it.
    assert plain.conv_call_s == 1e-5 and slow_conv.conv_call_s == 3e-4
    with pytest.raises(ValueError, match="conv_overhead_s"):
        Device("d", 1e9, 1e9, 1e9, conv_overhead_s=-1.0)
    assert "conv_overhead_s = 0.0003" in dumps_cluster(Cluster([Node("n", slow_conv, 1)], None))
    doc = {
        "devices": {"c": {"flops_per_s": 1e11, "mem_bytes_per_s": 2e10, "memory_bytes": 8e9,
                          "kernel_overhead_s": 1e-5, "conv_overhead_s": 2e-4}},
        "nodes": [{"name": "n", "device": "c", "count": 1}],
    }  # fmt: skip
    assert cluster_from_dict(doc).devices[0].conv_call_s == 2e-4


def test_a_steps_fixed_cost_ends_every_ranks_step(cnn_costs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Device.step_overhead_s: every rank that trains pays it once a step, whatever the
    strategy - each of the planner's candidates (data, filter, pipelines, subsets, replicated
    pipelines, asymmetric replicas) is exactly that much slower, and nothing else moves."""
    from dataclasses import replace

    from hetcoll.model.hardware import dumps_cluster

    def cluster(fixed: float) -> Cluster:
        fast = Device("fast", 4e10, 2e10, 1e10, 1e-6, step_overhead_s=fixed)
        slow = Device("slow", 1e10, 1e10, 1e10, 1e-6, step_overhead_s=fixed)
        return Cluster(
            [Node("n0", fast, 2, Link("l", 1e-5, 1e9)), Node("n1", slow, 1)],
            Link("net", 1e-5, 1e9),
        )

    def candidates(fixed: float) -> dict[tuple[str, tuple[int, ...]], Any]:
        preds = plan(cnn_costs, cluster(fixed), 64, prune=False)
        return {(x.strategy, tuple(x.shares)): x for x in preds}

    without, with_it = candidates(0.0), candidates(1e-3)
    assert len(without) > 20 and set(without) == set(with_it)
    for key, x in without.items():
        y = with_it[key]
        assert y.step_s - x.step_s == pytest.approx(1e-3, abs=1e-12), key
        assert y.memory_bytes == x.memory_bytes
    # A device without samples sits the step out: it pays nothing.
    c = cluster(1e-3)
    idle = data_parallel(cnn_costs, c, [32, 32, 0])
    assert idle.step_s - data_parallel(cnn_costs, cluster(0.0), [32, 32, 0]).step_s == (
        pytest.approx(1e-3, abs=1e-12)
    )
    # Negative is refused, naming the field; the cluster file carries it both ways.
    with pytest.raises(ValueError, match="step_overhead_s"):
        replace(c.devices[0], step_overhead_s=-1e-3)
    text = dumps_cluster(c)
    assert "step_overhead_s = 0.001" in text
    (tmp_path / "c.toml").write_text(text)
    assert load_cluster(tmp_path / "c.toml").devices[2].step_overhead_s == 1e-3
    assert "step_overhead_s" not in dumps_cluster(cluster(0.0))
    bad = {
        "devices": {"c": {"flops_per_s": 1e9, "mem_bytes_per_s": 1e9, "memory_bytes": 1e9,
                          "step_overhead_s": -1}},
        "nodes": [{"name": "n", "device": "c", "count": 1}],
    }  # fmt: skip
    with pytest.raises(ValueError, match=r"devices\.c\.step_overhead_s"):
        cluster_from_dict(bad)


def test_the_step_probes_fixed_cost_closes_the_model_on_it() -> None:
    """calibrate.step_overhead_from: with what it returns as the device's step_overhead_s,
    predict_plan predicts the step probe as measured; a probe faster than the model leaves 0."""
    from dataclasses import replace

    from hetcoll.lab import calibrate
    from hetcoll.model import predict_plan
    from hetcoll.plan import Plan

    device = Device("d", 1e10, 1e10, 1e10, kernel_overhead_s=5e-6)
    costs = layer_costs(
        calibrate.tiny_chain(calibrate.STEP_PROBE_DEPTH), (4,), loss=calibrate.step_probe_loss
    )
    probe = Plan.from_dict(calibrate.step_probe_plan(calibrate.STEP_PROBE_DEPTH))
    for measured in (3e-3, 7.5e-4):
        fixed = calibrate.step_overhead_from(measured, device)
        assert fixed > 0
        alone = Cluster([Node("n", replace(device, step_overhead_s=fixed), 1)])
        assert predict_plan(costs, alone, probe).step_s == pytest.approx(measured, rel=1e-12)
    assert calibrate.step_overhead_from(1e-7, device) == 0.0
    # At another depth (the GPU check's second probe), against that probe's own prediction.
    deep = 4 * calibrate.STEP_PROBE_DEPTH
    deep_costs = layer_costs(calibrate.tiny_chain(deep), (4,), loss=calibrate.step_probe_loss)
    fixed = calibrate.step_overhead_from(3e-3, device, deep)
    assert 0 < fixed < calibrate.step_overhead_from(3e-3, device)
    alone = Cluster([Node("n", replace(device, step_overhead_s=fixed), 1)])
    deep_probe = Plan.from_dict(calibrate.step_probe_plan(deep))
    assert predict_plan(deep_costs, alone, deep_probe).step_s == pytest.approx(3e-3, rel=1e-12)
    for depth in (0, 2.5, True):
        with pytest.raises(ValueError, match="depth"):
            calibrate.step_probe_seconds(depth)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="device"):
        calibrate.measure_step_overhead_s("cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="steps"):
        calibrate.measure_step_overhead_s(device, steps=0)
    for where in ("gpu0", "meta"):
        with pytest.raises(ValueError, match="where"):
            calibrate.measure_step_overhead_s(device, where=where)
    with pytest.raises(TypeError, match="where"):
        calibrate.measure_step_overhead_s(device, where=0)  # type: ignore[arg-type]


def test_shared_cores_timeline_by_hand() -> None:
    f = terms.shared_cores_finish_seconds
    # Two computing ranks on one core run at half speed until the shorter one ends.
    assert f([[("cpu", 1.0)], [("cpu", 2.0)]], 1) == pytest.approx([2.0, 3.0])
    # A sleeping rank holds no core: the other runs at full speed meanwhile.
    assert f([[("sleep", 2.0), ("cpu", 1.0)], [("cpu", 1.0)]], 1) == pytest.approx([3.0, 1.0])
    # Phases in order: 1 s alone, then 0.5 s of work at half speed beside the other's 1 s.
    assert f([[("cpu", 1.5)], [("sleep", 1.0), ("cpu", 1.0)]], 1) == pytest.approx([2.0, 2.5])
    assert f([[], [("cpu", 0.0)]], 2) == [0.0, 0.0]
    with pytest.raises(ValueError, match="cores"):
        f([[("cpu", 1.0)]], 0)
    with pytest.raises(ValueError, match="kind"):
        f([[("gpu", 1.0)]], 1)
    with pytest.raises(ValueError, match="time_slice_s"):
        f([[("cpu", 1.0)]], 1, -1.0)


def test_round_robin_timeline_by_hand() -> None:
    f, makespan = terms.shared_cores_finish_seconds, terms.shared_cores_makespan_seconds
    three = [[("cpu", 1.0)]] * 3
    # Work shorter than the slice: two ranks run to the end, the third waits for a core.
    assert f(three, 2, 4.0) == pytest.approx([1.0, 1.0, 2.0])
    # Slices of 0.5 s: 0-0.5 ranks 0, 1; 0.5-1 ranks 2, 0 (0 ends); 1-1.5 ranks 1, 2.
    assert f(three, 2, 0.5) == pytest.approx([1.0, 1.5, 1.5])
    # A pause lasts its factor times the compute's wall time: on one shared core rank 0's
    # 1 s of compute takes 2 s, so it then sleeps 2 s.
    assert f([[("cpu", 1.0), ("pause", 1.0)], [("cpu", 1.0)]], 1) == pytest.approx([4.0, 2.0])
    # ... counted from its first moment on a core: rank 2 waits 1 s, computes 1 s, sleeps 1 s.
    assert f([*three[:2], [("cpu", 1.0), ("pause", 1.0)]], 2, 4.0) == pytest.approx([1, 1, 3])
    # The makespan averages the three start orders: 2 s, 3 s (the long rank waits), 2 s.
    uneven = [[("cpu", 2.0)], [("cpu", 1.0)], [("cpu", 1.0)]]
    assert makespan(uneven, 2, 10.0) == pytest.approx(7 / 3)
    assert makespan(three, 2) == pytest.approx(1.5)
    assert makespan([], 2, 1.0) == 0.0


def test_devices_without_samples_sit_out(cnn_costs) -> None:  # type: ignore[no-untyped-def]
    three = data_parallel(cnn_costs, _cluster([(1e11, 2e10)] * 3), [16, 16, 0])
    two = data_parallel(cnn_costs, _cluster([(1e11, 2e10)] * 2), [16, 16])
    assert three.step_s == pytest.approx(two.step_s)
    assert three.memory_bytes[2] == 0.0


def test_even_batch_shares_name_bad_input() -> None:
    assert even_batch_shares(10, 4) == [3, 3, 2, 2]
    assert even_batch_shares(0, 2) == [0, 0]
    assert even_batch_shares(np.int64(5), np.int64(2)) == [3, 2]
    for args, text in (
        ((10, 0), "num_devices: must be an integer >= 1, got 0"),
        ((-1, 2), "batch: must be an integer >= 0, got -1"),
        ((10.5, 2), "batch: must be an integer >= 0, got 10.5"),
        ((None, 2), "batch: must be an integer >= 0, got None"),
        ((True, 2), "batch: must be an integer >= 0, got True"),
        ((10, True), "num_devices: must be an integer >= 1, got True"),
        ((10, "2"), "num_devices: must be an integer >= 1, got '2'"),
    ):
        with pytest.raises(ValueError, match=text):
            even_batch_shares(*args)


def test_balanced_shares_beat_even_shares_on_unequal_devices(cnn_costs) -> None:  # type: ignore[no-untyped-def]
    cluster = _cluster([(1e11, 2e10), (2.5e10, 5e9)])
    ranked = plan(cnn_costs, cluster, 128)
    by = {p.strategy: p for p in ranked}
    bal, even = by["data parallel, balanced"], by["data parallel, even"]
    assert bal.shares[0] > 3 * bal.shares[1] and sum(bal.shares) == 128
    assert even.shares == [64, 64]
    assert bal.step_s < even.step_s


def test_infeasible_plans_are_marked(cnn_costs) -> None:  # type: ignore[no-untyped-def]
    tiny = _cluster([(1e11, 2e10)] * 2, mem=1e6)  # 1 MB: not even the weights fit
    ranked = plan(cnn_costs, tiny, 64)
    assert ranked and not any(p.feasible for p in ranked)
    assert all(p.reason for p in ranked)
    dp = data_parallel(cnn_costs, tiny, [32, 32])
    assert not dp.feasible and "GB" in dp.reason


def test_filter_parallel_splits_filters_and_communicates_per_layer(cnn_costs) -> None:  # type: ignore[no-untyped-def]
    fast = _cluster([(1e11, 2e10)] * 2, bw=1e12, lat=0.0)
    slow = _cluster([(1e11, 2e10)] * 2, bw=1e8, lat=0.0)
    a = filter_parallel(cnn_costs, fast, 64, [1.0, 1.0])
    b = filter_parallel(cnn_costs, slow, 64, [1.0, 1.0])
    assert a.shares == [256, 256]  # the widest layer: 512 filters, split evenly
    # (the staging copies around the collectives do not depend on the link)
    assert b.breakdown["communication"] > 30 * a.breakdown["communication"]
    uneven = filter_parallel(cnn_costs, fast, 64, [3.0, 1.0])
    assert uneven.shares == [384, 128]


def test_filter_modes_pair_layers_as_the_torch_layers_do(cnn_costs) -> None:  # type: ignore[no-untyped-def]
    from hetcoll.model.predict import filter_modes

    # conv0 -> BN, ReLU -> conv3; conv7 -> BN, ReLU -> conv10; fc15 -> ReLU -> fc17 (the
    # pools and BNs after the split-input layers need the full tensor, so pairs do not chain).
    pairs = {"0": "3", "7": "10", "15": "17"}
    want = {a: "split-output" for a in pairs} | {b: "split-input" for b in pairs.values()}
    assert filter_modes(cnn_costs) == want
    assert set(filter_modes(cnn_costs, avoid_gathers=False).values()) == {"gather"}
    # A conv feeding a linear layer through a pool and a Flatten pairs; through a
    # LayerNorm (not channel-wise) it does not.
    seq = nn.Sequential(nn.Conv2d(3, 8, 3), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 9, 4))
    assert filter_modes(layer_costs(seq, (3, 8, 8))) == {"0": "split-output", "3": "split-input"}
    ln = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    assert filter_modes(layer_costs(ln, (4,))) == {"0": "gather", "2": "gather"}
    with pytest.raises(ValueError, match="modes"):
        filter_parallel(
            cnn_costs, _cluster([(1e11, 2e10)] * 2), 8, [1.0, 1.0], modes={"1": "gather"}
        )
    with pytest.raises(ValueError, match="modes"):
        filter_parallel(cnn_costs, _cluster([(1e11, 2e10)] * 2), 8, [1.0, 1.0], modes={"0": "x"})


@pytest.mark.parametrize(
    ("name", "shape"), [("resnet18", (3, 32, 32)), ("vit_b_16", (3, 224, 224))]
)
def test_predictor_takes_its_filter_modes_from_the_runtime(name, shape) -> None:  # type: ignore[no-untyped-def]
    """One pairing rule: on torchvision models (their own forwards, residual blocks, attention)
    the predictor's modes are exactly what hetcoll.torch.filter_parallel would do."""
    torchvision = pytest.importorskip("torchvision")
    from hetcoll.model.predict import filter_modes
    from hetcoll.torch.filters import filter_modes as runtime_modes

    with torch.device("meta"):
        model = getattr(torchvision.models, name)()
    modes = filter_modes(layer_costs(model, shape))
    assert modes == runtime_modes(model)
    if name == "resnet18":
        # A BasicBlock's traced forward pairs conv1 -> bn1 -> relu -> conv2; the shortcut's
        # add reads conv2's output and the block's input, so nothing pairs across blocks.
        assert modes["layer1.0.conv1"] == "split-output"
        assert modes["layer1.0.conv2"] == "split-input"
        assert modes["conv1"] == modes["layer2.0.downsample.0"] == modes["fc"] == "gather"
    else:
        # The encoder's MLP blocks are nn.Sequential: Linear -> GELU -> Dropout -> Linear pairs.
        assert modes["encoder.layers.encoder_layer_0.mlp.0"] == "split-output"
        assert modes["encoder.layers.encoder_layer_0.mlp.3"] == "split-input"


def test_a_grouped_convolution_between_a_pair_splits_by_whole_groups_in_the_model() -> None:
    """ResNeXt's grouped 3x3 convolution runs on whole groups of the 1x1 pair around it, as
    the runtime runs it: the model pairs across it and splits the pair's channels in whole
    groups, as filter_shares does (here 4 groups of 4 channels at 3 : 1 : 1); its compute is
    priced on each device's groups. Explicit shares of a part of a group are refused, named."""
    torchvision = pytest.importorskip("torchvision")
    from hetcoll.model import predict_plan
    from hetcoll.model.predict import filter_modes
    from hetcoll.plan import Plan
    from hetcoll.torch.filters import filter_modes as runtime_modes
    from hetcoll.torch.filters import filter_shares, split_layout

    resnet = torchvision.models.resnet
    model = resnet.ResNet(resnet.Bottleneck, [1, 1, 1, 1], groups=4, width_per_group=4)
    costs = layer_costs(model, (3, 32, 32))
    assert dict(costs.filter_units) == {f"layer{k}.0.conv1": 4 * 2 ** (k - 1) for k in (1, 2, 3, 4)}
    assert filter_modes(costs) == runtime_modes(model)
    assert filter_modes(costs)["layer1.0.conv1"] == "split-output"
    speeds = [3.0, 1.0, 1.0]
    cluster = _cluster([(1e11, 2e10)] * 3)
    got = filter_parallel(costs, cluster, 16, speeds).detail["shares_per_layer"]
    want = filter_shares(model, size=3, speeds=speeds)
    for k in (1, 2, 3, 4):
        assert got[f"layer{k}.0.conv1"] == want[f"layer{k}.0.conv1"], (k, got, want)
    assert want["layer1.0.conv1"] == [8, 4, 4]
    # (Channel by channel they would be 10 : 3 : 3, which no rank's groups hold.)
    loose = filter_parallel(replace(costs, filter_units=()), cluster, 16, speeds)
    assert loose.detail["shares_per_layer"]["layer1.0.conv1"] == [10, 3, 3]
    # A plan's stage of a chain names its layers' shares by index: a part of a group refused.
    chain = nn.Sequential(
        nn.Conv2d(3, 8, 1), nn.ReLU(), nn.Conv2d(8, 8, 3, groups=2), nn.Conv2d(8, 5, 1)
    )
    chain_costs = layer_costs(chain, (3, 8, 8))
    stage = {"ranks": [0, 1], "layers": [0, 4], "shares": {"0": [4, 4], "3": [4, 4]}}
    doc = {"replicas": [{"samples": 8, "stages": [stage]}]}
    assert predict_plan(chain_costs, cluster, Plan.from_dict(doc)).feasible
    stage["shares"] = {"0": [6, 2], "3": [6, 2]}
    with pytest.raises(ValueError, match=r"stages\[0\]\.shares\[0\]: layer '0' feeds a grouped "):
        predict_plan(chain_costs, cluster, Plan.from_dict(doc))
    # Its 2 groups are too few for 3 devices: kept whole, and the pair gathers, as at run time.
    assert filter_parallel(chain_costs, _cluster([(1e11, 2e10)] * 2), 8, [1.0, 1.0]).detail[
        "modes"
    ] == {"0": "split-output", "3": "split-input"}
    three = filter_parallel(chain_costs, cluster, 8, [1.0, 1.0, 1.0]).detail["modes"]
    assert three == split_layout(chain, ranks=3).modes == {"0": "gather", "3": "gather"}


def test_filter_parallel_communication_by_hand(cnn_costs) -> None:  # type: ignore[no-untyped-def]
    # Free compute and memory: the step is the collectives alone. Paired: the split-input
    # layers allreduce their partial outputs (forward); conv7 and fc15 allreduce their input
    # gradients (backward; conv0 has none: its input is the data). Gathering: every split layer
    # allgathers its output and, except conv0, allreduces its input gradient.
    lat, bw, batch, p = 1e-4, 1e9, 8, 2
    nodes = [Node(f"n{i}", Device(f"d{i}", 1e30, 1e30, 1e12), 1) for i in range(p)]
    cluster = Cluster(nodes, Link("net", lat, bw))
    layer = {x.name: x for x in cnn_costs.layers}

    def allreduce(nbytes: float) -> float:
        return float(terms.ring_allreduce_seconds(nbytes, p, lat, bw, 1e30, 4))

    paired = filter_parallel(cnn_costs, cluster, batch, [1.0, 1.0])
    want = sum(allreduce(layer[n].out_bytes_per_sample * batch) for n in ("3", "10", "17"))
    want += sum(allreduce(layer[n].in_bytes_per_sample * batch) for n in ("7", "15"))
    assert paired.step_s == pytest.approx(want, rel=1e-9)
    assert paired.detail["collectives"] == 5
    gathered = filter_parallel(
        cnn_costs, cluster, batch, [1.0, 1.0], modes=dict.fromkeys(paired.detail["modes"], "gather")
    )
    want = sum(
        terms.ring_allgatherv_seconds(layer[n].out_bytes_per_sample * batch / 2, p, lat, bw)
        for n in paired.detail["modes"]
    )
    want += sum(
        allreduce(layer[n].in_bytes_per_sample * batch) for n in ("3", "7", "10", "15", "17")
    )
    assert gathered.step_s == pytest.approx(want, rel=1e-9)
    assert gathered.detail["collectives"] == 11


def test_filter_parallel_splits_the_channelwise_layers_between_a_pair() -> None:
    # Compute-bound devices without kernel overheads and a free link: two even halves take
    # exactly half the layers' time of one device, the BatchNorm and ReLU between the pair
    # included (they run on the channel slice).
    seq = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64))
    costs = layer_costs(seq, (64,))

    def layers_s(p: int) -> float:
        nodes = [Node(f"n{i}", Device(f"d{i}", 1e9, 1e30, 1e12), 1) for i in range(p)]
        pred = filter_parallel(costs, Cluster(nodes, Link("free", 0.0, 1e30)), 16, [1.0] * p)
        assert sum(pred.breakdown.values()) == pytest.approx(pred.step_s)
        return pred.step_s - pred.breakdown["optimizer"]

    assert layers_s(2) == pytest.approx(0.5 * layers_s(1), rel=1e-9)


def test_a_schedule_times_the_step_the_predictor_gives(cnn_costs) -> None:  # type: ignore[no-untyped-def]
    from dataclasses import replace

    from hetcoll.model.predict import data_parallel_schedule, filter_parallel_schedule

    cluster = _cluster([(1e11, 2e10), (5e10, 1e10)])
    kw = {"overlap": False, "broadcast_buffers": False}
    sched = data_parallel_schedule(cnn_costs, cluster, [24, 16], **kw)  # type: ignore[arg-type]
    assert sched.prediction() == data_parallel(cnn_costs, cluster, [24, 16], **kw)  # type: ignore[arg-type]
    # A device whose backward starts 1 s late: the allreduces wait for it, then the update.
    late = replace(sched, backward_start_s=sched.backward_start_s + np.array([0.0, 1.0]))
    assert late.prediction().step_s == pytest.approx(
        float(late.backward_start_s[1] + sched.layers.backward_s[:, 1].sum())
        + sum(c for _, c in sched.buckets)
        + float(sched.update_s.max()),
        rel=1e-9,
    )
    fsched = filter_parallel_schedule(cnn_costs, cluster, 32, [1.0, 0.5])
    assert fsched.prediction() == filter_parallel(cnn_costs, cluster, 32, [1.0, 0.5])
    assert fsched.order()[0] == (0, True) and fsched.order()[-1] == (0, False)
    # Twice as slow everywhere: twice the compute, the same communication.
    twice = replace(fsched, layers=fsched.layers.scaled(2.0), update_s=2 * fsched.update_s)
    base, slow = fsched.prediction(), twice.prediction()
    comm = base.breakdown["communication"]
    assert slow.step_s - comm == pytest.approx(2 * (base.step_s - comm), rel=1e-9)


def test_pipeline_chain_partition_is_exact_against_brute_force() -> None:
    rng = np.random.default_rng(7)
    for trial in range(60):
        n, p = int(rng.integers(1, 7)), int(rng.integers(1, 5))
        costs = rng.uniform(0.1, 5.0, n).tolist()
        # Half the cases repeat speeds: runs of identical devices take a shortcut.
        if trial % 2:
            speeds = rng.choice([0.5, 1.0, 2.0], p).tolist()
        else:
            speeds = rng.uniform(0.5, 3.0, p).tolist()
        boundary = rng.uniform(0.0, 4.0, n).tolist()
        bw = 2.0

        def makespan(
            counts: tuple[int, ...], n=n, costs=costs, speeds=speeds, boundary=boundary, bw=bw
        ) -> float:
            start, worst = 0, 0.0
            for d, k in enumerate(counts):
                if k:
                    end = start + k
                    hand = boundary[end - 1] / bw if end < n else 0.0
                    worst = max(worst, sum(costs[start:end]) / speeds[d] + hand)
                    start = end
            return worst

        best = min(makespan(c) for c in itertools.product(range(n + 1), repeat=p) if sum(c) == n)
        got = hetcoll.partition_chain(costs, speeds, boundary_bytes=boundary[: n - 1], bandwidth=bw)
        assert sum(got) == n
        assert makespan(tuple(got)) == pytest.approx(best)


def test_pipeline_prediction_has_bubble_and_checks_layers(cnn_costs) -> None:  # type: ignore[no-untyped-def]
    cluster = _cluster([(1e11, 2e10)] * 3)
    one = pipeline(cnn_costs, cluster, 64, 1)
    many = pipeline(cnn_costs, cluster, 64, 16)
    assert one.detail["stages"] >= 2
    assert many.breakdown["bubble"] < one.breakdown["bubble"]
    assert sum(one.shares) == len(cnn_costs.layers)
    with pytest.raises(ValueError, match="layers_per_device"):
        pipeline(cnn_costs, cluster, 64, 4, layers_per_device=[1, 1, 1])
    with pytest.raises(ValueError, match="micro_batches"):
        pipeline(cnn_costs, cluster, 64, 0)


_speeds = st.lists(st.tuples(st.floats(1e9, 1e12), st.floats(1e9, 1e11)), min_size=1, max_size=5)


@settings(max_examples=12, deadline=None)
@given(devs=_speeds, factor=st.floats(1.0, 100.0), batch=st.integers(1, 256))
def test_more_bandwidth_or_flops_is_never_slower(cnn_costs, devs, factor, batch) -> None:  # type: ignore[no-untyped-def]
    # For a fixed plan (shares, filter split, stages), faster links, arithmetic or memory never
    # make a step slower. (The planner's choices are re-optimised per cluster; its pipeline
    # stages minimise the slowest stage, not the whole step, so only fixed plans are compared.)
    base = _cluster(devs)
    shares = even_batch_shares(batch, base.num_devices)
    speeds = [d.flops_per_s for d in base.devices]
    stages = pipeline(cnn_costs, base, batch, 1).shares
    for faster in (
        base.scaled(link_bw=factor),
        base.scaled(flops=factor),
        base.scaled(mem_bw=factor),
    ):
        for predict in (
            lambda c: data_parallel(cnn_costs, c, shares),
            lambda c: data_parallel(cnn_costs, c, shares, overlap=False),
            lambda c: filter_parallel(cnn_costs, c, batch, speeds),
            lambda c: pipeline(cnn_costs, c, batch, 1, layers_per_device=stages),
        ):
            assert predict(faster).step_s <= predict(base).step_s * (1 + 1e-12)


def test_data_parallel_bad_shares(cnn_costs) -> None:  # type: ignore[no-untyped-def]
    cluster = _cluster([(1e11, 2e10)] * 2)
    with pytest.raises(ValueError, match="shares"):
        data_parallel(cnn_costs, cluster, [16])
    with pytest.raises(ValueError, match="shares"):
        data_parallel(cnn_costs, cluster, [16, -1])
    with pytest.raises(ValueError, match="batch"):
        plan(cnn_costs, cluster, 0)


def test_cluster_from_dict_and_sweep_axes(cnn_costs) -> None:  # type: ignore[no-untyped-def]
    from hetcoll.model import sweep

    cluster = load_cluster(EXAMPLES / "a100_v100_cpu.toml")
    for axis in ("batch", "flops", "mem_bw", "link_bw", "nodes"):
        points = sweep(cnn_costs, cluster, 256, axis)
        assert len(points) >= 3 and all(pt.best for pt in points)
    with pytest.raises(ValueError, match="axis"):
        sweep(cnn_costs, cluster, 256, "colour")
    with pytest.raises(ValueError, match="<dict>: nodes"):
        cluster_from_dict(
            {"devices": {"a": {"flops_per_s": 1, "mem_bytes_per_s": 1, "memory_bytes": 1}}}
        )


# ---------------------------------------------------------------- command line


def test_cli_plan_json_and_text(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", "cnn", "--input", "3x32x32", "--batch", "256"]
    assert main([*args, "--cluster", str(EXAMPLES / "a100_v100_cpu.toml"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    best = out["plans"][0]
    assert best["feasible"] and sum(best["shares"]) in (256, 18)
    assert set(best["breakdown_s"]) >= {"compute", "memory", "communication"}
    assert main([*args, "--cluster", str(EXAMPLES / "a100_v100_cpu.toml")]) == 0
    text = capsys.readouterr().out
    assert "best:" in text and "runners-up:" in text


def test_cli_plan_sweep_writes_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "s.png"
    argv = ["plan", "--model", "vgg", "--input", "3x32x32", "--batch", "128", "--sweep", "nodes"]
    assert main([*argv, "--cluster", str(EXAMPLES / "a100_v100_cpu.toml"), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "nodes" in capsys.readouterr().out


def test_cli_errors_name_the_argument(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[devices]\n")
    with pytest.raises(SystemExit) as e:
        main(
            ["plan", "--model", "cnn", "--input", "3x32x32", "--batch", "8", "--cluster", str(bad)]
        )
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        main(
            [
                "plan",
                "--model",
                "nosuch",
                "--input",
                "3x32x32",
                "--batch",
                "8",
                "--cluster",
                str(bad),
            ]
        )


def test_cli_model_costs(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["model", "costs", "--model", "tests.test_model:_Gram", "--input", "4x8", "--json"])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    (row,) = out["layers"]
    assert row["forward_flops_per_sample"] == out["forward_flops"] == 2 * 4 * 4 * 8


@pytest.mark.parametrize(
    "module",
    [
        "hetcoll.model.costs.layers",
        "hetcoll.model.costs.records",
        "hetcoll.model.hardware",
        "hetcoll.model.networks",
        "hetcoll.model.terms",
        "hetcoll.lab.calibrate",
        "hetcoll.lab.validate",
        "hetcoll.lab.predict_emulated",
    ],
)
def test_docstring_examples(module: str) -> None:
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.failed == 0


def test_readme_section_examples(monkeypatch: pytest.MonkeyPatch) -> None:
    import doctest

    monkeypatch.chdir(ROOT)
    result = doctest.testfile(str(ROOT / "docs" / "model.md"), module_relative=False)
    assert result.attempted > 0 and result.failed == 0


# ---------------------------------------------------------------- real processes


def test_fit_alpha_beta_recovers_a_known_link() -> None:
    from hetcoll.lab.calibrate import fit_alpha_beta

    sizes = [8, 1024, 2**20, 2**22, 2**24]
    alpha, bw = fit_alpha_beta(sizes, [2e-6 + s / 3e9 for s in sizes])
    assert alpha == pytest.approx(2e-6 + 8 / 3e9) and bw == pytest.approx(3e9, rel=1e-3)
    with pytest.raises(ValueError, match="sizes_bytes"):
        fit_alpha_beta([8, 16], [1e-6, 1e-6])


@pytest.mark.multiproc
def test_convolutions_run_at_the_convolution_rate() -> None:
    """A conv layer's GEMMs take conv_flops_per_s, a linear layer's flops_per_s; the file
    field round-trips, and without it convolutions run at flops_per_s."""
    from hetcoll.model.predict import compute_seconds

    conv = layer_costs(nn.Conv2d(16, 32, 3, padding=1), (16, 8, 8))
    fc = layer_costs(nn.Linear(512, 256), (512,))
    assert all(k.conv == k.name.startswith("gemm") for k in conv.layers[0].forward)
    assert not any(k.conv for layer in fc.layers for k in (*layer.forward, *layer.backward))
    # Compute-bound devices (huge bandwidth, no overhead), so time = FLOPs / rate exactly.
    plain = Device("d", flops_per_s=1e9, mem_bytes_per_s=1e18, memory_bytes=1e12)
    fast_conv = Device("d", 1e9, 1e18, 1e12, conv_flops_per_s=4e9)
    batch = 8
    conv_flops = sum(
        k.flops(batch) for layer in conv.layers for k in (*layer.forward, *layer.backward)
    )
    gemm_flops = sum(
        k.flops(batch) for layer in conv.layers for k in (*layer.forward, *layer.backward) if k.conv
    )
    assert compute_seconds(conv, plain, batch) == pytest.approx(conv_flops / 1e9)
    assert compute_seconds(conv, fast_conv, batch) == pytest.approx(
        (conv_flops - gemm_flops) / 1e9 + gemm_flops / 4e9
    )
    assert compute_seconds(fc, fast_conv, batch) == pytest.approx(compute_seconds(fc, plain, batch))
    doc = {
        "devices": {
            "c": {
                "flops_per_s": 1e9,
                "mem_bytes_per_s": 1e10,
                "memory_bytes": 1e9,
                "conv_flops_per_s": 3e9,
            }
        },
        "nodes": [{"name": "n", "device": "c", "count": 1}],
    }
    assert cluster_from_dict(doc).devices[0].conv_rate == 3e9
    del doc["devices"]["c"]["conv_flops_per_s"]  # type: ignore[attr-defined]
    assert cluster_from_dict(doc).devices[0].conv_rate == 1e9


@pytest.mark.multiproc
def test_calibrate_measures_gloo_and_mpi_links(tmp_path: Path) -> None:
    from hetcoll.lab.calibrate import calibrate

    cal = calibrate(ranks=2, links=("gloo", "mpi"))
    out = tmp_path / "me.toml"
    out.write_text(cal.to_toml())
    cluster = load_cluster(out)
    assert cluster.num_devices == 2
    # Both ranks measured the device at once where they have a core each.
    side_by_side = "2 one-thread ranks at once" in out.read_text()
    assert side_by_side == (len(os.sched_getaffinity(0)) >= 2)
    dev = cluster.devices[0]
    assert 1e8 < dev.flops_per_s < 1e13 and 1e8 < dev.mem_bytes_per_s < 1e12
    assert 1e8 < dev.conv_rate < 1e13 and "conv_flops_per_s" in out.read_text()
    assert dev.conv_channel_block in (1, 8, 16) and "conv_channel_block" in out.read_text()
    assert 0 < dev.conv_call_s < 0.05 and "conv_overhead_s" in out.read_text()
    # A fresh 64 MiB tensor's first touch (new pages on Linux; 0 where memory is reused).
    touch = dev.first_touch_bytes_per_s
    assert touch == 0 or ("first_touch_bytes_per_s" in out.read_text() and 1e8 < touch < 1e12)
    # A training step's own fixed cost (a tiny model under parallelize, one rank).
    fixed = dev.step_overhead_s
    assert fixed == 0 or ("step_overhead_s" in out.read_text() and fixed < 0.05)
    names = {link.name for link in cal.links}
    assert names == {"gloo-local", "mpi-local"}
    for link in cal.links:
        assert 0 < link.latency_s < 0.05 and 1e7 < link.bytes_per_s < 1e12
        assert 0 <= link.call_s < 0.05
    assert "mpi-local" in out.read_text()  # the unused link is kept in the file
    # The ranks' link carries the fixed cost of a collective call the calibration fitted.
    gloo = next(link for link in cal.links if link.name == "gloo-local")
    assert cluster.nodes[0].link is not None
    assert cluster.nodes[0].link.call_s == pytest.approx(gloo.call_s, rel=1e-5)
    # Each probed kind at its own cost, the median of them for any other.
    kinds = dict(cluster.nodes[0].link.calls_s)
    assert sorted(kinds) == sorted(COLLECTIVE_KINDS)
    assert min(kinds.values()) <= gloo.call_s <= max(kinds.values())


def test_a_calls_fixed_cost_is_what_the_latencies_leave() -> None:
    from hetcoll.lab.calibrate import fit_call_seconds

    # On 4 ranks the model charges an allreduce 6 latencies, an allgather and an all-to-all
    # 3, a broadcast 2: what is left of each is 1 ms, 2 ms, 3 ms and 4 ms.
    calls = {"allreduce": 7e-3, "allgather": 5e-3, "all_to_all": 6e-3, "broadcast": 6e-3}
    assert fit_call_seconds(calls, 1e-3, 4) == pytest.approx(2.5e-3)
    assert fit_call_seconds({"broadcast": 1e-6}, 1e-3) == 0.0  # never below nothing
    with pytest.raises(ValueError, match="num_ranks"):
        fit_call_seconds(calls, 1e-3, 1)
    with pytest.raises(ValueError, match="calls_s"):
        fit_call_seconds({}, 1e-3)


def test_a_device_is_measured_on_one_thread_as_a_rank_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """measure_device runs every probe on one thread, whatever the caller's count (restored
    after): at torch's default of every core its GEMM and element-wise rates read as much as
    twice a rank's."""
    import torch

    from hetcoll.lab import calibrate

    seen: list[int] = []
    real = calibrate.measure_gemm_flops_per_s

    def spy(**kw: object) -> float:
        seen.append(torch.get_num_threads())
        return real(size=64, repeats=1)

    monkeypatch.setattr(calibrate, "measure_gemm_flops_per_s", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        calibrate.measure_device("rank", 1e9, quick=True)
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_measure_device_calls_before_ahead_of_every_probe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ranks measuring side by side keep their probes in step by a barrier before each
    (``before``): one call per timed probe, each ahead of its probe."""
    from hetcoll.lab import calibrate

    events: list[str] = []
    real = calibrate.measure_gemm_flops_per_s

    def gemm(**kw: object) -> float:
        events.append("gemm")
        return real(size=64, repeats=1)

    monkeypatch.setattr(calibrate, "measure_gemm_flops_per_s", gemm)
    device = calibrate.measure_device(
        "rank", 1e9, quick=True, before=lambda: events.append("before")
    )
    assert events.count("before") == 8 and device.flops_per_s > 0
    assert events[events.index("gemm") - 1] == "before"


_RATES = st.floats(1e6, 1e13)
_COSTS = st.floats(0, 1e-2)


@st.composite
def _devices(draw: Any) -> Device:
    return Device(
        draw(st.sampled_from(["a", "b", "c"])),
        flops_per_s=draw(_RATES),
        mem_bytes_per_s=draw(_RATES),
        memory_bytes=draw(st.floats(1e6, 1e12)),
        kernel_overhead_s=draw(_COSTS),
        elementwise_bytes_per_s=draw(st.one_of(st.just(0.0), _RATES)),
        conv_flops_per_s=draw(st.one_of(st.just(0.0), _RATES)),
        pool_bytes_per_s=draw(st.one_of(st.just(0.0), _RATES)),
        first_touch_bytes_per_s=draw(st.one_of(st.just(0.0), _RATES)),
        bf16_flops_per_s=draw(st.one_of(st.just(0.0), _RATES)),
        conv_overhead_s=draw(_COSTS),
        step_overhead_s=draw(_COSTS),
        conv_channel_block=draw(st.sampled_from([1, 8, 16])),
    )


@settings(max_examples=60, deadline=None)
@given(st.lists(_devices(), min_size=1, max_size=6))
def test_the_slowest_device_is_as_slow_as_the_slowest_in_every_figure(devices: list) -> None:
    from hetcoll.lab.calibrate import slowest_device

    d = slowest_device(devices, "node")
    assert d.name == "node" and d.memory_bytes == devices[0].memory_bytes
    assert d.conv_channel_block == devices[0].conv_channel_block
    for attr, read in (
        ("flops_per_s", "flops_per_s"),
        ("mem_bytes_per_s", "mem_bytes_per_s"),
        ("elementwise_bytes_per_s", "elementwise_rate"),
        ("pool_bytes_per_s", "pool_rate"),
        ("conv_flops_per_s", "conv_rate"),
    ):
        assert getattr(d, attr) == min(getattr(x, read) for x in devices), attr
    for attr, read in (
        ("kernel_overhead_s", "kernel_overhead_s"),
        ("conv_overhead_s", "conv_call_s"),
        ("step_overhead_s", "step_overhead_s"),
    ):
        assert getattr(d, attr) == max(getattr(x, read) for x in devices), attr
    # Every prediction from it is at least as slow as from any of them.
    costs = layer_costs(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten()), (3, 8, 8))
    slowest = data_parallel(costs, Cluster([Node("n", d, 1)]), [4]).step_s
    for x in devices:
        one = replace(x, conv_channel_block=d.conv_channel_block, memory_bytes=d.memory_bytes)
        assert slowest >= data_parallel(costs, Cluster([Node("n", one, 1)]), [4]).step_s * (
            1 - 1e-12
        )
    touches = [x.first_touch_bytes_per_s for x in devices if x.first_touch_bytes_per_s > 0]
    assert d.first_touch_bytes_per_s == min(touches, default=0.0)
    assert d.bf16_flops_per_s == min(x.bf16_flops_per_s for x in devices)
    # One device is its own slowest, as the model reads it.
    alone = slowest_device(devices[:1])
    for attr in ("elementwise_rate", "pool_rate", "conv_rate", "conv_call_s", "flops_per_s"):
        assert getattr(alone, attr) == getattr(devices[0], attr)


def test_slowest_device_reads_every_figure_of_a_device() -> None:
    """A figure added to Device must be given a rule in slowest_device (this list with it)."""
    assert {f.name for f in fields(Device)} == {
        "name", "flops_per_s", "mem_bytes_per_s", "memory_bytes", "kernel_overhead_s",
        "elementwise_bytes_per_s", "conv_flops_per_s", "conv_channel_block",
        "tf32_flops_per_s", "bf16_flops_per_s", "fp16_flops_per_s", "pool_bytes_per_s",
        "conv_overhead_s", "first_touch_bytes_per_s", "step_overhead_s",
    }  # fmt: skip


def test_slowest_device_and_measure_node_device_name_bad_arguments() -> None:
    from hetcoll.lab.calibrate import measure_node_device, slowest_device

    with pytest.raises(ValueError, match="devices: need a non-empty sequence"):
        slowest_device([])
    with pytest.raises(TypeError, match=r"devices\[1\]: must be a Device"):
        slowest_device([Device("a", 1e9, 1e9, 1e9), "b"])  # type: ignore[list-item]
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="ranks: must be an integer >= 1"):
            measure_node_device("n", 1e9, bad)  # type: ignore[arg-type]


@pytest.mark.multiproc
def test_a_nodes_device_is_its_slowest_rank_measured_side_by_side() -> None:
    """Every rank of the node measures at once (as many as there are cores); the node's device
    is the slowest rank's in every figure."""
    from hetcoll.lab.calibrate import measure_node_device, slowest_device

    device, own = measure_node_device("node", 1e9, 3, quick=True)
    assert len(own) == min(3, len(os.sched_getaffinity(0)))
    assert device == slowest_device(own, "node")
    assert all(d.flops_per_s > 1e8 and d.conv_call_s > 0 for d in own)


@pytest.mark.multiproc
def test_validation_subset_predicts_real_ddp_steps() -> None:
    from hetcoll.lab.validate import run_validation

    # Two ranks of emulated speeds 1 and 0.5 with balanced shares: DDP, the speed emulation,
    # the in-run calibration and the prediction, end to end. Three ranks outnumber a 2-core
    # machine's cores: they measure in turns and the model shares the cores, with the time
    # slice fitted in the run. (No error bound: accuracy is what `hetcoll model validate`
    # reports, a benchmark, not a test.)
    r, r3 = run_validation(
        [("cnn", [21, 11], [1.0, 0.5]), ("cnn", [8, 8, 4], [1.0, 1.0, 0.5])], steps=2, warmup=1
    )
    for row in (r, r3):
        assert row.strategy == "data" and len(row.measured_steps_s) == 2
        assert math.isfinite(row.predicted_s) and row.predicted_s > 0 and row.measured_s > 0
    assert r.ranks == 2 and r.batch == 32 and r3.ranks == 3 and r3.batch == 20
    if (os.cpu_count() or 1) < 3:
        # (A time slice of 0 is processor sharing.)
        assert r3.detail["time_slice_s"] >= 0 and "time_slice_s" not in r.detail


def test_validation_rows_spread_is_their_runs_range_or_their_steps_quartiles() -> None:
    from hetcoll.lab.validate import ValidationResult

    steps = [0.10, 0.11, 0.12, 0.13, 0.14, 0.30]
    one = ValidationResult("cnn", 2, [1, 1], [1.0, 1.0], 0.12, 0.125, measured_steps_s=steps)
    q1, _, q3 = statistics.quantiles(steps, n=4)
    assert one.spread == pytest.approx((q3 - q1) / statistics.median(steps))
    assert one.noise  # error -4%, quartiles ~30% of the median apart
    runs = ValidationResult(
        "cnn", 2, [1, 1], [1.0, 1.0], 0.10, 0.125, measured_steps_s=steps, run_errors=[-0.25, -0.15]
    )
    assert runs.spread == pytest.approx(0.10) and not runs.noise  # -20%, runs 10% apart
    assert ValidationResult("cnn", 1, [1], [1.0], 1.0, 1.0, measured_steps_s=[1.0]).spread == 0.0


@pytest.mark.multiproc
def test_validation_repeats_every_configuration_and_keeps_each_run() -> None:
    from hetcoll.lab.validate import run_validation

    seen = []
    (r,) = run_validation([("cnn", [8], [1.0])], steps=2, warmup=1, repeat=2, progress=seen.append)
    assert len(seen) == 2 and len(r.run_errors) == 2 and len(r.measured_steps_s) == 4
    assert r.run_errors == [s.error for s in seen]
    assert r.error == min(r.run_errors)  # the lower median of two
    assert r.spread == max(r.run_errors) - min(r.run_errors)
    with pytest.raises(ValueError, match="repeat"):
        run_validation([("cnn", [8], [1.0])], repeat=0)


@pytest.mark.multiproc
def test_validation_subset_runs_a_real_pipeline_plan() -> None:
    from hetcoll.lab.validate import plan_configurations, run_validation

    # Two one-rank stages of emulated speeds 1 and 1/2 under GPipe: parallelize, the stage
    # emulation, the in-run calibration and the prediction, end to end. (No error bound:
    # accuracy is what `hetcoll model validate` reports.)
    config = plan_configurations()[1]
    (r,) = run_validation([config], steps=2, warmup=1)
    assert r.strategy == "pipeline" and r.ranks == 2 and r.batch == 32
    assert r.shares == [32, 32] and r.speeds == [1.0, 0.5] and r.detail["plan"] == config.plan
    assert math.isfinite(r.predicted_s) and r.predicted_s > 0 and r.measured_s > 0


def _torch_filter_modes(rank: int, world: int, names: list[str]) -> dict[str, dict[str, str]]:
    from hetcoll.torch.filters import FilterParallelLayer
    from hetcoll.torch.filters import filter_parallel as split_model

    out = {}
    for name in names:
        shape = (784,) if name == "mlp" else (3, 32, 32)
        model = split_model(networks.build(name, shape), [1.0] * world, None)
        out[name] = {
            n: m.mode for n, m in model.named_modules() if isinstance(m, FilterParallelLayer)
        }
    return out


@pytest.mark.multiproc
def test_predicted_modes_are_the_torch_layers_modes() -> None:
    from hetcoll.launch import spawn
    from hetcoll.model.predict import filter_modes

    names = ["cnn", "vgg", "mlp"]
    (real,) = spawn(_torch_filter_modes, 1, names)
    for name in names:
        shape = (784,) if name == "mlp" else (3, 32, 32)
        assert filter_modes(layer_costs(networks.build(name, shape), shape)) == real[name], name


@pytest.mark.multiproc
def test_validation_subset_runs_real_filter_parallel_steps(cnn_costs) -> None:  # type: ignore[no-untyped-def]
    from hetcoll.lab.validate import FilterConfiguration, run_validation, summary
    from hetcoll.model.predict import filter_modes

    # Two ranks of emulated speeds 1 and 1/2, filters in proportion: the converted model, the
    # per-layer emulation, the in-run calibration and the prediction, end to end. (No error
    # bound: accuracy is what `hetcoll model validate` reports.)
    config = FilterConfiguration("cnn", 8, (1.0, 0.5), (1.0, 0.5))
    (r,) = run_validation([config], steps=3, warmup=1)
    assert r.strategy == "filter" and r.ranks == 2 and r.batch == 8 and r.speeds == [1.0, 0.5]
    assert math.isfinite(r.predicted_s) and r.predicted_s > 0 and r.measured_s > 0
    assert summary([r], "filter")[0] == abs(r.error)
    # The ranks ran the split layers in the modes the model predicts them in...
    assert r.detail["modes"] == filter_modes(cnn_costs)
    shares = r.detail["shares"]
    assert r.shares == shares["15"] == hetcoll.split(512, [1.0, 0.5], minimum=1)
    assert shares["0"] == shares["3"] == hetcoll.split(32, [1.0, 0.5], minimum=1)
    assert shares["7"] == shares["10"] == hetcoll.split(64, [1.0, 0.5], minimum=1)
    # ...and each rank held the parameters of its shares: conv0 (27 + 1 per filter) and its
    # BatchNorm (2), conv3's input columns (32 x 9); conv7 (288 + 1), BN (2), conv10's columns
    # (64 x 9); fc15 (4096 + 1), fc17's columns (10); replicated: conv3's and conv10's biases
    # and BatchNorms after them, fc17's bias (32 + 64 + 64 + 128 + 10).
    want = [
        318 * s + 867 * t + 4107 * u + 298
        for s, t, u in zip(shares["0"], shares["7"], shares["15"])
    ]
    assert r.detail["params_per_rank"] == want
    full = sum(p.numel() for p in networks.cnn().parameters())
    assert sum(want) == full + 298  # the replicated ones, twice


_HOSTILE_NUMBER = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 0.0, -0.0, 5e-324, True, None, "1", b"1", 2**2000, -(10**5000)]),
)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_devices_and_links_made_in_code_hold_valid_figures_or_name_the_bad_one(data) -> None:  # type: ignore[no-untyped-def]
    """Any value in any numeric field of a Device or a Link: the constructor raises a
    ValueError naming that field, or holds a figure the model can price with (finite; > 0
    where it divides, >= 0 elsewhere; a whole channel block)."""
    positive = {"flops_per_s", "mem_bytes_per_s", "memory_bytes"}
    good = {f.name: getattr(Device("d", 1e12, 1e11, 1e9), f.name) for f in fields(Device)}
    numeric = [n for n in good if n != "name"]
    name = data.draw(st.sampled_from(numeric), label="field")
    value = data.draw(_HOSTILE_NUMBER, label="value")
    try:
        device = Device(**{**good, name: value})
    except ValueError as e:
        assert f": {name}: must be" in str(e), str(e)
    else:
        got = getattr(device, name)
        assert not isinstance(got, bool) and isinstance(got, (int, float)) and math.isfinite(got)
        if name == "conv_channel_block":
            assert isinstance(got, int) and 1 <= got <= MAX_CHANNEL_BLOCK
        else:
            assert got > 0 if name in positive else got >= 0

    good_link = {"name": "l", "latency_s": 1e-6, "bytes_per_s": 5e9, "call_s": 0.0}
    name = data.draw(st.sampled_from(["latency_s", "bytes_per_s", "call_s"]), label="link field")
    try:
        link = Link(**{**good_link, name: value})
    except ValueError as e:
        assert f": {name}: must be" in str(e), str(e)
    else:
        got = getattr(link, name)
        assert not isinstance(got, bool) and isinstance(got, (int, float))
        # An infinite bandwidth is a device talking to itself (code only, never a file).
        assert got > 0 if name == "bytes_per_s" else (got >= 0 and math.isfinite(got))


def test_nodes_and_clusters_made_in_code_name_an_argument_of_another_type() -> None:
    d = Device("d", 1e12, 1e11, 1e9)
    eth = Link("eth", 1e-5, 1e9)
    a, b = Node("a", d, 1), Node("b", d, 1)
    text: Any = "eth"  # a name where an object belongs
    number: Any = 3
    cases = [
        (lambda: Node("n", text, 1), r"^Node 'n': device: must be a hetcoll.model.Device, got"),
        (lambda: Node("n", d, 2, text), r"^Node 'n': link: must be a hetcoll.model.Link or None"),
        (lambda: Node(number, d, 1), r"^Node: name: must be a str, got int"),
        (lambda: Device(number, 1e12, 1e11, 1e9), r"^Device: name: must be a str, got int"),
        (lambda: Link(number, 0.0, 1e9), r"^Link: name: must be a str, got int"),
        (lambda: Cluster(text), r"^<memory>: nodes: must be a list of hetcoll.model.Node, got"),
        (lambda: Cluster([a, text]), r"^<memory>: nodes\[1\]: must be a hetcoll.model.Node, got"),
        (lambda: Cluster([a, b], text), r"^<memory>: network: must be a hetcoll.model.Link or"),
    ]
    for make, message in cases:
        with pytest.raises(TypeError, match=message):
            make()
    assert Cluster((a, b), eth).num_devices == 2


def test_planner_arguments_that_priced_nonsense_are_named(cnn_costs) -> None:  # type: ignore[no-untyped-def]
    """NaN state copies once gave every plan NaN seconds (ranked first), -100 negative memory
    (marked feasible); a micro-batch count of 0 divided by zero deep in a candidate; a list of
    2**40 even shares filled the memory."""
    from hetcoll.model import even_batch_shares

    dev = Device("d", 1e12, 1e11, 1e9)
    two = Cluster([Node("n", dev, 2, Link("l", 1e-5, 1e9))])
    for copies in (float("nan"), -100, "2", True, 65):
        with pytest.raises(ValueError, match=r"^optimizer_state_copies: must be an integer"):
            plan(cnn_costs, two, 8, optimizer_state_copies=copies)
        with pytest.raises(ValueError, match=r"^optimizer_state_copies: must be an integer"):
            data_parallel(cnn_costs, two, [4, 4], optimizer_state_copies=copies)
    for micro, text in (([0], r"micro_batches\[0\]"), ([2, -2], r"micro_batches\[1\]"),
                        (4, "micro_batches"), (["a"], r"micro_batches\[0\]")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"^{text}: must be"):
            plan(cnn_costs, two, 8, micro_batches=micro)
    with pytest.raises(ValueError, match=r"^num_devices: must be at most 65536"):
        even_batch_shares(10, 2**40)
    assert plan(cnn_costs, two, 8, optimizer_state_copies=2)[0].step_s > 0


def test_clusters_name_indices_factors_and_calls_they_cannot_use() -> None:
    """link_between(-1, 0) once wrapped round to the last device; a dict of calls_s unpacked
    its keys' letters; scaled(flops=0) made a device of 0 FLOP/s named nowhere."""
    d = Device("d", 1e12, 1e11, 1e9)
    two = Cluster(
        [Node("a", d, 2, Link("shm", 1e-6, 5e9)), Node("b", d, 1)], Link("eth", 1e-5, 1e9)
    )
    assert two.link_between(0, 1).name == "shm"
    assert "eth" in two.link_between(np.int64(1), 2).name  # numpy indices are indices
    for a, b, name, got in ((-1, 0, "a", "-1"), (0, 3, "b", "3"), (1.0, 0, "a", "1.0"),
                            (True, 0, "a", "True"), (0, "1", "b", "'1'")):  # fmt: skip
        with pytest.raises(
            ValueError, match=rf"^{name}: must be a device index in 0..2, got {got}$"
        ):
            two.link_between(a, b)
    for factor in ("flops", "mem_bw", "link_bw"):
        for bad in (0, -2.0, math.nan, math.inf, "2", None):
            with pytest.raises(ValueError, match=rf"^{factor}: must be"):
                two.scaled(**{factor: bad})
    assert two.scaled(flops=2.0).devices[0].flops_per_s == 2e12
    for calls in ({"allreduce": 1e-3}, "allreduce", (("allreduce",),), (("allreduce", 1, 2),)):
        with pytest.raises(
            ValueError, match=r"^Link 'l': calls_s: must be \(kind, seconds\) pairs"
        ):
            Link("l", 1e-5, 1e9, calls_s=calls)  # type: ignore[arg-type]
    assert Link("l", 1e-5, 1e9, calls_s=[("allreduce", 1e-3)]).call_of("allreduce") == 1e-3
    with pytest.raises(ValueError, match=r"conv_channel_block: must be an integer in 1\.\.1024"):
        Device("d", 1e12, 1e11, 1e9, conv_channel_block=2**70)
    with pytest.raises(
        ValueError, match=r"^Device 'd': memory_bytes: must be finite, got an integer of 2001 bits$"
    ):
        Device("d", 1e12, 1e11, 2**2000)


def test_predictors_name_what_they_cannot_price(cnn_costs) -> None:  # type: ignore[no-untyped-def]
    """A model or cluster of another type once raised AttributeError deep inside; shares of
    nothing were a feasible step, shares past int64 overflowed; a NaN bucket cap was one
    bucket; balanced_batch_shares(-1) said "at most -2" samples fit; forward_flops(-1)
    counted negative FLOPs."""
    from hetcoll.model import balanced_batch_shares, predict_plan, sweep

    d = Device("d", 1e12, 1e11, 1e9)
    two = Cluster([Node("n", d, 2, Link("l", 1e-5, 1e9))])
    even_plan = data_parallel(cnn_costs, two, [4, 4]).to_plan()
    calls = {
        "data_parallel": lambda costs, cluster: data_parallel(costs, cluster, [4, 4]),
        "pipeline": lambda costs, cluster: pipeline(costs, cluster, 8, 2),
        "filter_parallel": lambda costs, cluster: filter_parallel(costs, cluster, 8, [1, 1]),
        "predict_plan": lambda costs, cluster: predict_plan(costs, cluster, even_plan),
        "plan": lambda costs, cluster: plan(costs, cluster, 8),
        "sweep": lambda costs, cluster: sweep(costs, cluster, 8, "batch", [8]),
        "balanced_batch_shares": lambda costs, cluster: balanced_batch_shares(costs, cluster, 8),
    }  # fmt: skip
    for call in calls.values():
        for bad in (None, "cnn", cnn_costs.layers):
            with pytest.raises(TypeError, match=r"^costs: must be a hetcoll.model.ModelCosts"):
                call(bad, two)
            with pytest.raises(TypeError, match=r"^cluster: must be a hetcoll.model.Cluster"):
                call(cnn_costs, bad)
        call(cnn_costs, two)  # the good arguments price
    total = "expected a total of at most"
    for shares, text in (([0, 0], "no device has samples"), ([2**70, 1], total),
                         ([2**53, 1], total), (None, "expected a sequence"),
                         ("44", "expected a sequence")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"^shares: {text}"):
            data_parallel(cnn_costs, two, shares)
    assert data_parallel(cnn_costs, two, [2**52, 2**52]).shares == [2**52, 2**52]
    for cap in (math.nan, 0, -1.0, "1", True):
        with pytest.raises(ValueError, match=r"^first_bucket_bytes: must be a number of bytes > 0"):
            data_parallel(cnn_costs, two, [4, 4], first_bucket_bytes=cap)
        with pytest.raises(ValueError, match=r"^bucket_bytes: must be a number of bytes > 0"):
            data_parallel(cnn_costs, two, [4, 4], bucket_bytes=cap)
    one_bucket = data_parallel(cnn_costs, two, [4, 4], first_bucket_bytes=math.inf)
    assert one_bucket.step_s > 0
    for batch in (-1, 0, 2.0, True, 2**53 + 1):
        with pytest.raises(ValueError, match=r"^batch: must be an integer in \[1, 2\*\*53\]"):
            balanced_batch_shares(cnn_costs, two, batch)
        with pytest.raises(ValueError, match=r"^batch: must be an integer in \[1, 2\*\*53\]"):
            plan(cnn_costs, two, batch)
    with pytest.raises(ValueError, match=r"^batch: must be an integer in \[2 \(micro_batches\)"):
        pipeline(cnn_costs, two, 1, 2)
    assert sum(balanced_batch_shares(cnn_costs, two, 9)) == 9
    for batch in (-1, math.nan, math.inf, "2", None, 2**2000):
        with pytest.raises(ValueError, match=r"^batch: must be a number of samples >= 0"):
            cnn_costs.forward_flops(batch)
        with pytest.raises(ValueError, match=r"^batch: must be a number of samples >= 0"):
            cnn_costs.backward_flops(batch)
    assert cnn_costs.forward_flops(np.int64(2)) == 2 * cnn_costs.forward_flops(1) > 0


def test_a_sweep_plans_every_point_it_labels(cnn_costs) -> None:  # type: ignore[no-untyped-def]
    """Each point's value is its label: 5 nodes of a 2-node cluster once planned the 2, batch
    1.9 planned 1, and -1 planned nothing, each labelled as asked."""
    from hetcoll.model import sweep

    d = Device("d", 1e12, 1e11, 1e9)
    nodes = Cluster([Node("a", d, 1), Node("b", d, 1)], Link("eth", 1e-5, 1e9))
    for axis, values, text in (("nodes", [5], r"values\[0\]: must be a count of nodes in 1..2"),
                               ("nodes", [1, 0], r"values\[1\]: must be a count of nodes"),
                               ("nodes", [1.0], r"values\[0\]: must be a count of nodes"),
                               ("batch", [1.9], r"values\[0\]: must be an integer batch >= 1"),
                               ("batch", [-1], r"values\[0\]: must be an integer batch"),
                               ("link_bw", [2, math.nan], r"values\[1\]: must be a factor > 0"),
                               ("flops", [0], r"values\[0\]: must be a factor > 0"),
                               ("mem_bw", "12", r"values: must be a non-empty sequence"),
                               ("mem_bw", [], r"values: must be a non-empty")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"^{text}"):
            sweep(cnn_costs, nodes, 8, axis, values)
    points = sweep(cnn_costs, nodes, 8, "nodes", [1, np.int64(2)])
    assert [p.value for p in points] == [1.0, 2.0]
    assert [p.best["data parallel, even"].shares for p in points] == [[8], [4, 4]]


def test_the_shape_of_one_sample_is_checked_once_for_every_reader() -> None:
    """A size of 0, True or 32.5 once built a model of nothing (networks.build) or weighted a
    hypergraph by it; a NaN bytes_per_element weighted every net NaN."""
    from hetcoll.model.hypergraph import network_hypergraph

    for shape in ((3, 0, 32), (0,), (3, 32.5, 32), (3, True, 32), (), "3x0x32", None):
        with pytest.raises(ValueError, match=r"^input_shape: expected the shape of one sample"):
            networks.build("cnn" if shape != (0,) else "mlp", shape, device="meta")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"^input_shape: expected the shape of one sample"):
            layer_costs(nn.Linear(4, 2), shape)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^input_shape: expected channels x height x width"):
        networks.build("cnn", (3, 32), device="meta")
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    for shape in ((3, 0, 8), (3, True, 8)):
        with pytest.raises(ValueError, match=r"^input_shape: expected the shape of one sample"):
            network_hypergraph(net, shape)
    for bpe in (math.nan, 0, 2.5, True, 65):
        with pytest.raises(ValueError, match=r"^bytes_per_element: must be an integer in 1..64"):
            network_hypergraph(net, (3, 8, 8), bytes_per_element=bpe)  # type: ignore[arg-type]
    assert network_hypergraph(net, "3x8x8", bytes_per_element=2).num_vertices == 6


def test_figures_that_overflow_a_step_are_refused_in_code_and_in_files(tmp_path: Path) -> None:
    """5e-324 FLOP/s or bytes/s once priced every plan at inf (a plan's JSON held Infinity
    and NaN breakdowns); a latency of 1.7e308 s likewise."""
    figures = {"flops_per_s": 1e12, "mem_bytes_per_s": 1e11, "memory_bytes": 1e9}
    for field, value, text in (("flops_per_s", 5e-324, "at least 1 a second"),
                               ("elementwise_bytes_per_s", 0.5, "0 or at least 1 a second"),
                               ("kernel_overhead_s", 1.7e308, "at most 1e\\+06 seconds"),
                               ("step_overhead_s", 1e7, "at most 1e\\+06 seconds")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"^Device 'd': {field}: must be {text}"):
            Device("d", **{**figures, field: value})  # type: ignore[arg-type]
    for field, value in (("bytes_per_s", 5e-324), ("latency_s", 1.7e308), ("call_s", 2e6)):
        with pytest.raises(ValueError, match=rf"^Link 'l': {field}: must be"):
            Link("l", **{"latency_s": 1e-5, "bytes_per_s": 1e9, field: value})  # type: ignore[arg-type]
    assert Link("self", 0.0, math.inf).bytes_per_s == math.inf  # a device talking to itself
    good = "flops_per_s = 1e12\nmem_bytes_per_s = 1e11\nmemory_bytes = 1e9\n"
    for table, line, text in (("devices.d", "flops_per_s = 5e-324", "devices.d.flops_per_s"),
                              ("links.l", "bytes_per_s = 5e-324", "links.l.bytes_per_s"),
                              ("links.l", "latency_s = 1.7e308", "links.l.latency_s")):  # fmt: skip
        device = good if table != "devices.d" else good.replace("flops_per_s = 1e12\n", "")
        link = "latency_s = 1e-5\nbytes_per_s = 1e9\n"
        link = "\n".join(x for x in link.splitlines() if x.split()[0] != line.split()[0])
        device_extra = line if table == "devices.d" else ""
        link_extra = line if table == "links.l" else ""
        path = tmp_path / "c.toml"
        path.write_text(
            f"[devices.d]\n{device}{device_extra}\n[links.l]\n{link}\n{link_extra}\n"
            '[[nodes]]\nname = "n"\ndevice = "d"\ncount = 2\nlink = "l"\n'
        )
        with pytest.raises(ValueError, match=rf"{text}: must be"):
            load_cluster(path)


def test_models_that_cannot_be_built_are_named_not_raised_from_inside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module whose import raised anything but ImportError (a SyntaxError) or called
    sys.exit (the CLI ended with its status and no word), a builder that raised, ':' (said
    "Empty module name"); a config of a billion layers (ran for ever), a vocabulary of 0 or 0
    experts (failed later, blaming the input), more experts a token than experts;
    transformers' reason cut to its first line (the field without why)."""
    (tmp_path / "broken_syntax.py").write_text("def f(:\n")
    (tmp_path / "raising_import.py").write_text("raise RuntimeError('at import')\n")
    (tmp_path / "raising_builder.py").write_text(
        "from torch import nn\n\ndef make() -> nn.Module:\n    raise RuntimeError('no')\n"
    )
    (tmp_path / "exiting_import.py").write_text("import sys\n\nsys.exit(3)\n")
    (tmp_path / "exiting_builder.py").write_text(
        "import sys\nfrom torch import nn\n\ndef make() -> nn.Module:\n    sys.exit()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name, text in (("broken_syntax:x", "cannot load 'broken_syntax:x': SyntaxError"),
                       ("exiting_import:x", r"cannot load 'exiting_import:x': its import "
                                            r"called sys.exit\(3\)"),
                       ("exiting_builder:make", r"'exiting_builder:make' failed to build: it "
                                                r"called sys.exit\(None\)"),
                       ("raising_import:x", "cannot load 'raising_import:x': RuntimeError"),
                       ("raising_builder:make", "'raising_builder:make' failed to build: "
                                                "RuntimeError: no"),
                       (":", "':' must be MODULE:ATTR"),
                       ("os:", "'os:' must be MODULE:ATTR")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"^model: {text}"):
            networks.build(name, (3, 8, 8))
    base = {"model_type": "mixtral", "vocab_size": 64, "hidden_size": 16,
            "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
            "max_position_embeddings": 32}  # fmt: skip
    for change, text in (({"num_hidden_layers": 10**9}, "num_hidden_layers: at most 10,000"),
                         ({"vocab_size": 0}, "vocab_size: must be >= 1, got 0"),
                         ({"num_local_experts": 0}, "num_local_experts: must be >= 1"),
                         ({"num_experts_per_tok": 9}, "num_experts_per_tok: 9 is more than"),
                         ({"num_local_experts": 10**6}, "1,000,000 experts in each of 2"),
                         ({"rope_scaling": {"type": "bogus"}}, "KeyError: 'bogus'"),
                         ({"hidden_size": "abc"}, "Validation error for field 'hidden_size': "
                                                  ".*expected int")):  # fmt: skip
        path = tmp_path / "config.json"
        path.write_text(json.dumps({**base, **change}))
        with pytest.raises(ValueError, match=rf"^model: hf:{path}: {text}"):
            networks.build(f"hf:{path}", (16,), device="meta")
    path.write_text(json.dumps(base))
    assert networks.build(f"hf:{path}", (16,), device="meta") is not None


def test_the_hypergraph_refuses_more_vertices_than_asked_before_listing_them() -> None:
    """10**11 input features once filled the memory listing their producers, and 10**12
    classes listing the last layer's neurons; the planner skips node-wise placement there."""
    from hetcoll.model.hypergraph import network_hypergraph
    from hetcoll.model.planner.search import SearchReport

    wide = networks.build("mlp", (99_999_999_999,), device="meta")
    with pytest.raises(ValueError, match=r"^max_vertices: the model has 2,058 filters"):
        network_hypergraph(wide, (99_999_999_999,), max_vertices=1500)
    many = networks.build("cnn", (1, 8, 8), 10**12, device="meta")
    with pytest.raises(ValueError, match=r"^max_vertices: the model has 1,000,000,00"):
        network_hypergraph(many, (1, 8, 8), max_vertices=1500)
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match=r"^max_vertices: must be an integer >= 1"):
            network_hypergraph(many, (1, 8, 8), max_vertices=bad)  # type: ignore[arg-type]
    d = Device("d", 1e12, 1e11, 1e12)
    two = Cluster([Node("n", d, 2, Link("l", 1e-5, 1e9))])
    report = SearchReport()
    plan(layer_costs(wide, (99_999_999_999,)), two, 8, model=wide, report=report)
    assert "99,999,999,999 channels" in report.skipped["node-wise placement"]
