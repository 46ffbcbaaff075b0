"""Keep torch's CPU work on one long-lived thread: the engine loop's.

torch's OpenMP runtime gives every thread that runs a parallel op its own pool of worker threads, and the pool
lives as long as that thread. While a second pool is alive (say the main thread's, left over from loading the
model), the engine pool's workers stop spinning between ops: they sleep and are woken for each of a step's
hundreds of parallel ops. Measured on 2 cores: a batch-1 decode step of the default model took 24 ms on the
loop thread after loading on the main thread, and 14 ms after loading on a thread that had ended. So the work
before the loop starts (loading, packing weights, allocating the cache) runs on a passing thread, whose pool
ends with it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

_Result = TypeVar("_Result")


def run_on_passing_thread(work: Callable[[], _Result], name: str = "batchserve-loader") -> _Result:
    """`work()` on a new thread that ends when it returns; its result, or its exception re-raised here."""
    outcome: list[_Result] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            outcome.append(work())
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=target, name=name)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return outcome[0]
