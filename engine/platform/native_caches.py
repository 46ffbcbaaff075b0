"""Bounds on the per-shape caches inside torch's oneDNN path, set before torch loads.

oneDNN keeps a compiled primitive per input shape (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`, default 1024) and torch's
ideep layer keeps its own per-shape objects on top (`LRU_CACHE_CAPACITY`, default 1024). A server sees a new
shape for every distinct prefill length and batch size, so both fill up over hours: measured, 600 distinct row
counts through eight prepacked float32 linears grew the process from 272 MB to 1370 MB, and a 30-minute mixed
soak grew by 24 % after its warm-up (docs/reliability.md). Each cache alone bounded does nothing (the other
still holds the primitives); both at 64 kept the same run at 539 MB, and re-creating a primitive costs nothing
measurable next to the matmul (`benchmarks/results/soak/`). Values already in the environment are kept.
"""

from __future__ import annotations

import os

CACHE_CAPACITY = 64
_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_native_caches(capacity: int = CACHE_CAPACITY) -> None:
    for name in _VARIABLES:
        os.environ.setdefault(name, str(capacity))
