"""Exact sample-weighted gradient averaging as a DDP communication hook.

DDP averages gradients by dividing the sum by the world size, which is the full-batch gradient
only when every rank has the same batch size. With local batches ``n_r`` and each rank's loss the
mean over its own batch (PyTorch's default), the full-batch gradient is
``sum_r n_r * g_r / sum_r n_r``. This hook computes exactly that: each bucket is pre-scaled by
``n_r`` (one pass), summed with the process group's allreduce,
and divided by ``N = sum_r n_r`` (:func:`hetcoll.torch.item_total`, the rule's denominator). On
gloo the ``n_r`` ride in a small bucket's own allreduce, appended to it in pieces small enough
that their sums stay exact integers in the bucket's type (float32 and float64 buckets up to
:data:`COUNT_IN_BUCKET_BYTES`: one collective a step for a small model, as DDP's own hook
makes); for larger and 16-bit buckets they are gathered by a one-element allgather issued with
the step's first such bucket, and on NCCL too (summed on the device, where a step no rank
counted a sample of averages to zeros instead of raising). Either way a ragged last batch or a
share change between steps needs nothing more: :func:`register_weighted_hook` counts each step's
samples off the DDP model's forward (:class:`hetcoll.torch.BatchCounter`); a state built by
hand takes ``state.local_batch = len(batch)`` instead.

Buckets on gloo may take another road (``algorithm="direct"``): every rank sends its raw bucket
and its ``n_r`` to every other rank in one round of point-to-point messages, and each rank forms
``sum_r (n_r / N) * g_r`` in rank order with one Rust pass, the weights fused into the
reduction; every rank computes bitwise the same sum. It is the exchange of
``hetcoll.allreduce(..., algorithm="direct")``, and "auto" takes it where
:func:`hetcoll.allreduce` would: on more than two ranks while ``(p - 1)`` buckets are a few MiB
(:data:`hetcoll.collectives.DIRECT_BYTES`), on two from a few MiB
(:data:`hetcoll.collectives.DIRECT_TWO_RANKS_FROM_BYTES`). Inside DDP's step the same
crossovers hold (benches/bench_data_parallel.py's hook benchmark). A worker thread runs it, so
the hook returns at once and DDP keeps overlapping communication with the backward.
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

A loss that is a mean over something else than rows, such as a language model's mean over its
valid tokens, weighs each rank by ``items(y)`` instead (:func:`hetcoll.torch.item_weights`, the
rule; a rank with no valid token is legal and contributes nothing)::

    state = register_weighted_hook(ddp, items=lambda y: int((y != -100).sum()))
    for x, y in loader:
        state.count(y)                      # collective: every rank, every step, before backward
        loss_fn(ddp(x), y).backward()       # loss_fn: the mean over y's valid tokens

(``items`` counts what the loss averages over: a loss that shifts its labels, as a causal
LM's does, averages over ``y[:, 1:]``, so count those.)

``count(y)`` exchanges the ranks' counts at once (one small allgather), so a bad count (zero on
every rank, a negative or non-integer ``items(y)``) raises a ``ValueError`` naming ``items`` on
every rank there, before the backward; the hook then scales each bucket by this rank's weight
``n_r / N`` and sums.
"""

# No `from __future__ import annotations`: DDP inspects the hook's annotations at runtime and
# requires the real `dist.GradBucket` / `Future[Tensor]` objects.
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import hetcoll
from hetcoll.collectives import choose_algorithm, direct_allreduce, premul_sum_op
from hetcoll.comm import (
    NOT_GIVEN,
    Communicator,
    agree,
    group_argument,
    is_mpi_comm,
    wrap,
    wrap_or_raise,
)
from hetcoll.kernels import numpy_view
from hetcoll.torch.batches import (
    MAX_ITEMS,
    NOT_COUNTED,
    BatchCounter,
    Items,
    LocalCount,
    added_counts,
    called_twice,
    count_items,
    counted,
    counted_rows,
    item_total,
    item_weights,
    items_argument,
    local_batch_value,
    not_counted,
)
from hetcoll.torch.state_dicts import few_names
from hetcoll.torch.step_timer import StepTimer
from hetcoll.torch.weighing import loss_failure, scaled, weighed

ALGORITHMS = ("auto", "direct", "allreduce")
#: On gloo the ranks' counts ride in the allreduce of a float32 or float64 bucket of up to this
#: many bytes (the buffer one count longer is kept, one per such bucket), where a separate
#: collective's fixed cost is a large part of the bucket's own; a larger bucket's count is
#: gathered apart, once a step, beside its allreduce. DDP's first bucket is 1 MiB.
COUNT_IN_BUCKET_BYTES = 1 << 20
#: register_weighted_hook's agreement: whether the ranks count items(y) or rows.
_ITEMS_FIELD = "items (0: rows counted off the forwards, 1: items(y) given)"
_TAG_BASE = 42_000
#: Each state's direct exchanges have tags of their own: state k's bucket i its weight on
#: ``_TAG_BASE + k * _TAGS_PER_STATE + 2i``, its data on the next, so that two DDP models in one
#: backward (a GAN's generator step through its discriminator) never take each other's
#: messages. ``k``: the ranks' agreed number for the state (:func:`_agreed_number`), modulo
#: ``_STATES``: the tags stay below 2**31.
_TAGS_PER_STATE = 1 << 17
_STATES = 1 << 14
#: The least number this process may give the next state's direct exchanges.
_next_number = 0


class WeightedAllreduceState:
    """State of :func:`weighted_allreduce_hook`: the process group and this rank's count in the
    current step, in one of three ways: ``local_batch``, its samples (set it before each
    backward when it changes); ``counter``, a :class:`hetcoll.torch.BatchCounter` on the DDP
    model that counts them off each step's forwards (:func:`register_weighted_hook` sets one
    up); or ``items``, a function ``items(y)`` counting what the loss averages over (valid
    tokens, ...), given each step's targets by :meth:`count`.

    ``group``: the torch.distributed process group DDP runs on (None: the default group, as
    everywhere in hetcoll once torch.distributed is initialised, which DDP needs);
    ``process_group=`` is its deprecated name.

    ``algorithm``: "direct" (one round of point-to-point messages; not on NCCL), "allreduce"
    (pre-scale and the process group's allreduce) or "auto" (direct for small buckets or two
    ranks, not on NCCL; see the module docstring).

    ``ready_at``: ``time.perf_counter()`` when the latest step's last gradient bucket was
    ready, before any waiting for the other ranks (on a GPU: when its work was queued).
    :class:`hetcoll.torch.StepTimer` gives the rank's own compute time per step, on a GPU
    too, the signal :class:`hetcoll.torch.Rebalancer` needs.

    Under ``ddp.join()`` a rank out of inputs runs the hook for the others' steps without a
    forward of its own: :func:`register_weighted_hook`'s counter counts it 0, but a state
    counting by hand keeps its last ``local_batch``, which would weigh gradients it no longer
    has. Set ``state.local_batch = 0`` once its inputs end, inside the ``join()``.

    Local, as torch's own hook states are: nothing is exchanged here, so a bad argument raises
    on this rank alone, and another rank that goes on waits in its first backward (the
    ranks' algorithms are agreed at the first bucket). :func:`register_weighted_hook`, which
    is collective, tells every rank instead.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        local_batch: int | None = None,
        *,
        algorithm: str = "auto",
        counter: BatchCounter | None = None,
        items: Items | None = None,
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
        items = items_argument(items)
        if items is not None and (local_batch is not None or counter is not None):
            raise TypeError(
                "items: give items= (each step's targets counted by state.count(y)) or "
                "local_batch / counter (samples), not both"
            )
        if local_batch is None and counter is None and items is None:
            raise TypeError(
                "local_batch: required (this rank's samples in the step) unless a counter "
                "counts them or items= counts the step's targets; "
                "hetcoll.torch.register_weighted_hook(ddp) sets one up"
            )
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm: must be one of {ALGORITHMS}, got {algorithm!r}")
        self.group = group
        #: The same group, under the name torch's own hook states use.
        self.process_group = group
        self.algorithm = algorithm
        self.counter = counter
        #: ``items(y)`` (None: samples are counted): see :meth:`count`.
        self.items = items
        self._local_batch: int | None = None
        self._by_hand = False  # the current step's count set by hand: the counter's dropped
        if local_batch is not None:
            self.local_batch = local_batch
        #: The global batch's items in the latest step :meth:`count` saw (with ``items``).
        self.global_items: int | None = None
        self._weight: float | None = None  # this step's n_r / N, set by count(), used once
        self._step_items: np.ndarray | None = None  # every rank's counts so far this step
        self._comm: Communicator | None = None
        self._in_step = False
        self._step_total: torch.futures.Future | None = None
        self._direct_exchange: _DirectExchange | None = None
        # Each bucket's buffer for its allreduce with the count appended, by bucket index.
        self._extended: dict[int, torch.Tensor] = {}
        self._agreed = False
        self._latest: np.ndarray | None = None  # every rank's count in the latest count(y)
        # This step's losses are weighed by weigh(): the hook takes the plain mean.
        self._weighed = False
        # Layers of the model whose forward exchanges between the ranks in training
        # (SyncBatchNorm), as register_weighted_hook finds them: a step not weighed on its loss
        # while one of them trains warns once.
        self._exchanging: list[tuple[str, torch.nn.Module]] = []
        self.ready_at = 0.0
        # The DDP model (register_weighted_hook): under its join(), a rank out of inputs runs
        # the hook without a forward, and counts none.
        self._ddp: Callable[[], Any] = lambda: None

    def _agree(self) -> None:
        """Once: every rank must have chosen the same algorithm, or the ranks would wait on
        messages of different kinds forever; raise :class:`hetcoll.CollectiveMismatchError` on
        every rank instead (:func:`hetcoll.comm.agree`; under NCCL its few bytes go through the
        current CUDA device, the one DDP's buckets are on)."""
        if self._agreed or self.items is not None:  # count's exchange carries it
            return
        agree(self._wrapped(), self._fields())
        self._agreed = True

    def _wrapped(self, failure: BaseException | None = None) -> Communicator:
        """The group as hetcoll's communicator, wrapped once; where there is no group, the
        caller's own argument error ``failure``, if any, is raised before the group's."""
        if self._comm is None:
            self._comm = wrap_or_raise(self.process_group, failure)
        return self._comm

    def _fields(self) -> dict[str, int]:
        codes = ", ".join(f"{a!r} = {i}" for i, a in enumerate(ALGORITHMS))
        return {f"algorithm ({codes})": ALGORITHMS.index(self.algorithm)}

    @property
    def local_batch(self) -> int | None:
        """This rank's count in the current step: its samples (with a counter: in the latest
        step whose exchange began; set by hand before a step's backward, that step's count
        instead of the counter's), or with ``items`` its items (summed over the step's
        :meth:`count` calls so far); None before the first."""
        return self._local_batch

    @local_batch.setter
    def local_batch(self, n: int) -> None:
        if self.items is not None:
            raise TypeError("local_batch: this state counts items; call state.count(y) instead")
        self._local_batch = local_batch_value(n)
        self._by_hand = True  # for the next step, over what a counter counted

    def count(self, y: Any) -> None:
        """This step's targets ``y``: this rank's count is ``items(y)``. Collective: every rank
        of the group calls it once per forward, before the backward (with gradient accumulation
        under DDP's ``no_sync``, once per micro-batch: the step's count is their sum, each
        rank's loss then the sum over its micro-batches divided by its step's items); the
        ranks' counts are exchanged here (one small allgather) and each rank's weight is
        ``n_r / N`` (:func:`hetcoll.torch.item_weights`), used by the next gradient exchange. A
        bad count on any rank (``items(y)`` negative, not an integer, or raising; zero items on
        every rank) raises ``ValueError`` naming ``items`` here, on every rank; a rank that
        skips the call raises ``RuntimeError`` in its backward, and the others here. A rank
        whose ``items(y)`` is 0 is legal: it contributes nothing that step (its loss, a mean
        over nothing, may be NaN)."""
        if self.items is None:
            raise TypeError(
                "items: count(y) needs a state built with items= (this one counts samples)"
            )
        if self._joined():
            raise RuntimeError(
                "items: count(y) cannot run under ddp.join(): a rank out of inputs takes no part "
                "in the counts' exchange, and the others would wait for it; give every rank the "
                "same number of steps (BalancedSampler does), or weigh by rows "
                "(register_weighted_hook without items=). DDP keeps join's setting after its "
                "context, so a model joined once stays so"
            )
        comm = self._wrapped()
        mine = count_items(self.items, y)
        # The algorithm rides in the same exchange: ranks that chose differently would wait on
        # messages of different kinds in the hook.
        with StepTimer.waiting():  # a wait for the other ranks inside the step, not compute
            counts = agree(comm, self._fields(), values=mine.exchanged)
        self._agreed = True
        # Micro-batches whose gradients accumulate (DDP's no_sync) each count theirs: the step
        # weighs their sum.
        self._step_items = added_counts(self._step_items, counts, mine.failure)
        self._latest = counts
        self._local_batch = int(self._step_items[comm.rank, 1])
        self.global_items = int(self._step_items[:, 1].sum())
        if not self.global_items and not self._syncs():
            # Micro-batches of nothing so far under no_sync: the step's later ones count (a
            # step of nothing raises at its last count, whose backward exchanges).
            self._weight = None
            return
        weights = item_weights(self._step_items, "items")
        self._weight = float(weights[comm.rank])

    def weigh(self, loss: torch.Tensor, *, weight: float | None = None) -> torch.Tensor:
        """``loss`` weighed before its backward, for a forward that exchanges between the ranks
        itself (``nn.SyncBatchNorm``; a loss over features gathered with
        ``torch.distributed.nn``): their backward sums the ranks' gradients inside the
        backward, before the hook could weigh them, so each rank's loss must carry its weight
        already. Returns ``loss * R * n_r / N`` (``R`` ranks; ``n_r`` this rank's count as the
        hook takes it: the samples counted off the forward or the ``local_batch`` set, or with
        ``items`` the latest :meth:`count`), and the step's hook then takes the ranks' plain
        mean. Under ``no_sync`` each micro-batch is weighed by its own count over the ranks:
        the step sums the micro-batches' weighted means, as one process does when it
        accumulates their means (divide each loss by their number for the mean of means).

        Collective: every rank calls it once per forward, after the forward and before the
        backward (counting samples: one small allgather of the ranks' counts; with ``items``,
        none, :meth:`count`'s exchange had them). A rank with nothing to count raises
        ``RuntimeError`` and the others :class:`hetcoll.CollectiveMismatchError`, at once.

        A rank weighing 0 (no valid item) adds nothing of its own loss and still sends its
        gradients: they hold what the other ranks' losses gave its parameters through the
        exchange in the forward (its loss's gradient must be finite: torch's cross-entropy
        over no valid label gives zeros).

        ``weight``: this rank's weight ``n_r / N``, where the caller has agreed on the counts
        already (the weights summing to 1 over the ranks; :func:`hetcoll.torch.item_weights`):
        nothing is counted or exchanged."""
        if weight is not None:
            if isinstance(weight, bool) or not isinstance(weight, (int, float)):
                raise TypeError(f"weight: must be a number, got {type(weight).__name__}")
            if not 0.0 <= weight <= 1.0:
                raise ValueError(f"weight: must be in [0, 1] (n_r / N), got {weight!r}")
        comm = self._wrapped(loss_failure(loss))
        if weight is None and self.items is None:
            if self.counter is not None:  # an eval-mode forward: this loss's backward reaches it
                self.counter.claim_unreached()
            mine = self._take_count()  # a failure is carried: every rank raises, none waits
            if mine.status == NOT_COUNTED and self._weighed:  # no forward since the last weigh
                mine = called_twice("local_batch", "state.weigh(loss)")
            # One exchange of the counts, a bad loss told to every rank in it.
            weighed_loss = weighed(loss, comm, mine, "local_batch", self._fields())
            self._agreed = True
        else:
            if weight is None and self._latest is None:  # items, and no count for this forward
                missing = (
                    called_twice("items", "state.weigh(loss)")
                    if self._weighed
                    else not_counted(
                        "items", "no count for this forward; call state.count(y) before weigh(loss)"
                    )
                )
                agree(comm, self._fields(), values=missing.exchanged, failure=missing.failure)
            bad_loss = loss_failure(loss)  # no exchange here (count()'s had the counts)
            if bad_loss is not None:
                raise bad_loss
            if weight is None:
                assert self._latest is not None  # agree raised otherwise
                counts, self._latest = self._latest, None
                weight = float(item_weights(counts, "items")[comm.rank])
            weighed_loss = scaled(loss, comm.size, float(weight))
        # A rank weighing 0 still sends its gradients: they hold what the other ranks' losses
        # gave its parameters through the exchange in the forward (its own loss adds none).
        self._weighed = True
        return weighed_loss

    def _take_count(self) -> LocalCount:
        """This step's samples: those the counter counted since it was last taken, or the
        ``local_batch`` set by hand (the counter's then discarded); a counter that counted
        nothing gives its error, carried rather than raised."""
        if self.counter is not None and not self._by_hand:
            try:
                mine = counted(self.counter.take())
            except RuntimeError as e:  # no forward since the last take
                if not self._joined():
                    return LocalCount(NOT_COUNTED, 0, e)
                mine = counted(0)  # out of inputs under ddp.join(): it weighs nothing
        else:
            if self.counter is not None:
                self.counter.discard()
            assert self._local_batch is not None  # the constructor requires it or a counter
            mine = counted(self._local_batch)
        self._by_hand = False
        self._local_batch = mine.value
        return mine

    def _syncs(self) -> bool:
        """Whether the next backward exchanges the gradients: False under the DDP model's
        ``no_sync()`` (known with :func:`register_weighted_hook`; a state built by hand is
        taken to exchange)."""
        ddp = self._ddp()
        return ddp is None or bool(getattr(ddp, "require_backward_grad_sync", True))

    def _joined(self) -> bool:
        """Whether this rank has joined under the DDP model's ``join()`` (it ran out of
        inputs: DDP runs its hook for the others' backward without a forward here)."""
        config = getattr(self._ddp(), "_join_config", None)
        return bool(getattr(config, "enable", False))

    def _begin_step(self) -> tuple[float, bool]:
        """This step's factor for the buckets, fixed at the step's first bucket: this rank's
        weight ``n_r / N`` (with ``items``; True) or its samples ``n_r``, to be divided by the
        ranks' sum (False); after :meth:`weigh`, ``1 / R``, the losses weighed already
        (True)."""
        if self._weighed:
            return 1.0 / self._wrapped().size, True
        names = [name for name, m in self._exchanging if m.training]
        if names:
            self._exchanging = []
            warnings.warn(
                f"ddp: {few_names(names)} exchange between the ranks in the forward "
                "(SyncBatchNorm), and their backward sums the ranks' gradients before this "
                "hook weighs them: with uneven shares the gradient is not the global batch's. "
                "Weigh each loss before its backward: loss = state.weigh(loss)",
                stacklevel=2,
            )
        if self.items is not None:
            if self._weight is None:
                # Joins the exchange a rank that did count is in (count's), so that it raises
                # at once too, not after a timeout or a mismatched gather.
                missing = RuntimeError(
                    "items: no count for this step; call state.count(y) with the step's targets "
                    "on every rank before the backward"
                )
                agree(self._wrapped(), self._fields(), values=[NOT_COUNTED, 0], failure=missing)
            assert self._weight is not None  # agree raised otherwise
            return self._weight, True
        if not self._in_step:
            mine = self._take_count()
            if mine.failure is not None:
                raise mine.failure
            self._in_step = True
        assert self._local_batch is not None  # the constructor requires it or a counter
        return float(self._local_batch), False

    def _end_step(self) -> None:
        """After the step's last bucket: the next call starts the next step, whose weight
        :meth:`count` sets anew."""
        self._in_step = False
        self._weight = None
        self._step_items = None
        self._latest = None
        self._weighed = False

    def _global_batch(self, local_batch: float, device: torch.device) -> torch.futures.Future:
        """Future of every rank's ``n_r`` for the current step (their sum is ``N``, see
        :func:`hetcoll.torch.item_total`); launched once per step, on NCCL from ``device``
        (the bucket's)."""
        if self._step_total is None:
            count = torch.tensor([int(local_batch)], dtype=torch.int64)
            if _backend(self.process_group) == "nccl":
                count = count.to(device)
            counts = count.new_empty(dist.get_world_size(self.process_group))
            work = dist.all_gather_into_tensor(
                counts, count, group=self.process_group, async_op=True
            )
            assert work is not None  # async_op=True
            self._step_total = work.get_future().then(lambda _: counts)
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


def _divide_(buf: torch.Tensor, total: torch.Tensor) -> None:
    """``buf /= total`` (a count on the same device), each element within one unit of the
    exact quotient in ``buf``'s type: a 16-bit bucket, whose type cannot hold every count, is
    divided in float32."""
    if buf.dtype in (torch.float16, torch.bfloat16):
        buf.copy_(buf.float().div_(total))
    else:
        buf.div_(total.to(buf.dtype))


def weighted_allreduce_hook(
    state: WeightedAllreduceState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket becomes ``sum_r n_r * grad_r / sum_r n_r`` on every rank
    (``n_r``: rank r's samples, or its items with ``items``)."""
    if not isinstance(state, WeightedAllreduceState):
        raise TypeError(
            "state: weighted_allreduce_hook needs a WeightedAllreduceState, got "
            f"{type(state).__name__} (register with ddp.register_comm_hook(state, hook))"
        )
    if not isinstance(bucket, dist.GradBucket):
        raise TypeError(
            f"bucket: must be a torch.distributed.GradBucket (DDP calls the hook with one), got "
            f"{type(bucket).__name__}"
        )
    last = bucket.is_last()
    if last:
        state.ready_at = time.perf_counter()
    buf = bucket.buffer()
    if buf.layout != torch.strided:  # every rank's bucket alike: every rank raises here
        raise TypeError(
            f"ddp: gradient bucket {bucket.index()} is {buf.layout} (an "
            "nn.Embedding(sparse=True)'s gradient); the weighted hook averages dense buckets: "
            "build the embedding with sparse=False"
        )
    state._agree()
    # factor: this rank's weight n_r / N (weighted) or its count n_r, the sum divided by N after.
    factor, weighted = state._begin_step()
    if last:
        state._end_step()
    if factor == 0:
        # Nothing to average on this rank: it sends zeros, not 0 * its gradient (NaN where its
        # loss was a mean over nothing).
        buf.zero_()
    try:
        return _reduced(state, buf, factor, weighted, bucket.index(), last)
    finally:
        if last:  # the next step gathers its own counts, whichever road this bucket took
            state._step_total = None


def _reduced(
    state: WeightedAllreduceState,
    buf: torch.Tensor,
    factor: float,
    weighted: bool,
    index: int,
    last: bool,
) -> torch.futures.Future[torch.Tensor]:
    """:func:`weighted_allreduce_hook`'s exchange of bucket ``index``'s ``buf``, scaled by
    ``factor`` (this rank's weight where ``weighted``, else its count), by the road it takes."""
    # The choice reads only what every rank has alike (sizes, the rank count, the engine), not
    # the bucket's device: a CUDA rank beside CPU ranks on gloo takes the direct exchange too,
    # its bucket staged through host memory (on NCCL every bucket is on a GPU: the allreduce).
    host_wire = buf.device.type == "cpu" or _backend(state.process_group) != "nccl"
    nbytes = buf.numel() * buf.element_size()
    if state.algorithm != "allreduce" and host_wire and buf.dtype in _KERNEL:
        if state._direct_exchange is None:
            tags = _TAG_BASE + _agreed_number(state._wrapped()) * _TAGS_PER_STATE
            state._direct_exchange = _DirectExchange(state.process_group, tags)
        direct = state._direct_exchange
        if state.algorithm == "direct" or choose_algorithm(direct.comm, nbytes, False) == "direct":
            return direct.submit(buf, factor, not weighted, index, last)
    bits = count_bits(buf.dtype, dist.get_world_size(state.process_group))
    if not weighted and host_wire and bits and nbytes <= COUNT_IN_BUCKET_BYTES:
        return _allreduce_counted(state, buf, factor, bits, index)
    if not weighted and buf.dtype == torch.float16:
        # n_r times a gradient overflows float16 (65504) from gradients of 65504 / n_r: the
        # step's counts are awaited first (the allgather the step's first bucket launched) and
        # the bucket scaled by the weight n_r / N.
        counts = state._global_batch(factor, buf.device).wait().cpu().numpy()
        try:
            factor /= float(item_total(counted_rows(counts), "local_batch"))
        except ValueError as e:  # raised through the future, as every other road's: raised
            return _failed(e)  # in the hook, it would leave DDP's reducer mid-step
        weighted = True
    # On NCCL each rank's factor is applied inside the reduction kernel (PREMUL_SUM).
    op = premul_sum_op(_backend(state.process_group), factor)
    if op is None:
        op = dist.ReduceOp.SUM
        if factor != 0:
            _scale_(buf, factor)
    if weighted:  # the weights sum to 1 already: the sum is the result
        work = dist.all_reduce(buf, op=op, group=state.process_group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    total_fut = state._global_batch(factor, buf.device)
    work = dist.all_reduce(buf, op=op, group=state.process_group, async_op=True)

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        reduced = fut.value()[0]
        counts = total_fut.wait()
        if counts.device.type != "cpu":
            # NCCL: its futures complete as the work is queued and this runs in the backward's
            # thread; reading the counts on the host would hold the backward until every rank
            # had reached its first bucket and that bucket's allreduce had ended. Divided on
            # the device instead; a step where no rank counted a sample averages to zeros.
            _divide_(reduced, counts.sum().clamp_min(1))
            return reduced
        reduced.div_(float(item_total(counted_rows(counts.numpy()), "local_batch")))
        return reduced

    return work.get_future().then(finish)


def count_bits(dtype: torch.dtype, world: int) -> int:
    """Bits of each piece of a count that rides in a bucket of ``dtype`` summed over ``world``
    ranks (:func:`_allreduce_counted`): every sum of ``world`` pieces is an integer within the
    type's significand, exact in any order of the reduction; 0 where the type has too few bits
    (16-bit buckets: their counts are gathered apart)."""
    significand = {torch.float32: 24, torch.float64: 53}.get(dtype, 0)
    bits = significand - (world - 1).bit_length()
    return bits if bits >= 8 else 0


def count_pieces(n: int, bits: int) -> list[float]:
    """``n`` (below :data:`~hetcoll.torch.batches.MAX_ITEMS`, as every count is) as pieces of
    ``bits`` bits, lowest first."""
    mask = (1 << bits) - 1
    return [
        float((n >> (bits * i)) & mask) for i in range(-(-(MAX_ITEMS - 1).bit_length() // bits))
    ]


def joined_count(pieces: list[float], bits: int) -> int:
    """The count whose :func:`count_pieces` (or a sum of several counts' pieces) ``pieces``
    are."""
    return sum(int(p) << (bits * i) for i, p in enumerate(pieces))


def _allreduce_counted(
    state: WeightedAllreduceState, buf: torch.Tensor, count: float, bits: int, index: int
) -> torch.futures.Future[torch.Tensor]:
    """``buf`` scaled by this rank's ``count`` ``n_r``, allreduced with the count itself after
    it in pieces of ``bits`` bits, then divided by their sum ``N``: one collective a step, where
    a separate gather of the counts made two (each a call's fixed cost). Every rank of the
    group takes this road alike (the choice reads the bucket's type, the ranks and the
    engine), so the buffers they reduce match."""
    n = buf.numel()
    pieces = count_pieces(int(count), bits)
    key = (n + len(pieces), buf.dtype, buf.device)
    held = state._extended.get(index)
    if held is None or (held.numel(), held.dtype, held.device) != key:
        held = state._extended[index] = torch.empty(key[0], dtype=buf.dtype, device=buf.device)
    torch.mul(buf, count, out=held[:n])  # one rounding, as the scaling in place was
    held[n:].copy_(torch.tensor(pieces, dtype=buf.dtype))
    work = dist.all_reduce(held, group=state.process_group, async_op=True)
    assert work is not None  # async_op=True

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        reduced = fut.value()[0]
        total = joined_count(reduced[n:].tolist(), bits)
        total = item_total(counted_rows([total]), "local_batch")
        torch.div(reduced[:n], float(total), out=buf)
        return buf

    return work.get_future().then(finish)


def register_weighted_hook(
    ddp: torch.nn.parallel.DistributedDataParallel,
    *,
    items: Items | None = None,
    algorithm: str = "auto",
    batch_dim: int = 0,
) -> WeightedAllreduceState:
    """Make ``ddp``'s gradient the exact sample-weighted mean over ranks, each step weighing
    the samples that went through ``ddp``'s forwards since the previous step
    (:func:`hetcoll.torch.batches.batch_size`: dimension ``batch_dim`` of the forward's first
    tensor argument, or the length of a list of samples, as torchvision's detection models
    take a list of images and a list of their targets; forwards without gradients, such as
    evaluation, do not count). Nothing to set in the training loop: uneven shares, a ragged
    last batch and new shares from :meth:`BalancedSampler.set_shares` are all weighed right.

    ``items``: when the loss is a mean over something else than rows (a language model's
    valid tokens: ``items=lambda y: int((y != -100).sum())``, or ``y[:, 1:]`` where the loss
    shifts its labels), each rank weighs ``items(y)``
    instead; call ``state.count(y)`` with each step's targets on every rank before the backward
    (:meth:`WeightedAllreduceState.count`). The gradient is then that of the mean over all valid
    items of the global batch.

    A forward that exchanges between the ranks itself (``nn.SyncBatchNorm``, a loss over
    features gathered from every rank) mixes the ranks' gradients inside the backward, before
    the hook: weigh each loss before its backward, ``loss = state.weigh(loss)``
    (:meth:`WeightedAllreduceState.weigh`). A step that does not, while a ``SyncBatchNorm``
    trains, warns once.

    The hook runs on ``ddp``'s own process group; ``algorithm`` as in
    :class:`WeightedAllreduceState`. On NCCL the ranks' sample counts are summed on the device,
    so the backward does not wait on the host for the other ranks (nor, then, does a
    :class:`~hetcoll.torch.StepTimer`'s span), but for float16 buckets, which are scaled by
    ``n_r / N`` before the reduction (``n_r`` times a gradient could overflow): a step in which
    no rank counted a sample averages to zeros there, where the other engines raise. Returns
    the state.

    Collective: every rank of ``ddp``'s group calls it, after building ``ddp`` (whose
    constructor is collective too) and before its first forward; the ranks' ``algorithm`` and
    whether they count ``items`` are agreed in one small allgather. A bad ``items``,
    ``algorithm`` or ``batch_dim`` on one rank raises there (``TypeError`` / ``ValueError``
    naming it) and :class:`hetcoll.CollectiveMismatchError` naming that rank and its error on
    the others, at once; ranks that chose differently raise
    :class:`~hetcoll.CollectiveMismatchError` on every rank. A parameter ``ddp`` averages that
    trains under PEFT's ``ParamWrapper`` (LoRA on a parameter: a Mixtral's router under
    ``"all-linear"``, its base weights trainable) raises ``ValueError`` naming it: PEFT's
    parametrization at each forward hides its gradient from DDP's hooks.
    """
    if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):  # no group to tell
        raise TypeError(
            f"ddp: must be a torch.nn.parallel.DistributedDataParallel, got {type(ddp).__name__}"
        )
    state: WeightedAllreduceState | None = None
    failure: BaseException | None = None
    try:
        _refuse_reparametrized(ddp)
        if items_argument(items) is not None:
            state = WeightedAllreduceState(ddp.process_group, algorithm=algorithm, items=items)
        else:
            counter = BatchCounter(ddp, batch_dim=batch_dim)
            try:
                state = WeightedAllreduceState(
                    ddp.process_group, algorithm=algorithm, counter=counter
                )
            except (TypeError, ValueError):
                counter.remove()
                raise
    except (TypeError, ValueError) as e:
        failure = e
    # One small allgather, right after DDP's own collective constructor: a rank whose
    # arguments are bad tells the others here (they raise at once, instead of waiting in their
    # first backward's exchange), and ranks that chose another algorithm, or items on some
    # ranks only, raise here on every rank rather than wait on exchanges of different kinds.
    comm = wrap_or_raise(ddp.process_group, failure)
    fields = {} if state is None else {**state._fields(), _ITEMS_FIELD: int(items is not None)}
    try:
        agree(comm, fields, failure=failure)
    except BaseException:
        if state is not None and state.counter is not None:  # its hooks off ddp again
            state.counter.remove()
        raise
    assert state is not None  # agree raised otherwise
    state._comm = comm
    state._agreed = True
    state._exchanging = [
        (name, m) for name, m in ddp.module.named_modules() if isinstance(m, torch.nn.SyncBatchNorm)
    ]
    state._ddp = weakref.ref(ddp)
    ddp.register_comm_hook(state, weighted_allreduce_hook)
    return state


def _refuse_reparametrized(ddp: torch.nn.parallel.DistributedDataParallel) -> None:
    """Raise ``ValueError`` naming it where a parameter DDP averages is trained under PEFT's
    ``ParamWrapper`` (LoRA on a parameter, as ``"all-linear"`` puts on a Mixtral's router):
    the wrapper registers a parametrization on it at each forward, which gives the parameter a
    new gradient accumulator, so DDP's hook on the old one never runs and the gradients of its
    bucket are never averaged (each rank would step on its own). The same model under
    :class:`~hetcoll.torch.DistributedOptimizer`, which averages after the backward, is
    right."""
    ignored = set(getattr(ddp, "parameters_to_ignore", ()))
    path_of = {id(m): n for n, m in ddp.module.named_modules()}
    for name, m in ddp.module.named_modules():
        cls = type(m)
        if cls.__name__ != "ParamWrapper" or not cls.__module__.startswith("peft."):
            continue
        base = m.get_base_layer()  # type: ignore[operator]
        pname = str(getattr(m, "parameter_name", ""))
        param = getattr(base, pname, None)
        at = path_of.get(id(base), "")
        path = f"{at}.{pname}" if at else pname
        if isinstance(param, torch.Tensor) and param.requires_grad and path not in ignored:
            raise ValueError(
                f"ddp: parameter {path!r} trains under PEFT's LoRA wrapper {name!r} "
                "(ParamWrapper), which registers a parametrization on it at each forward and "
                "so gives it a new gradient accumulator: DDP's hook on it never runs, and its "
                "bucket's gradients are never averaged. Freeze it (a LoRA fine-tuning trains "
                "the adapters alone), or average with hetcoll.torch.DistributedOptimizer"
            )


class _DirectExchange:
    """The direct weighted exchange of :mod:`hetcoll.collectives` (``algorithm="direct"``;
    sample counts weighed by the rule, or weights given) per bucket, with each bucket's own
    message tags. gloo's send/recv works have no futures, so a worker thread runs the
    exchanges and completes the hook's futures, and the backward goes on meanwhile; the last
    bucket of a step, which the backward only waits for, is exchanged right in the hook (no
    hand-over to the thread and back), beside the thread's."""

    def __init__(self, group: dist.ProcessGroup | None, tags: int) -> None:
        self.comm = wrap(group)
        self.tags = tags  # bucket i's weight on tags + 2i, its data on tags + 2i + 1
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="hetcoll-direct", daemon=True).start()

    def submit(
        self, buf: torch.Tensor, factor: float, normalize: bool, index: int, last: bool
    ) -> torch.futures.Future:
        """``factor``: this rank's weight, or (``normalize``) its count, divided by the
        ranks' sum in the exchange."""
        fut: torch.futures.Future = torch.futures.Future()
        if last:
            self._run(fut, buf, factor, normalize, index)
        else:
            self._jobs.put((fut, buf, factor, normalize, index))
        # DDP's reducer reads a future's value in C++, where an exception set on a Python
        # future is a value like any other ("Unable to cast ... to Tensor"); raised in a
        # callback, it is the future's error, which the backward raises.
        return fut.then(_value)

    def _serve(self) -> None:
        while True:
            self._run(*self._jobs.get())

    def _run(
        self, fut: torch.futures.Future, buf: torch.Tensor, w: float, normalize: bool, index: int
    ) -> None:
        try:
            fut.set_result(self._exchange(buf, w, normalize, index))
        except Exception as e:  # the backward that waits on the future raises it
            fut.set_exception(e)

    def _exchange(self, buf: torch.Tensor, w: float, normalize: bool, index: int) -> torch.Tensor:
        # A device bucket (a CUDA rank on gloo) goes through host memory, as hetcoll's
        # collectives stage it (hetcoll.collectives.device.stage_on_host).
        host = buf if buf.device.type == "cpu" else buf.cpu()
        view, bf16 = numpy_view(host, "bucket")
        tag = self.tags + 2 * index
        weigh = _weigh_samples if normalize else None
        direct_allreduce(self.comm, view.reshape(-1), bf16, w, None, weigh=weigh, tag=tag)
        if host is not buf:
            buf.copy_(host)
        return buf


def _agreed_number(comm: Communicator) -> int:
    """A state's number for its direct exchanges' tags, the same on every rank of ``comm``: the
    largest of the ranks' next free numbers (one small allgather, once per state, at its first
    direct bucket, which every rank reaches alike); each rank's next free number then past it.
    Ranks that made states apart (one raised at its registration, the others went on) agree
    again here."""
    global _next_number
    proposed = agree(comm, {"the weighted hook's direct exchange": 0}, values=[_next_number])
    number = int(proposed[:, 0].max())
    _next_number = number + 1
    return number % _STATES


def _value(fut: torch.futures.Future) -> torch.Tensor:
    return fut.wait()


def _failed(error: BaseException) -> torch.futures.Future[torch.Tensor]:
    """A hook's future that fails with ``error``: the backward raises it, and DDP's next step
    starts afresh (see :meth:`_DirectExchange.submit`)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_exception(error)
    return fut.then(_value)


def _weigh_samples(sent: np.ndarray) -> np.ndarray:
    """The ranks' sample counts, as the direct exchange carried them, weighed by the rule."""
    return item_weights(counted_rows(sent), "local_batch")
