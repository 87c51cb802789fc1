"""Accelerate's own checkpoints (``accelerator.save_state`` / ``load_state``, and
``accelerator.get_state_dict`` / ``save_model``) of a model split over the ranks (experts
placed by ``expert_parallel``; any model :func:`hetcoll.torch.gather_state_dict` gathers): the
unsplit model and optimizer state, which resume into any placement.

``save_state`` and ``save_model`` write the main process's ``model.state_dict()`` and
``optimizer.state_dict()``: of a split model, that rank's slices only (its own experts), under
the unsplit names, silently. :func:`whole_checkpoints` hooks them, through the hooks
Accelerate and torch give:

- ``accelerator.get_state_dict(model)`` (what ``save_model`` and ``save_state`` call) gives the
  unsplit weights (:func:`hetcoll.torch.gather_state_dict`), under the keys the model it is
  handed has (a wrapper's ``module.`` too), to the processes that write (FSDP's convention: a
  split model's is an empty dict on the others; a model split nowhere is whole everywhere);
- Accelerate's save-state pre-hook gathers the optimizer's state
  (:func:`hetcoll.torch.gather_optimizer_state_dict`, keyed by parameter name); the
  optimizer's next ``state_dict()`` (``save_state``'s own call, right after) gives that, once.
  A step taken in between drops it.
- ``load_state`` reads the unsplit weights back through ``load_state_dict``, which a split
  model slices as it loads; Accelerate's load-state pre-hook makes the optimizer's next
  ``load_state_dict`` (``load_state``'s own) take this rank's part of an optimizer state
  dict keyed by names (:func:`hetcoll.torch.filters.state.local_optimizer_state`).

The gathers are collective: every process calls ``save_state``, ``save_model`` and
``get_state_dict``, as Accelerate's examples do.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch import nn

from hetcoll.torch import gather_optimizer_state_dict, gather_state_dict
from hetcoll.torch.filters.layers import split_comms
from hetcoll.torch.filters.state import local_optimizer_state

#: Where Accelerate saves the model and optimizer its own way, not through their state dicts.
_OWN_CHECKPOINTS = (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)


def gather_destination(model: nn.Module, processes: int, on_each_node: bool) -> int | None:
    """Where a checkpoint's gathers of split ``model`` go: rank 0 of the split's group where
    that is the one process writing (the group is all ``processes`` and not every node's main
    process writes: ``save_on_each_node``), else every rank."""
    whole = all(c.size == processes for c in split_comms(model))
    return 0 if whole and not on_each_node else None


class WholeCheckpoints:
    """The hooks :func:`whole_checkpoints` made; :meth:`remove` takes them off."""

    def __init__(
        self, accelerator: Accelerator, model: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> None:
        self.accelerator = accelerator
        #: The model as prepared (a DDP wrapper, say) and as the user built it.
        self.prepared, self.model = model, accelerator.unwrap_model(model)
        self.optimizer = optimizer
        self._handles: list[Any] = [
            accelerator.register_save_state_pre_hook(self._on_save),
            accelerator.register_load_state_pre_hook(self._on_load_state),
        ]
        self._armed: list[Any] = []  # the optimizer's one-shot hooks for the save or load going on
        # accelerator.get_state_dict, replaced on the instance (Accelerate has no hook there);
        # what it was, for the models that are not this one and for remove().
        self._own_get_state_dict = accelerator.get_state_dict
        self._replaced = vars(accelerator).get("get_state_dict")  # None: the class's own
        accelerator.get_state_dict = self.get_state_dict  # type: ignore[method-assign]
        self._given: weakref.ref[OrderedDict[str, Any]] | None = None  # the last one given

    def remove(self) -> None:
        """Take the hooks off: ``save_state`` writes what it would without them."""
        self._disarm()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if vars(self.accelerator).get("get_state_dict") == self.get_state_dict:
            if self._replaced is None:
                del self.accelerator.get_state_dict
            else:
                self.accelerator.get_state_dict = self._replaced  # type: ignore[method-assign]
        self._given = None

    def _destination(self) -> int | None:
        config = self.accelerator.project_configuration
        processes, on_each_node = self.accelerator.num_processes, bool(config.save_on_each_node)
        return gather_destination(self.model, processes, on_each_node)

    def _is_ours(self, model: nn.Module) -> bool:
        return model is self.prepared or self.accelerator.unwrap_model(model) is self.model

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """``accelerator.get_state_dict`` while the hooks are on: of this model (as prepared,
        unwrapped or as the user built it), the unsplit state dict under ``model``'s keys (its
        inner model's with ``unwrap``), on the processes that write checkpoints, and (of a
        split model) an empty one on the others; of any other model, what Accelerate gives.
        Collective."""
        if not self._handles or not self._is_ours(model):
            return self._own_get_state_dict(model, unwrap=unwrap)
        prefix = "" if unwrap else _prefix(model, self.model)
        if not unwrap:
            # The keys Accelerate saves are the handed model's: checked on every process
            # before the collective gathers.
            keys = model.state_dict().keys()
            expected = {prefix + k for k in self.model.state_dict()}
            if keys != expected:
                other = sorted(keys ^ expected)[:3]
                raise ValueError(
                    "whole_checkpoints: Accelerate saves other keys than the model's state "
                    f"dict holds (such as {other}): the model was wrapped after "
                    "accelerator.prepare"
                )
        full = gather_state_dict(self.model, dst=self._destination()) or {}
        given = OrderedDict((prefix + k, v) for k, v in full.items())
        self._given = weakref.ref(given)
        return given

    def _on_save(self, models: list[nn.Module], weights: list[Any], output_dir: str) -> None:
        """Accelerate's save-state pre-hook (every process): the unsplit weights in place of
        the model's (given already where ``save_state`` asked :meth:`get_state_dict`), and the
        optimizer's unsplit state armed for its next ``state_dict()``."""
        index = next((i for i, m in enumerate(models) if self._is_ours(m)), None)
        if index is None or len(weights) != len(models):
            raise ValueError(
                "whole_checkpoints: the model is not one the accelerator saves (pass the model "
                "accelerator.prepare returned)"
            )
        given = self._given() if self._given is not None else None
        if weights[index] is not given:
            weights[index] = self.get_state_dict(models[index], unwrap=False)
        self._given = None
        if self.optimizer is not None:
            self._disarm()
            state = gather_optimizer_state_dict(self.model, self.optimizer, dst=self._destination())
            if state is not None:
                self._arm(state)

    def _arm(self, state: dict[str, Any]) -> None:
        """The optimizer's next ``state_dict()`` gives ``state``, unless it steps first."""
        assert self.optimizer is not None

        def give(optimizer: torch.optim.Optimizer, own: dict[str, Any]) -> dict[str, Any]:
            self._disarm()
            return state

        self._armed = [
            self.optimizer.register_state_dict_post_hook(give),
            self.optimizer.register_step_pre_hook(self._stepped),
        ]

    def _stepped(self, *_: Any) -> None:
        self._disarm()

    def _on_load_state(self, models: list[nn.Module], input_dir: str) -> None:
        """Accelerate's load-state pre-hook: the optimizer's next ``load_state_dict``
        (``load_state``'s own, right after) takes this rank's part of the unsplit state the
        checkpoint holds. Only that load: DCP's ``set_optimizer_state_dict`` also hands the
        optimizer state dicts keyed by names, of this rank's slices."""
        if self.optimizer is None:
            return
        self._disarm()
        self._armed = [
            self.optimizer.register_load_state_dict_pre_hook(self._on_load, prepend=True),
            self.optimizer.register_step_pre_hook(self._stepped),
        ]

    def _disarm(self) -> None:
        for h in self._armed:
            h.remove()
        self._armed = []

    def _on_load(
        self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Optimizer load pre-hook, once (:meth:`_on_load_state`): a state dict keyed by
        parameter names (the unsplit one this module's checkpoints hold) becomes this rank's
        part; one keyed as the optimizer's own (a checkpoint saved without these hooks) stays."""
        self._disarm()
        groups = state_dict.get("param_groups", [])
        named = any(isinstance(k, str) for g in groups for k in g.get("params", []))
        return local_optimizer_state(self.model, optimizer, state_dict) if named else None


def _prefix(prepared: nn.Module, model: nn.Module) -> str:
    """The key prefix of ``model``'s entries in ``prepared``'s state dict (DDP's ``module.``)."""
    for name, m in prepared.named_modules():
        if m is model:
            return f"{name}." if name else ""
    return ""


def whole_checkpoints(
    accelerator: Accelerator, model: nn.Module, optimizer: Any = None
) -> WholeCheckpoints:
    """Make ``accelerator.save_state`` write the unsplit ``model`` and ``optimizer`` state, and
    ``accelerator.load_state`` read it back into any placement of the model: a model whose
    experts ``expert_parallel`` placed on the ranks (any model ``gather_state_dict`` gathers;
    a plain model too: the same files, the optimizer's keyed by parameter name). Call it on every
    process, after ``accelerator.prepare``, with what it returned, in the run that saves and
    in the run that loads (before ``load_state``); every process then calls ``save_state``
    (the gathers are collective). The model's file is the one Accelerate writes, under its
    keys, holding the unsplit tensors; the optimizer's, a full optimizer state dict
    (:func:`hetcoll.torch.gather_optimizer_state_dict`'s). ``accelerator.get_state_dict(model)``
    and so ``accelerator.save_model(model, dir)`` give the unsplit weights too (every process
    calls them; of a split model, the processes that do not write get an empty dict, as under
    FSDP). Returns the hooks' handle (``.remove()``).

    >>> model, opt = accelerator.prepare(model, opt)  # doctest: +SKIP
    >>> whole_checkpoints(accelerator, model, opt)  # doctest: +SKIP
    >>> accelerator.save_state("ckpt")  # doctest: +SKIP
    >>> accelerator.save_model(model, "final")  # doctest: +SKIP
    """
    if not isinstance(accelerator, Accelerator):
        raise TypeError(
            f"accelerator: must be an accelerate.Accelerator, got {type(accelerator).__name__}"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: must be a torch.nn.Module, got {type(model).__name__}")
    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer
    if optimizer is not None and not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer: must be a torch.optim.Optimizer (or Accelerate's wrapper of one) or "
            f"None, got {type(optimizer).__name__}"
        )
    kind = accelerator.distributed_type
    if kind in _OWN_CHECKPOINTS:
        raise ValueError(
            f"accelerator: under {kind}, Accelerate saves the model and optimizer its own way "
            "(sharded), not through their state dicts: whole_checkpoints has nothing to do"
        )
    unwrapped = accelerator.unwrap_model(model)
    if inner is not None:
        params = {id(p) for p in unwrapped.parameters()}
        if any(id(p) not in params for g in inner.param_groups for p in g["params"]):
            raise ValueError("optimizer: holds tensors that are not the model's parameters")
    return WholeCheckpoints(accelerator, model, inner)
