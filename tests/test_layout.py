"""The layout of tests/: helpers shared between tests live in tests/support (see its docstring).
No module imports from a `test_*` module or a conftest, and a directory of test modules holds
nothing but test modules, its conftest (fixtures) and its `__init__.py`, or a tool named below."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
# Run by hand or by make, and beside the tests they belong to; they import from tests/support.
TOOLS = {"tests/runtime/whisper_report.py", "tests/fuzz/run.py"}


def _modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(path: Path) -> str:
    return _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]


def _imported(source: str, package: str) -> Iterator[tuple[int, str]]:
    """(line, module) of every module an import statement may name, relative ones resolved against
    `package` (the package of the module whose source it is)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            yield node.lineno, module
            for alias in node.names:  # `from package import test_x` imports the module test_x
                yield node.lineno, f"{module}.{alias.name}"


def _is_test_or_conftest(module: str) -> bool:
    last = module.rpartition(".")[2]
    return module.split(".")[0] == "tests" and (last.startswith("test_") or last == "conftest")


def test_no_module_imports_from_a_test_module_or_a_conftest() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in _modules()
        for line, module in _imported(path.read_text(), _package(path))
        if _is_test_or_conftest(module)
    ]
    assert not offenders, (
        "shared test helpers belong in tests/support, not in test modules or conftests:\n  " + "\n  ".join(offenders)
    )


def test_directories_of_tests_hold_only_tests_fixtures_and_named_tools() -> None:
    test_dirs = {p.parent for p in _modules() if p.name.startswith("test_")} - {TESTS}
    allowed = {"__init__.py", "conftest.py"}
    offenders = [
        str(path.relative_to(ROOT))
        for path in _modules()
        if path.parent in test_dirs
        and not path.name.startswith("test_")
        and path.name not in allowed
        and str(path.relative_to(ROOT)) not in TOOLS
    ]
    assert not offenders, "helpers of the tests belong in tests/support: " + ", ".join(offenders)


def test_the_import_check_sees_every_form_of_import() -> None:
    source = """
from .conftest import MIXES
from ..router.test_core import Harness
from tests.router import test_core
import tests.services.conftest
from tests.support.stacks import MIXES
from . import samples
"""
    found = [m for _, m in _imported(source, "tests.services") if _is_test_or_conftest(m)]
    assert found == [
        "tests.services.conftest",
        "tests.router.test_core",
        "tests.router.test_core",
        "tests.services.conftest",
    ]
    assert "tests.services.samples" in {m for _, m in _imported(source, "tests.services")}
