"""`/v1/responses` with the real SmolLM2-135M-Instruct through the `openai` SDK, in both modes: plain and streamed
(the SDK's own stream helper), a conversation continued by previous_response_id, forced function calls whose
arguments validate with `jsonschema` and whose output the next turn answers from, text.format json_schema, and
tool_choice "auto" (the default with tools), whose every call must validate too."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from openai.types.responses import FunctionToolParam

from tests.server_harness import RunningServer, mode_config, openai_client, real_loaded_model, running_server

pytestmark = pytest.mark.slow

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOL: FunctionToolParam = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the weather in a city",
    "parameters": WEATHER,
    "strict": True,
}
ASK = "What is the weather in Paris, in celsius?"


@pytest.fixture(scope="module", params=["dynamic", "continuous"])
def server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    with running_server(mode_config(request.param), real_loaded_model()) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai_client(server).with_options(timeout=600)  # a 2-core machine under load: tens of seconds


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_create_answers_as_chat_does(client: openai.OpenAI, model: str) -> None:
    question = "What is the capital of France?"
    response = client.responses.create(model=model, input=question, max_output_tokens=48, temperature=0)
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=48, temperature=0
    )
    assert response.status == "completed" and response.error is None
    assert response.output_text == chat.choices[0].message.content and "Paris" in response.output_text
    assert response.usage is not None and chat.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )


def test_the_sdks_stream_helper_gets_the_final_response(client: openai.OpenAI, model: str) -> None:
    deltas = []
    with client.responses.stream(model=model, input="Say hello.", max_output_tokens=64, temperature=0) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(deltas) != ""
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_previous_response_id_answers_as_the_whole_history_resent(client: openai.OpenAI, model: str) -> None:
    first = client.responses.create(model=model, input="My name is Ada.", max_output_tokens=24, temperature=0)
    second = client.responses.create(
        model=model, input="What is my name?", previous_response_id=first.id, max_output_tokens=24, temperature=0
    )
    history: list[Any] = [
        {"role": "user", "content": "My name is Ada."},
        *[item.model_dump(exclude_none=True) for item in first.output],  # output items go back as input
        {"role": "user", "content": "What is my name?"},
    ]
    resent = client.responses.create(
        model=model,
        input=history,
        max_output_tokens=24,
        temperature=0,
        store=False,
    )
    assert second.output_text == resent.output_text
    assert second.usage is not None and resent.usage is not None
    assert second.usage.input_tokens == resent.usage.input_tokens > first.usage.total_tokens  # type: ignore[union-attr]
    client.responses.delete(first.id)
    client.responses.retrieve(second.id)  # each stored response holds its whole conversation


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "name": "get_weather"}], ids=["required", "named"]
)
def test_a_forced_call_validates_and_its_output_answers_the_next_turn(
    client: openai.OpenAI, model: str, tool_choice: Any
) -> None:
    called = client.responses.create(
        model=model, input=ASK, tools=[TOOL], tool_choice=tool_choice, max_output_tokens=64, temperature=0
    )
    assert called.status == "completed"
    [call] = called.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    answer = client.responses.create(
        model=model,
        previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}],
        tools=[TOOL],
        tool_choice="none",
        max_output_tokens=64,
        temperature=0,
    )
    assert answer.status == "completed" and "18" in answer.output_text


def test_a_streamed_forced_call_sends_its_arguments_in_pieces(client: openai.OpenAI, model: str) -> None:
    events = list(
        client.responses.create(
            model=model,
            input=ASK,
            tools=[TOOL],
            tool_choice="required",
            max_output_tokens=64,
            temperature=0,
            stream=True,
        )
    )
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == pieces and done.name == "get_weather"
    jsonschema.validate(json.loads(pieces), WEATHER)
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[0].arguments == pieces  # type: ignore[union-attr]


def test_text_format_json_schema(client: openai.OpenAI, model: str) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model=model,
        input="Give a person's name and age as JSON.",
        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
        max_output_tokens=64,
        temperature=0,
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"


def _check_auto_output(output: list[Any]) -> None:
    """Under auto the model may answer or call: every item is a message or a call whose arguments validate."""
    assert output
    for item in output:
        assert item.type in ("message", "function_call"), item
        if item.type == "function_call":
            assert item.name == "get_weather"
            jsonschema.validate(json.loads(item.arguments), WEATHER)


@pytest.mark.parametrize("tool_choice", [None, "auto"], ids=["omitted", "auto"])
def test_auto_answers_or_calls_and_every_call_validates(client: openai.OpenAI, model: str, tool_choice: Any) -> None:
    """Needs tool_choice "auto" on the chat path (a 400 until it lands)."""
    choice: dict[str, Any] = {} if tool_choice is None else {"tool_choice": tool_choice}
    response = client.responses.create(
        model=model, input=ASK, tools=[TOOL], max_output_tokens=96, temperature=0, **choice
    )
    assert response.status == "completed"
    _check_auto_output(response.output)


def test_auto_streamed(client: openai.OpenAI, model: str) -> None:
    """Needs tool_choice "auto" on the chat path (a 400 until it lands)."""
    with client.responses.stream(model=model, input=ASK, tools=[TOOL], max_output_tokens=96, temperature=0) as stream:
        final = stream.get_final_response()
    _check_auto_output(final.output)
