"""``hetcoll plan``: the planner's ranking of a model's plans on a cluster, as text a user acts
on (each device named, what to run, a faster device subset), as JSON, a plot or a sweep; and
``--out``, the best plan as a file :func:`hetcoll.torch.parallelize` runs. A thin shell over
:mod:`hetcoll.model`."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Mapping
from typing import Any

from hetcoll.cli.arguments import (
    MAX_UNITS,
    integer,
    nonempty_path,
    plot_file,
    shown,
    strict_json,
    writable_file,
    write_failed,
)
from hetcoll.cli.model import (
    CLASSES_HELP,
    MAX_CLASSES,
    MODEL_HELP,
    add_input,
    add_precision,
    build_model,
    fmt_s,
    input_dtype,
    input_loss,
    input_spec,
    shares_text,
)


def _load(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    from hetcoll.model import layer_costs, load_cluster

    cluster = load_cluster(args.cluster)  # first: a bad file fails before the model is costed
    model = build_model(args)
    costs = layer_costs(
        model,
        input_spec(args),
        dtype=input_dtype(args),
        loss=input_loss(args),
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
    samples and its stages' ranks and layers, then how its experts are placed."""
    parts: list[str] = []
    ranks: list[int] = []
    samples: list[int] = []

    def flush() -> None:
        if ranks:
            parts.append(
                f"whole model on {_ranks_text(ranks)} ({shares_text(samples, limit=4)} samples)"
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
    if plan.experts is not None:  # whole experts per replica, in replica order
        per_layer = plan.experts.values() if isinstance(plan.experts, Mapping) else [plan.experts]
        placed = sorted(
            {
                ":".join(
                    str(h) if isinstance(h, int) else "[" + ",".join(map(str, h)) + "]"
                    for h in held
                )
                for held in per_layer
            }
        )
        which = "each experts layer" if len(placed) == 1 else "the experts layers"
        parts.append(f"experts per replica {', '.join(placed)} ({which})")
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
            one = unit.removesuffix("s") if sh[0] == 1 else unit  # "1 layer", "2 layers"
            what = f"{sh[0]} {one}" + (" each" if len(sh) > 1 or len(names) > 1 else "")
        else:
            what = f"{unit} {shares_text(list(sh))}"
        lines.append(f"    {where} ({devices}), {ranks}: {what}")
    return lines


def _shown_shares(best: Any, devices: int) -> list[int]:
    """The best plan's shares per device as printed: a pipeline's in the plan's (top-level)
    layers, as its plan line names them, not in the costed layers it was priced by (a decoder
    block is a dozen of those)."""
    if best.share_unit != "layers" or best.plan is None:
        return list(best.shares)
    held = [0] * devices
    for replica in best.plan.replicas:
        for stage in replica.stages:
            for r in stage.ranks:
                held[r] += stage.layers[1] - stage.layers[0]
    return held


def _left_out_text(cluster: Any, shares: list[int]) -> str:
    """The devices a plan leaves out, by kind: "2 x cpu (ranks 16-17)"."""
    kinds: dict[str, list[int]] = {}
    for r, (d, s) in enumerate(zip(cluster.devices, shares)):
        if s == 0:
            kinds.setdefault(d.name, []).append(r)
    return ", ".join(f"{len(rs)} x {k} ({_ranks_text(rs)})" for k, rs in kinds.items())


def _script(costs: Any) -> str:
    """The example that runs a plan of this model: the language-model one for token inputs."""
    tokens = any(x.dtype.startswith(("int", "uint")) for x in getattr(costs, "inputs", ()))
    return "examples/train_lm.py" if tokens else "examples/train_plan.py"


def _plan_of(pred: Any) -> Any:
    """``pred``'s plan, or None where the runtime cannot run it (``pred.plan_note`` says
    why)."""
    try:
        return pred.to_plan()
    except ValueError as e:
        if not pred.plan_note:
            pred.plan_note = str(e)
        return None


def _run_commands(best: Any, path: str, cluster: Any, script: str) -> list[str]:
    """How to run the plan of ``best`` written to ``path`` with ``script``: rank r
    is device r of the cluster file; a plan on a subset of the devices runs on the ranks up to
    the subset's last (those the planner predicted it with), the others are not started."""
    devices = best.detail.get("devices")
    world = max(devices) + 1 if devices else cluster.num_devices
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
            f"{r['load_balance']:>13.3f} {fmt_s(r['step_s']):>12}"
        )
    lines.append(
        "  (MB/step: bytes sent per step, all devices; load balance: slowest device's work "
        "time over the ideal, 1.0 is perfect)"
    )
    return lines


#: The longest ``--expert-loads`` file read: a thousand layers of a thousand experts, each
#: count in up to 15 characters.
MAX_LOADS_BYTES = 16 * 2**20


def _read_expert_loads(path: str | None) -> dict[str, Any] | None:
    """The ``--expert-loads`` file (a JSON object: each experts module's routed tokens per
    expert), read and checked for what needs no model (before the model is costed, so that a
    bad file fails at once)."""
    from hetcoll.model.files import read_small_file

    if path is None:
        return None
    data = read_small_file(path, "--expert-loads: a JSON file", MAX_LOADS_BYTES)
    try:
        loads = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"--expert-loads: cannot read {shown(path)} as JSON ({e})") from None
    # What the library's check lets through from a file: null (no loads, as None means in
    # code), and booleans (Python's ints) as counts.
    if not isinstance(loads, dict):
        raise ValueError(
            f"--expert-loads: {shown(path)} must hold a JSON object mapping experts module "
            f"paths to token counts, got {_json_type(loads)}"
        )
    for module, counts in loads.items():
        for count in counts if isinstance(counts, list) else [counts]:
            if isinstance(count, bool) or not isinstance(count, (int, float)):
                raise ValueError(
                    f"--expert-loads: {shown(path)}: {shown(module)}: token counts must be "
                    f"numbers, got {_json_type(count)} {_json_shown(count)}"
                )
    return loads


def _expert_loads(loads: dict[str, Any] | None, costs: Any) -> dict[str, Any] | None:
    """``--expert-loads`` (as :func:`_read_expert_loads` read it) checked against the model's
    experts layers."""
    from hetcoll.model import predict

    return predict.checked_loads(costs, loads, "--expert-loads")


def _json_type(value: Any) -> str:
    """What JSON calls ``value``'s type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def _json_shown(value: Any) -> str:
    """``value`` as its JSON text (``true``, ``null``), cut to a message's length."""
    return shown(value) if isinstance(value, (str, list, dict)) else json.dumps(value)


def _ratio(x: float) -> str:
    """``1.50x``; compact where fixed point would print hundreds of digits."""
    return f"{x:.2f}x" if x < 1e6 else f"{x:.3g}x"


def _plot(option: str, png: str, draw: Any) -> None:
    """``draw(png)``, a write that fails one line naming ``option``."""
    try:
        draw(png)
    except OSError as e:
        raise write_failed(option, png, e) from None


def _cmd_plan(args: argparse.Namespace) -> int:
    from hetcoll.model import plan, sweep
    from hetcoll.model.planner import SearchReport, explain, plot_plans, plot_sweep

    if args.sweep and args.out is not None:
        raise ValueError("--out: writes the best plan of one planning run, not of a sweep")
    # --sweep's default plot goes to the working directory: checked before any work.
    png: str = args.plot or f"hetcoll-sweep-{args.sweep}.png"
    if args.sweep and args.plot is None:
        try:
            writable_file(png)
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"--plot: {e} (the default with --sweep)") from None
    loads_read = _read_expert_loads(args.expert_loads)
    costs, cluster, model = _load(args)
    loads = _expert_loads(loads_read, costs)
    if args.sweep:
        points = sweep(costs, cluster, args.batch, args.sweep, expert_loads=loads)
        families = sorted({f for pt in points for f in pt.best})
        if args.json:
            print(
                strict_json(
                    {
                        "axis": args.sweep,
                        "points": [
                            {"value": pt.value, **{f: p.to_json() for f, p in pt.best.items()}}
                            for pt in points
                        ],
                    }
                )
            )
        else:
            print(f"predicted samples/s, best plan of each strategy, along {args.sweep}")
            print(f"{args.sweep:>10} " + " ".join(f"{f[:26]:>26}" for f in families))
            for pt in points:
                cells = [
                    f"{pt.best[f].samples_per_s:>26.4g}" if f in pt.best else f"{'-':>26}"
                    for f in families
                ]
                print(f"{pt.value:>10g} " + " ".join(cells))
        title = f"{args.model} on {cluster.source}, batch {args.batch}"
        _plot("--plot", png, lambda to: plot_sweep(points, args.sweep, to, title))
        if not args.json:
            print(f"plot: {png}")
        return 0
    t0 = time.perf_counter()
    report = SearchReport()
    ranked = plan(costs, cluster, args.batch, model=model, report=report, expert_loads=loads)
    planning_s = time.perf_counter() - t0
    # The plan to write: the best's, or, where the runtime cannot run the best (a model whose
    # blocks it cannot order, say), the best one it can run.
    written = next((p for p in ranked if p.feasible and _plan_of(p) is not None), ranked[0])
    if args.out is not None:
        if not written.feasible:
            raise ValueError(f"--out: no feasible plan ({written.reason})")
        to_write = written.to_plan()  # ValueError (exit 2) saying why there is none
        try:
            to_write.save(args.out)
        except OSError as e:
            raise write_failed("--out", args.out, e) from None
    if args.plot is not None:
        title = (
            f"{args.model} on {cluster.num_devices} devices, batch {args.batch}: "
            "predicted step by plan"
        )
        _plot("--plot", args.plot, lambda to: plot_plans(ranked, to, title))
    why = explain(ranked[0], cluster)
    if args.json:
        # Every candidate with its figures; the plans themselves, and on clusters of more than
        # 64 devices the figures of every device, for the shown ones (the best and the
        # runners-up --top lists): a plan of 10,240 replicas is large.
        print(
            strict_json(
                {
                    "model": args.model,
                    "inputs": [x.to_json() for x in costs.inputs],
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
                    **({"expert_loads": args.expert_loads} if args.expert_loads else {}),
                    **({"plot": args.plot} if args.plot else {}),
                }
            )
        )
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
    if loads:
        print(
            f"expert loads: {args.expert_loads} ({len(loads)} of {len(costs.experts)} experts "
            "layers): expert-parallel plans place their experts by them, and every plan holding "
            "experts is priced at them"
        )
    if not best.feasible:
        print(f"no feasible plan: {best.reason}")
    print(
        f"best: {best.strategy}: {fmt_s(best.step_s)} per step, {best.samples_per_s:.4g} samples/s"
    )
    print(f"  {best.share_unit} per device:")
    for line in _device_lines(cluster, _shown_shares(best, cluster.num_devices), best.share_unit):
        print(line)
    if best.feasible and not all(best.shares):
        everyone = next((p for p in ranked if p.feasible and all(p.shares)), None)
        versus = (
            f": {_ratio(everyone.step_s / best.step_s)} faster than the best plan on all "
            f"{cluster.num_devices} ({everyone.strategy}, {fmt_s(everyone.step_s)})"
            if everyone is not None
            else ""
        )
        print(f"  leaves out {_left_out_text(cluster, best.shares)}{versus}")
    if best.plan is not None:
        print(f"  plan: {_plan_text(best.plan)}")
    print("  breakdown: " + ", ".join(f"{k} {fmt_s(v)}" for k, v in best.breakdown.items()))
    print(f"  bottleneck: {why['text']}")
    print(f"  memory per device: up to {max(best.memory_bytes) / 1e9:.3g} GB")
    print("runners-up:")
    shown = ranked[1 : 1 + args.top]
    width = max([32, *(len(p.strategy) for p in shown)])
    for p in shown:
        mark = f"  [{explain(p, cluster)['term']}]" if p.feasible else f"  INFEASIBLE: {p.reason}"
        ratio = p.step_s / best.step_s if best.step_s > 0 else float("inf")
        print(f"  {p.strategy:<{width}} {fmt_s(p.step_s):>12}  ({_ratio(ratio)}){mark}")
    if report.placement_comparison is not None:
        for line in _comparison_lines(report.placement_comparison):
            print(line)
    for family, reason in report.skipped.items():
        print(f"not searched: {family}: {reason}")
    if args.plot:
        print(f"plot: {args.plot}")
    if written is not best and written.plan is not None:
        print(
            f"the runtime cannot run the best ({best.plan_note}); the best it can run: "
            f"{written.strategy}: {fmt_s(written.step_s)} per step "
            f"({_ratio(written.step_s / best.step_s)} the best's)"
        )
        print(f"  plan: {_plan_text(written.plan)}")
    if written.feasible and written.plan is not None:
        path = args.out or "PLAN.json"
        if args.out:
            print(f"wrote {args.out}; run it (rank r on device r as listed above) with")
        else:
            print("write it with --out PLAN.json, then run it (rank r on device r above) with")
        script = _script(costs)
        for command in _run_commands(written, path, cluster, script):
            print(f"  {command}")
        config = args.model.removeprefix("hf:")
        must = (
            f"return hetcoll.model.networks.hugging_face({config!r})\n  with your weights loaded"
            if config != args.model
            else f"build {args.model}"
        )
        print(
            f"  ({script} is in hetcoll's repository: its make_model must {must}; or call "
            "hetcoll.torch.parallelize in your own script)"
        )
    elif best.feasible:
        print(f"no plan file for this model: {best.plan_note}")
    return 0


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
    p.add_argument("--model", required=True, help=MODEL_HELP)
    add_input(p)
    p.add_argument(
        "--cluster",
        type=nonempty_path,
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
    p.add_argument("--classes", type=integer(1, MAX_CLASSES), default=10, help=CLASSES_HELP)
    p.add_argument(
        "--expert-loads",
        metavar="LOADS.json",
        type=nonempty_path,
        help="a mixture of experts' measured loads: a JSON object of each experts module's "
        "routed tokens per expert (hetcoll.torch.expert_loads, examples/train_lm.py "
        "--save-expert-loads); expert-parallel plans place the experts by them",
    )
    p.add_argument(
        "--conv-algorithm",
        choices=("implicit-gemm", "im2col"),
        default="implicit-gemm",
        help="how convolutions move memory: implicit-gemm as PyTorch's oneDNN/cuDNN kernels "
        "(default), im2col as PyDTNN's",
    )
    add_precision(p)
    p.add_argument(
        "--sweep",
        choices=("batch", "flops", "mem_bw", "link_bw", "nodes"),
        help="instead of one plan, the best plan of each strategy as one thing varies: the "
        "batch, devices' FLOP/s or memory bandwidth, links' bandwidth, or the number of nodes "
        "(a table and a plot)",
    )
    p.add_argument(
        "--plot",
        type=plot_file,
        help="write a plot to this file, in the format its extension names (.png, .svg, .pdf, "
        "...): predicted step time of the best plans, one bar each (with --sweep: the sweep's "
        "plot; default hetcoll-sweep-AXIS.png)",
    )
    p.add_argument(
        "--top", type=integer(0), default=5, help="how many runners-up to list (default 5)"
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print JSON instead of text (strict JSON: an infeasible plan's infinite step "
        "time is null)",
    )
    p.add_argument(
        "--out",
        metavar="PLAN.json",
        type=writable_file,
        help="write the best plan to this file, for examples/train_plan.py or "
        "hetcoll.torch.parallelize to run",
    )
    p.set_defaults(func=_cmd_plan)
