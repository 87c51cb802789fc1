"""Each optimizer step weighed by its items (valid tokens), across ranks and accumulated
micro-batches: the gradient of the mean over every item of the global step.

A language model's loss is a mean over its valid tokens (labels padded with -100). With uneven
per-rank batches (and even with even ones: padding differs) the ranks hold different numbers of
tokens, and DDP's averaging of per-rank means is not the mean over all tokens. hetcoll's rule
(:func:`hetcoll.torch.item_weights`) weighs rank ``r`` by ``n_r / N``, ``N = sum_r n_r``
(:func:`hetcoll.torch.item_total`). Under Accelerate the weighting rides on the loss, which also
covers gradient accumulation: :func:`step_items` counts this rank's items in each micro-batch of
the step, exchanges the ranks' counts once (one small allgather, checked: a bad count raises
``ValueError`` naming ``items`` on every rank) and returns ``N``. Then either

- the model sums over its items and divides by ``N`` itself (Hugging Face models take
  ``num_items_in_batch``): ``loss = model(**batch, num_items_in_batch=step.num_items).loss``; or
- the loss is the micro-batch's mean over its own items: ``loss = step.scale(mean_loss, i)``
  multiplies it by ``n_{r,i} / N`` (a micro-batch with no item must then not be NaN: prefer the
  first form, whose sum over nothing is 0);

and ``accelerator.backward(loss * step.loss_scale)``: ``loss_scale`` is the number of processes
(DDP divides the summed gradients by it) times the accelerator's gradient accumulation steps
(``accelerator.backward`` divides by them). Every micro-batch then contributes the sum of its
items' gradients divided by ``N``: over the step, exactly the gradient of the mean over all ``N``
items, on any shares and any accumulation. This is what Hugging Face's Trainer does with
``average_tokens_across_devices=True`` (which :class:`~hetcoll.accelerate.BalancedTrainer`
requires); here with hetcoll's checks and for loops of your own. (Hugging Face's causal-LM loss
computes in float32 inside, even for a float64 model; there a loss scale that is not a power of
two, 3 processes, rounds at float32's precision. A float64 loss of your own does not.)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator

from hetcoll.accelerate.data import processes
from hetcoll.comm import agree, has_default, wrap
from hetcoll.torch import item_total, item_weights
from hetcoll.torch.batches import Items, LocalCount, count_items, counted, items_argument


def causal_lm_items(batch: Any) -> int:
    """The valid next-token targets of a causal language model's batch: ``labels[..., 1:]`` not
    -100 (the model shifts the labels by one, so no row's first label is a target), what Hugging
    Face's causal-LM loss averages over and Trainer counts."""
    return int((_labels(batch)[..., 1:] != -100).sum())


def label_items(batch: Any) -> int:
    """The labels that are not -100 (models whose loss does not shift the labels)."""
    return int((_labels(batch) != -100).sum())


def _labels(batch: Any) -> torch.Tensor:
    labels = batch.get("labels") if isinstance(batch, dict) else None
    if not isinstance(labels, torch.Tensor):
        raise TypeError("items: the batch has no 'labels' tensor to count")
    return labels


@dataclass(frozen=True)
class StepItems:
    """One optimizer step's items (:func:`step_items`).

    ``num_items``: ``N``, every rank's items over all the step's micro-batches; ``local``: this
    rank's items in each micro-batch; ``counts``: every rank's items in the step, in rank order;
    ``loss_scale``: what to multiply each micro-batch's loss by before ``accelerator.backward``
    (see the module docstring)."""

    num_items: int
    local: tuple[int, ...]
    counts: tuple[int, ...]
    loss_scale: float

    @property
    def weights(self) -> np.ndarray:
        """Every rank's weight ``n_r / N`` in this step (:func:`hetcoll.torch.item_weights`)."""
        rows = np.array([counted(n).exchanged for n in self.counts], np.int64)
        return item_weights(rows)

    def scale(self, loss: torch.Tensor, index: int) -> torch.Tensor:
        """Micro-batch ``index``'s loss, a mean over its own items, weighed to its share of the
        step: ``loss * n_{r,i} / N`` (multiply by :attr:`loss_scale` too before the backward)."""
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"index: must be an integer, got {index!r}")
        if not 0 <= index < len(self.local):
            raise IndexError(f"index: the step has {len(self.local)} micro-batches, got {index}")
        return loss * (self.local[index] / self.num_items)


def optimizer_steps(batches: Iterable[Any], accumulate: int = 1) -> Iterator[list[Any]]:
    """The micro-batches of each optimizer step: ``batches`` (a loader) in groups of
    ``accumulate``, the epoch's last group shorter when the steps do not divide evenly (as
    Trainer accumulates). Every rank's loader has as many batches, so every rank's groups
    match. Run each group with ``accelerator.no_sync(model)`` on all but its last micro-batch
    and ``opt.step()`` after it, not with ``accelerator.accumulate(model)``: that decides when
    to synchronise from the loader's end, which the epoch's last group has reached before its
    first micro-batch runs (every micro-batch of it would synchronise and step)."""
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"accumulate: must be an integer >= 1, got {accumulate!r}")
    try:
        it = iter(batches)
    except TypeError:
        raise TypeError(
            f"batches: must be an iterable (a loader), got {type(batches).__name__}"
        ) from None
    return _groups(it, accumulate)


def _groups(batches: Iterator[Any], accumulate: int) -> Iterator[list[Any]]:
    """:func:`optimizer_steps`' groups, its arguments checked."""
    group: list[Any] = []
    for batch in batches:
        group.append(batch)
        if len(group) == accumulate:
            yield group
            group = []
    if group:
        yield group


def _count_step(items: Items, batches: Sequence[Any]) -> tuple[LocalCount, list[int]]:
    """This rank's count for the step (the first bad micro-batch's, else the sum) and its
    micro-batches' counts."""
    local = []
    for batch in batches:
        mine = count_items(items, batch)
        if mine.failure is not None:
            return mine, []
        local.append(mine.value)
    return counted(sum(local)), local


def step_items(
    accelerator: Accelerator, batches: Sequence[Any], items: Items = causal_lm_items
) -> StepItems:
    """Count one optimizer step's items: ``batches``, the step's micro-batches on this rank
    (one, or the ``gradient accumulation`` many), each counted by ``items(batch)`` (default
    :func:`causal_lm_items`). Collective: every rank calls it once per step, before the step's
    first backward, with as many micro-batches (else :class:`hetcoll.CollectiveMismatchError`
    on every rank). A bad count (``items`` raising or not an integer >= 0; no item on any rank)
    raises ``ValueError`` naming ``items`` on every rank."""
    if not isinstance(accelerator, Accelerator):
        raise TypeError(
            f"accelerator: must be an accelerate.Accelerator, got {type(accelerator).__name__}"
        )
    counter = items_argument(items)
    if counter is None:
        raise TypeError("items: must be a function items(batch) -> int, got None")
    batches = list(batches)
    mine, local = _count_step(counter, batches)
    fields = {"micro-batches in the step": len(batches)}
    if has_default():
        counts = agree(wrap(None), fields, values=mine.exchanged)
    else:  # one process, no process group
        counts = np.array([mine.exchanged], np.int64)
    total = item_total(counts, "items", mine.failure)
    scale = float(processes(accelerator)[0] * accelerator.gradient_accumulation_steps)
    return StepItems(total, tuple(local), tuple(int(n) for n in counts[:, 1]), scale)
