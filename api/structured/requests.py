"""A request's structured output: its grammar spec, whether the answer is a forced tool call, and the grammar
compiled for it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from api.protocol.errors import bad_request
from api.protocol.openai_api import ChatCompletionRequest, SamplingFields
from api.structured.grammars import INSTALL_HINT
from api.structured.spec import GrammarSpec, grammar_spec
from api.structured.tools import ToolCallMode, forced_tool_call
from engine.grammar import Grammar

if TYPE_CHECKING:
    from api.structured.grammars import Grammars

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def request_grammar(body: SamplingFields) -> tuple[GrammarSpec | None, ToolCallMode | None]:
    """What the request's answer must match (None: free text), and the tool-call mode when it must call a tool."""
    guided = {name: getattr(body, name) for name in _GUIDED if getattr(body, name) is not None}
    response_format = body.response_format.model_dump() if body.response_format is not None else None
    spec = grammar_spec(response_format, body.structured_outputs, guided)
    if not isinstance(body, ChatCompletionRequest):
        return spec, None
    forced = forced_tool_call(body.tools, body.tool_choice)
    if forced is None:
        return spec, None
    if spec is not None:
        raise bad_request(f"a forced tool call cannot be combined with {spec.param}", param="tool_choice")
    return forced


async def compile_grammar(grammars: Grammars | None, spec: GrammarSpec) -> Grammar:
    """The request's grammar (api/structured/grammars.py), compiled while the request keeps its place in the queue:
    it enters the scheduler at its arrival time, and no engine step ever waits for a grammar."""
    if grammars is None:
        raise bad_request(f"structured outputs need the xgrammar package on the server ({INSTALL_HINT})", spec.param)
    return await grammars.compile(spec)
