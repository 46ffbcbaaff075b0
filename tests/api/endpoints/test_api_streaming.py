"""Streaming (SSE) end to end on a real server with the tiny model: framing, content, usage, timings, disconnects,
and what each batching mode makes visible to a client (dynamic holds a short answer until its batch ends)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from scheduler.request import FinishEvent, RequestEvent, SequenceRequest
from tests.server_harness import (
    CHAT,
    LONG,
    PROMPT,
    RunningServer,
    error_of,
    metric_value,
    mode_config,
    model_name,
    num_running,
    openai_client,
    running_server,
    seats_all_free,
    server_mode,
    stop_string_in,
    tiny_tokenizer,
    wait_until,
)


def sse_events(response: httpx.Response) -> list[dict]:
    """Check the SSE framing of a whole response and return its JSON events (without the final [DONE])."""
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    body = response.read().decode("utf-8")
    assert body.endswith("\n\n")
    frames = body[: -len("\n\n")].split("\n\n")
    for frame in frames:  # every event is exactly one `data: ...` line
        assert frame.startswith("data: ") and "\n" not in frame, repr(frame)
    assert frames[-1] == "data: [DONE]"
    assert frames.count("data: [DONE]") == 1
    return [json.loads(frame[len("data: ") :]) for frame in frames[:-1]]


def post_stream(server: RunningServer, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.base_url}{path}", json={**body, "stream": True}, timeout=60) as response:
        return sse_events(response)


def joined_text(chunks: list, index: int = 0) -> str:
    """Concatenated text of one choice from openai-client chunks (completions or chat)."""
    parts = []
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.index == index:
                text = choice.delta.content if hasattr(choice, "delta") else choice.text
                parts.append(text or "")
    return "".join(parts)


def streamed_tokens(chunks: list) -> int:
    """Tokens a completions stream carried, counted from its logprobs (one entry per token, even when a token
    adds no text yet, e.g. part of a UTF-8 character)."""
    return sum(len(choice.logprobs.tokens or []) for chunk in chunks for choice in chunk.choices if choice.logprobs)


# ----- raw SSE framing -----
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True}),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 6, "ignore_eos": True}),
    ],
)
def test_sse_events_are_data_lines_ending_with_done(server: RunningServer, path: str, body: dict) -> None:
    events = post_stream(server, path, body)
    chat = path.endswith("chat/completions")
    assert {e["object"] for e in events} == {"chat.completion.chunk" if chat else "text_completion"}
    assert len({e["id"] for e in events}) == 1
    final = events[-1]
    assert [c["finish_reason"] for c in final["choices"]] == ["length"]
    assert all(c["finish_reason"] is None for e in events[:-1] for c in e["choices"])
    assert final["usage"]["completion_tokens"] == 6
    assert final["usage"]["total_tokens"] == final["usage"]["prompt_tokens"] + 6
    timings = final["timings"]
    assert timings["mode"] == server_mode(server)
    assert (timings["batch_id"] is not None) == (server_mode(server) == "dynamic")
    assert all("usage" not in e for e in events[:-1])
    if chat:
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"


def test_stream_with_include_usage_ends_with_a_usage_chunk(server: RunningServer) -> None:
    events = post_stream(
        server,
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 5, "ignore_eos": True, "stream_options": {"include_usage": True}},
    )
    last, before = events[-1], events[-2]
    assert last["choices"] == []
    num_prompt_tokens = len(tiny_tokenizer()(PROMPT)["input_ids"])
    cached = last["usage"]["prompt_tokens_details"]["cached_tokens"]  # whatever earlier tests left in the cache
    assert last["usage"] == {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": 5,
        "total_tokens": num_prompt_tokens + 5,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    assert 0 <= cached < num_prompt_tokens and last["timings"]["cached_tokens"] == cached
    assert last["timings"]["mode"] == server_mode(server)
    assert before["choices"][0]["finish_reason"] == "length"
    assert all("usage" in event and event["usage"] is None for event in events[:-1])  # null until the last


def test_error_before_the_stream_starts_is_a_plain_json_error(server: RunningServer) -> None:
    response = httpx.post(
        f"{server.base_url}/v1/completions", json={"prompt": PROMPT, "stream": True, "max_tokens": -1}
    )
    assert error_of(response, 400)["param"] == "max_tokens"
    assert response.headers["content-type"].startswith("application/json")


# ----- content through the openai client -----
def test_streamed_completion_equals_the_non_streamed_one(server: RunningServer, client: openai.OpenAI) -> None:
    kwargs = dict(
        model=model_name(server),
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    whole = client.completions.create(**kwargs)  # type: ignore[call-overload]
    chunks = list(client.completions.create(stream=True, **kwargs))  # type: ignore[call-overload]
    assert joined_text(chunks) == whole.choices[0].text
    final = chunks[-1]
    assert final.choices[0].finish_reason == "length"
    assert final.usage is not None and final.usage.completion_tokens == streamed_tokens(chunks) == 12
    assert final.timings["mode"] == server_mode(server)  # type: ignore[attr-defined]
    if server_mode(server) == "dynamic":
        assert isinstance(final.timings["batch_id"], int)  # type: ignore[attr-defined]


def test_streamed_completion_logprobs_have_sorted_alternatives(server: RunningServer, client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=model_name(server),
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            logprobs=2,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    tops = [
        top for c in chunks if c.choices and c.choices[0].logprobs for top in c.choices[0].logprobs.top_logprobs or []
    ]
    chosen = [
        lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs or []
    ]
    assert len(tops) == len(chosen) == 8
    for top, logprob in zip(tops, chosen, strict=True):
        values = list(top.values())
        assert 1 <= len(values) <= 2 and values == sorted(values, reverse=True)
        assert logprob == pytest.approx(values[0])


def test_streamed_chat_equals_the_non_streamed_one(server: RunningServer, client: openai.OpenAI) -> None:
    kwargs = dict(
        model=model_name(server),
        messages=CHAT,
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    chunks = list(client.chat.completions.create(stream=True, **kwargs))  # type: ignore[call-overload]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert joined_text(chunks) == whole.choices[0].message.content
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    assert chunks[-1].usage is not None and len(entries) == chunks[-1].usage.completion_tokens == 10
    assert all(len(e.top_logprobs) == 2 for e in entries)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_streamed_chat_with_include_usage(server: RunningServer, client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=model_name(server),
            messages=CHAT,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].timings["mode"] == server_mode(server)  # type: ignore[attr-defined]
    assert chunks[-2].choices[0].finish_reason == "length"


def test_streamed_n_choices_each_finish_once(server: RunningServer, client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=model_name(server),
            prompt=PROMPT,
            n=2,
            max_tokens=6,
            temperature=1.0,
            seed=5,
            logprobs=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1]
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    assert joined_text(chunks, 0) != joined_text(chunks, 1)
    tokens = streamed_tokens(chunks)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == tokens == 12
    whole = client.completions.create(
        model=model_name(server),
        prompt=PROMPT,
        n=2,
        max_tokens=6,
        temperature=1.0,
        seed=5,
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == [joined_text(chunks, i) for i in (0, 1)]


def test_streamed_stop_string_truncates_before_it(server: RunningServer, client: openai.OpenAI) -> None:
    kwargs = dict(
        model=model_name(server), prompt="hello world", max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    full = client.completions.create(**kwargs).choices[0].text  # type: ignore[call-overload]
    index, stop = stop_string_in(full)
    chunks = list(client.completions.create(stream=True, stop=stop, **kwargs))  # type: ignore[call-overload]
    assert joined_text(chunks) == full[:index]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].choices[0].model_extra == {"stop_reason": stop}  # on the last chunk only
    assert all(not chunk.choices[0].model_extra for chunk in chunks[:-1])


def test_streamed_echo_starts_with_the_prompt(server: RunningServer, client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=model_name(server),
            prompt=PROMPT,
            max_tokens=4,
            temperature=0,
            echo=True,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].text == PROMPT
    plain = (
        client.completions.create(
            model=model_name(server), prompt=PROMPT, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    assert joined_text(chunks) == PROMPT + plain


def test_streamed_seeded_sample_repeats(server: RunningServer, client: openai.OpenAI) -> None:
    kwargs = dict(
        model=model_name(server), prompt=PROMPT, max_tokens=8, temperature=1.0, seed=42, extra_body={"ignore_eos": True}
    )
    first = joined_text(list(client.completions.create(stream=True, **kwargs)))  # type: ignore[call-overload]
    second = joined_text(list(client.completions.create(stream=True, **kwargs)))  # type: ignore[call-overload]
    assert first == second == client.completions.create(**kwargs).choices[0].text  # type: ignore[call-overload]


def test_streamed_token_id_prompts_answer_each(server: RunningServer, client: openai.OpenAI) -> None:
    prompts = [tiny_tokenizer()(p)["input_ids"] for p in (PROMPT, "0123")]
    kwargs = dict(model=model_name(server), max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(prompt=prompts, stream=True, **kwargs))  # type: ignore[call-overload]
    singles = [client.completions.create(prompt=p, **kwargs).choices[0].text for p in prompts]  # type: ignore[call-overload]
    assert [joined_text(chunks, i) for i in (0, 1)] == singles
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_streamed_greedy_text_is_identical_in_both_modes(servers: dict[str, RunningServer]) -> None:
    def answers(server: RunningServer) -> list[str]:
        client = openai_client(server)
        kwargs = dict(
            model=model_name(server), max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        texts = [
            joined_text(list(client.completions.create(prompt=p, **kwargs)))  # type: ignore[call-overload]
            for p in (PROMPT, "hello world")
        ]
        chat = list(client.chat.completions.create(messages=CHAT, **kwargs))  # type: ignore[call-overload]
        return [*texts, joined_text(chat)]

    assert answers(servers["dynamic"]) == answers(servers["continuous"])


# ----- disconnects -----
def test_streaming_client_disconnect_aborts_its_request(server: RunningServer) -> None:
    steps_before = metric_value(server.base_url, "batchserve:steps_total")
    body = {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # it is running: a first token arrived
        assert num_running(server) == 1
    # Leaving the block closes the connection mid-stream.
    wait_until(lambda: seats_all_free(server), "the abandoned stream's request to be aborted")
    assert num_running(server) == 0
    assert metric_value(server.base_url, "batchserve:steps_total") - steps_before < LONG


def test_openai_stream_closed_early_frees_its_seat(server: RunningServer, client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=model_name(server), messages=CHAT, max_tokens=LONG, stream=True, extra_body={"ignore_eos": True}
    )
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    stream.close()
    wait_until(lambda: seats_all_free(server), "the closed stream's request to be aborted")


# ----- what each mode makes visible: a short and a long request in one batch -----
SHORT_TOKENS, LONG_TOKENS = 2, 40


def record_events(server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Record every scheduler event as (request id, "token" | "finish"), in the order the loop emits them."""
    emitted: list[tuple[str, str]] = []
    loop = server.runtime.loop
    submit = loop.submit

    def recording_submit(request: SequenceRequest, arrival: float | None = None) -> None:
        sink = request.sink

        def record(event: RequestEvent) -> None:
            emitted.append((request.request_id, "finish" if isinstance(event, FinishEvent) else "token"))
            sink(event)

        request.sink = record
        submit(request, arrival)

    monkeypatch.setattr(loop, "submit", recording_submit)
    return emitted


async def stream_pair(base_url: str) -> tuple[list[dict], list[dict]]:
    """Send a short and a long streaming request at once; return each one's events."""

    async def one(http: httpx.AsyncClient, max_tokens: int) -> list[dict]:
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "logprobs": 0, "stream": True}
        events = []
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[len("data: ") :]))
        return events

    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        short, long = await asyncio.gather(one(http, SHORT_TOKENS), one(http, LONG_TOKENS))
    return short, long


def token_count(events: list[dict]) -> int:
    return sum(len(c["logprobs"]["tokens"]) for e in events for c in e["choices"] if c["logprobs"])


def emission_positions(emitted: list[tuple[str, str]], response_id: str) -> tuple[list[int], int]:
    """Positions of a response's token events and of its finish event in the emission order."""
    mine = [(i, kind) for i, (request_id, kind) in enumerate(emitted) if request_id.startswith(response_id)]
    tokens = [i for i, kind in mine if kind == "token"]
    [finish] = [i for i, kind in mine if kind == "finish"]
    return tokens, finish


def test_dynamic_batch_holds_the_short_answer_until_the_long_one_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two seats and a batch timeout no test reaches: the batch leaves exactly when both requests wait.
    with running_server(mode_config("dynamic", max_batch_size=2, batch_timeout_ms=600_000)) as server:
        emitted = record_events(server, monkeypatch)
        held_before = metric_value(server.base_url, "batchserve:held_seats_total")
        short, long = asyncio.run(stream_pair(server.base_url))

        assert token_count(short) == SHORT_TOKENS and token_count(long) == LONG_TOKENS
        short_final, long_final = short[-1], long[-1]
        assert short_final["choices"][0]["finish_reason"] == "length"
        assert long_final["choices"][0]["finish_reason"] == "length"
        # The short answer's end is emitted only after the long one's last token.
        long_tokens, _ = emission_positions(emitted, long_final["id"])
        short_tokens, short_finish = emission_positions(emitted, short_final["id"])
        assert len(short_tokens) == SHORT_TOKENS and len(long_tokens) == LONG_TOKENS
        assert short_finish > long_tokens[-1]

        s, lg = short_final["timings"], long_final["timings"]
        assert s["mode"] == lg["mode"] == "dynamic"
        assert s["batch_id"] == lg["batch_id"] is not None
        assert s["num_steps"] == SHORT_TOKENS and lg["num_steps"] == LONG_TOKENS
        assert s["held_time_ms"] > 0
        # Both got their first token in the same step, so the short one's first token to release spans the long
        # one's whole decode (each figure is rounded to 1 us).
        assert s["decode_time_ms"] + s["held_time_ms"] >= lg["decode_time_ms"] - 0.002
        # The short one sat finished in its seat for every step after its last token until the batch ended.
        held = metric_value(server.base_url, "batchserve:held_seats_total") - held_before
        assert held == LONG_TOKENS - SHORT_TOKENS


def test_continuous_batch_releases_the_short_answer_first(monkeypatch: pytest.MonkeyPatch) -> None:
    with running_server(mode_config("continuous", max_num_seqs=2)) as server:
        emitted = record_events(server, monkeypatch)
        short, long = asyncio.run(stream_pair(server.base_url))

        assert token_count(short) == SHORT_TOKENS and token_count(long) == LONG_TOKENS
        short_final, long_final = short[-1], long[-1]
        long_tokens, long_finish = emission_positions(emitted, long_final["id"])
        _, short_finish = emission_positions(emitted, short_final["id"])
        assert short_finish < long_tokens[-1] < long_finish
        assert short_final["timings"]["batch_id"] is None and short_final["timings"]["mode"] == "continuous"
        assert short_final["timings"]["num_steps"] == SHORT_TOKENS
        assert metric_value(server.base_url, "batchserve:held_seats_total") == 0
