"""A pytest plugin (loaded by conftest.py) that keeps a hung multi-process test from hanging the
run: pytest-timeout fails the test by raising in its main thread, but the ranks it started
(Lightning's launcher, plain ``multiprocessing``) are still running, waiting on one another, and
the interpreter's exit joins ``multiprocessing``'s children: the run would hang there until CI's
limit. So the processes a failed test leaves behind are killed when it fails, and whatever is
left when the session ends is killed before the exit joins it."""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Generator

import psutil
import pytest

#: multiprocessing's own servers (the forkserver ``hetcoll.launch.spawn`` starts ranks from,
#: the resource tracker): they serve the next test and end with this process.
SERVERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")


def is_server(p: psutil.Process) -> bool:
    try:
        return any(s in " ".join(p.cmdline()) for s in SERVERS)
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
    if report.when == "call" and report.failed:
        killed = kill_descendants()
        if killed:
            report.sections.append(
                ("reaper", f"killed {len(killed)} processes the test left running: {killed}")
            )
    return report


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    kill_descendants()
