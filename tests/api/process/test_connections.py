"""Connection hygiene, against the real server over raw loopback sockets: slow heads and bodies get 408, idle
connections close, connections past the cap get 503, an HTTP/2 preface gets one 505, a malformed chunked body a
400, and a client that leaves mid-upload is an INFO line, not a traceback. Accept errors are logged once a second."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import selectors
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from api.process.asyncio_loop import AcceptErrorHandler
from api.process.connections import HTTP2_PREFACE
from api.process.log_throttle import LogThrottle
from tests.server_harness import RunningServer, free_port, mode_config, running_server, wait_until

WAIT_S = 20.0  # only against hangs: every wait below ends as soon as its condition holds
BODY = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def strict() -> Iterator[RunningServer]:
    """Short connection timeouts, so the tests see them fire."""
    config = mode_config(
        "continuous", keep_alive_timeout_s=0.5, header_timeout_s=0.5, request_read_timeout_s=0.5, max_num_seqs=2
    )
    with running_server(config) as srv:
        yield srv


@pytest.fixture(scope="module")
def lenient() -> Iterator[RunningServer]:
    """Long timeouts (so a loaded machine cannot trip them) and a cap of 20 connections."""
    config = mode_config(
        "continuous", keep_alive_timeout_s=60, header_timeout_s=60, request_read_timeout_s=60, max_connections=20
    )
    with running_server(config) as srv:
        yield srv


def _connect(server: RunningServer) -> socket.socket:
    host, port = server.base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=WAIT_S)
    return sock


def _read_to_eof(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset after the answer counts as closed)."""
    data = bytearray()
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return bytes(data)
        if not chunk:
            return bytes(data)
        data.extend(chunk)


def _parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


def _error(raw: bytes, status: int) -> dict[str, object]:
    """The one response in `raw`: `status`, an OpenAI-shaped JSON error, and the connection closed after it."""
    code, headers, body = _parse(raw)
    assert code == status, raw
    assert headers["content-type"] == "application/json" and headers["connection"] == "close"
    assert len(body) == int(headers["content-length"]), raw  # nothing after it
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error  # type: ignore[no-any-return]


def _trickle_until_answered(sock: socket.socket, data: bytes, interval_s: float = 0.05) -> int:
    """Send `data` a byte at a time until the server answers or closes; returns how many bytes went out."""
    for sent, byte in enumerate(data):
        if _readable(sock, interval_s):
            return sent
        try:
            sock.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            return sent
    return len(data)


def _readable(sock: socket.socket, timeout_s: float) -> bool:
    with selectors.DefaultSelector() as selector:
        selector.register(sock, selectors.EVENT_READ)
        return bool(selector.select(timeout_s))


def _completion_ok(server: RunningServer) -> None:
    response = httpx.post(f"{server.base_url}/v1/completions", content=BODY, timeout=WAIT_S, headers=_JSON)
    assert response.status_code == 200, response.text


_JSON = {"content-type": "application/json"}


def _quiet(logs: pytest.LogCaptureFixture) -> None:
    """Nothing above INFO, and no traceback."""
    loud = [r for r in logs.records if r.levelno > logging.INFO or r.exc_info]
    assert not loud, [(r.name, r.levelname, r.getMessage()) for r in loud]
    assert "Traceback" not in logs.text


# --- idle and slow connections ------------------------------------------------------------------------------


def test_idle_connections_close_after_the_keep_alive_timeout(strict: RunningServer) -> None:
    """50 connections that never send anything, and one idle after a request: all closed by the server."""
    fresh = [_connect(strict) for _ in range(50)]
    used = _connect(strict)
    used.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
    sockets = [*fresh, used]
    try:
        with selectors.DefaultSelector() as selector:
            for sock in sockets:
                selector.register(sock, selectors.EVENT_READ)
            open_ = set(sockets)
            deadline = time.monotonic() + WAIT_S
            while open_ and time.monotonic() < deadline:
                for key, _ in selector.select(0.5):
                    sock = key.fileobj  # type: ignore[assignment]
                    if sock is used and not _read_to_eof(sock).startswith(b"HTTP/1.1 200"):
                        raise AssertionError("the request before idling was not answered")
                    if sock is not used:
                        assert _read_to_eof(sock) == b""  # closed without a word: nothing was asked
                    selector.unregister(sock)
                    open_.discard(sock)
        assert not open_, f"{len(open_)} idle connections were never closed"
    finally:
        for sock in sockets:
            sock.close()


def test_a_head_trickled_byte_by_byte_gets_408(strict: RunningServer, logs: pytest.LogCaptureFixture) -> None:
    with _connect(strict) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n")
        sent = _trickle_until_answered(sock, b"X-Slow: " + b"a" * 300)
        assert sent >= 1  # bytes kept coming, faster than the timeout: they did not extend the deadline
        error = _error(_read_to_eof(sock), 408)
    assert error["type"] == "timeout_error" and error["code"] == "request_timeout"
    assert "request head" in str(error["message"])
    _completion_ok(strict)
    _quiet(logs)


def test_a_body_trickled_byte_by_byte_gets_408(strict: RunningServer, logs: pytest.LogCaptureFixture) -> None:
    body = b' {"prompt": "hello", "max_tokens": 2}' + b" " * 300
    with _connect(strict) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)
        )
        sent = _trickle_until_answered(sock, body)
        assert 1 <= sent < len(body)
        error = _error(_read_to_eof(sock), 408)
    assert error["type"] == "timeout_error" and "request body" in str(error["message"])
    wait_until(lambda: "before the whole body arrived" in logs.text, "the handler to end", timeout_s=WAIT_S)
    _completion_ok(strict)
    _quiet(logs)


# --- the connection cap -------------------------------------------------------------------------------------


def test_connections_past_the_cap_get_503_and_a_freed_slot_serves_again(
    lenient: RunningServer, logs: pytest.LogCaptureFixture
) -> None:
    connections = lenient.server.server_state.connections
    wait_until(lambda: not connections, "earlier connections to close", timeout_s=WAIT_S)
    held = [_connect(lenient) for _ in range(20)]
    try:
        wait_until(lambda: len(connections) == 20, "20 open connections", timeout_s=WAIT_S)
        for i in range(30):  # past the cap: half send a request, half nothing
            with _connect(lenient) as extra:
                if i % 2:
                    extra.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
                raw = _read_to_eof(extra)
            error = _error(raw, 503)
            assert error["type"] == "service_unavailable" and error["code"] == "too_many_connections"
            assert _parse(raw)[1]["retry-after"] == "1"
        assert len(connections) == 20  # the refused ones were never counted
        held[0].sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")  # an admitted connection still works
        assert held[0].recv(65536).startswith(b"HTTP/1.1 200")
        for sock in held[:5]:
            sock.close()
        wait_until(lambda: len(connections) <= 15, "the closed connections to be released", timeout_s=WAIT_S)
        _completion_ok(lenient)
    finally:
        for sock in held:
            sock.close()
    refusals = [r for r in logs.records if "refusing connections" in r.getMessage()]
    assert 1 <= len(refusals) < 30  # throttled: not one line per refused connection


# --- accept errors ------------------------------------------------------------------------------------------


def test_the_throttle_admits_one_event_a_second_and_counts_the_rest() -> None:
    now = [100.0]
    throttle = LogThrottle(1.0, clock=lambda: now[0])
    assert throttle.admit() == 0
    assert [throttle.admit() for _ in range(500)] == [None] * 500
    now[0] += 0.99
    assert throttle.admit() is None
    now[0] += 0.02
    assert throttle.admit() == 501
    now[0] += 5
    assert throttle.admit() == 0


def test_the_accept_error_handler_throttles_only_accept_errors(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    handler = AcceptErrorHandler(LogThrottle(1.0, clock=lambda: now[0]))
    passed_on: list[dict[str, object]] = []

    class Loop:
        def default_exception_handler(self, context: dict[str, object]) -> None:
            passed_on.append(context)

    emfile = {"message": "socket.accept() out of system resource", "exception": OSError(errno.EMFILE, "Too many")}
    caplog.set_level(logging.INFO, logger="batchserve.server")
    for _ in range(1000):
        handler(Loop(), {**emfile, "socket": object()})  # type: ignore[arg-type]
    now[0] = 1.5
    handler(Loop(), {**emfile, "socket": object()})  # type: ignore[arg-type]
    other = {"message": "something else", "exception": OSError(errno.EMFILE, "not from accept")}
    handler(Loop(), other)  # type: ignore[arg-type]
    lines = [r for r in caplog.records if r.name == "batchserve.server"]
    assert len(lines) == 2 and not any(r.exc_info for r in lines)
    assert "999 more accept errors" in lines[1].getMessage()
    assert passed_on == [other]


_EMFILE_SERVER = """
import logging, resource, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (48, hard))
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
import uvicorn
from api.config import ServerConfig
from api.process.server import uvicorn_config

async def app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})

config = ServerConfig(port=int(sys.argv[1]), max_connections=1000, keep_alive_timeout_s=60, header_timeout_s=60)
print("serving", flush=True)
uvicorn.Server(uvicorn_config(app, config, log_level="warning", lifespan="off")).run()
"""


@pytest.mark.slow  # a server process, and a storm that lasts 2.5 s by design
def test_running_out_of_descriptors_logs_once_a_second() -> None:
    """A server limited to 48 descriptors, 80 idle connections: accept fails with EMFILE for the rest, over and
    over; the log gets at most one line a second (asyncio's own handler wrote thousands, with tracebacks)."""
    port = free_port()
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _EMFILE_SERVER, str(port)],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    sockets: list[socket.socket] = []
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "serving\n"
        wait_until(lambda: _can_connect(port), "the server to listen", timeout_s=WAIT_S)
        start = time.monotonic()
        sockets = [socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) for _ in range(80)]
        time.sleep(2.5)  # the storm lasts while the connections wait; not an assertion on speed
        elapsed = time.monotonic() - start
    finally:
        for sock in sockets:
            sock.close()
        proc.terminate()
        try:
            _, stderr = proc.communicate(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
    reports = [line for line in stderr.splitlines() if "cannot accept connections" in line]
    assert "out of system resource" not in stderr and "Traceback" not in stderr, stderr[:2000]
    assert 1 <= len(reports) <= elapsed + 1, reports
    assert "Too many open files" in reports[0]


def _can_connect(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


# --- quiet client faults ------------------------------------------------------------------------------------


def test_a_disconnect_mid_upload_is_an_info_line(lenient: RunningServer, logs: pytest.LogCaptureFixture) -> None:
    with _connect(lenient) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"prompt": "'
        )
        wait_until(lambda: bool(lenient.server.server_state.tasks), "the handler to start", timeout_s=WAIT_S)
    wait_until(
        lambda: "before the whole body arrived" in logs.text or "error" in logs.text.lower(),
        "the handler",
        timeout_s=WAIT_S,
    )
    _quiet(logs)
    _completion_ok(lenient)


def test_a_malformed_chunk_size_gets_a_400(lenient: RunningServer, logs: pytest.LogCaptureFixture) -> None:
    with _connect(lenient) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b'Transfer-Encoding: chunked\r\n\r\n5\r\n{"pro\r\nzz\r\nmpt\r\n0\r\n\r\n'
        )
        error = _error(_read_to_eof(sock), 400)
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_http"
    wait_until(lambda: "before the whole body arrived" in logs.text, "the handler to end", timeout_s=WAIT_S)
    _quiet(logs)
    _completion_ok(lenient)


@pytest.mark.parametrize("split", [len(HTTP2_PREFACE), 9], ids=["whole", "split"])
def test_an_http2_preface_gets_one_505(lenient: RunningServer, logs: pytest.LogCaptureFixture, split: int) -> None:
    """Whole, or in two segments (the first a prefix h11 would read as the start of a request)."""
    settings_frame = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
    data = HTTP2_PREFACE + settings_frame
    with _connect(lenient) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(data[:split])
        time.sleep(0.05)  # lets the first segment arrive on its own; the test holds either way
        sock.sendall(data[split:])
        error = _error(_read_to_eof(sock), 505)
    assert error["code"] == "http_version_not_supported" and "HTTP/2" in str(error["message"])
    _quiet(logs)
