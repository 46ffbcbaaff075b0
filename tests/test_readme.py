"""The README's commands run as written after its own install lines: every shell command and Python block in it is
run here (or, where it would take minutes, checked as far as it can be without that), against a live `batchserve
serve` on the tiny model under the default model's name; what they import from outside the project must be
installed by the Quick start's `pip install` lines (what they name, or what that requires), and no command needs a
bare `sudo` (a container's root has none)."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from packaging.requirements import Requirement

from api.cli import build_parser, compare_config, compare_lineup
from api.flags import config_from_args
from engine.weights.loader import DEFAULT_MODEL_FILE
from tests.server_harness import free_port, wait_until

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RECORDER = Path(__file__).resolve().parent / "import_recorder"  # its sitecustomize logs third-party imports
README_URL = "http://127.0.0.1:8000"
DEFAULT_NAME = Path(DEFAULT_MODEL_FILE).stem  # what the README's snippets call the model


@dataclass(frozen=True)
class Block:
    section: str  # the `## ` heading it is under
    language: str
    text: str

    def commands(self) -> Iterator[str]:
        """Each shell command: continuation lines joined, then split at `&&`."""
        joined = re.sub(r"\\\n\s*", " ", self.text)
        for line in joined.splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                yield from (part.split(" #")[0].strip() for part in line.split("&&"))


def readme_blocks() -> list[Block]:
    blocks, section = [], ""
    pattern = re.compile(r"^## ([^\n]+)$|^```(\w*)\n(.*?)^```$", flags=re.MULTILINE | re.DOTALL)
    for match in pattern.finditer(README.read_text()):
        if match.group(1):
            section = match.group(1)
        else:
            blocks.append(Block(section, match.group(2), match.group(3)))
    return blocks


BLOCKS = readme_blocks()
SHELL = [block for block in BLOCKS if block.language == "bash"]
PYTHON = [block for block in BLOCKS if block.language == "python"]
COMMANDS = [command for block in SHELL for command in block.commands()]
INSTALL_WORDS = ("python3 -m venv", ". .venv/bin/activate", "pip install")


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def quick_start_installs() -> set[str]:
    """What the Quick start's first block installs."""
    return installs(next(block for block in SHELL if block.section.startswith("Quick start")).commands())


def installs(commands: Iterable[str]) -> set[str]:
    """The distributions `commands`' `pip install` lines install: those they name (the project from pyproject.toml,
    with each extra they ask for: `-e ".[bench]"`) and, but for `--no-deps`, what those require in turn (as
    installed here)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    named: list[Requirement] = []
    expand: list[Requirement] = []
    for command in commands:
        if not command.startswith("pip install"):
            continue
        words = shlex.split(command)[2:]
        for word in requirement_words(words):
            if word.startswith("."):
                extras = re.findall(r"[\w-]+", word.partition("[")[2])
                optional = [r for extra in extras for r in project["optional-dependencies"][extra]]
                requirements = [Requirement(r) for r in [*project["dependencies"], *optional]]
            else:
                requirements = [Requirement(word)]
            named += requirements
            expand += [] if "--no-deps" in words else requirements
    installed = {_normal(requirement.name) for requirement in named}
    while expand:
        requirement = expand.pop()
        try:
            requires = importlib.metadata.requires(requirement.name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for text in requires:
            needed = Requirement(text)
            wanted = needed.marker is None or any(
                needed.marker.evaluate({"extra": extra}) for extra in {"", *requirement.extras}
            )
            if wanted and _normal(needed.name) not in installed:
                installed.add(_normal(needed.name))
                expand.append(needed)
    return installed


def requirement_words(words: list[str]) -> Iterator[str]:
    """The requirements among a `pip install`'s words: not its options, nor the values of those that take one."""
    takes_value = {"--extra-index-url", "--index-url", "-i", "--find-links", "-f", "--constraint", "-c"}
    after_option = False
    for word in words:
        if not word.startswith("-") and not after_option:
            yield word
        after_option = word in takes_value


CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def subprocess_env(import_log: Path) -> dict[str, str]:
    """This environment, with the import recorder and this checkout first on the path."""
    path = os.pathsep.join([str(RECORDER), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "BATCHSERVE_IMPORT_LOG": str(import_log)}


def undeclared(import_log: Path) -> list[str]:
    """The recorded third-party modules that no distribution the Quick start installs provides."""
    providers = importlib.metadata.packages_distributions()
    installed = quick_start_installs()
    modules = set(import_log.read_text().split()) if import_log.exists() else set()
    return sorted(m for m in modules if not {_normal(d) for d in providers.get(m, [m])} & installed)


@pytest.fixture(scope="module")
def live_server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """`batchserve serve` (the Quick start's last command) on the tiny model, under the default model's name; its
    URL and the log its imports go to (the README's other commands log there too)."""
    import_log = tmp_path_factory.mktemp("imports") / "imports.log"
    port = free_port()
    batchserve = str(Path(sys.executable).with_name("batchserve"))
    argv = [batchserve, "serve", "--model", str(tiny_checkpoint), "--served-model-name", DEFAULT_NAME]
    process = subprocess.Popen(
        [*argv, "--port", str(port)], env=subprocess_env(import_log), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(healthy, "the README's server to become healthy", timeout_s=300)
        yield url, import_log
    finally:
        process.terminate()
        process.wait(60)
        if process.stderr is not None:
            process.stderr.close()


def test_no_command_needs_a_bare_sudo() -> None:
    needing = [command for command in COMMANDS if command.split()[0] == "sudo"]
    assert needing == [], "a container's root has no sudo: use a script that asks for it only when not root (.ci/run)"


def test_the_test_command_is_the_ci_script() -> None:
    (tests,) = [block for block in SHELL if block.section == "Tests"]
    script = ROOT / ".ci" / "run"
    assert next(tests.commands()) == ".ci/run" and os.access(script, os.X_OK)
    assert "python -m pytest -q" in script.read_text()


def test_the_quick_start_pins_xgrammar_as_the_ci_script_does() -> None:
    def pins(text: str) -> list[str]:
        return sorted(re.findall(r'"((?:xgrammar|apache-tvm-ffi)[<>=][^"]+)"', text))

    assert pins(README.read_text()) == pins((ROOT / ".ci" / "run").read_text()) != []


def test_torch_comes_from_pytorchs_cpu_index_in_the_quick_start_and_the_ci_script() -> None:
    """A pinned version alone is not the CPU build: PyPI's Linux x86_64 wheel of torch 2.13.0 is the CUDA one (527 MB,
    requiring cuda-toolkit, cuDNN and NCCL: GBs). PyTorch's CPU index, added to PyPI, serves `2.13.0+cpu`, which pip
    prefers to PyPI's `2.13.0` (a local version sorts above its public one); macOS and Windows wheels are CPU
    builds either way."""
    ci = re.sub(r"\\\n\s*", " ", (ROOT / ".ci" / "run").read_text())
    quick_start = " && ".join(next(b for b in SHELL if b.section.startswith("Quick start")).commands())
    for where, text in (("README", quick_start), (".ci/run", ci)):
        torch = [c for c in re.split(r"&&|\n", text) if "pip install" in c and re.search(r"\btorch==", c)]
        assert torch, f"{where} installs no pinned torch"
        for command in torch:
            words = shlex.split(command)
            assert "--extra-index-url" in words and words[words.index("--extra-index-url") + 1] == CPU_INDEX, (
                f"{where}: {command.strip()!r} takes PyPI's CUDA build on Linux"
            )
    assert "torch" in installs([f"pip install torch==2.13.0 --extra-index-url {CPU_INDEX}"])


def test_the_install_check_has_teeth() -> None:
    """The project alone does not bring the client the README's Python example imports: the bug this file guards."""
    assert "openai" in quick_start_installs() and "openai" not in installs(["pip install -e ."])


def test_every_shell_command_is_one_this_test_runs_or_checks() -> None:
    known = ("curl ", "batchserve serve", "batchserve compare", "python -m benchmarks ", ".ci/run", *INSTALL_WORDS)
    assert [command for command in COMMANDS if not command.startswith(known)] == []


@pytest.mark.parametrize(
    "command", [c for c in COMMANDS if c.startswith(("batchserve serve ", "batchserve compare "))], ids=str
)
def test_serve_and_compare_lines_parse_into_a_config(command: str) -> None:
    """Their flags exist, their values are in range and a plug-in policy loads: all a start checks before loading
    (starting each on the tiny model would add minutes; tests/api/test_cli.py starts one)."""
    args = build_parser().parse_args(shlex.split(command)[1:])
    if args.command == "serve":
        config_from_args(args)
    else:
        compare_config(args), compare_lineup(args)


def test_the_batchserve_commands_named_in_the_prose_parse() -> None:
    """A command written inline (`batchserve generate "Hello" --max-tokens 16`) is pasted as the blocks' are: its
    subcommand and flags exist."""
    inline = re.findall(r"`(batchserve [^`]+)`", re.sub(r"```.*?```", "", README.read_text(), flags=re.DOTALL))
    assert any(command.startswith("batchserve generate ") for command in inline)
    for command in inline:
        build_parser().parse_args(shlex.split(command)[1:])


@pytest.mark.slow
def test_the_curl_and_python_examples_run_against_a_live_server(live_server: tuple[str, Path], tmp_path: Path) -> None:
    url, import_log = live_server
    curls = [command for command in COMMANDS if command.startswith("curl ")]
    assert len(curls) >= 2
    for command in curls:
        run = subprocess.run(
            ["bash", "-c", command.replace(README_URL, url)], capture_output=True, text=True, timeout=120
        )
        assert run.returncode == 0 and '"choices"' in run.stdout and '"error"' not in run.stdout, (command, run)
    assert PYTHON
    for block in PYTHON:
        script = tmp_path / "readme_example.py"
        script.write_text(block.text.replace(README_URL, url))
        run = subprocess.run(
            [sys.executable, str(script)], env=subprocess_env(import_log), capture_output=True, text=True, timeout=120
        )
        assert run.returncode == 0, run.stderr[-3000:]
    assert undeclared(import_log) == [], "the Quick start does not install what these import"


def _benchmark_command_params() -> list[Any]:
    """One command per benchmark subcommand in the fast subset: the others run the same subcommand's imports again
    (a subprocess each, seconds of CPU), so they are slow and still run in the whole suite."""
    seen: set[str] = set()
    params = []
    for command in [c for c in COMMANDS if c.startswith("python -m benchmarks ")]:
        subcommand = shlex.split(command)[3]
        params.append(pytest.param(command, id=command, marks=[pytest.mark.slow] if subcommand in seen else []))
        seen.add(subcommand)
    return params


@pytest.mark.parametrize("command", _benchmark_command_params())
def test_benchmark_commands_parse_and_import_only_what_the_quick_start_installs(command: str, tmp_path: Path) -> None:
    """Run up to their argument parsing (`--help`: the real run loads the real model three times, minutes), which
    imports the command's modules."""
    import_log = tmp_path / "imports.log"
    argv = [sys.executable, *shlex.split(command)[1:], "--help"]
    run = subprocess.run(argv, cwd=ROOT, env=subprocess_env(import_log), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert undeclared(import_log) == [], "the Quick start does not install what this command imports"
