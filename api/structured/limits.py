"""The bounds on compiling a request's grammar: what a spec may cost before it is compiled, how long a compile may
run, and how many may wait. Each is a flag of `serve` (api/config.py); docs/structured_outputs.md explains them."""

from __future__ import annotations

import math
from dataclasses import dataclass

_MAX_COUNT = 2**31 - 1


@dataclass(frozen=True)
class GrammarLimits:
    max_bytes: int = 65_536  # the spec's text: a schema as compact JSON, a regex, a grammar
    max_depth: int = 128  # JSON nesting of a schema, through every keyword (objects and lists both count)
    max_refs: int = 256  # `$ref`s in a schema: a chain of them costs the compiler one expansion each
    max_repeat: int = 1_000  # the largest bound of a {m,n} repetition in a regex, a `pattern` or a grammar
    compile_timeout_s: float = 10.0  # a compile running longer is stopped (its worker killed) and refused
    compile_workers: int = 1  # worker processes compiling at once, at the lowest CPU priority
    max_pending: int = 16  # compiles running or waiting beyond this get a 429

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_depth", "max_refs", "max_repeat", "compile_workers", "max_pending"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MAX_COUNT:
                raise ValueError(f"{flag(name)} must be an integer from 1 to {_MAX_COUNT}, got {value!r}")
        timeout = self.compile_timeout_s
        if not (isinstance(timeout, int | float) and math.isfinite(timeout) and 0.01 <= timeout <= 3600):
            raise ValueError(f"{flag('compile_timeout_s')} must be from 0.01 to 3600 seconds, got {timeout!r}")
        if self.max_pending < self.compile_workers:
            raise ValueError(f"{flag('max_pending')} must be at least {flag('compile_workers')}")


def flag(name: str) -> str:
    """The `serve` flag that sets a field: ServerConfig's `grammar_<name>`."""
    return "--grammar-" + name.replace("_", "-")
