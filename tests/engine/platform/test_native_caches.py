"""oneDNN's per-shape caches are bounded before torch loads (engine/platform/native_caches.py), and a value the operator
set is kept."""

from __future__ import annotations

import os
import subprocess
import sys

from engine.platform.native_caches import CACHE_CAPACITY

PROBE = "import engine, os; print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'], os.environ['LRU_CACHE_CAPACITY'])"


def _run(env: dict[str, str]) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    return subprocess.run(
        [sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True, check=True
    ).stdout.split()


def test_importing_the_engine_bounds_both_caches() -> None:
    assert _run({}) == [str(CACHE_CAPACITY), str(CACHE_CAPACITY)]


def test_an_operators_value_is_kept() -> None:
    assert _run({"LRU_CACHE_CAPACITY": "7"}) == [str(CACHE_CAPACITY), "7"]


def test_the_suite_runs_with_the_bounds_too() -> None:
    # tests/__init__.py imports the engine before anything imports torch
    assert "LRU_CACHE_CAPACITY" in os.environ and "ONEDNN_PRIMITIVE_CACHE_CAPACITY" in os.environ
