"""Weighted allreduce and allgatherv on real MPI and gloo jobs of 2, 3 and 4 processes.

The cases themselves live in tests/collective_cases.py and run inside every rank (each rank
checks against a float64 reference and the ranks compare digests for bitwise equality); here
we launch the jobs and check that every case ran. Single-process argument errors are checked
directly.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import collective_cases
import hetcoll
import numpy as np
import pytest
import torch
from hetcoll import launch

HERE = Path(__file__).resolve().parent
EXPECTED = {"allreduce": 80, "aliasing": 3, "mismatch": 4, "allgatherv": 16, "autograd": 1}


@pytest.mark.multiproc
@pytest.mark.parametrize("p", [2, 3, 4])
def test_mpi_all_cases(p):
    proc = launch.mpiexec(p, [str(HERE / "mpi_workers" / "collectives.py")], timeout=240)
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == EXPECTED


@pytest.mark.multiproc
@pytest.mark.parametrize("p", [2, 3, 4])
def test_gloo_all_cases(p):
    assert launch.spawn(collective_cases.run_torch, p, timeout=240) == [EXPECTED] * p


@pytest.mark.multiproc
@pytest.mark.parametrize("algorithm", ["ring", "native"])
def test_mpi_dead_peer_raises_timeout_on_survivors(algorithm):
    # Hydra kills the whole job when one rank dies unless told not to; with auto-cleanup off the
    # survivors must notice by themselves, through the timeout.
    cmd = [
        launch.mpiexec_path(),
        "-disable-auto-cleanup",
        "-n",
        "3",
        sys.executable,
        str(HERE / "mpi_workers" / "dead_peer.py"),
        algorithm,
        "2",
    ]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    elapsed = time.monotonic() - start
    lines = sorted(x for x in proc.stdout.splitlines() if x.startswith("rank"))
    assert [x.split(" after")[0] for x in lines] == [
        "rank 0: CollectiveTimeout",
        "rank 1: CollectiveTimeout",
    ], proc.stdout + proc.stderr
    for x in lines:
        assert 1.9 <= float(x.split("after ")[1].split(" s")[0]) < 5.0
    assert elapsed < 30


def _dead_peer_rank(rank, world, port, algorithm, result_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    buf = hetcoll.allreduce(np.ones(1000), None)  # everybody alive: works
    if rank == world - 1:
        os._exit(3)  # dies without a word, like a killed process
    time.sleep(0.5)
    start = time.monotonic()
    try:
        hetcoll.allreduce(buf, None, algorithm=algorithm, timeout=2.0)
        outcome = "completed"
    except hetcoll.CollectiveTimeout:
        outcome = "CollectiveTimeout"
    with open(result_path, "wb") as f:
        pickle.dump((outcome, time.monotonic() - start), f)


@pytest.mark.multiproc
@pytest.mark.parametrize("algorithm", ["ring", "native"])
def test_gloo_dead_peer_raises_timeout_on_survivors(algorithm):
    ctx = torch.multiprocessing.get_context("spawn")
    port = launch.free_port()
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, f"{r}.pkl") for r in range(3)]
        procs = [
            ctx.Process(target=_dead_peer_rank, args=(r, 3, port, algorithm, paths[r]))
            for r in range(3)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        alive = [p.is_alive() for p in procs]
        for p in procs:
            if p.is_alive():
                p.kill()
        assert alive == [False] * 3
        assert [p.exitcode for p in procs] == [0, 0, 3]
        for path in paths[:2]:
            with open(path, "rb") as f:
                outcome, seconds = pickle.load(f)
            assert outcome == "CollectiveTimeout"
            assert seconds < 5.0


def test_single_process_argument_errors():
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="comm"):
        hetcoll.allreduce(np.ones(3), None)
    with pytest.raises(TypeError, match="comm"):
        hetcoll.allreduce(np.ones(3), "world")
    with pytest.raises(ValueError, match="algorithm"):
        hetcoll.allreduce(np.ones(3), None, algorithm="tree")
    with pytest.raises(ValueError, match="weight"):
        hetcoll.allreduce(np.ones(3), None, weight=float("inf"))
    with pytest.raises(ValueError, match="timeout"):
        hetcoll.allreduce(np.ones(3), None, timeout=0)
    with pytest.raises(TypeError, match="buf"):
        hetcoll.allreduce([1.0, 2.0], None)
    with pytest.raises(ValueError, match="buf: must be C-contiguous"):
        hetcoll.allreduce(np.ones((4, 4))[:, ::2], None)
    with pytest.raises(TypeError, match="buf"):
        hetcoll.allreduce(np.ones(3, np.int32), None)
    with pytest.raises(TypeError, match="local"):
        hetcoll.allgatherv([1, 2], None)


def test_ring_schedule_errors_name_the_argument():
    from hetcoll import _core

    with pytest.raises(ValueError, match="counts"):
        _core.ring_schedule([], 0, 1)
    with pytest.raises(ValueError, match="rank"):
        _core.ring_schedule([1, 2], 2, 1)
    with pytest.raises(ValueError, match="segment"):
        _core.ring_schedule([1, 2], 0, 0)
