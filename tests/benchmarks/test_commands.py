"""`python -m benchmarks <command>`: the table lists every command without importing it, and each one's --help
shows its own flags under its own name."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import pytest

from benchmarks.__main__ import main as dispatch
from benchmarks.commands import BY_NAME, COMMANDS


def test_help_lists_every_command_without_importing_any() -> None:
    code = (
        "import sys; from benchmarks.__main__ import main; main(['--help']); "
        "loaded = [m for m in sys.modules if m.startswith('benchmarks.') and m not in "
        "('benchmarks.__main__', 'benchmarks.commands')]; "
        "heavy = [m for m in ('torch', 'matplotlib', 'transformers') if m in sys.modules]; "
        "print('LOADED', loaded, heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    for command in COMMANDS:
        assert f"  {command.name} " in out and command.summary in out
    assert "LOADED [] []" in out


def test_names_are_unique_and_unknown_commands_fail(capsys: pytest.CaptureFixture[str]) -> None:
    assert len(BY_NAME) == len(COMMANDS)
    assert dispatch(["no-such-command"]) == 2
    assert "unknown command 'no-such-command'" in capsys.readouterr().err
    assert dispatch([]) == 2


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_each_command_has_main_and_its_own_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    module = importlib.import_module(BY_NAME[name].module)
    assert list(inspect.signature(module.main).parameters) == ["argv"]
    with pytest.raises(SystemExit) as exit_:
        dispatch([name, "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m benchmarks {name}")
