"""A peer's own virtual environment in the cache: peers whose pins fight this venv's (vLLM's CPU build, OpenVINO
GenAI) each get one, built once and marked when done."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PeerVenv:
    root: Path  # <cache>/<peer>/<version>
    version: str

    @property
    def venv(self) -> Path:
        return self.root / "venv"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def marker(self) -> Path:
        """Written last, after every install step: a venv without it is half built."""
        return self.venv / ".built"

    def is_built(self) -> bool:
        return self.marker.is_file() and self.python.exists()
