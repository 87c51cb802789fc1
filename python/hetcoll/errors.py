"""Exceptions of the collectives: raised on every rank, so no rank corrupts data or hangs."""

from __future__ import annotations


class CollectiveMismatchError(ValueError):
    """Ranks called one collective with arguments that disagree (length, dtype, algorithm,
    speeds, shares, parameter layouts), or another rank's own arguments failed (the message
    names it and its error). Raised on every rank by the agreement check
    (:func:`hetcoll.comm.agree`), before any data moves."""


class CollectiveTimeout(TimeoutError):
    """A collective did not complete within its ``timeout`` (seconds), or the engine reported a
    lost peer. The communicator should be treated as broken afterwards: a peer may be dead and
    messages may be in flight."""
