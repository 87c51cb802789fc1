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

from collections.abc import Mapping
from typing import Any

import torch

from hetcoll.comm import Communicator, agree, wrap_or_raise
from hetcoll.torch.batches import LocalCount, checked_count, item_weights
from hetcoll.torch.step_timer import StepTimer


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
    # Checked but not raised: a bad count rides in the exchange and every rank raises it.
    mine = checked_count(count, "count: must be an integer >= 0 (what the loss averages over)")
    comm = wrap_or_raise(group, loss_failure(loss) or mine.failure)
    return weighed(loss, comm, mine, "count")


def weighed(
    loss: torch.Tensor,
    comm: Communicator,
    mine: LocalCount,
    argument: str,
    fields: Mapping[str, int] | None = None,
) -> torch.Tensor:
    """``loss * R * n_r / N`` after one exchange of the ranks' counts (``mine``: this rank's,
    checked but not raised; ``fields``: what the ranks must agree on besides, as
    :func:`hetcoll.comm.agree` takes them): every rank raises the first rank's bad count,
    naming ``argument`` (:func:`item_weights`, the rule); a bad ``loss`` (:func:`loss_failure`)
    raises on its rank and :class:`~hetcoll.CollectiveMismatchError` on the others."""
    with StepTimer.waiting():  # a wait for the other ranks inside the step, not its compute
        counts = agree(comm, fields or {}, values=mine.exchanged, failure=loss_failure(loss))
    return scaled(loss, comm.size, float(item_weights(counts, argument, mine.failure)[comm.rank]))


def scaled(loss: torch.Tensor, ranks: int, weight: float) -> torch.Tensor:
    """``loss`` times ``R n_r / N`` (``weight``: ``n_r / N``, of ``ranks`` ranks): what an engine
    that divides the ranks' summed gradients by their number needs to give their weighted
    mean."""
    return loss * (ranks * weight)


def loss_failure(loss: object) -> BaseException | None:
    """What is wrong with ``loss`` to be weighed, or None: it must be a real floating-point
    tensor of one element, the mean its backward starts from (a per-row or a complex loss
    would raise in that backward on its rank alone, while the other ranks waited in the
    engine's exchange)."""
    if not isinstance(loss, torch.Tensor):
        return TypeError(f"loss: must be a tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        return ValueError(
            f"loss: must be one number (a mean), got shape {tuple(loss.shape)}; reduce it first"
        )
    if not loss.is_floating_point():
        return TypeError(f"loss: must be a real floating-point tensor, got {loss.dtype}")
    return None
