"""The limits at the context's edge, in both modes, on the tiny model with a 64-token context: a prompt at the
context length and one past it, max_tokens that would run past it, truncate_prompt_tokens at its edges, prompt
logprobs (20 alternatives, echoed) on the longest prompt that fits, and n at its cap with answers that exhaust the
KV cache (queued, never a hang). Each refusal is a 400 naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from api.config import ServerConfig
from tests.server_harness import RunningServer, mode_config, running_server

CONTEXT = 64
MAX_N = ServerConfig.max_n
URL = "/v1/completions"


@pytest.fixture(scope="module", params=["dynamic", "continuous"])
def edge_server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    # Two seats of the whole context: n at its cap must queue for the cache.
    config = mode_config(request.param, max_model_len=CONTEXT, kv_cache_tokens=2 * CONTEXT)
    with running_server(config) as server:
        yield server


def _post(server: RunningServer, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.base_url}{URL}", json={"model": "tiny-llama", **body}, timeout=120)


def _ids(count: int) -> list[int]:
    return [5 + i % 50 for i in range(count)]


def _refused(response: httpx.Response, params: tuple[str, ...]) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] in params, error
    return str(error["message"])


def test_a_prompt_one_short_of_the_context_gets_its_one_token(edge_server: RunningServer) -> None:
    response = _post(edge_server, prompt=_ids(CONTEXT - 1), max_tokens=1, ignore_eos=True)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage.pop("prompt_tokens_details")["cached_tokens"] < CONTEXT - 1
    assert usage == {"prompt_tokens": CONTEXT - 1, "completion_tokens": 1, "total_tokens": CONTEXT}


@pytest.mark.parametrize("length", [CONTEXT, CONTEXT + 1])
def test_a_prompt_at_or_past_the_context_length_is_refused(edge_server: RunningServer, length: int) -> None:
    message = _refused(_post(edge_server, prompt=_ids(length), max_tokens=1), ("prompt", "max_tokens"))
    assert str(CONTEXT) in message


def test_max_tokens_that_would_run_past_the_context_is_refused(edge_server: RunningServer) -> None:
    message = _refused(_post(edge_server, prompt=_ids(10), max_tokens=CONTEXT - 9), ("max_tokens", "prompt"))
    assert str(CONTEXT) in message
    fits = _post(edge_server, prompt=_ids(10), max_tokens=CONTEXT - 10, ignore_eos=True)
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == CONTEXT - 10


def test_chat_without_max_tokens_uses_the_rest_of_the_context(edge_server: RunningServer) -> None:
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    response = httpx.post(f"{edge_server.base_url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["total_tokens"] == CONTEXT


@pytest.mark.parametrize(
    ("keep", "expected_prompt"), [(1, 1), (CONTEXT - 1, CONTEXT - 1)], ids=["one", "context-minus-one"]
)
def test_truncate_prompt_tokens_keeps_the_last_tokens(edge_server: RunningServer, keep: int, expected_prompt: int):
    response = _post(edge_server, prompt=_ids(3 * CONTEXT), max_tokens=1, truncate_prompt_tokens=keep)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == expected_prompt


def test_truncate_prompt_tokens_of_zero_is_refused(edge_server: RunningServer) -> None:
    _refused(_post(edge_server, prompt=_ids(10), max_tokens=1, truncate_prompt_tokens=0), ("truncate_prompt_tokens",))


@pytest.mark.parametrize("keep", [CONTEXT, CONTEXT + 5, -1], ids=["context", "past-context", "minus-one"])
def test_truncating_to_the_context_or_past_it_leaves_no_room_and_says_so(edge_server: RunningServer, keep: int):
    """-1 keeps as many tokens as the context holds, which leaves none for the answer: refused, not a hang."""
    response = _post(edge_server, prompt=_ids(3 * CONTEXT), max_tokens=1, truncate_prompt_tokens=keep)
    _refused(response, ("prompt", "max_tokens", "truncate_prompt_tokens"))


def test_echoed_prompt_logprobs_with_20_alternatives_on_the_longest_prompt(edge_server: RunningServer) -> None:
    prompt = _ids(CONTEXT - 1)
    response = _post(edge_server, prompt=prompt, max_tokens=1, echo=True, logprobs=20, prompt_logprobs=20)
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    scored = choice["prompt_logprobs"]
    assert len(scored) == CONTEXT - 1 and scored[0] is None  # the first token has no context to be scored in
    assert all(
        20 <= len(position) <= 21 for position in scored[1:]
    )  # 20 alternatives, plus the token if not among them
    assert len(choice["logprobs"]["top_logprobs"]) == CONTEXT  # echoed prompt plus the one answer token


def test_n_at_its_cap_with_answers_that_exhaust_the_cache_queues_and_finishes(edge_server: RunningServer) -> None:
    response = _post(
        edge_server, prompt=_ids(8), n=MAX_N, max_tokens=CONTEXT - 8, ignore_eos=True, seed=1, temperature=1.0
    )
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == MAX_N
    assert response.json()["usage"]["completion_tokens"] == MAX_N * (CONTEXT - 8)
    health = httpx.get(f"{edge_server.base_url}/health", timeout=30)
    assert health.status_code == 200
