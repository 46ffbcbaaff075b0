"""`/v1/responses` through a live server (the tiny model, both modes) and the real `openai` SDK: a response is the
chat endpoint's answer to the same turns, streamed events build the same response, previous_response_id continues
the stored conversation (its prompt is the whole conversation, token for token), and the store answers GET and
DELETE, forgets what it was told not to keep, and evicts the oldest past its bound."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.server_harness import RunningServer, mode_config, openai_client, running_server

MODEL = "tiny-llama"


@pytest.fixture(scope="module", params=["dynamic", "continuous"])
def server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    with running_server(mode_config(request.param)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai_client(server)


def _chat(server: RunningServer, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def _prompt_tokens(server: RunningServer, messages: list[dict[str, Any]]) -> int:
    response = httpx.post(f"{server.base_url}/tokenize", json={"messages": messages}, timeout=60)
    assert response.status_code == 200, response.text
    return int(response.json()["count"])


def test_a_response_is_the_chat_answer_to_the_same_turns(server: RunningServer, client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, instructions="be brief", input="hello", max_output_tokens=6, temperature=0, metadata={"k": "v"}
    )
    chat = _chat(server, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}], 6)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.output_text == chat["choices"][0]["message"]["content"]
    assert response.usage is not None
    assert response.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert response.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.instructions == "be brief" and response.metadata == {"k": "v"} and response.to_dict()["store"]
    if chat["choices"][0]["finish_reason"] == "length":
        assert response.status == "incomplete" and response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed" and response.incomplete_details is None
    [item] = response.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")


def test_streamed_events_build_the_same_response(client: openai.OpenAI) -> None:
    whole = client.responses.create(model=MODEL, input="the quick brown fox", max_output_tokens=6, temperature=0)
    events = list(
        client.responses.create(
            model=MODEL, input="the quick brown fox", max_output_tokens=6, temperature=0, stream=True
        )
    )
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert [event.type for event in events[:4]] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert events[-1].type in ("response.completed", "response.incomplete")
    final = events[-1].response  # type: ignore[union-attr]
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert final.status == whole.status and final.usage is not None and whole.usage is not None
    counts = lambda usage: (usage.input_tokens, usage.output_tokens, usage.total_tokens)  # noqa: E731
    assert counts(final.usage) == counts(whole.usage)  # the cached share differs: the second hits the first's blocks
    assert client.responses.retrieve(final.id).output_text == final.output_text  # stored once it ended


def test_previous_response_id_continues_the_whole_conversation(server: RunningServer, client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, instructions="sys", input="hello", max_output_tokens=4, temperature=0)
    second = client.responses.create(
        model=MODEL, instructions="sys", input="more", previous_response_id=first.id, max_output_tokens=4, temperature=0
    )
    third = client.responses.create(  # new instructions replace the old; the turns stay
        model=MODEL, instructions="new", input="again", previous_response_id=second.id, max_output_tokens=4
    )
    turns = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "more"},
    ]
    assert second.previous_response_id == first.id
    assert second.usage is not None and second.usage.input_tokens == _prompt_tokens(
        server, [{"role": "system", "content": "sys"}, *turns]
    )
    assert (
        second.output_text
        == _chat(server, [{"role": "system", "content": "sys"}, *turns], 4)["choices"][0]["message"]["content"]
    )
    later = [*turns, {"role": "assistant", "content": second.output_text}, {"role": "user", "content": "again"}]
    assert third.usage is not None
    assert third.usage.input_tokens == _prompt_tokens(server, [{"role": "system", "content": "new"}, *later])


def test_function_call_items_and_their_outputs_reach_the_prompt(server: RunningServer, client: openai.OpenAI) -> None:
    items: list[Any] = [
        {"role": "user", "content": "add 1 and 2"},
        {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 1, "b": 2}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "3"},
    ]
    response = client.responses.create(model=MODEL, input=items, max_output_tokens=3, temperature=0)
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "add 1 and 2"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    assert response.usage is not None and response.usage.input_tokens == _prompt_tokens(server, messages)
    assert response.output_text == _chat(server, messages, 3)["choices"][0]["message"]["content"]


def test_retrieve_and_delete(server: RunningServer, client: openai.OpenAI) -> None:
    created = client.responses.create(model=MODEL, input="hello", max_output_tokens=2)
    assert client.responses.retrieve(created.id) == created
    client.responses.delete(created.id)
    for attempt in (lambda: client.responses.retrieve(created.id), lambda: client.responses.delete(created.id)):
        with pytest.raises(openai.NotFoundError) as caught:
            attempt()
        assert created.id in caught.value.message
    with pytest.raises(openai.NotFoundError) as continued:
        client.responses.create(model=MODEL, input="more", previous_response_id=created.id, max_output_tokens=2)
    assert continued.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert created.id in continued.value.message


def test_store_false_keeps_nothing(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="hello", max_output_tokens=2, store=False)
    assert response.to_dict()["store"] is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_the_store_evicts_the_oldest_past_its_count() -> None:
    with running_server(mode_config("continuous", responses_store_max_count=2)) as server:
        client = openai_client(server)
        ids = [client.responses.create(model=MODEL, input="hi", max_output_tokens=1).id for _ in range(3)]
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(ids[0])
        assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
