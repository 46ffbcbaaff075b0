"""The tool-call parsers by name (`--tool-call-parser`), and which one a model gets when the flag is not given."""

from __future__ import annotations

from api.structured.tool_parsers.base import ToolParser
from api.structured.tool_parsers.generic import GenericParser
from api.structured.tool_parsers.hermes import HermesParser
from api.structured.tool_parsers.llama3_json import PYTHON_TAG, Llama3JsonParser
from api.structured.tool_parsers.smollm2 import SmolLM2Parser

PARSERS: dict[str, ToolParser] = {
    parser.name: parser for parser in (HermesParser(), SmolLM2Parser(), Llama3JsonParser(), GenericParser())
}


def parser_named(name: str) -> ToolParser:
    return PARSERS[name]


def default_parser_name(chat_template: str | None, special_tokens: list[str]) -> str:
    """The format a model writes calls in, read off its template and tokens: `<tool_call>` in either (Hermes, Qwen,
    SmolLM3) is hermes, `<|python_tag|>` (Llama 3.1 and 3.2) llama3_json; a model that shows no format gets the
    generic envelope, as llama.cpp serves such models. That includes the default model, SmolLM2-135M-Instruct:
    `python -m benchmarks tool-routing` measured each format on it, and under the three lazy ones (its own family's
    smollm2 among them) it almost never starts a call; the envelope makes it choose at its first token, and it is
    the only one under which it calls the right tool (docs/tool_calling.md)."""
    template = chat_template or ""
    if "<tool_call>" in template or "<tool_call>" in special_tokens:
        return HermesParser.name
    if PYTHON_TAG in template or PYTHON_TAG in special_tokens:
        return Llama3JsonParser.name
    return GenericParser.name
