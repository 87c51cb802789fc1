"""A pytest plugin (loaded by conftest.py) that keeps a hung multi-process test from hanging the
run: pytest-timeout fails the test by raising in its main thread, but the ranks it started
(Lightning's launcher, plain ``multiprocessing``, torchrun's workers) are still running, waiting
on one another, and the interpreter's exit joins ``multiprocessing``'s children: the run would
hang there until CI's limit. So the processes a failed test (its set-up, call or tear-down)
leaves behind are killed when it fails, and whatever is left when the session ends is killed
before the exit joins it.

A launcher killed by the timeout (``subprocess.run`` kills its child when interrupted) leaves
its workers to the system (torchrun starts them in sessions of their own), where no walk of
this process's children finds them: this process is made their subreaper (Linux), so they stay
its descendants."""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import sys
from collections.abc import Generator

import psutil
import pytest

#: multiprocessing's own servers (the forkserver ``hetcoll.launch.spawn`` starts ranks from,
#: the resource tracker), children of this process: they serve the next test and end with this
#: process. The ranks the forkserver forks carry its command line, and are killed.
SERVERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")
PR_SET_CHILD_SUBREAPER = 36

if sys.platform.startswith("linux"):
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def is_server(p: psutil.Process) -> bool:
    try:
        return p.ppid() == os.getpid() and any(s in " ".join(p.cmdline()) for s in SERVERS)
    except psutil.Error:
        return False


def kill_descendants() -> list[int]:
    """Kill every process this one started, and theirs (multiprocessing's servers aside);
    reap them. Returns their pids."""
    procs = [p for p in psutil.Process().children(recursive=True) if not is_server(p)]
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(procs, timeout=10)
    multiprocessing.active_children()  # joins multiprocessing's own, now ended
    return [p.pid for p in procs]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed:
        killed = kill_descendants()
        if killed:
            report.sections.append(
                ("reaper", f"killed {len(killed)} processes the test left running: {killed}")
            )
    return report


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    kill_descendants()
