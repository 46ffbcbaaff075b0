"""The Starlette application: routes, auth, errors, and the model's lifecycle (load, serve, drain)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.routing import Route

from api.config import ServerConfig
from api.endpoints import routes
from api.endpoints.metrics import ServerMetrics
from api.endpoints.middleware import EXCEPTION_HANDLERS, middleware_stack
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

    app = Starlette(
        routes=[
            *openai_routes(),
            *event_routes_for_serve(),
        ],
        middleware=middleware_stack(config),
        exception_handlers=EXCEPTION_HANDLERS,
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
