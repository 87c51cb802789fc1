"""Filter-parallel cases that run inside every rank of a real job (gloo or MPI).

Each rank builds the same unsplit model from the same seed, splits a copy with
:func:`hetcoll.torch.filter_parallel`, and checks against the unsplit model run on this one
process: forward output, loss, every parameter gradient (gathered), parameters and BatchNorm
buffers after several optimizer steps. A failing check raises, which fails the launch.
"""

from __future__ import annotations

import contextlib
import copy
import random
import re
import warnings
from typing import Any

import torch
import torch.distributed
from torch import nn
from torch.nn import functional as F

from hetcoll.comm import wrap
from hetcoll.errors import CollectiveMismatchError
from hetcoll.torch import (
    FilterParallelConv2d,
    FilterParallelGroupedConv2d,
    FilterParallelLinear,
    filter_parallel,
    gather_gradients,
    gather_state_dict,
)
from hetcoll.torch.filters import FilterParallelLayer

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def awkward_cnn(bias: bool = True) -> nn.Sequential:
    """37, 61 and 5 filters; stride, padding, bias on/off, a BatchNorm after a split layer,
    pooling and a Flatten between a conv and a linear layer; input 3 x 12 x 12."""
    return nn.Sequential(
        nn.Conv2d(3, 37, 3, stride=2, padding=1, bias=bias),  # 0 -> 6x6
        nn.BatchNorm2d(37),  # 1
        nn.ReLU(),  # 2
        nn.Conv2d(37, 61, 3, padding=1, bias=False),  # 3
        nn.ReLU(),  # 4
        nn.MaxPool2d(2),  # 5 -> 3x3
        nn.Conv2d(61, 5, 3, padding=1, bias=bias),  # 6
        nn.Flatten(),  # 7
        nn.Linear(45, 13),  # 8
        nn.Tanh(),  # 9
        nn.Linear(13, 7, bias=bias),  # 10
    )


def rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """max |a - b| / max |b|; ``floor`` bounds the denominator from below for tensors that are
    zero up to rounding (a conv bias before a BatchNorm gets a gradient of ~1e-17)."""
    a, b = a.detach().cpu(), b.detach().cpu()
    scale = max(float(b.abs().max()), floor)
    return float((a - b).abs().max()) / (scale if scale > 0 else 1.0)


def assert_close(
    a: torch.Tensor, b: torch.Tensor, tol: float, what: str, floor: float = 0.0
) -> None:
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    err = rel_err(a, b, floor)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:g}"


def _batches(dtype: torch.dtype, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(6, 3, 12, 12, generator=g, dtype=dtype),
            torch.randint(0, 7, (6,), generator=g),
        )
        for _ in range(steps)
    ]


def equals_unsplit(
    group,
    spec,
    dtype,
    *,
    bias=True,
    avoid_gathers=True,
    optimizer="sgd",
    steps=3,
    build=None,
    batches=_batches,
    device="cpu",
) -> dict[str, str]:
    """Train the split and the unsplit model side by side; every figure must agree. Returns the
    modes chosen, by layer name. ``build`` makes the model (default: :func:`awkward_cnn`),
    ``batches(dtype, steps)`` its data. ``device``: where this rank's split model runs (a CUDA
    rank beside CPU ranks in tests/cuda_cases.py); the unsplit one runs on the CPU."""
    torch.manual_seed(0)
    ref = (build() if build is not None else awkward_cnn(bias)).to(dtype)
    split = filter_parallel(copy.deepcopy(ref), spec, group, avoid_gathers=avoid_gathers)
    split.to(device)
    tol = TOL[dtype]

    def make(m):
        if optimizer == "sgd":
            return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
        return torch.optim.Adam(m.parameters(), lr=1e-2)

    opt_ref, opt_split = make(ref), make(split)
    for step, (x, y) in enumerate(batches(dtype, steps)):
        out_ref = ref(x)
        out = split(x.to(device))
        assert out.device.type == torch.device(device).type, out.device
        assert_close(out, out_ref, tol, f"step {step}: output")
        loss_ref = nn.functional.cross_entropy(out_ref, y)
        loss = nn.functional.cross_entropy(out, y.to(device))
        assert_close(loss, loss_ref, tol, f"step {step}: loss")
        opt_ref.zero_grad()
        opt_split.zero_grad()
        loss_ref.backward()
        loss.backward()
        grads = gather_gradients(split, dst=None)
        expected = {n: p.grad for n, p in ref.named_parameters()}
        assert grads is not None and set(grads) == set(expected), (set(grads), set(expected))
        # Gradients that vanish mathematically (a conv bias right before a BatchNorm) are
        # rounding noise: their error is measured against 1% of the largest gradient.
        floor = 1e-2 * max(float(g.abs().max()) for g in expected.values())
        for n, g in expected.items():
            assert_close(grads[n], g, tol, f"step {step}: gradient of {n}", floor)
        opt_ref.step()
        opt_split.step()
    full = gather_state_dict(split, dst=0)
    if wrap(group).rank == 0:
        assert full is not None
        ref_state = ref.state_dict()
        assert list(full) == list(ref_state)
        # Parameters those vanishing gradients moved (a BatchNorm bias before a convolution
        # and another BatchNorm, as MobileNet's projections) hold rounding noise alike.
        floor = 1e-2 * max(
            float(t.abs().max()) for t in ref_state.values() if t.is_floating_point()
        )
        for n, t in ref_state.items():
            if t.is_floating_point():
                assert_close(full[n], t, tol, f"after {steps} steps: {n}", floor)
            else:
                assert torch.equal(full[n], t), n
    else:
        assert full is None
    # Evaluation mode (BatchNorm from running statistics) agrees too.
    ref.eval()
    split.eval()
    with torch.no_grad():
        x = batches(dtype, 1)[0][0]
        assert_close(split(x.to(device)), ref(x), tol, "eval output")
    return {n: m.mode for n, m in split.named_modules() if isinstance(m, FilterParallelLayer)}


class FunctionalNet(nn.Module):
    """A model with its own forward calling functions, not modules, between its layers: the
    pairing comes from its traced graph, not from an nn.Sequential."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 11, 3, padding=1)
        self.conv2 = nn.Conv2d(11, 9, 3, padding=1)
        self.fc1 = nn.Linear(9 * 6 * 6, 10)
        self.fc2 = nn.Linear(10, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.flatten(self.conv2(x).relu(), 1)
        return self.fc2(F.gelu(self.fc1(x)))


def _small_images(dtype: torch.dtype, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [
        (
            torch.randn(4, 3, 32, 32, generator=g, dtype=dtype),
            torch.randint(0, 5, (4,), generator=g),
        )
        for _ in range(steps)
    ]


def real_models(group, speeds) -> int:
    """Models with their own forwards: the pairs come from torch.fx, and the split model still
    equals the unsplit one. torchvision's ResNet-18 pairs conv1 -> conv2 in every block (the
    BatchNorm between them split too); FunctionalNet pairs through F.relu, pooling and
    torch.flatten."""
    from torchvision.models import resnet18

    modes = equals_unsplit(
        group, speeds, torch.float64, build=lambda: resnet18(num_classes=5), batches=_small_images,
        steps=2,
    )  # fmt: skip
    assert modes["layer1.0.conv1"] == "split-output", modes
    assert modes["layer1.0.conv2"] == "split-input", modes
    assert modes["layer2.0.downsample.0"] == "gather", modes
    modes = equals_unsplit(
        group,
        speeds,
        torch.float64,
        build=FunctionalNet,
        batches=lambda dtype, steps: [
            (x[:, :, :12, :12], y) for x, y in _small_images(dtype, steps)
        ],
    )
    assert modes == {
        "conv1": "split-output",
        "conv2": "split-input",
        "fc1": "split-output",
        "fc2": "split-input",
    }, modes
    # torchvision's Swin: its attention reads its qkv and proj weights itself (a functional
    # call), so they stay whole; its MLPs pair.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        modes = equals_unsplit(group, speeds, torch.float64, build=swin, batches=_small_images)
    assert not any(n.endswith(("attn.qkv", "attn.proj")) for n in modes), modes
    assert modes["features.1.0.mlp.0"] == "split-output", modes
    assert modes["features.1.0.mlp.3"] == "split-input", modes
    # torchvision's MobileNetV2: each inverted residual's 1x1 expansion pairs with its 1x1
    # projection, the depthwise 3x3 convolution between them split by channel alike (as the
    # BatchNorms), needing no communication; it was left replicated and both 1x1s gathered.
    # The first block has no expansion: its depthwise convolution stays whole, named.
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        modes = equals_unsplit(
            group, speeds, torch.float64, build=mobilenet, batches=_images_64, steps=2
        )
    for k in range(2, 18):
        assert modes[f"features.{k}.conv.0.0"] == "split-output", modes
        assert modes[f"features.{k}.conv.2"] == "split-input", modes
    replicated = [str(w.message) for w in seen if "left replicated" in str(w.message)]
    assert replicated == [
        "filter_parallel: left replicated (every rank computes them whole): "
        "'features.1.conv.0.0' (Conv2d, groups=8)"
    ], replicated
    # torchvision's EfficientNet and MobileNetV3: a squeeze-and-excitation between the 1x1
    # expansion and projection broke their pairing (both gathered, and the depthwise
    # convolution ran whole on every rank). It now splits with them: its reducing 1x1
    # convolution sums the rank's channels (split-input), its expanding one computes the
    # rank's channels' gates (split-output, by the expansion's shares).
    for build, blocks in ((efficientnet, ["features.2.0", "features.4.0"]), (mobilenet_v3, [])):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            modes = equals_unsplit(
                group, speeds, torch.float64, build=build, batches=_images_64, steps=2
            )
        se = [n[: -len(".fc1")] for n in modes if n.endswith(".fc1")]
        assert se, modes
        for n in se:
            if modes[n + ".fc1"] == "split-input":
                assert modes[n + ".fc2"] == "split-output", (n, modes)
        for block in blocks or [n.rpartition(".block")[0] for n in se[1:]]:
            names = sorted(n for n in modes if n.startswith(block + ".block."))
            assert [modes[n] for n in names] == [
                "split-output", "split-input", "split-output", "split-input"
            ], (block, modes)  # fmt: skip
    # torchvision's ResNeXt and RegNet: the grouped 3x3 convolution between each bottleneck's
    # 1x1 convolutions runs on whole groups of the pair's channels (their shares multiples of
    # a group's), as MobileNet's depthwise one runs per channel, RegNet's squeeze-and-excitation
    # after it split with them. It broke the pairing: every layer gathered. RegNet's first
    # stage has 2 groups, too few for 3 ranks: it stays whole there, named, and its pair
    # gathers.
    p = wrap(group).size
    modes = equals_unsplit(
        group, speeds, torch.float64, build=resnext, batches=_small_images, steps=2
    )
    for k in range(1, 5):
        assert modes[f"layer{k}.0.conv1"] == "split-output", modes
        assert modes[f"layer{k}.0.conv3"] == "split-input", modes
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        modes = equals_unsplit(
            group, speeds, torch.float64, build=regnet, batches=_small_images, steps=2
        )
    paired = [n[: -len(".f.a.0")] for n, m in modes.items() if m == "split-output" and ".f.a" in n]
    # (its excitation split with the pair: the reducing layer sums the rank's channels; where
    # the pair gathers, the excitation's two layers pair with each other)
    for block in paired:
        assert modes[f"{block}.f.se.fc1"] == "split-input", modes
        assert modes[f"{block}.f.c.0"] == "split-input", modes
    replicated = [str(w.message) for w in seen if "left replicated" in str(w.message)]
    if p == 3:
        assert replicated == [
            "filter_parallel: left replicated (every rank computes them whole): "
            "'trunk_output.block1.block1-0.f.b.0' (Conv2d, groups=2)"
        ], replicated
        assert paired == [f"trunk_output.block2.block2-{k}" for k in range(3)], modes
    else:
        assert not replicated, replicated
        assert paired == [
            "trunk_output.block1.block1-0",
            *(f"trunk_output.block2.block2-{k}" for k in range(3)),
        ], modes
    return 8


def resnext() -> nn.Module:
    """torchvision's ResNeXt: bottlenecks of 4 groups of 4 channels (16 wide) to 4 groups of
    32, one per stage."""
    from torchvision.models.resnet import Bottleneck, ResNet

    return ResNet(Bottleneck, [1, 1, 1, 1], num_classes=5, groups=4, width_per_group=4)


def regnet() -> nn.Module:
    """torchvision's RegNet (Y: a squeeze-and-excitation after each grouped convolution), two
    stages: one block of 2 groups of 8 channels, then three of 4 groups."""
    from torchvision.models.regnet import BlockParams, RegNet

    params = BlockParams.from_init_params(
        depth=4, w_0=16, w_a=8.0, w_m=2.0, group_width=8, se_ratio=0.25
    )
    return RegNet(params, num_classes=5)


def efficientnet() -> nn.Module:
    """torchvision's EfficientNet, four stages at a quarter width, without dropout or
    stochastic depth (the split and the unsplit model must drop alike)."""
    from functools import partial

    from torchvision.models.efficientnet import EfficientNet, MBConvConfig

    stage = partial(MBConvConfig, width_mult=0.25, depth_mult=0.3)
    settings = [
        stage(1, 3, 1, 32, 16, 1),
        stage(6, 3, 2, 16, 24, 2),
        stage(6, 5, 2, 24, 40, 2),
        stage(6, 3, 2, 40, 80, 3),
    ]
    return EfficientNet(settings, dropout=0.0, stochastic_depth_prob=0.0, num_classes=5)


def mobilenet_v3() -> nn.Module:
    """torchvision's MobileNetV3-Small at half width, without dropout."""
    from torchvision.models import mobilenet_v3_small

    return mobilenet_v3_small(num_classes=5, width_mult=0.5, dropout=0.0)


def mobilenet() -> nn.Module:
    """torchvision's MobileNetV2 at a quarter width, without dropout (the split and the
    unsplit model must drop alike)."""
    from torchvision.models import mobilenet_v2

    return mobilenet_v2(num_classes=5, width_mult=0.25, dropout=0.0)


def _images_64(dtype: torch.dtype, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # 64 x 64: MobileNet's last maps are 2 x 2 (train-mode BatchNorm over 4 samples of 1 x 1
    # maps turns rounding into errors of 1e-10).
    return [(F.interpolate(x, scale_factor=2), y) for x, y in _small_images(dtype, steps)]


def swin() -> nn.Module:
    """torchvision's Swin Transformer, small (no stochastic depth: the split and the unsplit
    model must drop alike)."""
    from torchvision.models import SwinTransformer

    return SwinTransformer(
        patch_size=[4, 4], embed_dim=12, depths=[2, 2], num_heads=[2, 4], window_size=[2, 2],
        num_classes=5, stochastic_depth_prob=0.0,
    )  # fmt: skip


def load_full_state(group) -> None:
    """A full (unsplit) state dict loads into a split model; gathering gives it back."""
    torch.manual_seed(3)
    src = awkward_cnn().double()
    torch.manual_seed(4)
    # The group second, as the README writes it, a real one (it was taken for the split).
    real = group if group is not None else torch.distributed.group.WORLD
    speeds = [2.0, 1.0, 1.0][: wrap(group).size]
    split = filter_parallel(awkward_cnn().double(), real, speeds=speeds)
    split.load_state_dict(src.state_dict())
    back = gather_state_dict(split, dst=None)
    assert back is not None
    for n, t in src.state_dict().items():
        assert torch.equal(back[n], t), n
    x = _batches(torch.float64, 1)[0][0]
    src.eval()
    split.eval()
    with torch.no_grad():
        assert_close(split(x), src(x), 1e-12, "output after load_state_dict")


def memory_proportional(group) -> None:
    """Parameter elements per rank: split layers hold exactly their share of the channels;
    Adam's state follows the parameters."""
    c = wrap(group)
    speeds = [4.0, 2.0, 1.0][: c.size]
    model = nn.Sequential(
        nn.Conv2d(3, 60, 3), nn.ReLU(), nn.Conv2d(60, 90, 3), nn.ReLU(), nn.Conv2d(90, 30, 3)
    )
    full = {n: p.numel() for n, p in model.named_parameters()}
    split = filter_parallel(model, speeds, group)
    modes = {n: m.mode for n, m in split.named_modules() if isinstance(m, FilterParallelLayer)}
    assert modes == {"0": "split-output", "2": "split-input", "4": "gather"}, modes
    layers = dict(split.named_modules())
    for name in ("0", "4"):
        m = layers[name]
        share, total = m.shares[c.rank], sum(m.shares)
        assert m.weight.numel() * total == full[f"{name}.weight"] * share
        assert m.bias.numel() * total == full[f"{name}.bias"] * share
    m = layers["2"]  # split-input: its input channels, the shares of layer 0; bias replicated
    assert m.shares == layers["0"].shares
    assert m.weight.numel() * sum(m.shares) == full["2.weight"] * m.shares[c.rank]
    assert m.bias.numel() == full["2.bias"]
    # multiple_of: every share a multiple of it (and at least it), from the same speeds.
    aligned = filter_parallel(
        nn.Sequential(nn.Conv2d(3, 64, 3), nn.Flatten(), nn.Linear(64, 32)),
        speeds,
        group,
        multiple_of=8,
        avoid_gathers=False,
    )
    for m in aligned.modules():
        if isinstance(m, FilterParallelLayer):
            assert all(s % 8 == 0 and s >= 8 for s in m.shares), m.shares
            assert m.shares[0] > m.shares[-1], m.shares
    opt = torch.optim.Adam(split.parameters())
    split(torch.randn(2, 3, 9, 9)).sum().backward()
    opt.step()
    for p in split.parameters():
        state = opt.state[p]
        assert state["exp_avg"].numel() == state["exp_avg_sq"].numel() == p.numel()


def bad_input(group) -> int:
    """Every rank raises the same clear error, before any collective: a collective right after
    each one still works."""
    c = wrap(group)
    p = c.size
    cases = [
        ([*[29, 7, 1][: p - 1], 0], r"rank \d has a share of 0"),
        ([30] + [1] * (p - 1), r"shares sum to \d+ but layer '0' has 37 channels"),
        ([37 - p] + [1] * p, rf"has {p + 1} shares but the group has {p} ranks"),
        ([1.0] * (p + 1), rf"has {p + 1} speeds but the group has {p} ranks"),
    ]
    raised = 0
    for spec, pattern in cases:
        model = nn.Sequential(nn.Conv2d(3, 37, 3), nn.ReLU())
        try:
            filter_parallel(model, spec, group)
        except ValueError as e:
            assert re.search(pattern, str(e)), (str(e), pattern)
            assert "shares_or_speeds" in str(e)
            raised += 1
        c.allgather_int64(torch.zeros(1, dtype=torch.int64).numpy(), None)
    grouped = nn.Sequential(nn.Conv2d(4, 8, 3, groups=2))
    try:  # named explicitly: refused
        filter_parallel(grouped, [1.0] * p, group, layers=["0"])
    except ValueError as e:
        assert "grouped convolution (groups=2)" in str(e) and "'0'" in str(e), str(e)
        raised += 1
    with warnings.catch_warnings(record=True) as caught:  # by default: kept whole, said so
        warnings.simplefilter("always")
        filter_parallel(grouped, [1.0] * p, group)
    assert any("'0' (Conv2d, groups=2)" in str(w.message) for w in caught), caught
    for build in (
        lambda: FilterParallelConv2d(4, 8, 3, groups=2, speeds=[1.0] * p, group=group),
        lambda: FilterParallelLinear(4, 8, shares=[8] + [0] * (p - 1), group=group),
        lambda: FilterParallelLinear(4, 8, shares=[4] * (p + 1), group=group),
    ):
        try:
            build()
        except ValueError:
            raised += 1
    # A grouped convolution between a pair takes whole groups: shares of a part of one raise,
    # for the pair's first layer (named by the shares) and for the convolution alone.
    pair = nn.Sequential(
        nn.Conv2d(3, 4 * p, 1), nn.Conv2d(4 * p, 4 * p, 3, groups=p), nn.Conv2d(4 * p, 5, 1)
    )
    uneven = [4 * p - 2 * (p - 1)] + [2] * (p - 1)
    try:
        filter_parallel(pair, {"0": uneven, "2": uneven}, group)
    except ValueError as e:
        assert str(e) == (
            f"shares_or_speeds['0']: layer '0' feeds grouped convolution '1', which each rank "
            f"runs on whole groups, so its shares must be multiples of 4 channels, got {uneven}"
        ), str(e)
        raised += 1
    try:
        FilterParallelGroupedConv2d.from_module(pair[1], uneven, group)
    except ValueError as e:
        assert str(e) == (
            "shares: must be multiples of the 4 channels of each of the grouped Conv2d's "
            f"{p} groups (each rank runs whole groups), got {uneven}"
        ), str(e)
        raised += 1
    c.allgather_int64(torch.zeros(1, dtype=torch.int64).numpy(), None)
    return raised


def standalone_layers(group) -> None:
    """The layers on their own: a gather-mode conv, a split-output linear feeding a split-input
    one, built by their constructors (same seed on every rank = same full layer)."""
    c = wrap(group)
    speeds = [3.0, 1.0, 1.0][: c.size]
    torch.manual_seed(5)
    ref_conv = nn.Conv2d(4, 9, 3, padding=1, padding_mode="reflect", dtype=torch.float64)
    torch.manual_seed(5)
    conv = FilterParallelConv2d(
        4, 9, 3, padding=1, padding_mode="reflect", speeds=speeds, group=group, dtype=torch.float64
    )
    x = torch.randn(2, 4, 5, 5, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    assert_close(conv(x), ref_conv(x2), 1e-12, "conv forward")
    conv(x).square().sum().backward()
    ref_conv(x2).square().sum().backward()
    assert_close(x.grad, x2.grad, 1e-12, "conv input gradient")

    a = nn.Linear(10, 11, dtype=torch.float64)
    b = nn.Linear(11, 3, dtype=torch.float64)
    shares = [5, 3, 3][: c.size] if c.size == 3 else [8, 3]
    fa = FilterParallelLinear.from_module(a, shares, group, mode="split-output")
    fb = FilterParallelLinear.from_module(b, shares, group, mode="split-input")
    assert fb.weight.shape == (3, shares[c.rank])
    x = torch.randn(4, 10, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out = fb(torch.relu(fa(x)))
    ref = b(torch.relu(a(x2)))
    assert_close(out, ref, 1e-12, "linear pair forward")
    out.sum().backward()
    ref.sum().backward()
    assert_close(x.grad, x2.grad, 1e-12, "linear pair input gradient")
    assert_close(fb.bias.grad, b.bias.grad, 1e-12, "split-input bias gradient")

    # Linear -> BatchNorm1d -> ReLU -> Linear: paired, the BatchNorm1d split with them.
    torch.manual_seed(6)
    mlp = nn.Sequential(nn.Linear(10, 11), nn.BatchNorm1d(11), nn.ReLU(), nn.Linear(11, 3))
    mlp = mlp.double()
    split = filter_parallel(copy.deepcopy(mlp), speeds, group)
    assert type(split[1]).__name__ == "FilterParallelBatchNorm1d"
    assert (split[0].mode, split[3].mode) == ("split-output", "split-input")
    x = torch.randn(5, 10, dtype=torch.float64)
    out, ref = split(x), mlp(x)
    assert_close(out, ref, 1e-12, "mlp with BatchNorm1d forward")
    out.square().sum().backward()
    ref.square().sum().backward()
    grads = gather_gradients(split, dst=None)
    floor = 1e-2 * max(float(p.grad.abs().max()) for p in mlp.parameters())  # bias before BN
    for n, p in mlp.named_parameters():
        assert_close(grads[n], p.grad, 1e-10, f"mlp gradient of {n}", floor)


def random_shares(rng: random.Random, total: int, p: int) -> list[int]:
    cuts = sorted(rng.sample(range(1, total), p - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, total])]


def random_pairs(group, trials: int = 12) -> int:
    """Random conv pairs (channels, kernel, stride, padding, bias, shares drawn from one seed,
    the same on every rank): a gather-mode conv, and a split-output conv feeding a split-input
    one, each against the unsplit layers: output, input gradient, weight and bias gradients."""
    c = wrap(group)
    rng = random.Random(7)
    checked = 0
    for _ in range(trials):
        cin, mid, cout = (rng.randint(c.size, 23) for _ in range(3))
        k, stride, pad = rng.randint(1, 3), rng.randint(1, 2), rng.randint(0, 2)
        bias = rng.random() < 0.5
        torch.manual_seed(rng.randint(0, 1000))
        a = nn.Conv2d(cin, mid, k, stride=stride, padding=pad, bias=bias).double()
        b = nn.Conv2d(mid, cout, 3, padding=1, bias=not bias).double()
        shares = random_shares(rng, mid, c.size)
        x = torch.randn(2, cin, 7, 7, dtype=torch.float64, requires_grad=True)
        ref = b(torch.relu(a(x)))
        (ref * ref).sum().backward()
        want = {"x": x.grad, "a": a.weight.grad, "b": b.weight.grad}
        for pair in (True, False):
            x.grad = None
            fa = FilterParallelConv2d.from_module(
                a, shares, group, mode="split-output" if pair else "gather"
            )
            fb = FilterParallelConv2d.from_module(
                b,
                shares if pair else random_shares(rng, cout, c.size),
                group,
                mode="split-input" if pair else "gather",
            )
            out = fb(torch.relu(fa(x)))
            assert_close(out, ref, 1e-12, f"pair={pair}: output")
            (out * out).sum().backward()
            assert_close(x.grad, want["x"], 1e-12, f"pair={pair}: input gradient")
            for name, m, full in (("a", fa, a), ("b", fb, b)):
                spec = m.split_spec()
                dim, _ = spec["weight"]
                lo, n = m.offset, m.shares[c.rank]
                expect = full.weight.grad.narrow(dim, lo, n)
                assert_close(m.weight.grad, expect, 1e-12, f"pair={pair}: {name} weight grad")
                if m.bias is not None:
                    fb_grad = full.bias.grad
                    if "bias" in spec:
                        fb_grad = fb_grad.narrow(0, lo, n)
                    assert_close(m.bias.grad, fb_grad, 1e-12, f"pair={pair}: {name} bias grad")
            checked += 1
    return checked


def random_grouped(group, trials: int = 8) -> int:
    """Random grouped convolutions between a pair (groups, channels per group, kernel, stride,
    padding, padding mode, bias and shares in whole groups drawn from one seed, the same on
    every rank), each rank running its groups: output, input gradient and every weight and bias
    gradient against the unsplit layers."""
    c = wrap(group)
    rng = random.Random(11)
    checked = 0
    for _ in range(trials):
        groups, width = rng.randint(c.size, 6), rng.randint(1, 3)
        mid = groups * width
        k, stride, pad = rng.randint(1, 3), rng.randint(1, 2), rng.randint(0, 1)
        mode = rng.choice(["zeros", "reflect", "circular"]) if pad else "zeros"
        bias = rng.random() < 0.5
        torch.manual_seed(rng.randint(0, 1000))
        a = nn.Conv2d(3, mid, 1, bias=bias).double()
        g = nn.Conv2d(
            mid, mid, k, stride=stride, padding=pad, groups=groups, bias=not bias, padding_mode=mode
        ).double()
        b = nn.Conv2d(mid, 5, 1).double()
        shares = [n * width for n in random_shares(rng, groups, c.size)]
        x = torch.randn(2, 3, 6, 6, dtype=torch.float64, requires_grad=True)
        ref = b(g(torch.relu(a(x))))
        (ref * ref).sum().backward()
        fa = FilterParallelConv2d.from_module(a, shares, group, mode="split-output")
        fg = FilterParallelGroupedConv2d.from_module(g, shares, group)
        fb = FilterParallelConv2d.from_module(b, shares, group, mode="split-input")
        want_x = x.grad
        x.grad = None
        out = fb(fg(torch.relu(fa(x))))
        assert_close(out, ref, 1e-12, f"grouped {groups}x{width}: output")
        (out * out).sum().backward()
        assert_close(x.grad, want_x, 1e-12, f"grouped {groups}x{width}: input gradient")
        lo, n = sum(shares[: c.rank]), shares[c.rank]
        for name, m, full, dim in (("a", fa, a, 0), ("g", fg, g, 0), ("b", fb, b, 1)):
            expect = full.weight.grad.narrow(dim, lo, n)
            assert_close(m.weight.grad, expect, 1e-12, f"grouped: {name} weight grad")
            if m.bias is not None:
                want_b = full.bias.grad if name == "b" else full.bias.grad.narrow(0, lo, n)
                assert_close(m.bias.grad, want_b, 1e-12, f"grouped: {name} bias grad")
        checked += 1
    return checked


def optimizer_over_the_split(group) -> None:
    """hetcoll's DistributedOptimizer over the split's own ranks would average their slices'
    gradients (on an even split of one shape): every rank raises, naming the split."""
    from hetcoll.torch import DistributedOptimizer

    p = wrap(group).size
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)).double()
    split = filter_parallel(model, group, speeds=[1.0] * p)
    opt = DistributedOptimizer(torch.optim.SGD(split.parameters(), lr=0.1), group, local_batch=3)
    split(torch.ones(3, 4, dtype=torch.float64)).sum().backward()
    try:
        opt.step()
    except ValueError as e:
        assert str(e).startswith(f"optimizer: its group holds {p} ranks of one"), e
        return
    raise AssertionError("DistributedOptimizer averaged the slices of one split")


def run_all(group) -> dict[str, object]:
    """Every case on this job's ranks; returns what rank 0 reports."""
    p = wrap(group).size
    speeds = [29.0, 7.0, 1.0][:p]  # 37 filters -> [29, 7, 1] on 3 ranks
    modes = equals_unsplit(group, speeds, torch.float64)
    assert modes == {
        "0": "split-output",
        "3": "split-input",
        "6": "split-output",
        "8": "split-input",
        "10": "gather",
    }, modes
    equals_unsplit(group, speeds, torch.float64, bias=False, optimizer="adam")
    # Explicit uneven shares, every layer gathering, BatchNorm replicated; float32.
    shares = {"0": [29, 7, 1], "3": [40, 20, 1], "6": [3, 1, 1], "8": [10, 2, 1], "10": [5, 1, 1]}
    if p == 2:
        shares = {"0": [29, 8], "3": [40, 21], "6": [4, 1], "8": [10, 3], "10": [6, 1]}
    # (SGD: Adam would turn the rounding noise of the bias before the BatchNorm into steps.)
    gathered = equals_unsplit(group, shares, torch.float32, avoid_gathers=False)
    assert set(gathered.values()) == {"gather"}
    load_full_state(group)
    memory_proportional(group)
    standalone_layers(group)
    optimizer_over_the_split(group)
    return {
        "equal": 3,
        "random": random_pairs(group),
        "random_grouped": random_grouped(group),
        "errors": bad_input(group),
        "real_models": real_models(group, speeds),
    }


def scaled_split(group: Any, make: Any) -> list[float]:
    """float16 training's loss scaling on a split model, with the scaler ``make("cpu", ...)``
    over the group (torch's ShardedGradScaler on gloo, hetcoll's GroupGradScaler on
    MPI): the ranks hold different slices, so an overflow one rank finds must make every
    rank skip the step (a GradScaler decides from its own rank's gradients: the ranks' copies
    of the whole layers part). Only the last rank finds one, in step 1: every rank skips it
    and halves its scale, and the model equals the unsplit one trained with a GradScaler
    skipping the same step, in float64 (scales are powers of two). Returns the scales."""
    p, rank = wrap(group).size, wrap(group).rank
    torch.manual_seed(0)
    ref = awkward_cnn(True).double()
    split = filter_parallel(copy.deepcopy(ref), group, speeds=[2.0] + [1.0] * (p - 1))
    runs = [
        (m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), scaler)
        for m, scaler in (
            (ref, torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)),
            (split, make("cpu", init_scale=2.0**8, growth_interval=2)),
        )
    ]
    scales = []
    for step, (x, y) in enumerate(_batches(torch.float64, 4)):
        for m, opt, scaler in runs:
            scaler.scale(nn.functional.cross_entropy(m(x), y)).backward()
            if step == 1 and (m is ref or rank == p - 1):
                next(q for q in m.parameters() if q.numel()).grad.view(-1)[0] = float("inf")
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        scales.append(runs[1][2].get_scale())
        assert runs[0][2].get_scale() == scales[-1], (step, scales)
    full = gather_state_dict(split, dst=None)
    ref_state = ref.state_dict()
    floor = 1e-2 * max(float(t.abs().max()) for t in ref_state.values() if t.is_floating_point())
    for k, v in ref_state.items():
        if v.is_floating_point():
            assert_close(full[k], v, TOL[torch.float64], f"scaled: {k}", floor)
    return scales


def run_torch(rank: int, world: int) -> dict[str, object]:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    torch.set_num_threads(1)
    return {**run_all(None), "scaled": scaled_split(None, ShardedGradScaler)}


def run_hostile(rank: int, world_size: int) -> list[str]:
    """Issue 26: an unbatched (C, H, W) input to a split conv raises on every rank (it hung, the
    ranks gathering along H), and a Linear tied to an embedding stays replicated and tied."""
    torch.manual_seed(0)
    conv_net = filter_parallel(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()), [1.0, 1.0], None)
    seen = []
    try:
        conv_net(torch.zeros(3, 6, 6))
    except ValueError as e:
        seen.append(str(e).split(";")[0])
    # Ranks passing batches of different sizes: the forward's one agreement raises on each,
    # naming the inputs, before any layer's reduction (which no longer checks on its own).
    try:
        conv_net(torch.zeros(2 + rank, 3, 6, 6))
    except CollectiveMismatchError as e:
        seen.append(str(e))
    assert conv_net(torch.zeros(2, 3, 6, 6)).shape == (2, 8, 4, 4)  # the group still works
    # Rank 0 evaluating (eval(), then no_grad) while rank 1 trains: each raises, naming the
    # mode (rank 0's exchanges paired with rank 1's, its output silently wrong).
    for mode in ("eval", "no_grad"):
        try:
            if rank == 0 and mode == "eval":
                conv_net.eval()
            alone = rank == 0 and mode == "no_grad"
            with torch.no_grad() if alone else contextlib.nullcontext():
                conv_net(torch.zeros(2, 3, 6, 6))
        except CollectiveMismatchError as e:
            seen.append(str(e).split(" (")[0])
        conv_net.train()
    try:  # a copy would train silently wrong (the original's exchanges, sums lost)
        copy.deepcopy(conv_net)
    except TypeError as e:
        seen.append(str(e).split(" (")[0])
    emb = nn.Embedding(10, 6)
    head = nn.Linear(6, 10, bias=False)
    head.weight = emb.weight
    tied = nn.Sequential(emb, nn.Linear(6, 6), nn.ReLU(), head)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filter_parallel(tied, [1.0, 1.0], None)
    seen += [str(w.message) for w in caught]
    assert tied[3].weight is tied[0].weight and type(tied[3]) is nn.Linear
    assert isinstance(tied[1], FilterParallelLinear)
    out = tied(torch.tensor([[1, 2]]))
    assert out.shape == (1, 2, 10)
    return seen


def optimizer_before(rank: int, world: int) -> list[str]:
    """An optimizer created before the split (filter_parallel, expert_parallel, parallelize)
    holds the replaced parameters: its step raised nothing and trained nothing of the model
    (the split layers of an MLP stayed as they were, a Llama's projections, a Mixtral's
    experts, a plan's every layer)."""
    from tensor_parallel_cases import mixtral

    from hetcoll import Plan
    from hetcoll.torch import expert_parallel, parallelize

    torch.manual_seed(0)
    said = []
    x = torch.randn(4, 8)
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    split = filter_parallel(model, speeds=[1.0, 0.25])
    split(x).sum().backward()
    try:
        opt.step()
    except ValueError as e:
        said.append(str(e))
    moe = mixtral()
    opt = torch.optim.Adam(moe.parameters())
    expert_parallel(moe, speeds=[1.0, 0.25])
    try:
        opt.step()
    except ValueError as e:
        said.append(str(e))
    net = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    stages = [{"ranks": [0], "layers": [0, 2]}, {"ranks": [1], "layers": [2, 3]}]
    plan = {"replicas": [{"samples": 4, "stages": stages}]}
    par = parallelize(net, Plan.from_dict(plan), loss_fn=lambda out, y: out.sum())
    par.step(x, torch.zeros(4))
    try:
        opt.step()
    except ValueError as e:
        said.append(str(e))
    torch.optim.SGD(par.parameters(), lr=0.1).step()  # made after: steps
    return said
