"""Every command line a cited result records (its "Reproduce" line in report.md, its `command` in result.json)
still parses with today's `python -m benchmarks`: the command exists and takes every flag and value given. A line
that runs a one-off script (`python benchmarks/scripts/NAME.py ...`, outside the dispatcher) names a script that
exists and takes those flags.

Each line goes through the real dispatcher, or the script's own `main`, in-process; the command's own argparse parser
checks it, and the run stops right after parsing (nothing is measured)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from benchmarks.__main__ import main as dispatch

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
LINE = re.compile(r"python -m benchmarks ([a-z][a-z-]*)(?=\s|$)([^`\n]*)")  # to the end of its line or code span
SCRIPT_LINE = re.compile(r"python (benchmarks/scripts/[a-z_]+\.py)(?=\s|$)([^`\n]*)")


class Parsed(Exception):
    """Raised by the patched parser once the arguments parsed: the command stops before it measures anything."""


def strings(value: Any) -> list[str]:
    """Every string in a parsed JSON document."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [text for item in value.values() for text in strings(item)]
    if isinstance(value, list):
        return [text for item in value for text in strings(item)]
    return []


def recorded_lines(pattern: re.Pattern[str] = LINE, prefix: str = "python -m benchmarks ") -> list[tuple[str, str]]:
    lines = set()
    for path in sorted(RESULTS.rglob("*")):
        if path.suffix not in (".md", ".json", ".txt") or not path.is_file():
            continue
        raw = path.read_text(errors="replace")
        texts = strings(json.loads(raw)) if path.suffix == ".json" else [re.sub(r"\\\n\s*", " ", raw)]
        for text in texts:
            for match in pattern.finditer(text):
                command = match.group(0).removeprefix(prefix).strip()
                lines.add((str(path.relative_to(RESULTS).parent), command))
    return sorted(lines)


LINES = recorded_lines()
SCRIPT_LINES = recorded_lines(SCRIPT_LINE, "python ")


def test_results_record_their_commands() -> None:
    assert len(LINES) > 50 and {line.split()[0] for _, line in LINES} >= {"ab", "simulate", "fit-cost", "ray"}


def parses(run: Callable[[], Any], monkeypatch: pytest.MonkeyPatch) -> tuple[bool, Any]:
    """Runs a command with argparse patched to stop once its arguments parsed: (parsed, exit code otherwise)."""
    parse_known = argparse.ArgumentParser.parse_known_args

    def parse_then_stop(self: argparse.ArgumentParser, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        namespace, extras = parse_known(self, args, namespace)
        if extras:  # an unknown flag: argparse's own error (exit code 2)
            return namespace, extras
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", parse_then_stop)
    try:
        return False, run()
    except Parsed:
        return True, None
    except SystemExit as exit_:
        return False, exit_.code


@pytest.mark.parametrize(("folder", "line"), LINES, ids=[f"{folder}: {line[:60]}" for folder, line in LINES])
def test_recorded_command_parses_today(folder: str, line: str, monkeypatch: pytest.MonkeyPatch) -> None:
    parsed, code = parses(lambda: dispatch(shlex.split(line)), monkeypatch)
    assert parsed, f"{folder}: `python -m benchmarks {line}` did not parse (exit {code})"


def test_results_record_their_script_runs() -> None:
    assert {line.split()[0] for _, line in SCRIPT_LINES} >= {"benchmarks/scripts/gc_pause.py"}


@pytest.mark.parametrize(
    ("folder", "line"), SCRIPT_LINES, ids=[f"{folder}: {line[:60]}" for folder, line in SCRIPT_LINES]
)
def test_recorded_script_run_parses_today(folder: str, line: str, monkeypatch: pytest.MonkeyPatch) -> None:
    script, *args = shlex.split(line)
    path = ROOT / script
    assert path.is_file(), f"{folder}: `python {line}`: no such script"
    spec = importlib.util.spec_from_file_location(f"_script_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)  # defines main; runs nothing (its __name__ is not "__main__")
    parsed, code = parses(lambda: module.main(args), monkeypatch)
    assert parsed, f"{folder}: `python {line}` did not parse (exit {code})"
