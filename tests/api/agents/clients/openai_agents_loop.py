"""openai-agents, set up as its docs show: an Agent with one function tool, run by `Runner.run` to its end, on the
default Responses API model (`OpenAIResponsesModel`) and on `OpenAIChatCompletionsModel`, each with an
AsyncOpenAI client pointed at the server and tracing off. `auto`: the SDK's default tool choice (unset);
`required`: a tool call first (the SDK resets the choice after it), so the tool's output goes back every time."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    ToolCallItem,
    ToolCallOutputItem,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from .common import (
    INSTRUCTIONS,
    MAX_TOKENS,
    MAX_TURNS,
    PROMPT,
    TOOL_DESCRIPTION,
    TOOL_NAME,
    Outcome,
    Target,
    checked_arguments,
    get_weather,
    run,
)

WEATHER = function_tool(get_weather, name_override=TOOL_NAME, description_override=TOOL_DESCRIPTION)


async def _run_agent(target: Target, api: str, tool_choice: str | None) -> Outcome:
    client = AsyncOpenAI(base_url=target.openai_base_url, api_key="unused", max_retries=0, timeout=300)
    model: Any = (
        OpenAIResponsesModel(target.model, client)
        if api == "responses"
        else OpenAIChatCompletionsModel(target.model, client)
    )
    settings = ModelSettings(max_tokens=MAX_TOKENS, temperature=0, tool_choice=tool_choice)
    agent = Agent(name="weather", instructions=INSTRUCTIONS, model=model, tools=[WEATHER], model_settings=settings)
    items: Sequence[Any]
    try:
        result = await Runner.run(agent, PROMPT, max_turns=MAX_TURNS)
        assert isinstance(result.final_output, str), f"final output {result.final_output!r} is not text"
        items, ending = result.new_items, "final_output"
    except MaxTurnsExceeded as error:
        items, ending = (error.run_data.new_items if error.run_data else []), "max_turns"
    finally:
        await client.close()
    calls = [item for item in items if isinstance(item, ToolCallItem)]
    for call in calls:
        assert getattr(call.raw_item, "name", None) == TOOL_NAME, f"call to an unknown tool: {call.raw_item!r}"
        checked_arguments(getattr(call.raw_item, "arguments", None) or "", WEATHER.params_json_schema)
    if tool_choice == "required":
        assert calls, "tool_choice 'required' gave no tool call"
        assert any(isinstance(item, ToolCallOutputItem) for item in items), "the tool's output never went back"
    return Outcome(ending, len(calls))


def _scenario(api: str, tool_choice: str | None) -> Any:
    return lambda target: asyncio.run(_run_agent(target, api, tool_choice))


SCENARIOS = {
    "responses_auto": _scenario("responses", None),
    "responses_required": _scenario("responses", "required"),
    "chat_auto": _scenario("chat", None),
    "chat_required": _scenario("chat", "required"),
}

if __name__ == "__main__":
    set_tracing_disabled(True)
    run(SCENARIOS)
