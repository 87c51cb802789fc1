"""Each step's local batch, read off the forward pass.

Sample-weighted averaging needs every rank's number of samples in the step. Setting it by hand
(``state.local_batch = len(x)``) is easy to forget, and forgetting it gives wrong gradients
without a word whenever shares are uneven or change. :class:`BatchCounter` instead counts the
samples of every forward that records a graph (grad enabled) since the last gradient exchange —
the samples whose gradients that exchange carries, gradient accumulation included. The DDP hook
(:func:`hetcoll.torch.register_weighted_hook`) and the MPI optimizer
(``DistributedOptimizer(..., model=model)``) use it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in a forward's arguments, in order, through tuples, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


class BatchCounter:
    """Counts the samples of ``module``'s forwards since the last :meth:`take`.

    A forward's batch size is dimension ``batch_dim`` of the first tensor among its arguments
    (positional first, then keyword; through tuples, lists and dicts), the convention of
    PyTorch's DataLoader and DDP. Forwards run with gradients disabled (evaluation) are not
    counted: no gradient comes of them.
    """

    def __init__(self, module: nn.Module, *, batch_dim: int = 0) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module: must be a torch.nn.Module, got {type(module).__name__}")
        if isinstance(batch_dim, bool) or not isinstance(batch_dim, int) or batch_dim < 0:
            raise ValueError(f"batch_dim: must be an integer >= 0, got {batch_dim!r}")
        self.batch_dim = batch_dim
        self._count = 0
        self._forwards = 0
        self._handle = module.register_forward_pre_hook(self._see, with_kwargs=True)

    def _see(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled():
            return
        for t in _tensors((args, kwargs)):
            if t.dim() > self.batch_dim:
                self._count += int(t.shape[self.batch_dim])
                self._forwards += 1
                return
        raise TypeError(
            f"module: cannot count this forward's samples: no tensor argument has dimension "
            f"{self.batch_dim} (batch_dim); set the local batch yourself instead"
        )

    @property
    def pending(self) -> int:
        """Samples counted since the last :meth:`take`."""
        return self._count

    def take(self) -> int:
        """The samples counted since the last call, and start counting again. Raises
        ``RuntimeError`` when no training forward ran in between (the exchange would weigh this
        rank's gradient by a stale count)."""
        if self._forwards == 0:
            raise RuntimeError(
                "local_batch: the module ran no forward with gradients enabled since the last "
                "gradient exchange, so this step's samples are unknown; run the forward through "
                "the module the counter watches (the DDP model, or the model given to "
                "DistributedOptimizer), or set local_batch yourself"
            )
        n = self._count
        self._count = 0
        self._forwards = 0
        return n

    def remove(self) -> None:
        """Stop counting (removes the forward pre-hook)."""
        self._handle.remove()
