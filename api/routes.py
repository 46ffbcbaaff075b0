"""HTTP handlers: completions, chat completions, models, health and metrics."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from api.config import ServerConfig
from api.errors import APIError, bad_request
from api.formatting import Formatter, UsageTally
from api.prompts import chat_max_tokens, chat_prompt, check_common_limits, choice_inputs, completion_prompts
from api.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields, parse_request
from api.service import ChoiceDelta, Generation
from api.state import Phase, Runtime

_T = TypeVar("_T")
_Request = TypeVar("_Request", CompletionRequest, ChatCompletionRequest)
logger = logging.getLogger("batchserve.api")


def _runtime(request: Request) -> Runtime:
    phase: Phase = request.app.state.phase
    if phase is Phase.LOADING:
        raise APIError(503, "the model is still loading; retry shortly", headers={"Retry-After": "5"})
    if phase is not Phase.READY:
        raise APIError(503, f"the server is not serving ({phase.value})")
    runtime: Runtime = request.app.state.runtime
    return runtime


async def _read_json_body(request: Request, limit: int) -> bytes:
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise bad_request("the request body must be JSON with Content-Type: application/json")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body exceeds the limit of {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body.extend(chunk)
        if len(body) > limit:
            raise APIError(413, f"the request body exceeds the limit of {limit} bytes")
    return bytes(body)


def _check_model(requested: str | None, runtime: Runtime) -> None:
    if requested is not None and requested != runtime.model_name:
        raise APIError(
            404,
            f"the model '{requested}' does not exist; this server serves '{runtime.model_name}'",
            param="model",
            code="model_not_found",
        )


async def _until_disconnect(request: Request, work: Awaitable[_T]) -> _T | None:
    """Run `work`, cancelling it if the client disconnects first (which aborts its sequences)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        return None
    return task.result()


async def _accept(request: Request, model: type[_Request]) -> tuple[ServerConfig, Runtime, _Request, float]:
    """What both endpoints do first: readiness, body, schema, model name and the server's request limits.

    Also returns when the request was in, on the scheduler's clock: its place in the queue."""
    config: ServerConfig = request.app.state.config
    runtime = _runtime(request)
    body = parse_request(model, await _read_json_body(request, config.max_body_bytes))
    _check_model(body.model, runtime)
    check_common_limits(body, config)
    return config, runtime, body, runtime.service.now()  # after the upload, before tokenising


async def completions(request: Request) -> Response:
    config, runtime, body, arrival = await _accept(request, CompletionRequest)
    if body.echo and body.logprobs is not None:
        raise bad_request("echo together with logprobs (prompt logprobs) is not supported", param="echo")
    # Tokenising a large prompt takes a while: off the event loop, so other streams keep flowing.
    prompts = await asyncio.to_thread(completion_prompts, body, runtime.tokenizer, config)
    inputs = choice_inputs(body, prompts, body.max_tokens or 16, body.logprobs)
    formatter = Formatter(runtime.service.new_request_id("cmpl"), runtime.model_name, runtime.tokenizer, chat=False)
    echo_texts = [str(runtime.tokenizer.decode(p)) for p in prompts] if body.echo else None
    return await _respond(request, body, runtime, formatter, inputs, echo_texts, body.logprobs, arrival)


async def chat_completions(request: Request) -> Response:
    _, runtime, body, arrival = await _accept(request, ChatCompletionRequest)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    prompt = await asyncio.to_thread(chat_prompt, body, runtime.tokenizer)
    max_tokens = chat_max_tokens(body, len(prompt), runtime.max_model_len)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    inputs = choice_inputs(body, [prompt], max_tokens, logprobs)
    request_id = runtime.service.new_request_id("chatcmpl")
    formatter = Formatter(request_id, runtime.model_name, runtime.tokenizer, chat=True, token_bytes=runtime.token_bytes)
    return await _respond(request, body, runtime, formatter, inputs, None, logprobs, arrival)


async def _respond(
    request: Request,
    body: _SamplingFields,
    runtime: Runtime,
    formatter: Formatter,
    inputs: list,
    echo_texts: list[str] | None,
    logprobs: int | None,
    arrival: float,
) -> Response:
    max_queue = request.app.state.config.max_queue
    if len(inputs) > max_queue:  # it could never be queued whole: a retry would never help, so not a 429
        raise bad_request(
            f"this request asks for {len(inputs)} sequences (prompts x n), more than the server's whole queue "
            f"of {max_queue}; send fewer prompts or a smaller n",
            param="n",
        )
    generation = runtime.service.start(inputs, formatter.request_id, arrival)  # 400/429/503 before any byte
    if body.stream:
        events = _stream(generation, body, formatter, echo_texts, logprobs)
        # On shutdown sse-starlette cancels open streams at once unless given a grace period: let them finish
        # within the server's (the lifespan's drain aborts whatever still runs after it).
        grace_s = request.app.state.config.shutdown_grace_s
        return EventSourceResponse(
            events, sep="\n", ping=15, headers={"Cache-Control": "no-cache"}, shutdown_grace_period=grace_s
        )
    try:
        result = await _until_disconnect(request, _collect(generation, body, formatter, echo_texts, logprobs))
    finally:
        generation.close()
    if result is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return JSONResponse(result)


def _generation_error(delta: ChoiceDelta) -> APIError:
    if delta.error_status == 503:
        return APIError(503, delta.error or "the server is overloaded", headers={"Retry-After": "1"})
    return APIError(500, f"generation failed: {delta.error}")


def _prompt_index(delta: ChoiceDelta, n: int) -> int:
    return delta.index // n


async def _collect(
    generation: Generation,
    body: _SamplingFields,
    formatter: Formatter,
    echo_texts: list[str] | None,
    logprobs: int | None,
) -> dict[str, object]:
    count = len(generation.choices)
    texts = [echo_texts[i // body.n] if echo_texts else "" for i in range(count)]
    entries: list[list] = [[] for _ in range(count)]
    finish: list[str | None] = [None] * count
    tally = UsageTally()
    async for delta in generation.deltas():
        if delta.error is not None:
            raise _generation_error(delta)
        texts[delta.index] += delta.text
        entries[delta.index].extend(delta.logprobs)
        if delta.finish_reason is not None:
            finish[delta.index] = delta.finish_reason
            tally.add(delta, _prompt_index(delta, body.n))
    choices = []
    for i in range(count):
        lp = None
        if logprobs is not None:
            lp = (
                formatter.chat_logprobs(entries[i], logprobs)
                if formatter.chat
                else formatter.completion_logprobs(entries[i], 0, logprobs)
            )
        choices.append(formatter.final_choice(i, texts[i], finish[i], lp))
    return formatter.response(choices, tally)


async def _stream(
    generation: Generation,
    body: _SamplingFields,
    formatter: Formatter,
    echo_texts: list[str] | None,
    logprobs: int | None,
) -> AsyncIterator[str]:
    count = len(generation.choices)
    offsets = [0] * count
    tally = UsageTally()
    finished = 0

    def chunk(choices: list[dict[str, object]], **extra: object) -> str:
        data = formatter.chunk(choices, **extra)
        if body.include_usage:  # as OpenAI: every chunk has the field, null until the closing one
            data.setdefault("usage", None)
        return json.dumps(data)

    try:
        for i in range(count):
            if formatter.chat:
                yield chunk([formatter.stream_choice(i, "", None, None, role=True)])
            elif echo_texts:
                text = echo_texts[i // body.n]
                offsets[i] = len(text)
                yield chunk([formatter.stream_choice(i, text, None, None)])
        async for delta in generation.deltas():
            if delta.error is not None:
                error = _generation_error(delta).body()
                yield json.dumps(error)
                break
            if delta.finish_reason is not None:
                finished += 1
                tally.add(delta, _prompt_index(delta, body.n))
            if not delta.text and not delta.logprobs and delta.finish_reason is None:
                continue
            lp = None
            if logprobs is not None and delta.logprobs:
                lp = (
                    formatter.chat_logprobs(delta.logprobs, logprobs)
                    if formatter.chat
                    else formatter.completion_logprobs(delta.logprobs, offsets[delta.index], logprobs)
                )
            offsets[delta.index] += len(delta.text)
            last = finished == count and delta.finish_reason is not None
            choice = formatter.stream_choice(delta.index, delta.text, delta.finish_reason, lp)
            extra: dict[str, object] = {}
            if last:  # with include_usage, usage comes once, in the closing choice-less chunk, as OpenAI sends it
                extra = (
                    {"timings": tally.timings()}
                    if body.include_usage
                    else {"usage": tally.usage(), "timings": tally.timings()}
                )
            yield chunk([choice], **extra)
        else:
            if body.include_usage:
                yield chunk([], usage=tally.usage(), timings=tally.timings())
    except APIError as exc:  # e.g. the request timeout, after the stream started
        yield json.dumps(exc.body())
    except Exception:  # the stream has started: report the fault in-band, then end it properly
        logger.exception("streaming %s failed", formatter.request_id)
        yield json.dumps(APIError(500, "internal server error while streaming").body())
    finally:
        generation.close()
    yield "[DONE]"


async def models(request: Request) -> Response:
    runtime = _runtime(request)
    card = {
        "id": runtime.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "batchserve",
        "max_model_len": runtime.max_model_len,
    }
    return JSONResponse({"object": "list", "data": [card]})


async def health(request: Request) -> Response:
    phase: Phase = request.app.state.phase
    if phase is Phase.READY and request.app.state.runtime.loop.alive:
        return JSONResponse({"status": "ok", "mode": request.app.state.config.mode})
    return JSONResponse({"status": phase.value}, status_code=503)


async def metrics(request: Request) -> Response:
    runtime = _runtime(request)
    return Response(runtime.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
