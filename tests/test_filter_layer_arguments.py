"""Bad arguments to the filter-parallel layers are named where they are given (an audit's
findings): sizes, kernels and flags torch took or failed on deep inside, speeds read from a
dict's keys or a string's characters, the wrong module handed to ``from_module``, layers only
``from_module`` can build. Good calls build and compute as the unsplit layers do. One rank, a
gloo group over a file store (no port)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from hetcoll.comm import wrap
from hetcoll.torch import (
    FilterParallelBatchNorm1d,
    FilterParallelBatchNorm2d,
    FilterParallelConv2d,
    FilterParallelDepthwiseConv2d,
    FilterParallelGroupedConv2d,
    FilterParallelLinear,
    FilterParallelMultiheadAttention,
    gather_state_dict,
)
from hetcoll.torch.filters import FilterParallelEmbedding, FilterParallelRMSNorm, SharedCopy

FL, FC = FilterParallelLinear, FilterParallelConv2d
BN1, BN2 = FilterParallelBatchNorm1d, FilterParallelBatchNorm2d
MHA, RMS = FilterParallelMultiheadAttention, FilterParallelRMSNorm
ONE = [1.0]
INT = "must be an integer >= 1"
PAIR = "must be an integer or a pair of integers"
SEQ = "speeds: must be a sequence of numbers, got"


def case(error: type[Exception], start: str, call: Callable[[], object]) -> Any:
    return pytest.param(error, start, call, id=start)


SIZES_AND_FLAGS = [
    case(TypeError, f"in_features: {INT}, got True", lambda: FL(True, 8, speeds=ONE)),
    case(TypeError, f"in_features: {INT}, got None", lambda: FL(None, 8, speeds=ONE)),
    case(TypeError, f"in_features: {INT}, got 'abc'", lambda: FL("abc", 8, speeds=ONE)),
    case(ValueError, f"in_features: {INT} and <= 2**31 - 1, got -1", lambda: FL(-1, 8, speeds=ONE)),
    case(ValueError, f"in_features: {INT} and <= 2**31 - 1", lambda: FL(2**70, 8, speeds=ONE)),
    case(
        ValueError,
        f"in_features: {INT} and <= 2**31 - 1, got an integer past 2**64",
        lambda: FL(10**5000, 8, speeds=ONE),  # its repr alone raises past 4300 digits
    ),
    case(TypeError, f"out_features: {INT}, got None", lambda: FL(4, None, speeds=ONE)),
    case(TypeError, f"out_features: {INT}, got True", lambda: FL(4, True, speeds=ONE)),
    case(TypeError, f"out_features: {INT}, got 2.5", lambda: FL(4, 2.5, shares=[8])),
    case(
        TypeError,
        f"in_features: {INT}, got 4.5",
        lambda: FL(4.5, 8, speeds=ONE, mode="split-input"),
    ),
    case(TypeError, "bias: must be True or False, got 'no'", lambda: FL(4, 8, "no", speeds=ONE)),
    case(TypeError, "bias: must be True or False, got 1", lambda: FL(4, 8, 1, speeds=ONE)),
    case(TypeError, f"in_channels: {INT}, got True", lambda: FC(True, 8, True, speeds=ONE)),
    case(TypeError, f"in_channels: {INT}, got None", lambda: FC(None, 8, 3, speeds=ONE)),
    case(TypeError, f"out_channels: {INT}, got 8.0", lambda: FC(3, 8.0, 3, speeds=ONE)),
    case(TypeError, "bias: must be True or False", lambda: FC(3, 8, 3, bias="no", speeds=ONE)),
]


@pytest.mark.parametrize(("error", "start", "call"), SIZES_AND_FLAGS)
def test_sizes_and_flags_are_named(one_rank: None, error: Any, start: str, call: Any) -> None:
    """True was a layer of 1 feature, 'no' a bias; None, 'abc' and 2.5 failed inside (a
    modulo, torch.empty) or were blamed on speeds, shares or in_features_per_channel; -1 raised
    torch's RuntimeError and 2**70 an overflow inside torch.empty."""
    with pytest.raises(error) as caught:
        call()
    assert str(caught.value).startswith(start), str(caught.value)


GEOMETRY = [
    case(TypeError, f"kernel_size: {PAIR} >= 1, got True", lambda: FC(3, 8, True, speeds=ONE)),
    case(ValueError, f"kernel_size: {PAIR} >= 1, got []", lambda: FC(3, 8, [], speeds=ONE)),
    case(
        ValueError,
        f"kernel_size: {PAIR} >= 1 and <= 2**31 - 1, got 0",
        lambda: FC(3, 8, 0, speeds=ONE),
    ),
    case(ValueError, f"kernel_size: {PAIR} >= 1 and", lambda: FC(3, 8, (3, 0), speeds=ONE)),
    case(
        ValueError,
        f"kernel_size: {PAIR} >= 1, got (3, 3, 3)",
        lambda: FC(3, 8, (3, 3, 3), speeds=ONE),
    ),
    case(TypeError, f"kernel_size: {PAIR} >= 1, got None", lambda: FC(3, 8, None, speeds=ONE)),
    case(TypeError, f"kernel_size: {PAIR} >= 1, got 2.5", lambda: FC(3, 8, (2.5, 3), speeds=ONE)),
    case(ValueError, f"stride: {PAIR} >= 1 and", lambda: FC(3, 8, 3, stride=0, speeds=ONE)),
    case(ValueError, f"padding: {PAIR} >= 0 and", lambda: FC(3, 8, 3, padding=-1, speeds=ONE)),
    case(
        ValueError,
        "padding: must be 'same', 'valid', an integer >= 0 or a pair of them, got 'bad'",
        lambda: FC(3, 8, 3, padding="bad", speeds=ONE),
    ),
    case(
        ValueError,
        "padding: 'same' needs stride 1",
        lambda: FC(3, 8, 3, stride=2, padding="same", speeds=ONE),
    ),
    case(
        ValueError, f"dilation: {PAIR} >= 1 and", lambda: FC(3, 8, 3, dilation=(1, 0), speeds=ONE)
    ),
    case(ValueError, "groups: is True", lambda: FC(3, 8, 3, groups=True, speeds=ONE)),
    case(ValueError, "groups: is 2", lambda: FC(4, 8, 3, groups=2, speeds=ONE)),
    case(
        ValueError, "padding_mode: must be one of", lambda: FC(3, 8, 3, padding_mode={}, speeds=ONE)
    ),
    case(
        ValueError,
        "padding_mode: must be one of",
        lambda: FC(3, 8, 3, padding_mode="mirror", speeds=ONE),
    ),
]


@pytest.mark.parametrize(("error", "start", "call"), GEOMETRY)
def test_convolution_geometry_is_named(one_rank: None, error: Any, start: str, call: Any) -> None:
    """[] and 0 as a kernel (a 0 stride, a -1 padding) built a layer whose forward raised
    torch's RuntimeError; True was a kernel of 1; None and {} failed inside torch, unnamed."""
    with pytest.raises(error) as caught:
        call()
    assert str(caught.value).startswith(start), str(caught.value)


BAD_SPEEDS = [
    case(TypeError, f"{SEQ} dict", lambda: {3.0: "x"}),
    case(TypeError, f"{SEQ} str", lambda: "1"),
    case(TypeError, f"{SEQ} int", lambda: 5),
    case(TypeError, f"{SEQ} a 2-D array", lambda: np.ones((1, 1))),
    case(TypeError, f"{SEQ} None (entry 0)", lambda: [None]),
    case(TypeError, f"{SEQ} '1' (entry 0)", lambda: ["1"]),
    case(TypeError, "speeds: booleans are not speeds, got True (entry 0)", lambda: [True]),
    case(ValueError, "speeds: must be finite numbers, got an integer past", lambda: [10**400]),
    case(ValueError, "speeds: must be finite numbers, got nan (entry 0)", lambda: [float("nan")]),
    case(ValueError, "speeds: ", lambda: [0.0]),  # hetcoll.split's check, named
    case(ValueError, "speeds: has 2 speeds but the group has 1 ranks", lambda: [1.0, 1.0]),
]

BUILDS = {
    "Linear": lambda speeds: FL(4, 8, speeds=speeds),
    "Conv2d": lambda speeds: FC(3, 8, 3, speeds=speeds),
    "Linear.from_module": lambda speeds: FL.from_module(nn.Linear(4, 8), speeds=speeds),
    "Conv2d.from_module": lambda speeds: FC.from_module(nn.Conv2d(3, 8, 3), speeds=speeds),
}


@pytest.mark.parametrize("build", BUILDS.values(), ids=BUILDS.keys())
@pytest.mark.parametrize(("error", "start", "speeds"), BAD_SPEEDS)
def test_speeds_must_be_a_sequence_of_finite_numbers(
    one_rank: None, build: Any, error: Any, start: str, speeds: Any
) -> None:
    """A dict's keys and a string's characters were read as speeds, True as 1; 5 failed at
    len(), None inside float(), 10**400 with an OverflowError."""
    with pytest.raises(error) as caught:
        build(speeds())
    assert str(caught.value).startswith(start), str(caught.value)


ONLY_FROM_MODULE = [
    pytest.param(lambda: BN1(8), "FilterParallelBatchNorm1d", id="BatchNorm1d"),
    pytest.param(lambda: BN2(8), "FilterParallelBatchNorm2d", id="BatchNorm2d"),
    pytest.param(
        lambda: FilterParallelDepthwiseConv2d(8, 8, 3, groups=8),
        "FilterParallelDepthwiseConv2d",
        id="DepthwiseConv2d",
    ),
    pytest.param(
        lambda: FilterParallelGroupedConv2d(8, 8, 3, groups=2),
        "FilterParallelGroupedConv2d",
        id="GroupedConv2d",
    ),
    pytest.param(
        lambda: gather_state_dict(nn.Sequential(BN1(8))),
        "FilterParallelBatchNorm1d",
        id="gather_state_dict",
    ),
    pytest.param(lambda: RMS(), "FilterParallelRMSNorm", id="RMSNorm"),
    pytest.param(lambda: FilterParallelEmbedding(), "FilterParallelEmbedding", id="Embedding"),
]


@pytest.mark.parametrize(("make", "name"), ONLY_FROM_MODULE)
def test_layers_only_from_module_builds_refuse_their_constructors(
    one_rank: None, make: Any, name: str
) -> None:
    """The BatchNorms' and the depthwise convolution's own constructors built a layer of no
    split: held_index() and gather_state_dict raised AttributeError 'shares'. The RMS norm and
    the embedding built one the same way, with no arguments."""
    with pytest.raises(TypeError, match=rf"^{name}: build one with {name}\.from_module$"):
        make()


WRONG_MODULES = [
    case(
        TypeError,
        "bn: must be a torch.nn.BatchNorm2d, got BatchNorm1d",
        lambda: BN2.from_module(nn.BatchNorm1d(8), [8]),
    ),
    case(
        TypeError,
        "bn: must be a torch.nn.BatchNorm1d, got BatchNorm2d",
        lambda: BN1.from_module(nn.BatchNorm2d(8), [8]),
    ),
    case(
        TypeError,
        "bn: must be a torch.nn.BatchNorm1d, got NoneType",
        lambda: BN1.from_module(None, [8]),
    ),
    case(
        TypeError,
        "bn: must be a torch.nn.BatchNorm2d, got Linear",
        lambda: BN2.from_module(nn.Linear(4, 8), [8]),
    ),
    case(
        TypeError,
        "conv: must be a torch.nn.Conv2d, got NoneType",
        lambda: FilterParallelDepthwiseConv2d.from_module(None, [8]),
    ),
    case(
        TypeError,
        "conv: must be a torch.nn.Conv2d, got Linear",
        lambda: FilterParallelGroupedConv2d.from_module(nn.Linear(4, 4), [8]),
    ),
    case(
        ValueError,
        "conv: a grouped convolution of whole groups per rank has groups > 1 and as many "
        "channels in as out, got groups 1, 8 in, 8 out",
        lambda: FilterParallelGroupedConv2d.from_module(nn.Conv2d(8, 8, 3), [8]),
    ),
    case(
        ValueError,
        "conv: a grouped convolution of whole groups per rank has groups > 1 and as many "
        "channels in as out, got groups 2, 8 in, 16 out",
        lambda: FilterParallelGroupedConv2d.from_module(nn.Conv2d(8, 16, 3, groups=2), [16]),
    ),
    case(
        ValueError,
        "conv: a depthwise convolution has groups = in = out channels, got groups 2, 8 in, 8 out",
        lambda: FilterParallelDepthwiseConv2d.from_module(nn.Conv2d(8, 8, 3, groups=2), [8]),
    ),
    case(
        TypeError,
        "mha: must be a torch.nn.MultiheadAttention, got NoneType",
        lambda: MHA.why_not(None),
    ),
    case(
        TypeError,
        "mha: must be a torch.nn.MultiheadAttention, got Linear",
        lambda: MHA.why_not(nn.Linear(4, 4)),
    ),
    case(
        TypeError,
        "mha: must be a torch.nn.MultiheadAttention, got Linear",
        lambda: MHA.from_module(nn.Linear(4, 4), [1]),
    ),
    case(
        TypeError,
        "shared_input: must be a SharedCopy or None, got str",
        lambda: FL.from_module(nn.Linear(4, 8), [8], shared_input="x"),
    ),
    case(
        ValueError,
        "shared_input: only split-output layers read a shared copy, got mode 'gather'",
        lambda: FL.from_module(nn.Linear(4, 8), [8], shared_input=SharedCopy(wrap(None), None)),
    ),
    case(
        ValueError,
        "eps: must be a finite number >= 0, got 'x'",
        lambda: RMS.from_module(nn.RMSNorm(8), "x", [8]),  # type: ignore[arg-type]
    ),
    case(
        ValueError,
        "blocks: must be integers >= 0, not all 0",
        lambda: RMS.from_module(nn.RMSNorm(8), 1e-6, [8], blocks="1"),
    ),
    case(
        TypeError,
        "shares: must be a sequence of integers, got dict",
        lambda: RMS.from_module(nn.RMSNorm(8), 1e-6, {8: 1}),  # type: ignore[arg-type]
    ),
]


@pytest.mark.parametrize(("error", "start", "call"), WRONG_MODULES)
def test_from_module_names_what_it_cannot_split(
    one_rank: None, error: Any, start: str, call: Any
) -> None:
    """A BatchNorm1d was split as a BatchNorm2d (and back); None and a Linear raised
    AttributeError inside from_module and why_not; shared_input='x' was accepted and dropped
    (as any shared copy was, outside split-output); the RMS norm's eps failed inside float()."""
    with pytest.raises(error) as caught:
        call()
    assert str(caught.value).startswith(start), str(caught.value)


GOOD_LINEARS = [
    ((4, 8), {"speeds": [1.0]}),
    ((np.int64(4), np.int64(8), False), {"speeds": np.array([2.5])}),
    ((4, 8, np.bool_(True)), {"speeds": (np.float32(1.0),), "multiple_of": np.int64(4)}),
    ((4, 8), {"shares": [np.int64(8)], "mode": "split-output"}),
    ((4, 8), {"speeds": [3], "mode": "split-input", "in_features_per_channel": 2}),
]

GOOD_CONVS = [
    ((3, 8, 3), {}),
    ((np.int64(3), np.int64(8), np.int64(3)), {"stride": np.int64(2), "bias": False}),
    ((3, 8, (3, 2)), {"stride": [2, 1], "padding": (1, 0), "dilation": (1, 2)}),
    ((3, 8, [3, 3]), {"padding": "same", "padding_mode": "reflect"}),
    ((3, 8, 3), {"padding": "valid", "padding_mode": "circular", "groups": np.int64(1)}),
    ((3, 8, 3), {"padding": 1, "padding_mode": "replicate"}),
]


def test_good_calls_build_and_compute_as_the_unsplit_layers(one_rank: None) -> None:
    """On one rank a split layer is the whole layer: it computes what torch's does, for the
    calls that were valid before (numpy integers, floats and bools among them)."""
    x2 = torch.randn(3, 4, dtype=torch.float64)
    for args, kwargs in GOOD_LINEARS:
        sizes, bias = (int(a) for a in args[:2]), [bool(a) for a in args[2:]]
        torch.manual_seed(1)
        ref = nn.Linear(*sizes, *bias, dtype=torch.float64)
        torch.manual_seed(1)
        split = FL(*args, dtype=torch.float64, **kwargs)
        assert torch.equal(split(x2), ref(x2)), (args, kwargs)

    x4 = torch.randn(2, 3, 7, 6, dtype=torch.float64)
    for args, kwargs in GOOD_CONVS:
        torch.manual_seed(2)
        ref_conv = nn.Conv2d(*args, **kwargs, dtype=torch.float64)
        torch.manual_seed(2)
        conv = FC(*args, **kwargs, speeds=ONE, dtype=torch.float64)
        assert torch.equal(conv(x4), ref_conv(x4)), (args, kwargs)

    # from_module: the layers only it builds, and a split-output column reading a shared copy.
    torch.manual_seed(3)
    bn1, bn2 = nn.BatchNorm1d(4).double(), nn.BatchNorm2d(3).double()
    dw = nn.Conv2d(3, 3, 3, groups=3, dtype=torch.float64)
    grouped = nn.Conv2d(6, 6, 3, groups=2, padding=1, padding_mode="reflect", dtype=torch.float64)
    x6 = torch.randn(2, 6, 7, 6, dtype=torch.float64)
    mha = nn.MultiheadAttention(8, 2, dtype=torch.float64)
    norm, emb = nn.RMSNorm(8, eps=1e-6, dtype=torch.float64), nn.Embedding(10, 4)
    copy = SharedCopy(wrap(None), None)
    column = FL.from_module(nn.Linear(4, 8), [8], mode="split-output", shared_input=copy)
    assert column.shared_input is copy
    assert MHA.why_not(mha) is None
    q = torch.randn(5, 2, 8, dtype=torch.float64)
    h = torch.randn(2, 3, 8, dtype=torch.float64)
    ids = torch.tensor([[0, 9, 3]])
    for split, ref_module, x, tol in (
        (BN1.from_module(bn1, [np.int64(4)]), bn1, x2, 1e-12),
        (BN2.from_module(bn2, [3]), bn2, x4, 1e-12),
        (FilterParallelDepthwiseConv2d.from_module(dw, [3]), dw, x4, 1e-12),
        (FilterParallelGroupedConv2d.from_module(grouped, [6]), grouped, x6, 1e-12),
        (RMS.from_module(norm, np.float64(1e-6), [8]), norm, h, 1e-6),  # in float32, as HF's
        (FilterParallelEmbedding.from_module(emb, [10]), emb, ids, 0.0),
    ):
        got, want = split(x), ref_module(x)
        assert torch.allclose(got, want, rtol=tol, atol=tol), type(split).__name__
    assert BN1.from_module(bn1, [4]).held_index().tolist() == [0, 1, 2, 3]
    state = gather_state_dict(nn.Sequential(BN1.from_module(bn1, [4])))
    assert set(state) == {f"0.{n}" for n, _ in bn1.state_dict().items()}
    out, weights = MHA.from_module(mha, [2])(q, q, q)
    ref_out, ref_weights = mha(q, q, q)
    assert torch.allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    assert torch.allclose(weights, ref_weights, rtol=1e-12, atol=1e-12)
