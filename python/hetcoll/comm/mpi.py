"""The :class:`Communicator` over mpi4py: :class:`MpiCommunicator`, and :class:`NodeWindows`
(memory every rank of one node maps)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from hetcoll import _core
from hetcoll.comm.base import Communicator, Request
from hetcoll.errors import CollectiveTimeout


class _MpiRequest(Request):
    def __init__(self, req: Any, what: str) -> None:
        self._req = req
        self._what = what

    def wait(self, deadline: float | None) -> None:
        from mpi4py import MPI

        try:
            if deadline is None:
                self._req.Wait()
                return
            # MPI has no timed wait: poll, backing off so oversubscribed ranks leave the cores
            # to the peers they are waiting for.
            pause = 1e-6
            while not self._req.Test():
                if time.monotonic() > deadline:
                    raise CollectiveTimeout(
                        f"{self._what}: no completion before the timeout; a peer may be dead"
                    )
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
        except MPI.Exception as e:
            raise CollectiveTimeout(f"{self._what}: the engine lost a peer: {e}") from e


# One user op per 16-bit kind for the whole process: mpi4py has only a few slots for them.
_HALF_SUM_OPS: dict[str, Any] = {}
# Each element kind's MPI datatype, filled on first use.
_MPI_TYPES: dict[str, Any] = {}


class NodeWindows:
    """Memory every rank of one node maps: MPI-3 shared-memory windows
    (``MPI_Win_allocate_shared``), which MPI allocates and maps into each rank, read and
    written by the ranks directly.

    Two windows, taken in turn (:meth:`take`); in each, every rank owns a segment of
    ``capacity`` bytes and a header of :data:`HEADER_SLOTS` float64 slots, and every rank sees
    every rank's. A rank writes only its own; :meth:`fence` makes every rank's writes visible
    to every rank (a barrier between two memory syncs, the MPI-3 pattern for shared memory).
    A collective that writes a window, fences, and reads reads nothing that its next use of
    the same window (two takes later, after another fence) can overwrite under a peer.
    """

    #: float64 slots at the start of each rank's part of a window, before its segment.
    HEADER_SLOTS = 8

    def __init__(self, node: Any, capacity: int) -> None:
        from mpi4py import MPI

        self.capacity = capacity
        self._node = node
        self._wins: list[Any] = []
        self.headers: list[list[np.ndarray]] = []
        self.segments: list[list[np.ndarray]] = []
        head = self.HEADER_SLOTS * 8
        for _ in range(2):
            win = MPI.Win.Allocate_shared(head + capacity, 1, comm=node)
            win.Lock_all(MPI.MODE_NOCHECK)  # one passive epoch, for Win_sync
            mapped: list[Any] = [win.Shared_query(q)[0] for q in range(node.size)]
            parts = [np.frombuffer(m, np.uint8) for m in mapped]
            self._wins.append(win)
            self.headers.append([m[:head].view(np.float64) for m in parts])
            self.segments.append([m[head:] for m in parts])
        self._turn = 0

    def take(self) -> int:
        """The window a collective's next round writes: 0 and 1 in turn."""
        i = self._turn
        self._turn = 1 - i
        return i

    def fence(self, i: int, deadline: float | None) -> None:
        """Every rank's writes to window ``i`` so far are visible to every rank."""
        win = self._wins[i]
        win.Sync()
        if deadline is None:
            self._node.Barrier()
        else:
            _MpiRequest(self._node.Ibarrier(), "MPI_Ibarrier of the node's ranks").wait(deadline)
        win.Sync()

    def free(self) -> None:
        """Release the windows (collective over the node's ranks)."""
        for win in self._wins:
            win.Unlock_all()
            win.Free()
        self._wins = []
        self.headers = []
        self.segments = []


def _free_node_cache(comm: Any, keyval: int, cache: Any) -> None:
    """MPI's delete callback for the node-window attribute: the communicator is being freed
    (collectively), so its windows and node communicator go too."""
    for key, windows in cache.items():
        if key != "node":
            windows.free()
    if cache["node"] is not None:
        cache["node"].Free()


def _node_keyval() -> int:
    """The MPI attribute key under which a communicator keeps its node windows."""
    global _NODE_KEYVAL
    if _NODE_KEYVAL is None:
        from mpi4py import MPI

        _NODE_KEYVAL = MPI.Comm.Create_keyval(delete_fn=_free_node_cache)
    return _NODE_KEYVAL


_NODE_KEYVAL: int | None = None


class MpiCommunicator(Communicator):
    """A :class:`Communicator` over an mpi4py ``Comm`` (intracommunicator)."""

    def __init__(self, comm: Any) -> None:
        if not all(hasattr(comm, m) for m in ("Get_rank", "Get_size", "Allgather")):
            raise TypeError(f"comm: must be an mpi4py communicator, got {type(comm).__name__}")
        self.native = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.engine = "mpi"

    @staticmethod
    def _type(kind: str) -> Any:
        types = _MPI_TYPES
        if not types:  # once: on every collective's path
            from mpi4py import MPI

            types.update(
                float32=MPI.FLOAT,
                float64=MPI.DOUBLE,
                float16=MPI.UINT16_T,
                bfloat16=MPI.UINT16_T,
                int64=MPI.INT64_T,
            )
        return types[kind]

    def _sum(self, kind: str) -> Any:
        """MPI_SUM, or for 16-bit floats (no MPI type) a commutative user op in Rust."""
        from mpi4py import MPI

        if kind not in ("float16", "bfloat16"):
            return MPI.SUM
        op = _HALF_SUM_OPS.get(kind)
        if op is None:
            bf16 = kind == "bfloat16"
            np_type = np.uint16 if bf16 else np.float16

            def add(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
                a = np.frombuffer(inbuf, dtype=np_type)
                b = np.frombuffer(inoutbuf, dtype=np_type)
                _core.weighted_sum_into([b, a], [1.0, 1.0], b, bfloat16=bf16)

            op = MPI.Op.Create(add, commute=True)
            _HALF_SUM_OPS[kind] = op
        return op

    def isend(self, buf: np.ndarray, dest: int, tag: int) -> Request:
        return _MpiRequest(self.native.Isend(buf, dest=dest, tag=tag), f"send to rank {dest}")

    def irecv(self, buf: np.ndarray, source: int, tag: int) -> Request:
        return _MpiRequest(
            self.native.Irecv(buf, source=source, tag=tag), f"receive from rank {source}"
        )

    def iallreduce_sum(self, buf: np.ndarray, kind: str) -> Request:
        from mpi4py import MPI

        req = self.native.Iallreduce(MPI.IN_PLACE, [buf, self._type(kind)], op=self._sum(kind))
        return _MpiRequest(req, "MPI_Iallreduce")

    def ibroadcast(self, buf: np.ndarray, root: int) -> Request:
        from mpi4py import MPI

        flat = buf.reshape(-1).view(np.uint8)
        return _MpiRequest(self.native.Ibcast([flat, MPI.BYTE], root=root), "MPI_Ibcast")

    def sendrecv(
        self,
        send: np.ndarray,
        dest: int,
        recv: np.ndarray,
        source: int,
        tag: int,
        deadline: float | None,
    ) -> None:
        if deadline is not None:  # MPI has no timed wait: the requests, polled
            return super().sendrecv(send, dest, recv, source, tag, deadline)
        from mpi4py import MPI

        try:
            self.native.Sendrecv(send, dest, tag, recv, source, tag)
        except MPI.Exception as e:
            raise CollectiveTimeout(
                f"MPI_Sendrecv with rank {dest}: the engine lost a peer: {e}"
            ) from e
        return None

    def allgather_fixed(self, send: np.ndarray, deadline: float | None) -> np.ndarray:
        if deadline is not None:  # MPI has no timed wait: the request, polled
            return super().allgather_fixed(send, deadline)
        from mpi4py import MPI

        out = np.empty((self.size, send.size), dtype=np.uint8)
        try:
            self.native.Allgather([send, MPI.BYTE], [out, MPI.BYTE])
        except MPI.Exception as e:
            raise CollectiveTimeout(f"MPI_Allgather: the engine lost a peer: {e}") from e
        return out

    def allreduce_sum(self, buf: np.ndarray, kind: str, deadline: float | None) -> None:
        if deadline is not None:  # MPI has no timed wait: the request, polled
            return super().allreduce_sum(buf, kind, deadline)
        from mpi4py import MPI

        try:
            self.native.Allreduce(MPI.IN_PLACE, [buf, self._type(kind)], op=self._sum(kind))
        except MPI.Exception as e:
            raise CollectiveTimeout(f"MPI_Allreduce: the engine lost a peer: {e}") from e
        return None

    def iallgatherv(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int]) -> Request:
        from mpi4py import MPI

        displs = [0]
        for c in counts[:-1]:
            displs.append(displs[-1] + int(c))
        req = self.native.Iallgatherv(
            [send, MPI.BYTE], [recv, [int(c) for c in counts], displs, MPI.BYTE]
        )
        return _MpiRequest(req, "MPI_Iallgatherv")

    def ialltoallv(
        self,
        send: np.ndarray,
        send_counts: Sequence[int],
        recv: np.ndarray,
        recv_counts: Sequence[int],
    ) -> Request:
        from mpi4py import MPI

        sizes = [[int(n) for n in send_counts], [int(n) for n in recv_counts]]
        starts = [[0, *itertools.accumulate(c[:-1])] for c in sizes]
        req = self.native.Ialltoallv(
            [send, sizes[0], starts[0], MPI.BYTE], [recv, sizes[1], starts[1], MPI.BYTE]
        )
        return _MpiRequest(req, "MPI_Ialltoallv")

    def ireduce_scatterv(
        self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int], kind: str
    ) -> Request:
        t = self._type(kind)
        req = self.native.Ireduce_scatter([send, t], [recv, t], list(counts), op=self._sum(kind))
        return _MpiRequest(req, "MPI_Ireduce_scatter")

    def node_windows(self, capacity: int, deadline: float | None = None) -> NodeWindows | None:
        # Cached on the communicator as an MPI attribute ({"node": the node's communicator or
        # None when the ranks span several nodes, capacity: windows}): freed with it.
        key = _node_keyval()
        cache = self.native.Get_attr(key)
        if cache is None or (cache["node"] is not None and capacity not in cache):
            # Creating windows is collective and cannot time out: all alive first.
            _MpiRequest(self.native.Ibarrier(), "MPI_Ibarrier before the node windows").wait(
                deadline
            )
        if cache is None:
            from mpi4py import MPI

            node = self.native.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
            one_node = node.Get_size() == self.size
            cache = {"node": node if one_node else None}
            if not one_node:
                node.Free()
            self.native.Set_attr(key, cache)
        node = cache["node"]
        if node is None:
            return None
        windows = cache.get(capacity)
        if windows is None:
            windows = cache[capacity] = NodeWindows(node, capacity)
        return windows
