"""BalancedTrainer: Hugging Face's ``Trainer`` with uneven, speed-proportional per-rank batches.

What stays Trainer's: the model, the arguments, the optimizer and schedule, gradient
accumulation, logging and checkpoints. What changes is the training loader: the global batch
(``per_device_train_batch_size`` times the number of processes, the batch Trainer would train
on) is split among the ranks by given ``shares``, relative ``speeds`` or speeds measured when
training starts (``measure=True``), and each rank takes its share of every global batch
(:func:`hetcoll.accelerate.prepare_balanced`, so Accelerate does not re-shard it).

The gradients need nothing more. With ``average_tokens_across_devices=True`` (Trainer's default)
Trainer counts every rank's valid tokens over the step's accumulated micro-batches, gathers
their sum ``N`` and has the model divide its summed token losses by ``N``
(``num_items_in_batch``), then multiplies the loss by the number of processes, which DDP's
averaging divides away: each step is the gradient of the mean over all ``N`` tokens of the
global step whatever each rank holds, the weighting ``n_r / N`` of hetcoll's rule
(:func:`hetcoll.torch.item_weights`). That holds only when the model takes ``num_items_in_batch``
(Hugging Face's models do; or a ``compute_loss_func``) and the tokens are averaged across
devices, so :class:`BalancedTrainer` raises naming the argument otherwise: a per-rank mean
averaged by DDP would weigh a rank of 3 rows as much as one of 5. A causal LM's tokens are its
targets, ``labels[..., 1:]``, for GPT-2 too, whose class Trainer does not know as one
(:func:`shifted_targets_uncounted`).
"""

from __future__ import annotations

import inspect
import json
import math
import os
from collections.abc import Sequence
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist
from torch import nn
from transformers import PreTrainedModel, Trainer, TrainerCallback
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINING_ARGS_NAME
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from hetcoll.accelerate.checkpoints import gather_destination
from hetcoll.accelerate.data import (
    BalancedLoader,
    balanced_shares,
    measure_model_speed,
    positive_numbers,
    prepare_balanced,
    processes,
)
from hetcoll.comm import agree, wrap
from hetcoll.torch import (
    ExpertParallelExperts,
    ExpertRebalancer,
    Rebalancer,
    StepTimer,
    clip_grad_norm_,
    gather_optimizer_state_dict,
    gather_speeds,
    gather_state_dict,
    load_full_optimizer_state_dict,
    load_full_state_dict,
)
from hetcoll.torch.batches import loader_rows
from hetcoll.torch.speed import check_share_source, every_argument

#: The file of a checkpoint holding the trainer's :class:`~hetcoll.torch.ExpertRebalancer`
#: state (JSON), beside the optimizer's.
EXPERTS_STATE_NAME = "expert_rebalancer.json"
#: The file of a checkpoint holding the trainer's batch :class:`~hetcoll.torch.Rebalancer`
#: state and the shares it had set (JSON), beside the optimizer's.
REBALANCER_STATE_NAME = "rebalancer.json"


class _WatchExperts(TrainerCallback):
    """After every optimizer step, the trainer's :class:`~hetcoll.torch.ExpertRebalancer`."""

    def __init__(self, trainer: BalancedTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._experts_watch().step()


def shifted_targets_uncounted(trainer: Trainer) -> bool:
    """Whether ``trainer`` would count a causal language model's labels where its loss averages
    over its shifted targets (``labels[..., 1:]``, every label but each row's first).

    Trainer counts the shifted targets of a model whose ``loss_type`` names the causal-LM loss
    (``*ForCausalLM`` classes); one registered as a causal LM under another class name has no
    ``loss_type`` (GPT-2's ``GPT2LMHeadModel``), though its loss, Hugging Face's default, shifts
    its labels alike: Trainer then counts a label per row too many, and scales every step's
    loss by the targets over the labels. ``False`` where Trainer already counts them so (or no
    longer decides it by ``_loss_shifts_labels``)."""
    if getattr(trainer, "_loss_shifts_labels", True):
        return False
    from transformers.loss.loss_utils import LOSS_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model = trainer.accelerator.unwrap_model(trainer.model)
    config = getattr(model, "config", None)
    return (
        isinstance(model, PreTrainedModel)
        and type(model).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
        and LOSS_MAPPING.get(str(getattr(model, "loss_type", None))) is None
        and "_loss_function" not in vars(model)  # no loss of the user's own set on it
        and not getattr(config, "is_encoder_decoder", False)
        and _forward_calls_its_loss_function(type(model))
    )


def _forward_calls_its_loss_function(cls: type) -> bool:
    """Whether ``cls.forward`` computes its loss by ``self.loss_function`` (Hugging Face's
    default for its ``loss_type``: the causal-LM loss where it has none), read off its code
    (XLNet's and XLM's heads compute their own, on labels aligned with the logits)."""
    try:
        return "self.loss_function(" in inspect.getsource(cls.forward)  # type: ignore[attr-defined]
    except (OSError, TypeError):
        return False


class BalancedTrainer(Trainer):
    """``transformers.Trainer`` where each rank trains on its share of every global batch.

    ``shares``: per-rank batch sizes (one per process, summing to the global batch,
    ``per_device_train_batch_size`` times the number of processes); ``speeds``: relative
    per-rank speeds, split exactly (:func:`hetcoll.split`); ``measure=True``: every rank's
    training step is timed on the first samples when training starts
    (:func:`hetcoll.accelerate.measure_model_speed`, at most ``measure_budget`` seconds) and the
    fits are split with their fixed costs and memory capacities; none of them: equal shares.
    ``seed``: the shuffle's seed (default: ``args.data_seed``, else ``args.seed``); the epoch's
    order is the seeded permutation one process would cut into global batches
    (``train_sampling_strategy="sequential"``: the dataset's order; samplers of other strategies
    raise ``ValueError`` naming it). Other arguments are Trainer's.

    ``rebalance_every``: re-solve the shares from every rank's own compute time every so many
    optimizer steps (a :class:`~hetcoll.torch.Rebalancer` deciding every ``rebalance_every``
    times ``gradient_accumulation_steps`` batches, :attr:`rebalancer`), timed from each step's
    forward to its last gradient (:class:`~hetcoll.torch.StepTimer`: no rank's time holds its
    wait for the others); it starts from the measured fits with ``measure=True``, else from
    the first steps' times. The new shares apply from the first batch no rank's loader has
    fetched; the gradient stays the global batch's whatever the shares. Its checkpoints hold
    the rebalancer's state and shares (``rebalancer.json``), which a resumed run on as many
    processes carries on from.

    Every ``logging_steps`` the logs carry ``share/r`` (the shares the step's last micro-batch
    was cut with: an epoch's short last one holds fewer rows) and, when known, ``speed/r``
    (samples/s measured or, rebalancing, modelled; the relative speeds given), beside the loss.

    A model whose experts :func:`hetcoll.torch.expert_parallel` placed on the ranks trains as
    one process too: its experts weigh every rank's rows as Trainer's loss scaling needs
    (``combine="mean"``, set here) and its gradient is clipped by the whole model's norm
    (:func:`hetcoll.torch.clip_grad_norm_`); ``rebalance_experts_every``: an
    :class:`~hetcoll.torch.ExpertRebalancer` after every optimizer step, placing them again by
    their routed tokens every so many steps (:attr:`expert_rebalancer`; at the ranks' speeds
    as given, else their shares). Its checkpoints (and :meth:`save_model`) hold the unsplit
    model and optimizer state, every rank's experts gathered, so a run resumes from them into
    whatever placement it starts with; with ``rebalance_experts_every`` they hold the
    rebalancer's state too (``expert_rebalancer.json``), and the resumed run puts the experts
    back where they were and decides on as the saved run would have. ``measure=True`` is not
    supported with it (the probe's steps would exchange tokens); ``rebalance_every`` is: the
    step timer leaves the experts' exchanges, where a rank waits for the others, out of its
    compute, and the experts are then placed at the speeds the rebalancer models.

    Raises ``ValueError`` naming ``average_tokens_across_devices`` when it is off on several
    processes and ``model`` when the model takes no ``num_items_in_batch`` and no
    ``compute_loss_func`` is given (the token weighting would be wrong; see the module
    docstring), or, at the first step, when it takes it but its loss does not divide by it
    (Hugging Face's sequence classification heads: a mean over the rank's own rows).
    """

    def __init__(
        self,
        *args: Any,
        shares: Sequence[int] | None = None,
        speeds: Sequence[float] | None = None,
        measure: bool = False,
        measure_budget: float = 10.0,
        seed: int | None = None,
        rebalance_every: int | None = None,
        rebalance_experts_every: int | None = None,
        **kwargs: Any,
    ) -> None:
        check_share_source(shares, speeds, measure, measure_budget)
        rebalance_every = every_argument(rebalance_every, "rebalance_every")
        rebalance_experts_every = every_argument(rebalance_experts_every, "rebalance_experts_every")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed: must be an integer or None, got {seed!r}")
        self._shares = None if shares is None else positive_numbers(shares, "shares", int)
        self._speeds = None if speeds is None else positive_numbers(speeds, "speeds", float)
        self._measure = measure
        self._measure_budget = float(measure_budget)
        self._seed = seed
        #: The training loader once built (its sampler, shares, speeds and fits).
        self.balanced: BalancedLoader | None = None
        self._rebalance_every = rebalance_every
        #: Re-solves the shares from the step times (``rebalance_every``), once the loader is.
        self.rebalancer: Rebalancer | None = None
        self._timer: StepTimer | None = None  # this rank's compute per batch, for it
        self._loss_checked = False  # whether the model's loss divides by num_items_in_batch
        super().__init__(*args, **kwargs)
        processes(self.accelerator, "TrainingArguments(use_cpu=True)")
        ranks = self.args.world_size
        if ranks > 1 and not self.args.average_tokens_across_devices:
            raise ValueError(
                "average_tokens_across_devices: BalancedTrainer needs it True (TrainingArguments' "
                "default): with uneven per-rank batches each rank's loss must be divided by the "
                "tokens of all ranks, not its own"
            )
        if ranks > 1 and not (self.model_accepts_loss_kwargs or self.compute_loss_func):
            raise ValueError(
                "model: its forward takes no num_items_in_batch (no **kwargs), so its loss is a "
                "mean over its own rank's tokens and DDP would weigh the ranks alike; pass "
                "compute_loss_func= (a loss that divides by num_items_in_batch)"
            )
        if self.args.train_sampling_strategy not in ("random", "sequential"):
            raise ValueError(
                "train_sampling_strategy: BalancedTrainer cuts the epoch's order into global "
                "batches itself and takes 'random' (shuffled) or 'sequential', got "
                f"{self.args.train_sampling_strategy!r}"
            )
        for name, values in (("shares", self._shares), ("speeds", self._speeds)):
            if values is not None and len(values) != ranks:
                raise ValueError(f"{name}: has {len(values)} entries for {ranks} processes")
        if shifted_targets_uncounted(self):
            self._loss_shifts_labels = True
        # Experts placed on the ranks (expert_parallel): Trainer scales each rank's loss by the
        # processes over all the step's tokens and DDP averages the ranks alike, so the rows
        # each expert receives weigh 1 / processes ("mean").
        placed = isinstance(self.model, nn.Module) and [
            m for m in self.model.modules() if isinstance(m, ExpertParallelExperts)
        ]
        for m in placed or ():
            m.combine = "mean"
        if placed and measure:
            raise ValueError(
                "measure: BalancedTrainer cannot time a model whose experts are placed on the "
                "ranks (its probe steps would exchange tokens); give shares= or speeds="
            )
        #: Watches the placed experts' loads (``rebalance_experts_every``), once training starts.
        self.expert_rebalancer: ExpertRebalancer | None = None
        self._rebalance_experts_every = rebalance_experts_every
        if rebalance_experts_every is not None:
            if not placed:
                raise ValueError(
                    "rebalance_experts_every: the model holds no experts placed by expert_parallel"
                )
            self.add_callback(_WatchExperts(self))

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """Trainer's; with ``rebalance_every``, the batch's compute time on this rank goes to
        the :attr:`rebalancer` (every rank calls it for every batch; it decides collectively)."""
        rebalancer = self.rebalancer
        if rebalancer is None:
            return super().training_step(model, inputs, num_items_in_batch)
        inner = self.accelerator.unwrap_model(model)
        if self._timer is None or self._timer.model is not inner:  # a new model (model_init)
            self._remove_timer()
            try:
                self._timer = StepTimer(inner)
            except ValueError as e:  # a model it cannot time (sharded over the ranks, ...)
                raise ValueError(f"rebalance_every: cannot time this model's steps: {e}") from None
        loss = super().training_step(model, inputs, num_items_in_batch)
        decided = len(rebalancer.history)
        rebalancer.observe(loader_rows(inputs, "inputs"), self._timer.pop())
        if self.balanced is not None and len(rebalancer.history) > decided:
            # A decision: the speed models moved (what the logs and the bar show).
            self.balanced.speeds, self.balanced.fits = rebalancer.speeds, rebalancer.fits
        return loss

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer's; the step timer's hooks (``rebalance_every``) come off the model after."""
        try:
            return super().train(*args, **kwargs)
        finally:
            self._remove_timer()

    def _remove_timer(self) -> None:
        if self._timer is not None:
            self._timer.remove()
            self._timer = None

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        """Trainer's, once the model's loss is seen to divide by ``num_items_in_batch``
        (:meth:`_check_loss_divides`, at the first step)."""
        if (
            not self._loss_checked
            and num_items_in_batch is not None
            and self.compute_loss_func is None
            and self.model_accepts_loss_kwargs
            and self.args.world_size > 1
        ):
            self._loss_checked = True
            self._check_loss_divides(model, inputs, num_items_in_batch)
        return super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )

    def _check_loss_divides(self, model: nn.Module, inputs: dict[str, Any], n: Any) -> None:
        """Raise ``ValueError`` naming ``model`` where its loss does not divide by
        ``num_items_in_batch`` though its forward takes it (Hugging Face's sequence
        classification heads take ``**kwargs`` but average over their own rank's rows): the
        loss of this rank's batch at ``n`` and at ``2 n`` items, without gradients, in eval
        mode (no dropout), on the unwrapped model (no collective); every rank reaches the same
        verdict, its model's."""
        inner = self.accelerator.unwrap_model(model)
        training = inner.training
        # Placed experts count the tokens routed to them (their rebalancer's loads): these
        # two forwards are no step's (their tokens' exchanges run alike on every rank).
        placed = [m for m in inner.modules() if isinstance(m, ExpertParallelExperts)]
        routed = [m.routed.clone() for m in placed]
        inner.eval()
        try:
            with torch.no_grad():
                losses = [_loss_of(inner(**inputs, num_items_in_batch=k)) for k in (n, 2 * n)]
        finally:
            inner.train(training)
            for m, counts in zip(placed, routed, strict=True):
                m.routed.copy_(counts)
        once, twice = (float(x) for x in losses)
        if not math.isclose(once, 2 * twice, rel_tol=1e-3, abs_tol=1e-12):
            raise ValueError(
                "model: its forward takes num_items_in_batch but its loss does not divide by it "
                f"(loss {once:.6g} at {int(n)} items, {twice:.6g} at {2 * int(n)}): a mean over "
                "its own rank's rows, which DDP would weigh alike on every rank; pass "
                "compute_loss_func= (a loss that divides by num_items_in_batch)"
            )

    def _experts_watch(self) -> ExpertRebalancer:
        """The trainer's :class:`~hetcoll.torch.ExpertRebalancer`, made at the first call
        (over the trainer's optimizer, at the ranks' speeds or shares of the batch)."""
        if self.expert_rebalancer is None:
            assert isinstance(self.model, nn.Module)  # checked when the trainer was made
            assert self._rebalance_experts_every is not None
            self.expert_rebalancer = ExpertRebalancer(
                self.model,
                self._inner_optimizer(),
                speeds=self._expert_speeds,
                every=self._rebalance_experts_every,
            )
        return self.expert_rebalancer

    def _placed_experts(self, model: Any) -> bool:
        return isinstance(model, nn.Module) and any(
            isinstance(m, ExpertParallelExperts) for m in model.modules()
        )

    def _clip_grad_norm(self, model: Any) -> Any:
        """Trainer's clipping, over the whole model's gradient where the ranks hold experts
        of their own (:func:`hetcoll.torch.clip_grad_norm_`): each rank's own norm alone would
        scale each rank's gradients differently."""
        if self._placed_experts(model):
            return clip_grad_norm_(model.parameters(), float(self.args.max_grad_norm))
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        if grad_norm is None and self._placed_experts(model):
            grad_norm = clip_grad_norm_(model.parameters(), math.inf)
        return super()._get_grad_norm(model, grad_norm)

    # -- checkpoints of a model whose experts are placed on the ranks -----------------------

    def _experts_model(self) -> nn.Module | None:
        """The model, where its experts are placed on the ranks (else None)."""
        return self.model if self._placed_experts(self.model) else None  # type: ignore[return-value]

    def _gather_to(self, model: nn.Module) -> int | None:
        """Where gathering the experts' state goes: rank 0 of their group when that is
        Trainer's one writer (the group is every process), else every rank."""
        return gather_destination(model, self.args.world_size, self.args.save_on_each_node)

    def _inner_optimizer(self) -> torch.optim.Optimizer:
        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # Accelerate's wrapper
        assert isinstance(inner, torch.optim.Optimizer)
        return inner

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Trainer's; a model whose experts are placed on the ranks is written whole, every
        rank's experts gathered (collective: every rank calls it, as Trainer does), so that
        ``from_pretrained`` and a resumed run read the unsplit model."""
        model = self._experts_model()
        if model is None:
            return super().save_model(output_dir, _internal_call)
        full = gather_state_dict(model, dst=self._gather_to(model))
        if self.args.should_save and full is not None:
            self._save_whole(output_dir or str(self.args.output_dir), full)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_whole(self, output_dir: str, state_dict: dict[str, torch.Tensor]) -> None:
        """The unsplit model's weights, under the model's own parameter names (one safetensors
        file: what ``from_pretrained`` and Trainer's resume read; ``save_pretrained`` would
        rename some models' experts, Mixtral's among them, into a layout Trainer's resume does
        not map back), its config, and the rest of what Trainer's ``_save`` writes."""
        os.makedirs(output_dir, exist_ok=True)
        safetensors.torch.save_file(
            {k: v.contiguous() for k, v in state_dict.items()},
            os.path.join(output_dir, SAFE_WEIGHTS_NAME),
            metadata={"format": "pt"},
        )
        config = getattr(self.model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(output_dir)
        generation = getattr(self.model, "generation_config", None)
        can_generate = getattr(self.model, "can_generate", lambda: False)
        if generation is not None and can_generate():
            generation.save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _load_from_checkpoint(
        self, resume_from_checkpoint: str, model: nn.Module | None = None
    ) -> None:
        """Trainer's, except as :meth:`_load_weights` says."""
        target = self.model if model is None else model
        if not self._load_weights(resume_from_checkpoint, target):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        """Trainer's (``load_best_model_at_end``), except as :meth:`_load_weights` says."""
        best = self.state.best_model_checkpoint
        if best is None or not self._load_weights(best, self.model):
            super()._load_best_model()

    def _load_weights(self, checkpoint: str, target: Any) -> bool:
        """Load ``checkpoint``'s weights into ``target`` where Trainer's own way would not
        (True), else leave it to Trainer (False). ``save_pretrained`` writes some models in
        another layout than their own (Mixtral's experts one by one), which Trainer loads
        without mapping back, leaving those weights as they were with only a warning: those
        are read as ``from_pretrained`` reads them (mapped back; a copy of the model on the
        CPU meanwhile). With experts placed on the ranks, the unsplit weights are loaded into
        this placement, every key checked (:func:`hetcoll.torch.load_full_state_dict`)."""
        if not isinstance(target, nn.Module):
            return False
        placed = self._placed_experts(target)
        state = _renamed_checkpoint(checkpoint, target)
        if state is None and not placed:
            return False
        if state is None:
            weights = os.path.join(checkpoint, SAFE_WEIGHTS_NAME)
            if not os.path.isfile(weights):
                raise ValueError(
                    f"resume_from_checkpoint: {checkpoint!r} holds no {SAFE_WEIGHTS_NAME} (a "
                    "model whose experts are placed on the ranks resumes from a checkpoint of "
                    "its unsplit weights, as BalancedTrainer writes)"
                )
            state = safetensors.torch.load_file(weights, device="cpu")
        if placed:
            load_full_state_dict(target, state)
        else:
            target.load_state_dict(state)
        return True

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Trainer's; with experts placed on the ranks, the unsplit model's optimizer state
        (:func:`hetcoll.torch.gather_optimizer_state_dict`, keyed by parameter name), not one
        rank's, which holds its own experts' moments only. With ``rebalance_every``, the
        rebalancer's state and the shares it set too (the same on every rank)."""
        model = self._experts_model()
        if model is None:
            super()._save_optimizer_and_scheduler(output_dir)
        else:
            self._save_experts_optimizer(output_dir, model)
        if self.rebalancer is not None and self.args.should_save:
            state = {
                "shares": list(self.rebalancer.sampler.shares),
                "rebalancer": self.rebalancer.state_dict(),
            }
            with open(os.path.join(output_dir, REBALANCER_STATE_NAME), "w") as f:
                json.dump(state, f)

    def _save_experts_optimizer(self, output_dir: str, model: nn.Module) -> None:
        """The optimizer and scheduler of a model whose experts are placed on the ranks."""
        assert self.lr_scheduler is not None  # made with the optimizer, before any step
        full = gather_optimizer_state_dict(
            model, self._inner_optimizer(), dst=self._gather_to(model)
        )
        if self.args.should_save and full is not None:
            torch.save(full, os.path.join(output_dir, OPTIMIZER_NAME))
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
            if self.expert_rebalancer is not None:  # the same on every rank
                with open(os.path.join(output_dir, EXPERTS_STATE_NAME), "w") as f:
                    json.dump(self.expert_rebalancer.state_dict(), f)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Trainer's; with experts placed on the ranks, each rank takes its experts' part of
        the unsplit optimizer state the checkpoint holds, whatever placement wrote it
        (:func:`hetcoll.torch.load_full_optimizer_state_dict`: a checkpoint of one rank's
        state raises ``ValueError`` naming ``state_dict``), and with
        ``rebalance_experts_every`` the experts go back where the saved run had placed them
        (:meth:`hetcoll.torch.ExpertRebalancer.load_state_dict`)."""
        model = self._experts_model()
        if checkpoint is None or model is None:
            super()._load_optimizer_and_scheduler(checkpoint)
        else:
            self._load_experts_optimizer(checkpoint, model)
        if self.rebalancer is not None and checkpoint is not None:
            self._load_rebalancer(checkpoint, self.rebalancer)

    def _load_rebalancer(self, checkpoint: str, rebalancer: Rebalancer) -> None:
        """The shares and the rebalancer's state ``checkpoint`` holds, if any (a checkpoint of
        a run without ``rebalance_every`` has none: this run starts afresh). Every rank reads
        the file and the ranks agree that they all found it and could read it (collective:
        one where the others did not, or a bad file, raises on every rank). Saved on another
        number of processes, the shares stay this run's, and so do the speed models; for another
        global batch, the saved shares' proportions are split anew."""
        path = os.path.join(checkpoint, REBALANCER_STATE_NAME)
        found, shares, failure = os.path.isfile(path), None, None
        if found:
            try:
                with open(path) as f:
                    state = json.load(f)
                if not isinstance(state, dict) or not {"shares", "rebalancer"} <= state.keys():
                    raise ValueError("it holds no shares and rebalancer state")
                shares = positive_numbers(state["shares"], "shares", int)
                rebalancer.load_state_dict(state["rebalancer"])
            except (OSError, ValueError, TypeError) as e:
                failure = ValueError(f"resume_from_checkpoint: {path!r}: {e}")
        agree(
            wrap(rebalancer.group), {f"{REBALANCER_STATE_NAME} found": int(found)}, failure=failure
        )
        now = rebalancer.sampler.shares
        if shares is not None and len(shares) == len(now):
            if sum(shares) != sum(now):  # another global batch now: the saved proportions
                shares = balanced_shares(sum(now), len(now), speeds=shares)
            rebalancer.sampler.set_shares(shares)

    def _load_experts_optimizer(self, checkpoint: str, model: nn.Module) -> None:
        """The optimizer and scheduler of a model whose experts are placed on the ranks, and
        their placement (see :meth:`_load_optimizer_and_scheduler`)."""
        assert self.lr_scheduler is not None  # made with the optimizer, before loading
        optimizer_file = os.path.join(checkpoint, OPTIMIZER_NAME)
        scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
        # As Trainer: a checkpoint without them resumes with fresh ones.
        if os.path.isfile(optimizer_file) and os.path.isfile(scheduler_file):
            full = torch.load(optimizer_file, map_location="cpu", weights_only=True)
            load_full_optimizer_state_dict(model, self._inner_optimizer(), full)
            self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))
        watched = os.path.join(checkpoint, EXPERTS_STATE_NAME)
        if self._rebalance_experts_every is not None and os.path.isfile(watched):
            # The experts go back where the saved run had placed them, with their optimizer
            # state, and the rebalancer decides on from the saved loads.
            with open(watched) as f:
                self._experts_watch().load_state_dict(json.load(f))

    def _expert_speeds(self) -> list[float] | None:
        """The ranks' speeds the experts are placed by: as measured or given, else their
        shares of the batch (None before the loader is built)."""
        if self.balanced is None:
            return None
        if self.balanced.speeds is not None:
            return [float(v) for v in self.balanced.speeds]
        return [float(n) for n in self.balanced.shares]

    @property
    def global_batch(self) -> int:
        """Samples per global batch: ``per_device_train_batch_size`` times the processes."""
        return int(self.args.per_device_train_batch_size) * int(self.args.world_size)

    def get_train_dataloader(self) -> Any:
        """Trainer's training loader (its dataset with unused columns removed, collator and
        worker settings), rebuilt around a :class:`~hetcoll.torch.BalancedSampler`."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        plain = super().get_train_dataloader()  # Trainer's column removal and collator
        dataset, collate = plain.dataset, plain.collate_fn
        fits = None
        if self._measure and self.balanced is None:
            if not isinstance(self.model, nn.Module):
                raise TypeError(
                    f"model: must be a torch.nn.Module, got {type(self.model).__name__}"
                )
            fit = measure_model_speed(
                self.model,
                dataset,
                collate,
                self.global_batch,
                device=self.args.device,
                time_budget=self._measure_budget,
            )
            fits = gather_speeds(fit) if dist.is_initialized() else [fit]
        workers: dict[str, Any] = {}
        if self.args.dataloader_num_workers > 0:
            workers = {
                "prefetch_factor": self.args.dataloader_prefetch_factor,
                "persistent_workers": self.args.dataloader_persistent_workers,
                "multiprocessing_context": self.args.dataloader_multiprocessing_context,
            }
        seed = self._seed
        if seed is None:
            seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        previous = self.balanced  # a rebuilt loader keeps the shares and what is known
        self.balanced = prepare_balanced(
            self.accelerator,
            dataset,
            self.global_batch,
            shares=self._shares if previous is None else previous.shares,
            speeds=self._speeds if previous is None else None,
            fits=fits,
            shuffle=self.args.train_sampling_strategy == "random",
            seed=seed,
            drop_last=self.args.dataloader_drop_last,
            collate_fn=collate,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
            worker_init_fn=plain.worker_init_fn,
            **workers,
        )
        if previous is not None:
            self.balanced.speeds, self.balanced.fits = previous.speeds, previous.fits
        if self._rebalance_every is not None and self.args.world_size > 1:
            # Decides every rebalance_every optimizer steps' batches; a rebuilt loader's
            # rebalancer carries on from the one before (its models, steps, capacities and
            # decisions).
            every = self._rebalance_every * int(self.args.gradient_accumulation_steps)
            before, sampler = self.rebalancer, self.balanced.sampler
            if before is None:
                self.rebalancer = Rebalancer(sampler, every=every, fits=fits)
            else:
                self.rebalancer = before.over(sampler, every=every)
        return self.balanced.loader

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Trainer's logs, with every rank's share and speed (training logs only)."""
        if self.balanced is not None and "loss" in logs:
            logs = {**logs, **self.balanced.log_entries()}
        super().log(logs, start_time)


def _renamed_checkpoint(checkpoint: str, model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The unsplit state dict of a Hugging Face checkpoint whose weights are not under
    ``model``'s own names, read by ``from_pretrained`` (which maps them back), in the model's
    dtype; None where they are (or where the checkpoint is no safetensors one)."""
    single = os.path.join(checkpoint, SAFE_WEIGHTS_NAME)
    index = os.path.join(checkpoint, SAFE_WEIGHTS_INDEX_NAME)
    if os.path.isfile(single):
        with safetensors.safe_open(single, "pt") as f:
            keys = set(f.keys())
    elif os.path.isfile(index):
        with open(index) as f:
            keys = set(json.load(f)["weight_map"])
    else:
        return None
    if keys <= set(model.state_dict()) or not isinstance(model, PreTrainedModel):
        return None
    dtype = next(model.parameters()).dtype
    loaded = type(model).from_pretrained(checkpoint, dtype=dtype)
    return {k: v.detach() for k, v in loaded.state_dict().items()}


def _loss_of(outputs: Any) -> torch.Tensor:
    """The loss a model's outputs carry (a ``ModelOutput``'s ``loss``, or the first entry)."""
    return outputs["loss"] if isinstance(outputs, dict) else outputs[0]
