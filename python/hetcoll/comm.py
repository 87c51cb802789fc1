"""One small Communicator over the engines hetcoll runs on: MPI (mpi4py) and torch.distributed.

The collectives in :mod:`hetcoll.collectives` need only this: rank and size, non-blocking
point-to-point messages, a non-blocking allreduce SUM, an allgather of pieces of different
lengths, a reduce-scatter of pieces of different lengths and, on MPI when every rank is on one
node, memory that every rank maps (:class:`NodeWindows`). Buffers are 1-D numpy arrays (the
zero-copy views :mod:`hetcoll.kernels` makes of numpy arrays and CPU tensors) together with
the element ``kind`` ("float32", "float64", "float16", "bfloat16", "int64"), because bfloat16
travels as raw 16-bit patterns that only the engine's reduction must know the meaning of.

Every wait takes an absolute ``deadline`` (``time.monotonic()`` seconds, or None to block): a
peer that does not answer in time, or that the engine reports lost, raises
:class:`hetcoll.CollectiveTimeout` instead of hanging.

>>> from mpi4py import MPI  # doctest: +SKIP
>>> comm = wrap(MPI.COMM_WORLD)  # doctest: +SKIP
>>> comm.rank, comm.size  # doctest: +SKIP
(0, 4)
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import sys
import time
import warnings
import weakref
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import numpy as np

from hetcoll import _core
from hetcoll.errors import CollectiveMismatchError, CollectiveTimeout

__all__ = [
    "NOT_GIVEN",
    "Communicator",
    "MpiCommunicator",
    "NodeWindows",
    "Request",
    "TorchCommunicator",
    "group_argument",
    "has_default",
    "wait_all",
    "wrap",
]

KINDS = ("float32", "float64", "float16", "bfloat16", "int64")


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

    def node_windows(self, capacity: int, deadline: float | None = None) -> NodeWindows | None:
        """Shared memory every rank maps (:class:`NodeWindows`, ``capacity`` bytes a rank),
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


# ----------------------------------------------------------------------------------------------
# MPI


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


# ----------------------------------------------------------------------------------------------
# torch.distributed


class TorchRequest(Request):
    """A request over a torch.distributed work handle (what the collectives wait on)."""

    # ``what`` names the transfer in errors only; point-to-point calls pass (verb, rank) and it
    # is formatted then, not on every one of the many segment messages.
    def __init__(self, work: Any, what: str | tuple[str, int], keep: Any = None) -> None:
        self._work = work
        self._what = what
        self._keep = keep  # tensors the engine still reads or writes

    def wait(self, deadline: float | None) -> None:
        try:
            if deadline is None:
                self._work.wait()
            else:
                # gloo closes the connection when a timed wait expires: the group is then
                # broken on every rank, which is what a dead peer means anyway.
                left = max(deadline - time.monotonic(), 1e-3)
                self._work.wait(timedelta(seconds=left))
        except Exception as e:
            what = self._what if isinstance(self._what, str) else f"{self._what[0]} {self._what[1]}"
            raise CollectiveTimeout(
                f"{what}: no completion before the timeout, or a peer was lost: {e}"
            ) from e
        self._keep = None


@contextmanager
def _lost_peer(what: str) -> Iterator[None]:
    """Starting a transfer to a dead peer fails at once on gloo ("connection closed"): that is
    the same event a timed wait reports, so it raises the same exception."""
    try:
        yield
    except (RuntimeError, ConnectionError) as e:
        raise _lost(what, e) from e


def _lost(what: str, e: BaseException) -> CollectiveTimeout:
    return CollectiveTimeout(f"{what}: the engine failed, a peer may be lost: {e}")


def _tensor(buf: np.ndarray, kind: str) -> Any:
    """A torch tensor sharing ``buf``'s memory, of the element type ``kind`` says."""
    import torch

    if kind == "bfloat16":
        return torch.from_numpy(buf.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(buf)


def _bytes(buf: np.ndarray) -> Any:
    """The bytes of ``buf`` as a tensor type every torch backend can send."""
    import torch

    if buf.dtype.itemsize == 2:
        return torch.from_numpy(buf.view(np.int16))
    return torch.from_numpy(buf)


class TorchCommunicator(Communicator):
    """A :class:`Communicator` over a torch.distributed process group (None: the default one)."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialised (init_process_group)")
        self.native = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.engine = str(dist.get_backend(group))
        self._dist = dist
        self._global = [
            r if group is None else dist.get_global_rank(group, r) for r in range(self.size)
        ]

    # The point-to-point calls run once per ring segment and per direct-exchange peer: kept to
    # the engine call and a try (no context manager, no message built unless it fails).
    def isend(self, buf: np.ndarray, dest: int, tag: int) -> Request:
        t = _bytes(buf)
        try:
            work = self._dist.isend(t, self._global[dest], group=self.native, tag=tag)
        except (RuntimeError, ConnectionError) as e:
            raise _lost(f"send to rank {dest}", e) from e
        return TorchRequest(work, ("send to rank", dest), t)

    def irecv(self, buf: np.ndarray, source: int, tag: int) -> Request:
        t = _bytes(buf)
        try:
            work = self._dist.irecv(t, self._global[source], group=self.native, tag=tag)
        except (RuntimeError, ConnectionError) as e:
            raise _lost(f"receive from rank {source}", e) from e
        return TorchRequest(work, ("receive from rank", source), t)

    def iallreduce_sum(self, buf: np.ndarray, kind: str) -> Request:
        import torch.distributed as dist

        t = _tensor(buf, kind)
        with _lost_peer("all_reduce"):
            work = dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.native, async_op=True)
        return TorchRequest(work, "all_reduce", t)

    def allreduce_sum(self, buf: np.ndarray, kind: str, deadline: float | None) -> None:
        if deadline is not None:  # a timed wait needs the request
            return super().allreduce_sum(buf, kind, deadline)
        import torch.distributed as dist

        with _lost_peer("all_reduce"):
            dist.all_reduce(_tensor(buf, kind), op=dist.ReduceOp.SUM, group=self.native)
        return None

    def allgather_fixed(self, send: np.ndarray, deadline: float | None) -> np.ndarray:
        # Equal pieces: gloo's all_gather_into_tensor, one collective with no repeated copy
        # (all_to_all_single, which uneven pieces need, took 1.3x its time at 32 B-64 KiB).
        import torch
        import torch.distributed as dist

        inp = torch.from_numpy(send if send.flags.writeable else send.copy())
        if self.engine == "nccl":
            # NCCL moves device memory only: the few bytes go through the current CUDA device.
            out = torch.empty(self.size * send.size, dtype=torch.uint8, device="cuda")
            inp = inp.cuda()
        else:
            out = torch.empty(self.size * send.size, dtype=torch.uint8)
        # Small and on every call's path (allgatherv's first round): without a deadline the
        # blocking call, with no request to wrap.
        try:
            work = dist.all_gather_into_tensor(
                out, inp, group=self.native, async_op=deadline is not None
            )
        except (RuntimeError, ConnectionError) as e:
            raise _lost("all_gather_into_tensor", e) from e
        if deadline is not None:
            TorchRequest(work, "all_gather_into_tensor", (out, inp)).wait(deadline)
        return out.cpu().numpy().reshape(self.size, send.size)

    def iallgatherv(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int]) -> Request:
        import torch
        import torch.distributed as dist

        # gloo's all_gather rejects pieces of different sizes; all_to_all_single with uneven
        # splits moves the same bytes: every rank sends its piece to each rank.
        out = torch.from_numpy(recv)
        # repeat() copies, so a read-only send buffer is safe; torch warns on those, though.
        send = send if send.flags.writeable else send.copy()
        inp = torch.from_numpy(send).repeat(self.size)
        with _lost_peer("all_to_all_single (allgatherv)"):
            work = dist.all_to_all_single(
                out,
                inp,
                output_split_sizes=[int(c) for c in counts],
                input_split_sizes=[send.size] * self.size,
                group=self.native,
                async_op=True,
            )
        return TorchRequest(work, "all_to_all_single (allgatherv)", (out, inp))

    def ialltoallv(
        self,
        send: np.ndarray,
        send_counts: Sequence[int],
        recv: np.ndarray,
        recv_counts: Sequence[int],
    ) -> Request:
        import torch
        import torch.distributed as dist

        out = torch.from_numpy(recv)
        inp = torch.from_numpy(send if send.flags.writeable else send.copy())
        with _lost_peer("all_to_all_single"):
            work = dist.all_to_all_single(
                out,
                inp,
                output_split_sizes=[int(n) for n in recv_counts],
                input_split_sizes=[int(n) for n in send_counts],
                group=self.native,
                async_op=True,
            )
        return TorchRequest(work, "all_to_all_single", (out, inp))

    def ireduce_scatterv(
        self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int], kind: str
    ) -> Request:
        import torch.distributed as dist

        src = _tensor(send, kind)
        out = _tensor(recv, kind)
        pieces = list(src.split(list(counts)))
        with _lost_peer("reduce_scatter"):
            work = dist.reduce_scatter(
                out, pieces, op=dist.ReduceOp.SUM, group=self.native, async_op=True
            )
        return TorchRequest(work, "reduce_scatter", (out, pieces))


def is_mpi_comm(x: object) -> bool:
    """Whether ``x`` is an mpi4py communicator (without importing mpi4py)."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and isinstance(x, mpi.Comm)


# One wrapper per process group, kept while the group lives: wrapping is on every collective's
# path (the default group's wrapper asks torch for rank, size and backend), and a group's rank,
# size and backend never change. Keyed by the group object itself (the default group's
# object for None), so a group destroyed and created anew gets a new wrapper.
_torch_wrappers: weakref.WeakKeyDictionary[Any, TorchCommunicator] = weakref.WeakKeyDictionary()


def _torch_communicator(group: Any) -> TorchCommunicator:
    import torch.distributed as dist

    key = dist.group.WORLD if group is None else group
    c = _torch_wrappers.get(key)
    if c is None:
        c = _torch_wrappers[key] = TorchCommunicator(group)
    return c


#: Environment variables that mpiexec (MPICH / Hydra, Intel MPI, Open MPI, PMIx, MVAPICH)
#: sets in every rank it starts.
MPI_LAUNCHER_VARIABLES = (
    "PMI_RANK",
    "PMI_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "PMIX_RANK",
    "MV2_COMM_WORLD_RANK",
)

#: What a public function was called with when it was not given a deprecated keyword.
NOT_GIVEN: Any = type("NotGiven", (), {"__repr__": lambda self: "NOT_GIVEN"})()


def _torch_default() -> bool:
    dist = sys.modules.get("torch.distributed")  # not imported: it cannot be initialised
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def _under_mpi() -> bool:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return True
    return any(v in os.environ for v in MPI_LAUNCHER_VARIABLES)


def has_default() -> bool:
    """Whether ``group=None`` means a communicator here (see :func:`wrap`), without raising."""
    return _torch_default() or _under_mpi()


def wrap(x: Any = None) -> Communicator:
    """A :class:`Communicator` over ``x``: an mpi4py communicator, a torch.distributed process
    group, a Communicator (returned as is), or None, the default of every public function of
    hetcoll that takes ``group=``, decided here only:

    1. torch.distributed's default group, when torch.distributed is initialised;
    2. else ``MPI.COMM_WORLD``, when mpi4py has initialised MPI or the process was started by
       mpiexec (:data:`MPI_LAUNCHER_VARIABLES`);
    3. else a ``ValueError`` naming ``group``.

    >>> import torch.distributed as dist  # doctest: +SKIP
    >>> wrap(None).size == dist.get_world_size()  # doctest: +SKIP
    True
    """
    if isinstance(x, Communicator):
        return x
    if x is None:
        if _torch_default():
            return _torch_communicator(None)
        if _under_mpi():
            from mpi4py import MPI

            return MpiCommunicator(MPI.COMM_WORLD)
        raise ValueError(
            "group: none given and no default: torch.distributed is not initialised "
            "(init_process_group) and this is no MPI job (mpiexec); pass group= an mpi4py "
            "communicator or a torch.distributed process group"
        )
    if is_mpi_comm(x):
        mpi = sys.modules["mpi4py.MPI"]
        if not isinstance(x, mpi.Intracomm):
            raise TypeError("group: an MPI intercommunicator is not supported")
        return MpiCommunicator(x)
    torch_dist = sys.modules.get("torch.distributed")
    if torch_dist is not None and isinstance(x, torch_dist.ProcessGroup):
        if not torch_dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialised (init_process_group)")
        return _torch_communicator(x)
    raise TypeError(
        "group: must be an mpi4py communicator, a torch.distributed ProcessGroup, None or a "
        f"hetcoll Communicator, got {type(x).__name__}"
    )


def group_argument(group: Any, where: str, **old: Any) -> Any:
    """``group``, or the value of a deprecated keyword that named it before (``comm=`` ...;
    pass ``name=value`` with :data:`NOT_GIVEN` as the keyword's default): that one still works
    for one release, with a ``DeprecationWarning``. Both at once is a ``ValueError``.

    >>> group_argument(None, "f", comm=NOT_GIVEN) is None
    True
    """
    given = {k: v for k, v in old.items() if v is not NOT_GIVEN}
    if not given:
        return group
    name, value = next(iter(given.items()))
    warnings.warn(
        f"{where}({name}=...) is now {where}(group=...); {name}= goes in the next release",
        DeprecationWarning,
        stacklevel=3,
    )
    if group is not None:
        raise ValueError(f"group: give group= or the deprecated {name}=, not both")
    return value


#: Round one of an agreement, per rank: [status, digest of the fields, *values].
_OK, _FAILED = 0, 1


def _digest(fields: Mapping[str, int]) -> int:
    """A 63-bit fingerprint of the field names and values, in order (blake2b, one pass)."""
    key = "\0".join(fields).encode() + np.array(list(fields.values()), np.int64).tobytes()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def _first_round(
    fields: Mapping[str, int], failure: BaseException | None, values: Sequence[int] | np.ndarray
) -> np.ndarray:
    out = np.empty(2 + len(values), dtype=np.int64)
    out[0] = _FAILED if failure is not None else _OK
    out[1] = 0 if failure is not None else _digest(fields)
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
    mine = _first_round(fields, failure, values)
    if comm.size == 1:
        if failure is not None:
            raise failure
        return mine[None, 2:]
    rows = comm.allgather_int64(mine, deadline)
    _settle(comm, rows, fields, failure, deadline)
    return rows[:, 2:]


def start_agreement(comm: Communicator, fields: Mapping[str, int]) -> Callable[[], None]:
    """:func:`agree` without waiting: starts the allgather and returns the function that waits
    for it and raises as :func:`agree` does (on every rank alike). A caller may compute, but not
    communicate on ``comm``, until it has called it. On NCCL, whose gathers move device memory,
    the check runs at once and the function has nothing left to do."""
    if comm.engine == "nccl":
        agree(comm, fields)
        return lambda: None
    mine = _first_round(fields, None, ())
    rows = np.empty((comm.size, mine.size), dtype=np.int64)
    request = comm.iallgatherv(
        mine.view(np.uint8), rows.reshape(-1).view(np.uint8), [mine.nbytes] * comm.size
    )

    def wait() -> None:
        request.wait(None)
        _settle(comm, rows, fields, None, None)

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
    for j, name in enumerate(names):
        column = rows[:, j]
        if (column != column[0]).any():
            per_rank = ", ".join(f"rank {r}: {int(v)}" for r, v in enumerate(column))
            raise CollectiveMismatchError(f"ranks disagree on {name} ({per_rank})")


def deadline(timeout: float | None) -> float | None:
    """The :func:`time.monotonic` moment a call with ``timeout`` seconds must end by (None or
    ``math.inf``: no limit); a bad ``timeout`` raises ``ValueError`` naming it."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout: must be a number of seconds > 0 or None, got {timeout!r}")
    if math.isinf(timeout):  # no limit; an infinite wait is what torch cannot represent
        return None
    return time.monotonic() + float(timeout)
