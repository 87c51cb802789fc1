"""Shared test set-up: one thread per process, and MPI ranks that yield their core while they
wait, so several ranks share 2 cores fairly; the reaper, which kills the processes a failed
(timed-out) test left running; and the rule that only tests marked ``multiproc`` launch
ranks."""

import contextlib
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import pytest

from hetcoll import launch

from reaper import pytest_runtest_makereport, pytest_sessionfinish

__all__ = ["pytest_runtest_makereport", "pytest_sessionfinish"]

os.environ.setdefault("OMP_NUM_THREADS", "1")
# `make test` runs the multi-rank tests two at a time on the cores, so each MPI job of the suite
# shares them with another: MPICH's waiting ranks yield their core between polls, as
# launch.mpiexec has them do where one job alone has more ranks than cores (by default they
# spin, taking the core that the rank they wait for, or the other job, needs).
for _name, _value in launch.OVERSUBSCRIBED_MPICH.items():
    os.environ.setdefault(_name, _value)


@pytest.fixture(autouse=True)
def ranks_only_where_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """`make test` runs the tests not marked ``multiproc`` one per core, at the same time, and
    the multiproc tests after them, two at a time: one launching ranks in the first part
    (``launch.spawn``, ``launch.mpiexec``, or a port for a rendezvous) would crowd its ranks
    onto a core another test holds. Such a launch raises, naming the mark."""
    if request.node.get_closest_marker("multiproc") is None:

        def refuse(*_: object, **__: object) -> None:
            raise RuntimeError(f"{request.node.nodeid} launches ranks: mark it multiproc")

        monkeypatch.setattr(launch, "free_port", refuse)
        monkeypatch.setattr(launch, "mpiexec_path", refuse)


@pytest.fixture(autouse=True)
def no_default_group_left() -> Iterator[None]:
    """A test that leaves torch.distributed's default group initialised in this process
    changes what ``group=None`` means for every later test on its pytest worker: it fails,
    named here, rather than a later test that expects no group. (MPI, once initialised, stays
    so: Lightning's environment detection initialises it when it imports mpi4py, which the
    modules running Lightning in this process turn off.)"""
    import torch.distributed as dist

    before = dist.is_initialized()
    yield
    if not before and dist.is_initialized():
        pytest.fail("the test left torch.distributed's default group initialised")


def _group_of_one() -> Iterator[None]:
    """torch.distributed's default group of this process alone, over gloo and an in-memory
    store (no port), until the generator ends."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


#: The group of one for one module's tests.
one_rank = pytest.fixture(scope="module", name="one_rank")(_group_of_one)
#: The group of one for one test, where the module's other tests must run outside any group
#: (tests forking ranks, which would inherit it).
one_rank_for_a_test = pytest.fixture(name="one_rank_for_a_test")(_group_of_one)


@pytest.fixture
def group_of_one() -> Callable[[], AbstractContextManager[None]]:
    """The group of one for a ``with`` block, where a test also runs outside any group."""
    return contextlib.contextmanager(_group_of_one)


@pytest.fixture
def lightning_without_mpi(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's Trainer detects its cluster environment, and MPI's detection imports
    mpi4py, which initialises MPI in this process: every later test there would find an MPI
    world of one as hetcoll's default group. For Trainers that run in this process (forking
    their ranks, never under mpiexec), that detection is off."""
    from lightning.fabric.plugins.environments import MPIEnvironment

    monkeypatch.setattr(MPIEnvironment, "detect", staticmethod(lambda: False))
