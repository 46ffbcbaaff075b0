"""The Responses API's objects: the response (`ResponseDraft.json`), its output items (a `message` with
`output_text` content, `function_call`s) and usage, built from a chat completion or from its stream."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from api.protocol.responses_api import InputItem, ResponsesRequest
from api.translation.responses_input import Message, input_messages

Item = dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def status_of(finish_reason: str | None) -> str:
    """A response (or an item) cut by max_output_tokens (or the context) is incomplete, as OpenAI's."""
    return "incomplete" if finish_reason == "length" else "completed"


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> Item:
    """A message; `text` None: one just opened, before its content part."""
    content = [] if text is None else [text_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> Item:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def usage_of(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    details = chat_usage.get("prompt_tokens_details") or {}
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0)},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def output_of_chat(result: dict[str, Any]) -> tuple[list[Item], str | None]:
    """A chat completion's one choice as output items (its text, then its calls), and its finish_reason."""
    choice = result["choices"][0]
    message, finish = choice["message"], choice["finish_reason"]
    status = status_of(finish)
    calls = message.get("tool_calls") or []
    items = []
    if message.get("content") or not calls:
        items.append(message_item(new_id("msg"), message.get("content") or "", status))
    for call in calls:
        function = call["function"]
        items.append(call_item(new_id("fc"), call["id"], function["name"], function["arguments"], status))
    return items, finish


def output_messages(output: list[Item]) -> list[Message]:
    """The output as chat messages, for the conversation a later previous_response_id continues: output items
    are input items too (clients send them back), so they take the same path."""
    items = [InputItem.model_validate(item) for item in output]
    return [message for _, message in input_messages(items, _call_ids(output))]


def _call_ids(output: list[Item]) -> set[str]:
    return {item["call_id"] for item in output if item["type"] == "function_call"}


@dataclass(frozen=True)
class ResponseDraft:
    """What a response says about its request, fixed when it starts; `json` adds its outcome."""

    request: ResponsesRequest
    model: str
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def json(
        self,
        status: str,
        output: list[Item],
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        body = self.request
        fmt = body.text.format if body.text is not None and body.text.format is not None else {"type": "text"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "model": self.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": body.store,
            "temperature": body.temperature,
            "text": {"format": fmt},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": body.tools or [],
            "top_p": body.top_p,
            "truncation": body.truncation,
            "usage": usage,
            "user": body.user,
        }
