"""Emulated heterogeneity: the delay a slow rank sleeps is the cost model's, split between the
forward and the backward the way the layers spend real time, and it survives a deepcopy (which
measure_speed makes). The sleeps are recorded, not timed."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hetcoll.lab.emulate import EmulatedSpeed, delay_points
from hetcoll.torch import SpeedFit


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 16, 4)
    )


def _recording(model: EmulatedSpeed, log: list[tuple[str, float]], phase: list[str]):
    def sleep(seconds: float) -> None:
        log.append((phase[0], seconds))

    model._sleep = sleep  # type: ignore[method-assign]


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
