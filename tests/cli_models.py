"""Models the command-line tests name as ``tests.cli_models:ATTR`` (``hetcoll --model``): what
``module:attr`` may load, and what it must refuse without calling it."""

from __future__ import annotations

from torch import Tensor, nn


class Recurrent(nn.Module):
    """An LSTM over the rows of a sample: nothing in it that filter parallelism splits."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        y, _ = self.lstm(x)
        return y.mean(dim=1)


def make_net() -> nn.Module:
    """A builder annotated to return a module: loaded."""
    return nn.Sequential(nn.Flatten(), nn.Linear(32, 4))


def make_sequential() -> nn.Sequential:
    """Annotated with an nn.Module subclass: loaded."""
    return nn.Sequential(nn.Flatten(), nn.Linear(32, 4))


CALLS: list[str] = []


def untyped():  # type: ignore[no-untyped-def]
    """No return annotation: refused, never called."""
    CALLS.append("untyped")
    return make_net()


def needs_width(width: int) -> nn.Module:
    """Annotated, but cannot be called without arguments: refused."""
    CALLS.append("needs_width")
    return nn.Linear(width, 4)


class NotAModel:
    """A class, not an nn.Module: refused, never constructed."""

    def __init__(self) -> None:
        CALLS.append("NotAModel")


INSTANCE = nn.Sequential(nn.Flatten(), nn.Linear(32, 4))


class OutOfOrder(nn.Module):
    """Blocks registered out of the order its forward calls them (its ``layers`` before the
    ``embed`` that feeds them, as MBart's ``layernorm_embedding`` comes after its layers), with
    no example inputs of its own to tell the call order: no plan can cut it, but one of
    whole-model replicas needs no cut."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.embed = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = h + layer(h)
        return h


def out_of_order() -> nn.Module:
    return OutOfOrder()


class WantsTargets(nn.Module):
    """A model that checks its inputs itself, as torchvision's detection models assert
    targets in training."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: Tensor, targets: object = None) -> Tensor:
        assert targets is not None, "targets should not be none when in training mode"
        return self.conv(x)
