"""``hetcoll model {costs,calibrate,validate}``: thin shells over :mod:`hetcoll.model`, and over
the lab's :mod:`hetcoll.lab.calibrate` and :mod:`hetcoll.lab.validate` (imported when those
commands run); and what ``hetcoll plan`` (:mod:`hetcoll.cli.plan`) shares with them: the
``--model``/``--input``/``--classes``/``--precision`` flags, the model they build, and how
seconds and shares print."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from hetcoll.cli.arguments import (
    CommandFailed,
    integer,
    nonempty_path,
    shown,
    strict_json,
    writable_file,
    write_failed,
)

#: The most classes ``--classes`` takes: a built-in model's last layer, sized by torch's int64
#: but costed per class, so a bound far past any dataset's.
MAX_CLASSES = 2**31 - 1


def fmt_s(x: float) -> str:
    if x != x or x == float("inf"):
        return "inf"
    if x >= 1e6:  # fixed point would print up to 300 digits
        return f"{x:.3g} s"
    if x >= 1:
        return f"{x:.3f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.3f} ms"
    return f"{x * 1e6:.1f} us"


def shares_text(shares: list[int], limit: int = 16) -> str:
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
    from hetcoll.model import layer_costs

    return layer_costs(
        build_model(args),
        input_spec(args),
        dtype=input_dtype(args),
        loss=input_loss(args),
        **kwargs,
    )


def input_spec(args: argparse.Namespace) -> Any:
    """``--input`` as ``layer_costs``' ``inputs``: one sample's shape (the forward's one
    positional input), or ``NAME=SHAPE,NAME=SHAPE`` keyword inputs (``{name: shape}``), each
    of ``--dtype`` or of its own, ``NAME=SHAPE:DTYPE`` (``{name: (shape, dtype)}``: Whisper's
    float features beside its int64 decoder ids)."""
    from hetcoll.model import parse_shape
    from hetcoll.model.costs.inputs import dtype_of

    text = args.input
    if "=" not in text:
        return parse_shape(text)
    out: dict[str, Any] = {}
    for part in text.split(","):
        name, sep, spec = (x.strip() for x in part.partition("="))
        if not sep or not name.isidentifier() or name in out:
            raise ValueError(
                "--input: keyword inputs are NAME=SHAPE (or NAME=SHAPE:DTYPE) pairs, "
                "comma-separated, each name once (input_ids=512,attention_mask=512, "
                f"input_features=80x3000:float32,decoder_input_ids=8:int64), got {shown(text)}"
            )
        shape, colon, dtype = spec.partition(":")
        try:
            out[name] = (parse_shape(shape), dtype_of(dtype)) if colon else parse_shape(shape)
        except ValueError as e:
            raise ValueError(f"--input: {name}: {e}") from None
    return out


def input_dtype(args: argparse.Namespace) -> Any:
    """``--dtype`` as a torch dtype."""
    from hetcoll.model.costs.inputs import dtype_of

    return dtype_of(args.dtype)


def build_model(args: argparse.Namespace) -> Any:
    """``--model`` built on the meta device (shapes only: a model too large for this machine's
    memory is costed, not built)."""
    from hetcoll.model import networks

    spec = input_spec(args)
    shape = next(iter(spec.values())) if isinstance(spec, dict) else spec
    if isinstance(shape, tuple) and shape and isinstance(shape[0], tuple):
        shape = shape[0]  # NAME=SHAPE:DTYPE
    if ":" in args.model and "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # module:attr finds the working directory's modules,
        # as `python -m` does (the `hetcoll` script's own directory comes first otherwise)
    return networks.build(args.model, shape, args.classes, device="meta")


MODEL_HELP = (
    "the model: a built-in (cnn, vgg, resnet, mlp); hf:PATH, a Hugging Face model built from "
    "its config (PATH: a config.json, or a directory holding one, as on the Hub; no weights "
    "or download needed, no remote code run); or MODULE:ATTR, where ATTR is an "
    "nn.Module subclass or a function annotated '-> nn.Module' taking no arguments "
    "(e.g. torchvision.models:resnet18 or mymodels:Net, found in the working directory); "
    "nothing else is called"
)
INPUT_HELP = (
    "the shape of one sample, without the batch: e.g. 3x32x32 (an image, channels first) or "
    "512 (a sequence of 512 token ids, with --dtype int64); or the forward's keyword inputs, "
    "NAME=SHAPE,...: input_ids=512,attention_mask=512 (a Hugging Face language model given "
    "its attention mask is costed on the meta device in a second; given token ids alone, its "
    "mask code reads their values, and the costs are counted on the CPU, a real run of a "
    "thousand samples); NAME=SHAPE:DTYPE gives one input a dtype of its own "
    "(input_features=80x3000:float32,decoder_input_ids=8:int64)"
)
#: The dtypes ``--dtype`` offers (torch's names).
INPUT_DTYPES = ("float32", "float64", "bfloat16", "float16", "int64", "int32")
DTYPE_HELP = (
    "the input's dtype: float32 (default) for images and features, int64 or int32 for token "
    "ids (the model's forward takes them as its one positional input, e.g. input_ids)"
)


LOSS_HELP = (
    "the loss each step ends with, costed after the model's last layer: none (default) or "
    "cross-entropy (of the output's logits, classes last; a language model's loss over its "
    "vocabulary costs more than its blocks at a vocabulary of thousands)"
)


def add_input(p: argparse.ArgumentParser) -> None:
    """The ``--input``, ``--dtype`` and ``--loss`` flags."""
    from hetcoll.model.costs.records import LOSSES

    p.add_argument("--input", required=True, help=INPUT_HELP)
    p.add_argument("--dtype", choices=INPUT_DTYPES, default="float32", help=DTYPE_HELP)
    p.add_argument("--loss", choices=("none", *LOSSES), default="none", help=LOSS_HELP)


def input_loss(args: argparse.Namespace) -> str | None:
    """``--loss`` as ``layer_costs``' ``loss``."""
    return None if args.loss == "none" else str(args.loss)


CLASSES_HELP = f"number of classes of the built-in models (default 10, at most {MAX_CLASSES:,})"


def add_precision(p: argparse.ArgumentParser) -> None:
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
        print(
            strict_json(
                {
                    "model": args.model,
                    "input": list(costs.input_shape),
                    "dtype": args.dtype,
                    "inputs": [x.to_json() for x in costs.inputs],
                    "precision": costs.precision,
                    "loss": costs.loss or None,
                    "params": costs.params,
                    "forward_flops": costs.forward_flops(1),
                    "backward_flops": costs.backward_flops(1),
                    "elementwise_forward_flops": costs.elementwise_flops(1)[0],
                    "elementwise_backward_flops": costs.elementwise_flops(1)[1],
                    "layers": [
                        {
                            "name": x.name,
                            "kind": x.kind,
                            "params": x.params,
                            "forward_flops_per_sample": x.forward_flops(1),
                            "backward_flops_per_sample": x.backward_flops(1),
                            "elementwise_flops_per_sample": list(x.elementwise_flops_per_sample),
                            "activation_bytes_per_sample": x.out_bytes_per_sample,
                            "gradient_bytes": x.gradient_bytes,
                        }
                        for x in costs.layers
                    ],
                    "notes": list(costs.notes),
                }
            )
        )
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
        return 0
    try:
        with open(args.output, "w") as f:
            f.write(text)
    except OSError as e:
        # The measurement took minutes: print it rather than lose it, then fail.
        sys.stdout.write(text)
        raise CommandFailed(
            f"{write_failed('--output', args.output, e)} (the file is printed instead)"
        ) from None
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
                f"{strategy:>13} {r.ranks:>5} {r.batch:>5} {shares_text(r.shares):>14}"
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
        print(
            strict_json(
                {
                    "results": [row_of(r) for r in results],
                    "repeat": args.repeat,
                    "median_abs_error": summary(results)[0],
                    "worst_abs_error": summary(results)[1],
                    "noise_rows": len(results) - len(signal),
                    "worst_abs_error_beyond_noise": max(
                        (abs(r.error) for r in signal), default=0.0
                    ),
                    "by_strategy": {
                        s: {"median_abs_error": med, "worst_abs_error": worst}
                        for s, (med, worst) in errors.items()
                    },
                },
                measured=True,  # a NaN is a measurement's (an error over a 0 s step)
            )
        )
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
                    f"{r.strategy:>13} {r.ranks:>5} {r.batch:>5} {shares_text(r.shares):>14}"
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
    from hetcoll.model.hardware import MAX_DEVICES

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
    c.add_argument("--model", required=True, help=MODEL_HELP)
    add_input(c)
    c.add_argument("--classes", type=integer(1, MAX_CLASSES), default=10, help=CLASSES_HELP)
    add_precision(c)
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
        help="the file to write (default -: print it); if the write fails, the file is printed",
    )
    k.add_argument(
        "--ranks",
        type=integer(1, MAX_DEVICES),
        help="how many ranks the node runs (default: one per core); that many measure the "
        "device side by side (at most one per core) and the file keeps the slowest's figures "
        f"(at most {MAX_DEVICES:,}, a node's most devices)",
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
        "--cluster",
        type=nonempty_path,
        help="a calibration file to predict with (default: measure this machine now)",
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
