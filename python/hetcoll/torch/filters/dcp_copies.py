"""The copies torch.distributed.checkpoint's ``get_state_dict`` makes of a split model's state
dicts: those in host memory keep the marks of the slices, and the full ones hold the unsplit
tensors.

Every model and optimizer state dict ``get_state_dict`` (and ``get_model_state_dict``,
``get_optimizer_state_dict``) returns passes through one function of
``torch.distributed.checkpoint.state_dict``, ``_maybe_full_or_cpu_state_dict``, which copies it
as ``StateDictOptions`` ask: into host memory (``cpu_offload=True``) and gathered
(``full_state_dict=True``: torch's own sharded tensors, DTensor and ShardedTensor, made whole).
:func:`keep_through_copies` wraps it, once that module is imported:

- The marks (:mod:`.dcp_fields`' ``FIELDS``, and :data:`~.dcp_fields.COPY`) live on the
  tensors' Python objects, so a copy dropped them and ``dcp.save`` then wrote one rank's slice
  under each name, silently. Each copy gets its tensor's marks.
- A rank's slices are plain tensors to torch, which gave them back as they are where the full
  state was asked for: ``torch.save`` of rank 0's "full" state dict wrote its slices. The
  state dicts of a split model are made whole first (:func:`assembled`): every rank tells the
  others the runs of entries its marked tensors hold, sends them, and builds the unsplit
  tensor of each name it holds part of. Collective over the default group, as DCP's
  ``full_state_dict`` is (with ``cpu_offload`` torch then keeps them on rank 0 alone).

The wrap is made as tensors are marked, which ``get_state_dict`` does before it copies: a
process that never checkpoints does not import DCP's ``state_dict`` module (most of a second).
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from hetcoll.collectives import allgatherv
from hetcoll.comm import allgather_objects, has_default, wrap
from hetcoll.torch.filters.dcp_fields import COPY, FIELDS
from hetcoll.torch.transport import as_bytes, from_bytes

#: The module, and its function, that copies state dicts (into host memory, or gathered),
#: model's and optimizer's alike.
STATE_DICT_MODULE = "torch.distributed.checkpoint.state_dict"
_COPYING = "_maybe_full_or_cpu_state_dict"
_copies_marked = False
#: The modules alive whose tensors are marked (given by :func:`keep_through_copies`): a
#: state dict of a model holding any of their parameters is a split model's.
_split_modules: Callable[[], Iterable[nn.Module]] = tuple


def keep_through_copies(split_modules: Callable[[], Iterable[nn.Module]]) -> None:
    """Wrap DCP's copying of state dicts (see the module docs), once, where its module is
    imported (a no-op otherwise, and when called again): called on every marking.
    ``split_modules()``: the modules alive holding marked slices."""
    global _copies_marked, _split_modules
    _split_modules = split_modules
    if _copies_marked:
        return
    module = sys.modules.get(STATE_DICT_MODULE)
    if module is None:
        return
    _copies_marked = True
    original = getattr(module, _COPYING, None)
    if original is None:
        warnings.warn(
            f"torch {torch.__version__}: torch.distributed.checkpoint.state_dict has no "
            f"{_COPYING}, so a split model's state dict copied by get_state_dict "
            "(cpu_offload=True on a GPU) loses the marks of its slices, and dcp.save would "
            "write one rank's slice for each tensor (save without cpu_offload there), and "
            "full_state_dict=True gives each rank's slices (gather_state_dict gives the "
            "unsplit state)",
            stacklevel=2,
        )
        return

    @functools.wraps(original)
    def copy(state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        info = args[0] if args else kwargs.get("info")
        if getattr(info, "full_state_dict", False) and _of_split_model(info):
            # torch keeps the full state of an offload on rank 0 alone ("to prevent CPU OOM"):
            # the unsplit tensors are made there only, in host memory.
            offload = bool(getattr(info, "cpu_offload", False))
            dst = 0 if offload and torch.distributed.is_initialized() else None
            return original(assembled(state_dict, dst, offload), *args, **kwargs)
        copied = original(state_dict, *args, **kwargs)
        if copied is not state_dict:
            _carry_fields(state_dict, copied)
        return copied

    setattr(module, _COPYING, copy)


def _of_split_model(info: Any) -> bool:
    """Whether DCP's state-dict call ``info`` is of a model holding a split module's
    parameters (every rank of a split model holds some: a rank of a plan holding none has
    its placeholder), from the parameters it maps to their names."""
    held = {id(p) for m in _split_modules() for p in m.parameters()}
    mapping = getattr(info, "fqn_param_mapping", {})
    return any(isinstance(k, torch.Tensor) and id(k) in held for k in mapping)


def _carry_fields(source: Any, copy: Any) -> None:
    """Set the fields (and :data:`COPY`) of each tensor of ``source`` (a state dict: dicts,
    lists and tuples of tensors) that has them on the tensor in the same place of its copy
    ``copy``, where that is another tensor of the same shape (a rank left out of the copy
    gets nothing)."""
    if isinstance(source, torch.Tensor):
        if isinstance(copy, torch.Tensor) and copy is not source and copy.shape == source.shape:
            for field in (*FIELDS, COPY):
                if hasattr(source, field):
                    setattr(copy, field, getattr(source, field))
    elif isinstance(source, dict) and isinstance(copy, dict):
        for key, value in source.items():
            if key in copy:
                _carry_fields(value, copy[key])
    elif (
        isinstance(source, (list, tuple))
        and isinstance(copy, (list, tuple))
        and len(source) == len(copy)
    ):
        for a, b in zip(source, copy, strict=True):
            _carry_fields(a, b)


# -- full state dicts: the unsplit tensors, from every rank's marked runs -------------------------

#: A run of a marked tensor's entries: (its offsets in the unsplit tensor, in the rank's
#: tensor, and its sizes), as DCP's fields give them.
Run = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def _marks(t: torch.Tensor) -> tuple[tuple[int, ...], list[Run]]:
    """The unsplit shape marked tensor ``t`` is part of, and its runs."""
    shape, offsets, local, sizes = (getattr(t, field) for field in FIELDS)
    runs = [(tuple(g), tuple(lo), tuple(n)) for g, lo, n in zip(offsets, local, sizes, strict=True)]
    return tuple(shape), runs


def _part(t: torch.Tensor) -> bool:
    """Whether ``t`` is marked as anything but the whole tensor in its own order."""
    if not hasattr(t, "global_offsets"):
        return False
    shape = tuple(t.shape)
    whole = (tuple(0 for _ in shape), tuple(0 for _ in shape), shape)
    return _marks(t) != (shape, [whole])


def _parts(obj: Any, path: tuple[Any, ...] = ()) -> Iterable[tuple[tuple[Any, ...], torch.Tensor]]:
    """Every marked part (:func:`_part`) in state dict ``obj``, with its path of keys."""
    if isinstance(obj, torch.Tensor):
        if _part(obj):
            yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _parts(v, (*path, k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _parts(v, (*path, i))


def _at(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(a, a + n) for a, n in zip(offsets, sizes, strict=True))


def assembled(state_dict: Any, dst: int | None = None, on_host: bool = False) -> Any:
    """``state_dict`` (a model's or an optimizer's, as DCP's ``get_state_dict`` gives them)
    with each marked slice this rank holds replaced by the unsplit tensor (on the slice's
    device, or ``on_host``); an empty slice of a tensor no rank holds part of (the placeholder
    of a plan's rank that holds no parameter, named as the model's first) stays. Collective
    over the default group: every rank calls it, those holding no slice too. ``dst``: the
    rank of that group that alone needs the result (the others send their slices and get
    ``state_dict`` back), or None: every rank.

    Entries several ranks hold (replicas, the key and value of multi-query attention every
    rank of its split holds) are taken from the lowest rank, a replica's copy
    (:data:`COPY`) last, so every rank builds the same tensor. Ranks disagreeing on a name's
    unsplit shape or dtype raise ``ValueError`` on every rank."""
    parts = list(_parts(state_dict))
    if not has_default():
        if parts:
            raise ValueError(
                "state_dict: a split model's full state dict (StateDictOptions(full_state_dict="
                "True)) is gathered over the default group, and there is none (neither "
                "torch.distributed's nor an MPI job's): use gather_state_dict"
            )
        return state_dict
    comm = wrap(None)
    mine = [(path, *_marks(t), t.dtype, bool(getattr(t, COPY, False))) for path, t in parts]
    told = allgather_objects(comm, mine)
    shapes: dict[tuple[Any, ...], tuple[tuple[int, ...], torch.dtype]] = {}
    for q, held in enumerate(told):
        for path, shape, _, dtype, _ in held:
            seen = shapes.setdefault(path, (shape, dtype))
            if seen != (shape, dtype):
                raise ValueError(
                    f"state_dict: {'.'.join(map(str, path))} is a slice of a {seen[1]} tensor of "
                    f"shape {seen[0]} on one rank and of a {dtype} tensor of shape {shape} on "
                    f"rank {q}: the ranks hold different models under one name"
                )
    local = [as_bytes(t[_at(lo, n)]) for _, t in parts for _, lo, n in _marks(t)[1]]
    send = torch.cat(local) if local else torch.empty(0, dtype=torch.uint8)
    if dst is None:
        received = allgatherv(send, comm)
    else:
        counts = [sum(_numel(n) * d.itemsize for _, _, r, d, _ in h for *_, n in r) for h in told]
        received = torch.empty(sum(counts) if comm.rank == dst else 0, dtype=torch.uint8)
        comm.ialltoallv(
            send.numpy(),
            [send.numel() if q == dst else 0 for q in range(comm.size)],
            received.numpy(),
            counts if comm.rank == dst else [0] * comm.size,
        ).wait(None)
        if comm.rank != dst:
            return state_dict
    # Every rank's runs, by name, in the order they are written (the last write wins: a
    # replica's copies first, then from the highest rank to the lowest).
    writes: dict[tuple[Any, ...], list[tuple[bool, int, Run, torch.Tensor]]] = {}
    at = 0
    for q, held in enumerate(told):
        for path, _, runs, dtype, copied in held:
            for run in runs:
                size = _numel(run[2]) * dtype.itemsize
                writes.setdefault(path, []).append((copied, q, run, received[at : at + size]))
                at += size
    full: dict[tuple[Any, ...], torch.Tensor] = {}
    for path, t in parts:
        shape = _marks(t)[0]
        out = torch.empty(shape, dtype=t.dtype)
        written = torch.zeros(shape, dtype=torch.bool)
        for _, _, (g, _, n), raw in sorted(writes.get(path, []), key=lambda w: (not w[0], -w[1])):
            out[_at(g, n)] = from_bytes(raw, t.dtype, n)
            written[_at(g, n)] = True
        if bool(written.all()):
            full[path] = out if on_host else out.to(t.device)
        elif t.numel() == 0:  # a placeholder: this rank holds none of that tensor
            full[path] = t
        else:
            raise ValueError(
                f"state_dict: entries of {'.'.join(map(str, path))} are held by no rank: a "
                "split model's full state dict is gathered over the default group, so every "
                "rank of it calls get_state_dict"
            )
    above = {path[:k] for path in full for k in range(len(path))}
    return _replaced(state_dict, (), full, above)


def _numel(sizes: tuple[int, ...]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def _replaced(
    obj: Any, path: tuple[Any, ...], full: dict[tuple[Any, ...], Any], above: set[tuple[Any, ...]]
) -> Any:
    """``obj`` with the tensor at each path of ``full`` replaced; the dicts and lists on those
    paths (``above``) are new, the rest shared."""
    if path in full:
        return full[path]
    if path not in above:
        return obj
    if isinstance(obj, dict):
        return {k: _replaced(v, (*path, k), full, above) for k, v in obj.items()}
    return type(obj)(_replaced(v, (*path, i), full, above) for i, v in enumerate(obj))
