"""The openai SDK against `/v1/responses`: `responses.create`, `responses.stream`, a `previous_response_id`
continuation (stored by default), and a function call whose output goes back through `previous_response_id`."""

from __future__ import annotations

from typing import Any

from openai import OpenAI
from openai.types.responses import FunctionToolParam, Response

from .common import (
    INSTRUCTIONS,
    MAX_TOKENS,
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

TOOL: FunctionToolParam = {
    "type": "function",
    "name": TOOL_NAME,
    "description": TOOL_DESCRIPTION,
    "parameters": TOOL_SCHEMA,
    "strict": True,
}


def _client(target: Target) -> OpenAI:
    return OpenAI(base_url=target.openai_base_url, api_key="unused", max_retries=0, timeout=300)


def _check_response(response: Response, target: Target) -> None:
    """The documented shape of a Response, which the SDK itself does not validate."""
    assert response.object == "response" and response.id, f"not a response: {response!r}"
    assert response.model == target.model, f"model {response.model!r}, asked for {target.model!r}"
    assert response.status in ("completed", "incomplete"), f"status {response.status!r}"
    if response.status == "incomplete":
        assert response.incomplete_details is not None, "an incomplete response without incomplete_details"
    assert response.output, "a response without output items"
    for item in response.output:
        assert item.type in ("message", "function_call"), f"unexpected output item {item!r}"
        if item.type == "message":
            assert item.role == "assistant" and item.id, f"output message {item!r}"
            assert all(part.type == "output_text" for part in item.content), f"message content {item.content!r}"
        else:
            assert item.call_id and item.name == TOOL_NAME, f"function call {item!r}"
            checked_arguments(item.arguments, TOOL_SCHEMA)
    usage = response.usage
    assert usage is not None and usage.input_tokens > 0 and usage.output_tokens > 0, f"usage {usage!r}"
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens, f"usage {usage!r}"


def create(target: Target) -> Outcome:
    with _client(target) as client:
        response = client.responses.create(model=target.model, input="Say hello.", max_output_tokens=32, temperature=0)
    _check_response(response, target)
    return Outcome(str(response.status))


def stream(target: Target) -> Outcome:
    with (
        _client(target) as client,
        client.responses.stream(model=target.model, input="Say hello.", max_output_tokens=32, temperature=0) as events,
    ):
        seen = list(events)
        final = events.get_final_response()
    types = [event.type for event in seen]
    assert types[0] == "response.created", f"event order {types}"
    assert types[-1] in ("response.completed", "response.incomplete"), f"event order {types}"
    for expected in ("response.output_item.added", "response.output_text.delta", "response.output_item.done"):
        assert expected in types, f"no {expected} event in {types}"
    _check_response(final, target)
    deltas = "".join(event.delta for event in seen if event.type == "response.output_text.delta")
    assert deltas == final.output_text, "the text deltas do not add up to the final response"
    return Outcome(str(final.status))


def continuation(target: Target) -> Outcome:
    with _client(target) as client:
        first = client.responses.create(
            model=target.model, input="My name is Sam.", max_output_tokens=16, temperature=0
        )
        second = client.responses.create(
            model=target.model,
            input="What is my name?",
            previous_response_id=first.id,
            max_output_tokens=16,
            temperature=0,
        )
    _check_response(first, target)
    _check_response(second, target)
    assert second.previous_response_id == first.id, f"previous_response_id {second.previous_response_id!r}"
    assert first.usage is not None and second.usage is not None
    # The continuation's prompt holds the first turn's input and output, then the new input.
    carried = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens > carried, (
        f"{second.usage.input_tokens} input tokens, the first turn had {carried}"
    )
    return Outcome(str(second.status))


def tool_continuation(target: Target) -> Outcome:
    """A forced function call, then its output sent back by `previous_response_id` with the default tool choice."""
    with _client(target) as client:
        first = client.responses.create(
            model=target.model,
            instructions=INSTRUCTIONS,
            input=PROMPT,
            tools=[TOOL],
            tool_choice="required",
            max_output_tokens=MAX_TOKENS,
            temperature=0,
        )
        _check_response(first, target)
        calls = [item for item in first.output if item.type == "function_call"]
        assert calls, f"tool_choice 'required' gave no function call: {first.output!r}"
        outputs: list[Any] = [
            {
                "type": "function_call_output",
                "call_id": call.call_id,
                "output": get_weather(**checked_arguments(call.arguments, TOOL_SCHEMA)),
            }
            for call in calls
        ]
        second = client.responses.create(
            model=target.model,
            previous_response_id=first.id,
            input=outputs,
            tools=[TOOL],
            max_output_tokens=MAX_TOKENS,
            temperature=0,
        )
    _check_response(second, target)
    return Outcome(str(second.status), len(calls))


SCENARIOS = {"create": create, "stream": stream, "continuation": continuation, "tool_continuation": tool_continuation}

if __name__ == "__main__":
    run(SCENARIOS)
