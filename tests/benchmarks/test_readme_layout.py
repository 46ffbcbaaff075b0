"""benchmarks/README.md's Layout section names every module of the package, so a newcomer's map of it is whole and
a module that no longer earns its place is noticed when it is added."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "benchmarks"


def layout_section() -> str:
    text = (PACKAGE / "README.md").read_text()
    return text[text.index("## Layout") : text.index("\n## ", text.index("## Layout") + 1)]


def test_the_layout_names_every_module() -> None:
    named = set(re.findall(r"`([a-z0-9_]+)", layout_section()))
    modules = {path.stem for path in PACKAGE.rglob("*.py") if path.stem not in ("__init__", "__main__", "commands")}
    assert sorted(modules - named) == []
