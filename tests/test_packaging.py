"""Packaging: every third-party module the server can import is declared in the core dependencies or in the
`serve` extra, so that `pip install contbatch[serve]` is enough to serve (issue 15, item 1); OpenTelemetry, which
only telemetry imports and only once it is on, comes from the `otel` extra. Nothing is installed: the import
closure of the server's modules is read from the source."""

from __future__ import annotations

import ast
import importlib.metadata
import sys
import tomllib
from collections.abc import Callable, Iterable
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
SERVER_ENTRIES = ["contbatch.cli.serve", "contbatch.entrypoints.openai.app"]
OTEL_ONLY = {"opentelemetry"}
OTEL_DISTRIBUTIONS = {"opentelemetry-api", "opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http"}
# Triton comes with torch's CUDA wheels; the GPU attention kernel imports it only where it is installed.
WITH_TORCH_CUDA = {"triton"}


def module_path(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def eager_imports_of(path: Path) -> set[str]:
    """The modules `path` imports when it is imported: its top-level imports, outside `if TYPE_CHECKING:`."""
    return _imported_names(ast.parse(path.read_text()).body)


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, at any depth of its code (lazy imports inside functions included)."""
    return _imported_names(ast.walk(ast.parse(path.read_text())))


def _imported_names(nodes: Iterable[ast.AST]) -> set[str]:
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def third_party_closure(entries: list[str], imports: Callable[[Path], set[str]] = imports_of) -> set[str]:
    """The top-level third-party modules imported by `entries` and every contbatch module they import (`imports`
    says what a module imports)."""
    seen: set[str] = set()
    todo, found = list(entries), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = module_path(name)
        if path is None:
            continue
        for imported in imports(path):
            top = imported.split(".")[0]
            if top == "contbatch":
                todo.append(imported)
            elif top not in sys.stdlib_module_names and top != "__future__":
                found.add(top)
    return found


def declared(extra: str) -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"], *project["optional-dependencies"][extra]]
    return {Requirement(text).name.lower().replace("_", "-") for text in requirements}


def distribution_of(module: str) -> set[str]:
    return {name.lower().replace("_", "-") for name in importlib.metadata.packages_distributions().get(module, [])}


def test_every_module_the_server_imports_is_in_the_serve_extra() -> None:
    modules = third_party_closure(SERVER_ENTRIES)
    assert {"fastapi", "uvicorn", "pydantic", "prometheus_client", "llguidance"} <= modules  # the scan sees them
    allowed = declared("serve")
    missing = {module: distribution_of(module) for module in modules - OTEL_ONLY - WITH_TORCH_CUDA
               if not distribution_of(module) & allowed}
    assert not missing, f"imported by the server but not in `serve` or the core dependencies: {missing}"


def test_opentelemetry_is_imported_only_once_telemetry_is_on_and_comes_from_the_otel_extra() -> None:
    assert third_party_closure(SERVER_ENTRIES) >= OTEL_ONLY  # the scan sees the lazy imports
    eager = third_party_closure([*SERVER_ENTRIES, "contbatch", "contbatch.telemetry"], eager_imports_of)
    assert not eager & OTEL_ONLY, "a module imports OpenTelemetry when it is imported, with telemetry off"
    assert declared("otel") >= OTEL_DISTRIBUTIONS


def test_triton_is_imported_only_when_the_gpu_kernel_is_used() -> None:
    assert third_party_closure(["contbatch.engine.attention"]) >= WITH_TORCH_CUDA  # the scan sees the lazy import
    eager = third_party_closure([*SERVER_ENTRIES, "contbatch"], eager_imports_of)
    assert not eager & WITH_TORCH_CUDA, "a module imports Triton when it is imported: a CPU install lacks it"


def test_all_installs_every_extra() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = set(project["optional-dependencies"]) - {"all", "test"}
    (everything,) = project["optional-dependencies"]["all"]
    assert set(Requirement(everything).extras) == extras
