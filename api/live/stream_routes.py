"""HTTP side of the event stream: `GET {prefix}/v1/events` and `GET /v1/compare/modes` (docs/events.md); the
page's workload is api/live/workload.py."""

from __future__ import annotations

from typing import Any

import anyio
from sse_starlette import EventSourceResponse
from starlette.datastructures import QueryParams
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from api.config import ServerConfig
from api.endpoints.event_hub import ModeSource, Subscriber
from api.endpoints.state import Phase, Runtime, ServerState
from api.protocol.errors import APIError, bad_request
from scheduler.config import Mode

_PING_S = 10
_TRUE = ("true", "1")
_FALSE = ("false", "0")
_EVENT_PARAMS = ("include_text", "api_key")
# What the page may send per mode, per second: its send control is bounded by this and by --max-prompts.
PAGE_MAX_RATE = 20
PAGE_MAX_TOKENS = 1024
PAGE_MAX_DELAY_S = 120.0  # the last request of a workload leaves at most this long after its start


def mode_settings(config: ServerConfig) -> dict[str, Any]:
    """The policy's settings as `hello` and /v1/compare/modes show them; a plug-in's import path and the mode whose
    seats and settings it runs with; speculation's drafts a row (k) and draft-length rule, where it speculates."""
    plug_in: dict[str, Any] = {} if config.policy is None else {"policy": config.policy, "policy_mode": config.mode}
    spec = config.speculative()
    if spec is not None:
        plug_in.update(speculative_tokens=spec.num_speculative_tokens, draft_length=spec.draft_length)
    if config.mode == Mode.DYNAMIC.value:
        return {"max_batch_size": config.max_batch_size, "batch_timeout_ms": config.batch_timeout_ms, **plug_in}
    if config.mode == Mode.STATIC.value:
        return {"max_batch_size": config.max_batch_size, "batch_window_ms": config.batch_window_ms, **plug_in}
    return {"max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens, **plug_in}


def mode_source(config: ServerConfig, runtime: Runtime, name: str | None = None) -> ModeSource:
    """`name`: the pane's (compare's line-up entry), by default the mode's."""
    hello = {"model": runtime.model_name, "seats": config.seats, **mode_settings(config)}
    source_name = name or config.mode
    return ModeSource(source_name, runtime.scheduler, runtime.loop.request_snapshot, runtime.tokenizer, hello)


def mode_entry(config: ServerConfig, prefix: str, name: str | None = None) -> dict[str, Any]:
    return {"mode": name or config.mode, "prefix": prefix, "seats": config.seats, **mode_settings(config)}


def event_params(query: QueryParams) -> bool:
    """`include_text`, after checking every parameter: unknown, repeated or malformed ones are a 400."""
    seen: set[str] = set()
    for name, _ in query.multi_items():
        if name not in _EVENT_PARAMS:
            message = f"unknown query parameter '{name[:40]}'; this endpoint takes include_text"
            raise bad_request(message, param=name[:40])
        if name in seen:
            raise bad_request(f"the query parameter '{name}' is given more than once", param=name)
        seen.add(name)
    value = query.get("include_text", "true").lower()
    if value not in _TRUE + _FALSE:
        raise bad_request("include_text must be true or false", param="include_text")
    return value in _TRUE


def _ready(request: Request) -> None:
    phase = ServerState.of(request.app).phase
    if phase is Phase.LOADING:
        raise APIError(503, "the model is still loading; retry shortly", headers={"Retry-After": "5"})
    if phase is not Phase.READY:
        raise APIError(503, f"the server is not serving ({phase.value})", headers={"Retry-After": "5"})


async def events(request: Request) -> Response:
    include_text = event_params(request.query_params)
    _ready(request)
    state = ServerState.of(request.app)
    hub = state.hub()
    subscriber = hub.subscribe(state.event_modes, include_text)
    if subscriber is None:
        raise APIError(
            503, f"the server has {hub.max_subscribers} event subscribers already; retry later",
            headers={"Retry-After": "5"},
        )  # fmt: skip
    stream = EventSourceResponse(
        subscriber.frames(), ping=_PING_S, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    return _Disconnectable(stream, subscriber)  # type: ignore[return-value]


class _Disconnectable:
    """The stream, cut off when the hub disconnects its subscriber: a reader that stopped reading leaves the
    response blocked in a send, which only a cancellation ends (the server then closes the connection)."""

    def __init__(self, stream: EventSourceResponse, subscriber: Subscriber) -> None:
        self.stream = stream
        self.subscriber = subscriber

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def serve() -> None:
                    await self.stream(scope, receive, send)
                    group.cancel_scope.cancel()

                async def watch() -> None:
                    await self.subscriber.kicked.wait()
                    group.cancel_scope.cancel()

                group.start_soon(serve)
                group.start_soon(watch)
        finally:
            self.subscriber.hub.unsubscribe(self.subscriber)


async def compare_modes(request: Request) -> Response:
    """Which modes this server serves, under which prefix, and the page's bounds."""
    state = ServerState.of(request.app)
    config = state.config
    return JSONResponse(
        {
            "object": "list",
            "data": list(state.mode_entries),
            "max_prompts": config.max_prompts,
            "max_rate": PAGE_MAX_RATE,
            "max_tokens": PAGE_MAX_TOKENS,
            "max_delay_s": PAGE_MAX_DELAY_S,
            "max_workloads": config.max_workloads,
        }
    )
