"""FSDP2 (``fully_shard``) on uneven shares: each rank's loss weighed by
:func:`hetcoll.torch.weigh_loss` trains the model one process trains on the same global batches
(float64, relative 1e-10), where FSDP's own mean of the ranks' means does not; bad counts raise
on every rank (real gloo ranks: tests/fsdp_cases.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hetcoll.launch import spawn

from fsdp_cases import bad_inputs, timed_steps, train, trained

pytestmark = pytest.mark.multiproc


def relative(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(float((g - w).abs().max() / w.abs().max()) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize(
    ("case", "shares", "epochs", "accumulate"),
    [
        ("mlp", [5, 2, 1], 2, 1),
        ("gpt2", [5, 3], 1, 1),
        ("vit", [6, 2], 1, 1),
        ("gpt2", [3, 5], 1, 2),
    ],
)
def test_weighed_losses_train_the_one_process_model(case, shares, epochs, accumulate):
    want = train(case, [sum(shares)], 0, epochs, accumulate=accumulate)
    ranks = spawn(trained, len(shares), case, shares, epochs, accumulate, timeout=300)
    for r in ranks:
        assert relative(r["weighed"], want) < 1e-10
        # FSDP's own mean of the ranks' means: the shares' gradient, not the global batch's.
        assert relative(r["plain"], want) > 1e-4


def test_bad_counts_and_losses_raise_on_every_rank_and_fsdp1_or_tp_refuse_a_step_timer():
    ranks = spawn(bad_inputs, 2)
    for rank, raised in enumerate(ranks):
        assert raised["count -1 on rank 1"].startswith("ValueError: count: rank 1")
        assert raised["count 2.5 on rank 0"].startswith("ValueError: count: rank 0")
        assert raised["a bool tensor on rank 0"].startswith(
            "ValueError: count: rank 0 counted something that is not a number"
        )
        assert raised["zero everywhere"].startswith("ValueError: count: every rank counted 0 for")
        if rank == 0:
            assert raised["loss not a tensor on rank 0"] == (
                "TypeError: loss: must be a tensor, got float"
            )
        else:
            assert raised["loss not a tensor on rank 0"].startswith(
                "CollectiveMismatchError: rank 0 raised TypeError: loss: must be a tensor"
            )
        if rank == 0:
            assert raised["per-row loss on rank 0"] == (
                "ValueError: loss: must be one number (a mean), got shape (3,); reduce it first"
            )
            for name in ("integer loss on rank 1", "complex loss on rank 1"):
                assert raised[name].startswith(
                    "CollectiveMismatchError: rank 1 raised TypeError: loss: must be a real "
                    "floating-point tensor"
                ), name
        else:
            assert raised["per-row loss on rank 0"].startswith(
                "CollectiveMismatchError: rank 0 raised ValueError: loss: must be one number"
            )
            assert raised["integer loss on rank 1"] == (
                "TypeError: loss: must be a real floating-point tensor, got torch.int64"
            )
            assert raised["complex loss on rank 1"] == (
                "TypeError: loss: must be a real floating-point tensor, got torch.complex128"
            )
        assert float(raised["good"]) == pytest.approx(2 * (1 + rank) / 3)
        assert raised["timer fsdp1"].startswith("model: it is sharded by FSDP1")
        assert (
            raised["timer without post_backward"].startswith("model: this torch's FSDP")
            and "FSDPParamGroup.post_backward" in raised["timer without post_backward"]
        )
        assert raised["left wrapped"] == "[]"
        assert raised["timer tensor parallel"].startswith(
            "model: its parameters are sharded by tensor parallelism"
        )
        assert raised["timer before sharding"].startswith(
            "StepTimer.pop: the model's parameters were replaced since the timer was made"
        )


#: What rank 1 sleeps in each block's forward in the StepTimer test below.
SLEEP_S = 0.15


def test_a_step_timer_leaves_fsdps_waits_for_the_slow_rank_out():
    """The real clock, on 2 gloo ranks: GPT-2 sharded by its blocks, rank 1 sleeping 0.15 s in
    each of its 3 blocks' forwards (0.45 s a forward). Every layer of rank 0 waits for rank 1's
    gathers, so its step lasts as long as rank 1's; its timer reads its own compute without
    those waits."""
    fast, slow = spawn(timed_steps, 2, SLEEP_S, timeout=240)
    asleep = 3 * SLEEP_S  # rank 1's sleep in a forward
    for name in (
        "step",
        "two micro-batches",
        "evaluated before pop",
        "beside a removed timer",
        "blocks only",
    ):
        micro = 2 if name == "two micro-batches" else 1
        (fast_s, fast_wall), (slow_s, _) = fast[name], slow[name]
        assert fast_wall > micro * 0.9 * asleep, name  # FSDP made it wait
        # The timer counted neither FSDP's waits nor weigh_loss's (measured about 0.02 s a
        # forward and backward), nor, read after an evaluation, FSDP's spans in it.
        assert 0.0 < fast_s < 0.4 * micro * asleep, name
        assert slow_s > micro * 0.9 * asleep, name  # the slow rank's own time is its own
    for r in (fast, slow):
        assert r["evaluation"].startswith("StepTimer.pop: the model ran no forward")
        assert r["restored"] and r["restored when dropped"]


def _lightning_fit(tmp_path: Path, *args: str) -> list[dict]:
    """``fsdp_cases.lightning_main`` on 2 ranks under torchrun: each rank's report."""
    pytest.importorskip("lightning")
    torchrun = Path(sys.executable).parent / "torchrun"
    cases = Path(__file__).parent / "fsdp_cases.py"
    launch = [str(torchrun), "--standalone", "--nproc-per-node=2", str(cases)]
    proc = subprocess.run(
        [*launch, str(tmp_path), *args],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_lightning_model_parallel_strategy_with_weighed_losses_is_the_one_process_model(tmp_path):
    """Lightning's ModelParallelStrategy (FSDP2 in configure_model), a BalancedSampler loader
    of the user's at 5:3 and weigh_loss in training_step, 2 epochs under torchrun."""
    reports = _lightning_fit(tmp_path, "5,3", "2")
    assert [r["shares"] for r in reports] == [[5, 3]] * 2
    want = train("gpt2", [8], 0, 2)
    for rank in range(2):
        assert relative(torch.load(tmp_path / f"rank{rank}.pt"), want) < 1e-10


def test_lightning_rebalancing_under_model_parallel_strategy_follows_the_slow_rank(tmp_path):
    """The same from 4:4, rank 1 sleeping 0.05 s in each of its 3 blocks' forwards, with a
    Rebalancing callback deciding every 2 batches: its StepTimer leaves FSDP's waits out, so
    rank 1 reads slow and the shares move to rank 0 (timed with the waits, both ranks would
    read alike); the model is still one process's."""
    reports = _lightning_fit(tmp_path, "4,4", "3", "0.05")
    assert reports[0] == reports[1]
    final = reports[0]["shares"]
    assert reports[0]["moved"] >= 1 and sum(final) == 8 and final[0] > final[1]
    want = train("gpt2", [8], 0, 3)
    for rank in range(2):
        assert relative(torch.load(tmp_path / f"rank{rank}.pt"), want) < 1e-10
