"""Tensors a stage's autograd graph starts from: another stage's output received as this
stage's input, or zeros standing in for a block's output while a forward is probed.

The usual way, ``received.requires_grad_()``, makes the tensor a leaf of autograd, and torch
refuses an in-place op on a leaf that requires a gradient. A stage whose first op works in
place (``nn.ReLU(inplace=True)`` after a cut, as torchvision's VGG, ResNet and DenseNet have
everywhere; ``F.relu(x, inplace=True)`` in a parent's forward) then fails. A copy would do,
at the price of one more activation per micro-batch held until the backward. Instead,
:class:`StageInput` passes the received tensor through an identity autograd function that
marks it as written: the very same tensor comes out as a non-leaf, which in-place ops may
modify, and the function's backward keeps the gradient that reaches it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["StageInput"]


class _Inbound(torch.autograd.Function):
    """``buf`` itself, now the output of this function (``mark_dirty``); its backward appends
    the gradient to ``sink``. ``anchor`` requires a gradient so that autograd records the
    call; it gets none."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, anchor: torch.Tensor, buf: torch.Tensor, sink: list[torch.Tensor]
    ) -> torch.Tensor:
        ctx.sink = sink
        ctx.mark_dirty(buf)
        return buf

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:  # type: ignore[override]
        ctx.sink.append(grad)
        return None, None, None


class StageInput:
    """``received`` as an input of this stage's autograd graph: :attr:`tensor` is
    ``received`` itself (no copy), not a leaf, so the stage may modify it in place, and
    :meth:`grad` is the gradient the stage's backward gave it.

    With ``requires_grad`` false, or for a tensor that cannot have a gradient (integer token
    ids, masks), :attr:`tensor` is ``received`` as it is and has no gradient. Outside grad
    mode (``torch.no_grad``) likewise."""

    __slots__ = ("_sink", "tensor")

    def __init__(self, received: torch.Tensor, requires_grad: bool = True) -> None:
        self._sink: list[torch.Tensor] = []
        self.tensor = received
        if (
            requires_grad
            and torch.is_grad_enabled()
            and (received.is_floating_point() or received.is_complex())
        ):
            anchor = torch.empty(0, device=received.device, requires_grad=True)
            buf = received.detach() if received.requires_grad else received
            self.tensor = _Inbound.apply(anchor, buf, self._sink)

    @property
    def requires_grad(self) -> bool:
        return self.tensor.requires_grad

    def grad(self) -> torch.Tensor:
        """The gradient the backward left for :attr:`tensor`; zeros of its shape where the
        stage's output does not depend on it (or before the backward)."""
        if not self._sink:
            return torch.zeros_like(self.tensor)
        return sum(self._sink[1:], self._sink[0])
