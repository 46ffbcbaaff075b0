"""Through a live server (the tiny model): a plug-in policy that raises in `plan` while a stream runs, and an engine
loop thread that dies.

Before: a plug-in whose `plan` raised while requests ran left their streams hanging (the loop asleep with no
wake-up), and one whose `next_deadline` raised killed the loop thread: /health answered 503 `ready` while requests
were accepted and never answered."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator

import httpx
import pytest

from scheduler.config import Mode
from tests.scheduler.faulty_policies import raising
from tests.server_harness import PROMPT, error_of, metric_value, mode_config, running_server

TOKENS = 16
STREAM_GUARD_S = 60.0  # only a guard against a hung stream (its pings keep the connection alive); never reached


def data_events(lines: Iterator[str]) -> list[str]:
    """The `data:` payloads of a stream, to its end; fails if it has not ended long after it should have."""
    deadline = time.monotonic() + STREAM_GUARD_S
    events: list[str] = []
    for line in lines:
        assert time.monotonic() < deadline, f"the stream hung after {events[-3:]}"
        if line.startswith("data: "):
            events.append(line[6:])
    return events


def stream_events(client: httpx.Client, max_tokens: int) -> contextlib.AbstractContextManager[httpx.Response]:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    return client.stream("POST", "/v1/completions", json={**body, "stream_options": {"include_usage": True}})


def streamed_text(client: httpx.Client) -> str:
    """A whole stream's text, checking that it ended normally."""
    with stream_events(client, TOKENS) as response:
        assert response.status_code == 200, response.read()
        events = data_events(response.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert not [chunk for chunk in chunks if "error" in chunk]
    assert chunks[-1]["usage"]["completion_tokens"] == TOKENS
    return "".join(choice["text"] for chunk in chunks for choice in chunk["choices"])


@pytest.mark.parametrize("mode", ["dynamic", "continuous"])
def test_a_plugin_policy_that_raises_mid_stream_lets_the_stream_complete_as_without_it(mode: str) -> None:
    with running_server(mode_config(mode)) as plain, httpx.Client(base_url=plain.base_url, timeout=30) as client:
        expected = streamed_text(client)
    faulty = mode_config(mode, policy=raising(Mode(mode), "plan", fail_from=3))  # the stream's third step
    with running_server(faulty) as server, httpx.Client(base_url=server.base_url, timeout=30) as client:
        assert streamed_text(client) == expected
        assert client.get("/health").status_code == 200
        assert metric_value(server.base_url, "batchserve:policy_fallbacks_total", mode=mode) == 1
        assert streamed_text(client) == expected  # the next one, under the built-in policy
        assert type(server.runtime.scheduler.policy).__module__ == f"scheduler.{mode}"


class Fatal(BaseException):
    """What no `except Exception` catches: the engine loop thread dies of it."""


def die(*args: object) -> None:
    raise Fatal("injected")


def test_a_dead_engine_loop_answers_every_request_503_at_once_and_health_says_why() -> None:
    reason = "the engine loop stopped (Fatal: injected)"
    with running_server(mode_config("continuous")) as server, httpx.Client(base_url=server.base_url) as client:
        with stream_events(client, 200) as running:
            lines = running.iter_lines()
            assert running.status_code == 200 and next(lines).startswith("data: ")  # it has started
            server.runtime.scheduler.step = die  # the loop's next step kills its thread
            events = data_events(lines)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "service_unavailable" and reason in error["message"]

        health = client.get("/health")
        assert health.status_code == 503 and health.json() == {"status": "failed", "reason": reason}
        for stream in (False, True):
            body = {"prompt": PROMPT, "max_tokens": 4, "stream": stream}
            error = error_of(client.post("/v1/completions", json=body), 503)
            assert error["type"] == "service_unavailable" and reason in str(error["message"])
        assert client.get("/metrics").status_code == 200  # still observable
