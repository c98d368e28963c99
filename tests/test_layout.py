"""The project's shape: short files and functions (the package, its C++ kernels, the tests and the examples), and the
import contract of pyproject.toml."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "contbatch"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
MODULES = sorted(PACKAGE.rglob("*.py"))
SOURCES = sorted([*MODULES, *(ROOT / "tests").rglob("*.py"), *(ROOT / "examples").rglob("*.py"),
                  *(PACKAGE / "engine" / "csrc").glob("*.[ch]*")])
PYTHON = [path for path in SOURCES if path.suffix == ".py"]


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _functions(tree: ast.AST) -> list[tuple[str, int]]:
    """Every function and method of `tree` (nested ones included) as (qualified name, lines from `def` to its end)."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                assert child.end_lineno is not None
                found.append((name, child.end_lineno - child.lineno + 1))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def test_the_package_has_modules() -> None:
    assert len(MODULES) > 10


def test_the_sources_include_tests_examples_and_kernels() -> None:
    kinds = {path.relative_to(ROOT).parts[0] for path in SOURCES} | {path.suffix for path in SOURCES}
    assert {"contbatch", "tests", "examples", ".py", ".cpp", ".h"} <= kinds


@pytest.mark.parametrize("path", SOURCES, ids=_name)
def test_file_is_short(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{_name(path)} has {lines} lines (at most {MAX_MODULE_LINES})"


@pytest.mark.parametrize("path", PYTHON, ids=_name)
def test_functions_are_short(path: Path) -> None:
    long = [(name, lines) for name, lines in _functions(ast.parse(path.read_text(), str(path)))
            if lines > MAX_FUNCTION_LINES]
    report = ", ".join(f"{name} has {lines} lines" for name, lines in long)
    assert not long, f"{_name(path)}: {report} (at most {MAX_FUNCTION_LINES} from `def` to its last line)"


def test_import_contracts_hold() -> None:
    command = [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()",
               "--no-cache"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"lint-imports failed:\n{result.stdout}\n{result.stderr}"
