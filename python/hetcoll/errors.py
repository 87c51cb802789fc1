"""Exceptions of the collectives: raised on every rank, so no rank corrupts data or hangs; and
how any of hetcoll's messages echoes a value it refuses (:func:`shown`), and the rule for an
argument that must be a finite number (:func:`finite_number`)."""

from __future__ import annotations

import math
import reprlib
from typing import Any

import numpy as np

#: The most characters of a value a message echoes: a value or file of megabytes makes no
#: readable error otherwise.
MAX_SHOWN = 200


def shown(value: Any, limit: int = MAX_SHOWN) -> str:
    """``repr(value)`` cut to ``limit`` characters (``'xxx...'``), for a message to echo.

    >>> shown(list(range(100)), 30)
    '[0, 1, 2, 3, 4, 5, 6, 7, 8,...'
    """
    r = reprlib.Repr()
    r.maxstring = r.maxother = r.maxlong = limit
    r.maxlist = r.maxtuple = r.maxdict = 16
    text = r.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def finite_number(value: object, name: str) -> float:
    """``value`` as a float where it is a finite real number (an int, a float or a NumPy
    scalar; not a bool); else a TypeError or ValueError naming the argument ``name``.

    >>> finite_number(2, "weight")
    2.0
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name}: must be a number, got {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:  # an int past float's range (2**1100)
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"{name}: must be finite, got {shown(value)}")
    return number


class CollectiveMismatchError(ValueError):
    """Ranks called one collective with arguments that disagree (length, dtype, algorithm,
    speeds, shares, parameter layouts), or another rank's own arguments failed (the message
    names it and its error). Raised on every rank by the agreement check
    (:func:`hetcoll.comm.agree`), before any data moves."""


class CollectiveTimeout(TimeoutError):
    """A collective did not complete within its ``timeout`` (seconds), or the engine reported a
    lost peer. The communicator should be treated as broken afterwards: a peer may be dead and
    messages may be in flight."""
