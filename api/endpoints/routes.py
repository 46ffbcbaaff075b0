"""HTTP handlers: completions, chat completions, models, tokenize and detokenize, version, health and metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Generic, TypeVar

from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from api.config import ServerConfig
from api.endpoints import responses, tokenization
from api.endpoints.auto_tool_formatting import AutoToolFormatter
from api.endpoints.formatting import ChatFormatter, CompletionFormatter
from api.endpoints.responses import ResponseShape
from api.endpoints.server_info import model_card, version_info
from api.endpoints.service import Generation
from api.endpoints.state import Phase, Runtime, ServerState
from api.endpoints.tool_call_formatting import ToolCallFormatter
from api.protocol.deltas import ChoiceInput
from api.protocol.errors import APIError, bad_request
from api.protocol.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
    parse_request,
    refusal,
)
from api.protocol.prediction import prediction_token_ids
from api.protocol.sampling import chat_max_tokens, check_common_limits, choice_inputs
from api.structured.requests import compile_grammar, request_grammar
from api.structured.spec import GrammarSpec
from api.text.prompts import chat_echo_text, chat_prompt, completion_prompts
from engine.sample.grammar import Grammar

_T = TypeVar("_T")
_Request = TypeVar("_Request", CompletionRequest, ChatCompletionRequest)
_TokensRequest = TypeVar("_TokensRequest", TokenizeRequest, DetokenizeRequest)
logger = logging.getLogger("batchserve.api")


def _runtime(request: Request) -> Runtime:
    state = ServerState.of(request.app)
    phase = state.phase
    if phase is Phase.LOADING:
        raise APIError(503, "the model is still loading; retry shortly", headers={"Retry-After": "5"})
    if phase is Phase.DRAINING:
        raise APIError(503, "the server is shutting down; retry shortly", headers={"Retry-After": "5"})
    if phase is not Phase.READY:
        raise APIError(503, f"the server is not serving ({phase.value})")
    return state.loaded()


async def read_json_body(request: Request, limit: int) -> bytes:
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


def log_ignored_fields(request: Request, ignored: list[str]) -> None:
    """As vLLM: fields this server does not use are ignored, not refused; logged by name only, never values."""
    if ignored:
        names = ", ".join(repr(name[:40]) for name in ignored[:10])
        logger.info("%s %s: ignoring fields this server does not use: %s", request.method, request.url.path, names)


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


async def _grammar(request: Request, runtime: Runtime, spec: GrammarSpec | None) -> Grammar | None:
    """The request's grammar, if it has one; a client that leaves while it compiles stops the compile."""
    if spec is None:
        return None
    grammar = await _until_disconnect(request, compile_grammar(runtime.grammars, spec))
    if grammar is None:
        raise APIError(499, "the client disconnected while its grammar compiled")  # nobody reads this
    return grammar


@dataclass(frozen=True)
class _Accepted(Generic[_Request]):
    """A request that passed the checks every endpoint makes, and when it came in on the scheduler's clock."""

    config: ServerConfig
    runtime: Runtime
    body: _Request
    arrival: float  # its place in the queue
    arrival_time: float  # the same instant in Unix seconds, reported in `timings` (as vLLM's metrics do)

    def public_id(self, prefix: str) -> str:
        """The response's id: the client's request_id where given (vLLM), else a fresh one."""
        if self.body.request_id is not None:
            return f"{prefix}-{self.body.request_id}"
        return self.runtime.service.new_request_id(prefix)


def check_serving(request: Request) -> ServerConfig:
    """Readiness, before reading a body: a server that cannot answer says so at once."""
    state = ServerState.of(request.app)
    _runtime(request)
    if state.loop_stopped is not None:  # nothing would ever answer it: say so now, before reading the body
        raise APIError(503, f"{state.loop_stopped}; this server cannot serve requests")
    return state.config


async def _accept(request: Request, model: type[_Request]) -> _Accepted[_Request]:
    """What both endpoints do first: readiness, body, schema, model name and the server's request limits."""
    config = check_serving(request)
    body = parse_request(model, await read_json_body(request, config.max_body_bytes))
    return _accept_parsed(request, body)


def _accept_parsed(request: Request, body: _Request) -> _Accepted[_Request]:
    """The checks on a parsed body: model name, priority, the server's request limits."""
    config, runtime = ServerState.of(request.app).config, _runtime(request)
    _check_model(body.model, runtime)
    refused = refusal(body, by_priority=config.scheduling_policy == "priority")
    if refused is not None:
        raise refused
    check_common_limits(body, config.max_n, config.max_stop_strings)
    log_ignored_fields(request, body.ignored_fields())
    # After the upload, before tokenising.
    return _Accepted(config, runtime, body, runtime.service.now(), time.time())


async def _prediction(body: SamplingFields, runtime: Runtime) -> tuple[int, ...]:
    """Predicted Outputs' tokens; tokenised off the event loop, and only where the request has a prediction."""
    if body.prediction is None:
        return ()
    return await asyncio.to_thread(prediction_token_ids, body, runtime.tokenizer, runtime.max_model_len)


def _prompt_scores_wanted(*wanted: int | None) -> int | None:
    present = [k for k in wanted if k is not None]
    return max(present) if present else None


async def completions(request: Request) -> Response:
    accepted = await _accept(request, CompletionRequest)
    body, runtime = accepted.body, accepted.runtime
    # Tokenising a large prompt takes a while: off the event loop, so other streams keep flowing.
    prompts = await asyncio.to_thread(
        completion_prompts, body, runtime.tokenizer, accepted.config, runtime.max_model_len
    )
    grammar = await _grammar(request, runtime, request_grammar(body).spec)
    echo_logprobs = body.echo and body.logprobs is not None
    prompt_k = _prompt_scores_wanted(body.prompt_logprobs, body.logprobs if echo_logprobs else None)
    prediction = await _prediction(body, runtime)
    inputs = choice_inputs(body, prompts, body.max_tokens, body.logprobs, prompt_k, grammar, prediction)
    formatter = CompletionFormatter(
        accepted.public_id("cmpl"), runtime.model_name, runtime.tokenizer, body.return_tokens_as_token_ids
    )
    echo_texts = [str(runtime.tokenizer.decode(p)) for p in prompts] if body.echo else None
    shape = ResponseShape(
        formatter, body.n, echo_texts, body.logprobs, echo_logprobs, body.prompt_logprobs, body.include_usage,
        body.continuous_usage, predicted=bool(prediction),
    )  # fmt: skip
    return await _respond(request, accepted, inputs, shape)


async def chat_completions(request: Request) -> Response:
    accepted = await _accept(request, ChatCompletionRequest)
    return await _respond(request, *await _chat_inputs(request, accepted))


async def start_chat(request: Request, body: ChatCompletionRequest) -> StartedChat:
    """Everything /v1/chat/completions does before its first byte, for a body already parsed: the Responses and
    Messages endpoints translate theirs into one and answer from what it starts (collect_chat or responses.stream)."""
    accepted, inputs, shape = await _chat_inputs(request, _accept_parsed(request, body))
    return _start(request, accepted, inputs, shape)


async def _chat_inputs(
    request: Request, accepted: _Accepted[ChatCompletionRequest]
) -> tuple[_Accepted[ChatCompletionRequest], list[ChoiceInput], ResponseShape]:
    body, runtime = accepted.body, accepted.runtime
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    plan = request_grammar(body, runtime.chat.parser)
    prompt = await _render_chat(runtime, body)
    # Without xgrammar, "auto" still reads calls out of the answer, unconstrained (a forced call is a 400).
    lazy_only = plan.parser is not None and runtime.grammars is None
    grammar = await _grammar(request, runtime, None if lazy_only else plan.spec)
    max_tokens = chat_max_tokens(body, len(prompt), runtime.max_model_len)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    prediction = await _prediction(body, runtime)
    inputs = choice_inputs(body, [prompt], max_tokens, logprobs, body.prompt_logprobs, grammar, prediction)
    formatter_args = (
        accepted.public_id("chatcmpl"), runtime.model_name, runtime.tokenizer, body.return_tokens_as_token_ids,
        runtime.token_bytes,
    )  # fmt: skip
    formatter: ChatFormatter
    if plan.forced is not None:
        formatter = ToolCallFormatter(plan.forced, runtime.metrics.observe_tool_calls, *formatter_args)
    elif plan.parser is not None:
        formatter = AutoToolFormatter(plan.parser, runtime.metrics.observe_tool_calls, *formatter_args)
    else:
        formatter = ChatFormatter(*formatter_args)
    echo = chat_echo_text(body)
    shape = ResponseShape(
        formatter, body.n, None if echo is None else [echo], logprobs, False, body.prompt_logprobs,
        body.include_usage, body.continuous_usage, predicted=bool(prediction),
    )  # fmt: skip
    return accepted, inputs, shape


async def chat_prompt_ids(request: Request, body: ChatCompletionRequest) -> list[int]:
    """The prompt /v1/chat/completions renders for `body`, after the checks every request passes, starting
    nothing: what the Messages API's count_tokens counts, so that it equals that request's prompt_tokens."""
    accepted = _accept_parsed(request, body)
    return await _render_chat(accepted.runtime, body)


async def _render_chat(runtime: Runtime, body: ChatCompletionRequest) -> list[int]:
    # Tokenising a long conversation takes a while: off the event loop, so other streams keep flowing.
    return await asyncio.to_thread(chat_prompt, body, runtime.tokenizer, runtime.max_model_len, runtime.chat)


@dataclass(frozen=True)
class StartedChat:
    """A chat generation under way, and how its answer is shaped."""

    generation: Generation
    shape: ResponseShape
    grace_s: float  # how long an open stream may run on at shutdown (--shutdown-grace-s)


def _start(
    request: Request, accepted: _Accepted[_Request], inputs: list[ChoiceInput], shape: ResponseShape
) -> StartedChat:
    config, service, body = accepted.config, accepted.runtime.service, accepted.body
    shape = dataclasses.replace(shape, replica=ServerState.of(request.app).replica, arrival_time=accepted.arrival_time)
    if len(inputs) > config.max_queue:  # it could never be queued whole: a retry would never help, so not a 429
        raise bad_request(
            f"this request asks for {len(inputs)} sequences (prompts x n), more than the server's whole queue "
            f"of {config.max_queue}; send fewer prompts or a smaller n",
            param="n",
        )
    # Internal ids stay unique whatever the client calls its request, and start with the response's id.
    public_id = shape.formatter.request_id
    internal_id = public_id if body.request_id is None else service.new_request_id(public_id)
    generation = service.start(inputs, internal_id, accepted.arrival)  # 400/429/503 before any byte
    return StartedChat(generation, shape, config.shutdown_grace_s)


async def _respond(
    request: Request, accepted: _Accepted[_Request], inputs: list[ChoiceInput], shape: ResponseShape
) -> Response:
    started = _start(request, accepted, inputs, shape)
    if accepted.body.stream:
        return event_stream(responses.stream(started.generation, started.shape), started.grace_s)
    result = await collect_chat(request, started)
    if result is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return JSONResponse(result)


def event_stream(events: AsyncIterator[str | ServerSentEvent], grace_s: float) -> EventSourceResponse:
    """An SSE response of `events` (each a data line's text, or a ServerSentEvent for a named event)."""
    # On shutdown sse-starlette cancels open streams at once unless given a grace period: let them finish within the
    # server's (the lifespan's drain aborts whatever still runs after it).
    return EventSourceResponse(
        events, sep="\n", ping=15, headers={"Cache-Control": "no-cache"}, shutdown_grace_period=grace_s
    )


async def collect_chat(request: Request, started: StartedChat) -> dict[str, object] | None:
    """The whole answer of a started generation; None if the client left first (its sequences are aborted)."""
    try:
        return await _until_disconnect(request, responses.collect(started.generation, started.shape))
    finally:
        started.generation.close()


async def models(request: Request) -> Response:
    runtime = _runtime(request)
    card = model_card(runtime, ServerState.of(request.app).started)
    return JSONResponse({"object": "list", "data": [card]})


async def model(request: Request) -> Response:
    """One model's card, as /v1/models lists it (the openai SDK's `models.retrieve`)."""
    runtime = _runtime(request)
    _check_model(request.path_params["model_id"], runtime)
    return JSONResponse(model_card(runtime, ServerState.of(request.app).started))


async def version(request: Request) -> Response:
    return JSONResponse(version_info(_runtime(request)))


async def _accept_tokens(
    request: Request, schema: type[_TokensRequest]
) -> tuple[ServerConfig, Runtime, _TokensRequest]:
    """What /tokenize and /detokenize check first, as the generation endpoints do: readiness, body, model name."""
    config = ServerState.of(request.app).config
    runtime = _runtime(request)
    body = parse_request(schema, await read_json_body(request, config.max_body_bytes))
    _check_model(body.model, runtime)
    log_ignored_fields(request, body.ignored_fields())
    return config, runtime, body


async def tokenize(request: Request) -> Response:
    """vLLM's `POST /tokenize`: a prompt's or messages' token ids, as the generation endpoints would count them."""
    config, runtime, body = await _accept_tokens(request, TokenizeRequest)
    # Off the event loop, as the generation endpoints tokenise: a long prompt must not stall other streams.
    answer = await asyncio.to_thread(
        tokenization.tokenize, body, runtime.tokenizer, config, runtime.max_model_len, runtime.chat
    )
    return JSONResponse(answer)


async def detokenize(request: Request) -> Response:
    """vLLM's `POST /detokenize`: token ids back to text."""
    _, runtime, body = await _accept_tokens(request, DetokenizeRequest)
    return JSONResponse(await asyncio.to_thread(tokenization.detokenize, body, runtime.tokenizer))


async def health(request: Request) -> Response:
    state = ServerState.of(request.app)
    if state.serving:
        return JSONResponse({"status": "ok", "mode": state.config.mode})
    if state.loop_stopped is not None:
        return JSONResponse({"status": "failed", "reason": state.loop_stopped}, status_code=503)
    retry = {"Retry-After": "5"} if state.phase in (Phase.LOADING, Phase.DRAINING) else None
    return JSONResponse({"status": state.phase.value}, status_code=503, headers=retry)


async def metrics(request: Request) -> Response:
    runtime = _runtime(request)
    return Response(runtime.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
