"""Emulated heterogeneity: the delay a slow rank sleeps is the cost model's, split between the
forward and the backward the way the layers spend real time, and it survives a deepcopy (which
measure_speed makes); slow_down sleeps each layer's own time, and on a filter-parallel model
only around the split layers' local computation. The sleeps are recorded, not timed."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hetcoll import launch
from hetcoll.lab.emulate import (
    EmulatedSpeed,
    SlowDown,
    delay_points,
    slow_down,
    slow_down_filter_parallel,
)
from hetcoll.torch import SpeedFit, filter_parallel
from hetcoll.torch.filters import FilterParallelDoRA, FilterParallelLayer, LocalLinear


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 16, 4)
    )


def _recording(model: EmulatedSpeed, log: list[tuple[str, float]], phase: list[str]):
    def sleep(seconds: float) -> None:
        log.append((phase[0], seconds))

    model.slowdown.sleep = sleep  # type: ignore[method-assign]


@pytest.mark.parametrize("copied", [False, True])
def test_delay_is_the_cost_models_split_between_forward_and_backward(copied):
    cost = SpeedFit(latency_s=0.002, samples_per_s=1000.0)
    model = EmulatedSpeed(_net(), 0.25, cost=cost, backward_ratio=2.0)
    if copied:
        model = copy.deepcopy(model)
    log: list[tuple[str, float]] = []
    phase = ["forward"]
    _recording(model, log, phase)
    x = torch.randn(10, 1, 4, 4)
    for _ in range(3):  # the layer weights settle; the totals must hold every time
        log.clear()
        phase[0] = "forward"
        out = model(x)
        phase[0] = "backward"
        out.sum().backward()
        total = (1 / 0.25 - 1) * cost.predict(10)
        forward = sum(s for p, s in log if p == "forward")
        backward = sum(s for p, s in log if p == "backward")
        assert forward == pytest.approx(total / 3)
        assert backward == pytest.approx(2 * total / 3)
        # One forward and one backward sleep per layer with parameters (conv and linear).
        assert len(log) == 4


def test_no_grad_forward_sleeps_only_the_forward_part():
    cost = SpeedFit(latency_s=0.0, samples_per_s=500.0)
    model = EmulatedSpeed(_net(), 0.5, cost=cost)
    log: list[tuple[str, float]] = []
    _recording(model, log, ["forward"])
    with torch.no_grad():
        model(torch.randn(5, 1, 4, 4))
    assert sum(s for _, s in log) == pytest.approx((1 / 0.5 - 1) * cost.predict(5) / 3)


def test_full_speed_never_sleeps_and_bad_input_names_the_argument():
    model = EmulatedSpeed(_net(), 1.0, cost=SpeedFit(0.0, 100.0))
    log: list[tuple[str, float]] = []
    _recording(model, log, ["forward"])
    model(torch.randn(2, 1, 4, 4)).sum().backward()
    assert log == []
    with pytest.raises(ValueError, match="speed"):
        EmulatedSpeed(_net(), 0.0)
    with pytest.raises(ValueError, match="backward_ratio"):
        EmulatedSpeed(_net(), 0.5, backward_ratio=-1)
    with pytest.raises(TypeError, match="cost"):
        EmulatedSpeed(_net(), 0.5, cost=3.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="module"):
        EmulatedSpeed("net", 0.5)  # type: ignore[arg-type]


def testdelay_points_are_the_layers_with_parameters():
    net = _net()
    assert delay_points(net) == [net[0], net[3]]
    relu = nn.ReLU()
    assert delay_points(relu) == [relu]


# -- slow_down: each layer's own time, forward and backward ---------------------------------------


def _record(handle: SlowDown) -> list[float]:
    log: list[float] = []
    handle.sleep = log.append  # type: ignore[method-assign]
    return log


def test_slow_down_sleeps_each_layers_own_forward_then_backward():
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    handle = slow_down(net, 0.25)
    assert handle.layers == [net[0], net[2]]
    log = _record(handle)
    net(torch.randn(5, 8, requires_grad=True)).sum().backward()
    # Forward: layer 0 then 2, each 3x its own forward; backward: 2 then 0.
    assert log[:2] == [3 * handle.forward_seconds[0], 3 * handle.forward_seconds[1]]
    assert len(log) == 4 and all(s > 0 for s in log)
    # An input that needs no gradient: torch cannot time the first layer's backward.
    with pytest.warns(UserWarning, match="no inputs require gradients"):
        net(torch.randn(5, 8)).sum().backward()
    assert len(log) == 7
    with torch.no_grad():
        net(torch.randn(5, 8))
    assert len(log) == 9  # forward only
    handle.remove()
    net(torch.randn(5, 8, requires_grad=True)).sum().backward()
    assert len(log) == 9
    assert slow_down([net[0]], 1.0).layers == [net[0]]  # full speed: nothing to hook
    with pytest.raises(ValueError, match="speed"):
        slow_down(net, 1.5)
    with pytest.raises(TypeError, match="model_or_layers"):
        slow_down("net", 0.5)  # type: ignore[arg-type]


def test_a_local_computations_backward_sleep_comes_before_its_weight_gradient():
    # The split layers compute through a child taking the weight as an input, so the full
    # backward hook fires after the local backward and before the weight's gradient is used.
    local = LocalLinear()
    w = nn.Parameter(torch.randn(3, 4))
    handle = slow_down([local], 0.5)
    order: list[str] = []
    handle.sleep = lambda s: order.append("sleep")  # type: ignore[method-assign]
    w.register_post_accumulate_grad_hook(lambda p: order.append("weight gradient"))
    local(torch.randn(2, 4), w, None).sum().backward()
    assert order == ["sleep", "sleep", "weight gradient"]


def _filter_rank(rank: int, world: int) -> dict[str, object]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 8))
    model = filter_parallel(net, [1.0, 1.0], None)
    handle = slow_down_filter_parallel(model, 0.25)
    log = _record(handle)
    model(torch.randn(4, 16)).sum().backward()
    split = [m for m in model.modules() if isinstance(m, FilterParallelLayer)]
    return {
        "hooked_local": handle.layers == [m.local for m in split],
        "forward": log[:2] == [3 * s for s in handle.forward_seconds],
        "sleeps": len(log),
        "dora": _dora_delay_points(),
    }


def _dora_delay_points() -> list[str]:
    """The delay points of a split DoRA model (PEFT's adapters on an MLP): its split layers'
    local computations, not its magnitudes' DoRA layers (whose forward sums a weight norm
    over the ranks: timed, a slow rank slept its wait for the others)."""
    import warnings

    from peft import LoraConfig, get_peft_model

    class Mlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(torch.relu(self.up(x)))

    config = LoraConfig(r=2, target_modules=["up", "down"], use_dora=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the layers PEFT's wrappers hold, named
        model = filter_parallel(get_peft_model(Mlp(), config), [1.0, 1.0], None)
    assert any(isinstance(m, FilterParallelDoRA) for m in model.modules())
    return sorted({type(m).__name__ for m in delay_points(model)})


@pytest.mark.multiproc
def test_slow_down_filter_parallel_hooks_the_split_layers_local_computation_only():
    # Not the split BatchNorm, not the collectives: two sleeps per split layer. A DoRA model's
    # split layers and whole adapters, not its DoRA layers.
    dora = ["Linear", "LocalLinear"]
    expected = {"hooked_local": True, "forward": True, "sleeps": 4, "dora": dora}
    assert launch.spawn(_filter_rank, 2, timeout=120) == [expected] * 2


def test_slow_down_times_no_backward_it_cannot_end_when_forwards_run_ahead():
    # GPipe order: every micro-batch's forward, then every backward. The first layer's input
    # needs no gradient, so torch cannot end its backward from outside; a start left over from
    # one micro-batch must not time the next one's whole backward.
    import warnings

    from hetcoll.lab.emulate import slow_down

    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    handle = slow_down(net, 0.5)
    timed: list[int] = []
    original = handle.backward_delay
    handle.backward_delay = lambda i, s: (timed.append(i), original(i, s))[1]  # type: ignore[method-assign]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note that the first layer's hook fires early
        losses = [net(torch.randn(3, 4)).sum() for _ in range(3)]
        for loss in losses:
            loss.backward()
    assert timed == [1, 1, 1]  # the second Linear, once a micro-batch; never the first
