"""Every test that loads the real SmolLM2-135M model carries `@pytest.mark.slow`, so `-m "not slow"` stays the quick
subset (README, "Tests").

Read with `ast`, nothing imported. A test loads the real model when its body, a function it calls, or a fixture it
requests reaches `load_model()` with no path (or `None`): directly, through a helper of its own module, one imported
from a module under tests/, or a fixture of a conftest.py above it. A call inside `with pytest.raises(...)` is one
the test expects to fail, not a load. Marked means the function's decorators, its class's, or the module's
`pytestmark` name `pytest.mark.slow`."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass
class Module:
    """One file's functions (module level and in classes), where its imported names come from, and which of its
    functions sit under a slow mark."""

    name: str
    functions: dict[str, FunctionNode] = field(default_factory=dict)
    imports: dict[str, tuple[str, str]] = field(default_factory=dict)
    slow: set[str] = field(default_factory=set)


def _names_slow(decorators: list[ast.expr]) -> bool:
    return any(isinstance(node, ast.Attribute) and node.attr == "slow" for d in decorators for node in ast.walk(d))


def parse_module(name: str, source: str) -> Module:
    module = Module(name)
    tree = ast.parse(source)
    module_slow = any(
        isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
        and _names_slow([node.value])
        for node in tree.body
    )
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            module.imports.update({alias.asname or alias.name: (node.module, alias.name) for alias in node.names})
        scopes = [(node, [])] if isinstance(node, FunctionNode) else []
        if isinstance(node, ast.ClassDef):
            scopes = [(item, node.decorator_list) for item in node.body if isinstance(item, FunctionNode)]
        for function, outer in scopes:
            module.functions[function.name] = function
            if module_slow or _names_slow(outer) or _names_slow(function.decorator_list):
                module.slow.add(function.name)
    return module


def _is_default_load(call: ast.Call) -> bool:
    """`load_model()`, `load_model(None, ...)` or `load_model(path=None, ...)`: the default model."""
    func = call.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    if name != "load_model":
        return False
    path = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "path"), None)
    return path is None or (isinstance(path, ast.Constant) and path.value is None)


def _expects_failure(node: ast.With | ast.AsyncWith) -> bool:
    return any(
        isinstance(item.context_expr, ast.Call)
        and isinstance(item.context_expr.func, ast.Attribute)
        and item.context_expr.func.attr == "raises"
        for item in node.items
    )


def _calls(function: FunctionNode) -> tuple[bool, set[str]]:
    """Whether `function` loads the default model itself, and the plain names it calls (outside pytest.raises)."""
    loads, called = False, set()
    stack: list[ast.AST] = list(function.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.With | ast.AsyncWith) and _expects_failure(node):
            continue
        if isinstance(node, ast.Call):
            loads = loads or _is_default_load(node)
            if isinstance(node.func, ast.Name):
                called.add(node.func.id)
        stack.extend(ast.iter_child_nodes(node))
    return loads, called


@dataclass
class Suite:
    """The modules under tests/ by dotted name, and which of their functions reach a default-model load."""

    modules: dict[str, Module]
    _memo: dict[tuple[str, str], bool] = field(default_factory=dict)

    def conftests(self, module: str) -> list[str]:
        """The conftest modules that apply to `module`, nearest first."""
        parts = module.split(".")[:-1]
        return [n for i in range(len(parts), 0, -1) if (n := ".".join([*parts[:i], "conftest"])) in self.modules]

    def loads(self, module: str, name: str, fixture_scope: str | None = None) -> bool:
        key = (module, name)
        if key in self._memo:
            return self._memo[key]
        self._memo[key] = False  # a cycle adds nothing
        function = self.modules[module].functions[name]
        direct, called = _calls(function)
        scope = fixture_scope or module
        fixtures = [a.arg for a in function.args.args + function.args.kwonlyargs]
        result = direct or any(self._resolves_to_load(module, n) for n in called)
        result = result or any(self._fixture_loads(scope, n) for n in fixtures)
        self._memo[key] = result
        return result

    def _resolves_to_load(self, module: str, name: str) -> bool:
        here = self.modules[module]
        if name in here.functions:
            return self.loads(module, name)
        source, original = here.imports.get(name, ("", ""))
        return source in self.modules and original in self.modules[source].functions and self.loads(source, original)

    def _fixture_loads(self, module: str, name: str) -> bool:
        for candidate in [module, *self.conftests(module)]:
            if name in self.modules[candidate].functions:
                return self.loads(candidate, name, fixture_scope=candidate)
        return False

    def unmarked_loaders(self) -> list[str]:
        return [
            f"{module}::{name}"
            for module, parsed in sorted(self.modules.items())
            if module.rsplit(".", 1)[-1].startswith("test_")
            for name in parsed.functions
            if name.startswith("test_") and name not in parsed.slow and self.loads(module, name)
        ]


def load_modules() -> dict[str, Module]:
    modules = {}
    for path in sorted(TESTS.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        modules[name] = parse_module(name, path.read_text())
    return modules


@pytest.fixture(scope="module")
def suite_modules() -> dict[str, Module]:
    """Every module under tests/ parsed once for this file's tests (each builds its own Suite on them)."""
    return load_modules()


def test_every_real_model_test_is_marked_slow(suite_modules: dict[str, Module]) -> None:
    unmarked = Suite(suite_modules).unmarked_loaders()
    assert not unmarked, f"load the real model without @pytest.mark.slow: {unmarked}"


def test_the_check_sees_the_loads(suite_modules: dict[str, Module]) -> None:
    """The real-model tests are found however they reach the model: a cached helper of their module, a harness
    function imported from tests/, a module fixture, a conftest fixture (the agent clients)."""
    suite = Suite(suite_modules)
    assert suite.loads("tests.engine.weights.test_quantization_real_model", "test_int4_batched_equals_alone")
    assert suite.loads(
        "tests.engine.test_real_model_parity", "test_seeded_sampling_is_the_same_alone_and_beside_others"
    )
    assert suite.loads(
        "tests.api.endpoints.test_api_real_model", "test_streamed_text_concatenates_to_the_non_streamed_text"
    )
    assert suite.loads("tests.api.agents.test_agent_clients", "test_agent_client")
    assert not suite.loads("tests.engine.weights.test_loader", "test_missing_default_package_says_how_to_fix")


def test_an_unmarked_load_is_reported() -> None:
    source = (
        "import pytest\n"
        "from engine.weights.loader import load_model\n"
        "def _model():\n    return load_model(None, dtype='bfloat16')\n"
        "@pytest.fixture\ndef model():\n    return _model()\n"
        "def test_unmarked(model):\n    pass\n"
        "@pytest.mark.slow\ndef test_marked(model):\n    pass\n"
        "def test_tiny():\n    load_model('tiny')\n"
    )
    suite = Suite({"tests.test_example": parse_module("tests.test_example", source)})
    assert suite.unmarked_loaders() == ["tests.test_example::test_unmarked"]
