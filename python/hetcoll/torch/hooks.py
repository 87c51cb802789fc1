"""Exact sample-weighted gradient averaging as a DDP communication hook.

DDP averages gradients by dividing the sum by the world size, which is the full-batch gradient
only when every rank has the same batch size. With local batches ``n_r`` and each rank's loss the
mean over its own batch (PyTorch's default), the full-batch gradient is
``sum_r n_r * g_r / sum_r n_r``. This hook computes exactly that: each bucket is pre-scaled by
``n_r`` (one fused pass; the Rust kernel for CPU tensors, torch for device tensors), summed with
the process group's allreduce, and divided by ``N = sum_r n_r``. ``N`` is itself summed across
ranks once per step, by a one-element allreduce issued with the step's first bucket, so a ragged
last batch or a share change between steps needs nothing more: :func:`register_weighted_hook`
counts each step's samples off the DDP model's forward (:class:`hetcoll.torch.BatchCounter`);
a state built by hand takes ``state.local_batch = len(batch)`` instead.

Small buckets on gloo take a shorter road (``algorithm="direct"``, the default choice for them):
every rank sends its raw bucket and its ``n_r`` to every other rank in one round of point-to-point
messages, and each rank forms ``sum_r (n_r / N) * g_r`` in rank order with one Rust pass, the
weights fused into the reduction. It is one message latency instead of the several rounds of a
ring allreduce plus the count's allreduce; every rank computes bitwise the same sum. It is the
exchange of ``hetcoll.allreduce(..., algorithm="direct")``. "auto" takes it on two ranks below
:data:`TWO_RANK_DIRECT_BELOW_BYTES` and on more while ``(p - 1)`` buckets are a few MiB (where
:func:`hetcoll.allreduce` would, :data:`hetcoll.collectives.DIRECT_BYTES`). A worker thread runs
it, so the hook returns at once and DDP keeps overlapping communication with the backward.
A CUDA rank's buckets on gloo take the same road as the CPU ranks' (staged through host
memory), so one GPU rank trains beside CPU ranks in one DDP group; on NCCL every bucket takes
the allreduce, each rank's weight fused into NCCL's reduction (``PREMUL_SUM``).

Usage::

    ddp = DDP(model)
    state = register_weighted_hook(ddp)     # each step weighs the samples ddp's forwards saw
    for x, y in loader:
        loss_fn(ddp(x), y).backward()

or, as with PyTorch's own hooks, with the count set by hand::

    state = WeightedAllreduceState(None, local_batch=shares[rank])
    ddp.register_comm_hook(state, weighted_allreduce_hook)
    for x, y in loader:
        state.local_batch = len(x)
        loss_fn(ddp(x), y).backward()
"""

# No `from __future__ import annotations`: DDP inspects the hook's annotations at runtime and
# requires the real `dist.GradBucket` / `Future[Tensor]` objects.
import queue
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

import hetcoll
from hetcoll.collectives import choose_algorithm, direct_allreduce, premul_sum_op
from hetcoll.comm import NOT_GIVEN, agree, group_argument, is_mpi_comm, wrap
from hetcoll.kernels import numpy_view
from hetcoll.torch.batches import BatchCounter

ALGORITHMS = ("auto", "direct", "allreduce")
#: "auto" sends a bucket on two ranks through the direct exchange below this size, per
#: backend. One round carries the bucket and the sample count, where the allreduce path adds the
#: count's allreduce; and a step's buckets come one at a time as the backward frees them, the
#: way single calls are timed (there, on two gloo ranks, the direct exchange took 0.3-1.1x the
#: time of dist.all_reduce up to 256 KiB; from 1 MiB its send/recv pairs were hit harder by the
#: host's late wake-ups, 1.49x and 1.50x at 1 and 4 MiB). The data-parallel benchmark runs with
#: it.
TWO_RANK_DIRECT_BELOW_BYTES: dict[str, float] = {"gloo": 1 << 20}
_TAG_BASE = 42_000  # bucket i: its weight on _TAG_BASE + 2i, its data on _TAG_BASE + 2i + 1


def local_batch_value(n: object) -> int:
    """A rank's sample count for one step, checked: an integer >= 0."""
    if isinstance(n, bool) or not hasattr(n, "__index__") or int(n.__index__()) < 0:
        raise ValueError(f"local_batch: must be an integer >= 0, got {n!r}")
    return int(n.__index__())


class WeightedAllreduceState:
    """State of :func:`weighted_allreduce_hook`: the process group and this rank's number of
    samples in the current step (set it before each backward when it changes, or give
    ``counter``, a :class:`hetcoll.torch.BatchCounter` on the DDP model, to count it off each
    step's forwards: :func:`register_weighted_hook` does both).

    ``group``: the torch.distributed process group DDP runs on (None: the default group, as
    everywhere in hetcoll once torch.distributed is initialised, which DDP needs);
    ``process_group=`` is its deprecated name.

    ``algorithm``: "direct" (one round of point-to-point messages; not on NCCL), "allreduce"
    (pre-scale and the process group's allreduce) or "auto" (direct for small buckets or two
    ranks, not on NCCL; see the module docstring).

    ``ready_at``: ``time.perf_counter()`` when the latest step's last gradient bucket was
    ready, before any waiting for the other ranks. With the time the step started it gives this
    rank's own compute time, the signal :class:`hetcoll.torch.Rebalancer` needs.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        local_batch: int | None = None,
        *,
        algorithm: str = "auto",
        counter: BatchCounter | None = None,
        process_group: Any = NOT_GIVEN,
    ) -> None:
        group = group_argument(group, "WeightedAllreduceState", process_group=process_group)
        if is_mpi_comm(group):
            raise TypeError(
                "group: the DDP hook runs on torch.distributed; for MPI wrap the optimizer in "
                "hetcoll.torch.DistributedOptimizer"
            )
        if counter is not None and not isinstance(counter, BatchCounter):
            raise TypeError(f"counter: must be a BatchCounter, got {type(counter).__name__}")
        if local_batch is None and counter is None:
            raise TypeError(
                "local_batch: required (this rank's samples in the step) unless a counter "
                "counts them; hetcoll.torch.register_weighted_hook(ddp) sets one up"
            )
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm: must be one of {ALGORITHMS}, got {algorithm!r}")
        self.group = group
        #: The same group, under the name torch's own hook states use.
        self.process_group = group
        self._local_batch: int | None = None
        if local_batch is not None:
            self.local_batch = local_batch
        self.algorithm = algorithm
        self.counter = counter
        self._in_step = False
        self._step_total: torch.futures.Future | None = None
        self._direct_exchange: _DirectExchange | None = None
        self._agreed = False
        self.ready_at = 0.0

    def _agree(self) -> None:
        """Once: every rank must have chosen the same algorithm, or the ranks would wait on
        messages of different kinds forever; raise :class:`hetcoll.CollectiveMismatchError` on
        every rank instead (:func:`hetcoll.comm.agree`; under NCCL its few bytes go through the
        current CUDA device, the one DDP's buckets are on)."""
        if self._agreed:
            return
        codes = ", ".join(f"{a!r} = {i}" for i, a in enumerate(ALGORITHMS))
        agree(wrap(self.process_group), {f"algorithm ({codes})": ALGORITHMS.index(self.algorithm)})
        self._agreed = True

    @property
    def local_batch(self) -> int | None:
        """This rank's samples in the current step (with a counter: in the latest step whose
        exchange began; None before the first)."""
        return self._local_batch

    @local_batch.setter
    def local_batch(self, n: int) -> None:
        self._local_batch = local_batch_value(n)

    def _begin_step(self) -> int:
        """This step's local batch, taken from the counter once, at the step's first bucket."""
        if not self._in_step:
            if self.counter is not None:
                self._local_batch = self.counter.take()
            self._in_step = True
        assert self._local_batch is not None  # the constructor requires it or a counter
        return self._local_batch

    def _global_batch(self) -> torch.futures.Future:
        """Future of ``N = sum_r n_r`` for the current step; launched once per step."""
        if self._step_total is None:
            count = torch.tensor([float(self._begin_step())], dtype=torch.float64)
            if _backend(self.process_group) == "nccl":
                count = count.cuda()
            work = dist.all_reduce(count, group=self.process_group, async_op=True)
            self._step_total = work.get_future()
        return self._step_total


def _backend(group: Any) -> str:
    try:
        return str(dist.get_backend(group))
    except Exception:
        return "gloo"


_KERNEL = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _scale_(buf: torch.Tensor, factor: float) -> None:
    if buf.device.type == "cpu" and buf.dtype in _KERNEL:
        hetcoll.weighted_sum([buf], [factor], out=buf)
    else:
        buf.mul_(factor)


def weighted_allreduce_hook(
    state: WeightedAllreduceState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket becomes ``sum_r n_r * grad_r / sum_r n_r`` on every rank."""
    if not isinstance(state, WeightedAllreduceState):
        raise TypeError(
            "state: weighted_allreduce_hook needs a WeightedAllreduceState, got "
            f"{type(state).__name__} (register with ddp.register_comm_hook(state, hook))"
        )
    last = bucket.is_last()
    if last:
        state.ready_at = time.perf_counter()
    buf = bucket.buffer()
    state._agree()
    local_batch = state._begin_step()
    if last:
        state._in_step = False  # the next call starts the next step
    # The choice reads only what every rank has alike (sizes, the rank count, the engine), not
    # the bucket's device: a CUDA rank beside CPU ranks on gloo takes the direct exchange too,
    # its bucket staged through host memory (on NCCL every bucket is on a GPU: the allreduce).
    host_wire = buf.device.type == "cpu" or _backend(state.process_group) != "nccl"
    if state.algorithm != "allreduce" and host_wire and buf.dtype in _KERNEL:
        if state._direct_exchange is None:
            state._direct_exchange = _DirectExchange(state.process_group)
        direct = state._direct_exchange
        nbytes = buf.numel() * buf.element_size()
        c = direct.comm
        two = c.size == 2 and nbytes < TWO_RANK_DIRECT_BELOW_BYTES.get(c.engine, 0)
        if state.algorithm == "direct" or two or choose_algorithm(c, nbytes, False) == "direct":
            return direct.submit(buf, local_batch, bucket.index(), last)
    total_fut = state._global_batch()
    if last:
        state._step_total = None  # the next step sums its own batch sizes
    # On NCCL each rank's factor is applied inside the reduction kernel (PREMUL_SUM).
    op = premul_sum_op(_backend(state.process_group), float(local_batch))
    if op is None:
        op = dist.ReduceOp.SUM
        _scale_(buf, float(local_batch))
    work = dist.all_reduce(buf, op=op, group=state.process_group, async_op=True)

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        reduced = fut.value()[0]
        total = float(total_fut.wait()[0].item())
        if total <= 0:
            raise ValueError("local_batch: every rank reported 0 samples for this step")
        reduced.div_(total)
        return reduced

    return work.get_future().then(finish)


def register_weighted_hook(
    ddp: torch.nn.parallel.DistributedDataParallel,
    *,
    algorithm: str = "auto",
    batch_dim: int = 0,
) -> WeightedAllreduceState:
    """Make ``ddp``'s gradient the exact sample-weighted mean over ranks, each step weighing
    the samples that went through ``ddp``'s forwards since the previous step (dimension
    ``batch_dim`` of the forward's first tensor argument; forwards without gradients, such as
    evaluation, do not count). Nothing to set in the training loop: uneven shares, a ragged
    last batch and new shares from :meth:`BalancedSampler.set_shares` are all weighed right.

    The hook runs on ``ddp``'s own process group; ``algorithm`` as in
    :class:`WeightedAllreduceState`. Returns the state (its ``ready_at`` feeds the
    :class:`hetcoll.torch.Rebalancer`).
    """
    if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            f"ddp: must be a torch.nn.parallel.DistributedDataParallel, got {type(ddp).__name__}"
        )
    state = WeightedAllreduceState(
        ddp.process_group, algorithm=algorithm, counter=BatchCounter(ddp, batch_dim=batch_dim)
    )
    ddp.register_comm_hook(state, weighted_allreduce_hook)
    return state


class _DirectExchange:
    """The direct weighted exchange of :mod:`hetcoll.collectives` (``algorithm="direct"``,
    weights normalized) per bucket, with each bucket's own message tags. gloo's send/recv works
    have no futures, so a worker thread runs the exchanges and completes the hook's futures, and
    the backward goes on meanwhile; the last bucket of a step, which the backward only waits for,
    is exchanged right in the hook (no hand-over to the thread and back), beside the thread's."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.comm = wrap(group)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="hetcoll-direct", daemon=True).start()

    def submit(
        self, buf: torch.Tensor, local_batch: int, index: int, last: bool
    ) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        if last:
            self._run(fut, buf, local_batch, index)
        else:
            self._jobs.put((fut, buf, local_batch, index))
        return fut

    def _serve(self) -> None:
        while True:
            self._run(*self._jobs.get())

    def _run(self, fut: torch.futures.Future, buf: torch.Tensor, n: int, index: int) -> None:
        try:
            fut.set_result(self._exchange(buf, n, index))
        except Exception as e:  # the backward that waits on the future raises it
            fut.set_exception(e)

    def _exchange(self, buf: torch.Tensor, n: int, index: int) -> torch.Tensor:
        # A device bucket (a CUDA rank on gloo) goes through host memory, as hetcoll's
        # collectives stage it (hetcoll.collectives.device.stage_on_host).
        host = buf if buf.device.type == "cpu" else buf.cpu()
        view, bf16 = numpy_view(host, "bucket")
        try:
            tag = _TAG_BASE + 2 * index
            direct_allreduce(
                self.comm, view.reshape(-1), bf16, float(n), None, normalize=True, tag=tag
            )
        except ValueError as e:
            raise ValueError("local_batch: every rank reported 0 samples for this step") from e
        if host is not buf:
            buf.copy_(host)
        return buf
