"""A bounded soak: many concurrent clients, some disconnecting, some aborting, some sending bad requests.

Each mode runs the same seeded round twice. After each round every valid, connected request got exactly its
max_tokens tokens; every sequence of a client that left was aborted (they ask for LONG tokens, so running them
to the end would show as "length"); the server runs and waits for nothing and holds no cache or seat; and after
the second round no request objects are alive and memory has stopped growing (see MEMORY_GROWTH_BOUND).
Bounded by request count; nothing asserts a duration.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import random
import re
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
import torch

from api.config import ServerConfig
from api.endpoints.service import Generation
from scheduler.request import FinishEvent, RequestEvent, SequenceRequest
from tests.server_harness import RunningServer, running_server

pytestmark = pytest.mark.slow

REQUESTS_PER_ROUND = 60
CONCURRENCY = 12
SEATS = 4
MAX_MODEL_LEN = 256
LONG = 160  # max_tokens of the requests whose clients leave early
# Python memory (tracemalloc) still held after the second identical round, beyond what the first left. The
# first round warms every lazy cache (pydantic, tokenizer, prometheus children, uvicorn and httpx internals), so
# the second should hold nothing more: measured, it moves by tens of KiB either way. 1 MiB (~17 KiB per request)
# is generous against that noise yet catches keeping each request's text or chunks. Tensors live outside
# tracemalloc; the engine's buffers are preallocated, and the exact checks (no SequenceRequest or Generation left
# alive, cache 0, every row free) cover what the engine and scheduler hold.
MEMORY_GROWTH_BOUND = 1024 * 1024
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world", "tiny", "numbers"]
BAD_BODIES = [
    b'{"prompt": "hi", "max_tokens": 0}',
    b'{"prompt": [1, 99999]}',
    b'{"prompt": "hi", "n": 1000}',
    b'{"messages": []}',
    b"{not json",
]


@dataclass
class Tally:
    completed: int = 0
    completed_choices: int = 0
    disconnected: int = 0
    aborted: int = 0
    rejected: int = 0
    failures: list[str] = field(default_factory=list)
    submitted: int = 0  # sequences the scheduler took
    finishes: dict[str, tuple[int, str]] = field(default_factory=dict)  # sequence id -> (max_tokens, reason)


@contextlib.contextmanager
def _ledger(server: RunningServer, tally: Tally) -> Iterator[None]:
    """Record how each submitted sequence finished, through the loop's public submit (ids only, no SequenceRequest)."""
    loop = server.runtime.loop
    real_submit = loop.submit

    def submit(request: SequenceRequest, arrival: float | None = None) -> None:
        request_id, max_tokens, sink = request.request_id, request.params.max_tokens, request.sink

        def recording_sink(event: RequestEvent) -> None:
            if isinstance(event, FinishEvent):
                tally.finishes[request_id] = (max_tokens, event.outcome.value)
            sink(event)

        request.sink = recording_sink
        real_submit(request, arrival)
        tally.submitted += 1

    loop.submit = submit  # type: ignore[method-assign]
    try:
        yield
    finally:
        del loop.submit


@pytest.fixture(scope="module", params=["dynamic", "continuous"])
def server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model gains nothing from intra-op threads on a shared 2-core box
    config = ServerConfig(
        port=0,
        mode=request.param,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=SEATS,
        max_batch_size=SEATS,
        batch_timeout_ms=10.0,
        max_num_batched_tokens=256,
    )
    try:
        with running_server(config) as srv:
            yield srv
    finally:
        torch.set_num_threads(threads)


def _valid_body(rng: random.Random, stream: bool, long: bool = False) -> tuple[str, dict[str, object]]:
    max_tokens = LONG if long else rng.randint(4, 24)
    n = rng.choice([1, 1, 1, 2])
    common: dict[str, object] = {
        "max_tokens": max_tokens,
        "n": n,
        "ignore_eos": True,
        "stream": stream,
        "temperature": rng.choice([0.0, 0.8]),
        "seed": rng.randrange(1000),
    }
    if stream:
        common["stream_options"] = {"include_usage": True}
    text = " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))
    if rng.random() < 0.5:
        return "/v1/completions", {"prompt": text, **common}
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], **common}


async def _stream_request(
    client: httpx.AsyncClient, path: str, body: dict[str, object], tally: Tally, stop_after: int | None
) -> None:
    """Read a stream to its end (stop_after None) or disconnect after `stop_after` events."""
    events: list[str] = []
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            tally.failures.append(f"stream {path}: {response.status_code} {(await response.aread())[:200]!r}")
            return
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
            if stop_after is not None and len(events) >= stop_after:
                tally.disconnected += 1
                return  # leaving the block closes the connection mid-stream
    _check_stream(path, body, events, tally)


def _check_stream(path: str, body: dict[str, object], events: list[str], tally: Tally) -> None:
    expected = int(body["max_tokens"]) * int(body["n"])  # type: ignore[call-overload]
    if not events or events[-1] != "[DONE]":
        tally.failures.append(f"stream {path} did not end with [DONE]: {events[-2:]}")
        return
    chunks = [json.loads(e) for e in events[:-1]]
    errors = [c for c in chunks if "error" in c]
    finishes = [ch["finish_reason"] for c in chunks for ch in c.get("choices", []) if ch["finish_reason"]]
    usage = chunks[-1].get("usage") or {}
    if errors or usage.get("completion_tokens") != expected or finishes != ["length"] * int(body["n"]):  # type: ignore[call-overload]
        tally.failures.append(f"stream {path}: errors={errors} usage={usage} finishes={finishes} want {expected}")
        return
    tally.completed += 1
    tally.completed_choices += int(body["n"])  # type: ignore[call-overload]


async def _plain_request(client: httpx.AsyncClient, path: str, body: dict[str, object], tally: Tally) -> None:
    response = await client.post(path, json=body)
    expected = int(body["max_tokens"]) * int(body["n"])  # type: ignore[call-overload]
    if response.status_code != 200:
        tally.failures.append(f"{path}: {response.status_code} {response.text[:200]}")
        return
    data = response.json()
    finishes = [c["finish_reason"] for c in data["choices"]]
    if data["usage"]["completion_tokens"] != expected or finishes != ["length"] * int(body["n"]):  # type: ignore[call-overload]
        tally.failures.append(f"{path}: usage={data['usage']} finishes={finishes} want {expected}")
        return
    tally.completed += 1
    tally.completed_choices += int(body["n"])  # type: ignore[call-overload]


async def _send_and_abort(base_url: str, path: str, body: dict[str, object], tally: Tally) -> None:
    """Write a whole request on a raw connection and close it without reading a byte of the answer."""
    host, port = base_url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    await writer.drain()
    writer.close()
    await writer.wait_closed()
    tally.aborted += 1


async def _bad_request(client: httpx.AsyncClient, body: bytes, tally: Tally) -> None:
    response = await client.post(
        "/v1/completions" if b"messages" not in body else "/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
    )
    if response.status_code != 400 or "error" not in response.json():
        tally.failures.append(f"bad request answered {response.status_code}: {response.text[:200]}")
        return
    tally.rejected += 1


async def _round(base_url: str, seed: int, tally: Tally) -> None:
    rng = random.Random(seed)
    gate = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(
        base_url=base_url, timeout=120, limits=httpx.Limits(max_connections=CONCURRENCY)
    ) as client:

        async def one(kind: float, sub: random.Random) -> None:
            async with gate:
                if kind < 0.40:
                    await _stream_request(client, *_valid_body(sub, stream=True), tally, stop_after=None)
                elif kind < 0.55:
                    await _plain_request(client, *_valid_body(sub, stream=False), tally)
                elif kind < 0.75:
                    path, body = _valid_body(sub, stream=True, long=True)
                    await _stream_request(client, path, body, tally, stop_after=sub.randint(1, 6))
                elif kind < 0.85:
                    await _send_and_abort(base_url, *_valid_body(sub, stream=sub.random() < 0.5, long=True), tally)
                else:
                    await _bad_request(client, sub.choice(BAD_BODIES), tally)

        await asyncio.gather(*(one(rng.random(), random.Random(rng.random())) for _ in range(REQUESTS_PER_ROUND)))


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def _wait_idle(server: RunningServer, polls: int = 400) -> None:
    """Aborts reach the loop asynchronously; poll (a bounded number of times) until nothing is pending."""
    scheduler = server.runtime.scheduler
    for _ in range(polls):
        if not scheduler.has_pending_work() and scheduler.num_queued == 0:
            return
        time.sleep(0.025)
    raise AssertionError(
        f"the server never went idle: {len(scheduler.waiting)} waiting, {len(scheduler.running)} running"
    )


def _assert_idle_and_empty(server: RunningServer) -> None:
    _wait_idle(server)
    engine = server.runtime.engine
    assert engine.cache_usage == 0
    assert engine.num_free_rows == engine.config.max_rows
    metrics = httpx.get(f"{server.base_url}/metrics").text
    assert _metric(metrics, "vllm:num_requests_running") == 0
    assert _metric(metrics, "vllm:num_requests_waiting") == 0
    assert _metric(metrics, "vllm:kv_cache_usage_perc") == 0


def _live(kind: type) -> int:
    gc.collect()
    return sum(type(obj) is kind for obj in gc.get_objects())


def _run_round(server: RunningServer, seed: int) -> Tally:
    tally = Tally()
    with _ledger(server, tally):
        asyncio.run(_round(server.base_url, seed, tally))
        _assert_idle_and_empty(server)
    assert not tally.failures, "\n".join(tally.failures)
    assert tally.completed + tally.disconnected + tally.aborted + tally.rejected == REQUESTS_PER_ROUND
    assert tally.completed >= REQUESTS_PER_ROUND // 3 and tally.disconnected and tally.aborted and tally.rejected
    # Every sequence taken got a finish; the short ones ran to their length, the clients that left were aborted.
    assert len(tally.finishes) == tally.submitted
    reasons = {(max_tokens == LONG, reason) for max_tokens, reason in tally.finishes.values()}
    assert reasons <= {(False, "length"), (True, "abort")}, reasons
    assert sum(max_tokens != LONG for max_tokens, _ in tally.finishes.values()) == tally.completed_choices
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    return tally


def test_soak_with_disconnects_and_bad_requests_leaves_nothing_behind(server: RunningServer) -> None:
    seed = 1234
    requests_before, generations_before = _live(SequenceRequest), _live(Generation)  # left by earlier tests, if any
    tracemalloc.start()
    try:
        _run_round(server, seed)
        gc.collect()
        after_first = tracemalloc.get_traced_memory()[0]

        _run_round(server, seed)
        gc.collect()
        after_second = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert _live(SequenceRequest) <= requests_before and _live(Generation) <= generations_before  # none of ours alive
    growth = after_second - after_first
    assert growth < MEMORY_GROWTH_BOUND, f"Python memory grew {growth / 2**20:.1f} MiB over an identical round"
