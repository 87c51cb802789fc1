"""Hugging Face Accelerate and Trainer integration (needs ``accelerate``; ``BalancedTrainer``
also ``transformers``): uneven, speed-proportional per-rank batches with exact token-weighted
gradients.

- :func:`prepare_balanced`: an Accelerate job's training loader where each rank takes its share
  (given, from relative speeds or from measured ones) of every global batch, placed on the
  device by Accelerate without its re-sharding; :class:`BalancedLoader` shows the shares and
  speeds in Accelerate's ``tqdm`` (:meth:`BalancedLoader.progress`) and logs.
- :func:`optimizer_steps` groups a loader's micro-batches by optimizer step, and
  :func:`step_items` counts one optimizer step's items (valid tokens) counted on every rank and
  exchanged, so that the step's loss weighs each micro-batch by its tokens over all the ranks'
  (hetcoll's rule, :func:`hetcoll.torch.item_weights`), gradient accumulation included.
- :func:`whole_checkpoints`: ``accelerator.save_state`` / ``load_state`` of a model split over
  the ranks (placed experts, split layers) write and read the unsplit model and optimizer
  state, which resume into any placement; ``get_state_dict`` and ``save_model`` give the
  unsplit model.
- :class:`BalancedTrainer`: ``transformers.Trainer`` with the balanced loader (Trainer's own
  token averaging across devices weighs the gradients) and the shares and speeds in its logs.
"""

from typing import TYPE_CHECKING, Any

from hetcoll.accelerate.checkpoints import WholeCheckpoints, whole_checkpoints
from hetcoll.accelerate.data import (
    BalancedLoader,
    balanced_shares,
    measure_model_speed,
    prepare_balanced,
)
from hetcoll.accelerate.weighting import (
    StepItems,
    causal_lm_items,
    label_items,
    optimizer_steps,
    step_items,
)

if TYPE_CHECKING:  # loaded on use (below); typed for the checker
    from hetcoll.accelerate.trainer import BalancedTrainer

__all__ = [
    "BalancedLoader",
    "BalancedTrainer",
    "StepItems",
    "WholeCheckpoints",
    "balanced_shares",
    "causal_lm_items",
    "label_items",
    "measure_model_speed",
    "optimizer_steps",
    "prepare_balanced",
    "step_items",
    "whole_checkpoints",
]


def __getattr__(name: str) -> Any:
    # BalancedTrainer needs transformers, which an Accelerate job may not have: loaded on use.
    if name == "BalancedTrainer":
        from hetcoll.accelerate.trainer import BalancedTrainer

        return BalancedTrainer
    raise AttributeError(f"module 'hetcoll.accelerate' has no attribute {name!r}")
