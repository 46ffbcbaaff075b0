"""Chat responses whose answer is a forced tool call: `message.tool_calls` instead of content, and streams that send
the call as OpenAI does (the id and name once, then the arguments in pieces), with finish_reason "tool_calls"."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from api.endpoints.formatting import ChatFormatter
from api.structured.tools import ToolCall, ToolCallMode, new_call_id, split_call

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

    def __init__(self, mode: ToolCallMode, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mode = mode
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
        calls = []
        split = split_call(self.mode, progress.text, complete=finish_reason is not None)
        if split is not None:
            name, arguments = split
            if arguments.startswith(progress.sent_arguments):
                piece = arguments[len(progress.sent_arguments) :]
                progress.sent_arguments = arguments
            else:  # split_call only appends; this would be a bug, and the client must not get a garbled call
                logger.error("%s: a streamed tool call's arguments changed after they were sent", self.request_id)
                piece = ""
            if not progress.announced:
                progress.announced = True
                calls.append({"index": 0, **ToolCall(progress.id, name, piece).json()})
            elif piece:
                calls.append({"index": 0, "function": {"arguments": piece}})
        if not calls and finish_reason is None and logprobs is None:
            return None
        delta: dict[str, object] = {"tool_calls": calls} if calls else {}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": _reason(finish_reason, split)}

    def final_choice(
        self, index: int, text: str, finish_reason: str | None, logprobs: dict | None
    ) -> dict[str, object]:
        split = split_call(self.mode, text, complete=True)
        message: dict[str, object] = {"role": "assistant", "content": None}
        if split is None:  # cut off before the function's name was complete: no call to report
            message["content"] = text
        else:
            message["tool_calls"] = [ToolCall(self._call(index).id, *split).json()]
        return {
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": _reason(finish_reason, split),
        }


def _reason(finish_reason: str | None, split: tuple[str, str] | None) -> str | None:
    """A call the grammar completed ends with "tool_calls"; one cut by max_tokens keeps "length"."""
    return "tool_calls" if finish_reason == "stop" and split is not None else finish_reason
