"""The test harness's reaper (tests/reaper.py): a multi-process test that hangs fails at
pytest-timeout's limit and the run goes on and ends, its processes killed. Without it, the
interpreter's exit joined the hung ranks for ever (seen with Lightning's launcher), and a
launcher killed by the timeout left its workers running (torchrun's, in sessions of their
own)."""

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
import subprocess
import sys
import time

AWAY = (
    "import subprocess, sys, time; "
    "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)'], "
    "start_new_session=True); "
    "open(sys.argv[1], 'w').write(str(w.pid)); time.sleep(3600)"
)


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


def test_hangs_in_a_launcher():
    # As torchrun under subprocess.run: the timeout kills the launcher, its worker (in a
    # session of its own) is left running.
    subprocess.run([sys.executable, "-c", AWAY, os.environ["WORKER_PID_FILE"]])
"""


def test_hung_multiprocess_tests_fail_at_their_timeout_and_the_run_ends(tmp_path: Path) -> None:
    (tmp_path / "test_hung.py").write_text(textwrap.dedent(HUNG))
    rank_file, worker_file = tmp_path / "rank.pid", tmp_path / "worker.pid"
    env = {
        **os.environ,
        "RANK_PID_FILE": str(rank_file),
        "WORKER_PID_FILE": str(worker_file),
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
        ),
    }
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "reaper",
         "--timeout", "3", "--rootdir", str(tmp_path), str(tmp_path / "test_hung.py")],
        env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert "2 failed, 1 passed" in run.stdout, run.stdout + run.stderr
    rank, worker = int(rank_file.read_text()), int(worker_file.read_text())
    assert f"killed 1 processes the test left running: [{rank}]" in run.stdout
    assert f"killed 1 processes the test left running: [{worker}]" in run.stdout
    for pid in (rank, worker):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
