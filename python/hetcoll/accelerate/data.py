"""The training data of an Accelerate job, balanced: each rank takes its share of every global
batch, and Accelerate places the batches on the device without re-sharding them.

``accelerator.prepare(loader)`` shards a loader's batches across processes: it wraps the batch
sampler in a ``BatchSamplerShard`` that hands rank ``r`` every ``P``-th batch (``split_batches``
and ``even_batches`` only choose how). A :class:`~hetcoll.torch.BalancedSampler` already gives
each rank its own batch of every step, so :func:`prepare_balanced` builds the loader around the
sampler's per-step view and prepares it as one process's loader
(``accelerate.data_loader.prepare_data_loader`` with ``num_processes=1``): Accelerate still
moves the batches to the device, tracks the end of the epoch for gradient accumulation and
forwards ``set_epoch``, and each rank keeps the batches its sampler chose.
"""

from __future__ import annotations

import copy
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from accelerate.state import GradientState
from accelerate.utils import tqdm as accelerate_tqdm
from torch import nn
from torch.utils.data import DataLoader

import hetcoll
from hetcoll.torch import BalancedSampler, SpeedFit, measure_speed
from hetcoll.torch.filters.checks import is_int


def processes(accelerator: Accelerator, fix: str = "Accelerator(cpu=True)") -> tuple[int, int]:
    """``accelerator``'s processes and this one's index, checked against torch.distributed's
    group: under torchrun on a host without GPUs, Accelerate initialises torch.distributed on
    every rank yet runs as one process unless told to use the CPU (``fix``, said in the
    error), and every rank would then take the whole batch for its own."""
    import torch.distributed as dist

    ranks = accelerator.num_processes
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() != ranks:
        raise ValueError(
            f"accelerator: Accelerate runs {ranks} process(es) but torch.distributed has "
            f"{dist.get_world_size()} ranks (torchrun on a host without GPUs?): pass {fix}"
        )
    return ranks, accelerator.process_index


def positive_numbers(values: Any, argument: str, kind: type) -> list[Any]:
    """``values`` checked: a non-empty sequence of numbers > 0 (integers when ``kind`` is
    int), as ``kind``; ``ValueError`` naming ``argument`` (and the entry) otherwise."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{argument}: must be a sequence of positive numbers, got {values!r}")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"{argument}[{i}]: must be a positive number, got {v!r}")
        if kind is int and (not float(v).is_integer()):
            raise ValueError(f"{argument}[{i}]: must be a positive integer, got {v!r}")
        out.append(kind(v))
    if not out:
        raise ValueError(f"{argument}: must not be empty")
    return out


def balanced_shares(
    total: int,
    ranks: int,
    *,
    shares: Sequence[int] | None = None,
    speeds: Sequence[float] | None = None,
    fits: Sequence[SpeedFit] | None = None,
) -> list[int]:
    """Each rank's samples of a global batch of ``total``: ``shares`` as given (one per rank,
    summing to ``total``); split from relative ``speeds``; or from every rank's measured
    :class:`~hetcoll.torch.SpeedFit` (``gather_speeds(measure_speed(...))``), with their fixed
    costs and memory capacities (:func:`hetcoll.split`); none of them: equal shares. Every rank
    gets at least one sample. Bad input raises ``ValueError`` naming the argument."""
    return _balanced_shares(total, ranks, shares, speeds, fits, "total")


def _balanced_shares(
    total: int,
    ranks: int,
    shares: Sequence[int] | None,
    speeds: Sequence[float] | None,
    fits: Sequence[SpeedFit] | None,
    argument: str,
) -> list[int]:
    """:func:`balanced_shares`, naming ``total`` as its caller's ``argument``."""
    if not is_int(total) or total < 1:
        raise ValueError(f"{argument}: must be an integer >= 1 (the global batch), got {total!r}")
    if not is_int(ranks) or ranks < 1:
        raise ValueError(f"ranks: must be an integer >= 1, got {ranks!r}")
    total, ranks = int(total), int(ranks)
    given = [
        n for n, v in (("shares", shares), ("speeds", speeds), ("fits", fits)) if v is not None
    ]
    if len(given) > 1:
        raise ValueError(f"{given[1]}: give at most one of shares, speeds, fits")
    if shares is not None:
        out = positive_numbers(shares, "shares", int)
        if len(out) != ranks:
            raise ValueError(f"shares: has {len(out)} entries for {ranks} ranks")
        if sum(out) != total:
            raise ValueError(f"shares: sum to {sum(out)}, but the global batch is {total}")
        return out
    if total < ranks:
        raise ValueError(
            f"{argument}: the global batch ({total}) is smaller than the number of ranks ({ranks})"
        )
    if speeds is not None:
        relative = positive_numbers(speeds, "speeds", float)
        if len(relative) != ranks:
            raise ValueError(f"speeds: has {len(relative)} entries for {ranks} ranks")
        return hetcoll.split(total, relative, minimum=1)
    if fits is not None:
        fits = list(fits)
        if len(fits) != ranks or not all(isinstance(f, SpeedFit) for f in fits):
            raise ValueError(f"fits: must be {ranks} SpeedFit (gather_speeds), got {fits!r}")
        caps = [total if f.capacity is None else max(1, min(f.capacity, total)) for f in fits]
        return hetcoll.split(
            total,
            [f.samples_per_s for f in fits],
            latency=[f.latency_s for f in fits],
            capacity=caps,
            minimum=1,
        )
    return hetcoll.split(total, [1.0] * ranks, minimum=1)


class _LossOf(nn.Module):
    """A model that takes keyword batches and returns an output with ``.loss`` (Hugging Face's
    convention), as a module of one batch returning the loss, for the speed probe."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: dict[str, Any]) -> torch.Tensor:
        out = self.model(**batch)
        loss = out["loss"] if isinstance(out, dict) else out[0]
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                "model: must return its loss (an output with .loss, or a tuple led by it) when "
                f"called on a batch with labels, got {type(out).__name__}"
            )
        return loss


def measure_model_speed(
    model: nn.Module,
    dataset: Any,
    collate_fn: Callable[[list[Any]], Any],
    batch_size: int,
    *,
    device: torch.device | str = "cpu",
    time_budget: float = 10.0,
) -> SpeedFit:
    """This rank's training speed for a model called on keyword batches that returns its loss
    (``model(**batch).loss``, Hugging Face's convention): forward and backward of a copy of
    ``model`` timed on the dataset's first samples collated by ``collate_fn``, at a few batch
    sizes up to ``batch_size`` (the global batch), with :func:`hetcoll.torch.measure_speed`
    (its capacity counted too). Exchange the ranks' fits with
    :func:`hetcoll.torch.gather_speeds` and pass them as ``fits=``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: must be an integer >= 1, got {batch_size!r}")
    n = len(dataset)
    if n < 1:
        raise ValueError("dataset: is empty")

    def make_batch(b: int) -> tuple[Any, None]:
        batch = collate_fn([dataset[i % n] for i in range(b)])
        return {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}, None

    sizes = sorted({max(1, batch_size // 4), max(1, batch_size // 2), batch_size})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a flat probe: its own upper estimate
        return measure_speed(
            _LossOf(model),
            make_batch,
            lambda loss, _: loss,
            batch_sizes=sizes,
            time_budget=time_budget,
            probe_memory=True,
        )


class BalancedLoader:
    """The training loader of one rank of a balanced Accelerate job (from
    :func:`prepare_balanced`): iterate it as the prepared ``DataLoader`` it holds (``loader``),
    call :meth:`set_epoch` every epoch. ``sampler`` is its :class:`~hetcoll.torch.BalancedSampler`
    (``state_dict`` / ``load_state_dict`` to resume), ``fits`` every rank's measured speed when
    the shares came from one, ``speeds`` every rank's speed as known (samples/s when measured;
    the relative speeds given; else None)."""

    def __init__(
        self,
        loader: DataLoader,
        sampler: BalancedSampler,
        speeds: list[float] | None,
        fits: list[SpeedFit] | None,
    ) -> None:
        self.loader = loader
        self.sampler = sampler
        self.speeds = speeds
        self.fits = fits

    @property
    def shares(self) -> list[int]:
        """Every rank's samples per step, now (from the next step the loader cuts; see
        :meth:`taken_shares`)."""
        return list(self.sampler.shares)

    def taken_shares(self) -> list[int]:
        """Every rank's samples in the step the loop took last, for logging: the shares it was
        cut with (:meth:`hetcoll.torch.BalancedSampler.taken_shares`; new shares set by a
        rebalancer apply from a later step). Accelerate's loader holds the batch after the one
        it hands out, until the epoch's last: that one is left out."""
        return self.sampler.taken_shares(ahead=self._held())

    def _held(self) -> int:
        """Batches Accelerate's loader over this sampler holds beyond those it handed out: the
        one after, while it iterates and before the epoch's last (0 where no such loader
        iterates: another loader, an evaluation's, may be Accelerate's active one)."""
        for shard in reversed(GradientState().dataloader_references):
            if shard is not None and self.sampler.feeds(getattr(shard, "batch_sampler", None)):
                return int(not shard.end_of_dataloader)
        return 0

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        """The epoch's shuffle (every rank, every epoch, before iterating)."""
        self.loader.set_epoch(epoch)  # type: ignore[attr-defined]

    def log_entries(self) -> dict[str, float]:
        """``share/r`` for every rank and, when known, ``speed/r``: for a logger."""
        out = {f"share/{r}": float(s) for r, s in enumerate(self.taken_shares())}
        if self.speeds is not None:
            out.update({f"speed/{r}": float(v) for r, v in enumerate(self.speeds)})
        return out

    def postfix(self) -> dict[str, str]:
        """The shares and speeds as a progress bar's postfix (``bar.set_postfix(...)``):
        ``{"shares": "5:3", "speeds": "120:40 samples/s"}``."""
        out = {"shares": ":".join(str(s) for s in self.taken_shares())}
        if self.speeds is not None:
            unit = " samples/s" if self.fits is not None else " (relative)"
            out["speeds"] = ":".join(f"{v:.3g}" for v in self.speeds) + unit
        return out

    def progress(self, desc: str | None = None, **tqdm_kwargs: Any) -> Any:
        """Accelerate's ``tqdm`` over this loader (shown on the main process only), the shares
        and speeds in its postfix."""
        tqdm_kwargs.setdefault("file", sys.stderr)
        bar = accelerate_tqdm(self.loader, desc=desc, **tqdm_kwargs)
        bar.set_postfix(self.postfix(), refresh=False)
        return bar


def prepare_balanced(
    accelerator: Accelerator,
    dataset: Any,
    batch_size: int,
    *,
    shares: Sequence[int] | None = None,
    speeds: Sequence[float] | None = None,
    fits: Sequence[SpeedFit] | None = None,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    **loader_kwargs: Any,
) -> BalancedLoader:
    """A balanced training loader for ``accelerator``'s process: every global batch of
    ``batch_size`` samples (the dataset's seeded permutation cut in order, as one process would
    draw it: :class:`~hetcoll.torch.BalancedSampler`) split among the ranks by ``shares``,
    ``speeds`` or measured ``fits`` (:func:`balanced_shares`), this rank taking its share. The
    batches come on ``accelerator.device``; Accelerate does not re-shard them (see the module
    docstring). Call it on every rank with the same arguments: the shares are checked across
    them. ``loader_kwargs`` go to ``DataLoader`` (``collate_fn``, ``num_workers``,
    ``pin_memory``...; not ``batch_size``, ``sampler``, ``shuffle`` or ``batch_sampler``).

    Weigh each step by its items (:func:`step_items`) when the loss is a mean over tokens.
    """
    if not isinstance(accelerator, Accelerator):
        raise TypeError(
            f"accelerator: must be an accelerate.Accelerator, got {type(accelerator).__name__}"
        )
    for name in ("sampler", "batch_sampler", "shuffle", "batch_size"):
        if name in loader_kwargs:
            raise TypeError(f"{name}: prepare_balanced makes the loader's sampler itself")
    ranks, rank = processes(accelerator)
    chosen = _balanced_shares(batch_size, ranks, shares, speeds, fits, "batch_size")
    sampler = BalancedSampler(
        dataset, chosen, rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    loader = DataLoader(dataset, batch_sampler=sampler.batch_sampler(), **loader_kwargs)
    prepared = prepare_data_loader(
        loader,
        accelerator.device,
        num_processes=1,  # the sampler already chose this rank's batch of every step
        process_index=0,
        put_on_device=accelerator.device_placement,
        non_blocking=accelerator.non_blocking,
        use_stateful_dataloader=accelerator.use_stateful_dataloader,
    )
    fit_list = None if fits is None else list(fits)
    known: list[float] | None = None
    if fit_list is not None:
        known = [f.samples_per_s for f in fit_list]
    elif speeds is not None:
        known = [float(v) for v in speeds]
    return BalancedLoader(prepared, sampler, known, copy.copy(fit_list))
