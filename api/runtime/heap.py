"""Keep the garbage collector off the loaded model.

A loaded server holds some 426,000 objects the cyclic collector tracks (the model's modules and parameters, the
tokenizer, the weight packs). Each full collection walks all of them while holding the GIL, which stops the
engine's loop thread and the API alike: 126 ms a collection on the 2-core Xeon (`benchmarks/scripts/gc_pause.py`,
benchmarks/results/gc_pause.json), and in a diagnostic server at 1 request/s ten while the model loaded and about
one a minute while serving. Loading therefore runs with the collector off, and what it built is then frozen
(moved to the permanent generation, which collections skip): a full collection afterwards walks only what serving
allocated since. Whatever the other threads hold at that moment (a few responses the event loop is writing) is
frozen too. Frozen objects that later form garbage cycles are never collected, so this is done once, after
loading, when nearly everything alive lives as long as the server, and only by a server that owns its process
(`batchserve serve`, `compare`, a Ray replica): an app built inside another program, a test among them, leaves
that program's heap alone. Then glibc's malloc_trim(0) hands the loader's freed memory (the format measurement's
candidate copies, the conversion's buffers) back to the OS, so resident memory settles at what serving holds.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import logging
from collections.abc import Iterator

logger = logging.getLogger("batchserve.server")


@contextlib.contextmanager
def frozen_after_loading(enabled: bool = True) -> Iterator[None]:
    """No collection while the body loads; then one, and everything still alive is frozen (if `enabled`, and
    only if the body loaded: a failure re-enables the collector and freezes nothing)."""
    if not enabled:
        yield
        return
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    except BaseException:
        if was_enabled:  # a failed load leaves nothing worth freezing: the server is about to exit
            gc.enable()
        raise
    gc.collect()  # the loader's own garbage goes now, not frozen with the model
    trim_heap()
    gc.freeze()
    if was_enabled:
        gc.enable()
    # Said where it happens: a Ray replica's log shows it too (its driver's ready line cannot see the replica's heap).
    logger.info("heap frozen after loading: %s objects the collector no longer walks", f"{gc.get_freeze_count():,}")


def trim_heap() -> bool:
    """Return the C heap's free pages to the OS (glibc's malloc_trim(0)); False where the C library has none
    (musl, macOS), which changes nothing but resident memory."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
