"""Structured outputs and forced tool calls through a live server (uvicorn, tiny random model), in both modes,
streaming and not, through the openai SDK: every answer matches its grammar, ends with "stop" (or "tool_calls")
because the grammar ended, and free requests beside constrained ones get what they get alone."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import pytest

pytest.importorskip("xgrammar")

from tests.server_harness import RunningServer, openai_client

PROMPT = "the quick brown fox"
MESSAGES = [{"role": "user", "content": "hello world, this is a test"}]
# Bounded answers: a random model cannot wander off in a string, so each ends by its grammar.
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "size": {"enum": ["small", "large"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 2},
    },
    "required": ["ok", "size", "count", "tags"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "pick", "parameters": SCHEMA}},
    {
        "type": "function",
        "function": {
            "name": "toggle",
            "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]},
        },
    },
]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _model(server: RunningServer) -> str:
    return str(httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][0]["id"])


def _completion(server: RunningServer, stream: bool, **extra: Any) -> tuple[list[str], list[str]]:
    client = openai_client(server)
    extra = dict(extra)
    kwargs: dict[str, Any] = {"model": _model(server), "prompt": PROMPT, "max_tokens": extra.pop("max_tokens", 200)}
    kwargs.update(temperature=extra.pop("temperature", 0.0), n=extra.pop("n", 1), extra_body=extra)
    if not stream:
        response = client.completions.create(**kwargs)
        return [c.text for c in response.choices], [str(c.finish_reason) for c in response.choices]
    texts, reasons = [""] * kwargs["n"], [""] * kwargs["n"]
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    return texts, reasons


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_choice": ["yes", "no", "maybe so"]}, lambda t: t in ("yes", "no", "maybe so")),
        ({"structured_outputs": {"regex": "[0-9]{3}-[a-c]{2}"}}, lambda t: re.fullmatch("[0-9]{3}-[a-c]{2}", t)),
        ({"structured_outputs": {"grammar": 'root ::= "(" [ab]? ")"'}}, lambda t: re.fullmatch(r"\([ab]?\)", t)),
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"response_format": {"type": "json_object"}, "temperature": 1.0, "seed": 3, "n": 3, "max_tokens": 240},
         lambda t: isinstance(json.loads(t), dict)),
    ],
    ids=["choice", "regex", "ebnf", "json_schema", "json_object-sampled-n3"],
)  # fmt: skip
def test_completions_match_their_grammar_and_stop(server: RunningServer, stream: bool, extra: dict, check) -> None:
    texts, reasons = _completion(server, stream, **extra)
    for text, reason in zip(texts, reasons, strict=True):
        if reason == "length":  # a random model may spend a sampled object's tokens inside one string
            assert "json_object" in str(extra)
            continue
        assert check(text), text
        assert reason == "stop", text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_json_schema_answers_validate(server: RunningServer, stream: bool) -> None:
    client = openai_client(server)
    response_format = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
    kwargs: dict[str, Any] = dict(model=_model(server), messages=MESSAGES, max_tokens=200, temperature=0)
    if stream:
        parts = list(client.chat.completions.create(stream=True, response_format=response_format, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
        reason = [c.choices[0].finish_reason for c in parts if c.choices][-1]
    else:
        response = client.chat.completions.create(response_format=response_format, **kwargs)
        text, reason = response.choices[0].message.content or "", response.choices[0].finish_reason
    jsonschema.validate(json.loads(text), SCHEMA)
    assert reason == "stop"


def _call(server: RunningServer, tool_choice: Any, stream: bool) -> tuple[str, str, str, str | None]:
    """(call id, function name, arguments, finish_reason) of a forced tool call."""
    client = openai_client(server)
    kwargs: dict[str, Any] = dict(model=_model(server), messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice)
    kwargs.update(max_tokens=200, temperature=0)
    if not stream:
        response = client.chat.completions.create(**kwargs)
        message = response.choices[0].message
        assert message.content is None and message.tool_calls is not None and len(message.tool_calls) == 1
        call = message.tool_calls[0]
        assert call.type == "function"
        return call.id, call.function.name, call.function.arguments, response.choices[0].finish_reason
    call_id, name, arguments, reason = "", "", "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        reason = choice.finish_reason or reason
        for delta in choice.delta.tool_calls or ():
            assert delta.index == 0
            if delta.id is not None:  # the first delta of the call, and only it, names it
                assert not call_id and delta.function is not None and delta.function.name
                call_id, name = delta.id, delta.function.name
            assert call_id, "arguments before the call was announced"
            arguments += delta.function.arguments or "" if delta.function else ""
        assert choice.delta.content in (None, "")
    return call_id, name, arguments, reason


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "toggle"}}],
                         ids=["required", "named"])  # fmt: skip
def test_forced_tool_calls_whole_and_streamed_agree(server: RunningServer, tool_choice: Any) -> None:
    whole = _call(server, tool_choice, stream=False)
    streamed = _call(server, tool_choice, stream=True)
    for call_id, name, arguments, reason in (whole, streamed):
        assert call_id.startswith("call_") and reason == "tool_calls"
        jsonschema.validate(json.loads(arguments), TOOL_SCHEMAS[name])
        if isinstance(tool_choice, dict):
            assert name == "toggle"
    assert whole[1:] == streamed[1:]  # greedy: the same call, token for token


@pytest.fixture(scope="module")
def whole_answers() -> dict[tuple[Any, ...], Any]:
    """Each server's whole greedy answer to a request the cut tests cut short, asked once (it cannot change)."""
    return {}


def _raw_call(server: RunningServer, tool_choice: Any, stream: bool, **extra: Any) -> tuple[dict[str, Any], str]:
    """The message (content, tool_calls and their arguments, streamed ones joined) and finish_reason of a forced
    call with `extra` fields (a stop string, a small max_tokens)."""
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 200, "temperature": 0}
    body.update(stream=stream, **extra)
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    if not stream:
        choice = response.json()["choices"][0]
        return choice["message"], choice["finish_reason"]
    message: dict[str, Any] = {"content": None, "tool_calls": None}
    reasons = []
    for line in response.text.splitlines():
        if not line.startswith("data: {"):
            continue
        choice = json.loads(line[6:])["choices"][0]
        reasons.append(choice["finish_reason"])
        delta = choice["delta"]
        if delta.get("content"):
            message["content"] = (message["content"] or "") + delta["content"]
        for call in delta.get("tool_calls") or ():
            calls = message["tool_calls"] = message["tool_calls"] or [{"function": {"name": "", "arguments": ""}}]
            calls[0]["function"]["name"] += call["function"].get("name") or ""
            calls[0]["function"]["arguments"] += call["function"].get("arguments") or ""
    assert all(r is None for r in reasons[:-1])
    return message, reasons[-1]


def _cut_text(message: dict[str, Any], stream: bool) -> str:
    """What a cut answer shows of itself: its content, or in a stream that had announced the call, the call's
    arguments (they went out as they came)."""
    if not stream or message["tool_calls"] is None:
        assert message.get("tool_calls") is None and isinstance(message["content"], str), message
        return message["content"]
    return message["tool_calls"][0]["function"]["arguments"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("cut", ["stop", "length"])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "toggle"}}],
                         ids=["required", "named"])  # fmt: skip
def test_a_call_cut_short_reports_its_cut_and_its_text(
    server: RunningServer, whole_answers: dict[tuple[Any, ...], Any], tool_choice: Any, cut: str, stream: bool
) -> None:
    """A stop string inside the call (or max_tokens) ends it where it falls, as anywhere: the answer says "stop"
    (or "length") with the text as it is, never "tool_calls" with arguments that do not parse (it said "tool_calls"
    with `arguments: "{"`)."""
    key = (server, "call", json.dumps(tool_choice))
    if key not in whole_answers:
        whole_answers[key] = _raw_call(server, tool_choice, stream=False)
    whole, reason = whole_answers[key]
    assert reason == "tool_calls"
    arguments = whole["tool_calls"][0]["function"]["arguments"]
    extra = {"stop": ["}"]} if cut == "stop" else {"max_tokens": 3}
    message, reason = _raw_call(server, tool_choice, stream, **extra)
    assert reason == cut
    text = _cut_text(message, stream)
    with pytest.raises(ValueError):
        json.loads(text)
    if cut == "stop":  # cut at the first "}": the arguments' first closing brace, the stop string left out
        assert "}" not in text and text.rstrip().endswith(arguments[: arguments.index("}")].rstrip())
    elif isinstance(tool_choice, dict):  # the first tokens of the same greedy arguments
        assert text.strip() and arguments.startswith(text.strip())
    else:  # the first tokens of the same greedy wrapper, `{"name": ...`
        assert text.startswith("{") and "parameters" not in text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_stop_inside_a_grammar_ends_the_answer_there(
    server: RunningServer, whole_answers: dict[tuple[Any, ...], Any], endpoint: str, stream: bool
) -> None:
    """Structured outputs the same way: "stop", and the grammar's text up to the stop string, as is."""
    key = (server, "grammar", endpoint)
    if endpoint == "completions":
        if key not in whole_answers:
            whole_answers[key] = _completion(server, False, guided_json=SCHEMA)
        whole, reason = whole_answers[key]
        cut, cut_reason = _completion(server, stream, guided_json=SCHEMA, stop=["}"])
        whole_text, text = whole[0], cut[0]
        reason, cut_reason = reason[0], cut_reason[0]
    else:
        client = openai_client(server)
        response_format = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}}
        kwargs: dict[str, Any] = dict(model=_model(server), messages=MESSAGES, max_tokens=200, temperature=0)
        kwargs.update(response_format=response_format)
        if key not in whole_answers:
            answer = client.chat.completions.create(**kwargs).choices[0]
            whole_answers[key] = answer.message.content or "", answer.finish_reason
        whole_text, reason = whole_answers[key]
        if stream:
            parts = [c.choices[0] for c in client.chat.completions.create(stream=True, stop=["}"], **kwargs)]
            text, cut_reason = "".join(p.delta.content or "" for p in parts), parts[-1].finish_reason
        else:
            cut_answer = client.chat.completions.create(stop=["}"], **kwargs).choices[0]
            text, cut_reason = cut_answer.message.content or "", cut_answer.finish_reason
    assert reason == "stop" and whole_text.rstrip().endswith("}")
    assert cut_reason == "stop" and text == whole_text[: whole_text.index("}")]


def test_tool_history_renders_and_a_tool_free_request_is_unchanged(server: RunningServer) -> None:
    """Assistant tool_calls and tool results in the history go through the template; tool_choice none with tools
    answers as text."""
    client = openai_client(server)
    model = _model(server)
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "toggle", "arguments": '{"on": true}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
    ]  # fmt: skip
    response = client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0
    )
    assert response.choices[0].finish_reason == "tool_calls"
    text = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=5, temperature=0
    )
    assert text.choices[0].message.tool_calls is None and text.choices[0].message.content


def test_free_requests_beside_constrained_ones_answer_as_alone(server: RunningServer) -> None:
    client = openai_client(server)
    model = _model(server)
    prompts = [f"{PROMPT} {i}" for i in range(4)]

    def free(prompt: str) -> str:
        return client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0).choices[0].text

    alone = [free(p) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        constrained = [
            pool.submit(_completion, server, False, guided_json=SCHEMA) for _ in range(4)
        ]  # fmt: skip
        together = list(pool.map(free, prompts))
        for future in constrained:
            texts, _ = future.result()
            jsonschema.validate(json.loads(texts[0]), SCHEMA)
    assert together == alone
    seats = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    assert re.search(r"^vllm:num_requests_running\S* 0(\.0)?$", seats, re.M), "a seat is still held"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "does not compile"),
        ({"guided_grammar": "root ::= missing"}, "guided_grammar", "does not compile"),
        ({"guided_json": {"type": "bogus"}}, "guided_json", "does not compile"),
        ({"guided_json": SCHEMA, "min_tokens": 3}, "min_tokens", "structured outputs"),
        ({"guided_choice": ["a"], "allowed_token_ids": [1, 2]}, "allowed_token_ids", "structured outputs"),
    ],
)
def test_grammars_that_cannot_run_are_a_400_naming_the_field(server: RunningServer, body, param, words) -> None:
    response = httpx.post(
        f"{server.base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, **body}, timeout=30
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]
