"""The shape of benchmarks/: jobs import each other only through the shared subpackages, loadgen drives any server
without importing the product, and the simulator runs without the A/B command, matplotlib or transformers."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
JOBS = ("online", "peers", "micro", "sim", "page")  # each a subpackage of commands for one kind of question
SHARED = ("loadgen", "results_io")  # any job may use these
# The imports across jobs that are allowed, each for a reason.
ACROSS_JOBS = {
    ("online", "benchmarks.peers.targets"): "the A/B command launches the peers as baselines",
    ("sim", "benchmarks.micro.rows"): "the profiler adds engine rows as the micro benchmarks do",
    ("peers", "benchmarks.micro.engine_bench"): "openvino-probe times the engine with the engine benchmark's passes",
}
PRODUCT = ("api", "engine", "scheduler")


def _imports(path: Path) -> list[str]:
    modules: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.append(node.module)
        elif isinstance(node, ast.Import):
            modules.extend(alias.name for alias in node.names)
    return modules


def _modules() -> list[tuple[str, Path]]:
    """(subpackage, file) for every module under benchmarks/ (results/ holds data, not code; scripts/ holds one-off
    scripts outside the package, which may import any job)."""
    found = []
    for path in sorted(BENCHMARKS.rglob("*.py")):
        parts = path.relative_to(BENCHMARKS).parts
        if parts[0] not in ("results", "scripts"):
            found.append((parts[0] if len(parts) > 1 else "", path))
    return found


def test_every_subpackage_is_a_job_or_shared() -> None:
    packages = {p.name for p in BENCHMARKS.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(JOBS) | set(SHARED)


def test_no_import_across_jobs_except_through_shared_packages() -> None:
    crossing = []
    for package, path in _modules():
        for module in _imports(path):
            parts = module.split(".")
            if parts[0] != "benchmarks" or len(parts) < 2 or parts[1] not in JOBS or parts[1] == package:
                continue
            if package in SHARED or (package, module) not in ACROSS_JOBS:
                crossing.append(f"{path.relative_to(BENCHMARKS)} imports {module}")
    assert crossing == []


def test_loadgen_imports_nothing_of_the_product() -> None:
    found = [
        f"{path.relative_to(BENCHMARKS)} imports {module}"
        for package, path in _modules()
        if package == "loadgen"
        for module in _imports(path)
        if module.split(".")[0] in PRODUCT
    ]
    assert found == []


def test_subpackage_inits_import_nothing() -> None:
    """So that importing benchmarks.sim, say, brings in nothing heavy on its way to one module."""
    for init in BENCHMARKS.rglob("__init__.py"):
        if init.parent != BENCHMARKS and "results" not in init.parts:
            assert _imports(init) == [], init


def test_the_simulator_runs_without_the_ab_command_matplotlib_or_transformers() -> None:
    code = (
        "import sys, benchmarks.sim.cli; "
        "print(sorted(m for m in ('benchmarks.online.ab', 'matplotlib', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
