"""The package's architecture, checked: layers and cycles (import-linter contracts in
pyproject.toml), no private name crossing from one of hetcoll's top-level modules or packages
into another, and the library importing none of the lab."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "hetcoll"
ROOT = PACKAGE.parents[1]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _room(module: str) -> str:
    """The top-level module or package of hetcoll that ``module`` belongs to (``hetcoll.comm``,
    ``hetcoll.collectives`` for ``hetcoll.collectives.ring``; ``hetcoll`` for the root)."""
    return ".".join(module.split(".")[:2])


def _private_imports(source: str, me: str, is_package: bool) -> list[str]:
    """``from x import _name`` in module ``me``, where x is a hetcoll module outside ``me``'s
    top-level module or package (a package's private names are its own: its modules share
    them), or an import from a private module of another package (a package's private modules
    are its own); the bindings module ``hetcoll._core`` is the Rust layer's public face."""
    package = me if is_package else me.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            origin = f"{base}.{node.module}" if node.module else base
        else:
            origin = node.module or ""
        inside = origin == "hetcoll" or origin.startswith("hetcoll.")
        if not inside or origin in (me, "hetcoll._core"):
            continue
        parent, _, leaf = origin.rpartition(".")
        if leaf.startswith("_") and not (me + ".").startswith(parent + "."):
            found.append(f"{me}:{node.lineno} imports from private module {origin}")
        if _room(origin) == _room(me) != "hetcoll":
            continue  # within one package: its private names are its own
        for alias in node.names:
            if origin == "hetcoll" and alias.name == "_core":
                continue
            if alias.name.startswith("_") and not alias.name.startswith("__"):
                found.append(f"{me}:{node.lineno} imports {alias.name} from {origin}")
    return found


def test_no_private_name_crosses_a_module_boundary():
    found = [
        f
        for path in sorted(PACKAGE.rglob("*.py"))
        for f in _private_imports(path.read_text(), _module_name(path), path.name == "__init__.py")
    ]
    assert found == []


def test_private_import_scan_finds_what_it_should():
    src = (
        "from hetcoll.kernels import _numpy_view, weighted_sum\n"
        "from hetcoll._core import split\n"
        "from hetcoll import _core\n"
        "from ._tuning import SEGMENT\n"
        "from .ring import _steps\n"
        "from hetcoll.collectives._tuning import SEGMENT\n"
        "from hetcoll.torch.probe import _own\n"
        "from hetcoll.collectives.ring import _ring\n"
        "from hetcoll.torch.ring import _steps\n"
        "from hetcoll.torch import _helper\n"
        "from .. import _root_helper\n"
    )
    assert _private_imports(src, "hetcoll.torch.probe", False) == [
        "hetcoll.torch.probe:1 imports _numpy_view from hetcoll.kernels",
        "hetcoll.torch.probe:6 imports from private module hetcoll.collectives._tuning",
        "hetcoll.torch.probe:8 imports _ring from hetcoll.collectives.ring",
        "hetcoll.torch.probe:11 imports _root_helper from hetcoll",
    ]


def test_private_import_scan_keeps_a_package_s_private_names_inside_it():
    # A package's modules, and its __init__, share its private modules and names.
    inside = (
        "from hetcoll.collectives import _tuning\n"
        "from hetcoll.collectives._common import _scratch\n"
        "from ._header import _fields\n"
        "from .ring import _ring\n"
    )
    assert _private_imports(inside, "hetcoll.collectives.gather", False) == []
    assert _private_imports(inside, "hetcoll.collectives", True) == []
    # Top-level modules are rooms of their own: the root package is not one they share.
    top = "from hetcoll.kernels import _x\nfrom .fusion import _y\nfrom hetcoll import _z\n"
    assert _private_imports(top, "hetcoll.comm", False) == [
        "hetcoll.comm:1 imports _x from hetcoll.kernels",
        "hetcoll.comm:2 imports _y from hetcoll.fusion",
        "hetcoll.comm:3 imports _z from hetcoll",
    ]
    # Nor do two packages share theirs, either way round.
    assert _private_imports(inside, "hetcoll.torch.hooks", False) == [
        "hetcoll.torch.hooks:1 imports _tuning from hetcoll.collectives",
        "hetcoll.torch.hooks:2 imports from private module hetcoll.collectives._common",
        "hetcoll.torch.hooks:2 imports _scratch from hetcoll.collectives._common",
    ]


def test_import_contracts_hold():
    """Layers, the lab beside the library and acyclic siblings, as pyproject.toml states them."""
    lint = Path(sys.executable).parent / "lint-imports"
    if not lint.exists():
        pytest.skip("import-linter is not installed (make test installs it)")
    proc = subprocess.run(
        [str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "package", ["hetcoll", "hetcoll.torch", "hetcoll.model", "hetcoll.accelerate"]
)
def test_importing_the_library_imports_no_lab_module(package):
    """Nor torch's subsystems that only some calls need, loaded on use: torch.compile's tracer
    (a second to import on a 2-core host; disabling it for hetcoll's exchanging autograd
    functions at their definition used to import it) and torch.distributed.checkpoint (half
    a second)."""
    code = (
        f"import json, sys, {package}\n"
        "lab = ('hetcoll.lab', 'demo', 'emulat', 'calibrat', 'validat')\n"
        "heavy = ('torch._dynamo', 'torch.distributed.checkpoint')\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('hetcoll')"
        " and any(w in m for w in lab) or m in heavy)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_renamed_names_still_work_with_a_warning():
    import hetcoll.model
    import hetcoll.torch

    with pytest.warns(DeprecationWarning, match="predict_filter_parallel"):
        old = hetcoll.model.filter_parallel
    assert old is hetcoll.model.predict_filter_parallel is hetcoll.model.predict.filter_parallel
    with pytest.warns(DeprecationWarning, match="hetcoll.lab.emulate"):
        emulated = hetcoll.torch.EmulatedSpeed
    with pytest.warns(DeprecationWarning, match="hetcoll.lab.emulate.slow_down_filter_parallel"):
        set_speed = hetcoll.torch.set_emulated_speed
    from hetcoll.lab.emulate import EmulatedSpeed, slow_down_filter_parallel

    assert emulated is EmulatedSpeed
    assert set_speed is slow_down_filter_parallel
