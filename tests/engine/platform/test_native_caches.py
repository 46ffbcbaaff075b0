"""oneDNN's per-shape caches are bounded before torch loads (engine/platform/native_caches.py), and a value the operator
set is kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.platform.native_caches import CACHE_CAPACITY, bound_native_caches

PROBE = "import engine, os; print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'], os.environ['LRU_CACHE_CAPACITY'])"


def _run(env: dict[str, str]) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    return subprocess.run(
        [sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True, check=True
    ).stdout.split()


def test_importing_the_engine_bounds_both_caches() -> None:
    # A fresh process: this one imported the engine long ago, and only a first import runs the bounds.
    assert _run({}) == [str(CACHE_CAPACITY), str(CACHE_CAPACITY)]


def test_an_operators_value_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    # In-process: the bounds are set by one call, which the fresh import above is shown to make.
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    bound_native_caches()
    values = [os.environ[name] for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")]
    assert values == [str(CACHE_CAPACITY), "7"]


def test_the_suite_runs_with_the_bounds_too() -> None:
    # tests/__init__.py imports the engine before anything imports torch
    assert "LRU_CACHE_CAPACITY" in os.environ and "ONEDNN_PRIMITIVE_CACHE_CAPACITY" in os.environ
