"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API, run on the chat path
(api/translation/messages.py), its errors in Anthropic's shape."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from api.endpoints import responses
from api.endpoints.routes import (
    chat_prompt_ids,
    check_serving,
    collect_chat,
    event_stream,
    log_ignored_fields,
    read_json_body,
    start_chat,
)
from api.endpoints.state import ServerState
from api.protocol.errors import APIError
from api.protocol.messages_api import CountTokensRequest, MessagesRequest, error_response, parse_messages_request
from api.text.chat_template import control_token_texts
from api.translation.messages import refuse_control_text, to_chat, to_message
from api.translation.messages_stream import StreamStart, message_events

logger = logging.getLogger("batchserve.api")
_Body = TypeVar("_Body", CountTokensRequest, MessagesRequest)
# The chat path names its own fields in errors; these are the Messages API's names for them.
_FIELDS = {
    "stop": "stop_sequences",
    "prompt": "messages",
    "user": "metadata.user_id",
    "response_format": "output_config.format",
}


async def messages(request: Request) -> Response:
    return await _in_anthropic_shape(request, _messages)


async def count_tokens(request: Request) -> Response:
    """The prompt's tokens as /v1/messages would render it: equal to that request's `usage.input_tokens`."""
    return await _in_anthropic_shape(request, _count_tokens)


async def _messages(request: Request) -> Response:
    body = await _parse(request, MessagesRequest)
    started = await start_chat(request, to_chat(body))
    if body.stream:
        formatter = started.shape.formatter
        input_tokens = len(started.generation.choices[0].prompt_token_ids)
        start = StreamStart(formatter.request_id, formatter.model, input_tokens, body.stop_sequences)
        chunks = responses.stream(started.generation, started.shape)
        return event_stream(message_events(chunks, start), started.grace_s)
    result = await collect_chat(request, started)
    if result is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return JSONResponse(to_message(result, body.stop_sequences))


async def _count_tokens(request: Request) -> Response:
    body = await _parse(request, CountTokensRequest)
    return JSONResponse({"input_tokens": len(await chat_prompt_ids(request, to_chat(body)))})


async def _parse(request: Request, model: type[_Body]) -> _Body:
    """Readiness, the body, its schema and what its translation cannot take."""
    config = check_serving(request)
    body = parse_messages_request(model, await read_json_body(request, config.max_body_bytes))
    log_ignored_fields(request, body.ignored_fields())
    refuse_control_text(body, control_token_texts(ServerState.of(request.app).loaded().tokenizer))
    return body


async def _in_anthropic_shape(request: Request, handler: Callable[[Request], Awaitable[Response]]) -> Response:
    try:
        return await handler(request)
    except APIError as exc:
        return error_response(_named(exc))
    except Exception:  # before any byte went out: an answer in this API's shape, and the server keeps serving
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(APIError(500, "internal server error; the server is still serving"))


def _named(error: APIError) -> APIError:
    """The error with its message led by the field it is about, in this API's names (Anthropic's errors carry no
    `param`); the translation's own messages start with their field's path already."""
    if error.param is None:
        return error
    field = _FIELDS.get(error.param, error.param)
    if error.message.startswith(field):
        return error
    return APIError(error.status, f"{field}: {error.message}", field, error.code, error.headers)
