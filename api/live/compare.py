"""`batchserve compare`: both batching modes side by side on one port, over one copy of the model's weights.

Each mode is a full `serve` app (its own engine and KV cache, scheduler, seats, metrics and generation service)
mounted at `/{mode}`, so its OpenAI API is `/{mode}/v1/...`. The root answers `/health` and `/metrics` for both,
the combined event stream `/v1/events`, `/v1/compare/modes` and the page. One `FairShareLoop` thread steps both
schedulers, least busy first, so each mode gets an equal share of the machine (docs/design.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from api.config import ServerConfig
from api.endpoints import app as serve_app
from api.endpoints.errors import APIError
from api.endpoints.metrics import ServerMetrics
from api.endpoints.middleware import EXCEPTION_HANDLERS, middleware_stack
from api.endpoints.service import GenerationService
from api.endpoints.state import Phase, Runtime
from api.live import page, stream_routes
from api.live.hub import EventHub
from api.process.drain import drain
from api.runtime.build import build_model_runtime, build_runner
from api.runtime.heap import frozen_after_loading
from api.scale_out.merge_metrics import LabelledMerge, exposition
from scheduler.config import Mode
from scheduler.fair_share import FairShareLoop

logger = logging.getLogger("batchserve.api")

MODES = (Mode.DYNAMIC.value, Mode.CONTINUOUS.value)


def mode_config(config: ServerConfig, mode: str) -> ServerConfig:
    return dataclasses.replace(config, mode=mode)


def _mode_app(config: ServerConfig) -> Starlette:
    """One mode's API, as `serve` has it; mounted under its prefix, started by the root's lifespan."""
    app = Starlette(
        routes=[
            *serve_app.openai_routes(),
            Route("/v1/events", stream_routes.events, methods=["GET"]),
        ],
        exception_handlers=EXCEPTION_HANDLERS,
    )
    app.state.config = config
    app.state.phase = Phase.LOADING
    app.state.replica = None
    app.state.event_modes = (config.mode,)
    app.state.mode_entries = (stream_routes.mode_entry(config, f"/{config.mode}"),)
    return app


def create_compare_app(
    config: ServerConfig, loader: serve_app.ModelLoader = serve_app.default_loader, freeze_heap: bool = False
) -> Starlette:
    mode_apps = {mode: _mode_app(mode_config(config, mode)) for mode in MODES}

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        hub = EventHub(asyncio.get_running_loop(), time.monotonic(), time.monotonic)
        for target in (app, *mode_apps.values()):
            target.state.events = hub
        thread = threading.Thread(target=_load, args=(app, mode_apps, config, loader, freeze_heap), daemon=True)
        thread.name = "batchserve-loader"
        thread.start()
        yield
        await drain_all(app)

    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/v1/events", stream_routes.events, methods=["GET"]),
            Route("/v1/compare/modes", stream_routes.compare_modes, methods=["GET"]),
            Route("/", page.index, methods=["GET"]),
            Route("/static/{name}", page.static_file, methods=["GET"]),
            *(Mount(f"/{mode}", app=mode_app) for mode, mode_app in mode_apps.items()),
        ],
        middleware=middleware_stack(config),
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lifespan,
    )
    app.state.config = config
    app.state.phase = Phase.LOADING
    app.state.ready = threading.Event()
    app.state.mode_apps = mode_apps
    app.state.event_modes = MODES
    app.state.mode_entries = tuple(e for m in mode_apps.values() for e in m.state.mode_entries)
    return app


def _load(
    app: Starlette,
    mode_apps: dict[str, Starlette],
    config: ServerConfig,
    loader: serve_app.ModelLoader,
    freeze_heap: bool,
) -> None:
    """Load the model once; build one runner (one copy of the weights) and, per mode, its own engine and cache."""
    try:
        with frozen_after_loading(freeze_heap):
            fair, runtimes = _build_runtimes(mode_apps, config, loader)
        fair.start()
    except Exception:
        logger.exception("failed to load the model")
        app.state.phase = Phase.FAILED
        for mode_app in mode_apps.values():
            mode_app.state.phase = Phase.FAILED
        app.state.ready.set()
        return
    hub: EventHub = app.state.events
    for mode, mode_app in mode_apps.items():
        hub.add_source(stream_routes.mode_source(mode_app.state.config, runtimes[mode]))
        mode_app.state.runtime = runtimes[mode]
        mode_app.state.phase = Phase.READY
    app.state.runtime = runtimes[MODES[1]]  # what `serve`'s announcement reads: the model's name
    app.state.phase = Phase.READY
    app.state.ready.set()


def _build_runtimes(
    mode_apps: dict[str, Starlette], config: ServerConfig, loader: serve_app.ModelLoader
) -> tuple[FairShareLoop, dict[str, Runtime]]:
    """Both modes' runtimes over one runner, behind one fair-share loop (not started)."""
    loaded = loader(config)
    runner = build_runner(config.runtime_options(), loaded)
    models = {}
    for mode, mode_app in mode_apps.items():
        options = mode_app.state.config.runtime_options()
        metrics = ServerMetrics(mode, options.model_name(loaded.source))
        models[mode] = (build_model_runtime(options, loaded, on_step=metrics.observe_step, runner=runner), metrics)
    fair = FairShareLoop([model.scheduler for model, _ in models.values()])
    runtimes: dict[str, Runtime] = {}
    for mode, (model, mode_metrics) in models.items():
        counts = model.scheduler.counts
        mode_metrics.bind_gauges(
            running=lambda c=counts: c().running,  # type: ignore[misc]
            waiting=lambda c=counts: c().waiting,  # type: ignore[misc]
            cache_usage=lambda c=counts: c().cache_usage,  # type: ignore[misc]
        )
        shared = dataclasses.replace(model, loop=fair.handle(model.scheduler))
        service = GenerationService(shared.loop, model.tokenizer, mode_metrics, config.request_timeout_s)
        runtimes[mode] = Runtime.serving(shared, service, mode_metrics)
    return fair, runtimes


async def drain_all(app: Starlette) -> None:
    """Drain both modes at once (SIGTERM or the end of the lifespan); idempotent."""
    config: ServerConfig = app.state.config
    if app.state.phase is Phase.READY:
        app.state.phase = Phase.DRAINING
    await asyncio.gather(*(drain(m, config.shutdown_grace_s) for m in app.state.mode_apps.values()))


async def health(request: Request) -> Response:
    """200 when both modes serve; otherwise 503 with each mode's state."""
    states = {}
    for mode, mode_app in request.app.state.mode_apps.items():
        phase: Phase = mode_app.state.phase
        alive = phase is Phase.READY and mode_app.state.runtime.loop.alive
        states[mode] = "ok" if alive else phase.value
    if all(state == "ok" for state in states.values()):
        return JSONResponse({"status": "ok", "modes": states})
    retry = {"Retry-After": "5"} if request.app.state.phase in (Phase.LOADING, Phase.DRAINING) else None
    status = request.app.state.phase.value if request.app.state.phase is not Phase.READY else "degraded"
    return JSONResponse({"status": status, "modes": states}, status_code=503, headers=retry)


async def metrics(request: Request) -> Response:
    if request.app.state.phase is not Phase.READY:
        raise APIError(503, "the model is still loading; retry shortly", headers={"Retry-After": "5"})
    # each family once, with both modes' series (already labelled `mode`); `/{mode}/metrics` shows one mode's alone
    sources = ((mode, m.state.runtime.metrics.registry.collect()) for mode, m in request.app.state.mode_apps.items())
    body = exposition(LabelledMerge(sources, "mode"))
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")
