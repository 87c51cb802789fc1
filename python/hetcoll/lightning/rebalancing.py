"""Rebalancing: a Lightning callback that keeps a ``BalancedSampler``'s shares at the ranks'
measured speeds under a strategy whose training loader is the user's own.

:class:`~hetcoll.lightning.BalancedStrategy` rebalances by itself (``rebalance_every``).
Other strategies (``ModelParallelStrategy``, FSDP2 in ``configure_model``; DDP with the
weighting on the loss) train from a loader the user built on a
:class:`~hetcoll.torch.BalancedSampler` (``Trainer(use_distributed_sampler=False)``). This
callback times each training batch's compute on the rank with a
:class:`~hetcoll.torch.StepTimer` made when training starts (after ``configure_model`` has
sharded the model, so FSDP's gathers and reduce-scatters are left out of each batch's time)
and feeds it, with the batch's rows, to the user's :class:`~hetcoll.torch.Rebalancer`, whose
new shares the sampler applies from the next batch no rank's loader has cut. The
rebalancer's state rides in Lightning's checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from hetcoll.torch import Rebalancer, StepTimer
from hetcoll.torch.batches import loader_rows


class Rebalancing(Callback):
    """Feed ``rebalancer`` (a :class:`~hetcoll.torch.Rebalancer` over the training loader's
    ``BalancedSampler``) each training batch's rows and this rank's compute time for it (a
    :class:`~hetcoll.torch.StepTimer` on the LightningModule, made when training starts).
    Every rank gets the callback; every ``rebalancer.every`` batches the ranks decide together
    (under gradient accumulation each batch is a micro-batch: count ``every`` in them).

    ``rows``: a function of the batch giving the samples it holds (None: the batch's first
    tensor's length, or its list's, as the sampler cut them).

    >>> sampler = BalancedSampler(dataset, shares, rank)  # doctest: +SKIP
    >>> loader = DataLoader(dataset, batch_sampler=sampler.batch_sampler())  # doctest: +SKIP
    >>> trainer = Trainer(strategy=ModelParallelStrategy(), use_distributed_sampler=False,
    ...                   callbacks=[Rebalancing(Rebalancer(sampler, every=10))])  # doctest: +SKIP

    The timer starts a batch at the first forward of the LightningModule or of a module
    directly inside it (``self.model``): a ``training_step`` that calls only modules deeper
    down raises ``RuntimeError`` naming this. Not with
    :class:`~hetcoll.lightning.BalancedStrategy`, which rebalances its own loader
    (``rebalance_every``): ``ValueError`` when training starts. A model whose steps the timer
    cannot separate from the other ranks' (FSDP1, DeepSpeed ZeRO-3, tensor parallelism)
    raises the timer's ``ValueError`` then. A ``self.log(..., sync_dist=True)`` in
    ``training_step`` waits for the other ranks inside the batch and counts as compute.
    """

    def __init__(self, rebalancer: Rebalancer, *, rows: Callable[[Any], int] | None = None) -> None:
        if not isinstance(rebalancer, Rebalancer):
            raise TypeError(
                f"rebalancer: must be a hetcoll.torch.Rebalancer, got {type(rebalancer).__name__}"
            )
        if rows is not None and not callable(rows):
            raise TypeError(f"rows: must be a function of the batch, got {type(rows).__name__}")
        #: The rebalancer fed.
        self.rebalancer = rebalancer
        self.rows = rows
        self._timer: StepTimer | None = None
        self._restored: dict[str, Any] | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from hetcoll.lightning.strategy import BalancedStrategy

        if isinstance(trainer.strategy, BalancedStrategy):
            raise ValueError(
                "rebalancer: BalancedStrategy rebalances its own loader; give it "
                "rebalance_every= instead of a Rebalancing callback"
            )
        if self._restored is not None:  # Lightning restores callbacks before training starts
            self.rebalancer.load_state_dict(self._restored)
            self._restored = None
        self._timer = StepTimer(pl_module)  # the model as it trains: sharded, wrapped

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        if self._timer is None:
            return
        rows = loader_rows(batch, "batch") if self.rows is None else self.rows(batch)
        try:
            seconds = self._timer.pop()
        except RuntimeError as e:
            raise RuntimeError(
                f"Rebalancing: {e}. The timer starts a batch at the first forward of the "
                "LightningModule or of a module directly inside it: training_step must call "
                "one of them"
            ) from e
        self.rebalancer.observe(rows, seconds)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._timer is not None:
            self._timer.remove()
            self._timer = None

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        self.on_train_end(trainer, pl_module)  # the timer's hooks off the model

    def state_dict(self) -> dict[str, Any]:
        return {"rebalancer": self.rebalancer.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = state_dict.get("rebalancer")
