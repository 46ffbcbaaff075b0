"""The Starlette application: routes, auth, errors, and the model's lifecycle (load, serve, drain)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from urllib.parse import parse_qsl

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.config import ServerConfig
from api.endpoints import routes
from api.endpoints.errors import APIError
from api.endpoints.metrics import ServerMetrics
from api.endpoints.service import GenerationService
from api.endpoints.state import Phase, Runtime
from api.live import page, stream_routes
from api.live.hub import EventHub
from api.process.drain import drain
from api.runtime.build import build_model_runtime, load
from api.runtime.heap import frozen_after_loading
from engine.loader import LoadedModel

logger = logging.getLogger("batchserve.api")

ModelLoader = Callable[[ServerConfig], LoadedModel]


def default_loader(config: ServerConfig) -> LoadedModel:
    return load(config.runtime_options())


def build_runtime(config: ServerConfig, loaded: LoadedModel) -> Runtime:
    """The model's runtime (see `api.runtime.build`) with the server's metrics and generation service."""
    options = config.runtime_options()
    metrics = ServerMetrics(config.mode, options.model_name(loaded.source))
    model = build_model_runtime(options, loaded, on_step=metrics.observe_step)
    counts = model.scheduler.counts  # a snapshot published by the loop thread: safe to read from this one
    metrics.bind_gauges(
        running=lambda: counts().running,
        waiting=lambda: counts().waiting,
        cache_usage=lambda: counts().cache_usage,
    )
    service = GenerationService(model.loop, model.tokenizer, metrics, config.request_timeout_s)
    return Runtime.serving(model, service, metrics)


def _canonical_bearer(credentials: bytes) -> bytes:
    """The scheme is case-insensitive (RFC 9110, 11.1): `bearer KEY` is `Bearer KEY`. The key is left as sent."""
    scheme, space, token = credentials.partition(b" ")
    return b"Bearer " + token if space and scheme.lower() == b"bearer" else credentials


def _open_path(path: str) -> bool:
    """/health, and the page and its files: the page holds no data and asks for the key itself."""
    return path in ("/health", "/") or path.startswith("/static/")


class APIKeyMiddleware:
    """Every endpoint but /health and the page needs `Authorization: Bearer <key>`, compared in constant time.
    The event streams also take `?api_key=`: a browser's EventSource cannot send headers."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not _open_path(scope["path"]):
            headers = [value for name, value in scope["headers"] if name == b"authorization"]
            source = "Authorization headers"
            if not headers and scope["path"].endswith("/v1/events"):
                headers = [b"Bearer " + key.encode() for key in _query_keys(scope)]
                source = "api_key query parameters"
            if len(headers) > 1:  # which one would count is ambiguous (proxies differ): refuse rather than guess
                message = f"the request has {len(headers)} {source}; send exactly one"
                duplicate = APIError(400, message, code="invalid_header")
                await duplicate.response()(scope, receive, send)
                return
            supplied = _canonical_bearer(headers[0]) if headers else b""
            if not hmac.compare_digest(supplied, self._expected):
                error = APIError(
                    401, "a valid API key is required: send 'Authorization: Bearer <key>'", code="invalid_api_key"
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


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


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return APIError(404, f"no route for {request.method} {request.url.path}").response()
    if exc.status_code == 405:
        return APIError(405, f"method {request.method} is not allowed on {request.url.path}").response()
    return APIError(exc.status_code, str(exc.detail)).response()


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error on %s", request.url.path, exc_info=exc)
    return _INTERNAL_ERROR.response()


def event_routes_for_serve() -> list[Route]:
    """The event stream, the modes and the page (`batchserve compare` mounts its own; see api/live/compare.py)."""
    return [
        Route("/v1/events", stream_routes.events, methods=["GET"]),
        Route("/v1/compare/modes", stream_routes.compare_modes, methods=["GET"]),
        Route("/", page.index, methods=["GET"]),
        Route("/static/{name}", page.static_file, methods=["GET"]),
    ]


def openai_routes() -> list[Route]:
    """One mode's API: what `serve` answers at its root, and `compare` under each mode's prefix."""
    return [
        Route("/v1/completions", routes.completions, methods=["POST"]),
        Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
        Route("/v1/models", routes.models, methods=["GET"]),
        Route("/health", routes.health, methods=["GET"]),
        Route("/metrics", routes.metrics, methods=["GET"]),
    ]


def create_app(config: ServerConfig, loader: ModelLoader = default_loader, freeze_heap: bool = False) -> Starlette:
    """The server's app. `freeze_heap`: the app owns its process, whose heap is frozen after loading
    (api.runtime.heap)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        app.state.phase = Phase.LOADING
        app.state.events = EventHub(asyncio.get_running_loop(), time.monotonic(), time.monotonic)
        thread = threading.Thread(
            target=_load, args=(app, config, loader, freeze_heap), name="batchserve-loader", daemon=True
        )
        thread.start()
        yield
        await drain(app, config.shutdown_grace_s)  # at once if the server already drained on a signal

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
    middleware.append(Middleware(InternalErrorMiddleware))  # inside CORS, so its 500s carry CORS headers
    if config.api_key:
        middleware.append(Middleware(APIKeyMiddleware, api_key=config.api_key))
    app = Starlette(
        routes=[
            *openai_routes(),
            *event_routes_for_serve(),
        ],
        middleware=middleware,
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _internal_error},
        lifespan=lifespan,
    )
    app.state.config = config
    app.state.phase = Phase.LOADING
    app.state.ready = threading.Event()
    app.state.replica = None  # set by api.scale_out.ray_serve: the replica's name in every response's timings
    app.state.event_modes = (config.mode,)
    app.state.mode_entries = (stream_routes.mode_entry(config, ""),)
    return app


def _load(app: Starlette, config: ServerConfig, loader: ModelLoader, freeze_heap: bool) -> None:
    try:
        with frozen_after_loading(freeze_heap):
            runtime = build_runtime(config, loader(config))
        runtime.loop.start()
    except Exception:
        logger.exception("failed to load the model")
        app.state.phase = Phase.FAILED
        app.state.ready.set()
        return
    app.state.events.add_source(stream_routes.mode_source(config, runtime))
    app.state.runtime = runtime
    app.state.phase = Phase.READY
    app.state.ready.set()
