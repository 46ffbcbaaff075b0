"""A chat stream's chunks (as the chat formatters write them) as the Responses API's named events: their order,
their sequence numbers, the items they build, and the response they end with."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

from api.endpoints.formatting import ChatFormatter
from api.protocol.errors import APIError
from api.protocol.openai_api import parse_request
from api.protocol.responses_api import ResponsesRequest
from api.translation.response_objects import ResponseDraft
from api.translation.responses_stream import response_events
from tests.server_harness import tiny_tokenizer

USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10, "prompt_tokens_details": {"cached_tokens": 4}}


def _draft(**fields: Any) -> ResponseDraft:
    return ResponseDraft(parse_request(ResponsesRequest, json.dumps({"input": "hi", **fields}).encode()), "tiny")


def _chunks(formatter: ChatFormatter, pieces: list[str], finish: str) -> list[str]:
    """What api/endpoints/responses.stream sends for one choice with include_usage: the opening, the text in
    pieces, the finish, the closing usage chunk, [DONE]."""
    choices = [formatter.opening_choice(0)]
    choices += [formatter.stream_choice(0, piece, None, None) for piece in pieces]
    choices.append(formatter.stream_choice(0, "", finish, None))
    chunks = [json.dumps(formatter.chunk([c])) for c in choices if c is not None]
    return [*chunks, json.dumps(formatter.chunk([], usage=USAGE)), "[DONE]"]


def _run(chunks: list[str], draft: ResponseDraft) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The events as (name, data) pairs' data, checked to carry their name; and what on_complete got."""
    completed: list[dict[str, Any]] = []

    async def source() -> AsyncGenerator[str, None]:
        for chunk in chunks:
            yield chunk

    async def collect() -> list[dict[str, Any]]:
        events = []
        async for event in response_events(source(), draft, completed.append):
            data = json.loads(str(event.data))
            assert event.event == data["type"]
            events.append(data)
        return events

    return asyncio.run(collect()), completed


def _types(events: list[dict[str, Any]]) -> list[str]:
    return [event["type"] for event in events]


def test_text_streams_as_one_message_item() -> None:
    formatter = ChatFormatter("chatcmpl-1", "tiny", tiny_tokenizer())
    events, completed = _run(_chunks(formatter, ["Hel", "lo", "!"], "stop"), _draft())
    assert _types(events) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Hello!"
    item_id = events[2]["item"]["id"]
    assert all(e["item_id"] == item_id and e["output_index"] == 0 for e in events[3:9])
    assert events[7]["text"] == "Hello!" and events[8]["part"]["text"] == "Hello!"
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["incomplete_details"] is None
    assert final["output"] == [events[9]["item"]]
    assert final["output"][0]["content"][0]["text"] == "Hello!" and final["output"][0]["status"] == "completed"
    assert final["usage"] == {
        "input_tokens": 7,
        "input_tokens_details": {"cached_tokens": 4},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 10,
    }
    assert completed == [final]


def _call_chunks(formatter: ChatFormatter, name: str, pieces: list[str]) -> list[str]:
    """A chat stream of one tool call as OpenAI streams it (and the chat path's tool formatters write it): the
    id, type and name once with empty arguments, then the arguments in pieces, then finish_reason tool_calls."""

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        return json.dumps(formatter.chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]))

    opening = {"id": "call_1", "type": "function", "function": {"name": name, "arguments": ""}}
    chunks = [chunk({"role": "assistant", "content": None, "tool_calls": [{"index": 0, **opening}]})]
    chunks += [chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}) for piece in pieces]
    return [*chunks, chunk({}, "tool_calls"), json.dumps(formatter.chunk([], usage=USAGE)), "[DONE]"]


def test_a_call_streams_as_a_function_call_item() -> None:
    formatter = ChatFormatter("chatcmpl-2", "tiny", tiny_tokenizer())
    events, completed = _run(_call_chunks(formatter, "add", ['{"a"', ": 1", "}"]), _draft())
    assert _types(events)[2:] == [
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * 3,
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added, done = events[2]["item"], events[-2]["item"]
    assert added["type"] == "function_call" and added["name"] == "add" and added["status"] == "in_progress"
    assert added["call_id"] == "call_1" and added["id"].startswith("fc_")
    assert events[-3]["arguments"] == '{"a": 1}' and events[-3]["name"] == "add"
    assert done == {**added, "arguments": '{"a": 1}', "status": "completed"}
    assert completed[0]["output"] == [done]


def test_max_output_tokens_ends_the_stream_incomplete() -> None:
    formatter = ChatFormatter("chatcmpl-3", "tiny", tiny_tokenizer())
    events, completed = _run(_chunks(formatter, ["a", "b"], "length"), _draft(max_output_tokens=2))
    final = events[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["status"] == "incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["response"]["output"][0]["status"] == "incomplete"
    assert completed == [final["response"]]  # still stored: it is an answer, cut short


def test_an_empty_answer_is_an_empty_message() -> None:
    formatter = ChatFormatter("chatcmpl-4", "tiny", tiny_tokenizer())
    events, _ = _run(_chunks(formatter, [], "stop"), _draft())
    assert "response.output_text.delta" not in _types(events)
    assert events[-1]["response"]["output"][0]["content"] == [
        {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    ]


def test_text_then_calls_are_items_in_order_each_closed_before_the_next() -> None:
    """The shape tool_choice auto streams (text, then calls by index): chunks as OpenAI's chat stream has them."""
    formatter = ChatFormatter("chatcmpl-5", "tiny", tiny_tokenizer())

    def call(index: int, **fields: Any) -> str:
        delta = {"tool_calls": [{"index": index, **fields}]}
        return json.dumps(formatter.chunk([{"index": 0, "delta": delta, "finish_reason": None}]))

    chunks = [
        json.dumps(formatter.chunk([{"index": 0, "delta": {"content": "Let me see."}, "finish_reason": None}])),
        call(0, id="call_a", type="function", function={"name": "f", "arguments": '{"x"'}),
        call(0, function={"arguments": ": 1}"}),
        call(1, id="call_b", type="function", function={"name": "g", "arguments": "{}"}),
        json.dumps(formatter.chunk([{"index": 0, "delta": {}, "finish_reason": "tool_calls"}])),
        json.dumps(formatter.chunk([], usage=USAGE)),
        "[DONE]",
    ]
    events, _ = _run(chunks, _draft())
    added = [e for e in events if e["type"] == "response.output_item.added"]
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["output_index"] for e in added] == [0, 1, 2] == [e["output_index"] for e in done]
    order = [(e["type"], e["output_index"]) for e in events if e["type"].startswith("response.output_item")]
    assert order == [
        ("response.output_item.added", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.output_item.done", 1),
        ("response.output_item.added", 2),
        ("response.output_item.done", 2),
    ]
    output = events[-1]["response"]["output"]
    assert [item["type"] for item in output] == ["message", "function_call", "function_call"]
    assert [(item.get("call_id"), item.get("arguments")) for item in output[1:]] == [
        ("call_a", '{"x": 1}'),
        ("call_b", "{}"),
    ]
    assert events[-1]["type"] == "response.completed"


def test_an_error_after_the_start_fails_the_response_and_nothing_is_stored() -> None:
    formatter = ChatFormatter("chatcmpl-6", "tiny", tiny_tokenizer())
    error = APIError(504, "the request timed out after 1 s").body()
    chunks = [*_chunks(formatter, ["a"], "stop")[:2], json.dumps(error), "[DONE]"]
    events, completed = _run(chunks, _draft())
    assert events[-1]["type"] == "response.failed"
    response = events[-1]["response"]
    assert response["status"] == "failed" and response["error"]["message"] == "the request timed out after 1 s"
    assert response["output"][0]["status"] == "incomplete"
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert completed == []


def test_a_fault_while_translating_fails_the_response_in_band() -> None:
    formatter = ChatFormatter("chatcmpl-7", "tiny", tiny_tokenizer())
    chunks = [*_chunks(formatter, ["a"], "stop")[:2], "not JSON", "[DONE]"]
    events, completed = _run(chunks, _draft())
    assert events[-1]["type"] == "response.failed" and completed == []
    assert events[-1]["response"]["error"] == {
        "code": "server_error",
        "message": "internal server error while streaming",
    }
