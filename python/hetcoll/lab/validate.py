"""Validate the model on this machine: run real training steps, one process per rank on gloo
through :func:`hetcoll.launch.spawn`, and compare the measured step time with the prediction.

Three kinds of run are validated:

- **data** parallel: plain torch DDP, per-rank batch sizes, against
  :func:`hetcoll.model.predict.data_parallel`;
- **filter** parallel: the model converted by :func:`hetcoll.torch.filter_parallel` (every
  Conv2d / Linear split, consecutive layers paired split-output -> split-input), every rank on
  the whole batch, each split layer's filters divided evenly or in proportion to the speeds,
  against :func:`hetcoll.model.predict.filter_parallel` with the modes and shares the ranks
  really ran;
- **plans** (rows ``pipeline``, ``hybrid``, ``subset``: :func:`plan_configurations`): a
  :class:`hetcoll.Plan` run by :func:`hetcoll.torch.parallelize`, against
  :func:`hetcoll.model.predict_plan`'s laid-out step (:func:`hetcoll.model.predict.plan_schedule`).

Heterogeneity is *emulated*. Data parallel: a rank of speed factor f sleeps (1/f - 1) x its own
measured compute time between its forward and backward
(:func:`hetcoll.lab.validate_ranks.emulate_speed`). Filter parallel runs in lock step layer by
layer, so one pause per step would not act like a slower device: each split layer sleeps (1/f - 1)
x its own local compute, forward and backward
(:func:`hetcoll.lab.emulate.slow_down_filter_parallel`); the replicated layers run at full speed; a
plan's ranks do the same on every layer with parameters of their stage
(:func:`hetcoll.lab.emulate.slow_down`). The predictions are the library's with the same pauses put
in (:mod:`hetcoll.lab.predict_emulated`).

The device and link figures come either from a calibration file or, by default, from the same
microbenchmarks run inside the ranks before every step (medians, all ranks at once or ``cores`` at
a time; the link fitted once to allreduce times by the ring model) - on a shared machine that is
the only way to predict under the load the steps see. Ranks beyond the number of cores share them
in the model (:class:`~hetcoll.lab.predict_emulated.SharedCores`), with the time slice and wake-up
cost fitted to lock-step stretches the ranks run first (:func:`shared_cores_of`). Both strategies
share that machinery (:func:`hetcoll.lab.validate_ranks.timed_steps`, :func:`_link_of`,
:func:`_median_prediction`).
DDP's overlap of allreduce and backward is modelled only while the ranks leave cores free
(gloo's copies and reductions need the cores the compute uses).

>>> med, worst = summary([ValidationResult("cnn", 1, [16], [1.0], 0.015, 0.010)])
>>> round(med, 3), round(worst, 3)
(0.5, 0.5)
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from hetcoll.lab import predict_emulated
from hetcoll.lab.predict_emulated import SharedCores
from hetcoll.lab.validate_ranks import LINK_SIZES, data_rank, filter_rank, plan_rank
from hetcoll.model.costs import ModelCosts, layer_costs
from hetcoll.model.hardware import Cluster, Device, Link, Node
from hetcoll.model.predict import Prediction, filter_modes
from hetcoll.plan import Plan

# -- configurations and results -------------------------------------------------------------------


@dataclass(frozen=True)
class FilterConfiguration:
    """A filter-parallel run: every rank trains ``model`` on the whole ``batch``; each split
    layer's filters are divided in proportion to ``parts`` (one per rank; equal parts: even
    shares), and rank r runs at emulated speed ``speeds[r]`` (0 < f <= 1). ``avoid_gathers``
    as in :func:`hetcoll.torch.filter_parallel` (False: a gather after every split layer).

    >>> FilterConfiguration("cnn", 32, (1.0, 0.5), (1.0, 0.5)).ranks
    2
    """

    model: str
    batch: int
    parts: tuple[float, ...]
    speeds: tuple[float, ...]
    avoid_gathers: bool = True

    @property
    def ranks(self) -> int:
        return len(self.parts)


@dataclass(frozen=True)
class PlanConfiguration:
    """A plan run by :func:`hetcoll.torch.parallelize`: ``plan`` (a :class:`hetcoll.Plan`'s
    dictionary form) on ``len(speeds)`` ranks, rank r's stage slowed to ``speeds[r]`` by
    :func:`hetcoll.lab.emulate.slow_down`. ``strategy``: the row's name (``"pipeline"``,
    ``"hybrid"``, ...).

    >>> PlanConfiguration("cnn", "pipeline", {"replicas": []}, (1.0, 0.5)).ranks
    2
    """

    model: str
    strategy: str
    plan: dict[str, Any] = field(hash=False)
    speeds: tuple[float, ...]

    @property
    def ranks(self) -> int:
        return len(self.speeds)

    @property
    def batch(self) -> int:
        return sum(int(r["samples"]) for r in self.plan["replicas"])

    def samples_per_rank(self) -> list[int]:
        """Each rank's replica's samples (0: idle)."""
        out = [0] * self.ranks
        for r in self.plan["replicas"]:
            for st in r["stages"]:
                for k in st["ranks"]:
                    out[k] = int(r["samples"])
        return out


# A data-parallel configuration: (model, samples per rank, emulated speed per rank).
DataConfiguration = tuple[str, list[int], list[float]]
Configuration = DataConfiguration | FilterConfiguration | PlanConfiguration


@dataclass
class ValidationResult:
    """One configuration: predicted and measured seconds per step.

    ``shares``: samples per rank (data) or filters per rank of the widest split layer
    (filter); ``batch``: the global batch. ``detail``: what the ranks really ran (filter: each
    split layer's mode and shares, each rank's parameter count).
    """

    model: str
    ranks: int
    shares: list[int]
    speeds: list[float]
    predicted_s: float
    measured_s: float
    overlap: bool = True
    predicted_other_s: float = 0.0  # data parallel: the prediction with the other overlap
    strategy: str = "data"
    batch: int = 0
    detail: dict[str, Any] = field(default_factory=dict)
    # Every timed step's seconds (slowest rank), over every run of the configuration, and each
    # run's error: what :attr:`spread` reads.
    measured_steps_s: list[float] = field(default_factory=list)
    run_errors: list[float] = field(default_factory=list)

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted_s - self.measured_s) / self.measured_s

    @property
    def spread(self) -> float:
        """How much the row's own measurements vary, as a fraction of its measured step: the
        range of its runs' errors when it ran more than once, else the interquartile range of
        its steps over their median (0 with fewer than 4 steps)."""
        if len(self.run_errors) > 1:
            return max(self.run_errors) - min(self.run_errors)
        if len(self.measured_steps_s) < 4:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.measured_steps_s, n=4)
        return (q3 - q1) / statistics.median(self.measured_steps_s)

    @property
    def noise(self) -> bool:
        """The row's measurements vary by more than its error: the error says nothing about
        the model."""
        return self.spread > abs(self.error)


def validation_cluster(devices: Sequence[Device], link: Link) -> Cluster:
    """The model's view of the local ranks: rank r runs on ``devices[r]`` as measured, at full
    speed. (The emulated speeds go to :mod:`hetcoll.lab.predict_emulated`, which knows a
    pause from slower compute.)"""
    nodes = [Node(f"rank{r}", replace(d, name=f"rank{r}"), 1) for r, d in enumerate(devices)]
    return Cluster(nodes, link if len(devices) > 1 else None, "<validation>")


def predicted_step(
    costs: ModelCosts,
    config: Configuration,
    devices: Sequence[Device],
    link: Link,
    host: SharedCores | None = None,
    *,
    overlap: bool = True,
    modes: dict[str, str] | None = None,
) -> Prediction:
    """The model's step for ``config`` on ranks measured as ``devices`` joined by ``link``
    (:func:`validation_cluster`), the emulated speeds and the ``host``'s shared cores put in by
    :mod:`hetcoll.lab.predict_emulated`: what the validation compares with the measured step.
    ``overlap`` (data parallel): DDP's allreduce overlapping the backward; ``modes`` (filter
    parallel): the split layers' modes, as the ranks ran them (default: the pairing rule's).

    >>> predicted_step(costs, ("cnn", [43, 21], [1.0, 0.5]), devices, link).step_s  # doctest: +SKIP
    """
    cluster = validation_cluster(devices, link)
    if isinstance(config, PlanConfiguration):
        return predict_emulated.parallel_plan(
            costs, cluster, Plan.from_dict(config.plan), list(config.speeds), host=host
        )
    if isinstance(config, FilterConfiguration):
        if modes is None:
            modes = filter_modes(costs, avoid_gathers=config.avoid_gathers)
        return predict_emulated.filter_parallel(
            costs,
            cluster,
            config.batch,
            list(config.parts),
            list(config.speeds),
            host=host,
            modes=modes,
        )
    _, shares, speeds = config
    return predict_emulated.data_parallel(
        costs, cluster, shares, list(speeds), host=host, overlap=overlap
    )


def default_configurations(model: str = "cnn") -> list[Configuration]:
    """Data parallel: 1-4 ranks, several batch sizes, balanced and unbalanced shares at even
    and uneven emulated speeds. Filter parallel: 2-3 ranks, batches 16-64, even and
    speed-proportional filter shares, paired layers (and one run gathering after every
    layer)."""
    return [
        (model, [16], [1.0]),
        (model, [64], [1.0]),
        (model, [16, 16], [1.0, 1.0]),
        (model, [64, 64], [1.0, 1.0]),
        (model, [32, 32], [1.0, 0.5]),  # even shares, uneven speeds: the slow rank sets the pace
        (model, [43, 21], [1.0, 0.5]),  # shares balanced to the speeds
        (model, [24, 24, 24], [1.0, 1.0, 0.5]),
        (model, [29, 29, 14], [1.0, 1.0, 0.5]),
        (model, [16, 16, 16, 16], [1.0, 1.0, 1.0, 1.0]),
        (model, [32, 16, 8, 8], [1.0, 0.5, 0.25, 0.25]),
        FilterConfiguration(model, 16, (1.0, 1.0), (1.0, 1.0)),
        FilterConfiguration(model, 64, (1.0, 1.0), (1.0, 1.0)),
        FilterConfiguration(model, 32, (1.0, 1.0), (1.0, 1.0), avoid_gathers=False),
        FilterConfiguration(model, 32, (1.0, 1.0), (1.0, 0.5)),  # even filters, uneven speeds
        FilterConfiguration(model, 32, (1.0, 0.5), (1.0, 0.5)),  # filters follow the speeds
        FilterConfiguration(model, 32, (1.0, 1.0, 1.0), (1.0, 1.0, 0.5)),
        FilterConfiguration(model, 32, (1.0, 1.0, 0.5), (1.0, 1.0, 0.5)),
        *plan_configurations(model),
    ]


def plan_configurations(model: str = "cnn") -> list[PlanConfiguration]:
    """Plans of the built-in ``cnn`` (18 layers; other models get none): pipelines of 2 and 3
    one-rank stages (even and uneven speeds, both schedules), asymmetric replicas (one rank
    with the whole model beside a 2-stage pipeline), a filter-split stage after a one-rank
    stage, and a device subset (the slowest rank idle)."""
    if model != "cnn":
        return []

    def one(samples: int, stages: list[tuple[list[int], int, int]]) -> dict[str, Any]:
        return {
            "samples": samples,
            "stages": [{"ranks": r, "layers": [lo, hi]} for r, lo, hi in stages],
        }

    def plan(schedule: str, m: int, *replicas: dict[str, Any]) -> dict[str, Any]:
        return {"microbatches": m, "schedule": schedule, "replicas": list(replicas)}

    split = {"ranks": [1, 2], "speeds": [0.5, 0.5], "layers": [7, 18]}
    return [
        PlanConfiguration(
            model, "pipeline", plan("1F1B", 4, one(32, [([0], 0, 7), ([1], 7, 18)])), (1.0, 1.0)
        ),
        PlanConfiguration(
            model, "pipeline", plan("GPipe", 4, one(32, [([0], 0, 10), ([1], 10, 18)])), (1.0, 0.5)
        ),
        PlanConfiguration(
            model,
            "pipeline",
            plan("1F1B", 4, one(32, [([0], 0, 7), ([1], 7, 12), ([2], 12, 18)])),
            (1.0, 1.0, 0.5),
        ),
        PlanConfiguration(
            model,
            "hybrid",
            plan("1F1B", 4, one(24, [([0], 0, 18)]), one(12, [([1], 0, 10), ([2], 10, 18)])),
            (1.0, 0.5, 0.5),
        ),
        PlanConfiguration(
            model,
            "hybrid",
            plan("GPipe", 2, {"samples": 32, "stages": [{"ranks": [0], "layers": [0, 7]}, split]}),
            (1.0, 0.5, 0.5),
        ),
        PlanConfiguration(
            model,
            "subset",
            plan("GPipe", 1, one(22, [([0], 0, 18)]), one(10, [([1], 0, 18)])),
            (1.0, 0.5, 0.25),
        ),
    ]


# -- on the caller's side: pairing the ranks' measurements with predictions -----------------------


def _measured_steps(runs: Sequence[dict[str, Any]]) -> list[float]:
    """The slowest rank's seconds of every timed step."""
    return [max(t) for t in zip(*(r["step_s"] for r in runs))]


def _link_of(runs: Sequence[dict[str, Any]], p: int, link: Link | None) -> Link:
    if link is not None:
        return link
    if p == 1:
        return Link("none", 0.0, 1.0)
    from hetcoll.lab.calibrate import fit_ring_allreduce

    slowest = [max(t) for t in zip(*(r["allreduce_s"] for r in runs))]
    alpha, bw = fit_ring_allreduce(p, LINK_SIZES, slowest)
    return Link("gloo-allreduce", alpha, bw)


def shared_cores_of(runs: Sequence[dict[str, Any]], cores: int) -> SharedCores | None:
    """The host as the model shares its cores: the scheduler's time slice and the wake-up cost
    per collective fitted to the lock-step stretches each rank's result holds under
    ``"lockstep_s"`` (:func:`hetcoll.lab.validate_ranks.scheduler_here`; medians over the
    ranks); None (no sharing to model) when the ranks fit in the cores."""
    if "lockstep_s" not in runs[0] or len(runs) <= cores:
        return None
    from hetcoll.lab.calibrate import TIME_SLICE_WORKS_S, fit_time_slice, fit_wake_seconds

    stretches = [statistics.median(s) for s in zip(*(r["lockstep_s"] for r in runs))]
    q = fit_time_slice(len(runs), cores, TIME_SLICE_WORKS_S, stretches)
    wake = fit_wake_seconds(len(runs), cores, TIME_SLICE_WORKS_S, stretches, q)
    return SharedCores(cores, q, wake)


def _sharing_detail(host: SharedCores | None) -> dict[str, float]:
    return {} if host is None else {"time_slice_s": host.time_slice_s, "wake_s": host.wake_s}


def _median_prediction(
    runs: Sequence[dict[str, Any]],
    device: Device | None,
    predict: Callable[[Sequence[Device]], float],
) -> float:
    """``predict(devices)`` with the file's device on every rank, or the median over steps of
    the prediction from the devices measured just before each step."""
    if device is not None:
        return predict([device] * len(runs))
    return statistics.median(predict(list(d)) for d in zip(*(r["devices"] for r in runs)))


@dataclass(frozen=True)
class _Setup:
    """What every configuration of one validation run shares: the model's costs, the device and
    link from a calibration file (None: measured in the run), the sample shape, the steps, and
    this machine's cores."""

    costs: ModelCosts
    device: Device | None
    link: Link | None
    input_shape: tuple[int, ...]
    steps: int
    warmup: int
    cores: int


def _validate_data(
    config: DataConfiguration,
    setup: _Setup,
) -> ValidationResult:
    from hetcoll.launch import spawn

    costs, device, link, cores = setup.costs, setup.device, setup.link, setup.cores
    input_shape, steps, warmup = setup.input_shape, setup.steps, setup.warmup

    model, shares, speeds = config
    if len(shares) != len(speeds):
        raise ValueError(f"configurations: {len(shares)} shares but {len(speeds)} speeds")
    p = len(shares)
    here = device is None or (link is None and p > 1)
    args = (model, input_shape, list(shares), list(speeds), steps, warmup, here)
    runs = spawn(data_rank, p, *args, timeout=300.0)
    lk = _link_of(runs, p, link)
    host = shared_cores_of(runs, cores)
    # DDP overlaps the allreduce with the backward pass, but on a CPU host gloo's copies and
    # reductions run on the same cores as the compute: once the ranks fill the cores there
    # is nothing to overlap with, so the model runs them one after the other.
    overlap = p < cores

    def predictor(ov: bool) -> Callable[[Sequence[Device]], float]:
        def predict(devs: Sequence[Device]) -> float:
            return predicted_step(costs, config, devs, lk, host, overlap=ov).step_s

        return predict

    predicted, other = (
        _median_prediction(runs, device, predictor(ov)) for ov in (overlap, not overlap)
    )
    return ValidationResult(
        model,
        p,
        list(shares),
        list(speeds),
        predicted,
        statistics.median(step_times := _measured_steps(runs)),
        overlap,
        other,
        "data",
        sum(shares),
        _sharing_detail(host),
        measured_steps_s=step_times,
    )


def _validate_filter(
    config: FilterConfiguration,
    setup: _Setup,
) -> ValidationResult:
    from hetcoll.launch import spawn

    costs, device, link = setup.costs, setup.device, setup.link
    input_shape, steps, warmup = setup.input_shape, setup.steps, setup.warmup

    p = config.ranks
    if p < 2 or len(config.speeds) != p:
        raise ValueError(
            f"configurations: a filter-parallel run needs >= 2 ranks and one speed per part, "
            f"got parts {config.parts} and speeds {config.speeds}"
        )
    here = device is None or link is None
    args = (config.model, input_shape, config.batch, list(config.parts), list(config.speeds))
    runs = spawn(filter_rank, p, *args, config.avoid_gathers, steps, warmup, here, timeout=300.0)
    lk = _link_of(runs, p, link)
    host = shared_cores_of(runs, setup.cores)
    modes: dict[str, str] = runs[0]["modes"]

    def predict(devs: Sequence[Device]) -> float:
        # Full-speed devices: the emulation slows only the split layers, and so does the model.
        pred = predicted_step(costs, config, devs, lk, host, modes=modes)
        if pred.detail["shares_per_layer"] != runs[0]["shares"]:
            raise RuntimeError(
                f"filter_parallel: the model's shares {pred.detail['shares_per_layer']} differ "
                f"from the layers' {runs[0]['shares']}"
            )
        return pred.step_s

    predicted = _median_prediction(runs, device, predict)
    widest = max(runs[0]["shares"].values(), key=sum)
    return ValidationResult(
        config.model,
        p,
        list(widest),
        list(config.speeds),
        predicted,
        statistics.median(step_times := _measured_steps(runs)),
        False,
        0.0,
        "filter",
        config.batch,
        {
            "modes": modes,
            "shares": runs[0]["shares"],
            "params_per_rank": [r["params"] for r in runs],
            "avoid_gathers": config.avoid_gathers,
            **_sharing_detail(host),
        },
        measured_steps_s=step_times,
    )


def _validate_plan(config: PlanConfiguration, setup: _Setup) -> ValidationResult:
    from hetcoll.launch import spawn

    costs, device, link = setup.costs, setup.device, setup.link
    p = config.ranks
    here = device is None or (link is None and p > 1)
    args = (config.model, setup.input_shape, config.plan, list(config.speeds))
    runs = spawn(plan_rank, p, *args, setup.steps, setup.warmup, here, timeout=300.0)
    lk = _link_of(runs, p, link)
    host = shared_cores_of(runs, setup.cores)

    def predict(devs: Sequence[Device]) -> float:
        return predicted_step(costs, config, devs, lk, host).step_s

    return ValidationResult(
        config.model,
        p,
        config.samples_per_rank(),
        list(config.speeds),
        _median_prediction(runs, device, predict),
        statistics.median(step_times := _measured_steps(runs)),
        False,
        0.0,
        config.strategy,
        config.batch,
        {"plan": config.plan, **_sharing_detail(host)},
        measured_steps_s=step_times,
    )


def run_validation(
    configurations: Sequence[Configuration],
    *,
    device: Device | None = None,
    link: Link | None = None,
    input_shape: tuple[int, ...] = (3, 32, 32),
    steps: int = 9,
    warmup: int = 2,
    repeat: int = 1,
    progress: Callable[[ValidationResult], None] | None = None,
) -> list[ValidationResult]:
    """Run each configuration for real and predict it; return both per configuration.

    A configuration is ``(model, samples per rank, speeds)`` (data parallel) or a
    :class:`FilterConfiguration`. Without ``device`` / ``link`` (a calibration file's), each
    configuration measures them in its own rank processes: the device before every step (GEMM,
    copy, kernel overhead, element-wise layers; every rank at once, or ``cores`` at a time when
    the ranks outnumber the cores), the link once (allreduces of 1 KiB and 8 MiB with the call
    the strategy makes, fitted by the ring model). Step k is predicted from the
    figures measured just before it; the result pairs the median prediction with the median
    measured step (slowest rank).

    ``repeat`` runs every configuration that many times, in rounds (each round runs them all,
    so a change of load on the machine reaches every row alike); a row is then its run of
    median error, with every run's error (:attr:`ValidationResult.spread`). ``progress`` sees
    every run as it ends.
    """
    from hetcoll.model import networks

    if not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat: must be an integer >= 1, got {repeat!r}")
    cores = os.cpu_count() or 1
    costs_of: dict[str, ModelCosts] = {}
    runs: list[list[ValidationResult]] = [[] for _ in configurations]
    shape = tuple(input_shape)
    for _ in range(repeat):
        for i, config in enumerate(configurations):
            model = config[0] if isinstance(config, tuple) else config.model
            if model not in costs_of:
                costs_of[model] = layer_costs(networks.build(model, shape), shape)
            setup = _Setup(costs_of[model], device, link, shape, steps, warmup, cores)
            if isinstance(config, PlanConfiguration):
                res = _validate_plan(config, setup)
            elif isinstance(config, FilterConfiguration):
                res = _validate_filter(config, setup)
            else:
                res = _validate_data(config, setup)
            runs[i].append(res)
            if progress:
                progress(res)
    return [_over_runs(r) for r in runs]


def _over_runs(runs: Sequence[ValidationResult]) -> ValidationResult:
    """One row from the runs of a configuration: the run whose error is the median of theirs
    (the lower median for an even count; each run's prediction pairs with its own measurement,
    taken under the same load), with every run's steps and error."""
    if len(runs) == 1:
        return runs[0]
    errors = [r.error for r in runs]
    middle = runs[errors.index(statistics.median_low(errors))]
    return replace(
        middle,
        measured_steps_s=[t for r in runs for t in r.measured_steps_s],
        run_errors=errors,
    )


def summary(
    results: Sequence[ValidationResult], strategy: str | None = None
) -> tuple[float, float]:
    """(median, worst) absolute relative error, over the rows of ``strategy`` ("data",
    "filter") or all rows."""
    errs = [abs(r.error) for r in results if strategy is None or r.strategy == strategy]
    if not errs:
        raise ValueError(f"strategy: no results for {strategy!r}")
    return statistics.median(errs), max(errs)
