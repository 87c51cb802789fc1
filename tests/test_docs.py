"""The README's and the docstrings' `>>>` examples run as written."""

import doctest
import importlib
from pathlib import Path

import pytest

import hetcoll
import hetcoll.fusion
import hetcoll.kernels
import hetcoll.model.predict
import hetcoll.torch.sampler

ROOT = Path(__file__).resolve().parent.parent


def test_readme_examples():
    result = doctest.testfile(str(ROOT / "README.md"), module_relative=False)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize(
    "module",
    [
        hetcoll.kernels,
        hetcoll.fusion,
        hetcoll.torch.sampler,
        importlib.import_module("hetcoll.torch.filters"),
        hetcoll.model.predict,
    ],
)
def test_docstring_examples(module):
    result = doctest.testmod(module)
    assert result.failed == 0
