"""One small Communicator over the engines hetcoll runs on: MPI (mpi4py) and torch.distributed.

The collectives in :mod:`hetcoll.collectives` need only this: rank and size, non-blocking
point-to-point messages, a non-blocking allreduce SUM, an allgather of pieces of different
lengths, a reduce-scatter of pieces of different lengths and, on MPI when every rank is on one
node, memory that every rank maps (:class:`NodeWindows`). Buffers are 1-D numpy arrays (the
zero-copy views :mod:`hetcoll.kernels` makes of numpy arrays and CPU tensors) together with
the element ``kind`` ("float32", "float64", "float16", "bfloat16", "int64"), because bfloat16
travels as raw 16-bit patterns that only the engine's reduction must know the meaning of.

Every wait takes an absolute ``deadline`` (``time.monotonic()`` seconds, or None to block): a
peer that does not answer in time, or that the engine reports lost, raises
:class:`hetcoll.CollectiveTimeout` instead of hanging.

>>> from mpi4py import MPI  # doctest: +SKIP
>>> comm = wrap(MPI.COMM_WORLD)  # doctest: +SKIP
>>> comm.rank, comm.size  # doctest: +SKIP
(0, 4)
"""

from hetcoll.comm.agreement import (
    agree,
    allgather_objects,
    fingerprint,
    same_rows,
    start_agreement,
)
from hetcoll.comm.base import KINDS, Communicator, Request, SharedWindows, deadline, wait_all
from hetcoll.comm.default import (
    MPI_LAUNCHER_VARIABLES,
    NOT_GIVEN,
    deadline_or_failure,
    global_ranks,
    group_argument,
    has_default,
    is_group,
    is_mpi_comm,
    same_processes,
    shared_processes,
    wrap,
    wrap_or_raise,
)
from hetcoll.comm.distributed import TorchCommunicator, TorchRequest
from hetcoll.comm.mpi import MpiCommunicator, NodeWindows

__all__ = [
    "KINDS",
    "MPI_LAUNCHER_VARIABLES",
    "NOT_GIVEN",
    "Communicator",
    "MpiCommunicator",
    "NodeWindows",
    "Request",
    "SharedWindows",
    "TorchCommunicator",
    "TorchRequest",
    "agree",
    "allgather_objects",
    "deadline",
    "deadline_or_failure",
    "fingerprint",
    "global_ranks",
    "group_argument",
    "has_default",
    "is_group",
    "is_mpi_comm",
    "same_processes",
    "same_rows",
    "shared_processes",
    "start_agreement",
    "wait_all",
    "wrap",
    "wrap_or_raise",
]
