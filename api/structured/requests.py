"""A request's structured output: its grammar spec, how its tools shape the answer, and the grammar compiled for
it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from api.protocol.errors import bad_request
from api.protocol.openai_api import ChatCompletionRequest, SamplingFields
from api.structured.grammars import INSTALL_HINT
from api.structured.spec import GrammarSpec, grammar_spec
from api.structured.tool_choice import ToolPlan, tool_plan
from api.structured.tool_parsers.base import ToolParser
from engine.sample.grammar import Grammar

if TYPE_CHECKING:
    from api.structured.grammars import Grammars

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def request_grammar(body: SamplingFields, parser: ToolParser | None = None) -> ToolPlan:
    """What the request's answer must match (`spec`, None: free text), and how its tools read out of it (chat;
    `parser`: the server's tool parser, for `tool_choice` "auto")."""
    guided = {name: getattr(body, name) for name in _GUIDED if getattr(body, name) is not None}
    response_format = body.response_format.model_dump() if body.response_format is not None else None
    spec = grammar_spec(response_format, body.structured_outputs, guided)
    if not isinstance(body, ChatCompletionRequest):
        return ToolPlan(spec)
    return tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls, spec, parser)


async def compile_grammar(grammars: Grammars | None, spec: GrammarSpec) -> Grammar:
    """The request's grammar (api/structured/grammars.py), compiled while the request keeps its place in the queue:
    it enters the scheduler at its arrival time, and no engine step ever waits for a grammar."""
    if grammars is None:
        raise bad_request(f"structured outputs need the xgrammar package on the server ({INSTALL_HINT})", spec.param)
    return await grammars.compile(spec)
