"""Chat responses under `tool_choice` "auto": the server's tool parser reads each choice's answer, and its calls come
back as `message.tool_calls`, its free text as content.

A stream sends free text as content deltas as soon as it cannot be the start of a call, and each call as OpenAI
streams one: its index, then its id, type and name once, then its arguments in fragments that only append. The last
chunk says `finish_reason: "tool_calls"` when the answer holds a whole call and ended in none; an answer cut inside
a call (max_tokens, a stop string) keeps its own finish_reason, and the whole response shows that call's text as
content, since its arguments do not parse.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from api.endpoints.formatting import ChatFormatter
from api.structured.tool_parsers.base import CallArguments, CallStart, Content, Event, Parsed, StreamParser, ToolParser
from api.structured.tools import ToolCall, new_call_id

# Called once per finished choice with the parser's name and how its calls came out (`count_outcomes`).
OutcomeSink = Callable[[str, str, int], None]


class AutoToolFormatter(ChatFormatter):
    def __init__(self, parser: ToolParser, on_outcome: OutcomeSink | None, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.parser = parser
        self._on_outcome = on_outcome
        self._streams: dict[int, StreamParser] = {}
        self._ids: dict[int, list[str]] = {}

    def opening_choice(self, index: int) -> dict[str, object] | None:
        # content null, as OpenAI opens a stream that may hold calls: a client that assembles the deltas then has
        # null content for an answer that is calls only, as the whole response has
        return {
            "index": index,
            "delta": {"role": "assistant", "content": None},
            "logprobs": None,
            "finish_reason": None,
        }

    def stream_choice(
        self, index: int, text: str | None, finish_reason: str | None, logprobs: dict | None
    ) -> dict[str, object] | None:
        stream = self._streams.setdefault(index, self.parser.stream())
        events = stream.feed(text or "")
        if finish_reason is not None:
            events += stream.finish()
        delta: dict[str, object] = {}
        content = "".join(event.text for event in events if isinstance(event, Content))
        if content:
            delta["content"] = content
        calls = self._call_deltas(index, events)
        if calls:
            delta["tool_calls"] = calls
        if not delta and finish_reason is None and logprobs is None:
            return None
        if finish_reason is not None:
            finish_reason = self._finished(stream.result(), finish_reason)
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def final_choice(
        self, index: int, text: str, finish_reason: str | None, logprobs: dict | None
    ) -> dict[str, object]:
        parsed = self.parser.parse(text)
        message: dict[str, object] = {"role": "assistant", "content": parsed.message_content}
        if parsed.calls:
            message["content"] = parsed.message_content or None
            message["tool_calls"] = [ToolCall(new_call_id(), c.name, c.arguments).json() for c in parsed.calls]
        reason = self._finished(parsed, finish_reason) if finish_reason is not None else None
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}

    def _call_deltas(self, index: int, events: list[Event]) -> list[dict[str, Any]]:
        """The chunk's `tool_calls`: one entry per call it touches, the announcement first with its id."""
        ids = self._ids.setdefault(index, [])
        deltas: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, CallStart):
                ids.append(new_call_id())
                deltas.append({"index": event.index, **ToolCall(ids[event.index], event.name, "").json()})
            elif isinstance(event, CallArguments):
                if deltas and deltas[-1]["index"] == event.index:
                    deltas[-1]["function"]["arguments"] += event.text
                else:
                    deltas.append({"index": event.index, "function": {"arguments": event.text}})
        return deltas

    def _finished(self, parsed: Parsed, finish_reason: str) -> str:
        if self._on_outcome is not None:
            for outcome, count in outcomes(parsed).items():
                self._on_outcome(self.parser.name, outcome, count)
        return "tool_calls" if parsed.calls and not parsed.unfinished else finish_reason


def outcomes(parsed: Parsed) -> dict[str, int]:
    """How an answer's calls came out, for `batchserve:tool_calls`: parsed calls, a call the answer ended inside
    (`unfinished`), or no call at all (`no_call`)."""
    counts = {"parsed": len(parsed.calls), "unfinished": 1 if parsed.unfinished else 0}
    if not parsed.calls and not parsed.unfinished:
        counts["no_call"] = 1
    return {outcome: count for outcome, count in counts.items() if count}
