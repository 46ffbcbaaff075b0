"""A chat completion stream as the Responses API's named events, each with its `sequence_number`:
response.created, response.in_progress; per output item response.output_item.added, then for a message
response.content_part.added, response.output_text.delta..., response.output_text.done, response.content_part.done,
and for a function call response.function_call_arguments.delta..., response.function_call_arguments.done; then
response.output_item.done; and last response.completed (response.incomplete when max_output_tokens cut it,
response.failed when the generation failed after the stream began).

The chat stream's chunks are read as any client reads them (content deltas; tool_calls by index, their id and name
once, arguments in pieces), so whatever the chat path streams (forced or parsed calls) comes out as items."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from sse_starlette import ServerSentEvent

from api.protocol.errors import APIError
from api.translation.response_objects import (
    Item,
    ResponseDraft,
    call_item,
    message_item,
    new_id,
    status_of,
    text_part,
    usage_of,
)

logger = logging.getLogger("batchserve.api")


class _Translator:
    """The events of one stream, with the output items as they grow; at most one item is open at a time."""

    def __init__(self, draft: ResponseDraft) -> None:
        self.draft = draft
        self.sequence = 0
        self.items: list[Item] = []
        self.open: Item | None = None
        self.calls: dict[int, Item] = {}  # the chat stream's tool call index -> its item
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None

    def event(self, kind: str, **fields: Any) -> ServerSentEvent:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return ServerSentEvent(data=json.dumps(data), event=kind)

    def opening(self) -> list[ServerSentEvent]:
        response = self.draft.json("in_progress", [])
        return [self.event(kind, response=response) for kind in ("response.created", "response.in_progress")]

    def on_chunk(self, data: dict[str, Any]) -> list[ServerSentEvent]:
        if data.get("usage"):
            self.usage = data["usage"]
        events: list[ServerSentEvent] = []
        for choice in data.get("choices") or ():  # one choice: a Responses request has no `n`
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._call(call)
            if choice.get("finish_reason") is not None:
                self.finish = choice["finish_reason"]
        return events

    def _add(self, item: Item) -> list[ServerSentEvent]:
        events = self._close("completed")
        self.open = item
        self.items.append(item)
        return [*events, self.event("response.output_item.added", output_index=len(self.items) - 1, item=item)]

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _open_message(self) -> list[ServerSentEvent]:
        item = message_item(new_id("msg"), None, "in_progress")
        events = self._add(item)
        item["content"].append(text_part(""))
        part = self.event("response.content_part.added", **self._where(), content_index=0, part=text_part(""))
        return [*events, part]

    def _text(self, text: str) -> list[ServerSentEvent]:
        events = []
        if self.open is None or self.open["type"] != "message":
            events += self._open_message()
        assert self.open is not None
        self.open["content"][0]["text"] += text
        where = self._where()
        events.append(self.event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=[]))
        return events

    def _call(self, call: dict[str, Any]) -> list[ServerSentEvent]:
        index = call.get("index", 0)
        function = call.get("function") or {}
        events = []
        if index not in self.calls:
            call_id = call.get("id") or new_id("call")
            item = call_item(new_id("fc"), call_id, function.get("name", ""), "", "in_progress")
            self.calls[index] = item
            events += self._add(item)
        elif self.calls[index] is not self.open:  # the chat path streams one call after another: never seen
            logger.error("%s: a streamed tool call went on after the next item began", self.draft.id)
            return []
        piece = function.get("arguments") or ""
        if piece:
            self.calls[index]["arguments"] += piece
            events.append(self.event("response.function_call_arguments.delta", **self._where(), delta=piece))
        return events

    def _close(self, status: str) -> list[ServerSentEvent]:
        item, events = self.open, list[ServerSentEvent]()
        if item is None:
            return events
        where = self._where()
        if item["type"] == "message":
            part = item["content"][0]
            text = part["text"]
            events.append(self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]))
            events.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        else:
            done = {"arguments": item["arguments"], "name": item["name"]}
            events.append(self.event("response.function_call_arguments.done", **where, **done))
        item["status"] = status
        events.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        self.open = None
        return events

    def closing(self) -> tuple[list[ServerSentEvent], dict[str, Any]]:
        """The last events, and the response they end with."""
        status = status_of(self.finish)
        events = []
        if not self.items:  # nothing was generated: an empty message, as the whole answer has
            events += self._open_message()
        events += self._close(status)
        response = self.draft.json(status, self.items, usage_of(self.usage))
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return [*events, self.event(kind, response=response)], response

    def failed(self, error: dict[str, Any]) -> ServerSentEvent:
        if self.open is not None:  # as it stood when the generation failed
            self.open["status"] = "incomplete"
        code = "server_error" if str(error.get("type")) == "internal_error" else error.get("code")
        failure = {"code": code, "message": error.get("message", "the response failed")}
        return self.event("response.failed", response=self.draft.json("failed", self.items, error=failure))


async def response_events(
    chunks: AsyncGenerator[str, None], draft: ResponseDraft, on_complete: Callable[[dict[str, Any]], None]
) -> AsyncIterator[ServerSentEvent]:
    """The Responses events of a chat stream (api/endpoints/responses.stream's data lines); `on_complete` gets
    the final response of a stream that completed (or was cut by max_output_tokens), never of one that failed."""
    translator = _Translator(draft)
    for event in translator.opening():
        yield event
    async with aclosing(chunks):  # the client gone, the chat stream closes too: its generation is aborted
        try:
            async for chunk in chunks:
                if chunk == "[DONE]":
                    break
                data = json.loads(chunk)
                if "error" in data:
                    yield translator.failed(data["error"])
                    return
                for event in translator.on_chunk(data):
                    yield event
        except Exception:  # the stream has started: report the fault in-band, as the chat stream does
            logger.exception("streaming response %s failed", draft.id)
            yield translator.failed(APIError(500, "internal server error while streaming").body()["error"])
            return
    events, response = translator.closing()
    on_complete(response)
    for event in events:
        yield event
