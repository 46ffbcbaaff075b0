"""`priority` through the API: a 400 naming it under fcfs (as vLLM), taken under --scheduling-policy priority; the
request's priority class in `timings` and /metrics; --priority-preemption refused where it has no meaning."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from api.apps.compare import mode_config as compare_mode_config
from api.cli import main
from api.config import ServerConfig
from scheduler.lineup import parse_entry
from tests.server_harness import (
    RunningServer,
    metric_samples,
    metric_value,
    mode_config,
    real_loaded_model,
    running_server,
)


@pytest.fixture(scope="module")
def priority_server() -> Iterator[RunningServer]:
    with running_server(mode_config("continuous", scheduling_policy="priority")) as server:
        yield server


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_priority_server_takes_the_field_on_both_endpoints(priority_server: RunningServer, path: str) -> None:
    body: dict[str, object] = {"max_tokens": 3, "temperature": 0, "priority": -7}
    body.update({"prompt": "hello"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    response = httpx.post(f"{priority_server.base_url}{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


def test_an_fcfs_server_refuses_a_non_zero_priority_naming_the_flag(server: RunningServer) -> None:
    body = {"prompt": "hello", "max_tokens": 3, "priority": 2}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "priority" and "--scheduling-policy priority" in error["message"]


# ----- per-priority-class observability: `timings` and /metrics -----
BY_CLASS = (
    "batchserve:time_to_first_token_by_priority_seconds_count",
    "batchserve:request_queue_time_by_priority_seconds_count",
)


def complete(server: RunningServer, priority: int) -> dict:
    body = {"prompt": "hello", "max_tokens": 2, "temperature": 0, "ignore_eos": True, "priority": priority}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["timings"]


def test_timings_and_metrics_carry_the_priority_class(priority_server: RunningServer) -> None:
    """Each class has its own series; a priority beyond ±10 shares its end's open class, so a client cannot grow
    the label set without bound."""
    labels = {"-3": -3, "0": 0, ">10": 50, "<-10": -1000}
    before = {
        (name, label): metric_value(priority_server.base_url, name, priority=label)
        for name in BY_CLASS
        for label in labels
    }
    for priority in labels.values():
        timings = complete(priority_server, priority)
        assert timings["priority"] == priority and timings["num_preemptions"] == 0
    for name in BY_CLASS:
        for label in labels:
            assert metric_value(priority_server.base_url, name, priority=label) == before[name, label] + 1, (
                name,
                label,
            )
    samples = metric_samples(priority_server.base_url)
    preemptions = samples["batchserve:request_preemptions_by_priority_total"]
    assert {series["priority"] for series, _ in preemptions} >= set(labels)
    assert all(value == 0 for _, value in preemptions)
    assert all(series["mode"] == "continuous" for series, _ in preemptions)


def test_an_fcfs_server_has_no_priority_classes_and_reports_priority_zero(server: RunningServer) -> None:
    assert complete(server, 0)["priority"] == 0
    samples = metric_samples(server.base_url)
    assert not [name for name in samples if "by_priority" in name]
    assert "vllm:time_to_first_token_seconds_count" in samples  # the vLLM names stay as they are


# ----- --priority-preemption: refused where it has no meaning, naming the flag -----
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--priority-preemption"], "--priority-preemption needs --scheduling-policy priority"),
        (
            ["serve", "--priority-preemption", "--scheduling-policy", "priority", "--mode", "static"],
            "--priority-preemption needs --mode continuous",
        ),
        (["compare", "--priority-preemption"], "--priority-preemption needs --scheduling-policy priority"),
    ],  # --priority-preemption-threshold 0: tests/api/test_flag_ranges.py, with every numeric flag
)
def test_priority_preemption_is_refused_at_start_where_it_has_no_meaning(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exited:  # before any model loads
        main(argv)
    assert message in str(exited.value.code)


def test_compare_gives_priority_preemption_to_the_continuous_pane_only() -> None:
    config = ServerConfig(scheduling_policy="priority", priority_preemption=True)
    assert compare_mode_config(config, parse_entry("continuous")).scheduler_config().priority_preemption
    dynamic = compare_mode_config(config, parse_entry("dynamic")).scheduler_config()
    assert not dynamic.priority_preemption and dynamic.by_priority


# ----- --priority-preemption end to end, with the real model -----
def post_completion(server: RunningServer, body: dict) -> dict:
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def stream_completion(server: RunningServer, body: dict, started: threading.Event) -> tuple[str, dict]:
    """The streamed text and the last chunk's timings; `started` is set once the first text arrives."""
    texts: list[str] = []
    timings: dict = {}
    url = f"{server.base_url}/v1/completions"
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            texts += [choice["text"] for choice in event["choices"]]
            if "".join(texts):
                started.set()
            timings = event.get("timings") or timings
    return "".join(texts), timings


@pytest.mark.slow
def test_a_displaced_request_resumes_and_answers_as_it_does_alone() -> None:
    """One seat: a priority-10 request is streaming when a priority-0 one comes. The newcomer takes the seat at
    once; the displaced request resumes after it (recomputing its context) and its greedy answer is the one it
    gives alone."""
    config = mode_config("continuous", max_num_seqs=1, scheduling_policy="priority", priority_preemption=True)
    batch = {"prompt": "Once upon a time, there was a", "max_tokens": 96, "temperature": 0, "ignore_eos": True}
    batch["priority"] = 10
    urgent = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "priority": 0}
    with running_server(config, loaded=real_loaded_model()) as server:
        alone = post_completion(server, batch)
        assert alone["timings"]["num_preemptions"] == 0
        started = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            streamed = pool.submit(stream_completion, server, batch, started)
            assert started.wait(300), "the priority-10 request never started"
            answered = post_completion(server, urgent)  # while the long request still has most of its tokens to go
            text, timings = streamed.result(timeout=600)
        preempted = metric_value(server.base_url, "batchserve:request_preemptions_by_priority_total", priority="10")
    assert answered["timings"]["priority"] == 0 and answered["timings"]["num_preemptions"] == 0
    assert timings["priority"] == 10 and timings["num_preemptions"] == 1
    assert text == alone["choices"][0]["text"]
    assert preempted == 1
