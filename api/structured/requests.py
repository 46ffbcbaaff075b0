"""A request's structured output: its grammar spec, whether the answer is a forced tool call, and the grammar
compiled for it off the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

from api.endpoints.errors import bad_request
from api.endpoints.protocol import ChatCompletionRequest, SamplingFields
from api.structured.spec import GrammarCompileError, GrammarSpec, compile_error, grammar_spec
from api.structured.tools import ToolCallMode, forced_tool_call
from engine.grammar import Grammar

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from api.structured.xgrammar_backend import XGrammarCompiler

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
INSTALL_HINT = "pip install --no-deps xgrammar apache-tvm-ffi"


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


def grammar_compiler(
    tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: Sequence[int]
) -> XGrammarCompiler | None:
    """The server's compiler, or None where xgrammar is not installed (structured outputs are then a 400)."""
    try:
        from api.structured.xgrammar_backend import XGrammarCompiler
    except ImportError:
        return None
    return XGrammarCompiler(tokenizer, vocab_size, stop_token_ids)


async def compile_grammar(compiler: XGrammarCompiler | None, spec: GrammarSpec) -> Grammar:
    """Compile on a worker thread: a large schema's first compile takes a while, and the event loop serves streams.
    The request then enters the scheduler's queue at its arrival time, so the wait overlaps its place in the queue
    and no engine step ever waits for a grammar."""
    if compiler is None:
        raise bad_request(f"structured outputs need the xgrammar package on the server ({INSTALL_HINT})", spec.param)
    try:
        return await asyncio.to_thread(compiler.compile, spec)
    except GrammarCompileError as exc:
        raise compile_error(spec, str(exc)) from None
