"""Per-request phases from server timings, and from client times when the server sends none."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.loadgen.client import RequestRecord
from benchmarks.loadgen.phases import ServerTimings, request_phases


def make(timings: dict[str, Any] | None, error: str | None = None) -> RequestRecord:
    return RequestRecord(
        index=0,
        kind="x",
        max_tokens=3,
        prompt_tokens_est=4,
        scheduled_time=1.0,
        send_time=1.0,
        first_token_time=1.2,
        chunk_times=(1.2, 1.3, 1.5),
        end_time=1.8,
        output_tokens=3,
        prompt_tokens=4,
        usage_reported=True,
        server_timings=timings,
        finish_reason="length",
        text="abc",
        error=error,
    )


BATCHSERVE = {
    "mode": "dynamic",
    "queue_time_ms": 100.0,
    "time_to_first_token_ms": 150.0,  # counts the queue, as vLLM's does
    "decode_time_ms": 300.0,
    "held_time_ms": 250.0,
    "e2e_time_ms": 700.0,
    "num_steps": 3,
    "batch_id": 5,
}


def test_server_timings_split_into_phases() -> None:
    phases = request_phases(make(BATCHSERVE))
    assert phases is not None and phases.source == "server"
    assert (phases.waiting, phases.prefill, phases.decoding, phases.held) == pytest.approx((0.1, 0.05, 0.3, 0.25))
    assert phases.end == pytest.approx(1.7)


def test_ttft_measured_from_scheduling_is_not_double_counted() -> None:
    from_scheduled = {**BATCHSERVE, "time_to_first_token_ms": 50.0}  # 100 + 50 + 300 + 250 = 700
    timings = ServerTimings.parse(from_scheduled)
    assert timings is not None and timings.prefill_ms == 50.0


def test_client_times_when_server_sends_no_timings() -> None:
    phases = request_phases(make(None))
    assert phases is not None and phases.source == "client"
    assert (phases.waiting, phases.prefill, phases.decoding, phases.held) == pytest.approx((0.0, 0.2, 0.3, 0.3))


def test_foreign_timings_object_is_ignored() -> None:
    llama_cpp = {"prompt_n": 4, "prompt_ms": 12.0, "predicted_n": 3, "predicted_ms": 30.0}
    assert ServerTimings.parse(llama_cpp) is None
    phases = request_phases(make(llama_cpp))
    assert phases is not None and phases.source == "client"


def test_failed_request_has_no_phases() -> None:
    assert request_phases(make(None, error="HTTP 500")) is None
