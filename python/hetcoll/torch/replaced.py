"""Parameters a split replaced: :func:`~hetcoll.torch.filter_parallel`,
:func:`~hetcoll.torch.expert_parallel` and :func:`~hetcoll.torch.parallelize` give the model (or
the plan) new parameters, each rank's slices or copies. An optimizer created before them still
holds the old ones, and its steps would train nothing of the model, without a word; so the
parameters replaced are recorded here (:func:`record_replaced`), and one optimizer step pre-hook
(torch's ``register_optimizer_step_pre_hook``, registered with the first record) raises
``ValueError`` at the step of an optimizer holding any of them."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

#: The replaced parameters by ``id``: a weak reference (the entry is gone with the tensor) and
#: the call that replaced it. Keyed by ``id``: tensors compare elementwise, not by identity.
_REPLACED: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}
#: Each optimizer checked, with its number of parameters then (a group added: checked again).
_CHECKED: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
_HOOK: Any = None


def record_replaced(before: Iterable[nn.Parameter], after: Iterable[nn.Parameter], by: str) -> None:
    """Record the parameters of ``before`` that are not in ``after`` as replaced by ``by`` (a
    call's name, said in the error)."""
    global _HOOK
    kept = {id(p) for p in after}
    for p in before:
        if id(p) not in kept:
            _REPLACED[id(p)] = (weakref.ref(p, _forget(id(p))), by)
    if _HOOK is None and _REPLACED:
        _HOOK = register_optimizer_step_pre_hook(_check)


def _forget(key: int) -> Any:
    """The callback that drops entry ``key`` once its tensor is gone."""

    def forget(_: object) -> None:
        _REPLACED.pop(key, None)

    return forget


def _check(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _REPLACED:
        return
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    if _CHECKED.get(optimizer) == count:
        return
    for g in optimizer.param_groups:
        for p in g["params"]:
            ref, by = _REPLACED.get(id(p), (None, ""))
            held = None if ref is None else ref()
            if held is not None and held is p:
                raise ValueError(
                    f"optimizer: it holds a parameter (shape {tuple(held.shape)}) that {by} "
                    "replaced: the model now trains new parameters (each rank's slices, or a "
                    f"plan's copies), which this optimizer does not hold. Create the optimizer "
                    f"after {by}, from the model's parameters (a plan's: "
                    "par.parameters())"
                )
    _CHECKED[optimizer] = count
