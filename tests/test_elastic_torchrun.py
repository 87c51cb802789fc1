"""Elastic restarts under torchrun (issue 29): examples/train_elastic.py checkpoints every step
and resumes from the newest checkpoint with the shares re-solved for the ranks of each start.
A worker fails once mid-run (tests/elastic_workers/torchrun_worker.py), or a node is lost, and
torchrun (``--nnodes=1:3 --max-restarts=1``, c10d rendezvous on localhost) restarts the group;
the final weights equal one uninterrupted process in float64 (to 1e-10).

Every launch runs under a timeout and is killed, agents and workers, when it passes: a failure
fails the test instead of hanging it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hetcoll.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "elastic_workers" / "torchrun_worker.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
# Each epoch is 6 full steps and a small one (2 epochs): the worker fails after the first epoch's
# last step (the restart begins the next epoch), the node is lost mid-epoch.
WORKER_FAILS_AT, NODE_LOST_AT = 7, 4
TIMEOUT = 240.0

sys.path.insert(0, str(ROOT / "examples"))
import train_elastic  # noqa: E402

pytestmark = pytest.mark.multiproc


def _env(tmp_path: Path, how: str, fail_at: int, first_world: int) -> dict[str, str]:
    # The agents' shared TCPStore outlives a restart with the last attempt's keys, and gloo
    # may read a dead peer's address from them (pytorch #135712): one store per rendezvous.
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(
        HETCOLL_TEST_FAIL=how,
        HETCOLL_TEST_FAIL_AT=str(fail_at),
        HETCOLL_TEST_MARKER=str(tmp_path / "failed.txt"),
        HETCOLL_TEST_FIRST_WORLD=str(first_world),
    )
    return env


def _launch(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    # A session of its own: a timeout kills the agent and its workers together.
    with open(log, "w") as out:
        return subprocess.Popen(
            [str(TORCHRUN), *argv], env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


def _wait(procs: list[subprocess.Popen], logs: list[Path]) -> list[int]:
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=TIMEOUT))
    except subprocess.TimeoutExpired:
        tails = "\n".join(f"--- {log}\n{log.read_text()[-3000:]}" for log in logs)
        pytest.fail(f"torchrun still running after {TIMEOUT:.0f} s, killed\n{tails}")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return codes


def _reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, torch.Tensor]:
    """One process, every step, the same global batches."""
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    args = train_elastic.parse(["--checkpoints", str(tmp_path / "reference"), "--speed", "1"])
    return train_elastic.train(args)


def _starts(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "starts.jsonl").read_text().splitlines()]


def _assert_exact(directory: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    final = torch.load(directory / "final.pt", weights_only=True)
    for k, want in _reference(tmp_path, monkeypatch).items():
        torch.testing.assert_close(final[k], want, rtol=0, atol=1e-10)
        assert final[k].dtype == torch.float64


def test_torchrun_restarts_the_group_after_a_worker_fails(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    log = tmp_path / "torchrun.log"
    argv = [
        "--nnodes=1:3", "--nproc-per-node=3", "--max-restarts=1", "--monitor-interval=0.5",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=worker",
        "--rdzv-conf=last_call_timeout=1",
        str(WORKER), "--checkpoints", str(ckpt), "--speed", "1,1,2", "--timeout", "60",
    ]  # fmt: skip
    codes = _wait([_launch(argv, _env(tmp_path, "worker", WORKER_FAILS_AT, 3), log)], [log])
    assert codes == [0], log.read_text()[-3000:]
    assert (tmp_path / "failed.txt").exists()  # the failure happened
    starts = _starts(ckpt)
    assert [(s["world"], s["resumed_from"], s["restart"]) for s in starts] == [
        (3, 0, 0),
        (3, WORKER_FAILS_AT, 1),
    ], starts
    _assert_exact(ckpt, tmp_path, monkeypatch)


def test_torchrun_loses_a_node_and_resumes_on_two_ranks(tmp_path, monkeypatch):
    """Three agents (nodes) of one rank each; rank 2's agent is killed after step 4; the
    other two re-rendezvous (``--nnodes=1:3``) and resume on 2 ranks with shares re-solved.
    The rendezvous store is this test's own (``is_host=0`` on every agent), so whichever node
    is lost, the store stays."""
    store = torch.distributed.TCPStore(
        "127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False
    )
    ckpt = tmp_path / "ckpt"
    env = _env(tmp_path, "node", NODE_LOST_AT, 3)
    procs, logs = [], []
    for node, speed in enumerate(("1", "1", "2")):
        argv = [
            "--nnodes=1:3", "--nproc-per-node=1", "--max-restarts=1", "--monitor-interval=0.5",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{store.port}", "--rdzv-id=node",
            "--rdzv-conf=is_host=0,last_call_timeout=3,keep_alive_interval=1,"
            "keep_alive_max_attempt=3,join_timeout=120",
            str(WORKER), "--checkpoints", str(ckpt), "--speed", speed, "--timeout", "60",
        ]  # fmt: skip
        logs.append(tmp_path / f"agent{node}.log")
        procs.append(_launch(argv, env, logs[-1]))
    codes = _wait(procs, logs)
    tails = "\n".join(f"--- {log}\n{log.read_text()[-3000:]}" for log in logs)
    assert sorted(codes) == [-signal.SIGKILL, 0, 0], (codes, tails)
    starts = _starts(ckpt)
    assert starts[0]["world"] == 3 and starts[0]["resumed_from"] == 0, starts
    assert starts[-1]["world"] == 2 and starts[-1]["resumed_from"] == NODE_LOST_AT, starts
    assert len(starts[-1]["shares"]) == 2 and sum(starts[-1]["shares"]) == 8, starts
    _assert_exact(ckpt, tmp_path, monkeypatch)
