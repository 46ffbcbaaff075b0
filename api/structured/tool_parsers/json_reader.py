"""Reading JSON out of an answer as it is generated: one call object (`{"name": ..., "arguments": ...}`), whose
arguments stream as they come, and JSON strings (the generic envelope's keys and its `response` text).

Nothing here validates JSON as it reads: it tracks strings and nesting to know where a value ends, and a call is
whole only once its object parses (the server's own JSON parser and limits, api/protocol/openai_api.py).
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Generator

from api.protocol.openai_api import parse_json_text
from api.structured.tool_parsers.base import ParsedCall
from api.structured.tool_parsers.reader import Cursor, peek

# A call object up to its arguments, the name first (as every format's grammar writes it): the call can be
# announced here, before its arguments. "parameters" is Llama 3's key; the others write "arguments".
_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_HEAD_LIMIT = 1024  # past this many characters the object is read whole instead (a name is at most 64)
_ARGUMENT_KEYS = ("arguments", "parameters")
_SURROGATE = re.compile(r"[\ud800-\udfff]")
# One escape: a surrogate pair (its halves decode together), another \\u escape, or any other.
_ESCAPE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}|\\u[0-9a-fA-F]{4}|\\.", re.DOTALL)
_HEX = frozenset("0123456789abcdefABCDEF")


class CallOutcome(enum.Enum):
    WHOLE = "whole"  # a call: announced, its arguments sent, and appended to the cursor's calls
    NOT_A_CALL = "not_a_call"  # nothing announced: the text read is not a call (or ended before it could be one)
    BROKEN = "broken"  # announced, then the answer ended inside it or went on as no call can


class _Nesting:
    """Where a JSON text is: inside a string or not, and how deep."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self._escaped = False

    def push(self, char: str) -> None:
        if self.in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self.in_string = False
        elif char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1


class _Arguments:
    """The arguments value inside a call object being read: where it starts and ends, and how much was sent."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.start: int | None = None
        self.end: int | None = None
        self.scalar = False  # a bare number or literal: it ends only at the character after it
        self.sent: int | None = None

    def push(self, nesting: _Nesting, char: str, at: int) -> None:
        """`char` (at `at`) was just pushed onto `nesting`."""
        if self.end is not None:
            return
        if self.start is None:
            if not char.isspace():
                self.start = self.sent = at
                self.scalar = char not in '{["'
                self._check_end(nesting, char, at)
            return
        self._check_end(nesting, char, at)

    def _check_end(self, nesting: _Nesting, char: str, at: int) -> None:
        if self.scalar:
            ends = nesting.depth < 1 or (not nesting.in_string and (char in ",}]" or char.isspace()))
            if ends and at > (self.start or 0):
                self.end = at
        elif nesting.depth == 1 and not nesting.in_string and at >= (self.start or 0):
            self.end = at + 1

    def flush(self, cursor: Cursor, upto: int) -> None:
        """Send what is read of the arguments, up to `upto`; a scalar only once it is whole."""
        if self.start is None or self.sent is None or (self.scalar and self.end is None):
            return
        limit = upto if self.end is None else min(upto, self.end)
        if limit > self.sent:
            cursor.emit_arguments(self.index, cursor.text[self.sent : limit])
            self.sent = limit


def read_call(cursor: Cursor) -> Generator[None, None, CallOutcome]:
    """Read the call object at the cursor. It is announced as soon as its name is complete (name first), or else
    once the object is whole; its arguments stream as they are generated."""
    start = cursor.pos
    if (yield from peek(cursor)) != "{":
        return CallOutcome.NOT_A_CALL
    nesting = _Nesting()
    arguments: _Arguments | None = None
    while True:
        text = cursor.text
        while cursor.pos < len(text):
            char = text[cursor.pos]
            nesting.push(char)
            cursor.pos += 1
            if arguments is not None:
                arguments.push(nesting, char, cursor.pos - 1)
            elif not nesting.in_string and nesting.depth == 1 and cursor.pos - start <= _HEAD_LIMIT:
                arguments = _announce(cursor, start)
            if nesting.depth == 0:
                if arguments is not None:
                    arguments.flush(cursor, cursor.pos)
                    return _whole(cursor, start, arguments)
                return _whole_object(cursor, start)
        if arguments is not None:
            arguments.flush(cursor, cursor.pos)
        if cursor.ended:
            return CallOutcome.NOT_A_CALL if arguments is None else CallOutcome.BROKEN
        yield


def _announce(cursor: Cursor, start: int) -> _Arguments | None:
    head = _HEAD.match(cursor.text, start, cursor.pos)
    if head is None or head.end() != cursor.pos:
        return None
    name = _decoded(head.group(1))
    if name is None:
        return None
    return _Arguments(cursor.announce(name))


def _whole(cursor: Cursor, start: int, arguments: _Arguments) -> CallOutcome:
    """A call read name first, its object now closed: whole if the object and its arguments parse."""
    if arguments.start is None or arguments.end is None:
        return CallOutcome.BROKEN
    text = cursor.text[arguments.start : arguments.end]
    try:
        value = parse_json_text(cursor.text[start : cursor.pos])
        parse_json_text(text)
    except ValueError:
        return CallOutcome.BROKEN
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return CallOutcome.BROKEN
    cursor.calls.append(ParsedCall(value["name"], text))
    return CallOutcome.WHOLE


def _whole_object(cursor: Cursor, start: int) -> CallOutcome:
    """An object whose name did not come first: a call if it parses and has a name and arguments."""
    try:
        value = parse_json_text(cursor.text[start : cursor.pos])
    except ValueError:
        return CallOutcome.NOT_A_CALL
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return CallOutcome.NOT_A_CALL
    key = next((k for k in _ARGUMENT_KEYS if k in value), None)
    if key is None:
        return CallOutcome.NOT_A_CALL
    arguments = json.dumps(value[key], ensure_ascii=False)
    index = cursor.announce(value["name"])
    cursor.emit_arguments(index, arguments)
    cursor.calls.append(ParsedCall(value["name"], arguments))
    return CallOutcome.WHOLE


def read_key(cursor: Cursor) -> Generator[None, None, str | None]:
    """A JSON string at the cursor, decoded; None if there is none (or the answer ends inside it)."""
    if (yield from peek(cursor)) != '"':
        return None
    start = cursor.pos
    nesting = _Nesting()
    while True:
        text = cursor.text
        while cursor.pos < len(text):
            nesting.push(text[cursor.pos])
            cursor.pos += 1
            if not nesting.in_string:
                return _decoded(text[start : cursor.pos])
        if cursor.ended:
            return None
        yield


def stream_string(cursor: Cursor) -> Generator[None, None, bool]:
    """Release the JSON string at the cursor as content, decoded, as it is generated. False if the answer ends
    inside it."""
    if (yield from peek(cursor)) != '"':
        return False
    cursor.pos += 1
    done = cursor.pos  # raw text before this is released
    escaped = False
    while True:
        text = cursor.text
        while cursor.pos < len(text):
            char = text[cursor.pos]
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                cursor.emit_content(decode_fragment(text[done : cursor.pos]))
                cursor.pos += 1
                return True
            cursor.pos += 1
        whole = done + complete_escapes(text, done, cursor.pos)
        cursor.emit_content(decode_fragment(text[done:whole]))
        done = whole
        if cursor.ended:
            return False
        yield


def complete_escapes(text: str, start: int, end: int) -> int:
    """How much of the raw string text[start:end] can be decoded now: all but an escape that is not complete yet
    (a surrogate pair's first half waits for its second)."""
    i = start
    while i < end:
        if text[i] != "\\":
            i += 1
            continue
        if i + 1 >= end:
            return i - start
        if text[i + 1] != "u":
            i += 2
            continue
        if i + 6 > end:
            return i - start
        if not 0xD800 <= _hex(text[i + 2 : i + 6]) <= 0xDBFF:
            i += 6
            continue
        low = text[i + 6 : min(i + 12, end)]
        if len(low) < 6 and "\\u".startswith(low[:2]) and all(c in _HEX for c in low[2:]):
            return i - start  # the pair's second half may still come
        i += 12 if len(low) == 6 and low.startswith("\\u") and 0xDC00 <= _hex(low[2:]) <= 0xDFFF else 6
    return end - start


def decode_fragment(raw: str) -> str:
    """Raw JSON string text (no quotes) decoded escape by escape; a lone surrogate becomes U+FFFD, and an escape
    JSON does not have (a grammar would not let it through) is kept as it is."""
    if "\\" not in raw:
        return raw
    return _SURROGATE.sub("\ufffd", _ESCAPE.sub(_unescape, raw))


def _unescape(match: re.Match[str]) -> str:
    try:
        value = json.loads(f'"{match.group()}"')
    except ValueError:
        return match.group()
    return value if isinstance(value, str) else match.group()


def _hex(digits: str) -> int:
    return int(digits, 16) if len(digits) == 4 and all(c in _HEX for c in digits) else -1


def _decoded(literal: str) -> str | None:
    try:
        value = parse_json_text(literal)
    except ValueError:
        return None
    return value if isinstance(value, str) else None
