"""`generic`: llama.cpp's envelope for models with no tool format of their own. The whole answer is one JSON object,
constrained from its first token: calls, or a text answer.

    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
    {"response": "Paris is the capital of France."}

A text answer streams as ordinary content, decoded from its JSON string as it comes. `{"tool_call": {...}}` (one
call, llama.cpp's spelling without parallel calls) is read too.
"""

from __future__ import annotations

import json
from collections.abc import Generator, Sequence

from api.structured.spec import GrammarSpec, schema_spec
from api.structured.tool_parsers.base import FunctionTool, ParsedCall, StreamParser, ToolParser, call_object
from api.structured.tool_parsers.json_reader import CallOutcome, read_call, read_key, stream_string
from api.structured.tool_parsers.reader import Cursor, Reading, ReadingParser, expect, free_text, peek, sink
from api.structured.tool_parsers.reader import skip_whitespace as skip
from api.structured.tool_parsers.tags import PARAM, calls_schema


class GenericParser(ToolParser):
    name = "generic"
    summary = 'the whole answer is JSON: `{"tool_calls": [...]}` or `{"response": "..."}`, constrained from the start'

    def grammar(self, tools: Sequence[FunctionTool], parallel: bool) -> GrammarSpec:
        call, definitions = calls_schema(tools)
        calls = {"type": "array", "items": call, "minItems": 1, **({} if parallel else {"maxItems": 1})}
        schema = {
            "anyOf": [
                _envelope("tool_calls", calls),
                _envelope("response", {"type": "string"}),
            ],
            "$defs": definitions,
        }
        return schema_spec(schema, PARAM)

    def stream(self) -> StreamParser:
        return ReadingParser(_read)

    def system_prompt(self, tools: Sequence[FunctionTool]) -> str:
        definitions = json.dumps([tool.definition() for tool in tools], indent=2)
        example = self.render_calls([ParsedCall("tool_name", '{"argument": "value"}')])
        return (
            "Respond in JSON format, either with `tool_calls` (a request to call tools) or with `response` (your "
            "reply to the user's request).\n\n"
            f"You can call any of the following tools:\n{definitions}\n\n"
            f"A tool call looks like this:\n{example}\n"
            'A reply looks like this:\n{"response": "..."}'
        )

    def render_calls(self, calls: Sequence[ParsedCall]) -> str:
        return '{"tool_calls": [' + ", ".join(call_object(call) for call in calls) + "]}"


_KEYS = ("response", "tool_calls", "tool_call")


def _envelope(key: str, schema: dict[str, object]) -> dict[str, object]:
    return {"type": "object", "properties": {key: schema}, "required": [key], "additionalProperties": False}


def _read(cursor: Cursor) -> Reading:
    key = yield from _envelope_key(cursor)
    if key == "response" and (yield from peek(cursor)) == '"':
        if (yield from stream_string(cursor)):
            yield from _close(cursor)
    elif key in ("tool_calls", "tool_call"):
        if (yield from _calls(cursor, key)):
            yield from _close(cursor)
    else:  # not the envelope (no grammar would let this through): the answer as it is
        cursor.pos = 0
    yield from free_text(cursor, ())


def _envelope_key(cursor: Cursor) -> Generator[None, None, str | None]:
    """Read `{"key":` and answer the key, if the answer starts as the envelope does."""
    yield from skip(cursor)
    if not (yield from expect(cursor, "{")):
        return None
    yield from skip(cursor)
    key = yield from read_key(cursor)
    yield from skip(cursor)
    if key not in _KEYS or not (yield from expect(cursor, ":")):
        return None
    yield from skip(cursor)
    return key


def _close(cursor: Cursor) -> Generator[None, None, None]:
    """The envelope's `}`; text after it is content (none, under the grammar)."""
    yield from skip(cursor)
    if (yield from expect(cursor, "}")):
        yield from skip(cursor)


def _calls(cursor: Cursor, key: str) -> Generator[None, None, bool]:
    """The calls after `"tool_calls":` (a list) or `"tool_call":` (one object). False once the rest is sunk."""
    start = cursor.pos
    if key == "tool_call":
        outcome = yield from read_call(cursor)
        return (yield from _after(cursor, outcome, start))
    if not (yield from expect(cursor, "[")):
        return (yield from _after(cursor, CallOutcome.NOT_A_CALL, start))
    first = True
    while True:
        yield from skip(cursor)
        char = yield from peek(cursor)
        if char == "]":
            cursor.pos += 1
            return True
        if not first:
            if char != ",":
                return (yield from _after(cursor, CallOutcome.NOT_A_CALL, cursor.pos))
            cursor.pos += 1
            yield from skip(cursor)
        first = False
        start = cursor.pos
        outcome = yield from read_call(cursor)
        if outcome is not CallOutcome.WHOLE:
            return (yield from _after(cursor, outcome, start))


def _after(cursor: Cursor, outcome: CallOutcome, start: int) -> Generator[None, None, bool]:
    """After the last call read: on if it was whole; otherwise what is left is unfinished if a call was announced,
    or the whole answer is text if none was."""
    if outcome is CallOutcome.WHOLE:
        return True
    if cursor.announced:  # the first call broke: the whole answer is unfinished; a later one, from where it began
        yield from sink(cursor, (start if cursor.calls else 0) if outcome is CallOutcome.BROKEN else cursor.pos)
        return False
    cursor.pos = 0
    yield from free_text(cursor, ())
    return False
