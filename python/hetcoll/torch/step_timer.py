"""StepTimer: this rank's own compute time per training step, for a Rebalancer.

Under DDP a rank's backward ends when every rank's gradients have arrived: timed around the
step, every rank takes as long as the slowest, a rank's speed reads as its share over that
time, and a rebalancer fed with it never moves the shares. The time a rebalancer needs is the
rank's own: from its model's forward to the moment its backward has produced the last of its
gradients. DDP waits for the ranks' allreduce only after that, in the callback that ends the
backward; the buffers it broadcasts before the forward (another wait) come before the model's
own forward starts.

So the timer hooks the model, not the wrapper: a forward pre-hook marks the step's first
forward, and every parameter's post-accumulate-grad hook the latest gradient accumulated.
With or without DDP, and for micro-batches under ``no_sync`` alike; a communication hook that
itself waits for the other ranks inside the backward (before the last gradient) is counted.
On a GPU the marks are CUDA events recorded on the current stream (the hooks run as the work
is queued, before it is done), read once the last one has completed: one host
synchronisation per :meth:`StepTimer.pop`.

FSDP2 (``fully_shard``) waits for the other ranks inside the step, at every layer: each
layer's forward and backward start by gathering its parameters from every rank, and its
gradients leave by a reduce-scatter. There the step runs from the first forward to the end of
FSDP's last backward callback, and every span of FSDP's own work in it is taken off: each
parameter group's ``pre_forward``, ``pre_backward`` and ``post_backward`` (the gathers, their
waits and the reduce-scatters) and the root's final backward callback (its wait for the last
reductions). These are FSDP's parameter-group methods, wrapped on the instances (not the
classes) while the timer lives; a torch whose FSDP lacks them is refused. What is left is the
rank's own compute, its layers' forward and backward, as under DDP.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

#: FSDP2's methods whose spans are its own work, not the rank's compute: per parameter group
#: (the gathers of each layer's parameters and their waits, its gradients' reduce-scatter;
#: ``unshard`` / ``wait_for_unshard`` also run alone, from a prefetch), and per state (the
#: root's callback at the end of the backward, which waits for the last reductions).
_GROUP_WAITS = ("pre_forward", "pre_backward", "post_backward", "unshard", "wait_for_unshard")
_FINAL_CALLBACK = "_root_post_backward_final_callback"


def _shards(param: torch.Tensor) -> int:
    """Over how many mesh dimensions ``param`` is sharded: a DTensor's sharded placements
    (FSDP2, tensor parallelism; a replicated one, ``replicate``, is a whole copy, as under DDP);
    0 for a plain tensor."""
    return sum(p.is_shard() for p in _placements(param))


def _placements(param: torch.Tensor) -> tuple[Any, ...]:
    """A DTensor's placements (one per mesh dimension); () for a plain tensor."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch before 2.5 (and builds without distributed): no DTensor here
        return ()
    return tuple(param.placements) if isinstance(param, DTensor) else ()


def _under_fsdp1(model: nn.Module) -> bool:
    """Whether ``model`` is or holds a ``FullyShardedDataParallel`` (FSDP1, whose parameters
    are flat shards, no DTensors)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # builds without distributed
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def _fsdp2_states(model: nn.Module) -> list[Any]:
    """The FSDP2 states (``fully_shard``) of ``model``'s modules, each once, in module order."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch before 2.6, or without distributed
        return []
    states: dict[int, Any] = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            states.setdefault(id(state), state)
    return list(states.values())


def _param_groups(state: Any) -> list[Any]:
    """An FSDP2 state's parameter groups: a list in torch 2.10 on, one (or None) before."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def _refusal(why: str) -> ValueError:
    return ValueError(
        f"model: {why}, whose forward and backward wait for the other ranks at every layer: "
        "each rank's time from forward to last gradient is the slowest rank's, and shares fed "
        "with it never move. Measure each rank's speed on the model before sharding it "
        "(hetcoll.torch.measure_speed) and give the shares to the BalancedSampler"
    )


#: Every StepTimer not yet removed: :meth:`StepTimer.waiting` marks its span on each.
_LIVE: weakref.WeakSet[StepTimer] = weakref.WeakSet()


def _restore(wrapped: list[tuple[Any, str, Callable[..., Any], Any]], handles: list[Any]) -> None:
    """Take a timer's hooks off and put FSDP's methods back as they were before it wrapped
    them (another timer's wrapper, or the class's own method), unless a later timer has
    wrapped them since (its own removal puts this one's back, which then passes through).
    Called once, by :meth:`StepTimer.remove` or when the timer is collected."""
    for handle in handles:
        handle.remove()
    handles.clear()
    for owner, name, spanned, previous in reversed(wrapped):
        if vars(owner).get(name) is spanned:
            if previous is None:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)
    wrapped.clear()


class StepTimer:
    """Times each step of ``model`` on this rank: from its first forward (or the first of a
    module directly inside it) to its last gradient accumulated (see the module docstring),
    leaving out the waits for other ranks. Forwards without gradients (``torch.no_grad()``:
    an evaluation) start no step.

    ``model``: the module (a ``DistributedDataParallel`` is timed through its ``module``).
    Call :meth:`pop` once per step (or micro-batch), after its backward; feed the seconds to
    :meth:`hetcoll.torch.Rebalancer.observe`:

    >>> timer = StepTimer(ddp_model)  # doctest: +SKIP
    >>> for x, y in loader:  # doctest: +SKIP
    ...     loss_fn(ddp_model(x), y).backward()
    ...     rebalancer.observe(len(x), timer.pop())
    ...     optimizer.step(); optimizer.zero_grad()

    A model on a CUDA device (where its parameters are when a step starts; under FSDP2, the
    device FSDP computes on) is timed by CUDA events (:meth:`pop` waits for the step's last
    gradient to be computed); its parameters must be on one device. A model sharded by FSDP2
    (``fully_shard``, applied before the timer is made) is timed to the end of FSDP's
    backward with FSDP's own gathers, reduce-scatters and their waits left out (the module
    docstring). Refused, as each waits for the other ranks in ways the timer cannot
    separate: FSDP1 (``FullyShardedDataParallel``), DeepSpeed ZeRO-3, and tensor parallelism
    (parameters sharded outside FSDP, or over two mesh dimensions).

    A collective of your own inside the step (a loss averaged over the ranks for a log line
    before the backward) waits for the other ranks too: run it under
    :meth:`StepTimer.waiting` to leave that wait out. hetcoll's own exchanges inside a step
    (:func:`~hetcoll.torch.weigh_loss`, the DDP hook state's ``count`` and ``weigh``) do.
    :meth:`reset` drops a step an exception cut short; :meth:`remove` takes the hooks off.
    The marks are the timer's own: one step at a time, not backwards run concurrently.
    """

    def __init__(self, model: nn.Module) -> None:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: must be a torch.nn.Module, got {type(model).__name__}")
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("model: has no parameter that requires a gradient to time")
        states = _fsdp2_states(model)
        groups = [g for s in states for g in _param_groups(s)]
        by_fsdp = {id(fp.sharded_param) for g in groups for fp in getattr(g, "fsdp_params", ())}
        if _under_fsdp1(model):
            raise _refusal("it is sharded by FSDP1 (FullyShardedDataParallel)")
        if any(hasattr(p, "ds_id") for p in params):
            raise _refusal("its parameters are sharded by DeepSpeed ZeRO-3")
        if any(_shards(p) > 1 or (_shards(p) and id(p) not in by_fsdp) for p in params):
            raise _refusal("its parameters are sharded by tensor parallelism")
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(
                f"model: its parameters are on {len(devices)} devices "
                f"({', '.join(sorted(str(d) for d in devices))}); StepTimer times one device's work"
            )
        #: The module timed.
        self.model = model
        self._first = params[0]  # where the model is when a step starts
        self._groups = groups  # FSDP2's parameter groups in the model (none: no FSDP)
        # FSDP computes on its own device: with its CPU offload the shards sit on the host.
        self._fsdp_device: torch.device | None = next(
            (d for d in (getattr(st, "_device", None) for st in states) if d is not None), None
        )
        self._cuda = False
        self._started: Any = None  # the step's first mark: a perf_counter time or a CUDA event
        self._ended: Any = None  # its latest end mark, of the same kind
        self._waits: list[tuple[Any, Any]] = []  # the waits' spans in the step (start, end)
        self._waits_at_end = 0  # of them, those before the end mark (later ones are outside)
        self._depth = 0  # FSDP's methods call one another: the outermost span counts
        self._wait_from: Any = None
        me = weakref.ref(self)  # the hooks do not keep the timer alive

        def forward(module: nn.Module, args: Any) -> None:
            timer = me()
            if timer is not None:
                timer._mark_start()

        def accumulated(param: torch.Tensor) -> None:
            timer = me()
            if timer is not None:
                timer._mark_end()

        # The step starts at the first forward of the model or of a module directly inside it
        # (a LightningModule's training_step calls its inner model, not its own forward); on
        # a module FSDP shards, after FSDP's pre-forward (its gather and wait), which FSDP
        # puts first among the module's pre-hooks.
        self._handles: list[Any] = [
            m.register_forward_pre_hook(forward) for m in (model, *model.children())
        ]
        self._handles += [p.register_post_accumulate_grad_hook(accumulated) for p in params]
        self._wrapped: list[tuple[Any, str, Callable[..., Any], Any]] = []
        self._removed = False
        self._finalizer = weakref.finalize(self, _restore, self._wrapped, self._handles)
        for group in groups:
            for name in _GROUP_WAITS:
                self._wrap(group, name, final=False)
        for state in states:
            self._wrap(state, _FINAL_CALLBACK, final=True)
        _LIVE.add(self)

    @staticmethod
    @contextlib.contextmanager
    def waiting() -> Iterator[None]:
        """Time inside is a wait for the other ranks, not compute: left out of the current
        step of every live timer. For a collective of your own inside a step::

            with StepTimer.waiting():
                torch.distributed.all_reduce(loss_sum)
        """
        timers = list(_LIVE)
        for timer in timers:
            timer._wait_begin()
        try:
            yield
        finally:
            for timer in timers:
                timer._wait_end(False)

    def _wrap(self, owner: Any, name: str, *, final: bool) -> None:
        """Replace ``owner.name`` (a bound method of FSDP's) on the instance by one that marks
        its span as FSDP's work; ``final``: its end also ends the step's compute."""
        inner = getattr(owner, name, None)
        if not callable(inner):
            self.remove()
            raise ValueError(
                f"model: this torch's FSDP ({torch.__version__}) has no {type(owner).__name__}."
                f"{name}, so StepTimer cannot leave FSDP's waits for the other ranks out of its "
                "steps. Measure each rank's speed on the model before sharding it "
                "(hetcoll.torch.measure_speed) and give the shares to the BalancedSampler"
            )
        me = weakref.ref(self)

        def spanned(*args: Any, **kwargs: Any) -> Any:
            timer = me()
            if timer is None or timer._removed:  # the timer is gone: the method it wrapped
                return inner(*args, **kwargs)
            timer._wait_begin()
            try:
                return inner(*args, **kwargs)
            finally:
                timer._wait_end(final)

        previous = vars(owner).get(name)  # another timer's wrapper, or None: the class's
        setattr(owner, name, spanned)
        self._wrapped.append((owner, name, spanned, previous))

    def _mark(self) -> Any:
        """Now: a perf_counter time, or on a GPU a CUDA event recorded on the current stream."""
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _mark_start(self) -> None:
        # The step's first forward (a second one is its own); one without gradients is no
        # training step's (an evaluation, a check of the loss).
        if self._started is not None or not torch.is_grad_enabled():
            return
        device = self._fsdp_device or self._first.device
        self._cuda = device.type == "cuda"
        self._started = self._mark()

    def _mark_end(self) -> None:
        if self._started is None:  # a gradient outside a timed step (before the first forward)
            return
        self._ended = self._mark()  # marked again at each gradient: the last one counts
        self._waits_at_end = len(self._waits)

    def _wait_begin(self) -> None:
        self._depth += 1
        if self._depth == 1 and self._started is not None:
            self._wait_from = self._mark()

    def _wait_end(self, final: bool) -> None:
        self._depth -= 1
        if self._depth > 0 or self._wait_from is None:
            return
        end = self._mark()
        self._waits.append((self._wait_from, end))
        self._wait_from = None
        if final:
            self._ended = end
            self._waits_at_end = len(self._waits)

    def _seconds(self, start: Any, end: Any) -> float:
        if self._cuda:
            return float(start.elapsed_time(end)) / 1000.0
        return float(end - start)

    def _holds_first(self) -> bool:
        """Whether the parameter the timer started from is still the model's: one of its
        parameters, or (FSDP2) one of FSDP's shards, which the module does not hold between a
        forward and its backward, nor after a forward without gradients (the gathered ones
        are there)."""
        return any(p is self._first for p in self.model.parameters()) or any(
            fp.sharded_param is self._first for g in self._groups for fp in g.fsdp_params
        )

    def reset(self) -> None:
        """Drop the step in progress (one an exception cut short): the next forward starts a
        new one."""
        self._started = self._ended = self._wait_from = None
        self._waits = []
        self._waits_at_end = 0
        self._depth = 0

    def pop(self) -> float:
        """Seconds of this rank's compute in the step since the last call: from its first
        forward to its last gradient accumulated (under FSDP2: to the end of its backward,
        FSDP's own spans left out; to now, where no gradient came: a forward alone), less the
        waits in it (:meth:`waiting`). Then the next step starts. ``RuntimeError`` where the
        model ran no forward since the last call, or where its parameters were replaced since
        the timer was made (sharded, or loaded with ``assign=True``: the hooks are on the old
        ones)."""
        if not self._holds_first():
            raise RuntimeError(
                "StepTimer.pop: the model's parameters were replaced since the timer was made "
                "(sharded by FSDP, or loaded with assign=True): its hooks are on the old ones. "
                "Make the timer from the model as it trains"
            )
        started, ended, waits, at_end = self._started, self._ended, self._waits, self._waits_at_end
        self.reset()
        if started is None:
            raise RuntimeError(
                "StepTimer.pop: the model ran no forward since the last pop (call it once per "
                "step, after the step's backward)"
            )
        if ended is None:
            ended = self._mark()
        else:
            waits = waits[:at_end]  # spans after the step's end (an evaluation) are not in it
        if self._cuda:
            ended.synchronize()
        waited = sum(self._seconds(a, b) for a, b in waits)
        return max(self._seconds(started, ended) - waited, 0.0)

    def remove(self) -> None:
        """Take the timer's hooks off the model (and its spans off FSDP's methods)."""
        self._removed = True
        _LIVE.discard(self)
        self._finalizer()
