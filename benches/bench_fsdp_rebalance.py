"""Throughput of FSDP2 (``torch.distributed.fsdp.fully_shard``) balanced by hetcoll on two ranks
of unequal speed, rebalancing as it trains, against plain FSDP2.

Two gloo CPU ranks under torchrun, one thread each, rank 1 at an *emulated* half speed (its
layers sleep as long again as their own forward and backward: `hetcoll.lab.emulate.slow_down`,
put on the layers before sharding), train the GPT-2 of benches/bench_trainer_rebalance.py
(examples/train_lm.py's `make_model`: a byte vocabulary, eager attention), sharded by its blocks
and then its root (`fully_shard`), with SGD at a constant rate, five ways, each on the same
global batch (32 rows of 64 tokens) for the same 20 optimizer steps: plain FSDP2 (equal shares
from torch's `DistributedSampler`, FSDP's own mean of the ranks' means; the peer, as FSDP runs
today), `weigh_loss` at equal shares from a `BalancedSampler` (what weighing costs: it should
match the peer), `weigh_loss` at the probe's shares (`measure_speed` on each rank's model
before sharding, `gather_speeds`, `hetcoll.split`, as examples/train_balanced.py plans them; no
rebalancing), `weigh_loss` with a `StepTimer` (made after `fully_shard`) feeding
`Rebalancer(every=2)` from equal shares, and the fast rank alone (one process, the whole batch,
no FSDP). The four two-rank runs take turns in one launch (a fresh model each, their order
rotated from launch to launch); the fast rank alone is a launch of its own beside each.

The model is compute-bound: 4 blocks of width 256 (3.2M parameters) on rows of 64 tokens, its
forward, backward and SGD step on one thread about 0.2 s for 16 rows, against FSDP's gathers
and reduce-scatters of a few MB per block between two local gloo ranks. The loss is the mean
over a rank's rows' next-token predictions (every token valid, as many per row), weighed by the
rows (`weigh_loss(loss, len(idx))`).

Throughput: the steady state, the global batch over the median optimizer step of steps 7 to
20 by rank 0's clock: start-up, the probe and the rebalancer's first decision are left out
(the notes give the mean over the same steps too). The ideal is the sum of the two ranks' own
speeds, measured in each two-rank launch as bench_trainer_rebalance.py measures it (its
`own_speed`): each rank's forward, backward and SGD step, unsharded, at its share of the batch
split by speeds 1 : 0.5 (22 : 10), the two ranks at once, no communication. Medians and spread
over 3 launch pairs in which no rank waited for a core more than 5% of its timed steps (Linux's
/proc/self/schedstat); up to 6 pairs are tried, and if fewer than 3 are quiet all are kept, as
the notes then say. Heterogeneity is emulated: no figure here comes from ranks of really
different hardware.

    make bench-fsdp-rebalance      # writes benches/results/fsdp_rebalance.json
    HETCOLL_BENCH_QUICK=1 python -m pytest benches/bench_fsdp_rebalance.py -s   # a dry run

Lab code, like everything in benches/: it imports the library, the library never imports it.
Run as a script, this file is the launches' worker (see ``worker_main``).
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable, Iterable
from itertools import pairwise
from typing import Any

import pytest
import torch

# The trainer benchmark's model, data, sizes, launches, quiet-launch filter, ideal and records.
from bench_trainer_rebalance import (
    REBALANCE_EVERY,
    SIZE,
    SPEEDS,
    STEPS,
    WARMUP,
    make_model,
    measure_pairs,
    record_arms,
    record_decisions,
    record_method,
    run_launch,
    shares_text,
    text_rows,
    waited,
    worker_arguments,
)
from torch import nn

LR = 0.05  # SGD's constant rate, as the trainer benchmark's arguments
#: The probe's time limit per rank (seconds; the trainer benchmark's ``measure_budget``).
PROBE_BUDGET = 2.0
#: The two-rank configurations (each launch runs them all, in a rotated order).
CONFIGS = ("plain", "equal", "measured", "rebalance")
WEIGHED = ("equal", "measured", "rebalance")
NAMES = {
    "plain": "plain FSDP2 (equal split, FSDP's own mean)",
    "equal": "weigh_loss, equal shares",
    "measured": "weigh_loss, the probe's shares (measure_speed), no rebalancing",
    "rebalance": f"weigh_loss + StepTimer + Rebalancer(every={REBALANCE_EVERY}), from equal shares",
    "alone": "the fast rank alone (1 process, whole batch, no FSDP)",
}
SHORT = {
    "plain": "plain FSDP2",
    "equal": "equal shares",
    "measured": "measured",
    "rebalance": "rebalancing",
    "alone": "fast rank alone",
}


# -- the worker: one launch, run under torchrun (two ranks) or alone -------------------------------


def lm_loss(out: Any, ids: torch.Tensor) -> torch.Tensor:
    """The mean over the rows' next-token predictions (Hugging Face's causal-LM loss: the
    logits shifted against the labels)."""
    logits = out.logits[:, :-1]
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def probe_shares(
    model: nn.Module, ids: torch.Tensor, ranks: int
) -> tuple[list[int], list[list[float]]]:
    """examples/train_balanced.py's plan_shares: this rank's training step (forward, backward,
    SGD) timed by ``measure_speed`` at a few sizes up to the global batch, on a copy of the
    (slowed, unsharded) ``model``; every rank's fit; ``hetcoll.split``. The shares, and each
    rank's fitted samples/s and latency."""
    import hetcoll
    from hetcoll.torch import gather_speeds, measure_speed

    top = SIZE["batch"]
    fit = measure_speed(
        model,
        lambda b: (ids[:b], ids[:b]),
        lm_loss,
        batch_sizes=sorted({max(1, top // 8), max(2, top // 4), max(3, top // 2), top}),
        optimizer=lambda params: torch.optim.SGD(params, lr=LR),
        time_budget=PROBE_BUDGET,
        probe_memory=True,
    )
    fits = gather_speeds(fit) if ranks > 1 else [fit]
    shares = hetcoll.split(
        top,
        [f.samples_per_s for f in fits],
        latency=[f.latency_s for f in fits],
        capacity=[f.capacity or top for f in fits],
        minimum=1,
    )
    return shares, [[f.samples_per_s, f.latency_s] for f in fits]


def plain_batches(rows: int, ranks: int, rank: int) -> list[list[int]]:
    """Torch's ``DistributedSampler`` cut into equal batches: how FSDP's data is split today."""
    from torch.utils.data import BatchSampler, DistributedSampler, TensorDataset

    dataset = TensorDataset(torch.arange(rows))  # only its length counts
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset, num_replicas=ranks, rank=rank, shuffle=True, seed=0
    )
    return list(BatchSampler(sampler, SIZE["batch"] // ranks, drop_last=False))


def gathered(value: Any, ranks: int) -> list[Any]:
    """Every rank's ``value`` (rank order)."""
    if ranks == 1:
        return [value]
    import torch.distributed as dist

    every: list[Any] = [None] * ranks
    dist.all_gather_object(every, value)
    return every


def run_config(config: str, rank: int, ranks: int, ids: torch.Tensor) -> dict[str, Any]:
    """One training run of ``config`` (a fresh model, rank ``rank`` slowed to its emulated
    speed, then sharded): its steady-state step time, the shares, the timer's readings."""
    from hetcoll.lab.emulate import slow_down
    from hetcoll.torch import BalancedSampler, Rebalancer, StepTimer, weigh_loss

    batch = SIZE["batch"]
    model = make_model()
    slowed = slow_down(model, SPEEDS[rank]) if ranks > 1 else None
    shares, probed, probe_s = [batch // ranks] * ranks, None, None
    if config == "measured":
        t0 = time.perf_counter()
        shares, probed = probe_shares(model, ids, ranks)
        probe_s = time.perf_counter() - t0
    if ranks > 1:
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:  # type: ignore[union-attr]
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sampler = timer = rebalancer = None
    steps: Iterable[list[int]]
    if config in WEIGHED:
        sampler = BalancedSampler(range(len(ids)), shares, rank, seed=0)
        steps = sampler.batch_sampler()
    else:
        steps = plain_batches(len(ids), ranks, rank)
    if config == "rebalance":
        timer = StepTimer(model)  # after fully_shard: on its parameters
        rebalancer = Rebalancer(sampler, every=REBALANCE_EVERY)  # type: ignore[arg-type]
    ends: list[float] = []
    waits: list[float] = []
    step_shares: list[list[int]] = []
    timed: list[float] = []  # the timer's seconds per step (this rank)
    for idx in steps:
        x = ids[idx]
        loss = lm_loss(model(input_ids=x), x)
        if config in WEIGHED:  # FSDP divides the ranks' sum by their number: weigh by rows
            loss = weigh_loss(loss, len(idx))
        loss.backward()
        if timer is not None and rebalancer is not None:
            seconds = timer.pop()
            timed.append(seconds)
            rebalancer.observe(len(idx), seconds)
        opt.step()
        opt.zero_grad()
        ends.append(time.perf_counter())
        waits.append(waited())
        step_shares.append(sampler.taken_shares() if sampler is not None else list(shares))
    if len(ends) != STEPS:
        raise RuntimeError(f"{config}: {len(ends)} optimizer steps, expected {STEPS}")
    durations = [b - a for a, b in pairwise(ends)]  # steps 2 to STEPS
    steady = ends[-1] - ends[WARMUP - 1]
    mine = {
        "waited": (waits[-1] - waits[WARMUP - 1]) / steady,
        # The timer's steady-state reading: the median of this rank's steps after WARMUP, and
        # the rows it ran then (its share at the end).
        "timed_s": statistics.median(timed[WARMUP:]) if timed else None,
        "timed_rows": step_shares[-1][rank],
    }
    every = gathered(mine, ranks)
    report: dict[str, Any] = {
        # The steady state: the median optimizer step after the first WARMUP (a burst of the
        # shared host's other work moves a mean more than the run's own pace).
        "step_s": statistics.median(durations[WARMUP - 1 :]),
        "mean_step_s": steady / (STEPS - WARMUP),
        "waited": [m["waited"] for m in every],
        "durations": durations,
        "shares": step_shares[-1],  # the shares the last step ran at
        "step_shares": step_shares,
        "probe": probed,
        "probe_s": probe_s,
        "timed_s": [m["timed_s"] for m in every],
        "timed_rows": [m["timed_rows"] for m in every],
        "rebalancer_speeds": None,
        "decisions": [],
    }
    if rebalancer is not None:
        report["rebalancer_speeds"] = rebalancer.speeds
        report["decisions"] = [
            {"batch": e.step, "shares": list(e.new_shares), "applied": e.applied}
            for e in rebalancer.history
        ]
    if timer is not None:
        timer.remove()
    if slowed is not None:
        slowed.remove()
    del model, opt, timer, rebalancer
    gc.collect()  # FSDP's state goes while the process group still exists
    return report


def worker_main(argv: list[str] | None = None) -> None:
    """One launch: ``--configs`` in that order (two ranks under torchrun: first each rank's own
    speed for the ideal), rank 0 writing the report as ``--json``."""
    import torch.distributed as dist

    args = worker_arguments(argv, __file__, NAMES)
    torch.set_num_threads(1)
    data = text_rows(STEPS * SIZE["batch"])
    ids = torch.stack([row["input_ids"] for row in data])
    if "WORLD_SIZE" in os.environ:  # torchrun
        dist.init_process_group("gloo")
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    run_launch(args, rank, ranks, data, lambda config: run_config(config, rank, ranks, ids))


# -- the benchmark: the launches, their medians -------------------------------------------------


@pytest.mark.timeout(1800)  # 3 to 6 launch pairs of about 2 minutes on 2 cores
def test_fsdp_rebalance(record: Callable[..., None], figure: Callable[..., None]) -> None:
    m = measure_pairs(CONFIGS, __file__)
    group = (
        f"GPT-2 ({SIZE['layers']} blocks of width {SIZE['hidden']}) under FSDP2, 2 gloo ranks at "
        f"emulated speeds {SPEEDS[0]:g} and {SPEEDS[1]:g}, global batch {SIZE['batch']} x "
        f"{SIZE['seq']} tokens, {STEPS} steps (median of {len(m.kept)} launches)"
    )
    record_arms(record, figure, group, m, "plain", NAMES, SHORT)
    runs = m.runs
    record_decisions(figure, group, m)
    figure(
        group,
        "StepTimer in the rebalancing run: each rank's own samples/s by its timer (its last "
        f"share over the median of its steps {WARMUP + 1} to {STEPS}), rank 0, rank 1; the "
        "Rebalancer's modelled speeds; by launch",
        "; ".join(
            ", ".join(f"{n / s:.1f}" for n, s in zip(r["timed_rows"], r["timed_s"]))
            + " (model "
            + ", ".join(f"{v:.1f}" for v in r["rebalancer_speeds"] or [])
            + ")"
            for r in runs["rebalance"]
        ),
    )
    figure(
        group,
        "StepTimer in the rebalancing run: each rank's timed compute / rank 0's whole step "
        "(steady medians), rank 0, rank 1, by launch",
        "; ".join(
            ", ".join(f"{s / r['step_s']:.0%}" for s in r["timed_s"]) for r in runs["rebalance"]
        ),
    )
    figure(
        group,
        "the probe's speeds (samples/s) and latencies (ms), rank 0, rank 1, and shares, by launch",
        "; ".join(
            ", ".join(f"{v:.1f} ({a * 1e3:.0f} ms)" for v, a in r["probe"] or [])
            + f" -> {shares_text(r['shares'])} in {r['probe_s']:.1f} s"
            for r in runs["measured"]
        ),
    )
    record_method(figure, group, m, "plain", SHORT, "; the probe's time is outside the timed steps")
    assert all(r["shares"] == [SIZE["batch"] // 2] * 2 for r in runs["equal"])


if __name__ == "__main__":
    worker_main()
