"""The incremental reading every format shares: a cursor over the answer so far, and a format's reading written as
one generator that pauses (`yield`) whenever it needs text that has not been generated yet.

Each character is looked at a bounded number of times however the answer is split into pieces, and a format's
reading is plain sequential code (find the trigger, read the call, expect the end tag), the same for a streamed
answer and a whole one. Free text is released as content as soon as it cannot be the start of a trigger, except
whitespace, which waits for what follows it: before a call it is dropped, so content is not a stray newline.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from api.structured.tool_parsers.base import CallArguments, CallStart, Content, Event, Parsed, ParsedCall, StreamParser

Reading = Generator[None, None, None]  # a format's reading of one answer: yields when it needs more text


@dataclass
class Cursor:
    """The answer so far, how far it has been read, and what reading it has produced."""

    text: str = ""
    pos: int = 0
    ended: bool = False  # no more text will come
    events: list[Event] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    calls: list[ParsedCall] = field(default_factory=list)
    announced: int = 0  # calls announced, whole or not
    unfinished: str = ""

    @property
    def waiting(self) -> bool:
        """Everything generated is read, and more may come."""
        return self.pos >= len(self.text) and not self.ended

    def emit_content(self, text: str) -> None:
        if text:
            self.events.append(Content(text))
            self.content.append(text)

    def announce(self, name: str) -> int:
        index = self.announced
        self.announced += 1
        self.events.append(CallStart(index, name))
        return index

    def emit_arguments(self, index: int, text: str) -> None:
        if text:
            self.events.append(CallArguments(index, text))


class ReadingParser(StreamParser):
    """A StreamParser that runs a format's reading over a cursor."""

    def __init__(self, reading: Callable[[Cursor], Reading]) -> None:
        self._cursor = Cursor()
        self._reading = reading(self._cursor)
        self._done = False

    def feed(self, text: str) -> list[Event]:
        if self._cursor.ended:
            raise RuntimeError("feed after finish")
        self._cursor.text += text
        return self._run()

    def finish(self) -> list[Event]:
        self._cursor.ended = True
        return self._run()

    def result(self) -> Parsed:
        cursor = self._cursor
        return Parsed("".join(cursor.content), tuple(cursor.calls), cursor.unfinished)

    def _run(self) -> list[Event]:
        if not self._done:
            try:
                next(self._reading)
            except StopIteration:
                self._done = True
        cursor = self._cursor
        if self._done and cursor.pos < len(cursor.text):  # a reading returns only at the end: this is a bug
            raise RuntimeError("a tool-call reading stopped before the end of the answer")
        events, cursor.events = cursor.events, []
        return events


def peek(cursor: Cursor) -> Generator[None, None, str | None]:
    """The next character, unread; None at the end of the answer."""
    while cursor.waiting:
        yield
    return cursor.text[cursor.pos] if cursor.pos < len(cursor.text) else None


def skip_whitespace(cursor: Cursor) -> Generator[None, None, None]:
    while True:
        char = yield from peek(cursor)
        if char is None or not char.isspace():
            return
        cursor.pos += 1


def expect(cursor: Cursor, literal: str) -> Generator[None, None, bool]:
    """Read `literal` if the text goes on with it; otherwise read nothing and answer False."""
    start = cursor.pos
    while True:
        have = cursor.text[start : start + len(literal)]
        if not literal.startswith(have):
            return False
        if len(have) == len(literal):
            cursor.pos = start + len(literal)
            return True
        if cursor.ended:
            return False
        yield


def sink(cursor: Cursor, start: int) -> Reading:
    """A call was announced and the answer cannot go on as that format: the rest, from `start`, is `unfinished`."""
    while not cursor.ended:
        cursor.pos = len(cursor.text)
        yield
    cursor.pos = len(cursor.text)
    cursor.unfinished = cursor.text[start:]


class Trigger(Protocol):
    def find(self, text: str, start: int) -> tuple[int, int] | None:
        """The first whole match at or after `start`, as (start, end)."""

    def partial(self, text: str, start: int) -> int | None:
        """The first position at or after `start` from which the rest of `text` could still grow into a match."""


@dataclass(frozen=True)
class Literal:
    """A trigger that is a fixed string (`<tool_call>`)."""

    text: str

    def find(self, text: str, start: int) -> tuple[int, int] | None:
        at = text.find(self.text, start)
        return None if at < 0 else (at, at + len(self.text))

    def partial(self, text: str, start: int) -> int | None:
        for size in range(min(len(self.text) - 1, len(text) - start), 0, -1):
            if text.endswith(self.text[:size]):
                return len(text) - size
        return None


@dataclass(frozen=True)
class TriggerMatch:
    trigger: Trigger
    start: int
    end: int
    content_end: int  # where the content before it ends: the whitespace in between is dropped


def free_text(cursor: Cursor, triggers: Sequence[Trigger]) -> Generator[None, None, TriggerMatch | None]:
    """Release free text as content up to the first trigger, and answer where it is (the cursor at its start); None
    at the end of the answer, all of it released."""
    while True:
        text, start = cursor.text, cursor.pos
        found = [(match, trigger) for trigger in triggers if (match := trigger.find(text, start)) is not None]
        if found:
            (at, end), trigger = min(found, key=lambda pair: pair[0])
            content_end = _whitespace_start(text, start, at)
            cursor.emit_content(text[start:content_end])
            cursor.pos = at
            return TriggerMatch(trigger, at, end, content_end)
        if cursor.ended:
            cursor.emit_content(text[start:])
            cursor.pos = len(text)
            return None
        held = min((p for trigger in triggers if (p := trigger.partial(text, start)) is not None), default=len(text))
        release = _whitespace_start(text, start, held)
        cursor.emit_content(text[start:release])
        cursor.pos = release
        yield


def _whitespace_start(text: str, start: int, end: int) -> int:
    """Where the whitespace that ends text[start:end] begins."""
    while end > start and text[end - 1].isspace():
        end -= 1
    return end
