"""Filter parallelism on real gloo and MPI jobs of 2 and 3 processes.

The cases live in tests/filter_cases.py and run inside every rank: awkward channel counts (37,
61, 5), uneven shares such as [29, 7, 1], stride, padding, bias on and off, a BatchNorm after a
split layer, float64 (rel. error <= 1e-10) and float32 (<= 1e-5) against the unsplit model on
one process; state dicts both ways; parameter memory per rank; bad input. Here we launch the
jobs and check every case ran; argument errors that need no group are checked in-process.
"""

from __future__ import annotations

import json
from pathlib import Path

import filter_cases
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from hetcoll import launch
from hetcoll.lab.demo import DemoConfig, DemoNet, format_table, run, summary_rows
from hetcoll.lab.emulate import slow_down_filter_parallel
from hetcoll.torch import FilterParallelLinear, filter_parallel, filter_shares

HERE = Path(__file__).resolve().parent
EXPECTED = {"equal": 3, "random": 24, "random_grouped": 8, "errors": 10, "real_models": 8}
#: filter_cases.scaled_split's scale after each of its 4 steps, on every rank: 2**8, grown
#: every 2 steps without an overflow, halved by step 1's (found by the last rank alone).
SCALES = [256.0, 128.0, 128.0, 256.0]


@pytest.mark.multiproc
@pytest.mark.parametrize("p", [2, 3])
def test_gloo_equals_unsplit(p):
    got = launch.spawn(filter_cases.run_torch, p, timeout=120)
    assert got == [{**EXPECTED, "scaled": SCALES}] * p


@pytest.mark.multiproc
@pytest.mark.parametrize("p", [2, 3])
def test_mpi_equals_unsplit(p):
    proc = launch.mpiexec(p, [str(HERE / "mpi_workers" / "filter_parallel.py")], timeout=180)
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {**EXPECTED, "scaled": [SCALES] * p}


def test_bad_arguments_without_a_group():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(TypeError, match=r"model: must be a torch.nn.Module"):
        filter_parallel("net", [1.0], None)
    with pytest.raises(TypeError, match=r"shares_or_speeds: must be a sequence"):
        filter_parallel(model, 3, None)
    with pytest.raises(TypeError, match=r"shares_or_speeds: booleans"):
        filter_parallel(model, [True], None)
    with pytest.raises(ValueError, match=r"layers: the model has no module named 'x'"):
        filter_parallel(model, [1.0], None, layers=["x"])
    # A dict of shares names the layers itself: its errors name shares, not layers.
    from hetcoll.torch.filters import filter_shares

    with pytest.raises(ValueError, match=r"^shares: the model has no module named 'x'"):
        filter_shares(model, size=1, shares={"x": [4]})
    with pytest.raises(ValueError, match=r"^shares: '' is a Sequential"):
        filter_shares(model, size=1, shares={"": [4]})
    with pytest.raises(ValueError, match=r"^shares_or_speeds: the model has no module named 'x'"):
        filter_shares(model, {"x": [4]}, 1)
    with pytest.raises(ValueError, match=r"multiple_of: must be an integer >= 1"):
        filter_parallel(model, [1.0], None, multiple_of=0)
    with pytest.raises(ValueError, match=r"mode: must be one of"):
        FilterParallelLinear(4, 4, shares=[4], mode="scatter")
    with pytest.raises(ValueError, match=r"shares, speeds: give exactly one"):
        FilterParallelLinear(4, 4)
    with pytest.raises(ValueError, match=r"speed: must be in"):
        slow_down_filter_parallel(model, 0.0)
    with pytest.raises(ValueError, match=r"in_features_per_channel: 3 does not divide"):
        FilterParallelLinear(4, 4, shares=[4], in_features_per_channel=3)
    # Neither torch.distributed nor MPI in this process: no default group, refused by name.
    with pytest.raises(ValueError, match=r"group: none given and no default"):
        filter_parallel(model, [1.0], None)


@pytest.mark.multiproc
def test_demo_filter_strategy_learns_the_same_model_with_either_split():
    cfg = DemoConfig(
        speeds=(1.0, 0.25), epochs=1, global_batch=128, progress=False, strategy="filter"
    )
    report = run(cfg)
    assert report["emulated"] is True and report["strategy"] == "filter"
    rows = {r["run"]: r for r in summary_rows(report)}
    conv1 = DemoNet()[0].out_channels
    assert rows["unbalanced"]["shares"] == [conv1 // 2, conv1 // 2]  # conv1's filters, even
    fast, slow = rows["balanced"]["shares"]
    assert fast + slow == conv1 and fast > slow
    for layer, shares in report["layer_shares"]["balanced"].items():
        assert shares[0] > shares[1], layer
    # Same data, same initial weights; the splits differ only in float32 summation order, which
    # depends on the instruction set, so the two runs agree to a tolerance, not bit for bit
    # (exactness is asserted in float64 by test_gloo_equals_unsplit / test_mpi_equals_unsplit).
    b, u = rows["balanced"], rows["unbalanced"]
    assert abs(b["test_loss"] - u["test_loss"]) <= 1e-3 * u["test_loss"]
    assert abs(b["test_accuracy"] - u["test_accuracy"]) <= 0.01
    assert "balanced / unbalanced throughput" in format_table(report)


def test_layers_left_replicated_are_named_in_a_warning():
    from hetcoll.torch.filters import filter_modes, filter_shares

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3, groups=4), nn.LSTM(4, 4))
    with pytest.warns(
        UserWarning, match=r"left replicated.*'1' \(Conv2d, groups=4\), '2' \(LSTM\)"
    ):
        assert filter_shares(model, [3.0, 1.0], 2) == {"0": [6, 2]}  # grouped: kept, no error
    with pytest.warns(UserWarning) as record:
        assert filter_shares(nn.Sequential(nn.Conv1d(3, 4, 3)), [1.0, 1.0], 2) == {}
    assert [str(w.message)[:40] for w in record] == [
        "filter_parallel: left replicated (every ",
        "filter_parallel: Sequential has no Conv2",
    ]
    # The pairing rule itself (what the planner asks) stays quiet.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert filter_modes(model) == {"0": "gather"}


def test_speeds_and_shares_by_keyword_are_never_ambiguous():
    from hetcoll.torch.filters import filter_shares

    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 2))
    # Integers as speeds (as hetcoll.split reads them) and as shares, each said by keyword.
    assert filter_shares(model, size=2, speeds=[2, 1]) == {"0": [4, 2], "2": [4, 2]}
    assert filter_shares(model, size=2, shares=[5, 1]) == {"0": [5, 1], "2": [5, 1]}
    assert filter_shares(model, size=2, shares={"0": [1, 5]}) == {"0": [1, 5]}  # layers: its keys
    with pytest.warns(DeprecationWarning, match="integers in shares_or_speeds are read as"):
        assert filter_shares(model, [5, 1], 2) == {"0": [5, 1], "2": [5, 1]}
    with pytest.raises(TypeError, match=r"speeds, shares: give exactly one.*got speeds, shares"):
        filter_shares(model, size=2, speeds=[1.0, 1.0], shares=[3, 3])
    with pytest.raises(TypeError, match=r"speeds, shares: give exactly one"):
        filter_shares(model, size=2)
    with pytest.raises(TypeError, match=r"shares: must be integers \(speeds go to speeds=\)"):
        filter_shares(model, size=2, shares=[1.0, 0.5])
    with pytest.raises(TypeError, match=r"speeds: booleans"):
        filter_shares(model, size=2, speeds=[True, 1])
    with pytest.raises(ValueError, match=r"shares: layer '0' has 6 channels|shares: shares sum"):
        filter_shares(model, size=2, shares=[5, 5])
    with pytest.raises(TypeError, match=r"size: required"):
        filter_shares(model, speeds=[1.0])
    with pytest.raises(TypeError, match=r"speeds, shares: give exactly one"):
        filter_parallel(model, None)


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(4, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, padding=1)
        self.c = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        y = torch.relu(self.a(x))
        return self.b(y) + y  # y is read twice: a's output must be whole


class _Reused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.a(self.b(self.a(x)))  # a called twice: it cannot have one mode


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # not traceable
            return self.b(self.a(x))
        return self.b(self.a(-x))


def test_pairing_through_traced_forwards():
    from filter_cases import FunctionalNet

    from hetcoll.torch.filters import filter_modes

    assert filter_modes(FunctionalNet()) == {
        "conv1": "split-output",
        "conv2": "split-input",
        "fc1": "split-output",
        "fc2": "split-input",
    }
    assert filter_modes(_Residual()) == {"a": "gather", "b": "gather", "c": "gather"}
    assert set(filter_modes(_Reused()).values()) == {"gather"}
    assert set(filter_modes(_DataDependent()).values()) == {"gather"}
    # A Sequential of traced blocks: pairs inside the blocks, none across the residuals.
    import torchvision

    modes = filter_modes(torchvision.models.resnet18())
    assert modes["layer3.1.conv1"] == "split-output" and modes["layer3.1.conv2"] == "split-input"
    assert modes["conv1"] == modes["fc"] == "gather"


class _Excite(nn.Module):
    """A squeeze-and-excitation written as users write it: a mean, two 1x1 convolutions."""

    def __init__(self, channels: int, squeezed: int, gate_read_twice: bool = False) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(channels, squeezed, 1)
        self.expand = nn.Conv2d(squeezed, channels, 1)
        self.twice = gate_read_twice

    def forward(self, x):
        gate = torch.sigmoid(self.expand(F.silu(self.reduce(x.mean((2, 3), keepdim=True)))))
        return x * gate + gate if self.twice else x * gate


class _Inverted(nn.Module):
    """An inverted residual block without its residual: one run, input to output."""

    def __init__(self) -> None:
        super().__init__()
        self.depthwise = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.norm = nn.BatchNorm2d(16)
        self.excite = _Excite(16, 4)

    def forward(self, x):
        return self.excite(F.relu(self.norm(self.depthwise(x))))


def test_a_squeeze_and_excitation_splits_with_the_run_around_it():
    from hetcoll.torch.filters import chain_filter_modes, filter_modes, filter_shares

    run = {"0": "split-output", "2.reduce": "split-input", "2.expand": "split-output"}
    model = nn.Sequential(nn.Conv2d(3, 16, 1), nn.ReLU(), _Excite(16, 4), nn.Conv2d(16, 6, 1))
    assert filter_modes(model) == {**run, "3": "split-input"}
    # The expanding layer computes the gates of the rank's channels: the first layer's shares.
    shares = filter_shares(model, size=2, speeds=[1.0, 0.25])
    assert shares["2.expand"] == shares["0"] == shares["2.reduce"] == shares["3"] == [13, 3]
    given = {"0": [10, 6], "2.reduce": [10, 6], "2.expand": [10, 6], "3": [10, 6]}
    assert filter_shares(model, given, 2) == given
    given["2.expand"] = [8, 8]
    with pytest.raises(ValueError, match=r"'2.expand' scales the channels of '0', so its shares"):
        filter_shares(model, given, 2)
    # Alone, its two layers pair with each other, as any two layers in a run.
    alone = {"0.reduce": "split-output", "0.expand": "split-input"}
    assert filter_modes(nn.Sequential(_Excite(16, 4))) == alone
    model = nn.Sequential(nn.Conv2d(3, 16, 1), nn.Flatten(), _Excite(16, 4))
    assert filter_modes(model) == {
        "0": "gather",
        "2.reduce": "split-output",
        "2.expand": "split-input",
    }
    # A gate read twice is no excitation: the run stops there.
    model = nn.Sequential(nn.Conv2d(3, 16, 1), _Excite(16, 4, True), nn.Conv2d(16, 6, 1))
    assert filter_modes(model) == {
        "0": "gather",
        "1.reduce": "split-output",
        "1.expand": "split-input",
        "2": "gather",
    }
    # A block whose forward is one run continues a run around it (the depthwise convolution
    # and the BatchNorm split with it): a plan's stage, an nn.Sequential of a model's layers,
    # pairs as the whole model's traced forward does.
    model = nn.Sequential(nn.Conv2d(3, 16, 1), _Inverted(), nn.Conv2d(16, 6, 1))
    assert filter_modes(model) == {
        "0": "split-output", "1.excite.reduce": "split-input",
        "1.excite.expand": "split-output", "2": "split-input",
    }  # fmt: skip
    assert chain_filter_modes(list(model.named_children()))[0] == filter_modes(model)
    import torchvision

    for build in (torchvision.models.mobilenet_v3_small, torchvision.models.efficientnet_b0):
        whole = build()
        layers = [*whole.named_children()]  # features, avgpool, classifier
        layers.insert(2, ("flatten", _Flatten()))
        assert chain_filter_modes(layers)[0] == filter_modes(whole)


class _Flatten(nn.Module):
    def forward(self, x):
        return torch.flatten(x, 1)


def test_an_untraceable_forward_is_named_in_a_warning():
    from hetcoll.torch.filters import filter_shares

    message = r"could not trace the forward of _DataDependent \("
    with pytest.warns(UserWarning, match=message) as rec:
        filter_shares(_DataDependent(), size=2, speeds=[1.0, 1.0])
    assert "'a' gather, 'b' gather" in str(rec[-1].message)


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_an_optimizer_made_before_the_split_raises_at_its_step():
    for said in launch.spawn(filter_cases.optimizer_before, 2, timeout=90):
        assert [s.split(":")[0] for s in said] == ["optimizer"] * 3, said
        for s, call in zip(said, ("filter_parallel", "expert_parallel", "parallelize")):
            assert f"that {call} replaced" in s and f"Create the optimizer after {call}" in s


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_unbatched_input_and_tied_weights():
    """Issue 26: an unbatched input to a split conv raised nowhere and hung; filter_parallel
    split a Linear tied to an embedding and silently untied it. Survey 11: a rank evaluating
    while another trained got a wrong output without a word."""
    results = launch.spawn(filter_cases.run_hostile, 2, timeout=90)
    assert results[0] == results[1]
    unbatched, mismatch, mode, grad, copied, warning = results[0]
    assert copied == "model: a model split by filter_parallel cannot be deep-copied", copied
    assert "the split model's inputs (shapes and dtypes)" in mismatch, mismatch
    # Rank 0 evaluating while rank 1 trains (its output was silently wrong).
    assert mode == "ranks disagree on the split model's mode", mode
    assert grad == "ranks disagree on gradients", grad
    assert unbatched == (
        "input: a filter-parallel FilterParallelConv2d takes batched 4-D input (N, C, H, W), "
        "got shape (3, 6, 6)"
    )
    assert "'3' (Linear, weight shared with '0': a split would untie them)" in warning


def test_tied_layers_stay_replicated_or_raise_by_name():
    from hetcoll.torch.filters import filter_shares

    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    model = nn.Sequential(a, nn.ReLU(), b, nn.ReLU(), nn.Linear(4, 2))
    with pytest.warns(UserWarning, match=r"'0' \(Linear, weight shared with '2'"):
        assert list(filter_shares(model, [1.0, 1.0], 2)) == ["4"]
    with pytest.raises(ValueError, match=r"^layers: '2' cannot be split: weight shared with '0'"):
        filter_shares(model, [1.0, 1.0], 2, layers=["2"])
    same = nn.Linear(4, 4)
    twice = nn.Sequential(same, nn.ReLU(), same)  # one module under two names
    with pytest.warns(UserWarning) as record:
        assert filter_shares(twice, [1.0, 1.0], 2) == {}
    messages = [str(w.message) for w in record]
    assert "'0' (Linear, weight shared with '2': a split would untie them)" in messages[0]
    assert "no Conv2d (groups=1) or Linear layer or experts it can split" in messages[1]


def test_a_layer_too_small_for_the_ranks_stays_whole_by_default():
    # A regression head of one output (or an MoE's one-output gate) cannot give each of two
    # ranks a channel: chosen by default it stays replicated, named in a warning; the other
    # layers split. Named in layers, it raises.
    from hetcoll.torch.filters import filter_shares

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Linear(8, 1))
    with pytest.warns(UserWarning, match=r"'3' \(Linear, 1 output channels: fewer than 2"):
        shares = filter_shares(model, size=2, speeds=[1.0, 0.5])
    assert set(shares) == {"0", "2"}
    with pytest.raises(ValueError, match="has 1 channels, too few for 2 ranks"):
        filter_shares(model, size=2, speeds=[1.0, 0.5], layers=["0", "3"])


def test_a_layer_whose_weight_the_forward_reads_stays_whole():
    # Swin's attention calls a function with its qkv and proj weights instead of calling the
    # layers: a split would hand that function a slice. By default they stay whole (warned);
    # named in layers they raise.
    from filter_cases import swin

    from hetcoll.torch.filters import filter_shares

    with pytest.warns(UserWarning, match=r"'features\.1\.0\.attn\.qkv'.*reads their parameters"):
        shares = filter_shares(swin(), size=2, speeds=[1.0, 0.5])
    assert "features.1.0.attn.qkv" not in shares and "features.1.0.mlp.0" in shares
    with pytest.raises(ValueError, match=r"layers: 'features\.1\.0\.attn\.proj': a traced"):
        filter_shares(swin(), size=2, speeds=[1.0, 0.5], layers=["features.1.0.attn.proj"])


def test_a_parametrized_linear_stays_replicated_and_is_named() -> None:
    # A weight-normed Linear computes more than x @ W.T + b: left whole, as a weight-normed
    # Conv2d is, but it was left out of the warning.
    from torch.nn.utils.parametrizations import weight_norm

    from hetcoll.torch.filters import filter_shares

    model = nn.Sequential(
        nn.Linear(4, 8), nn.ReLU(), weight_norm(nn.Linear(8, 8)), nn.ReLU(), nn.Linear(8, 2)
    )
    kept = r"left replicated .*'2' \(ParametrizedLinear, parametrizations"
    with pytest.warns(UserWarning, match=kept):
        assert filter_shares(model, size=2, speeds=[1.0, 1.0]) == {"0": [4, 4], "4": [1, 1]}


class _RunningMean(nn.Module):
    """Updates a running mean and a call counter in its forward (in training)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.ones(d))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * x.mean(0))
                self.calls += 1
        return x - self.mean


def test_looking_at_a_model_leaves_its_buffers_as_they_were() -> None:
    # Before: torch.fx's traces ran the forward's in-place updates of buffers for real (they
    # read buffers as the tensors they are): after filter_shares, the running mean was 0.9^4
    # and the counter 4, in the user's model and in the copy a plan trained.
    from hetcoll.model import layer_costs
    from hetcoll.torch.filters import filter_shares, split_layout
    from hetcoll.torch.layers import model_layers

    model = nn.Sequential(nn.Linear(16, 32), _RunningMean(32), nn.ReLU(), nn.Linear(32, 10))
    model_layers(model)
    split_layout(model)
    filter_shares(model, size=2, speeds=[1.0, 0.5])
    layer_costs(model, (16,))
    assert torch.equal(model[1].mean, torch.ones(32)) and int(model[1].calls) == 0


def _split_twice(rank, world):
    model = filter_parallel(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), [1.0, 0.5])
    try:
        filter_parallel(model, [1.0, 0.5])
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.multiproc
def test_a_split_model_is_not_split_again():
    """expert_parallel's placed experts then filter_parallel failed at the first forward with
    numpy's "could not broadcast input array from shape (3,) into shape (32,)"."""
    for said in launch.spawn(_split_twice, 2, timeout=60):
        assert said.startswith("model: '0' is split across the ranks already"), said


def _encoder() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, dropout=0.0)
    return nn.Sequential(layer).double()


#: filter_parallel's arguments per case, as (rank 0's, rank 1's), and what each rank raises:
#: before, rank 1 raised alone where it had a sample or a bad timeout, and rank 0 waited.
_SAMPLE = torch.zeros(2, 3, 8, dtype=torch.float64)
FILTER_ONE_RANK = {
    "sample_with_shares": (
        ({"shares": "by speeds"}, {"shares": "by speeds", "sample": _SAMPLE}),
        "CollectiveMismatchError: rank 1 raised ValueError: sample: balances a split by speeds",
        "ValueError: sample: balances a split by speeds; give speeds=, not shares",
    ),
    "bad_speeds_with_sample": (
        ({"speeds": [1.0, 0.5], "sample": _SAMPLE}, {"speeds": [1.0, -1.0], "sample": _SAMPLE}),
        "CollectiveMismatchError: rank 1 raised ValueError: speeds",
        "ValueError: speeds",
    ),
    "sample_fails": (
        ({"speeds": [1.0, 0.5], "sample": _SAMPLE}, {"speeds": [1.0, 0.5], "sample": "ids"}),
        "CollectiveMismatchError: rank 1 raised ValueError: sample: the model's forward on it",
        "ValueError: sample: the model's forward on it failed",
    ),
    "sample_on_one_rank": (
        ({"speeds": [1.0, 0.5], "sample": _SAMPLE}, {"speeds": [1.0, 0.5]}),
        "CollectiveMismatchError: ranks disagree on sample timings (rank 0: 3, rank 1: (not",
        "CollectiveMismatchError: ranks disagree on sample timings (rank 0: 3, rank 1: (not",
    ),
    "timeout": (
        ({"speeds": [1.0, 0.5]}, {"speeds": [1.0, 0.5], "timeout": -1.0}),
        "CollectiveMismatchError: rank 1 raised ValueError: timeout: must be a number",
        "ValueError: timeout: must be a number of seconds > 0 or None, got -1.0",
    ),
}


def _filter_one_rank(rank, world):
    import warnings

    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        by_speeds = filter_shares(_encoder(), size=2, speeds=[1.0, 0.5])
        for case, (per_rank, *_) in FILTER_ONE_RANK.items():
            given = {k: by_speeds if k == "shares" else v for k, v in per_rank[rank].items()}
            try:
                filter_parallel(_encoder(), **given)
                out[case] = "no error"
            except (ValueError, TypeError, RuntimeError) as e:
                out[case] = f"{type(e).__name__}: {e}"
        # The group still works: the same split on both ranks, timed by the sample.
        split = filter_parallel(_encoder(), speeds=[1.0, 0.5], sample=_SAMPLE)
    out["after"] = [m.shares for m in split.modules() if isinstance(m, FilterParallelLinear)]
    return out


@pytest.mark.multiproc
def test_a_bad_sample_or_timeout_on_one_rank_raises_on_every_rank():
    """One rank's bad argument beside its sample (or a sample on one rank only, or a bad
    timeout) raises on every rank at once (the group's timeout is short: a rank left waiting
    fails the test)."""
    per_rank = launch.spawn(_filter_one_rank, 2, timeout=20)
    for case, (_, *said) in FILTER_ONE_RANK.items():
        for r in range(2):
            assert per_rank[r][case].startswith(said[r]), (case, r, per_rank[r][case])
    assert per_rank[0]["after"] == per_rank[1]["after"] and per_rank[0]["after"]


def test_an_in_place_op_after_a_gathered_layer_takes_one_sample(one_rank: None) -> None:
    """A gathered layer's output at batch 1 was a view autograd forbids modifying in place (the
    channels moved back to their dimension needed no copy): torchvision's
    ``ReLU(inplace=True)`` after it raised, a SqueezeNet split given one sample. Equal to the
    unsplit model, at batch 1 and 2."""
    for make, shape in (
        (lambda: nn.Sequential(nn.Linear(8, 6), nn.ReLU(inplace=True)), (8,)),
        (lambda: nn.Sequential(nn.Conv2d(3, 5, 3), nn.ReLU(inplace=True)), (3, 6, 6)),
    ):
        for batch in (1, 2):
            torch.manual_seed(0)
            whole = make().double()
            split = filter_parallel(make().double(), speeds=[1.0])
            split.load_state_dict(whole.state_dict())
            x = torch.randn(batch, *shape, dtype=torch.float64)
            assert torch.equal(split(x), whole(x))
            split(x).square().sum().backward()
            whole(x).square().sum().backward()
            for (name, a), b in zip(split.named_parameters(), whole.parameters()):
                assert torch.equal(a.grad, b.grad), name
