"""Loaded at interpreter start by a subprocess whose PYTHONPATH starts with this folder (tests/test_readme.py): where
$BATCHSERVE_IMPORT_LOG is set, appends to that file the top-level name of every module that the project's code or
the `__main__` script imports from outside the standard library and the project, once each: what an install must
provide for that command to run."""

from __future__ import annotations

import builtins
import os
import sys
from typing import Any

_PROJECT = frozenset({"api", "engine", "scheduler", "benchmarks", "tests", "__main__"})


def _install(log: str) -> None:
    real_import = builtins.__import__
    seen: set[str] = set()

    def recording(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
        if level == 0 and globals is not None:
            top = name.partition(".")[0]
            importer = str(globals.get("__name__", "")).partition(".")[0]
            if importer in _PROJECT and top not in seen and top not in _PROJECT and top not in sys.stdlib_module_names:
                seen.add(top)
                with open(log, "a") as out:
                    out.write(f"{top}\n")
        return real_import(name, globals, locals, fromlist, level)

    builtins.__import__ = recording


if os.environ.get("BATCHSERVE_IMPORT_LOG"):
    _install(os.environ["BATCHSERVE_IMPORT_LOG"])
