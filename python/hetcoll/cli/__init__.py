"""The ``hetcoll`` command, the top layer: ``split``, ``demo``, ``plan`` and ``model``.

Each subcommand is a thin shell over the public API (or, for ``demo`` and ``model
calibrate/validate``, over the lab, :mod:`hetcoll.lab`, imported only when such a command runs);
nothing here computes anything the library does not expose.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import hetcoll
from hetcoll.cli.arguments import (
    MAX_UNITS,
    CommandFailed,
    GuardedStdout,
    Parser,
    StdoutFailed,
    end_quietly_on_broken_pipe,
    floats,
    integer,
    ints,
    shown,
    strict_json,
    write_failed,
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
        print(
            strict_json(
                {
                    "shares": shares,
                    "finish_seconds": finish,
                    "makespan_seconds": max(finish),
                    "even_shares": even,
                    "even_makespan_seconds": max(even_finish),
                }
            )
        )
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


#: The slowest emulated speed ``demo --speeds`` takes: a rank of speed s sleeps (1/s - 1) times
#: its compute, so 1e-3 makes a step of 10 ms one of 10 s (1e-9 slept for years, 1e-300
#: overflowed the sleep's deadline).
MIN_DEMO_SPEED = 1e-3
#: The most epochs ``demo --epochs`` runs (a bound on a mistyped count, far past any demo).
MAX_DEMO_EPOCHS = 10**6
#: ``demo --seed``'s range: torch generators and the sampler take seeds below 2**63.
MAX_DEMO_SEED = 2**63 - 1


def _demo_speeds(text: str) -> str:
    """An argparse ``type``: ``demo --speeds``, comma-separated speeds in
    ``[MIN_DEMO_SPEED, 1]``, kept as text (the demo's config reads it)."""
    try:
        speeds = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        speeds = []
    if not speeds:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {shown(text)}")
    for s in speeds:
        if not MIN_DEMO_SPEED <= s <= 1:  # also NaN
            raise argparse.ArgumentTypeError(
                f"each must be in [{MIN_DEMO_SPEED:g}, 1] (a rank of speed s sleeps (1/s - 1) "
                f"times its compute), got {s:g} in {shown(text)}"
            )
    return text


def _add_demo(sub: argparse._SubParsersAction) -> None:
    # The demo's options are torch-free; its training (the lab's hetcoll.lab.demo) is imported
    # when the command runs.
    from hetcoll.lab.demo_config import add_parser

    p = add_parser(sub)
    # Bounds the lab's parser leaves to the run (which starts ranks first): checked while the
    # command line is parsed, so a bad value fails before any rank starts.
    bounds = {
        "speeds": (
            _demo_speeds,
            "emulated speed of each rank as a fraction of real speed, each in "
            f"[{MIN_DEMO_SPEED:g}, 1]: a rank of speed s sleeps (1/s - 1) times its compute "
            "(default 1,0.25)",
        ),
        "epochs": (integer(1, MAX_DEMO_EPOCHS), f"epochs to train (1 to {MAX_DEMO_EPOCHS:,})"),
        "seed": (integer(0, MAX_DEMO_SEED), "the seed of the model and the shuffle (0 to 2**63-1)"),
    }
    for action in p._actions:
        if action.dest in bounds:
            action.type, action.help = bounds[action.dest]
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    from hetcoll.lab.demo import format_table, plot, run
    from hetcoll.lab.demo_config import config_from_args

    config = config_from_args(args)
    config.validate()
    try:  # before the training, so that a bad --out costs no minutes
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"out: cannot create the directory {shown(args.out)}: {e.strerror}"
        ) from None
    if not os.access(args.out, os.W_OK):
        raise ValueError(f"out: cannot write in {shown(args.out)}: permission denied")
    report = run(config)
    png = os.path.join(args.out, "demo.png")
    written = os.path.join(args.out, "demo.json")
    failed = None  # a write that failed: the report still prints, the training is not lost
    try:
        plot(report, png)
    except OSError as e:
        failed = write_failed("--out", png, e)
    if failed is None:
        try:
            with open(written, "w") as f:
                f.write(strict_json(report, indent=1, measured=True))
        except OSError as e:
            failed = write_failed("--out", written, e)
    if args.json:
        print(strict_json(report, measured=True))
    else:
        print(format_table(report))
        if failed is None:
            print(f"plot: {png}")
    if failed is not None:
        raise failed
    return 0


_SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_demo, _add_split]


def _add_model_commands(sub: argparse._SubParsersAction) -> None:
    # Imported on use: the model pulls in torch, which `hetcoll split` does not need.
    from hetcoll.cli.model import add_model
    from hetcoll.cli.plan import add_plan

    add_plan(sub)
    add_model(sub)


_SUBCOMMANDS.append(_add_model_commands)


#: The longest error line printed: a library message echoing a value of megabytes is cut in
#: its middle (its head says what is wrong, its tail often why).
MAX_LINE = 1000


def _one_line(message: str) -> str:
    """The first line of ``message`` (torch's own messages add a C++ stack after it), cut to
    :data:`MAX_LINE` characters."""
    first = message.splitlines()[0] if message.strip() else ""
    if len(first) > MAX_LINE:
        first = f"{first[: MAX_LINE * 2 // 3]} ... {first[-(MAX_LINE // 3) :]}"
    return first


def _warn_again(caught: list[warnings.WarningMessage], command: str) -> None:
    """Each distinct warning of ``caught`` issued again, shown on one line (``hetcoll plan:
    warning: ... (UserWarning)``) where nothing records it."""

    def one_line(message: Any, category: type[Warning], *_: Any, **__: Any) -> str:
        return f"hetcoll {command}: warning: {_one_line(str(message))} ({category.__name__})\n"

    seen = set()
    formatwarning = warnings.formatwarning
    warnings.formatwarning = one_line
    try:
        for w in caught:
            key = (w.category, _one_line(str(w.message)))
            if key not in seen:
                seen.add(key)
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    finally:
        warnings.formatwarning = formatwarning


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``hetcoll`` command. Bad input (a flag argparse or the library refuses with a
    ``ValueError``) ends in one line on stderr, ``hetcoll CMD: error: ...``, and exit status
    2; a failure the command explains (a write that failed) in one line and exit status 1;
    any other exception is a bug and keeps its traceback. Warnings the library raised are
    dropped where the command fails (its error says what matters) and shown one line each
    where it succeeds."""
    parser = Parser(
        prog="hetcoll",
        description="Balanced collective training on workers of unequal speed.",
    )
    parser.add_argument("--version", action="version", version=hetcoll.__version__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _SUBCOMMANDS:
        add(sub)
    args = parser.parse_args(argv)
    # The command as typed: `hetcoll model costs`, as argparse names it for a bad flag.
    command = " ".join(filter(None, (args.command, getattr(args, f"{args.command}_command", None))))

    def fail(status: int, message: str) -> NoReturn:
        parser.exit(status, f"hetcoll {command}: error: {_one_line(message)}\n")

    if sys.stdout is None:  # started with stdout closed (`>&-`): nowhere to print the result
        fail(1, "stdout is closed")
    stdout = sys.stdout
    sys.stdout = GuardedStdout(stdout)  # type: ignore[assignment]
    try:
        with warnings.catch_warnings(record=True) as caught:
            status = int(args.func(args))
            sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
        _warn_again(caught, command)
        return status
    except BrokenPipeError:
        return end_quietly_on_broken_pipe()
    except StdoutFailed as e:
        end_quietly_on_broken_pipe()  # the unwritten rest must not fail the final flush too
        fail(1, f"cannot write to stdout: {e}")
    except CommandFailed as e:
        fail(1, str(e))
    except (ValueError, OverflowError) as e:
        fail(2, str(e) or type(e).__name__)
    finally:
        sys.stdout = stdout


if __name__ == "__main__":
    sys.exit(main())
