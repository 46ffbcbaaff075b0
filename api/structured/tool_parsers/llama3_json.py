"""`llama3_json`: Llama 3.1 and 3.2's JSON tool calls, `<|python_tag|>` optionally first, then one object per call,
`{"name": ..., "parameters": ...}` ("arguments" is read too), calls separated by `;`:

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

The object itself is the trigger: free text runs until `{"name":` (any whitespace) or `<|python_tag|>`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from api.structured.spec import GrammarSpec
from api.structured.tool_parsers.base import FunctionTool, ParsedCall, StreamParser, ToolParser, call_object
from api.structured.tool_parsers.json_reader import CallOutcome, read_call
from api.structured.tool_parsers.reader import Cursor, Literal, Reading, ReadingParser, free_text, peek, sink
from api.structured.tool_parsers.reader import skip_whitespace as skip
from api.structured.tool_parsers.tags import json_name, tag, triggered

PYTHON_TAG = "<|python_tag|>"
_HEAD = '{"name": '  # how the grammar writes a call's start (the trigger text, to the model)
_NAME_KEY = '"name"'


@dataclass(frozen=True)
class _ObjectHead:
    """`{`, whitespace, `"name"`, whitespace, `:`: the start of a call object in free text."""

    pattern: re.Pattern[str] = re.compile(r'\{\s*"name"\s*:')

    def find(self, text: str, start: int) -> tuple[int, int] | None:
        match = self.pattern.search(text, start)
        return None if match is None else (match.start(), match.end())

    def partial(self, text: str, start: int) -> int | None:
        at = text.find("{", start)
        while at >= 0:
            if _could_start_head(text, at + 1):
                return at
            at = text.find("{", at + 1)
        return None


def _could_start_head(text: str, i: int) -> bool:
    """Whether text[i:], after a `{`, may still grow into `\\s*"name"\\s*:` (it is not one yet)."""
    while i < len(text) and text[i].isspace():
        i += 1
    rest = text[i : i + len(_NAME_KEY)]
    if not _NAME_KEY.startswith(rest):
        return False
    if len(rest) < len(_NAME_KEY):
        return True
    i += len(_NAME_KEY)
    while i < len(text) and text[i].isspace():
        i += 1
    return i == len(text)


_TRIGGERS = (Literal(PYTHON_TAG), _ObjectHead())


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    summary = '`<|python_tag|>` optional, then `{"name": ..., "parameters": ...}` objects separated by `;`'

    def grammar(self, tools: Sequence[FunctionTool], parallel: bool) -> GrammarSpec:
        tags = []
        for prefix in ("", PYTHON_TAG):
            for tool in tools:
                begin = f'{prefix}{_HEAD}"{json_name(tool.name)}", "parameters": '
                tags.append(tag(begin, tool.parameters, "}"))
        return triggered([_HEAD, PYTHON_TAG], tags, stop_after_first=not parallel)

    def stream(self) -> StreamParser:
        return ReadingParser(_read)

    def system_prompt(self, tools: Sequence[FunctionTool]) -> str:
        definitions = "\n\n".join(json.dumps({"type": "function", "function": t.definition()}, indent=4) for t in tools)
        return (
            "Given the following functions, please respond with a JSON for a function call with its proper "
            "arguments that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
            "value}. Do not use variables. If no function fits, answer in plain text.\n\n"
            f"{definitions}"
        )

    def render_calls(self, calls: Sequence[ParsedCall]) -> str:
        return "; ".join(call_object(call, "parameters") for call in calls)


def _read(cursor: Cursor) -> Reading:
    while True:
        found = yield from free_text(cursor, _TRIGGERS)
        if found is None:
            return
        if found.trigger == _TRIGGERS[0]:
            cursor.pos = found.end
            yield from skip(cursor)
        outcome = yield from read_call(cursor)
        if outcome is CallOutcome.BROKEN:
            yield from sink(cursor, found.content_end)
            return
        if outcome is CallOutcome.NOT_A_CALL:
            if cursor.pos == found.start:  # nothing read: the trigger's first character is text, and on from there
                cursor.pos += 1
            cursor.emit_content(cursor.text[found.content_end : cursor.pos])
            continue
        yield from skip(cursor)
        if (yield from peek(cursor)) == ";":
            cursor.pos += 1
            yield from skip(cursor)
