"""Bad arguments to hetcoll.torch's helpers are named where they are given (an audit's
findings): a timeout past what torch can time, a split output of another rank's width, per-layer
shares read as speeds, flags given as strings, datasets that are no datasets, a complex
checkpoint loaded into a real model. One rank, a gloo group over a file store (no port)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import hetcoll
from hetcoll.comm import wrap
from hetcoll.torch import (
    BalancedSampler,
    BatchCounter,
    DistributedOptimizer,
    ReplicaSavePlanner,
    SplitOutput,
    WeightedAllreduceState,
    clip_grad_norm_,
    filter_parallel,
    filter_shares,
    gather_state_dict,
    load_full_state_dict,
    weighted_allreduce_hook,
)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def encoder_layer() -> nn.Module:
    return nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)


def test_a_timeout_past_torchs_longest_wait_is_no_limit(one_rank: None) -> None:
    """1e15 s once overflowed torch's wait, reported as a lost peer; np.int64(5) was refused."""
    x = torch.randn(2, 4)
    for timeout in (1e15, 2**70, math.inf, np.int64(5), np.float32(2.5)):
        assert torch.equal(SplitOutput.of(x, wrap(None), [4], timeout=timeout).whole(), x)
        out = hetcoll.allreduce(np.ones(3), timeout=timeout)
        assert out.tolist() == [1.0, 1.0, 1.0]
    assert filter_parallel(mlp(), speeds=[1.0], timeout=np.int64(5))(x).shape == (2, 2)
    for bad in (0, -1, math.nan, "5", True):
        with pytest.raises(ValueError, match=r"^timeout: must be a number of seconds > 0"):
            SplitOutput.of(x, wrap(None), [4], timeout=bad)


def test_a_split_output_is_made_of_this_ranks_piece(one_rank: None) -> None:
    """A share of 7 for a piece of 4 once failed inside gloo; -3 gave a shape (2, -3); a
    SplitOutput made by hand raised AttributeError from every op, its repr too."""
    x, comm = torch.randn(2, 4), wrap(None)
    listed, counted = "shares: must be a list of integers", r"shares: must be 1 integers >= 0"
    for shares, kind, text in (([7], ValueError, "shares: this rank's share, 7, must be"),
                               ([-3], ValueError, counted), ([], ValueError, counted),
                               ([True], ValueError, counted), (None, TypeError, listed),
                               ("abcd", TypeError, listed)):  # fmt: skip
        with pytest.raises(kind, match=rf"^{text}"):
            SplitOutput.of(x, comm, shares)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^local: must be a tensor"):
        SplitOutput.of(None, comm, [4])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^comm: must be a hetcoll.comm.Communicator"):
        SplitOutput.of(x, None, [4])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^SplitOutput: build one with SplitOutput.of"):
        SplitOutput(x)
    with pytest.raises(TypeError, match=r"^SplitOutput: build one with SplitOutput.of"):
        repr(x.as_subclass(SplitOutput))
    split = SplitOutput.of(x, comm, [np.int64(4)])
    assert torch.equal((split * 2).whole(), x * 2)


def test_filter_shares_per_layer_are_shares_and_flags_are_flags() -> None:
    """Floats (or bools) for an MLP's second layer were once read as speeds, None raised
    'NoneType is not iterable', an attention named alone was blamed on its out_proj;
    avoid_gathers=None turned every layer to gathering, and a sample was ignored in silence."""
    layer = encoder_layer()
    for value, kind, text in (([0.7, 0.3], TypeError, "must be integers"),
                              ([True, True], TypeError, "must be integers"),
                              (None, TypeError, "must be a sequence of integers"),
                              ("ab", TypeError, "must be a sequence of integers")):  # fmt: skip
        with pytest.raises(kind, match=rf"^shares\['linear2'\]: {text}"):
            filter_shares(layer, size=2, shares={"linear1": [8, 8], "linear2": value})
    with pytest.raises(ValueError, match=r"^shares\['self_attn'\]: \[8, 8\] are not whole heads"):
        filter_shares(layer, size=2, shares={"self_attn": [8, 8]})
    assert filter_shares(layer, size=2, shares={"linear1": [8, 8], "linear2": [8, 8]}) == {
        "linear1": [8, 8],
        "linear2": [8, 8],
    }
    for flag in (None, "no", 1):
        with pytest.raises(TypeError, match=r"^avoid_gathers: must be True or False"):
            filter_shares(mlp(), size=2, speeds=[1, 1], avoid_gathers=flag)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^sample: balances a split by speeds"):
        filter_shares(mlp(), size=2, shares=[4, 4], sample=torch.randn(2, 4))
    with pytest.warns(UserWarning, match=r"sample times the work .* it is not run"):
        assert filter_shares(mlp(), size=2, speeds=[1, 1], sample="abc") == {
            "0": [4, 4],
            "2": [4, 4],
        }
    with pytest.raises(ValueError, match=r"^speeds: must be finite numbers, got an integer"):
        filter_shares(mlp(), size=2, speeds=[10**400, 1])
    with pytest.raises(TypeError, match=r"^speeds: must be a sequence of numbers, got None \("):
        filter_shares(mlp(), size=2, speeds=[1, None])
    # One check of speeds for the layers and the converter: an array, and a dict's keys.
    assert filter_shares(mlp(), size=2, speeds=np.array([1.0, 3.0])) == {"0": [2, 6], "2": [2, 6]}
    with pytest.raises(TypeError, match=r"^speeds: must be a sequence of numbers, got dict"):
        filter_shares(mlp(), size=2, speeds={1.0: 1, 3.0: 1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^shares_or_speeds: must be finite numbers"):
        filter_shares(mlp(), [10**400, 1.0], size=2)


def test_samplers_take_flags_and_datasets_only() -> None:
    """shuffle='no' once shuffled, drop_last=None dropped nothing, a dict's keys 'a' and 'b'
    were drawn as indices 0 and 1, a str was an 8-sample dataset."""
    for name in ("shuffle", "drop_last", "verify"):
        with pytest.raises(TypeError, match=rf"^{name}: must be True or False, got 'no'"):
            BalancedSampler(range(8), [8], 0, **{name: "no"})  # type: ignore[arg-type]
    for dataset in ({"a": 1, "b": 2}, "abcdefgh", b"ab"):
        with pytest.raises(TypeError, match=r"^dataset: must be a map-style dataset"):
            BalancedSampler(dataset, [2], 0, verify=False)
    assert sorted(BalancedSampler({0: "x", 1: "y"}, [2], 0, verify=False)) == [0, 1]
    assert sorted(BalancedSampler(range(8), [8], 0, shuffle=False, verify=False)) == list(range(8))
    with pytest.raises(TypeError, match=r"^reached: must be True or False, got 'abc'"):
        BatchCounter(mlp(), reached="abc")  # type: ignore[arg-type]


def test_checkpoints_and_hooks_name_what_torch_left_unchecked(one_rank: None) -> None:
    """A complex checkpoint once loaded into a real model (its imaginary part dropped); DCP's
    flags took any value; the weighted hook given no bucket raised AttributeError; an
    optimizer's param group without params raised KeyError; max_norm past float's range
    raised OverflowError and np.float32 was refused."""
    model = filter_parallel(mlp(), speeds=[1.0])
    full = gather_state_dict(model)
    for dtype in (torch.complex64, torch.bool, torch.int64):
        bad = {k: v.to(dtype) for k, v in full.items()}
        with pytest.raises(ValueError, match=r"^state_dict: '0.weight' is torch\."):
            load_full_state_dict(model, bad)
    load_full_state_dict(model, {k: v.double() for k, v in full.items()})  # as torch loads it
    assert all(torch.equal(v, full[k]) for k, v in gather_state_dict(model).items())
    for flags in ({"flatten_state_dict": "no"}, {"dedup_save_to_lowest_rank": []}):
        with pytest.raises(TypeError, match=rf"^{next(iter(flags))}: must be True or False"):
            ReplicaSavePlanner(**flags)
    ReplicaSavePlanner(False, dedup_save_to_lowest_rank=True)
    with pytest.raises(TypeError, match=r"^bucket: must be a torch.distributed.GradBucket"):
        weighted_allreduce_hook(WeightedAllreduceState(local_batch=3), None)  # type: ignore[arg-type]
    opt = DistributedOptimizer(torch.optim.SGD(mlp().parameters(), lr=0.1), local_batch=3)
    with pytest.raises(ValueError, match=r"^param_group: must be a dict with 'params'"):
        opt.add_param_group({"lr": 1})
    net = mlp()
    net(torch.randn(3, 4)).sum().backward()
    before = torch.cat([p.grad.flatten() for p in net.parameters()])  # type: ignore[union-attr]
    clip_grad_norm_(net.parameters(), 10**400)  # no limit, as inf
    clip_grad_norm_(net.parameters(), np.float32(1e6))
    after = torch.cat([p.grad.flatten() for p in net.parameters()])  # type: ignore[union-attr]
    assert torch.equal(before, after)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=r"^max_norm: must be a number >= 0"):
            clip_grad_norm_(net.parameters(), -1.0)


def test_expert_and_rebalancer_helpers_name_values_they_cannot_use() -> None:
    """is_rank_local(None) once answered False; a threshold past float's range raised
    OverflowError."""
    from hetcoll.torch import Rebalancer, is_rank_local

    with pytest.raises(TypeError, match=r"^p: must be a tensor"):
        is_rank_local(None)  # type: ignore[arg-type]
    assert not is_rank_local(nn.Parameter(torch.zeros(1)))
    sampler = BalancedSampler(range(64), [4, 4], 0, verify=False)
    for threshold in (10**400, math.inf, -0.1, True):
        with pytest.raises(ValueError, match=r"^threshold: must be a finite number >= 0"):
            Rebalancer(sampler, threshold=threshold, group=None)
    assert Rebalancer(sampler, threshold=np.float32(0.1)).threshold == pytest.approx(0.1)
