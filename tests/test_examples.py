"""The examples launched as users launch them: plain ``python``, ``torchrun`` and ``mpiexec``.

examples/train_balanced.py: on two ranks of unequal (emulated) speed, whatever split the speeds
give and however the Rebalancer moves it mid-training, the trained model is the one a single
process trains on the same global batches (float64, to rounding), under DDP, MPI and FSDP.
examples/train_plan.py: the planner's plan (``hetcoll plan --out``) under torchrun and a
hand-written plan under mpiexec train the model one process trains (float64, to 1e-10).
"""

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
# 11 steps of 32 samples an epoch: the Rebalancer (every 10 steps) moves the split mid-epoch.
TRAIN_SAMPLES = 352
COMMON = ["--epochs", "2", "--batch", "32", "--max-train-samples", str(TRAIN_SAMPLES)]
COMMON += ["--float64", "--quiet"]


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
    assert report["backend"] == "none" and report["first_shares"] == [32]
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
        tmp_path, "torchrun", torchrun, "--emulate", "1,0.25", "--shares", "16,16"
    )
    assert [r["rank"] for r in reports] == [0, 1]
    report = reports[0]
    assert report["backend"] == "gloo" and report["world"] == 2
    assert report["rebalances"] >= 1
    final = report["epochs"][-1]["shares"]
    assert sum(final) == 32 and final[0] > 2 * final[1]  # the fast rank takes most samples
    # Every training sample once per epoch, between the two ranks.
    for e0, e1 in zip(reports[0]["epochs"], reports[1]["epochs"]):
        assert e0["rank_samples"] + e1["rank_samples"] == TRAIN_SAMPLES
    _same_model(single, state)


def test_torchrun_fsdp_rebalanced_training_is_the_single_process_model(single, tmp_path):
    # FSDP2 (fully_shard) from equal shares on ranks of speed 1 and 0.25, each loss weighed by
    # weigh_loss: timed by a StepTimer without FSDP's waits, rank 1 reads slow and the
    # Rebalancer moves samples to rank 0 mid-epoch (timed with FSDP's waits, both ranks would
    # read alike and the shares stay); the model is one process's whatever the split.
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node=2"]
    state, reports = _train(
        tmp_path, "fsdp", torchrun, "--emulate", "1,0.25", "--shares", "16,16", "--fsdp"
    )
    assert reports[0]["first_shares"] == [16, 16]
    assert reports[0]["rebalances"] >= 1
    final = reports[0]["epochs"][-1]["shares"]
    assert sum(final) == 32 and final[0] > 2 * final[1]
    for e0, e1 in zip(reports[0]["epochs"], reports[1]["epochs"]):
        assert e0["rank_samples"] + e1["rank_samples"] == TRAIN_SAMPLES
    _same_model(single, state)


def test_mpiexec_measured_split_training_is_the_single_process_model(single, tmp_path):
    mpiexec = [launch.mpiexec_path(), "-n", "2", sys.executable]
    state, reports = _train(tmp_path, "mpi", mpiexec, "--emulate", "1,0.25")
    report = reports[0]
    assert report["backend"] == "mpi" and report["world"] == 2
    first = report["first_shares"]
    assert sum(first) == 32 and first[0] > first[1]  # measured: rank 1 is slower
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
    err = _stderr_of_failed_run("--fsdp", "--epochs", "1")
    assert "--fsdp: needs torchrun (torch.distributed)" in err


# ---------------------------------------------------------------- examples/train_plan.py

PLAN_SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_plan.py"
PLAN_COMMON = ["--epochs", "1", "--steps", "8", "--float64", "--quiet"]
# One fast device beside two slow ones too small for the whole model: the planner puts the two
# in a pipeline beside a whole-model replica (uneven micro-batches, 1F1B).
SMALL_CLUSTER = """
[devices.fast]
flops_per_s = 2e10
mem_bytes_per_s = 2e10
memory_bytes = 1e9
kernel_overhead_s = 1e-6

[devices.small]
flops_per_s = 5e9
mem_bytes_per_s = 5e9
memory_bytes = 1.6e6
kernel_overhead_s = 1e-6

[links.net]
latency_s = 1e-5
bytes_per_s = 1e10

[[nodes]]
name = "a"
device = "fast"
count = 1

[[nodes]]
name = "b"
device = "small"
count = 2
link = "net"

[network]
link = "net"
"""


def _train_plan(tmp: Path, name: str, launcher: list[str], plan: Path, *extra: str) -> tuple:
    """Run train_plan.py under ``launcher``; the trained state dict and every rank's report."""
    out = ["--save", str(tmp / f"{name}.pt"), "--json", str(tmp / f"{name}{{rank}}.json")]
    proc = subprocess.run(
        [*launcher, str(PLAN_SCRIPT), "--plan", str(plan), *PLAN_COMMON, *out, *extra],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HETCOLL_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, f"{launcher}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    reports = [json.loads(p.read_text()) for p in sorted(tmp.glob(f"{name}[0-9].json"))]
    return torch.load(tmp / f"{name}.pt"), reports


@pytest.fixture(scope="module")
def plan_single(tmp_path_factory):
    """One process, one replica: the reference every plan of batch 48 must train exactly."""
    tmp = tmp_path_factory.mktemp("plan_single")
    one = tmp / "one.json"
    one.write_text(
        json.dumps({"replicas": [{"samples": 48, "stages": [{"ranks": [0], "layers": [0, 9]}]}]})
    )
    state, (report,) = _train_plan(tmp, "single", [sys.executable], one)
    assert report["backend"] == "none" and report["world"] == 1 and len(report["losses"]) == 8
    return state, report["losses"]


def _same_as(reference: tuple, state: dict, losses: list[float]) -> None:
    want_state, want_losses = reference
    assert losses == pytest.approx(want_losses, rel=1e-10)
    assert state.keys() == want_state.keys()
    for k, v in want_state.items():
        assert float((state[k] - v).abs().max()) <= 1e-10 * float(v.abs().max()), k


def test_torchrun_trains_the_planner_s_plan_like_one_process(plan_single, tmp_path):
    from hetcoll import Plan
    from hetcoll.cli import main

    cluster = tmp_path / "small.toml"
    cluster.write_text(SMALL_CLUSTER)
    plan = tmp_path / "plan.json"
    argv = ["plan", "--model", "hetcoll.lab.demo_ranks:DemoNet", "--input", "1x8x8"]
    assert main([*argv, "--batch", "48", "--cluster", str(cluster), "--out", str(plan)]) == 0
    written = Plan.load(plan)
    # Whatever the planner picks (on this cluster its best is a node-wise split over the
    # three devices, asymmetric replicas a runner-up) spans the 3 ranks and the batch.
    assert written.batch == 48 and set(written.ranks) == {0, 1, 2}
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node=3"]
    state, reports = _train_plan(tmp_path, "torchrun", torchrun, plan)
    assert [r["rank"] for r in reports] == [0, 1, 2]
    assert reports[0]["backend"] == "gloo" and reports[0]["world"] == 3
    # Ranks that split a layer or hold replicas of one exchanged something.
    assert all(sum(r["traffic"].values()) > 0 for r in reports)
    _same_as(plan_single, state, reports[0]["losses"])


def test_mpiexec_trains_a_plan_with_a_filter_split_stage_like_one_process(plan_single, tmp_path):
    plan = tmp_path / "split.json"
    plan.write_text(
        json.dumps(
            {
                "microbatches": 2,
                "schedule": "GPipe",
                "replicas": [
                    {
                        "samples": 30,
                        "stages": [
                            {"ranks": [0], "layers": [0, 2]},
                            {"ranks": [1, 2], "speeds": [1.0, 0.5], "layers": [2, 9]},
                        ],
                    },
                    {"samples": 18, "stages": [{"ranks": [3], "layers": [0, 9]}]},
                ],
            }
        )
    )
    mpiexec = [launch.mpiexec_path(), "-n", "4", sys.executable]
    state, reports = _train_plan(tmp_path, "mpi", mpiexec, plan, "--mpi")
    assert [r["place"] for r in reports] == [[0, 0], [0, 1], [0, 1], [1, 0]]
    assert reports[0]["backend"] == "mpi" and reports[0]["world"] == 4
    _same_as(plan_single, state, reports[0]["losses"])


def test_train_plan_names_a_bad_plan(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"replicas": [{"samples": 8, "stages": []}]}))
    proc = subprocess.run(
        [sys.executable, str(PLAN_SCRIPT), "--plan", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode != 0
    assert "--plan: plan.replicas[0].stages: must hold at least one stage" in proc.stderr


# ---------------------------------------------------------------- examples/train_lm.py

LM_SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_lm.py"
LM_COMMON = ["--arch", "gpt2", "--steps", "3", "--batch", "12", "--microbatches", "3"]
LM_COMMON += ["--float64", "--quiet"]


def _train_lm(tmp: Path, name: str, launcher: list[str], *extra: str) -> tuple:
    """Run train_lm.py under ``launcher``; the trained state dict and every rank's report."""
    out = ["--save", str(tmp / f"{name}.pt"), "--json", str(tmp / f"{name}{{rank}}.json")]
    proc = subprocess.run(
        [*launcher, str(LM_SCRIPT), *LM_COMMON, *out, *extra],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HETCOLL_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, f"{launcher}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    reports = [json.loads(p.read_text()) for p in sorted(tmp.glob(f"{name}[0-9].json"))]
    return torch.load(tmp / f"{name}.pt"), reports


@pytest.fixture(scope="module")
def lm_single(tmp_path_factory):
    """One process, the whole batch: what every launch of the same batches must train."""
    tmp = tmp_path_factory.mktemp("lm_single")
    state, (report,) = _train_lm(tmp, "single", [sys.executable])
    assert report["world"] == 1 and len(report["losses"]) == 3
    assert report["losses"][-1] < report["losses"][0]  # it learns
    return state, report["losses"]


def test_torchrun_trains_the_lm_as_a_pipeline_like_one_process(lm_single, tmp_path):
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node=3"]
    state, reports = _train_lm(tmp_path, "torchrun", torchrun, "--emulate", "1,0.5,0.25")
    assert [r["place"] for r in reports] == [[0, 0], [0, 1], [0, 2]]  # one 3-stage pipeline
    assert reports[0]["backend"] == "gloo"
    assert all(r["traffic"]["activations"] + r["traffic"]["gradients"] > 0 for r in reports)
    _same_as(lm_single, state, reports[0]["losses"])


def test_mpiexec_trains_the_lm_under_a_hybrid_plan_like_one_process(lm_single, tmp_path):
    # GPT-2's blocks: wte, wpe, drop, h.0 .. h.5, ln_f, lm_head (11); the head is tied to wte.
    plan = tmp_path / "hybrid.json"
    plan.write_text(
        json.dumps(
            {
                "microbatches": 2,
                "schedule": "1F1B",
                "replicas": [
                    {
                        "samples": 7,
                        "stages": [
                            {"ranks": [0], "layers": [0, 6]},
                            {"ranks": [1], "layers": [6, 11]},
                        ],
                    },
                    {"samples": 5, "stages": [{"ranks": [2], "layers": [0, 11]}]},
                ],
            }
        )
    )
    mpiexec = [launch.mpiexec_path(), "-n", "3", sys.executable]
    state, reports = _train_lm(tmp_path, "mpi", mpiexec, "--mpi", "--plan", str(plan))
    assert [r["place"] for r in reports] == [[0, 0], [0, 1], [1, 0]]
    assert reports[0]["backend"] == "mpi" and all(r["traffic"]["allreduce"] > 0 for r in reports)
    _same_as(lm_single, state, reports[0]["losses"])


def test_hetcoll_plan_writes_a_plan_train_lm_runs_like_one_process(tmp_path):
    """The planner's plan for the example's Llama (token inputs), run by torchrun, trains what
    one process trains (to 1e-6: Llama's rotary embedding computes in float32, so a batch
    and its rows split into micro-batches already differ by ~1e-7)."""
    from hetcoll import Plan
    from hetcoll.cli import main

    cluster = tmp_path / "small.toml"
    # Two slow devices with 2 MB each: the 310k-parameter Llama does not fit one of them.
    cluster.write_text(SMALL_CLUSTER.replace("memory_bytes = 1.6e6", "memory_bytes = 2e6"))
    plan = tmp_path / "lm.json"
    sys.path.insert(0, str(LM_SCRIPT.parent))
    try:
        # Given the attention mask, Hugging Face's mask code reads no token values: the costs
        # are counted on the meta device (given token ids alone, by a run on the CPU).
        argv = ["plan", "--model", "train_lm:make_model", "--dtype", "int64"]
        argv += ["--input", "input_ids=64,attention_mask=64"]
        assert main([*argv, "--batch", "12", "--cluster", str(cluster), "--out", str(plan)]) == 0
    finally:
        sys.path.remove(str(LM_SCRIPT.parent))
    written = Plan.load(plan)
    # A pipeline over the three devices, cut between decoder layers (see the planner's tests).
    assert written.batch == 12 and len(written.replicas[0].stages) == 3
    llama = ["--arch", "llama"]
    one, (report,) = _train_lm(tmp_path, "one", [sys.executable], *llama)
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--standalone"]
    torchrun.append(f"--nproc-per-node={max(written.ranks) + 1}")
    state, reports = _train_lm(tmp_path, "planned", torchrun, *llama, "--plan", str(plan))
    assert reports[0]["plan"] == written.to_dict()
    assert reports[0]["losses"] == pytest.approx(report["losses"], rel=1e-6)
    for k, v in one.items():
        assert float((state[k] - v).abs().max()) <= 1e-6 * float(v.abs().max()), k


def test_train_lm_names_save_expert_loads_without_experts_to_save(tmp_path):
    """--save-expert-loads needs a plan placing experts (as --rebalance-experts does): without
    one (the default pipeline) the run stops at once, naming the flag."""
    argv = ["--steps", "1", "--quiet", "--save-expert-loads", str(tmp_path / "loads.json")]
    run = subprocess.run(
        [sys.executable, str(LM_SCRIPT), *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode != 0
    assert "--save-expert-loads: the plan places no experts" in run.stderr, run.stderr
    assert not (tmp_path / "loads.json").exists()


def test_hetcoll_plan_places_mixtral_s_experts_and_train_lm_runs_it_like_one_process(
    tmp_path, capsys
):
    """The planner's plan for the example's Mixtral on two devices too small for all its
    experts each: whole experts placed on the ranks (the plan's ``experts``); run by torchrun,
    its experts placed again by their loads after every step (``--rebalance-experts 1``), it
    trains what one process trains (to 1e-6: Hugging Face's router takes its softmax in
    float32, which rounds a batch and its rows apart by ~1e-7). The loads it measured
    (``--save-expert-loads``) plan again (``hetcoll plan --expert-loads``); a file that does
    not fit the model is refused by name."""
    from hetcoll import Plan
    from hetcoll.cli import main

    cluster = tmp_path / "two.toml"
    cluster.write_text(
        "[devices.d]\nflops_per_s = 1e10\nmem_bytes_per_s = 1e10\nmemory_bytes = 3e7\n"
        '[links.net]\nlatency_s = 1e-5\nbytes_per_s = 1e10\n[[nodes]]\nname = "a"\n'
        'device = "d"\ncount = 2\nlink = "net"\n'
    )
    plan = tmp_path / "mixtral.json"
    sys.path.insert(0, str(LM_SCRIPT.parent))
    try:
        argv = ["plan", "--model", "train_lm:make_mixtral", "--dtype", "int64"]
        argv += ["--input", "input_ids=64,attention_mask=64", "--loss", "cross-entropy"]
        argv += ["--batch", "6", "--cluster", str(cluster)]
        assert main([*argv, "--out", str(plan)]) == 0
    finally:
        sys.path.remove(str(LM_SCRIPT.parent))
    written = Plan.load(plan)
    assert written.experts is not None and written.ranks == (0, 1), written.to_dict()
    mixtral = ["--arch", "mixtral", "--steps", "2", "--batch", "6"]
    one, (report,) = _train_lm(tmp_path, "one", [sys.executable], *mixtral)
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--standalone"]
    torchrun.append("--nproc-per-node=2")
    loads = tmp_path / "loads.json"
    planned = [*mixtral, "--plan", str(plan), "--rebalance-experts", "1"]
    planned += ["--save-expert-loads", str(loads)]
    state, reports = _train_lm(tmp_path, "planned", torchrun, *planned)
    # Placed again after each step by the tokens routed (--rebalance-experts 1): the
    # experts moved both times, training as one process still; the plan follows.
    moves = reports[0]["experts_moves"]
    assert [(m["step"], m["moved"]) for m in moves] == [(1, True), (2, True)]
    assert all(r["plan"] == reports[0]["plan"] for r in reports)
    assert reports[0]["plan"] == {**written.to_dict(), "experts": moves[-1]["experts"]}
    assert reports[0]["losses"] == pytest.approx(report["losses"], rel=1e-6)
    for k, v in one.items():
        assert float((state[k] - v).abs().max()) <= 1e-6 * float(v.abs().max()), k
    # The experts' measured loads (the rebalancer's estimate), for the planner to place them
    # by: each of the 6 layers' 8 experts, and the plan it writes from them.
    measured = json.loads(loads.read_text())
    assert sorted(measured) == [f"model.layers.{i}.mlp.experts" for i in range(6)]
    assert all(len(v) == 8 and min(v) >= 0 and sum(v) > 0 for v in measured.values())
    again = tmp_path / "by_load.json"
    sys.path.insert(0, str(LM_SCRIPT.parent))
    try:
        capsys.readouterr()
        assert main([*argv, "--expert-loads", str(loads), "--out", str(again)]) == 0
        assert f"expert loads: {loads} (6 of 6 experts layers)" in capsys.readouterr().out
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({"model.layers.0.mlp.experts": [1, 2]}))
        with pytest.raises(SystemExit) as exit_:
            main([*argv, "--expert-loads", str(bad)])
        assert exit_.value.code == 2
        assert "--expert-loads: 'model.layers.0.mlp.experts' needs 8" in capsys.readouterr().err
    finally:
        sys.path.remove(str(LM_SCRIPT.parent))
    assert Plan.load(again).experts is not None
