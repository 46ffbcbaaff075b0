"""What a client reads about the server itself: the model card (`/v1/models`, `/v1/models/{id}`) and `/version`
with the optional features this install has on."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

from api.runtime.build import ModelRuntime

_PACKAGE = "batchserve"
_PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def model_card(runtime: ModelRuntime, created: int) -> dict[str, object]:
    """OpenAI's model object with vLLM's additions (`root`, `parent`, `max_model_len`); `created`: when the server
    started, so the card is the same on every call."""
    return {
        "id": runtime.model_name,
        "object": "model",
        "created": created,
        "owned_by": "batchserve",
        "root": runtime.source,
        "parent": None,
        "max_model_len": runtime.max_model_len,
    }


def version_info(runtime: ModelRuntime) -> dict[str, object]:
    """vLLM's `{"version"}`, plus `features`: each feature that needs an optional package, and whether it is on."""
    return {"version": package_version(), "features": {"structured_outputs": runtime.grammars is not None}}


def package_version() -> str:
    """The installed package's version; from a source tree that was never installed, pyproject.toml's."""
    try:
        return importlib.metadata.version(_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        return str(tomllib.loads(_PYPROJECT.read_text())["project"]["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"
