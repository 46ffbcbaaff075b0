"""`smollm2`: the SmolLM2 family's format, a list of calls in one `<tool_call>...</tool_call>` tag, `[]` for "no
call" (the function-calling prompt of the SmolLM2 model card, which the tools block here repeats):

    <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>
"""

from __future__ import annotations

import enum
import json
from collections.abc import Generator, Sequence

from api.structured.spec import GrammarSpec
from api.structured.tool_parsers.base import FunctionTool, ParsedCall, StreamParser, ToolParser, call_object
from api.structured.tool_parsers.json_reader import CallOutcome, read_call
from api.structured.tool_parsers.reader import (
    Cursor,
    Literal,
    Reading,
    ReadingParser,
    expect,
    free_text,
    peek,
    sink,
)
from api.structured.tool_parsers.reader import skip_whitespace as skip
from api.structured.tool_parsers.tags import calls_schema, tag, triggered

START, END = "<tool_call>", "</tool_call>"
_TRIGGERS = (Literal(START),)


class SmolLM2Parser(ToolParser):
    name = "smollm2"
    summary = 'a list of `{"name": ..., "arguments": ...}` objects in one `<tool_call>...</tool_call>`; `[]`: no call'

    def grammar(self, tools: Sequence[FunctionTool], parallel: bool) -> GrammarSpec:
        call, definitions = calls_schema(tools)
        schema = {"type": "array", "items": call, **({} if parallel else {"maxItems": 1}), "$defs": definitions}
        # One tag holds every call; without parallel calls the answer ends after it, so at most one call in all.
        return triggered([START], [tag(START, schema, END)], stop_after_first=not parallel)

    def stream(self) -> StreamParser:
        return ReadingParser(_read)

    def system_prompt(self, tools: Sequence[FunctionTool]) -> str:
        definitions = json.dumps([tool.definition() for tool in tools])
        return (
            "You are an expert in composing functions. You are given a question and a set of possible functions.\n"
            "Based on the question, you will need to make one or more function/tool calls to achieve the purpose.\n"
            "If none of the functions can be used, point it out and refuse to answer.\n"
            "If the given question lacks the parameters required by the function, also point it out.\n\n"
            f"You have access to the following tools:\n<tools>{definitions}</tools>\n\n"
            "The output MUST strictly adhere to the following format, and NO other text MUST be included.\n"
            "The example format is as follows. Please make sure the parameter type is correct. If no function call "
            "is needed, please make the tool calls an empty list '[]'.\n"
            f'{START}[\n{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}},\n'
            f"... (more tool calls as required)\n]{END}"
        )

    def render_calls(self, calls: Sequence[ParsedCall]) -> str:
        return START + "[" + ", ".join(call_object(call) for call in calls) + "]" + END


def _read(cursor: Cursor) -> Reading:
    while True:
        found = yield from free_text(cursor, _TRIGGERS)
        if found is None:
            return
        cursor.pos = found.end
        yield from skip(cursor)
        listed = (yield from _read_list(cursor, found.content_end)) if (yield from expect(cursor, "[")) else _List.TEXT
        if listed is _List.TEXT:  # nothing of it was announced: the tag, and what followed it, read as text
            cursor.emit_content(cursor.text[found.content_end : cursor.pos])
            continue
        if listed is _List.SUNK:
            return
        yield from skip(cursor)
        if (yield from expect(cursor, END)):
            yield from skip(cursor)


class _List(enum.Enum):
    CLOSED = "closed"  # its `]` was read
    TEXT = "text"  # not a list of calls, and nothing was announced
    SUNK = "sunk"  # a call was announced and the list broke off: the rest is unfinished


def _read_list(cursor: Cursor, tag_start: int) -> Generator[None, None, _List]:
    """The calls of one list, after its `[`. A first call that breaks leaves the whole tag unfinished; a later one,
    itself."""
    announced = cursor.announced
    first = True
    start, outcome = cursor.pos, CallOutcome.WHOLE
    while True:
        yield from skip(cursor)
        char = yield from peek(cursor)
        if char == "]":
            cursor.pos += 1
            return _List.CLOSED
        if not first:
            if char != ",":
                break
            cursor.pos += 1
            yield from skip(cursor)
        first = False
        start = tag_start if cursor.announced == announced else cursor.pos
        outcome = yield from read_call(cursor)
        if outcome is not CallOutcome.WHOLE:
            break
    if cursor.announced == announced:
        return _List.TEXT
    yield from sink(cursor, start if outcome is CallOutcome.BROKEN else cursor.pos)
    return _List.SUNK
