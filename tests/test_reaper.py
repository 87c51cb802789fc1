"""The test harness's reaper (tests/reaper.py): a multi-process test that hangs fails at
pytest-timeout's limit and the run goes on and ends, its processes killed. Without it, the
interpreter's exit joined the hung ranks for ever (seen with Lightning's launcher)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil

HUNG = """
import multiprocessing
import os
import time


def wait_for_ever():
    time.sleep(3600)


def test_hangs(tmp_path):
    ctx = multiprocessing.get_context("fork")
    rank = ctx.Process(target=wait_for_ever, daemon=False)  # as Lightning starts its ranks
    rank.start()
    with open(os.environ["RANK_PID_FILE"], "w") as f:
        f.write(str(rank.pid))
    rank.join()


def test_after():
    pass
"""


def test_a_hung_multiprocess_test_fails_at_its_timeout_and_the_run_ends(tmp_path: Path) -> None:
    (tmp_path / "test_hung.py").write_text(textwrap.dedent(HUNG))
    pid_file = tmp_path / "rank.pid"
    env = {
        **os.environ,
        "RANK_PID_FILE": str(pid_file),
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
        ),
    }
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "reaper",
         "--timeout", "5", "--rootdir", str(tmp_path), str(tmp_path / "test_hung.py")],
        env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert "1 failed, 1 passed" in run.stdout, run.stdout + run.stderr
    rank = int(pid_file.read_text())
    assert f"killed 1 processes the test left running: [{rank}]" in run.stdout
    assert not psutil.pid_exists(rank) or psutil.Process(rank).status() == psutil.STATUS_ZOMBIE
