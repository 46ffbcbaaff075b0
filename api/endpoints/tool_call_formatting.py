"""Chat responses whose answer is a forced tool call: `message.tool_calls` instead of content, and streams that send
the call as OpenAI does (the id and name once, then the arguments in pieces), with finish_reason "tool_calls".

Only a whole call is reported as one. A stop string or stop token applies inside the grammar as anywhere (as in
vLLM), and max_tokens may end it too: an answer cut short keeps its finish_reason ("stop", "length") and its text as
content; a stream that already sent part of the call ends with that finish_reason instead of "tool_calls"."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from api.endpoints.auto_tool_formatting import OutcomeSink
from api.endpoints.formatting import ChatFormatter
from api.structured.tools import CallText, ToolCall, ToolCallMode, new_call_id, split_call

logger = logging.getLogger("batchserve.api")


@dataclass
class _CallProgress:
    """One choice's call as it streams: the text so far, and how much of it was sent."""

    id: str
    text: str = ""
    announced: bool = False  # the chunk with the id and name went out
    sent_arguments: str = ""


class ToolCallFormatter(ChatFormatter):
    """A ChatFormatter for requests with tool_choice "required" or a named function (api/structured/tools.py)."""

    def __init__(self, mode: ToolCallMode, on_outcome: OutcomeSink | None, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mode = mode
        self._on_outcome = on_outcome
        self._progress: dict[int, _CallProgress] = {}

    def _call(self, index: int) -> _CallProgress:
        return self._progress.setdefault(index, _CallProgress(new_call_id()))

    def opening_choice(self, index: int) -> dict[str, object] | None:
        delta: dict[str, object] = {"role": "assistant", "content": None}
        if self.mode.name is not None:  # the name is known before any token
            progress = self._call(index)
            progress.announced = True
            delta["tool_calls"] = [{"index": 0, **ToolCall(progress.id, self.mode.name, "").json()}]
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}

    def stream_choice(
        self, index: int, text: str | None, finish_reason: str | None, logprobs: dict | None
    ) -> dict[str, object] | None:
        progress = self._call(index)
        progress.text += text or ""
        final = finish_reason is not None
        call = split_call(self.mode, progress.text, final)
        delta: dict[str, object] = {}
        if call is not None:
            if call.arguments.startswith(progress.sent_arguments):
                piece = call.arguments[len(progress.sent_arguments) :]
                progress.sent_arguments = call.arguments
            else:  # split_call only appends; this would be a bug, and the client must not get a garbled call
                logger.error("%s: a streamed tool call's arguments changed after they were sent", self.request_id)
                piece = ""
            if not progress.announced:
                progress.announced = True
                delta["tool_calls"] = [{"index": 0, **ToolCall(progress.id, call.name, piece).json()}]
            elif piece:
                delta["tool_calls"] = [{"index": 0, "function": {"arguments": piece}}]
        elif final and progress.text:  # cut before a name was complete: no call was announced, so the text as is
            delta["content"] = progress.text
        if not delta and not final and logprobs is None:
            return None
        reason = self._finished(finish_reason, call)
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}

    def final_choice(
        self, index: int, text: str, finish_reason: str | None, logprobs: dict | None
    ) -> dict[str, object]:
        call = split_call(self.mode, text, final=True)
        message: dict[str, object] = {"role": "assistant", "content": None}
        if call is not None and call.whole:
            message["tool_calls"] = [ToolCall(self._call(index).id, call.name, call.arguments).json()]
        else:  # cut short (a stop string, a stop token, max_tokens): not a call a client could parse; the text
            message["content"] = text
        return {
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": self._finished(finish_reason, call),
        }

    def _finished(self, finish_reason: str | None, call: CallText | None) -> str | None:
        """A whole call ends with "tool_calls"; an answer cut short keeps what cut it ("stop" for a stop string or a
        stop token, "length" for max_tokens), never "tool_calls" with arguments that do not parse."""
        if finish_reason is None:
            return None
        whole = call is not None and call.whole
        if self._on_outcome is not None:
            self._on_outcome("forced", "parsed" if whole else "unfinished", 1)
        return "tool_calls" if whole else finish_reason
