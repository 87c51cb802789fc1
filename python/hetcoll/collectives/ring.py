"""The ring: reduce-scatter then allgather over ``p`` chunks, on the engine's point-to-point
calls. The schedule (steps, chunk and segment bounds) comes from the Rust core
(``schedules/ring.rs``); each received segment is reduced by the Rust ``weighted_sum`` kernel,
the weights fused into that reduction, and forwarded as soon as it is reduced. Also the
allgather half alone, for allgatherv "ring"."""

from __future__ import annotations

import numpy as np

from hetcoll import _core
from hetcoll.collectives._common import _TAG, _TAG_GATHER, _TAG_WEIGHT, _scratch
from hetcoll.comm import Communicator, Request, wait_all


def _ring(
    c: Communicator,
    flat: np.ndarray,
    bf16: bool,
    w: float,
    counts: list[int],
    segment: int,
    deadline: float | None,
) -> None:
    """Reduce-scatter then allgather around the ring; see ``schedules/ring.rs``.

    Step t sends exactly the segments step t-1 received, so each segment goes out as soon as it
    is reduced; receives of step t+1 are posted before step t is processed. Two scratch buffers
    alternate between reduce-scatter steps; allgather receives land in ``flat`` directly.
    """
    p, r = c.size, c.rank
    right, left = (r + 1) % p, (r - 1) % p
    steps = _core.ring_schedule(counts, r, segment)
    biggest = max(counts)
    scratch = [_scratch(0, biggest, flat.dtype), _scratch(1, biggest, flat.dtype)]

    def post(t: int) -> list[Request]:
        reduce, _, recv = steps[t]
        base = recv[0][0]
        if reduce:
            return [c.irecv(scratch[t % 2][a - base : b - base], left, _TAG + t) for a, b in recv]
        return [c.irecv(flat[a:b], left, _TAG + t) for a, b in recv]

    # Step 0 sends this rank's raw chunk, which it never reduces, unscaled: the receiver applies
    # the sender's weight in its first reduction, so no pass scales it. The weight travels
    # ahead, 8 bytes from each rank to its right neighbour.
    _, send0, _ = steps[0]
    weights = np.array([w, 0.0])
    weight_in = c.irecv(weights[1:], left, _TAG_WEIGHT)
    weight_out = c.isend(weights[:1], right, _TAG_WEIGHT)
    recvs = post(0)
    sends = [c.isend(flat[a:b], right, _TAG) for a, b in send0]
    weight_in.wait(deadline)
    w_left = float(weights[1])
    last = len(steps) - 1
    # On two ranks the raw chunk sent at step 0 is the one step 1 receives the result into:
    # each of its segments is received again only after its step-0 send has completed.
    reuse = p == 2
    reposted = 0  # step-0 segments whose send completed and whose receive is posted

    def repost(upto: int) -> None:
        nonlocal reposted
        while reposted < min(upto, len(send0)):
            sends[reposted].wait(deadline)
            a, b = send0[reposted]
            next_recvs.append(c.irecv(flat[a:b], left, _TAG + 1))
            reposted += 1

    for t, (reduce, _, recv) in enumerate(steps):
        next_recvs = post(t + 1) if t < last and not (reuse and t == 0) else []
        next_sends: list[Request] = []
        base = recv[0][0]
        for j, (a, b) in enumerate(recv):
            recvs[j].wait(deadline)
            if reduce and b > a:
                part = flat[a:b]
                got = scratch[t % 2][a - base : b - base]
                w_got = w_left if t == 0 else 1.0
                _core.weighted_sum_into([part, got], [w, w_got], part, bfloat16=bf16)
            if t < last:
                next_sends.append(c.isend(flat[a:b], right, _TAG + t + 1))
            if reuse and t == 0:
                repost(j + 1)
        if reuse and t == 0:
            repost(len(send0))
            sends = sends[reposted:]
        wait_all(sends, deadline)
        sends, recvs = next_sends, next_recvs
    wait_all([*sends, weight_out], deadline)


def _ring_blocking(
    c: Communicator,
    flat: np.ndarray,
    bf16: bool,
    w: float,
    counts: list[int],
    deadline: float | None,
) -> None:
    """:func:`_ring` when each chunk is one segment: nothing to pipeline, so each step is one
    blocking exchange with the neighbours (on MPI without a deadline, one ``MPI_Sendrecv``),
    after the weights' own. The same reductions, in the same order, as :func:`_ring`."""
    p, r = c.size, c.rank
    right, left = (r + 1) % p, (r - 1) % p
    steps = _core.ring_schedule(counts, r, max(1, *counts))
    weights = np.array([w, 0.0])
    c.sendrecv(weights[:1], right, weights[1:], left, _TAG_WEIGHT, deadline)
    w_left = float(weights[1])
    scratch = _scratch(0, max(counts), flat.dtype)
    for t, (reduce, ((sa, sb),), ((a, b),)) in enumerate(steps):
        if reduce:
            got = scratch[: b - a]
            c.sendrecv(flat[sa:sb], right, got, left, _TAG + t, deadline)
            if b > a:
                part = flat[a:b]
                w_got = w_left if t == 0 else 1.0
                _core.weighted_sum_into([part, got], [w, w_got], part, bfloat16=bf16)
        else:
            c.sendrecv(flat[sa:sb], right, flat[a:b], left, _TAG + t, deadline)


def _ring_allgather(
    c: Communicator,
    send: np.ndarray,
    out: np.ndarray,
    counts: list[int],
    segment: int,
    deadline: float | None,
) -> None:
    """The allgather half of the ring (``schedules/ring.rs``) on bytes: rank r's piece is chunk
    r of ``out``; each step forwards, segment by segment, what the previous step received."""
    p, r = c.size, c.rank
    right, left = (r + 1) % p, (r - 1) % p
    bounds = np.concatenate([[0], np.cumsum(counts)])
    out[bounds[r] : bounds[r + 1]] = send
    steps = _core.ring_schedule(counts, r, segment)[p - 1 :]
    last = len(steps) - 1

    def post(t: int) -> list[Request]:
        return [c.irecv(out[a:b], left, _TAG_GATHER + t) for a, b in steps[t][2]]

    sends = [c.isend(out[a:b], right, _TAG_GATHER) for a, b in steps[0][1]]
    recvs = post(0)
    for t, (_, _, recv) in enumerate(steps):
        next_recvs = post(t + 1) if t < last else []
        next_sends: list[Request] = []
        for j, (a, b) in enumerate(recv):
            recvs[j].wait(deadline)
            if t < last:
                next_sends.append(c.isend(out[a:b], right, _TAG_GATHER + t + 1))
        wait_all(sends, deadline)
        sends, recvs = next_sends, next_recvs
    wait_all(sends, deadline)
