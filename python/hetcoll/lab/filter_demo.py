"""``hetcoll demo --strategy filter``: the demo CNN trained filter-parallel on ranks of unequal
(emulated) speed, twice:

- **unbalanced**: every split layer divided evenly, as torch.chunk or Mesh-TensorFlow would;
- **balanced**: each rank's speed measured (the same probe as the data-parallel demo), every
  split layer divided with :func:`hetcoll.split` in proportion.

Every rank sees every sample of the global batch (model parallelism); each holds and computes
only its share of the filters of DemoNet's four layers (paired conv1 -> conv2 and fc1 -> fc2:
two allreduces of partial sums forward, one of fc1's input gradient backward, no gathers). Both
runs compute the same model up to float32 rounding; only the time differs. Speeds are
*emulated*: each split layer sleeps ``(1/speed - 1)`` times its measured local compute, forward
and backward (:func:`hetcoll.lab.emulate.slow_down_filter_parallel`, module hooks put on from
outside); the replicated parts (activations, pooling, loss, optimizer) run at full speed on
every rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from hetcoll.lab.demo_config import DemoConfig
from hetcoll.lab.demo_ranks import (
    DemoNet,
    Engine,
    RunResult,
    evaluate,
    load_digits,
    probe,
    rank_rows,
    run_epochs,
)
from hetcoll.lab.emulate import slow_down_filter_parallel
from hetcoll.torch.filters import FilterParallelLayer, filter_parallel


def _train(engine: Engine, group: Any, cfg: DemoConfig, name: str, speeds: list[float]):
    rank = engine.rank
    xtr, ytr, xte, yte = load_digits(cfg.seed)
    torch.manual_seed(cfg.seed)
    model = filter_parallel(DemoNet(), group, speeds=speeds)
    slow_down_filter_parallel(model, cfg.speeds[rank])
    split = [m for m in model.modules() if isinstance(m, FilterParallelLayer)]
    result = RunResult(name, list(split[0].shares))
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)

    def step(idx: torch.Tensor) -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
        opt.step()

    run_epochs(
        engine, cfg, result, len(ytr), cfg.global_batch, step, lambda: evaluate(model, xte, yte)
    )
    layer_shares = {f"{type(m).__name__}[{i}]": list(m.shares) for i, m in enumerate(split)}
    return result, layer_shares


def run_rank(engine: Engine, cfg: DemoConfig) -> dict[str, Any] | None:
    """Both filter-parallel runs on this rank; rank 0 returns the report (the data-parallel
    demo's format, plus the shares of every split layer)."""
    torch.set_num_threads(1)
    group = getattr(engine, "comm", None)  # MPI communicator, or torch's default group
    fits, _ = probe(engine, cfg)
    measured = [f.samples_per_s for f in fits]
    plans = {"unbalanced": [1.0] * engine.world, "balanced": measured}
    runs, shares = [], {}
    for name in cfg.runs:
        result, shares[name] = _train(engine, group, cfg, name, plans[name])
        runs.append(result)
    if engine.rank != 0:
        return None
    return {
        "config": dataclasses.asdict(cfg),
        "strategy": "filter",
        "emulated": True,
        "ranks": rank_rows(cfg, fits),
        # Every rank's measured throughput on the whole model, added up: what the ranks could
        # reach together with perfect balance and free communication.
        "ideal_samples_per_s": sum(measured),
        "layer_shares": shares,
        "runs": {r.name: dataclasses.asdict(r) for r in runs},
    }
