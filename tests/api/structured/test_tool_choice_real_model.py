"""tool_choice on the real default model (SmolLM2-135M-Instruct) through a live server, with its default parser and
the server's tool-aware template: auto calls (whole, streamed, through the openai SDK), an answer after a tool's
result, none, required, parallel_tool_calls false; every call validates against its tool with jsonschema. A 135M
model routes poorly (docs/tool_calling.md measures it): these prompts are ones it gets right greedily."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

pytest.importorskip("xgrammar")

from api.protocol.openai_api import ChatCompletionRequest
from api.text.prompts import chat_prompt
from tests.server_harness import RunningServer, mode_config, openai_client, real_loaded_model, running_server

pytestmark = pytest.mark.slow
_CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
_PLACE = {"type": "object", "properties": {"place": {"type": "string"}}, "required": ["place"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the weather", "parameters": _CITY}},
    {"type": "function", "function": {"name": "get_time", "description": "Get the time", "parameters": _PLACE}},
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "Is it raining in London today?"}]


@pytest.fixture(scope="module", params=["continuous", "dynamic"])
def server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    with running_server(mode_config(request.param), real_loaded_model()) as running:
        yield running


def _create(server: RunningServer, stream: bool = False, **kwargs: Any) -> tuple[Any, list[tuple[str, str]], str]:
    """(message content, [(name, arguments)], finish_reason), whole or assembled from the SDK's stream helper."""
    client = openai_client(server).with_options(timeout=900)  # a 2-core machine under load: tens of seconds
    body: dict[str, Any] = {"model": server.runtime.model_name, "temperature": 0, "max_tokens": 60, **kwargs}
    if stream:
        with client.chat.completions.stream(**body) as events:
            choice = events.get_final_completion().choices[0]
    else:
        choice = client.chat.completions.create(**body).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    return choice.message.content, calls, str(choice.finish_reason)


@pytest.mark.parametrize("tool_choice", [None, "auto"])
def test_auto_calls_the_tool_whole_and_streamed_alike(server: RunningServer, tool_choice: str | None) -> None:
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    content, calls, reason = _create(server, messages=ASK, tools=TOOLS, **extra)
    assert calls and calls[0][0] == "get_weather" and "london" in json.loads(calls[0][1])["city"].lower()
    assert reason == "tool_calls" and content is None
    assert _create(server, stream=True, messages=ASK, tools=TOOLS, **extra) == (content, calls, reason)


def test_after_the_tools_result_it_answers(server: RunningServer) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "London"}'}}
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"rain": false, "sky": "clear"}'},
    ]
    content, calls, reason = _create(server, messages=messages, tools=TOOLS)
    assert calls == [] and content and reason in ("stop", "length")


def test_parallel_tool_calls_false_calls_once(server: RunningServer) -> None:
    ask = [{"role": "user", "content": "Current time in Tokyo, please."}]
    _, calls, _ = _create(server, messages=ask, tools=TOOLS, parallel_tool_calls=False)
    assert len(calls) == 1


def test_none_answers_in_text_and_required_calls(server: RunningServer) -> None:
    content, calls, _ = _create(server, messages=ASK, tools=TOOLS, tool_choice="none")
    assert calls == [] and content
    _, calls, reason = _create(server, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120)
    assert len(calls) == 1 and reason == "tool_calls"


def test_plain_requests_render_with_the_models_own_template(server: RunningServer) -> None:
    """The tool-aware template is for requests with tools: a plain one's prompt is token for token the model's
    own template's (so float32 greedy parity with transformers holds as before)."""
    runtime = server.runtime
    assert runtime.chat.tool_template is not None  # the default model's own template ignores tools
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hello there"}]})
    ours = chat_prompt(request, runtime.tokenizer, runtime.max_model_len, runtime.chat)
    assert ours == chat_prompt(request, runtime.tokenizer, runtime.max_model_len)
    own = runtime.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello there"}], add_generation_prompt=True, return_dict=False
    )
    assert ours == list(own)
