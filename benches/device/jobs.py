"""What plans.py and lm.py share: their command line; hetcoll's planner's pick for the machine;
running a list of plans on every rank of one job, each measured and (on rank 0) predicted, the
results file rewritten after each plan so that a timeout keeps what was measured; and launching
that job from the parent.

Lab code, like everything in benches/: it imports the library, the library never imports it.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

import hetcoll
from hetcoll import launch

from hetero import measure_gpu, real_cluster, sync_gpu

#: The run of the plan hetcoll's planner picks for the machine (:func:`planner_pick`).
PICK = "the planner's pick"
#: The run of the GPU rank alone, the CPU ranks idle (the peer of the ratios; the run
#: :func:`runtime_breakdown` takes apart).
ALONE = "the GPU alone"
#: :func:`plan_group`'s answer on a rank a plan's run does not start.
NOT_STARTED = object()


def started_ranks(plan: Mapping[str, Any]) -> int:
    """The ranks ``hetcoll plan`` tells a user to start for ``plan``: 0 up to the last one it
    names (``torchrun --nproc-per-node N``, ``mpiexec -n N``); ranks after it are not started.

    >>> started_ranks({"replicas": [{"samples": 4, "stages": [{"ranks": [0], "layers": [0, 9]}]}]})
    1
    """
    return max(hetcoll.Plan.from_dict(plan).ranks) + 1


def plan_group(plan: Mapping[str, Any]) -> Any:
    """The group ``plan`` runs on, as a user starts it (:func:`started_ranks`): None (the job's)
    where it names the job's last rank, else a new group of ranks 0 .. N-1, and
    :data:`NOT_STARTED` on the ranks after them, which sit the plan out: idle ranks a plan
    leaves at the end cost its steps nothing (in one job they would join every step's batch
    agreement and loss sum). Every rank calls it, plan by plan, in one order."""
    n = started_ranks(plan)
    if n >= dist.get_world_size():
        return None
    group = dist.new_group(list(range(n)))
    return group if dist.get_rank() < n else NOT_STARTED


def plan_stepper(
    plan: Mapping[str, Any], make: Callable[[Any], Any], optimizer: Callable[[Any], Any]
) -> Callable[[Any, Any], None]:
    """A training step ``step(x, y)`` of ``plan`` on the ranks a user starts for it
    (:func:`plan_group`): ``make(group)`` parallelizes the model on ``group``, ``optimizer``
    makes its optimizer from its parameters; a step is ``par.step(x, y)``, the optimizer's step
    and ``zero_grad()``. On the ranks not started, a step that does nothing (they still join
    the barriers that time it). Every rank calls it, plan by plan, in one order."""
    group = plan_group(plan)
    if group is NOT_STARTED:
        return lambda x, y: None
    par = make(group)
    opt = optimizer(par.parameters())

    def step(x: Any, y: Any) -> None:
        par.step(x, y)
        opt.step()
        opt.zero_grad()

    return step


def parse(
    doc: str,
    argv: list[str] | None,
    *,
    min_cpu_ranks: int,
    batch: int,
    batch_help: str,
    warmup: int,
    steps: int,
) -> argparse.Namespace:
    """The scripts' one command line (their defaults differ)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--json", required=True, help="where to write the results")
    ap.add_argument("--cluster", help="hetcoll model calibrate's file (CPU ranks, gloo link)")
    ap.add_argument(
        "--cpu-ranks", type=int, default=3, help=f"CPU ranks beside the GPU (>= {min_cpu_ranks})"
    )
    ap.add_argument("--batch", type=int, default=batch, help=batch_help)
    ap.add_argument("--microbatches", type=int, default=4, help="of the pipelines and hybrid")
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--probe-s", type=float, default=2.0, help="each rank's speed probe budget")
    ap.add_argument("--timeout", type=float, default=100.0, help="seconds for the job")
    args = ap.parse_args(argv)
    if args.cpu_ranks < min_cpu_ranks:
        ap.error(f"--cpu-ranks: at least {min_cpu_ranks}, got {args.cpu_ranks}")
    return args


def main(rank_main: Callable[..., Any], args: argparse.Namespace, about: dict[str, Any]) -> int:
    """The parent's side: the results' header (``about`` describes the model), rank 0's device
    as the model sees it (the GPU's probes, run on the CPU in the dry run, so that the dry run
    predicts through the same path), then the job (:func:`run_job`)."""
    cuda = torch.cuda.is_available()
    started = time.perf_counter()
    result: dict[str, Any] = {
        "status": "ok" if cuda else "skipped: no CUDA (dry run, rank 0 on the CPU)",
        "cuda": cuda,
        **about,
        "batch": args.batch,
        "microbatches": args.microbatches,
        "warmup": args.warmup,
        "steps": args.steps,
        "cpu_ranks": args.cpu_ranks,
        "cpu_threads_per_rank": 1,
        "torch": torch.__version__,
        "hetcoll": hetcoll.__file__,
        "gpu": measure_gpu(torch.device("cuda", 0) if cuda else torch.device("cpu")),
        "configurations": [],
    }
    if cuda:
        torch.cuda.empty_cache()
    write_results(args.json, result)
    cfg = {
        "cuda": cuda,
        "gpu": result["gpu"],
        "cluster": args.cluster,
        "json": args.json,
        "batch": args.batch,
        "microbatches": args.microbatches,
        "warmup": args.warmup,
        "steps": args.steps,
        "probe_s": args.probe_s,
        "result": result,
    }
    return run_job(rank_main, 1 + args.cpu_ranks, cfg, args.timeout, result, args.json, started)


def _line(r: dict[str, Any]) -> str:
    """A configuration's row, as the job prints it."""
    p = r.get("prediction", {})
    tokens = f"{r['tokens_per_s']:10,.0f} tokens/s  " if "tokens_per_s" in r else ""
    return (
        f"{r['name']:<44} {r['status'][:40]:<40} {tokens}"
        f"measured {r.get('step_s', float('nan')) * 1e3:9.2f} ms  "
        f"predicted {p.get('step_s', float('nan')) * 1e3:9.2f} ms  "
        f"error {p.get('error', float('nan')):+.1%}"
    )


def planner_pick(
    cfg: dict[str, Any], world: int, costs: Callable[[], Any], optimizer_state_copies: int = 1
) -> tuple[str, dict[str, Any]] | None:
    """The plan :func:`hetcoll.model.plan` ranks first for this machine's ranks (the calibrated
    CPU ranks and gloo link, rank 0 the GPU as measured) and ``cfg["batch"]``, as
    ``(kind, plan dict)``: what a user who asks the planner would run. Rank 0 searches
    (``costs()``: the model's layer costs; ``optimizer_state_copies``: the optimizer's, as
    the planner takes them) and every rank gets its answer. None without a calibration file."""
    from hetcoll.model import plan

    pick: list[Any] = [None]
    if dist.get_rank() == 0:
        cluster, _, why_not = real_cluster(cfg["cluster"], cfg["gpu"], world)
        if why_not is None:
            best = plan(
                costs(), cluster, cfg["batch"], optimizer_state_copies=optimizer_state_copies
            )[0]
            pick[0] = (f"planned: {best.strategy}", best.to_plan().to_dict())
    dist.broadcast_object_list(pick, src=0)
    return pick[0]


def planner_over(result: dict[str, Any], rate: str) -> None:
    """The planner's pick's throughput (``rate``: a row's samples or tokens per second) over
    the GPU alone's and over the best of the other runs, from the runs measured so far."""
    rows = {r["name"]: r for r in result["configurations"] if r["status"] == "ok"}
    if PICK not in rows:
        return
    got = rows[PICK][rate]
    others = [r[rate] for name, r in rows.items() if name != PICK]
    over = {ALONE: got / rows[ALONE][rate]} if ALONE in rows else {}
    if others:
        over["the best other run"] = got / max(others)
    result["planner_over"] = over


def slowest_rank_seconds(step: Callable[[], None], dev: torch.device) -> float:
    """Seconds of ``step()`` run by every rank at once: started after a barrier, ended with the
    device synchronized, the slowest rank's (what every timed step of these scripts is)."""
    dist.barrier()
    t0 = time.perf_counter()
    step()
    sync_gpu(dev)
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def runtime_breakdown(
    rank: int,
    plan: dict[str, Any],
    model: Callable[[], Any],
    call: Callable[[Any, Any], Any],
    loss_fn: Callable[[Any, Any], Any],
    optimizer: Callable[[Any], Any],
    data: tuple[Any, Any],
    dev: torch.device,
    rounds: int,
    **parallelize_kw: Any,
) -> dict[str, Any] | None:
    """Where the GPU alone's step goes (issue 40: the first GPU run measured it about twice
    what the model predicted). Rank 0's bare step (zero_grad, ``call(model, x)``, the loss,
    backward, the optimizer, the device synchronized; the other ranks wait) and ``plan``'s
    step under parallelize on the ranks a user starts for it (:func:`plan_group`; timed as the
    configurations are: between barriers, the slowest rank's), interleaved for ``rounds``
    rounds, medians; then rank 0's plan steps profiled
    (cProfile): the functions that took longest of their own and the runtime's own
    (``hetcoll/torch/parallel.py``) by their cumulative time. Rank 0 gets the figures, or
    ``{"status": "failed: ..."}`` where the breakdown raised (on every rank alike; one that
    raises on some ranks only leaves the others waiting, to the job's timeout)."""
    from hetcoll.torch import parallelize

    try:
        torch.manual_seed(0)
        planned = plan_stepper(
            plan,
            lambda group: parallelize(
                model().to(dev), plan, loss_fn=loss_fn, group=group, **parallelize_kw
            ),
            optimizer,
        )
        bare = model().to(dev)
        bopt = optimizer(bare.parameters())
        x, y = data

        def bare_step() -> None:
            if rank == 0:
                bopt.zero_grad()
                loss_fn(call(bare, x), y).backward()
                bopt.step()

        def plan_step() -> None:
            planned(x, y)

        timed: dict[str, list[float]] = {"bare": [], "plan": []}
        for i in range(rounds + 2):  # two rounds to warm up
            for name, fn in (("bare", bare_step), ("plan", plan_step)):
                t = slowest_rank_seconds(fn, dev)
                if i >= 2:
                    timed[name].append(t)
        profile = cProfile.Profile()
        for _ in range(rounds):
            dist.barrier()
            if rank == 0:
                profile.enable()
            plan_step()
            sync_gpu(dev)
            if rank == 0:
                profile.disable()
        syncs = host_syncs(plan_step, dev if rank == 0 else torch.device("cpu"))
        if rank != 0:
            return None
        stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]

        def rows(key: Callable[[Any], float], keep: Callable[[str], bool]) -> list[dict[str, Any]]:
            top = sorted(
                ((k, v) for k, v in stats.items() if keep(k[0])), key=lambda kv: -key(kv[1])
            )
            return [
                {
                    "function": f"{os.path.basename(f)}:{line}({name})",
                    "calls": v[1],
                    "own_s": v[2] / rounds,
                    "cumulative_s": v[3] / rounds,
                }
                for (f, line, name), v in top[:20]
            ]

        return {
            "status": "ok",
            "plan": ALONE,
            "started_ranks": started_ranks(plan),
            "rounds": rounds,
            "bare_step_s": statistics.median(timed["bare"]),
            "plan_step_s": statistics.median(timed["plan"]),
            "profile_own": rows(lambda v: v[2], lambda f: True),
            "profile_runtime": rows(
                lambda v: v[3], lambda f: f.endswith("hetcoll/torch/parallel.py")
            ),
            "host_syncs": syncs,
        }
    except Exception as e:
        failed = {"status": f"failed: {type(e).__name__}: {e}"[:2000]}
        return failed if rank == 0 else None


def host_syncs(fn: Callable[[], None], dev: torch.device) -> list[dict[str, Any]] | None:
    """Where one call of ``fn`` makes the host wait for ``dev`` (CUDA's sync debug mode: a
    ``.item()``, a copy to the host, a ``nonzero``...), each place by its call stack's last
    frames in hetcoll, the benches or the examples, with how often it synced there; a sync
    stops the host queueing work ahead of the GPU. None where ``dev`` is no CUDA device (the
    mode needs one). ``fn`` runs once either way: a collective runs on every rank."""
    if dev.type != "cuda":
        fn()
        return None
    found: Counter[str] = Counter()

    def record(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        if "synchroniz" not in str(message):
            return
        ours = [
            f"{os.path.basename(f.filename)}:{f.lineno}({f.name})"
            for f in traceback.extract_stack()[:-1]
            if any(k in f.filename for k in ("hetcoll", "benches", "examples"))
        ]
        found[" < ".join(reversed(ours[-3:])) or f"{filename}:{lineno}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sync_gpu(dev)
    return [{"where": k, "syncs": n} for k, n in found.most_common(20)]


def prediction(step_s: float, without_s: float, measured_s: float) -> dict[str, Any]:
    """A configuration's ``prediction``: the model's step and its error against the measured
    one, and the same without the devices' step overhead (``Device.step_overhead_s``, new
    since the first GPU run: whether it closes the gap is what the next run says)."""
    return {
        "status": "ok",
        "step_s": step_s,
        "error": step_s / measured_s - 1,
        "without_step_overhead_s": without_s,
        "error_without_step_overhead": without_s / measured_s - 1,
    }


def write_results(path: str, result: dict[str, Any]) -> None:
    """``result`` as JSON at ``path``, with the median and worst relative error of the
    predictions made so far (``prediction_error``)."""
    errors = [
        abs(r["prediction"]["error"])
        for r in result["configurations"]
        if r["status"] == "ok" and r.get("prediction", {}).get("status") == "ok"
    ]
    if errors:
        result["prediction_error"] = {
            "median": statistics.median(errors),
            "worst": max(errors),
            "count": len(errors),
        }
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def run_configurations(
    rank: int,
    result: dict[str, Any],
    runs: Mapping[str, tuple[str, dict[str, Any]]],
    measure: Callable[[dict[str, Any]], dict[str, Any]],
    predict: Callable[[dict[str, Any], float], dict[str, Any]],
    path: str,
    summarize: Callable[[dict[str, Any]], None] = lambda result: None,
) -> dict[str, Any] | None:
    """Every rank runs each plan of ``runs`` (name -> (kind, plan dict)) with ``measure(plan)``
    (its figures, ``step_s`` among them); a plan the runtime refuses (on every rank) is
    recorded as failed and the others still run. Rank 0 predicts each measured plan with
    ``predict(plan, step_s)`` (a failure to predict is a result too), appends the row,
    ``summarize(result)`` and rewrites ``path``. Returns ``result`` on rank 0, else None."""
    for name, (kind, plan) in runs.items():
        t0 = time.perf_counter()
        # Run on the ranks a user starts for it (plan_group): the model predicts those.
        row: dict[str, Any] = {
            "name": name,
            "kind": kind,
            "plan": plan,
            "started_ranks": started_ranks(plan),
        }
        try:
            row.update(measure(plan))
            row["status"] = "ok"
        except Exception as e:
            row["status"] = f"failed: {type(e).__name__}: {e}"[:2000]
            row["traceback"] = traceback.format_exc()[-4000:]
        dist.barrier()
        if rank == 0:
            if row["status"] == "ok":
                try:
                    row["prediction"] = predict(plan, row["step_s"])
                except Exception as e:
                    row["prediction"] = {"status": f"failed: {type(e).__name__}: {e}"[:2000]}
            row["seconds"] = time.perf_counter() - t0
            result["configurations"].append(row)
            summarize(result)
            write_results(path, result)
    return result if rank == 0 else None


def run_job(
    rank_main: Callable[..., Any],
    world: int,
    cfg: dict[str, Any],
    timeout: float,
    result: dict[str, Any],
    path: str,
    started: float,
) -> int:
    """Launch ``rank_main(rank, world, cfg)`` on ``world`` ranks; rank 0's result, or what it
    wrote to ``path`` before the job failed, is written back with the job's status and the
    seconds since ``started`` (a :func:`time.perf_counter` value), printed and judged: 0 when
    the job and every configuration succeeded, else 1."""
    try:
        result = launch.spawn(rank_main, world, cfg, timeout=timeout, threads_per_rank=1)[0]
    except Exception as e:  # what rank 0 wrote before the failure stays in the file
        try:
            with open(path) as f:
                result = json.load(f)
        except (OSError, json.JSONDecodeError):
            pass
        result["status"] = f"failed: {type(e).__name__}: {e}"[:2000]
    result["seconds"] = time.perf_counter() - started
    write_results(path, result)
    print(json.dumps({k: v for k, v in result.items() if k != "configurations"}, default=str))
    for r in result["configurations"]:
        print(_line(r))
    failed = [r for r in result["configurations"] if r["status"] != "ok"]
    return 1 if failed or result["status"].startswith("failed") else 0
