"""The chat side of the agent workload: each turn's request body, and the next turn's history from the last answer.

A later turn resends the whole history (as agents do): the previous request's messages, the model's answer as an
assistant message (its text and its tool calls as the server returned them), then the new turn's reply, as one tool
result per call, or as a user message when the answer called no tool.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from benchmarks.loadgen.workloads import ChatTurn, RequestSpec


def chat_payload(turn: ChatTurn, max_tokens: int) -> dict[str, Any]:
    """What an agent sends: the history, the tools, and no tool_choice (OpenAI's default with tools is auto); a chat
    without tools sends none."""
    payload: dict[str, Any] = {"messages": list(turn.messages), "max_tokens": max_tokens}
    if turn.tools:
        payload["tools"] = list(turn.tools)
    return payload


def next_turn(
    previous: RequestSpec, text: str, tool_calls: tuple[dict[str, Any], ...], spec: RequestSpec
) -> RequestSpec:
    """`spec` (a later turn, carrying its reply) with the whole history: `previous` as sent, then its answer."""
    assert previous.chat is not None and spec.chat is not None
    answer: dict[str, Any] = {"role": "assistant", "content": text or None}
    if tool_calls:
        answer["tool_calls"] = list(tool_calls)
        replies = [{"role": "tool", "tool_call_id": call["id"], "content": spec.chat.reply} for call in tool_calls]
    else:
        replies = [{"role": "user", "content": spec.chat.reply}]
    messages = (*previous.chat.messages, answer, *replies)
    return dataclasses.replace(spec, chat=dataclasses.replace(spec.chat, messages=messages))


class ToolCallDeltas:
    """Streamed tool calls put back together: OpenAI sends each call's id, type and name once, under its `index`,
    then fragments of its arguments that only append."""

    def __init__(self) -> None:
        self._calls: dict[int, dict[str, Any]] = {}

    def add(self, deltas: list[Any]) -> bool:
        """Take one chunk's `delta.tool_calls`; whether it carried any."""
        for delta in deltas:
            if not isinstance(delta, dict):
                continue
            call = self._calls.setdefault(
                int(delta.get("index", 0)), {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            )
            call["id"] = delta.get("id") or call["id"]
            function = delta.get("function") or {}
            call["function"]["name"] += function.get("name") or ""
            call["function"]["arguments"] += function.get("arguments") or ""
        return bool(deltas)

    def calls(self) -> tuple[dict[str, Any], ...]:
        return tuple(self._calls[index] for index in sorted(self._calls))
