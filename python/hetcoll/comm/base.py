"""The interface every engine implements: :class:`Communicator` (rank, size, non-blocking
point-to-point, allreduce SUM, allgathers, reduce-scatter), :class:`Request`, the element
``KINDS`` buffers carry, and :func:`deadline` (the absolute moment a wait must end by)."""

from __future__ import annotations

import math
import numbers
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

KINDS = ("float32", "float64", "float16", "bfloat16", "int64")


class SharedWindows(Protocol):
    """Memory every rank of one node maps, as the shared-memory collectives use it (MPI's
    :class:`~hetcoll.comm.NodeWindows` is the one engine's that has it): two windows taken in
    turn, each with every rank's header slots and segment of ``capacity`` bytes, and a fence
    that makes every rank's writes visible to every rank."""

    capacity: int
    headers: list[list[np.ndarray]]
    segments: list[list[np.ndarray]]

    def take(self) -> int: ...

    def fence(self, i: int, deadline: float | None) -> None: ...


class Request(ABC):
    """A message or collective in flight."""

    @abstractmethod
    def wait(self, deadline: float | None) -> None:
        """Block until done; raise :class:`CollectiveTimeout` past ``deadline`` or on peer loss."""


def wait_all(requests: Sequence[Request], deadline: float | None) -> None:
    """Wait for every request, in order, against one deadline."""
    for r in requests:
        r.wait(deadline)


class Communicator(ABC):
    """Rank, size and the transfers the collectives are built from.

    ``engine`` names the engine ("mpi", "gloo", "nccl", ...); ``native`` is the wrapped object.
    """

    rank: int
    size: int
    engine: str
    native: Any

    @abstractmethod
    def isend(self, buf: np.ndarray, dest: int, tag: int) -> Request:
        """Start sending the bytes of ``buf`` to rank ``dest``."""

    @abstractmethod
    def irecv(self, buf: np.ndarray, source: int, tag: int) -> Request:
        """Start receiving into ``buf`` from rank ``source`` (same byte count as sent)."""

    @abstractmethod
    def iallreduce_sum(self, buf: np.ndarray, kind: str) -> Request:
        """Start ``buf <- sum over ranks of buf``, in place."""

    @abstractmethod
    def ibroadcast(self, buf: np.ndarray, root: int) -> Request:
        """Start ``buf <- root's buf`` on every rank, in place (bytes: any dtype)."""

    def sendrecv(
        self,
        send: np.ndarray,
        dest: int,
        recv: np.ndarray,
        source: int,
        tag: int,
        deadline: float | None,
    ) -> None:
        """Send ``send`` to rank ``dest`` while receiving ``recv`` from rank ``source``;
        returns when both are done. Both sides must agree on which of the two are empty."""
        requests = []
        if recv.size:
            requests.append(self.irecv(recv, source, tag))
        if send.size:
            requests.append(self.isend(send, dest, tag))
        wait_all(requests, deadline)

    def allreduce_sum(self, buf: np.ndarray, kind: str, deadline: float | None) -> None:
        """``buf <- sum over ranks of buf``, in place, returning when done: the engine's
        blocking call when there is no deadline to keep (it can pick other algorithms than its
        non-blocking one, and skips the request)."""
        self.iallreduce_sum(buf, kind).wait(deadline)

    @abstractmethod
    def iallgatherv(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int]) -> Request:
        """Start ``recv <- concat over ranks r of send_r``, as bytes: ``send`` and ``recv`` are
        uint8 arrays, ``counts[r]`` the byte count of rank r's piece."""

    @abstractmethod
    def ialltoallv(
        self,
        send: np.ndarray,
        send_counts: Sequence[int],
        recv: np.ndarray,
        recv_counts: Sequence[int],
    ) -> Request:
        """Start an all-to-all of bytes: ``send`` (uint8) holds, in rank order, the
        ``send_counts[q]`` bytes for each rank q; ``recv`` (uint8) receives, in rank order,
        ``recv_counts[q]`` bytes from each rank q."""

    @abstractmethod
    def ireduce_scatterv(
        self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int], kind: str
    ) -> Request:
        """Start ``recv <- (sum over ranks of send)[o_r : o_r + counts[r]]`` on rank r."""

    def node_windows(self, capacity: int, deadline: float | None = None) -> SharedWindows | None:
        """Shared memory every rank maps (:class:`SharedWindows`, ``capacity`` bytes a rank),
        or None: the engine has none, or the ranks span several nodes. Collective on its first
        call for a ``capacity`` (every rank must make it, alive by ``deadline``), then cached
        with the group."""
        return None

    #: Every rank's piece bytes in each of allgatherv's last gathers on this group (it predicts
    #: the next; :func:`hetcoll.collectives.speculative._predict`); created on first use. One
    #: wrapper per torch process group (:func:`wrap`) makes it per group.
    gather_history: deque[tuple[int, ...]] | None = None

    def allgather_fixed(self, send: np.ndarray, deadline: float | None) -> np.ndarray:
        """Every rank's ``send`` (1-D uint8, the same length on every rank), as the rows of a
        ``(size, len(send))`` matrix."""
        out = np.empty((self.size, send.size), dtype=np.uint8)
        counts = [send.size] * self.size
        self.iallgatherv(send, out.reshape(-1), counts).wait(deadline)
        return out

    def allgather_int64(self, values: np.ndarray, deadline: float | None) -> np.ndarray:
        """Every rank's ``values`` (1-D int64, one length on every rank), as rows of a matrix."""
        values = np.ascontiguousarray(values, dtype=np.int64)
        rows = self.allgather_fixed(values.view(np.uint8), deadline)
        return rows.view(np.int64).reshape(self.size, values.size)


def deadline(timeout: float | None) -> float | None:
    """The :func:`time.monotonic` moment a call with ``timeout`` seconds must end by (None or
    ``math.inf``: no limit); a bad ``timeout`` raises ``ValueError`` naming it."""
    if timeout is None:
        return None
    # numpy's numbers are numbers (np.int64(5) once was refused); NaN and bools are not.
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout > 0:
        raise ValueError(f"timeout: must be a number of seconds > 0 or None, got {timeout!r}")
    try:
        seconds = float(timeout)
    except OverflowError:  # an int past float's range (2**2000): no limit
        return None
    return None if seconds == math.inf else time.monotonic() + seconds
