"""``hetcoll plan`` and ``hetcoll model {costs,calibrate,validate}``: thin shells over
:mod:`hetcoll.model`, and over the lab's :mod:`hetcoll.lab.calibrate` and
:mod:`hetcoll.lab.validate` (imported when those commands run)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from hetcoll.cli.arguments import MAX_UNITS, integer, writable_file


def _fmt_s(x: float) -> str:
    if x != x or x == float("inf"):
        return "inf"
    if x >= 1:
        return f"{x:.3f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.3f} ms"
    return f"{x * 1e6:.1f} us"


def _shares_text(shares: list[int], limit: int = 16) -> str:
    if len(shares) <= limit:
        return ",".join(str(s) for s in shares)
    # Long clusters: run-length encode (1,024 devices of a few types have few distinct shares).
    runs: list[list[int]] = []
    for s in shares:
        if runs and runs[-1][0] == s:
            runs[-1][1] += 1
        else:
            runs.append([s, 1])
    return ",".join(f"{s}x{n}" if n > 1 else str(s) for s, n in runs)


def _costs(args: argparse.Namespace, **kwargs: Any) -> Any:
    """The layer costs of ``--model`` on samples of ``--input``, the model built on the meta
    device: shapes only, so a model too large for this machine's memory is costed, not built."""
    from hetcoll.model import layer_costs, parse_shape

    return layer_costs(_model(args), parse_shape(args.input), **kwargs)


def _model(args: argparse.Namespace) -> Any:
    """``--model`` built on the meta device (shapes only: a model too large for this machine's
    memory is costed, not built)."""
    from hetcoll.model import networks, parse_shape

    shape = parse_shape(args.input)
    if ":" in args.model and "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # module:attr finds the working directory's modules,
        # as `python -m` does (the `hetcoll` script's own directory comes first otherwise)
    return networks.build(args.model, shape, args.classes, device="meta")


def _load(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    from hetcoll.model import layer_costs, load_cluster, parse_shape

    cluster = load_cluster(args.cluster)  # first: a bad file fails before the model is costed
    model = _model(args)
    costs = layer_costs(
        model,
        parse_shape(args.input),
        conv_algorithm=args.conv_algorithm,
        precision=args.precision,
    )
    return costs, cluster, model


def _ranks_text(ranks: list[int]) -> str:
    runs: list[list[int]] = []
    for r in ranks:
        if runs and runs[-1][1] + 1 == r:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)
    return ("ranks " if len(ranks) > 1 else "rank ") + text


def _plan_text(plan: Any) -> str:
    """A plan on one line: runs of one-rank whole-model replicas, then each other replica's
    samples and its stages' ranks and layers."""
    parts: list[str] = []
    ranks: list[int] = []
    samples: list[int] = []

    def flush() -> None:
        if ranks:
            parts.append(
                f"whole model on {_ranks_text(ranks)} ({_shares_text(samples, limit=4)} samples)"
            )
            ranks.clear()
            samples.clear()

    for r in plan.replicas:
        if len(r.stages) == 1 and len(r.stages[0].ranks) == 1:
            ranks.append(r.stages[0].ranks[0])
            samples.append(r.samples)
            continue
        flush()
        stages = " | ".join(
            f"{_ranks_text(sorted(s.ranks))} layers {s.layers[0]}-{s.layers[1]}" for s in r.stages
        )
        parts.append(f"{r.samples} samples through [{stages}]")
    flush()
    head = f"{plan.microbatches} micro-batches {plan.schedule}; " if plan.microbatches > 1 else ""
    return head + "; ".join(parts)


def _nodes_json(cluster: Any) -> list[dict[str, Any]]:
    """Each node of ``cluster``: its name, device and ranks (devices are ranks in file order)."""
    out, rank = [], 0
    for n in cluster.nodes:
        out.append({"node": n.name, "device": n.device.name, "ranks": [rank, rank + n.count - 1]})
        rank += n.count
    return out


def _device_lines(cluster: Any, shares: list[int], unit: str) -> list[str]:
    """Each node's devices and shares, one line per run of alike nodes (same device, count and
    shares), so that a cluster of 1,024 devices in a few kinds of node prints a few lines."""
    rows: list[list[Any]] = []  # [(device, count, shares), node names, first rank, last rank]
    rank = 0
    for n in cluster.nodes:
        key = (n.device.name, n.count, tuple(shares[rank : rank + n.count]))
        if rows and rows[-1][0] == key:
            rows[-1][1].append(n.name)
            rows[-1][3] = rank + n.count - 1
        else:
            rows.append([key, [n.name], rank, rank + n.count - 1])
        rank += n.count
    lines = []
    for (device, count, sh), names, first, last in rows:
        where = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
        devices = f"{count} x {device}" if count > 1 else device
        if len(names) > 1:
            devices = f"{len(names)} nodes of {devices}"
        ranks = f"rank {first}" if first == last else f"ranks {first}-{last}"
        if not any(sh):
            what = "left out"
        elif len(set(sh)) == 1:
            what = f"{sh[0]} {unit}" + (" each" if len(sh) > 1 or len(names) > 1 else "")
        else:
            what = f"{unit} {_shares_text(list(sh))}"
        lines.append(f"    {where} ({devices}), {ranks}: {what}")
    return lines


def _left_out_text(cluster: Any, shares: list[int]) -> str:
    """The devices a plan leaves out, by kind: "2 x cpu (ranks 16-17)"."""
    kinds: dict[str, list[int]] = {}
    for r, (d, s) in enumerate(zip(cluster.devices, shares)):
        if s == 0:
            kinds.setdefault(d.name, []).append(r)
    return ", ".join(f"{len(rs)} x {k} ({_ranks_text(rs)})" for k, rs in kinds.items())


def _run_commands(best: Any, path: str, cluster: Any) -> list[str]:
    """How to run the plan of ``best`` written to ``path`` with examples/train_plan.py: rank r
    is device r of the cluster file; a plan on a subset of the devices runs on the ranks up to
    the subset's last (those the planner predicted it with), the others are not started."""
    devices = best.detail.get("devices")
    world = max(devices) + 1 if devices else cluster.num_devices
    script = "examples/train_plan.py"
    # torchrun starts the same number of ranks on every node: the nodes the ranks fill.
    counts, first = set(), 0
    for n in cluster.nodes:
        if first < world:
            counts.add(n.count)
        first += n.count
    out = []
    if world <= cluster.nodes[0].count:
        out.append(f"torchrun --standalone --nproc-per-node {world} {script} --plan {path}")
    elif len(counts) == 1 and world % cluster.nodes[0].count == 0:
        k = cluster.nodes[0].count
        out.append(
            f"torchrun --nnodes {world // k} --nproc-per-node {k} --node-rank I "
            f"--rdzv-endpoint HOST:PORT {script} --plan {path}   # on node I, 0..{world // k - 1}"
        )
    out.append(f"mpiexec -n {world} python {script} --plan {path} --mpi")
    return out


def _comparison_lines(table: dict[str, Any]) -> list[str]:
    """Seed 002's comparison on the devices the node-wise plans were searched on."""
    rows = table["rows"]
    lines = [
        f"node-wise placement against the other strategies on {_ranks_text(table['devices'])} "
        "(seed 002's comparison):",
        f"  {'strategy':<34} {'MB/step':>10} {'load balance':>13} {'step':>12}",
    ]
    for r in rows:
        lines.append(
            f"  {r['strategy']:<34} {r['bytes_per_step'] / 1e6:>10.1f} "
            f"{r['load_balance']:>13.3f} {_fmt_s(r['step_s']):>12}"
        )
    lines.append(
        "  (MB/step: bytes sent per step, all devices; load balance: slowest device's work "
        "time over the ideal, 1.0 is perfect)"
    )
    return lines


def _cmd_plan(args: argparse.Namespace) -> int:
    from hetcoll.model import plan, sweep
    from hetcoll.model.planner import SearchReport, explain, plot_plans, plot_sweep

    if args.sweep and args.out:
        raise ValueError("--out: writes the best plan of one planning run, not of a sweep")
    costs, cluster, model = _load(args)
    if args.sweep:
        points = sweep(costs, cluster, args.batch, args.sweep)
        families = sorted({f for pt in points for f in pt.best})
        if args.json:
            json.dump(
                {
                    "axis": args.sweep,
                    "points": [
                        {"value": pt.value, **{f: p.to_json() for f, p in pt.best.items()}}
                        for pt in points
                    ],
                },
                sys.stdout,
            )
            print()
        else:
            print(f"predicted samples/s, best plan of each strategy, along {args.sweep}")
            print(f"{args.sweep:>10} " + " ".join(f"{f[:26]:>26}" for f in families))
            for pt in points:
                cells = [
                    f"{pt.best[f].samples_per_s:>26.4g}" if f in pt.best else f"{'-':>26}"
                    for f in families
                ]
                print(f"{pt.value:>10g} " + " ".join(cells))
        png = args.plot or f"hetcoll-sweep-{args.sweep}.png"
        plot_sweep(points, args.sweep, png, f"{args.model} on {cluster.source}, batch {args.batch}")
        if not args.json:
            print(f"plot: {png}")
        return 0
    t0 = time.perf_counter()
    report = SearchReport()
    ranked = plan(costs, cluster, args.batch, model=model, report=report)
    planning_s = time.perf_counter() - t0
    if args.out:
        if not ranked[0].feasible:
            raise ValueError(f"--out: no feasible plan ({ranked[0].reason})")
        ranked[0].to_plan().save(args.out)  # ValueError (exit 2) saying why there is none
    if args.plot:
        plot_plans(
            ranked,
            args.plot,
            f"{args.model} on {cluster.num_devices} devices, batch {args.batch}: "
            "predicted step by plan",
        )
    why = explain(ranked[0], cluster)
    if args.json:
        # Every candidate with its figures; the plans themselves, and on clusters of more than
        # 64 devices the figures of every device, for the shown ones (the best and the
        # runners-up --top lists): a plan of 10,240 replicas is large.
        json.dump(
            {
                "model": args.model,
                "batch": args.batch,
                "devices": cluster.num_devices,
                "nodes": _nodes_json(cluster),
                "precision": costs.precision,
                "planning_s": planning_s,
                "best_bottleneck": why,
                "search": report.to_json(),
                "plans": [
                    {
                        **p.to_json(
                            with_plan=i <= args.top,
                            per_device=i <= args.top or cluster.num_devices <= 64,
                        ),
                        "bottleneck": explain(p, cluster),
                    }
                    for i, p in enumerate(ranked)
                ],
                "notes": list(costs.notes),
                **({"plot": args.plot} if args.plot else {}),
            },
            sys.stdout,
        )
        print()
        return 0
    best = ranked[0]
    print(
        f"{args.model} ({costs.params:,} parameters, {costs.forward_flops(1) / 1e6:.1f} MFLOP "
        f"forward per sample, {costs.precision}), batch {args.batch}, "
        f"{cluster.num_devices} devices (planned in {planning_s * 1e3:.0f} ms: "
        f"{len(ranked)} plans ranked, {sum(report.pruned.values())} pruned by a bound)"
    )
    for note in costs.notes:
        print(f"note: {note}")
    if not best.feasible:
        print(f"no feasible plan: {best.reason}")
    print(
        f"best: {best.strategy}: {_fmt_s(best.step_s)} per step, {best.samples_per_s:.4g} samples/s"
    )
    print(f"  {best.share_unit} per device:")
    for line in _device_lines(cluster, best.shares, best.share_unit):
        print(line)
    if best.feasible and not all(best.shares):
        everyone = next((p for p in ranked if p.feasible and all(p.shares)), None)
        versus = (
            f": {everyone.step_s / best.step_s:.2f}x faster than the best plan on all "
            f"{cluster.num_devices} ({everyone.strategy}, {_fmt_s(everyone.step_s)})"
            if everyone is not None
            else ""
        )
        print(f"  leaves out {_left_out_text(cluster, best.shares)}{versus}")
    if best.plan is not None:
        print(f"  plan: {_plan_text(best.plan)}")
    print("  breakdown: " + ", ".join(f"{k} {_fmt_s(v)}" for k, v in best.breakdown.items()))
    print(f"  bottleneck: {why['text']}")
    print(f"  memory per device: up to {max(best.memory_bytes) / 1e9:.3g} GB")
    print("runners-up:")
    shown = ranked[1 : 1 + args.top]
    width = max([32, *(len(p.strategy) for p in shown)])
    for p in shown:
        mark = f"  [{explain(p, cluster)['term']}]" if p.feasible else f"  INFEASIBLE: {p.reason}"
        ratio = p.step_s / best.step_s if best.step_s > 0 else float("inf")
        print(f"  {p.strategy:<{width}} {_fmt_s(p.step_s):>12}  ({ratio:.2f}x){mark}")
    if report.placement_comparison is not None:
        for line in _comparison_lines(report.placement_comparison):
            print(line)
    for family, reason in report.skipped.items():
        print(f"not searched: {family}: {reason}")
    if args.plot:
        print(f"plot: {args.plot}")
    if best.feasible and best.plan is not None:
        path = args.out or "PLAN.json"
        if args.out:
            print(f"wrote {args.out}; run it (rank r on device r as listed above) with")
        else:
            print("write it with --out PLAN.json, then run it (rank r on device r above) with")
        for command in _run_commands(best, path, cluster):
            print(f"  {command}")
        print(
            f"  (examples/train_plan.py is in hetcoll's repository: its make_model must build "
            f"{args.model}; or call hetcoll.torch.parallelize in your own script)"
        )
    elif best.feasible:
        print(f"no plan file for this model: {best.plan_note}")
    return 0


_MODEL_HELP = (
    "the model: a built-in (cnn, vgg, resnet, mlp) or MODULE:ATTR, where ATTR is an "
    "nn.Module subclass or a function annotated '-> nn.Module' taking no arguments "
    "(e.g. torchvision.models:resnet18 or mymodels:Net, found in the working directory); "
    "nothing else is called"
)
_INPUT_HELP = "the shape of one sample, channels first, without the batch: e.g. 3x32x32"
_CLASSES_HELP = "number of classes of the built-in models (default 10)"


def add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="find the fastest way to train a model on a cluster, and how to run it",
        description="Predict one training step of every strategy - data parallel with balanced "
        "or even batches, filter parallel (each layer's channels split by speed), pipelines, "
        "replicas of unequal shape, on all devices or a faster subset - and print the best, "
        "each device's share, and the command that runs it. The prediction is the analytical "
        "performance model of docs/model.md; the model is costed on the meta device (no "
        "memory, any size). --out writes the best plan as a file examples/train_plan.py runs.",
    )
    p.add_argument("--model", required=True, help=_MODEL_HELP)
    p.add_argument("--input", required=True, help=_INPUT_HELP)
    p.add_argument(
        "--cluster",
        required=True,
        help="the cluster's TOML file: devices, links, nodes (see examples/clusters/, or write "
        "this machine's with hetcoll model calibrate)",
    )
    p.add_argument(
        "--batch",
        type=integer(1, MAX_UNITS),
        required=True,
        help="global batch size: samples per training step over all devices",
    )
    p.add_argument("--classes", type=integer(1), default=10, help=_CLASSES_HELP)
    p.add_argument(
        "--conv-algorithm",
        choices=("implicit-gemm", "im2col"),
        default="implicit-gemm",
        help="how convolutions move memory: implicit-gemm as PyTorch's oneDNN/cuDNN kernels "
        "(default), im2col as PyDTNN's",
    )
    _add_precision(p)
    p.add_argument(
        "--sweep",
        choices=("batch", "flops", "mem_bw", "link_bw", "nodes"),
        help="instead of one plan, the best plan of each strategy as one thing varies: the "
        "batch, devices' FLOP/s or memory bandwidth, links' bandwidth, or the number of nodes "
        "(a table and a plot)",
    )
    p.add_argument(
        "--plot",
        type=writable_file,
        help="write a plot to this PNG: predicted step time of the best plans, one bar each "
        "(with --sweep: the sweep's plot; default hetcoll-sweep-AXIS.png)",
    )
    p.add_argument(
        "--top", type=integer(0), default=5, help="how many runners-up to list (default 5)"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument(
        "--out",
        metavar="PLAN.json",
        type=writable_file,
        help="write the best plan to this file, for examples/train_plan.py or "
        "hetcoll.torch.parallelize to run",
    )
    p.set_defaults(func=_cmd_plan)


def _add_precision(p: argparse.ArgumentParser) -> None:
    from hetcoll.model.hardware import PRECISIONS

    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="training precision (autocast): matmuls at the devices' peak for it, 2-byte "
        "activations for bf16/fp16 (docs/model.md, Precision)",
    )


def _cmd_costs(args: argparse.Namespace) -> int:
    costs = _costs(args, precision=args.precision)
    if args.json:
        json.dump(
            {
                "model": args.model,
                "input": list(costs.input_shape),
                "precision": costs.precision,
                "params": costs.params,
                "forward_flops": costs.forward_flops(1),
                "backward_flops": costs.backward_flops(1),
                "layers": [
                    {
                        "name": x.name,
                        "kind": x.kind,
                        "params": x.params,
                        "forward_flops_per_sample": x.forward_flops(1),
                        "backward_flops_per_sample": x.backward_flops(1),
                        "activation_bytes_per_sample": x.out_bytes_per_sample,
                        "gradient_bytes": x.gradient_bytes,
                    }
                    for x in costs.layers
                ],
                "notes": list(costs.notes),
            },
            sys.stdout,
        )
        print()
    else:
        print(costs.table())
        for note in costs.notes:
            print(f"note: {note}")
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from hetcoll.lab.calibrate import calibrate

    links = tuple(x for x in args.links.split(",") if x)
    for x in links:
        if x not in ("gloo", "mpi"):
            raise ValueError(f"links: expected gloo and/or mpi, got {x!r}")
    cal = calibrate(
        ranks=args.ranks,
        links=links,
        transport=args.transport,
        progress=lambda s: print(s, file=sys.stderr, flush=True),
    )
    text = cal.to_toml()
    if args.output == "-":
        sys.stdout.write(text)
    else:
        with open(args.output, "w") as f:
            f.write(text)
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    from hetcoll.lab.validate import (
        FilterConfiguration,
        PlanConfiguration,
        default_configurations,
        run_validation,
        summary,
    )
    from hetcoll.model import load_cluster

    configs = default_configurations(args.model)
    if args.quick:
        data = [c for c in configs if isinstance(c, tuple)]
        filt = [c for c in configs if isinstance(c, FilterConfiguration)]
        plans = [c for c in configs if isinstance(c, PlanConfiguration)]
        configs = [data[5], filt[4], *plans[1:2]]
    device = link = None
    if args.cluster:
        cluster = load_cluster(args.cluster)
        device = cluster.devices[0]
        link = cluster.ring_link() if cluster.num_devices > 1 else None

    def row_of(r: Any) -> dict[str, Any]:
        data = r.strategy == "data"
        row = {
            "strategy": r.strategy,
            "ranks": r.ranks,
            "batch": r.batch,
            "shares": r.shares,
            "speeds": r.speeds,
            "predicted_s": r.predicted_s,
            "measured_s": r.measured_s,
            "error": r.error,
            "spread": r.spread,
            "noise": r.noise,
            "run_errors": r.run_errors,
            "measured_steps_s": r.measured_steps_s,
        }
        if data:
            row.update(overlap=r.overlap, predicted_other_overlap_s=r.predicted_other_s)
        elif "plan" in r.detail:
            row.update(plan=r.detail["plan"])
        else:
            row.update(
                avoid_gathers=r.detail["avoid_gathers"],
                modes=r.detail["modes"],
                layer_shares=r.detail["shares"],
                params_per_rank=r.detail["params_per_rank"],
            )
        return row

    bar = None
    if args.json:  # the table goes to stdout at the end; a bar on stderr meanwhile
        from tqdm import tqdm  # type: ignore[import-untyped]

        bar = tqdm(total=len(configs) * args.repeat, unit="run", desc="validate", file=sys.stderr)

    def show(r: Any) -> None:
        data = r.strategy == "data"
        if bar is not None:
            bar.set_postfix_str(f"{r.strategy} {r.ranks} ranks: error {r.error:+.0%}")
            bar.update()
        else:
            speeds = ",".join(f"{s:g}" for s in r.speeds)
            other = f"{(r.predicted_other_s - r.measured_s) / r.measured_s:+.0%}" if data else "-"
            overlap = ("yes" if r.overlap else "no") if data else "-"
            strategy = r.strategy
            if not data and not r.detail.get("avoid_gathers", True):
                strategy += "/gather"
            print(
                f"{strategy:>13} {r.ranks:>5} {r.batch:>5} {_shares_text(r.shares):>14}"
                f" {speeds:>15} {r.predicted_s * 1e3:>10.1f} {r.measured_s * 1e3:>10.1f}"
                f" {r.error:>+7.0%} {overlap:>7} {other:>11}",
                flush=True,
            )

    if not args.json:
        print(
            f"{args.model} on gloo, emulated speeds. data: plain torch DDP, shares = samples per "
            "rank, a rank of speed f sleeps (1/f - 1) x its compute time between forward and "
            "backward. filter: "
            "hetcoll.torch.filter_parallel, every rank on the whole batch, shares = filters of "
            "the widest layer, each split layer sleeps (1/f - 1) x its own compute. pipeline, "
            "hybrid, subset: plans run by hetcoll.torch.parallelize, shares = samples of each "
            "rank's replica, each layer with parameters sleeps (1/f - 1) x its own compute"
        )
        head = (
            "strategy",
            "ranks",
            "batch",
            "shares",
            "speeds",
            "pred (ms)",
            "meas (ms)",
            "error",
            "overlap",
            "other error",
        )
        widths = (13, 5, 5, 14, 15, 10, 10, 7, 7, 11)
        print(" ".join(f"{h:>{w}}" for h, w in zip(head, widths)))
    results = run_validation(
        configs, device=device, link=link, steps=args.steps, repeat=args.repeat, progress=show
    )
    if bar is not None:
        bar.close()
    strategies = sorted({r.strategy for r in results})
    errors = {s: summary(results, s) for s in strategies}
    signal = [r for r in results if not r.noise]
    if args.json:
        json.dump(
            {
                "results": [row_of(r) for r in results],
                "repeat": args.repeat,
                "median_abs_error": summary(results)[0],
                "worst_abs_error": summary(results)[1],
                "noise_rows": len(results) - len(signal),
                "worst_abs_error_beyond_noise": max((abs(r.error) for r in signal), default=0.0),
                "by_strategy": {
                    s: {"median_abs_error": med, "worst_abs_error": worst}
                    for s, (med, worst) in errors.items()
                },
            },
            sys.stdout,
        )
        print()
    else:
        if args.repeat > 1:
            print(
                f"each row's run of median error of {args.repeat} (spread: the range of the "
                "runs' errors; noise: the spread exceeds the error):"
            )
            for r in results:
                speeds = ",".join(f"{s:g}" for s in r.speeds)
                verdict = "noise" if r.noise else ""
                print(
                    f"{r.strategy:>13} {r.ranks:>5} {r.batch:>5} {_shares_text(r.shares):>14}"
                    f" {speeds:>15} {r.predicted_s * 1e3:>10.1f} {r.measured_s * 1e3:>10.1f}"
                    f" {r.error:>+7.0%} spread {r.spread:>4.0%} {verdict}"
                )
        every = {"all rows": summary(results)} if len(strategies) > 1 else {}
        for s, (med, worst) in {**errors, **every}.items():
            print(f"{s}: median |error| {med:.1%}, worst {worst:.1%} (target: 12% / 30%)")
        noisy = len(results) - len(signal)
        if noisy:
            worst = max((abs(r.error) for r in signal), default=0.0)
            print(
                f"{noisy} of {len(results)} rows vary by more than their error (noise); worst "
                f"|error| of the others {worst:.1%}"
            )
        print(
            "overlap: DDP's allreduce overlapped with the backward in the model (only while the "
            "ranks leave cores free); other error: the prediction with the other setting; "
            "filter/gather: a gather after every split layer (no pairing)"
        )
    return 0


def add_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "model",
        help="the performance model: a model's costs, this machine's speeds, the check",
        description="A model's layer costs; measure this machine into a cluster file; check "
        "the model's predictions against measured steps.",
    )
    msub = p.add_subparsers(dest="model_command", required=True)

    c = msub.add_parser(
        "costs",
        help="each layer's FLOPs, parameters and bytes moved, per sample",
        description="Each layer's forward and backward FLOPs, parameters and bytes per sample, "
        "counted on the meta device (no memory, any size): what the planner predicts from.",
    )
    c.add_argument("--model", required=True, help=_MODEL_HELP)
    c.add_argument("--input", required=True, help=_INPUT_HELP)
    c.add_argument("--classes", type=integer(1), default=10, help=_CLASSES_HELP)
    _add_precision(c)
    c.add_argument("--json", action="store_true", help="print JSON instead of a table")
    c.set_defaults(func=_cmd_costs)

    k = msub.add_parser(
        "calibrate",
        help="measure this machine and write its cluster TOML file",
        description="Measure this machine's FLOP/s, memory bandwidth and links between local "
        "ranks, and write the cluster file hetcoll plan --cluster reads.",
    )
    k.add_argument(
        "--output",
        "-o",
        default="-",
        type=lambda x: x if x == "-" else writable_file(x),
        help="the file to write (default: print it)",
    )
    k.add_argument(
        "--ranks", type=integer(1), help="how many ranks the node runs (default: one per core)"
    )
    k.add_argument(
        "--links", default="gloo,mpi", help="which links to measure: gloo, mpi or both (gloo,mpi)"
    )
    k.add_argument(
        "--transport",
        default="gloo",
        choices=("gloo", "mpi"),
        help="the link the node's ranks use in the file (default gloo)",
    )
    k.set_defaults(func=_cmd_calibrate)

    v = msub.add_parser(
        "validate",
        help="check the predictions: predicted vs measured steps on this machine",
        description="Run data-parallel, filter-parallel and plan (pipeline, hybrid, device "
        "subset) training steps on local ranks of emulated speeds and compare each measured "
        "step time with the model's prediction.",
    )
    v.add_argument(
        "--model", default="cnn", choices=("cnn", "vgg", "resnet", "mlp"), help="built-in model"
    )
    v.add_argument(
        "--cluster", help="a calibration file to predict with (default: measure this machine now)"
    )
    v.add_argument(
        "--steps", type=integer(1), default=9, help="timed steps per configuration (default 9)"
    )
    v.add_argument(
        "--quick", action="store_true", help="three configurations only (data, filter, plan)"
    )
    v.add_argument(
        "--repeat",
        type=integer(1),
        default=1,
        help="run every configuration this many times, in rounds, and report each row's "
        "median and spread (default 1)",
    )
    v.add_argument("--json", action="store_true", help="print JSON instead of a table")
    v.set_defaults(func=_cmd_validate)
