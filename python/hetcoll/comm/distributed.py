"""The :class:`Communicator` over torch.distributed (gloo on CPU, NCCL on GPU):
:class:`TorchCommunicator` and its :class:`TorchRequest`."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import numpy as np

from hetcoll.comm.base import Communicator, Request
from hetcoll.errors import CollectiveTimeout

#: The longest timed wait torch's work handles take: their timeout is in milliseconds, a C int.
#: A deadline further off (24.8 days) is waited for without a limit.
_LONGEST_WAIT_S = (2**31 - 1) / 1000


class TorchRequest(Request):
    """A request over a torch.distributed work handle (what the collectives wait on)."""

    # ``what`` names the transfer in errors only; point-to-point calls pass (verb, rank) and it
    # is formatted then, not on every one of the many segment messages.
    def __init__(
        self,
        work: Any,
        what: str | tuple[str, int],
        keep: Any = None,
        then: Callable[[], Any] | None = None,
    ) -> None:
        self._work = work
        self._what = what
        self._keep = keep  # tensors the engine still reads or writes
        self._then = then  # once done: a device result copied back into the host buffer

    def wait(self, deadline: float | None) -> None:
        try:
            if deadline is None:
                self._work.wait()
            else:
                # gloo closes the connection when a timed wait expires: the group is then
                # broken on every rank, which is what a dead peer means anyway.
                left = max(deadline - time.monotonic(), 1e-3)
                if left < _LONGEST_WAIT_S:
                    self._work.wait(timedelta(seconds=left))
                else:  # past what the engine can time (1e15 s once overflowed, a "lost peer")
                    self._work.wait()
        except Exception as e:
            what = self._what if isinstance(self._what, str) else f"{self._what[0]} {self._what[1]}"
            raise CollectiveTimeout(
                f"{what}: no completion before the timeout, or a peer was lost: {e}"
            ) from e
        if self._then is not None:
            self._then()  # after NCCL's wait, ordered on the current stream: synchronous
            self._then = None
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
    """A :class:`Communicator` over a torch.distributed process group (None: the default one).

    Its transfers take host buffers (numpy arrays) on every engine. NCCL moves device memory
    only, so there each goes through the current CUDA device: the buffers are copied there,
    and a result back into its host buffer once the transfer is done (its request's wait).
    The collectives send device tensors through NCCL directly, without these copies."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialised (init_process_group)")
        self.native = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.engine = str(dist.get_backend(group))
        self._dist = dist
        #: Each group rank's rank in the default group (the group's processes, in its order).
        self.global_ranks = [
            r if group is None else dist.get_global_rank(group, r) for r in range(self.size)
        ]

    def _wire(self, t: Any) -> Any:
        """Host tensor ``t`` as the engine moves it: on NCCL, a copy on the current CUDA
        device; elsewhere ``t`` itself."""
        return t.cuda() if self.engine == "nccl" else t

    def _staged(self, out: Any, inplace: bool = False) -> tuple[Any, Callable[[], Any] | None]:
        """Host result buffer ``out`` as the engine fills it (holding ``out``'s values where
        the transfer reads them too, ``inplace``), and what copies it back once the transfer
        is done (None where the engine fills ``out`` itself)."""
        if self.engine != "nccl":
            return out, None
        import torch

        wire = out.cuda() if inplace else torch.empty_like(out, device="cuda")
        return wire, lambda: out.copy_(wire)

    # The point-to-point calls run once per ring segment and per direct-exchange peer: kept to
    # the engine call and a try (no context manager, no message built unless it fails).
    def isend(self, buf: np.ndarray, dest: int, tag: int) -> Request:
        t = self._wire(_bytes(buf))
        try:
            work = self._dist.isend(t, self.global_ranks[dest], group=self.native, tag=tag)
        except (RuntimeError, ConnectionError) as e:
            raise _lost(f"send to rank {dest}", e) from e
        return TorchRequest(work, ("send to rank", dest), t)

    def irecv(self, buf: np.ndarray, source: int, tag: int) -> Request:
        t, then = self._staged(_bytes(buf))
        try:
            work = self._dist.irecv(t, self.global_ranks[source], group=self.native, tag=tag)
        except (RuntimeError, ConnectionError) as e:
            raise _lost(f"receive from rank {source}", e) from e
        return TorchRequest(work, ("receive from rank", source), t, then)

    def iallreduce_sum(self, buf: np.ndarray, kind: str) -> Request:
        import torch.distributed as dist

        t, then = self._staged(_tensor(buf, kind), inplace=True)
        with _lost_peer("all_reduce"):
            work = dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.native, async_op=True)
        return TorchRequest(work, "all_reduce", t, then)

    def ibroadcast(self, buf: np.ndarray, root: int) -> Request:
        import torch
        import torch.distributed as dist

        t, then = self._staged(torch.from_numpy(buf.reshape(-1).view(np.uint8)), inplace=True)
        with _lost_peer("broadcast"):
            work = dist.broadcast(t, self.global_ranks[root], group=self.native, async_op=True)
        return TorchRequest(work, "broadcast", t, then)

    def allreduce_sum(self, buf: np.ndarray, kind: str, deadline: float | None) -> None:
        if deadline is not None or self.engine == "nccl":  # a timed wait, a copy back
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

        inp = self._wire(torch.from_numpy(send if send.flags.writeable else send.copy()))
        out = torch.empty(self.size * send.size, dtype=torch.uint8, device=inp.device)
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

        out, then = self._staged(torch.from_numpy(recv))
        # repeat() copies, so a read-only send buffer is safe; torch warns on those, though.
        send = send if send.flags.writeable else send.copy()
        if send.size and all(int(c) == send.size for c in counts):
            # Equal pieces (an agreement's fingerprints): one all_gather_into_tensor with no
            # repeated copy, as allgather_fixed does (all_to_all_single took 1.3x its time).
            inp = self._wire(torch.from_numpy(send).contiguous())
            with _lost_peer("all_gather_into_tensor (allgatherv)"):
                work = dist.all_gather_into_tensor(out, inp, group=self.native, async_op=True)
            return TorchRequest(work, "all_gather_into_tensor (allgatherv)", (out, inp), then)
        # gloo's all_gather rejects pieces of different sizes; all_to_all_single with uneven
        # splits moves the same bytes: every rank sends its piece to each rank.
        inp = self._wire(torch.from_numpy(send)).repeat(self.size)
        with _lost_peer("all_to_all_single (allgatherv)"):
            work = dist.all_to_all_single(
                out,
                inp,
                output_split_sizes=[int(c) for c in counts],
                input_split_sizes=[send.size] * self.size,
                group=self.native,
                async_op=True,
            )
        return TorchRequest(work, "all_to_all_single (allgatherv)", (out, inp), then)

    def ialltoallv(
        self,
        send: np.ndarray,
        send_counts: Sequence[int],
        recv: np.ndarray,
        recv_counts: Sequence[int],
    ) -> Request:
        import torch
        import torch.distributed as dist

        out, then = self._staged(torch.from_numpy(recv))
        inp = self._wire(torch.from_numpy(send if send.flags.writeable else send.copy()))
        with _lost_peer("all_to_all_single"):
            work = dist.all_to_all_single(
                out,
                inp,
                output_split_sizes=[int(n) for n in recv_counts],
                input_split_sizes=[int(n) for n in send_counts],
                group=self.native,
                async_op=True,
            )
        return TorchRequest(work, "all_to_all_single", (out, inp), then)

    def ireduce_scatterv(
        self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int], kind: str
    ) -> Request:
        import torch.distributed as dist

        src = self._wire(_tensor(send, kind))
        out, then = self._staged(_tensor(recv, kind))
        pieces = list(src.split(list(counts)))
        with _lost_peer("reduce_scatter"):
            work = dist.reduce_scatter(
                out, pieces, op=dist.ReduceOp.SUM, group=self.native, async_op=True
            )
        return TorchRequest(work, "reduce_scatter", (out, pieces), then)
