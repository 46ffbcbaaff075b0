"""Prefix caching as clients see it, against real servers in both modes: `usage.prompt_tokens_details.cached_tokens`
and `timings.cached_tokens`, `cache_salt`, the metrics, and answers that do not change when the prompt is cached."""

from __future__ import annotations

import random
from collections.abc import Iterator

import httpx
import pytest

from tests.server_harness import RunningServer, metric_value, mode_config, openai_client, running_server, tiny_tokenizer

BLOCK = 16  # the engine's default block size


def fresh_prompt(seed: int, length: int = 40) -> list[int]:
    """Token ids no other test sends, so what the shared servers' caches hold cannot leak in."""
    vocab = len(tiny_tokenizer())
    generator = random.Random(f"prefix-caching-{seed}")
    return [generator.randrange(10, vocab) for _ in range(length)]


def complete(server: RunningServer, prompt: list[int], **body: object) -> dict:
    payload = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **body}
    response = httpx.post(f"{server.base_url}/v1/completions", json=payload, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def cached_tokens(result: dict) -> int:
    cached = result["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert result["timings"]["cached_tokens"] == cached
    return cached


def test_a_repeated_prompt_reads_its_full_blocks_and_answers_the_same(server: RunningServer) -> None:
    prompt = fresh_prompt(1)
    first, second = complete(server, prompt), complete(server, prompt)
    assert (cached_tokens(first), cached_tokens(second)) == (0, (len(prompt) - 1) // BLOCK * BLOCK)
    assert first["choices"][0]["text"] == second["choices"][0]["text"]


def test_a_chat_that_resends_its_history_is_served_from_the_cache(server: RunningServer) -> None:
    client = openai_client(server)
    words = " ".join(tiny_tokenizer().decode([t]) for t in fresh_prompt(2, 30))
    messages = [{"role": "system", "content": f"Answer briefly. {words}"}, {"role": "user", "content": "hello"}]
    first = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=6, temperature=0)  # type: ignore[arg-type]
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "and then?"},
    ]
    chunks = list(
        client.chat.completions.create(
            model="tiny-llama",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks[-1].usage
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert usage is not None and usage.prompt_tokens_details is not None
    # The second turn starts with the whole first prompt: at least its full blocks are read back.
    assert usage.prompt_tokens_details.cached_tokens >= (first.usage.prompt_tokens - 1) // BLOCK * BLOCK > 0


def test_only_requests_with_the_same_salt_share_blocks(server: RunningServer) -> None:
    prompt = fresh_prompt(3)
    hits = [cached_tokens(complete(server, prompt, cache_salt=salt)) for salt in ("alice", "bob", None, "alice")]
    assert hits == [0, 0, 0, 32]


@pytest.mark.parametrize("salt", ["", 7, ["a"]])
def test_a_bad_salt_is_a_400_naming_the_field(server: RunningServer, salt: object) -> None:
    response = httpx.post(
        f"{server.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 1, "cache_salt": salt}, timeout=30
    )
    assert response.status_code == 400
    assert "cache_salt" in response.json()["error"]["message"]


def test_prompt_logprobs_requests_read_nothing_and_the_metrics_count_hits(server: RunningServer) -> None:
    prompt = fresh_prompt(4)
    complete(server, prompt)
    hits_before = metric_value(server.base_url, "vllm:prefix_cache_hits_total")
    queries_before = metric_value(server.base_url, "vllm:prefix_cache_queries_total")
    assert cached_tokens(complete(server, prompt, prompt_logprobs=1)) == 0
    assert cached_tokens(complete(server, prompt)) == 32
    assert metric_value(server.base_url, "vllm:prefix_cache_hits_total") - hits_before == 32
    assert metric_value(server.base_url, "vllm:prefix_cache_queries_total") - queries_before == 2 * len(prompt)
    assert 0 <= metric_value(server.base_url, "batchserve:kv_cache_cached_free_perc") <= 1


@pytest.fixture(scope="module")
def uncached_server() -> Iterator[RunningServer]:
    with running_server(mode_config("continuous", enable_prefix_caching=False)) as server:
        yield server


def test_with_caching_off_nothing_is_read(uncached_server: RunningServer) -> None:
    prompt = fresh_prompt(5)
    prompt_tokens_before = metric_value(uncached_server.base_url, "vllm:prompt_tokens_total")
    results = [complete(uncached_server, prompt) for _ in range(2)]
    assert [cached_tokens(result) for result in results] == [0, 0]
    assert results[0]["choices"][0]["text"] == results[1]["choices"][0]["text"]
    # Nothing was looked up, as in vLLM with caching off: the prompts count, the prefix-cache queries do not.
    assert metric_value(uncached_server.base_url, "vllm:prompt_tokens_total") - prompt_tokens_before == 2 * len(prompt)
    assert metric_value(uncached_server.base_url, "vllm:prefix_cache_queries_total") == 0
