"""`POST /v1/responses` (OpenAI's Responses API) on the chat path, and `GET`/`DELETE /v1/responses/{id}` on the
app's response store. A request becomes a chat completion request (responses_input.py), is started as
/v1/chat/completions starts one, and its answer becomes a response (response_objects.py) or the Responses stream's
events (responses_stream.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from api.endpoints import responses as chat_responses
from api.endpoints.routes import check_serving, collect_chat, event_stream, read_json_body, start_chat
from api.protocol.errors import APIError, bad_request
from api.protocol.openai_api import parse_request
from api.protocol.responses_api import ResponsesRequest, responses_refusal
from api.translation.response_objects import ResponseDraft, output_messages, output_of_chat, status_of, usage_of
from api.translation.response_store import ResponseStore
from api.translation.responses_input import Message, chat_plan
from api.translation.responses_stream import response_events

logger = logging.getLogger("batchserve.api")


def _not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(
        404,
        f"no stored response has the id {response_id[:80]!r} (never stored, deleted, or evicted from the store)",
        param=param,
        code="response_not_found",
    )


class ResponsesRoutes:
    """The three routes, bound to one app's store."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    async def create(self, request: Request) -> Response:
        config = check_serving(request)
        body = parse_request(ResponsesRequest, await read_json_body(request, config.max_body_bytes))
        refused = responses_refusal(body)
        if refused is not None:
            raise refused
        ignored = body.ignored_fields()
        if ignored:  # as the chat path: names only, never values
            names = ", ".join(repr(name[:40]) for name in ignored[:10])
            logger.info("POST %s: ignoring fields this server does not use: %s", request.url.path, names)
        history = self._history(body.previous_response_id)
        plan = chat_plan(body, history)
        try:
            started = await start_chat(request, plan.chat)
        except APIError as exc:
            raise plan.renamed(exc) from None
        draft = ResponseDraft(body, started.shape.formatter.model)

        def keep(response: dict[str, Any]) -> None:
            if body.store:
                self.store.put(response, [*history, *plan.turn, *output_messages(response["output"])])

        if body.stream:
            chunks = chat_responses.stream(started.generation, started.shape)
            return event_stream(response_events(chunks, draft, keep), started.grace_s)
        result = await collect_chat(request, started)
        if result is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        return JSONResponse(_answer(draft, result, keep))

    def _history(self, previous_response_id: str | None) -> list[Message]:
        if previous_response_id is None:
            return []
        stored = self.store.get(previous_response_id)
        if stored is None:
            raise _not_found(previous_response_id, param="previous_response_id")
        return stored.conversation

    async def retrieve(self, request: Request) -> Response:
        if request.query_params.get("stream", "false").lower() not in ("false", "0"):
            raise bad_request("replaying a stored response as a stream is not supported by this server", "stream")
        stored = self.store.get(request.path_params["response_id"])
        if stored is None:
            raise _not_found(request.path_params["response_id"])
        return JSONResponse(stored.response)

    async def delete(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if not self.store.delete(response_id):
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


def _answer(draft: ResponseDraft, result: dict[str, Any], keep: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    output, finish = output_of_chat(result)
    response = draft.json(status_of(finish), output, usage_of(result.get("usage")))
    keep(response)
    return response
