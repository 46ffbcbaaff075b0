"""Graceful shutdown: stop intake, let running requests finish within the grace period, end the rest with a 503.

`drain()` runs while the server still listens (see `api.cli`), so a request or /health that arrives meanwhile gets
503 with Retry-After rather than a refused connection.
"""

from __future__ import annotations

import asyncio
import logging
import time

from api.endpoints.state import Phase, Runtime, ServerState

logger = logging.getLogger("batchserve.api")

_POLL_S = 0.05
# After the grace period the loop thread ends what is left at its next step boundary: wait for a step in progress.
_STEP_WAIT_S = 10.0


def begin_drain(state: ServerState) -> None:
    """Stop taking requests: /health and new requests get 503, requests never started get 503 now, and in dynamic
    mode finished answers are no longer held for their batch. Running requests go on."""
    if state.phase is Phase.READY:
        state.phase = Phase.DRAINING
        runtime = state.loaded()
        runtime.loop.begin_drain()
        if runtime.grammars is not None:
            runtime.grammars.close()  # a compile in progress is killed: shutdown never waits for one


async def drain(state: ServerState, grace_s: float) -> None:
    """Drain, wait until no request is left or `grace_s` passed, end what is left with SHUTDOWN (an error event
    then [DONE] on a stream, a 503 otherwise), then stop the engine loop. Idempotent."""
    runtime = state.runtime
    begin_drain(state)
    if runtime is None:
        return
    await _until_idle(runtime, time.monotonic() + grace_s)
    if runtime.scheduler.counts().pending_work:
        logger.warning("shutdown grace period of %s s is over: ending the requests still running", grace_s)
        runtime.loop.shutdown()
        await _until_idle(runtime, time.monotonic() + _STEP_WAIT_S)
    await asyncio.to_thread(runtime.loop.stop)  # off the event loop: responses are still being written


async def _until_idle(runtime: Runtime, deadline: float) -> None:
    while runtime.scheduler.counts().pending_work and runtime.loop.alive and time.monotonic() < deadline:
        await asyncio.sleep(_POLL_S)
