"""hetcoll.accelerate: Hugging Face Accelerate loops and Trainer on uneven per-rank batches.

The examples (examples/accelerate_balanced.py, examples/hf_trainer_balanced.py) on CPU ranks
(gloo) with two accumulated micro-batches per optimizer step train GPT-2 and Llama (two ranks
at shares 5:3; GPT-2 also on three at 4:3:1 with a float64 loss, see below), from configs,
eager attention, float64, to the weights one process trains on the same global batches (one
micro-batch of 16 rows a step), to 1e-10; the loss as Accelerate's own examples write it (each
rank's mean, DDP averaging the ranks alike) does not. tests/accelerate_workers/cases.py runs
the collective checks and a rank without any valid token on two real ranks.

Each script runs as ``torchrun`` runs it: launched by torchrun itself, as users launch it, in
the tests that read what it prints, in the Trainer's and the loop's first cases and in the one
about torchrun; elsewhere on ranks forked by :func:`hetcoll.launch.run_script` (the same
``__main__``, arguments and environment, without an interpreter and torch's import a rank:
0.5 s a launch instead of 7)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import accelerate  # noqa: F401 (preloaded: see below)
import numpy as np
import pytest
import torch
import transformers.trainer  # noqa: F401 (preloaded: see below)

from hetcoll import launch

# accelerate and transformers.trainer are imported before the first launch so that launch's
# rank server preloads them (launch.PRELOAD_IF_LOADED): each forked rank starts with them.

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TORCHRUN = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node=2"]
#: Two ranks forked by launch.run_script (:func:`_launch`).
FORKED = 2
# 40 rows: 5 micro-steps of 8 rows an epoch, i.e. optimizer steps of 2, 2 and 1 micro-batches
# (the epoch's last step accumulates fewer); one process: steps of 16, 16 and 8 rows.
COMMON = ["--rows", "40", "--epochs", "2", "--float64", "--quiet"]
ONE = ["--batch", "16"]
TWO = ["--batch", "8", "--accumulate", "2", "--shares", "5,3"]

sys.path.insert(0, str(EXAMPLES))


def _launch(launcher: list[str] | int, script: Path, *argv: str) -> None:
    """``script argv...`` under ``launcher``: a command (torchrun, as users launch it; this
    Python, one process), or a number of ranks forked by :func:`hetcoll.launch.run_script`,
    which runs the script as torchrun does (its ranks' environment, ``__main__``) without
    starting an interpreter a rank (7 s a launch here)."""
    if isinstance(launcher, int):
        launch.run_script(script, launcher, list(argv), timeout=300)
        return
    proc = subprocess.run(
        [*launcher, str(script), *argv],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, f"{launcher}: exit {proc.returncode}\n{proc.stderr[-3000:]}"


def _run(
    tmp: Path, name: str, launcher: list[str] | int, script: str, *extra: str
) -> tuple[dict, list]:
    """The example under ``launcher`` (:func:`_launch`): the trained state dict and every
    rank's report."""
    out = ["--save", str(tmp / f"{name}.pt"), "--json", str(tmp / f"{name}{{rank}}.json")]
    _launch(launcher, EXAMPLES / script, *COMMON, *out, *extra)
    reports = [json.loads(p.read_text()) for p in sorted(tmp.glob(f"{name}[0-9].json"))]
    return torch.load(tmp / f"{name}.pt"), reports


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``one_process(script, *extra)``: the example in one process (the reference the ranks'
    runs must equal), run once for the module for each ``extra``: its state dict and report.
    Callers only read them."""
    done: dict[tuple[str, ...], tuple[dict, list]] = {}

    def run(script: str, *extra: str) -> tuple[dict, list]:
        if (script, *extra) not in done:
            tmp = tmp_path_factory.mktemp("one")
            done[(script, *extra)] = _run(tmp, "one", [sys.executable], script, *extra, *ONE)
        return done[(script, *extra)]

    return run


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# -- Accelerate --------------------------------------------------------------------------------


# Hugging Face's causal-LM loss computes in float32 inside (``logits.float()``, a downcast for a
# float64 model), and so does Llama's RMSNorm: their rounding meets the loss scale (processes x
# accumulation), exact only when a power of two. 2 ranks: Hugging Face's loss, GPT-2 and Llama;
# 3 ranks: GPT-2 (float64 LayerNorm) with the example's float64 loss (``--own-loss``).
@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("arch", "shares", "loss"),
    [("gpt2", "5,3", []), ("llama", "5,3", []), ("gpt2", "4,3,1", ["--own-loss"])],
    ids=["gpt2-5:3", "llama-5:3", "gpt2-4:3:1-float64-loss"],
)
def test_accelerate_uneven_shares_with_accumulation_are_the_one_process_model(
    arch, shares, loss, tmp_path, one_process
):
    one, (report,) = one_process("accelerate_balanced.py", "--arch", arch, *loss)
    assert report["world"] == 1 and report["shares"] == [16]
    ranks = len(shares.split(","))
    launcher: list[str] | int = ranks  # forked (_launch); the first case as users launch it
    if (arch, shares, loss) == ("gpt2", "5,3", []):
        launcher = [*TORCHRUN[:-1], f"--nproc-per-node={ranks}"]
    two = ["--batch", "8", "--accumulate", "2", "--shares", shares, *loss]
    many, reports = _run(tmp_path, "many", launcher, "accelerate_balanced.py", "--arch", arch, *two)
    assert [r["rank"] for r in reports] == list(range(ranks))
    expected = [int(v) for v in shares.split(",")]
    assert all(r["shares"] == expected and r["world"] == ranks for r in reports)
    # The ranks trained on different numbers of tokens, together every token one process saw.
    tokens = [r["tokens"] for r in reports]
    assert len(set(tokens)) == ranks and sum(tokens) == report["tokens"]
    assert _max_diff(one, many) < 1e-10
    if arch == "gpt2" and not loss:
        # The baseline (each rank's own mean, DDP averaging the ranks alike) is measurably off.
        plain, _ = _run(
            tmp_path, "plain", ranks, "accelerate_balanced.py", "--arch", arch, *two,
            "--plain-mean",
        )  # fmt: skip
        assert _max_diff(one, plain) > 1e-4


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("arch", "experts"), [("gpt2", []), ("mixtral", ["--experts"])], ids=["gpt2", "mixtral-experts"]
)
def test_accelerate_loop_rebalanced_as_it_trains_is_the_one_process_model(
    tmp_path, arch, experts, one_process
):
    """The example's ``--rebalance-every 1`` (a Rebalancer over the loader's sampler, fed by a
    StepTimer), rank 1 emulated at 0.3 of its speed (it sleeps): from 5 : 3 the shares move
    towards rank 0 as the loop trains, deciding after every optimizer step of two
    micro-batches, and the model is still one process's on the same global batches. With
    Mixtral's experts placed on the ranks too (3 : 1), whose exchanges make rank 0 wait for
    rank 1 inside every step: the timer leaves those waits out (measured: 5 : 3 to 6 : 2 to
    7 : 1)."""
    one, _ = one_process("accelerate_balanced.py", "--arch", arch)
    emulated = ["--rebalance-every", "1", "--emulate", "1,0.3", *experts]
    two, reports = _run(tmp_path, "two", FORKED, "accelerate_balanced.py", "--arch", arch,
                        *TWO, *emulated)  # fmt: skip
    assert _max_diff(one, two) < 1e-10
    for r in reports:
        assert r["rebalanced"] == reports[0]["rebalanced"]  # decided alike on every rank
        assert [d["batch"] for d in r["rebalanced"]] == [2, 4, 6, 8, 10]
        assert r["shares"][0] > 5 and sum(r["shares"]) == 8


def _measured(tmp_path: Any, script: str, rows: int) -> tuple[Any, list[dict[str, Any]]]:
    """``script`` on two torchrun ranks with measured speeds (rank 1 emulated at half): the
    finished process and each rank's report."""
    proc = subprocess.run(
        [*TORCHRUN, str(EXAMPLES / script), "--arch", "gpt2", "--rows", str(rows), "--batch",
         "8", "--epochs", "1", "--measure", "--emulate", "1,0.5", "--json",
         str(tmp_path / "m{rank}.json")],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, [json.loads(p.read_text()) for p in sorted(tmp_path.glob("m[0-9].json"))]


@pytest.mark.multiproc
def test_accelerate_measured_speeds_show_in_the_progress_bar(tmp_path):
    proc, reports = _measured(tmp_path, "accelerate_balanced.py", 24)
    shares, speeds = reports[0]["shares"], reports[0]["speeds"]
    assert all(r["shares"] == shares and r["speeds"] == speeds for r in reports)
    assert sum(shares) == 8 and min(shares) >= 1
    assert len(speeds) == 2 and all(s > 0 for s in speeds)
    # Rank 0's tqdm bar (Accelerate's) carries the shares and the measured speeds.
    bar = proc.stderr
    assert f"shares={shares[0]}:{shares[1]}" in bar
    assert "samples/s" in bar.split("speeds=", 1)[1].split("]", 1)[0]


# -- Trainer -----------------------------------------------------------------------------------


@pytest.mark.multiproc
def test_trainer_at_shares_5_3_with_accumulation_is_the_one_process_model(tmp_path, one_process):
    one, (report,) = one_process("hf_trainer_balanced.py", "--arch", "gpt2")
    two, reports = _run(tmp_path, "two", TORCHRUN, "hf_trainer_balanced.py", "--arch", "gpt2", *TWO)
    assert _max_diff(one, two) < 1e-10
    # 6 optimizer steps, each logged with every rank's share.
    assert len(report["logged"]) == 6 and report["logged"][0]["share/0"] == 16
    for r in reports:
        assert r["shares"] == [5, 3]
        assert [(e["share/0"], e["share/1"]) for e in r["logged"]] == [(5, 3)] * 6
        # The same losses as one process's, step by step.
        for mine, single in zip(r["logged"], report["logged"]):
            assert mine["loss"] == pytest.approx(single["loss"], rel=1e-6)


@pytest.mark.multiproc
@pytest.mark.parametrize("script", ["hf_trainer_balanced.py", "accelerate_balanced.py"])
def test_experts_placed_on_the_ranks_train_as_the_one_process_model(tmp_path, script, one_process):
    """Mixtral at shares 5:3 with two accumulated micro-batches a step, its experts placed on
    the ranks by the same shares (3 and 1 of 4: ``expert_parallel``), under Trainer and under
    the Accelerate loop. Each scales every rank's loss for DDP's mean, so the experts weigh
    every rank's rows 1 / processes (``combine="mean"``: BalancedTrainer sets it, the loop
    passes it); Trainer's clipping (max_grad_norm 1) takes the whole model's norm
    (``clip_grad_norm_``: each rank's own would clip each differently). The gathered model
    is one process's on the same global batches, to 1e-10; under Trainer, either fix alone
    leaves it 1e-5 to 1e-4 away. Under Trainer they start 1 : 3 and its expert rebalancer
    (``rebalance_experts_every=1``) moves them (any experts on any rank) after the first
    and third steps, exactly still."""
    mixtral = ["--arch", "mixtral"]
    trainer = script.startswith("hf_trainer")
    # Under Trainer, placed 1 : 3 (against the rows' 5 : 3) and watched after every step.
    watch = ["--expert-shares", "1,3", "--rebalance-experts", "1"] if trainer else []
    one, _ = one_process(script, *mixtral)
    two, reports = _run(tmp_path, "two", FORKED, script, *mixtral, *TWO, "--experts", *watch)
    assert _max_diff(one, two) < 1e-10
    assert [r["shares"] for r in reports] == [[5, 3], [5, 3]]
    if trainer:  # moved after the first and third steps (gains past 5%), left there after
        moves = [(m["step"], m["moved"]) for m in reports[0]["experts_moves"]]
        assert moves == [(1, True), (2, False), (3, True), (4, False), (5, False), (6, False)]
        layer0, layer1 = "model.layers.0.mlp.experts", "model.layers.1.mlp.experts"
        placed = [m["experts"] for m in reports[0]["experts_moves"] if m["moved"]]
        assert placed == [
            {layer0: [[0, 2, 3], [1]], layer1: [3, 1]},  # any experts: counts where runs
            {layer0: [[1, 3], [0, 2]], layer1: [[0, 1, 3], [2]]},
        ]


@pytest.mark.multiproc
def test_accelerate_save_state_of_placed_experts_resumes_into_any_placement(tmp_path, one_process):
    """The Accelerate loop with Mixtral's experts placed 1 : 3 on two ranks saves
    ``accelerator.save_state`` after its first epoch through ``whole_checkpoints``: the file
    Accelerate writes holds the unsplit model (every expert, not the main process's one) and
    the unsplit optimizer state keyed by name. Resumed by ``load_state`` into another
    placement (by the shares 5 : 3: three experts and one) and into one process without placed
    experts, the second epoch ends where one process's uninterrupted run does, to 1e-10.
    (Without it, the file held rank 0's expert alone under the unsplit name.)
    ``accelerator.save_model`` writes the unsplit model too, and so does the model's
    ``save_pretrained`` of ``accelerator.get_state_dict`` (Accelerate's idiom), which
    ``from_pretrained`` reads."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    mixtral = ["--arch", "mixtral"]
    one, _ = one_process("accelerate_balanced.py", *mixtral)
    ckpt = str(tmp_path / "ckpt")
    final = tmp_path / "final"
    save = ["--experts", "--expert-shares", "1,3", "--epochs", "1", "--save-state", ckpt]
    save += ["--save-model", str(final), "--save-pretrained", str(tmp_path / "pretrained")]
    first, _ = _run(tmp_path, "first", FORKED, "accelerate_balanced.py", *mixtral, *TWO, *save)
    weights = load_file(Path(ckpt) / "model.safetensors")
    assert weights.keys() == one.keys() and _max_diff(weights, first) == 0.0
    # accelerator.save_model at the end (and get_state_dict, which --save wrote): unsplit too;
    # so is save_pretrained of get_state_dict (Accelerate's idiom), read by from_pretrained.
    assert _max_diff(load_file(final / "model.safetensors"), first) == 0.0
    pretrained = AutoModelForCausalLM.from_pretrained(tmp_path / "pretrained", dtype=torch.float64)
    assert _max_diff(pretrained.state_dict(), first) == 0.0
    optimizer = torch.load(Path(ckpt) / "optimizer.bin", weights_only=True)
    experts = "model.layers.0.mlp.experts.down_proj"
    assert optimizer["state"][experts]["momentum_buffer"].shape == one[experts].shape == (4, 32, 88)
    assert set(optimizer["param_groups"][0]["params"]) == optimizer["state"].keys() == one.keys()
    resume = ["--resume", ckpt]
    two, reports = _run(
        tmp_path, "two", FORKED, "accelerate_balanced.py", *mixtral, *TWO, "--experts", *resume
    )
    assert _max_diff(one, two) < 1e-10
    assert all(r["tokens"] > 0 for r in reports)  # the second epoch alone trained
    alone, _ = _run(
        tmp_path, "alone", [sys.executable], "accelerate_balanced.py", *mixtral, *ONE, *resume
    )
    assert _max_diff(one, alone) < 1e-10
    assert _max_diff(one, first) > 1e-4  # the second epoch trained something


def test_whole_checkpoints_in_one_process_and_its_bad_input(tmp_path):
    """One process: ``save_state`` through ``whole_checkpoints`` writes the optimizer's state
    keyed by parameter name, ``load_state`` reads it back into a fresh model and optimizer
    exactly, and the handle's ``remove`` leaves Accelerate's own files. ``get_state_dict`` and
    ``save_model`` give the model's state under its keys. Bad arguments are named."""
    from accelerate import Accelerator
    from safetensors.torch import load_file

    from hetcoll.accelerate import whole_checkpoints

    def built(seed: int) -> tuple[Any, Any]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        return model.double(), torch.optim.AdamW(model.parameters(), lr=0.1)

    accelerator = Accelerator(cpu=True)
    model, opt = accelerator.prepare(*built(0))
    model(torch.ones(3, 4, dtype=torch.float64)).sum().backward()
    opt.step()
    handle = whole_checkpoints(accelerator, model, opt)
    accelerator.save_state(str(tmp_path / "whole"))
    saved = torch.load(tmp_path / "whole" / "optimizer.bin", weights_only=True)
    assert saved["param_groups"][0]["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert opt.state_dict()["param_groups"][0]["params"] == [0, 1, 2, 3]  # its own, after
    resumed = Accelerator(cpu=True)  # as a new run's
    fresh, fresh_opt = resumed.prepare(*built(1))
    whole_checkpoints(resumed, fresh, fresh_opt)
    resumed.load_state(str(tmp_path / "whole"))
    assert _max_diff(fresh.state_dict(), model.state_dict()) == 0.0
    for a, b in zip(fresh_opt.state_dict()["state"].values(), opt.state_dict()["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    handle.remove()
    assert vars(accelerator).get("get_state_dict") is None
    accelerator.save_state(str(tmp_path / "own"))
    own = torch.load(tmp_path / "own" / "optimizer.bin", weights_only=True)
    assert own["param_groups"][0]["params"] == [0, 1, 2, 3]
    # get_state_dict and save_model: the model's own keys (a plain model's state is whole),
    # the wrapper's with unwrap=False; another model's, Accelerate's own; none after remove.
    whole_checkpoints(accelerator, model, opt)
    assert list(accelerator.get_state_dict(model)) == list(model.state_dict())
    assert _max_diff(accelerator.get_state_dict(model, unwrap=False), model.state_dict()) == 0.0
    accelerator.save_model(model, tmp_path / "model")
    assert _max_diff(load_file(tmp_path / "model" / "model.safetensors"), model.state_dict()) == 0.0
    other = torch.nn.Linear(2, 2)
    assert accelerator.get_state_dict(other).keys() == {"weight", "bias"}
    with pytest.raises(TypeError, match=r"^accelerator: must be an accelerate\.Accelerator"):
        whole_checkpoints(None, model, opt)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^model: must be a torch\.nn\.Module"):
        whole_checkpoints(accelerator, "model", opt)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^optimizer: must be a torch\.optim\.Optimizer"):
        whole_checkpoints(accelerator, model, "opt")
    with pytest.raises(ValueError, match=r"^optimizer: holds tensors that are not the model's"):
        whole_checkpoints(accelerator, model, fresh_opt)
    accelerator.free_memory()
    resumed.free_memory()


@pytest.mark.multiproc
def test_trainer_rebalancing_rows_with_experts_placed_is_the_one_process_model(
    tmp_path, one_process
):
    """BalancedTrainer(rebalance_every=1) with Mixtral's experts placed on the two ranks, rank
    1 emulated at 0.3 of its speed: the rows move towards rank 0 (5 : 3 to 7 : 1 or 6 : 2,
    measured), decided alike on both ranks, and the model is one process's to 1e-10."""
    mixtral = ["--arch", "mixtral"]
    script = "hf_trainer_balanced.py"
    one, _ = one_process(script, *mixtral)
    emulated = ["--experts", "--rebalance-every", "1", "--emulate", "1,0.3"]
    two, reports = _run(tmp_path, "two", FORKED, script, *mixtral, *TWO, *emulated)
    assert _max_diff(one, two) < 1e-10
    for r in reports:
        assert r["rebalanced"] == reports[0]["rebalanced"]
        assert r["shares"][0] > 5 and sum(r["shares"]) == 8


@pytest.mark.multiproc
def test_trainer_measured_speeds_show_in_its_logs(tmp_path):
    proc, reports = _measured(tmp_path, "hf_trainer_balanced.py", 16)
    shares, speeds = reports[0]["shares"], reports[0]["speeds"]
    assert sum(shares) == 8 and len(speeds) == 2 and all(s > 0 for s in speeds)
    for r in reports:
        assert r["shares"] == shares and r["speeds"] == speeds
        assert len(r["logged"]) == 2
        for entry in r["logged"]:
            assert [entry["share/0"], entry["share/1"]] == shares
            assert [entry["speed/0"], entry["speed/1"]] == pytest.approx(speeds)
    # Trainer prints its logs: the shares and speeds with the loss.
    assert "'share/1': " in proc.stdout + proc.stderr and "'speed/0': " in proc.stdout + proc.stderr


def _resume_run(out: Path, resume: str, steps: int, *extra: str) -> None:
    """tests/accelerate_workers/trainer_resume.py on two ranks (:func:`_launch`)."""
    worker = ROOT / "tests" / "accelerate_workers" / "trainer_resume.py"
    _launch(FORKED, worker, str(out), resume, str(steps), *extra)


@pytest.mark.multiproc
def test_trainer_resumed_mid_epoch_from_its_checkpoint_is_the_uninterrupted_model(tmp_path):
    """Mixtral under AdamW, 5 steps an epoch: resumed from Trainer's checkpoint after step 2
    (Trainer skips the epoch's first 2 balanced batches), on through the second epoch to step
    7, it ends where the uninterrupted run does. The checkpoint is the uninterrupted run's own
    (a run stopped after step 2 writes the same one, at the same step: one launch fewer).
    ``save_pretrained`` wrote it in Hugging Face's layout of Mixtral (each expert's
    projections apart), whose experts and router Trainer's own resume leaves as they were
    (0.44 off at step 7); BalancedTrainer reads it as ``from_pretrained`` does."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    _resume_run(tmp_path / "whole", "none", 7)
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    _resume_run(tmp_path / "resumed", str(checkpoint), 7)
    whole = torch.load(tmp_path / "whole" / "final-7.pt")
    resumed = torch.load(tmp_path / "resumed" / "final-7.pt")
    assert _max_diff(whole, resumed) < 1e-10
    assert not load_file(checkpoint / "model.safetensors").keys() <= whole.keys()  # renamed
    # The steps after the checkpoint trained something.
    at_2 = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64).state_dict()
    assert _max_diff(whole, at_2) > 1e-4
    # load_best_model_at_end's load of that checkpoint reads it alike.
    assert _max_diff(torch.load(tmp_path / "whole" / "best.pt"), at_2) < 1e-12


@pytest.mark.multiproc
def test_trainer_with_placed_experts_resumes_from_its_checkpoint_as_the_uninterrupted_model(
    tmp_path,
):
    """Mixtral, its experts placed 1 : 3 and placed again by their loads every 2 steps, AdamW:
    Trainer's checkpoint after step 2 holds the unsplit model and optimizer state (every
    rank's experts and moments gathered, under the model's own names), taken after the
    rebalancer moved them, and the rebalancer's state; resumed, the experts go back where
    the checkpoint had them (from the starting placement 1 : 3), the rebalancer decides at
    steps 4 and 6 exactly as the uninterrupted run did, and training to step 7 ends where
    that run does. ``from_pretrained`` reads the checkpoints too. (Before, each rank's
    moments went to every rank and the resume failed; then the resumed run started from
    1 : 3 with no loads; Hugging Face's ``save_pretrained`` writes Mixtral's experts in a
    layout its resume silently skips.)"""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    _resume_run(tmp_path / "whole", "none", 7, "experts")
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    _resume_run(tmp_path / "resumed", str(checkpoint), 7, "experts")
    whole = torch.load(tmp_path / "whole" / "final-7.pt")
    resumed = torch.load(tmp_path / "resumed" / "final-7.pt")
    assert _max_diff(whole, resumed) < 1e-10
    # The checkpoint was written after the experts moved (the rebalancer's decision at step
    # 2); the resumed run's decisions after it are the uninterrupted run's, from the same
    # placement and loads.
    events = json.loads((tmp_path / "whole" / "events.json").read_text())
    assert [e[0] for e in events] == [2, 4, 6] and events[0][4]  # moved at step 2
    assert events[0][1] != events[0][2]
    assert json.loads((tmp_path / "resumed" / "events.json").read_text()) == events[1:]
    state = json.loads((checkpoint / "expert_rebalancer.json").read_text())
    assert state["step"] == 2 and state["placement"] == events[0][2]
    at_2 = load_file(checkpoint / "model.safetensors")
    assert at_2.keys() == whole.keys()  # the unsplit model, every expert
    assert _max_diff(whole, at_2) > 1e-4  # and the steps after it trained
    assert _max_diff(torch.load(tmp_path / "whole" / "best.pt"), at_2) < 1e-12  # best model
    optimizer = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    experts = "model.layers.0.mlp.experts.down_proj"
    assert optimizer["state"][experts]["exp_avg"].shape == whole[experts].shape
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "whole" / "checkpoint-7")
    assert _max_diff({k: v.double() for k, v in loaded.state_dict().items()}, whole) < 1e-10


def _rebalanced(
    out: Path, launcher: list[str] | int, resume: str = "none", batch: int = 8
) -> tuple[dict, list[dict]]:
    """tests/accelerate_workers/trainer_rebalance.py (6 steps, global batches of ``batch``)
    under ``launcher`` (:func:`_launch`): the trained weights and every rank's report."""
    worker = ROOT / "tests" / "accelerate_workers" / "trainer_rebalance.py"
    _launch(launcher, worker, str(out), resume, "6", str(batch))
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("[0-9].json"))]
    return torch.load(out / "final.pt"), reports


@pytest.mark.multiproc
def test_trainer_rebalancing_follows_the_ranks_speeds_and_resumes_with_its_shares(tmp_path):
    """BalancedTrainer(rebalance_every=1) on 2 ranks, rank 1 three times slower (only the
    clock is faked): from equal shares it moves to 6 : 2, the best split, at its first
    decision (after one optimizer step of two micro-batches), from the first batch no loader
    had cut, and stays; its models are the ranks' real per-row costs. Every step's logged
    shares are those its last micro-batch ran at; the weights are one process's on the same
    global batches (GPT-2, float64, AdamW). Resumed from the checkpoint after step 2, it runs
    at the saved 6 : 2 from its first batch (not the equal start) with the saved models, and
    ends where the uninterrupted run does; resumed at a global batch of 12, it starts at the
    saved proportions, 9 : 3. One process takes rebalance_every too (nothing to balance: it
    raised at the first decision, wanting a process group), and the step timer's hooks come
    off the model when train() ends."""
    one, (alone,) = _rebalanced(tmp_path / "one", [sys.executable])
    assert alone["decisions"] == [] and alone["hooks_left"] == 0
    whole, reports = _rebalanced(tmp_path / "whole", FORKED)
    assert _max_diff(one, whole) < 1e-10
    first, second = reports
    steps = [s for s, _ in first["ran"]]
    assert steps == [s for s, _ in second["ran"]] == [1, 1, 2, 2, 3, 4, 4, 5, 5, 6]
    ran = [[a, b] for (_, a), (_, b) in zip(first["ran"], second["ran"], strict=True)]
    assert ran == [[4, 4]] * 3 + [[6, 2]] * 7  # the fourth batch was the first not yet cut
    last_of_step = {s: rows for s, rows in zip(steps, ran, strict=True)}
    for r in reports:
        assert r["hooks_left"] == 0
        assert r["logged"] == [last_of_step[s] for s in range(1, 7)]
        assert [d[1:] for d in r["decisions"]] == [[[6, 2], True]] + [[[6, 2], False]] * 4
        assert r["speeds"] == pytest.approx([1000.0, 1000.0 / 3], rel=1e-9)
    saved = json.loads((tmp_path / "whole" / "checkpoint-2" / "rebalancer.json").read_text())
    assert saved["shares"] == [6, 2] and saved["rebalancer"]["step"] == 4
    resumed, again = _rebalanced(
        tmp_path / "resumed", FORKED, str(tmp_path / "whole" / "checkpoint-2")
    )
    assert _max_diff(resumed, whole) < 1e-10
    for r in again:  # steps 3 to 6: from the saved shares on, deciding as before
        assert [s for s, _ in r["ran"]] == [3, 4, 4, 5, 5, 6]
        assert [d[0] for d in r["decisions"]] == [6, 8, 10]
        assert r["speeds"] == pytest.approx([1000.0, 1000.0 / 3], rel=1e-9)
    assert [rows for _, rows in again[0]["ran"]] == [6] * 6
    assert [rows for _, rows in again[1]["ran"]] == [2] * 6
    _, wider = _rebalanced(
        tmp_path / "wider", FORKED, str(tmp_path / "whole" / "checkpoint-2"), batch=12
    )
    assert [[r["ran"][0][1] for r in wider]] == [[9, 3]]  # the saved 6 : 2 of a batch of 12


# -- checks across real ranks ------------------------------------------------------------------


def _workers(
    tmp: Path, script: str, launcher: list[str] | int, monkeypatch: pytest.MonkeyPatch
) -> list[dict]:
    """tests/accelerate_workers/``script`` on two ranks under ``launcher`` (:func:`_launch`):
    each rank's report."""
    monkeypatch.setenv("HETCOLL_TEST_OUT", str(tmp))
    _launch(launcher, ROOT / "tests" / "accelerate_workers" / script)
    return [json.loads((tmp / f"{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.multiproc
def test_bad_input_raises_on_every_rank_and_a_rank_without_tokens_weighs_zero(
    tmp_path, monkeypatch
):
    reports = _workers(tmp_path, "cases.py", FORKED, monkeypatch)
    # The rank that read a bad rebalancer.json names it; the other is told.
    assert reports[1]["rebalancer_bad"]["raised"] == "ValueError"
    assert reports[1]["rebalancer_bad"]["message"].startswith("resume_from_checkpoint: ")
    assert reports[0]["rebalancer_bad"]["raised"] == "CollectiveMismatchError"
    for o in reports:
        assert o["world"] == 2
        assert o["bad_items"]["raised"] == "ValueError"
        assert o["bad_items"]["message"].startswith("items: rank 1 counted -3")
        assert o["micro_batches"]["raised"] == "CollectiveMismatchError"
        assert "micro-batches in the step" in o["micro_batches"]["message"]
        assert o["shares"]["raised"] == "CollectiveMismatchError"
        assert o["shares_sum"] == {
            "raised": "ValueError",
            "message": "shares: sum to 9, but the global batch is 8",
        }
        assert o["average_tokens"]["raised"] == "ValueError"
        assert o["average_tokens"]["message"].startswith("average_tokens_across_devices:")
        assert o["no_kwargs"]["raised"] == "ValueError"
        assert o["no_kwargs"]["message"].startswith("model:")
        # A forward taking num_items_in_batch whose loss ignores it (BERT's classification
        # heads: the ranks were weighed 1 : 1 at shares 5 : 3, silently).
        assert o["ignores_items"]["raised"] == "ValueError"
        assert o["ignores_items"]["message"].startswith(
            "model: its forward takes num_items_in_batch but its loss does not divide by it"
        )
        assert o["strategy"]["message"].startswith("train_sampling_strategy:")
        assert o["rebalancer_missing"]["raised"] == "CollectiveMismatchError"
        assert "rebalancer.json found" in o["rebalancer_missing"]["message"]
        assert o["rebalancer_good"]["raised"] == "" and o["restored_shares"] == [6, 2]
        assert o["ranks"]["message"] == "speeds: has 3 entries for 2 processes"
        zero = o["zero_rank"]
        assert zero["weights"] == [1.0, 0.0] and zero["counts"][0] > 0 and zero["finite"]
        assert zero["max_grad_diff"] < 1e-12
        # GPT-2's loss averages over its shifted targets: Trainer counted its labels (a row's
        # first too; its class names no loss_type) and trained 3e-2 away from one process.
        gpt2 = o["gpt2_targets"]
        assert gpt2["counted"] == [gpt2["targets"]] and gpt2["max_diff"] < 1e-12, gpt2


@pytest.mark.multiproc
@pytest.mark.skipif(torch.cuda.is_available(), reason="Accelerate takes the GPUs there")
def test_torchrun_without_gpus_and_without_the_cpu_flag_is_named(tmp_path, monkeypatch):
    """Accelerate under torchrun on a host without GPUs runs as one process unless given
    cpu=True (use_cpu=True), though torch.distributed has every rank: each rank took the whole
    batch (prepare_balanced raised on the speeds' count, BalancedTrainer on its fits)."""
    for out in _workers(tmp_path, "without_cpu_flag.py", TORCHRUN, monkeypatch):
        assert (out["processes"], out["world"]) == (1, 2), out
        said = "accelerator: Accelerate runs 1 process(es) but torch.distributed has 2 ranks"
        assert out["prepare_balanced"].startswith(said), out
        assert out["prepare_balanced"].endswith("pass Accelerator(cpu=True)"), out
        assert out["trainer"].startswith(said), out
        assert out["trainer"].endswith("pass TrainingArguments(use_cpu=True)"), out


# -- one process -------------------------------------------------------------------------------


def test_balanced_shares_and_its_bad_input():
    from hetcoll.accelerate import balanced_shares
    from hetcoll.torch import SpeedFit

    assert balanced_shares(8, 2, shares=[5, 3]) == [5, 3]
    assert balanced_shares(8, 2, speeds=[3.0, 1.0]) == [6, 2]
    assert balanced_shares(8, 2) == [4, 4]
    fits = [SpeedFit(0.0, 300.0), SpeedFit(0.0, 100.0, capacity=1)]
    assert balanced_shares(8, 2, fits=fits) == [7, 1]  # rank 1 holds one sample
    for kwargs, argument in (
        ({"shares": [5, 3], "speeds": [1, 1]}, "speeds"),
        ({"shares": [5, 4]}, "shares"),
        ({"shares": [8]}, "shares"),
        ({"shares": [8, 0]}, "shares"),
        ({"speeds": [1.0, -1.0]}, "speeds"),
        ({"speeds": [1.0]}, "speeds"),
        ({"fits": [fits[0]]}, "fits"),
    ):
        with pytest.raises(ValueError, match=rf"^{argument}"):
            balanced_shares(8, 2, **kwargs)
    # Named as the caller knows them: balanced_shares' total, prepare_balanced's batch_size.
    with pytest.raises(ValueError, match=r"^total: the global batch \(1\)"):
        balanced_shares(1, 2)
    with pytest.raises(ValueError, match=r"^total: must be an integer"):
        balanced_shares(0, 2)
    with pytest.raises(ValueError, match=r"^ranks: must be an integer >= 1"):
        balanced_shares(8, 0, speeds=[])
    assert balanced_shares(np.int64(8), np.int64(2)) == [4, 4]  # numpy integers are integers


def test_one_process_loader_steps_and_token_counts():
    from accelerate import Accelerator
    from accelerate_balanced import text_rows
    from torch.utils.data import default_collate

    from hetcoll.accelerate import (
        causal_lm_items,
        label_items,
        optimizer_steps,
        prepare_balanced,
        step_items,
    )

    accelerator = Accelerator(cpu=True)
    rows = text_rows(10)
    data = prepare_balanced(accelerator, rows, 4, shuffle=False, collate_fn=default_collate)
    assert data.shares == [4] and len(data) == 3
    batches = list(data)
    assert [len(b["input_ids"]) for b in batches] == [4, 4, 2]
    assert torch.equal(batches[1]["input_ids"], torch.stack([r["input_ids"] for r in rows[4:8]]))
    assert data.postfix() == {"shares": "4"} and data.log_entries() == {"share/0": 4.0}
    step = step_items(accelerator, batches[:2])
    valid = [int((b["labels"][:, 1:] != -100).sum()) for b in batches[:2]]
    assert step.local == tuple(valid) and step.num_items == sum(valid)
    assert step.counts == (sum(valid),) and step.loss_scale == 1.0
    assert step.weights.tolist() == [1.0]
    loss = torch.tensor(2.0, dtype=torch.float64)
    assert float(step.scale(loss, 1)) == 2.0 * valid[1] / sum(valid)
    assert label_items(batches[0]) > causal_lm_items(batches[0])
    with pytest.raises(ValueError, match=r"^items: rank 0 counted 1\.5"):
        step_items(accelerator, batches, items=lambda b: 1.5)
    with pytest.raises(ValueError, match=r"^items: every rank counted 0 items"):
        step_items(accelerator, batches, items=lambda b: 0)
    with pytest.raises(TypeError, match=r"^accelerator"):
        step_items(None, batches)  # type: ignore[arg-type]
    assert [len(g) for g in optimizer_steps(data, 2)] == [2, 1]
    assert [len(g) for g in optimizer_steps(range(4), 2)] == [2, 2]
    with pytest.raises(ValueError, match=r"^accumulate"):
        list(optimizer_steps(data, 0))
    with pytest.raises(TypeError, match=r"^batches: must be an iterable"):
        optimizer_steps(None, 1)  # type: ignore[arg-type]
    # Iterable through __getitem__ alone (a map-style dataset) is iterable.
    from torch.utils.data import TensorDataset

    assert [len(g) for g in optimizer_steps(TensorDataset(torch.arange(4)), 2)] == [2, 2]
    with pytest.raises(ValueError, match=r"^batch_size: must be an integer"):
        prepare_balanced(accelerator, rows, 0)
    with pytest.raises(TypeError, match=r"^sampler"):
        prepare_balanced(accelerator, rows, 4, sampler=None)


@pytest.mark.parametrize("skip", [0, 3], ids=["from-the-start", "skip-first-3"])
@pytest.mark.parametrize("workers", [0, 2])
def test_logged_shares_are_those_of_the_step_the_loop_took(workers, skip):
    """Accelerate's loader holds the batch after the one it hands out, and loader workers
    fetch further ahead: new shares apply from a step already cut, and the shares logged for
    a step (``log_entries``) are the ones it ran at, also through ``skip_first_batches`` (how
    Trainer resumes mid-epoch), whose skipped steps are cut but never handed out. They were
    the newest shares (logged 2 where 5 ran)."""
    from accelerate import Accelerator, skip_first_batches
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader

    from hetcoll.accelerate import BalancedLoader
    from hetcoll.torch import BalancedSampler

    Accelerator(cpu=True)
    data = list(range(80))  # 10 steps of 8: rank 0 takes 5, then 2
    sampler = BalancedSampler(data, [5, 3], 0, shuffle=False, verify=False)
    plain = DataLoader(data, batch_sampler=sampler.batch_sampler(), num_workers=workers)
    loader = prepare_data_loader(plain, num_processes=1, process_index=0)
    balanced = BalancedLoader(loader, sampler, None, None)
    ran, logged = [], []
    for k, batch in enumerate(skip_first_batches(loader, skip) if skip else loader):
        ran.append(len(batch))
        logged.append(int(balanced.log_entries()["share/0"]))
        assert balanced.taken_shares() == ([5, 3] if len(batch) == 5 else [2, 6])
        if k == 0:
            sampler.set_shares([2, 6])  # from the first step no loader has cut
    assert logged == ran and len(ran) == 10 - skip
    assert ran[:2] == [5, 5] and ran[-1] == 2  # cut ahead at 5, then 2
    assert sampler.state_dict(ahead=0)["position"] == 80  # the whole epoch, every step taken


def test_trainer_rebalancing_arguments_are_checked(tmp_path):
    from accelerate_balanced import make_model
    from transformers import TrainingArguments

    from hetcoll.accelerate import BalancedTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match=r"^rebalance_every: must be an integer >= 1"):
            BalancedTrainer(model=make_model("gpt2"), args=args, rebalance_every=bad)
    trainer = BalancedTrainer(
        model=make_model("gpt2"), args=args, train_dataset=[{}] * 8, rebalance_every=3
    )
    assert trainer.rebalancer is None  # made with the training loader


def test_logged_shares_read_the_balanced_loader_not_another_active_one():
    """An evaluation loader left mid-way (a loop that breaks) stays Accelerate's active loader:
    the balanced loader's own look-ahead decides, so the epoch's last step, cut at new
    shares, logs them (read from the evaluation loader's, it logged the step before's)."""
    from accelerate import Accelerator
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader

    from hetcoll.accelerate import BalancedLoader
    from hetcoll.torch import BalancedSampler

    Accelerator(cpu=True)
    data = list(range(80))
    sampler = BalancedSampler(data, [5, 3], 0, shuffle=False, verify=False)
    plain = DataLoader(data, batch_sampler=sampler.batch_sampler())
    balanced = BalancedLoader(prepare_data_loader(plain, num_processes=1, process_index=0),
                              sampler, None, None)  # fmt: skip
    evaluation = prepare_data_loader(DataLoader(range(10), batch_size=2), num_processes=1,
                                     process_index=0)  # fmt: skip
    ran, logged, left = [], [], None
    for k, batch in enumerate(balanced.loader):
        if k == 2:
            left = iter(evaluation)
            next(left)  # an evaluation that stops after one batch
        if k == 7:
            sampler.set_shares([2, 6])  # the loader holds step 9: from step 10, the last
        ran.append(len(batch))
        logged.append(balanced.taken_shares()[0])
    assert left is not None
    assert ran == [5] * 9 + [2] and logged == ran
