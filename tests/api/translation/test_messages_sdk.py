"""The anthropic SDK, unchanged, against a live server with the real default model, in both modes: `messages.create`,
`messages.stream` (its text_stream and final message), `messages.count_tokens` equal to the usage, stop sequences,
and a tool turn (a forced tool_use, then its tool_result) whose calls validate against the tool's schema.

The SDK of this era sends no sampling fields of its own: greedy requests pass `temperature` in `extra_body`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import jsonschema
import pytest
from anthropic.types import Message, MessageParam, ToolParam

from tests.server_harness import (
    RunningServer,
    mode_config,
    openai_client,
    real_loaded_model,
    running_server,
    stop_string_in,
)

pytestmark = pytest.mark.slow

MODES = ("dynamic", "continuous")
GREEDY = {"temperature": 0}
QUESTION: list[MessageParam] = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[ToolParam] = [
    {"name": "get_weather", "description": "The current weather in a city", "input_schema": WEATHER_SCHEMA},
    {
        "name": "get_time",
        "description": "The local time in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}},
    },
]
WEATHER_QUESTION: list[MessageParam] = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module", params=MODES)
def server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    with running_server(mode_config(request.param), real_loaded_model()) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def _model(server: RunningServer) -> str:
    return str(server.runtime.model_name)


def _create(server: RunningServer, client: anthropic.Anthropic, **fields: Any) -> Message:
    fields = {"model": _model(server), "max_tokens": 24, "messages": QUESTION, "extra_body": GREEDY, **fields}
    return client.messages.create(**fields)


def _count(server: RunningServer, client: anthropic.Anthropic, **fields: Any) -> int:
    return client.messages.count_tokens(model=_model(server), **{"messages": QUESTION, **fields}).input_tokens


def _text(message: Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_create_answers_as_the_chat_path_does_and_count_tokens_is_its_usage(
    server: RunningServer, client: anthropic.Anthropic
) -> None:
    message = _create(server, client)
    chat = openai_client(server).chat.completions.create(
        model=_model(server), messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=24,
        temperature=0,
    )  # fmt: skip
    assert message.id.startswith("msg_") and message.role == "assistant" and message.model == _model(server)
    assert [block.type for block in message.content] == ["text"]
    assert _text(message) == chat.choices[0].message.content and "Paris" in _text(message)
    assert message.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    assert chat.usage is not None
    assert (message.usage.input_tokens, message.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    assert _count(server, client) == message.usage.input_tokens
    system = [{"type": "text", "text": "Answer in one word."}]
    assert _count(server, client, system=system) == _create(server, client, system=system).usage.input_tokens


def test_a_stream_says_what_create_says(server: RunningServer, client: anthropic.Anthropic) -> None:
    created = _create(server, client)
    with client.messages.stream(model=_model(server), max_tokens=24, messages=QUESTION, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == _text(final) == _text(created)
    assert final.id.startswith("msg_") and final.stop_reason == created.stop_reason
    assert (final.usage.input_tokens, final.usage.output_tokens) == (
        created.usage.input_tokens,
        created.usage.output_tokens,
    )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_stop_sequence_ends_the_message_before_it(
    server: RunningServer, client: anthropic.Anthropic, stream: bool
) -> None:
    full = _text(_create(server, client))
    index, stop = stop_string_in(full, length=3)
    fields: dict[str, Any] = {"model": _model(server), "max_tokens": 24, "messages": QUESTION, "extra_body": GREEDY}
    if stream:
        with client.messages.stream(**fields, stop_sequences=[stop, "never said"]) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**fields, stop_sequences=[stop, "never said"])
    assert (_text(message), message.stop_reason, message.stop_sequence) == (full[:index], "stop_sequence", stop)


def _tool_use(message: Message) -> Any:
    [call] = [block for block in message.content if block.type == "tool_use"]
    assert call.id.startswith("toolu_")
    return call


def test_a_tool_turn_forced_then_answered(server: RunningServer, client: anthropic.Anthropic) -> None:
    """A forced call (tool_choice "tool", then "any", streamed), then its result sent back: what agents do."""
    named = _create(
        server, client, messages=WEATHER_QUESTION, tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"},
        max_tokens=64,
    )  # fmt: skip
    call = _tool_use(named)
    assert named.stop_reason == "tool_use" and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER_SCHEMA)
    fields: dict[str, Any] = {"model": _model(server), "max_tokens": 64, "messages": WEATHER_QUESTION, "tools": TOOLS}
    with client.messages.stream(**fields, tool_choice={"type": "any"}, extra_body=GREEDY) as events:
        streamed = events.get_final_message()
    anyone = _tool_use(streamed)
    assert streamed.stop_reason == "tool_use" and anyone.name in ("get_weather", "get_time")
    jsonschema.validate(anyone.input, next(tool["input_schema"] for tool in TOOLS if tool["name"] == anyone.name))

    turn: list[MessageParam] = [
        *WEATHER_QUESTION,
        {"role": "assistant", "content": [block.to_dict() for block in named.content]},  # type: ignore[list-item,misc]
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C, sunny"}]},
    ]
    answer = _create(server, client, messages=turn, tools=TOOLS, tool_choice={"type": "none"}, max_tokens=32)
    assert [block.type for block in answer.content] == ["text"] and _text(answer)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    count = _count(server, client, messages=turn, tools=TOOLS, tool_choice={"type": "none"})
    assert count == answer.usage.input_tokens


def test_tool_choice_auto(server: RunningServer, client: anthropic.Anthropic) -> None:
    """Anthropic's default with tools: the model answers or calls, and every call validates; streamed, the same."""
    message = _create(server, client, messages=WEATHER_QUESTION, tools=TOOLS, max_tokens=64)
    with client.messages.stream(
        model=_model(server), max_tokens=64, messages=WEATHER_QUESTION, tools=TOOLS, tool_choice={"type": "auto"},
        extra_body=GREEDY,
    ) as events:  # fmt: skip
        streamed = events.get_final_message()

    def content(reply: Message) -> list[dict[str, object]]:  # a call's id is fresh each time
        return [{k: v for k, v in block.to_dict().items() if k != "id"} for block in reply.content]

    assert content(streamed) == content(message)
    calls = [block for block in message.content if block.type == "tool_use"]
    for call in calls:
        jsonschema.validate(call.input, next(tool["input_schema"] for tool in TOOLS if tool["name"] == call.name))
    assert message.stop_reason in (("tool_use",) if calls else ("end_turn", "max_tokens"))
