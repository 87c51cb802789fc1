"""BalancedSampler: each rank's batch is its share of every global step.

Per epoch a seeded permutation of the dataset is cut into global steps of ``B = sum(shares)``
consecutive indices; inside a step rank ``r`` takes the contiguous piece of length
``shares[r]`` that starts after the pieces of ranks ``0..r-1``. Every rank therefore runs the
same number of steps, with batch size equal to its share, and the union over ranks of one epoch
is the dataset exactly once.

The remainder (fewer than ``B`` samples left at the end of an epoch) is a last, smaller global
step split over the ranks in proportion to their shares with :func:`hetcoll.split` (each rank at
least one sample). When the remainder has fewer samples than there are ranks it is padded with
samples from the start of the epoch, as ``DistributedSampler`` pads, so no rank has an empty
step; ``drop_last=True`` drops the remainder instead.

Resuming (:meth:`BalancedSampler.state_dict` / :meth:`~BalancedSampler.load_state_dict`, the
convention of torchdata's stateful samplers): the state is the epoch, seed, shares and the
*global* position in the epoch's permutation, i.e. the samples of all ranks' steps that the
training loop has taken. A ``DataLoader`` fetches ahead of training (``num_workers`` workers
hold ``prefetch_factor`` steps each), so the sampler counts steps where they reach the loop:
the first time a loader iterator pulls a step it is recognised (its ``_index_sampler`` is this
sampler's batch view, or a batch sampler over this sampler), and the batches its ``__next__``
returns are counted; :meth:`~BalancedSampler.state_dict` taken after step ``k`` is trained
therefore resumes at step ``k + 1`` with any ``num_workers``, ``prefetch_factor`` and
``pin_memory``, inside the loop or after leaving it. Iterated directly (no loader), a step
counts when it is yielded. torchdata's ``StatefulDataLoader`` tracks consumption itself: it
snapshots what left the sampler (the batch view's own ``state_dict``) and its
``loader.state_dict()`` resumes exactly too. Out-of-order loaders (``in_order=False``) hand
steps out in another order than the sampler's and cannot be resumed by a position.

The permutation depends on the dataset length, seed and epoch only (a checkpoint of another
length, seed, ``shuffle`` or ``drop_last`` is refused, naming it), so a restored sampler
continues from that position: with the same number of ranks it takes the saved shares back
and yields exactly the steps the original would have yielded next; with a different number of
ranks it keeps the shares it was built with (e.g. re-solved for the new ranks) and splits the
rest of the epoch with them, so the epoch still covers every sample exactly once. With
``verify`` the ranks check that they restored the same epoch and position, and all raise if
not.

:meth:`BalancedSampler.whole_batches` builds the sampler of a job where every rank takes the
whole global batch, as a plan's :meth:`~hetcoll.torch.Parallel.step` does
(:meth:`~hetcoll.torch.Parallel.sampler`).
"""

from __future__ import annotations

import sys
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from types import FrameType
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, Sampler

import hetcoll
from hetcoll.comm import agree, group_argument, has_default, wrap
from hetcoll.torch.filters.checks import check_flag


def _positive_int(value: Any, argument: str) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__") or int(value.__index__()) < 1:
        raise ValueError(f"{argument}: must be a positive integer, got {value!r}")
    return int(value.__index__())


def _validate_shares(shares: Sequence[int], argument: str = "shares") -> list[int]:
    if isinstance(shares, (str, bytes, Mapping)) or not hasattr(shares, "__iter__"):
        # a dict's keys once read as the shares
        raise ValueError(f"{argument}: must be a sequence of positive integers, got {shares!r}")
    out = [_positive_int(s, f"{argument}[{i}]") for i, s in enumerate(shares)]
    if not out:
        raise ValueError(f"{argument}: must not be empty")
    return out


def _verify(
    group: Any,
    shares: list[int],
    failure: BaseException | None = None,
    *,
    whole: bool = False,
    also: dict[str, int] | None = None,
    values: Sequence[int] = (),
) -> np.ndarray:
    """Every rank checks that all ranks passed the same shares, one per rank of ``group`` (one,
    the global batch, when every rank takes the ``whole`` batch), and the same of ``also`` (the
    permutation's seed, shuffle, drop_last and the dataset's length: ranks that disagree there
    would take overlapping samples and leave others out, without a word): a rank that
    disagrees would otherwise run a different number of steps and hang the others. One
    agreement (:func:`hetcoll.comm.agree`); a rank whose shares are invalid (``failure``) joins
    it, so that the others raise at once, and then raises its own error. ``values``: integers
    that may differ per rank, returned for every rank (:func:`hetcoll.comm.agree`)."""
    comm = wrap(group)
    fields = {"the number of shares": len(shares)}
    fields.update({f"shares[{i}]": int(v) for i, v in enumerate(shares)})
    fields.update(also or {})
    got = agree(comm, fields, failure=failure, values=values)
    if not whole and len(shares) != comm.size:  # agreed: every rank raises it
        raise ValueError(f"shares: has {len(shares)} entries but the group has {comm.size} ranks")
    return got


#: The attribute of a DataLoader iterator that holds the :class:`_Progress` it counts into.
_PROGRESS = "_hetcoll_sampler_progress"

#: Epochs run from 0 below this (an epoch seeds its shuffle with ``seed + epoch``, which a
#: torch.Generator takes below 2**64).
MAX_EPOCH = 2**62
#: Per DataLoader iterator type, its subclass whose ``__next__`` counts the batches it returns.
_COUNTING: dict[type, type] = {}


def _counting_next(parent_next: Any) -> Any:
    """A ``__next__`` that calls ``parent_next`` and counts the batch it returns into the
    :class:`_Progress` the iterator carries: the batches handed to the training loop."""

    def __next__(self: Any) -> Any:
        batch = parent_next(self)
        progress = self.__dict__.get(_PROGRESS)
        if progress is not None:
            progress.taken += 1
        return batch

    return __next__


_COUNTING_CODE = _counting_next(None).__code__


def _counting_type(cls: type) -> type:
    """``cls`` with :func:`_counting_next` as its ``__next__`` (made once per type)."""
    if cls.__dict__.get("_hetcoll_counts_batches"):
        return cls
    sub = _COUNTING.get(cls)
    if sub is None:
        sub = type(
            cls.__name__,
            (cls,),
            {
                "__next__": _counting_next(cls.__next__),  # type: ignore[attr-defined]
                "_hetcoll_counts_batches": True,
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
            },
        )
        _COUNTING[cls] = sub
    return sub


def _before_ahead(taken: int, ahead: Any) -> int:
    """The steps the training loop has trained of the ``taken`` its loader handed out, when it
    holds ``ahead`` of them untrained; ``ValueError`` naming ``ahead`` where it is no count of
    those."""
    if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0:
        raise ValueError(f"ahead: must be an integer >= 0, got {ahead!r}")
    if ahead > taken:
        raise ValueError(f"ahead: {ahead}, but only {taken} steps of this epoch were taken")
    return taken - ahead


def _batch_size_failure(loader: Any, sampler: BalancedSampler) -> ValueError | None:
    """A loader batching this sampler's samples itself (``DataLoader(sampler=..., batch_size=B)``,
    maybe wrapped: :func:`_source`) must batch them by this rank's share, and drop a short last
    batch only where the sampler does: otherwise this rank's steps are cut elsewhere than the
    other ranks', which then run other numbers of steps and wait for each other. The error, or
    None."""
    source = _source(getattr(loader, "_index_sampler", None), sampler)
    batches = None if source is None else source[1]
    size = getattr(batches, "batch_size", None)
    if not isinstance(batches, BatchSampler):
        return None  # steps the sampler cut (its batch view)
    if size == sampler.batch_size:
        if batches.drop_last and not sampler.drop_last:
            # The epoch's last, smaller step: dropped on the ranks whose piece of it is short
            # of their share, run on the others (which then wait for them).
            return ValueError(
                "drop_last: the DataLoader drops a short last batch and the BalancedSampler "
                "does not, so ranks would run different numbers of steps; pass "
                "drop_last=True to BalancedSampler instead (or DataLoader(dataset, "
                "batch_sampler=sampler.batch_sampler()))"
            )
        return None
    return ValueError(
        f"batch_size: the DataLoader batches rank {sampler.rank}'s samples by {size}, but its "
        f"share of each global step is {sampler.batch_size}; the ranks would take steps of "
        "other sizes and numbers. Build it with DataLoader(dataset, "
        "batch_sampler=sampler.batch_sampler()) (new shares then apply from the next step), "
        "or batch_size=sampler.batch_size"
    )


def _source(index_sampler: Any, sampler: BalancedSampler) -> tuple[int, Any] | None:
    """Where a loader's index sampler pulls ``sampler``'s steps or samples (its batch view, a
    batch sampler over it, or batch samplers wrapping those: Accelerate's ``SkipBatchSampler``,
    which ``skip_first_batches`` and a resumed Trainer put around it): the steps the wrappers
    skip before the first they hand out (their ``skip_batches``), and the innermost one, which
    pulls from ``sampler`` itself. None where it does not."""
    skipped = 0
    for _ in range(4):
        if index_sampler is None:
            return None
        if getattr(index_sampler, "sampler", None) is sampler:
            return skipped, index_sampler
        n = getattr(index_sampler, "skip_batches", 0)
        skipped += n if isinstance(n, int) and not isinstance(n, bool) else 0
        index_sampler = getattr(index_sampler, "batch_sampler", None)
    return None


class _Progress:
    """One iteration over the sampler: where each step it yielded ends in the epoch's
    permutation, and how many of them the training loop has taken."""

    def __init__(self, start: int) -> None:
        #: ``ends[j]``: the global position after this iteration's first ``j`` steps.
        self.ends = [start]
        #: ``shares[j]``: the shares step ``j`` of this iteration was cut with.
        self.shares: list[list[int]] = []
        #: Batches the DataLoader iterator pulling the steps has returned (None: no loader,
        #: every yielded step is taken).
        self.taken: int | None = None
        self.loader: weakref.ref[Any] | None = None
        #: Steps the loader's batch sampler skips before the first it hands out (see
        #: :func:`_source`): yielded by this iteration, never taken.
        self.skipped = 0

    def attach(self, frame: FrameType | None, sampler: BalancedSampler) -> Any:
        """Find the DataLoader iterator that pulls the first step (a caller a few frames up,
        whose index sampler is this sampler's batch view or a batch sampler over the sampler)
        and count the batches it returns from now on. A loader without workers pulls the
        first step inside the ``__next__`` that returns it: that batch counts as taken.
        Returns the iterator (None: no loader found)."""
        it: Any = None
        plain_next = counting_next = False
        for _ in range(12):
            if frame is None:
                break
            caller = frame.f_locals.get("self")
            if it is None:
                source = _source(getattr(caller, "_index_sampler", None), sampler)
                if source is not None:
                    it = caller
                    self.skipped = source[0]
            if it is not None and caller is it and frame.f_code.co_name == "__next__":
                if frame.f_code is _COUNTING_CODE:
                    counting_next = True
                else:
                    plain_next = True
            frame = frame.f_back
        if it is None:
            return None
        try:
            it.__class__ = _counting_type(type(it))
            it.__dict__[_PROGRESS] = self
        except (TypeError, AttributeError):  # not a plain Python object: counted as yielded
            warnings.warn(
                f"BalancedSampler: cannot count the batches a {type(it).__name__} hands out; "
                "state_dict() counts the steps it fetched, ahead of training",
                RuntimeWarning,
                stacklevel=2,
            )
            return it
        self.loader = weakref.ref(it)
        self.taken = int(plain_next and not counting_next)
        return it

    def steps_taken(self) -> int:
        """Steps of this iteration the loader handed out (or yielded, without a loader)."""
        steps = len(self.ends) - 1 if self.taken is None else self.taken + self.skipped
        return min(steps, len(self.ends) - 1)

    def inside_loader(self) -> bool:
        """Whether the call comes from the loader iterator itself (torchdata's
        ``StatefulDataLoader`` snapshots its sampler as it pulls steps, and counts what it
        hands out itself)."""
        it = None if self.loader is None else self.loader()
        if it is None:
            return False
        frame: FrameType | None = sys._getframe(2)
        for _ in range(8):
            if frame is None:
                return False
            if frame.f_locals.get("self") is it:
                return True
            frame = frame.f_back
        return False


class BalancedSampler(Sampler[int]):
    """Drop-in for ``DistributedSampler`` with uneven per-rank batch sizes.

    ``shares[r]`` is rank ``r``'s batch size per step (integers, e.g. from
    :func:`hetcoll.split` over measured speeds). Use it with
    ``DataLoader(dataset, batch_size=shares[rank], sampler=sampler)`` (a loader batching by
    another size raises ``ValueError`` naming ``batch_size`` at its first batch), or pass
    ``sampler.batch_sampler()`` as ``batch_sampler=`` to let :meth:`set_shares` take effect at
    the next step instead of the next epoch.

    ``verify`` (default on) checks across the ranks of ``group``, here, in :meth:`set_shares`
    and in :meth:`load_state_dict`, that every rank passed the same shares, one per rank (and
    restored the same position), and when an iteration starts, that every rank starts the same
    epoch at the same position; it raises on every rank if not (one small all-gather, on
    torch.distributed or MPI; iterate on every rank, or pass ``verify=False``). ``group``: an
    mpi4py communicator or a torch.distributed process group; None is
    :func:`hetcoll.comm.wrap`'s default (torch's default group, else ``MPI.COMM_WORLD`` under
    mpiexec), and with neither (one process) nothing is checked.

    >>> s = BalancedSampler(range(10), [3, 1], rank=0, shuffle=False, verify=False)
    >>> list(s)
    [0, 1, 2, 4, 5, 6, 8]
    """

    def __init__(
        self,
        dataset: Any,
        shares: Sequence[int],
        rank: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        verify: bool = True,
        group: Any = None,
    ) -> None:
        self._init(dataset, shares, rank, shuffle, seed, drop_last, verify, group, whole=False)

    @classmethod
    def whole_batches(
        cls,
        dataset: Any,
        batch: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        verify: bool = True,
        group: Any = None,
    ) -> BalancedSampler:
        """A sampler that gives every rank the whole global batch of ``batch`` samples of each
        step (the same indices on every rank), for jobs whose ranks all take the global batch:
        a plan's :meth:`~hetcoll.torch.Parallel.step` (see
        :meth:`~hetcoll.torch.Parallel.sampler`). The epoch's order, the last smaller step,
        resuming and the checks across ``group`` are those of a :class:`BalancedSampler`; a
        restored state keeps this sampler's ``batch`` (the plan's), whatever batch saved it.

        >>> s = BalancedSampler.whole_batches(range(5), 2, shuffle=False, verify=False)
        >>> list(s.batch_sampler())
        [[0, 1], [2, 3], [4]]
        """
        self = cls.__new__(cls)
        self._init(dataset, [batch], 0, shuffle, seed, drop_last, verify, group, whole=True)
        return self

    def _init(
        self,
        dataset: Any,
        shares: Sequence[int],
        rank: int,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        verify: bool,
        group: Any,
        *,
        whole: bool,
    ) -> None:
        self.group = group_argument(group, "BalancedSampler")  # a str once stood as a group
        # A flag of another type is told to the others, as with verify=True, then raised.
        self.verify = verify if isinstance(verify, bool) else True
        #: Every rank takes the whole global batch (:meth:`whole_batches`).
        self.whole = whole
        try:
            # 'no' once shuffled, None dropped nothing
            shuffle, drop_last = check_flag(shuffle, "shuffle"), check_flag(drop_last, "drop_last")
            check_flag(verify, "verify")
            if isinstance(dataset, (str, bytes)) or (
                isinstance(dataset, Mapping) and not all(i in dataset for i in range(len(dataset)))
            ):  # its characters, or keys it does not have, once drawn as samples
                raise TypeError(
                    "dataset: must be a map-style dataset (indexed 0..len-1), got a "
                    f"{type(dataset).__name__}"
                )
            if whole:
                self.shares = [_positive_int(shares[0], "batch")]
            else:
                self.shares = _validate_shares(shares)
            if (
                isinstance(rank, bool)
                or not isinstance(rank, int)
                or not 0 <= rank < len(self.shares)
            ):
                raise ValueError(
                    f"rank: must be an integer in [0, {len(self.shares)}) (one share per rank), "
                    f"got {rank!r}"
                )
            if (
                isinstance(seed, bool)
                or not hasattr(seed, "__index__")
                or not -(2**63) <= seed.__index__() < 2**63
            ):  # each epoch seeds a torch.Generator with seed + epoch
                raise ValueError(f"seed: must be an integer in [-2**63, 2**63), got {seed!r}")
            try:
                self.num_samples_total = len(dataset)
            except TypeError as e:
                raise TypeError("dataset: must have a length (a map-style dataset)") from e
        except (TypeError, ValueError) as e:
            if self._checks():  # the other ranks raise too, at once (as many values as theirs)
                _verify(group, [], failure=e, whole=whole, values=[0])
            raise
        self.rank = rank
        self.shuffle = shuffle
        self.seed = int(seed.__index__())
        self.drop_last = drop_last
        self.epoch = 0
        #: Global samples of this epoch's permutation in the steps that have left the sampler
        #: (a DataLoader fetches ahead: :meth:`state_dict` counts the steps it handed out).
        self.position = 0
        self._resume_at = 0  # where the next iteration starts (set by load_state_dict)
        self._progress: _Progress | None = None  # the current iteration's steps
        self._padding_told = False  # warned once that a last step is padded
        # The switches set_shares made ahead of this rank's loader in the current iteration:
        # (global position it switched at, the shares before it), in order.
        self._earlier: tuple[_Progress, list[tuple[int, list[int]]]] | None = None
        if self._checks():
            also = {
                "seed": self.seed % (1 << 63),
                "shuffle": int(self.shuffle),
                "drop_last": int(self.drop_last),
                "the dataset's length": self.num_samples_total,
            }
            passed = _verify(group, self.shares, whole=whole, also=also, values=[rank])[:, 0]
            # Two ranks passing one rank would take the same samples, and leave others out.
            wrong = [q for q, r in enumerate(passed.tolist()) if r != q]
            if wrong and not whole:  # the same rows on every rank: every rank raises
                raise ValueError(
                    f"rank: the group's rank {wrong[0]} passed rank={int(passed[wrong[0]])}; "
                    "each rank passes its own rank in the group (torch.distributed.get_rank("
                    "group), comm.Get_rank())"
                )

    def _checks(self) -> bool:
        """Whether shares are checked across ranks: ``verify``, and a group to check on."""
        return self.verify and (self.group is not None or has_default())

    # -- the epoch plan ---------------------------------------------------------------------

    def _permutation(self) -> list[int]:
        n = self.num_samples_total
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=g).tolist()

    def _last_step(self, remaining: int, shares: list[int]) -> list[int] | None:
        """Per-rank sizes of the final, smaller step (None when it is dropped)."""
        if remaining == 0 or self.drop_last:
            return None
        if self.whole:
            return [remaining]
        p = len(shares)
        padded = max(remaining, p)
        return hetcoll.split(padded, shares, minimum=1)

    def _steps(self, shares_of_step: Any) -> Iterator[list[int]]:
        """This rank's indices step by step; ``shares_of_step(pos)`` is re-read at each step
        (starting at global position ``pos``) so that :meth:`set_shares` applies from the next
        step on."""
        perm = self._permutation()
        n = len(perm)
        pos, self._resume_at = self._resume_at, 0
        progress = _Progress(pos)
        # The caller of this first step: a DataLoader iterator counts what it hands out.
        failure = _batch_size_failure(progress.attach(sys._getframe(1), self), self)
        if self._checks():  # ranks that start elsewhere (one resumed, one not) would hang
            fields = {"the epoch": self.epoch, "the position it starts at": pos}
            # A rank batching by another size than its share: every rank raises, none waits.
            agree(wrap(self.group), fields, failure=failure)
        elif failure is not None:
            raise failure
        self.position = pos
        self._progress = progress
        while pos < n:
            shares = shares_of_step(pos)
            total = sum(shares)
            if n - pos >= total:
                sizes = shares
            else:
                last = self._last_step(n - pos, shares)
                if last is not None and sum(last) > n - pos and not self._padding_told:
                    self._padding_told = True
                    warnings.warn(
                        f"BalancedSampler: the epoch's last step holds {n - pos} samples for "
                        f"{len(shares)} ranks, and every rank needs one, so {sum(last) - n + pos} "
                        "are repeated from the epoch's start (as DistributedSampler pads): that "
                        "step's gradient is not one process's. drop_last=True drops it; a "
                        "global batch that leaves at least one sample per rank avoids it",
                        stacklevel=2,
                    )
                if last is None:
                    # The dropped remainder: the epoch is over once the last step is taken.
                    self.position = progress.ends[-1] = n
                    return
                sizes = last
            start = pos + sum(sizes[: self.rank])
            idx = [perm[i % n] for i in range(start, start + sizes[self.rank])]
            pos += sum(sizes)
            self.position = min(pos, n)  # a padded last step ends the epoch
            progress.ends.append(self.position)
            same = progress.shares and progress.shares[-1] == shares
            progress.shares.append(progress.shares[-1] if same else list(shares))
            yield idx

    def __iter__(self) -> Iterator[int]:
        shares = list(self.shares)  # fixed for the epoch: DataLoader batches by a fixed size
        for step in self._steps(lambda _: shares):
            yield from step

    def batch_sampler(self) -> _BatchView:
        """An iterable of per-step index lists for ``DataLoader(batch_sampler=...)``; shares set
        with :meth:`set_shares` apply from the next step the loader fetches (with
        ``num_workers > 0`` its workers prefetch ``prefetch_factor`` steps each, which keep the
        shares they were cut with). Ranks whose loaders fetch ahead by different numbers of
        steps (other ``num_workers``) still switch at the same step: the first one no rank
        had fetched (with ``verify``; without it, give every rank the same loader settings)."""
        return _BatchView(self)

    def __len__(self) -> int:
        """Samples this rank draws in one epoch (at the current shares)."""
        return sum(len(s) for s in self._plan_sizes())

    def _plan_sizes(self, start: int | None = None) -> list[range]:
        """This rank's step sizes from ``start`` (None: where the next iteration starts, 0 or a
        restored position) to the end of the epoch."""
        start = self._resume_at if start is None else start
        n, total = self.num_samples_total - start, sum(self.shares)
        full, rem = divmod(n, total)
        sizes = [range(self.shares[self.rank])] * full
        last = self._last_step(rem, self.shares)
        if last is not None:
            sizes.append(range(last[self.rank]))
        return sizes

    @property
    def steps_per_epoch(self) -> int:
        """Global steps in one whole epoch (the same on every rank; ``len(batch_sampler())``
        counts those of the next iteration, fewer after :meth:`load_state_dict` mid-epoch)."""
        return len(self._plan_sizes(0))

    def taken_shares(self, *, ahead: int = 0) -> list[int]:
        """The shares the step the training loop took last (the one its loader handed out last)
        was cut with, for logging: :attr:`shares` may be newer, :meth:`set_shares` applying
        from a later step. (An epoch's last, smaller step is cut from them into fewer samples.)
        Before any step of the epoch is taken, :attr:`shares`.

        ``ahead``: batches the loop holds but has not trained yet (Accelerate's
        ``DataLoaderShard`` holds the next one until the epoch's last), as in
        :meth:`state_dict`: the step before those."""
        progress = self._progress
        taken = _before_ahead(0 if progress is None else progress.steps_taken(), ahead)
        if progress is None or taken == 0:
            return list(self.shares)
        return list(progress.shares[taken - 1])

    def feeds(self, batch_sampler: Any) -> bool:
        """Whether ``batch_sampler`` (a ``DataLoader``'s) yields this sampler's steps: its
        :meth:`batch_sampler` view, a ``BatchSampler`` over it, or samplers wrapping those
        (Accelerate's ``SkipBatchSampler``)."""
        return _source(batch_sampler, self) is not None

    @property
    def batch_size(self) -> int:
        """This rank's batch size in a full step."""
        return self.shares[self.rank]

    def set_epoch(self, epoch: int) -> None:
        """Reseed the shuffle, as ``DistributedSampler.set_epoch``: call it on every rank. A
        position restored by :meth:`load_state_dict` holds for its own epoch only: setting
        another epoch starts that one from its beginning."""
        if (
            isinstance(epoch, bool)
            or not hasattr(epoch, "__index__")
            or not 0 <= epoch.__index__() < MAX_EPOCH
        ):  # what load_state_dict reads back, and a seed + epoch torch.Generator takes
            raise ValueError(f"epoch: must be an integer in [0, 2**62), got {epoch!r}")
        epoch = epoch.__index__()
        if epoch != self.epoch:
            self._resume_at = 0
            self.position = 0
            self._progress = None
        self.epoch = epoch

    def set_shares(self, shares: Sequence[int]) -> None:
        """New per-rank batch sizes (call on every rank with the same values, e.g. from a
        :class:`~hetcoll.torch.Rebalancer`). Checked across the ranks as at construction
        (``verify``): ranks that disagree raise :class:`hetcoll.CollectiveMismatchError`, all of
        them, and keep their old shares. The new shares apply from the first step that no
        rank's loader has fetched yet (the same step on every rank, however far each loader
        fetches ahead)."""
        try:
            shares = _validate_shares(shares)
            if len(shares) != len(self.shares):
                raise ValueError(
                    f"shares: has {len(shares)} entries but the sampler has {len(self.shares)} "
                    "ranks"
                )
        except ValueError as e:
            if self._checks():  # the other ranks raise too, at once (as many values as theirs)
                _verify(self.group, [], failure=e, whole=self.whole, values=[self.position])
            raise
        # Loaders fetch ahead (workers prefetch steps cut at the old shares), by as many steps
        # as their num_workers and prefetch_factor say: the new shares apply from the first step
        # no rank has cut yet, every rank cutting the steps before it at the old shares.
        switch = self.position
        if self._checks():
            cut = _verify(self.group, shares, whole=self.whole, values=[self.position])
            switch = int(cut[:, 0].max())
        if self._progress is not None and switch > self.position:
            # Every switch this loader has not reached is kept: a second change before the
            # first one's switch (the loaders of other ranks fetching further ahead) must not
            # move the steps before it to the middle shares.
            earlier = self._earlier
            kept = earlier[1] if earlier is not None and earlier[0] is self._progress else []
            self._earlier = (self._progress, [*kept, (switch, list(self.shares))])
        self.shares = shares

    def _shares_at(self, pos: int) -> list[int]:
        """The shares of the step starting at global position ``pos`` of the current
        iteration: the old ones before the step :meth:`set_shares` switched at."""
        earlier = self._earlier
        if earlier is not None and earlier[0] is self._progress:
            switches = earlier[1]  # in order; pos only grows in an iteration: drop those passed
            while switches and switches[0][0] <= pos:
                switches.pop(0)
            if switches:
                return switches[0][1]
        return list(self.shares)

    def state_dict(self, *, ahead: int = 0) -> dict[str, Any]:
        """Where this sampler is: epoch, seed, shares and the global position in the epoch after
        the steps the training loop has taken (see the module docstring: with a ``DataLoader``
        the batches it handed out, whatever it fetched ahead). Plain ints, lists and bools, for
        any checkpoint format. Local: any rank's state is the job's.

        ``ahead``: batches the loop itself has taken from the loader but not trained yet, for a
        loop that fetches ahead of training (Accelerate's ``DataLoaderShard`` holds the next
        batch): the position leaves them out.
        """
        progress = self._progress
        if progress is None or progress.inside_loader():
            _before_ahead(0, ahead)
            return self._state(self.position)  # what left (a stateful loader counts the rest)
        return self._state(progress.ends[_before_ahead(progress.steps_taken(), ahead)])

    def _state(self, position: int) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "seed": self.seed,
            "shares": list(self.shares),
            "position": position,
            "num_samples_total": self.num_samples_total,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (a :meth:`state_dict`): the next iteration yields what the
        saved sampler's training loop would have taken next. Same number of ranks: the saved
        shares come back (call :meth:`set_shares` afterwards to change them). Another number of
        ranks: this sampler's own shares split the rest of the epoch. The dataset's length,
        ``shuffle``, ``seed`` and ``drop_last`` must be the saved ones (the permutation depends
        on them): another raises ``ValueError`` naming it. With ``verify``, collective: the
        ranks check that they restored the same epoch, position and shares, and all raise
        :class:`hetcoll.CollectiveMismatchError` if not (a rank whose state is bad raises its
        own error, the others the mismatch)."""
        try:
            epoch, position, shares = self._check_state(state)
        except (TypeError, ValueError) as e:
            if self._checks():
                agree(wrap(self.group), {}, failure=e)
            raise
        same_ranks = not self.whole and len(shares) == len(self.shares)
        restored = shares if same_ranks else self.shares
        if self._checks():
            fields = {"the restored epoch": epoch, "the restored position": position}
            fields.update({f"the restored shares[{i}]": v for i, v in enumerate(restored)})
            agree(wrap(self.group), fields)
        self.epoch = epoch
        self.shares = restored
        # An epoch that had ended starts afresh at the next iteration, as the original would.
        self.position = position
        self._resume_at = position if position < self.num_samples_total else 0
        self._progress = None

    def _check_state(self, state: Any) -> tuple[int, int, list[int]]:
        """The epoch, position and shares of ``state``, checked against this sampler."""
        if not isinstance(state, dict):
            raise TypeError(f"state: must be a dict from state_dict(), got {type(state).__name__}")
        missing = [k for k in ("epoch", "seed", "shares", "position") if k not in state]
        if missing:
            raise ValueError(f"state: missing {missing} (not a BalancedSampler state_dict)")
        theirs = state.get("num_samples_total", self.num_samples_total)
        if theirs != self.num_samples_total:
            raise ValueError(
                f"dataset: has {self.num_samples_total} samples but the checkpoint's sampler had "
                f"{theirs!r} (state['num_samples_total']): its position indexes the order of "
                "another dataset"
            )
        for key, mine in (
            ("seed", self.seed),
            ("shuffle", self.shuffle),
            ("drop_last", self.drop_last),
        ):
            if key in state and state[key] != mine:
                raise ValueError(
                    f"{key}: is {mine!r} but the checkpoint's sampler had {key}={state[key]!r} "
                    f"(state[{key!r}]); the epoch's order depends on it: build the sampler with "
                    f"{key}={state[key]!r} to resume from this checkpoint"
                )
        shares = _validate_shares(state["shares"], "state['shares']")
        position, epoch = state["position"], state["epoch"]
        if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch < MAX_EPOCH:
            raise ValueError(f"state['epoch']: must be an integer in [0, 2**62), got {epoch!r}")
        if (
            isinstance(position, bool)
            or not isinstance(position, int)
            or not 0 <= position <= self.num_samples_total
        ):
            raise ValueError(
                f"state['position']: must be an integer in [0, {self.num_samples_total}], "
                f"got {position!r}"
            )
        return epoch, position, shares


class _BatchView:
    """Per-step index lists of a :class:`BalancedSampler`, honouring ``set_shares`` each step.
    Its own ``state_dict`` / ``load_state_dict`` (torchdata's ``Stateful``) hold the position of
    the steps that left it: a stateful loader (``StatefulDataLoader``) snapshots it as it pulls
    steps and counts the ones it hands out itself."""

    def __init__(self, sampler: BalancedSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[list[int]]:
        return self.sampler._steps(self.sampler._shares_at)

    def __len__(self) -> int:
        return len(self.sampler._plan_sizes())

    def state_dict(self) -> dict[str, Any]:
        return self.sampler._state(self.sampler.position)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
