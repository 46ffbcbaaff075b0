"""The Starlette application of `batchserve serve`: one mode's API, the event stream and the page, behind the
middleware; the model loads in the background (api/apps/loading.py) and drains at shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.routing import Route

from api.apps.loading import ModelLoader, build_runtime, default_loader, load_in_background
from api.config import ServerConfig
from api.endpoints import routes
from api.endpoints.event_hub import EventHub
from api.endpoints.middleware import EXCEPTION_HANDLERS, middleware_stack
from api.endpoints.state import Phase, Runtime, ServerState
from api.live import page, stream_routes, workload
from api.process.drain import drain
from api.structured.grammars import CompileWorkers
from api.translation import messages_routes
from api.translation.response_store import ResponseStore, StoreLimits
from api.translation.responses import ResponsesRoutes


def live_routes() -> list[Route]:
    """The event stream, the modes, the page and its workload: at the root of `serve` and of `compare`
    (api/apps/compare.py)."""
    return [
        Route("/v1/events", stream_routes.events, methods=["GET"]),
        Route("/v1/compare/modes", stream_routes.compare_modes, methods=["GET"]),
        Route("/v1/compare/workload", workload.workload, methods=["POST"]),
        Route("/", page.index, methods=["GET"]),
        *(Route(path, page.static_file, methods=["GET"]) for path in sorted(page.FILE_PATHS)),
    ]


def openai_routes(config: ServerConfig) -> list[Route]:
    """One mode's API: what `serve` answers at its root, and `compare` under each mode's prefix. The Responses
    routes share one store, made here: each app (each of compare's modes) keeps its own."""
    limits = StoreLimits(config.responses_store_max_count, config.responses_store_max_bytes)
    responses_api = ResponsesRoutes(ResponseStore(limits))
    return [
        Route("/v1/completions", routes.completions, methods=["POST"]),
        Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
        Route("/v1/messages", messages_routes.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", messages_routes.count_tokens, methods=["POST"]),
        Route("/v1/responses", responses_api.create, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses_api.retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}", responses_api.delete, methods=["DELETE"]),
        Route("/v1/models", routes.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", routes.model, methods=["GET"]),
        Route("/tokenize", routes.tokenize, methods=["POST"]),
        Route("/detokenize", routes.detokenize, methods=["POST"]),
        Route("/version", routes.version, methods=["GET"]),
        Route("/health", routes.health, methods=["GET"]),
        Route("/metrics", routes.metrics, methods=["GET"]),
    ]


def create_app(
    config: ServerConfig,
    loader: ModelLoader = default_loader,
    freeze_heap: bool = False,
    compile_workers: CompileWorkers | None = None,
) -> Starlette:
    """The server's app. `freeze_heap`: the app owns its process, whose heap is frozen after loading
    (api.runtime.heap). `compile_workers`: grammar compile workers shared with other apps in this process, which
    their owner closes (default: the app's own)."""
    state = ServerState(config, event_modes=(config.mode,), mode_entries=(stream_routes.mode_entry(config, ""),))

    def publish(runtime: Runtime) -> None:
        state.hub().add_source(stream_routes.mode_source(config, runtime))
        state.runtime = runtime

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.phase = Phase.LOADING
        state.events = EventHub(asyncio.get_running_loop(), time.monotonic(), time.monotonic)
        build = lambda: build_runtime(config, loader(config), compile_workers)  # noqa: E731
        load_in_background([state], freeze_heap, build, lambda runtime: runtime.loop.start(), publish)
        yield
        await drain(state, config.shutdown_grace_s)  # at once if the server already drained on a signal

    app = Starlette(
        routes=[*openai_routes(config), *live_routes()],
        middleware=middleware_stack(config, page.OPEN_PATHS),
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lifespan,
    )
    return state.attach(app)
