"""What wraps every app of the server (`serve`'s, `compare`'s root and its modes): the API key, the 500 that keeps
the connection open, CORS, and the handlers that answer errors in OpenAI's shape (in Anthropic's on the Messages
API's paths)."""

from __future__ import annotations

import hmac
import logging
from urllib.parse import parse_qsl

from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, ExceptionHandler, Message, Receive, Scope, Send

from api.config import ServerConfig
from api.protocol.errors import APIError
from api.protocol.messages_api import error_response, is_messages_path

logger = logging.getLogger("batchserve.api")


def _canonical_bearer(credentials: bytes) -> bytes:
    """The scheme is case-insensitive (RFC 9110, 11.1): `bearer KEY` is `Bearer KEY`. The key is left as sent."""
    scheme, space, token = credentials.partition(b" ")
    return b"Bearer " + token if space and scheme.lower() == b"bearer" else credentials


class APIKeyMiddleware:
    """Every endpoint but /health and the page needs the key: `Authorization: Bearer <key>`, or `x-api-key: <key>`
    as Anthropic's clients send it; compared in constant time, and every key sent must be the one. The event streams
    also take `?api_key=`: a browser's EventSource cannot send headers."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str]) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self._open_paths:
            refused = self._refusal(scope)
            if refused is not None:
                response = error_response(refused) if is_messages_path(scope["path"]) else refused.response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> APIError | None:
        headers = [value for name, value in scope["headers"] if name == b"authorization"]
        keys = [b"Bearer " + value for name, value in scope["headers"] if name == b"x-api-key"]
        source = "Authorization headers"
        if not headers and not keys and scope["path"].endswith("/v1/events"):
            headers = [b"Bearer " + key.encode() for key in _query_keys(scope)]
            source = "api_key query parameters"
        for sent, where in ((headers, source), (keys, "x-api-key headers")):
            if len(sent) > 1:  # which one would count is ambiguous (proxies differ): refuse rather than guess
                return APIError(400, f"the request has {len(sent)} {where}; send exactly one", code="invalid_header")
        supplied = [_canonical_bearer(header) for header in headers] + keys or [b""]  # none: compared all the same
        if not all(hmac.compare_digest(key, self._expected) for key in supplied):
            return APIError(
                401,
                "a valid API key is required: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                code="invalid_api_key",
            )
        return None


def _query_keys(scope: Scope) -> list[str]:
    pairs = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
    return [value for name, value in pairs if name == "api_key"]


class InternalErrorMiddleware:
    """Answer an unhandled exception with an OpenAI-shaped 500 and keep the connection open.

    Starlette's own 500 handler re-raises after answering, and uvicorn then closes the keep-alive connection,
    so the same client's next request on it could fail with a reset. Once a response has started (a stream)
    there is no clean answer left: the exception propagates and the connection closes.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            if started:
                raise
            logger.exception("unhandled error on %s", scope.get("path"))
            await _INTERNAL_ERROR.response()(scope, receive, send)


_INTERNAL_ERROR = APIError(500, "internal server error; the server is still serving")


def _answer(request: Request, error: APIError) -> Response:
    """In the shape of the API the path belongs to: Anthropic's on the Messages API's paths, OpenAI's elsewhere."""
    return error_response(error) if is_messages_path(request.url.path) else error.response()


async def api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return _answer(request, exc)


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return _answer(request, APIError(404, f"no route for {request.method} {request.url.path}"))
    if exc.status_code == 405:
        return _answer(request, APIError(405, f"method {request.method} is not allowed on {request.url.path}"))
    return _answer(request, APIError(exc.status_code, str(exc.detail)))


async def internal_error(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error on %s", request.url.path, exc_info=exc)
    return _INTERNAL_ERROR.response()


EXCEPTION_HANDLERS: dict[type[Exception], ExceptionHandler] = {
    APIError: api_error,
    HTTPException: http_error,
    Exception: internal_error,
}


def middleware_stack(config: ServerConfig, open_paths: frozenset[str]) -> list[Middleware]:
    """CORS (only with origins configured), then the 500s inside it so they carry CORS headers, then the API key,
    asked on every path but `open_paths` (/health, and the page and its files: they hold no data)."""
    middleware = []
    if config.cors_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(config.cors_origins),
                allow_methods=["GET", "POST"],
                allow_headers=["*"],
            )
        )
    middleware.append(Middleware(InternalErrorMiddleware))
    if config.api_key:
        middleware.append(Middleware(APIKeyMiddleware, api_key=config.api_key, open_paths=open_paths))
    return middleware
