"""Which engine a call runs on: :func:`wrap` turns what the caller passed (an mpi4py
communicator, a torch.distributed process group, a Communicator, or None: torch's default
group, else ``MPI.COMM_WORLD`` under mpiexec) into a :class:`~hetcoll.comm.Communicator`;
:func:`group_argument` takes the ``group=`` keyword and its older names."""

from __future__ import annotations

import os
import sys
import warnings
import weakref
from typing import Any

from hetcoll.comm.base import Communicator, deadline
from hetcoll.comm.distributed import TorchCommunicator
from hetcoll.comm.mpi import MpiCommunicator


def is_mpi_comm(x: object) -> bool:
    """Whether ``x`` is an mpi4py communicator (without importing mpi4py)."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and isinstance(x, mpi.Comm)


# One wrapper per process group, kept while the group lives: wrapping is on every collective's
# path (the default group's wrapper asks torch for rank, size and backend), and a group's rank,
# size and backend never change. Keyed by the group object itself (the default group's
# object for None), so a group destroyed and created anew gets a new wrapper.
_torch_wrappers: weakref.WeakKeyDictionary[Any, TorchCommunicator] = weakref.WeakKeyDictionary()


def _torch_communicator(group: Any) -> TorchCommunicator:
    import torch.distributed as dist

    key = dist.group.WORLD if group is None else group
    c = _torch_wrappers.get(key)
    if c is None:
        c = _torch_wrappers[key] = TorchCommunicator(group)
    return c


#: Environment variables that mpiexec (MPICH / Hydra, Intel MPI, Open MPI, PMIx, MVAPICH)
#: sets in every rank it starts.
MPI_LAUNCHER_VARIABLES = (
    "PMI_RANK",
    "PMI_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "PMIX_RANK",
    "MV2_COMM_WORLD_RANK",
)

#: What a public function was called with when it was not given a deprecated keyword.
NOT_GIVEN: Any = type("NotGiven", (), {"__repr__": lambda self: "NOT_GIVEN"})()


def _torch_default() -> bool:
    dist = sys.modules.get("torch.distributed")  # not imported: it cannot be initialised
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def _under_mpi() -> bool:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return True
    return any(v in os.environ for v in MPI_LAUNCHER_VARIABLES)


def has_default() -> bool:
    """Whether ``group=None`` means a communicator here (see :func:`wrap`), without raising."""
    return _torch_default() or _under_mpi()


def wrap_or_raise(group: Any, failure: BaseException | None) -> Communicator:
    """:func:`wrap` of ``group`` for a collective that found ``failure`` (this rank's own
    argument error) before it could communicate: the caller then tells the other ranks
    (:func:`~hetcoll.comm.agree` with ``failure=``). Where ``group`` is no group there is no
    one to tell, and ``failure``, if any, is raised first (else the group's own error)."""
    try:
        return wrap(group)
    except (TypeError, ValueError):
        if failure is not None:
            raise failure from None
        raise


def deadline_or_failure(timeout: Any, group: Any) -> tuple[float | None, ValueError | None]:
    """The :func:`~hetcoll.comm.deadline` of ``timeout`` and None, or, for a bad ``timeout``,
    None and its error, for the caller to tell the other ranks in its first exchange (which
    then waits without a deadline). On MPI, or where ``group`` is no group, the error is raised
    here, alone: a rank without a deadline waits in MPI's blocking calls, which ranks polling
    nonblocking ones never match."""
    try:
        return deadline(timeout), None
    except ValueError as e:
        try:
            engine = wrap(group).engine
        except (TypeError, ValueError):
            raise e from None
        if engine == "mpi":
            raise
        return None, e


def wrap(x: Any = None) -> Communicator:
    """A :class:`Communicator` over ``x``: an mpi4py communicator, a torch.distributed process
    group, a Communicator (returned as is), or None, the default of every public function of
    hetcoll that takes ``group=``, decided here only:

    1. torch.distributed's default group, when torch.distributed is initialised;
    2. else ``MPI.COMM_WORLD``, when mpi4py has initialised MPI or the process was started by
       mpiexec (:data:`MPI_LAUNCHER_VARIABLES`);
    3. else a ``ValueError`` naming ``group``.

    >>> import torch.distributed as dist  # doctest: +SKIP
    >>> wrap(None).size == dist.get_world_size()  # doctest: +SKIP
    True
    """
    if isinstance(x, Communicator):
        return x
    if x is None:
        if _torch_default():
            return _torch_communicator(None)
        if _under_mpi():
            from mpi4py import MPI

            return MpiCommunicator(MPI.COMM_WORLD)
        raise ValueError(
            "group: none given and no default: torch.distributed is not initialised "
            "(init_process_group) and this is no MPI job (mpiexec); pass group= an mpi4py "
            "communicator or a torch.distributed process group"
        )
    outside = (
        "group: this rank is not a member of the group ({}); call with a group only on its members"
    )
    if is_mpi_comm(x):
        mpi = sys.modules["mpi4py.MPI"]
        if x == mpi.COMM_NULL:
            raise ValueError(outside.format("MPI.COMM_NULL, as comm.Split gives a rank left out"))
        if not isinstance(x, mpi.Intracomm):
            raise TypeError("group: an MPI intercommunicator is not supported")
        return MpiCommunicator(x)
    torch_dist = sys.modules.get("torch.distributed")
    if torch_dist is not None and type(x) is int and x == torch_dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(outside.format("GroupMember.NON_GROUP_MEMBER, as new_group gives it"))
    if torch_dist is not None and isinstance(x, torch_dist.ProcessGroup):
        if not torch_dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialised (init_process_group)")
        return _torch_communicator(x)
    raise _not_a_group(x)


def _not_a_group(x: object) -> TypeError:
    return TypeError(
        "group: must be an mpi4py communicator, a torch.distributed ProcessGroup, None or a "
        f"hetcoll Communicator, got {type(x).__name__}"
    )


def is_group(x: object) -> bool:
    """Whether ``x`` is what :func:`wrap` takes as a group (None aside): a
    :class:`Communicator`, an mpi4py communicator, a torch.distributed process group, or torch's
    mark of a rank outside a group (``GroupMember.NON_GROUP_MEMBER``, which :func:`wrap`
    refuses by name)."""
    if isinstance(x, Communicator) or is_mpi_comm(x):
        return True
    torch_dist = sys.modules.get("torch.distributed")
    if torch_dist is None or not torch_dist.is_available():
        return False
    if type(x) is int and x == torch_dist.GroupMember.NON_GROUP_MEMBER:
        return True
    return isinstance(x, torch_dist.ProcessGroup)


def same_processes(a: Communicator, b: Communicator) -> bool:
    """Whether ``a`` and ``b`` hold the same processes in the same rank order (their engines'
    groups may be distinct objects: a group made twice over the same ranks). Local."""
    for name, c in (("a", a), ("b", b)):
        if not isinstance(c, Communicator):
            raise TypeError(f"{name}: must be a hetcoll.comm.Communicator, got {type(c).__name__}")
    if a.native is b.native:
        return True
    if a.engine == "mpi" or b.engine == "mpi":
        if a.engine != b.engine:
            return False
        mpi = sys.modules["mpi4py.MPI"]
        return bool(mpi.Comm.Compare(a.native, b.native) in (mpi.IDENT, mpi.CONGRUENT))
    return global_ranks(a) == global_ranks(b)


def shared_processes(a: Communicator, b: Communicator) -> list[int] | None:
    """The processes ``a`` and ``b`` both hold, by their global ranks (torch.distributed's
    default group, or MPI's ``COMM_WORLD``), ascending; None where one is MPI's and the other
    torch.distributed's (no local way to tell). Local."""
    if a.engine == "mpi" or b.engine == "mpi":
        if a.engine != b.engine:
            return None
        mpi = sys.modules["mpi4py.MPI"]
        world = mpi.COMM_WORLD.Get_group()
        held = []
        for c in (a, b):
            group = c.native.Get_group()
            try:
                held.append(set(mpi.Group.Translate_ranks(group, range(group.Get_size()), world)))
            finally:
                group.Free()
        world.Free()
        return sorted(held[0] & held[1])
    return sorted(set(global_ranks(a)).intersection(global_ranks(b)))


def global_ranks(c: Communicator) -> list[int]:
    """The default group's ranks of a torch.distributed communicator's processes, in its
    rank order (``c`` may wrap one, as a counting communicator does)."""
    torch_comm = wrap(c.native)
    if not isinstance(torch_comm, TorchCommunicator):
        raise TypeError(f"c: a torch.distributed communicator, got engine {c.engine!r}")
    return torch_comm.global_ranks


def group_argument(group: Any, where: str, **old: Any) -> Any:
    """``group``, or the value of a deprecated keyword that named it before (``comm=`` ...;
    pass ``name=value`` with :data:`NOT_GIVEN` as the keyword's default): that one still works
    for one release, with a ``DeprecationWarning``. Both at once is a ``ValueError``.

    >>> group_argument(None, "f", comm=NOT_GIVEN) is None
    True
    """
    given = {k: v for k, v in old.items() if v is not NOT_GIVEN}
    if not given:
        # Checked here too: a caller that wraps the group only later (a hook's first step, a
        # sampler that never verifies) once held a str as its group.
        if group is not None and not is_group(group):
            raise _not_a_group(group)
        return group
    name, value = next(iter(given.items()))
    warnings.warn(
        f"{where}({name}=...) is now {where}(group=...); {name}= goes in the next release",
        DeprecationWarning,
        stacklevel=3,
    )
    if group is not None:
        raise ValueError(f"group: give group= or the deprecated {name}=, not both")
    return value
