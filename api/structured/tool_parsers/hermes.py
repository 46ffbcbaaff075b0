"""`hermes`: one JSON object per `<tool_call>...</tool_call>` tag, inside free text (Hermes 2 Pro, Qwen2.5 and
Qwen3, SmolLM3):

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

from collections.abc import Sequence

from api.structured.spec import GrammarSpec
from api.structured.tool_parsers.base import (
    FunctionTool,
    ParsedCall,
    StreamParser,
    ToolParser,
    call_object,
    tools_json_lines,
)
from api.structured.tool_parsers.json_reader import CallOutcome, read_call
from api.structured.tool_parsers.reader import Cursor, Literal, Reading, ReadingParser, expect, free_text, sink
from api.structured.tool_parsers.reader import skip_whitespace as skip
from api.structured.tool_parsers.tags import json_name, tag, triggered

START, END = "<tool_call>", "</tool_call>"
_TRIGGERS = (Literal(START),)


class HermesParser(ToolParser):
    name = "hermes"
    summary = 'one `{"name": ..., "arguments": ...}` object per `<tool_call>...</tool_call>` tag, inside free text'

    def grammar(self, tools: Sequence[FunctionTool], parallel: bool) -> GrammarSpec:
        begin = START + '\n{{"name": "{}", "arguments": '
        tags = [tag(begin.format(json_name(t.name)), t.parameters, "}\n" + END) for t in tools]
        return triggered([START], tags, stop_after_first=not parallel)

    def stream(self) -> StreamParser:
        return ReadingParser(_read)

    def system_prompt(self, tools: Sequence[FunctionTool]) -> str:
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{tools_json_lines(tools)}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            f"{START}{END} XML tags:\n"
            f'{START}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{END}'
        )

    def render_calls(self, calls: Sequence[ParsedCall]) -> str:
        return "\n".join(f"{START}\n{call_object(call)}\n{END}" for call in calls)


def _read(cursor: Cursor) -> Reading:
    while True:
        found = yield from free_text(cursor, _TRIGGERS)
        if found is None:
            return
        cursor.pos = found.end
        yield from skip(cursor)
        outcome = yield from read_call(cursor)
        if outcome is CallOutcome.BROKEN:
            yield from sink(cursor, found.content_end)
            return
        if outcome is CallOutcome.NOT_A_CALL:  # the tag, and what followed it, read as text
            cursor.emit_content(cursor.text[found.content_end : cursor.pos])
            continue
        yield from skip(cursor)
        if (yield from expect(cursor, END)):
            yield from skip(cursor)
