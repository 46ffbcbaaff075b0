"""HTTP handlers: completions, chat completions, models, health and metrics."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from sse_starlette import EventSourceResponse
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from api.config import ServerConfig
from api.errors import APIError, bad_request
from api.formatting import Formatter, UsageTally
from api.prompts import (
    chat_echo_text,
    chat_max_tokens,
    chat_prompt,
    check_common_limits,
    choice_inputs,
    completion_prompts,
)
from api.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields, parse_request, refusal
from api.service import ChoiceDelta, ChoiceInput, Generation, TokenLogprob
from api.state import Phase, Runtime

_T = TypeVar("_T")
_Request = TypeVar("_Request", CompletionRequest, ChatCompletionRequest)
logger = logging.getLogger("batchserve.api")


def _runtime(request: Request) -> Runtime:
    phase: Phase = request.app.state.phase
    if phase is Phase.LOADING:
        raise APIError(503, "the model is still loading; retry shortly", headers={"Retry-After": "5"})
    if phase is Phase.DRAINING:
        raise APIError(503, "the server is shutting down; retry shortly", headers={"Retry-After": "5"})
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
    try:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise APIError(413, f"the request body exceeds the limit of {limit} bytes")
    except ClientDisconnect:
        # The client left mid-upload, or the connection layer closed it (a malformed chunk, a read timeout) and
        # answered already: an ordinary event, not a fault. The 400 goes nowhere; it only ends the handler.
        logger.info("%s %s: the connection closed before the whole body arrived", request.method, request.url.path)
        raise bad_request("the request body was not received in full") from None
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
    refused = refusal(body)
    if refused is not None:
        raise refused
    check_common_limits(body, config)
    ignored = body.ignored_fields()
    if ignored:  # as vLLM: fields this server does not know are ignored, not refused (names only, never values)
        names = ", ".join(repr(name[:40]) for name in ignored[:10])
        logger.info("%s %s: ignoring unknown fields %s", request.method, request.url.path, names)
    return config, runtime, body, runtime.service.now()  # after the upload, before tokenising


@dataclass(frozen=True)
class _Shape:
    """What a response shows beside each choice's generated text, from the request's fields."""

    n: int
    echo_texts: list[str] | None  # per prompt: text the answer starts with (completions echo, chat echo)
    logprobs: int | None  # alternatives per generated token; None: no logprobs
    echo_logprobs: bool  # completions: the prompt's logprobs come first, as the legacy API echoes them
    prompt_logprobs: int | None  # vLLM's prompt_logprobs field
    include_usage: bool
    continuous_usage: bool
    tokens_as_ids: bool  # vLLM's return_tokens_as_token_ids

    def echo_text(self, index: int) -> str:
        return self.echo_texts[index // self.n] if self.echo_texts else ""


def _prompt_scores_wanted(*wanted: int | None) -> int | None:
    present = [k for k in wanted if k is not None]
    return max(present) if present else None


async def completions(request: Request) -> Response:
    config, runtime, body, arrival = await _accept(request, CompletionRequest)
    # Tokenising a large prompt takes a while: off the event loop, so other streams keep flowing.
    prompts = await asyncio.to_thread(completion_prompts, body, runtime.tokenizer, config, runtime.max_model_len)
    echo_logprobs = body.echo and body.logprobs is not None
    prompt_k = _prompt_scores_wanted(body.prompt_logprobs, body.logprobs if echo_logprobs else None)
    inputs = choice_inputs(body, prompts, body.max_tokens, body.logprobs, prompt_k)
    formatter = Formatter(
        _public_id("cmpl", body, runtime), runtime.model_name, runtime.tokenizer, chat=False,
        tokens_as_ids=body.return_tokens_as_token_ids,
    )  # fmt: skip
    echo_texts = [str(runtime.tokenizer.decode(p)) for p in prompts] if body.echo else None
    shape = _Shape(
        body.n, echo_texts, body.logprobs, echo_logprobs, body.prompt_logprobs, body.include_usage,
        body.continuous_usage, body.return_tokens_as_token_ids,
    )  # fmt: skip
    return await _respond(request, body, runtime, formatter, inputs, shape, arrival)


async def chat_completions(request: Request) -> Response:
    _, runtime, body, arrival = await _accept(request, ChatCompletionRequest)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    prompt = await asyncio.to_thread(chat_prompt, body, runtime.tokenizer, runtime.max_model_len)
    max_tokens = chat_max_tokens(body, len(prompt), runtime.max_model_len)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    inputs = choice_inputs(body, [prompt], max_tokens, logprobs, body.prompt_logprobs)
    formatter = Formatter(
        _public_id("chatcmpl", body, runtime), runtime.model_name, runtime.tokenizer, chat=True,
        token_bytes=runtime.token_bytes, tokens_as_ids=body.return_tokens_as_token_ids,
    )  # fmt: skip
    echo = chat_echo_text(body)
    shape = _Shape(
        body.n, None if echo is None else [echo], logprobs, False, body.prompt_logprobs, body.include_usage,
        body.continuous_usage, body.return_tokens_as_token_ids,
    )  # fmt: skip
    return await _respond(request, body, runtime, formatter, inputs, shape, arrival)


def _public_id(prefix: str, body: _SamplingFields, runtime: Runtime) -> str:
    """The response's id: the client's request_id where given (vLLM), else a fresh one."""
    if body.request_id is not None:
        return f"{prefix}-{body.request_id}"
    return runtime.service.new_request_id(prefix)


async def _respond(
    request: Request,
    body: _SamplingFields,
    runtime: Runtime,
    formatter: Formatter,
    inputs: list[ChoiceInput],
    shape: _Shape,
    arrival: float,
) -> Response:
    max_queue = request.app.state.config.max_queue
    if len(inputs) > max_queue:  # it could never be queued whole: a retry would never help, so not a 429
        raise bad_request(
            f"this request asks for {len(inputs)} sequences (prompts x n), more than the server's whole queue "
            f"of {max_queue}; send fewer prompts or a smaller n",
            param="n",
        )
    # Internal ids stay unique whatever the client calls its request, and start with the response's id.
    internal_id = (
        formatter.request_id if body.request_id is None else runtime.service.new_request_id(formatter.request_id)
    )
    generation = runtime.service.start(inputs, internal_id, arrival)  # 400/429/503 before any byte
    if body.stream:
        events = _stream(generation, shape, formatter)
        # On shutdown sse-starlette cancels open streams at once unless given a grace period: let them finish
        # within the server's (the lifespan's drain aborts whatever still runs after it).
        grace_s = request.app.state.config.shutdown_grace_s
        return EventSourceResponse(
            events, sep="\n", ping=15, headers={"Cache-Control": "no-cache"}, shutdown_grace_period=grace_s
        )
    try:
        result = await _until_disconnect(request, _collect(generation, shape, formatter))
    finally:
        generation.close()
    if result is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return JSONResponse(result)


def _generation_error(delta: ChoiceDelta) -> APIError:
    if delta.error_status == 503:
        return APIError(503, delta.error or "the server is overloaded", headers={"Retry-After": "1"})
    return APIError(500, f"generation failed: {delta.error}")


def _logprobs_json(
    formatter: Formatter, shape: _Shape, entries: Sequence[TokenLogprob], offset: int
) -> dict[str, list] | None:
    if shape.logprobs is None:
        return None
    if formatter.chat:
        return formatter.chat_logprobs(entries, shape.logprobs)
    return formatter.completion_logprobs(entries, offset, shape.logprobs)


async def _collect(generation: Generation, shape: _Shape, formatter: Formatter) -> dict[str, object]:
    count = len(generation.choices)
    texts = [shape.echo_text(i) for i in range(count)]
    entries: list[list[TokenLogprob]] = [[] for _ in range(count)]
    prompt_scores: list[tuple[TokenLogprob, ...]] = [() for _ in range(count)]
    finish: list[str | None] = [None] * count
    tally = UsageTally()
    async for delta in generation.deltas():
        if delta.error is not None:
            raise _generation_error(delta)
        texts[delta.index] += delta.text
        if delta.prompt_logprobs:
            prompt_scores[delta.index] = delta.prompt_logprobs
            if shape.echo_logprobs:  # the echoed prompt's tokens lead the completion's
                entries[delta.index][:0] = delta.prompt_logprobs
        entries[delta.index].extend(delta.logprobs)
        if delta.finish_reason is not None:
            finish[delta.index] = delta.finish_reason
            tally.add(delta, delta.index // shape.n)
    choices = []
    for i in range(count):
        choice = formatter.final_choice(i, texts[i], finish[i], _logprobs_json(formatter, shape, entries[i], 0))
        if shape.prompt_logprobs is not None and not formatter.chat:
            choice["prompt_logprobs"] = formatter.prompt_logprobs(prompt_scores[i], shape.prompt_logprobs)
        choices.append(choice)
    response = formatter.response(choices, tally)
    if shape.prompt_logprobs is not None and formatter.chat:  # vLLM puts the chat prompt's on the response
        response["prompt_logprobs"] = formatter.prompt_logprobs(prompt_scores[0], shape.prompt_logprobs)
    return response


async def _stream(generation: Generation, shape: _Shape, formatter: Formatter) -> AsyncIterator[str]:
    count = len(generation.choices)
    offsets = [0] * count
    generated = [0] * count
    tally = UsageTally()
    finished = 0
    prompt_tokens = sum(len(c.prompt_token_ids) for c in generation.choices[:: shape.n])

    def chunk(choices: list[dict[str, object]], **extra: object) -> str:
        data = formatter.chunk(choices, **extra)
        if shape.continuous_usage and "usage" not in extra:  # vLLM: usage so far on every chunk
            done = sum(generated)
            data["usage"] = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": done,
                "total_tokens": prompt_tokens + done,
            }
        elif shape.include_usage:  # as OpenAI: every chunk has the field, null until the closing one
            data.setdefault("usage", None)
        return json.dumps(data)

    def echo_chunk(index: int, prompt_scores: Sequence[TokenLogprob] = ()) -> str:
        text = shape.echo_text(index)
        offsets[index] = len(text)
        lp = formatter.completion_logprobs(prompt_scores, 0, shape.logprobs or 0) if prompt_scores else None
        return chunk([formatter.stream_choice(index, text, None, lp)])

    try:
        for i in range(count):
            if formatter.chat:
                yield chunk([formatter.stream_choice(i, "", None, None, role=True)])
                if shape.echo_texts:
                    yield echo_chunk(i)
            elif shape.echo_texts and not shape.echo_logprobs:
                yield echo_chunk(i)
        async for delta in generation.deltas():
            if delta.error is not None:
                error = _generation_error(delta).body()
                yield json.dumps(error)
                break
            if delta.prompt_logprobs and shape.echo_logprobs:  # the prompt's scores exist once it is prefilled
                yield echo_chunk(delta.index, delta.prompt_logprobs)
            generated[delta.index] = delta.num_output_tokens or generated[delta.index]
            if delta.finish_reason is not None:
                finished += 1
                tally.add(delta, delta.index // shape.n)
            if not delta.text and not delta.logprobs and delta.finish_reason is None:
                continue
            lp = _logprobs_json(formatter, shape, delta.logprobs, offsets[delta.index]) if delta.logprobs else None
            offsets[delta.index] += len(delta.text)
            last = finished == count and delta.finish_reason is not None
            choice = formatter.stream_choice(delta.index, delta.text, delta.finish_reason, lp)
            extra: dict[str, object] = {}
            if last:  # with include_usage, usage comes once, in the closing choice-less chunk, as OpenAI sends it
                extra = (
                    {"timings": tally.timings()}
                    if shape.include_usage
                    else {"usage": tally.usage(), "timings": tally.timings()}
                )
            yield chunk([choice], **extra)
        else:
            if shape.include_usage:
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
    retry = {"Retry-After": "5"} if phase in (Phase.LOADING, Phase.DRAINING) else None
    return JSONResponse({"status": phase.value}, status_code=503, headers=retry)


async def metrics(request: Request) -> Response:
    runtime = _runtime(request)
    return Response(runtime.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
