"""Balancing a transformer's splits by time (``filter_parallel(sample=...)``): a few timed
forwards of the unsplit model say how much work every rank repeats whole around its split
blocks (norms, embeddings, residual adds), which becomes :func:`hetcoll.split`'s ``latency``
at each rank's speed (:func:`replicated_latencies`). Local: the caller agrees on the timings."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from hetcoll.torch.filters.heads import TensorSplit


def replicated_latencies(
    splits: list[TensorSplit], seconds: list[float], speeds: Sequence[float]
) -> list[list[float] | None]:
    """Each split's :func:`hetcoll.split` latency per rank: the work every rank repeats whole
    (norms, embeddings, residual adds: the forward's time outside the splits), an equal part of
    it before each split's reduction, in that split's features at each rank's speed.
    ``seconds``: the whole forward's, then each split's own."""
    total, own = seconds[0], seconds[1:]
    replicated = max(total - sum(own), 0.0) / len(splits)
    out: list[list[float] | None] = []
    for ts, t in zip(splits, own, strict=True):
        per_feature = t / (ts.units * ts.width)
        if per_feature <= 0.0 or not math.isfinite(per_feature):
            out.append(None)
            continue
        out.append([replicated / per_feature / float(v) for v in speeds])
    return out


def _block_seconds(
    model: nn.Module, sample: Any, splits: list[TensorSplit], others: list[str]
) -> list[float]:
    """Seconds of a forward of the unsplit ``model`` on ``sample`` (a tensor, a tuple of
    positional inputs or a dict of keyword inputs) less those of the layers ``others`` (split
    on their own, by speed), then of each split's own work in it: an attention's whole module
    (projections and scores) less the projections every rank runs whole (multi-query key and
    value), an MLP's layers. Without gradients; the median of three forwards after one to warm
    up."""
    named = dict(model.named_modules())
    groups = [
        [named[ts.module]] if ts.kind != "mlp" else [named[n] for n in ts.layers()] for ts in splits
    ]
    groups.append([named[n] for n in others])
    groups += [[named[n] for n in ts.held_whole(named)] for ts in splits]  # inside theirs
    spent = [0.0] * len(groups)
    started: dict[int, float] = {}
    handles = []
    for k, modules in enumerate(groups):
        for m in modules:

            def before(mod: nn.Module, args: Any) -> None:
                started[id(mod)] = time.perf_counter()

            def after(mod: nn.Module, args: Any, out: Any, k: int = k) -> None:
                spent[k] += time.perf_counter() - started.pop(id(mod), time.perf_counter())

            handles.append(m.register_forward_pre_hook(before))
            handles.append(m.register_forward_hook(after))
    runs: list[list[float]] = []
    try:
        with torch.no_grad():
            for _ in range(4):
                spent[:] = [0.0] * len(groups)
                t0 = time.perf_counter()
                if isinstance(sample, Mapping):
                    model(**sample)
                elif isinstance(sample, (tuple, list)):
                    model(*sample)
                else:
                    model(sample)
                whole = spent[len(splits) + 1 :]
                own = [t - w for t, w in zip(spent[: len(splits)], whole, strict=True)]
                runs.append([time.perf_counter() - t0 - spent[len(splits)], *own])
    finally:
        for h in handles:
            h.remove()
    timed = sorted(runs[1:], key=lambda r: r[0])
    return timed[len(timed) // 2]


def sample_seconds(
    model: nn.Module, sample: Any, splits: list[TensorSplit], others: list[str]
) -> tuple[list[float], ValueError | None]:
    """:func:`_block_seconds`, or zeros and the error naming ``sample`` when the model's
    forward on it fails."""
    try:
        return _block_seconds(model, sample, splits, others), None
    except Exception as e:  # whatever the user's forward raises
        failure = ValueError(f"sample: the model's forward on it failed: {type(e).__name__}: {e}")
        return [0.0] * (1 + len(splits)), failure
