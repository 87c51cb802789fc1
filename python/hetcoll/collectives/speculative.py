"""allgatherv's speculative first round (engines in :data:`SPECULATIVE_GATHER_ENGINES`): each
rank's header travels with as many bytes of its piece as the group's recent gathers predict,
in one all-to-all for small rounds, else point to point; when the prediction holds, "auto" is
done in that one round, and pieces longer than predicted send their rest in a second."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence

import numpy as np

from hetcoll.collectives import _tuning
from hetcoll.collectives._common import (
    _GATHER_IN,
    _GATHER_OUT,
    _TAG_GATHER_DATA,
    _TAG_GATHER_HEAD,
    _TAG_GATHER_REST,
    _scratch,
)
from hetcoll.collectives._header import NO_OUT, _agreed_lengths, _fields
from hetcoll.comm import Communicator, wait_all


def _predict(records: deque[tuple[int, ...]], p: int) -> tuple[int, ...]:
    """Every rank's piece bytes in the group's next gather, from its last ones (``records``,
    the same on every rank): the gather ``k`` calls back for the shortest ``k`` <=
    :data:`GATHER_PERIODS` with which the last ``k`` gathers repeat the ``k`` before them, else
    the last gather, else nothing.

    >>> _predict(deque([(1, 2), (3, 4), (1, 2), (3, 4)]), 2)
    (1, 2)
    """
    n = len(records)
    for k in range(1, min(_tuning.GATHER_PERIODS, n // 2) + 1):
        if all(records[n - j] == records[n - j - k] for j in range(1, k + 1)):
            return records[n - k]
    return records[-1] if records else (0,) * p


def _speculative_round(
    c: Communicator,
    shape: Sequence[int],
    dtype: str,
    send: np.ndarray,
    row_bytes: int,
    deadline: float | None,
    algorithm: str,
    into: np.ndarray | None = None,
    out_rows: int = NO_OUT,
) -> tuple[list[int], np.ndarray | None]:
    """:func:`_exchange_shapes` with every rank's header travelling with as many bytes of its
    piece as predicted. Returns the lengths and, for "auto", the pieces joined (uint8), in
    ``into`` (uint8) when its size is right; pieces longer than predicted are completed by a
    second round.

    Every message size comes from the prediction, which only depends on what all ranks
    exchanged before, so senders and receivers agree on it whatever this call's arguments: a
    rank sends at most the predicted bytes, and a receive takes a message up to its buffer's
    size (gloo aborts the process on a longer one). Ranks that disagree on shapes, dtype or
    algorithm therefore all get through this round, and all raise."""
    p, r = c.size, c.rank
    if c.gather_history is None:
        c.gather_history = deque(maxlen=2 * _tuning.GATHER_PERIODS)
    records = c.gather_history
    guess = _predict(records, p)
    head = _fields(shape, dtype, algorithm, out_rows)
    if not send.flags.writeable:
        send = send.copy()  # torch will not wrap a read-only array
    mine = send[: guess[r]]
    joined: np.ndarray | None = None  # the predicted layout, where point to point lands
    if sum(guess) <= _tuning.BATCHED_GATHER_BYTES:
        heads, boxes = _batched_round(c, head, mine, guess, deadline)
    else:
        heads, boxes, joined = _direct_round(c, head, mine, guess, deadline, into)
    lengths = _agreed_lengths(heads, r).tolist()
    counts = tuple(n * row_bytes for n in lengths)
    records.append(counts)  # the same on every rank
    if algorithm != "auto":
        return lengths, None
    if joined is not None and counts == guess:
        return lengths, joined  # every piece is in place
    # The exact layout: the bytes that came, then the rest of pieces longer than predicted.
    to = [0, *itertools.accumulate(counts)]
    out = into if into is not None and into.size == to[-1] else np.empty(to[-1], np.uint8)
    if joined is not None and joined is into:
        boxes = [box.copy() for box in boxes]  # the two layouts overlap
    peers = [q for q in range(p) if q != r]
    for q in peers:
        k = min(counts[q], guess[q])
        out[to[q] : to[q] + k] = boxes[q][:k]
    out[to[r] : to[r + 1]] = send
    requests = [
        c.irecv(out[to[q] + guess[q] : to[q + 1]], q, _TAG_GATHER_REST)
        for q in peers
        if counts[q] > guess[q]
    ]
    if counts[r] > guess[r]:
        requests += [c.isend(send[guess[r] :], q, _TAG_GATHER_REST) for q in peers]
    wait_all(requests, deadline)
    return lengths, out


def _batched_round(
    c: Communicator,
    head: np.ndarray,
    mine: np.ndarray,
    guess: tuple[int, ...],
    deadline: float | None,
) -> tuple[np.ndarray, list[np.ndarray]]:
    """The speculative round as one all-to-all: to each peer a block of this rank's header and
    predicted bytes (``mine``), from each peer its block, through reused scratch. Returns the
    headers (a row per rank) and each rank's predicted bytes as they came (``mine`` for this
    rank), still in scratch: no piece is in its final place yet."""
    p, r, h = c.size, c.rank, head.nbytes
    block = [h + g for g in guess]
    outgoing = _scratch(_GATHER_OUT, (p - 1) * block[r], np.dtype(np.uint8))
    rows = outgoing.reshape(p - 1, block[r])
    rows[:, :h] = head.view(np.uint8)
    rows[:, h : h + mine.size] = mine  # a piece shorter than predicted leaves stale bytes
    sizes_in = [0 if q == r else block[q] for q in range(p)]
    incoming = _scratch(_GATHER_IN, sum(sizes_in), np.dtype(np.uint8))
    sizes_out = [0 if q == r else block[r] for q in range(p)]
    c.ialltoallv(outgoing, sizes_out, incoming, sizes_in).wait(deadline)
    heads = np.empty((p, h), np.uint8)
    boxes = []
    at = 0
    for q in range(p):
        if q == r:
            heads[q] = head.view(np.uint8)
            boxes.append(mine)
            continue
        heads[q] = incoming[at : at + h]
        boxes.append(incoming[at + h : at + block[q]])
        at += block[q]
    return heads.view(np.int64), boxes


def _direct_round(
    c: Communicator,
    head: np.ndarray,
    mine: np.ndarray,
    guess: tuple[int, ...],
    deadline: float | None,
    into: np.ndarray | None,
) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
    """The speculative round point to point: this rank's header to every peer, and its
    predicted bytes (``mine``) in their own message, which each peer receives straight into
    place in the predicted layout (``into`` when its size is right). Returns the headers (a
    row per rank), each rank's predicted bytes as they came, and the predicted layout."""
    p, r, h = c.size, c.rank, head.nbytes
    at = [0, *itertools.accumulate(guess)]
    joined = into if into is not None and into.size == at[-1] else np.empty(at[-1], np.uint8)
    heads = np.empty((p, h), np.uint8)
    heads[r] = head.view(np.uint8)
    boxes = [joined[at[q] : at[q + 1]] for q in range(p)]
    requests = []
    for k in range(1, p):  # each peer in turn from the right neighbour on
        q = (r + k) % p
        requests.append(c.irecv(heads[q], q, _TAG_GATHER_HEAD))
        if guess[q]:
            requests.append(c.irecv(boxes[q], q, _TAG_GATHER_DATA))
    for k in range(1, p):
        q = (r - k) % p
        requests.append(c.isend(heads[r], q, _TAG_GATHER_HEAD))
        if guess[r]:
            requests.append(c.isend(mine, q, _TAG_GATHER_DATA))
    boxes[r][: mine.size] = mine  # while the messages travel
    wait_all(requests, deadline)
    return heads.view(np.int64), boxes, joined
