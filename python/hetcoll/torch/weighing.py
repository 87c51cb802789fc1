"""Exact sample- or token-weighted gradients under any engine that averages the ranks'
gradients: :func:`weigh_loss`.

FSDP (``torch.distributed.fsdp.fully_shard``), ``replicate``, DeepSpeed and Horovod each sum
the ranks' gradients and divide by the number of ranks: the full batch's gradient only when
every rank's loss averages over as many samples (or valid tokens) as every other's. With
uneven shares it is not, and these engines take no hook that could weigh the ranks (DDP does:
:func:`hetcoll.torch.register_weighted_hook`; MPI: :class:`hetcoll.torch.DistributedOptimizer`).
The weighting then rides on the loss: rank ``r``'s loss, a mean over its ``n_r``, times
``R n_r / N`` (:func:`hetcoll.torch.item_weights`, the rule), and the engine's plain mean is
``sum_r n_r g_r / N``, the gradient of the mean over all ``N`` of the global batch.
"""

from __future__ import annotations

from typing import Any

import torch

from hetcoll.comm import agree, wrap_or_raise
from hetcoll.torch.batches import checked_count, item_weights


def weigh_loss(loss: torch.Tensor, count: Any, group: Any = None) -> torch.Tensor:
    """``loss`` weighed so that an engine averaging the ranks' gradients (FSDP's
    ``fully_shard``, ``replicate``, DeepSpeed) computes the gradient of the whole global batch's
    mean, whatever the ranks' shares: returns ``loss * R * n_r / N``, where ``R`` is the
    number of ranks, ``n_r = count`` this rank's and ``N`` every rank's counts summed.

    ``loss``: this rank's loss, one number, the mean over its own ``count`` (PyTorch's default
    reduction). ``count``: what that mean is over, an integer >= 0 (a Python or numpy integer
    or an integer tensor of one element): the rows, ``len(x)``, or a language model's valid
    targets, ``(y[:, 1:] != -100).sum()`` where the loss shifts its labels. A rank counting
    0 is legal and weighs 0, but its loss's gradient must still be finite (the engine sums it
    with the others'): torch's cross-entropy over no valid label gives zeros, where a mean of
    one's own, ``(l * mask).sum() / mask.sum()``, gives NaN on every rank (divide by
    ``mask.sum().clamp_min(1)``). ``group``: the ranks averaging (None: :func:`hetcoll.comm.wrap`'s
    default, torch's default group).

    Collective: every rank calls it once per forward, before the backward (one small
    allgather of the counts; a rank that skips a call, or makes one more, pairs its counts with
    another step's, as any collective called unequally does). A bad count on any rank
    (negative, not an integer, a bool; 0 on every rank) raises ``ValueError`` naming
    ``count`` on every rank, and a bad ``loss`` (not one floating-point number) raises there
    and :class:`~hetcoll.CollectiveMismatchError` on the others. Under gradient accumulation,
    each micro-batch is weighed by its own global count: the step sums the micro-batches'
    means over the ranks, as one process accumulating their means does (divide each by their
    number for the mean of means).

    >>> model = fully_shard(model)  # doctest: +SKIP
    >>> for x, y in loader:  # over a BalancedSampler's uneven shares
    ...     loss = weigh_loss(loss_fn(model(x), y), len(x))  # doctest: +SKIP
    ...     loss.backward(); opt.step(); opt.zero_grad()  # doctest: +SKIP
    """
    bad_loss = _loss_failure(loss)
    # Checked but not raised: a bad count rides in the exchange and every rank raises it.
    mine = checked_count(count, f"count: must be an integer >= 0, got {count!r}")
    comm = wrap_or_raise(group, bad_loss or mine.failure)
    counts = agree(comm, {}, values=mine.exchanged, failure=bad_loss)
    weight = float(item_weights(counts, "count", mine.failure)[comm.rank])
    return loss * (comm.size * weight)


def _loss_failure(loss: object) -> BaseException | None:
    """What is wrong with ``loss`` (told to every rank), or None: a floating-point tensor of
    one element, the mean its backward starts from (a per-row loss would raise in that
    backward on this rank alone, and the other ranks wait in the engine's exchange)."""
    if not isinstance(loss, torch.Tensor):
        return TypeError(f"loss: must be a tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        return ValueError(
            f"loss: must be one number (the mean over count), got shape {tuple(loss.shape)}; "
            "reduce it first"
        )
    if not (loss.is_floating_point() or loss.is_complex()):
        return TypeError(f"loss: must be a floating-point tensor, got {loss.dtype}")
    return None
