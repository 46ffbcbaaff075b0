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
# The SmolLM2 family's own template ignores tools; of the four formats this one measured best on the default model
# (SmolLM2-135M-Instruct) over `python -m benchmarks tool-routing` (docs/tool_calling.md).
SMOLLM2_DEFAULT = "smollm2"


def parser_named(name: str) -> ToolParser:
    return PARSERS[name]


def default_parser_name(chat_template: str | None, special_tokens: list[str], source: str) -> str:
    """The format a model writes calls in, read off its template and tokens: `<tool_call>` in either (Hermes, Qwen,
    SmolLM3) is hermes, `<|python_tag|>` (Llama 3.1 and 3.2) llama3_json; the SmolLM2 family (by its model file's
    name) its measured best; anything else, which knows no format, the generic envelope."""
    template = chat_template or ""
    if "<tool_call>" in template or "<tool_call>" in special_tokens:
        return HermesParser.name
    if PYTHON_TAG in template or PYTHON_TAG in special_tokens:
        return Llama3JsonParser.name
    if "smollm2" in source.lower():
        return SMOLLM2_DEFAULT
    return GenericParser.name
