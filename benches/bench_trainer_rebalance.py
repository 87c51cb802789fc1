"""Throughput of ``hetcoll.accelerate.BalancedTrainer`` under Hugging Face's ``Trainer`` on two
ranks of unequal speed, rebalancing as it trains against plain ``transformers.Trainer``.

Two gloo CPU ranks under torchrun, one thread each, rank 1 at an *emulated* half speed (its
layers sleep as long again as their own forward and backward: `hetcoll.lab.emulate.slow_down`,
what `examples/hf_trainer_balanced.py --emulate 1,0.5` does), train a GPT-2 built from a config
(byte vocabulary, eager attention, SGD at a constant rate, the example's `TrainingArguments`)
five ways, each on the same global batch (32 rows of 64 tokens) for the same 20 optimizer
steps: plain `transformers.Trainer` (DDP's equal split; the peer), `BalancedTrainer` at equal
shares (no rebalancing: it should match the peer), `BalancedTrainer(rebalance_every=2)` starting
from equal shares, `BalancedTrainer(measure=True)` (the probe's shares, no rebalancing), and the
fast rank alone (plain `Trainer`, one process, the whole batch). The four two-rank runs take
turns in one launch (a fresh model each, their order rotated from launch to launch); the fast
rank alone is a launch of its own beside each.

The model is compute-bound: 4 blocks of width 256 (3.2M parameters) on rows of 64 tokens. Its
forward, backward and SGD step on one thread take about 0.2 s for 16 rows and 0.4 s for 32, in
proportion to the rows, against fixed costs per step of a few percent of that (Trainer's step,
DDP's allreduce of the 13 MB of gradients: about 14 ms between two local gloo ranks). At the
example's default size (2 blocks of width 32, rows of 16 bytes) a two-rank Trainer step takes
10 to 20 ms of which the ranks' compute is a few, which a per-row speed model cannot tell apart
from the fixed part: there the probe and the rebalancer shift rows off the slow rank past the
speeds' 11 : 5 of 16 (to 15 : 1 in a dry run, ``HETCOLL_BENCH_QUICK=1``, which runs that size),
and the shifted splits run no faster than the equal one there.

Throughput: the steady state, the global batch over the median optimizer step of steps 7 to
20 by rank 0's clock (a `TrainerCallback` at every step's end): start-up, the probe and the
rebalancer's first decision are left out (the notes give the mean over the same steps too, and
Trainer's own `train_samples_per_second`, the whole loop). The ideal is the sum of the two
ranks' own speeds, measured in each two-rank launch: each rank's forward, backward and SGD step
at its share of the batch split by speeds 1 : 0.5 (22 : 10), the two ranks at once as in
training, no communication. Medians and spread over 3 launch pairs in which no rank waited for
a core more than 5% of its timed steps (Linux's /proc/self/schedstat: on a shared host another
job's burst slows the full-speed rank more than the sleeping one, and moves a run's best split);
up to 6 pairs are tried, and if fewer than 3 are quiet all are kept, as the notes then say.
Heterogeneity is emulated: no figure here comes from ranks of really different hardware.

    make bench-trainer-rebalance      # writes benches/results/trainer_rebalance.json
    HETCOLL_BENCH_QUICK=1 python -m pytest benches/bench_trainer_rebalance.py -s   # a dry run

Lab code, like everything in benches/: it imports the library, the library never imports it.
Run as a script, this file is the launches' worker (see ``worker_main``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import TrainerCallback

#: The emulated speed of each rank: rank 1 at half of its real speed.
SPEEDS = (1.0, 0.5)
#: ``HETCOLL_BENCH_QUICK=1``: a dry run (the example's tiny model, 1 launch, a few steps).
QUICK = os.environ.get("HETCOLL_BENCH_QUICK") == "1"
#: The model and the global batch: GPT-2 blocks, their width, heads, row length, rows per step.
SIZE = (
    {"layers": 2, "hidden": 32, "heads": 2, "seq": 16, "batch": 16}
    if QUICK
    else {"layers": 4, "hidden": 256, "heads": 4, "seq": 64, "batch": 32}
)
STEPS = 6 if QUICK else 20  # optimizer steps per run, one epoch
WARMUP = 2 if QUICK else 6  # steps left out of the steady state
#: Launch pairs (the two-rank launch and the fast rank alone) kept for the medians: quiet ones,
#: where no rank waited for a core more than ``BUSY`` of the time it was timed; at most
#: ``MAX_LAUNCHES`` tried, else every one tried is kept (and the notes say so).
LAUNCHES = 1 if QUICK else 3
MAX_LAUNCHES = 1 if QUICK else 6
BUSY = 0.05
REBALANCE_EVERY = 2
#: The two-rank configurations (each launch runs them all, in a rotated order).
CONFIGS = ("trainer", "equal", "rebalance", "measured")
NAMES = {
    "trainer": "plain transformers.Trainer (DDP's equal split)",
    "equal": "BalancedTrainer, equal shares, no rebalancing",
    "rebalance": f"BalancedTrainer(rebalance_every={REBALANCE_EVERY}), from equal shares",
    "measured": "BalancedTrainer(measure=True), no rebalancing",
    "alone": "plain Trainer, the fast rank alone (1 process, whole batch)",
}
SHORT = {
    "trainer": "plain Trainer",
    "equal": "equal shares",
    "rebalance": "rebalancing",
    "measured": "measured",
    "alone": "fast rank alone",
}
#: Standard-library modules whose source is the text (they ship with every CPython).
CORPUS = ("textwrap.py", "string.py", "difflib.py", "argparse.py")


# -- the worker: one launch, run under torchrun (two ranks) or alone -------------------------------


def make_model() -> nn.Module:
    """GPT-2 of ``SIZE`` as examples/train_lm.py builds it (a byte vocabulary, no dropout,
    eager attention); the same weights on every rank."""
    from bench_tensor_parallel import lm_example

    torch.manual_seed(0)
    return lm_example().make_model(  # type: ignore[no-any-return]
        "gpt2",
        hidden=SIZE["hidden"],
        layers=SIZE["layers"],
        heads=SIZE["heads"],
        positions=SIZE["seq"],
    )


def text_rows(rows: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``rows`` rows of ``SIZE["seq"]`` bytes of the standard library's source from random
    places, every token valid (the same compute on every row)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data = b"".join((stdlib / name).read_bytes() for name in CORPUS)
    text = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    seq = SIZE["seq"]
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(text) - seq, (rows,), generator=g).tolist()
    out = []
    for start in starts:
        ids = text[start : start + seq].clone()
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return out


def training_arguments(output_dir: str) -> Any:
    """examples/hf_trainer_balanced.py's arguments: SGD at a constant rate, every step logged
    (``share/r`` in BalancedTrainer's logs), nothing saved; the global batch ``SIZE["batch"]``
    split among the processes."""
    from transformers import TrainingArguments

    args = TrainingArguments(
        output_dir=output_dir,
        use_cpu=True,
        per_device_train_batch_size=1,  # set below, once the processes are known
        num_train_epochs=1,
        learning_rate=0.05,
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        seed=0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        ddp_find_unused_parameters=False,
        disable_tqdm=True,
    )
    args.per_device_train_batch_size = SIZE["batch"] // args.world_size
    return args


def waited() -> float:
    """Seconds this process's main thread has spent runnable but waiting for a core (Linux's
    /proc/self/schedstat; 0 where there is none): the host's other work taking the CPU."""
    try:
        return int(Path("/proc/self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def own_speed(
    rank: int, share: int, data: list[dict[str, torch.Tensor]], steps: int
) -> tuple[float, float]:
    """This rank's own samples/s at ``share`` rows: forward, backward and SGD step of the model
    (emulated speed included), no communication, timed after one warm-up step; every rank at
    once (a barrier first), as in training. And the part of that time it waited for a core."""
    import torch.distributed as dist
    from torch.utils.data import default_collate

    from hetcoll.lab.emulate import slow_down

    model = make_model()
    slowed = slow_down(model, SPEEDS[rank])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    batch = default_collate(data[:share])

    def step() -> None:
        opt.zero_grad()
        model(**batch).loss.backward()
        opt.step()

    step()
    dist.barrier()
    t0, w0 = time.perf_counter(), waited()
    for _ in range(steps):
        step()
    seconds = time.perf_counter() - t0
    slowed.remove()
    return share * steps / seconds, (waited() - w0) / seconds


class StepClock(TrainerCallback):
    """The time at every optimizer step's end, by this process's clock."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.waited: list[float] = []  # :func:`waited` at each step's end

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.ends.append(time.perf_counter())
        self.waited.append(waited())


def run_config(
    config: str, rank: int, ranks: int, data: list[dict[str, torch.Tensor]]
) -> dict[str, Any]:
    """One training run of ``config`` (a fresh model, rank ``rank`` slowed to its emulated
    speed): its steady-state step time, Trainer's own throughput, the shares."""
    from transformers import Trainer

    from hetcoll.accelerate import BalancedTrainer
    from hetcoll.lab.emulate import slow_down

    model = make_model()
    slowed = slow_down(model, SPEEDS[rank]) if ranks > 1 else None
    clock = StepClock()
    with tempfile.TemporaryDirectory() as out:
        common: dict[str, Any] = {
            "model": model,
            "args": training_arguments(out),
            "train_dataset": data,
            "callbacks": [clock],
        }
        if config in ("trainer", "alone"):
            trainer: Trainer = Trainer(**common)
        else:
            trainer = BalancedTrainer(
                **common,
                measure=config == "measured",
                measure_budget=2.0,
                rebalance_every=REBALANCE_EVERY if config == "rebalance" else None,
            )
        metrics = trainer.train().metrics
    ends = clock.ends
    if len(ends) != STEPS:
        raise RuntimeError(f"{config}: {len(ends)} optimizer steps, expected {STEPS}")
    durations = [b - a for a, b in pairwise(ends)]  # steps 2 to STEPS
    report: dict[str, Any] = {
        # The steady state: the median optimizer step after the first WARMUP (a burst of the
        # shared host's other work moves a mean more than the run's own pace).
        "step_s": statistics.median(durations[WARMUP - 1 :]),
        "mean_step_s": (ends[-1] - ends[WARMUP - 1]) / (STEPS - WARMUP),
        # Every rank's wait for a core over those steps, a part of their time (below).
        "waited": (clock.waited[-1] - clock.waited[WARMUP - 1]) / (ends[-1] - ends[WARMUP - 1]),
        "durations": durations,
        "trainer_samples_per_s": metrics["train_samples_per_second"],
        "shares": [SIZE["batch"] // ranks] * ranks,
        "step_shares": None,
        "speeds": None,
        "decisions": [],
    }
    if isinstance(trainer, BalancedTrainer):
        assert trainer.balanced is not None
        report["speeds"] = trainer.balanced.speeds
        logged = [e for e in trainer.state.log_history if "share/0" in e]
        report["step_shares"] = [[int(e[f"share/{r}"]) for r in range(ranks)] for e in logged]
        # The shares the last step ran at (not a decision after it, which no step used).
        report["shares"] = report["step_shares"][-1]
        if trainer.rebalancer is not None:
            report["decisions"] = [
                {"batch": e.step, "shares": list(e.new_shares), "applied": e.applied}
                for e in trainer.rebalancer.history
            ]
    if ranks > 1:
        import torch.distributed as dist

        every: list[Any] = [None] * ranks
        dist.all_gather_object(every, report["waited"])
        report["waited"] = every
    else:
        report["waited"] = [report["waited"]]
    if slowed is not None:
        slowed.remove()
    del trainer, model
    gc.collect()  # DDP's reducer goes while the process group still exists
    return report


def worker_arguments(
    argv: list[str] | None, script: str, names: dict[str, str]
) -> argparse.Namespace:
    """A launch's worker's arguments, as :func:`launch` passes them: ``--configs`` (of
    ``names``) and ``--json`` (rank 0's report)."""
    ap = argparse.ArgumentParser(description=f"one launch of {Path(script).name}")
    ap.add_argument("--configs", required=True, help="comma-separated, of " + ", ".join(names))
    ap.add_argument("--json", required=True, help="rank 0's report")
    return ap.parse_args(argv)


def run_launch(
    args: argparse.Namespace,
    rank: int,
    ranks: int,
    data: list[dict[str, torch.Tensor]],
    run: Callable[[str], dict[str, Any]],
) -> None:
    """A launch's worker once its process group is up: every rank's own speed (two ranks),
    then ``run`` of each of ``args.configs`` in order; rank 0 writes the report as
    ``args.json``; the group goes."""
    import torch.distributed as dist

    report: dict[str, Any] = {"size": SIZE, "steps": STEPS, "warmup": WARMUP, "runs": {}}
    if ranks > 1:
        report["own_speeds"] = own_speeds(rank, ranks, data)
    for config in args.configs.split(","):
        report["runs"][config] = run(config)
    if rank == 0:
        Path(args.json).write_text(json.dumps(report))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def own_speeds(rank: int, ranks: int, data: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """Every rank's own speed (:func:`own_speed`) at its share of the batch split by
    ``SPEEDS``, the ranks at once: the shares, each rank's samples/s and how much it waited
    for a core. Collective (torch.distributed)."""
    import torch.distributed as dist

    import hetcoll

    shares = hetcoll.split(SIZE["batch"], list(SPEEDS))
    mine = own_speed(rank, shares[rank], data, steps=2 if QUICK else 6)
    speeds: list[Any] = [None] * ranks
    dist.all_gather_object(speeds, mine)
    return {
        "shares": shares,
        "samples_per_s": [v for v, _ in speeds],
        "waited": [w for _, w in speeds],
    }


def worker_main(argv: list[str] | None = None) -> None:
    """One launch: ``--configs`` in that order (two ranks under torchrun: first each rank's own
    speed for the ideal), rank 0 writing the report as ``--json``."""
    import torch.distributed as dist

    args = worker_arguments(argv, __file__, NAMES)
    torch.set_num_threads(1)
    data = text_rows(STEPS * SIZE["batch"])
    with tempfile.TemporaryDirectory() as out:
        ranks = training_arguments(out).world_size  # sets up the process group under torchrun
    rank = dist.get_rank() if dist.is_initialized() else 0
    run_launch(args, rank, ranks, data, lambda config: run_config(config, rank, ranks, data))


# -- the benchmark: the launches, their medians -------------------------------------------------


def launch(configs: list[str], ranks: int, out: Path, script: str = __file__) -> dict[str, Any]:
    """One launch of ``script``'s worker (this file's; torchrun for two ranks, else one
    process): its report."""
    if ranks > 1:
        torchrun = Path(sys.executable).parent / "torchrun"
        cmd = [str(torchrun), "--standalone", "--nproc-per-node", str(ranks)]
    else:
        cmd = [sys.executable]
    cmd += [script, "--configs", ",".join(configs), "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}\n{proc.stderr[-4000:]}")
    report: dict[str, Any] = json.loads(out.read_text())
    return report


@dataclass(frozen=True)
class _Stats:
    median: float
    iqr: float
    rounds: int


class Launches:
    """What benches/conftest.py's ``record`` reads off a pytest-benchmark fixture
    (``.stats.stats``: median, IQR, rounds), here over launches: each launch's steady-state
    seconds per optimizer step."""

    def __init__(self, seconds: list[float]) -> None:
        q1, _, q3 = (
            statistics.quantiles(seconds, n=4, method="inclusive")
            if len(seconds) > 1
            else seconds * 3
        )
        stats = _Stats(statistics.median(seconds), q3 - q1, len(seconds))
        self.stats = type("Metadata", (), {"stats": stats})()


def shares_text(shares: list[int]) -> str:
    return ":".join(str(s) for s in shares)


def runs_text(values: list[float], fmt: str) -> str:
    return ", ".join(fmt.format(v) for v in values)


def steps_text(step_shares: list[list[int]]) -> str:
    """Shares step by step, runs of the same written once: ``16:16 x3, 21:11 x21``."""
    out: list[list[Any]] = []
    for shares in step_shares:
        if out and out[-1][0] == shares:
            out[-1][1] += 1
        else:
            out.append([shares, 1])
    return ", ".join(f"{shares_text(s)} x{n}" for s, n in out)


def busiest(pair: tuple[dict[str, Any], dict[str, Any]]) -> float:
    """The most any rank of a launch pair waited for a core, a part of its timed time: the
    steady steps of every run and the ranks' own speeds."""
    waits = [w for report in pair for r in report["runs"].values() for w in r["waited"]]
    return max(waits + pair[0]["own_speeds"]["waited"])


@dataclass
class Measured:
    """The launch pairs of a benchmark (two ranks taking turns at ``configs``, and the fast
    rank alone), those kept, and their runs by configuration ("alone" the lone rank's)."""

    tried: list[tuple[dict[str, Any], dict[str, Any]]]
    busy: list[float]  # per pair, the most any rank waited for a core
    kept: list[int]
    runs: dict[str, list[dict[str, Any]]]
    ideal: list[float]  # per kept pair, the sum of the ranks' own speeds (samples/s)
    own: list[dict[str, Any]]  # per kept pair, the ranks' own speeds as measured


def measure_pairs(configs: tuple[str, ...], script: str = __file__) -> Measured:
    """Launch pairs until ``LAUNCHES`` are quiet (no rank waited for a core more than
    ``BUSY`` of its timed steps) or ``MAX_LAUNCHES`` were tried; keep the quiet ones, else
    all. The two-rank launch runs ``configs`` in an order rotated from pair to pair, and which
    of a pair runs first alternates."""
    tried: list[tuple[dict[str, Any], dict[str, Any]]] = []  # (two ranks, the fast one alone)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(MAX_LAUNCHES):
            order = list(configs[i % len(configs) :] + configs[: i % len(configs)])
            two, one = Path(tmp, f"two{i}.json"), Path(tmp, f"one{i}.json")
            if i % 2 == 0:
                pair = (launch(order, 2, two, script), launch(["alone"], 1, one, script))
            else:
                alone = launch(["alone"], 1, one, script)
                pair = (launch(order, 2, two, script), alone)
            tried.append(pair)
            if sum(busiest(p) <= BUSY for p in tried) >= LAUNCHES:
                break
    busy = [busiest(p) for p in tried]
    quiet = [i for i, b in enumerate(busy) if b <= BUSY]
    kept = quiet if len(quiet) >= LAUNCHES else list(range(len(tried)))
    launches = [tried[i][0] for i in kept]
    runs = {c: [r["runs"][c] for r in launches] for c in configs}
    runs["alone"] = [tried[i][1]["runs"]["alone"] for i in kept]
    own = [r["own_speeds"] for r in launches]
    ideal = [sum(o["samples_per_s"]) for o in own]
    return Measured(tried, busy, kept, runs, ideal, own)


def record_arms(
    record: Callable[..., None],
    figure: Callable[..., None],
    group: str,
    m: Measured,
    peer: str,
    names: dict[str, str],
    short: dict[str, str],
) -> None:
    """Each configuration's steady step over the kept launches against ``peer``'s (per
    launch), the rebalancing and measured ones against the sum of the ranks' own speeds, that
    sum, and the same by the mean step."""
    batch = SIZE["batch"]
    for config, per_launch in m.runs.items():
        seconds = [r["step_s"] for r in per_launch]
        rates = [batch / s for s in seconds]
        of_ideal = [rate / total for rate, total in zip(rates, m.ideal)]
        shares = [shares_text(r["shares"]) for r in per_launch]
        note = (
            f"{statistics.median(rates):.1f} samples/s (min {min(rates):.1f}, max "
            f"{max(rates):.1f}); {statistics.median(of_ideal):.0%} of the speed sum; the last "
            f"step's shares {shares[0] if len(set(shares)) == 1 else ', '.join(shares)}"
        )
        record(Launches(seconds), group, names[config], peer=config == peer, note=note)
        if config != peer:
            paired = [p["step_s"] / r["step_s"] for p, r in zip(m.runs[peer], per_launch)]
            figure(
                group,
                f"{names[config]} / {short[peer]}, throughput",
                f"{statistics.median(paired):.2f}x (runs: {runs_text(paired, '{:.2f}')})",
                headline=config in ("rebalance", "measured"),
            )
    for config in ("rebalance", "measured"):
        of_ideal = [batch / r["step_s"] / total for r, total in zip(m.runs[config], m.ideal)]
        figure(
            group,
            f"{names[config]}: throughput / the sum of the ranks' speeds",
            f"{statistics.median(of_ideal):.0%} (runs: {runs_text(of_ideal, '{:.0%}')})",
            headline=config == "rebalance",
        )
    figure(
        group,
        "the sum of the ranks' own speeds (the ideal), samples/s",
        f"{statistics.median(m.ideal):.1f} (runs: {runs_text(m.ideal, '{:.1f}')}; rank 0 + "
        f"rank 1 at shares {shares_text(m.own[0]['shares'])}: "
        + "; ".join(" + ".join(f"{v:.1f}" for v in o["samples_per_s"]) for o in m.own)
        + ")",
    )
    figure(
        group,
        f"samples/s by the mean step of steps {WARMUP + 1} to {STEPS} instead of the median",
        "; ".join(
            f"{short[c]} {statistics.median(batch / r['mean_step_s'] for r in per_launch):.1f}"
            for c, per_launch in m.runs.items()
        ),
    )


def record_decisions(figure: Callable[..., None], group: str, m: Measured) -> None:
    """The rebalancing run's shares step by step and its decisions, per kept launch."""
    for i, r in zip(m.kept, m.runs["rebalance"]):
        applied = [d for d in r["decisions"] if d["applied"]]
        figure(
            group,
            f"rebalancing, launch {i + 1}: the shares step by step; its decisions",
            f"{steps_text(r['step_shares'] or [])}; "
            + ", ".join(f"after batch {d['batch']} to {shares_text(d['shares'])}" for d in applied)
            + f" ({len(r['decisions']) - len(applied)} more kept the shares)",
        )


def record_method(
    figure: Callable[..., None],
    group: str,
    m: Measured,
    peer: str,
    short: dict[str, str],
    also: str,
) -> None:
    """How the figures were measured (``also``: what this benchmark adds), and which launches
    were kept, the others' rebalancing against ``peer`` given."""
    figure(
        group,
        "how measured",
        "rounds: launches; a launch's time: the median of rank 0's optimizer steps "
        f"{WARMUP + 1} to {STEPS} (the steady state); the two-rank runs take turns in each "
        "launch, in an order rotated from launch to launch; ratios: the peer's time over the "
        "entry's (> 1: faster), of the medians in the table, of each launch's pair in the "
        f"figures{also}."
        + (" A dry run (HETCOLL_BENCH_QUICK=1): not a measurement." if QUICK else ""),
    )
    set_aside = [
        f"launch {i + 1} (waited {m.busy[i]:.0%}; rebalancing / {short[peer]} there "
        f"{two['runs'][peer]['step_s'] / two['runs']['rebalance']['step_s']:.2f}x)"
        for i, (two, _) in enumerate(m.tried)
        if i not in m.kept
    ]
    figure(
        group,
        "launches kept",
        f"{len(m.kept)} of {len(m.tried)} tried; a launch pair is kept if no rank waited for a "
        f"core (the host's other work: /proc/self/schedstat) more than {BUSY:.0%} of its timed "
        f"steps, once {LAUNCHES} such are found, else all are; each launch's most: "
        + ", ".join(f"{b:.1%}" for b in m.busy)
        + (f"; set aside: {', '.join(set_aside)}" if set_aside else ""),
    )


@pytest.mark.timeout(1800)  # 3 to 6 launch pairs of about 70 s on 2 cores
def test_trainer_rebalance(record: Callable[..., None], figure: Callable[..., None]) -> None:
    m = measure_pairs(CONFIGS)
    group = (
        f"GPT-2 ({SIZE['layers']} blocks of width {SIZE['hidden']}), 2 gloo ranks at emulated "
        f"speeds {SPEEDS[0]:g} and {SPEEDS[1]:g}, global batch {SIZE['batch']} x {SIZE['seq']} "
        f"tokens, {STEPS} steps (median of {len(m.kept)} launches)"
    )
    record_arms(record, figure, group, m, "trainer", NAMES, SHORT)
    runs = m.runs
    figure(
        group,
        "Trainer's own train_samples_per_second (the whole loop, its first steps included)",
        "; ".join(
            f"{SHORT[c]} {statistics.median(r['trainer_samples_per_s'] for r in per_launch):.1f}"
            for c, per_launch in runs.items()
        ),
    )
    record_decisions(figure, group, m)
    figure(
        group,
        "measure=True: the probe's speeds (samples/s), rank 0, rank 1, and shares, by launch",
        "; ".join(
            ", ".join(f"{v:.1f}" for v in r["speeds"] or []) + f" -> {shares_text(r['shares'])}"
            for r in runs["measured"]
        ),
    )
    record_method(figure, group, m, "trainer", SHORT, "")
    assert all(r["shares"] == [SIZE["batch"] // 2] * 2 for r in runs["equal"])


if __name__ == "__main__":
    worker_main()
