"""Scale-out on Ray Serve: two replicas of the tiny-model server on loopback behind Ray's proxy, driven with the
`openai` SDK and httpx; routing, backpressure, disconnects, metrics and a replica killed with SIGKILL.

Ray starts once per test session (it is the cost: some tens of seconds on two cores); the application once per
module. The tests share it and run in file order; the SIGKILL test is last, since it replaces a replica.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from api.config import ServerConfig
from api.scale_out.ray_serve import (
    APP_NAME,
    DIRECTORY_DEPLOYMENT,
    LOCAL_RAY_ENV,
    PROXY_CALLBACK_ENV,
    REPLICA_THREAD_ENV,
    ScaleOut,
    application,
    build_app,
    log_to_stderr,
    max_ongoing_requests,
    replica_actor_options,
    start_local_ray,
)
from api.scale_out.replica_asgi import ReplicaReport
from tests import server_harness as harness
from tests.server_harness import free_port

pytestmark = pytest.mark.slow

PROMPT = "the quick brown fox"
LONG = 200  # tokens: a request that runs for many steps (the tiny model's context is 256)
SEATS, QUEUE = 2, 4  # per replica: 8 concurrent requests fit the two replicas, 40 do not
CLOCK_SLACK_S = 0.05  # between the replica's release stamp and the test's reading of the same clock at the kill


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    """Each poll reads the cluster through Serve's proxy: every 0.2 s is often enough."""
    harness.wait_until(condition, what, timeout_s, every_s=0.2)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[str]:
    """A local Ray instance and Serve's proxy on a free loopback port, once per session: the proxy's URL."""
    previous = {name: os.environ.get(name) for name in (PROXY_CALLBACK_ENV, *LOCAL_RAY_ENV)}
    # 4 logical CPUs for 2 one-CPU replicas: a replacement for a killed replica is placed at once, even before
    # Ray has given back the dead one's CPU. Each replica still computes with one thread.
    start_local_ray(num_cpus=4, log_to_driver=False)  # with the proxy's fault middleware
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="module")
def base_url(ray_cluster: str, tiny_checkpoint: Path) -> Iterator[str]:
    # No compiled CPU kernels: a replica starts without the extension (built, or building, by other tests).
    config = ServerConfig(model=str(tiny_checkpoint), max_num_seqs=SEATS, max_queue=QUEUE, cpu_kernels=False)
    serve.run(application(config, ScaleOut(replicas=2, cpus_per_replica=1.0)), name=APP_NAME, route_prefix="/")
    url = ray_cluster
    wait_until(lambda: len(ready_replicas(url)) == 2, "both replicas to report ready")
    try:
        yield url
    finally:
        serve.delete(APP_NAME)


def ready_replicas(url: str) -> list[str]:
    try:
        health = httpx.get(f"{url}/health", timeout=30)
    except httpx.TimeoutException:  # a busy machine: the caller polls again
        return []
    return list(health.json()["replicas"]["ids"]) if health.status_code == 200 else []


def eventually_ready(url: str, replica: str, wait_s: float = 60.0) -> bool:
    """Whether `/health` lists `replica` as ready: a replica can answer a request a moment before its first
    report reaches the directory that `/health` reads."""
    deadline = time.monotonic() + wait_s
    while replica not in ready_replicas(url):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def directory_reports() -> list[ReplicaReport]:
    handle = serve.get_deployment_handle(DIRECTORY_DEPLOYMENT, APP_NAME)
    reports: list[ReplicaReport] = handle.reports.remote().result(timeout_s=30)
    return reports


def samples(url: str, name: str) -> dict[str, float]:
    """One metric's value per replica, from the proxy's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and "replica" in sample.labels:
                values[sample.labels["replica"]] = values.get(sample.labels["replica"], 0.0) + sample.value
    return values


def sse_lines(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


# ----- the single server never loads Ray -----
def test_single_server_path_does_not_import_ray(tiny_checkpoint: Path) -> None:
    """`batchserve serve` without --replicas, and importing api.cli and api.apps.serve, leave Ray out of the
    process."""
    check = (
        "import sys, threading, time, httpx, api.cli, api.apps.serve\n"
        "assert 'ray' not in sys.modules, 'importing api.cli/api.apps.serve imported ray'\n"
        "port = int(sys.argv[1])\n"
        "def probe():\n"
        "    for _ in range(600):\n"
        "        try:\n"
        "            if httpx.get(f'http://127.0.0.1:{port}/health').status_code == 200:\n"
        "                break\n"
        "        except httpx.HTTPError:\n"
        "            pass\n"
        "        time.sleep(0.2)\n"
        "    print('RAY_LOADED' if any(m == 'ray' or m.startswith('ray.') for m in sys.modules) else 'NO_RAY', "
        "flush=True)\n"
        "    import os, signal; os.kill(os.getpid(), signal.SIGTERM)\n"
        "threading.Thread(target=probe, daemon=True).start()\n"
        "api.cli.main(['serve', '--model', sys.argv[2], '--port', sys.argv[1], '--no-cpu-kernels'])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", check, str(free_port()), str(tiny_checkpoint)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "NO_RAY" in result.stdout, result.stdout + result.stderr[-3000:]


# ----- configuration -----
def test_a_replicas_own_info_lines_reach_stderr_once(capsys: pytest.CaptureFixture[str]) -> None:
    # A Ray worker has no handler for our loggers: without one, the replica's info lines went nowhere.
    logger = logging.getLogger("batchserve.test-replica-log")
    try:
        log_to_stderr(logger)
        log_to_stderr(logger)
        assert len(logger.handlers) == 1 and not logger.propagate
        logging.getLogger("batchserve.test-replica-log.child").info("heap frozen after loading: 3 objects")
        assert capsys.readouterr().err.count("INFO batchserve.test-replica-log.child: heap frozen") == 1
    finally:
        logger.handlers.clear()


def test_max_ongoing_requests_leaves_the_429_to_the_replica() -> None:
    config = ServerConfig(max_num_seqs=3, max_queue=5)
    assert max_ongoing_requests(config) > config.seats + config.max_queue


def test_replicas_serve_on_rays_event_loop_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REPLICA_THREAD_ENV, raising=False)
    options = replica_actor_options(ScaleOut(2, 1.0))
    assert (options["num_cpus"], options["num_gpus"]) == (1.0, 0.0)
    assert options["runtime_env"] == {"env_vars": {REPLICA_THREAD_ENV: "0"}}  # in the replica's own environment
    monkeypatch.setenv(REPLICA_THREAD_ENV, "1")  # a deployment that wants Ray's default keeps it
    assert replica_actor_options(ScaleOut(2, 1.0))["runtime_env"]["env_vars"][REPLICA_THREAD_ENV] == "1"


def test_serve_run_builder_takes_the_serve_flags_as_strings_or_values(tiny_checkpoint: Path) -> None:
    """`serve run api.scale_out.ray_serve:build_app mode=dynamic ...` passes strings; a YAML config's args are typed."""
    for args in (
        {"mode": "dynamic", "max_batch_size": "3", "replicas": "2", "cpu_kernels": "false"},
        {"mode": "dynamic", "max_batch_size": 3, "replicas": 2, "cpu_kernels": False},
    ):
        app = build_app({**args, "model": str(tiny_checkpoint)})
        assert isinstance(app, serve.Application)
    with pytest.raises(SystemExit):
        build_app({"mode": "neither"})


# ----- the API through the proxy -----
def test_openai_sdk_through_the_proxy_streaming_and_not(base_url: str) -> None:
    sdk = client(base_url)
    model = sdk.models.list().data[0].id
    reply = sdk.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert reply.choices[0].finish_reason in ("length", "stop") and reply.usage is not None
    assert reply.model_extra is not None
    assert eventually_ready(base_url, reply.model_extra["timings"]["replica"])
    chunks = list(
        sdk.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    last = chunks[-1].model_extra
    assert last is not None and last["timings"]["replica"]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    plain = sdk.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0
    )
    assert streamed == plain.choices[0].message.content  # greedy: the same text whichever replica answers


def test_errors_keep_their_openai_shape_and_status_through_the_proxy(base_url: str) -> None:
    bad = httpx.post(f"{base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": -1}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    missing = httpx.post(f"{base_url}/v1/completions", json={"prompt": PROMPT, "model": "nope"}, timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    with httpx.stream("POST", f"{base_url}/v1/completions", json={"prompt": PROMPT, "stream": True}, timeout=30) as r:
        lines = sse_lines(r)
    assert lines[-1] == "[DONE]" and json.loads(lines[-2])["timings"]["replica"]


def replicas_serving(url: str, until: str | None = None) -> set[str]:
    """The replicas named in the timings of rounds of concurrent requests, until two (or `until`) answered."""
    sdk = client(url)
    model = sdk.models.list().data[0].id

    def one(_: int) -> str:
        reply = sdk.completions.create(model=model, prompt=PROMPT, max_tokens=16, extra_body={"ignore_eos": True})
        assert reply.model_extra is not None
        return str(reply.model_extra["timings"]["replica"])

    served: set[str] = set()
    with ThreadPoolExecutor(max_workers=6) as pool:
        for _ in range(10):  # Ray's router spreads concurrent requests by the replicas' ongoing requests
            served |= set(pool.map(one, range(6)))
            if (until in served) if until is not None else len(served) == 2:
                break
    return served


def test_both_replicas_receive_requests(base_url: str) -> None:
    serving = replicas_serving(base_url)
    assert len(serving) == 2
    assert all(eventually_ready(base_url, replica) for replica in serving)


# ----- observability -----
def test_health_and_metrics_show_every_replica(base_url: str) -> None:
    wait_until(lambda: len(ready_replicas(base_url)) == 2, "both replicas' reports")
    health = httpx.get(f"{base_url}/health", timeout=30).json()
    assert health["status"] == "ok" and health["replicas"]["ready"] == 2
    ids = set(health["replicas"]["ids"])
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_count",
        "vllm:generation_tokens_total",
    ):
        assert set(samples(base_url, name)) == ids, name
    assert sum(samples(base_url, "vllm:generation_tokens_total").values()) > 0  # the tests above generated
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    assert "batchserve:replicas_ready 2.0" in text


# ----- disconnects and backpressure -----
def test_client_disconnect_through_the_proxy_aborts_on_the_replica(base_url: str) -> None:
    wait_until(lambda: sum(samples(base_url, "vllm:num_requests_running").values()) == 0, "an idle cluster")
    steps_before = sum(samples(base_url, "batchserve:steps_total").values())
    body = {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # it is running
    # Leaving the block closed the connection mid-stream; the proxy cancels the request on its replica.
    wait_until(lambda: sum(samples(base_url, "vllm:num_requests_running").values()) == 0, "the abort")
    time.sleep(1.5)  # a heartbeat, so the peer's counters in /metrics are current too
    assert sum(samples(base_url, "batchserve:steps_total").values()) - steps_before < LONG


Stream = tuple[int, dict[str, str], list[str]]  # status, headers, data lines (an error body as one line)


async def _streams(url: str, count: int, max_tokens: int) -> list[Stream]:
    """`count` concurrent streams: each one's status, headers and data lines."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}

    async def one(http: httpx.AsyncClient) -> Stream:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return response.status_code, dict(response.headers), [(await response.aread()).decode()]
            lines = [line.removeprefix("data: ") async for line in response.aiter_lines() if line.startswith("data:")]
            return 200, dict(response.headers), lines

    limits = httpx.Limits(max_connections=count)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        return await asyncio.gather(*(one(http) for _ in range(count)))


def test_a_full_cluster_answers_429_with_retry_after(base_url: str) -> None:
    results = asyncio.run(_streams(base_url, 40, 64))  # capacity: 2 replicas x (2 seats + 4 queued)
    refused = [r for r in results if r[0] == 429]
    served = [r for r in results if r[0] == 200]
    assert refused and served and len(refused) + len(served) == len(results), [r[0] for r in results]
    for _, headers, lines in refused:
        assert headers["retry-after"] == "1"
        assert json.loads(lines[0])["error"]["type"] == "rate_limit_error"
    for _, _, lines in served:
        assert lines[-1] == "[DONE]" and json.loads(lines[-2])["usage"]["completion_tokens"] == 64


def test_replicas_of_a_local_ray_compute_at_normal_priority(base_url: str) -> None:
    """Ray lowers its workers by 15 niceness steps unless told otherwise; a replica holds the engine. Ray's
    processes start from this one's priority (pytest may itself run under `nice`)."""
    reports = directory_reports()
    assert len(reports) == 2
    for report in reports:
        assert os.getpriority(os.PRIO_PROCESS, report.pid) == os.getpriority(os.PRIO_PROCESS, 0), report.replica


# ----- faults: last, since it replaces a replica -----
def test_sigkill_of_a_replica_under_load(base_url: str) -> None:
    reports = {r.replica: r.pid for r in directory_reports()}
    assert len(reports) == 2

    async def load_then_kill() -> tuple[str, float, list[Stream]]:
        streams = asyncio.ensure_future(_streams(base_url, 2 * (SEATS + QUEUE) - 4, LONG))
        # Kill a replica once it is running requests (read from /metrics, at most a heartbeat old).
        victim = None
        deadline = time.monotonic() + 60
        while victim is None:
            assert not streams.done() and time.monotonic() < deadline, "the streams never ran on a replica"
            running = await asyncio.to_thread(samples, base_url, "vllm:num_requests_running")
            victim = next((name for name, value in running.items() if value >= 1 and name in reports), None)
            await asyncio.sleep(0.1)
        os.kill(reports[victim], signal.SIGKILL)
        return victim, time.time(), await streams

    victim, killed_at, results = asyncio.run(load_then_kill())
    failed, intact = [], []
    for status, _, lines in results:
        if status == 429:  # the router sent it to a replica already full: answered, not lost
            continue
        if status != 200:
            assert status >= 500, (status, lines)  # never a hang: a 5xx before any byte
            failed.append(lines)
            continue
        assert lines[-1] == "[DONE]", lines[-3:]
        last = json.loads(lines[-2])
        if "error" in last:  # cut off mid-stream: an error event, then [DONE]
            assert last["error"]["type"] == "service_unavailable"
            failed.append(lines)
        else:
            assert last["usage"]["completion_tokens"] == LONG
            # The victim is picked from /metrics, up to a heartbeat old: one of its first streams may have ended
            # before the kill. A whole stream of its must have ended by then, on the replica's own stamps (same
            # machine, same clock): a killed process finishes nothing.
            timings = last["timings"]
            if timings["replica"] == victim:
                released = timings["arrival_time"] + timings["e2e_time_ms"] / 1e3
                assert released <= killed_at + CLOCK_SLACK_S, (released - killed_at, timings)
            intact.append(lines)
    assert failed, "the killed replica had requests in flight, and they must end with an error"
    # Ray replaces the replica: a new one reports ready and serves.
    newcomers: set[str] = set()

    def replaced() -> bool:  # one reading of /health decides both: a replica list can change between two reads
        ready = set(ready_replicas(base_url))
        newcomers.update(ready - set(reports))
        return len(ready - {victim}) == 2 and bool(newcomers)

    wait_until(replaced, "Ray to restart the replica", 240)
    newcomer = newcomers.pop()
    assert newcomer in replicas_serving(base_url, until=newcomer)
