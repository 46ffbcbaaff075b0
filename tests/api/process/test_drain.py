"""Graceful shutdown against a real `batchserve serve` process that receives a real SIGTERM, in both modes.

The server runs a tiny random model through `tests.paced_server`, which makes every engine step last at least
STEP_S: a request of N tokens therefore runs for at least N x STEP_S, so requests of known lengths are still running
when the signal comes, however fast the machine is. Clients are plain HTTP, each on its own thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.paced_server import LOAD_ENV, STEP_ENV
from tests.server_harness import PROMPT, free_port, wait_until

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
MODES = ["dynamic", "continuous"]
STEP_S = 0.05
LONG = 80  # tokens: at least 4 s of steps, far more than the few steps each check below takes
ENDLESS = 200  # tokens: at least 10 s, far beyond the short grace period of the tests that use it
CUT_OFF = "ASGI callable returned without completing response"


@dataclass(frozen=True)
class ServerProcess:
    process: subprocess.Popen[bytes]
    base_url: str
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def healthy(self) -> bool:
        assert self.process.poll() is None, f"the server exited early:\n{self.output()}"
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200
        return False


def start_paced(
    checkpoint: Path, log: Path, command: list[str], flags: list[str], load_s: float | None = None
) -> ServerProcess:
    """`batchserve <command>` (serve or compare) on the paced tiny model, not waited for; `load_s`: its loader
    spends that long in torch before building the runner."""
    port = free_port()
    argv = [sys.executable, "-m", "tests.paced_server", command, "--model", str(checkpoint), "--port", str(port)]
    with log.open("wb") as sink:  # a file, not a pipe: a full pipe would stall the server
        process = subprocess.Popen(
            [*argv, *flags, "--no-cpu-kernels"],
            stdout=sink,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={
                **os.environ,
                STEP_ENV: str(STEP_S),
                "PYTHONUNBUFFERED": "1",
                **({LOAD_ENV: str(load_s)} if load_s is not None else {}),
            },
        )
    return ServerProcess(process, f"http://127.0.0.1:{port}", log)


@contextlib.contextmanager
def paced_server(checkpoint: Path, log: Path, mode: str, seats: int, grace_s: float) -> Iterator[ServerProcess]:
    # dynamic: a bus leaves once `seats` requests wait (the timeout is out of reach), so its members are known
    seat_flags = (
        ["--max-batch-size", str(seats), "--batch-timeout-ms", "60000"]
        if mode == "dynamic"
        else ["--max-num-seqs", str(seats)]
    )
    flags = ["--mode", mode, *seat_flags, "--shutdown-grace-s", str(grace_s)]
    server = start_paced(checkpoint, log, "serve", flags)
    process = server.process
    try:
        wait_until(server.healthy, "the server process to become healthy", timeout_s=180)
        yield server
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(30)


def completion(max_tokens: int, stream: bool) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream, "logprobs": 0}


class StreamClient(threading.Thread):
    """One streaming completion, read on its own thread: `data` fills as the server sends."""

    def __init__(self, base_url: str, max_tokens: int, prefix: str = "") -> None:
        super().__init__(daemon=True)
        self.url = f"{base_url}{prefix}/v1/completions"
        self.body = completion(max_tokens, stream=True)
        self.data: list[str] = []  # the payload of every `data:` line, in order
        self.failure: BaseException | None = None
        self.done = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.data.append(line.removeprefix("data: "))
        except BaseException as exc:  # reported by finish(): a cut connection is what these tests look for
            self.failure = exc
        finally:
            self.done.set()

    def chunks(self) -> list[dict[str, Any]]:
        return [json.loads(d) for d in list(self.data) if d != "[DONE]"]

    @property
    def tokens(self) -> int:
        return sum(
            len(c["choices"][0]["logprobs"]["tokens"])
            for c in self.chunks()
            if c.get("choices") and c["choices"][0]["logprobs"]
        )

    def finish(self) -> list[dict[str, Any]]:
        """Wait for the end; the chunks, once it is clear the stream ended properly with [DONE] (was not cut)."""
        assert self.done.wait(120), "the stream did not end"
        assert self.failure is None, f"the stream failed: {self.failure!r}"
        assert self.data and self.data[-1] == "[DONE]", f"the stream ended without [DONE]: {self.data[-3:]}"
        return self.chunks()


class PostClient(threading.Thread):
    """One non-streaming completion on its own thread."""

    def __init__(self, base_url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url = f"{base_url}/v1/completions"
        self.body = completion(max_tokens, stream=False)
        self.response: httpx.Response | None = None
        self.failure: BaseException | None = None
        self.done = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            self.response = httpx.post(self.url, json=self.body, timeout=120)
        except BaseException as exc:
            self.failure = exc
        finally:
            self.done.set()

    def result(self) -> httpx.Response:
        assert self.done.wait(120), "the request got no answer"
        assert self.response is not None, f"the request failed: {self.failure!r}"
        return self.response


def gauge(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"vllm:{name}{{"))


def assert_shutdown_error(body: dict[str, Any]) -> None:
    """An OpenAI-shaped error that names the shutdown."""
    assert set(body) == {"error"}, body
    assert body["error"]["type"] == "service_unavailable"
    assert body["error"]["code"] == "service_unavailable"
    assert "shut" in body["error"]["message"]


def assert_503(response: httpx.Response) -> None:
    assert response.status_code == 503
    assert int(response.headers["retry-after"]) > 0
    assert_shutdown_error(response.json())


def assert_clean_exit(server: ServerProcess) -> None:
    assert server.process.wait(60) == 0, server.output()
    output = server.output()
    assert "batchserve ready on" in output
    assert "batchserve stopped" in output
    assert_no_traceback(output)


def assert_no_traceback(output: str) -> None:
    for noise in ("Traceback", "CancelledError", "KeyboardInterrupt", CUT_OFF):
        assert noise not in output, output


@pytest.mark.parametrize("mode", MODES)
def test_sigterm_keeps_listening_with_503s_fails_queued_requests_at_once_and_lets_running_ones_finish(
    mode: str, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    # In dynamic mode the bus also carries a short answer: complete after 3 steps, then held for its batch.
    held = mode == "dynamic"
    with paced_server(tiny_checkpoint, tmp_path / "server.log", mode, seats=3 if held else 2, grace_s=60) as server:
        short = StreamClient(server.base_url, 3) if held else None
        running = [StreamClient(server.base_url, LONG) for _ in range(2)]
        wait_until(lambda: all(s.tokens > 0 for s in running), "both long requests to stream tokens")
        if short is not None:
            wait_until(lambda: short.tokens == 3, "the short answer's tokens")
            assert not short.done.is_set()  # held for its batch
        queued_stream, queued_plain = StreamClient(server.base_url, 8), PostClient(server.base_url, 8)
        wait_until(lambda: gauge(server.base_url, "num_requests_waiting") == 2, "two requests to wait for a seat")

        server.process.send_signal(signal.SIGTERM)
        # Never started: a 503 now (an error event then [DONE] on a stream), not after the running ones.
        queued_chunks = queued_stream.finish()
        assert queued_stream.tokens == 0
        assert_shutdown_error(queued_chunks[-1])
        assert_503(queued_plain.result())
        if short is not None:  # released when the drain began: its batch has no purpose any more
            short_chunks = short.finish()
            assert short_chunks[-1]["choices"][0]["finish_reason"] == "length"
            assert short_chunks[-1]["usage"]["completion_tokens"] == 3
            # Its batch would have held it until both long ones had all their tokens.
            assert max(s.tokens for s in running) < LONG // 2
        # Still listening while draining: /health and new requests get 503 with Retry-After, not a refusal.
        health = httpx.get(f"{server.base_url}/health", timeout=10)
        assert health.status_code == 503 and int(health.headers["retry-after"]) > 0
        assert health.json() == {"status": "draining"}
        assert_503(httpx.post(f"{server.base_url}/v1/completions", json=completion(4, stream=False), timeout=10))
        assert not any(s.done.is_set() for s in running)  # all of the above happened during the drain

        for stream in running:  # the running ones finish: every token, finish_reason length, [DONE]
            chunks = stream.finish()
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            assert chunks[-1]["usage"]["completion_tokens"] == LONG
            assert stream.tokens == LONG
        assert_clean_exit(server)


@pytest.mark.parametrize("mode", MODES)
def test_at_the_grace_limit_streams_end_with_an_error_event_then_done_and_plain_requests_get_503(
    mode: str, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    with paced_server(tiny_checkpoint, tmp_path / "server.log", mode, seats=2, grace_s=2) as server:
        endless_stream, endless_plain = StreamClient(server.base_url, ENDLESS), PostClient(server.base_url, ENDLESS)
        wait_until(lambda: endless_stream.tokens > 0, "the stream's first tokens")
        wait_until(lambda: gauge(server.base_url, "num_requests_running") == 2, "both requests to run")

        server.process.send_signal(signal.SIGTERM)
        chunks = endless_stream.finish()
        assert_shutdown_error(chunks[-1])  # the last event, then [DONE]
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
        assert 0 < endless_stream.tokens < ENDLESS
        assert_503(endless_plain.result())
        assert_clean_exit(server)


# ----- `batchserve compare`: both modes in one process -----


def test_compare_at_the_grace_limit_ends_every_modes_streams_then_exits_cleanly(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    server = start_paced(tiny_checkpoint, tmp_path / "compare.log", "compare", ["--shutdown-grace-s", "2"])
    try:
        wait_until(server.healthy, "the compare process to become healthy", timeout_s=180)
        streams = {mode: StreamClient(server.base_url, ENDLESS, prefix=f"/{mode}") for mode in MODES}
        wait_until(lambda: all(s.tokens > 0 for s in streams.values()), "both modes' streams to send tokens")
        server.process.send_signal(signal.SIGTERM)
        for stream in streams.values():  # an error event naming the shutdown, then [DONE]
            chunks = stream.finish()
            assert_shutdown_error(chunks[-1])
            assert 0 < stream.tokens < ENDLESS
        assert_clean_exit(server)
    finally:
        if server.process.poll() is None:
            server.process.kill()
        server.process.wait(30)


@pytest.mark.parametrize("first, second", [(signal.SIGTERM, signal.SIGINT), (signal.SIGINT, signal.SIGINT)])
def test_a_second_signal_ends_the_running_requests_now_then_exits_cleanly(
    first: signal.Signals, second: signal.Signals, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    # Ctrl-C twice, or SIGTERM then Ctrl-C: once exited at once, skipping the app's shutdown, with tracebacks.
    with paced_server(tiny_checkpoint, tmp_path / "server.log", "continuous", seats=2, grace_s=600) as server:
        endless = StreamClient(server.base_url, ENDLESS)
        wait_until(lambda: endless.tokens > 0, "the stream's first tokens")
        server.process.send_signal(first)
        wait_until(lambda: "stopping: letting 1 running request(s) finish" in server.output(), "the drain to begin")
        assert not endless.done.is_set()
        server.process.send_signal(second)
        chunks = endless.finish()
        assert_shutdown_error(chunks[-1])  # ended, not left to run out the 600 s grace period
        assert 0 < endless.tokens < ENDLESS
        assert_clean_exit(server)
        assert "stopping now: ending the requests still running (1)" in server.output()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_starting_exits_zero_without_a_traceback(
    sig: signal.Signals, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    server = start_paced(tiny_checkpoint, tmp_path / "server.log", "serve", [])
    try:  # sent while torch and transformers import (a Ctrl-C there was a KeyboardInterrupt traceback), or later
        wait_until(lambda: "loading torch and transformers" in server.output(), "the process to start")
        server.process.send_signal(sig)
        assert server.process.wait(120) == 0, server.output()
        assert_no_traceback(server.output())
    finally:
        if server.process.poll() is None:
            server.process.kill()
        server.process.wait(30)


def test_sigterm_while_compare_loads_exits_cleanly(tiny_checkpoint: Path, tmp_path: Path) -> None:
    server = start_paced(tiny_checkpoint, tmp_path / "compare.log", "compare", ["--shutdown-grace-s", "2"])
    try:
        wait_until(lambda: "Uvicorn running" in server.output() or "CPU:" in server.output(), "the process to start")
        server.process.send_signal(signal.SIGTERM)  # the model is still loading (or just loaded)
        assert server.process.wait(120) == 0, server.output()
        assert_no_traceback(server.output())
    finally:
        if server.process.poll() is None:
            server.process.kill()
        server.process.wait(30)


def test_sigterm_while_the_loader_is_inside_torch_exits_cleanly(tiny_checkpoint: Path, tmp_path: Path) -> None:
    # The loader thread still in torch when the interpreter finalised aborted the process in C++ ("terminate
    # called without an active exception", status 134): a Ctrl-C during a first start's format measurement.
    server = start_paced(tiny_checkpoint, tmp_path / "server.log", "serve", [], load_s=120)
    try:
        wait_until(lambda: "loading: busy in torch" in server.output(), "the loader to be inside torch")
        wait_until(lambda: _health_status(server) == 503, "the server to listen while it loads")
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(60) == 0, server.output()
        output = server.output()
        assert "stopped while loading the model" in output
        assert "batchserve stopped" in output and "terminate called" not in output
        assert_no_traceback(output)
    finally:
        if server.process.poll() is None:
            server.process.kill()
        server.process.wait(30)


def _health_status(server: ServerProcess) -> int | None:
    try:
        return httpx.get(f"{server.base_url}/health", timeout=5).status_code
    except httpx.TransportError:
        return None
