"""benches/device's plans and LM checks (issue 40), here without a GPU: the plans they build are
valid plans the performance model predicts, of the kinds the issue names, and plans.py runs
every one of them end to end on real ranks (rank 0 on the CPU, as in the dry run)."""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

import hetcoll

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benches" / "device"))

import plans as device_plans  # noqa: E402

#: The plans run at any speeds (an eleventh, "balanced, every rank", when the split idles a rank).
BASE = (
    "data-parallel, balanced",
    "data-parallel, equal split",
    "the GPU alone",
    "device subset: GPU + CPU 1",
    "filter split over every rank",
    "filter split: GPU + CPU 1",
    "pipeline: GPU convs, CPU 1 head",
    "pipeline: GPU convs, head over CPU stages",
    "pipeline: GPU convs, head split over CPUs",
    "hybrid: pipeline beside CPU replicas",
)

#: A calibration file as `hetcoll model calibrate` writes it: the CPU rank and the gloo link.
CALIBRATION = (
    "[devices.cpu]\nflops_per_s = 5e10\nmem_bytes_per_s = 1e10\nmemory_bytes = 8e9\n"
    "kernel_overhead_s = 5e-6\n[links.gloo]\nlatency_s = 5e-5\nbytes_per_s = 1e9\n"
    '[[nodes]]\nname = "here"\ndevice = "cpu"\ncount = 2\nlink = "gloo"\n'
)

#: A GPU rank about 20x a CPU rank, three CPU ranks of unequal speeds (samples/s, fixed s).
SPEEDS = [6000.0, 300.0, 250.0, 200.0]
LATENCY = [2e-3, 1e-3, 1e-3, 1e-3]


def _cluster(world: int) -> Any:
    from hetcoll.model import Cluster, Device, Link, Node

    gpu = Device("gpu", 50e12, 3e12, 80e9, kernel_overhead_s=5e-6)
    cpu = Device("cpu", 5e10, 1e10, 8e9, kernel_overhead_s=5e-6)
    link = Link("gloo", 5e-5, 1e9)
    return Cluster([Node("gpu", gpu, 1), Node("cpu", cpu, world - 1, link)], link)


def test_cnn_plans_are_valid_and_predicted() -> None:
    """Ten plans over 1 GPU + 3 CPU ranks: each a valid plan of the demo CNN's 9 layers over
    the global batch, every rank in some plan, the kinds the issue asks for, each predicted."""
    from hetcoll.model import layer_costs, predict_plan

    built = device_plans.plans(SPEEDS, LATENCY, 256, 4)
    assert set(built) >= set(BASE)
    # The split leaves no CPU rank idle at these speeds: "every rank" would repeat "balanced".
    assert len(built) == 10
    assert {kind for kind, _ in built.values()} >= {
        "data-parallel",
        "filter split",
        "pipeline",
        "hybrid",
    }
    costs = layer_costs(device_plans.demo_model(), device_plans.SHAPE)
    cluster = _cluster(4)
    used: set[int] = set()
    for name, (_, spec) in built.items():
        plan = hetcoll.Plan.from_dict(spec)
        assert plan.num_layers == device_plans.LAYERS, name
        assert plan.batch == 256, name
        used.update(plan.ranks)
        step = predict_plan(costs, cluster, plan).step_s
        assert math.isfinite(step) and step > 0, (name, step)
    assert used == {0, 1, 2, 3}
    alone = hetcoll.Plan.from_dict(built["the GPU alone"][1])
    assert list(alone.ranks) == [0]
    # The balanced split gives the GPU nearly all of the batch; the equal one a quarter.
    balanced = [r["samples"] for r in built["data-parallel, balanced"][1]["replicas"]]
    assert balanced[0] > 200 and sum(balanced) == 256
    assert [r["samples"] for r in built["data-parallel, equal split"][1]["replicas"]] == [64] * 4


@pytest.mark.multiproc  # the step's fixed cost: a rank of its own
def test_gpu_probes_make_the_models_device() -> None:
    """hetero.measure_gpu's probes (run here on the CPU, as the dry run does): positive finite
    figures, the Device fields among them; a view op costs the host something, less than a
    step of the probe."""
    import dataclasses

    import torch

    from hetcoll.model import Device

    import hetero

    figures = hetero.measure_gpu(torch.device("cpu"))
    for key in (
        "flops_per_s",
        "conv_flops_per_s",
        "mem_bytes_per_s",
        "kernel_overhead_s",
        "conv_overhead_s",
        "step_overhead_s",
        "launch_s",
        "view_s",
    ):
        assert math.isfinite(figures[key]) and figures[key] >= 0, key
    assert figures["flops_per_s"] > 0 and figures["kernel_overhead_s"] > 0
    assert 0 < figures["view_s"] < 1e-3
    # The step probe at two depths; the first is the device's step overhead.
    probes = figures["step_probes"]
    assert [p["depth"] for p in probes] == [8, 32]
    assert all(p["step_s"] > 0 and p["residual_s"] >= 0 for p in probes)
    assert probes[1]["step_s"] > probes[0]["step_s"]
    assert figures["step_overhead_s"] == probes[0]["residual_s"]
    fields = {f.name for f in dataclasses.fields(Device)}
    assert "step_overhead_s" in fields and "view_s" not in fields
    # Copies to and from the host: pageable both ways; pinned on a GPU only.
    rates = figures["host_copy"]
    assert rates["pageable_to_host_bytes_per_s"] > 0 < rates["pageable_from_host_bytes_per_s"]
    assert rates["pinned_to_host_bytes_per_s"] is rates["pinned_from_host_bytes_per_s"] is None


def test_real_cluster_puts_the_gpu_first(tmp_path: Path) -> None:
    """real_cluster: the GPU's figures at rank 0 (what is not a Device field, launch_s, left
    out), the calibrated CPU rank after it, the gloo link between; no file, no cluster."""
    import hetero

    figures = {
        "name": "H200",
        "flops_per_s": 5e13,
        "mem_bytes_per_s": 4e12,
        "memory_bytes": 1.4e11,
        "kernel_overhead_s": 1e-5,
        "conv_overhead_s": 2e-5,
        "launch_s": 3e-6,
    }
    cluster_file = tmp_path / "cluster.toml"
    cluster_file.write_text(CALIBRATION)
    cluster, alone, why_not = hetero.real_cluster(str(cluster_file), figures, 4)
    assert why_not is None
    assert cluster.num_devices == 4 and alone.num_devices == 1
    first = cluster.devices[0]
    assert (first.name, first.flops_per_s, first.conv_overhead_s) == ("gpu", 5e13, 2e-5)
    assert [d.name for d in cluster.devices[1:]] == ["cpu"] * 3
    link = cluster.link_between(0, 1)
    assert (link.latency_s, link.bytes_per_s) == (5e-5, 1e9)
    missing = hetero.real_cluster(str(tmp_path / "none.toml"), figures, 4)
    assert missing[0] is None and missing[2].startswith("skipped: no calibration file")


def test_cnn_plans_need_two_cpu_ranks() -> None:
    with pytest.raises(ValueError, match="--cpu-ranks: the plans need at least 2 CPU ranks"):
        device_plans.plans(SPEEDS[:2], LATENCY[:2], 64, 4)


def test_lm_plans_are_valid_and_predicted() -> None:
    """The LM check's runs: the GPU alone, balanced, equal, a pipeline and (with 2+ CPU ranks)
    a hybrid, each a valid plan of train_lm's Llama the model predicts."""
    import torch

    from hetcoll.model import layer_costs, predict_plan
    from hetcoll.torch.layers import model_layers

    device_lm = importlib.import_module("lm")  # benches/device/lm.py
    model = device_lm.lm_model(torch.device("cpu"))
    layers = len(model_layers(model))
    shape = {"input_ids": (64,), "attention_mask": (64,)}
    costs = layer_costs(model, shape, dtype=torch.int64)
    cases = (
        ([f / 60 for f in SPEEDS], LATENCY, 5),
        ([f / 60 for f in SPEEDS[:2]], LATENCY[:2], 4),
        # The CPU ranks' fixed cost outlasts the GPU's step: "balanced" idles them.
        ([5000.0, 80.0, 80.0, 80.0], [0.02, 0.03, 0.03, 0.03], 6),
    )
    for speeds, latency, runs in cases:
        world = len(speeds)
        built = device_lm.plans(speeds, latency, 64, 4, layers)
        assert len(built) == runs, list(built)
        for name, (_, spec) in built.items():
            plan = hetcoll.Plan.from_dict(spec)
            assert plan.num_layers == layers and plan.batch == 64, name
            step = predict_plan(costs, _cluster(world), plan).step_s
            assert math.isfinite(step) and step > 0, (name, step)


def _dry_run(
    main: Any, tmp_path: Path, *, cpu_ranks: int, batch: int, warmup: int
) -> dict[str, Any]:
    """A device script's ``main`` as the dry run runs it (rank 0 on the CPU, 2 timed steps,
    the calibration of :data:`CALIBRATION`): its JSON, once it returned 0."""
    cluster = tmp_path / "cluster.toml"
    cluster.write_text(CALIBRATION)
    out = tmp_path / "out.json"
    args = ["--cluster", str(cluster), "--json", str(out), "--cpu-ranks", str(cpu_ranks)]
    args += ["--batch", str(batch), "--warmup", str(warmup), "--steps", "2", "--probe-s", "0.2"]
    assert main([*args, "--timeout", "200"]) == 0
    return json.loads(out.read_text())


@pytest.mark.multiproc
def test_plans_script_runs_every_plan(tmp_path: Path) -> None:
    """plans.py as the dry run runs it (1 + 2 ranks, rank 0 on the CPU, a calibration of the
    CPU ranks written here): every plan runs under parallelize and is predicted, and the JSON
    holds each one's measured and predicted step."""
    got = _dry_run(device_plans.main, tmp_path, cpu_ranks=2, batch=16, warmup=0)
    assert got["status"].startswith("skipped: no CUDA")
    rows = got["configurations"]
    names = [r["name"] for r in rows]
    # Ten plans, eleven when the split idles a rank, and the planner's pick beside them.
    assert set(names) >= set(BASE) and names[-1] == device_plans.PICK, names
    assert len(names) - 1 in (10, 11), names
    for r in rows:
        assert r["status"] == "ok", (r["name"], r.get("traceback"))
        assert r["prediction"]["status"] == "ok", r["prediction"]
        assert r["step_s"] > 0 and r["prediction"]["step_s"] > 0
        assert r["prediction"]["error"] == pytest.approx(
            r["prediction"]["step_s"] / r["step_s"] - 1
        )
        # And without the devices' step overhead: shorter, never longer (the term only adds).
        without = r["prediction"]["without_step_overhead_s"]
        assert 0 < without <= r["prediction"]["step_s"]
        assert r["prediction"]["error_without_step_overhead"] == pytest.approx(
            without / r["step_s"] - 1
        )
    assert got["prediction_error"]["count"] == len(names)
    # Each plan ran on the ranks a user starts for it (0 up to the last it names), as
    # `hetcoll plan` prints the commands: the GPU alone on rank 0 alone, the subset on two.
    started = {r["name"]: r["started_ranks"] for r in rows}
    for r in rows:
        assert started[r["name"]] == 1 + max(hetcoll.Plan.from_dict(r["plan"]).ranks)
    assert started[device_plans.ALONE] == 1 and started["device subset: GPU + CPU 1"] == 2
    assert max(started.values()) == 3
    assert got["runtime"]["status"] == "ok" and got["runtime"]["started_ranks"] == 1
    # The demo CNN's gradients, for the report's staging note: its parameters in float32.
    assert got["gradient_bytes"] == 4 * sum(
        p.numel() for p in device_plans.demo_model().parameters()
    )


def test_cnn_plans_idle_a_rank_the_split_leaves_out() -> None:
    """A CPU rank whose fixed cost alone outlasts the GPU's whole step gets no sample from
    hetcoll.split: "balanced" leaves it idle, "balanced, every rank" gives it one."""
    speeds, latency = [500_000.0, 900.0, 800.0, 700.0], [1e-3, 5e-3, 5e-3, 5e-3]
    built = device_plans.plans(speeds, latency, 256, 4)
    assert len(built) == 11
    assert [r["samples"] for r in built["data-parallel, balanced"][1]["replicas"]] == [256]
    every = built["data-parallel, balanced, every rank"][1]["replicas"]
    assert [r["samples"] for r in every] == [253, 1, 1, 1]


@pytest.mark.multiproc
def test_hetero_script_takes_the_balanced_step_apart(tmp_path: Path) -> None:
    """hetero.py as the dry run runs it (1 + 1 ranks, rank 0 on the CPU): the balanced step's
    parts, every rank's own step without the allreduce and the allreduce alone (on each rank's
    device and in host memory), and the model's parts of it beside them; and a message's hop
    between the ranks, beside the model's link."""
    import hetero

    (row,) = _dry_run(hetero.main, tmp_path, cpu_ranks=1, batch=32, warmup=1)["configurations"]
    parts = row["balanced_parts"]
    assert len(parts["local_s"]) == 2 and all(t > 0 for t in parts["local_s"])
    assert parts["allreduce_s"] > 0 and parts["allreduce_host_s"] > 0
    assert parts["gradient_bytes"] == 4 * sum(p.numel() for p in hetero.demo_model().parameters())
    model = row["prediction"]["balanced_parts"]
    assert len(model["compute_s"]) == 2 and model["critical_device"] in (0, 1)
    assert 0 < model["allreduce_s"] < row["prediction"]["step_s"]["balanced"]
    assert model["breakdown"]["communication"] >= 0
    # A message's hop between rank 0 and rank 1, measured and as the model's link prices it.
    assert [h["bytes"] for h in row["hops"]] == list(hetero.HOP_BYTES)
    assert all(h["device_s"] > 0 and h["host_s"] > 0 for h in row["hops"])
    link = [h["link_s"] for h in row["prediction"]["hops"]]
    assert len(link) == len(hetero.HOP_BYTES) and link == sorted(link) and link[0] > 0
