"""A model as a chain of layers: what a Plan's ``layers`` ranges count.

An ``nn.Sequential`` is the chain of its children. Any other model is traced (``torch.fx``, with
its top-level children kept whole) and its graph must then be a chain: each top-level call reads
the previous one's output and constants only. torchvision's ResNet, for instance, becomes
``conv1, bn1, relu, maxpool, layer1 .. layer4, avgpool, flatten, fc`` — the ``torch.flatten``
its forward calls is a layer of its own. Tracing keeps the model's own modules, so their
parameter names (and the state dict's keys) stay the original ones.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

__all__ = ["Call", "model_layers"]


class _Input:
    """Stands for the previous layer's output in a :class:`Call`'s arguments."""

    def __repr__(self) -> str:
        return "<input>"

    def __deepcopy__(self, memo: dict[int, Any]) -> _Input:
        return self  # one marker: copies of a Call (made for every stage) keep finding it

    def __reduce__(self) -> str:
        return "_INPUT"


_INPUT = _Input()


class Call(nn.Module):
    """A function or method call of a traced forward as a layer: ``target(input, *args)`` with
    the previous layer's output in the place the graph had it."""

    def __init__(
        self, target: Callable[..., Any] | str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ):
        super().__init__()
        self.target = target
        self.args = args
        self.kwargs = kwargs

    def forward(self, x: torch.Tensor) -> Any:
        args = [x if a is _INPUT else a for a in self.args]
        kwargs = {k: x if v is _INPUT else v for k, v in self.kwargs.items()}
        if isinstance(self.target, str):
            obj, *rest = args
            return getattr(obj, self.target)(*rest, **kwargs)
        return self.target(*args, **kwargs)

    def extra_repr(self) -> str:
        name = self.target if isinstance(self.target, str) else getattr(self.target, "__name__", "")
        return f"{name}{self.args}" if not self.kwargs else f"{name}{self.args} {self.kwargs}"


class _TopLevel(fx.Tracer):
    """Keeps every direct child of the traced module whole (one call node each)."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return "." not in qualname


def _is_plain_sequential(m: nn.Module) -> bool:
    return isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward


def model_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers of ``model`` in the order they run, as ``(name, module)``: a Plan's
    ``layers`` ranges index this list. Names are the model's own child names (calls traced out
    of a forward get their graph node's name). The modules are the model's own, not copies.

    >>> [n for n, _ in model_layers(nn.Sequential(nn.Linear(4, 3), nn.ReLU()))]
    ['0', '1']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: must be a torch.nn.Module, got {type(model).__name__}")
    if _is_plain_sequential(model):
        chain = list(model.named_children())
        if not chain:
            raise ValueError("model: an empty nn.Sequential has no layers")
        return chain
    try:
        graph = _TopLevel().trace(model)
    except Exception as e:  # any tracing failure gets the same advice
        raise ValueError(
            f"model: {type(model).__name__} could not be traced into a chain of layers "
            f"({type(e).__name__}: {e}); give an nn.Sequential of its parts instead"
        ) from None
    children = dict(model.named_children())
    layers: list[tuple[str, nn.Module]] = []
    prev: fx.Node | None = None
    for node in graph.nodes:
        if node.op == "placeholder":
            if prev is not None:
                raise ValueError(
                    f"model: {type(model).__name__}.forward takes more than one input; a plan "
                    "runs models of one tensor input"
                )
            prev = node
            continue
        if node.op == "output":
            if node.args[0] is not prev:
                raise ValueError(
                    f"model: {type(model).__name__}'s output is not its last call's result"
                )
            break
        where = f"model: {type(model).__name__}'s call {node.name!r} ({node.op} {node.target})"
        if node.op == "get_attr":
            raise ValueError(
                f"{where} reads a parameter or buffer outside a child module, so the model is "
                "not a chain of layers; give an nn.Sequential of its parts instead"
            )
        if node.op == "call_function" and node.target is operator.getitem:
            raise ValueError(f"{where} indexes a result: stage boundaries must carry one tensor")
        used = [n for n in node.all_input_nodes]
        if used != [prev]:
            names = ", ".join(n.name for n in used) or "nothing"
            raise ValueError(
                f"{where} reads {names}, not just the previous call's output, so the model is "
                "not a chain of layers (a residual or branch at the top level); give an "
                "nn.Sequential of its parts instead"
            )
        if node.op == "call_module":
            if node.args != (prev,) or node.kwargs:
                raise ValueError(f"{where} passes more than the previous output to a child")
            layers.append((str(node.target), children[str(node.target)]))
        else:
            args = tuple(_INPUT if a is prev else a for a in node.args)
            kwargs = {k: _INPUT if v is prev else v for k, v in node.kwargs.items()}
            if any(isinstance(a, fx.Node) for a in (*args, *kwargs.values())):
                raise ValueError(f"{where} nests the previous output inside an argument")
            target: Callable[..., Any] | str = node.target  # type: ignore[assignment]
            layers.append((node.name, Call(target, args, kwargs)))
        prev = node
    if not layers:
        raise ValueError(f"model: {type(model).__name__} has no layers")
    return layers
