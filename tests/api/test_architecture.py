"""The shape of api/: its subpackages and top-level modules form layers, and each imports only the layers below it.

The protocol (request models, errors, deltas, the mapping onto engine inputs) is the leaf; the apps that wire the
routes, the live page and the process together are the top, and only the CLI imports them."""

from __future__ import annotations

import ast
from pathlib import Path

API = Path(__file__).resolve().parents[2] / "api"
# Low to high. A subpackage, or a module at the top of api/, may import only what comes before it here.
LAYERS = (
    "protocol",  # the leaf: shapes and errors every other part speaks
    "structured",  # grammars for structured outputs and tool calls
    "config",  # ServerConfig (its grammar limits come from structured/)
    "flags",  # the command line's flags onto ServerConfig
    "text",  # prompts, chat templates, detokenizing
    "runtime",  # the model, engine and scheduler built for a config
    "endpoints",  # the routes and the server's state
    "translation",  # the Responses and Messages APIs onto the chat path
    "process",  # connections, drain, the uvicorn setup
    "live",  # the compare page, its event streams and workloads
    "apps",  # the serve and compare apps: wiring
    "scale_out",  # the serve app's replicas behind Ray Serve
    "formats",  # `batchserve formats`: the weight formats auto chose
    "cli",
    "__main__",
)


def _unit(path: Path) -> str:
    """The layer a file belongs to: its subpackage, or its own name at the top of api/."""
    parts = path.relative_to(API).parts
    return parts[0] if len(parts) > 1 else path.stem


def _imported_units(path: Path) -> set[str]:
    """Every api/ layer the file imports, at any depth (deferred imports inside functions count too)."""
    units = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "api" and len(parts) > 1 and parts[1] in LAYERS:
                units.add(parts[1])
    return units


def _files() -> list[Path]:
    return [path for path in sorted(API.rglob("*.py")) if path.name != "__init__.py" or path.parent != API]


def test_every_subpackage_and_module_has_a_layer() -> None:
    units = {_unit(path) for path in _files()}
    assert units - set(LAYERS) == set()


def test_each_layer_imports_only_layers_below_it() -> None:
    upward = [
        f"{path.relative_to(API)} imports api.{target}"
        for path in _files()
        for target in _imported_units(path)
        if target != _unit(path) and LAYERS.index(target) > LAYERS.index(_unit(path))
    ]
    assert upward == []


def test_the_protocol_imports_nothing_else_of_api() -> None:
    """The leaf holds what every layer shares, so that none of them needs another to speak the protocol."""
    found = [
        f"{path.relative_to(API)} imports api.{target}"
        for path in sorted((API / "protocol").rglob("*.py"))
        for target in _imported_units(path)
        if target != "protocol"
    ]
    assert found == []
