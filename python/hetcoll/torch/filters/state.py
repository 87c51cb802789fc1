"""The state of a split model: its state dict, gradients and optimizer state gathered into the
unsplit model's (one exchange of every slice, to every rank or to the one that keeps it), and
the unsplit model's loaded back into any split of it (a checkpoint that resumes on other ranks
or speeds)."""

from __future__ import annotations

import copy
import math
import zlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hetcoll.comm import Communicator, agree
from hetcoll.torch.filters.checks import check_module, is_int
from hetcoll.torch.filters.layers import ChannelSplit, split_comms, split_runs, whole_positions
from hetcoll.torch.filters.shards import hook_optimizer
from hetcoll.torch.state_dicts import (
    Part,
    check_full_optimizer_state_dict,
    check_full_state_dict,
    check_optimizer,
    local_optimizer_state_dict,
    named_optimizer_state,
    state_kind,
)
from hetcoll.torch.transport import CountingCommunicator, from_bytes


def _gather(
    model: nn.Module, values: dict[str, torch.Tensor], dst: int | None, argument: str
) -> dict[str, torch.Tensor] | None:
    """Full tensors from ``values`` (keys as in ``model.state_dict()``), split ones gathered.

    Every rank's slices travel in one allgatherv of bytes (to rank ``dst`` alone where given:
    an all-to-all whose only receiver is ``dst``): the shares say how long each rank's piece of
    each tensor is, so no sizes need exchanging first.
    """
    split: dict[str, tuple[ChannelSplit, int, tuple[int, ...], tuple[int, ...]]] = {}
    for mname, m in model.named_modules():
        if isinstance(m, ChannelSplit):
            whole_of = m.whole_spec()
            for pname, (dim, blocks) in m.split_spec().items():
                key = f"{mname}.{pname}" if mname else pname
                split[key] = (m, dim, blocks, whole_of.get(pname, ()))
    comms = {id(m.comm): m.comm for m, *_ in split.values()}
    if len(comms) > 1:
        raise ValueError(f"{argument}: split modules on different process groups")
    found = next(iter(comms.values()), None)
    comm = None if found is None else CountingCommunicator.uncounted(found)  # not a step's
    size = comm.size if comm is not None else 1
    if dst is not None and (not is_int(dst) or not 0 <= dst < size):
        raise ValueError(f"dst: must be a rank in [0, {size}) or None, got {dst!r}")
    keep = comm is None or dst is None or comm.rank == dst
    # (key, dim, rows per rank, rows per rank of each block (its split ones, then those every
    # rank holds), row shape, dtype, bytes per row, the entries' rank order where not runs)
    pieces = []
    local = []
    for key, t in values.items():
        if key in split:
            m, dim, blocks, whole = split[key]
            moved = t.detach().cpu().movedim(dim, 0).contiguous()
            row = moved.shape[1:]
            row_bytes = math.prod(row) * moved.element_size()  # a rank may hold no rows
            kept: tuple[int, ...] = whole or (0,) * len(blocks)
            per_block = [
                [n for w, k in zip(blocks, kept, strict=True) for n in (s * w, k)] for s in m.shares
            ]
            rows = [sum(b) for b in per_block]
            pieces.append((key, dim, rows, per_block, row, t.dtype, row_bytes, m.order))
            local.append(moved.reshape(-1).view(torch.uint8))
    full: dict[str, torch.Tensor] = {}
    if comm is not None and pieces:
        per_rank = [sum(rows[r] * rb for _, _, rows, _, _, _, rb, _ in pieces) for r in range(size)]
        send = torch.cat(local).numpy()
        out = torch.empty(sum(per_rank) if keep else 0, dtype=torch.uint8)
        if dst is None:
            comm.iallgatherv(send, out.numpy(), per_rank).wait(None)
        else:  # to rank dst alone: the others neither receive nor hold the whole model
            to_dst = [send.size if q == dst else 0 for q in range(size)]
            comm.ialltoallv(send, to_dst, out.numpy(), per_rank if keep else [0] * size).wait(None)
        if keep:
            start = [sum(per_rank[:r]) for r in range(size)]
            for key, dim, rows, per_block, row, dtype, rb, out_of_order in pieces:
                held = []
                for r in range(size):
                    n = rows[r] * rb
                    held.append(from_bytes(out[start[r] : start[r] + n], dtype, (rows[r], *row)))
                    start[r] += n
                # Each rank's piece holds its entries of every block (packed q/k/v), then the
                # block's entries every rank holds: the full tensor is block by block, rank
                # by rank within a block, then those entries (rank 0's).
                joined = [h.split(per_block[r]) for r, h in enumerate(held)]
                order = [
                    joined[r][b]
                    for b in range(len(per_block[0]))
                    for r in (range(size) if b % 2 == 0 else [0])
                ]
                joined_rows = torch.cat(order)
                if out_of_order is not None:  # each rank's entries where the unsplit has them
                    placed = torch.empty_like(joined_rows)
                    placed[torch.tensor(out_of_order, dtype=torch.long)] = joined_rows
                    joined_rows = placed
                full[key] = joined_rows.movedim(0, dim).contiguous()
    if not keep:
        return None
    # Every tensor on the CPU, as documented: the unsplit ones copied off the rank's device too.
    return {k: full[k] if k in full else t.detach().to("cpu", copy=True) for k, t in values.items()}


def split_tensors(model: nn.Module) -> dict[str, tuple[torch.Tensor, Part]]:
    """This rank's slices of split parameters and buffers: ``{name: (tensor, part)}``, the
    :class:`~hetcoll.torch.state_dicts.Part` saying where the tensor sits in the full one
    (entries ``start ..`` along ``dim``, or the entries ``index`` along it for whole heads of
    a packed query/key/value layer); names as in ``model.state_dict()``. Tensors that are not
    split are left out: they are whole on every rank.

    >>> split_tensors(nn.Linear(2, 2))
    {}
    """
    state = model.state_dict(keep_vars=True)
    return {k: (state[k], p) for k, p in _parts(model).items() if not p.whole}


def gather_state_dict(model: nn.Module, *, dst: int | None = 0) -> dict[str, torch.Tensor] | None:
    """The state dict of the unsplit model: split parameters and buffers gathered from every
    rank; keys as in the original model. Returned on rank ``dst`` (None elsewhere; a rank of
    the split's group, as torch's ``group_dst``), or on every rank with ``dst=None``. Every
    rank must call it (one exchange of all the slices; gathered
    tensors are on the CPU).

    >>> full = gather_state_dict(model)  # doctest: +SKIP
    >>> unsplit.load_state_dict(full)  # on rank 0  # doctest: +SKIP
    """
    check_module(model)
    return _gather(model, model.state_dict(), dst, "model")


def gather_gradients(model: nn.Module, *, dst: int | None = 0) -> dict[str, torch.Tensor] | None:
    """``{name: full gradient}`` for every parameter with a gradient, split ones gathered (as
    :func:`gather_state_dict`). For checking against the unsplit model.

    >>> grads = gather_gradients(model, dst=None)  # doctest: +SKIP
    """
    check_module(model)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return _gather(model, grads, dst, "model")


# -- checkpoints: the unsplit model's state, and back into any split ------------------------------


def _parts(model: nn.Module) -> dict[str, Part]:
    """Every state-dict entry of ``model`` by name: where this rank's tensor sits in the
    unsplit model's (a channel slice for split ones, the whole tensor otherwise)."""
    state = model.state_dict(keep_vars=True)
    parts = {k: Part(tuple(t.shape)) for k, t in state.items()}
    for mname, m in model.named_modules():
        if isinstance(m, ChannelSplit):
            prefix = f"{mname}." if mname else ""
            local = {pname: state[prefix + pname] for pname in m.split_spec()}
            for pname, part in split_parts(m, local).items():
                parts[prefix + pname] = part
    return parts


def split_parts(m: ChannelSplit, local: Mapping[str, torch.Tensor]) -> dict[str, Part]:
    """Where each of split module ``m``'s split tensors given in ``local`` (by their names in
    ``m``) sits in the unsplit tensor: a channel slice, or the entries ``index`` (with
    ``written`` where the split's rank 0 alone writes the entries every rank holds)."""
    parts = {}
    kept = m.whole_spec()
    for pname, (dim, blocks) in m.split_spec().items():
        if pname not in local:
            continue
        shape = list(local[pname].shape)
        whole = kept.get(pname, ())
        shape[dim] = sum(m.shares) * sum(blocks) + sum(whole)
        if m.order is not None:  # entries held out of order: one block, none whole
            parts[pname] = Part(tuple(shape), dim, index=m.held_index())
        elif len(blocks) == 1 and not whole:
            count = int(local[pname].shape[dim])
            parts[pname] = Part(tuple(shape), dim, m.offset * blocks[0], count)
        else:
            runs = split_runs(m.shares, m.rank, blocks, whole)
            index = torch.cat([torch.arange(a, a + n) for a, n in runs])
            # Entries every rank holds are written by the split's rank 0 alone.
            written = None
            if whole and m.rank != 0:
                mine = torch.ones(len(index), dtype=torch.bool)
                mine[whole_positions(m.shares, m.rank, blocks, whole)] = False
                written = torch.nonzero(mine).flatten()
            parts[pname] = Part(tuple(shape), dim, index=index, written=written)
    return parts


def _split_comm(model: nn.Module) -> Communicator | None:
    comms = {id(c): CountingCommunicator.uncounted(c) for c in split_comms(model)}
    if len(comms) > 1:
        raise ValueError("model: split modules on different process groups")
    return next(iter(comms.values()), None)


def gather_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, dst: int | None = 0
) -> dict[str, Any] | None:
    """The unsplit model's optimizer state: ``optimizer``'s state with every split tensor
    gathered from the ranks (SGD's momentum, Adam's moments: state shaped as its parameter is
    split as the parameter is), keyed by the parameter names of the original model, as
    torch.distributed.checkpoint's full optimizer state dict and FSDP's
    ``full_optim_state_dict`` are: ``{"state": {name: {...}}, "param_groups": [{..., "params":
    [names]}]}`` (:mod:`hetcoll.torch.state_dicts`). Returned on rank ``dst`` (None elsewhere),
    or on every rank with ``dst=None``. Collective, as :func:`gather_state_dict`: every rank
    calls it with its optimizer over ``model.parameters()``; ranks whose optimizer state
    differs in layout raise :class:`hetcoll.CollectiveMismatchError`, all of them.
    :func:`load_full_optimizer_state_dict` loads the result into any split of the model.

    >>> full = gather_optimizer_state_dict(model, opt, dst=None)  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: must be a torch.nn.Module, got {type(model).__name__}")
    comm = _split_comm(model)
    size = comm.size if comm is not None else 1
    if dst is not None and (not is_int(dst) or not 0 <= dst < size):
        raise ValueError(f"dst: must be a rank in [0, {size}) or None, got {dst!r}")
    names: dict[int, str | None] = {id(p): n for n, p in model.named_parameters()}
    failure: BaseException | None = None
    state: dict[str, dict[str, Any]] = {}
    groups: list[tuple[dict[str, Any], list[str]]] = []
    try:
        state, groups = named_optimizer_state(optimizer, names)
    except (TypeError, ValueError) as e:
        failure = e
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    layout = [
        (n, f, state_kind(v, shapes[n]), str(getattr(v, "dtype", type(v).__name__)))
        for n, entries in state.items()
        for f, v in entries.items()
    ]
    if comm is not None:
        fields = {
            "the optimizer state's names, fields and dtypes": zlib.crc32(repr(layout).encode()),
            "the optimizer's param groups": zlib.crc32(repr(groups).encode()),
        }
        agree(comm, fields, failure=failure)
    elif failure is not None:
        raise failure
    full: dict[str, dict[str, Any]] = {n: {} for n in state}
    for field in dict.fromkeys(f for _, f, kind, _ in layout if kind == "sliced"):
        values = {n: state[n][field] for n, f, kind, _ in layout if f == field and kind == "sliced"}
        gathered = _gather(model, values, dst, "model")
        if gathered is not None:
            for n, t in gathered.items():
                full[n][field] = t
    if comm is not None and dst is not None and comm.rank != dst:
        return None
    for n, f, kind, _ in layout:
        if kind != "sliced":
            v = state[n][f]
            full[n][f] = v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
    return {
        "state": {n: {f: full[n][f] for f in state[n]} for n in state},
        "param_groups": [{**hyper, "params": listed} for hyper, listed in groups],
    }


def load_full_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load the unsplit model's ``state_dict`` (:func:`gather_state_dict`'s, or a plain
    model's) into ``model``, split or not: each rank keeps its slice of every split tensor,
    whatever split wrote the checkpoint. Local (no communication); keys and shapes are checked
    first, against the unsplit model, and a mismatch raises naming ``state_dict``.

    >>> model = filter_parallel(Net(), speeds=new_speeds)  # doctest: +SKIP
    >>> load_full_state_dict(model, ckpt["model"])  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: must be a torch.nn.Module, got {type(model).__name__}")
    dtypes = {k: t.dtype for k, t in model.state_dict(keep_vars=True).items()}
    check_full_state_dict(state_dict, {k: p.shape for k, p in _parts(model).items()}, dtypes=dtypes)
    model.load_state_dict(state_dict)  # split modules slice full tensors (ChannelSplit)


def load_full_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]
) -> None:
    """Load a full optimizer state dict (:func:`gather_optimizer_state_dict`'s, or
    :meth:`hetcoll.torch.Parallel.full_optimizer_state_dict`'s) into ``optimizer``, built over
    ``model.parameters()`` with the same param groups: each rank takes its slice of every split
    parameter's state, whatever split wrote it, and the saved hyperparameters. Local (no
    communication); names and shapes are checked first, against the unsplit model.

    >>> load_full_optimizer_state_dict(model, opt, ckpt["optimizer"])  # doctest: +SKIP
    """
    check_module(model)
    optimizer.load_state_dict(local_optimizer_state(model, optimizer, state_dict))
    hook_optimizer(optimizer)  # saved next through DCP, before any step: marked


def local_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]
) -> dict[str, Any]:
    """What ``optimizer.load_state_dict`` takes on this rank from a full optimizer state dict
    (:func:`load_full_optimizer_state_dict` loads it): this rank's slice of every split
    parameter's state, indexed as the optimizer's own, with the saved hyperparameters. Local;
    names and shapes are checked first, against the unsplit model."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: must be a torch.nn.Module, got {type(model).__name__}")
    check_optimizer(optimizer)
    parts = _parts(model)
    params = dict(model.named_parameters())
    check_full_optimizer_state_dict(state_dict, {n: parts[n].shape for n in params})
    held: dict[int, tuple[str, Part] | None] = {id(p): (n, parts[n]) for n, p in params.items()}
    return local_optimizer_state_dict(optimizer, state_dict, held)
