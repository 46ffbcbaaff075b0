"""A chat stream's chunks as the Messages API streams: named server-sent events, in Anthropic's order.

`message_start` (no content yet, the prompt's tokens as `input_tokens`), a `ping`, then per content block a
`content_block_start`, its deltas (`text_delta`; `input_json_delta` whose `partial_json` pieces join into the tool
call's input) and a `content_block_stop`; last `message_delta` (stop_reason, stop_sequence and the output tokens)
and `message_stop`. An error after the stream started is an `error` event, and the stream ends there.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from sse_starlette import ServerSentEvent

from api.protocol.messages_api import error_event
from api.translation.messages import message_id, stop_of, tool_use_id


@dataclass(frozen=True)
class StreamStart:
    """What message_start says before any token: the chat stream's id, the model, the prompt's length."""

    chat_id: str
    model: str
    input_tokens: int
    stop_sequences: list[str] | None


def event(payload: dict[str, Any]) -> ServerSentEvent:
    return ServerSentEvent(data=json.dumps(payload), event=payload["type"])


async def message_events(chunks: AsyncGenerator[str, None], start: StreamStart) -> AsyncIterator[ServerSentEvent]:
    """The events of one message from the chat stream's data lines (chunk JSON, an error's JSON, then [DONE]).
    Closing this closes `chunks`, which aborts the generation if it still runs (the client left)."""
    try:
        async for payload in _events(chunks, start):
            yield payload
    finally:
        await chunks.aclose()


async def _events(chunks: AsyncGenerator[str, None], start: StreamStart) -> AsyncIterator[ServerSentEvent]:
    blocks = _Blocks()
    message: dict[str, object] = {
        "id": message_id(start.chat_id),
        "type": "message",
        "role": "assistant",
        "model": start.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": start.input_tokens, "output_tokens": 0},
    }
    yield event({"type": "message_start", "message": message})
    yield event({"type": "ping"})
    stop: tuple[str, str | None] = ("end_turn", None)
    output_tokens = 0
    async for data in chunks:
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            yield event(error_event(chunk))
            return  # as Anthropic: the error is the stream's last event
        for choice in chunk.get("choices") or ():
            for payload in blocks.on_delta(choice.get("delta") or {}):
                yield event(payload)
            if choice.get("finish_reason") is not None:
                stop = stop_of(choice, start.stop_sequences)
        if chunk.get("usage"):
            output_tokens = chunk["usage"]["completion_tokens"]
    for payload in blocks.close():
        yield event(payload)
    usage = {"input_tokens": start.input_tokens, "output_tokens": output_tokens}
    yield event({"type": "message_delta", "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]}, "usage": usage})
    yield event({"type": "message_stop"})


class _Blocks:
    """The content blocks as the chat deltas open them: text runs into one text block; each new tool call (a delta
    with its id) closes what is open and starts a tool_use block."""

    def __init__(self) -> None:
        self.index = -1  # the open block's; -1: none yet
        self.open_type: str | None = None

    def on_delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.get("content"):
            if self.open_type != "text":
                events += self._start({"type": "text", "text": ""})
            text = {"type": "text_delta", "text": delta["content"]}
            events.append({"type": "content_block_delta", "index": self.index, "delta": text})
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            if call.get("id") is not None:
                block: dict[str, object] = {
                    "type": "tool_use",
                    "id": tool_use_id(call["id"]),
                    "name": function.get("name"),
                    "input": {},
                }
                events += self._start(block)
            if function.get("arguments") and self.open_type == "tool_use":
                piece = {"type": "input_json_delta", "partial_json": function["arguments"]}
                events.append({"type": "content_block_delta", "index": self.index, "delta": piece})
        return events

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close()
        self.index += 1
        self.open_type = str(block["type"])
        return [*events, {"type": "content_block_start", "index": self.index, "content_block": block}]

    def close(self) -> list[dict[str, Any]]:
        if self.open_type is None:
            return []
        self.open_type = None
        return [{"type": "content_block_stop", "index": self.index}]
