"""The loss a step's costs end with (``layer_costs(..., loss=...)``): a function of the model's
output to one number, counted like any layer (its ops on the meta device, forward and backward)
as the last costed layer, :data:`~hetcoll.model.costs.records.LOSS_LAYER`.

A language model's cross-entropy is a softmax over every token's vocabulary: at a vocabulary of
thousands it moves more bytes than the decoder blocks, so a prediction without it is low by as
much (the LM head's logits are written, read by the log-softmax, its gradient written back).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from hetcoll.model.costs.records import LOSSES


def output_logits(output: object) -> torch.Tensor:
    """The tensor a loss reads from a model's output: a Hugging Face ``ModelOutput``'s
    ``logits``, the output itself when it is a tensor, else the first floating tensor in it.

    >>> output_logits((torch.zeros(2, 3), torch.ones(1))).shape
    torch.Size([2, 3])
    """
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, torch.Tensor):
        return output
    for t in tree_flatten(output)[0]:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t
    raise ValueError(f"loss: the model's output ({type(output).__name__}) holds no float tensor")


def cross_entropy(output: object) -> torch.Tensor:
    """``F.cross_entropy`` of the model's logits (:func:`output_logits`; classes last: a
    classifier's ``(batch, classes)``, a language model's ``(batch, tokens, vocabulary)``)
    against class 0 for every row: what a step's loss costs, whatever its labels.

    >>> float(cross_entropy(torch.zeros(4, 2)))  # log 2
    0.6931471824645996
    """
    logits = output_logits(output)
    if logits.dim() < 2:
        raise ValueError(
            f"loss: 'cross-entropy' needs logits with classes last, got shape {tuple(logits.shape)}"
        )
    rows = logits.reshape(-1, logits.shape[-1])
    target = torch.zeros(rows.shape[0], dtype=torch.long, device=rows.device)
    return torch.nn.functional.cross_entropy(rows, target)


def resolve_loss(loss: object) -> tuple[str, Callable[[Any], torch.Tensor] | None]:
    """``loss`` as (its name, the function): ``None`` (no loss costed), a name of
    :data:`LOSSES`, or a callable taking the model's output and returning the batch's loss.

    >>> resolve_loss("cross-entropy")[0], resolve_loss(None)
    ('cross-entropy', ('', None))
    """
    if loss is None:
        return "", None
    if isinstance(loss, str):
        if loss == "cross-entropy":
            return loss, cross_entropy
        raise ValueError(f"loss: expected None, one of {LOSSES} or a callable, got {loss!r}")
    if callable(loss):
        name = getattr(loss, "__qualname__", None) or type(loss).__name__
        return str(name), loss
    raise TypeError(
        f"loss: expected None, one of {LOSSES} or a callable, got {type(loss).__name__}"
    )
