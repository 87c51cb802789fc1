"""torchrun's entry point in tests/test_elastic_torchrun.py: examples/train_elastic.py with one
failure injected, the first time global rank 2 finishes step ``HETCOLL_TEST_FAIL_AT`` (a marker
file, ``HETCOLL_TEST_MARKER``, says it happened; restarts leave it alone). Rank 2 waits until
rank 0 has written that step's checkpoint, so the restart resumes from that step, then
``HETCOLL_TEST_FAIL=worker`` raises (torchrun restarts the group on the same nodes) and
``node`` kills its own torchrun agent and exits (the node is lost: the other agents restart on
the nodes left). ``HETCOLL_TEST_FIRST_WORLD``: the world the run must start on; a start on
fewer ranks before the first checkpoint (an agent slow to join the first rendezvous) waits
until torchrun restarts it with the late node, so the failure always meets the full world."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import train_elastic


def main() -> None:
    args = train_elastic.parse()
    fail_at = int(os.environ["HETCOLL_TEST_FAIL_AT"])
    how = os.environ["HETCOLL_TEST_FAIL"]
    marker = Path(os.environ["HETCOLL_TEST_MARKER"])
    first_world = int(os.environ["HETCOLL_TEST_FIRST_WORLD"])
    if (
        train_elastic.newest_checkpoint(args.checkpoints) is None
        and int(os.environ["WORLD_SIZE"]) < first_world
    ):
        time.sleep(600)  # the agent restarts this worker when the late node has joined

    def after_step(step: int) -> None:
        if step != fail_at or int(os.environ["RANK"]) != 2 or marker.exists():
            return
        marker.write_text(f"rank 2 failed ({how}) after step {step}, agent pid {os.getppid()}\n")
        written = train_elastic.checkpoint_path(args.checkpoints, step)
        deadline = time.monotonic() + 60
        while not written.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if how == "node":
            os.kill(os.getppid(), signal.SIGKILL)  # the torchrun agent: its node is gone
            os._exit(1)
        raise RuntimeError(f"injected failure of rank 2 after step {step}")

    train_elastic.train(args, after_step)


if __name__ == "__main__":
    main()
