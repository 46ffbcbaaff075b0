"""Run the real batchserve app under uvicorn on a free loopback port, with a tiny or the real model, and the helpers
the API tests share: metrics, waits, error shapes, and `compare`'s servers."""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import uvicorn
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families
from transformers import PreTrainedTokenizerFast

from api.apps.compare import create_compare_app
from api.apps.serve import create_app
from api.config import ServerConfig
from api.endpoints.state import ServerState
from api.process.server import uvicorn_config
from api.structured.grammars import CompileWorkers
from benchmarks.loadgen.server_proc import free_port
from engine.weights.loader import LoadedModel, load_model
from scheduler.lineup import parse_lineup
from tests.conftest import build_tiny_causal_lm, train_byte_level_tokenizer

TINY_EOS = "<|eos|>"
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, this is a tiny tokenizer for fast tests",
    "numbers 0123456789 and punctuation: ;,.!?()[]{}",
    "user assistant system role content",
]


@functools.cache
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny models' tokenizer, with a chat template so the chat endpoint works too."""
    fast = train_byte_level_tokenizer(_CORPUS, 320, TINY_EOS)
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def tiny_loaded_model(arch: str = "llama", seed: int = 0) -> LoadedModel:
    """A random tiny model whose vocabulary matches `tiny_tokenizer()`; EOS is its special token."""
    tokenizer = tiny_tokenizer()
    model = build_tiny_causal_lm(arch, seed=seed, vocab_size=len(tokenizer))
    return LoadedModel(model, tokenizer, f"tiny-{arch}", (int(tokenizer.eos_token_id),), 256)


@functools.cache
def shared_compile_workers() -> CompileWorkers:
    """Grammar compile workers for every server of this test process: a worker costs ~2 s of a core to start
    (it imports xgrammar and torch), and servers with the same tokenizer and limits share one."""
    workers = CompileWorkers()
    atexit.register(workers.close)
    return workers


@functools.cache
def real_loaded_model() -> LoadedModel:
    """SmolLM2-135M-Instruct (converted once, then from the cache); shared by the slow tests of a session."""
    return load_model()


@dataclass(frozen=True)
class RunningServer:
    base_url: str
    app: object
    server: uvicorn.Server

    @property
    def runtime(self):  # type: ignore[no-untyped-def]
        return ServerState.of(self.app).runtime  # type: ignore[arg-type]


@contextlib.contextmanager
def running_server(
    config: ServerConfig, loaded: LoadedModel | None = None, freeze_heap: bool = False
) -> Iterator[RunningServer]:
    """Start the app on `config.port` (0: a free port) in a thread; wait until /health is 200."""
    port = config.port or free_port()
    config = ServerConfig(**{**config.__dict__, "port": port})
    model = loaded if loaded is not None else tiny_loaded_model()
    app = create_app(
        config, loader=lambda _config: model, freeze_heap=freeze_heap, compile_workers=shared_compile_workers()
    )
    with serving_app(app, config) as (base_url, server):
        yield RunningServer(base_url, app, server)


@contextlib.contextmanager
def serving_app(app: object, config: ServerConfig) -> Iterator[tuple[str, uvicorn.Server]]:
    """Serve `app` (serve's or compare's) under uvicorn on `config.port` in a thread; yields its base URL and the
    server once /health is 200, and stops it after."""
    server = uvicorn.Server(uvicorn_config(app, config, log_level="warning"))  # type: ignore[arg-type]
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{config.port}"
    try:
        _wait_healthy(base_url)
        yield base_url, server
    finally:
        server.should_exit = True
        thread.join(30)


def _wait_healthy(base_url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.05)
    raise RuntimeError(f"server at {base_url} did not become healthy in {timeout_s} s")


def mode_config(mode: str, **overrides: object) -> ServerConfig:
    """A small server on a free port: 4 seats; in dynamic mode a batch leaves as soon as a request waits."""
    values: dict[str, object] = {
        "mode": mode,
        "port": 0,
        "max_batch_size": 4,
        "batch_timeout_ms": 0.0,
        "max_num_seqs": 4,
    }
    return ServerConfig(**{**values, **overrides})  # type: ignore[arg-type]


def openai_client(server: RunningServer, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=api_key, max_retries=0, timeout=60)


def read_events(
    url: str,
    stop: threading.Event,
    into: list[tuple[str, dict[str, Any]]],
    opened: list[socket.socket] | None = None,
    **kw: Any,
) -> None:
    """Read a server's `GET /v1/events` stream into `into` as (event name, data) until `stop` is set (run it on a
    thread; the stream is read up to its next line) or the stream's socket, appended to `opened`, is shut down;
    `kw` goes to httpx (headers)."""
    with httpx.stream("GET", url, timeout=60, **kw) as response:
        assert response.status_code == 200
        if opened is not None:
            opened.append(response.extensions["network_stream"].get_extra_info("socket"))
        kind = ""
        with contextlib.suppress(httpx.ReadError, httpx.RemoteProtocolError):  # the socket was shut down
            for line in response.iter_lines():
                if line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: "):
                    into.append((kind, json.loads(line[6:])))
                if stop.is_set():
                    return


@contextlib.contextmanager
def events_read(url: str, **kw: Any) -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """A server's `GET /v1/events` stream read on a thread into the yielded list until the block ends, which closes
    the connection at once: a server stopped after it then does not wait for the stream's next ping (10 s) to
    learn that its reader left."""
    events: list[tuple[str, dict[str, Any]]] = []
    opened: list[socket.socket] = []
    reader = threading.Thread(target=read_events, args=(url, threading.Event(), events, opened), kwargs=kw)
    reader.start()
    try:
        yield events
    finally:
        deadline = time.monotonic() + 60
        while not opened and reader.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        for sock in opened:
            sock.shutdown(socket.SHUT_RDWR)
        reader.join(60)


# ----- what the API tests share -----
MODES = ("dynamic", "continuous")
PROMPT = "the quick brown fox"
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello world"}]
LONG = 200  # tokens of a request that is still running when the test acts on it (it is aborted, never awaited)


def model_name(server: RunningServer) -> str:
    return str(server.runtime.model_name)


def server_mode(server: RunningServer) -> str:
    return str(ServerState.of(server.app).config.mode)  # type: ignore[arg-type]


def metric_samples(base_url: str, headers: dict[str, str] | None = None) -> dict[str, list[tuple[dict, float]]]:
    """Sample name -> [(labels, value)] from /metrics."""
    response = httpx.get(f"{base_url}/metrics", headers=headers, timeout=10)
    assert response.status_code == 200, response.text
    samples: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return samples


def metric_value(base_url: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 when the series does not exist yet)."""
    return sum(
        value
        for sample_labels, value in metric_samples(base_url).get(name, [])
        if all(sample_labels.get(k) == v for k, v in labels.items())
    )


def wait_until(
    predicate: Callable[[], bool], what: str = "the condition", timeout_s: float = 30.0, every_s: float = 0.01
) -> None:
    """Poll every `every_s` until `predicate()` holds; fail after a generous deadline (a bounded wait, not a timing
    check)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(every_s)


def seats_all_free(server: RunningServer) -> bool:
    runtime = server.runtime
    seats = ServerState.of(server.app).config.seats  # type: ignore[arg-type]
    return (
        runtime.engine.num_free_rows == seats
        and runtime.scheduler.counts().running == 0
        and runtime.engine.cache_usage == 0.0
        and not runtime.scheduler.counts().pending_work
    )


def num_running(server: RunningServer) -> float:
    return metric_value(server.base_url, "vllm:num_requests_running", mode=server_mode(server))


def as_dicts(messages: list[ChatCompletionMessageParam]) -> list[dict[str, str]]:
    """Chat messages as a tokenizer's chat template takes them."""
    return [{"role": str(m["role"]), "content": str(m.get("content"))} for m in messages]


def error_of(response: httpx.Response, status: int) -> dict[str, object]:
    """The OpenAI error object of a response, checking its status and shape."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error  # type: ignore[no-any-return]


def stop_string_in(text: str, length: int = 2) -> tuple[int, str]:
    """The first substring of `text` after its first character that occurs nowhere earlier and holds no U+FFFD
    (an undecodable byte): usable as a stop string that truncates `text` at a known index."""
    for index in range(1, len(text) - length + 1):
        candidate = text[index : index + length]
        if "\ufffd" not in candidate and text.find(candidate) == index:
            return index, candidate
    raise AssertionError(f"no usable stop string in {text!r}")


# ----- `batchserve compare` -----
@dataclass(frozen=True)
class CompareServer:
    base_url: str
    app: Any


@contextlib.contextmanager
def compare_server(freeze_heap: bool = False, **overrides: Any) -> Iterator[CompareServer]:
    """`compare` (dynamic and continuous) on the tiny model, 4 seats each."""
    values: dict[str, Any] = {"port": free_port(), "max_batch_size": 4, "max_num_seqs": 4, "batch_timeout_ms": 500.0}
    config = ServerConfig(**{**values, **overrides})
    model = tiny_loaded_model()
    app = create_compare_app(
        config, loader=lambda _config: model, freeze_heap=freeze_heap, compile_workers=shared_compile_workers()
    )
    with serving_app(app, config) as (base_url, _):
        yield CompareServer(base_url, app)


@contextlib.contextmanager
def lineup_server(lineup: str, **overrides: Any) -> Iterator[str]:
    """`compare` with the line-up `lineup` (scheduler/lineup.py) on the tiny model; yields its base URL."""
    values: dict[str, Any] = {"port": free_port(), "max_batch_size": 3, "max_num_seqs": 3, "batch_window_ms": 20.0}
    config = ServerConfig(**{**values, **overrides})
    model = tiny_loaded_model()
    app = create_compare_app(
        config,
        loader=lambda _config: model,
        lineup=parse_lineup(lineup, speculation=True),
        compile_workers=shared_compile_workers(),
    )
    with serving_app(app, config) as (base_url, _):
        yield base_url
