"""`batchserve compare`: batching modes side by side on one port, over one copy of the model's weights.

Each entry of the line-up (`--modes`, default dynamic,continuous; a built-in mode or a plug-in policy, see
scheduler/lineup.py) is a full `serve` app (its own engine and KV cache, scheduler, seats, metrics and generation
service) mounted at `/{name}`, so its OpenAI API is `/{name}/v1/...`. The root answers `/health` and `/metrics` for
all, the combined event stream `/v1/events`, `/v1/compare/modes`, the page and its workload
(`/v1/compare/workload`, api/live/workload.py). One `FairShareLoop` thread steps every scheduler, least busy
first, so each gets an equal share of the machine (docs/design.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from api.apps import serve as serve_app
from api.apps.loading import (
    PREPARING,
    ModelLoader,
    default_loader,
    load_in_background,
    metered_model,
    serving_runtime,
)
from api.config import ServerConfig
from api.endpoints.event_hub import EventHub
from api.endpoints.merge_metrics import LabelledMerge, exposition
from api.endpoints.middleware import EXCEPTION_HANDLERS, middleware_stack
from api.endpoints.state import Phase, Runtime, ServerState
from api.live import page, stream_routes
from api.process.drain import drain
from api.protocol.errors import APIError
from api.runtime.build import build_runner
from api.structured.grammars import CompileWorkers
from engine.phases import phase
from scheduler.config import Mode
from scheduler.fair_share import FairShareLoop
from scheduler.lineup import DEFAULT, Entry, parse_lineup

logger = logging.getLogger("batchserve.api")

DEFAULT_LINEUP = parse_lineup(DEFAULT)


def mode_config(config: ServerConfig, entry: Entry, split: bool = False) -> ServerConfig:
    """The entry's server: its mode's seats and settings, and its plug-in policy if it is one.
    --priority-preemption is continuous mode's flag, as --max-num-seqs is: the other panes go without it.
    `split`: the line-up has `<mode>-spec` panes, and only those get --speculative-config (else every pane does)."""
    preemption = config.priority_preemption and entry.mode is Mode.CONTINUOUS
    speculative = config.speculative_config if entry.speculative or not split else None
    return dataclasses.replace(
        config,
        mode=entry.mode.value,
        policy=entry.policy,
        priority_preemption=preemption,
        speculative_config=speculative,
    )


def _mode_app(config: ServerConfig, name: str) -> tuple[Starlette, ServerState]:
    """One entry's API, as `serve` has it; mounted under its prefix, started by the root's lifespan."""
    app = Starlette(
        routes=[*serve_app.openai_routes(config), Route("/v1/events", stream_routes.events, methods=["GET"])],
        exception_handlers=EXCEPTION_HANDLERS,
    )
    entry = stream_routes.mode_entry(config, f"/{name}", name)
    state = ServerState(config, event_modes=(name,), mode_entries=(entry,))
    return state.attach(app), state


def create_compare_app(
    config: ServerConfig,
    loader: ModelLoader = default_loader,
    freeze_heap: bool = False,
    lineup: tuple[Entry, ...] = DEFAULT_LINEUP,
    compile_workers: CompileWorkers | None = None,
) -> Starlette:
    """`compile_workers`: grammar compile workers shared with other apps in this process, which their owner closes
    (default: the app's own, shared by its panes and closed after they drain)."""
    workers = compile_workers if compile_workers is not None else CompileWorkers()
    split = any(entry.speculative for entry in lineup)
    mode_apps = {entry.name: _mode_app(mode_config(config, entry, split), entry.name) for entry in lineup}
    modes = {name: mode_state for name, (_, mode_state) in mode_apps.items()}
    entries = tuple(e for mode_state in modes.values() for e in mode_state.mode_entries)
    state = ServerState(config, event_modes=tuple(modes), mode_entries=entries, modes=modes)

    def publish(built: tuple[FairShareLoop, dict[str, Runtime]]) -> None:
        _, runtimes = built
        for name, mode_state in modes.items():
            state.hub().add_source(stream_routes.mode_source(mode_state.config, runtimes[name], name))
            mode_state.runtime = runtimes[name]
        state.runtime = runtimes[lineup[-1].name]  # what `serve`'s announcement reads: the model's name

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        hub = EventHub(asyncio.get_running_loop(), time.monotonic(), time.monotonic)
        for target in (state, *modes.values()):
            target.events = hub
        build = lambda: _build_runtimes(modes, config, loader, workers)  # noqa: E731
        load_in_background([state, *modes.values()], freeze_heap, build, lambda built: built[0].start(), publish)
        yield
        await drain_all(state)
        if compile_workers is None:
            workers.close()

    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            *serve_app.live_routes(),
            *(Mount(f"/{mode}", app=mode_app) for mode, (mode_app, _) in mode_apps.items()),
        ],
        middleware=middleware_stack(config, page.OPEN_PATHS),
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lifespan,
    )
    return state.attach(app)


def _build_runtimes(
    modes: dict[str, ServerState], config: ServerConfig, loader: ModelLoader, workers: CompileWorkers
) -> tuple[FairShareLoop, dict[str, Runtime]]:
    """Load the model once; build one runner (one copy of the weights) and, per entry, its own engine and cache,
    behind one fair-share loop (not started)."""
    loaded = loader(config)
    with phase(logger, PREPARING, announce=False):
        runner = build_runner(config.runtime_options(), loaded)
        models = {
            name: metered_model(mode_state.config, loaded, runner, name, workers) for name, mode_state in modes.items()
        }
        fair = FairShareLoop([model.scheduler for model, _ in models.values()])
        runtimes = {
            mode: serving_runtime(
                modes[mode].config, dataclasses.replace(model, loop=fair.handle(model.scheduler)), mode_metrics
            )
            for mode, (model, mode_metrics) in models.items()
        }
    return fair, runtimes


async def drain_all(state: ServerState) -> None:
    """Drain every mode at once (SIGTERM or the end of the lifespan); idempotent."""
    if state.phase is Phase.READY:
        state.phase = Phase.DRAINING
    await asyncio.gather(*(drain(m, state.config.shutdown_grace_s, name) for name, m in state.modes.items()))


async def health(request: Request) -> Response:
    """200 when every mode serves; otherwise 503 with each mode's state (and why, if the engine loop died)."""
    state = ServerState.of(request.app)
    states = {mode: _mode_health(m) for mode, m in state.modes.items()}
    if all(mode_state == "ok" for mode_state in states.values()):
        return JSONResponse({"status": "ok", "modes": states})
    retry = {"Retry-After": "5"} if state.phase in (Phase.LOADING, Phase.DRAINING) else None
    status = state.phase.value if state.phase is not Phase.READY else "degraded"
    body: dict[str, object] = {"status": status, "modes": states}
    reasons = [reason for m in state.modes.values() if (reason := m.loop_stopped) is not None]
    if reasons:  # the modes share one loop thread: it died for all of them
        body.update(status="failed", reason=reasons[0])
    return JSONResponse(body, status_code=503, headers=retry)


def _mode_health(mode_state: ServerState) -> str:
    if mode_state.serving:
        return "ok"
    return "failed" if mode_state.loop_stopped is not None else mode_state.phase.value


async def metrics(request: Request) -> Response:
    state = ServerState.of(request.app)
    if state.phase is not Phase.READY:
        raise APIError(503, "the model is still loading; retry shortly", headers={"Retry-After": "5"})
    # each family once, with every mode's series (labelled `mode`: the entry's name); `/{name}/metrics`: one's alone
    sources = ((mode, m.loaded().metrics.registry.collect()) for mode, m in state.modes.items())
    body = exposition(LabelledMerge(sources, "mode"))
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")
