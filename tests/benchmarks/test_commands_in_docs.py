"""Every `python -m benchmarks ...` command line in the README and the current docs still parses: its command exists
and answers `--help`. (docs/notes/ is historical and exempt.)

The listing and each documented prefix go through the real dispatcher (`python -m benchmarks`'s `main`)
in-process (one interpreter, not one per command: each would import torch again)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from benchmarks.__main__ import main as dispatch

ROOT = Path(__file__).resolve().parents[2]
INVOCATION = "python -m benchmarks"


def documents() -> list[Path]:
    docs = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [doc for doc in docs if doc.exists()]


def command_prefixes(text: str) -> set[tuple[str, ...]]:
    """The words after the invocation up to the first option (the command and any sub-command or positional)."""
    text = re.sub(r"\\\n\s*", " ", text)  # shell line continuations
    prefixes = set()
    for match in re.finditer(re.escape(INVOCATION) + r"((?: +[^\s`|;&<>()]+)*)", text):
        try:
            words = shlex.split(match.group(1))
        except ValueError:
            words = match.group(1).split()
        prefix = []
        for word in words:
            if word.startswith("-") or not re.fullmatch(r"[\w./:=-]+", word):
                break
            prefix.append(word)
        if prefix:
            prefixes.add(tuple(prefix))
    return prefixes


DOCUMENTED = sorted(set().union(*(command_prefixes(doc.read_text()) for doc in documents())))


def test_the_docs_name_benchmark_commands() -> None:
    assert {prefix[0] for prefix in DOCUMENTED} >= {"ab", "simulate", "fit-cost", "llama-probe"}


def test_help_lists_every_documented_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert dispatch(["--help"]) == 0  # in-process: test_commands.py runs it in a fresh interpreter for its imports
    listing = capsys.readouterr().out
    names = {prefix[0] for prefix in DOCUMENTED}
    missing = sorted(name for name in names if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", listing))
    assert missing == []


@pytest.mark.parametrize("prefix", DOCUMENTED, ids=" ".join)
def test_documented_command_answers_help(prefix: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = dispatch([*prefix, "--help"])
    except SystemExit as exit_:  # argparse's --help exits
        code = exit_.code
    out, err = capsys.readouterr()
    assert code in (0, None), err[-2000:]
    assert "usage:" in out


def test_every_script_the_docs_name_exists() -> None:
    """A one-off script (benchmarks/scripts/, outside the dispatcher) that a doc tells the reader to run is there."""
    named = {
        name for doc in documents() for name in re.findall(r"benchmarks/scripts/[a-z0-9_]+\.(?:py|sh)", doc.read_text())
    }
    assert "benchmarks/scripts/gc_pause.py" in named
    assert sorted(name for name in named if not (ROOT / name).is_file()) == []
