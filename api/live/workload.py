"""`POST /v1/compare/workload`: the page's workload, started by the server in every pane at the same moments.

A browser opens at most 6 HTTP/1.1 connections to one server: were the page to send each pane's requests itself,
those beyond that would wait in the browser and reach their pane late. So the page sends one request, and the
server starts each arrival (the requests sharing a `delay_s`) in every pane in-process, through each pane's
generation service, and streams every answer back on one server-sent event stream, one event per piece:
`{pane, index, request_id, text, finish_reason, error}` (docs/compare.md). A client that leaves aborts it all.

At most --max-workloads run at once (api/live/workload_slot.py). A workload takes its slot once its body has passed
every check, and gives it back when its last answer ends, before `[DONE]` (so a client may start the next one as
soon as it reads it), or when its stream ends otherwise: failed, client gone, shutdown.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from api.endpoints.routes import read_json_body
from api.endpoints.service import Generation
from api.endpoints.state import Phase, Runtime, ServerState
from api.live.stream_routes import PAGE_MAX_DELAY_S, PAGE_MAX_RATE, PAGE_MAX_TOKENS
from api.live.workload_slot import WorkloadSlot, check_free
from api.protocol.deltas import ChoiceInput
from api.protocol.errors import APIError, bad_request
from api.protocol.openai_api import CompletionRequest
from api.protocol.sampling import choice_inputs

logger = logging.getLogger("batchserve.api")

MAX_PROMPT_CHARS = 4096
_DELAY_SLACK_S = 1e-6  # the page computes delays as i / rate, in floating point


class WorkloadItem(BaseModel):
    """One request of the workload; every pane gets the same."""

    model_config = ConfigDict(extra="forbid", strict=True)

    index: int = Field(ge=0, le=1_000_000)  # the page's number for it: its box in each pane
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    max_tokens: int = Field(ge=1, le=PAGE_MAX_TOKENS)
    delay_s: float = Field(0.0, ge=0.0, le=PAGE_MAX_DELAY_S, allow_inf_nan=False)  # after the workload's start


class WorkloadBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    panes: list[str] = Field(min_length=1)
    requests: list[WorkloadItem] = Field(min_length=1)
    ignore_eos: bool = False


@dataclass(frozen=True)
class _Arrival:
    """The requests leaving together: one generation per pane, its choices in `indexes` order."""

    delay_s: float
    indexes: tuple[int, ...]
    inputs: dict[str, list[ChoiceInput]]  # per pane: its own inputs (the scheduler owns a request's token list)


def _parse(raw: bytes) -> WorkloadBody:
    """The body, or a 400 naming the first bad field by its path (`requests.2.max_tokens`)."""
    try:
        return WorkloadBody.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"])
        if first["type"] == "json_invalid":
            raise bad_request(f"the request body is not valid JSON: {first['msg']}") from None
        if not where:
            raise bad_request("the request body must be a JSON object") from None
        if first["type"] == "missing":
            raise bad_request(f"the required parameter '{where}' is missing", param=where) from None
        if first["type"] == "extra_forbidden":
            raise bad_request(f"unknown parameter '{where[:80]}'", param=where[:80]) from None
        raise bad_request(f"invalid value for '{where}': {first['msg']}", param=where) from None


def _panes(request: Request, names: list[str]) -> dict[str, Runtime]:
    """The named panes' runtimes: `compare`'s entries, or `serve`'s one mode."""
    state = ServerState.of(request.app)
    if state.phase is Phase.LOADING:
        raise APIError(503, "the model is still loading; retry shortly", headers={"Retry-After": "5"})
    served = state.modes or {state.event_modes[0]: state}
    chosen: dict[str, Runtime] = {}
    for name in names:
        if name not in served:
            raise bad_request(f"unknown pane '{name[:40]}'; this server has {', '.join(served)}", param="panes")
        if name in chosen:
            raise bad_request(f"the pane '{name}' is named twice", param="panes")
        if not served[name].serving:
            raise APIError(503, f"the pane '{name}' is not serving; retry shortly", headers={"Retry-After": "5"})
        chosen[name] = served[name].loaded()
    return chosen


def _check_requests(items: list[WorkloadItem], max_prompts: int) -> None:
    if len(items) > max_prompts:
        raise bad_request(f"at most {max_prompts} requests per pane (the server's --max-prompts)", param="requests")
    seen: set[int] = set()
    for i, item in enumerate(items):
        if item.index in seen:
            raise bad_request(f"the index {item.index} is given twice", param=f"requests.{i}.index")
        seen.add(item.index)
    # At most PAGE_MAX_RATE arrivals a second: the page's rate bound, whatever sends the body.
    order = sorted(range(len(items)), key=lambda i: items[i].delay_s)
    gap = 1 / PAGE_MAX_RATE
    for before, after in itertools.pairwise(order):
        step = items[after].delay_s - items[before].delay_s
        if 0 < step < gap - _DELAY_SLACK_S:
            raise bad_request(
                f"at most {PAGE_MAX_RATE} arrivals a second: distinct delay_s values must be at least {gap} s apart",
                param=f"requests.{after}.delay_s",
            )


def _arrivals(body: WorkloadBody, prompts: list[list[int]], panes: dict[str, Runtime]) -> list[_Arrival]:
    """Group the requests by delay; a request's tokens and length must fit the model's context."""
    groups: dict[float, list[int]] = {}
    limit = min(runtime.max_model_len for runtime in panes.values())
    for i, (item, ids) in enumerate(zip(body.requests, prompts, strict=True)):
        if not ids:
            raise bad_request("the prompt has no tokens", param=f"requests.{i}.prompt")
        if len(ids) + item.max_tokens > limit:
            message = f"the prompt's {len(ids)} tokens and max_tokens {item.max_tokens} exceed the context of {limit}"
            raise bad_request(message, param=f"requests.{i}.max_tokens")
        groups.setdefault(item.delay_s, []).append(i)
    sampling = [_sampling(item.max_tokens, body.ignore_eos) for item in body.requests]
    arrivals = []
    for delay, members in sorted(groups.items()):
        inputs = {
            pane: [
                choice
                for i in members
                for choice in choice_inputs(sampling[i], [list(prompts[i])], body.requests[i].max_tokens, None)
            ]
            for pane in panes
        }
        arrivals.append(_Arrival(delay, tuple(body.requests[i].index for i in members), inputs))
    return arrivals


def _sampling(max_tokens: int, ignore_eos: bool) -> CompletionRequest:
    """A workload request's sampling: greedy, exact lengths with `ignore_eos`; every other field its default."""
    fields = {"prompt": "", "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": ignore_eos}
    return CompletionRequest.model_validate(fields)


@dataclass(eq=False)
class _Fanout:
    """The running workload: starts each arrival in every pane, gathers every answer's pieces into one queue."""

    panes: dict[str, Runtime]
    arrivals: list[_Arrival]
    slot: WorkloadSlot
    events: asyncio.Queue[dict[str, Any] | None] = field(default_factory=asyncio.Queue)
    generations: list[Generation] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def frames(self) -> AsyncIterator[str]:
        self.tasks.append(asyncio.create_task(self._start_all()))
        running = len(self.arrivals) * len(self.panes)  # one None each, when its generation ends
        while running:
            event = await self.events.get()
            if event is None:
                running -= 1
            else:
                yield json.dumps(event)
        self.slot.release()  # every answer has ended: a client that reads [DONE] may start the next workload
        yield "[DONE]"

    async def _start_all(self) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        for arrival in self.arrivals:
            await asyncio.sleep(max(0.0, start + arrival.delay_s - loop.time()))
            for pane, runtime in self.panes.items():  # no await between panes: they all queue now
                self._start(pane, runtime, arrival)

    def _start(self, pane: str, runtime: Runtime, arrival: _Arrival) -> None:
        service = runtime.service
        request_id = service.new_request_id("cmpl")
        try:
            generation = service.start(arrival.inputs[pane], request_id, service.now())
        except Exception as exc:  # a full queue (429), a draining pane (503): those boxes end in the error
            self._fail(pane, arrival.indexes, _error_body(exc))
            self.events.put_nowait(None)
            return
        self.generations.append(generation)
        for choice in generation.choices:  # the box learns its scheduler id before its first token
            self._emit(pane, arrival.indexes[choice.index], choice.request_id)
        self.tasks.append(asyncio.create_task(self._read(pane, arrival, generation)))

    async def _read(self, pane: str, arrival: _Arrival, generation: Generation) -> None:
        ended: set[int] = set()
        try:
            async for delta in generation.deltas():
                error = None if delta.error is None else delta.error.body()["error"]
                if delta.finish_reason is not None or error is not None:
                    ended.add(delta.index)
                request_id = generation.choices[delta.index].request_id
                self._emit(pane, arrival.indexes[delta.index], request_id, delta.text, delta.finish_reason, error)
        except Exception as exc:  # the request timed out, or worse: its unfinished choices end in the error
            unfinished = [arrival.indexes[c.index] for c in generation.choices if c.index not in ended]
            self._fail(pane, tuple(unfinished), _error_body(exc))
        finally:
            generation.close()
            self.events.put_nowait(None)

    def _emit(
        self,
        pane: str,
        index: int,
        request_id: str | None,
        text: str = "",
        finish_reason: str | None = None,
        error: dict[str, Any] | None = None,
    ) -> None:
        event = {"pane": pane, "index": index, "request_id": request_id, "text": text}
        self.events.put_nowait({**event, "finish_reason": finish_reason, "error": error})

    def _fail(self, pane: str, indexes: tuple[int, ...], error: dict[str, Any]) -> None:
        for index in indexes:
            self._emit(pane, index, None, error=error)

    def close(self) -> None:
        """Cancel what has not started and abort what runs: every seat it took frees within a step; and give
        back the workload's slot."""
        for task in self.tasks:
            task.cancel()
        for generation in self.generations:
            generation.close()
        self.slot.release()


def _error_body(exc: Exception) -> dict[str, Any]:
    if isinstance(exc, APIError):
        return exc.body()["error"]
    logger.exception("a workload's request failed", exc_info=exc)
    return APIError(500, "internal error").body()["error"]


class _Closing:
    """The stream, then the workload closed, however the stream ended (done, failed, client gone, shutdown)."""

    def __init__(self, stream: EventSourceResponse, fanout: _Fanout) -> None:
        self.stream = stream
        self.fanout = fanout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.stream(scope, receive, send)
        finally:
            self.fanout.close()


async def workload(request: Request) -> Response:
    state = ServerState.of(request.app)
    config = state.config
    check_free(state)  # a 429 before the body is read and tokenised
    body = _parse(await read_json_body(request, config.max_body_bytes))
    panes = _panes(request, body.panes)
    _check_requests(body.requests, config.max_prompts)
    tokenizer = next(iter(panes.values())).tokenizer  # the panes share one model, so one tokenizer
    texts = [item.prompt for item in body.requests]
    prompts = await asyncio.to_thread(lambda: [list(tokenizer(text)["input_ids"]) for text in texts])
    arrivals = _arrivals(body, prompts, panes)
    # Checked again: another workload may have started while this one was read. No await from here until _Closing
    # runs, whose end gives the slot back whatever happens.
    fanout = _Fanout(panes, arrivals, WorkloadSlot.take(state))
    stream = EventSourceResponse(
        fanout.frames(), sep="\n", ping=15, headers={"Cache-Control": "no-cache"},
        shutdown_grace_period=config.shutdown_grace_s,
    )  # fmt: skip
    return _Closing(stream, fanout)  # type: ignore[return-value]
