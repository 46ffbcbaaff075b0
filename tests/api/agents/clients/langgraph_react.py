"""LangGraph's `create_react_agent` with a ChatOpenAI model and one tool, run to its end under a recursion limit:
`auto` (the model decides), `streaming` (the same over streamed chat completions) and `required` (a model bound
with tool_choice "required", which calls the tool every turn, so the graph ends on its step limit after the
tool's results went back)."""

from __future__ import annotations

from typing import Any

from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import StructuredTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.prebuilt import create_react_agent

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

WEATHER = StructuredTool.from_function(get_weather, name=TOOL_NAME, description=TOOL_DESCRIPTION)
# Each turn is two steps (the model, then the tools), so this bounds the loop at MAX_TURNS model calls.
RECURSION_LIMIT = 2 * MAX_TURNS
# What the graph answers itself, instead of calling the model, when too few steps remain for a tool round.
OUT_OF_STEPS = "Sorry, need more steps to process this request."


def _run_graph(target: Target, streaming: bool = False, tool_choice: str | None = None) -> Outcome:
    chat = ChatOpenAI(
        base_url=target.openai_base_url,
        api_key="unused",  # type: ignore[arg-type]
        model=target.model,
        temperature=0,
        max_completion_tokens=MAX_TOKENS,
        max_retries=0,
        timeout=300,
        streaming=streaming,
    )
    model: Any = chat if tool_choice is None else chat.bind_tools([WEATHER], tool_choice=tool_choice)
    graph = create_react_agent(model, [WEATHER], prompt=INSTRUCTIONS)
    state: dict[str, Any] = {}
    try:
        for chunk in graph.stream(
            {"messages": [("user", PROMPT)]}, {"recursion_limit": RECURSION_LIMIT}, stream_mode="values"
        ):
            state = chunk  # the last state seen, which a recursion error would otherwise take with it
        ending = "step_limit" if state["messages"][-1].content == OUT_OF_STEPS else "final_answer"
    except GraphRecursionError:
        ending = "recursion_limit"
    messages = state.get("messages", [])
    replies = [message for message in messages if isinstance(message, AIMessage)]
    assert replies, "the graph got no answer from the model"
    schema = convert_to_openai_tool(WEATHER)["function"]["parameters"]
    calls = 0
    for reply in replies:
        assert not reply.invalid_tool_calls, f"tool calls LangChain could not parse: {reply.invalid_tool_calls}"
        for call in reply.tool_calls:
            assert call["name"] == TOOL_NAME, f"call to an unknown tool: {call}"
            checked_arguments(call["args"], schema)
            calls += 1
    if tool_choice == "required":
        assert ending in ("step_limit", "recursion_limit"), "a model forced to call tools ended the graph by itself"
        assert any(isinstance(message, ToolMessage) for message in messages), "no tool result went back"
    return Outcome(ending, calls)


SCENARIOS = {
    "auto": lambda target: _run_graph(target),
    "streaming": lambda target: _run_graph(target, streaming=True),
    "required": lambda target: _run_graph(target, tool_choice="required"),
}

if __name__ == "__main__":
    run(SCENARIOS)
