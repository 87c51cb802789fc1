"""Seed 002's comparison on hetcoll's own runs: hypergraph (node-wise) placement against filter
splits, a pipeline and data parallelism, three gloo ranks of emulated speeds 1 : 0.5 : 0.25:

    python benches/bench_placement.py [--launches 3] [--steps 30] [--quick] [--json PATH]
        [--plot PATH]

The five plans are :func:`hetcoll.lab.placement_compare.comparison_plans` of a VGG-like CNN on
scikit-learn's 8x8 digits (:func:`vgg_digits`, global batch 64): the hypergraph placement
(:func:`hetcoll.model.hypergraph_plan`, 4 micro-batches), one stage split evenly and one split
by the speeds (:func:`hetcoll.torch.filter_parallel`'s pairing), a pipeline of one-rank stages
cut by :func:`hetcoll.partition_chain` (4 micro-batches, GPipe) and data parallelism (samples
split by the speeds). Every plan trains the same model from the same weights on the same
batches with SGD (momentum 0.9), each run by :func:`hetcoll.torch.parallelize`, the plans taking
turns step by step in an order shuffled every step (as ``benches/bench_plans.py`` does).

Per step and plan it measures:

- **bytes**: :meth:`hetcoll.torch.Parallel.traffic` summed over the ranks, by kind;
- **load balance**: :func:`hetcoll.lab.placement_compare.balance` of each rank's compute
  seconds, timed by :class:`ComputeTimer` around the layers the emulation slows (their sleeps
  included): the slowest rank's over the time each would take were the work shared by speed;
- **step time**: the slowest rank's forward, backward and SGD step (barrier before, max after);
- **loss**: the global batch's mean loss, against the same steps of the unsplit model in this
  process, and after the last step the test set's loss and accuracy of
  :meth:`~hetcoll.torch.Parallel.full_state_dict`; one more (untimed) launch runs the same
  steps in float64, where every plan, being exact, equals one process to rounding.

Peers, in the same launch: data parallelism for the bytes, the even filter split for the step
time. Heterogeneity is emulated by :func:`hetcoll.lab.emulate.slow_down` on each rank's stage.
``--json`` writes a results file for ``benches/report.py``; ``--plot`` a PNG of bytes and step
time per plan.
"""

from __future__ import annotations

import argparse
import functools
import random
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hetcoll import launch
from hetcoll.lab.placement_compare import balance

SPEEDS = (1.0, 0.5, 0.25)
BATCH = 64
MICROBATCHES = 4
SHAPE = (1, 8, 8)
LR = 0.2
#: Global batches of the predicted bytes' sweep (the model-parallel plans' bytes grow with the
#: batch, data parallelism's do not).
SWEEP = (16, 64, 256, 1024)
KINDS = ("activations", "gradients", "outputs", "allreduce")
#: The named peers: bytes against data parallelism, step time against the even filter split.
BYTES_PEER = "data parallel"
TIME_PEER = "even filter split"


def vgg_digits() -> nn.Sequential:
    """A VGG-like CNN for 1 x 8 x 8 digits: two blocks of two 3x3 convolutions (32-128 filters)
    and a 2x2 max-pool, then two linear layers; 307k parameters, 9.6 MFLOP per sample forward.
    ReLUs not in place (the emulation's backward hooks forbid it)."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(128, 128, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(128 * 2 * 2, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


def batches(steps: int, n: int, seed: int = 1) -> list[torch.Tensor]:
    """Indices into the ``n`` training samples of each of ``steps`` global batches: epochs of
    a seeded permutation, cut into batches of :data:`BATCH` (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    order = torch.cat([torch.randperm(n, generator=g) for _ in range(steps * BATCH // n + 1)])
    return [order[i * BATCH : (i + 1) * BATCH] for i in range(steps)]


class ComputeTimer:
    """Wall seconds spent inside ``layers``' forwards and backwards since :meth:`reset`.

    Hooks put on after :func:`hetcoll.lab.emulate.slow_down`'s on the same layers run after
    its sleeps, so the time includes them: the emulated compute. A forward runs from the
    forward pre-hook to the forward hook; a backward from the gradient of the layer's output
    to its full backward hook. As for the emulation, a layer none of whose inputs needs a
    gradient (a model's first) has no backward torch can time from outside: it is not counted.
    """

    def __init__(self, layers: Iterable[nn.Module]) -> None:
        self.seconds = 0.0
        self._handles: list[Any] = []
        self._forward: dict[int, float] = {}
        self._backward: dict[int, float | None] = {}
        for i, m in enumerate(layers):
            if not isinstance(m, nn.Module):
                raise TypeError(f"layers: must be torch.nn.Modules, got {type(m).__name__}")
            self._handles += [
                m.register_forward_pre_hook(functools.partial(self._before, i)),
                m.register_forward_hook(functools.partial(self._after, i)),
                m.register_full_backward_hook(functools.partial(self._after_backward, i)),
            ]

    def reset(self) -> None:
        self.seconds = 0.0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _before(self, i: int, _m: nn.Module, _args: Any) -> None:
        self._forward[i] = time.perf_counter()

    def _after(self, i: int, _m: nn.Module, args: Any, out: Any) -> None:
        self.seconds += time.perf_counter() - self._forward[i]
        self._backward[i] = None
        timed = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        if timed and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(functools.partial(self._backward_starts, i))

    def _backward_starts(self, i: int, _grad: torch.Tensor) -> None:
        self._backward[i] = time.perf_counter()

    def _after_backward(self, i: int, _m: nn.Module, _gin: Any, _gout: Any) -> None:
        start, self._backward[i] = self._backward.get(i), None
        if start is not None:
            self.seconds += time.perf_counter() - start


# -- inside a rank ------------------------------------------------------------------------------


def _rank(
    rank: int,
    world: int,
    plan_dicts: dict[str, dict[str, Any]],
    steps: int,
    warmup: int,
    dtype: str = "float32",
) -> dict[str, Any] | None:
    from hetcoll.lab.demo_ranks import evaluate, load_digits
    from hetcoll.lab.emulate import slow_down
    from hetcoll.torch import parallelize

    torch.set_num_threads(1)
    # The first layer's input needs no gradient: torch warns that its backward hook fires on
    # outputs only; that layer's backward is neither slowed nor timed.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    dt = getattr(torch, dtype)
    xtr, ytr, xte, yte = load_digits(0)
    xtr, xte = xtr.to(dt), xte.to(dt)
    order = batches(warmup + steps, len(ytr))
    runs = {}
    for name, plan in plan_dicts.items():
        torch.manual_seed(0)
        par = parallelize(vgg_digits().to(dt), plan, loss_fn=nn.CrossEntropyLoss())
        layers = slow_down(par.stage, SPEEDS[rank]).layers if par.stage is not None else []
        opt = torch.optim.SGD(par.parameters(), lr=LR, momentum=0.9)
        runs[name] = (par, opt, ComputeTimer(layers))
    rows: dict[str, dict[str, list[Any]]] = {
        name: {"step_s": [], "compute_s": [], "bytes": [], "loss": []} for name in runs
    }
    for i, idx in enumerate(order):
        x, y = xtr[idx], ytr[idx]
        names = list(runs)
        random.Random(i).shuffle(names)  # the same order on every rank
        for name in names:
            par, opt, timer = runs[name]
            dist.barrier()
            timer.reset()
            t0 = time.perf_counter()
            loss = par.step(x, y)
            opt.step()
            opt.zero_grad()
            elapsed = time.perf_counter() - t0
            traffic = par.traffic()
            mine = torch.tensor(
                [elapsed, timer.seconds, *(float(traffic[k]) for k in KINDS)], dtype=torch.float64
            )
            every = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(every, mine)
            row = rows[name]
            row["loss"].append(float(loss))
            row["bytes"].append(
                {k: int(sum(float(t[2 + j]) for t in every)) for j, k in enumerate(KINDS)}
            )
            if i >= warmup:
                row["step_s"].append(max(float(t[0]) for t in every))
                row["compute_s"].append([float(t[1]) for t in every])
    # Each plan's per-step records, then its test set's loss and accuracy after the last step.
    result: dict[str, dict[str, Any]] = {}
    for name, (par, _, _) in runs.items():
        state = par.full_state_dict()
        net = vgg_digits().to(dt)
        net.load_state_dict(state)
        test_loss, test_accuracy = evaluate(net, xte, yte)
        result[name] = rows[name] | {"test_loss": test_loss, "test_accuracy": test_accuracy}
    return result if rank == 0 else None


def reference(steps: int, dtype: str = "float32") -> dict[str, Any]:
    """The same steps on the unsplit model in this process: each step's mean loss, and the test
    set's loss and accuracy after the last."""
    from hetcoll.lab.demo_ranks import evaluate, load_digits

    torch.set_num_threads(1)
    dt = getattr(torch, dtype)
    xtr, ytr, xte, yte = load_digits(0)
    xtr, xte = xtr.to(dt), xte.to(dt)
    torch.manual_seed(0)
    net = vgg_digits().to(dt)
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    for idx in batches(steps, len(ytr)):
        loss = loss_fn(net(xtr[idx]), ytr[idx])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    test_loss, accuracy = evaluate(net, xte, yte)
    return {"loss": losses, "test_loss": test_loss, "test_accuracy": accuracy}


# -- the caller -----------------------------------------------------------------------------------


def _quartiles(xs: Sequence[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def _loss_gap(losses: Sequence[float], ref: Sequence[float]) -> float:
    if len(losses) != len(ref):
        raise ValueError(f"losses: {len(losses)} steps against the reference's {len(ref)}")
    return max(abs(a - b) for a, b in zip(losses, ref))


def summarise(
    launches: list[dict[str, Any]],
    ref: dict[str, Any],
    predicted: dict[str, Any],
    exact: dict[str, Any] | None = None,
    ref64: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """One row per plan from every launch's per-step records: bytes (every step of every
    launch moves the same: checked), medians and spreads, and the losses against ``ref``; with
    ``exact`` (a float64 launch's records) and ``ref64``, its losses against those."""
    rows = []
    for name in launches[0]:
        per = [run[name] for run in launches]
        seen = {tuple(b[k] for k in KINDS) for run in per for b in run["bytes"]}
        if len(seen) != 1:
            raise RuntimeError(f"{name}: bytes per step differ between steps: {sorted(seen)}")
        traffic = dict(zip(KINDS, seen.pop()))
        medians = [statistics.median(run["step_s"]) for run in per]
        balances = [statistics.median(balance(c, SPEEDS) for c in run["compute_s"]) for run in per]
        loss_gap = max(_loss_gap(run["loss"], ref["loss"]) for run in per)
        rows.append(
            {
                "name": name,
                "traffic": traffic,
                "bytes": sum(traffic.values()),
                "predicted_bytes": predicted[name]["bytes"],
                "balance": statistics.median(balances),
                "balance_per_launch": balances,
                "predicted_balance": predicted[name]["balance"],
                "step_s": statistics.median(medians),
                "predicted_step_s": predicted[name].get("step_s"),
                "step_s_per_launch": medians,
                "quartiles_s_per_launch": [_quartiles(run["step_s"]) for run in per],
                "compute_s_per_launch": [
                    [statistics.median(c[r] for c in run["compute_s"]) for r in range(len(SPEEDS))]
                    for run in per
                ],
                "final_loss": per[0]["loss"][-1],
                "loss_gap": loss_gap,
                "test_loss": [run["test_loss"] for run in per],
                "test_accuracy": [run["test_accuracy"] for run in per],
                "layout": predicted[name]["layout"],
            }
        )
        if exact is not None and ref64 is not None:
            rows[-1]["loss_gap_float64"] = _loss_gap(exact[name]["loss"], ref64["loss"])
            rows[-1]["test_accuracy_float64"] = exact[name]["test_accuracy"]
    by = {r["name"]: r for r in rows}
    for r in rows:
        r["bytes_vs_peer"] = r["bytes"] / by[BYTES_PEER]["bytes"]
        # Paired per launch: the peer's median step over this plan's, > 1: this plan is faster.
        ratios = [p / m for p, m in zip(by[TIME_PEER]["step_s_per_launch"], r["step_s_per_launch"])]
        r["speedup_vs_peer"] = statistics.median(ratios)
        r["speedup_vs_peer_per_launch"] = ratios
    return rows


def emulated_cluster() -> Any:
    """The library's view of the three ranks: this machine measured on one thread
    (:func:`hetcoll.lab.calibrate.measure_device`, quick) at each emulated speed
    (:func:`hetcoll.lab.emulate.emulated_device`), joined by the measured gloo link between two
    local ranks (as ``benches/bench_plans.py`` predicts its plans)."""
    from hetcoll.lab import calibrate
    from hetcoll.lab.emulate import emulated_device
    from hetcoll.lab.validate import validation_cluster

    device = calibrate.measure_device("this-machine-1-thread", 4e9, quick=True)
    fit = calibrate.measure_gloo_link()
    link = fit.link("gloo-local")
    return validation_cluster([emulated_device(device, f) for f in SPEEDS], link)


def sweep(batches: Sequence[int] = SWEEP, dtype: str = "float32") -> list[dict[str, Any]]:
    """Predicted bytes per step of each plan with a prediction, at each global batch
    (:func:`hetcoll.lab.placement_compare.placement_compare`)."""
    from hetcoll.lab.placement_compare import placement_compare

    out: list[dict[str, int | None]] = []
    for b in batches:
        model = vgg_digits().to(getattr(torch, dtype))
        rows = placement_compare(model, SHAPE, SPEEDS, b, microbatches=MICROBATCHES)
        out.append({"batch": b, **{r.strategy: r.bytes_per_step for r in rows}})
    return out


def results_file(
    rows: list[dict[str, Any]],
    ref: dict[str, Any],
    args: argparse.Namespace,
    plot: str | None,
    swept: list[dict[str, Any]],
    ref64: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The rows as a results file for benches/report.py."""
    from report import RATIO, SCHEMA, host_info, now

    speeds = ":".join(f"{s:g}" for s in SPEEDS)
    total = args.warmup + args.steps
    comm, timing, accuracy = [], [], []
    for r in rows:
        comm.append(
            [
                r["name"],
                r["layout"],
                r["traffic"]["activations"] / 1e6,
                r["traffic"]["gradients"] / 1e6,
                r["traffic"]["outputs"] / 1e6,
                r["traffic"]["allreduce"] / 1e6,
                r["bytes"] / 1e6,
                r["predicted_bytes"] / 1e6 if r["predicted_bytes"] is not None else None,
                r["bytes_vs_peer"],
                r["balance"],
                r["predicted_balance"],
            ]
        )
        pred = r.get("predicted_step_s")
        timing.append(
            [
                r["name"],
                pred * 1e3 if pred is not None else None,
                r["step_s"] * 1e3,
                pred / r["step_s"] - 1 if pred is not None else None,
                ", ".join(f"{m * 1e3:.1f}" for m in r["step_s_per_launch"]),
                statistics.median(q3 - q1 for q1, q3 in r["quartiles_s_per_launch"]) * 1e3,
                r["speedup_vs_peer"],
                ", ".join(f"{x:.2f}" for x in r["speedup_vs_peer_per_launch"]),
            ]
        )
        accuracy.append(
            [
                r["name"],
                r["final_loss"],
                r["loss_gap"],
                statistics.median(r["test_loss"]),
                ", ".join(f"{a:.1%}" for a in r["test_accuracy"]),
                r.get("loss_gap_float64"),
                r.get("test_accuracy_float64"),
            ]
        )
    accuracy.append(
        [
            "one process (the unsplit model)",
            ref["loss"][-1],
            0.0,
            ref["test_loss"],
            f"{ref['test_accuracy']:.1%}",
            0.0 if ref64 is not None else None,
            ref64["test_accuracy"] if ref64 is not None else None,
        ]
    )
    hyper = next(r for r in rows if r["name"] == "hypergraph placement")
    differ = [
        r["name"]
        for r in rows
        if r["predicted_bytes"] is not None and r["predicted_bytes"] != r["bytes"]
    ]
    matched = (
        f"At batch {BATCH} the measured bytes above equal these predictions to the byte."
        if not differ
        else f"At batch {BATCH} the measured bytes differ from the predictions for: "
        + ", ".join(differ)
        + "."
    )
    description = (
        "Seed 002 (hypergraph-partitioned node-wise model parallelism) reports better load "
        "balance and less communication than other model-parallel splits and 93% less than "
        "data parallelism. Here each way of sharing one model runs for real under "
        f"`hetcoll.torch.parallelize` on {len(SPEEDS)} gloo ranks of emulated speeds {speeds}: "
        "a VGG-like CNN (`vgg_digits` in `benches/bench_placement.py`: four 3x3 convolutions of "
        "32-128 filters, two linear layers, 307k parameters) on scikit-learn's 8x8 digits, "
        f"global batch {BATCH}, SGD. The plans are "
        "`hetcoll.lab.placement_compare.comparison_plans`: the hypergraph placement "
        f"(`hetcoll.model.hypergraph_plan`, {MICROBATCHES} micro-batches), one stage split "
        "evenly and one split by the speeds (filter parallelism), a pipeline of one-rank stages "
        f"cut by `hetcoll.partition_chain` over the layers' FLOPs ({MICROBATCHES} micro-batches, "
        "GPipe), and data parallelism (samples split by the speeds). Each rank slows its stage "
        "with `hetcoll.lab.emulate.slow_down`."
    )
    if plot:
        description += f"\n\n![Bytes per step and step time per plan]({plot})"
    return {
        "schema": SCHEMA,
        "benchmark": "placement",
        "title": "Node-wise placement (seed 002) against filter splits, pipeline, data parallel",
        "command": "python benches/bench_placement.py " + shlex.join(sys.argv[1:]),
        "when": now(),
        "host": host_info(),
        "description": description,
        "notes": [
            f"{args.launches} launch(es); every plan trains {total} steps ({args.warmup} "
            f"untimed) on the same batches, the plans taking turns in an order shuffled every "
            f"step; {'float64' if args.float64 else 'float32'}.",
            *(["`--quick`: a short run, not for the figures."] if args.quick else []),
        ],
        "headlines": [
            {
                "figure": f"hypergraph placement, {len(SPEEDS)} ranks at emulated speeds {speeds}: "
                "bytes per step vs data parallel; step time vs even filter split",
                "value": f"{hyper['bytes_vs_peer']:.2f}x the bytes; "
                f"{hyper['speedup_vs_peer']:.2f}x faster",
            }
        ],
        "sections": [
            {
                "title": "Communication and load balance per step",
                "peer": "data parallelism's bytes, in the same launch",
                "columns": [
                    {"name": "plan"},
                    {"name": "layout"},
                    {"name": "activations (MB)", "format": "{:.3f}"},
                    {"name": "gradients (MB)", "format": "{:.3f}"},
                    {"name": "outputs (MB)", "format": "{:.3f}"},
                    {"name": "allreduce (MB)", "format": "{:.3f}"},
                    {"name": "total (MB)", "format": "{:.3f}"},
                    {"name": "predicted (MB)", "format": "{:.3f}"},
                    {"name": "bytes vs data parallel", "format": RATIO},
                    {"name": "balance, measured", "format": "{:.2f}"},
                    {"name": "balance, predicted", "format": "{:.2f}"},
                ],
                "rows": comm,
                "notes": [
                    "Bytes: `Parallel.traffic()` summed over the ranks (a collective counts the "
                    "2 (p-1)/p of its buffer a ring sends); the same in every step and launch "
                    "(checked). Predicted: `hetcoll.model.placement_traffic` (hypergraph "
                    "placement, pipeline), 2 (p-1)/p of the parameter bytes on each rank "
                    "(data parallel); "
                    "– where the library has no prediction (the filter splits).",
                    "Balance (`hetcoll.lab.placement_compare.balance`, seed 002's imbalance "
                    "of a partition with targets): the slowest rank's compute time over the time "
                    "each rank would take were the same work shared in proportion to the speeds "
                    "(1.00: perfect; the step is at least this times the ideal). Measured: each "
                    "rank's wall time inside the layers the emulation slows (Conv2d / Linear, or "
                    "a split layer's local part), their sleeps included, forward and backward (a "
                    "model's first layer's backward is neither slowed nor timed), the work "
                    "being that time times the rank's speed; median over steps, then over "
                    "launches. Predicted: from each rank's Conv2d / Linear forward FLOPs.",
                ],
            },
            {
                "title": "Step time",
                "peer": "the even filter split's step time, in the same launch",
                "columns": [
                    {"name": "plan"},
                    {"name": "predicted (ms)", "format": "{:.1f}"},
                    {"name": "step (ms)", "format": "{:.1f}"},
                    {"name": "error", "format": "{:+.0%}"},
                    {"name": "launches (ms)"},
                    {"name": "IQR within a launch (ms)", "format": "{:.1f}"},
                    {"name": "vs even filter split (even / plan)", "format": RATIO},
                    {"name": "per launch"},
                ],
                "rows": timing,
                "notes": [
                    "Step: forward, backward and SGD step of the slowest rank (barrier before, "
                    "max over ranks after); the median over launches of each launch's median "
                    "over the timed steps; IQR: the median over launches of the steps' "
                    "interquartile range. vs even filter split: the ratio of the two plans' "
                    "medians in each launch, then the median; > 1: faster than the even split.",
                    "Predicted: `hetcoll.lab.placement_compare.placement_compare` with the "
                    "cluster the library sees (this machine measured on one thread at each "
                    "emulated speed, the measured gloo link): `hetcoll.model.predict_placement` "
                    "for the hypergraph placement (its convolution and linear FLOPs only), "
                    "`hetcoll.model.predict_plan` for the others; error = predicted / measured "
                    "- 1.",
                ],
            },
            {
                "title": "Loss and accuracy after the same steps",
                "peer": "the unsplit model trained on the same batches in one process",
                "columns": [
                    {"name": "plan"},
                    {"name": f"train loss, step {total}", "format": "{:.4f}"},
                    {"name": "max \u0394loss vs one process", "format": "{:.1e}"},
                    {"name": "test loss", "format": "{:.4f}"},
                    {"name": "test accuracy, per launch"},
                    {"name": "float64: max \u0394loss vs one process", "format": "{:.1e}"},
                    {"name": "float64: test accuracy", "format": "{:.1%}"},
                ],
                "rows": accuracy,
                "notes": [
                    f"Loss: the global batch's mean loss at each of the {total} steps; max "
                    "\u0394loss: the largest difference from one process's over all steps (and "
                    "launches); train and test loss: the first launch's and the median. The "
                    "float64 columns: one more launch of the same plans and steps in float64 "
                    "(not timed), against one process in float64.",
                    "Every plan computes the batch's exact gradient, so in float64 the losses "
                    "agree to rounding; in float32 a different order of summation (split "
                    "layers' partial sums, micro-batches, replicas) starts them apart by "
                    "rounding, and at this learning rate training amplifies that over the "
                    "steps. So accuracy after the same steps is the same up to that noise; "
                    "what the plans change is the time the steps take.",
                ],
            },
            {
                "title": "Predicted bytes per step against the global batch",
                "peer": "data parallelism's bytes at the same batch",
                "columns": [
                    {"name": "batch", "format": "{:,}"},
                    {"name": "hypergraph placement (MB)", "format": "{:.3f}"},
                    {"name": "pipeline (MB)", "format": "{:.3f}"},
                    {"name": "data parallel (MB)", "format": "{:.3f}"},
                    {"name": "hypergraph / data parallel", "format": RATIO},
                ],
                "rows": [
                    [
                        w["batch"],
                        w["hypergraph placement"] / 1e6,
                        w["pipeline"] / 1e6,
                        w["data parallel"] / 1e6,
                        w["hypergraph placement"] / w["data parallel"],
                    ]
                    for w in swept
                ],
                "notes": [
                    "`hetcoll.lab.placement_compare.placement_compare` for the same model, "
                    "speeds and micro-batches (the placement re-partitioned at each batch): a "
                    "model-parallel plan sends feature maps, which grow with the batch; data "
                    "parallelism allreduces the gradients, which do not. " + matched
                ],
            },
        ],
    }


def draw(rows: list[dict[str, Any]], path: Path) -> None:
    """Bytes per step (stacked by kind) and step time (median, launches' range) per plan (PNG,
    matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in rows]
    at = range(len(rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    bottom = [0.0] * len(rows)
    for kind in KINDS:
        mb = [r["traffic"][kind] / 1e6 for r in rows]
        if any(mb):
            ax1.bar(at, mb, bottom=bottom, label=kind)
            bottom = [b + m for b, m in zip(bottom, mb)]
    ax1.set_ylabel("MB per step, all ranks")
    ax1.legend(fontsize=8)
    ms = [r["step_s"] * 1e3 for r in rows]
    lo = [m - min(r["step_s_per_launch"]) * 1e3 for m, r in zip(ms, rows)]
    hi = [max(r["step_s_per_launch"]) * 1e3 - m for m, r in zip(ms, rows)]
    ax2.bar(at, ms, yerr=[lo, hi], capsize=4, color="tab:gray")
    ax2.set_ylabel("step time (ms), median; bars: launches' range")
    for ax in (ax1, ax2):
        ax.set_xticks(list(at), [n.replace(" ", "\n", 1) for n in names], fontsize=8)
    speeds = " : ".join(f"{s:g}" for s in SPEEDS)
    fig.suptitle(f"{len(SPEEDS)} gloo ranks at emulated speeds {speeds}, batch {BATCH}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launches", type=int, default=3, help="launches of the three ranks")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per plan")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per plan (trained)")
    ap.add_argument("--quick", action="store_true", help="one launch of 3 steps (a smoke run)")
    ap.add_argument(
        "--float64",
        action="store_true",
        help="train in float64 (every plan's losses then equal one process's to rounding)",
    )
    ap.add_argument("--json", type=Path, help="write a results file for benches/report.py")
    ap.add_argument("--plot", type=Path, help="draw bytes and step time per plan (PNG)")
    args = ap.parse_args(argv)
    if args.quick:
        args.launches, args.steps, args.warmup = 1, 2, 1
    for flag in ("launches", "steps"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag}: must be >= 1")
    if args.warmup < 0:
        ap.error("--warmup: must be >= 0")
    from hetcoll.lab.placement_compare import layout, placement_compare

    dtype = "float64" if args.float64 else "float32"
    t0 = time.perf_counter()
    print("measuring this machine for the predictions (about 20 s) ...", flush=True)
    cluster = emulated_cluster()
    model = vgg_digits().to(getattr(torch, dtype))
    compared = placement_compare(
        model, SHAPE, SPEEDS, BATCH, microbatches=MICROBATCHES, cluster=cluster
    )
    plans = {r.strategy: r.plan.to_dict() for r in compared}
    predicted = {
        r.strategy: {
            "bytes": r.bytes_per_step,
            "balance": r.balance,
            "layout": layout(r.plan),
            "step_s": r.step_s,
        }
        for r in compared
    }
    print(f"plans ready ({time.perf_counter() - t0:.1f} s); the unsplit reference ...", flush=True)
    ref = reference(args.warmup + args.steps, dtype)
    launches = []
    for n in range(args.launches):
        print(
            f"launch {n + 1}/{args.launches}: {len(plans)} plans x {args.warmup + args.steps} "
            "steps on 3 ranks ...",
            flush=True,
        )
        t0 = time.perf_counter()
        launches.append(
            launch.spawn(_rank, len(SPEEDS), plans, args.steps, args.warmup, dtype, timeout=1800)[0]
        )
        print(f"  done in {time.perf_counter() - t0:.0f} s", flush=True)
    exact = ref64 = None
    if not args.float64:
        print("exactness: one float64 launch of the same steps ...", flush=True)
        ref64 = reference(args.warmup + args.steps, "float64")
        exact = launch.spawn(
            _rank, len(SPEEDS), plans, args.steps, args.warmup, "float64", timeout=1800
        )[0]
    rows = summarise(launches, ref, predicted, exact, ref64)
    print(
        f"{'plan':<32} {'MB/step':>8} {'vs DP':>6} {'balance':>8} {'step ms':>8} "
        f"{'vs even':>8} {'|dloss|':>8} {'f64':>8} {'test acc':>8}"
    )
    for r in rows:
        f64 = r.get("loss_gap_float64")
        print(
            f"{r['name']:<32} {r['bytes'] / 1e6:8.3f} {r['bytes_vs_peer']:6.2f} "
            f"{r['balance']:8.2f} {r['step_s'] * 1e3:8.1f} {r['speedup_vs_peer']:7.2f}x "
            f"{r['loss_gap']:8.1e} {f64 if f64 is not None else float('nan'):8.1e} "
            f"{statistics.median(r['test_accuracy']):8.1%}"
        )
    print(f"one process: test accuracy {ref['test_accuracy']:.1%} after {len(ref['loss'])} steps")
    plot = None
    if args.plot:
        draw(rows, args.plot)
        print(f"plot: {args.plot}")
        docs = Path(__file__).resolve().parents[1] / "docs"
        try:
            plot = str(args.plot.resolve().relative_to(docs))
        except ValueError:
            plot = None  # not under docs/: not linked from docs/benchmarks.md
    if args.json:
        from report import write_result

        write_result(args.json, results_file(rows, ref, args, plot, sweep(dtype=dtype), ref64))
        print(f"wrote {args.json}")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
