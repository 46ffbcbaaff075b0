"""The server's asyncio loop, with accept errors (out of descriptors) logged at most once a second.

When `accept()` fails with EMFILE and the like, asyncio logs the error with a traceback, once for every pending
connection on every retry, and schedules a retry each time: measured at ~14,000 lines a second. The connection cap
(api/process/connections.py) keeps the server below its descriptor limit; this keeps the log readable when something
else takes the descriptors anyway.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from typing import Any

from api.process.log_throttle import LogThrottle

logger = logging.getLogger("batchserve.server")

_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def is_accept_resource_error(context: dict[str, Any]) -> bool:
    """asyncio's report of a failed `accept()` on a listening socket for want of descriptors or memory."""
    exc = context.get("exception")
    return "socket" in context and isinstance(exc, OSError) and exc.errno in _OUT_OF_RESOURCES


class AcceptErrorHandler:
    """A loop exception handler: accept errors throttled to one line (no traceback); anything else as asyncio would."""

    def __init__(self, throttle: LogThrottle) -> None:
        self._throttle = throttle

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if not is_accept_resource_error(context):
            loop.default_exception_handler(context)
            return
        suppressed = self._throttle.admit()
        if suppressed is not None:
            logger.error(
                "cannot accept connections: %s (%d more accept errors since the last report); "
                "lower --max-connections or raise the descriptor limit (ulimit -n)",
                context["exception"],
                suppressed,
            )


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvicorn's loop factory (`loop="api.process.asyncio_loop:new_event_loop"`)."""
    loop = asyncio.SelectorEventLoop()
    loop.set_exception_handler(AcceptErrorHandler(LogThrottle(1.0)))
    return loop
