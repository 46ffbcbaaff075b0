"""LiteLLM's `completion` with tools and no tool_choice, as its docs show for an OpenAI-compatible server
(model "openai/<served name>", api_base): the assistant message goes back as returned, then each tool's result,
until the model answers or the turn bound; plain and streamed (`stream_chunk_builder` assembles the chunks)."""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its import fetches a price list from the web otherwise

import litellm

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

litellm.suppress_debug_info = True  # else it prints its provider list to stdout, around the JSON lines

TOOLS = [
    {"type": "function", "function": {"name": TOOL_NAME, "description": TOOL_DESCRIPTION, "parameters": TOOL_SCHEMA}}
]


def _completion(target: Target, messages: list[Any], stream: bool) -> Any:
    request: dict[str, Any] = {
        "model": f"openai/{target.model}",
        "api_base": target.openai_base_url,
        "api_key": "unused",
        "messages": messages,
        "tools": TOOLS,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "max_retries": 0,
        "timeout": 300,
    }
    if not stream:
        return litellm.completion(**request)
    chunks = list(litellm.completion(**request, stream=True))
    assert chunks, "an empty stream"
    return litellm.stream_chunk_builder(chunks, messages=messages)


def tool_loop(target: Target, stream: bool = False) -> Outcome:
    messages: list[Any] = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": PROMPT}]
    calls = 0
    for _ in range(MAX_TURNS):
        choice = _completion(target, messages, stream).choices[0]
        tool_calls = choice.message.tool_calls or []
        if not tool_calls:
            assert choice.finish_reason in ("stop", "length"), f"finish_reason {choice.finish_reason!r}"
            return Outcome(str(choice.finish_reason), calls)
        assert choice.finish_reason == "tool_calls", f"tool calls with finish_reason {choice.finish_reason!r}"
        messages.append(choice.message)
        for call in tool_calls:
            assert call.id and call.function.name == TOOL_NAME, f"tool call {call!r}"
            arguments = checked_arguments(call.function.arguments, TOOL_SCHEMA)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": get_weather(**arguments)})
            calls += 1
    return Outcome("max_turns", calls)


SCENARIOS = {"tools": tool_loop, "tools_stream": lambda target: tool_loop(target, stream=True)}

if __name__ == "__main__":
    run(SCENARIOS)
