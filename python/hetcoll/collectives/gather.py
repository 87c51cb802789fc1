"""allgatherv: the entry point, the choice of algorithm and the first round that carries it
(speculative on gloo, through the node windows on one MPI node, else an allgather of the
lengths), and the output's checks. The algorithms are the engine's own ("native"), the ring's
allgather half (:mod:`.ring`), the direct exchange (:mod:`.direct`) and the node windows
(:mod:`.shared`)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from hetcoll.collectives import _tuning
from hetcoll.collectives._common import _NO_SHARED, ALGORITHMS, ArrayT, _segment_bytes
from hetcoll.collectives._header import FAILED, NO_OUT, _exchange_shapes, _PeerFailed
from hetcoll.collectives.device import _allgatherv_device, stage_on_host
from hetcoll.collectives.direct import _direct_allgather
from hetcoll.collectives.ring import _ring_allgather
from hetcoll.collectives.shared import _shared_round
from hetcoll.collectives.speculative import _speculative_round
from hetcoll.comm import (
    NOT_GIVEN,
    Communicator,
    agree,
    deadline_or_failure,
    group_argument,
    wrap,
)
from hetcoll.kernels import check_dense, is_tensor


def allgatherv(
    local: ArrayT,
    group: Any = None,
    *,
    out: ArrayT | None = None,
    algorithm: str = "auto",
    timeout: float | None = None,
    segment_bytes: int | None = None,
    comm: Any = NOT_GIVEN,
) -> ArrayT:
    """Concatenation along axis 0 of every rank's ``local``, pieces of different lengths.
    ``group``: as :func:`hetcoll.allreduce` takes it (``comm=``, its deprecated name).

    ``local`` is a numpy array or a CPU torch tensor (any dtype) with at least one
    dimension; the other dimensions and the dtype must match on every rank (else
    :class:`hetcoll.CollectiveMismatchError` on every rank). Returns a new array of the same
    kind, or ``out``: an array of that kind, dtype and trailing shape, C-contiguous, with as
    many rows as all pieces together (checked in the first round, where the lengths become
    known: a wrong count raises a ValueError on that rank and a
    :class:`hetcoll.CollectiveMismatchError` naming it on the others), which
    saves allocating (and, for large outputs, page-faulting) a new one every call. A device
    (CUDA) tensor is gathered by NCCL on NCCL (all_to_all_single, no ``out``); on gloo or MPI
    it is staged through host memory as :func:`hetcoll.allreduce` stages it, gathered as a CPU
    tensor, and the result returned on its device.
    ``algorithm``: "native" is MPI_Allgatherv, or on torch all_to_all_single with uneven splits
    (gloo's all_gather rejects uneven pieces); "ring" passes the pieces around the ring with the
    engine's send/recv straight into the output, segment by segment; "direct" sends each piece
    to every other rank in one round of send/recv straight into the output; "auto" on MPI
    picks by total size (:data:`GATHER_RING_CROSSOVER_BYTES`). Every call starts with one round
    that exchanges the lengths (and checks shapes, dtype and algorithm). On gloo that round
    also carries as many bytes of each piece as the group's recent gathers predict
    (:data:`SPECULATIVE_GATHER_ENGINES`), in one all-to-all for small gathers
    (:data:`BATCHED_GATHER_BYTES`), else point to point: "auto" is then done in that round
    when the prediction holds, and sends only the rest of longer pieces when it does not.
    ``segment_bytes`` cuts the ring's messages (default: one message per piece and step;
    nothing is computed between them, so smaller messages would only add per-message cost).

    >>> allgatherv(np.arange(rank + 1.0), group)  # on 3 ranks  # doctest: +SKIP
    array([0., 0., 1., 0., 1., 2.])
    """
    group = group_argument(group, "allgatherv", comm=comm)
    # Bad arguments are told to the others in the first round (they raise at once). A bad
    # timeout too, but on MPI: there it is raised here, alone, since a rank without a deadline
    # waits in blocking calls, which a rank polling nonblocking ones never matches.
    deadline, bad_timeout = deadline_or_failure(timeout, group)
    failure: BaseException | None = None
    try:
        if bad_timeout is not None:
            raise bad_timeout
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm: must be one of {ALGORITHMS}, got {algorithm!r}")
        _segment_bytes(segment_bytes)
    except (TypeError, ValueError) as e:
        failure, algorithm, segment_bytes = e, "auto", None
    result, _ = _gather(local, group, deadline, algorithm, segment_bytes, out, failure)
    return result  # type: ignore[no-any-return]


def _gather(
    local: Any,
    comm: Any,
    deadline: float | None,
    algorithm: str = "auto",
    segment_bytes: int | None = None,
    out: Any = None,
    failure: BaseException | None = None,
) -> tuple[Any, list[int]]:
    """:func:`allgatherv`, plus every rank's length along axis 0; ``failure``: this rank's
    argument error, told to every rank in the first round."""
    host = stage_on_host(local, comm) if failure is None else None
    if host is not None:  # gloo, MPI: gathered as a CPU tensor, like the group's CPU ranks
        if out is not None:
            raise ValueError("out: not supported for device tensors")
        gathered, lengths = _gather(host, comm, deadline, algorithm, segment_bytes)
        return gathered.to(local.device), lengths
    if failure is None and is_tensor(local) and local.device.type not in ("cpu", "meta"):
        if out is not None:
            raise ValueError("out: not supported for device tensors")
        return _allgatherv_device(local, comm, deadline)
    try:
        c = wrap(comm)
    except (TypeError, ValueError):
        c = None  # no one to tell: the argument's own error first, as with a group
    try:
        if failure is not None:
            raise failure
        view = _local_view(local)
        dtype = _dtype_code(local, view)
        into = None if out is None else _out_view(out, local, view)
    except (TypeError, ValueError) as e:
        if c is None:
            raise
        # Still join the first round, with nothing to gather and a header that says so: the
        # others raise at once (a CollectiveMismatchError naming this rank and its error).
        failure, view, into, algorithm = e, np.empty(0, np.uint8), None, FAILED
        dtype = view.dtype.str
    if c is None:
        c = wrap(comm)
    into_bytes = None if into is None else into.reshape(-1).view(np.uint8)
    out_rows = NO_OUT if into is None else into.shape[0]
    try:
        lengths, joined = _first_round(c, view, dtype, deadline, algorithm, into_bytes, out_rows)
    except _PeerFailed:
        agree(c, {}, deadline, failure=failure)  # the errors, told to every rank; raises
        raise
    if failure is not None:  # every rank failed on its own: all headers agreed
        agree(c, {}, deadline, failure=failure)
    send = view.reshape(-1).view(np.uint8)
    row_bytes = view.itemsize * math.prod(view.shape[1:])
    rows = sum(lengths)
    dest = into  # its rows checked on every rank in the first round
    if joined is not None:  # "auto": the pieces are in place after the speculative round
        out_view = joined.view(view.dtype).reshape(rows, *view.shape[1:])
        if dest is not None and joined is not into_bytes:
            dest[...] = out_view
    else:
        out_view = dest if dest is not None else np.empty((rows, *view.shape[1:]), view.dtype)
        counts = [n * row_bytes for n in lengths]
        recv = out_view.reshape(-1).view(np.uint8)
        if algorithm == "auto":
            crossover = _tuning.GATHER_RING_CROSSOVER_BYTES.get(c.engine, math.inf)
            algorithm = "ring" if recv.nbytes >= crossover else "native"
        if algorithm == "native" or c.size == 1:
            c.iallgatherv(send, recv, counts).wait(deadline)
        elif algorithm == "shared":  # only here without shared memory: ranks agreed, all raise
            raise ValueError(_NO_SHARED.format(c.engine))
        elif algorithm == "direct":
            _direct_allgather(c, send, recv, counts, deadline)
        else:
            segment = segment_bytes if segment_bytes is not None else max(1, *counts)
            _ring_allgather(c, send, recv, counts, segment, deadline)
    if into is not None:
        return out, lengths
    if is_tensor(local):
        import torch

        t = torch.from_numpy(out_view)
        return (t.view(torch.bfloat16) if local.dtype == torch.bfloat16 else t), lengths
    return out_view, lengths


def _local_view(local: Any) -> np.ndarray:
    """``local`` as a C-contiguous numpy array (a tensor's memory as its bytes' type), checked."""
    if is_tensor(local):
        if local.device.type == "meta":
            raise ValueError("local: a meta tensor holds no values to gather")
        check_dense(local, "local")
        # A lazily conjugated or negated tensor (x.conj(), x.conj().imag) gathers its values:
        # numpy cannot view the lazy form (a RuntimeError the peers were never told of).
        plain = local.detach().resolve_conj().resolve_neg()
        view = _tensor_bytes_view(plain.contiguous(), "local")
    elif isinstance(local, np.ndarray):
        if local.dtype.hasobject:
            raise ValueError("local: an array of Python objects has no bytes to gather")
        # np.ascontiguousarray makes a 0-d array 1-d, which the check below would never see.
        view = np.ascontiguousarray(local) if local.ndim else local
    else:
        raise TypeError(
            f"local: must be a numpy array or a torch tensor, got {type(local).__name__}"
        )
    if view.ndim == 0:
        raise ValueError("local: must have at least one dimension (pieces join along axis 0)")
    return view


def _first_round(
    c: Communicator,
    view: np.ndarray,
    dtype: str,
    deadline: float | None,
    algorithm: str,
    into_bytes: np.ndarray | None,
    out_rows: int,
) -> tuple[list[int], np.ndarray | None]:
    """Every rank's length along axis 0, the headers checked, and for "auto" possibly the
    pieces joined already: speculative on gloo, through the node windows on one MPI node, else
    an allgather of the headers. ``dtype``: the piece's (:func:`_dtype_code`); ``into_bytes``:
    ``out`` as bytes, where "auto" may join them; ``out_rows``: its rows (``NO_OUT``: none),
    checked on every rank."""
    send = view.reshape(-1).view(np.uint8)
    row_bytes = view.itemsize * math.prod(view.shape[1:])
    # The arguments of either round that carries the pieces with the headers, in order.
    piece = (view.shape, dtype, send, row_bytes, deadline, algorithm, into_bytes, out_rows)
    if c.size > 1 and c.engine in _tuning.SPECULATIVE_GATHER_ENGINES:
        return _speculative_round(c, *piece)
    if (
        c.size > 1
        and (windows := c.node_windows(_tuning.SHARED_SEGMENT_BYTES, deadline)) is not None
    ):
        return _shared_round(c, windows, *piece)
    shapes = _exchange_shapes(c, view.shape, dtype, deadline, algorithm, out_rows)
    return [int(n) for n in shapes], None


def _tensor_bytes_view(t: Any, argument: str) -> np.ndarray:
    """A CPU tensor's memory as numpy: any dtype numpy has as itself, bfloat16 (unknown to
    numpy) as its 16-bit patterns, so that it travels as bytes; other dtypes numpy lacks
    (float8, complex32, quantized) raise ``TypeError`` naming ``argument``."""
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy()
    try:
        return t.numpy()
    except TypeError:  # "Got unsupported ScalarType ...", which names no argument
        raise TypeError(f"{argument}: dtype {t.dtype} has no numpy counterpart") from None


def _dtype_code(local: Any, view: np.ndarray) -> str:
    """The dtype ranks compare in the first round: numpy's, but bfloat16 by its own name, as
    its view (int16 patterns) would match an int16 piece and the bytes be read as the other
    type."""
    if is_tensor(local) and str(local.dtype) == "torch.bfloat16":
        return "bfloat16"
    return view.dtype.str


def _out_view(out: Any, local: Any, view: np.ndarray) -> np.ndarray:
    """``out`` as a writeable numpy array of ``view``'s dtype (bfloat16 as its bit patterns),
    after the checks that need no lengths: kind, dtype, trailing shape, layout."""
    if is_tensor(local):
        if not is_tensor(out) or out.device.type != "cpu":
            raise TypeError(f"out: must be a CPU torch tensor like local, got {type(out).__name__}")
        if out.dtype != local.dtype:
            raise TypeError(f"out: dtype {out.dtype} differs from local's {local.dtype}")
        if out.requires_grad:
            raise ValueError("out: must not require grad")
        check_dense(out, "out")
        if out.is_conj() or out.is_neg():  # written in place: numpy cannot view its lazy form
            raise ValueError("out: has its conjugate or negative bit set; pass a plain tensor")
        array = _tensor_bytes_view(out, "out")
    elif isinstance(out, np.ndarray):
        array = out
    else:
        raise TypeError(f"out: must be a numpy array like local, got {type(out).__name__}")
    if array.dtype != view.dtype:
        raise TypeError(f"out: dtype {array.dtype} differs from local's {view.dtype}")
    if array.shape[1:] != view.shape[1:] or array.ndim != view.ndim:
        raise ValueError(
            f"out: shape {tuple(array.shape)} must be (rows, *{tuple(view.shape[1:])})"
        )
    if not array.flags.c_contiguous or not array.flags.writeable:
        raise ValueError("out: must be C-contiguous and writeable")
    if np.may_share_memory(array, view):
        raise ValueError("out: must not overlap local")
    return array
