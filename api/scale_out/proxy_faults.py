"""In Ray Serve's proxy: a request whose replica died still gets an answer in the single server's shapes.

Ray imports `proxy_middlewares` in the proxy process (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH), before the proxy
reports ready: this module stays light (Starlette and the error shape only, no model code).
"""

from __future__ import annotations

import json
import logging

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.protocol.errors import APIError

logger = logging.getLogger("batchserve.api")

_REPLICA_FAILED = "the replica serving this request failed; retry shortly"


class ProxyFaultMiddleware:
    """In the proxy: a replica that dies mid-request leaves an answer in the single server's shapes.

    Before any byte: an OpenAI-shaped 503 with Retry-After (another replica, or the restarted one, can take the
    retry). Mid-stream: an error event, then `[DONE]`, then the stream ends, as the server ends a stream it can no
    longer serve.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = finished = event_stream = False

        async def tracking_send(message: Message) -> None:
            nonlocal started, finished, event_stream
            if message["type"] == "http.response.start":
                started = True
                content_type = dict(message.get("headers", [])).get(b"content-type", b"")
                event_stream = content_type.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            logger.warning("the proxy failed on %s", scope.get("path"), exc_info=True)
        if finished:
            return
        try:
            if not started:
                error = APIError(503, _REPLICA_FAILED, headers={"Retry-After": "1"})
                await error.response()(scope, receive, send)
            elif event_stream:
                event = json.dumps(APIError(503, _REPLICA_FAILED).body())
                await send({"type": "http.response.body", "body": f"data: {event}\n\ndata: [DONE]\n\n".encode()})
        except Exception:  # the client is gone too: nothing left to tell
            pass


def proxy_middlewares() -> list[Middleware]:
    """The proxy's middlewares; Ray calls this (see the module's docstring)."""
    return [Middleware(ProxyFaultMiddleware)]
