"""The repository's shape, checked from the source: layers point down, no import cycle, small product modules, and
each optional heavy dependency imported by one module only.

Imports are read with `ast` (module-level and inside functions alike), so nothing here imports the packages."""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "scheduler", "api", "benchmarks")
PRODUCT = ("engine", "scheduler", "api")
# Which project packages each package may import (the layers: api -> scheduler -> engine; benchmarks use all).
ALLOWED = {
    "engine": {"engine"},
    "scheduler": {"scheduler", "engine"},
    "api": {"api", "scheduler", "engine"},
    "benchmarks": set(PACKAGES),
}
# engine/'s subpackages, low to high: each may import those before it and the engine's top-level modules (config,
# errors, outputs, phases, rows); only engine.engine, on top, imports from all of them.
ENGINE_LAYERS = ("platform", "weights", "sample", "kv", "spec", "model")
MAX_PRODUCT_LINES = 400
ONE_IMPORTER = ("ray", "xgrammar")  # optional heavy dependencies: one product module each


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files(packages: tuple[str, ...] = PACKAGES) -> Iterator[Path]:
    for package in packages:
        yield from sorted((ROOT / package).rglob("*.py"))


def imported_names(path: Path) -> tuple[str, ...]:
    """Every module name an import statement in `path` names, relative imports resolved."""
    return _imported_names(path, path.stat().st_mtime_ns)


@functools.cache  # each file is parsed once for the several checks here, again only if it changed
def _imported_names(path: Path, _mtime_ns: int) -> tuple[str, ...]:
    return tuple(_read_imports(path))


def _read_imports(path: Path) -> Iterator[str]:
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(path): path for path in source_files()}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = {target for target in imported_names(path) if target in modules and target != name}
    return graph


def test_layers_point_down() -> None:
    upward = [
        f"{source} imports {target}"
        for source, targets in import_graph().items()
        for target in targets
        if target.split(".")[0] not in ALLOWED[source.split(".")[0]]
    ]
    assert upward == []


def test_engine_subpackages_point_down() -> None:
    def layer(module: str) -> int:
        """The module's place in ENGINE_LAYERS; -1 for engine's top-level modules, len for engine.engine."""
        parts = module.split(".")
        if module == "engine.engine":
            return len(ENGINE_LAYERS)
        return ENGINE_LAYERS.index(parts[1]) if len(parts) > 2 else -1

    graph = import_graph()
    upward = [
        f"{source} imports {target}"
        for source, targets in graph.items()
        if source.startswith("engine.") and layer(source) >= 0
        for target in targets
        if target.startswith("engine.") and layer(target) > layer(source)
    ]
    assert upward == []
    assert "engine.platform.native" in graph["engine.model.model_runner"]  # the check sees the imports


def test_no_import_cycle() -> None:
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert [" -> ".join(cycle) for cycle in cycles] == []


@pytest.mark.parametrize("path", list(source_files(PRODUCT)), ids=lambda path: str(path.relative_to(ROOT)))
def test_product_modules_stay_small(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= MAX_PRODUCT_LINES


@pytest.mark.parametrize("dependency", ONE_IMPORTER)
def test_heavy_optional_dependency_has_one_importer(dependency: str) -> None:
    importers = {
        module_name(path)
        for path in source_files(PRODUCT)
        if any(name == dependency or name.startswith(f"{dependency}.") for name in imported_names(path))
    }
    assert len(importers) <= 1, importers


def test_the_checks_see_the_imports() -> None:
    """Guards the guard: the graph must contain edges the code is known to have."""
    graph = import_graph()
    assert "engine.outputs" in graph["scheduler.request"]
    assert "scheduler.lifecycle" in graph["scheduler.core"]
