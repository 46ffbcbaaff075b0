"""The bounds on compiling a request's grammar: what a spec may cost before it is compiled, how long a compile may
run, and how many may wait. Each is a flag of `serve` (api/config.py); docs/structured_outputs.md explains them."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.ranges import QUEUE, Range

# Each limit's range (one definition: GrammarLimits checks it, and ServerConfig's `grammar_*` flags with it).
RANGES = {
    "max_bytes": Range(1, 1 << 30, integer=True),
    "max_depth": QUEUE,
    "max_refs": QUEUE,
    "max_repeat": QUEUE,
    "compile_timeout_s": Range(0.01, 3600),
    "compile_workers": Range(1, 64, integer=True),
    "max_pending": QUEUE,
}


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
        for name, bounds in RANGES.items():
            bounds.check(flag(name), getattr(self, name))


def flag(name: str) -> str:
    """The `serve` flag that sets a field: ServerConfig's `grammar_<name>`."""
    return "--grammar-" + name.replace("_", "-")
