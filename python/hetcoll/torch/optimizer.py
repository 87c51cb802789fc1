"""Sample-weighted data parallelism without DDP, for jobs launched with ``mpiexec`` and no
torch.distributed (or on a torch.distributed group): wrap the optimizer, nothing else in the
training loop changes (Horovod's ``DistributedOptimizer`` pattern, with the weighting Horovod
never had).

``step()`` packs every gradient into fusion buffers of at most ``fusion_bytes`` (the Rust kernel
scales each by ``n_r / N`` while it copies), sums them in place with :func:`hetcoll.allreduce`
(``MPI_Allreduce``, or hetcoll's ring for large buffers), unpacks, and only then runs the
wrapped optimizer, so every rank applies the exact full-batch gradient
``sum_r n_r g_r / N`` (``n_r``: rank r's samples, or with ``items=`` the items its loss averages
over, such as valid tokens; the weights are :func:`hetcoll.torch.item_weights`'s). ``N`` and an
agreement check (every rank must hold parameters of the
same number, order, shapes and dtypes, or all ranks raise
:class:`hetcoll.CollectiveMismatchError`) travel in one small all-gather per step.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import torch

from hetcoll import fusion
from hetcoll.collectives import allreduce
from hetcoll.comm import NOT_GIVEN, agree, group_argument, shared_processes, wrap
from hetcoll.errors import shown
from hetcoll.torch.batches import (
    COUNTED,
    NOT_COUNTED,
    BatchCounter,
    Items,
    LocalCount,
    added_count,
    called_twice,
    checked_count,
    count_items,
    counted,
    item_weights,
    items_argument,
    not_counted,
)
from hetcoll.torch.expert_parallel import is_rank_local
from hetcoll.torch.filters.checks import check_module, is_int
from hetcoll.torch.filters.layers import split_modules

_SUPPORTED = (torch.float32, torch.float64)
_NO_CLOSURE = object()  # _average's loss when no closure runs: gradients only
#: The integers each rank sends in a step's agreement: its count (two), whether it lacks a
#: gradient, whether GradScaler found an inf. A rank that fails first sends as many zeros.
_STEP_VALUES = 4


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` so that :meth:`step` first averages gradients across the ranks of
    ``group``, weighted by each rank's ``local_batch``. It is a ``torch.optim.Optimizer`` whose
    ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's, so that torch's
    learning-rate schedulers take it (``StepLR(opt, ...)``).

    ``group``: an mpi4py communicator or a torch.distributed process group; None is
    :func:`hetcoll.comm.wrap`'s default (torch's default group, else ``MPI.COMM_WORLD`` under
    mpiexec). ``comm=`` is its deprecated name.

    This rank's count in the step, one of: ``model``, each step weighs the samples that went
    through ``model``'s forwards since the previous step (a :class:`BatchCounter` counts them,
    along dimension ``batch_dim``); ``local_batch``, set ``opt.local_batch`` whenever it
    changes; or ``items``, a function ``items(y)`` counting what the loss averages over (a
    language model's valid tokens: ``lambda y: int((y != -100).sum())`` for targets aligned
    with the outputs, ``y[:, 1:]`` where the loss shifts them), given each step's
    targets by :meth:`count` before :meth:`step`. A bad count on any rank (``items(y)``
    negative, not an integer, or raising; zero items on every rank) raises ``ValueError``
    naming ``items`` from :meth:`step` on every rank; a rank with zero items contributes nothing.
    So does a ``local_batch`` given or set that is no integer >= 0, naming ``local_batch``
    (raised where it was set, the other ranks would wait in their step), and so do a bad
    ``fusion_bytes``, ``model`` or ``batch_dim``: on the rank given it, its ``ValueError`` /
    ``TypeError`` naming it, on the others a :class:`hetcoll.CollectiveMismatchError` naming
    that rank and its error. The constructor is local (it exchanges nothing); the first
    :meth:`step` (or :meth:`synchronize`) is where every rank communicates.

    >>> opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
    ...                            model=model)  # doctest: +SKIP
    >>> loss_fn(model(x), y).backward(); opt.step()  # doctest: +SKIP
    >>> opt = DistributedOptimizer(sgd, items=lambda y: int((y != -100).sum()))  # doctest: +SKIP
    >>> opt.count(y); loss_fn(model(x), y).backward(); opt.step()  # doctest: +SKIP
    """

    #: ``torch.amp.GradScaler`` then calls :meth:`step` on every rank, giving this rank's scale
    #: (``grad_scale``) and inf check (``found_inf``), where it would skip the step of a rank
    #: whose gradients hold an inf while the others wait in theirs.
    _step_supports_amp_scaling = True

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        group: Any = None,
        *,
        local_batch: int | None = None,
        model: torch.nn.Module | None = None,
        items: Items | None = None,
        batch_dim: int = 0,
        fusion_bytes: int = 64 << 20,
        comm: Any = NOT_GIVEN,
    ) -> None:
        group = group_argument(group, "DistributedOptimizer", comm=comm)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer: must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        # A bad fusion_bytes, model or batch_dim is raised from the first step, on every rank
        # (the step's agreement tells the others): raised here, alone, the others would wait
        # in their step. The constructor exchanges nothing.
        self._bad_argument: BaseException | None = None
        if (
            isinstance(fusion_bytes, bool)
            or not isinstance(fusion_bytes, (int, float, np.integer, np.floating))
            or not 1 <= fusion_bytes < 2**62  # inf, NaN and 2**70 are no bucket size
        ):
            self._bad_argument = ValueError(
                f"fusion_bytes: must be a number in [1, 2**62), got {fusion_bytes!r}"
            )
        items = items_argument(items)
        if items is not None and (local_batch is not None or model is not None):
            raise TypeError(
                "items: give items= (each step's targets counted by opt.count(y)) or "
                "local_batch / model= (samples), not both"
            )
        if items is None and (local_batch is None) == (model is None):
            raise TypeError(
                "local_batch: give either local_batch (this rank's samples, set again when it "
                "changes) or model= (the samples of its forwards are counted), not both"
                if model is not None
                else "local_batch: required unless model= is given to count each step's samples"
            )
        self.optimizer = optimizer
        self.group = group
        self._comm = wrap(group)
        self.counter: BatchCounter | None = None
        if model is not None:
            try:
                self.counter = BatchCounter(model, batch_dim=batch_dim, reached=True)
            except (TypeError, ValueError) as e:
                self._bad_argument = self._bad_argument or e
        #: ``items(y)`` (None: samples are counted): see :meth:`count`.
        self.items = items
        #: The global batch's count (samples, or items) in the latest synchronised step.
        self.global_batch: int | None = None
        # This step's count(y)s, taken by synchronize (their sum is the step's count), each
        # with the gradients as they stood at it (_grad_marks): a count whose backward ran
        # since (its gradients changed) is dropped by zero_grad.
        self._counts: list[tuple[LocalCount, list[Any]]] = []
        self._local_batch: int | None = None
        self._bad_local_batch: LocalCount | None = None  # a bad local_batch, told at the step
        if local_batch is not None:
            self.local_batch = local_batch
        self.fusion_bytes = fusion_bytes if self._bad_argument else int(fusion_bytes)
        # synchronize() ran since the last step() / zero_grad(): step() does not average again.
        self._synchronized = False
        #: Whether the latest :meth:`step` under a ``torch.amp.GradScaler`` was skipped on
        #: every rank, some rank's gradients holding an inf or a NaN.
        self.skipped = False

    @property
    def local_batch(self) -> int | None:
        """This rank's count in the step: its samples (with ``model=``: in the latest
        synchronised step), or with ``items`` its items in the latest synchronised step; None
        before the first."""
        return self._local_batch

    @local_batch.setter
    def local_batch(self, n: int) -> None:
        if self.items is not None:
            raise TypeError("local_batch: this optimizer counts items; call opt.count(y) instead")
        # A bad one is raised from step(), on every rank: raised here, the others would wait.
        mine = checked_count(n, lambda: f"local_batch: must be an integer >= 0, got {shown(n)}")
        self._bad_local_batch = None if mine.status == COUNTED else mine
        if self._bad_local_batch is None:
            self._local_batch = mine.value

    def count(self, y: Any) -> None:
        """This step's targets ``y``: this rank's count is ``items(y)``, weighed at the next
        :meth:`step` (or :meth:`synchronize`). Local: nothing is exchanged here, and a bad count
        raises from :meth:`step`, on every rank. Called again before the step (once per
        micro-batch, the gradients accumulating), the step's count is the sum. :meth:`zero_grad`
        drops the counts whose backward it drops (a micro-batch skipped after its backward), as
        it drops the forwards counted with ``model=``; a count made before ``zero_grad`` and
        its backward after stays."""
        if self.items is None:
            raise TypeError(
                "items: count(y) needs an optimizer built with items= (this one counts samples)"
            )
        mine = count_items(self.items, y)
        self._counts.append((mine, self._grad_marks()))

    def _grad_marks(self) -> list[Any]:
        """Each parameter's gradient as it stands (None, or the tensor's identity and version):
        a backward since changes a mark (it sets a new gradient, or adds into it in place)."""
        return [
            None if p.grad is None else (id(p.grad), p.grad._version)
            for group in self.optimizer.param_groups
            for p in group["params"]
        ]

    def _local_count(self) -> tuple[LocalCount, str]:
        """This step's count as exchanged, and the argument its errors name."""
        if self.items is not None:
            mine = None
            for c, _ in self._counts:
                mine = added_count(mine, c)
            if mine is None:
                mine = not_counted("items", "no count for this step; call opt.count(y) first")
            self._counts = []
            return mine, "items"
        if self._bad_local_batch is not None:
            return self._bad_local_batch, "local_batch"
        if self.counter is not None:
            try:
                self._local_batch = self.counter.take()
            except RuntimeError as e:  # no forward: every rank raises, none waits
                return LocalCount(NOT_COUNTED, 0, e), "local_batch"
        assert self._local_batch is not None  # the constructor requires it or a counter
        return counted(self._local_batch), "local_batch"

    # Not torch.optim.Optimizer.__init__: the wrapped optimizer holds the groups and state.
    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, state: Any) -> None:
        self.optimizer.state = state

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.optimizer.defaults = defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not isinstance(param_group, dict) or "params" not in param_group:
            raise ValueError(  # torch's own message is a KeyError: 'params'
                "param_group: must be a dict with 'params' (and any hyperparameters), got "
                f"{param_group!r}"
            )
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:  # torch's would keep the groups alone
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def _params(self) -> list[torch.Tensor]:
        """The parameters averaged over the ranks: those that require a gradient, but for
        each rank's own experts (:func:`hetcoll.torch.expert_parallel`), whose gradients sum
        every rank's tokens already."""
        return [
            p
            for g in self.optimizer.param_groups
            for p in g["params"]
            if p.requires_grad and not is_rank_local(p)
        ]

    def _refuse_split_ranks(self, params: list[torch.Tensor]) -> None:
        """Raise where two ranks of the group hold slices of one filter_parallel split: their
        gradients are of different entries (on an even split, of one shape), and averaging
        them would mix them. Replicas of a split average over one rank of each."""
        ids = {id(p) for p in params}
        for m in split_modules():
            held = [getattr(m, n, None) for n in m.split_spec()]
            if not any(id(t) in ids for t in held if isinstance(t, torch.Tensor)):
                continue
            shared = shared_processes(m.comm, self._comm) or []
            if len(shared) > 1:
                raise ValueError(
                    f"optimizer: its group holds {len(shared)} ranks of one filter_parallel split "
                    "whose slices it would average (parts of one model, not replicas); step "
                    "a split model with its own optimizer alone, or average replicas of it "
                    "over a group holding one rank of each split"
                )

    def synchronize(self) -> None:
        """Replace every gradient by the mean over all ranks weighted by their counts, samples
        or items (collective; :func:`hetcoll.torch.item_weights`)."""
        self._average(_NO_CLOSURE)
        self._synchronized = True

    def _average(self, loss: Any, amp: tuple[float, bool] | None = None) -> Any:
        """:meth:`synchronize`; given a closure's ``loss`` (None where it returns none), also
        the global batch's loss: each rank's weighed as its gradients are, summed over the
        ranks (one process's mean), as a tensor of the loss's dtype and device (a float for a
        float).

        ``amp``: under ``torch.amp.GradScaler``, this rank's ``(1 / scale, found an inf)``:
        each rank's gradients are unscaled by its own scale as they are packed, and where any
        rank found an inf nothing is exchanged and :attr:`skipped` is set on every rank."""
        params = self._params()
        try:
            if self._bad_argument is not None:  # the constructor's, told to every rank here
                raise self._bad_argument
            self._refuse_split_ranks(params)
            for i, p in enumerate(params):
                if p.device.type != "cpu" or p.dtype not in _SUPPORTED:
                    raise TypeError(
                        f"optimizer: parameter {i} is {p.dtype} on {p.device}; the MPI path "
                        "handles float32/float64 CPU parameters"
                    )
                if p.grad is not None and p.grad.layout != torch.strided:
                    raise TypeError(
                        f"optimizer: parameter {i}'s gradient is {p.grad.layout} (an "
                        "nn.Embedding(sparse=True)'s); the MPI path averages dense gradients: "
                        "build the embedding with sparse=False"
                    )
        except (TypeError, ValueError) as e:  # the others raise too (hetcoll.comm.agree)
            agree(self._comm, {}, failure=e, values=[0] * _STEP_VALUES)
            raise
        # Counting samples or items, a second average of one step has no count: every rank
        # raises, saying so (the others wait in this exchange). A local_batch set by hand is
        # no count of a step: averaging twice gives the same gradients again.
        counted = self.items is not None or self.counter is not None
        if counted and self._averaged():
            argument = "items" if self.items is not None else "local_batch"
            mine = called_twice(argument, "opt.synchronize()")
        else:
            mine, argument = self._local_count()
        # One allgather per step: the layout's fingerprint (ranks whose parameters differ in
        # number, order, shape or dtype would sum unrelated gradients, or abort MPI on buffers
        # of different sizes) with every rank's count, and whether it lacks a gradient.
        fields = {
            **_layout(params),
            "fusion_bytes": self.fusion_bytes,
            "scaled by a GradScaler": int(amp is not None),
            # Ranks must agree on exchanging a closure's loss: one more collective follows.
            "step's closure (0: none, 1: returns a loss, 2: returns None)": (
                0 if loss is _NO_CLOSURE else 2 if loss is None else 1
            ),
        }
        missing = [p.grad is None for p in params]
        found_inf = int(amp is not None and amp[1])
        values = [*mine.exchanged, int(any(missing)), found_inf]
        assert len(values) == _STEP_VALUES
        rows = agree(self._comm, fields, values=values)
        counts = rows[:, :2]
        scale = float(item_weights(counts, argument, mine.failure)[self._comm.rank])
        self._local_batch = mine.value
        self.global_batch = int(counts[:, 1].sum())
        self.skipped = bool(rows[:, 3].any())
        if self.skipped:  # one process's GradScaler would skip this step: every rank does
            return None
        if amp is not None:
            scale *= amp[0]
        if rows[:, 2].any():
            # A parameter no rank gave a gradient stays without one, as in one process: the
            # optimizer skips it (a rank's zeros would move it by momentum and weight decay).
            # The layouts agree, so every rank sends as many words.
            used = np.bitwise_or.reduce(
                self._comm.allgather_int64(_bits([not m for m in missing]), None), axis=0
            )
            params = [p for i, p in enumerate(params) if used[i // 63] >> (i % 63) & 1]
        grads: list[torch.Tensor] = []
        for p in params:
            if p.grad is None or scale == 0:
                # A rank with nothing to average sends zeros, not 0 * its gradient (NaN where
                # its loss was a mean over nothing).
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        # The kernels pack C-contiguous memory: a gradient in another layout (channels_last,
        # a transposed view) goes through a contiguous copy.
        dense = [g if g.is_contiguous() else g.contiguous() for g in grads]
        for bucket in self._buckets(dense):
            flat = fusion.pack(bucket, scale=scale)
            # The engine's allreduce or hetcoll's ring, by size; the layout is agreed already.
            allreduce(flat, self._comm, check=False)
            fusion.unpack(flat, bucket)
        with torch.no_grad():
            for g, d in zip(grads, dense, strict=True):
                if d is not g:
                    g.copy_(d)
        if loss is _NO_CLOSURE or loss is None:
            return loss
        # A rank weighing 0 adds nothing (its loss, a mean over nothing, may be NaN).
        value = float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
        weighed = np.array([scale * value if scale else 0.0])
        total = float(allreduce(weighed, self._comm, check=False)[0])
        if isinstance(loss, torch.Tensor):
            return torch.tensor(total, dtype=loss.dtype, device=loss.device)
        return total

    def _buckets(self, grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Consecutive gradients of one dtype, at most ``fusion_bytes`` per bucket (a larger
        single gradient gets a bucket of its own)."""
        buckets: list[list[torch.Tensor]] = []
        size = 0
        for g in grads:
            nbytes = g.numel() * g.element_size()
            if not buckets or buckets[-1][0].dtype != g.dtype or size + nbytes > self.fusion_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(g)
            size += nbytes
        return buckets

    def step(self, closure: Any = None) -> Any:
        """Average gradients across ranks, then step the wrapped optimizer.

        With ``closure`` (``torch.optim.LBFGS``, or any optimizer's ``step(closure)``), the
        closure computes the gradients (zero them, forward, ``opt.count(y)`` with ``items``,
        backward, return the loss), so the average follows each of its calls, and the call
        returns the global batch's loss: each rank's loss weighed as its gradients are, summed
        over the ranks. Every rank's optimizer then sees one process's loss and gradients and
        decides alike (LBFGS's line search and stopping test), so every rank calls the closure
        as often. Returns what the wrapped optimizer's step returns (with a closure, that
        loss).

        After :meth:`synchronize` (since the last step or ``zero_grad``), the gradients are
        averaged already and ``step()`` steps.

        Under ``torch.amp.GradScaler`` (``scaler.step(opt)``), each rank's gradients are
        unscaled by its own scale and averaged, and where any rank's hold an inf or a NaN every
        rank skips the step (:attr:`skipped`), as one process would. Each rank's scaler backs
        off by its own inf check, so a rank that overflowed alone lowers its scale alone; the
        steps are one process's all the same. To clip, average first: ``opt.synchronize();
        scaler.unscale_(opt)``, clip, ``scaler.step(opt)``: every rank then checks the averaged
        gradients, finds the same infs, and keeps the same scale."""
        synchronized, self._synchronized = self._averaged(), False
        amp = self._amp_scaling()
        if closure is None:
            if synchronized:
                self.skipped = amp is not None and amp[1]  # averaged: every rank's check alike
                if amp is not None and not self.skipped and amp[0] != 1.0:
                    with torch.no_grad():
                        for p in self._params():
                            if p.grad is not None:
                                p.grad.mul_(amp[0])
            else:
                self._average(_NO_CLOSURE, amp)
            return None if self.skipped else self.optimizer.step()
        if not callable(closure):
            raise TypeError(f"closure: must be callable, got {type(closure).__name__}")

        def averaged() -> Any:
            return self._average(closure())

        return self.optimizer.step(averaged)

    def _averaged(self) -> bool:
        """Whether the gradients are averaged already: :meth:`synchronize` ran, and no count
        came since (a forward counted by ``model=``, a :meth:`count` with ``items``), which
        would be of new gradients (a loop that steps the wrapped optimizer itself after
        synchronising, and zeroes the model's gradients rather than this optimizer's)."""
        if not self._synchronized:
            return False
        if self.items is not None:
            return not self._counts
        return self.counter is None or self.counter.forwards == 0  # by hand: until zero_grad

    def _amp_scaling(self) -> tuple[float, bool] | None:
        """``(1 / scale, found an inf)`` where ``torch.amp.GradScaler.step`` calls this step
        (it sets ``grad_scale``, None once :func:`unscale_` ran, and ``found_inf`` for the
        call), else None. ``1 / scale`` is GradScaler's own (a float32 reciprocal)."""
        if "found_inf" not in self.__dict__:
            return None
        scale = self.__dict__.get("grad_scale")
        inv = 1.0 if scale is None else float(torch.as_tensor(scale).double().reciprocal().float())
        return inv, bool(float(self.__dict__["found_inf"]))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._synchronized = False
        if self.counter is not None:  # the forwards whose gradients are dropped here
            self.counter.discard_reached()
        if self._counts:  # and the counts: those whose backward ran since
            now = self._grad_marks()
            self._counts = [(c, marks) for c, marks in self._counts if marks == now]
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


def _bits(flags: list[bool]) -> np.ndarray:
    """``flags`` packed 63 to an int64 word (non-negative words, as the gather carries them)."""
    words = np.zeros(max(1, -(-len(flags) // 63)), np.int64)
    for i, f in enumerate(flags):
        if f:
            words[i // 63] |= 1 << (i % 63)
    return words


def _layout(params: list[torch.Tensor], what: str = "parameter") -> dict[str, int]:
    """The tensors' order, shapes and dtypes as :func:`hetcoll.comm.agree` fields (``what``
    they are, in the names)."""
    shapes = np.array([d for p in params for d in (p.dim(), *p.shape)], np.int64)
    dtypes = ",".join(str(p.dtype) for p in params).encode()
    elements = "the gradient elements" if what == "parameter" else f"the {what} elements"
    return {
        f"the number of {what}s": len(params),
        elements: sum(p.numel() for p in params),
        f"the {what} shapes, in order (crc32)": zlib.crc32(shapes.tobytes()),
        f"the {what} dtypes, in order (crc32)": zlib.crc32(dtypes),
    }


def broadcast_parameters(
    module: torch.nn.Module, group: Any = None, root: int = 0, *, comm: Any = NOT_GIVEN
) -> None:
    """Copy ``root``'s parameters and buffers to every rank of ``group`` (``root`` a rank of
    ``group``, as torch's ``group_src``; call before training;
    ``group`` as :class:`DistributedOptimizer` takes it, ``comm=`` its deprecated name)."""
    check_module(module, "module")
    group = group_argument(group, "broadcast_parameters", comm=comm)
    c = wrap(group)
    tensors = [*module.parameters(), *module.buffers()]
    failure = None
    if not is_int(root) or not 0 <= root < c.size:
        failure = ValueError(f"root: must be a rank of group, in [0, {c.size}), got {root!r}")
    # Ranks whose models differ would broadcast into tensors of other sizes (MPI: "Message
    # truncated" on some ranks, none on others), and a rank whose root is no rank would raise
    # alone: they raise on every rank instead.
    fields = {**_layout(tensors, "module tensor"), "root": -1 if failure else int(root)}
    agree(c, fields, failure=failure)
    if c.engine != "mpi":
        import torch.distributed as dist

        src = root if c.native is None else dist.get_global_rank(c.native, root)
    with torch.no_grad():
        for t in tensors:
            # Engines write C-contiguous memory (gloo left a strided view as it was): a tensor
            # in another layout goes through a contiguous copy.
            dense = t.is_contiguous()
            buf = t.detach() if dense else t.detach().contiguous()
            if c.engine != "mpi":
                dist.broadcast(buf, src=src, group=c.native)
            else:  # as bytes: any dtype (bfloat16 has no numpy type)
                c.native.Bcast(buf.reshape(-1).view(torch.uint8).numpy(), root=root)
            if not dense:
                t.copy_(buf)
