"""The profile's served probe: lone requests through a real server, split into the served step and the rest."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from benchmarks.loadgen.client import RequestRecord
from benchmarks.sim.cost.files import BusyArrival, load_busy_arrival, load_fitted, load_request_overhead
from benchmarks.sim.cost.model import FittedCostModel, StepShape, chunk_attention_pairs
from benchmarks.sim.cost.served import load_served_extras, served_extra
from benchmarks.sim.profiling import cli as fit_cost
from benchmarks.sim.profiling.engine_replay import AloneReplay
from benchmarks.sim.profiling.served_probe import LOAD_PROBE_MAX_TOKENS, ServedLoad, serve_argv, split, split_busy
from benchmarks.sim.profiling.steps import AFTER_LARGE_STEPS


def _lone(index: int, client_ttft: float, server_ttft_ms: float, queue_ms: float, decode_ms: float) -> RequestRecord:
    timings = {"time_to_first_token_ms": server_ttft_ms, "queue_time_ms": queue_ms, "decode_time_ms": decode_ms}
    return RequestRecord(
        index=index, kind="probe", max_tokens=5, prompt_tokens_est=30, scheduled_time=0.0, send_time=0.0,
        first_token_time=client_ttft, chunk_times=(client_ttft,), end_time=client_ttft + 0.1, output_tokens=5,
        prompt_tokens=31, usage_reported=True, server_timings=timings, finish_reason="length", text="", error=None,
    )  # fmt: skip


def test_split_takes_the_served_step_out_of_the_clients_ttft() -> None:
    records = [
        _lone(0, 0.060, server_ttft_ms=50.0, queue_ms=4.0, decode_ms=40.0),  # step 46 ms, 14 ms outside
        _lone(1, 0.050, server_ttft_ms=44.0, queue_ms=2.0, decode_ms=32.0),  # step 42 ms, 8 ms outside
        _lone(2, 0.070, server_ttft_ms=60.0, queue_ms=3.0, decode_ms=36.0),  # step 57 ms, 13 ms outside
    ]
    probe = split(records)
    assert probe.prefill_s == pytest.approx(0.046)
    assert probe.outside_step_s == pytest.approx(0.013)
    assert probe.decode_step_s == pytest.approx(0.009)  # 36 ms over the 4 tokens after the first
    assert (probe.prompt_tokens, probe.count) == (31, 3)


def test_split_refuses_a_failed_probe_request() -> None:
    failed = _lone(1, 0.05, 44.0, 2.0, 32.0)
    with pytest.raises(RuntimeError, match="probe request 1 failed"):
        split([_lone(0, 0.05, 44.0, 2.0, 32.0), RequestRecord(**{**failed.to_dict(), "error": "HTTP 500"})])


def _background(step_s: float, tokens: int = 50) -> RequestRecord:
    lone = _lone(99, 0.05, 45.0, 1.0, 400.0)
    chunks = tuple(0.05 + step_s * i for i in range(tokens))
    return dataclasses.replace(lone, chunk_times=chunks, output_tokens=tokens, end_time=chunks[-1])


def test_split_busy_measures_the_stall_and_the_slower_path_against_idle_requests() -> None:
    idle = [_lone(i, 0.040 + 0.001 * i, server_ttft_ms=30.0 + i, queue_ms=1.0, decode_ms=40.0) for i in range(3)]
    # client minus server TTFT: 10 ms idle; 18 ms busy. Queue: 1 ms idle, 12 ms busy, with 10 ms background steps
    busy = [_lone(i, 0.060 + 0.001 * i, server_ttft_ms=42.0 + i, queue_ms=12.0, decode_ms=40.0) for i in range(3)]
    measured = split_busy(idle, busy, _background(0.010))
    assert measured.stall_s == pytest.approx(0.012 - 0.001 - 0.005)  # beyond the half step an arrival waits
    assert measured.outside_s == pytest.approx(0.018 - 0.010)
    # a busy phase that found nothing slower measures nothing, rather than a negative cost
    assert split_busy(busy, idle, _background(0.010)) == BusyArrival(0.0, 0.0)


def test_split_busy_takes_the_step_from_gaps_with_no_probe_request_in_flight() -> None:
    idle = [_lone(0, 0.040, server_ttft_ms=30.0, queue_ms=1.0, decode_ms=40.0)]
    busy = [dataclasses.replace(_lone(0, 0.3, 42.0, 12.0, 40.0), send_time=0.1, end_time=0.9)]
    # 10 ms one-row steps, but 30 ms ones while the probe request ran beside the stream (0.1-0.9 s): most gaps
    times, t = [], 0.05
    while t < 0.95:
        times.append(t)
        t += 0.030 if 0.1 <= t < 0.9 else 0.010
    background = dataclasses.replace(_background(0.010), chunk_times=tuple(times), end_time=times[-1])
    assert split_busy(idle, busy, background).stall_s == pytest.approx(0.012 - 0.001 - 0.005)


def test_split_busy_refuses_requests_sent_after_the_background_ended() -> None:
    idle = [_lone(0, 0.040, 30.0, 1.0, 40.0)]
    late = [dataclasses.replace(_lone(i, 0.06, 42.0, 12.0, 40.0), send_time=5.0 + i) for i in range(3)]
    on_time = dataclasses.replace(late[0], send_time=0.1)
    with pytest.raises(RuntimeError, match="ended before 3 of its 3 requests"):
        split_busy(idle, late, _background(0.010))
    assert split_busy(idle, [on_time, late[1]], _background(0.010)).stall_s > 0  # half of them beside it: enough


def test_split_busy_refuses_a_failed_background_or_request() -> None:
    idle = [_lone(0, 0.04, 30.0, 1.0, 40.0)]
    with pytest.raises(RuntimeError, match="background stream failed"):
        split_busy(idle, idle, _background(0.010, tokens=2))
    failed = RequestRecord(**{**idle[0].to_dict(), "error": "HTTP 500"})
    with pytest.raises(RuntimeError, match="probe request 0 failed"):
        split_busy(idle, [failed], _background(0.010))


def test_serve_argv_passes_only_what_differs_from_serves_defaults() -> None:
    args = argparse.Namespace(
        model="/m", dtype="float32", cpu_kernels=False, max_model_len=1024, mode="dynamic", port=9, host="h"
    )
    argv = serve_argv(args, skip=("mode", "host", "port"))
    assert argv == ["--model", "/m", "--max-model-len", "1024", "--no-cpu-kernels", "--dtype", "float32"]


@pytest.mark.slow
def test_profile_measures_a_served_server_and_the_simulator_reads_it(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """End to end on the tiny model: the profile starts a real `batchserve serve` with its engine flags."""
    out = tmp_path / "cost.json"
    argv = ["--out", str(out), "--model", str(tiny_checkpoint), "--dtype", "float32", "--quantization", "none"]
    grid = ["--batch-sizes", "1,2,4", "--prefill-tokens", "0,8", "--contexts", "16,32", "--repeats", "1"]
    probes = ["--cold-repeats", "1", "--after-large-repeats", "1", "--served-probes", "2", "--served-gap-s", "0.3"]
    load = ["--served-load-requests", "6", "--served-load-seats", "3", "--served-load-modes", "continuous,dynamic"]
    assert fit_cost.main([*argv, *grid, *probes, *load]) == 0
    document = json.loads(out.read_text())
    served = document["served"]
    assert served["count"] == 2 and served["prompt_tokens"] > 0
    assert served["prefill_s"] > 0 and served["decode_step_s"] > 0
    assert load_request_overhead(out) == served["outside_step_s"] > 0  # HTTP and SSE take some time
    # the busy phase (the same lone requests beside one long stream) is stored and read back as measured
    assert load_busy_arrival(out) == BusyArrival(served["busy_stall_s"], served["busy_outside_s"])
    model = load_fitted(out)
    assert isinstance(model, FittedCostModel)  # float32: one regime
    # the transient after a prefill is measured and stored, though one regime has no weights to switch back to
    assert len(document["engine_after_large_ms"]) == AFTER_LARGE_STEPS
    assert all(ms >= 0 for ms in document["engine_after_large_ms"])
    # a burst through a server of each mode, then the same requests on the engine alone
    extras = load_served_extras(out)
    assert set(served["load"]) == set(extras) == {"continuous", "dynamic"}
    for mode, entry in served["load"].items():
        alone = entry["alone"]
        assert (entry["seats"], entry["requests"]) == (3, 6), mode
        assert alone["generated_tokens"] == 6 * LOAD_PROBE_MAX_TOKENS, mode  # every answer ran to its length
        # 3 seats at a time (the cache holds them): two seats could give at most 2 tokens a step. Arrivals replay
        # as the server stamped them, so a staggered burst takes a few steps past two waves' 2 x (96 + 1)
        assert alone["steps"] < alone["generated_tokens"] // 2, mode
        assert 0 < alone["engine_s"] <= alone["span_s"] and entry["served_span_s"] > 0, mode
        rebuilt = ServedLoad(3, (), entry["served_span_s"])
        assert extras[mode] == served_extra(rebuilt, AloneReplay(**alone)), mode  # stored as measured
    tokens = served["prompt_tokens"]
    lone = StepShape(1, tokens, 1, chunk_attention_pairs(0, tokens), tokens)
    # the prefill's cold cost is the served lone prefill beyond the warm served step (the fit plus what serving
    # adds to a continuous step), not the engine-alone probe's
    warm_served = model.step_time(lone) + extras["continuous"].seconds(lone)
    assert model.cold_step_s == pytest.approx(max(0.0, served["prefill_s"] - warm_served))
