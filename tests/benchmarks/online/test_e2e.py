"""The load generator, serve_bench and the A/B driver against a fake OpenAI-compatible streaming server.

The fake is a raw asyncio HTTP/1.1 server (chunked transfer encoding) that deliberately splits SSE frames
across network writes, mixes CRLF and LF line endings and sends keep-alive comments, so the client's parsing
is exercised the way a real network would. It also exports batchserve-style Prometheus metrics.
It runs in a thread for in-process tests, and as a subprocess (`serve_forever`) for the A/B driver.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from benchmarks.loadgen.arrivals import ArrivalConfig
from benchmarks.loadgen.client import ClientConfig, EosPolicy
from benchmarks.loadgen.flags import workload_config
from benchmarks.loadgen.run import RunConfig, RunResult, run_benchmark
from benchmarks.loadgen.server_proc import LaunchConfig
from benchmarks.loadgen.summaries import SLO
from benchmarks.loadgen.workloads import RequestSpec, WorkloadConfig, build_workload
from benchmarks.online import ab, serve_bench
from benchmarks.peers.targets import Target
from benchmarks.results_io.report import ABOutcome, write_report

ROOT = Path(__file__).resolve().parents[3]
BATCH_SIZE_PER_STEP = 2.0  # what the fake reports for every step
HELD_PER_REQUEST = 3  # held seat-steps the fake reports per request
GATE_TIMEOUT_S = 5.0  # not a timed assert: it only keeps a client that never reaches the gate from hanging the test


@dataclass(frozen=True)
class FakeBehaviour:
    send_usage: bool = True
    send_timings: bool = True
    fail_marker: str | None = None  # prompts containing this get HTTP 500
    # Hold every request's answer until this many are in flight at once (once reached, the gate stays open), so a
    # client that can reach that concurrency must; a client that cannot is let through after GATE_TIMEOUT_S.
    gate: int = 0


def token_text(i: int) -> str:
    return f"w{i} "


@dataclass
class FakeServer:
    behaviour: FakeBehaviour = field(default_factory=FakeBehaviour)
    payloads: list[dict[str, Any]] = field(default_factory=list)
    max_in_flight: int = 0
    port: int = 0
    _in_flight: int = 0
    _thread: threading.Thread | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _stop: asyncio.Event | None = None
    _gate_open: asyncio.Event | None = None  # made on the server's own loop
    _ready: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["mode", "model_name"]
        self.steps = Counter("batchserve:steps", "steps", labels, registry=self.registry)
        self.held = Counter("batchserve:held_seats", "held", labels, registry=self.registry)
        self.batch = Histogram("batchserve:batch_size", "seqs/step", labels, registry=self.registry)
        self.gen = Counter("vllm:generation_tokens", "tokens", labels, registry=self.registry)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # lifecycle
    def __enter__(self) -> FakeServer:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "fake server did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None and self._thread is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    async def _main(self, port: int = 0) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._handle, "127.0.0.1", port)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        async with server:
            await self._stop.wait()

    # HTTP
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            request_line, *header_lines = head.decode().split("\r\n")
            method, path, _ = request_line.split(" ", 2)
            headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines if h)}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            await self._route(method, path, body, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _route(self, method: str, path: str, body: bytes, writer: asyncio.StreamWriter) -> None:
        if method == "GET" and path == "/health":
            await _respond(writer, 200, b"ok", "text/plain")
        elif method == "GET" and path == "/metrics":
            await _respond(writer, 200, generate_latest(self.registry), "text/plain; version=0.0.4")
        elif method == "GET" and path == "/v1/models":
            await _respond(writer, 200, json.dumps({"data": [{"id": "fake-model"}]}).encode(), "application/json")
        elif method == "POST" and path == "/v1/completions":
            await self._completions(json.loads(body), writer)
        else:
            await _respond(writer, 404, b"not found", "text/plain")

    async def _completions(self, payload: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        self.payloads.append(payload)
        marker = self.behaviour.fail_marker
        if marker is not None and marker in payload["prompt"]:
            await _respond(writer, 500, b'{"error": "boom"}', "application/json")
            return
        self._in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self._in_flight)
        try:
            await self._pass_gate()
            await self._stream(payload, writer)
        finally:
            self._in_flight -= 1

    async def _pass_gate(self) -> None:
        if self._gate_open is None:
            self._gate_open = asyncio.Event()
        if self._in_flight >= self.behaviour.gate:
            self._gate_open.set()
        try:
            await asyncio.wait_for(self._gate_open.wait(), GATE_TIMEOUT_S)
        except TimeoutError:
            self._gate_open.set()

    async def _stream(self, payload: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        n = int(payload["max_tokens"])
        prompt_tokens = len(payload["prompt"].split())
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
            b"Connection: close\r\n\r\n"
        )
        await _chunk(writer, b": keep-alive\n\n")
        for i in range(n):
            frame = _frame({"object": "text_completion", "choices": [{"index": 0, "text": token_text(i)}]})
            if i % 2:  # odd tokens use CRLF line endings
                frame = frame.replace(b"\n", b"\r\n")
            cut = len(frame) // 2  # split every frame across two network writes
            await _chunk(writer, frame[:cut])
            await asyncio.sleep(0)
            await _chunk(writer, frame[cut:])
        last: dict[str, Any] = {
            "object": "text_completion",
            "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
        }
        if self.behaviour.send_usage:
            last["usage"] = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": n,
                "total_tokens": n + prompt_tokens,
            }
        if self.behaviour.send_timings:
            last["timings"] = {
                "mode": "fake",
                "queue_time_ms": 1.0,
                "time_to_first_token_ms": 3.0,
                "decode_time_ms": 4.0,
                "held_time_ms": 0.5,
                "e2e_time_ms": 7.5,
                "num_steps": n,
                "batch_id": 0,
            }
        await _chunk(writer, _frame(last) + b"data: [DONE]\n\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        labels = {"mode": "fake", "model_name": "fake-model"}
        self.steps.labels(**labels).inc(n)
        self.held.labels(**labels).inc(HELD_PER_REQUEST)
        self.gen.labels(**labels).inc(n)
        for _ in range(n):
            self.batch.labels(**labels).observe(BATCH_SIZE_PER_STEP)


def _frame(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def _chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
    await writer.drain()


async def _respond(writer: asyncio.StreamWriter, status: int, body: bytes, content_type: str) -> None:
    reason = {200: "OK", 404: "Not Found", 500: "Internal Server Error"}[status]
    writer.write(
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        f"Connection: close\r\n\r\n".encode()
        + body
    )
    await writer.drain()


def serve_forever(port: int) -> None:
    """Entry point for the subprocess the A/B driver starts."""
    asyncio.run(FakeServer()._main(port))


# Tests


def _config(base_url: str, **client: Any) -> RunConfig:
    return RunConfig(
        label="fake",
        client=ClientConfig(base_url=base_url, show_progress=False, seed=7, **client),
        arrivals=ArrivalConfig(request_rate=float("inf"), seed=0),
        slo=SLO(ttft_ms=60_000.0),
    )


def _specs(n: int = 6) -> list[RequestSpec]:
    return build_workload(
        WorkloadConfig(
            name="mixed",
            num_prompts=n,
            seed=3,
            short_output=4,
            long_output_min=9,
            long_output_max=12,
            long_fraction=0.5,
        )
    )


def test_records_every_token_usage_and_server_timings() -> None:
    specs = _specs()
    with FakeServer() as server:
        result = asyncio.run(run_benchmark(specs, _config(server.base_url)))
    assert [r.index for r in result.records] == [s.index for s in specs]
    for spec, record in zip(specs, result.records, strict=True):
        assert record.ok, record.error
        assert record.output_tokens == spec.max_tokens
        assert len(record.chunk_times) == spec.max_tokens
        assert record.text == "".join(token_text(i) for i in range(spec.max_tokens))
        assert record.usage_reported
        assert record.prompt_tokens == len(spec.prompt.split())
        assert record.finish_reason == "length"
        assert record.server_timings is not None and record.server_timings["mode"] == "fake"
        assert record.send_time <= record.chunk_times[0] <= record.chunk_times[-1] <= record.end_time
    summary = result.summary
    assert summary.completed == len(specs) and summary.failed == 0
    assert summary.output_tokens == sum(s.max_tokens for s in specs)
    assert summary.queue_ms is not None and summary.queue_ms.mean == pytest.approx(1.0)
    assert summary.goodput == summary.request_throughput  # the 60 s TTFT target is met by every request
    # /metrics deltas cover the measured requests only, not the warm-up request.
    metrics = result.server_metrics
    assert metrics is not None
    assert metrics.steps == summary.output_tokens
    assert metrics.mean_batch_size == pytest.approx(BATCH_SIZE_PER_STEP)
    assert metrics.held_seats == HELD_PER_REQUEST * len(specs)
    assert metrics.generation_tokens == summary.output_tokens


def test_sends_openai_streaming_request_with_ignore_eos_and_per_request_seed() -> None:
    specs = _specs(3)
    with FakeServer() as server:
        asyncio.run(run_benchmark(specs, _config(server.base_url, model="m")))
    # The first payload is the warm-up; the rest arrive in any order, and the seed tells which is which.
    measured = sorted(server.payloads[1:], key=lambda p: p["seed"])
    for spec, payload in zip(specs, measured, strict=True):
        assert payload["stream"] is True
        assert payload["stream_options"] == {"include_usage": True}
        assert payload["ignore_eos"] is True
        assert payload["max_tokens"] == spec.max_tokens
        assert payload["seed"] == 7 + spec.index
        assert payload["model"] == "m"


def test_natural_stopping_and_transformers_policies_change_the_payload() -> None:
    specs = _specs(2)
    with FakeServer() as server:
        asyncio.run(run_benchmark(specs, _config(server.base_url, eos_policy=EosPolicy.NATURAL)))
        asyncio.run(run_benchmark(specs, _config(server.base_url, eos_policy=EosPolicy.HF_MIN_NEW_TOKENS)))
    natural, hf = server.payloads[1:3], sorted(server.payloads[4:6], key=lambda p: p["seed"])
    assert all("ignore_eos" not in p and "generation_config" not in p for p in natural)
    for spec, payload in zip(specs, hf, strict=True):
        assert "ignore_eos" not in payload
        assert json.loads(payload["generation_config"])["min_new_tokens"] == spec.max_tokens


def test_counts_text_chunks_when_the_server_sends_no_usage() -> None:
    specs = _specs(4)
    with FakeServer(FakeBehaviour(send_usage=False, send_timings=False)) as server:
        result = asyncio.run(run_benchmark(specs, _config(server.base_url)))
    for spec, record in zip(specs, result.records, strict=True):
        assert record.ok
        assert not record.usage_reported
        assert record.output_tokens == spec.max_tokens
        assert record.server_timings is None
    assert result.summary.queue_ms is None


def test_http_errors_are_recorded_not_raised() -> None:
    specs = [RequestSpec(0, "fine prompt", 3, 2, "x"), RequestSpec(1, "please FAIL", 3, 2, "x")]
    with FakeServer(FakeBehaviour(fail_marker="FAIL")) as server:
        result = asyncio.run(run_benchmark(specs, _config(server.base_url)))
    ok, bad = result.records
    assert ok.ok and ok.output_tokens == 3
    assert bad.error is not None and bad.error.startswith("HTTP 500")
    assert result.summary.completed == 1 and result.summary.failed == 1
    assert result.summary.errors == (bad.error,)


@pytest.mark.parametrize("cap", [2, 3])
def test_max_concurrency_caps_requests_in_flight(cap: int) -> None:
    """The server holds the answers until `cap` requests are in flight, so the client must reach the cap (a serial
    one never does) and never pass it."""
    specs = build_workload(WorkloadConfig(name="uniform", num_prompts=8, input_len=4, output_len=6))
    with FakeServer(FakeBehaviour(gate=cap)) as server:
        config = replace(_config(server.base_url, max_concurrency=cap), warmup_requests=0)  # a lone warm-up: no gate
        asyncio.run(run_benchmark(specs, config))
    assert server.max_in_flight == cap


def test_serve_bench_cli_prints_table_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run.json"
    with FakeServer() as server:
        code = serve_bench.main([
            "--base-url", server.base_url, "--workload", "uniform", "--num-prompts", "4", "--input-len", "5",
            "--output-len", "3", "--request-rate", "1000", "--no-progress", "--goodput", "ttft:60000",
            "e2e:60000", "--out", str(out),
        ])  # fmt: skip
    assert code == 0
    assert "Successful requests:" in capsys.readouterr().out
    document = json.loads(out.read_text())
    assert document["model"] == "fake-model"  # discovered from /v1/models
    run = RunResult.from_dict(document["result"])
    assert run.summary.completed == 4
    assert run.summary.output_tokens == 12
    assert all(r.output_tokens == 3 for r in run.records)


@pytest.mark.slow
def test_ab_driver_starts_measures_and_stops_a_server_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); from tests.benchmarks.online.test_e2e import serve_forever; "
    )
    code += "serve_forever(int(sys.argv[1]))"
    target = Target("dynamic", (sys.executable, "-c", code, "{port}"), EosPolicy.IGNORE_EOS, "fake")
    args = serve_bench.build_parser().parse_args(
        [
            "--workload",
            "uniform",
            "--num-prompts",
            "3",
            "--input-len",
            "4",
            "--output-len",
            "2",
            "--no-progress",
        ]
    )
    outcome = ab.run_target(
        target,
        build_workload(workload_config(args)),
        ab.config_factory(args),
        (1000.0, float("inf")),
        tmp_path / "raw" / "dynamic.server.log",
        LaunchConfig(argv=("x",), health_timeout_s=60, stop_grace_s=5),
    )
    assert outcome.error is None
    assert outcome.main is not None and outcome.main.summary.completed == 3
    assert [r.request_rate for r in outcome.sweep] == [1000.0, float("inf")]
    assert str(ROOT) in outcome.command
    log = tmp_path / "raw" / "dynamic.server.log"  # a start's minutes of progress go there: the console says so
    assert f"dynamic: starting its server; its progress: {log}" in capsys.readouterr().err
    written = write_report(
        ABOutcome("cmd", {}, {"dynamic": outcome.command}, {}, {"dynamic": outcome.main}, {"dynamic": outcome.sweep}),
        tmp_path,
    )
    assert written["report.md"].exists() and (tmp_path / "sweep.png").exists()


def test_ab_driver_reports_a_server_that_fails_to_start(tmp_path: Path) -> None:
    target = Target("broken", (sys.executable, "-c", "import sys; print('no model'); sys.exit(3)"), EosPolicy.NATURAL)
    args = serve_bench.build_parser().parse_args(["--num-prompts", "1", "--no-progress"])
    outcome = ab.run_target(target, [], ab.config_factory(args), (), tmp_path / "broken.log", LaunchConfig(argv=("x",)))
    assert outcome.main is None
    assert outcome.error is not None and "exited with code 3" in outcome.error and "no model" in outcome.error


if __name__ == "__main__":
    serve_forever(int(sys.argv[1]))


def test_a_conversation_turn_is_sent_after_the_previous_answer_with_the_whole_history() -> None:
    specs = build_workload(WorkloadConfig(name="multi-turn", num_prompts=6, turns=3, system_prompt_words=8))
    with FakeServer() as server:
        result = asyncio.run(run_benchmark(specs, _config(server.base_url)))
    assert all(record.ok for record in result.records)
    prompts = [payload["prompt"] for payload in server.payloads[1:]]  # after the warm-up
    by_index = {record.index: record for record in result.records}
    for spec in specs:
        if spec.follows is None:
            continue
        previous = by_index[spec.follows]
        sent = next(p for p in prompts if p.endswith(spec.prompt) and len(p) > len(spec.prompt))
        assert sent.endswith(previous.text + spec.prompt)  # the previous prompt, its answer, the new message
        assert by_index[spec.index].send_time >= previous.end_time  # only after the previous answer ended
