"""allreduce "native": the weight as a Rust pre-scale, then the engine's own allreduce SUM
(``MPI_Allreduce``, ``dist.all_reduce``), in one call or, on gloo from a size, in two halves in
flight at once (torch's gloo process group runs its collectives on two worker threads)."""

from __future__ import annotations

import math

import numpy as np

from hetcoll import _core
from hetcoll.collectives import _tuning
from hetcoll.comm import Communicator, wait_all


def _native(
    c: Communicator, flat: np.ndarray, bf16: bool, w: float, kind: str, deadline: float | None
) -> None:
    """The weight fused into a Rust pre-scale, then the engine's allreduce: one call, or from
    :data:`NATIVE_HALVES_FROM_BYTES` (:data:`NATIVE_HALVES_TWO_RANKS_FROM_BYTES` on two ranks)
    two calls in flight at once, the second half pre-scaled while the first is under way."""
    if c.size == 2:
        halves = _tuning.NATIVE_HALVES_TWO_RANKS_FROM_BYTES
    else:
        halves = _tuning.NATIVE_HALVES_FROM_BYTES
    if flat.nbytes < halves.get(c.engine, math.inf):
        if w != 1.0:
            _core.weighted_sum_into([flat], [w], flat, bfloat16=bf16)
        c.allreduce_sum(flat, kind, deadline)
        return
    half = flat.size // 2
    requests = []
    for part in (flat[:half], flat[half:]) if half else (flat,):
        if w != 1.0:
            _core.weighted_sum_into([part], [w], part, bfloat16=bf16)
        requests.append(c.iallreduce_sum(part, kind))
    wait_all(requests, deadline)
