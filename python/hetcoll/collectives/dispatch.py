"""allreduce: the entry point, its argument checks, and the choice "auto" stands for
(:func:`choose_algorithm`, reading the crossovers of the tuning table at call time). The
algorithms themselves are in :mod:`.ring`, :mod:`.native`, :mod:`.direct`, :mod:`.shared` and,
for device tensors, :mod:`.device`."""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from hetcoll import _core
from hetcoll.collectives import _tuning
from hetcoll.collectives._common import (
    _KIND_CODE,
    _NO_SHARED,
    ALGORITHMS,
    ArrayT,
    _counts,
    _kind,
    _segment_bytes,
)
from hetcoll.collectives._header import _inline_words
from hetcoll.collectives.device import _allreduce_device, stage_on_host
from hetcoll.collectives.direct import direct_allreduce
from hetcoll.collectives.native import _native
from hetcoll.collectives.ring import _ring, _ring_blocking
from hetcoll.collectives.shared import _shared
from hetcoll.comm import NOT_GIVEN, Communicator, agree, group_argument, wrap
from hetcoll.comm import deadline as deadline_of
from hetcoll.errors import finite_number
from hetcoll.kernels import is_tensor, numpy_view, tracked_by_autograd


def allreduce(
    buf: ArrayT,
    group: Any = None,
    *,
    weight: float = 1.0,
    algorithm: str = "auto",
    speeds: Sequence[float] | None = None,
    check: bool = True,
    timeout: float | None = None,
    segment_bytes: int | None = None,
    comm: Any = NOT_GIVEN,
) -> ArrayT:
    """In place, ``buf <- sum over ranks r of weight_r * buf_r``; returns ``buf``.

    ``buf`` is a C-contiguous numpy array or CPU torch tensor (float32, float64, float16,
    bfloat16; 16-bit types are reduced in float32 and rounded at each ring hop). ``group`` is
    an mpi4py communicator, a torch.distributed process group or None (the default of
    :func:`hetcoll.comm.wrap`: torch's default group, else ``MPI.COMM_WORLD`` under mpiexec;
    ``comm=`` is its deprecated name). ``weight`` is this rank's weight (ranks may
    differ). ``algorithm``: "ring", "native", "direct", "shared" (MPI, one node) or "auto" (see
    :data:`SHARED_FROM_BYTES`, :data:`DIRECT_BYTES` and :data:`RING_CROSSOVER_BYTES`, on two
    ranks :data:`DIRECT_TWO_RANKS_FROM_BYTES` and :data:`RING_TWO_RANKS_FROM_BYTES`; "auto"
    with ``speeds`` is "shared" where it runs, else the ring). ``speeds`` (one per rank, same
    on every rank) sizes the chunks of the ring and of "shared" with :func:`hetcoll.split`;
    chunk r is reduced last by rank r. Every rank ends with bitwise the same result. ``check``
    (default on) first compares length, dtype, algorithm, speeds and ``segment_bytes`` across
    ranks (:func:`hetcoll.comm.agree`: one allgather of a 16-byte fingerprint) and raises
    :class:`hetcoll.CollectiveMismatchError` on every rank when they differ; a rank whose own
    arguments are bad tells the others in that exchange, so they raise at once too.
    ``check=False`` skips it (a mismatch is then undefined behaviour, a hang or a timeout).
    ``segment_bytes`` cuts the ring's messages (default :data:`SEGMENT_BYTES`, or
    :data:`TWO_RANK_SEGMENT_BYTES` on two ranks). A device (CUDA) tensor on NCCL takes NCCL's
    own allreduce, the weight fused into it (``PREMUL_SUM``); on gloo or MPI it is staged
    through host memory (copied to the host, reduced there as a CPU tensor by the same
    algorithms, copied back), so that ranks holding CUDA tensors and ranks holding CPU tensors
    reduce together in one group.

    >>> allreduce(grad, group, weight=local_batch / global_batch)  # doctest: +SKIP
    """
    group = group_argument(group, "allreduce", comm=comm)
    host = stage_on_host(buf, group)
    if host is not None:
        allreduce(
            host,
            group,
            weight=weight,
            algorithm=algorithm,
            speeds=speeds,
            check=check,
            timeout=timeout,
            segment_bytes=segment_bytes,
        )
        buf.detach().copy_(host)  # type: ignore[attr-defined]
        return buf
    bad_check = None
    if not isinstance(check, bool):  # told to the others, which check (the default)
        bad_check = TypeError(f"check: must be True or False, got {check!r}")
        check = True
    # The group first: a rank whose other arguments are bad still tells the others. Without
    # one, those arguments' errors come first all the same (no one to tell).
    try:
        c: Communicator | None = wrap(group)
    except (TypeError, ValueError) as e:
        c, no_group = None, e
    deadline = None
    try:
        deadline = deadline_of(timeout)
        if bad_check is not None:
            raise bad_check
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm: must be one of {ALGORITHMS}, got {algorithm!r}")
        if is_tensor(buf) and buf.device.type == "meta":  # type: ignore[attr-defined]
            raise ValueError("buf: a meta tensor holds no values to reduce")
        if is_tensor(buf) and buf.device.type != "cpu":  # type: ignore[attr-defined]
            if c is None:
                raise no_group
            return _allreduce_device(
                buf, c, finite_number(weight, "weight"), algorithm, check, deadline
            )
        flat, bf16, kind, w = _local_arguments(buf, weight, speeds, segment_bytes, c)
        if c is None:
            raise no_group
    except (TypeError, ValueError) as e:
        if check and c is not None:  # join the agreement: raises e here, a mismatch elsewhere
            agree(c, {}, deadline, failure=e, values=np.zeros(_inline_words(c.size), np.int64))
        raise
    if check:
        # Before any algorithm-specific communication: "auto" then chooses alike everywhere.
        fields = _fingerprint(flat.size, kind, algorithm, speeds, segment_bytes)
        words = np.zeros(_inline_words(c.size), np.int64)
        inline = algorithm == "auto" and c.size > 1 and 8 + flat.nbytes <= words.nbytes
        if inline:  # the weight, then the buffer's bytes: reduced in the agreement itself
            words[0] = np.float64(w).view(np.int64)
            words[1:].view(np.uint8)[: flat.nbytes] = flat.view(np.uint8)
        rows = agree(c, fields, deadline, values=words)
        if inline:  # agreed, so on every rank: the same sum in rank order, bitwise alike
            pieces = rows[:, 1:].view(np.uint8)[:, : flat.nbytes].view(flat.dtype)
            weights = rows[:, 0].view(np.float64).tolist()
            _core.weighted_sum_into(list(pieces), weights, flat, bfloat16=bf16)
            return buf
    if algorithm == "auto":
        algorithm = choose_algorithm(c, flat.nbytes, speeds is not None, deadline)
    windows = None
    if algorithm == "shared":
        windows = c.node_windows(_tuning.SHARED_SEGMENT_BYTES, deadline)
        if windows is None:
            raise ValueError(_NO_SHARED.format(c.engine))
    counts = _counts(flat.size, c.size, speeds) if algorithm == "ring" else None
    if c.size == 1 or flat.size == 0:
        if w != 1.0 and flat.size:
            _core.weighted_sum_into([flat], [w], flat, bfloat16=bf16)
        return buf
    if algorithm == "native":
        _native(c, flat, bf16, w, kind, deadline)
    elif algorithm == "direct":
        direct_allreduce(c, flat, bf16, w, deadline)
    elif algorithm == "shared":
        assert windows is not None
        _shared(c, windows, flat, bf16, w, kind, speeds, deadline)
    else:
        assert counts is not None
        if segment_bytes is None:
            two = _tuning.TWO_RANK_SEGMENT_BYTES.get(c.engine) if c.size == 2 else None
            segment_bytes = _tuning.SEGMENT_BYTES if two is None else two
        segment = max(1, segment_bytes // flat.itemsize)
        if max(counts) <= segment:
            _ring_blocking(c, flat, bf16, w, counts, deadline)
        else:
            _ring(c, flat, bf16, w, counts, segment, deadline)
    return buf


def _local_arguments(
    buf: Any,
    weight: object,
    speeds: Sequence[float] | None,
    segment_bytes: int | None,
    c: Communicator | None,
) -> tuple[np.ndarray, bool, str, float]:
    """allreduce's checks that need no other rank: ``buf`` as a flat view, whether it is
    bfloat16, its kind, and the weight; raises the argument's error."""
    w = finite_number(weight, "weight")
    _segment_bytes(segment_bytes)
    if tracked_by_autograd(buf):  # kernels.check_writable's rule, as a ValueError told to all
        raise ValueError(
            "buf: requires grad; allreduce writes it in place and is not differentiable "
            "(torch refuses the same for its in-place ops): reduce its .grad, or write "
            "under torch.no_grad()"
        )
    view, bf16 = numpy_view(buf, "buf")
    if not view.flags.c_contiguous:
        raise ValueError("buf: must be C-contiguous (allreduce works in place)")
    if not view.flags.writeable:
        raise ValueError("buf: must be writeable (allreduce works in place)")
    kind = _kind(view, bf16)
    if speeds is not None and c is not None:
        _counts(1, c.size, speeds)  # the argument's errors now, not at the first chunk
    return view.reshape(-1), bf16, kind, w


#: The codes named in the fields, so that ranks that disagree read which dtype and algorithm
#: each passed (as the DDP hook names its algorithms).
_DTYPE_FIELD = "dtype (" + ", ".join(f"{k} = {v}" for k, v in _KIND_CODE.items()) + ")"
_ALGORITHM_FIELD = "algorithm (" + ", ".join(f"{a!r} = {i}" for i, a in enumerate(ALGORITHMS)) + ")"


def _fingerprint(
    length: int,
    kind: str,
    algorithm: str,
    speeds: Sequence[float] | None,
    segment_bytes: int | None,
) -> dict[str, int]:
    """What every rank of one allreduce must pass alike, as integers for :func:`agree`."""
    return {
        "length": length,
        _DTYPE_FIELD: _KIND_CODE[kind],
        _ALGORITHM_FIELD: ALGORITHMS.index(algorithm),
        "speeds (crc32)": -1
        if speeds is None
        else zlib.crc32(np.asarray(speeds, np.float64).tobytes()),
        "segment_bytes": segment_bytes or 0,
    }


def choose_algorithm(
    c: Communicator, nbytes: int, chunk_speeds: bool, deadline: float | None = None
) -> str:
    """The algorithm "auto" stands for; the same on every rank (it reads only what ranks agree
    on: sizes, the rank count, the engine and whether the ranks share one node)."""
    if (
        c.size > 1
        and nbytes >= _tuning.SHARED_FROM_BYTES.get(c.engine, math.inf)
        and c.node_windows(_tuning.SHARED_SEGMENT_BYTES, deadline) is not None
    ):
        return "shared"
    if chunk_speeds:
        return "ring"
    if c.size == 2:
        if nbytes >= _tuning.RING_TWO_RANKS_FROM_BYTES.get(c.engine, math.inf):
            return "ring"
        if nbytes >= _tuning.DIRECT_TWO_RANKS_FROM_BYTES.get(c.engine, math.inf):
            return "direct"
        return "native"
    if c.size > 2 and (c.size - 1) * nbytes <= _tuning.DIRECT_BYTES.get(c.engine, 0):
        return "direct"
    if nbytes >= _tuning.RING_CROSSOVER_BYTES.get(c.engine, math.inf):
        return "ring"
    return "native"
