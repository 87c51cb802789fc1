"""A split model's optimizer state as torch.distributed.checkpoint's shards of the unsplit
model's: an optimizer holding split parameters marks, in its ``state_dict()``, each state
tensor shaped as its parameter (SGD's momentum, Adam's moments) where the parameter's slice
sits (:meth:`~.layers.ChannelSplit.mark_shards`, as the model's own ``state_dict()`` marks
the slices). ``dcp.save`` of ``get_state_dict(model, optimizer)`` then writes the unsplit
state, and ``dcp.load`` reads it into any other split; ``optimizer.load_state_dict`` refuses
marked state cut for another rank or split.

Optimizers are found at their first step (torch's global ``register_optimizer_step_pre_hook``,
registered by :func:`track_optimizers`; ``get_state_dict`` steps a fresh optimizer first) or
where hetcoll loads a full state into them (:func:`hook_optimizer`), and each given a
state-dict post-hook and a load pre-hook once."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from hetcoll.torch.filters.layers import ChannelSplit, split_modules

#: Each optimizer already given its hooks.
_HOOKED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_HOOK: Any = None


def track_optimizers() -> None:
    """Give every optimizer, at its next step, the hooks that mark its split state (once;
    called by the splits: :func:`~hetcoll.torch.filter_parallel`,
    :func:`~hetcoll.torch.expert_parallel`)."""
    global _HOOK
    if _HOOK is None:
        _HOOK = register_optimizer_step_pre_hook(_on_step)


def _on_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    hook_optimizer(optimizer)


def hook_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Give ``optimizer`` the hooks that mark its split state, once (at its first step, or
    where hetcoll loads state into it before any step)."""
    if optimizer in _HOOKED:
        return
    _HOOKED.add(optimizer)
    optimizer.register_state_dict_post_hook(_mark_state)
    optimizer.register_load_state_dict_pre_hook(_check_state)


def _split_params() -> dict[int, tuple[torch.Tensor, ChannelSplit, str]]:
    """Every split parameter alive by ``id``: the tensor, its split module and its name there."""
    out: dict[int, tuple[torch.Tensor, ChannelSplit, str]] = {}
    for m in split_modules():
        for name in m.split_spec():
            p = getattr(m, name, None)
            if isinstance(p, torch.Tensor):
                out[id(p)] = (p, m, name)
    return out


def _held(optimizer: torch.optim.Optimizer) -> dict[int, tuple[ChannelSplit, str]]:
    """The optimizer's split parameters by their index in its state dict."""
    split = _split_params()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return {
        i: (split[id(p)][1], split[id(p)][2])
        for i, p in enumerate(params)
        if id(p) in split and split[id(p)][0] is p
    }


def _mark_state(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """The state dict with each split parameter's state tensors marked: fresh views of them
    (the optimizer's own tensors keep no marks), written in place by ``dcp.load``."""
    held = _held(optimizer)
    state = state_dict.get("state", {})
    for i, (m, name) in held.items():
        entries = state.get(i)
        if not isinstance(entries, dict):
            continue
        marked = dict(entries)  # the optimizer's own dict is in the state dict: not changed
        for field, v in entries.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                view = v.detach().view_as(v)
                if m.mark_shards(name, view):
                    marked[field] = view
        state[i] = marked
    return state_dict


def _check_state(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """Refuse marked state (saved from a split model's optimizer) that is not this rank's slice
    of this split (another rank's has this rank's shape on an even split)."""
    state = state_dict.get("state", {})
    for i, (m, name) in _held(optimizer).items():
        entries = state.get(i)
        if not isinstance(entries, dict):
            continue
        for field, v in entries.items():
            if isinstance(v, torch.Tensor) and hasattr(v, "global_offsets"):
                m.check_slice(f"state[{i}][{field!r}]", name, v, "optimizer state_dict")
