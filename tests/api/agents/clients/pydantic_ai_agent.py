"""pydantic-ai: an `Agent` with one function tool and text output on `OpenAIChatModel`, run to its end under a
request limit."""

from __future__ import annotations

from openai import AsyncOpenAI
from pydantic_ai import Agent, Tool, UsageLimits, capture_run_messages
from pydantic_ai.exceptions import UsageLimitExceeded
from pydantic_ai.messages import ModelResponse, ToolCallPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

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


def _run_agent(target: Target) -> Outcome:
    client = AsyncOpenAI(base_url=target.openai_base_url, api_key="unused", max_retries=0, timeout=300)
    model = OpenAIChatModel(target.model, provider=OpenAIProvider(openai_client=client))
    tool = Tool(get_weather, takes_ctx=False, name=TOOL_NAME, description=TOOL_DESCRIPTION)
    agent = Agent(model, output_type=str, instructions=INSTRUCTIONS, tools=[tool])
    with capture_run_messages() as messages:
        try:
            result = agent.run_sync(
                PROMPT,
                model_settings={"max_tokens": MAX_TOKENS, "temperature": 0.0},
                usage_limits=UsageLimits(request_limit=MAX_TURNS),
            )
            assert isinstance(result.output, str), f"output {result.output!r} is not text"
            ending = "final_output"
        except UsageLimitExceeded:
            ending = "request_limit"
    calls = [
        part
        for message in messages
        if isinstance(message, ModelResponse)
        for part in message.parts
        if isinstance(part, ToolCallPart)
    ]
    for call in calls:
        assert call.tool_name == TOOL_NAME, f"call to an unknown tool: {call}"
        checked_arguments(call.args if call.args is not None else {}, TOOL_SCHEMA)
    return Outcome(ending, len(calls))


SCENARIOS = {"auto": _run_agent}

if __name__ == "__main__":
    run(SCENARIOS)
