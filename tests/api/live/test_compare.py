"""`batchserve compare` on the tiny model: both modes' APIs under their prefixes, /health, /metrics, the event
stream (what a hostage workload looks like in each mode), its auth and query checks, and the slow-subscriber bound."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from api.endpoints.state import ServerState
from tests.server_harness import (
    CompareServer,
    compare_server,
    read_events,
    wait_until,
)

KEY = "sekret"


@pytest.fixture(scope="module")
def server() -> Iterator[CompareServer]:
    with compare_server() as running:
        yield running


def client(server: CompareServer, mode: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/{mode}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.mark.parametrize("mode", ["dynamic", "continuous"])
def test_each_prefix_serves_completions_chat_and_streams_with_timings(server: CompareServer, mode: str) -> None:
    api = client(server, mode)
    model = api.models.list().data[0].id
    reply = api.completions.create(model=model, prompt="hello world", max_tokens=5, temperature=0)
    assert reply.usage is not None and reply.usage.completion_tokens >= 1
    assert reply.model_extra is not None and reply.model_extra["timings"]["mode"] == mode
    chat = api.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.choices[0].finish_reason in ("stop", "length")
    chunks = list(api.completions.create(model=model, prompt="the quick", max_tokens=4, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].model_extra is not None and chunks[-1].model_extra["timings"]["mode"] == mode


@pytest.mark.parametrize("mode", ["dynamic", "continuous"])
def test_each_prefix_answers_errors_with_the_openai_shape(server: CompareServer, mode: str) -> None:
    bad = httpx.post(f"{server.base_url}/{mode}/v1/completions", json={"prompt": "x", "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    unknown = httpx.post(f"{server.base_url}/{mode}/v1/completions", json={"model": "nope", "prompt": "x"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{server.base_url}/{mode}/v1/nothing").status_code == 404


@pytest.mark.parametrize("mode", ["dynamic", "continuous"])
def test_each_prefix_serves_tokenize_detokenize_version_and_the_model_card(server: CompareServer, mode: str) -> None:
    base = f"{server.base_url}/{mode}"
    tokens = httpx.post(f"{base}/tokenize", json={"prompt": "hello world"}).json()["tokens"]
    assert httpx.post(f"{base}/detokenize", json={"tokens": tokens}).json() == {"prompt": "hello world"}
    grammars = ServerState.of(server.app).modes[mode].loaded().grammars  # type: ignore[arg-type]
    assert httpx.get(f"{base}/version").json()["features"] == {"structured_outputs": grammars is not None}
    api = client(server, mode)
    assert api.models.retrieve("tiny-llama") == api.models.list().data[0]
    bad = httpx.post(f"{base}/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_each_prefix_serves_responses_from_its_own_store(server: CompareServer) -> None:
    dynamic, continuous = client(server, "dynamic"), client(server, "continuous")
    first = dynamic.responses.create(model="tiny-llama", input="hello", max_output_tokens=2)
    again = dynamic.responses.create(
        model="tiny-llama", input="more", previous_response_id=first.id, max_output_tokens=2
    )
    assert again.previous_response_id == first.id and dynamic.responses.retrieve(first.id) == first
    with pytest.raises(openai.NotFoundError):  # each mode's app keeps its own
        continuous.responses.retrieve(first.id)


def test_health_answers_for_both_modes_and_metrics_label_every_series_by_mode(server: CompareServer) -> None:
    health = httpx.get(f"{server.base_url}/health")
    assert health.status_code == 200 and health.json()["modes"] == {"dynamic": "ok", "continuous": "ok"}
    text = httpx.get(f"{server.base_url}/metrics").text
    for mode in ("dynamic", "continuous"):
        assert f'vllm:num_requests_running{{mode="{mode}"' in text
        assert f'batchserve:steps_total{{mode="{mode}"' in text
    series = [line for line in text.splitlines() if line.startswith(("vllm:", "batchserve:"))]
    assert series and all('mode="' in line for line in series)
    families = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(families) == len(set(families))  # each family once, with both modes' series
    for mode, other in (("dynamic", "continuous"), ("continuous", "dynamic")):
        own = httpx.get(f"{server.base_url}/{mode}/metrics").text  # one mode's alone, as `serve` shows it
        assert f'mode="{mode}"' in own and f'mode="{other}"' not in own


def test_compare_modes_lists_both_prefixes(server: CompareServer) -> None:
    body = httpx.get(f"{server.base_url}/v1/compare/modes").json()
    assert [(m["mode"], m["prefix"], m["seats"]) for m in body["data"]] == [
        ("dynamic", "/dynamic", 4),
        ("continuous", "/continuous", 4),
    ]
    assert body["max_prompts"] == 32


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("include_text=maybe", "include_text"),
        ("colour=red", "colour"),
        ("include_text=1&include_text=0", "include_text"),
    ],
)
def test_bad_event_query_parameters_get_a_400_naming_them(server: CompareServer, query: str, param: str) -> None:
    for path in ("/v1/events", "/dynamic/v1/events"):
        answer = httpx.get(f"{server.base_url}{path}?{query}")
        assert answer.status_code == 400
        assert answer.json()["error"]["param"] == param


def _send(base: str, mode: str, max_tokens: int, ids: dict[str, list[str]]) -> None:
    body = {"prompt": "hello world", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(f"{base}/{mode}/v1/completions", json=body, timeout=60).json()
    ids[mode].append(f"{reply['id']}-0")


def test_hostage_workload_shows_held_seats_in_dynamic_and_none_in_continuous(server: CompareServer) -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    stop = threading.Event()
    reader = threading.Thread(
        target=read_events, args=(f"{server.base_url}/v1/events?include_text=false", stop, events), daemon=True
    )
    reader.start()
    wait_until(lambda: {e["mode"] for k, e in events if k == "hello"} == {"dynamic", "continuous"}, timeout_s=60.0)
    long_ids: dict[str, list[str]] = {"dynamic": [], "continuous": []}
    short_ids: dict[str, list[str]] = {"dynamic": [], "continuous": []}
    # One long answer and three short ones to each mode at once: in dynamic mode they board one bus (4 seats).
    senders = [threading.Thread(target=_send, args=(server.base_url, m, 40, long_ids)) for m in long_ids]
    senders += [
        threading.Thread(target=_send, args=(server.base_url, m, 3, short_ids)) for m in short_ids for _ in "abc"
    ]
    for thread in senders:
        thread.start()
    for thread in senders:
        thread.join(60)
    every = {rid for ids in (*long_ids.values(), *short_ids.values()) for rid in ids}
    wait_until(
        lambda: every <= {e["request_id"] for k, e in events if k == "request" and e["event"] == "released"},
        timeout_s=60.0,
    )
    stop.set()

    def at(mode: str, rid: str, point: str) -> float:
        return next(e["t"] for k, e in events if k == "request" and e["request_id"] == rid and e["event"] == point)

    def held_lanes(mode: str) -> list[dict[str, Any]]:
        steps = [e for k, e in events if k == "step" and e["mode"] == mode]
        return [lane for step in steps for lane in step["lanes"] if lane["phase"] == "held"]

    dynamic_long = long_ids["dynamic"][0]
    assert {lane["request_id"] for lane in held_lanes("dynamic")} >= set(short_ids["dynamic"])
    for rid in short_ids["dynamic"]:  # finished early, released with the long answer
        assert at("dynamic", rid, "finished") < at("dynamic", dynamic_long, "finished")
        assert at("dynamic", rid, "released") >= at("dynamic", dynamic_long, "finished")
    continuous_long = long_ids["continuous"][0]
    assert held_lanes("continuous") == []
    for rid in short_ids["continuous"]:
        assert at("continuous", rid, "released") < at("continuous", continuous_long, "finished")
    finished = [e for k, e in events if k == "request" and e["event"] == "finished" and e["request_id"] in every]
    assert len(finished) == len(every) == 8 and all(e["outcome"] == "length" for e in finished)


def test_a_subscriber_that_never_reads_is_lagged_then_disconnected_while_serving_goes_on(
    server: CompareServer,
) -> None:
    hub = ServerState.of(server.app).hub()
    disconnected = hub.disconnected

    async def subscribe() -> Any:
        return hub.subscribe(("dynamic", "continuous"), include_text=True)

    previous_size = hub.queue_size
    hub.queue_size = 8
    try:
        subscriber = asyncio.run_coroutine_threadsafe(subscribe(), hub.loop).result(10)
    finally:
        hub.queue_size = previous_size
    api = client(server, "continuous")
    model = api.models.list().data[0].id
    for _ in range(3):  # each answer is more than a queue of events; the subscriber reads none of them
        reply = api.completions.create(model=model, prompt="hello", max_tokens=30, extra_body={"ignore_eos": True})
        assert reply.usage is not None and reply.usage.completion_tokens == 30
    wait_until(lambda: hub.disconnected > disconnected, timeout_s=60.0)
    assert subscriber.closed and subscriber.kicked.is_set() and subscriber not in hub.subscribers
    assert len(subscriber._queue) <= 8  # what it held never grew past its bound
    assert hub.lagged >= 1


def test_a_disconnected_subscriber_sees_its_stream_closed(server: CompareServer) -> None:
    hub = ServerState.of(server.app).hub()
    before = list(hub.subscribers)
    with httpx.stream("GET", f"{server.base_url}/dynamic/v1/events", timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines) == "event: hello"
        (subscriber,) = [s for s in hub.subscribers if s not in before]
        hub.loop.call_soon_threadsafe(hub.kick, subscriber)
        list(lines)  # returns once the server ends the stream (no traffic would keep it open: a read timeout fails)
        assert response.is_stream_consumed
    assert subscriber.closed and subscriber not in hub.subscribers


def test_lagged_subscriber_gets_a_summary_then_a_fresh_hello(server: CompareServer) -> None:
    hub = ServerState.of(server.app).hub()

    async def run() -> list[str]:
        subscriber = hub.subscribe(("continuous",), include_text=False)
        assert subscriber is not None
        frames = subscriber.frames()
        first = await frames.__anext__()  # the hello
        kinds = [first.decode().split("\n")[0]]
        subscriber._size = 4
        api = httpx.AsyncClient(base_url=f"{server.base_url}/continuous/v1", timeout=60)
        await api.post("/completions", json={"prompt": "hi", "max_tokens": 12, "ignore_eos": True})
        await api.aclose()
        for _ in range(3):
            frame = await asyncio.wait_for(frames.__anext__(), 30)
            kinds.append(frame.decode().split("\n")[0])
        await frames.aclose()
        return kinds

    kinds = asyncio.run_coroutine_threadsafe(run(), hub.loop).result(60)
    assert kinds[0] == "event: hello"
    assert kinds[1] == "event: lagged"
    assert "event: hello" in kinds[2:]


def test_api_key_guards_every_prefix_and_the_event_stream() -> None:
    with compare_server(api_key=KEY) as server:
        assert httpx.get(f"{server.base_url}/health").status_code == 200
        assert httpx.get(f"{server.base_url}/").status_code == 200  # the page asks for the key itself
        guarded = ("/dynamic/v1/models", "/continuous/v1/models", "/v1/events", "/continuous/v1/events", "/metrics")
        for path in (*guarded, "/dynamic/version", "/continuous/v1/models/tiny-llama"):
            answer = httpx.get(f"{server.base_url}{path}")
            assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{server.base_url}/v1/events?api_key=wrong").status_code == 401
        # ?api_key= is for EventSource only: other endpoints want the header
        assert httpx.get(f"{server.base_url}/dynamic/v1/models?api_key={KEY}").status_code == 401
        by_query = httpx.Request("GET", f"{server.base_url}/dynamic/v1/events", params={"api_key": KEY})
        by_header = httpx.Request(
            "GET", f"{server.base_url}/dynamic/v1/events", headers={"Authorization": f"Bearer {KEY}"}
        )
        with httpx.Client(timeout=30) as http:
            for request in (by_query, by_header):
                response = http.send(request, stream=True)
                try:
                    assert response.status_code == 200
                    first = next(line for line in response.iter_lines() if line.startswith("data: "))
                    assert json.loads(first[6:])["mode"] == "dynamic"
                finally:
                    response.close()
        api = client(server, "dynamic", KEY)
        reply = api.completions.create(model=api.models.list().data[0].id, prompt="hello", max_tokens=3)
        assert reply.choices[0].text is not None


def test_benchmarks_drive_either_prefix(server: CompareServer) -> None:
    from benchmarks.online import serve_bench

    for mode in ("dynamic", "continuous"):
        argv = ["--base-url", server.base_url, "--prefix", f"/{mode}", "--workload", "uniform", "--num-prompts", "2",
                "--input-len", "4", "--output-len", "4", "--no-progress", "--warmup", "0"]  # fmt: skip
        assert serve_bench.main(argv) == 0  # 0: every request completed


def test_compare_bench_counts_tokens_in_its_window_and_feeds_its_subscribers(server: CompareServer) -> None:
    from benchmarks.online.compare_bench import Load, drive_with_subscribers

    load = Load(concurrency=2, max_tokens=4, prompt="hello world", warmup_s=0.2, duration_s=1.0)
    url = f"{server.base_url}/continuous"
    measured, event_bytes = asyncio.run(drive_with_subscribers(url, f"{url}/v1/events", load, subscribers=2))
    assert measured.errors == 0 and measured.requests >= 1
    assert measured.tokens > 0 and measured.output_tok_s == measured.tokens / load.duration_s
    assert event_bytes > 0


def test_compare_command_sets_both_modes_seats_and_keeps_the_per_mode_flags() -> None:
    from api.cli import build_parser, compare_config

    args = build_parser().parse_args(["compare", "--seats", "6", "--batch-timeout-ms", "20", "--api-key", "k"])
    config = compare_config(args)
    assert (config.max_batch_size, config.max_num_seqs, config.batch_timeout_ms) == (6, 6, 20.0)
    assert config.api_key == "k"
    alone = compare_config(build_parser().parse_args(["compare", "--max-batch-size", "3", "--max-num-seqs", "5"]))
    assert (alone.max_batch_size, alone.max_num_seqs) == (3, 5)


def test_compare_command_refuses_bad_seats_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    from api.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["compare", "--seats", "0"])
    assert exited.value.code == 2
    assert "argument --seats: must be an integer from 1 to" in capsys.readouterr().err
