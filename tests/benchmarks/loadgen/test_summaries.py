"""Percentiles, per-request latencies and run summaries, checked against numpy and hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.loadgen.client import RequestRecord
from benchmarks.loadgen.summaries import SLO, Summary, percentile, summarize

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


@settings(deadline=None)  # a busy machine must not fail a correct percentile
@given(st.lists(finite, min_size=1, max_size=60), st.floats(min_value=0, max_value=100))
def test_percentile_matches_numpy_linear(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-9, abs=1e-6)


@pytest.mark.parametrize("q", [0, 10, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy_on_fixed_data(q: float) -> None:
    values = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([10.0, 20.0], 50) == 15.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile([42.0], 99) == 42.0


def test_percentile_rejects_empty_and_out_of_range() -> None:
    with pytest.raises(ValueError, match="percentile of an empty sequence"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"q must be in \[0, 100\], got 101"):
        percentile([1.0], 101)


def record(
    index: int,
    send: float,
    chunks: list[float],
    end: float,
    tokens: int | None = None,
    prompt_tokens: int | None = 10,
    error: str | None = None,
    timings: dict[str, float] | None = None,
) -> RequestRecord:
    return RequestRecord(
        index=index,
        kind="x",
        max_tokens=len(chunks),
        prompt_tokens_est=8,
        scheduled_time=send,
        send_time=send,
        first_token_time=chunks[0] if chunks else None,
        chunk_times=tuple(chunks),
        end_time=end,
        output_tokens=len(chunks) if tokens is None else tokens,
        prompt_tokens=prompt_tokens,
        usage_reported=tokens is not None,
        server_timings=timings,
        finish_reason=None if error else "length",
        text="",
        error=error,
    )


def test_request_latencies_follow_vllm_definitions() -> None:
    r = record(0, send=1.0, chunks=[1.5, 1.7, 2.0], end=2.1)
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(1.1)
    assert r.tpot == pytest.approx((1.1 - 0.5) / 2)
    assert r.itls == pytest.approx([0.2, 0.3])
    assert record(1, 0.0, [0.4], 0.5).tpot is None  # one token: no time per output token


def test_summary_on_synthetic_records() -> None:
    timings = {
        "queue_time_ms": 5.0,
        "time_to_first_token_ms": 50.0,
        "decode_time_ms": 10.0,
        "held_time_ms": 2.0,
        "e2e_time_ms": 62.0,
    }
    records = [
        # ttft 0.1, e2e 0.4, tokens 4 -> tpot 0.1, itls .1 .1 .1
        record(0, 0.0, [0.1, 0.2, 0.3, 0.4], 0.4, tokens=4, prompt_tokens=10, timings=timings),
        # ttft 0.3, e2e 0.5, tokens 2 -> tpot 0.2, itl .2; no usage: prompt tokens from the estimate (8)
        record(1, 0.5, [0.8, 1.0], 1.0, prompt_tokens=None),
        record(2, 0.2, [], 0.3, error="HTTP 500: boom"),
    ]
    s = summarize(records, duration_s=2.0, slo=SLO(ttft_ms=200))
    assert (s.completed, s.failed) == (2, 1)
    assert s.input_tokens == 10 + 8
    assert s.output_tokens == 6
    assert s.request_throughput == pytest.approx(1.0)
    assert s.output_throughput == pytest.approx(3.0)
    assert s.total_token_throughput == pytest.approx(12.0)
    assert s.goodput == pytest.approx(0.5)  # only request 0 has TTFT under 200 ms
    assert s.ttft_ms is not None and s.ttft_ms.count == 2
    # ttft values 100 and 300 ms: p90 = 100 + 0.9 * 200, p99 = 100 + 0.99 * 200
    assert (s.ttft_ms.mean, s.ttft_ms.p50, s.ttft_ms.p90, s.ttft_ms.p99) == pytest.approx((200, 200, 280, 298))
    assert s.e2e_ms is not None and s.e2e_ms.mean == pytest.approx(450.0)
    assert s.tpot_ms is not None and s.tpot_ms.mean == pytest.approx(150.0)
    assert s.itl_ms is not None and s.itl_ms.count == 4 and s.itl_ms.mean == pytest.approx(125.0)
    assert s.itl_ms.p50 == pytest.approx(100.0)
    assert s.queue_ms is not None and s.queue_ms.count == 1 and s.queue_ms.mean == 5.0
    assert s.held_ms is not None and s.held_ms.mean == 2.0
    assert s.errors == ("HTTP 500: boom",)


def test_summary_round_trips_through_dict() -> None:
    s = summarize([record(0, 0.0, [0.1, 0.2], 0.3)], duration_s=1.0)
    assert Summary.from_dict(s.to_dict()) == s
    assert s.goodput is None  # no SLO, no goodput


def test_slo_parsing_and_checks() -> None:
    slo = SLO.parse(["ttft:500", "e2el:10000", "tpot:50"])
    assert slo == SLO(ttft_ms=500.0, tpot_ms=50.0, e2e_ms=10000.0)
    fast = record(0, 0.0, [0.1, 0.12, 0.14], 0.15)
    slow_tpot = record(1, 0.0, [0.1, 0.3, 0.5], 0.5)
    assert slo.met_by(fast)
    assert not slo.met_by(slow_tpot)
    assert not slo.met_by(record(2, 0.0, [], 0.1, error="x"))
    assert not SLO(ttft_ms=1000).met_by(record(3, 0.0, [], 0.1))  # no token, no TTFT
    assert not SLO(itl_ms=150).met_by(slow_tpot)
    with pytest.raises(ValueError, match="bad SLO 'latency:5'"):
        SLO.parse(["latency:5"])
    with pytest.raises(ValueError, match="SLO ttft must be > 0 ms"):
        SLO.parse(["ttft:-1"])
