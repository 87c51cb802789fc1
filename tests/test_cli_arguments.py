"""The ``hetcoll`` command's bad input and failed output, in this process: a bad flag ends in
one line on stderr naming it and exit status 2 (the demo's before any rank starts), a write
that fails in one line naming the flag and exit status 1, never a traceback, a hang or a
silently ignored value; ``--json`` is strict JSON. The models are cheap (a CNN on 1x8x8) and
nothing trains."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from hetcoll.cli import main
from hetcoll.cli.arguments import CommandFailed, strict_json
from hetcoll.cli.model import fmt_s
from hetcoll.model.hardware import MAX_DEVICES

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "python"), "OMP_NUM_THREADS": "1"}

CLUSTER = """\
[devices.d]
flops_per_s = 1e12
mem_bytes_per_s = 1e11
memory_bytes = {memory}

[links.l]
latency_s = 1e-5
bytes_per_s = 1e10

[[nodes]]
name = "n"
device = "d"
count = 2
link = "l"
"""


def cluster(tmp_path: Path, memory: str = "1e10") -> str:
    """A cluster file of one node of 2 devices of ``memory`` bytes each."""
    path = tmp_path / "cluster.toml"
    path.write_text(CLUSTER.format(memory=memory))
    return str(path)


def plan_argv(tmp_path: Path, *more: str) -> list[str]:
    model = ["--model", "cnn", "--input", "1x8x8", "--batch", "8"]
    return ["plan", *model, "--cluster", cluster(tmp_path), *more]


def fails(capsys: pytest.CaptureFixture[str], argv: list[str], status: int) -> str:
    """The one stderr line of ``hetcoll ARGV``, which must exit with ``status``."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == status, capsys.readouterr().err
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("hetcoll "), lines[0]
    return lines[0]


def dev_full_link(tmp_path: Path, name: str) -> str:
    """A file name in ``tmp_path`` whose writes fail (a link to /dev/full: a full disk)."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    link = tmp_path / name
    link.symlink_to("/dev/full")
    return str(link)


def strict(text: str) -> Any:
    """``text`` read as strict JSON (Python's reader takes NaN and Infinity otherwise)."""

    def refuse(constant: str) -> None:
        raise AssertionError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


# Rows 1, 2: strict JSON.


def test_plan_json_writes_an_infeasible_plans_step_as_null(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny = cluster(tmp_path, memory="1e3")  # no plan fits
    argv = ["plan", "--model", "cnn", "--input", "1x8x8", "--batch", "8", "--cluster", tiny]
    assert main([*argv, "--json"]) == 0
    plans = strict(capsys.readouterr().out)["plans"]
    assert not any(p["feasible"] for p in plans)
    assert any(p["step_s"] is None for p in plans)  # an infinite step (Infinity was written)


def test_strict_json_refuses_nan_by_where_it_is() -> None:
    assert strict_json({"a": [1.0, float("inf"), -float("inf")]}) == '{"a": [1.0, null, null]}'
    with pytest.raises(CommandFailed, match=r"plans\[0\]\.step_s is NaN"):
        strict_json({"plans": [{"step_s": float("nan")}]})
    # In measurements (the demo's report) a NaN is data: a diverged loss.
    assert strict_json({"loss": float("nan")}, measured=True) == '{"loss": null}'


# Rows 4, 5, 6, 22, 23, 28: bounds checked while the command line is parsed (the demo's before
# any rank starts: the conftest refuses ranks here).

BOUNDS = [
    (["demo", "--no-progress", "--speeds", "1,1e-9", "--epochs", "1"], "--speeds", "[0.001, 1]"),
    (["demo", "--no-progress", "--speeds", "1,1e-300", "--epochs", "1"], "--speeds", "1e-300"),
    (["demo", "--speeds", "1,nan"], "--speeds", "[0.001, 1]"),
    (["demo", "--seed", "9" * 23], "--seed", f"at most {2**63 - 1}"),
    (["demo", "--seed", "-1"], "--seed", ">= 0"),
    (["demo", "--epochs", "9" * 23], "--epochs", "at most 1000000"),
    (["model", "calibrate", "--ranks", "9" * 23], "--ranks", f"at most {MAX_DEVICES}"),
    (["model", "calibrate", "--ranks", str(MAX_DEVICES + 1)], "--ranks", f"at most {MAX_DEVICES}"),
    (
        ["model", "costs", "--model", "cnn", "--input", "1x8x8", "--classes", "9" * 23],
        "--classes",
        f"at most {2**31 - 1}",
    ),
]


@pytest.mark.parametrize(("argv", "option", "words"), BOUNDS, ids=lambda x: str(x)[:50])
def test_out_of_range_flags_are_refused_while_parsing(
    capsys: pytest.CaptureFixture[str], argv: list[str], option: str, words: str
) -> None:
    line = fails(capsys, argv, 2)
    assert f"error: argument {option}: " in line and words in line, line


def test_plan_classes_are_bounded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = fails(capsys, plan_argv(tmp_path, "--classes", str(2**31)), 2)
    assert "argument --classes: must be at most" in line


# Rows 10, 20, 21, 35: empty paths.

EMPTY = [
    (["model", "calibrate", "-o", ""], "--output/-o"),
    (["model", "validate", "--cluster", ""], "--cluster"),
    (["plan", "--model", "cnn", "--input", "1x8x8", "--batch", "8", "--cluster", ""], "--cluster"),
]


@pytest.mark.parametrize(("argv", "option"), EMPTY, ids=lambda x: str(x)[:50])
def test_empty_paths_are_refused(
    capsys: pytest.CaptureFixture[str], argv: list[str], option: str
) -> None:
    assert fails(capsys, argv, 2).endswith(f"error: argument {option}: empty path")


@pytest.mark.parametrize("option", ["--out", "--plot", "--expert-loads"])
def test_plan_empty_paths_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str
) -> None:
    line = fails(capsys, plan_argv(tmp_path, option, ""), 2)
    assert line.endswith(f"error: argument {option}: empty path"), line


# Rows 16, 17, 26: a plot's format, from its extension, at parse time.


@pytest.mark.parametrize("name", ["noext", "out.txt", "/dev/full"])
def test_plot_needs_an_extension_matplotlib_writes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    line = fails(capsys, plan_argv(tmp_path, "--plot", str(tmp_path / name)), 2)
    assert "argument --plot: expected a file name ending in .png, .svg, .pdf" in line, line


def test_plot_is_written_where_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    svg = tmp_path / "plans.SVG"  # the extension in any case
    assert main(plan_argv(tmp_path, "--plot", str(svg))) == 0
    assert f"plot: {svg}" in capsys.readouterr().out
    assert svg.read_bytes().lstrip().startswith(b"<?xml")


# Rows 7, 8, 9, 11: writes that fail after the work, one line naming the flag, exit 1.


@pytest.mark.parametrize(("option", "name"), [("--out", "p.json"), ("--plot", "p.png")])
def test_plan_writes_that_fail_name_their_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, name: str
) -> None:
    full = dev_full_link(tmp_path, name)
    line = fails(capsys, plan_argv(tmp_path, option, full), 1)
    assert line == f"hetcoll plan: error: {option}: cannot write {full!r}: No space left on device"


def test_sweep_default_plot_is_checked_first_and_its_write_failure_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hetcoll-sweep-nodes.png").mkdir()
    line = fails(capsys, plan_argv(tmp_path, "--sweep", "nodes"), 2)
    assert "error: --plot: 'hetcoll-sweep-nodes.png' is a directory" in line, line
    assert "(the default with --sweep)" in line
    dev_full_link(tmp_path, "hetcoll-sweep-batch.png")
    line = fails(capsys, plan_argv(tmp_path, "--sweep", "batch"), 1)
    assert "error: --plot: cannot write 'hetcoll-sweep-batch.png': No space left" in line, line


def test_calibrate_prints_its_file_when_the_write_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import hetcoll.lab.calibrate

    class Measured:
        def to_toml(self) -> str:
            return "# measured\n"

    monkeypatch.setattr(hetcoll.lab.calibrate, "calibrate", lambda **_: Measured())
    full = dev_full_link(tmp_path, "c.toml")
    with pytest.raises(SystemExit) as e:
        main(["model", "calibrate", "-o", full, "--links", "gloo"])
    assert e.value.code == 1
    out, err = capsys.readouterr()
    assert out == "# measured\n"
    assert err.splitlines() == [
        f"hetcoll model calibrate: error: --output: cannot write {full!r}: No space left on "
        "device (the file is printed instead)"
    ]


# Row 15: stdout that fails.


class FullStdout:
    """A stdout on a full disk."""

    def write(self, text: str) -> int:
        raise OSError(28, "No space left on device")

    def flush(self) -> None:
        raise OSError(28, "No space left on device")


def test_stdout_that_fails_is_one_line_and_status_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stdout", FullStdout())
    line = fails(capsys, ["split", "10", "--speeds", "1,2"], 1)
    assert line == "hetcoll split: error: cannot write to stdout: No space left on device"
    monkeypatch.setattr(sys, "stdout", None)
    assert fails(capsys, ["split", "10", "--speeds", "1,2"], 1).endswith("stdout is closed")


@pytest.mark.parametrize(("redirect", "why"), [(">/dev/full", "No space left"), (">&-", "closed")])
def test_stdout_that_fails_in_a_real_process(redirect: str, why: str) -> None:
    """Including the interpreter's final flush of what was never written."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    run = subprocess.run(
        f"{sys.executable} -m hetcoll.cli split 10 --speeds 1,2 --json {redirect}",
        shell=True,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1
    assert len(run.stderr.splitlines()) == 1 and why in run.stderr, run.stderr


# Rows 18, 19, 33: --expert-loads, checked before the model is costed.


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("null", "must hold a JSON object mapping experts module paths to token counts, got null"),
        ("[1, 2]", "got an array"),
        (
            '{"m.experts": [true, false, 1]}',
            "'m.experts': token counts must be numbers, got a boolean true",
        ),
        ('{"m.experts": true}', "got a boolean true"),
        ('{"m.experts": [1, "x"]}', "got a string 'x'"),
    ],
)
def test_expert_loads_of_other_types_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, words: str
) -> None:
    loads = tmp_path / "loads.json"
    loads.write_text(content)
    line = fails(capsys, plan_argv(tmp_path, "--expert-loads", str(loads)), 2)
    assert line.startswith(f"hetcoll plan: error: --expert-loads: {str(loads)!r}"), line
    assert words in line, line


def test_huge_values_are_cut_in_messages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    loads = tmp_path / "loads.json"
    loads.write_text(json.dumps({"m.experts": [1, "x" * 3_000_000]}))
    line = fails(capsys, plan_argv(tmp_path, "--expert-loads", str(loads)), 2)
    assert "got a string 'xxx" in line and len(line) < 600, len(line)
    # The library's own message echoing a huge key (a CNN has no experts layer): cut too.
    loads.write_text(json.dumps({"k" * 3_000_000: [1]}))
    line = fails(capsys, plan_argv(tmp_path, "--expert-loads", str(loads)), 2)
    assert "is no experts layer" in line and len(line) < 1100, len(line)
    line = fails(capsys, ["split", "x" * 100_000, "--speeds", "1"], 2)
    assert "expected an integer" in line and len(line) < 300, len(line)


# Row 24: seconds past a million print compactly.


def test_huge_seconds_print_compactly() -> None:
    assert fmt_s(1e308) == "1e+308 s"
    assert fmt_s(2_000_000.0) == "2e+06 s"
    assert fmt_s(12.5) == "12.500 s"


# Rows 27, 30: a library warning does not make a one-line error several.


def test_warnings_of_a_failed_command_are_dropped(capsys: pytest.CaptureFixture[str]) -> None:
    # torch warns about zero-element tensors before the 1x1 input is refused: the warning
    # never leaves the command (a process would print it above the error).
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        line = fails(capsys, ["model", "costs", "--model", "cnn", "--input", "1x1x1"], 2)
    assert "Output size is too small" in line, line
    assert [str(w.message) for w in seen] == []


def test_warnings_of_a_command_that_succeeds_are_one_line_each() -> None:
    """Issued again after the command (once each, so that pytest.warns and -W see them), shown
    one line each in a process, not the source line and location of Python's format."""
    code = (
        "import sys, warnings, hetcoll\n"
        "split = hetcoll.split\n"
        "def warning_split(*args, **kwargs):\n"
        "    for _ in range(2):\n"
        "        warnings.warn('first line\\nsecond line', RuntimeWarning, stacklevel=1)\n"
        "    return split(*args, **kwargs)\n"
        "hetcoll.split = warning_split\n"
        "from hetcoll.cli import main\n"
        "sys.exit(main(['split', '10', '--speeds', '1,4', '--json']))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert strict(run.stdout)["shares"] == [2, 8]
    assert run.stderr.splitlines() == ["hetcoll split: warning: first line (RuntimeWarning)"]


# Row 34: python -m hetcoll.


def test_python_m_hetcoll_runs_the_command() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "hetcoll", "split", "10", "--speeds", "1,4", "--json"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert strict(run.stdout)["shares"] == [2, 8]
