"""Global-norm gradient clipping for a model whose ranks hold parameters of their own.

``torch.nn.utils.clip_grad_norm_`` takes the norm of the gradients it is given: on a rank
holding only its own experts (:func:`hetcoll.torch.expert_parallel`) or its slices of split
layers (:func:`hetcoll.torch.filter_parallel`) that is not the model's norm, every rank gets a
different one, and each scales its gradients by a different factor (a split model's
replicated weights then drift apart). :func:`clip_grad_norm_` sums every rank's own
parameters' squared gradients over the group (one allreduce of a number) and adds the
replicated ones' once, so every rank scales by the factor one process would.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from hetcoll.comm import Communicator, agree, deadline, same_processes, wrap_or_raise
from hetcoll.torch.expert_parallel import is_rank_local
from hetcoll.torch.filters.layers import split_modules
from hetcoll.torch.filters.state import split_parts
from hetcoll.torch.state_dicts import Part


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    *,
    group: Any = None,
    timeout: float | None = None,
) -> torch.Tensor:
    """Clip the gradients of ``parameters`` (this rank's: replicated ones, and its own, those
    :func:`hetcoll.torch.is_rank_local` names) to the 2-norm ``max_norm`` of the whole
    model's gradient: the replicated gradients counted once, every rank's own summed over
    ``group`` (an mpi4py communicator or a torch.distributed process group; None:
    :func:`hetcoll.comm.wrap`'s default). Every rank scales by ``max_norm / (norm + 1e-6)``
    where that is below 1, as ``torch.nn.utils.clip_grad_norm_`` does; ``max_norm=inf``
    measures without clipping. Collective: every rank calls it. Returns the norm before
    clipping (a float64 tensor, the same on every rank). For a model whose ranks hold their
    own experts (:func:`~hetcoll.torch.expert_parallel`) or their slices of split layers
    (:func:`~hetcoll.torch.filter_parallel`: each slice's squares summed over the ranks,
    entries every rank holds counted once), the rest whole on every rank; a
    :class:`~hetcoll.torch.Parallel` clips with its own
    :meth:`~hetcoll.torch.Parallel.clip_grad_norm_` (pipeline stages hold other layers).

    >>> clip_grad_norm_(model.parameters(), 1.0)  # doctest: +SKIP
    """
    failure: Exception | None = None
    try:
        limit = checked_max_norm(max_norm)
        if not isinstance(parameters, (torch.Tensor, Iterable)):
            raise TypeError(
                "parameters: must be a tensor or tensors (a model's parameters()), got "
                f"{type(parameters).__name__}"
            )
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if not all(isinstance(p, torch.Tensor) for p in params):
            raise TypeError("parameters: must be tensors (a model's parameters())")
    except (TypeError, ValueError) as e:  # raised on every rank, after the exchange
        failure, limit, params = e, 0.0, []
    comm = wrap_or_raise(group, failure)
    grads = [p.grad for p in params if p.grad is not None]
    pieces = _split_pieces(params, comm) if failure is None else {}
    shared = 0.0
    own = 0.0
    for p in params:
        if p.grad is None:
            continue
        if is_rank_local(p):
            own += squares([p.grad])
        elif id(p) in pieces:
            own += squares([pieces[id(p)].written_of(p.grad)])
        else:
            shared += squares([p.grad])
    norm = math.sqrt(shared + summed_squares(comm, own, limit, failure, timeout))
    scale_to_norm(grads, norm, limit)
    return torch.tensor(norm, dtype=torch.float64)


def _split_pieces(params: list[torch.Tensor], comm: Communicator) -> dict[int, Part]:
    """The split layers' slices among ``params`` (by ``id``): where each sits in its unsplit
    tensor. A split over another number of ranks than ``comm``'s raises ``ValueError``."""
    wanted = {id(p) for p in params}
    pieces: dict[int, Part] = {}
    for m in split_modules():
        assert isinstance(m, torch.nn.Module)
        local = dict(m.named_parameters())
        if not wanted.intersection(id(t) for t in local.values()):
            continue
        if m.comm.size != comm.size or not same_processes(m.comm, comm):
            raise ValueError(
                f"group: its ranks ({comm.size}) are not those a split layer among the "
                f"parameters is split over ({m.comm.size}); pass the split model's group"
            )
        for name, part in split_parts(m, local).items():
            if id(local[name]) in wanted:
                pieces[id(local[name])] = part
    return pieces


def checked_max_norm(max_norm: object) -> float:
    """``max_norm`` as a float; ``ValueError`` naming it unless a number >= 0 (inf too)."""
    if (
        isinstance(max_norm, bool)
        or not isinstance(max_norm, numbers.Real)  # numpy's floats too
        or not max_norm >= 0  # type: ignore[operator]
    ):
        raise ValueError(f"max_norm: must be a number >= 0, got {max_norm!r}")
    try:
        return float(max_norm)
    except OverflowError:  # an int past float's range: no limit, as inf
        return math.inf


def summed_squares(
    comm: Communicator,
    mine: float,
    max_norm: float,
    failure: Exception | None,
    timeout: float | None,
) -> float:
    """The sum over ``comm``'s ranks of their squares ``mine``, in rank order (the same float
    on every rank), with the ranks' agreement on ``max_norm``: one small allgather
    (:func:`hetcoll.comm.agree`). A rank's own argument error (``failure``) or ranks clipping
    to different norms raise on every rank, where one rank's error alone left the others
    waiting in the sum."""
    bits = np.array([max_norm, mine], np.float64).view(np.int64)
    rows = agree(
        comm,
        {"max_norm (its float64 bits)": int(bits[0])},
        deadline(timeout),
        failure=failure,
        values=[int(bits[1])],
    )
    return float(sum(np.ascontiguousarray(rows[:, 0]).view(np.float64).tolist()))


def squares(grads: Iterable[torch.Tensor]) -> float:
    """The sum of the gradients' squared entries, in float64."""
    return sum((float(g.detach().double().pow(2).sum()) for g in grads), 0.0)


def scale_to_norm(grads: Iterable[torch.Tensor], norm: float, max_norm: float) -> None:
    """Scale ``grads`` in place by ``max_norm / (norm + 1e-6)`` where that is below 1, as
    ``torch.nn.utils.clip_grad_norm_`` does once it has the total ``norm``."""
    coefficient = max_norm / (norm + 1e-6)
    if coefficient < 1.0:
        with torch.no_grad():
            for g in grads:
                g.mul_(coefficient)
