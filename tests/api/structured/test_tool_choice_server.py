"""tool_choice auto, none, required, named and parallel_tool_calls through a live server (uvicorn, tiny random
model), both modes, streamed and not, through the openai SDK: every call parses and validates against its tool,
the stream and the whole answer agree, and bad input is a 400 naming its field (forced calls:
test_structured_server.py).

The tiny model writes whatever its random weights like; the generic parser's envelope makes it decide between a
call and a text answer at its first tokens, so sampled seeds give both branches."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest

pytest.importorskip("xgrammar")

from tests.server_harness import RunningServer, mode_config, openai_client, running_server

from .test_structured_server import MESSAGES, TOOL_SCHEMAS, TOOLS

SEEDS = range(8)


@pytest.fixture(scope="module", params=["dynamic-generic", "continuous-hermes"])
def server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    mode, parser = request.param.split("-")
    with running_server(mode_config(mode, tool_call_parser=parser)) as running:
        yield running


def _model(server: RunningServer) -> str:
    return str(httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][0]["id"])


def _post(server: RunningServer, **body: Any) -> httpx.Response:
    body = {"model": _model(server), "messages": MESSAGES, "max_tokens": 200, **body}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)


def _streamed(server: RunningServer, **body: Any) -> tuple[str | None, list[dict[str, Any]], str, list[dict]]:
    """(content, calls, finish_reason, chunks) assembled from a stream as a client does."""
    body = {"model": _model(server), "messages": MESSAGES, "max_tokens": 200, "stream": True, **body}
    content, calls, reason, chunks = None, [], "", []
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            chunks.append(chunk)
            for choice in chunk["choices"]:
                delta = choice["delta"]
                if delta.get("content"):
                    content = (content or "") + delta["content"]
                for call in delta.get("tool_calls", ()):
                    if call["index"] == len(calls):  # announced: its id, type and name, once
                        assert call["id"].startswith("call_") and call["type"] == "function"
                        calls.append({"name": call["function"]["name"], "arguments": ""})
                    else:
                        assert "id" not in call and "name" not in call["function"]
                        assert call["index"] == len(calls) - 1
                    calls[call["index"]]["arguments"] += call["function"].get("arguments", "")
                reason = choice["finish_reason"] or reason
    return content, calls, reason, chunks


def _check_calls(calls: list[dict[str, Any]]) -> None:
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), TOOL_SCHEMAS[call["name"]])


@pytest.mark.slow
def test_auto_calls_validate_and_the_stream_agrees_with_the_whole_answer(server) -> None:
    """`tool_choice` "auto", and left out (the default with tools), on alternate seeds."""
    branches = set()
    for seed in SEEDS:
        extra = {"tool_choice": "auto"} if seed % 2 else {}
        body = {"tools": TOOLS, "temperature": 1.0, "seed": seed, **extra}
        whole = _post(server, **body).json()["choices"][0]
        message = whole["message"]
        calls = [c["function"] for c in message.get("tool_calls") or []]
        _check_calls(calls)
        reason = whole["finish_reason"]
        assert (reason == "tool_calls") == bool(calls) or reason == "length"
        content, streamed, stream_reason, _ = _streamed(server, **body)
        assert stream_reason == reason
        if reason == "length" and len(streamed) > len(calls):  # cut inside a call: streamed in part, whole as text
            assert streamed[: len(calls)] == calls and message["content"].endswith(streamed[-1]["arguments"])
        else:
            assert streamed == calls and content == message["content"]
        branches.add("call" if calls else "text")
    if server.runtime.chat.parser.name == "generic":  # the envelope: both branches come up
        assert branches == {"call", "text"}


@pytest.mark.slow
def test_parallel_tool_calls_false_makes_at_most_one_call(server) -> None:
    for seed in SEEDS:
        body = {"tools": TOOLS, "temperature": 1.0, "seed": seed, "parallel_tool_calls": False}
        message = _post(server, **body).json()["choices"][0]["message"]
        assert len(message.get("tool_calls") or []) <= 1


def test_none_answers_as_if_there_were_no_tools(server) -> None:
    """The tiny template ignores tools, so "none" is the same prompt and no grammar: the same greedy text."""
    plain = _post(server, temperature=0).json()["choices"][0]["message"]
    none = _post(server, temperature=0, tools=TOOLS, tool_choice="none").json()["choices"][0]["message"]
    assert none == plain and "tool_calls" not in none


@pytest.mark.slow
def test_the_sdk_reads_auto_calls_whole_and_streamed(server) -> None:
    if server.runtime.chat.parser.name != "generic":
        pytest.skip("the tiny model calls under the generic envelope only")
    client = openai_client(server)
    answers = {s: _post(server, tools=TOOLS, temperature=1.0, seed=s).json()["choices"][0] for s in SEEDS}
    seed = next(s for s, choice in answers.items() if choice["finish_reason"] == "tool_calls")
    kwargs: dict[str, Any] = dict(model=_model(server), messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=seed)
    whole = client.chat.completions.create(max_tokens=200, **kwargs).choices[0].message
    with client.chat.completions.stream(max_tokens=200, **kwargs) as stream:
        final = stream.get_final_completion().choices[0].message
    assert [(c.function.name, c.function.arguments) for c in whole.tool_calls or []] == [
        (c.function.name, c.function.arguments) for c in final.tool_calls or []
    ]
    assert (whole.content or "") == (final.content or "")  # a stream opens with content "", as vLLM's


def test_tool_calls_are_counted_by_parser_and_outcome(server) -> None:
    _post(server, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=200)
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    parser = server.runtime.chat.parser.name
    assert f'parser="{parser}"' in text
    forced = [line for line in text.splitlines() if 'parser="forced"' in line and 'outcome="parsed"' in line]
    assert forced and float(forced[0].rsplit(" ", 1)[1]) >= 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}]}, "tools"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}, "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_bad_tool_input_is_a_400_naming_the_field(server, body, param) -> None:
    response = _post(server, **body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
