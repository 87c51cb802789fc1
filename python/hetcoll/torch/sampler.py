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
*global* position in the epoch's permutation, i.e. the samples all ranks' steps handed out so
far. The permutation depends on the dataset length, seed and epoch only, so a restored sampler
continues from that position: with the same number of ranks it takes the saved shares back and
yields exactly the steps the original would have yielded next; with a different number of ranks
it keeps the shares it was built with (e.g. re-solved for the new ranks) and splits the rest of
the epoch with them, so the epoch still covers every sample exactly once. The position counts
whole steps as they leave the sampler: the steps a ``DataLoader`` has fetched, which with
``num_workers=0`` are the steps trained on.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Sampler

import hetcoll
from hetcoll.comm import agree, has_default, wrap


def _validate_shares(shares: Sequence[int], argument: str = "shares") -> list[int]:
    if isinstance(shares, (str, bytes)) or not hasattr(shares, "__iter__"):
        raise ValueError(f"{argument}: must be a sequence of positive integers, got {shares!r}")
    out = []
    for i, s in enumerate(shares):
        if isinstance(s, bool) or not hasattr(s, "__index__"):
            raise ValueError(f"{argument}[{i}]: must be a positive integer, got {s!r}")
        s = int(s.__index__())
        if s < 1:
            raise ValueError(f"{argument}[{i}]: must be a positive integer, got {s}")
        out.append(s)
    if not out:
        raise ValueError(f"{argument}: must not be empty")
    return out


def _verify(group: Any, shares: list[int], failure: BaseException | None = None) -> None:
    """Every rank checks that all ranks passed the same shares, one per rank of ``group``: a
    rank that disagrees would otherwise run a different number of steps and hang the others.
    One agreement (:func:`hetcoll.comm.agree`); a rank whose shares are invalid (``failure``)
    joins it, so that the others raise at once, and then raises its own error."""
    comm = wrap(group)
    fields = {"the number of shares": len(shares)}
    fields.update({f"shares[{i}]": int(v) for i, v in enumerate(shares)})
    agree(comm, fields, failure=failure)
    if len(shares) != comm.size:  # agreed: every rank raises it
        raise ValueError(f"shares: has {len(shares)} entries but the group has {comm.size} ranks")


class BalancedSampler(Sampler[int]):
    """Drop-in for ``DistributedSampler`` with uneven per-rank batch sizes.

    ``shares[r]`` is rank ``r``'s batch size per step (integers, e.g. from
    :func:`hetcoll.split` over measured speeds). Use it with
    ``DataLoader(dataset, batch_size=shares[rank], sampler=sampler)``, or pass
    ``sampler.batch_sampler()`` as ``batch_sampler=`` to let :meth:`set_shares` take effect at
    the next step instead of the next epoch.

    ``verify`` (default on) checks across the ranks of ``group``, here and in
    :meth:`set_shares`, that every rank passed the same shares, one per rank, and raises on
    every rank if not (one small all-gather, on
    torch.distributed or MPI). ``group``: an mpi4py communicator or a torch.distributed process
    group; None is :func:`hetcoll.comm.wrap`'s default (torch's default group, else
    ``MPI.COMM_WORLD`` under mpiexec), and with neither (one process) nothing is checked.

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
        self.group = group
        self.verify = bool(verify)
        try:
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
            try:
                self.num_samples_total = len(dataset)
            except TypeError as e:
                raise TypeError("dataset: must have a length (a map-style dataset)") from e
        except (TypeError, ValueError) as e:
            if self._checks():  # the other ranks raise too, at once
                _verify(group, [], failure=e)
            raise
        self.rank = rank
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        #: Global samples of this epoch's permutation handed out by the steps yielded so far.
        self.position = 0
        self._resume_at = 0  # where the next iteration starts (set by load_state_dict)
        if self._checks():
            _verify(group, self.shares)

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
        p = len(shares)
        padded = max(remaining, p)
        return hetcoll.split(padded, shares, minimum=1)

    def _steps(self, shares_of_step: Any) -> Iterator[list[int]]:
        """This rank's indices step by step; ``shares_of_step()`` is re-read at each step so that
        :meth:`set_shares` applies from the next step on."""
        perm = self._permutation()
        n = len(perm)
        pos, self._resume_at = self._resume_at, 0
        self.position = pos
        while pos < n:
            shares = shares_of_step()
            total = sum(shares)
            if n - pos >= total:
                sizes = shares
            else:
                last = self._last_step(n - pos, shares)
                if last is None:
                    self.position = n  # the dropped remainder: the epoch is over
                    return
                sizes = last
            start = pos + sum(sizes[: self.rank])
            idx = [perm[i % n] for i in range(start, start + sizes[self.rank])]
            pos += sum(sizes)
            self.position = min(pos, n)  # a padded last step ends the epoch
            yield idx

    def __iter__(self) -> Iterator[int]:
        shares = list(self.shares)  # fixed for the epoch: DataLoader batches by a fixed size
        for step in self._steps(lambda: shares):
            yield from step

    def batch_sampler(self) -> _BatchView:
        """An iterable of per-step index lists for ``DataLoader(batch_sampler=...)``; shares set
        with :meth:`set_shares` apply from the next step."""
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

    @property
    def batch_size(self) -> int:
        """This rank's batch size in a full step."""
        return self.shares[self.rank]

    def set_epoch(self, epoch: int) -> None:
        """Reseed the shuffle, as ``DistributedSampler.set_epoch``: call it on every rank. A
        position restored by :meth:`load_state_dict` holds for its own epoch only: setting
        another epoch starts that one from its beginning."""
        if int(epoch) != self.epoch:
            self._resume_at = 0
        self.epoch = int(epoch)

    def set_shares(self, shares: Sequence[int]) -> None:
        """New per-rank batch sizes (call on every rank with the same values, e.g. from a
        :class:`~hetcoll.torch.Rebalancer`). Checked across the ranks as at construction
        (``verify``): ranks that disagree raise :class:`hetcoll.CollectiveMismatchError`, all of
        them, and keep their old shares."""
        try:
            shares = _validate_shares(shares)
            if len(shares) != len(self.shares):
                raise ValueError(
                    f"shares: has {len(shares)} entries but the sampler has {len(self.shares)} "
                    "ranks"
                )
        except ValueError as e:
            if self._checks():  # the other ranks raise too, at once
                _verify(self.group, [], failure=e)
            raise
        if self._checks():
            _verify(self.group, shares)
        self.shares = shares

    def state_dict(self) -> dict[str, Any]:
        """Where this sampler is: epoch, seed, shares and the global position in the epoch (see
        the module docstring). Plain ints, lists and bools, for any checkpoint format."""
        return {
            "epoch": self.epoch,
            "seed": self.seed,
            "shares": list(self.shares),
            "position": self.position,
            "num_samples_total": self.num_samples_total,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (a :meth:`state_dict`): the next iteration yields what the
        saved sampler would have yielded next. Same number of ranks: the saved shares come back
        (call :meth:`set_shares` afterwards to change them). Another number of ranks: this
        sampler's own shares split the rest of the epoch. The dataset length, ``shuffle`` and
        ``drop_last`` must match the saved ones (the permutation depends on them)."""
        if not isinstance(state, dict):
            raise TypeError(f"state: must be a dict from state_dict(), got {type(state).__name__}")
        missing = [k for k in ("epoch", "seed", "shares", "position") if k not in state]
        if missing:
            raise ValueError(f"state: missing {missing} (not a BalancedSampler state_dict)")
        for key, mine in (
            ("num_samples_total", self.num_samples_total),
            ("shuffle", self.shuffle),
            ("drop_last", self.drop_last),
        ):
            if key in state and state[key] != mine:
                raise ValueError(f"state: {key} was {state[key]!r}, this sampler has {mine!r}")
        shares = _validate_shares(state["shares"], "state['shares']")
        position = state["position"]
        if (
            isinstance(position, bool)
            or not isinstance(position, int)
            or not 0 <= position <= self.num_samples_total
        ):
            raise ValueError(
                f"state['position']: must be an integer in [0, {self.num_samples_total}], "
                f"got {position!r}"
            )
        self.epoch = int(state["epoch"])
        self.seed = int(state["seed"])
        if len(shares) == len(self.shares):
            self.shares = shares
        # An epoch that had ended starts afresh at the next iteration, as the original would.
        self.position = position
        self._resume_at = position if position < self.num_samples_total else 0


class _BatchView:
    """Per-step index lists of a :class:`BalancedSampler`, honouring ``set_shares`` each step."""

    def __init__(self, sampler: BalancedSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[list[int]]:
        return self.sampler._steps(lambda: self.sampler.shares)

    def __len__(self) -> int:
        return len(self.sampler._plan_sizes())
