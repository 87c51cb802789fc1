"""The LM example on real devices (issue 40, item 4): examples/train_lm.py's byte-level Llama
(built from a config, float32, eager attention, AdamW) trained by one GPU rank beside CPU ranks
in one gloo group, through :func:`hetcoll.torch.parallelize` with ``items=valid_tokens`` (every
step the gradient of the mean over the global batch's valid tokens).

    python benches/device/lm.py --cluster OUT/cluster.toml --json OUT/lm.json

One job of 1 GPU rank + ``--cpu-ranks`` one-thread CPU ranks (3 by default). The data is
train_lm's: the standard library's source read as bytes (``train_lm.corpus``), rows of random
lengths padded and masked; where that source is missing (a Python installed without its
``.py`` files) pseudo-random printable bytes of the same size stand in, and ``corpus`` says so.
Every rank measures its own training step in rows/s (:func:`hetcoll.torch.measure_speed`,
forward, backward and AdamW), then the ranks run, on the same global batches of ``--batch`` rows:

- **the GPU alone** (the CPU ranks not started: every plan runs on the ranks a user starts for
  it, :func:`jobs.plan_group`);
- **balanced**: whole-model replicas, rows from :func:`hetcoll.split` of the measured fits (a
  rank whose fixed cost alone outlasts the step gets no row and idles); **balanced, every
  rank**: the same with at least one row each (run when it differs);
- **equal split**: the same replicas with equal rows (what DDP does);
- **pipeline**: the GPU's stage (embedding, rotary, every decoder layer) feeding CPU rank 1's
  (the final norm and the head), 1F1B over ``--microbatches``;
- **hybrid**: that pipeline beside whole-model replicas on CPU ranks 2.., rows split by speed;
- **the planner's pick**: the plan :func:`hetcoll.model.plan` ranks first for these ranks.

A step's time is the slowest rank's (barriers around, the GPU synchronized); throughput is the
timed steps' valid tokens over their seconds. Rank 0 predicts each step with
:func:`hetcoll.model.predict_plan` (the costs of full 64-byte rows, the devices of
:func:`hetero.real_cluster`) and rewrites ``--json`` after each run, so a timeout keeps what was
measured. Without CUDA (the dry run) rank 0 is a CPU rank (the model sees it through
:func:`hetero.measure_gpu`'s probes run on the CPU) and the figures mean nothing.
"""

from __future__ import annotations

import functools
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

import hetcoll
from hetcoll.model import layer_costs, predict_plan

import jobs
from hetero import probe_sizes, real_cluster, strict_fp32, without_step_overhead
from jobs import (
    ALONE,
    PICK,
    plan_stepper,
    planner_over,
    planner_pick,
    prediction,
    run_configurations,
    runtime_breakdown,
    slowest_rank_seconds,
    started_ranks,
    write_results,
)

# examples/train_lm.py (and its train_plan.py) as modules, here and in the ranks.
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

import train_lm  # noqa: E402

LR = 3e-3
DATA_SEED = 0


def text() -> tuple[torch.Tensor, str]:
    """The corpus as byte ids, and what it is."""
    try:
        return train_lm.corpus(), "the standard library's source (examples/train_lm.py)"
    except OSError as e:  # no .py files in this Python: bytes of the same kind
        g = torch.Generator().manual_seed(DATA_SEED)
        data = torch.randint(32, 127, (400_000,), generator=g)
        return data, f"synthetic printable bytes (train_lm.corpus: {type(e).__name__}: {e})"


class Keyword(nn.Module):
    """The model called on a dict of keyword inputs, as parallelize calls it: what
    :func:`hetcoll.torch.measure_speed` (which calls ``model(x)``) needs."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: dict[str, torch.Tensor]) -> Any:
        return self.model(**x)


def lm_model(dev: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return train_lm.make_model("llama").to(dev)


def _rows(batch: tuple[dict[str, torch.Tensor], torch.Tensor], idx: torch.Tensor) -> Any:
    x, y = batch
    return {k: v[idx] for k, v in x.items()}, y[idx]


def _speed(dev: torch.device, pool: Any, batch: int, probe_s: float) -> Any:
    """This rank's fit of the LM's training step (rows/s), exchanged with every rank's."""
    from hetcoll.torch import gather_speeds, measure_speed

    xd, yd = pool

    def make_batch(b: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return _rows((xd, yd), (torch.arange(b) % len(yd)).to(dev))

    fit = measure_speed(
        Keyword(lm_model(dev)),
        make_batch,
        train_lm.lm_loss,
        batch_sizes=probe_sizes(batch),
        warmup=2,
        time_budget=probe_s,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.0),
    )
    return gather_speeds(fit)


def plans(
    speeds: list[float], latency: list[float], batch: int, microbatches: int, layers: int
) -> dict[str, tuple[str, dict[str, Any]]]:
    """Name -> (kind, plan dict) for 1 GPU rank (rank 0) + CPU ranks, rows by speed."""
    world = len(speeds)
    cpus = list(range(1, world))
    whole = [0, layers]

    def replicas(ranks: list[int], shares: list[int]) -> list[dict[str, Any]]:
        """A replica per rank with rows (ranks with none idle)."""
        return [
            {"samples": s, "stages": [{"ranks": [r], "layers": whole}]}
            for r, s in zip(ranks, shares)
            if s
        ]

    def plan(reps: list[dict[str, Any]], m: int = 1) -> dict[str, Any]:
        return {"microbatches": m, "schedule": "1F1B", "replicas": reps}

    # The GPU's stage: everything up to the final norm; CPU rank 1's: the norm and the head.
    pipeline = [
        {"ranks": [0], "layers": [0, layers - 2]},
        {"ranks": [1], "layers": [layers - 2, layers]},
    ]
    balanced = hetcoll.split(batch, speeds, latency=latency)
    every = hetcoll.split(batch, speeds, latency=latency, minimum=1)
    out = {
        ALONE: ("data-parallel", plan(replicas([0], [batch]))),
        "balanced": ("data-parallel", plan(replicas([0, *cpus], balanced))),
        "equal split": (
            "data-parallel",
            plan(replicas([0, *cpus], hetcoll.split(batch, [1.0] * world))),
        ),
        "pipeline: GPU layers, CPU 1 norm + head": (
            "pipeline",
            plan([{"samples": batch, "stages": pipeline}], microbatches),
        ),
    }
    if every != balanced:  # the split left a rank idle: also with every rank at work
        out["balanced, every rank"] = ("data-parallel", plan(replicas([0, *cpus], every)))
        out = {k: out[k] for k in (ALONE, "balanced", "balanced, every rank", *out)}
    if len(cpus) >= 2:  # the pipeline's rate is about the GPU's: the head is little compute
        shares = hetcoll.split(
            batch, [speeds[0], *speeds[2:]], latency=[latency[0], *latency[2:]], minimum=1
        )
        out["hybrid: pipeline beside CPU replicas"] = (
            "hybrid",
            plan(
                [{"samples": shares[0], "stages": pipeline}, *replicas(cpus[1:], shares[1:])],
                microbatches,
            ),
        )
    return out


def _run(
    plan: dict[str, Any], dev: torch.device, data: list[Any], warmup: int
) -> tuple[list[float], int]:
    """Each timed step's seconds (the slowest rank's) and the timed steps' valid tokens, on
    the ranks a user starts for ``plan`` (:func:`jobs.plan_group`)."""
    from hetcoll.torch import parallelize

    planned = plan_stepper(
        plan,
        lambda group: parallelize(
            lm_model(dev), plan, loss_fn=train_lm.lm_loss, items=train_lm.valid_tokens, group=group
        ),
        lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.0),
    )
    times, tokens = [], 0
    for i, (x, y) in enumerate(data):
        t = slowest_rank_seconds(functools.partial(planned, x, y), dev)
        if i >= warmup:
            times.append(t)
            tokens += int(train_lm.valid_tokens(y))
    return times, tokens


def _balanced_over(result: dict[str, Any]) -> None:
    """The balanced split's throughput over the equal split's, the GPU alone's and the sum of
    the ranks' measured speeds, from the configurations measured so far."""
    rows = {r["name"]: r for r in result["configurations"] if r["status"] == "ok"}
    if "balanced" in rows:
        rate = rows["balanced"]["tokens_per_s"]
        result["balanced_over"] = {
            name: rate / rows[name]["tokens_per_s"]
            for name in ("equal split", ALONE)
            if name in rows
        }
        if "speeds" in result:
            result["balanced_over_sum_of_speeds"] = rows["balanced"]["rows_per_s"] / sum(
                s["rows_per_s"] for s in result["speeds"]
            )


#: AdamW's state: two tensors per parameter (the moments), as the model prices its update.
STATE_COPIES = 2


@functools.cache
def _costs() -> Any:
    """The LM's layer costs, computed once (about a second; rank 0)."""
    shape = {"input_ids": (train_lm.SEQ,), "attention_mask": (train_lm.SEQ,)}
    return layer_costs(
        lm_model(torch.device("cpu")), shape, dtype=torch.int64, loss=train_lm.costed_loss
    )


def _predict(cfg: dict[str, Any], world: int, plan: dict[str, Any], measured: float) -> Any:

    cluster, _, why_not = real_cluster(cfg["cluster"], cfg["gpu"], world)
    if why_not is not None:
        return {"status": why_not}
    step, without = (
        predict_plan(
            _costs(), c, hetcoll.Plan.from_dict(plan), optimizer_state_copies=STATE_COPIES
        ).step_s
        for c in (cluster, without_step_overhead(cluster))
    )
    return prediction(step, without, measured)


def rank_main(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """One rank; rank 0 writes ``cfg["json"]`` after each run and returns the result."""

    from hetcoll.torch.layers import model_layers

    torch.set_num_threads(1)
    gpu = rank == 0 and cfg["cuda"]
    dev = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        strict_fp32()  # float32 as measure_gpu measured it
    batch, warmup = cfg["batch"], cfg["warmup"]
    corpus, what = text()
    # The GPU rank's batches on the GPU, as a loader would put them.
    data = [
        ({k: v.to(dev) for k, v in x.items()}, y.to(dev))
        for x, y in train_lm.batches(corpus, batch, warmup + cfg["steps"], DATA_SEED)
    ]
    fits = _speed(dev, data[0], batch, cfg["probe_s"])
    speeds = [f.samples_per_s for f in fits]
    latency = [f.latency_s for f in fits]
    rows_tokens = sum(int(train_lm.valid_tokens(y)) for _, y in data) / (batch * len(data))
    result: dict[str, Any] = cfg["result"]
    result["corpus"] = what
    result["devices"] = ["cuda" if (r == 0 and cfg["cuda"]) else "cpu" for r in range(world)]
    result["valid_tokens_per_row"] = rows_tokens
    if rank == 0:  # the report's staging note: the bytes the cost model counts
        result["gradient_bytes"] = _costs().gradient_bytes
    result["speeds"] = [
        {"rank": r, "rows_per_s": s, "tokens_per_s": s * rows_tokens, "latency_s": a}
        for r, (s, a) in enumerate(zip(speeds, latency))
    ]
    layers = len(model_layers(lm_model(torch.device("cpu"))))
    runs = plans(speeds, latency, batch, cfg["microbatches"], layers)

    def measure(plan: dict[str, Any]) -> dict[str, Any]:
        times, tokens = _run(plan, dev, data, warmup)
        return {
            "step_s": statistics.median(times),
            "tokens_per_s": tokens / sum(times),
            "rows_per_s": batch * len(times) / sum(times),
        }

    pick = planner_pick(cfg, world, _costs, STATE_COPIES)
    if pick is not None:
        runs[PICK] = pick

    def summarize(result: dict[str, Any]) -> None:
        _balanced_over(result)
        planner_over(result, "tokens_per_s")

    out = run_configurations(
        rank,
        result,
        runs,
        measure,
        lambda plan, step: _predict(cfg, started_ranks(plan), plan, step),
        cfg["json"],
        summarize,
    )
    # Last: a hang here (the job's timeout) keeps every plan's figures already written.
    breakdown = runtime_breakdown(
        rank,
        runs[ALONE][1],
        lambda: lm_model(torch.device("cpu")),
        lambda model, inputs: model(**inputs),
        train_lm.lm_loss,
        lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.0),
        data[0],
        dev,
        cfg["steps"],
        items=train_lm.valid_tokens,
    )
    if out is not None and breakdown is not None:
        out["runtime"] = breakdown
        write_results(cfg["json"], out)
    return out


def main(argv: list[str] | None = None) -> int:
    args = jobs.parse(
        __doc__,
        argv,
        min_cpu_ranks=1,
        batch=64,
        batch_help="the global batch, rows of 64 bytes",
        warmup=2,
        steps=8,
    )
    about = {
        "model": "examples/train_lm.py's Llama (6 layers, hidden 64, bytes), float32, AdamW",
        "seq": train_lm.SEQ,
    }
    return jobs.main(rank_main, args, about)


if __name__ == "__main__":
    sys.exit(main())
