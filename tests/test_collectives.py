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
import re
import subprocess
import sys
import tempfile
import time
from collections import deque
from datetime import timedelta
from pathlib import Path

import collective_cases
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import hetcoll
from hetcoll import collectives, launch
from hetcoll.collectives import _tuning, speculative

HERE = Path(__file__).resolve().parent
EXPECTED = {
    "allreduce": 106,
    "auto": 1,
    "sweep": 12,
    "aliasing": 3,
    "mismatch": 10,
    "shared": 2,
    "allgatherv": 20,
    "speculative": 24,
    "allgatherv_out": 17,
    "alltoallv": 1,
    "autograd": 1,
}


#: MPI adds "shared": 7 lengths x 4 dtypes in check_allreduce, the headers' own mismatch
#: check (3: length, dtype, speeds), and in check_shared 2 x 4 x 5 allreduces, 4 allgathervs
#: through small windows and 2 "auto" allgathervs on either side of SHARED_GATHER_BELOW_BYTES.
EXPECTED_MPI = {**EXPECTED, "allreduce": 134, "mismatch": 13, "shared": 46}


def _expected_per_rank(expected: dict[str, int]) -> list[dict[int, dict[str, int]]]:
    return [
        {p: expected for p, members in collective_cases.GROUPS.items() if r in members}
        for r in range(4)
    ]


@pytest.mark.multiproc
def test_mpi_all_cases_on_2_3_and_4_ranks():
    proc = launch.mpiexec(4, [str(HERE / "mpi_workers" / "collectives.py")], timeout=240)
    (per_rank,) = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("[")]
    got = [{int(p): c for p, c in counts.items()} for counts in per_rank]
    assert got == _expected_per_rank(EXPECTED_MPI)


@pytest.mark.multiproc
def test_gloo_all_cases_on_2_3_and_4_ranks():
    assert launch.spawn(collective_cases.run_torch, 4, timeout=240) == _expected_per_rank(EXPECTED)


def _timeout_lines(stdout: str) -> list[str]:
    # mpiexec forwards each rank's output on its own; two ranks' lines can run together, so
    # the reports are picked out of the whole text rather than line by line.
    return sorted(re.findall(r"rank \d+ \w+: \w+(?: after [\d.]+ s)?", stdout))


def _mpich_shm_files() -> set[Path]:
    shm = Path("/dev/shm")
    return set(shm.glob("mpich_shm_*")) if shm.is_dir() else set()


@pytest.mark.multiproc
def test_mpi_dead_peer_raises_timeout_on_survivors():
    # Hydra kills the whole job when one rank dies unless told not to; with auto-cleanup off the
    # survivors must notice by themselves, through the timeout.
    cmd = [
        launch.mpiexec_path(),
        "-disable-auto-cleanup",
        "-n",
        "3",
        sys.executable,
        str(HERE / "mpi_workers" / "dead_peer.py"),
        "1",
    ]
    start = time.monotonic()
    before = _mpich_shm_files()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    finally:
        # Ranks that leave with os._exit never tear down MPICH's shared-memory segment; the
        # job is over, so the files it left in /dev/shm belong to no one.
        for path in _mpich_shm_files() - before:
            path.unlink(missing_ok=True)
    elapsed = time.monotonic() - start
    lines = _timeout_lines(proc.stdout)
    assert [x.split(" after")[0] for x in lines] == [
        f"rank {r} {a}: CollectiveTimeout"
        for r in (0, 1)
        for a in ("direct", "native", "ring", "shared")
    ], proc.stdout + proc.stderr
    # The 1 s timeout fired (or MPI reported the lost peer earlier) instead of a hang. The bound
    # is loose on purpose: it tells a timeout from a hang, not how fast a busy host wakes up.
    for x in lines:
        assert float(x.split("after ")[1].split(" s")[0]) < 30.0, proc.stdout
    assert elapsed < 60


def _dead_peer_rank(rank, world, port, result_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    buf = hetcoll.allreduce(np.ones(1000), None)  # everybody alive: works
    if rank == world - 1:
        os._exit(3)  # dies without a word, like a killed process
    time.sleep(0.5)
    outcomes = []
    for algorithm in ("ring", "native", "direct"):
        start = time.monotonic()
        try:
            hetcoll.allreduce(buf, None, algorithm=algorithm, timeout=2.0)
            outcomes.append(("completed", time.monotonic() - start))
        except hetcoll.CollectiveTimeout:
            outcomes.append(("CollectiveTimeout", time.monotonic() - start))
    with open(result_path, "wb") as f:
        pickle.dump(outcomes, f)
    # Leave without tearing the process group down: with a peer gone, PyTorch's gloo teardown
    # sometimes aborts the process (SIGABRT) after hetcoll has already raised and returned.
    os._exit(0)


@pytest.mark.multiproc
def test_gloo_dead_peer_raises_timeout_on_survivors():
    exits, results = _with_a_dying_rank(_dead_peer_rank, 3)
    assert exits == [0, 0, 3]
    for outcomes in results[:2]:
        # gloo notices the closed connection at once; the timeout bounds the wait otherwise.
        # A loose bound: it tells a timeout from a hang, not how fast a busy host wakes up.
        assert [o for o, _ in outcomes] == ["CollectiveTimeout"] * 3
        assert all(seconds < 30.0 for _, seconds in outcomes)


def _with_a_dying_rank(target, world: int) -> tuple[list[int | None], list[object]]:
    """``target(rank, world, port, result_path)`` on ``world`` spawned processes, the last of
    which dies (exit code 3) while the others pickle their outcomes: every exit code (None for
    a process still alive after 90 s, killed) and the survivors' outcomes."""
    ctx = torch.multiprocessing.get_context("spawn")
    port = launch.free_port()
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, f"{r}.pkl") for r in range(world)]
        procs = [ctx.Process(target=target, args=(r, world, port, paths[r])) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(90)
        exits = [None if p.is_alive() else p.exitcode for p in procs]
        for p in procs:
            if p.is_alive():
                p.kill()
        results = []
        for path in paths[:-1]:
            with open(path, "rb") as f:
                results.append(pickle.load(f))
    return exits, results


def _hook_dead_peer_rank(rank, world, port, result_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    from hetcoll.torch import register_weighted_hook

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.02)  # a bucket each
    register_weighted_hook(ddp, algorithm="direct")
    ddp(torch.randn(3 + rank, 64)).sum().backward()  # everybody alive: works
    if rank == world - 1:  # dies in its backward, after its last layers' buckets went out
        model[0].weight.register_hook(lambda _: os._exit(3))
    try:
        ddp(torch.randn(3 + rank, 64)).sum().backward()
        outcome = "completed"
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    with open(result_path, "wb") as f:
        pickle.dump(outcome, f)
    os._exit(0)  # no teardown with a peer gone (see _dead_peer_rank)


@pytest.mark.multiproc
def test_a_dead_peer_under_the_ddp_hook_raises_a_timeout_the_backward_names():
    # The direct exchange's worker thread set its CollectiveTimeout on the bucket's future,
    # which DDP's reducer read in C++ as the bucket's value: "Unable to cast ... to Tensor".
    # DDP's backward raises RuntimeError for any error of a hook's future; its message now
    # names the timeout and the lost peer.
    exits, (outcome,) = _with_a_dying_rank(_hook_dead_peer_rank, 2)
    assert exits == [0, 3]
    assert isinstance(outcome, str)
    assert outcome.startswith("RuntimeError: "), outcome
    assert "CollectiveTimeout: receive from rank 1" in outcome, outcome
    assert "Unable to cast" not in outcome, outcome


def test_single_process_argument_errors():
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="group: none given and no default"):
        hetcoll.allreduce(np.ones(3), None)
    with pytest.raises(TypeError, match="group"):
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
    # Refused by name, before the group's own error: each escaped as numpy's or torch's own
    # (a RuntimeError, which a rank did not tell its peers) or, for a 0-d numpy array, was
    # gathered as one row (np.ascontiguousarray makes it 1-d).
    with pytest.raises(ValueError, match=r"^local: must have at least one dimension"):
        hetcoll.allgatherv(np.array(1.0), None)
    with pytest.raises(TypeError, match=r"^local: dtype torch.float8_e4m3fn"):
        hetcoll.allgatherv(torch.ones(3).to(torch.float8_e4m3fn), None)
    with pytest.raises(ValueError, match=r"^local: must be a dense .* nested"):
        hetcoll.allgatherv(torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), None)
    lazy = torch.ones(2, dtype=torch.complex64)
    with pytest.raises(ValueError, match=r"^out: has its conjugate or negative bit"):
        hetcoll.allgatherv(lazy, None, out=torch.zeros(2, dtype=torch.complex64).conj())
    with pytest.raises(ValueError, match=r"^buf: has its negative bit set"):
        hetcoll.allreduce(lazy.conj().imag, None)


class _FourGlooRanks:
    """What choose_algorithm reads of a communicator: four gloo ranks, no shared memory."""

    size, engine = 4, "gloo"

    def node_windows(self, capacity, deadline=None):
        return None


def test_tuning_table_is_read_at_call_time_and_rebound_through_the_package(monkeypatch):
    # Every public tuning name reads the private table; rebinding it in either place reaches
    # the algorithms on their next call (they look the table up then, never copy it).
    tuning = {name for name in vars(_tuning) if name.isupper()}
    assert tuning <= set(collectives.__all__) <= tuning | set(dir(collectives))
    for name in tuning:
        assert getattr(collectives, name) is getattr(_tuning, name)
    four = _FourGlooRanks()
    assert collectives.choose_algorithm(four, 1 << 20, False) == "direct"  # type: ignore[arg-type]
    with monkeypatch.context() as m:
        m.setattr(_tuning, "DIRECT_BYTES", {"gloo": 0})
        assert collectives.choose_algorithm(four, 1 << 20, False) == "native"  # type: ignore[arg-type]
    records = deque([(1, 2), (3, 4), (1, 2), (3, 4)])
    assert speculative._predict(records, 2) == (1, 2)
    with monkeypatch.context() as m:
        m.setattr(collectives, "GATHER_PERIODS", 1)  # the package forwards it to the table
        assert _tuning.GATHER_PERIODS == collectives.GATHER_PERIODS == 1
        assert "GATHER_PERIODS" not in vars(collectives)
        assert speculative._predict(records, 2) == (3, 4)
    assert _tuning.GATHER_PERIODS == 16
    assert collectives.choose_algorithm(four, 1 << 20, False) == "direct"  # type: ignore[arg-type]
    with pytest.raises(AttributeError, match="NO_SUCH_BYTES"):
        _ = collectives.NO_SUCH_BYTES  # type: ignore[attr-defined]


def test_ring_schedule_errors_name_the_argument():
    from hetcoll import _core

    with pytest.raises(ValueError, match="counts"):
        _core.ring_schedule([], 0, 1)
    with pytest.raises(ValueError, match="rank"):
        _core.ring_schedule([1, 2], 2, 1)
    with pytest.raises(ValueError, match="segment"):
        _core.ring_schedule([1, 2], 0, 0)


@given(
    pattern=st.lists(
        st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=16, unique=True
    ),
    repeats=st.integers(2, 3),
    extra=st.integers(0, 15),
)
def test_prediction_follows_a_repeating_pattern_of_gathers(pattern, repeats, extra):
    # allgatherv's speculative round sends what _predict returns: after a pattern of gathers
    # has repeated (twice or more), the next gather is predicted exactly, whatever the phase.
    extra %= len(pattern)
    seq = pattern * repeats + pattern[:extra]
    history: deque[tuple[int, ...]] = deque(maxlen=2 * _tuning.GATHER_PERIODS)
    history.extend(seq)
    assert speculative._predict(history, 2) == pattern[extra]


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), max_size=40))
def test_prediction_is_a_past_gather_or_nothing(records):
    history: deque[tuple[int, ...]] = deque(maxlen=2 * _tuning.GATHER_PERIODS)
    history.extend(records)
    guess = speculative._predict(history, 2)
    assert guess in history or (guess == (0, 0) and not history)


def _one_rank_bad_timeout(rank, world):
    """Rank 1 alone passes a bad timeout: allgatherv and allgatherv_autograd raised it alone
    and rank 0 waited in the gather (allreduce told it already)."""
    from hetcoll.collectives import allgatherv_autograd

    bad = -1.0 if rank == 1 else 10.0
    calls = {
        "allgatherv": lambda: hetcoll.allgatherv(np.arange(rank + 1.0), timeout=bad),
        "allgatherv_autograd": lambda: allgatherv_autograd(torch.ones(rank + 1), timeout=bad),
        "allreduce": lambda: hetcoll.allreduce(np.ones(3), timeout=bad),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "no error"
        except (ValueError, TypeError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    buf = np.full(2, rank + 1.0)
    hetcoll.allreduce(buf)  # the group still works
    out["after"] = buf.tolist()
    return out


@pytest.mark.multiproc
def test_a_bad_timeout_on_one_rank_raises_on_every_rank():
    per_rank = launch.spawn(_one_rank_bad_timeout, 2, timeout=20)
    own = "ValueError: timeout: must be a number of seconds > 0 or None, got -1.0"
    for name in ("allgatherv", "allgatherv_autograd", "allreduce"):
        assert per_rank[0][name] == f"CollectiveMismatchError: rank 1 raised {own} (the call " + (
            "was abandoned on every rank)"
        ), (name, per_rank[0][name])
        assert per_rank[1][name] == own, (name, per_rank[1][name])
    assert [o["after"] for o in per_rank] == [[3.0, 3.0]] * 2


def _numbers_past_int64_and_float(rank: int, world: int) -> dict[str, str]:
    """Each call's outcome on a one-rank gloo group: its error, or "ok"."""
    from hetcoll.comm import agree, wrap

    x = np.ones(4)
    calls = {
        "weight": lambda: hetcoll.allreduce(x, None, weight=2**1100),
        "segment_bytes": lambda: hetcoll.allreduce(x, None, segment_bytes=2**70),
        "timeout": lambda: hetcoll.allreduce(x, None, timeout=2**2000),
        "agree": lambda: agree(wrap(None), {"length": 2**70}),
        "agree_type": lambda: agree(wrap(None), {"length": "4"}),  # type: ignore[dict-item]
        "scale": lambda: hetcoll.fusion.pack([x], scale=2**1100),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "ok"
        except Exception as e:
            out[name] = f"{type(e).__name__}: {str(e)[:60]}"
    return out


@pytest.mark.multiproc
def test_numbers_past_int64_and_float_are_named_not_overflowed():
    """Integers too large for an int64 or a float once raised OverflowError from numpy or
    float() inside the collectives; a timeout past float's range is no limit, as inf is."""
    (got,) = launch.spawn(_numbers_past_int64_and_float, 1, timeout=60)
    expected = {
        "weight": "ValueError: weight: must be finite, got 13582985",
        "segment_bytes": "ValueError: segment_bytes: must be an integer in [1, 2**62) or None",
        "timeout": "ok",
        "agree": "ValueError: fields['length']: must fit in 64 bits, got 11805916",
        "agree_type": "TypeError: fields['length']: must be an integer, got '4'",
        "scale": "ValueError: scale: must be finite, got 13582985",
    }
    assert got.keys() == expected.keys()
    for name, want in expected.items():
        assert got[name].startswith(want), (name, got[name])


def test_speeds_that_are_no_list_are_named():
    """A dict's keys were read as the speeds; an int raised "has no len()"."""
    from hetcoll.collectives._common import _counts

    assert _counts(10, 2, [1.0, 2.0]) == _counts(10, 2, np.array([1.0, 2.0])) == [3, 7]
    for bad in (5, {0: 1.0, 1: 2.0}, "12"):
        with pytest.raises(ValueError, match=r"^speeds: must be a sequence of numbers, one per"):
            _counts(10, 2, bad)  # type: ignore[arg-type]
