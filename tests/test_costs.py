"""Layer costs counted op by op on the meta device (issue 28 part 1) and the training precision
(part 2): FLOPs against torch's FlopCounterMode on stock torchvision models and on attention
written in ``forward``, bytes by hand, attribution of backward ops, precision peaks from the
cluster TOML, element sizes, and bad precision names."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode

from hetcoll.cli import main
from hetcoll.model import Device, cluster_from_dict, layer_costs, load_cluster, networks, plan
from hetcoll.model.hardware import dumps_cluster
from hetcoll.model.predict import compute_seconds

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "clusters"


def _meta_flops(model: nn.Module, shape: tuple[int, ...], batch: int = 1) -> tuple[int, int]:
    """FlopCounterMode's forward and backward FLOPs of ``model`` on meta tensors."""
    state = {
        k: torch.empty_like(v, device="meta").requires_grad_(v.requires_grad)
        for k, v in model.named_parameters()
    }
    state.update({k: torch.empty_like(v, device="meta") for k, v in model.named_buffers()})
    fwd, bwd = FlopCounterMode(display=False), FlopCounterMode(display=False)
    with fwd:
        y = functional_call(model, state, (torch.empty((batch, *shape), device="meta"),))
    with bwd:
        y.backward(torch.empty_like(y))
    return fwd.get_total_flops(), bwd.get_total_flops()


class Attention(nn.Module):
    """Multi-head self-attention whose matmuls and softmax live in ``forward`` (through
    ``F.scaled_dot_product_attention``), not in leaf modules."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def small_transformer() -> nn.Module:
    """Two pre-norm blocks over 64 tokens of width 32, 4 heads."""
    return nn.Sequential(Block(32, 4), Block(32, 4))


def _torchvision(name: str) -> nn.Module:
    import torchvision

    return getattr(torchvision.models, name)()  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "name", ["resnet18", "mobilenet_v3_small", "vit_b_16", "regnet_x_400mf", "densenet121"]
)
def test_cli_costs_json_forward_flops_agree_with_flop_counter_on_torchvision(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: vit_b_16 35% low (attention and matmuls outside leaf modules were invisible),
    # mobilenet_v3_small crashed on its in-place Hardswish, regnet_x_400mf could not be built
    # on the meta device (its constructor reads its widths off tensors), densenet121 had no
    # plan layers (its in-place ReLUs met the leaf tensors standing for blocks' outputs).
    argv = ["model", "costs", "--model", f"torchvision.models:{name}", "--input", "3x224x224"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    model = _torchvision(name)
    reference, _ = _meta_flops(model, (3, 224, 224))
    ratio = out["forward_flops"] / reference
    print(f"{name}: hetcoll / FlopCounterMode forward FLOPs = {ratio:.6f}")
    assert 0.95 <= ratio <= 1.05
    # Every parameter is some layer's, once.
    assert out["params"] == sum(p.numel() for p in model.parameters())
    assert sum(x["params"] for x in out["layers"]) == out["params"]
    assert not [n for n in out["notes"] if "formula" in n]


def test_resnet18_formulas_equal_the_op_count_forward_and_backward() -> None:
    # The leaf formulas (conv, linear GEMMs) stay as the cross-check of the op count: on a model
    # whose arithmetic is all convolutions and one linear layer they agree exactly.
    model = _torchvision("resnet18")
    costs = layer_costs(model, (3, 224, 224))
    fwd, bwd = _meta_flops(model, (3, 224, 224), batch=2)
    assert costs.forward_flops(2) == fwd
    assert costs.backward_flops(2) == bwd
    assert costs.plan_layers  # the residual adds go with their block: still a chain of layers


def test_attention_in_forward_is_costed_and_backward_goes_to_its_layer() -> None:
    model = small_transformer()
    costs = layer_costs(model, (64, 32))
    fwd, bwd = _meta_flops(model, (64, 32), batch=2)
    assert costs.forward_flops(2) == fwd and costs.backward_flops(2) == bwd
    names = [x.name for x in costs.layers]
    attn = costs.layers[names.index("0.attn")]
    assert attn.kind == "Attention.forward" and attn.own_ops
    # Between its children's calls, in execution order.
    assert names.index("0.attn.qkv") < names.index("0.attn") < names.index("0.attn.out")
    # SDPA: Q K^T and A V, 2 * 64 * 64 * 8 FLOPs each per head, 4 heads; backward twice that
    # (FlopCounterMode's formulas), all on this layer.
    assert attn.forward_flops(1) == 4 * 2 * 64 * 64 * 8 * 2
    assert attn.backward_flops(1) == 2 * attn.forward_flops(1)
    # Ratio against the reference on the CLI's own path (per sample).
    ref1, _ = _meta_flops(model, (64, 32))
    print(f"small transformer: hetcoll / FlopCounterMode = {costs.forward_flops(1) / ref1:.6f}")
    assert costs.forward_flops(1) == ref1


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.w = nn.Parameter(torch.randn(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) + x) @ self.w


def test_bytes_of_ops_in_forward_by_hand() -> None:
    costs = layer_costs(Residual(), (16,))
    own = [x for x in costs.layers if x.own_ops]
    assert [x.name for x in costs.layers] == ["lin", "Residual"]
    (layer,) = own
    assert layer.params == 16 * 8 and layer.param_bytes == 16 * 8 * 4
    ops = {k.name: k for k in layer.forward}
    # x + y: read 16 + 16 floats, write 16, per sample; nothing fixed.
    assert ops["ops"].bytes_per_sample == 3 * 16 * 4 and ops["ops"].bytes_fixed == 0
    # (x + y) @ w: 2 * 16 * 8 FLOPs and 16 + 8 floats per sample, the weight read once.
    assert ops["matmul"].flops_per_sample == 2 * 16 * 8
    assert ops["matmul"].bytes_per_sample == (16 + 8) * 4
    assert ops["matmul"].bytes_fixed == 16 * 8 * 4
    assert not ops["ops"].flops_per_sample  # element-wise work costs bytes, not FLOPs
    assert ops["ops"].elementwise and not ops["matmul"].elementwise


# ---------------------------------------------------------------- precision

PEAKS = {"tf32_flops_per_s": 8e12, "bf16_flops_per_s": 16e12, "fp16_flops_per_s": 32e12}


def _compute_bound(**peaks: float) -> Device:
    """A device where only arithmetic costs time: no launch cost, unbounded bandwidth."""
    return Device("gpu", 1e12, 1e30, 1e12, elementwise_bytes_per_s=1e30, **peaks)


def test_predictions_scale_as_the_peaks_say() -> None:
    costs = layer_costs(networks.mlp((64,)), (64,))
    device = _compute_bound(**PEAKS)
    fp32 = compute_seconds(costs, device, 32)
    assert fp32 == pytest.approx((costs.forward_flops(32) + costs.backward_flops(32)) / 1e12)
    for precision, peak in (("tf32", 8e12), ("bf16", 16e12), ("fp16", 32e12)):
        t = compute_seconds(costs.at_precision(precision), device, 32)
        assert fp32 / t == pytest.approx(peak / 1e12, rel=1e-12)
        assert compute_seconds(
            layer_costs(networks.mlp((64,)), (64,), precision=precision), device, 32
        ) == pytest.approx(t, rel=1e-12)


def test_convolutions_keep_their_calibrated_rate_ratio() -> None:
    # A calibrated convolution rate (1.5x the GEMM rate here) is scaled by the same peak ratio.
    costs = layer_costs(nn.Sequential(nn.Conv2d(8, 8, 3, bias=False)), (8, 16, 16))
    device = Device("gpu", 1e12, 1e30, 1e12, conv_flops_per_s=1.5e12, bf16_flops_per_s=4e12)
    ratio = compute_seconds(costs, device, 4) / compute_seconds(
        costs.at_precision("bf16"), device, 4
    )
    assert ratio == pytest.approx(4.0, rel=1e-12)


def test_bf16_halves_activation_bytes_not_weights_or_gradients() -> None:
    costs = layer_costs(networks.cnn((3, 32, 32)), (3, 32, 32))
    half = costs.at_precision("bf16")
    assert half.precision == "bf16" and half.activation_itemsize == 2
    assert half.param_bytes == costs.param_bytes  # fp32 master weights, gradients, allreduce
    for a, b in zip(costs.layers, half.layers):
        assert b.out_bytes_per_sample == a.out_bytes_per_sample / 2
        assert b.gradient_bytes == a.gradient_bytes
        for ka, kb in zip(a.forward + a.backward, b.forward + b.backward):
            assert kb.moved_bytes(8) == ka.moved_bytes(8) / 2 and kb.flops(8) == ka.flops(8)
    assert half.plan_out_bytes == tuple(x / 2 for x in costs.plan_out_bytes)
    assert costs.at_precision("tf32").layers == costs.layers  # tf32 keeps fp32 tensors
    assert half.at_precision("fp32") == costs


def test_a_device_without_the_peak_falls_back_to_fp32_with_a_warning() -> None:
    costs = layer_costs(networks.mlp((64,)), (64,))
    device = _compute_bound(fp16_flops_per_s=4e12)  # like a V100: fp16 tensor cores only
    with pytest.warns(UserWarning, match="device 'gpu' has no bf16 peak.*fp32 rate"):
        t = compute_seconds(costs.at_precision("bf16"), device, 16)
    assert t == pytest.approx(compute_seconds(costs, device, 16), rel=1e-12)


def test_plan_and_cli_take_the_precision(capsys: pytest.CaptureFixture[str]) -> None:
    cluster = load_cluster(EXAMPLES / "a100_v100_cpu.toml")
    a100 = cluster.devices[0]
    assert (a100.peak_flops_per_s("bf16"), a100.matmul_speedup("tf32")) == (312e12, 8.0)
    costs = layer_costs(networks.cnn((3, 32, 32)), (3, 32, 32))
    a100_only = cluster.subset(list(range(8)))
    fp32 = plan(costs, a100_only, 256, subsets=False)[0]
    bf16 = plan(costs, a100_only, 256, subsets=False, precision="bf16")[0]
    assert bf16.breakdown["compute"] < fp32.breakdown["compute"] / 8
    args = ["plan", "--model", "cnn", "--input", "3x32x32", "--batch", "256", "--json"]
    with pytest.warns(UserWarning, match="no bf16 peak"):  # the V100s and CPUs have none
        cluster_file = str(EXAMPLES / "a100_v100_cpu.toml")
        assert main([*args, "--cluster", cluster_file, "--precision", "bf16"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["precision"] == "bf16" and out["plans"][0]["feasible"]


def test_precision_peaks_round_trip_through_toml(tmp_path: Path) -> None:
    doc = {
        "devices": {
            "g": {"flops_per_s": 1e12, "mem_bytes_per_s": 1e11, "memory_bytes": 8e9, **PEAKS}
        },
        "nodes": [{"name": "n", "device": "g", "count": 1}],
    }
    for cluster in (cluster_from_dict(doc), load_cluster(EXAMPLES / "a100_v100_cpu.toml")):
        (tmp_path / "c.toml").write_text(dumps_cluster(cluster))
        again = load_cluster(tmp_path / "c.toml")
        for a, b in zip(cluster.devices, again.devices, strict=True):
            for p in ("fp32", "tf32", "bf16", "fp16"):
                assert b.peak_flops_per_s(p) == a.peak_flops_per_s(p)
    assert cluster_from_dict(doc).devices[0].matmul_speedup("fp16") == 32.0
    v100 = load_cluster(EXAMPLES / "a100_v100_cpu.toml").devices[8]
    assert v100.name == "v100-sxm2-32gb" and v100.peak_flops_per_s("bf16") == 0.0


def test_bad_precision_names_and_peaks_raise_naming_the_argument() -> None:
    costs = layer_costs(nn.Linear(4, 3), (4,))
    with pytest.raises(ValueError, match="precision: expected one of fp32, tf32, bf16, fp16"):
        layer_costs(nn.Linear(4, 3), (4,), precision="bf32")
    with pytest.raises(ValueError, match=r"^precision:"):
        costs.at_precision("int8")
    cluster = load_cluster(EXAMPLES / "a100_v100_cpu.toml")
    with pytest.raises(ValueError, match=r"^precision:"):
        plan(costs, cluster, 8, precision="FP16")
    with pytest.raises(ValueError, match=r"^precision:"):
        cluster.devices[0].peak_flops_per_s("half")
    doc = {
        "devices": {
            "g": {"flops_per_s": 1, "mem_bytes_per_s": 1, "memory_bytes": 1, "bf16_flops_per_s": -1}
        },
        "nodes": [{"name": "n", "device": "g"}],
    }
    with pytest.raises(ValueError, match=r"devices\.g\.bf16_flops_per_s: must be a number >= 0"):
        cluster_from_dict(doc)
    with pytest.raises(SystemExit):
        main(["model", "costs", "--model", "cnn", "--input", "3x32x32", "--precision", "int8"])


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.lstm(x)
        return self.fc(y[:, -1])


def test_a_leaf_returning_a_tuple_is_costed_from_its_ops() -> None:
    model = Recurrent()
    costs = layer_costs(model, (5, 8))
    fwd, bwd = _meta_flops(model, (5, 8), batch=2)
    assert costs.forward_flops(2) == fwd and costs.backward_flops(2) == bwd
    lstm = costs.layers[0]
    assert (lstm.name, lstm.params) == ("lstm", sum(p.numel() for p in model.lstm.parameters()))
    assert lstm.out_bytes_per_sample == 5 * 16 * 4  # the output sequence, not the state


class _Stores(nn.Module):
    """Keeps what its forward computed in a plain attribute, as RAFT's correlation block
    keeps its pyramid: after a count on meta tensors, a tensor with a graph."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.kept = [torch.zeros(1)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.kept = [self.fc(x)]
        return self.kept[0] * 2


def test_tensors_a_forward_stores_on_the_model_are_set_back_after_counting() -> None:
    # Before: the count left meta tensors with a graph on the user's model, and the costs'
    # block mapping then failed to copy it (deepcopy of a non-leaf tensor); torchvision's
    # RAFT raised so from `hetcoll model costs` and `hetcoll plan`.
    model = _Stores()
    kept = model.kept
    costs = layer_costs(model, (8,))
    assert model.kept is kept and kept[0].device.type == "cpu"
    assert costs.forward_flops(1) == 2 * 8 * 8
    import torchvision

    raft = torchvision.models.optical_flow.raft_small()
    pyramid = raft.corr_block.corr_pyramid
    costs = layer_costs(raft, {"image1": (3, 128, 128), "image2": (3, 128, 128)})
    assert raft.corr_block.corr_pyramid is pyramid and costs.forward_flops(1) > 0


class _Frames(nn.Module):
    """A CNN run on every frame of a clip, the frames folded into the batch it sees: one
    sample's input to the conv is (frames, channels, height, width)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.fc = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[:2]
        f = self.conv(x.flatten(0, 1)).mean((2, 3))
        return self.fc(f.view(b, t, -1).mean(1))


def test_a_conv_seeing_frames_folded_into_its_batch_is_costed_per_frame() -> None:
    # Before: the formula read a sample's first dimension (the 8 frames) as the channels,
    # 2.7x the forward FLOPs (torchvision's MViT folds heads so, its pooling convs' 0).
    model = _Frames()
    costs = layer_costs(model, (8, 3, 16, 16))
    fwd, bwd = _meta_flops(model, (8, 3, 16, 16), batch=2)
    assert costs.forward_flops(2) == fwd and costs.backward_flops(2) == bwd
    assert not costs.notes


class _Wrapped(nn.Module):
    """Attention whose matmuls live in its forward, its output a tensor or held by a
    ``types.SimpleNamespace`` (as many users' wrappers return)."""

    def __init__(self, wrap: bool) -> None:
        super().__init__()
        self.q, self.wrap = nn.Linear(16, 16), wrap

    def forward(self, x: torch.Tensor) -> Any:
        q = self.q(x)
        y = torch.softmax(q @ q.transpose(-1, -2), -1) @ q
        return types.SimpleNamespace(logits=y) if self.wrap else y


def test_an_output_outside_pytrees_is_costed_backward_too() -> None:
    # Before: no tensor found in a SimpleNamespace, no backward run: the forward's own
    # matmuls and element-wise ops had no backward cost.
    fwd, bwd = _meta_flops(_Wrapped(False), (8, 16), batch=2)
    for wrap in (False, True):
        costs = layer_costs(_Wrapped(wrap), (8, 16))
        assert costs.forward_flops(2) == fwd and costs.backward_flops(2) == bwd


class _TableBias(nn.Module):
    """A bias computed by an MLP from a constant table, once a forward whatever the batch
    (Swin v2's continuous position bias), beside a layer on the samples, and a product of
    the table by a weight in the forward's own code (DeBERTa's and Funnel's projections of
    their relative positions)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.randn(5, 16))
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        self.kernel = nn.Parameter(torch.randn(16, 8))
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.mlp(self.table) + self.table @ self.kernel  # (5, 8), once a forward
        return self.fc(x) + bias


@pytest.mark.parametrize("batch", [1, 3, 64])
def test_work_on_a_constant_table_is_costed_once_a_step(batch: int) -> None:
    # Before: the MLP's formula took the table's first dimension for the batch (its FLOPs
    # per sample, 1.26x Swin v2-T's forward at 16x16), and the product in the forward's code
    # was divided among the counting batch's samples (DeBERTa-v2 1.16x high at batch 2).
    costs = layer_costs(_TableBias(), (5, 8))
    fwd, bwd = _meta_flops(_TableBias(), (5, 8), batch=batch)
    assert costs.forward_flops(batch) == fwd and costs.backward_flops(batch) == bwd
    mlp = next(x for x in costs.layers if x.name == "mlp.0")
    assert mlp.forward_flops(batch) == mlp.forward_flops(1) == 2 * 5 * 16 * 32
    assert mlp.forward_flops(0) == 0  # a device with no samples runs no step
    # The performance model prices the same FLOPs.
    seconds = compute_seconds(costs, _compute_bound(), batch)
    assert seconds == pytest.approx((fwd + bwd) / 1e12, rel=1e-12)


def _frozen_backbone() -> nn.Module:
    """A classifier fine-tuned on a frozen backbone (its convolutions' weights and biases
    need no gradient), the head trained."""
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(), nn.Flatten(),
        nn.Linear(8 * 4 * 4, 10),
    )  # fmt: skip
    for p in model[:4].parameters():
        p.requires_grad_(False)
    return model


def test_a_frozen_backbone_costs_no_weight_gradients() -> None:
    # Before: every conv got its weight-gradient GEMM (backward 3.85x FlopCounterMode's), and
    # the frozen weights were allreduced and updated.
    costs = layer_costs(_frozen_backbone(), (3, 8, 8))
    fwd, bwd = _meta_flops(_frozen_backbone(), (3, 8, 8), batch=4)
    assert costs.forward_flops(4) == fwd and costs.backward_flops(4) == bwd
    by = {x.name: x for x in costs.layers}
    # The first conv needs no gradient at all; the second its input's alone (none either).
    assert by["0"].backward == () and by["2"].backward == ()
    assert [k.name for k in by["5"].backward] == ["gemm-dW", "bias-grad"]
    head = (8 * 4 * 4 * 10 + 10) * 4
    assert costs.gradient_bytes == by["5"].gradient_bytes == head
    assert costs.param_bytes == head + (3 * 8 * 9 + 8 + 8 * 8 * 9 + 8) * 4
    # Data parallelism allreduces and updates the head's weights alone.
    from hetcoll.model.predict import data_parallel_schedule

    trainable = _frozen_backbone().requires_grad_(True)
    cluster = cluster_from_dict(
        {
            "devices": {"d": {"flops_per_s": 1e12, "mem_bytes_per_s": 1e10, "memory_bytes": 1e12}},
            "links": {"l": {"latency_s": 0.0, "bytes_per_s": 1e9}},
            "nodes": [{"name": "a", "device": "d", "count": 2, "link": "l"}],
            "network": {"link": "l"},
        }
    )
    frozen = data_parallel_schedule(costs, cluster, [4, 4])
    trained = data_parallel_schedule(layer_costs(trainable, (3, 8, 8)), cluster, [4, 4])
    whole = layer_costs(trainable, (3, 8, 8)).gradient_bytes
    assert frozen.update_s[0] / trained.update_s[0] == pytest.approx(head / whole, rel=1e-12)
    allreduce = [sum(c for _, c in s.buckets) for s in (frozen, trained)]
    assert allreduce[0] / allreduce[1] == pytest.approx(head / whole, rel=1e-12)


def test_frozen_weights_hold_no_gradients_or_optimizer_state_in_any_plan() -> None:
    # Before: pipelines, filter splits and expert placements held, updated and summed the
    # frozen backbone's gradients and optimizer state (a LoRA fine-tune's plans were priced
    # as a full fine-tune's: up to 3x the memory).
    from hetcoll import Plan
    from hetcoll.model.predict import filter_parallel_schedule, plan_schedule

    costs = layer_costs(_frozen_backbone(), (3, 8, 8))
    trainable = layer_costs(_frozen_backbone().requires_grad_(True), (3, 8, 8))
    backbone = costs.param_bytes - costs.gradient_bytes
    head = costs.gradient_bytes
    cluster = cluster_from_dict(
        {
            "devices": {"d": {"flops_per_s": 1e12, "mem_bytes_per_s": 1e10, "memory_bytes": 1e12}},
            "links": {"l": {"latency_s": 0.0, "bytes_per_s": 1e9}},
            "nodes": [{"name": "a", "device": "d", "count": 4, "link": "l"}],
            "network": {"link": "l"},
        }
    )
    # Two replicas of a two-stage pipeline: the backbone's stage holds its weights alone; the
    # head's, weights, gradients, momentum and the buffer the replicas sum gradients in.
    stages = [{"ranks": [0], "layers": [0, 3]}, {"ranks": [1], "layers": [3, 6]}]
    other = [{"ranks": [2], "layers": [0, 3]}, {"ranks": [3], "layers": [3, 6]}]
    plan = Plan.from_dict(
        {
            "microbatches": 2,
            "schedule": "1F1B",
            "replicas": [{"samples": 4, "stages": stages}, {"samples": 4, "stages": other}],
        }
    )
    laid = plan_schedule(costs, cluster, plan, optimizer_state_copies=1)
    assert list(laid.state_bytes) == [backbone, 4 * head, backbone, 4 * head]
    assert list(laid.update_s) == [0.0, 5 * head / 1e10, 0.0, 5 * head / 1e10]
    # A filter split over 4 devices: each holds a quarter of the backbone's filters, frozen.
    split = filter_parallel_schedule(costs, cluster, 8, [1, 1, 1, 1])
    whole = filter_parallel_schedule(trainable, cluster, 8, [1, 1, 1, 1])
    assert list(whole.memory_bytes - split.memory_bytes) == [2 * backbone / 4] * 4
    rows = np.array([3, 3, 2, 2])  # the head's 10 outputs, each 8 * 4 * 4 weights and a bias
    assert split.update_s == pytest.approx(5 * rows * (8 * 4 * 4 + 1) * 4 / 1e10, rel=1e-12)


class _Checkpointed(nn.Module):
    """A residual block run under gradient checkpointing (recomputed in the backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(8 * 8 * 8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.stem(x)
        h = h + checkpoint(self.block, h, use_reentrant=False)
        return self.head(h.flatten(1))


def test_gradient_checkpointing_costs_its_recompute_in_the_backward() -> None:
    # Before: on a model built on the CPU the count failed (the recompute ran on the model's
    # own weights, not the counted ones); on the meta device each recomputed call was a layer
    # more, with a formula backward that never runs (forward 1.48x, backward 1.20x), and the
    # planner found its layers out of order (no plan at all).
    costs = layer_costs(_Checkpointed(), (3, 8, 8))
    assert [x.name for x in costs.layers if not x.own_ops] == ["stem", "block.0", "block.1", "head"]
    model, x = _Checkpointed(), torch.randn(4, 3, 8, 8)
    with FlopCounterMode(display=False) as fwd:
        y = model(x)
    with FlopCounterMode(display=False) as bwd:
        y.sum().backward()  # the recompute among the backward's FLOPs
    assert costs.forward_flops(4) == fwd.get_total_flops()
    assert costs.backward_flops(4) == bwd.get_total_flops()
    # The recomputed convolution, with the backward node that ran it (the block's last).
    conv = next(x for x in costs.layers if x.name == "block.0")
    recompute = [k for x in costs.layers for k in x.backward if k.name == "recompute"]
    assert sum(k.flops(4) for k in recompute) == conv.forward_flops(4) > 0
    assert costs.plan_layers == ("stem", "block", "head")


class _MaskOnTheCpu(nn.Module):
    """Makes a tensor of its own in its forward without ``device=`` (as a causal mask is
    often built): it lands on the CPU, beside the meta tensors the costs run on."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1]), diagonal=1)
        return self.fc(x) + mask @ x


def test_a_forward_making_cpu_tensors_is_costed_on_the_cpu() -> None:
    costs = layer_costs(_MaskOnTheCpu(), (8, 8))
    fc = next(x for x in costs.layers if x.name == "fc")
    assert fc.forward_flops(1) == 2 * 8 * 8 * 8
    # The mask product (8x8 @ 8x8 per sample), counted too.
    assert costs.forward_flops(1) == fc.forward_flops(1) + 2 * 8 * 8 * 8


@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    at=st.integers(0, 4),
    rows=st.integers(1, 3),
)
def test_one_samples_shape_is_found_wherever_the_batch_is(
    shape: list[int], at: int, rows: int
) -> None:
    """The counting batch's dimension (the batch, or batch x rows flattened) may sit anywhere:
    one sample's shape drops it (``rows`` > 1: keeps the rows per sample in its place)."""
    from hetcoll.model.costs.counting import per_sample_shape
    from hetcoll.model.costs.records import _COUNT_BATCH

    at = min(at, len(shape))
    batched = [*shape[:at], _COUNT_BATCH * rows, *shape[at:]]
    want = [*shape[:at], *([rows] if rows > 1 else []), *shape[at:]]
    assert list(per_sample_shape(batched)) == want


def test_fresh_tensors_above_32_mib_cost_their_first_touch_on_a_cpu() -> None:
    """Each layer keeps the tensors its ops allocate (per sample and fixed bytes, counted);
    a device with ``first_touch_bytes_per_s`` pays ``bytes / rate`` for each one larger than
    FRESH_PAGES_BYTES (a CPU maps it afresh every step), none for smaller ones, and a device
    without the rate (a GPU, a cluster file's) nothing: the time of a 8192-wide linear layer
    grows by exactly its output's and its gradients' first touches from the batch where they
    pass 32 MiB. The rate is in the cluster file as written and read."""
    from dataclasses import replace

    from hetcoll.model.hardware import FRESH_PAGES_BYTES
    from hetcoll.model.predict.timing import _layer_times, device_arrays

    costs = layer_costs(nn.Sequential(nn.Linear(64, 8192)), (64,))
    (layer,) = costs.layers
    out = 8192 * 4  # its output per sample, float32
    assert (out, 0.0, 1) in layer.allocations[0]
    gpu = Device("d", flops_per_s=1e11, mem_bytes_per_s=2e10, memory_bytes=1e12)
    cpu = replace(gpu, first_touch_bytes_per_s=2e9)

    def times(device: Device, batch: int) -> np.ndarray:
        lt = _layer_times(costs, device_arrays((device,)), np.array([batch]))
        return np.array([lt.forward_s[0, 0], lt.backward_s[0, 0], lt.memory_s[0, 0]])

    for batch in (256, 1024, 2048, 4096):
        extra = times(cpu, batch) - times(gpu, batch)
        want = [
            sum(
                n * (ps * batch + fixed) / 2e9
                for ps, fixed, n in made
                if ps * batch + fixed > FRESH_PAGES_BYTES
            )
            for made in layer.allocations
        ]
        assert extra == pytest.approx([*want, sum(want)], rel=1e-12, abs=1e-15)
        assert bool(extra[0] > 0) is (out * batch > FRESH_PAGES_BYTES)
    cluster = cluster_from_dict(
        {"devices": {"c": {"flops_per_s": 1e11, "mem_bytes_per_s": 2e10, "memory_bytes": 1e9,
                           "first_touch_bytes_per_s": 2e9}},
         "nodes": [{"name": "n", "device": "c", "count": 1}]}
    )  # fmt: skip
    assert cluster.devices[0].first_touch_bytes_per_s == 2e9
    assert "first_touch_bytes_per_s = 2e+09" in dumps_cluster(cluster)
    with pytest.raises(ValueError, match="first_touch_bytes_per_s"):
        replace(gpu, first_touch_bytes_per_s=-1.0)


class _WithUnused(nn.Module):
    """Blocks of which each holds a projection its forward never calls (as Longformer's
    global-attention projections without global tokens), and a root weight never read."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"used": nn.Linear(8, 8), "spare": nn.Linear(8, 8)}) for _ in range(2)
        )
        self.mask_embedding = nn.Parameter(torch.zeros(8))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block["used"](x))
        return self.head(x)


def test_parameters_the_forward_never_reads_are_held_without_gradients() -> None:
    # Before: they were in no layer (the costs' parameter count short of the model's, and no
    # device held their bytes).
    model = _WithUnused()
    costs = layer_costs(model, (8,))
    assert costs.params == sum(p.numel() for p in model.parameters())
    spare = (8 * 8 + 8) * 4
    by = {x.name: x for x in costs.layers}
    for i in range(2):
        # the block's used projection: its sibling's weights, which never get a gradient
        x = by[f"blocks.{i}.used"]
        assert (x.param_bytes, x.frozen_bytes, x.gradient_bytes) == (2 * spare, spare, spare)
    assert costs.gradient_bytes == costs.param_bytes - 2 * spare - 8 * 4
    assert any("5 parameters are not used" in n for n in costs.notes)
    # A pipeline stage holding the second block holds its spare projection's weights.
    cut = costs.plan_layers.index("blocks.1.used")
    assert sum(x.param_bytes for x in costs.layers[costs.plan_layer_of.index(cut) :]) == (
        2 * spare + (8 * 3 + 3) * 4
    )
