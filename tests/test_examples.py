"""examples/train_balanced.py launched as users launch it: plain ``python``, ``torchrun`` and
``mpiexec``. On two ranks of unequal (emulated) speed, whatever split the speeds give and however
the Rebalancer moves it mid-training, the trained model is the one a single process trains on the
same global batches (float64, to rounding)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hetcoll import launch

pytestmark = pytest.mark.multiproc

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_balanced.py"
COMMON = ["--epochs", "2", "--batch", "128", "--float64", "--quiet"]


def _train(tmp: Path, name: str, launcher: list[str], *extra: str) -> tuple[dict, list[dict]]:
    """Run the example under ``launcher``; the trained state dict and every rank's report."""
    out = [*COMMON, "--save", str(tmp / f"{name}.pt"), "--json", str(tmp / f"{name}{{rank}}.json")]
    proc = subprocess.run(
        [*launcher, str(SCRIPT), *out, *extra],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, f"{launcher}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    reports = [json.loads(p.read_text()) for p in sorted(tmp.glob(f"{name}[0-9].json"))]
    return torch.load(tmp / f"{name}.pt"), reports


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    state, (report,) = _train(tmp_path_factory.mktemp("single"), "single", [sys.executable])
    assert report["backend"] == "none" and report["first_shares"] == [128]
    return state


def _same_model(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-12, msg=k)


def test_torchrun_rebalanced_training_is_the_single_process_model(single, tmp_path):
    # Equal shares on ranks of speed 1 and 0.25: the Rebalancer moves samples to rank 0 within
    # the first epoch, changing the split mid-epoch.
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node=2"]
    state, reports = _train(
        tmp_path, "torchrun", torchrun, "--emulate", "1,0.25", "--shares", "64,64"
    )
    assert [r["rank"] for r in reports] == [0, 1]
    report = reports[0]
    assert report["backend"] == "gloo" and report["world"] == 2
    assert report["rebalances"] >= 1
    final = report["epochs"][-1]["shares"]
    assert sum(final) == 128 and final[0] > 2 * final[1]  # the fast rank takes most samples
    # Every training sample once per epoch, between the two ranks.
    for e0, e1 in zip(reports[0]["epochs"], reports[1]["epochs"]):
        assert e0["rank_samples"] + e1["rank_samples"] == 1437
    _same_model(single, state)


def test_mpiexec_measured_split_training_is_the_single_process_model(single, tmp_path):
    mpiexec = [launch.mpiexec_path(), "-n", "2", sys.executable]
    state, reports = _train(tmp_path, "mpi", mpiexec, "--emulate", "1,0.25")
    report = reports[0]
    assert report["backend"] == "mpi" and report["world"] == 2
    first = report["first_shares"]
    assert sum(first) == 128 and first[0] > first[1]  # measured: rank 1 is slower
    _same_model(single, state)


def _stderr_of_failed_run(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0
    return proc.stderr


def test_bad_arguments_are_named():
    err = _stderr_of_failed_run("--shares", "100,20", "--batch", "128")
    assert "--shares: must add up to --batch (128)" in err
    err = _stderr_of_failed_run("--emulate", "1,0.5", "--epochs", "1")
    assert "--emulate: needs one value per rank (1)" in err
