"""The OpenAI-compatible API end to end: a real server (uvicorn, tiny model) driven by the `openai` client and httpx.

Non-streaming behaviour, errors, auth, limits, load shedding, loading state, disconnects and metrics, in both
batching modes. Streaming lives in test_api_streaming.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
import torch
import uvicorn

from api.apps.serve import create_app
from api.config import ServerConfig
from engine.weights.loader import LoadedModel
from tests.server_harness import (
    CHAT,
    LONG,
    MODES,
    PROMPT,
    RunningServer,
    as_dicts,
    error_of,
    free_port,
    metric_samples,
    metric_value,
    mode_config,
    model_name,
    num_running,
    openai_client,
    running_server,
    seats_all_free,
    server_mode,
    stop_string_in,
    tiny_loaded_model,
    tiny_tokenizer,
    wait_until,
)


# ----- models, completions, chat -----
def test_models_lists_the_served_model(server: RunningServer, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny-llama"]
    assert models[0].owned_by == "batchserve"
    raw = httpx.get(f"{server.base_url}/v1/models").json()
    assert raw["object"] == "list" and raw["data"][0]["max_model_len"] == 256


def test_completion_has_text_finish_reason_usage_and_timings(server: RunningServer, client: openai.OpenAI) -> None:
    sent = time.time()
    result = client.completions.create(
        model=model_name(server),
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    assert result.object == "text_completion" and result.id.startswith("cmpl-")
    [choice] = result.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    assert isinstance(choice.text, str) and choice.text
    assert choice.logprobs is not None and len(choice.logprobs.tokens or []) == 8  # one entry per generated token
    assert result.usage is not None
    assert result.usage.completion_tokens == 8
    assert result.usage.prompt_tokens == len(tiny_tokenizer()(PROMPT)["input_ids"])
    assert result.usage.total_tokens == result.usage.prompt_tokens + 8
    timings = result.timings  # type: ignore[attr-defined]
    assert timings["mode"] == server_mode(server)
    assert timings["num_steps"] >= 8 and timings["num_choices"] == 1
    assert timings["e2e_time_ms"] >= timings["time_to_first_token_ms"] >= timings["queue_time_ms"] >= 0
    assert sent <= timings["arrival_time"] <= time.time()  # Unix seconds, the instant the queue orders by
    if server_mode(server) == "dynamic":
        assert isinstance(timings["batch_id"], int)
    else:
        assert timings["batch_id"] is None


def test_chat_completion_answers_with_an_assistant_message(server: RunningServer, client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model=model_name(server), messages=CHAT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert result.object == "chat.completion" and result.id.startswith("chatcmpl-")
    [choice] = result.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    prompt_ids = tiny_tokenizer().apply_chat_template(
        as_dicts(CHAT), add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert result.usage is not None
    assert result.usage.prompt_tokens == len(prompt_ids)
    assert result.usage.completion_tokens == 6
    assert result.timings["mode"] == server_mode(server)  # type: ignore[attr-defined]


def test_chat_max_completion_tokens_limits_the_answer(server: RunningServer, client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model=model_name(server), messages=CHAT, max_completion_tokens=3, extra_body={"ignore_eos": True}
    )
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None and result.usage.completion_tokens == 3


def test_n_returns_n_choices_with_distinct_indices(server: RunningServer, client: openai.OpenAI) -> None:
    result = client.completions.create(
        model=model_name(server), prompt=PROMPT, n=3, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in result.choices) == [0, 1, 2]
    assert len({c.text for c in result.choices}) == 1  # greedy: every choice is the same answer
    assert result.usage is not None
    assert result.usage.completion_tokens == 12
    assert result.usage.prompt_tokens == len(tiny_tokenizer()(PROMPT)["input_ids"])  # the prompt counts once
    assert result.timings["num_choices"] == 3  # type: ignore[attr-defined]


def test_seeded_sampling_gives_each_of_n_choices_its_own_sample(server: RunningServer, client: openai.OpenAI) -> None:
    kwargs = dict(
        model=model_name(server),
        prompt=PROMPT,
        n=2,
        max_tokens=8,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    first = client.completions.create(**kwargs)  # type: ignore[call-overload]
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts[0] != texts[1]
    again = client.completions.create(**kwargs)  # type: ignore[call-overload]
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts


def test_chat_n_returns_n_choices(server: RunningServer, client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model=model_name(server),
        messages=CHAT,
        n=2,
        max_tokens=4,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in result.choices) == [0, 1]
    assert result.choices[0].message.content != result.choices[1].message.content
    assert result.usage is not None and result.usage.completion_tokens == 8


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_completion_logprobs_cover_every_token_with_sorted_alternatives(
    server: RunningServer, client: openai.OpenAI, temperature: float
) -> None:
    result = client.completions.create(
        model=model_name(server),
        prompt=PROMPT,
        max_tokens=10,
        logprobs=3,
        temperature=temperature,
        seed=11,
        extra_body={"ignore_eos": True},
    )
    [choice] = result.choices
    logprobs = choice.logprobs
    assert logprobs is not None and result.usage is not None
    n = result.usage.completion_tokens
    assert n == 10
    assert len(logprobs.tokens or []) == len(logprobs.token_logprobs or []) == len(logprobs.top_logprobs or []) == n
    assert len(logprobs.text_offset or []) == n
    for token_logprob, top in zip(logprobs.token_logprobs or [], logprobs.top_logprobs or [], strict=True):
        assert token_logprob <= 0.0
        assert 1 <= len(top) <= 3
        values = list(top.values())
        assert values == sorted(values, reverse=True)
        assert all(v <= 0.0 for v in values)
        if temperature == 0.0:  # greedy: the chosen token is the most likely one
            assert token_logprob == pytest.approx(values[0])
        else:
            assert token_logprob <= values[0] + 1e-6


def test_chat_logprobs_give_content_with_top_logprobs(server: RunningServer, client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model=model_name(server),
        messages=CHAT,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    [choice] = result.choices
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert result.usage is not None and len(content) == result.usage.completion_tokens == 6
    for entry in content:
        assert len(entry.top_logprobs) == 2
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.logprob == pytest.approx(values[0])  # greedy
    # Each token's own bytes (not U+FFFD's for a partial character) make up the answer; a random model may
    # leave a broken character, which both sides read as U+FFFD.
    assert b"".join(bytes(entry.bytes or []) for entry in content).decode("utf-8", "replace") == choice.message.content


def test_stop_string_truncates_the_answer_before_it(server: RunningServer, client: openai.OpenAI) -> None:
    kwargs = dict(
        model=model_name(server), prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    full = client.completions.create(**kwargs).choices[0].text  # type: ignore[call-overload]
    index, stop = stop_string_in(full)
    stopped = client.completions.create(**kwargs, stop=[stop])  # type: ignore[call-overload]
    [choice] = stopped.choices
    assert choice.text == full[:index]
    assert choice.finish_reason == "stop"
    assert choice.model_extra == {"stop_reason": stop}  # vLLM's: the stop string that ended it
    assert stopped.usage is not None and 1 <= stopped.usage.completion_tokens <= 24


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_stop_string_matched_only_by_the_final_flush_ends_with_stop(server: RunningServer, stream: bool) -> None:
    """max_tokens cuts the reply inside a multi-byte character: the final flush decodes it to U+FFFD, which a stop
    string matches. The text is cut there and the finish reason is "stop", not "length"."""
    # Byte-level BPE spells byte 0xE2 (the lead of a 3-byte character) as the character U+00E2.
    lead_byte = tiny_tokenizer().convert_tokens_to_ids(chr(0xE2))
    assert tiny_tokenizer().decode([lead_byte]) == "\ufffd"
    body = {
        "model": "tiny-llama",
        "prompt": PROMPT,
        "max_tokens": 1,
        "allowed_token_ids": [lead_byte],
        "stop": ["\ufffd"],
        "stream": stream,
    }
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    if stream:
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        text = "".join(choice["text"] for event in events for choice in event["choices"])
        reasons = [c["finish_reason"] for event in events for c in event["choices"] if c["finish_reason"]]
    else:
        [choice] = response.json()["choices"]
        text, reasons = choice["text"], [choice["finish_reason"]]
    assert text == "" and reasons == ["stop"]


def test_chat_stop_string_truncates_the_answer_before_it(server: RunningServer, client: openai.OpenAI) -> None:
    kwargs = dict(
        model=model_name(server), messages=CHAT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    full = client.chat.completions.create(**kwargs).choices[0].message.content or ""  # type: ignore[call-overload]
    index, stop = stop_string_in(full)
    choice = client.chat.completions.create(**kwargs, stop=stop).choices[0]  # type: ignore[call-overload]
    assert choice.message.content == full[:index]
    assert choice.finish_reason == "stop" and choice.model_extra == {"stop_reason": stop}


def test_echo_prefixes_the_prompt(server: RunningServer, client: openai.OpenAI) -> None:
    plain = (
        client.completions.create(
            model=model_name(server), prompt=PROMPT, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    echoed = client.completions.create(
        model=model_name(server), prompt=PROMPT, max_tokens=5, temperature=0, echo=True, extra_body={"ignore_eos": True}
    )
    assert echoed.choices[0].text == PROMPT + plain
    assert echoed.usage is not None and echoed.usage.completion_tokens == 5


def test_same_seed_at_temperature_one_gives_the_same_text(server: RunningServer, client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model=model_name(server),
                prompt=PROMPT,
                max_tokens=8,
                temperature=1.0,
                seed=seed,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
        )

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


def test_prompt_given_as_token_ids_matches_the_text_prompt(server: RunningServer, client: openai.OpenAI) -> None:
    ids = tiny_tokenizer()(PROMPT)["input_ids"]
    kwargs = dict(model=model_name(server), max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    from_text = client.completions.create(prompt=PROMPT, **kwargs)  # type: ignore[call-overload]
    from_ids = client.completions.create(prompt=ids, **kwargs)  # type: ignore[call-overload]
    assert from_ids.choices[0].text == from_text.choices[0].text
    assert from_ids.usage is not None and from_ids.usage.prompt_tokens == len(ids)


def test_prompt_given_as_a_list_of_token_id_lists_answers_each(server: RunningServer, client: openai.OpenAI) -> None:
    prompts = [tiny_tokenizer()(p)["input_ids"] for p in (PROMPT, "hello world")]
    kwargs = dict(model=model_name(server), max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    singles = [client.completions.create(prompt=p, **kwargs).choices[0].text for p in prompts]  # type: ignore[call-overload]
    batch = client.completions.create(prompt=prompts, **kwargs)  # type: ignore[call-overload]
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == singles
    assert batch.usage is not None
    assert batch.usage.prompt_tokens == sum(len(p) for p in prompts)
    assert batch.usage.completion_tokens == 10


def test_prompt_list_with_n_orders_choices_prompt_major(server: RunningServer, client: openai.OpenAI) -> None:
    result = client.completions.create(
        model=model_name(server),
        prompt=[PROMPT, "hello world"],
        n=2,
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    texts = [c.text for c in sorted(result.choices, key=lambda c: c.index)]
    assert len(texts) == 4 and texts[0] == texts[1] and texts[2] == texts[3]


def test_greedy_text_is_identical_in_both_modes(servers: dict[str, RunningServer]) -> None:
    def answers(server: RunningServer) -> list[str]:
        client = openai_client(server)
        extra_body = {"ignore_eos": True}
        texts = [
            c.text
            for p in (PROMPT, "hello", "0123456789")
            for c in client.completions.create(
                model=model_name(server), prompt=p, max_tokens=12, temperature=0, extra_body=extra_body
            ).choices
        ]
        chat = client.chat.completions.create(
            model=model_name(server), messages=CHAT, max_tokens=12, temperature=0, extra_body=extra_body
        )
        return [*texts, chat.choices[0].message.content or ""]

    dynamic, continuous = answers(servers["dynamic"]), answers(servers["continuous"])
    assert dynamic == continuous
    assert all(dynamic)


def test_seeded_sample_is_identical_in_both_modes(servers: dict[str, RunningServer]) -> None:
    texts = {
        mode: openai_client(server)
        .completions.create(
            model=model_name(server),
            prompt=PROMPT,
            max_tokens=10,
            temperature=1.0,
            seed=99,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
        for mode, server in servers.items()
    }
    assert texts["dynamic"] == texts["continuous"]


# ----- EOS and ignore_eos: a model whose EOS is the first greedy token of PROMPT -----
@pytest.fixture(scope="module")
def eos_first_model() -> LoadedModel:
    tiny = tiny_loaded_model()
    ids = tiny_tokenizer()(PROMPT)["input_ids"]
    with torch.no_grad():
        first = int(tiny.model(torch.tensor([ids])).logits[0, -1].argmax())
    return LoadedModel(tiny.model, tiny.tokenizer, "tiny-eos", (first,), tiny.max_model_len)


@pytest.mark.parametrize("mode", MODES)
def test_eos_stops_generation_unless_ignore_eos(mode: str, eos_first_model: LoadedModel) -> None:
    with running_server(mode_config(mode), loaded=eos_first_model) as server:
        client = openai_client(server)
        stopped = client.completions.create(model="tiny-eos", prompt=PROMPT, max_tokens=8, temperature=0)
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.usage is not None and stopped.usage.completion_tokens == 1
        ignored = client.completions.create(
            model="tiny-eos", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        assert ignored.choices[0].finish_reason == "length"
        assert ignored.usage is not None and ignored.usage.completion_tokens == 8


# ----- errors -----
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": PROMPT, "max_tokens": -1}, "max_tokens"),
        ({"prompt": PROMPT, "max_tokens": "5"}, "max_tokens"),
        ({"prompt": PROMPT, "temperature": -0.5}, "temperature"),
        ({"prompt": PROMPT, "top_p": 0}, "top_p"),
        ({"prompt": PROMPT, "n": 0}, "n"),
        ({"prompt": PROMPT, "logprobs": 21}, "logprobs"),
        ({"prompt": PROMPT, "suffix": "and then"}, "suffix"),
        ({"prompt": PROMPT, "best_of": 2}, "best_of"),
        ({"prompt": PROMPT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": []}, "prompt"),
        ({"max_tokens": 4}, "prompt"),
        ({"prompt": [[1, 2], [-1]]}, "prompt"),
        ({"prompt": [1] * 300}, "prompt"),  # longer than the 256-token context by itself
        ({"prompt": [1] * 10, "max_tokens": 250}, "max_tokens"),  # fits, but not with its completion
        ({"prompt": PROMPT, "min_tokens": 8, "max_tokens": 4}, "min_tokens"),
    ],
)
def test_invalid_completion_request_is_a_400_naming_the_param(server: RunningServer, body: dict, param: str) -> None:
    error = error_of(httpx.post(f"{server.base_url}/v1/completions", json=body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": 5, "content": "hi"}]}, "messages"),
        ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": CHAT, "tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
        ({"messages": CHAT, "max_tokens": 1000}, "max_tokens"),
    ],
)
def test_invalid_chat_request_is_a_400_naming_the_param(server: RunningServer, body: dict, param: str) -> None:
    error = error_of(httpx.post(f"{server.base_url}/v1/chat/completions", json=body), 400)
    assert error["param"] == param


def test_openai_client_sees_bad_request_with_the_param(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny-llama", prompt=PROMPT, best_of=2)
    assert caught.value.status_code == 400
    assert caught.value.param == "best_of"  # type: ignore[attr-defined]
    assert "best_of" in caught.value.message


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"", b'"a string"'])
def test_malformed_body_is_a_400(server: RunningServer, content: bytes) -> None:
    response = httpx.post(
        f"{server.base_url}/v1/completions", content=content, headers={"content-type": "application/json"}
    )
    error = error_of(response, 400)
    assert error["type"] == "invalid_request_error"
    assert "JSON" in str(error["message"])


def test_body_that_is_not_json_content_is_a_400(server: RunningServer) -> None:
    response = httpx.post(
        f"{server.base_url}/v1/completions",
        content=b"prompt=hi",
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert "JSON" in str(error_of(response, 400)["message"])


def test_unknown_model_is_a_404_naming_model(server: RunningServer, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-9", prompt=PROMPT, max_tokens=2)
    assert caught.value.param == "model"  # type: ignore[attr-defined]
    error = error_of(
        httpx.post(f"{server.base_url}/v1/chat/completions", json={"model": "gpt-9", "messages": CHAT}), 404
    )
    assert error["param"] == "model" and "gpt-9" in str(error["message"])


def test_unknown_route_is_a_404_and_wrong_method_a_405(server: RunningServer) -> None:
    error = error_of(httpx.get(f"{server.base_url}/v1/embeddings"), 404)
    assert error["type"] == "not_found_error"
    error_of(httpx.get(f"{server.base_url}/v1/completions"), 405)


def test_body_above_max_body_bytes_is_a_413() -> None:
    with running_server(mode_config("continuous", max_body_bytes=2_000)) as server:
        url = f"{server.base_url}/v1/completions"
        small = httpx.post(url, json={"prompt": "x" * 100, "max_tokens": 1})
        assert small.status_code == 200
        declared = httpx.post(url, json={"prompt": "x" * 5_000, "max_tokens": 1})
        assert error_of(declared, 413)["type"] == "invalid_request_error"

        def chunks() -> Iterator[bytes]:  # no Content-Length: the limit holds while the body streams in
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"x" * 500
            yield b'"}'

        streamed = httpx.post(url, content=chunks(), headers={"content-type": "application/json"})
        error_of(streamed, 413)
        assert httpx.get(f"{server.base_url}/health").status_code == 200


# ----- auth -----
def test_api_key_is_required_everywhere_but_health() -> None:
    with running_server(mode_config("continuous", api_key="sekrit")) as server:
        base = server.base_url
        for method, path in [
            ("GET", "/v1/models"),
            ("POST", "/v1/completions"),
            ("POST", "/v1/chat/completions"),
            ("GET", "/metrics"),
        ]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
                response = httpx.request(method, f"{base}{path}", headers=headers, json={"prompt": "x"})
                error = error_of(response, 401)
                assert error["type"] == "authentication_error"
        assert httpx.get(f"{base}/health").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai_client(server, api_key="wrong").models.list()
        good = openai_client(server, api_key="sekrit")
        assert good.models.list().data[0].id == "tiny-llama"
        assert good.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=2).usage is not None
        metrics = httpx.get(f"{base}/metrics", headers={"Authorization": "Bearer sekrit"})
        assert metrics.status_code == 200 and "vllm:num_requests_running" in metrics.text


# ----- load shedding -----
@pytest.mark.parametrize("mode", MODES)
def test_full_queue_is_a_429_with_retry_after(mode: str) -> None:
    """One seat, a queue of one: a running request holds the seat, a second one waits, the third is shed."""
    config = mode_config(mode, max_batch_size=1, max_num_seqs=1, max_queue=1)
    with running_server(config) as server, httpx.Client(base_url=server.base_url, timeout=60) as http:
        body = {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as running:
            assert running.status_code == 200
            lines = running.iter_lines()  # keep a reference: a discarded iterator closes the connection
            assert next(lines).startswith("data: ")  # a first token: it holds the only seat, out of the queue
            with http.stream("POST", "/v1/completions", json=body) as waiting:
                assert waiting.status_code == 200  # submitted (headers follow submission); it waits for the seat
                shed = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
                error = error_of(shed, 429)
                assert error["type"] == "rate_limit_error"
                assert int(shed.headers["retry-after"]) >= 1
                with pytest.raises(openai.RateLimitError):
                    openai_client(server).completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=2)
                assert metric_value(server.base_url, "vllm:num_requests_waiting") == 1
        wait_until(lambda: seats_all_free(server), "the shed test's requests to be aborted")
        after = openai_client(server).completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=2)
        assert after.choices[0].finish_reason in ("length", "stop")


def test_more_sequences_than_the_whole_queue_is_a_400_not_a_429() -> None:
    with running_server(mode_config("continuous", max_queue=4)) as server:
        response = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"prompt": [PROMPT, PROMPT, PROMPT], "n": 2, "max_tokens": 2},
            timeout=60,
        )
        error = error_of(response, 400)
        message = str(error["message"])
        assert error["param"] == "n" and "6 sequences" in message and "queue of 4" in message
        assert seats_all_free(server)
        fits = httpx.post(
            f"{server.base_url}/v1/completions", json={"prompt": [PROMPT, PROMPT], "n": 2, "max_tokens": 2}, timeout=60
        )
        assert fits.status_code == 200 and len(fits.json()["choices"]) == 4


# ----- loading state -----
@contextlib.contextmanager
def server_with_loader(loader: Callable[[ServerConfig], LoadedModel]) -> Iterator[str]:
    """The real app under uvicorn with a custom loader; yields once the port answers (loaded or not)."""
    port = free_port()
    app = create_app(ServerConfig(port=port), loader=loader)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: _port_open(port), "the server to listen")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_health_is_503_while_loading_then_200() -> None:
    gate = threading.Event()

    def loader(config: ServerConfig) -> LoadedModel:
        assert gate.wait(60), "the test never released the loader"
        return tiny_loaded_model()

    try:
        with server_with_loader(loader) as base:
            health = httpx.get(f"{base}/health")
            assert health.status_code == 503 and health.json()["status"] == "loading"
            early = httpx.post(f"{base}/v1/completions", json={"prompt": PROMPT})
            assert error_of(early, 503)["type"] == "service_unavailable"
            assert "retry-after" in early.headers
            error_of(httpx.get(f"{base}/v1/models"), 503)
            gate.set()
            wait_until(lambda: httpx.get(f"{base}/health").status_code == 200, "the model to load")
            assert httpx.get(f"{base}/health").json() == {"status": "ok", "mode": "continuous"}
            done = httpx.post(f"{base}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            assert done.status_code == 200
    finally:
        gate.set()


def test_health_is_503_when_loading_failed() -> None:
    def loader(config: ServerConfig) -> LoadedModel:
        raise RuntimeError("no such model")

    with server_with_loader(loader) as base:
        wait_until(lambda: httpx.get(f"{base}/health").json()["status"] != "loading", "the load to fail")
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and health.json() == {"status": "failed"}
        error_of(httpx.post(f"{base}/v1/completions", json={"prompt": PROMPT}), 503)


# ----- disconnects -----
def test_non_streaming_client_disconnect_aborts_its_request(server: RunningServer) -> None:
    steps_before = metric_value(server.base_url, "batchserve:steps_total")

    async def request_then_leave() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            pending = asyncio.ensure_future(
                http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True})
            )
            # Bounded wait until the request holds a seat, then drop the connection by cancelling the call.
            deadline = time.monotonic() + 30
            while not server.runtime.scheduler.counts().running:
                assert not pending.done(), "the request finished before the test could disconnect"
                assert time.monotonic() < deadline, "the request never started running"
                await asyncio.sleep(0.01)
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pending

    asyncio.run(request_then_leave())
    wait_until(lambda: seats_all_free(server), "the abandoned request to be aborted")
    assert num_running(server) == 0
    # It was aborted, not run to the end: far fewer engine steps than its LONG tokens.
    assert metric_value(server.base_url, "batchserve:steps_total") - steps_before < LONG


# ----- metrics -----
METRIC_NAMES = (
    "vllm:time_to_first_token_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_total",
    "vllm:request_success_total",
    "batchserve:batch_size_count",
)


def test_metrics_use_vllm_names_with_a_mode_label(server: RunningServer, client: openai.OpenAI) -> None:
    mode = server_mode(server)
    before = metric_value(server.base_url, "vllm:generation_tokens_total", mode=mode)
    succeeded = metric_value(server.base_url, "vllm:request_success_total", mode=mode, finished_reason="length")
    client.completions.create(
        model=model_name(server), prompt=PROMPT, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    samples = metric_samples(server.base_url)
    for name in METRIC_NAMES:
        assert name in samples, name
        assert all(
            labels.get("mode") == mode and labels.get("model_name") == "tiny-llama" for labels, _ in samples[name]
        ), name
    assert metric_value(server.base_url, "vllm:generation_tokens_total", mode=mode) == before + 5
    assert metric_value(server.base_url, "vllm:num_requests_running", mode=mode) == 0
    assert metric_value(server.base_url, "vllm:kv_cache_usage_perc", mode=mode) == 0
    assert (
        metric_value(server.base_url, "vllm:request_success_total", mode=mode, finished_reason="length")
        == succeeded + 1
    )
    text = httpx.get(f"{server.base_url}/metrics").text
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_the_engine_serves_on_the_device_the_model_was_loaded_on_whatever_the_flag_says(device: str) -> None:
    from api.apps.loading import build_runtime

    # The tiny model is on the CPU. Where CUDA is present both flags name another device; where it is not,
    # "cuda" does: either way an engine that followed the flag instead of the model would fail here.
    runtime = build_runtime(ServerConfig(device=device), tiny_loaded_model())
    assert runtime.engine.device == torch.device("cpu")
    assert runtime.engine.cache.data.device == torch.device("cpu")
