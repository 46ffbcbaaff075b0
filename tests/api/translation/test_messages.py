"""The Messages API's translation onto the chat path, and its wire format against a live tiny-model server in both
modes: the events as Anthropic names and orders them, errors in Anthropic's shape, count_tokens equal to the usage,
and answers equal to the chat path's own for the same conversation."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import httpx
import pytest

from api.protocol.errors import APIError
from api.protocol.messages_api import CountTokensRequest, MessagesRequest, parse_messages_request
from api.translation.messages import to_chat, to_message
from api.translation.messages_stream import StreamStart, message_events
from tests.server_harness import (
    RunningServer,
    metric_value,
    mode_config,
    num_running,
    running_server,
    seats_all_free,
    wait_until,
)

MODES = ("dynamic", "continuous")
USER = {"role": "user", "content": "hello world"}
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}


def _request(model: type[CountTokensRequest] = MessagesRequest, **fields: Any) -> Any:
    body = {"model": "m", "max_tokens": 8, "messages": [USER], **fields}
    return parse_messages_request(model, json.dumps(body).encode())


def _refused(**fields: Any) -> APIError:
    with pytest.raises(APIError) as caught:
        to_chat(_request(**fields))
    assert caught.value.status == 400
    return caught.value


# ----- the request onto the chat path -----


def test_a_conversation_with_a_tool_turn_maps_turn_by_turn_in_order() -> None:
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]}
    failed = {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no such city", "is_error": True}
    chat = to_chat(
        _request(
            system=[{"type": "text", "text": "Be brief. "}, {"type": "text", "text": "Use tools."}],
            messages=[
                USER,
                {
                    "role": "assistant",
                    "content": [{"type": "text", "text": "Let me look."}, CALL, {**CALL, "id": "toolu_2"}],
                },
                {"role": "user", "content": [result, failed, {"type": "text", "text": "and tomorrow?"}]},
            ],
            tools=[WEATHER],
            tool_choice={"type": "tool", "name": "get_weather"},
            stop_sequences=["END"],
            top_k=5,
            temperature=0.5,
            metadata={"user_id": "u1"},
        )
    )
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    arguments = json.dumps({"city": "Paris"})
    calls = [
        {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        for call_id in ("toolu_1", "toolu_2")
    ]
    assert messages == [
        {"role": "system", "content": "Be brief. Use tools."},
        {"role": "user", "content": "hello world"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": calls},
        {"role": "tool", "content": "sunny", "tool_call_id": "toolu_1"},
        {"role": "tool", "content": "Error: no such city", "tool_call_id": "toolu_2"},
        {"role": "user", "content": "and tomorrow?"},
    ]
    function = {"name": "get_weather", "parameters": WEATHER["input_schema"], "description": WEATHER["description"]}
    assert chat.tools == [{"type": "function", "function": function}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert (chat.stop, chat.top_k, chat.temperature, chat.max_tokens, chat.user) == (["END"], 5, 0.5, 8, "u1")
    assert chat.add_generation_prompt and not chat.continue_final_message


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
    ],
)
def test_tool_choice_maps_onto_the_chat_path(choice: dict[str, str], expected: object) -> None:
    assert to_chat(_request(tools=[WEATHER], tool_choice=choice)).tool_choice == expected


def test_a_system_turn_among_the_messages_stays_in_its_place() -> None:
    system = {"role": "system", "content": [{"type": "text", "text": "Now answer in French."}]}
    chat = to_chat(_request(messages=[USER, {"role": "assistant", "content": "Hi."}, system, USER]))
    assert [(m.role, m.content) for m in chat.messages] == [
        ("user", "hello world"),
        ("assistant", "Hi."),
        ("system", "Now answer in French."),
        ("user", "hello world"),
    ]


def test_an_assistant_turn_last_is_a_prefill_the_answer_continues() -> None:
    chat = to_chat(_request(messages=[USER, {"role": "assistant", "content": "The answer is"}]))
    assert chat.continue_final_message and not chat.add_generation_prompt
    assert chat.messages[-1].content == "The answer is"


def test_a_tool_only_assistant_turn_has_null_content_and_count_tokens_takes_no_sampling() -> None:
    messages = [USER, {"role": "assistant", "content": [CALL]}, {"role": "user", "content": [_result()]}]
    chat = to_chat(_request(CountTokensRequest, messages=messages, tools=[WEATHER]))
    assert chat.messages[1].content is None and chat.messages[1].tool_calls
    assert chat.max_tokens is None and chat.stop is None and not chat.stream


def _result(tool_use_id: str = "toolu_1") -> dict[str, object]:
    return {"type": "tool_result", "tool_use_id": tool_use_id, "content": "sunny"}


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"messages": [USER, {"role": "user", "content": [_result()]}]}, "messages.1.content.0.tool_use_id"),
        (  # a result answers the turn right before it, not an older one
            {
                "messages": [
                    USER,
                    {"role": "assistant", "content": [CALL]},
                    {"role": "user", "content": [_result()]},
                    {"role": "assistant", "content": "ok"},
                    {"role": "user", "content": [_result()]},
                ]
            },
            "messages.4.content.0.tool_use_id",
        ),
        ({"messages": [{"role": "user", "content": [CALL]}]}, "belong in an assistant turn"),
        ({"messages": [USER, {"role": "assistant", "content": [_result()]}]}, "belong in a user turn"),
        ({"messages": [USER, {"role": "assistant", "content": [CALL, CALL]}]}, "used twice"),
        ({"messages": [USER, {"role": "assistant", "content": [CALL]}]}, "need a user turn with their tool_result"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice.name: 'other' is not"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice.name: field required"),
        ({"tool_choice": {"type": "any"}}, "needs tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools.1.name"),
        ({"tools": [{**WEATHER, "input_schema": {"type": "string"}}]}, "tools.0.input_schema"),
    ],
)
def test_inconsistent_requests_are_a_400_naming_the_field(fields: dict[str, object], fragment: str) -> None:
    assert fragment in _refused(**fields).message


def test_a_chat_answer_becomes_a_message() -> None:
    call = {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    chat: dict[str, Any] = {
        "id": "chatcmpl-xyz",
        "model": "m",
        "choices": [
            {"message": {"role": "assistant", "content": None, "tool_calls": [call]}, "finish_reason": "tool_calls"}
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19},
    }
    assert to_message(chat, None) == {
        "id": "msg_xyz",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [{"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {"city": "Oslo"}}],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": 12, "output_tokens": 7},
    }
    stopped = {**chat["choices"][0], "message": {"content": "hi"}, "finish_reason": "stop", "stop_reason": "END"}
    message = to_message({**chat, "choices": [stopped]}, ["END"])
    assert (message["stop_reason"], message["stop_sequence"], message["content"]) == (
        "stop_sequence",
        "END",
        [{"type": "text", "text": "hi"}],
    )
    for finish, reason in (("stop", "end_turn"), ("length", "max_tokens")):
        ended = {**stopped, "finish_reason": finish, "stop_reason": None}
        assert to_message({**chat, "choices": [ended]}, ["END"])["stop_reason"] == reason


# ----- chat chunks onto Anthropic's events -----


def _chunk(delta: dict[str, object], finish: str | None = None, **extra: object) -> str:
    return json.dumps({"id": "chatcmpl-1", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra})


async def _chunks(*data: str) -> AsyncGenerator[str, None]:
    for item in data:
        yield item


def _events(*data: str) -> list[tuple[str, dict[str, Any]]]:
    async def run() -> list[tuple[str, dict[str, Any]]]:
        start = StreamStart("chatcmpl-1", "m", 11, ["END"])
        return [(str(e.event), json.loads(str(e.data))) async for e in message_events(_chunks(*data), start)]

    return asyncio.run(run())


def test_text_then_a_tool_call_stream_as_two_blocks_in_anthropics_order() -> None:
    announce = {"index": 0, "id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    events = _events(
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"content": "Let me"}),
        _chunk({"content": " look."}),
        _chunk({"tool_calls": [announce]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}, "tool_calls"),
        json.dumps({"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 9}}),
        "[DONE]",
    )
    names = [name for name, _ in events]
    assert names == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert (
        start["id"] == "msg_1" and start["content"] == [] and start["usage"] == {"input_tokens": 11, "output_tokens": 0}
    )
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert events[4][1]["delta"] == {"type": "text_delta", "text": " look."}
    tool = {"type": "tool_use", "id": "toolu_7", "name": "get_weather", "input": {}}
    assert events[6][1] == {"type": "content_block_start", "index": 1, "content_block": tool}
    pieces = "".join(data["delta"]["partial_json"] for _, data in events[7:9])
    assert json.loads(pieces) == {"city": "Oslo"} and events[9][1]["index"] == 1
    assert events[10][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[10][1]["usage"] == {"input_tokens": 11, "output_tokens": 9}


def test_a_stop_sequence_and_an_error_in_the_stream() -> None:
    stopped = _events(_chunk({"content": "a"}, "stop", **{}), "[DONE]")
    assert stopped[-2][1]["delta"]["stop_reason"] == "end_turn"
    matched = json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": "END"}]})
    assert _events(matched, "[DONE]")[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    error = APIError(504, "the request ran longer than the server's request timeout of 1 s").body()
    failed = _events(_chunk({"content": "a"}), json.dumps(error), "[DONE]")
    assert [name for name, _ in failed][-2:] == ["content_block_delta", "error"]  # the error ends the stream
    assert failed[-1][1] == {"type": "error", "error": {"type": "timeout_error", "message": error["error"]["message"]}}


# ----- a live server -----


@pytest.fixture(scope="module", params=MODES)
def server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    with running_server(mode_config(request.param)) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def _body(server: RunningServer, **fields: object) -> dict[str, object]:
    return {"model": server.runtime.model_name, "max_tokens": 6, "temperature": 0, "messages": [USER], **fields}


def _sse(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """Named events as a client reads them: `event:` then `data:`, one blank line after each."""
    events = []
    for frame in response.text.replace("\r\n", "\n").split("\n\n"):
        lines = [line for line in frame.split("\n") if line and not line.startswith(":")]
        if lines:
            assert lines[0].startswith("event: ") and lines[1].startswith("data: ") and len(lines) == 2, frame
            events.append((lines[0][7:], json.loads(lines[1][6:])))
    return events


def test_a_whole_message_and_its_stream_say_the_same(server: RunningServer, http: httpx.Client) -> None:
    whole = http.post("/v1/messages", json=_body(server), headers={"anthropic-version": "2023-06-01"})
    assert whole.status_code == 200, whole.text
    message = whole.json()
    assert message["id"].startswith("msg_") and message["type"] == "message" and message["role"] == "assistant"
    assert message["stop_reason"] == "max_tokens" and message["usage"]["output_tokens"] == 6
    streamed = http.post("/v1/messages", json=_body(server, stream=True))
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    events = _sse(streamed)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert set(names[3:-3]) == {"content_block_delta"}
    text = "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta")
    assert text == message["content"][0]["text"]
    assert events[-2][1]["usage"] == message["usage"] == {**events[0][1]["message"]["usage"], "output_tokens": 6}


def test_count_tokens_is_the_usage_of_the_same_request(server: RunningServer, http: httpx.Client) -> None:
    tool_turn = [USER, {"role": "assistant", "content": [CALL]}, {"role": "user", "content": [_result()]}]
    for fields in (
        {},
        {"system": [{"type": "text", "text": "be brief"}]},
        {"system": "be brief", "tools": [WEATHER], "tool_choice": {"type": "none"}, "messages": tool_turn},
        {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}},
    ):
        body = _body(server, **fields)
        used = http.post("/v1/messages", json=body)
        assert used.status_code == 200, used.text
        del body["max_tokens"], body["temperature"]
        count = http.post("/v1/messages/count_tokens", json=body)
        assert count.status_code == 200, count.text
        assert count.json() == {"input_tokens": used.json()["usage"]["input_tokens"]}


def test_a_prefill_continues_as_the_chat_path_continues_it(server: RunningServer, http: httpx.Client) -> None:
    prefill = [USER, {"role": "assistant", "content": "the quick"}]
    message = http.post("/v1/messages", json=_body(server, messages=prefill)).json()
    chat = http.post(
        "/v1/chat/completions",
        json={**_body(server, messages=prefill), "continue_final_message": True, "add_generation_prompt": False},
    ).json()
    assert message["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert message["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]


def test_max_tokens_0_only_prefills(server: RunningServer, http: httpx.Client) -> None:
    message = http.post("/v1/messages", json=_body(server, max_tokens=0)).json()
    assert message["content"] == [] and message["stop_reason"] == "max_tokens"
    assert message["usage"]["output_tokens"] == 0 and message["usage"]["input_tokens"] > 0


def test_errors_are_in_anthropics_shape_on_these_routes_only(server: RunningServer, http: httpx.Client) -> None:
    refused = http.post("/v1/messages", json=_body(server, model="claude-x"))
    assert refused.status_code == 404
    assert refused.json() == {
        "type": "error",
        "error": {
            "type": "not_found_error",
            "message": f"model: the model 'claude-x' does not exist; this server serves '{server.runtime.model_name}'",
        },
    }
    wrong_method = http.get("/v1/messages/count_tokens")
    assert wrong_method.status_code == 405 and wrong_method.json()["type"] == "error"
    too_many = http.post("/v1/messages", json=_body(server, stop_sequences=[str(i) for i in range(50)]))
    assert too_many.status_code == 400 and too_many.json()["error"]["message"].startswith("stop_sequences: at most")
    chat = http.post("/v1/chat/completions", json={"model": "claude-x", "messages": [USER]})
    assert chat.status_code == 404 and set(chat.json()) == {"error"}  # OpenAI's shape elsewhere


def test_a_stream_the_client_leaves_aborts_its_request(server: RunningServer) -> None:
    steps_before = metric_value(server.base_url, "batchserve:steps_total")
    body = _body(server, max_tokens=200, stream=True)
    with httpx.stream("POST", f"{server.base_url}/v1/messages", json=body, timeout=60) as response:
        lines = response.iter_lines()
        while next(lines) != "event: content_block_delta":  # it is running: a first token arrived
            pass
        assert num_running(server) == 1
    # Leaving the block closes the connection mid-stream.
    wait_until(lambda: seats_all_free(server), "the abandoned stream's request to be aborted")
    assert metric_value(server.base_url, "batchserve:steps_total") - steps_before < 200
