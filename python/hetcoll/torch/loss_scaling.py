"""Loss scaling (float16 training) under a plan: which scalers a plan's step can drive, and how
its ranks check, inside a sum they already run, that they scale by the same factor.

A plan's stages hold different parameters, so one rank's gradients can overflow while
another's do not; every rank must then skip the same optimizer steps, or the model's copies
part. torch's :class:`~torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler` (made for
FSDP's shards, which hold different parameters too) sums its overflow flags over a process
group in ``unscale_``, so over the plan's group every rank skips alike, an idle rank too.
A plain :class:`torch.amp.GradScaler` decides from its own rank's gradients alone.
:class:`GroupGradScaler` does what ShardedGradScaler does over any of hetcoll's groups: an
mpi4py communicator too, so an MPI-launched plan (or filter split) scales its loss as well.

Every rank must also scale by the same factor: a pipeline's first stages unscale gradients
that its last stage scaled. Their scalers move alike from the same start; the step checks
that they did, in the step's loss sum (:func:`scale_fields`, :func:`scales_agree`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hetcoll.comm import Communicator, deadline, same_processes, wrap

__all__ = [
    "GROUP",
    "NO_SCALER",
    "SCALE_FIELDS",
    "SHARDED",
    "UNUSABLE",
    "GroupGradScaler",
    "scale_fields",
    "scaler_status",
    "scales_agree",
]

#: :func:`scaler_status`'s codes, agreed on by every rank of a step: ranks passing a
#: ShardedGradScaler and a GroupGradScaler would sum their flags in different collectives.
NO_SCALER, SHARDED, UNUSABLE, GROUP = 0, 1, 2, 3

#: How many float64 entries :func:`scale_fields` adds to a sum.
SCALE_FIELDS = 4


class GroupGradScaler(torch.amp.GradScaler):
    """A :class:`torch.amp.GradScaler` whose ``unscale_`` sums the ranks' overflow flags over
    ``group``, so that every rank skips the optimizer steps in which any rank's gradients
    overflowed, and every rank's scale moves alike: what training needs where ranks hold
    different parameters (a plan's stages, a filter split's slices). torch's
    :class:`~torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler` does the same over
    a torch.distributed group; this one takes any of hetcoll's groups, an mpi4py communicator
    too (None: the default group, as everywhere in hetcoll).

    Used as any GradScaler, on every rank of ``group`` (``unscale_`` is collective, and so is
    ``step`` where ``unscale_`` was not called): ``scaler.scale(loss).backward()`` (or
    ``par.step(x, y, scaler=scaler)``), ``scaler.unscale_(opt)`` to clip,
    ``scaler.step(opt)``, ``scaler.update()``. A rank holding no gradient takes part with no
    overflow of its own. Each rank reads its flag back to the host once per ``unscale_`` (a
    CUDA rank's one sync), since the flags travel through hetcoll's communicator. ``timeout``:
    seconds each sum may wait for the other ranks (None: no limit), past which it raises
    :class:`~hetcoll.CollectiveTimeout`.

    Pickling follows DDP's rule: a scaler over the default group (``group=None``) pickles, and
    unpickles over the default group of the process that loads it; one over a group given
    explicitly raises ``TypeError`` (a communicator cannot be pickled), as does unpickling an
    enabled scaler where there is no default group. Either way ``state_dict()`` and
    ``load_state_dict()`` carry the scale, as GradScaler's do.

    >>> scaler = GroupGradScaler("cuda", group=MPI.COMM_WORLD)  # doctest: +SKIP
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        group: Any = None,
        timeout: float | None = None,
    ) -> None:
        deadline(timeout)  # a bad timeout raises here, naming it
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        # A disabled scaler (enabled=False, or CUDA asked for where there is none) does
        # nothing, as torch's does, and needs no group: one process may construct it.
        self._comm: Communicator | None = wrap(group) if self.is_enabled() else None
        self._timeout = timeout
        self._default_group = group is None

    def __getstate__(self) -> dict[str, Any]:
        if self._comm is not None and not self._default_group:
            raise TypeError(
                "GroupGradScaler: a scaler over a group given explicitly cannot be pickled (its "
                "communicator cannot): save scaler.state_dict() and load it into a "
                "GroupGradScaler built over the group, or build it with group=None (the "
                "default group, which unpickling takes again)"
            )
        state = super().__getstate__()
        state["_comm"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if self._enabled:
            # The default group of the process that loads it, as DDP's unpickling takes it.
            self._comm = wrap(None)

    @property
    def comm(self) -> Communicator | None:
        """The communicator the overflow flags are summed over (None while disabled)."""
        return self._comm

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale ``optimizer``'s gradients in place and sum every rank's overflow flag over
        the group (collective). Each device's flag then holds the group's sum."""
        if not self.is_enabled():
            return
        super().unscale_(optimizer)
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        if not found:  # no gradient here: this rank found no overflow, and still steps alike
            assert self._scale is not None  # unscale_ made it (scale() first)
            found[self._scale.device] = torch.zeros(
                1, dtype=torch.float32, device=self._scale.device
            )
        summed = np.array([sum(float(f.item()) for f in found.values())], dtype=np.float64)
        assert self._comm is not None  # enabled
        self._comm.allreduce_sum(summed, "float64", deadline(self._timeout))
        for f in found.values():
            f.fill_(float(summed[0]))


def scaler_status(scaler: Any, comm: Any) -> tuple[int, str | None]:
    """``scaler``'s code for a plan whose communicator is ``comm`` (the same on every rank that
    passes alike), and why it cannot run there (None where it can): :data:`NO_SCALER` for
    None or a disabled scaler, :data:`SHARDED` for a ShardedGradScaler over the plan's ranks,
    :data:`GROUP` for a :class:`GroupGradScaler` over them, :data:`UNUSABLE` for anything
    else."""
    if scaler is None:
        return NO_SCALER, None
    if not isinstance(scaler, torch.amp.GradScaler):
        return UNUSABLE, (
            "scaler: expected a hetcoll.torch.GroupGradScaler, a torch.distributed.fsdp."
            f"sharded_grad_scaler.ShardedGradScaler or None, got {type(scaler).__name__}"
        )
    if not scaler.is_enabled():
        return NO_SCALER, None
    if isinstance(scaler, GroupGradScaler):
        assert scaler.comm is not None  # enabled
        if not same_processes(scaler.comm, comm):
            return UNUSABLE, (
                f"scaler: its group ({scaler.comm.size} ranks) is not the plan's ({comm.size} "
                "ranks): every rank of the plan, and none else, must sum the overflow flags"
            )
        return GROUP, None
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    if not isinstance(scaler, ShardedGradScaler):
        return UNUSABLE, (
            "scaler: a plan's stages hold different parameters, so every rank must learn "
            "whether any rank's gradients overflowed: a GradScaler decides from its own rank's "
            "alone. Use hetcoll.torch.GroupGradScaler(device=..., group=<the plan's group>) "
            "(or torch's ShardedGradScaler on torch.distributed), which sums that over its "
            "group"
        )
    if comm.engine == "mpi":
        return UNUSABLE, (
            "scaler: a ShardedGradScaler sums its overflow flags over torch.distributed, and "
            "this plan runs on an MPI communicator: use hetcoll.torch.GroupGradScaler("
            "device=..., group=<the plan's communicator>)"
        )
    import torch.distributed as dist

    group = scaler.process_group
    try:
        ranks = list(
            range(dist.get_world_size()) if group is None else dist.get_process_group_ranks(group)
        )
    except (ValueError, RuntimeError):  # a group this rank is not in
        return UNUSABLE, "scaler: its process_group does not hold this rank, one of the plan's"
    if ranks != list(comm.global_ranks):
        return UNUSABLE, (
            f"scaler: its process_group holds ranks {ranks} and the plan's group "
            f"{list(comm.global_ranks)}: every rank of the plan, and none else, must sum the "
            "overflow flags"
        )
    return SHARDED, None


def scale_fields(scale: torch.Tensor) -> torch.Tensor:
    """What a rank adds to a float64 sum so that every rank learns whether all scaled by
    ``scale`` (a one-element float32 tensor, on any device; not read). Its bit pattern,
    halved into two 16-bit integers ``h``, each with its square: over ``n`` ranks
    ``n * sum(h**2) == sum(h)**2`` holds when and only when every rank's ``h`` is the same
    (Cauchy-Schwarz). The sums are of integers below 2**32 each, exact in float64 for up to
    2**21 ranks, and :func:`scales_agree` compares them as integers."""
    bits = scale.detach().reshape(1).to(torch.float32).view(torch.int32).to(torch.int64)
    bits = bits & 0xFFFFFFFF
    halves = torch.cat([bits >> 16, bits & 0xFFFF])
    return torch.stack([halves[0], halves[0] ** 2, halves[1], halves[1] ** 2]).to(torch.float64)


def scales_agree(summed: list[float], ranks: int) -> bool:
    """Whether :func:`scale_fields`, summed over ``ranks`` ranks, came from one scale."""
    hi, hi2, lo, lo2 = (int(x) for x in summed)
    return ranks * hi2 == hi * hi and ranks * lo2 == lo * lo
