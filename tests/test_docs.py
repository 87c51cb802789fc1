"""The README's and the docstrings' `>>>` examples run as written."""

import doctest
import importlib
from pathlib import Path

import pytest

import hetcoll
import hetcoll.collectives.speculative
import hetcoll.fusion
import hetcoll.kernels
import hetcoll.model.predict
import hetcoll.plan
import hetcoll.torch.sampler

ROOT = Path(__file__).resolve().parent.parent


def test_readme_examples():
    result = doctest.testfile(str(ROOT / "README.md"), module_relative=False)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize(
    "module",
    [
        hetcoll.kernels,
        hetcoll.errors,
        hetcoll.fusion,
        hetcoll.collectives.speculative,
        hetcoll.torch.sampler,
        hetcoll.plan,
        importlib.import_module("hetcoll.torch.expert_parallel"),
        *(
            importlib.import_module(f"hetcoll.torch.filters.{m}")
            for m in ("checks", "autograd", "layers", "chains", "tensor_split", "convert", "state")
        ),
        *(
            importlib.import_module(f"hetcoll.model.predict.{m}")
            for m in (
                "prediction",
                "timing",
                "data",
                "filters",
                "layout",
                "work",
                "classes",
                "schedule",
                "plans",
                "pipelines",
            )
        ),
        *(
            importlib.import_module(f"hetcoll.model.planner.{m}")
            for m in ("rates", "subsets", "report", "placements", "search", "sweeps")
        ),
    ],
)
def test_docstring_examples(module):
    result = doctest.testmod(module)
    assert result.failed == 0


def test_every_tuning_constant_has_its_heading_in_docs_collectives():
    # The tuning table's comments point to docs/collectives.md#<name>; each must land on a
    # heading of the "Tuning table" section, and each constant must have one.
    import re

    from hetcoll.collectives import _tuning

    doc = (ROOT / "docs" / "collectives.md").read_text()
    table = doc.split("\n## Tuning table\n", 1)[1].split("\n## ", 1)[0]
    headings = set(re.findall(r"^### `([A-Z_]+)`$", table, re.M))
    assert headings == {name for name in vars(_tuning) if name.isupper()}
    source = Path(_tuning.__file__).read_text()
    anchors = re.findall(r"docs/collectives\.md#(\w+)", source)
    assert sorted(anchors) == sorted(name.lower() for name in headings)


def _guide_plan_lines() -> list[str]:
    text = (ROOT / "docs" / "guides.md").read_text().replace("\\\n", " ")
    return [ln for ln in text.splitlines() if ln.startswith("hetcoll plan ")]


@pytest.mark.parametrize("line", _guide_plan_lines(), ids=["cnn", "lm", "mixtral by loads"])
def test_the_guides_plan_commands_run_as_written(tmp_path, line):
    """docs/guides.md's `hetcoll plan` lines (the CNN example's and the LM example's, its model
    loaded as examples.train_lm from the repository's root; its mixture of experts with the
    loads a run measured), each run with its --out redirected (and --expert-loads, to loads
    skewed toward each layer's first two experts, as train_lm.py --save-expert-loads writes
    them): each writes a plan the runtime reads, for the batch it asks."""
    import json
    import shlex
    import subprocess
    import sys

    argv = shlex.split(line)[1:]
    argv[argv.index("--out") + 1] = str(tmp_path / "plan.json")
    if "--expert-loads" in argv:
        loads = tmp_path / "loads.json"
        skewed = [40, 30, 5, 5, 5, 5, 5, 5]
        loads.write_text(json.dumps({f"model.layers.{i}.mlp.experts": skewed for i in range(6)}))
        argv[argv.index("--expert-loads") + 1] = str(loads)
    run = subprocess.run(
        [sys.executable, "-m", "hetcoll.cli", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    batch = int(argv[argv.index("--batch") + 1])
    assert hetcoll.Plan.load(tmp_path / "plan.json").batch == batch
