"""Full state dicts of split models: the unsplit model's weights and optimizer state, keyed by
its own parameter names, and back into any split of it.

A filter-parallel model (:func:`hetcoll.torch.filter_parallel`) or a plan's
:class:`~hetcoll.torch.Parallel` holds on each rank slices of some parameters, cut by shares
that depend on the number of ranks and their speeds. A checkpoint meant to resume on other
ranks therefore holds the *unsplit* model's state, which any new split can slice again: its
state dict (:func:`~hetcoll.torch.gather_state_dict`, :meth:`Parallel.full_state_dict`) and its
optimizer's, in the form of torch.distributed.checkpoint's ``get_optimizer_state_dict(...,
options=StateDictOptions(full_state_dict=True))`` and FSDP's ``full_optim_state_dict``: the
optimizer's own ``state_dict()`` with parameter names for indices::

    {"state": {"0.weight": {"momentum_buffer": <full tensor>}, ...},
     "param_groups": [{"lr": 0.1, "momentum": 0.9, ..., "params": ["0.weight", "0.bias", ...]}]}

The state of an elementwise optimizer (SGD's momentum, Adam's moments, RMSprop's averages) is
shaped as its parameter, so a split parameter's state is split the same way and a full one
slices like the weights; scalars (Adam's ``step``) and plain values are the same on every rank.
State of any other shape (a factored optimizer's row and column statistics) cannot follow a
re-split and is refused by name.

This module is the local part, the same for both kinds of model: where a rank's tensor sits in
the full one (:class:`Part`), the format's checks (the same verdict on every rank given the
same dicts, so no rank raises alone) and the conversions between name- and index-keyed
optimizer state. The collectives that gather live with each split:
:func:`hetcoll.torch.filters.gather_optimizer_state_dict` and
:meth:`hetcoll.torch.parallel.Parallel.full_optimizer_state_dict`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "Part",
    "check_full_optimizer_state_dict",
    "check_full_state_dict",
    "check_optimizer",
    "local_optimizer_state_dict",
    "named_optimizer_state",
    "state_kind",
]


@dataclass(frozen=True)
class Part:
    """Where a rank's tensor sits in the full tensor of ``shape``: entries ``start ..
    start + length`` along ``dim`` (a channel split), the entries ``index`` along ``dim`` (an
    owners stage's channels along dim 0, whole heads of packed query/key/value), or the whole
    tensor (``length`` and ``index`` None). ``written``: the entries along ``dim`` of the
    rank's tensor it puts into a full tensor (None: all). Entries every rank of a split holds
    (multi-query attention's key and value packed with its split query heads) are put by one
    rank alone, so a sum over the ranks counts them once."""

    shape: tuple[int, ...]
    dim: int = 0
    start: int = 0
    length: int | None = None
    index: torch.Tensor | None = None
    written: torch.Tensor | None = None

    @property
    def whole(self) -> bool:
        return self.length is None and self.index is None

    def written_of(self, local: torch.Tensor) -> torch.Tensor:
        """The entries of this rank's ``local`` tensor (or its gradient) that it puts into a
        full tensor (:meth:`put`): all but those another rank writes."""
        if self.written is None:
            return local
        return local.index_select(self.dim, self.written.to(local.device))

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``full`` (a view where it can be one)."""
        if self.index is not None:
            return full.index_select(self.dim, self.index.to(full.device))
        if self.length is None:
            return full
        return full.narrow(self.dim, self.start, self.length)

    def put(self, full: torch.Tensor, local: torch.Tensor) -> None:
        """Write this rank's ``local`` where it belongs in ``full``."""
        local = local.detach().to(full.device, full.dtype)
        if self.index is not None and self.written is not None:
            full.index_copy_(
                self.dim, self.index[self.written].to(full.device), self.written_of(local)
            )
        elif self.index is not None:
            full.index_copy_(self.dim, self.index.to(full.device), local)
        elif self.length is None:
            full.copy_(local)
        else:
            full.narrow(self.dim, self.start, self.length).copy_(local)


def check_optimizer(optimizer: object, argument: str = "optimizer") -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"{argument}: must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )


def state_kind(value: object, param_shape: Sequence[int]) -> str:
    """How one entry of a parameter's optimizer state follows a split: ``"sliced"`` (a tensor
    shaped as the parameter), ``"scalar"`` (a 0-dim tensor, such as Adam's step), ``"value"``
    (anything not a tensor) or ``"other"`` (a tensor of another shape: not elementwise)."""
    if isinstance(value, torch.Tensor):
        if tuple(value.shape) == tuple(param_shape):
            return "sliced"
        return "scalar" if value.dim() == 0 else "other"
    return "value"


def _not_elementwise(argument: str, name: str, field: str, shape: Any, want: Any) -> ValueError:
    return ValueError(
        f"{argument}: state {field!r} of parameter {name!r} has shape {tuple(shape)}, not the "
        f"parameter's {tuple(want)}: only optimizers whose state is elementwise (SGD, Adam, "
        "AdamW, RMSprop, ...) can follow a split"
    )


def named_optimizer_state(
    optimizer: torch.optim.Optimizer,
    names: Mapping[int, str | None],
    argument: str = "optimizer",
) -> tuple[dict[str, dict[str, Any]], list[tuple[dict[str, Any], list[str]]]]:
    """This rank's optimizer state by parameter name (its own tensors, not copied) and its
    param groups as (hyperparameters, names). ``names`` maps ``id(param)`` to the parameter's
    name in the unsplit model, or to None for a placeholder that keeps no state (an idle
    rank's). A parameter missing from ``names``, or state that is not elementwise, raises
    ``ValueError`` naming ``argument``."""
    check_optimizer(optimizer, argument)
    state: dict[str, dict[str, Any]] = {}
    groups: list[tuple[dict[str, Any], list[str]]] = []
    for g, group in enumerate(optimizer.param_groups):
        listed = []
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"{argument}: param_groups[{g}] holds a tensor of shape {tuple(p.shape)} "
                    "that is not a parameter of the model (build the optimizer over the "
                    "model's parameters())"
                )
            name = names[id(p)]
            if name is None:
                continue
            listed.append(name)
            entries = optimizer.state.get(p)
            if not entries:
                continue
            for field, value in entries.items():
                if state_kind(value, p.shape) == "other":
                    raise _not_elementwise(argument, name, field, value.shape, p.shape)
            state[name] = dict(entries)
        hyper = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
        groups.append((hyper, listed))
    return state, groups


def check_full_state_dict(
    state_dict: object,
    shapes: Mapping[str, Sequence[int]],
    argument: str = "state_dict",
    dtypes: Mapping[str, torch.dtype] | None = None,
) -> None:
    """``state_dict`` holds exactly the keys of ``shapes`` (the unsplit model's state-dict
    names), each a tensor of that shape, and of the kind of the model's ``dtypes`` (floating,
    complex, or integer and bool: a float64 checkpoint loads into float32 as torch's
    ``load_state_dict`` loads it, but a complex one lost its imaginary part)."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"{argument}: must be a state dict (a mapping), got {type(state_dict).__name__}"
        )
    missing = [k for k in shapes if k not in state_dict]
    unexpected = [k for k in state_dict if k not in shapes]
    if unexpected:
        raise ValueError(
            f"{argument}: has key(s) the model does not have: {few_names(unexpected)} (a state "
            "dict of another model?)" + (f"; and lacks {few_names(missing)}" if missing else "")
        )
    if missing:
        raise ValueError(f"{argument}: lacks key(s) {few_names(missing)}")
    for k, want in shapes.items():
        v = state_dict[k]
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"{argument}: {k!r} must be a tensor, got {type(v).__name__}")
        if tuple(v.shape) != tuple(want):
            raise ValueError(
                f"{argument}: {k!r} has shape {tuple(v.shape)}, the unsplit model's is "
                f"{tuple(want)} (give the full state dict, not one rank's slice)"
            )
        if dtypes is not None and _kind(v.dtype) != _kind(dtypes[k]):
            raise ValueError(
                f"{argument}: {k!r} is {v.dtype}, the model's is {dtypes[k]} (a "
                f"{_kind(v.dtype)} tensor cannot load into a {_kind(dtypes[k])} one)"
            )


def _kind(dtype: torch.dtype) -> str:
    if dtype.is_complex:
        return "complex"
    return "floating" if dtype.is_floating_point else "integer or bool"


def few_names(keys: Sequence[str]) -> str:
    """The first five of ``keys``, quoted, and how many more (for error messages)."""
    shown = ", ".join(repr(k) for k in keys[:5])
    return shown + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


def check_full_optimizer_state_dict(
    state_dict: object, shapes: Mapping[str, Sequence[int]], argument: str = "state_dict"
) -> None:
    """``state_dict`` is a full optimizer state dict (see the module docs) of a model whose
    parameters have the names and shapes of ``shapes``."""
    if (
        not isinstance(state_dict, Mapping)
        or not isinstance(state_dict.get("state"), Mapping)
        or not isinstance(state_dict.get("param_groups"), Sequence)
    ):
        raise TypeError(
            f"{argument}: must be a full optimizer state dict {{'state': ..., 'param_groups': "
            f"...}} keyed by parameter names, got {type(state_dict).__name__}"
        )
    state, groups = state_dict["state"], state_dict["param_groups"]
    listed: dict[str, int] = {}
    for g, group in enumerate(groups):
        params = group.get("params") if isinstance(group, Mapping) else None
        if not isinstance(params, Sequence) or isinstance(params, (str, bytes)):
            raise TypeError(f"{argument}: param_groups[{g}] must be a dict with a 'params' list")
        for name in params:
            if not isinstance(name, str):
                raise ValueError(
                    f"{argument}: param_groups[{g}] lists {name!r}, not a parameter name: this "
                    "is an optimizer's own state_dict(), keyed by indices; give the full one, "
                    "keyed by names (full_optimizer_state_dict / gather_optimizer_state_dict)"
                )
            if name not in shapes:
                raise ValueError(
                    f"{argument}: param_groups[{g}] names parameter {name!r}, which the model "
                    "does not have (a state dict of another model?)"
                )
            if name in listed:
                raise ValueError(
                    f"{argument}: parameter {name!r} is in param_groups[{listed[name]}] and "
                    f"param_groups[{g}]"
                )
            listed[name] = g
    for name, entries in state.items():
        if name not in listed:
            raise ValueError(
                f"{argument}: state[{name!r}] belongs to no param group"
                + ("" if name in shapes else " (the model has no such parameter)")
            )
        if not isinstance(entries, Mapping):
            raise TypeError(f"{argument}: state[{name!r}] must be a dict of the parameter's state")
        for field, value in entries.items():
            if state_kind(value, shapes[name]) == "other":
                raise _not_elementwise(argument, name, field, value.shape, shapes[name])


def local_optimizer_state_dict(
    optimizer: torch.optim.Optimizer,
    state_dict: Mapping[str, Any],
    parts: Mapping[int, tuple[str, Part] | None],
    argument: str = "state_dict",
) -> dict[str, Any]:
    """What ``optimizer.load_state_dict`` takes on this rank: the full (checked)
    ``state_dict``'s state sliced to the parts the optimizer's parameters hold, with the full
    dict's hyperparameters. ``parts`` maps ``id(param)`` to its name and :class:`Part`, or to
    None for a placeholder without state. The slices are copies: stepping the optimizer never
    writes into ``state_dict``."""
    check_optimizer(optimizer, "optimizer")
    full_groups = state_dict["param_groups"]
    if len(full_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"{argument}: has {len(full_groups)} param groups, the optimizer "
            f"{len(optimizer.param_groups)} (build it with the groups it was saved with)"
        )
    full_state = state_dict["state"]
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for g, (full, group) in enumerate(zip(full_groups, optimizer.param_groups, strict=True)):
        names = set(full["params"])
        ids = []
        for p in group["params"]:
            if id(p) not in parts:
                raise ValueError(
                    f"optimizer: param_groups[{g}] holds a tensor of shape {tuple(p.shape)} that "
                    "is not a parameter of the model"
                )
            held = parts[id(p)]
            if held is not None:
                name, part = held
                if name not in names:
                    raise ValueError(
                        f"{argument}: param_groups[{g}] does not list parameter {name!r}, "
                        f"which the optimizer's param group {g} holds"
                    )
                if name in full_state:
                    entries = full_state[name].items()
                    state[index] = {field: _local_value(v, part) for field, v in entries}
            ids.append(index)
            index += 1
        hyper = {k: copy.deepcopy(v) for k, v in full.items() if k != "params"}
        groups.append({**hyper, "params": ids})
    return {"state": state, "param_groups": groups}


def _local_value(value: Any, part: Part) -> Any:
    if isinstance(value, torch.Tensor):
        if tuple(value.shape) == part.shape and value.dim():
            return part.take(value).clone()
        return value.clone()
    return copy.deepcopy(value)
