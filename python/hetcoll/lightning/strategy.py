"""BalancedStrategy: Lightning's DDP with uneven, speed-proportional per-rank batches.

The user's training ``DataLoader`` keeps its ``batch_size``, read as the *global* batch. The
strategy rebuilds that loader around a :class:`~hetcoll.torch.BalancedSampler`: the epoch's
permutation (the one a one-rank ``DistributedSampler`` draws: ``torch.randperm`` seeded with
``seed + epoch``, or the dataset in order when not shuffled) is cut into global batches and
each rank takes its share of every one, so the ranks together see, step by step, the samples
one process would see. DDP's gradient averaging is replaced by hetcoll's comm hook
(:func:`~hetcoll.torch.weighted_allreduce_hook`), with each step's local batch size set from
the batch the loader hands the rank, so the averaged gradient is the full-batch gradient.
With ``items``, a function of the batch counting what ``training_step``'s loss averages over
(a language model's valid tokens), each rank weighs its items instead, exchanged at the start
of every step (:meth:`hetcoll.torch.WeightedAllreduceState.count`).

Shares, in order of precedence: given (``shares``), split from relative ``speeds``
(:func:`hetcoll.split`), measured when training starts (``measure=True``: every rank times its
training step with :func:`~hetcoll.torch.measure_speed` on the first samples of the dataset, the
fits are exchanged with :func:`~hetcoll.torch.gather_speeds` and split exactly, within each
rank's memory capacity from the same probe), or equal. ``rebalance_every``
adds a :class:`~hetcoll.torch.Rebalancer` fed with each rank's compute time per batch (its
forward to its last gradient, :class:`~hetcoll.torch.StepTimer`: no rank's time holds DDP's
wait for the others; on a GPU, the kernels' time); new shares apply from the next batch the loader
fetches, with Lightning's default fetching and ``num_workers=0`` the next step (worker processes
fetch ahead, so there a few steps later, the same step on every rank: the first that no rank's
loader had fetched). ``rebalance_experts_every`` adds an
:class:`~hetcoll.torch.ExpertRebalancer` to a model whose experts ``configure_model`` placed
(:func:`~hetcoll.torch.expert_parallel`): after every optimizer step it counts, and every so
many steps it places the experts again by their routed tokens when that pays, at the ranks'
speeds as last known (measured, else given, else the shares). Lightning's checkpoints hold
both rebalancers' state: a resumed run starts from the saved speed models, and its experts
go back where they were, the rebalancer deciding on as the saved run's would.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

import hetcoll
from hetcoll.comm import Communicator, agree, wrap
from hetcoll.torch import (
    BalancedSampler,
    ExpertParallelExperts,
    ExpertRebalancer,
    Rebalancer,
    SpeedFit,
    StepTimer,
    WeightedAllreduceState,
    clip_grad_norm_,
    gather_optimizer_state_dict,
    gather_speeds,
    gather_state_dict,
    item_weights,
    leave_to_ranks,
    load_full_optimizer_state_dict,
    load_full_state_dict,
    measure_speed,
    weighted_allreduce_hook,
)
from hetcoll.torch.batches import Items, count_items, counted, items_argument, loader_rows
from hetcoll.torch.filters.layers import split_comms
from hetcoll.torch.speed import check_share_source, every_argument

_OWN_HOOK_ARGUMENTS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper")


def _positive_ints(values: Any, argument: str) -> list[int]:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{argument}: must be a sequence of positive integers, got {values!r}")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not hasattr(v, "__index__") or int(v.__index__()) < 1:
            raise ValueError(f"{argument}[{i}]: must be a positive integer, got {v!r}")
        out.append(int(v.__index__()))
    if not out:
        raise ValueError(f"{argument}: must not be empty")
    return out


def _positive_floats(values: Any, argument: str) -> list[float]:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{argument}: must be a sequence of positive numbers, got {values!r}")
    out = []
    for i, v in enumerate(values):
        try:
            f = float(v)
        except (TypeError, ValueError):
            f = float("nan")
        if isinstance(v, bool) or not (math.isfinite(f) and f > 0):
            raise ValueError(f"{argument}[{i}]: must be a finite number > 0, got {v!r}")
        out.append(f)
    if not out:
        raise ValueError(f"{argument}: must not be empty")
    return out


class _TrainingStep(nn.Module):
    """The LightningModule's ``training_step`` as a module returning the loss, for the probe."""

    def __init__(self, module: LightningModule) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch: Any) -> torch.Tensor:
        out = self.module.training_step(batch, 0)
        loss = out["loss"] if isinstance(out, dict) else out
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                "measure: training_step must return the loss (a tensor, or a dict with 'loss') "
                f"to be timed, got {type(out).__name__}"
            )
        return loss


class _ShareLog(Callback):
    """Logs every rank's share (progress bar too) and, when known, speed in samples/s."""

    def __init__(self, strategy: BalancedStrategy) -> None:
        self.strategy = strategy

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        s = self.strategy
        if s.sampler is None:
            return
        # The shares this batch ran at: a rebalance after it set the next steps'.
        metrics = {f"share/{r}": float(v) for r, v in enumerate(s.sampler.taken_shares())}
        speeds = s.speeds
        pl_module.log_dict(metrics, prog_bar=True, on_step=True, on_epoch=False)
        if speeds is not None:
            pl_module.log_dict(
                {f"speed/{r}": float(v) for r, v in enumerate(speeds)},
                prog_bar=False,
                on_step=True,
                on_epoch=False,
            )


class _ObserveBatches(Callback):
    """After every training batch, its compute time to the strategy's rebalancer."""

    def __init__(self, strategy: BalancedStrategy) -> None:
        self.strategy = strategy

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        self.strategy._observe_batch()


class _RebalancersState(Callback):
    """The strategy's rebalancers' state in Lightning's checkpoints (a callback's
    ``state_dict``; the same on every rank), put back when training starts, once the loader,
    the sampler's restored position and the optimizer are there: the batch rebalancer's
    models (:meth:`~hetcoll.torch.Rebalancer.load_state_dict`), and the experts where the
    expert rebalancer had placed them, with its steps and loads
    (:meth:`~hetcoll.torch.ExpertRebalancer.load_state_dict`)."""

    def __init__(self, strategy: BalancedStrategy) -> None:
        self.strategy = strategy
        self._restored: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        s, state = self.strategy, {}
        if s.rebalancer is not None:
            state["rebalancer"] = s.rebalancer.state_dict()
        if s.expert_rebalancer is not None:
            state["experts"] = s.expert_rebalancer.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = state_dict  # Lightning restores callbacks before the optimizers

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        state, self._restored = self._restored or {}, None
        s = self.strategy
        if "rebalancer" in state and s.rebalancer is not None:
            s.rebalancer.load_state_dict(state["rebalancer"])
        if "experts" in state and s.rebalance_experts_every is not None:
            s._experts_watch(trainer.optimizers[0]).load_state_dict(state["experts"])


class _BalancedLoader(DataLoader):
    """The training loader: its sampler's state goes into Lightning's checkpoints (Lightning
    saves the state of loaders with ``state_dict``/``load_state_dict``), so a run resumed mid-epoch
    continues the epoch at the first step not trained (the sampler counts the batches this
    loader handed to the fit loop, whatever its workers fetched ahead), on as many ranks or
    another number; the ranks check that they restored the same position."""

    def state_dict(self) -> dict[str, Any]:
        sampler = self.batch_sampler.sampler  # type: ignore[union-attr]
        return dict(sampler.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sampler = self.batch_sampler.sampler  # type: ignore[union-attr]
        saved = state.get("shares") if isinstance(state, dict) else None
        if isinstance(saved, list) and sum(saved) != sum(sampler.shares):
            # Lightning counts an epoch's batches once, at the global batch it finds.
            raise ValueError(
                f"train_dataloader: batch_size {sum(sampler.shares)} (the global batch), but the "
                f"checkpoint was trained at {sum(saved)}: resume with the same batch_size"
            )
        sampler.load_state_dict(state)

    def __len__(self) -> int:
        # Lightning counts an epoch's batches once, before a restored state takes effect, and
        # keeps the count for every epoch: the whole epoch's (a resumed epoch ends when the
        # sampler runs out, on the step it would have ended on).
        return int(self.batch_sampler.sampler.steps_per_epoch)  # type: ignore[union-attr]

    def __iter__(self) -> Any:
        # Lightning makes the first epoch's iterator before it sets the sampler's epoch
        # (FitLoop.setup_data, then set_epoch in on_advance_start): loader workers would start
        # cutting the steps of the epoch before (a run resumed from an epoch's last step
        # replayed that epoch's order). The iterator is made at the first batch instead.
        return _Deferred(self)


class _Deferred:
    """A loader's iterator, made when the first batch is asked for."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader
        self.iterator: Any = None

    def __iter__(self) -> _Deferred:
        return self

    def __next__(self) -> Any:
        if self.iterator is None:
            self.iterator = DataLoader.__iter__(self.loader)
        return next(self.iterator)

    def __len__(self) -> int:
        return len(self.loader)


class _WholeModelLauncher(_MultiProcessingLauncher):
    """Lightning's launcher of spawned or forked ranks, sending the main process the whole
    model where the ranks hold parts of it (experts placed by :func:`hetcoll.torch.
    expert_parallel`, filter-parallel layers): rank 0's own part would not load into the main
    process's whole module. The gather is collective, as Lightning's own collection is."""

    def _collect_rank_zero_results(self, trainer: Trainer, results: Any) -> Any:
        module = trainer.lightning_module
        if not split_comms(module):
            return super()._collect_rank_zero_results(trainer, results)
        full = gather_state_dict(module, dst=None)
        module.state_dict = lambda *args, **kwargs: full  # type: ignore[method-assign, assignment]
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            del module.state_dict


class BalancedStrategy(DDPStrategy):
    """Lightning's DDP strategy where each rank takes its share of every global batch and
    gradients are averaged weighted by samples (exact: the full-batch gradient).

    ``shares``: per-rank batch sizes (one per rank, summing to the training DataLoader's
    ``batch_size``, the global batch). ``speeds``: relative per-rank speeds instead, split
    exactly (:func:`hetcoll.split`). ``measure``: time every rank's training step when training
    starts and split by the fits (``measure_budget`` seconds at most for the probe). None of
    them: equal shares. ``rebalance_every``: re-solve the shares from the batches' compute
    times every so many batches (:class:`hetcoll.torch.Rebalancer`); under manual optimization
    with several backward calls in a batch, run all but its last under
    ``self.toggle_model(sync_grad=False)`` (or ``no_sync``): a synchronising backward waits
    for the other ranks inside the batch's timed span, and the shares would not move (a
    ``RuntimeWarning`` says so, once, at a batch's second synchronising backward). With
    experts placed on the ranks, their token exchanges (where a rank waits for the others)
    are left out of the timed span, and ``rebalance_experts_every`` places them at the speeds
    the rebalancer models.
    ``rebalance_experts_every``: for experts placed in ``configure_model``
    (:func:`hetcoll.torch.expert_parallel`), look at their routed tokens every so many steps
    and place them again when that pays
    (:class:`hetcoll.torch.ExpertRebalancer`, at the ranks' speeds as last known: measured, else
    ``speeds``, else the shares; :attr:`expert_rebalancer`). ``seed``: the shuffle's seed when
    the loader's sampler is a ``RandomSampler`` (with Lightning's injected
    ``DistributedSampler`` its seed is used). ``items``: when ``training_step``'s loss is a mean
    over something else than the batch's rows, such as a language model's valid tokens, a
    function of the batch as the loader yields it that counts them (``items=lambda batch:
    int((batch[1] != -100).sum())`` for ``(ids, labels)`` batches whose labels line up with
    the outputs; ``batch[1][:, 1:]`` where the loss shifts them, as a causal LM's does); each
    rank's gradient is then
    weighed by its items and every step is the gradient of the mean over all valid items of the
    global batch (the shares, the probe and the rebalancer still count rows). A bad count raises
    ``ValueError`` naming ``items`` on every rank. Other keyword arguments go to ``DDPStrategy``
    (e.g. ``start_method="spawn"``); its comm-hook arguments are taken by this strategy.

    The training loader's sampler decides the order: Lightning's ``DistributedSampler`` (its
    default) and ``RandomSampler`` shuffle, ``SequentialSampler`` (``shuffle=False`` with
    ``Trainer(use_distributed_sampler=False)``) keeps the dataset order; other samplers and
    batch samplers raise. Validation and test loaders are Lightning's as usual.

    Gradient accumulation (``Trainer(accumulate_grad_batches=k)``, or changing with a
    ``GradientAccumulationScheduler``, or the user's own under manual optimization) trains as
    one process accumulating alike: Lightning divides every micro-batch's loss by ``k`` and DDP
    skips the exchange until the step's last micro-batch, so the step is the mean of its
    micro-batches' full-batch gradients. Each micro-batch's ranks weigh their rows (or
    ``items``) in it: their counts are exchanged as the micro-batch starts (one small
    allgather), each rank's loss is scaled by its weight ``n_r / N`` times the ranks (DDP's
    mean divides that away), and a rank with no item in a micro-batch adds nothing (its
    gradient, NaN for a mean over nothing, is dropped), whichever shares each micro-batch ran
    at. ``items`` is weighed so always; rows without accumulation in the hook.

    >>> trainer = Trainer(strategy=BalancedStrategy(speeds=[3, 1]), accelerator="cpu",
    ...                   devices=2)  # doctest: +SKIP
    """

    strategy_name = "hetcoll_balanced"

    def __init__(
        self,
        shares: Sequence[int] | None = None,
        speeds: Sequence[float] | None = None,
        measure: bool = False,
        rebalance_every: int | None = None,
        *,
        seed: int = 0,
        measure_budget: float = 10.0,
        items: Items | None = None,
        rebalance_experts_every: int | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        check_share_source(shares, speeds, measure, measure_budget)
        rebalance_every = every_argument(rebalance_every, "rebalance_every")
        rebalance_experts_every = every_argument(rebalance_experts_every, "rebalance_experts_every")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed: must be an integer, got {seed!r}")
        self.items = items_argument(items)
        for name in _OWN_HOOK_ARGUMENTS:
            if name in ddp_kwargs:
                raise TypeError(f"{name}: BalancedStrategy registers its own DDP comm hook")
        super().__init__(**ddp_kwargs)
        self.shares = None if shares is None else _positive_ints(shares, "shares")
        self._given_speeds = None if speeds is None else _positive_floats(speeds, "speeds")
        self.measure = measure
        self.rebalance_every = rebalance_every
        self.seed = seed
        self.measure_budget = float(measure_budget)
        #: The training loader's sampler, once the loader is set up.
        self.sampler: BalancedSampler | None = None
        self._balanced: tuple[int, DataLoader] | None = None  # the epoch and loader it balanced
        #: Every rank's measured fit (``measure=True``), in rank order.
        self.fits: list[SpeedFit] | None = None
        self.rebalancer: Rebalancer | None = None
        self.rebalance_experts_every = rebalance_experts_every
        #: Watches the experts' loads (``rebalance_experts_every``), from the first step on.
        self.expert_rebalancer: ExpertRebalancer | None = None
        self.hook_state: WeightedAllreduceState | None = None
        self._timer: StepTimer | None = None  # this rank's compute per batch, for the rebalancer
        self._synced_backwards = 0  # the batch's backward calls that synchronised the ranks
        self._told_synced = False  # warned once of a second such call in a batch
        self._local_batch = 0
        #: Weighing by micro-batch (:meth:`_by_micro_batch`): the running micro-batch's loss
        #: factor (its weight times the ranks); None weighing in the hook.
        self._micro_scale: float | None = None
        #: With items: drops the gradients of micro-batches this rank weighs 0 in.
        self._weightless_hooks: list[Any] = []
        #: The model's SyncBatchNorms (Trainer's ``sync_batchnorm=True``): while one trains,
        #: batches are weighed on their loss (their backward mixes the ranks' gradients).
        self._sync_norms: list[nn.SyncBatchNorm] = []
        #: This micro-batch's gradients are dropped (:meth:`_drop_if_weightless`).
        self._drop_weightless = False
        self._comm: Communicator | None = None
        #: Inside ``training_step``: this rank's weight for the means it logs (:meth:`reduce`).
        self._log_weight: float | None = None

    @property
    def speeds(self) -> list[float] | None:
        """Every rank's speed in samples/s as last known (rebalancer, else probe; None if
        neither measured; relative ``speeds`` given by the user are not samples/s)."""
        if self.rebalancer is not None and self.rebalancer.speeds is not None:
            return self.rebalancer.speeds
        if self.fits is not None:
            return [f.samples_per_s for f in self.fits]
        return None

    def _expert_speeds(self) -> list[float]:
        """The ranks' speeds the experts are placed by: as last measured, else given, else the
        ranks' shares of the batch."""
        known = self.speeds
        if known is not None:
            return known
        if self._given_speeds is not None:
            return list(self._given_speeds)
        if self.sampler is not None:
            return [float(n) for n in self.sampler.shares]
        return [1.0] * self.world_size

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.rebalance_experts_every is not None:
            self._experts_watch(getattr(optimizer, "optimizer", optimizer)).step()
        return out

    def _experts_watch(self, optimizer: torch.optim.Optimizer) -> ExpertRebalancer:
        """The strategy's :class:`~hetcoll.torch.ExpertRebalancer`, made at the first call
        (over ``optimizer``, the module's), with ``rebalance_experts_every``."""
        if self.expert_rebalancer is None:
            assert self.lightning_module is not None  # set while training
            assert self.rebalance_experts_every is not None
            try:
                self.expert_rebalancer = ExpertRebalancer(
                    self.lightning_module,
                    optimizer,
                    speeds=self._expert_speeds,
                    every=self.rebalance_experts_every,
                )
            except ValueError as e:
                raise ValueError(f"rebalance_experts_every: {e}") from None
        return self.expert_rebalancer

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if isinstance(self._launcher, _MultiProcessingLauncher):
            method: Any = self._start_method  # not "popen": that launcher is another
            self._launcher = _WholeModelLauncher(self, start_method=method)

    # -- checkpoints: the unsplit model where the ranks hold parts of it -------------------

    def _split_module(self) -> LightningModule | None:
        """The LightningModule where its ranks hold parts of it (experts placed by
        :func:`~hetcoll.torch.expert_parallel`, filter-parallel layers), else None."""
        module = self.lightning_module
        return module if module is not None and split_comms(module) else None

    def _gather_to(self, module: nn.Module) -> int | None:
        """Rank 0, Lightning's writer, where the parts are split over every rank; else every
        rank gathers."""
        return 0 if all(c.size == self.world_size for c in split_comms(module)) else None

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Lightning's; where the ranks hold parts of the model, the unsplit model's state,
        every rank's part gathered (collective: Lightning takes a checkpoint's state on every
        rank and writes rank 0's), so the checkpoint loads into any split and into the
        unsplit module."""
        module = self._split_module()
        if module is None:
            return super().lightning_module_state_dict()
        return gather_state_dict(module, dst=self._gather_to(module)) or {}

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Lightning's; where the ranks hold parts of the model, the unsplit model's optimizer
        state (:func:`~hetcoll.torch.gather_optimizer_state_dict`, keyed by parameter name):
        one rank's holds its own part's only."""
        module = self._split_module()
        if module is None:
            return super().optimizer_state(optimizer)
        inner = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's
        return gather_optimizer_state_dict(module, inner, dst=self._gather_to(module)) or {}

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Lightning's; where the ranks hold parts of the model, each rank takes its part of
        the checkpoint's unsplit state, whatever split wrote it, every key checked
        (:func:`~hetcoll.torch.load_full_state_dict`)."""
        module = self._split_module()
        if module is None:
            return super().load_model_state_dict(checkpoint, strict=strict)
        load_full_state_dict(module, checkpoint["state_dict"])

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Lightning's; where the ranks hold parts of the model, each rank takes its part of
        the unsplit optimizer state (:func:`~hetcoll.torch.load_full_optimizer_state_dict`)."""
        module = self._split_module()
        if module is None:
            return super().load_optimizer_state_dict(checkpoint)
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            load_full_optimizer_state_dict(module, optimizer, state)

    # -- DDP: hetcoll's comm hook ---------------------------------------------------------

    def _setup_model(self, model: nn.Module) -> DistributedDataParallel:
        # Experts placed by expert_parallel (in configure_model, on any submodule) are each
        # rank's own: DDP must leave them alone, named from the module it wraps.
        leave_to_ranks(model)
        return super()._setup_model(model)

    def _register_ddp_hooks(self) -> None:
        # Lightning registers hooks on CUDA only; this one runs on every device.
        assert isinstance(self.model, DistributedDataParallel)
        # Weighing by rows in the hook, or (by micro-batch) the plain mean of losses that carry
        # the weights: one sample each.
        self.hook_state = WeightedAllreduceState(None, local_batch=0)
        self._sync_norms = [m for m in self.model.modules() if isinstance(m, nn.SyncBatchNorm)]
        self.model.register_comm_hook(self.hook_state, weighted_allreduce_hook)
        if self.items is not None:
            self._weightless_hooks = [
                p.register_hook(self._drop_if_weightless)
                for p in self.model.parameters()
                if p.requires_grad
            ]

    def _drop_if_weightless(self, grad: torch.Tensor) -> torch.Tensor | None:
        """A parameter's gradient from a micro-batch this rank weighs 0 in: zeros (a mean over
        no item is NaN, and ``0 * NaN`` is NaN), before it accumulates or reaches the hook;
        kept while a SyncBatchNorm trains, whose exchange gives this rank's parameters what
        the other ranks' losses make of them."""
        return torch.zeros_like(grad) if self._drop_weightless else None

    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        if self.lightning_module is not None and any(
            isinstance(m, ExpertParallelExperts) for m in self.lightning_module.modules()
        ):
            # Each rank holds experts of its own: clipping by norm (gradient_clip_val) takes
            # the whole model's norm, every rank's own parameters' squares summed.
            plugin = self.precision_plugin

            def by_norm(optimizer: Any, clip_val: float) -> None:
                clip_grad_norm_(list(plugin.main_params(optimizer)), float(clip_val))

            plugin.clip_grad_by_norm = by_norm  # type: ignore[method-assign]

    def setup_environment(self) -> None:
        super().setup_environment()
        # The strategy's callbacks, there before Lightning restores a checkpoint's callbacks.
        module = self.lightning_module
        trainer = module.trainer if module is not None else None
        if trainer is None:
            return
        # The trainer's callback list (set by its callback connector, hence unseen by mypy).
        callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
        for kind in (_ObserveBatches, _ShareLog, _RebalancersState):
            if not any(isinstance(c, kind) and c.strategy is self for c in callbacks):
                # The batch's time is observed before any other callback sees the batch end
                # (a checkpoint saved there holds the rebalancer with that batch counted).
                at = 0 if kind is _ObserveBatches else len(callbacks)
                callbacks.insert(at, kind(self))

    # -- the training loader --------------------------------------------------------------

    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training or not isinstance(dataloader, DataLoader):
            return dataloader
        return self._balanced_loader(dataloader)

    def _balanced_loader(self, dl: DataLoader) -> DataLoader:
        epoch = self.lightning_module.trainer.current_epoch if self.lightning_module else 0
        if (
            self._balanced is not None
            and self._balanced[0] == epoch
            and self._balanced[1] is not dl
        ):
            # A second training loader of the same loading (a dict or list of them): one
            # sampler, one set of shares, one rebalancer and one checkpointed position each
            # would be needed (the second was cut by the first's shares: 6.9e-2 off).
            raise ValueError(
                "train_dataloader: BalancedStrategy balances one training loader, and this "
                "returns several (a dict, a list or a CombinedLoader of them); combine their "
                "datasets into one loader (torch.utils.data.ConcatDataset, or a dataset of "
                "pairs)"
            )
        self._balanced = (epoch, dl)
        if dl.batch_size is None:
            raise ValueError(
                "train_dataloader: BalancedStrategy needs batch_size= (the global batch), "
                "not a batch_sampler"
            )
        sampler = dl.sampler
        if isinstance(sampler, DistributedSampler):
            shuffle, seed = bool(sampler.shuffle), int(sampler.seed)
        elif isinstance(sampler, RandomSampler):
            shuffle, seed = True, self.seed
        elif isinstance(sampler, SequentialSampler):
            shuffle, seed = False, self.seed
        else:
            iterable = isinstance(dl.dataset, IterableDataset)
            raise ValueError(
                "train_dataloader: BalancedStrategy replaces the sampler with its own and can "
                "take a DistributedSampler, RandomSampler or SequentialSampler, got "
                + (
                    "an IterableDataset, which has no sampler: its samples cannot be dealt "
                    "by share (give each rank its share of a stream in a loop of your own: "
                    "docs/guides.md, 'Streams')"
                    if iterable
                    else type(sampler).__name__
                )
            )
        shares = self._resolve_shares(dl)
        self.sampler = BalancedSampler(
            dl.dataset, shares, self.global_rank, shuffle=shuffle, seed=seed, drop_last=dl.drop_last
        )
        if self.rebalancer is not None:  # a reloaded loader: the rebalancer carries on
            self.rebalancer = self.rebalancer.over(self.sampler)
        elif self.rebalance_every is not None:
            self.rebalancer = Rebalancer(self.sampler, every=self.rebalance_every, fits=self.fits)
        workers: dict[str, Any] = {}
        if dl.num_workers > 0:
            workers = {
                "prefetch_factor": dl.prefetch_factor,
                "persistent_workers": dl.persistent_workers,
            }
        return _BalancedLoader(
            dl.dataset,
            batch_sampler=self.sampler.batch_sampler(),
            num_workers=dl.num_workers,
            collate_fn=dl.collate_fn,
            pin_memory=dl.pin_memory,
            timeout=dl.timeout,
            worker_init_fn=dl.worker_init_fn,
            multiprocessing_context=dl.multiprocessing_context,
            generator=dl.generator,
            **workers,
        )

    def _resolve_shares(self, dl: DataLoader) -> list[int]:
        total, ranks = int(dl.batch_size or 0), self.world_size
        if self.sampler is None:  # ranks whose loaders differ would blame the shares
            agree(wrap(None), {"the train_dataloader's batch_size (the global batch)": total})
        # Lightning rebuilds a loader made with batch_sampler= around its own sampler, with
        # batch_size=1: say so where the global batch of 1 is refused.
        hint = (
            "; a train_dataloader made with batch_sampler= comes here as batch_size 1 "
            "(Lightning rebuilds it): BalancedStrategy needs batch_size=, the global batch"
            if total == 1
            else ""
        )
        if self.sampler is not None:  # a reloaded loader keeps the current shares,
            current = list(self.sampler.shares)  # or their proportions at its batch size
            if sum(current) == total:
                return current
            if total < ranks:
                raise ValueError(
                    f"train_dataloader: batch_size {total} (the global batch) is smaller than "
                    f"the number of ranks ({ranks}){hint}"
                )
            return hetcoll.split(total, current, minimum=1)
        if self.shares is not None:
            if len(self.shares) != ranks:
                raise ValueError(f"shares: has {len(self.shares)} entries for {ranks} ranks")
            if sum(self.shares) != total:
                raise ValueError(
                    f"shares: sum to {sum(self.shares)}, but the train_dataloader's batch_size "
                    f"(the global batch) is {total}{hint}"
                )
            return list(self.shares)
        if total < ranks:
            raise ValueError(
                f"train_dataloader: batch_size {total} (the global batch) is smaller than the "
                f"number of ranks ({ranks}){hint}"
            )
        if self._given_speeds is not None:
            if len(self._given_speeds) != ranks:
                raise ValueError(f"speeds: has {len(self._given_speeds)} entries for {ranks} ranks")
            return hetcoll.split(total, self._given_speeds, minimum=1)
        if self.measure:
            self.fits = gather_speeds(self._probe(dl, total))
            caps = [total if f.capacity is None else min(f.capacity, total) for f in self.fits]
            return hetcoll.split(
                total,
                [f.samples_per_s for f in self.fits],
                latency=[f.latency_s for f in self.fits],
                capacity=caps,
                minimum=1,
            )
        return hetcoll.split(total, [1.0] * ranks, minimum=1)

    def _probe(self, dl: DataLoader, total: int) -> SpeedFit:
        """This rank's training step timed on the first samples of the dataset, at batch sizes
        up to the global batch, on a copy of the module (the trainer left out)."""
        module = self.lightning_module
        assert module is not None
        probe = copy.deepcopy(module, memo={id(module.trainer): None})
        n = len(dl.dataset)  # type: ignore[arg-type]

        def make_batch(b: int) -> tuple[Any, None]:
            batch = dl.collate_fn([dl.dataset[i % n] for i in range(b)])
            return self.batch_to_device(batch), None

        sizes = sorted({max(1, total // 4), max(1, total // 2), total})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the copy's self.log calls, without a trainer
            return measure_speed(
                _TrainingStep(probe),
                make_batch,
                lambda loss, _: loss,
                batch_sizes=sizes,
                time_budget=self.measure_budget,
                probe_memory=True,  # CUDA: the allocator's peak; CPU: counted
            )

    # -- per step: the local batch for the hook, step times for the rebalancer --------------

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._synced_backwards = 0
        # Rows, or a list of samples' entries (detection).
        self._local_batch = loader_rows(batch, "batch")
        self._micro_scale = None
        self._drop_weightless = False
        if self.hook_state is not None:
            by_micro_batch = self._by_micro_batch()
            if by_micro_batch is not None:
                self._micro_scale = self._micro_batch_scale(
                    batch, self._local_batch, by_micro_batch
                )
                synced = by_micro_batch["training SyncBatchNorm"]
                self._drop_weightless = self._micro_scale == 0 and not synced
                self.hook_state.local_batch = 1  # unused: backward weighs the loss
            else:
                self.hook_state.local_batch = self._local_batch
        if self.rebalancer is not None and self._timer is None and self.model is not None:
            self._timer = StepTimer(self.model)  # from this batch's forward on

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._log_weight = (
            self._micro_scale if self._micro_scale is not None else float(self._local_batch)
        )
        try:
            return super().training_step(*args, **kwargs)
        finally:
            self._log_weight = None

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        """DDPStrategy's, but a mean logged inside ``training_step`` (``self.log(...,
        sync_dist=True)``, on each step) is the global batch's: each rank's value weighed by
        its rows (or ``items``) in the batch, as its gradient is, where DDP's takes the ranks'
        plain mean (a training loss then equals one process's on the same global batch); a
        rank weighing 0 (no valid item: its mean, NaN) adds nothing. Means of a whole epoch
        are Lightning's, weighed by each logged value's ``batch_size``."""
        weight = self._log_weight
        mean = isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")
        if (
            weight is None
            or not mean
            or not isinstance(tensor, torch.Tensor)
            or not tensor.is_floating_point()
            or not torch.distributed.is_initialized()
        ):
            return super().reduce(tensor, group, reduce_op)
        flat = tensor.detach().reshape(-1).double()
        w = flat.new_tensor(weight)
        weighed = torch.where(w > 0, flat * w, torch.zeros_like(flat))
        packed = torch.cat([weighed, w.reshape(1)])
        torch.distributed.all_reduce(packed, group=group)
        return (packed[:-1] / packed[-1]).to(tensor.dtype).reshape(tensor.shape)

    def _by_micro_batch(self) -> dict[str, int] | None:
        """Whether this batch's ranks are weighed on its loss rather than in the hook (which
        weighs the gradients that reach it, summed over a window, by the last batch's rows):
        with ``items``, with gradient accumulation (``accumulate_grad_batches`` now, which a
        ``GradientAccumulationScheduler`` changes), under manual optimization (whose
        windows only the user's code knows), and while a ``SyncBatchNorm`` trains (its
        backward sums the ranks' gradients before the hook). Then the fields the ranks must
        agree on; else None."""
        module = self.lightning_module
        trainer = module.trainer if module is not None else None
        accumulate = int(trainer.accumulate_grad_batches) if trainer is not None else 1
        manual = module is not None and not module.automatic_optimization
        synced = any(m.training for m in self._sync_norms)
        if self.items is None and accumulate == 1 and not manual and not synced:
            return None
        return {
            "accumulate_grad_batches": accumulate,
            "manual optimization": int(manual),
            "training SyncBatchNorm": int(synced),
        }

    def _micro_batch_scale(self, batch: Any, rows: int, fields: dict[str, int]) -> float:
        """This batch's weight ``n_r / N`` over its rows (or ``items``) on every rank
        (collective: one small allgather, which also checks ``fields`` alike on every rank).
        A bad count raises ``ValueError`` naming ``items`` on every rank."""
        assert self.hook_state is not None
        mine = counted(rows) if self.items is None else count_items(self.items, batch)
        if self._comm is None:
            self._comm = wrap(self.hook_state.process_group)
        comm = self._comm
        counts = agree(comm, fields, values=mine.exchanged, failure=None)
        weights = item_weights(counts, "items" if self.items is not None else "batch", mine.failure)
        return float(weights[comm.rank])

    def backward(
        self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        if self._micro_scale is not None and self.hook_state is not None:
            # The batch's weight on its loss (which Lightning divided by
            # accumulate_grad_batches); the hook takes the ranks' plain mean, exchanging no
            # counts of its own.
            closure_loss = self.hook_state.weigh(closure_loss, weight=self._micro_scale)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        if self.rebalancer is None or not getattr(self.model, "require_backward_grad_sync", False):
            return
        # A backward that synchronises waits for the other ranks before the batch's last
        # gradient of its next one: the batch's timed span then holds that wait.
        self._synced_backwards += 1
        if self._synced_backwards == 2 and not self._told_synced:
            self._told_synced = True
            warnings.warn(
                "rebalance_every: a batch ran a second backward that synchronises the ranks' "
                "gradients; the first waits for the other ranks inside the batch's timed span, "
                "so the shares cannot follow the speeds. Run all but the batch's last backward "
                "under self.toggle_model(sync_grad=False) (or no_sync)",
                RuntimeWarning,
                stacklevel=2,
            )

    def _observe_batch(self) -> None:
        """The batch's compute time on this rank, to the rebalancer: once per batch, after it
        (collective every ``rebalance_every`` batches), from its first forward to its last
        gradient (see the class docstring on manual optimization)."""
        if self.rebalancer is not None and self._timer is not None:
            self.rebalancer.observe(self._local_batch, self._timer.pop())

    def teardown(self) -> None:
        if self._timer is not None:
            self._timer.remove()
            self._timer = None
        for handle in self._weightless_hooks:
            handle.remove()
        self._weightless_hooks = []
        super().teardown()
