"""Argument checks of the filter-parallel layers and converter, and the resolution of speeds
into channel shares (:func:`hetcoll.split`). All local: they run before any collective, so bad
input raises on every rank instead of leaving the ranks' collectives mismatched."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np
from torch import nn

import hetcoll
from hetcoll.comm import deadline

#: The modes a split layer runs in (:mod:`hetcoll.torch.filters` says what each does).
MODES = ("gather", "split-output", "split-input")


def is_int(x: object) -> bool:
    """An int or numpy integer, booleans excluded."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def speeds_argument(speeds: object, argument: str = "speeds") -> list[float]:
    """``speeds`` as floats: a sequence (or 1-D array) of finite real numbers, each entry
    named alone where it is not one (a list's repr can be 10**5000's); the one check of speeds
    for the filter-parallel layers and converter. A dict's keys or a string's characters were
    once read as speeds, and ``5`` failed at ``len``. Their count and signs are
    :func:`speeds_to_shares`' to check (:func:`hetcoll.split`'s rule)."""
    if isinstance(speeds, np.ndarray) and speeds.ndim != 1:
        raise TypeError(f"{argument}: must be a sequence of numbers, got a {speeds.ndim}-D array")
    if isinstance(speeds, (str, bytes)) or not isinstance(speeds, (Sequence, np.ndarray)):
        raise TypeError(f"{argument}: must be a sequence of numbers, got {type(speeds).__name__}")
    rates = []
    for i, s in enumerate(speeds):
        if isinstance(s, (bool, np.bool_)):
            raise TypeError(f"{argument}: booleans are not speeds, got {s!r} (entry {i})")
        if not isinstance(s, numbers.Real):
            raise TypeError(f"{argument}: must be a sequence of numbers, got {s!r} (entry {i})")
        try:
            rate = float(s)
        except OverflowError:  # an int past float's range (10**400)
            raise ValueError(
                f"{argument}: must be finite numbers, got an integer past float's range (entry {i})"
            ) from None
        if not math.isfinite(rate):
            raise ValueError(f"{argument}: must be finite numbers, got {s!r} (entry {i})")
        rates.append(rate)
    return rates


def check_module(value: object, argument: str = "model") -> None:
    """``value`` a torch module; ``TypeError`` naming ``argument`` otherwise (None once
    reached ``.named_modules()`` inside, an AttributeError naming nothing)."""
    if not isinstance(value, nn.Module):
        raise TypeError(f"{argument}: must be a torch.nn.Module, got {type(value).__name__}")


def check_shares(
    shares: object, total: int, size: int, argument: str, what: str, *, empty: bool = False
) -> list[int]:
    """``shares`` as a list of positive ints (non-negative with ``empty``, some rank's
    positive), one per rank, summing to ``total``."""
    if isinstance(shares, (str, bytes)) or not isinstance(shares, Sequence):
        raise TypeError(f"{argument}: must be a sequence of integers, got {type(shares).__name__}")
    if not all(is_int(s) for s in shares):
        raise TypeError(f"{argument}: shares must be integers, got {list(shares)!r}")
    out = [int(s) for s in shares]
    if len(out) != size:
        raise ValueError(
            f"{argument}: has {len(out)} shares but the group has {size} ranks (one per rank)"
        )
    for r, s in enumerate(out):
        if s < 0 or (s == 0 and not empty):
            raise ValueError(
                f"{argument}: rank {r} has a share of {s}; "
                + ("none can be negative" if empty else "every rank needs at least one channel")
            )
    if sum(out) != total:
        raise ValueError(f"{argument}: shares sum to {sum(out)} but {what} has {total} channels")
    return out


def speeds_to_shares(
    speeds: Sequence[Any],
    total: int,
    size: int,
    multiple_of: int,
    argument: str,
    what: str,
    *,
    empty: bool = False,
    latency: Sequence[float] | None = None,
) -> list[int]:
    """``total`` channels split over ``size`` ranks in proportion to ``speeds``
    (:func:`hetcoll.split`, in multiples of ``multiple_of``, at least one multiple each unless
    ``empty``; ``latency``: each rank's work beside its channels, as :func:`hetcoll.split`
    takes it)."""
    rates = speeds_argument(speeds, argument)
    if len(rates) != size:
        raise ValueError(
            f"{argument}: has {len(rates)} speeds but the group has {size} ranks (one per rank)"
        )
    minimum = 0 if empty else multiple_of
    if total < max(size * minimum, multiple_of):
        raise ValueError(
            f"{argument}: {what} has {total} channels, too few for {size} ranks with at least "
            f"{multiple_of} each; leave it out (layers=...)"
        )
    try:
        return hetcoll.split(
            total,
            rates,
            multiple_of=multiple_of,
            minimum=minimum,
            latency=None if latency is None else list(latency),
        )
    except ValueError as e:
        raise ValueError(f"{argument}: {what}: {e}") from e


def check_choice(shares: object, speeds: object, multiple_of: object) -> None:
    """Exactly one of ``shares`` and ``speeds`` given, and a valid ``multiple_of``."""
    if (shares is None) == (speeds is None):
        raise ValueError("shares, speeds: give exactly one of them")
    if not is_int(multiple_of) or multiple_of < 1:  # type: ignore[operator]
        raise ValueError(f"multiple_of: must be an integer >= 1, got {multiple_of!r}")


def resolve_shares(
    shares: Sequence[int] | None,
    speeds: Sequence[float] | None,
    multiple_of: int,
    total: int,
    size: int,
    what: str,
    *,
    empty: bool = False,
) -> list[int]:
    """A layer's shares: from ``speeds`` when given, else ``shares`` checked (a rank's may
    be 0 with ``empty``)."""
    if speeds is not None:
        return speeds_to_shares(speeds, total, size, int(multiple_of), "speeds", what)
    return check_shares(shares, total, size, "shares", what, empty=empty)


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode: must be one of {MODES}, got {mode!r}")


def check_conv(conv: nn.Conv2d, argument: str) -> None:
    if not isinstance(conv, nn.Conv2d):
        raise TypeError(f"{argument}: must be a torch.nn.Conv2d, got {type(conv).__name__}")
    if conv.groups != 1:
        raise ValueError(
            f"{argument}: is a grouped convolution (groups={conv.groups}); filter parallelism "
            "splits groups=1 convolutions only"
        )
    if conv.transposed:
        raise ValueError(f"{argument}: transposed convolutions are not supported")


def check_linear(linear: nn.Linear, argument: str) -> None:
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"{argument}: must be a torch.nn.Linear, got {type(linear).__name__}")


def check_flag(value: object, argument: str) -> bool:
    """``value`` a bool (numpy's too), as a bool: any other value was once read by its truth
    (``'no'`` as true, ``None`` as false)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{argument}: must be True or False, got {value!r}")
    return bool(value)


def check_timeout(timeout: float | None) -> None:
    """``timeout`` as every collective takes it (:func:`hetcoll.comm.deadline`'s rule), checked
    where it is given rather than at the first collective."""
    deadline(timeout)
