"""Every command line a cited result records (its "Reproduce" line in report.md, its `command` in result.json)
still parses with today's `python -m benchmarks`: the command exists and takes every flag and value given.

Each line goes through the real dispatcher in-process; the command's own argparse parser checks it, and the run
stops right after parsing (nothing is measured)."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from benchmarks.__main__ import main as dispatch

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
LINE = re.compile(r"python -m benchmarks ([a-z][a-z-]*)(?=\s|$)([^`\n]*)")  # to the end of its line or code span


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


def recorded_lines() -> list[tuple[str, str]]:
    lines = set()
    for path in sorted(RESULTS.rglob("*")):
        if path.suffix not in (".md", ".json", ".txt") or not path.is_file():
            continue
        raw = path.read_text(errors="replace")
        texts = strings(json.loads(raw)) if path.suffix == ".json" else [re.sub(r"\\\n\s*", " ", raw)]
        for text in texts:
            for match in LINE.finditer(text):
                command = match.group(0).removeprefix("python -m benchmarks ").strip()
                lines.add((str(path.relative_to(RESULTS).parent), command))
    return sorted(lines)


LINES = recorded_lines()


def test_results_record_their_commands() -> None:
    assert len(LINES) > 50 and {line.split()[0] for _, line in LINES} >= {"ab", "simulate", "fit-cost", "ray"}


@pytest.mark.parametrize(("folder", "line"), LINES, ids=[f"{folder}: {line[:60]}" for folder, line in LINES])
def test_recorded_command_parses_today(folder: str, line: str, monkeypatch: pytest.MonkeyPatch) -> None:
    parse_known = argparse.ArgumentParser.parse_known_args

    def parse_then_stop(self: argparse.ArgumentParser, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        namespace, extras = parse_known(self, args, namespace)
        if extras:  # an unknown flag: argparse's own error (exit code 2)
            return namespace, extras
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", parse_then_stop)
    try:
        code = dispatch(shlex.split(line))
    except Parsed:
        return
    except SystemExit as exit_:
        code = exit_.code
    pytest.fail(f"{folder}: `python -m benchmarks {line}` did not parse (exit {code})")
