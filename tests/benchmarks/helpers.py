"""What benchmark test modules share: synthetic runs with known figures, for the report and the A/B tables."""

from __future__ import annotations

import math

from benchmarks.loadgen.client import RequestRecord
from benchmarks.loadgen.prom import ScrapedMetrics
from benchmarks.loadgen.run import RunResult
from benchmarks.loadgen.summaries import summarize


def synthetic_record(i: int, send: float, ttft: float, decode: float, held: float, with_timings: bool) -> RequestRecord:
    first = send + ttft
    chunks = tuple(first + decode * k / 3 for k in range(4))
    timings = {
        "mode": "x",
        "queue_time_ms": ttft * 400,
        "time_to_first_token_ms": ttft * 1e3,
        "decode_time_ms": decode * 1e3,
        "held_time_ms": held * 1e3,
        "e2e_time_ms": (ttft + decode + held) * 1e3,
        "num_steps": 4,
        "batch_id": i // 2,
    }
    return RequestRecord(
        index=i,
        kind="short",
        max_tokens=4,
        prompt_tokens_est=10,
        scheduled_time=send,
        send_time=send,
        first_token_time=first,
        chunk_times=chunks,
        end_time=chunks[-1] + held,
        output_tokens=4,
        prompt_tokens=10,
        usage_reported=True,
        server_timings=timings if with_timings else None,
        finish_reason="length",
        text="abcd",
        error=None,
    )


def synthetic_run(label: str, scale: float, held: float, rate: float = math.inf, timings: bool = True) -> RunResult:
    records = tuple(synthetic_record(i, 0.05 * i, 0.1 * scale, 0.3 * scale, held, timings) for i in range(6))
    duration = max(r.end_time for r in records)
    metrics = ScrapedMetrics(
        steps=40.0,
        mean_batch_size=2.0 / scale,
        held_seats=12.0 if held else 0.0,
        prompt_tokens=60.0,
        generation_tokens=24.0,
        mean_ttft_ms=None,
        mean_queue_ms=None,
    )
    return RunResult(label, rate, 1.0, summarize(records, duration), metrics if timings else None, records)
