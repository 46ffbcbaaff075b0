"""The anthropic SDK against `/v1/messages`: `messages.create`, `messages.stream`, `messages.count_tokens` (equal
to `usage.input_tokens` of the same request) and a tool loop: a tool_use forced by tool_choice "any", then
tool_result turns with the default (auto) choice until the model answers or the turn bound."""

from __future__ import annotations

from typing import Any

from anthropic import Anthropic
from anthropic.types import Message, MessageParam, ToolParam

from .common import (
    INSTRUCTIONS,
    MAX_TOKENS,
    MAX_TURNS,
    PROMPT,
    TOOL_DESCRIPTION,
    TOOL_NAME,
    TOOL_SCHEMA,
    Outcome,
    Target,
    checked_arguments,
    get_weather,
    run,
)

TOOL: ToolParam = {"name": TOOL_NAME, "description": TOOL_DESCRIPTION, "input_schema": TOOL_SCHEMA}
HELLO: list[MessageParam] = [{"role": "user", "content": "Say hello."}]
STOP_REASONS = {"end_turn", "max_tokens", "stop_sequence", "tool_use"}


def _client(target: Target) -> Anthropic:
    return Anthropic(base_url=target.base_url, api_key="unused", max_retries=0, timeout=300)


def _check_message(message: Message, target: Target, stop_reasons: set[str] = STOP_REASONS) -> None:
    """The documented shape of a Message, which the SDK itself does not validate."""
    assert message.type == "message" and message.role == "assistant", f"not an assistant message: {message!r}"
    assert message.id, "message without an id"
    assert message.model == target.model, f"model {message.model!r}, asked for {target.model!r}"
    assert message.stop_reason in stop_reasons, f"stop_reason {message.stop_reason!r}, expected one of {stop_reasons}"
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0, f"usage {message.usage!r}"
    for block in message.content:
        assert block.type in ("text", "tool_use"), f"unexpected content block {block!r}"
        if block.type == "tool_use":
            assert block.id and block.name == TOOL_NAME, f"tool_use block {block!r}"
            checked_arguments(block.input, TOOL_SCHEMA)
    if message.stop_reason == "tool_use":
        assert any(block.type == "tool_use" for block in message.content), "stop_reason tool_use without a tool_use"


def _text(message: Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def create(target: Target) -> Outcome:
    with _client(target) as client:
        message = client.messages.create(model=target.model, max_tokens=32, messages=HELLO)
    _check_message(message, target, {"end_turn", "max_tokens"})
    return Outcome(str(message.stop_reason))


def stream(target: Target) -> Outcome:
    with (
        _client(target) as client,
        client.messages.stream(model=target.model, max_tokens=32, messages=HELLO) as events,
    ):
        types, pieces = [], []
        for event in events:
            types.append(event.type)
            if event.type == "text":
                pieces.append(event.text)
        final = events.get_final_message()
    assert types[0] == "message_start" and types[-1] == "message_stop", f"event order {types}"
    for expected in ("content_block_start", "content_block_delta", "content_block_stop", "message_delta"):
        assert expected in types, f"no {expected} event in {types}"
    _check_message(final, target, {"end_turn", "max_tokens"})
    assert "".join(pieces) == _text(final), "the text deltas do not add up to the final message"
    return Outcome(str(final.stop_reason))


def count_tokens(target: Target) -> Outcome:
    plain: dict[str, Any] = {"model": target.model, "system": INSTRUCTIONS, "messages": HELLO}
    with_tools: dict[str, Any] = {**plain, "messages": [{"role": "user", "content": PROMPT}], "tools": [TOOL]}
    with _client(target) as client:
        for request in (plain, with_tools):
            counted = client.messages.count_tokens(**request).input_tokens
            used = client.messages.create(**request, max_tokens=8).usage.input_tokens
            assert counted == used, f"count_tokens said {counted}, the same request used {used} input tokens"
    return Outcome("counted")


def _as_params(message: Message) -> list[Any]:
    """An assistant turn's content, sent back as request blocks."""
    blocks: list[Any] = []
    for block in message.content:
        if block.type == "text":
            blocks.append({"type": "text", "text": block.text})
        elif block.type == "tool_use":
            blocks.append({"type": "tool_use", "id": block.id, "name": block.name, "input": block.input})
    return blocks


def _tool_request(target: Target) -> dict[str, Any]:
    # Greedy, as the other clients' loops: at the API's default temperature (1.0) a 135M model's forced call can
    # sample a city name that runs to max_tokens. This SDK's create() no longer takes temperature; the API does.
    return {
        "model": target.model,
        "system": INSTRUCTIONS,
        "max_tokens": MAX_TOKENS,
        "tools": [TOOL],
        "extra_body": {"temperature": 0},
    }


def tool_loop(target: Target) -> Outcome:
    messages: list[MessageParam] = [{"role": "user", "content": PROMPT}]
    request = _tool_request(target)
    calls = 0
    with _client(target) as client:
        reply = client.messages.create(**request, messages=messages, tool_choice={"type": "any"})
        _check_message(reply, target, {"tool_use"})
        for _ in range(MAX_TURNS):
            uses = [block for block in reply.content if block.type == "tool_use"]
            if reply.stop_reason != "tool_use":
                return Outcome(str(reply.stop_reason), calls)
            calls += len(uses)
            results: list[Any] = [
                {
                    "type": "tool_result",
                    "tool_use_id": use.id,
                    "content": get_weather(**checked_arguments(use.input, TOOL_SCHEMA)),
                }
                for use in uses
            ]
            messages += [{"role": "assistant", "content": _as_params(reply)}, {"role": "user", "content": results}]
            reply = client.messages.create(**request, messages=messages)
            _check_message(reply, target)
    return Outcome("max_turns", calls)


def tool_stream(target: Target) -> Outcome:
    """A forced tool call, streamed: the SDK assembles the input from input_json_delta events."""
    request = _tool_request(target)
    messages: list[MessageParam] = [{"role": "user", "content": PROMPT}]
    with (
        _client(target) as client,
        client.messages.stream(**request, messages=messages, tool_choice={"type": "any"}) as events,
    ):
        types = [event.type for event in events]
        final = events.get_final_message()
    assert types[0] == "message_start" and types[-1] == "message_stop", f"event order {types}"
    assert "input_json" in types, f"no input_json_delta event in {types}"
    _check_message(final, target, {"tool_use"})
    return Outcome("tool_use", sum(block.type == "tool_use" for block in final.content))


SCENARIOS = {
    "create": create,
    "stream": stream,
    "count_tokens": count_tokens,
    "tool_loop": tool_loop,
    "tool_stream": tool_stream,
}

if __name__ == "__main__":
    run(SCENARIOS)
