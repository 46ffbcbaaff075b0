"""Run the real batchserve app under uvicorn on a free loopback port, with a tiny or the real model."""

from __future__ import annotations

import contextlib
import functools
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import uvicorn
from transformers import PreTrainedTokenizerFast

from api.apps.serve import create_app
from api.config import ServerConfig
from api.endpoints.state import ServerState
from api.process.server import uvicorn_config
from benchmarks.loadgen.server_proc import free_port
from engine.loader import LoadedModel, load_model
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
    app = create_app(config, loader=lambda _config: model, freeze_heap=freeze_heap)
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
