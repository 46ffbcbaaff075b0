"""Prometheus scrape parsing and before/after deltas."""

from __future__ import annotations

import pytest

from benchmarks.loadgen.prom import metrics_delta, parse_metrics

L = '{mode="dynamic",model_name="m"}'


def exposition(steps: float, held: float, bs_sum: float, bs_count: float, ttft_sum: float, ttft_count: float) -> str:
    return f"""\
# HELP batchserve:steps_total Engine steps
# TYPE batchserve:steps_total counter
batchserve:steps_total{L} {steps}
# HELP batchserve:held_seats_total Held seat-steps
# TYPE batchserve:held_seats_total counter
batchserve:held_seats_total{L} {held}
# HELP batchserve:batch_size Sequences per step
# TYPE batchserve:batch_size histogram
batchserve:batch_size_bucket{{le="1.0",mode="dynamic",model_name="m"}} 2.0
batchserve:batch_size_bucket{{le="+Inf",mode="dynamic",model_name="m"}} {bs_count}
batchserve:batch_size_sum{L} {bs_sum}
batchserve:batch_size_count{L} {bs_count}
# HELP vllm:time_to_first_token_seconds TTFT
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{le="+Inf",mode="dynamic",model_name="m"}} {ttft_count}
vllm:time_to_first_token_seconds_sum{L} {ttft_sum}
vllm:time_to_first_token_seconds_count{L} {ttft_count}
# HELP vllm:num_requests_running Running
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{L} 0.0
"""


BEFORE = exposition(steps=10, held=4, bs_sum=30, bs_count=10, ttft_sum=0.5, ttft_count=2)
AFTER = exposition(steps=30, held=16, bs_sum=90, bs_count=30, ttft_sum=1.5, ttft_count=6)


def test_parse_keeps_counters_sums_and_counts_drops_buckets() -> None:
    parsed = parse_metrics(BEFORE)
    assert parsed["batchserve:steps_total"] == 10.0
    assert parsed["batchserve:batch_size_sum"] == 30.0
    assert parsed["batchserve:batch_size_count"] == 10.0
    assert parsed["vllm:num_requests_running"] == 0.0
    assert not any(name.endswith("_bucket") for name in parsed)


def test_parse_sums_over_label_sets() -> None:
    text = 'x_total{a="1"} 2\nx_total{a="2"} 3\n'
    assert parse_metrics(text)["x_total"] == 5.0


def test_delta_gives_steps_mean_batch_size_and_held_seats() -> None:
    delta = metrics_delta(parse_metrics(BEFORE), parse_metrics(AFTER))
    assert delta.steps == 20.0
    assert delta.mean_batch_size == pytest.approx(60.0 / 20.0)
    assert delta.held_seats == 12.0
    assert delta.mean_ttft_ms == pytest.approx(1.0 / 4.0 * 1e3)
    assert delta.generation_tokens is None  # not exported by this server
    assert delta.mean_queue_ms is None


def test_missing_held_seat_counter_means_zero_on_batchserve_and_unknown_elsewhere() -> None:
    without_held = {k: v for k, v in parse_metrics(AFTER).items() if not k.startswith("batchserve:held")}
    assert metrics_delta(parse_metrics(BEFORE), without_held).held_seats == 0.0
    assert metrics_delta({}, {"vllm:num_requests_running": 0.0}).held_seats is None


def test_delta_with_no_steps_has_no_mean_batch_size() -> None:
    parsed = parse_metrics(BEFORE)
    assert metrics_delta(parsed, parsed).mean_batch_size is None
