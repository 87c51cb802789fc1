"""A rank's slices of a split model as torch.distributed.checkpoint's shards of the unsplit
model's tensors.

A tensor a rank holds part of (a split layer's weight, an owners stage's channels, the
optimizer state shaped as either) is marked, in the state dicts that hold it, with where its
entries sit in the unsplit tensor: the fields of DCP's ``CheckpointableTensor``
(``global_shape``, and per run of entries its ``global_offsets``, ``local_offsets`` and
``local_sizes``; :class:`Marks`). ``dcp.save`` then writes every rank's runs as shards of one
unsplit tensor, and ``dcp.load`` reads into any other split (other ranks, other speeds) the
entries each rank's runs hold. A marked slice loaded where it was not cut for (``torch.save``
keeps the fields) is refused.

Modules holding such slices register here (:func:`register_marking`) and say, for each of
their tensors, its :class:`Marks` (``param_marks()``). Model state dicts are marked by those
modules; an optimizer holding marked parameters is given a state-dict post-hook (marking its
state) and a load pre-hook (checking it, and slicing the unsplit state DCP's
``full_state_dict`` loads hand it) once, at its first step (torch's global
``register_optimizer_step_pre_hook``, registered by :func:`track_optimizers`; DCP's
``get_state_dict`` steps a fresh optimizer first), where DCP's state-dict functions first
meet it (one whose state exists before any step, Adagrad's, is not stepped there), or where
hetcoll loads state into it (:func:`hook_optimizer`).
"""

from __future__ import annotations

import functools
import sys
import types
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from hetcoll.torch.filters import dcp_copies, dcp_fields


@dataclass(frozen=True)
class Marks:
    """Where a rank's tensor sits in the unsplit one along dimension ``dim`` (of ``length``
    entries there): ``runs`` of ``(start in the unsplit tensor, start in the rank's,
    count)``, in the rank's order."""

    dim: int
    runs: tuple[tuple[int, int, int], ...]
    length: int

    @staticmethod
    def of_index(dim: int, index: list[int], length: int) -> Marks:
        """The marks of a tensor holding the unsplit tensor's entries ``index`` (in that
        order) along ``dim``: consecutive entries are one run."""
        runs: list[list[int]] = []
        for at, i in enumerate(index):
            if runs and runs[-1][0] + runs[-1][2] == i:
                runs[-1][2] += 1
            else:
                runs.append([i, at, 1])
        return Marks(dim, tuple((a, b, n) for a, b, n in runs), length)

    def fits(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is shaped as the rank's slice along :attr:`dim`."""
        return t.dim() > self.dim and sum(n for _, _, n in self.runs) == t.shape[self.dim]

    def fields(self, shape: tuple[int, ...]) -> dict[str, tuple[Any, ...]]:
        """The ``CheckpointableTensor`` fields of a slice of ``shape``."""
        return dict(_fields(self, shape))

    def mark(self, t: torch.Tensor) -> bool:
        """Set the fields on ``t``; False, marking nothing, where ``t`` is not shaped as the
        rank's slice."""
        if not self.fits(t):
            return False
        _on_marking()
        for field, value in self.fields(tuple(t.shape)).items():
            setattr(t, field, value)
        return True

    def holds(self, t: torch.Tensor) -> bool:
        """Whether marked ``t`` is a slice cut as this one (or a whole tensor, whose marks
        say it holds everything)."""
        if hasattr(t, "global_shape") and not is_slice(t):
            return True
        mine = self.fields(tuple(t.shape)) if self.fits(t) else None
        return mine is not None and all(getattr(t, f, None) == v for f, v in mine.items())

    def loaded(self, argument: str, key: str, t: torch.Tensor) -> torch.Tensor:
        """``t``, entry ``key`` of ``argument`` being loaded, as the loader keeps it: refused
        (:meth:`refuse`) where its marks say another rank's or split's slice, and unmarked (a
        detached alias: ``load_state_dict(assign=True)`` and optimizers keep what they load)."""
        if not hasattr(t, "global_offsets"):
            return t
        if not self.holds(t):
            raise self.refuse(argument, key, t)
        return t.detach()

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the unsplit ``full`` (empty where it holds none)."""
        parts = [full.narrow(self.dim, a, n) for a, _, n in self.runs]
        if not parts:
            return full.narrow(self.dim, 0, 0)
        return parts[0] if len(parts) == 1 else torch.cat(parts, self.dim)

    def refuse(self, argument: str, key: str, t: torch.Tensor) -> ValueError:
        """The error for marked ``t``, entry ``key`` of ``argument``, cut elsewhere."""
        d = self.dim
        offsets, sizes = getattr(t, "global_offsets", ()), getattr(t, "local_sizes", ())
        saved = [(o[d], o[d] + s[d]) for o, s in zip(offsets, sizes)]
        held = [(a, a + n) for a, _, n in self.runs]
        return ValueError(
            f"{argument}: {key} is a slice a split model saved (entries {saved} along dim {d} "
            f"of {tuple(getattr(t, 'global_shape', ()))}), and this rank holds {held} of the "
            "unsplit tensor: it was cut for another rank or split. Save the unsplit state "
            "(gather_state_dict, gather_optimizer_state_dict) and load it with "
            "load_full_state_dict / load_full_optimizer_state_dict, or save and load through "
            "torch.distributed.checkpoint (dcp.save and dcp.load of get_state_dict(model, "
            "optimizer)), which reads each rank's entries whatever split saved them"
        )


def is_slice(t: torch.Tensor) -> bool:
    """Whether ``t`` is marked as a slice: its marks name an unsplit tensor of another
    shape (a whole tensor's marks name its own)."""
    return hasattr(t, "global_shape") and tuple(t.global_shape) != tuple(t.shape)


def guard_save_pretrained(model: Any) -> None:
    """Make a split Hugging Face model's ``save_pretrained`` refuse a state dict of slices
    (its own, which it takes by default, or one passed holding marked slices): it would
    write this rank's slices under the unsplit names, and safetensors keeps no marks. A
    gathered state dict (``gather_state_dict``) saves as the unsplit model's."""
    if callable(getattr(type(model), "save_pretrained", None)):
        # Bound on the instance (deepcopy binds it to the copy), by a module-level function
        # (pickle finds it); the class's own method is what it calls.
        model.save_pretrained = types.MethodType(_save_pretrained_unsplit, model)


def _save_pretrained_unsplit(model: Any, *args: Any, **kwargs: Any) -> Any:
    state = kwargs.get("state_dict")
    sliced = [
        k
        for k, t in (model.state_dict() if state is None else state).items()
        if isinstance(t, torch.Tensor) and is_slice(t)
    ]
    if sliced:
        raise ValueError(
            f"save_pretrained: the model is split over ranks, and its state dict holds this "
            f"rank's slices ({sliced[0]!r}, ...), which would be written as the unsplit "
            "tensors; pass state_dict=gather_state_dict(model, dst=0) (collective: every rank "
            "calls it) and save on rank 0, or save through torch.distributed.checkpoint"
        )
    return type(model).save_pretrained(model, *args, **kwargs)


@functools.lru_cache(maxsize=4096)
def _fields(marks: Marks, shape: tuple[int, ...]) -> tuple[tuple[str, tuple[Any, ...]], ...]:
    """:meth:`Marks.fields`, kept: every state dict of a split asks again."""
    d, nd = marks.dim, len(shape)
    full = tuple(marks.length if k == d else s for k, s in enumerate(shape))
    values = (
        full,
        tuple(_at(nd, d, a) for a, _, _ in marks.runs),
        tuple(_at(nd, d, b) for _, b, _ in marks.runs),
        tuple(tuple(n if k == d else s for k, s in enumerate(shape)) for _, _, n in marks.runs),
    )
    return tuple(zip(dcp_fields.FIELDS, values, strict=True))


def _at(ndim: int, dim: int, value: int) -> tuple[int, ...]:
    """A coordinate of ``ndim`` dimensions: ``value`` along ``dim``, 0 along the others."""
    return tuple(value if k == dim else 0 for k in range(ndim))


class Marking(Protocol):
    """A module holding slices: each of its sliced tensors with its marks. It may also say
    which of its parameters it holds as copies of what another rank writes
    (``param_copies() -> list[Tensor]``: a plan's replicas after the first)."""

    def param_marks(self) -> list[tuple[torch.Tensor, Marks]]: ...


#: The flag of a replica's copies (:data:`~hetcoll.torch.filters.dcp_fields.COPY`, defined
#: beside DCP's fields, whose copies keep it too).
COPY = dcp_fields.COPY


def flag_copy(t: torch.Tensor) -> None:
    """Flag state-dict tensor ``t`` as a copy of a tensor another rank writes (:data:`COPY`)."""
    _on_marking()
    setattr(t, COPY, True)


def _on_marking(*_: Any) -> None:
    """What a state dict of a split module (the model's or its optimizer's) and marking its
    tensors do first, once DCP's ``state_dict`` module is imported (``get_state_dict`` makes
    them before it copies anything or meets an optimizer): DCP's copies keep the marks, its
    full copies are made whole (:mod:`.dcp_copies`), and its optimizers are hooked as it meets
    them. On every rank of a split, those that mark nothing too (a plan's rank holding whole
    tensors): the full copies are made whole together."""
    dcp_copies.keep_through_copies(_marking_modules)
    _hook_where_dcp_meets_optimizers()


def _marking_modules() -> list[Any]:
    return list(_MARKING)


#: The function of DCP's ``state_dict`` module that meets each optimizer first, in
#: ``get_state_dict`` and ``set_state_dict`` alike (stepping a fresh one whose state is empty).
_MEETS = "_init_optim_state"
_meeting_hooked = False


def _hook_where_dcp_meets_optimizers() -> None:
    """Hook each optimizer DCP meets (:func:`hook_optimizer`) before it reads the state: one
    whose state exists before any step (Adagrad's sums) is never stepped there, so its state
    went unmarked, and ``dcp.load`` refused the unsplit state's size. Once, where the module
    is imported."""
    global _meeting_hooked
    module = sys.modules.get(dcp_copies.STATE_DICT_MODULE)
    if _meeting_hooked or module is None:
        return
    _meeting_hooked = True
    original = getattr(module, _MEETS, None)
    if original is None:  # optimizers are hooked at their first step still
        return

    @functools.wraps(original)
    def meet(optim: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        hook_optimizer(optim)
        return original(optim, *args, **kwargs)

    setattr(module, _MEETS, meet)


#: Every module alive holding marked slices (split modules, owners stages), weakly.
_MARKING: weakref.WeakSet[Any] = weakref.WeakSet()
#: Each optimizer already given its hooks.
_HOOKED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_HOOK: Any = None


#: Counts the registrations (a split made or changed): what each optimizer's marked
#: parameters were found under (:func:`_held`).
_GENERATION = 0
#: Each optimizer's marked parameters, with the generation and parameters they were found for.
_HELD: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[Any, Any]] = (
    weakref.WeakKeyDictionary()
)


def register_marking(module: Marking) -> None:
    """Count ``module`` among those whose tensors are marked (its optimizer state too); a
    split module registers again whenever its split changes."""
    global _GENERATION
    dcp_fields.install()  # a torch older than 2.14: DCP is taught the marks
    if module not in _MARKING and isinstance(module, nn.Module):
        module.register_state_dict_pre_hook(_on_marking)
    _MARKING.add(module)
    _GENERATION += 1
    _on_marking()


def track_optimizers() -> None:
    """Give every optimizer, at its next step, the hooks that mark its state of marked
    parameters (once; called by the splits: :func:`~hetcoll.torch.filter_parallel`,
    :func:`~hetcoll.torch.expert_parallel`, :func:`~hetcoll.torch.parallelize`)."""
    global _HOOK
    if _HOOK is None:
        _HOOK = register_optimizer_step_pre_hook(_on_step)


def _on_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    hook_optimizer(optimizer)


def hook_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Give ``optimizer`` the hooks that mark its state, once (at its first step, or where
    hetcoll loads state into it before any step). Its state then is checked: state another
    rank saved, loaded by ``load_state_dict`` before the optimizer had its hooks, raises
    here, before any step trains with it."""
    if optimizer in _HOOKED:
        return
    held = _held(optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, (_, marks) in held.items():
        for field, v in optimizer.state.get(params[i], {}).items():
            if isinstance(v, torch.Tensor):
                marks.loaded("optimizer", f"state[{i}][{field!r}]", v)
    _HOOKED.add(optimizer)
    optimizer.register_state_dict_post_hook(_mark_state)
    optimizer.register_load_state_dict_pre_hook(_check_state)


def _held(optimizer: torch.optim.Optimizer) -> dict[int, tuple[torch.Tensor, Marks]]:
    """The optimizer's marked parameters by their index in its state dict, with their marks."""
    return _scan(optimizer)[0]


def _scan(
    optimizer: torch.optim.Optimizer,
) -> tuple[dict[int, tuple[torch.Tensor, Marks]], frozenset[int]]:
    """:func:`_held`, and the indices of the parameters this rank holds as copies of what
    another rank writes (:data:`COPY`); found again only when a split changed or the
    optimizer holds other parameters: every state dict of every optimizer asks."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    key = (_GENERATION, tuple(id(p) for p in params))
    cached = _HELD.get(optimizer)
    if cached is not None and cached[0] == key:
        return cached[1]
    marked: dict[int, tuple[torch.Tensor, Marks]] = {}
    copies: dict[int, torch.Tensor] = {}
    for m in list(_MARKING):
        for p, marks in m.param_marks():
            marked[id(p)] = (p, marks)
        for p in getattr(m, "param_copies", list)():
            copies[id(p)] = p
    held = {
        i: marked[id(p)] for i, p in enumerate(params) if id(p) in marked and marked[id(p)][0] is p
    }
    copied = frozenset(i for i, p in enumerate(params) if copies.get(id(p)) is p)
    _HELD[optimizer] = (key, (held, copied))
    return held, copied


def _keys(state_dict: dict[str, Any]) -> list[Any]:
    """The keys of ``state_dict``'s ``state`` by parameter position: its param groups' entries
    in order (indices in an optimizer's own, names where DCP's ``set_optimizer_state_dict``
    hands them by name)."""
    groups = state_dict.get("param_groups", [])
    return [k for g in groups if isinstance(g, dict) for k in g.get("params", [])]


def _mark_state(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """The state dict with each marked parameter's state shaped as it marked, and the state
    of parameters held as copies flagged (:data:`COPY`): fresh views of the tensors (the
    optimizer's own keep no marks), which ``dcp.load`` writes in place. State of other shapes
    (a step count, Adafactor's factored statistics) is left unmarked."""
    _on_marking()
    state, keys = state_dict.get("state", {}), _keys(state_dict)
    held, copies = _scan(optimizer)
    for i in sorted(held.keys() | copies):
        entries = state.get(keys[i]) if i < len(keys) else None
        if not isinstance(entries, dict):
            continue
        out = dict(entries)  # the optimizer's own dict is in the state dict: not changed
        for field, v in entries.items():
            shaped = i in held and isinstance(v, torch.Tensor) and v.shape == held[i][0].shape
            if not shaped and not (i in copies and isinstance(v, torch.Tensor)):
                continue
            view = v.detach().view_as(v)
            if shaped and not held[i][1].mark(view) and i not in copies:
                continue
            if i in copies:
                flag_copy(view)
            out[field] = view
        state[keys[i]] = out
    return state_dict


def _check_groups(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """Refuse param groups without a learning rate (every optimizer's groups hold one): DCP's
    state dict of a model whose ranks hold different parameters (a plan's pipeline), saved
    or loaded without ``flatten_optimizer_state_dict``, gives all but one rank's groups none,
    and the optimizer would fail only at its first step, on those ranks alone."""
    for k, group in enumerate(state_dict.get("param_groups", [])):
        if isinstance(group, dict) and "lr" not in group and "lr" in optimizer.defaults:
            raise ValueError(
                f"optimizer state_dict: param_groups[{k}] holds no hyperparameters (no 'lr'): "
                "torch.distributed.checkpoint of a model whose ranks hold different parameters "
                "(a plan's pipeline stages) needs StateDictOptions("
                "flatten_optimizer_state_dict=True) in get_state_dict and set_state_dict"
            )


def _check_state(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Refuse marked state that is not this rank's slice (another rank's has this rank's
    shape on an even split), and take this rank's slice of unmarked state shaped as the
    unsplit parameter (DCP's ``set_optimizer_state_dict`` with ``full_state_dict``)."""
    _check_groups(optimizer, state_dict)
    state, keys = state_dict.get("state", {}), _keys(state_dict)
    out = dict(state)
    for i, (p, marks) in _held(optimizer).items():
        entries = state.get(keys[i]) if i < len(keys) else None
        if not isinstance(entries, dict):
            continue
        full_shape = marks.fields(tuple(p.shape))["global_shape"] if marks.fits(p) else None
        sliced = dict(entries)
        for field, v in entries.items():
            if not isinstance(v, torch.Tensor):
                continue
            key = f"state[{keys[i]!r}][{field!r}]"
            sliced[field] = v = marks.loaded("optimizer state_dict", key, v)
            # DCP's full state (keyed by names) is the unsplit model's: this rank's slice. An
            # optimizer's own (keyed by index) is its rank's, whatever shapes it holds.
            if isinstance(keys[i], str) and tuple(v.shape) == full_shape and v.shape != p.shape:
                sliced[field] = marks.take(v)
        out[keys[i]] = sliced
    return {**state_dict, "state": out}
