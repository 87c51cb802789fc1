"""Loss scaling (float16 training) under a plan: which scalers a plan's step can drive, and how
its ranks check, inside a sum they already run, that they scale by the same factor.

A plan's stages hold different parameters, so one rank's gradients can overflow while
another's do not; every rank must then skip the same optimizer steps, or the model's copies
part. torch's :class:`~torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler` (made for
FSDP's shards, which hold different parameters too) sums its overflow flags over a process
group in ``unscale_``, so over the plan's group every rank skips alike, an idle rank too.
A plain :class:`torch.amp.GradScaler` decides from its own rank's gradients alone.

Every rank must also scale by the same factor: a pipeline's first stages unscale gradients
that its last stage scaled. Their scalers move alike from the same start; the step checks
that they did, in the step's loss sum (:func:`scale_fields`, :func:`scales_agree`).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "NO_SCALER",
    "SCALE_FIELDS",
    "SHARDED",
    "UNUSABLE",
    "scale_fields",
    "scaler_status",
    "scales_agree",
]

#: :func:`scaler_status`'s codes, agreed on by every rank of a step.
NO_SCALER, SHARDED, UNUSABLE = 0, 1, 2

#: How many float64 entries :func:`scale_fields` adds to a sum.
SCALE_FIELDS = 4


def scaler_status(scaler: Any, comm: Any) -> tuple[int, str | None]:
    """``scaler``'s code for a plan whose communicator is ``comm`` (the same on every rank that
    passes alike), and why it cannot run there (None where it can): :data:`NO_SCALER` for
    None or a disabled scaler, :data:`SHARDED` for a ShardedGradScaler over the plan's ranks,
    :data:`UNUSABLE` for anything else."""
    if scaler is None:
        return NO_SCALER, None
    if not isinstance(scaler, torch.amp.GradScaler):
        return UNUSABLE, (
            f"scaler: expected a torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler "
            f"or None, got {type(scaler).__name__}"
        )
    if not scaler.is_enabled():
        return NO_SCALER, None
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    if not isinstance(scaler, ShardedGradScaler):
        return UNUSABLE, (
            "scaler: a plan's stages hold different parameters, so every rank must learn "
            "whether any rank's gradients overflowed: a GradScaler decides from its own rank's "
            "alone. Use torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler("
            "device=..., process_group=<the plan's group>), which sums that over its group"
        )
    if comm.engine == "mpi":
        return UNUSABLE, (
            "scaler: a ShardedGradScaler sums its overflow flags over torch.distributed, and "
            "this plan runs on an MPI communicator: parallelize over a torch.distributed group"
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
