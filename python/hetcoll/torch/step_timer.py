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
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def _sharded(param: torch.Tensor) -> bool:
    """Whether ``param`` is sharded over ranks: a DTensor with a sharded placement (FSDP2,
    tensor parallelism; a replicated one, ``replicate``, is a whole copy, as under DDP), or a
    DeepSpeed ZeRO-3 parameter (its ``ds_id``)."""
    if hasattr(param, "ds_id"):
        return True
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch before 2.5 (and builds without distributed): no DTensor here
        return False
    return isinstance(param, DTensor) and any(p.is_shard() for p in param.placements)


def _under_fsdp1(model: nn.Module) -> bool:
    """Whether ``model`` is or holds a ``FullyShardedDataParallel`` (FSDP1, whose parameters
    are flat shards, no DTensors)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # builds without distributed
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


class StepTimer:
    """Times each step of ``model`` on this rank: from its first forward to its last gradient
    accumulated (see the module docstring), leaving out the waits for other ranks. Forwards
    without gradients (``torch.no_grad()``: an evaluation) start no step.

    ``model``: the module (a ``DistributedDataParallel`` is timed through its ``module``).
    Call :meth:`pop` once per step (or micro-batch), after its backward; feed the seconds to
    :meth:`hetcoll.torch.Rebalancer.observe`:

    >>> timer = StepTimer(ddp_model)  # doctest: +SKIP
    >>> for x, y in loader:  # doctest: +SKIP
    ...     loss_fn(ddp_model(x), y).backward()
    ...     rebalancer.observe(len(x), timer.pop())
    ...     optimizer.step(); optimizer.zero_grad()

    A model on a CUDA device (where its parameters are when a step starts) is timed by CUDA
    events (:meth:`pop` waits for the step's last gradient to be computed); its parameters
    must be on one device. A model sharded over the ranks (FSDP's ``fully_shard``) is refused:
    it waits for the other ranks inside every layer. :meth:`remove` takes the hooks off.
    """

    def __init__(self, model: nn.Module) -> None:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: must be a torch.nn.Module, got {type(model).__name__}")
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("model: has no parameter that requires a gradient to time")
        if any(_sharded(p) for p in params) or _under_fsdp1(model):
            raise ValueError(
                "model: its parameters are sharded (FSDP, fully_shard, DeepSpeed ZeRO-3, "
                "tensor parallelism), whose forward and backward wait for the other ranks at every "
                "layer: each rank's time from forward to last gradient is the slowest rank's, "
                "and shares fed with it never move. Measure each rank's speed on the model "
                "before sharding it (hetcoll.torch.measure_speed) and give the shares to the "
                "BalancedSampler"
            )
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(
                f"model: its parameters are on {len(devices)} devices "
                f"({', '.join(sorted(str(d) for d in devices))}); StepTimer times one device's work"
            )
        #: The module timed.
        self.model = model
        self._first = params[0]  # where the model is when a step starts
        self._cuda = False
        self._started: float | None = None
        self._ended: float | None = None
        self._start_event: Any = None
        self._end_event: Any = None
        me = weakref.ref(self)  # the hooks do not keep the timer alive

        def forward(module: nn.Module, args: Any) -> None:
            timer = me()
            if timer is not None:
                timer._mark_start()

        def accumulated(param: torch.Tensor) -> None:
            timer = me()
            if timer is not None:
                timer._mark_end()

        self._handles = [model.register_forward_pre_hook(forward)]
        self._handles += [p.register_post_accumulate_grad_hook(accumulated) for p in params]

    def _mark_start(self) -> None:
        # The step's first forward (a second one is its own); one without gradients is no
        # training step's (an evaluation, a check of the loss).
        if self._started is not None or not torch.is_grad_enabled():
            return
        self._started = time.perf_counter()
        self._cuda = self._first.device.type == "cuda"
        if self._cuda:
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record()

    def _mark_end(self) -> None:
        if self._started is None:  # a gradient outside a timed step (before the first forward)
            return
        self._ended = time.perf_counter()
        if self._cuda:
            if self._end_event is None:
                self._end_event = torch.cuda.Event(enable_timing=True)
            self._end_event.record()  # recorded again at each gradient: the last one counts

    def pop(self) -> float:
        """Seconds of this rank's compute in the step since the last call: from its first
        forward to its last gradient accumulated (to now, where no gradient came: a forward
        alone). Then the next step starts. ``RuntimeError`` where the model ran no forward
        since the last call, or where its parameters were replaced since the timer was
        made (sharded, or loaded with ``assign=True``: the hooks are on the old ones)."""
        if not any(p is self._first for p in self.model.parameters()):
            raise RuntimeError(
                "StepTimer.pop: the model's parameters were replaced since the timer was made "
                "(sharded by FSDP, or loaded with assign=True): its hooks are on the old ones. "
                "Make the timer from the model as it trains"
            )
        started, ended = self._started, self._ended
        start_event, end_event = self._start_event, self._end_event
        self._started = self._ended = None
        self._start_event = self._end_event = None
        if started is None:
            raise RuntimeError(
                "StepTimer.pop: the model ran no forward since the last pop (call it once per "
                "step, after the step's backward)"
            )
        if self._cuda and start_event is not None:
            if end_event is None:
                end_event = torch.cuda.Event(enable_timing=True)
                end_event.record()
            end_event.synchronize()
            return float(start_event.elapsed_time(end_event)) / 1000.0
        return (time.perf_counter() if ended is None else ended) - started

    def remove(self) -> None:
        """Take the timer's hooks off the model."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
