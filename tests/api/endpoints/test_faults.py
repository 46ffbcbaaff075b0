"""Fault injection: a failing engine step, a failing handler, a client that stops reading, a request that runs
past the server's timeout. Each hurts only its own request; everyone else is served and the server keeps going.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from api.config import ServerConfig
from tests.server_harness import RunningServer, running_server

SEATS = 4
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


class FaultyForward:
    """Stands in for the runner's `forward`: chosen calls raise, and every call can be slowed down."""

    def __init__(self, runner: object) -> None:
        self.real = runner.forward  # type: ignore[attr-defined]
        self.lock = threading.Lock()
        self.calls = 0
        self.fail_at: set[int] = set()
        self.failed = 0
        self.delay_s = 0.0

    def fail_call(self, k: int) -> None:
        """Make the k-th call from now (1: the next one) raise."""
        with self.lock:
            self.fail_at.add(self.calls + k)

    def __call__(self, batch: object, cache: object) -> torch.Tensor:
        with self.lock:
            self.calls += 1
            fail = self.calls in self.fail_at
        if self.delay_s:
            time.sleep(self.delay_s)
        if fail:
            self.failed += 1
            raise RuntimeError("injected fault: the accelerator fell over")
        return self.real(batch, cache)  # type: ignore[no-any-return]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model gains nothing from intra-op threads on a shared 2-core box
    yield
    torch.set_num_threads(threads)


def _config(mode: str, **overrides: object) -> ServerConfig:
    values: dict[str, object] = {
        "port": 0,
        "mode": mode,
        "max_num_seqs": SEATS,
        "max_batch_size": SEATS,
        "batch_timeout_ms": 10.0,
        **overrides,
    }
    return ServerConfig(**values)  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=["dynamic", "continuous"])
def server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    with running_server(_config(request.param)) as srv:
        yield srv


@pytest.fixture
def faulty(server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> FaultyForward:
    runner = server.runtime.engine.runner
    wrapper = FaultyForward(runner)
    monkeypatch.setattr(runner, "forward", wrapper)
    return wrapper


def _body(path: str, max_tokens: int, stream: bool = False, **extra: object) -> dict[str, object]:
    body: dict[str, object] = {"max_tokens": max_tokens, "ignore_eos": True, "stream": stream, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if path == CHAT:
        return {"messages": [{"role": "user", "content": "hello there"}], **body}
    return {"prompt": "hello there", **body}


def _events(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def _stream(client: httpx.Client, path: str, max_tokens: int, **extra: object) -> list[str]:
    with client.stream("POST", path, json=_body(path, max_tokens, stream=True, **extra)) as response:
        assert response.status_code == 200
        return _events(response)


def _assert_complete_stream(events: list[str], tokens: int) -> None:
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c]
    assert chunks[-1]["usage"]["completion_tokens"] == tokens


def _assert_error_stream(events: list[str], kind: str, fragment: str) -> None:
    """An error ends a started stream as an error event, then [DONE]."""
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == kind and fragment in error["message"]
    assert all("error" not in json.loads(e) for e in events[:-2])


def _wait_idle(server: RunningServer, polls: int = 400) -> None:
    scheduler = server.runtime.scheduler
    for _ in range(polls):
        if not scheduler.has_pending_work():
            break
        time.sleep(0.025)
    engine = server.runtime.engine
    assert not scheduler.has_pending_work() and scheduler.num_queued == 0
    assert engine.cache_usage == 0 and engine.num_free_rows == engine.config.max_rows


def _assert_serving(server: RunningServer, client: httpx.Client) -> None:
    assert client.get("/health").status_code == 200
    for path in (COMPLETIONS, CHAT):
        response = client.post(path, json=_body(path, 6))
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 6
        _assert_complete_stream(_stream(client, path, 5), 5)
    _wait_idle(server)


# ----- a failing engine step -----
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_a_failed_step_answers_its_request_500_and_the_next_is_served(
    server: RunningServer, faulty: FaultyForward, path: str
) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        faulty.fail_call(1)
        response = client.post(path, json=_body(path, 8))
        assert response.status_code == 500
        assert "Traceback" not in response.text and "injected" not in response.text
        error = response.json()["error"]
        assert error["type"] == "internal_error" and "generation failed" in error["message"]
        assert faulty.failed == 1
        _assert_serving(server, client)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("failing_call", [1, 3])  # the prompt's step, or a decode step after tokens streamed
def test_a_failed_step_ends_its_stream_with_an_error_event_then_done(
    server: RunningServer, faulty: FaultyForward, path: str, failing_call: int
) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        faulty.fail_call(failing_call)
        events = _stream(client, path, 8)
        _assert_error_stream(events, "internal_error", "generation failed")
        assert "injected" not in "".join(events)
        _assert_serving(server, client)


def test_a_failed_step_fails_only_the_requests_in_it(server: RunningServer, faulty: FaultyForward) -> None:
    """Concurrent streams: those in the failing step end with an error, the others complete, and a second
    wave is served in full."""

    async def wave(fail: bool) -> list[list[str]]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:

            async def one(i: int) -> list[str]:
                path = (COMPLETIONS, CHAT)[i % 2]
                async with client.stream("POST", path, json=_body(path, 12, stream=True)) as response:
                    assert response.status_code == 200
                    return [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]

            if fail:
                faulty.fail_call(4)
            return await asyncio.gather(*(one(i) for i in range(2 * SEATS)))

    outcomes = asyncio.run(wave(fail=True))
    failed = [events for events in outcomes if any("error" in json.loads(e) for e in events[:-1])]
    assert 1 <= len(failed) <= SEATS  # one step holds at most SEATS sequences
    for events in outcomes:
        if events in failed:
            _assert_error_stream(events, "internal_error", "generation failed")
        else:
            _assert_complete_stream(events, 12)
    _wait_idle(server)
    for events in asyncio.run(wave(fail=False)):
        _assert_complete_stream(events, 12)
    _wait_idle(server)


# ----- a failing handler -----
def test_an_unexpected_handler_error_is_a_500_and_the_connection_keeps_serving(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = server.runtime.service
    real_start = service.start
    calls = {"n": 0}

    def flaky_start(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] % 2:
            raise RuntimeError("boom: internal detail")
        return real_start(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(service, "start", flaky_start)
    # One connection for everything: an error must not cost the same client its next request.
    with httpx.Client(base_url=server.base_url, timeout=60, limits=httpx.Limits(max_connections=1)) as client:
        for _ in range(4):
            response = client.post(COMPLETIONS, json=_body(COMPLETIONS, 3))
            assert response.status_code == 500
            assert "boom" not in response.text and "Traceback" not in response.text
            assert response.json()["error"]["type"] == "internal_error"
            assert response.headers.get("connection") != "close"
            response = client.post(COMPLETIONS, json=_body(COMPLETIONS, 3))
            assert response.status_code == 200, response.text
    _wait_idle(server)


# ----- a client that stops reading -----
def _connection_of(server: RunningServer, response: httpx.Response) -> Any:
    """The server side (uvicorn's protocol object) of the connection a response came on."""
    port = response.extensions["network_stream"].get_extra_info("client_addr")[1]
    connections = server.server.server_state.connections
    matches = [c for c in connections if (getattr(c, "client", None) or (None, None))[1] == port]
    assert len(matches) == 1
    return matches[0]


def test_a_client_that_stops_reading_does_not_stall_other_streams(server: RunningServer) -> None:
    # n=8 x 120 tokens with 5 logprobs is ~700 KB of events: far more than the server's transport buffer
    # (64 KiB), its socket send buffer (shrunk to 4 KiB below, a slow network path) and the client's receive
    # buffer together, so once the client stops reading, the server's writes to it really block.
    slow_body = _body(COMPLETIONS, 120, stream=True, n=8, logprobs=5)
    with (
        httpx.Client(base_url=server.base_url, timeout=60) as slow,
        slow.stream("POST", COMPLETIONS, json=slow_body) as response,
    ):
        assert response.status_code == 200
        connection = _connection_of(server, response)
        server_socket = connection.transport.get_extra_info("socket")
        server_socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        for _ in range(800):  # then stop reading, until the server's writer for this stream is paused
            if connection.flow.write_paused:
                break
            time.sleep(0.01)
        assert connection.flow.write_paused

        async def others() -> list[list[str]]:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:

                async def one(path: str) -> list[str]:
                    async with client.stream("POST", path, json=_body(path, 10, stream=True)) as other:
                        return [line[6:] async for line in other.aiter_lines() if line.startswith("data: ")]

                return await asyncio.gather(*(one(p) for p in [COMPLETIONS, CHAT] * SEATS))

        for events in asyncio.run(others()):
            _assert_complete_stream(events, 10)
        # They all finished while the slow stream was still stuck behind its unread bytes.
        assert not connection.cycle.response_complete

        server_socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        events = [line[6:] for line in lines if line.startswith("data: ")]
    _assert_complete_stream(events, 8 * 120)
    _wait_idle(server)


# ----- the per-request timeout -----
@pytest.mark.parametrize("mode", ["dynamic", "continuous"])
def test_the_request_timeout_aborts_a_long_request_and_frees_its_seat(mode: str) -> None:
    with (
        running_server(_config(mode, request_timeout_s=2.0)) as srv,
        httpx.Client(base_url=srv.base_url, timeout=60) as client,
    ):
        slow = FaultyForward(srv.runtime.engine.runner)
        # Every step sleeps, so 200 tokens cannot take less than 10 s: they cannot beat the 2 s timeout however
        # fast the machine is, and the timeout is long enough for the short request below on a busy one.
        slow.delay_s = 0.05
        srv.runtime.engine.runner.forward = slow

        response = client.post(COMPLETIONS, json=_body(COMPLETIONS, 200))
        assert response.status_code == 504
        error = response.json()["error"]
        assert error["type"] == "timeout_error" and "request timeout of 2.0 s" in error["message"]
        _wait_idle(srv)

        _assert_error_stream(_stream(client, CHAT, 200), "timeout_error", "request timeout")
        _wait_idle(srv)

        slow.delay_s = 0.0
        response = client.post(COMPLETIONS, json=_body(COMPLETIONS, 3))  # ~4 unslowed steps against 2 s
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
        assert client.get("/health").status_code == 200
        _wait_idle(srv)


# ----- the queue timeout -----
@pytest.mark.parametrize("mode", ["dynamic", "continuous"])
def test_a_request_that_waits_past_the_queue_timeout_gets_503_and_others_are_served(mode: str) -> None:
    config = _config(mode, max_num_seqs=1, max_batch_size=1, queue_timeout_s=0.5)
    with running_server(config) as srv, httpx.Client(base_url=srv.base_url, timeout=60) as client:
        slow = FaultyForward(srv.runtime.engine.runner)
        slow.delay_s = 0.05  # the one seat stays busy for 30 steps, 1.5 s or more: far past the 0.5 s limit
        srv.runtime.engine.runner.forward = slow
        with client.stream("POST", COMPLETIONS, json=_body(COMPLETIONS, 30, stream=True)) as busy:
            lines = busy.iter_lines()  # kept open: dropping the iterator would close the stream (a disconnect)
            first = next(line for line in lines if line.startswith("data: "))  # it holds the seat now
            assert "error" not in first
            late = client.post(COMPLETIONS, json=_body(COMPLETIONS, 2))
            assert late.status_code == 503, late.text
            assert late.headers["retry-after"] == "1"
            error = late.json()["error"]
            assert error["type"] == "service_unavailable" and "queue" in error["message"]
            _assert_complete_stream([line[6:] for line in lines if line.startswith("data: ")], 30)
        slow.delay_s = 0.0
        _assert_serving(srv, client)
