"""allreduce and allgatherv "shared" (MPI, every rank on one node): through two MPI-3
shared-memory windows that every rank maps (:class:`hetcoll.comm.NodeWindows`), in pieces,
with a fence (a barrier) between the rounds; allreduce fuses the weights into one Rust pass.
Also allgatherv's first round on one node, through the same windows, whatever the algorithm."""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

import numpy as np

from hetcoll import _core
from hetcoll.collectives import _tuning
from hetcoll.collectives._common import _KIND_CODE, _counts
from hetcoll.collectives._header import _FIELDS, _agreed_lengths, _fields
from hetcoll.comm import Communicator, SharedWindows, same_rows


def _shared(
    c: Communicator,
    windows: SharedWindows,
    flat: np.ndarray,
    bf16: bool,
    w: float,
    kind: str,
    speeds: Sequence[float] | None,
    deadline: float | None,
) -> None:
    """``flat <- sum_q w_q * buf_q`` through memory every rank of the node maps, piece by
    piece (:data:`SHARED_SEGMENT_BYTES`), each piece in its own window of the two.

    A rank writes its weight, length and dtype into its header and its piece into its segment,
    and fences. In one round (small pieces, :data:`SHARED_ONE_ROUND_BYTES`) every rank then sums
    the whole piece from every rank's segment, in rank order. In two, rank r sums only its
    chunk (sized by :func:`hetcoll.split`, ``speeds`` when given) into its own segment, which
    no other rank reads until the second fence, after which every rank copies every chunk
    out: the weights fused into the one sum, every element summed once, the same bits
    everywhere. A rank's own chunk never goes through the window on the way in (only it reads
    it). The headers also hold each rank's length, dtype and speeds: ranks that disagree all raise
    :class:`hetcoll.CollectiveMismatchError` after the first fence, before anything is read."""
    p, r = c.size, c.rank
    per = windows.capacity // flat.itemsize
    code = float(_KIND_CODE[kind])
    # The speeds, fingerprinted into the header too: they size every rank's chunk, and ranks
    # that size them differently would sum overlapping chunks (wrong results, no error).
    speeds_code = (
        -1.0 if speeds is None else float(zlib.crc32(np.asarray(speeds, np.float64).tobytes()))
    )
    chunked = 0  # the piece length ``counts`` were split for (every piece but the last shares it)
    for start in range(0, flat.size, per):
        piece = flat[start : start + per]
        m = piece.size
        i = windows.take()
        heads = windows.headers[i]
        segs = [s[: piece.nbytes].view(flat.dtype) for s in windows.segments[i]]
        heads[r][:4] = (w, flat.size, code, speeds_code)
        one_round = p * piece.nbytes <= _tuning.SHARED_ONE_ROUND_BYTES
        if one_round:
            segs[r][:] = piece
        else:
            if m != chunked:
                counts = _counts(m, p, speeds)
                lo = sum(counts[:r])
                hi = lo + counts[r]
                chunked = m
            segs[r][:lo] = piece[:lo]
            segs[r][hi:] = piece[hi:]
        windows.fence(i, deadline)
        if start == 0:  # length, dtype and speeds, from every rank's header
            same_rows(
                ("length", "dtype", "speeds (crc32)"), np.array([h[1:4] for h in heads], np.int64)
            )
        weights = [float(h[0]) for h in heads]
        if one_round:
            sources = [piece if q == r else segs[q] for q in range(p)]
            _core.weighted_sum_into(sources, weights, piece, bfloat16=bf16)
            continue
        sources = [piece[lo:hi] if q == r else segs[q][lo:hi] for q in range(p)]
        _core.weighted_sum_into(sources, weights, segs[r][lo:hi], bfloat16=bf16)
        windows.fence(i, deadline)
        a = 0
        for q, n_q in enumerate(counts):
            piece[a : a + n_q] = segs[q][a : a + n_q]
            a += n_q


def _shared_round(
    c: Communicator,
    windows: SharedWindows,
    shape: Sequence[int],
    dtype: str,
    send: np.ndarray,
    row_bytes: int,
    deadline: float | None,
    algorithm: str,
    into_bytes: np.ndarray | None,
    out_rows: int,
) -> tuple[list[int], np.ndarray | None]:
    """allgatherv's first round on one node, through the node windows, whatever the
    algorithm: every rank writes its header (:func:`_fields`) and, for "auto" and "shared", the
    first segment of its piece, and fences once. Every rank then reads the same headers, so
    ranks that disagree on shape, dtype or algorithm all raise. For "auto" and "shared" the
    pieces are then copied out (and their rest sent in further rounds, one fence each) into
    ``into_bytes`` if it has the right size, else a new array, which is returned with the
    lengths; for the other algorithms, and for "auto" from :data:`SHARED_GATHER_BELOW_BYTES`,
    only the lengths."""
    r = c.rank
    data = algorithm in ("auto", "shared")
    i = windows.take()
    heads = [h.view(np.int64)[: len(_FIELDS)] for h in windows.headers[i]]
    heads[r][:] = _fields(shape, dtype, algorithm, out_rows)
    first = send[: windows.capacity] if data else send[:0]
    windows.segments[i][r][: first.size] = first
    windows.fence(i, deadline)
    lengths = [int(n) for n in _agreed_lengths(np.stack(heads), r)]
    counts = [n * row_bytes for n in lengths]
    total = sum(counts)
    if not data or (
        algorithm == "auto" and total >= _tuning.SHARED_GATHER_BELOW_BYTES.get(c.engine, math.inf)
    ):
        return lengths, None
    recv = into_bytes if into_bytes is not None and into_bytes.size == total else None
    if recv is None:
        recv = np.empty(total, np.uint8)
    _copy_parts(r, first, windows.segments[i], recv, counts, 0, windows.capacity)
    _shared_gather(c, windows, send, recv, counts, deadline, windows.capacity)
    return lengths, recv


def _copy_parts(
    r: int,
    mine: np.ndarray,
    segs: list[np.ndarray],
    recv: np.ndarray,
    counts: Sequence[int],
    a: int,
    cap: int,
) -> None:
    """Bytes ``a`` to ``a + cap`` of every rank's piece from its segment (this rank's from
    ``mine``) to their places in ``recv``."""
    start = 0
    for q, n in enumerate(counts):
        part = min(cap, n - a)
        if part > 0:
            recv[start + a : start + a + part] = mine if q == r else segs[q][:part]
        start += n


def _shared_gather(
    c: Communicator,
    windows: SharedWindows,
    send: np.ndarray,
    recv: np.ndarray,
    counts: Sequence[int],
    deadline: float | None,
    start: int = 0,
) -> None:
    """Every rank's bytes from ``start`` on into ``recv`` at their offsets (``counts[q]``
    bytes from rank q), through the node windows: in each round every rank writes up to a
    segment of its piece into its segment, fences once, and copies every rank's part out. A
    window is written again two rounds later, after the next round's fence, when every rank has
    copied it out."""
    cap = windows.capacity
    r = c.rank
    for a in range(start, max(counts, default=0), cap):
        i = windows.take()
        segs = windows.segments[i]
        mine = send[a : a + cap]
        segs[r][: mine.size] = mine
        windows.fence(i, deadline)
        _copy_parts(r, mine, segs, recv, counts, a, cap)
