"""Graceful shutdown: stop intake, let running requests finish within the grace period, end the rest with a 503.

`drain()` runs while the server still listens (see `api.cli`), so a request or /health that arrives meanwhile gets
503 with Retry-After rather than a refused connection. `cut_short()` (a second SIGTERM or Ctrl-C) ends the grace
period now: what still runs is ended the same way, and the shutdown goes on as usual, cleanly.
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


def cut_short(state: ServerState) -> None:
    """End the grace period of `state`'s drain (and of its modes', in `compare`) now."""
    for each in (state, *state.modes.values()):
        each.cut_short = True


async def drain(state: ServerState, grace_s: float, label: str = "") -> None:
    """Drain, wait until no request is left, `grace_s` passed or `cut_short`, end what is left with SHUTDOWN (an
    error event then [DONE] on a stream, a 503 otherwise), then stop the engine loop. Idempotent: only the first
    call logs what became of the requests (`label`: the mode's name, in `compare`)."""
    runtime = state.runtime
    first = state.phase is Phase.READY
    begin_drain(state)
    if runtime is None:
        return
    prefix = f"{label}: " if label else ""
    running = runtime.scheduler.counts().running
    if first and running:
        logger.info(
            "%sstopping: letting %d running request(s) finish, for up to %g s (SIGTERM or Ctrl-C again ends them now)",
            prefix,
            running,
            grace_s,
        )
    await _until_idle(state, runtime, time.monotonic() + grace_s)
    counts = runtime.scheduler.counts()
    if counts.pending_work:
        why = "stopping now" if state.cut_short else f"the shutdown grace period of {grace_s:g} s is over"
        logger.warning(
            "%s%s: ending the requests still running (%d) or waiting (%d) with a 503",
            prefix,
            why,
            counts.running,
            counts.waiting,
        )
        runtime.loop.shutdown()
        await _until_idle(None, runtime, time.monotonic() + _STEP_WAIT_S)
    elif first and running:
        logger.info("%severy running request finished", prefix)
    await asyncio.to_thread(runtime.loop.stop)  # off the event loop: responses are still being written


async def _until_idle(state: ServerState | None, runtime: Runtime, deadline: float) -> None:
    """Until no work is left, the loop died, the deadline passed, or (given `state`) the drain is cut short."""
    while runtime.scheduler.counts().pending_work and runtime.loop.alive and time.monotonic() < deadline:
        if state is not None and state.cut_short:
            return
        await asyncio.sleep(_POLL_S)
