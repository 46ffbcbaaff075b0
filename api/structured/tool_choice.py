"""What a chat request's `tools`, `tool_choice` and `parallel_tool_calls` make of its answer.

- `"auto"` (and `tool_choice` left out when there are tools): the model answers freely, and the server's tool parser
  reads calls out of its answer; the parser's lazy grammar keeps every call parseable and its arguments valid
  against the tool's `parameters`. Another structured output in the same request wins: its grammar holds the
  whole answer, which is then content (the tools still reach the template).
- `"none"`: text; the tools still reach the template, as in vLLM.
- `"required"` or a named function: a forced call (api/structured/tools.py).
- `parallel_tool_calls: false`: at most one call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from api.protocol.errors import bad_request
from api.structured.spec import GrammarSpec
from api.structured.tool_parsers.base import ToolParser
from api.structured.tools import ToolCallMode, checked_tools, forced_tool_call


@dataclass(frozen=True)
class ToolPlan:
    """How a request's answer is constrained and read: `spec` (None: free), then either a forced call's mode, or
    the parser that reads calls out of free generation, or neither (plain text)."""

    spec: GrammarSpec | None
    forced: ToolCallMode | None = None
    parser: ToolParser | None = None


def tool_plan(
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    parallel: bool,
    other: GrammarSpec | None,
    parser: ToolParser | None,
) -> ToolPlan:
    """`other`: the request's own structured output, if any; `parser`: the server's tool parser (None: a server
    without one reads no calls, and "auto" answers in text)."""
    forced = forced_tool_call(tools, tool_choice)  # checks tools and tool_choice, whatever the choice
    if forced is not None:
        if other is not None:
            raise bad_request(f"a forced tool call cannot be combined with {other.param}", param="tool_choice")
        return ToolPlan(*forced)
    if not tools or tool_choice == "none" or other is not None or parser is None:
        return ToolPlan(other)
    return ToolPlan(parser.grammar(checked_tools(tools), parallel), parser=parser)
