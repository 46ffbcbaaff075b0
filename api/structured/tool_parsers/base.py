"""What a tool-call parser is: a model family's call format, written four ways.

- `grammar`: the lazy grammar that keeps calls parseable (text free until the format's trigger, then the call
  constrained so its arguments match the tool's `parameters`), or for an envelope format a grammar from the start;
- `stream`: an incremental parser fed the answer's text as it is generated, whose events only ever append (content,
  a call's name once, its argument fragments);
- `parse`: the same parser fed the whole answer at once, so the streamed and the whole answer cannot disagree;
- `system_prompt` and `render_calls`: the format shown to the model (api/text/tool_template.py), in its tools
  block and in the assistant turns of the history, so `parse(render_calls(calls))` gives the calls back.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from api.structured.spec import GrammarSpec


@dataclass(frozen=True)
class FunctionTool:
    """One function of a request's `tools`, checked (api/structured/tools.py)."""

    name: str
    description: str | None
    parameters: dict[str, Any]  # a JSON schema object

    def definition(self) -> dict[str, Any]:
        """The function as OpenAI's tools list holds it, for a prompt."""
        described = {"description": self.description} if self.description else {}
        return {"name": self.name, **described, "parameters": self.parameters}


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # the arguments as JSON text: what was generated, whitespace and key order kept


@dataclass(frozen=True)
class Content:
    """Free text of the answer: the message's content."""

    text: str


@dataclass(frozen=True)
class CallStart:
    """A call's name is known: announce the call (its id, type and name, once)."""

    index: int
    name: str


@dataclass(frozen=True)
class CallArguments:
    """More of call `index`'s arguments text, appended to what came before."""

    index: int
    text: str


Event = Content | CallStart | CallArguments


@dataclass(frozen=True)
class Parsed:
    """A whole answer, read. `unfinished`: the raw text of a call the answer ended in (cut by max_tokens or a stop
    string) after it was announced; the message shows it as content, since its arguments do not parse."""

    content: str
    calls: tuple[ParsedCall, ...]
    unfinished: str = ""

    @property
    def message_content(self) -> str:
        return self.content + self.unfinished


class StreamParser(ABC):
    """One answer's parser: `feed` each new piece of text, then `finish` once; both return the new events."""

    @abstractmethod
    def feed(self, text: str) -> list[Event]: ...

    @abstractmethod
    def finish(self) -> list[Event]: ...

    @abstractmethod
    def result(self) -> Parsed:
        """After `finish`: the whole answer as read."""


class ToolParser(ABC):
    """A model family's tool-call format. Parsers hold no state: `stream()` makes one answer's parser."""

    name: ClassVar[str]
    summary: ClassVar[str]  # for the docs and --help: the format in a line

    @abstractmethod
    def grammar(self, tools: Sequence[FunctionTool], parallel: bool) -> GrammarSpec:
        """The grammar of an answer that may call `tools` (at most one call unless `parallel`)."""

    @abstractmethod
    def stream(self) -> StreamParser: ...

    def parse(self, text: str) -> Parsed:
        parser = self.stream()
        parser.feed(text)
        parser.finish()
        return parser.result()

    @abstractmethod
    def system_prompt(self, tools: Sequence[FunctionTool]) -> str:
        """The tools and how to call them, for the system block."""

    @abstractmethod
    def render_calls(self, calls: Sequence[ParsedCall]) -> str:
        """An assistant turn's calls, as the model writes them."""


def tools_json_lines(tools: Sequence[FunctionTool]) -> str:
    """One `{"type": "function", "function": {...}}` object per line, as Hermes-style prompts list tools."""
    return "\n".join(json.dumps({"type": "function", "function": tool.definition()}) for tool in tools)


def call_object(call: ParsedCall, key: str = "arguments") -> str:
    """`{"name": ..., "<key>": ...}` with the arguments as given (JSON text, spliced in as it is)."""
    return f'{{"name": {json.dumps(call.name)}, "{key}": {call.arguments or "{}"}}}'
