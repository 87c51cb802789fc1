"""torch.distributed.checkpoint reading a rank's slices by their marks, taught to a torch older
than 2.14.

:class:`~hetcoll.torch.filters.shards.Marks` sets DCP's ``CheckpointableTensor`` fields
(``global_shape``, ``global_offsets``, ``local_offsets``, ``local_sizes``) on the state-dict
tensors a rank holds part of. DCP reads those fields from torch 2.14
(``torch.distributed.checkpoint.protocol``). An older DCP takes a marked slice for a whole
tensor: ``dcp.save`` writes one rank's slice under the unsplit name, silently wrong, and
``dcp.load`` refuses the unsplit tensor's size.

On such a torch, :func:`install` teaches DCP the fields, as torch 2.14 reads them, by wrapping
the four functions of DCP's default planners that look at a tensor's shards: the write items
of a tensor, its chunks, the shard an index names, and the local load plan's size check. Each
wrapper hands every tensor without the fields to torch's own function unchanged. Where one of
those functions is missing (a torch this was not written against), nothing is wrapped and
:func:`install` says so with a warning: saving a split model through DCP is then wrong there.

On every torch, the fields live on the tensors' Python objects, so a copy drops them: the
copies DCP's state-dict functions make keep them (:mod:`.dcp_copies`).
"""

from __future__ import annotations

import functools
import importlib
import warnings
from typing import Any

import torch

#: The DCP modules and the functions of each that are wrapped, by the name each module
#: calls them by (a module that imported a function by name holds its own reference).
_WRAPPED = {
    "planner_helpers": ("_create_write_items", "_create_chunk_list"),
    "default_planner": ("_create_write_items", "create_default_local_load_plan"),
    "format_utils": ("_create_chunk_list",),
    "utils": ("find_tensor_shard",),
}
_installed = False
#: DCP's ``CheckpointableTensor`` fields, in the order
#: :class:`~hetcoll.torch.filters.shards.Marks` gives them.
FIELDS = ("global_shape", "global_offsets", "local_offsets", "local_sizes")
#: The attribute set (True) on the state-dict tensors a rank holds as a copy of tensors
#: another rank writes whole (a plan's replicas after the first, which may cut them
#: otherwise): :class:`~hetcoll.torch.ReplicaSavePlanner` writes them once, from the first.
COPY = "hetcoll_copy"


def needed() -> bool:
    """Whether this torch's DCP lacks the ``CheckpointableTensor`` fields (torch < 2.14)."""
    try:
        importlib.import_module("torch.distributed.checkpoint.protocol")
    except ImportError:
        return True
    return False


def install() -> None:
    """Wrap DCP's shard functions to read the fields, once, where this torch's DCP does not
    (:func:`needed`); a no-op elsewhere and when called again."""
    global _installed
    if _installed or not needed():
        return
    _installed = True
    try:
        modules = {
            name: importlib.import_module(f"torch.distributed.checkpoint.{name}")
            for name in _WRAPPED
        }
    except ImportError as e:  # a torch built without distributed: no DCP to teach
        warnings.warn(f"torch.distributed.checkpoint cannot be imported ({e})", stacklevel=2)
        return
    missing = [
        f"{name}.{f}" for name, fs in _WRAPPED.items() for f in fs if not hasattr(modules[name], f)
    ]
    if missing:
        warnings.warn(
            f"torch {torch.__version__}: torch.distributed.checkpoint has no {missing[0]}, so "
            "hetcoll cannot teach it a split model's slices: dcp.save of such a model would "
            "write one rank's slice for each tensor. Save gather_state_dict(model) instead, "
            "or use torch >= 2.14",
            stacklevel=2,
        )
        return
    wrappers = {
        "_create_write_items": _write_items,
        "_create_chunk_list": _chunk_list,
        "find_tensor_shard": _tensor_shard,
        "create_default_local_load_plan": _local_load_plan,
    }
    for name, fs in _WRAPPED.items():
        for f in fs:
            original = getattr(modules[name], f)
            setattr(modules[name], f, functools.wraps(original)(_bind(wrappers[f], original)))


def _bind(wrapper: Any, original: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        return wrapper(original, *args, **kwargs)

    return call


def _sliced(obj: object) -> bool:
    """Whether ``obj`` is a tensor marked as shards of a larger one."""
    return isinstance(obj, torch.Tensor) and hasattr(obj, "global_offsets")


def _chunks(t: Any) -> list[Any]:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    return [
        ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
        for o, s in zip(t.global_offsets, t.local_sizes, strict=True)
    ]


def _write_items(original: Any, fqn: str, obj: Any) -> Any:
    if not _sliced(obj):
        return original(fqn, obj)
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    properties = TensorProperties.create_from_tensor(obj)
    return [
        WriteItem(
            index=MetadataIndex(fqn, chunk.offsets, i),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=chunk, properties=properties, size=torch.Size(obj.global_shape)
            ),
        )
        for i, chunk in enumerate(_chunks(obj))
    ]


def _chunk_list(original: Any, tensor: Any) -> Any:
    return _chunks(tensor) if _sliced(tensor) else original(tensor)


def _tensor_shard(original: Any, tensor: Any, index: Any) -> Any:
    """The view of ``tensor`` holding the shard ``index`` names (by its global offset), which
    ``dcp.save`` writes and ``dcp.load`` copies into."""
    if not _sliced(tensor):
        return original(tensor, index)
    offsets = [torch.Size(o) for o in tensor.global_offsets]
    if index.offset is None:
        if len(offsets) != 1:
            raise ValueError(f"{index.fqn}: a slice of several shards, looked up without offset")
        k = 0
    elif (
        index.index is not None
        and index.index < len(offsets)
        and offsets[index.index] == (index.offset)
    ):
        k = index.index
    elif index.offset in offsets:
        k = offsets.index(index.offset)
    else:
        raise ValueError(f"{index.fqn}: this rank's slice holds no shard at {index.offset}")
    at, size = tensor.local_offsets[k], tensor.local_sizes[k]
    return tensor[tuple(slice(a, a + n) for a, n in zip(at, size, strict=True))]


def _local_load_plan(original: Any, state_dict: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
    """The load plan of ``state_dict`` with each marked slice checked and read as the unsplit
    tensor it is part of: a stand-in of the unsplit shape (no storage) carries its fields
    through the size check; the plan's reads name shards by their global offsets, and the
    planner resolves them in the real state dict (:func:`_tensor_shard`)."""
    standing = dict(state_dict)
    for fqn, obj in state_dict.items():
        if _sliced(obj):
            stand = torch.empty(obj.global_shape, dtype=obj.dtype, device="meta")
            for field in FIELDS:
                setattr(stand, field, getattr(obj, field))
            standing[fqn] = stand
    return original(standing, *args, **kwargs)
