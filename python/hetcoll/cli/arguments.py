"""How the ``hetcoll`` command meets bad input: argument types that refuse a bad flag while the
command line is parsed, and a parser whose errors are one line on stderr and exit status 2.

Every subcommand's parser is a :class:`Parser` (``add_subparsers`` makes its children of the
parent's class), so argparse's own errors (a missing flag, an unknown choice) and the types'
errors read alike: ``hetcoll plan: error: argument --batch: must be an integer >= 1, got '0'``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from hetcoll.model.terms import MAX_SAMPLES

# The largest batch or split the command accepts: the performance model's.
MAX_UNITS = MAX_SAMPLES


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr (no usage block), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def integer(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``[minimum, maximum]``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {text!r}")
        return value

    return parse


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def floats(text: str) -> list[float]:
    """An argparse ``type``: comma-separated numbers (their range is the library's to check)."""
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None


def ints(text: str) -> list[int]:
    """An argparse ``type``: comma-separated integers."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def writable_file(text: str) -> str:
    """An argparse ``type``: a file path the command can create or overwrite, checked before
    any work starts (a plot or plan written after a minute of work should not fail then)."""
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, expected a file path")
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: no directory {parent!r}")
    if not os.access(parent, os.W_OK) or (os.path.exists(text) and not os.access(text, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: permission denied")
    return text


def end_quietly_on_broken_pipe() -> int:
    """What a command does when its reader went away (``hetcoll plan --json | head``): the
    standard recipe, stdout pointed at /dev/null so that the interpreter's final flush does
    not raise again, and exit status 1 (no traceback)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 1
