""" "Ranks agree on these arguments": :func:`agree` and :func:`start_agreement` (one allgather of
a 16-byte fingerprint; on a mismatch or a rank's local failure every rank raises),
:func:`fingerprint` (the fields' digest they compare),
:func:`same_rows`, and :func:`allgather_objects` (what each rank holds, told to all)."""

from __future__ import annotations

import hashlib
import json
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from hetcoll.comm.base import Communicator
from hetcoll.errors import CollectiveMismatchError

#: Round one of an agreement, per rank: [status, digest of the fields, *values].
_OK, _FAILED = 0, 1


def fingerprint(fields: Mapping[str, int]) -> int:
    """A 63-bit fingerprint of the field names and values, in order (blake2b, one pass): what
    :func:`agree` compares; a caller that carries it in a collective of its own compares it
    there, and on a mismatch calls :func:`agree` with the same fields to raise, naming them."""
    try:
        raw = np.asarray(list(fields.values()))
        if raw.size and raw.dtype.kind not in "biuf":  # strings, or ints past 64 bits (objects)
            raise TypeError(raw.dtype)
        values = raw.astype(np.int64)
    except (OverflowError, TypeError, ValueError):
        for name, value in fields.items():
            if not isinstance(value, (int, float, np.number)):
                raise TypeError(f"fields[{name!r}]: must be an integer, got {value!r}") from None
            if isinstance(value, int) and not -(2**63) <= value < 2**63:
                raise ValueError(f"fields[{name!r}]: must fit in 64 bits, got {value!r}") from None
        raise
    key = "\0".join(fields).encode() + values.tobytes()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def _check_comm(comm: object) -> None:
    if not isinstance(comm, Communicator):
        raise TypeError(
            "comm: must be a hetcoll.comm.Communicator (hetcoll.comm.wrap(group) makes one), "
            f"got {type(comm).__name__}"
        )


def _first_round(
    fields: Mapping[str, int], failure: BaseException | None, values: Sequence[int] | np.ndarray
) -> np.ndarray:
    out = np.empty(2 + len(values), dtype=np.int64)
    out[0] = _FAILED if failure is not None else _OK
    out[1] = 0 if failure is not None else fingerprint(fields)
    out[2:] = values
    return out


def agree(
    comm: Communicator,
    fields: Mapping[str, int],
    deadline: float | None = None,
    *,
    failure: BaseException | None = None,
    values: Sequence[int] | np.ndarray = (),
) -> np.ndarray:
    """Raise :class:`~hetcoll.CollectiveMismatchError` on every rank unless every rank passed the
    same integer for each named field. The one check "ranks agree on these arguments" of the
    collectives, the sampler, the optimizer and the filter-parallel layers.

    One small allgather of a fingerprint (a status word and a 63-bit digest of the names and
    values, whatever their number); only when the fingerprints differ does a second exchange
    carry the fields themselves, so that every rank names the same field and per-rank values.

    ``failure``: this rank's own argument error, found before the call could communicate. The
    rank still joins the exchange, so that the others raise at once (a
    :class:`~hetcoll.CollectiveMismatchError` naming this rank and its error) instead of waiting
    for a timeout; then it raises ``failure`` itself. ``values``: integers that may differ per
    rank (a local batch size), carried in the same allgather: returns their ``(size,
    len(values))`` matrix. Every rank must pass as many (a failing rank passes zeros).

    ``deadline``: a :func:`time.monotonic` value (see :func:`deadline`), or None.
    """
    _check_comm(comm)
    mine = _first_round(fields, failure, values)
    if comm.size == 1:
        if failure is not None:
            raise failure
        return mine[None, 2:]
    rows = comm.allgather_int64(mine, deadline)
    _settle(comm, rows, fields, failure, deadline)
    return rows[:, 2:]


def start_agreement(
    comm: Communicator,
    fields: Mapping[str, int],
    *,
    failure: BaseException | None = None,
    values: Sequence[int] | np.ndarray = (),
) -> Callable[[], np.ndarray]:
    """:func:`agree` without waiting: starts the allgather and returns the function that waits
    for it, raises as :func:`agree` does (on every rank alike) and returns what it returns (the
    ranks' ``values``, one row each). A caller may compute, but not communicate on ``comm``,
    until it has called it. On NCCL, whose gathers move device memory, the check runs at once
    and the function has nothing left to do; a rank alone has no one to agree with (as in
    :func:`agree`): nothing is sent.

    Ranks may start it at different points of their work (one before computing, with zeros for
    its ``values``; another after, with its own): what is sent depends on the number of
    ``values`` alone, so the two still meet, and disagree where their fields do."""
    _check_comm(comm)
    if comm.size == 1 and failure is None:  # as agree: nothing to compare, nothing hashed
        alone = np.asarray(values, dtype=np.int64).reshape(1, -1)
        return lambda: alone
    if comm.size == 1 or comm.engine == "nccl":
        try:
            rows = agree(comm, fields, failure=failure, values=values)
        except BaseException as e:
            error = e

            def raise_it() -> np.ndarray:
                raise error

            return raise_it
        return lambda: rows
    mine = _first_round(fields, failure, values)
    rows = np.empty((comm.size, mine.size), dtype=np.int64)
    request = comm.iallgatherv(
        mine.view(np.uint8), rows.reshape(-1).view(np.uint8), [mine.nbytes] * comm.size
    )

    def wait() -> np.ndarray:
        request.wait(None)
        _settle(comm, rows, fields, failure, None)
        return rows[:, 2:]

    return wait


def _settle(
    comm: Communicator,
    rows: np.ndarray,
    fields: Mapping[str, int],
    failure: BaseException | None,
    deadline: float | None,
) -> None:
    """After round one (``rows``): return if every rank is well and the digests agree; else
    every rank (all see the same rows) exchanges its fields or its error and raises."""
    if rows[0, 0] == _OK and (rows[:, :2] == rows[0, :2]).all():  # all well, all alike
        return
    if failure is not None:
        mine: dict[str, Any] = {"error": f"{type(failure).__name__}: {failure}"}
    else:
        mine = {"fields": {k: int(v) for k, v in fields.items()}}
    every = [json.loads(b) for b in _allgather_bytes(comm, json.dumps(mine).encode(), deadline)]
    if failure is not None:
        raise failure
    failed = [f"rank {q} raised {d['error']}" for q, d in enumerate(every) if "error" in d]
    if failed:
        raise CollectiveMismatchError(f"{'; '.join(failed)} (the call was abandoned on every rank)")
    per_rank = [d["fields"] for d in every]
    names = list(dict.fromkeys(n for f in per_rank for n in f))
    for name in names:
        column = [f.get(name) for f in per_rank]
        if any(v != column[0] for v in column):
            listed = ", ".join(
                f"rank {q}: {'(not given)' if v is None else v}" for q, v in enumerate(column)
            )
            raise CollectiveMismatchError(f"ranks disagree on {name} ({listed})")
    raise CollectiveMismatchError("ranks disagree (fingerprints differ)")  # a hash collision


def _allgather_bytes(comm: Communicator, data: bytes, deadline: float | None) -> list[bytes]:
    """Every rank's ``data`` (any lengths): the lengths, then the bytes padded to the longest
    (two fixed-size allgathers, which every engine has, NCCL included)."""
    sizes = comm.allgather_int64(np.array([len(data)], np.int64), deadline)[:, 0]
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: len(data)] = np.frombuffer(data, np.uint8)
    rows = comm.allgather_fixed(padded, deadline)
    return [rows[q, : int(n)].tobytes() for q, n in enumerate(sizes)]


def same_rows(names: Sequence[str], rows: np.ndarray) -> None:
    """Raise :class:`~hetcoll.CollectiveMismatchError` unless column ``j`` of ``rows`` (one row
    per rank), field ``names[j]``, is the same on every rank."""
    rows = np.asarray(rows)
    if rows.ndim != 2 or rows.shape[1] != len(names):
        raise ValueError(
            f"rows: must be one row per rank of {len(names)} values (one per name), got shape "
            f"{rows.shape}"
        )
    for j, name in enumerate(names):
        column = rows[:, j]
        if (column != column[0]).any():
            per_rank = ", ".join(f"rank {r}: {int(v)}" for r, v in enumerate(column))
            raise CollectiveMismatchError(f"ranks disagree on {name} ({per_rank})")


def allgather_objects(comm: Communicator, obj: Any) -> list[Any]:
    """Every rank's ``obj`` (pickled: the peers are this job's own ranks), in rank order."""
    return [pickle.loads(b) for b in _allgather_bytes(comm, pickle.dumps(obj), None)]
