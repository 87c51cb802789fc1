"""Tensor messages and sub-groups for the plan runtime, on torch.distributed or MPI.

The runtime moves whole tensors between given ranks (activations forward, their gradients
backward) and reduces gradients over sub-groups of ranks. :func:`transport` picks the engine from
the ``group`` argument the user passes, as every hetcoll collective does: an mpi4py communicator,
a torch.distributed process group, or None (torch's default group).

On torch.distributed the tensors travel as they are (CPU tensors on gloo, CUDA tensors on NCCL);
on MPI they travel as bytes of host memory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from hetcoll.comm import Communicator, Request, TorchCommunicator, wrap

__all__ = ["CountingCommunicator", "Inbox", "Transport", "transport"]


class Transport(ABC):
    """Point-to-point tensors, sub-groups and whole-group collectives over one group."""

    rank: int
    size: int
    engine: str
    comm: Communicator  # the same group as a hetcoll Communicator (for hetcoll's collectives)

    @abstractmethod
    def isend(self, t: torch.Tensor, dst: int, tag: int) -> Any:
        """Start sending ``t`` (contiguous) to group rank ``dst``; keep ``t`` until waited."""

    @abstractmethod
    def irecv(self, t: torch.Tensor, src: int, tag: int) -> Any:
        """Start receiving into ``t`` (contiguous) from group rank ``src``; ``t`` holds the
        message once :meth:`wait` has returned. Messages of one source and tag are matched in
        the order their receives were started."""

    def recv(self, t: torch.Tensor, src: int, tag: int) -> None:
        """Receive into ``t`` (contiguous) from group rank ``src``."""
        self.wait([self.irecv(t, src, tag)])

    @abstractmethod
    def wait(self, handles: Sequence[Any]) -> None:
        """Wait for the sends and receives :meth:`isend` and :meth:`irecv` started."""

    @abstractmethod
    def subgroup(self, ranks: Sequence[int]) -> Any:
        """A group of ``ranks`` (group ranks; the sub-group numbers them in increasing order,
        as torch's ``new_group`` does), or None on ranks outside it. Every rank of the group
        calls it, for the same ``ranks``, in the same order. On a torch sub-group, all of its
        ranks give the sub-group itself."""

    def allreduce(self, t: torch.Tensor, sub: Any) -> None:
        """``t <- sum of t`` over sub-group ``sub`` (from :meth:`subgroup`; None: the group).
        A group of one rank sends nothing: its sum is its own tensor."""
        if sub is None and self.size == 1:
            return
        self._allreduce(t, sub)

    @abstractmethod
    def _allreduce(self, t: torch.Tensor, sub: Any) -> None:
        """:meth:`allreduce` on the engine."""

    def iallreduce(self, t: torch.Tensor) -> Any:
        """Start ``t <- sum of t`` over the group; ``t`` holds the sum once :meth:`wait` has
        returned for the handle. Every rank starts it at the same point of its collectives
        on the group. A group of one rank sends nothing."""
        if self.size == 1:
            return None
        return self._iallreduce(t)

    @abstractmethod
    def _iallreduce(self, t: torch.Tensor) -> Any:
        """:meth:`iallreduce` on the engine."""

    @abstractmethod
    def broadcast(self, t: torch.Tensor, src: int, sub: Any = None) -> None:
        """``t <- t of rank src`` (a rank of ``sub``, None: of the group) on every rank of it."""


class _TorchTransport(Transport):
    def __init__(self, comm: TorchCommunicator) -> None:
        import torch.distributed as dist

        self.comm = comm
        self._dist = dist
        self._group = comm.native
        self.rank, self.size, self.engine = comm.rank, comm.size, comm.engine
        self._global = comm.global_ranks
        self._subs: dict[tuple[int, ...], Any] = {}

    def isend(self, t: torch.Tensor, dst: int, tag: int) -> Any:
        return self._dist.isend(t, self._global[dst], tag=tag)

    def irecv(self, t: torch.Tensor, src: int, tag: int) -> Any:
        return self._dist.irecv(t, self._global[src], tag=tag)

    def wait(self, handles: Sequence[Any]) -> None:
        for h in handles:
            if h is not None:
                h.wait()

    def subgroup(self, ranks: Sequence[int]) -> Any:
        key = tuple(sorted(ranks))
        if key not in self._subs:
            dist = self._dist
            world = self._group is None or dist.get_world_size(self._group) == dist.get_world_size()
            if world:
                # Every rank of the default group creates every group, in one order, numbered
                # in the order of this group's ranks (a group of every rank in another order
                # is no default group). The whole group too: a group of its own keeps its
                # collectives apart from those the caller runs on the group meanwhile (DDP's).
                # `sort_ranks` is newer than torch 2.11, whose groups are all numbered in the
                # default group's order: this group's ranks are then ascending already.
                members = [self._global[r] for r in key]
                if members == sorted(members):
                    sub = dist.new_group(members)
                else:
                    sub = dist.new_group(members, sort_ranks=False)
            elif key == tuple(range(self.size)):
                # The whole sub-group, numbered alike: no group to make (torch's split_group
                # on a group of some ranks only moves its count of groups on those ranks
                # alone, so that a group every rank makes later never connects).
                sub = self._group
            else:
                sub = dist.split_group(self._group, [list(key)])
            self._subs[key] = sub if self.rank in key else None
        return self._subs[key]

    def _allreduce(self, t: torch.Tensor, sub: Any) -> None:
        self._dist.all_reduce(t, group=self._group if sub is None else sub)

    def _iallreduce(self, t: torch.Tensor) -> Any:
        return self._dist.all_reduce(t, group=self._group, async_op=True)

    def broadcast(self, t: torch.Tensor, src: int, sub: Any = None) -> None:
        group = self._group if sub is None else sub
        self._dist.broadcast(t, self._dist.get_global_rank(group, src) if group else src, group)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes on the host, as a flat uint8 tensor (a copy where ``t`` is not dense)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def from_bytes(
    raw: torch.Tensor, dtype: torch.dtype, shape: Sequence[int], *, copy: bool = False
) -> torch.Tensor:
    """The ``dtype`` tensor of ``shape`` held in the uint8 tensor ``raw`` (a slice of a packed
    buffer, :func:`as_bytes`'s bytes of tensors of several dtypes one after the other): a view
    where its offset suits ``dtype``, else a copy (a float64 after 3 bytes of a bool mask
    cannot be viewed in place); with ``copy``, a copy always (one, either way)."""
    if copy or raw.storage_offset() % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype).reshape(shape)


def _host_bytes(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


class _MpiTransport(Transport):
    def __init__(self, comm: Any) -> None:
        from mpi4py import MPI

        self.comm = wrap(comm)
        self._mpi = MPI
        self._c = comm
        self.rank, self.size, self.engine = comm.Get_rank(), comm.Get_size(), "mpi"
        self._subs: dict[tuple[int, ...], Any] = {}

    # A handle is (request, host buffer, the tensor a received host buffer is copied into).

    def isend(self, t: torch.Tensor, dst: int, tag: int) -> Any:
        host = t if t.device.type == "cpu" else t.cpu()
        return (self._c.Isend([_host_bytes(host), self._mpi.BYTE], dst, tag), host, None)

    def irecv(self, t: torch.Tensor, src: int, tag: int) -> Any:
        host = t if t.device.type == "cpu" else torch.empty_like(t, device="cpu")
        return (self._c.Irecv([_host_bytes(host), self._mpi.BYTE], src, tag), host, t)

    def wait(self, handles: Sequence[Any]) -> None:
        handles = [h for h in handles if h is not None]
        self._mpi.Request.Waitall([h[0] for h in handles])
        for _, host, t in handles:
            if t is not None and host is not t:
                t.copy_(host)

    def subgroup(self, ranks: Sequence[int]) -> Any:
        key = tuple(sorted(ranks))
        if key not in self._subs:
            # Only the members create it (MPI_Comm_create_group); the others skip.
            sub = None
            if self.rank in key:
                group = self._c.Get_group().Incl(list(key))
                sub = self._c.Create_group(group, tag=len(self._subs))
                group.Free()
            self._subs[key] = sub
        return self._subs[key]

    def _inplace(self, t: torch.Tensor, op: Any) -> None:
        host = _summable(t)
        op(host.numpy())
        if host is not t:
            t.copy_(host)

    def _allreduce(self, t: torch.Tensor, sub: Any) -> None:
        c = self._c if sub is None else sub
        self._inplace(t, lambda a: c.Allreduce(self._mpi.IN_PLACE, a, op=self._mpi.SUM))

    def _iallreduce(self, t: torch.Tensor) -> Any:
        host = _summable(t)
        request = self._c.Iallreduce(self._mpi.IN_PLACE, host.numpy(), op=self._mpi.SUM)
        return (request, host, t)

    def broadcast(self, t: torch.Tensor, src: int, sub: Any = None) -> None:
        c = self._c if sub is None else sub
        host = t if t.device.type == "cpu" else t.cpu()
        c.Bcast(_host_bytes(host), root=src)
        if host is not t:
            t.copy_(host)


def _summable(t: torch.Tensor) -> torch.Tensor:
    """``t`` in host memory in a dtype MPI sums: bfloat16 (which NumPy lacks) and float16
    (which MPI lacks) as float32, the sum rounded back once into ``t``; others as they are."""
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.to("cpu", torch.float32)
    return t if t.device.type == "cpu" else t.cpu()


class Inbox:
    """A stage's receives, posted an operation ahead. ``post(n)`` lists the messages of a
    schedule's ``n``-th operation as ``(buffer, source, tag)``; :meth:`take` starts them all
    before waiting for any (one handshake's latency, not one per message), and the next
    operation's too, so that its messages land while this one computes. ``ready`` is called
    once before the first receive (the runtime's batch check). Receives of one source and tag
    match in the order they were started, so posting ahead keeps the schedule's order."""

    def __init__(
        self,
        tr: Transport,
        count: int,
        post: Callable[[int], list[tuple[torch.Tensor, int, int]]],
        ready: Callable[[], None],
    ) -> None:
        self._tr, self._count, self._post, self._ready = tr, count, post, ready
        self._posted: dict[int, tuple[list[torch.Tensor], list[Any]]] = {}

    def _start(self, n: int) -> None:
        if n in self._posted or n >= self._count:
            return
        messages = self._post(n)
        if messages:
            self._ready()
        handles = [self._tr.irecv(buf, src, tag) for buf, src, tag in messages]
        self._posted[n] = ([buf for buf, _, _ in messages], handles)

    def take(self, n: int) -> list[torch.Tensor]:
        """Operation ``n``'s buffers, in ``post(n)``'s order, once they have arrived."""
        self._start(n)
        self._start(n + 1)
        bufs, handles = self._posted.pop(n)
        self._tr.wait(handles)
        return bufs


def transport(group: Any = None) -> Transport:
    """The :class:`Transport` over ``group``: an mpi4py communicator, a torch.distributed
    process group, or None (:func:`hetcoll.comm.wrap`'s default)."""
    c = wrap(group)  # the clear TypeError / ValueError for anything else
    if c.engine == "mpi":
        return _MpiTransport(c.native)
    torch_comm = wrap(c.native)  # the group's own (c may count what it sends)
    assert isinstance(torch_comm, TorchCommunicator)
    return _TorchTransport(torch_comm)


class CountingCommunicator(Communicator):
    """A :class:`Communicator` that counts the bytes this rank sends through it, by kind: the
    runtime gives one to each filter-split stage and says which kind (``"activations"``
    forward, ``"gradients"`` backward) the current traffic is. Collectives count what a
    bandwidth-optimal algorithm sends: ``2 (p-1)/p`` of an allreduced buffer, ``p - 1`` copies
    of this rank's piece of an allgather; point-to-point messages count exactly."""

    def __init__(self, inner: Communicator, counts: dict[str, int]) -> None:
        self.inner = inner
        self.rank, self.size, self.engine, self.native = (
            inner.rank,
            inner.size,
            inner.engine,
            inner.native,
        )
        self.counts = counts
        self.kind = "activations"

    def _add(self, n: float) -> None:
        self.counts[self.kind] = self.counts.get(self.kind, 0) + round(n)

    @staticmethod
    def count_as(comm: Communicator, kind: str) -> None:
        """Count what ``comm`` sends from now on as ``kind``, if it is counting."""
        if isinstance(comm, CountingCommunicator):
            comm.kind = kind

    @staticmethod
    def uncounted(comm: Communicator) -> Communicator:
        """``comm`` without counting (for exchanges outside a step: checkpoints)."""
        return comm.inner if isinstance(comm, CountingCommunicator) else comm

    def isend(self, buf: np.ndarray, dest: int, tag: int) -> Request:
        self._add(buf.nbytes)
        return self.inner.isend(buf, dest, tag)

    def irecv(self, buf: np.ndarray, source: int, tag: int) -> Request:
        return self.inner.irecv(buf, source, tag)

    def iallreduce_sum(self, buf: np.ndarray, kind: str) -> Request:
        self._add(2 * (self.size - 1) / self.size * buf.nbytes)
        return self.inner.iallreduce_sum(buf, kind)

    def allreduce_sum(self, buf: np.ndarray, kind: str, deadline: float | None) -> None:
        self._add(2 * (self.size - 1) / self.size * buf.nbytes)
        self.inner.allreduce_sum(buf, kind, deadline)

    def ibroadcast(self, buf: np.ndarray, root: int) -> Request:
        if self.rank == root:
            self._add((self.size - 1) * buf.nbytes)
        return self.inner.ibroadcast(buf, root)

    def iallgatherv(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int]) -> Request:
        self._add((self.size - 1) * send.nbytes)
        return self.inner.iallgatherv(send, recv, counts)

    def ialltoallv(
        self,
        send: np.ndarray,
        send_counts: Sequence[int],
        recv: np.ndarray,
        recv_counts: Sequence[int],
    ) -> Request:
        self._add(sum(send_counts) - send_counts[self.rank])
        return self.inner.ialltoallv(send, send_counts, recv, recv_counts)

    def ireduce_scatterv(
        self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int], kind: str
    ) -> Request:
        self._add(send.nbytes - recv.nbytes)
        return self.inner.ireduce_scatterv(send, recv, counts, kind)
