"""The direct exchange: every rank sends its buffer to every other rank in one round of
non-blocking messages. allreduce "direct" then forms the weighted sum in rank order in one Rust
pass (the fewest message latencies; ``p - 1`` buffers of traffic and scratch per rank);
allgatherv "direct" receives each piece straight into its place in the output."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from hetcoll import _core
from hetcoll.collectives._common import _TAG_DIRECT, _TAG_GATHER_DIRECT, _scratch
from hetcoll.comm import Communicator, wait_all


def direct_allreduce(
    c: Communicator,
    flat: np.ndarray,
    bf16: bool,
    w: float,
    deadline: float | None,
    *,
    weigh: Callable[[np.ndarray], np.ndarray] | None = None,
    tag: int = _TAG_DIRECT,
) -> None:
    """Every rank sends its raw buffer and its weight to every other rank (one round), then
    ``flat <- sum_q w_q * buf_q`` in rank order, in one Rust pass, on every rank alike.

    ``weigh`` maps the weights as sent, in rank order, to the weights summed with (the weighted
    DDP hook sends sample counts and weighs them with :func:`hetcoll.torch.item_weights`; it
    may raise, on every rank alike); ``tag`` and ``tag + 1`` carry the weights and the data, so
    exchanges with different tags may run at once on different threads (each thread has its own
    scratch)."""
    p, r = c.size, c.rank
    weights = np.empty(p, np.float64)
    weights[r] = w
    got = _scratch(3, (p - 1) * flat.size, flat.dtype).reshape(p - 1, flat.size)
    peer = {q: got[q if q < r else q - 1] for q in range(p) if q != r}
    requests = []
    for q, into in peer.items():
        requests += [
            c.irecv(weights[q : q + 1], q, tag),
            c.irecv(into, q, tag + 1),
            c.isend(weights[r : r + 1], q, tag),
            c.isend(flat, q, tag + 1),
        ]
    wait_all(requests, deadline)
    if weigh is not None:
        weights = np.asarray(weigh(weights), np.float64)
    sources = [flat if q == r else peer[q] for q in range(p)]
    _core.weighted_sum_into(sources, [float(x) for x in weights], flat, bfloat16=bf16)


def _direct_allgather(
    c: Communicator, send: np.ndarray, out: np.ndarray, counts: list[int], deadline: float | None
) -> None:
    """One round: this rank's piece goes to every other rank, and every other rank's piece
    lands in its place in ``out`` (empty pieces send nothing; every rank knows the counts)."""
    bounds = np.concatenate([[0], np.cumsum(counts)])
    r = c.rank
    out[bounds[r] : bounds[r + 1]] = send
    requests = []
    for q in range(c.size):
        if q == r:
            continue
        if counts[q]:
            requests.append(c.irecv(out[bounds[q] : bounds[q + 1]], q, _TAG_GATHER_DIRECT))
        if counts[r]:
            requests.append(c.isend(send, q, _TAG_GATHER_DIRECT))
    wait_all(requests, deadline)
