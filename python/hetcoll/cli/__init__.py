"""The ``hetcoll`` command, the top layer: ``split``, ``demo``, ``plan`` and ``model``.

Each subcommand is a thin shell over the public API (or, for ``demo`` and ``model
calibrate/validate``, over the lab, :mod:`hetcoll.lab`, imported only when such a command runs);
nothing here computes anything the library does not expose.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence

import hetcoll
from hetcoll.cli.arguments import (
    MAX_UNITS,
    Parser,
    end_quietly_on_broken_pipe,
    floats,
    integer,
    ints,
)


def _cmd_split(args: argparse.Namespace) -> int:
    shares = hetcoll.split(
        args.total,
        args.speeds,
        latency=args.latency,
        capacity=args.capacity,
        multiple_of=args.multiple_of,
        minimum=args.minimum,
    )
    finish = hetcoll.finish_times(shares, args.speeds, latency=args.latency)
    # The even split is what a framework without balancing does: the comparison users ask for.
    p = len(args.speeds)
    even = [args.total // p + (1 if r < args.total % p else 0) for r in range(p)]
    even_finish = hetcoll.finish_times(even, args.speeds, latency=args.latency)
    if not all(math.isfinite(t) for t in (*finish, *even_finish)):
        # Units over a subnormal speed: seconds past float's range (and JSON has no Infinity).
        raise ValueError(
            "speeds: a finish time (of this split or of the even one it is compared with) "
            "exceeds 1.8e308 s, the largest float; give speeds in larger units (per "
            "millisecond, per batch)"
        )
    if args.json:
        json.dump(
            {
                "shares": shares,
                "finish_seconds": finish,
                "makespan_seconds": max(finish),
                "even_shares": even,
                "even_makespan_seconds": max(even_finish),
            },
            sys.stdout,
        )
        print()
        return 0
    print(f"{'rank':>4} {'speed':>12} {'share':>10} {'finish (s)':>12}")
    for r, (s, b, t) in enumerate(zip(args.speeds, shares, finish)):
        print(f"{r:>4} {s:>12.6g} {b:>10} {t:>12.6g}")
    print(
        f"makespan {max(finish):.6g} s; an even split would take {max(even_finish):.6g} s "
        f"({_ratio(max(even_finish) / max(finish))} longer)"
    )
    return 0


def _ratio(x: float) -> str:
    """``1.50x``; ``5e+300x`` where fixed point would print hundreds of digits; past float's
    range, ``more than 1.8e308x``."""
    if not math.isfinite(x):
        return "more than 1.8e308x"
    return f"{x:.2f}x" if x < 1e6 else f"{x:.3g}x"


def _add_split(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "split",
        help="integer shares that minimise the slowest rank's finish time",
        description="Split TOTAL units (samples, filters, bytes) over ranks of the given speeds "
        "so that the slowest rank finishes as early as possible. Exact.",
    )
    p.add_argument(
        "total", type=integer(1, MAX_UNITS), help="how many units to split (an integer >= 1)"
    )
    p.add_argument(
        "--speeds",
        type=floats,
        required=True,
        help="each rank's speed in units per second, comma-separated, e.g. 4,1,0.5",
    )
    p.add_argument("--latency", type=floats, help="each rank's start-up time in seconds")
    p.add_argument("--capacity", type=ints, help="the most units each rank can hold")
    p.add_argument(
        "--multiple-of", type=integer(1), default=1, help="make every share a multiple of this"
    )
    p.add_argument("--minimum", type=integer(0), default=0, help="the smallest share any rank gets")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_cmd_split)


def _add_demo(sub: argparse._SubParsersAction) -> None:
    # The demo's options are torch-free; its training (the lab's hetcoll.lab.demo) is imported
    # when the command runs.
    from hetcoll.lab.demo_config import add_parser

    add_parser(sub).set_defaults(func=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    from hetcoll.lab.demo import format_table, plot, run
    from hetcoll.lab.demo_config import config_from_args

    config = config_from_args(args)
    config.validate()
    try:  # before the training, so that a bad --out costs no minutes
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        raise ValueError(f"out: cannot create the directory {args.out!r}: {e.strerror}") from None
    if not os.access(args.out, os.W_OK):
        raise ValueError(f"out: cannot write in {args.out!r}: permission denied")
    report = run(config)
    png = os.path.join(args.out, "demo.png")
    plot(report, png)
    with open(os.path.join(args.out, "demo.json"), "w") as f:
        json.dump(report, f, indent=1)
    if args.json:
        json.dump(report, sys.stdout)
        print()
    else:
        print(format_table(report))
        print(f"plot: {png}")
    return 0


_SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_demo, _add_split]


def _add_model_commands(sub: argparse._SubParsersAction) -> None:
    # Imported on use: the model pulls in torch, which `hetcoll split` does not need.
    from hetcoll.cli.model import add_model
    from hetcoll.cli.plan import add_plan

    add_plan(sub)
    add_model(sub)


_SUBCOMMANDS.append(_add_model_commands)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``hetcoll`` command. Bad input (a flag argparse or the library refuses with a
    ``ValueError``) ends in one line on stderr, ``hetcoll CMD: error: ...``, and exit status
    2; any other exception is a bug and keeps its traceback."""
    parser = Parser(
        prog="hetcoll",
        description="Balanced collective training on workers of unequal speed.",
    )
    parser.add_argument("--version", action="version", version=hetcoll.__version__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _SUBCOMMANDS:
        add(sub)
    args = parser.parse_args(argv)
    try:
        status = int(args.func(args))
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
        return status
    except BrokenPipeError:
        return end_quietly_on_broken_pipe()
    except (ValueError, OverflowError) as e:
        # One line: the first of the message (torch's own messages add a C++ stack after it).
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        # The command as typed: `hetcoll model costs`, as argparse names it for a bad flag.
        command = " ".join(
            filter(None, (args.command, getattr(args, f"{args.command}_command", None)))
        )
        parser.exit(2, f"hetcoll {command}: error: {first}\n")


if __name__ == "__main__":
    sys.exit(main())
