"""The simulator: it makes exactly the real engine's scheduling decisions, and its CLI writes what `benchmarks ab`
writes.

The decision-equality tests run the production `Scheduler` twice on the same request sequence, with the same
virtual clock driver (`benchmarks.sim.cluster.Replica`) and the same step-cost model: once over the real `Engine`
on a tiny random Llama (its step also advances the clock by the model's cost), once over `SimEngine`, told only
each request's lengths and where the real model stopped on its own. Every step's schedule, the running, waiting
and held sets after it, every preemption and every request's timings must be identical.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from benchmarks.loadgen.client import RequestRecord
from benchmarks.loadgen.run import RunResult
from benchmarks.loadgen.trace import (
    TraceRequest,
    export_runs,
    from_records,
    read_exported,
    read_trace,
    write_trace,
)
from benchmarks.loadgen.workloads import RequestSpec
from benchmarks.sim import cli as simulate
from benchmarks.sim.cost.files import BusyArrival, load_busy_arrival, save_fitted
from benchmarks.sim.cost.model import COLD_AFTER_S, StepShape, fit_cost_model
from benchmarks.sim.engine import SimEngine, VirtualClock
from benchmarks.sim.run import SimSettings, simulate_trace
from engine.config import EngineConfig
from engine.sample.sampling_params import SamplingParams
from scheduler.config import Mode, SchedulerConfig
from scheduler.request import Outcome
from tests.benchmarks.sim.helpers import (
    COST,
    Req,
    assert_same_decisions,
    requests,
    run_real,
    with_natural_stops,
    write_cost,
)


@pytest.mark.parametrize("mode", [Mode.DYNAMIC, Mode.CONTINUOUS])
def test_simulated_engine_makes_the_real_engines_decisions_with_natural_stops(
    tiny_llama: PreTrainedModel, mode: Mode
) -> None:
    engine_config = EngineConfig(max_rows=4, kv_cache_tokens=1024, block_size=16, max_model_len=128)
    config = SchedulerConfig(
        mode=mode, max_batch_size=4, batch_timeout_ms=30, max_num_seqs=4, max_num_batched_tokens=48
    )
    reqs = with_natural_stops(tiny_llama, engine_config, config, requests(1, 14, 40, 14, 0.02))
    real = assert_same_decisions(tiny_llama, engine_config, config, reqs)
    outcomes = [r[0] for r in real.requests.values()]
    assert Outcome.STOPPED in outcomes and Outcome.LENGTH in outcomes
    if mode is Mode.DYNAMIC:
        assert any(step[5] > 0 for step in real.steps), "no seat was ever held: the case does not test the bus"
        assert len({r[3][1] for r in real.requests.values()}) > 2, "expected several buses"
    else:  # prompts joined running sequences: a step mixed a prefill chunk with decodes
        assert any(len(s) > 1 and any(count > 1 for _, count in s) for s in real.schedules)


def test_simulated_engine_makes_the_real_engines_decisions_under_preemption(tiny_llama: PreTrainedModel) -> None:
    # Six 16-token blocks for four seats: growing sequences run out of cache and the newest is preempted. Without
    # a prefix cache here (the next tests have one: a preempted request finds its own blocks again).
    engine_config = EngineConfig(
        max_rows=4, kv_cache_tokens=96, block_size=16, max_model_len=128, enable_prefix_caching=False
    )
    config = SchedulerConfig(mode=Mode.CONTINUOUS, max_num_seqs=4, max_num_batched_tokens=32)
    reqs = [r for r in requests(2, 12, 30, 40, 0.01) if len(r.prompt) + r.max_tokens <= 96]
    real = assert_same_decisions(tiny_llama, engine_config, config, reqs)
    assert any(r[3][0] > 0 for r in real.requests.values()), "no request was preempted"


def test_simulated_engine_makes_the_real_engines_decisions_when_the_bus_fills_the_cache(
    tiny_llama: PreTrainedModel,
) -> None:
    # Dynamic reserves whole lengths up front: a bus boards only as many as the cache holds, the rest wait.
    engine_config = EngineConfig(max_rows=4, kv_cache_tokens=128, block_size=16, max_model_len=128)
    config = SchedulerConfig(mode=Mode.DYNAMIC, max_batch_size=4, batch_timeout_ms=20)
    reqs = [r for r in requests(3, 10, 30, 30, 0.015) if len(r.prompt) + r.max_tokens <= 128]
    real = assert_same_decisions(tiny_llama, engine_config, config, reqs)
    assert any(0 < len(s) < 4 for s in real.schedules)


def sharing_requests(seed: int, count: int, spacing_s: float, max_output: int) -> list[Req]:
    """Prompts over three shared prefixes (1-3 blocks long), each with its own tail, some repeated whole."""
    generator = torch.Generator().manual_seed(seed)
    prefixes = [tuple(torch.randint(1, 159, (n,), generator=generator).tolist()) for n in (20, 35, 48)]
    reqs: list[Req] = []
    for i in range(count):
        tail = tuple(torch.randint(1, 159, (int(torch.randint(1, 20, (), generator=generator)),), generator=generator))
        prompt = reqs[i - 3].prompt if i % 5 == 4 else prefixes[i % 3] + tuple(int(t) for t in tail)
        max_tokens = int(torch.randint(2, max_output + 1, (), generator=generator))
        reqs.append(Req(0.0 if i < 3 else round(spacing_s * i, 3), prompt, max_tokens))
    return reqs


@pytest.mark.parametrize("mode", [Mode.DYNAMIC, Mode.CONTINUOUS])
def test_simulated_prefix_cache_makes_the_real_engines_decisions(tiny_llama: PreTrainedModel, mode: Mode) -> None:
    """With prefix caching on in both engines (the same BlockPool and PrefixCache code), the same prompts find the
    same cached blocks at the same moments: every step computes the same tokens."""
    engine_config = EngineConfig(max_rows=4, kv_cache_tokens=1024, block_size=16, max_model_len=128)
    assert engine_config.enable_prefix_caching
    config = SchedulerConfig(
        mode=mode, max_batch_size=4, batch_timeout_ms=30, max_num_seqs=4, max_num_batched_tokens=48
    )
    reqs = sharing_requests(4, 15, 0.03, 12)
    real = assert_same_decisions(tiny_llama, engine_config, config, reqs)
    without = run_real(tiny_llama, dataclasses.replace(engine_config, enable_prefix_caching=False), config, reqs)
    computed, computed_without = (sum(n for s in run.schedules for _, n in s) for run in (real, without))
    assert computed < computed_without - 100, "the case shares too little to test the cache"


def test_simulated_prefix_cache_makes_the_real_engines_decisions_under_preemption_and_eviction(
    tiny_llama: PreTrainedModel,
) -> None:
    """Seven blocks for four seats: sequences are preempted and resume from what of their own blocks is still
    cached, and parked blocks are evicted least recently released first, in both engines alike."""
    engine_config = EngineConfig(max_rows=4, kv_cache_tokens=112, block_size=16, max_model_len=112)
    config = SchedulerConfig(mode=Mode.CONTINUOUS, max_num_seqs=4, max_num_batched_tokens=32)
    reqs = [r for r in sharing_requests(5, 14, 0.01, 40) if len(r.prompt) + r.max_tokens <= 112]
    real = assert_same_decisions(tiny_llama, engine_config, config, reqs)
    assert any(r[3][0] > 0 for r in real.requests.values()), "no request was preempted"
    assert real.cache[1] > 0, "nothing was found in the cache"


# ----- the CLI, traces and replicas -----
def test_simulate_cli_writes_result_json_with_the_ab_schema(tmp_path: Path) -> None:
    cost = write_cost(tmp_path / "cost.json")
    out = tmp_path / "sim"
    argv = ["--cost-model", str(cost), "--num-prompts", "24", "--seats", "4", "--request-rate", "inf"]
    assert simulate.main([*argv, "--sweep-rates", "2,inf", "--out", str(out)]) == 0
    document = json.loads((out / "result.json").read_text())
    assert document["simulated"] is True and "fitted" in document["cost_model"]
    assert set(document["runs"]) == {"dynamic", "continuous"}
    for name, run in document["runs"].items():
        summary = run["summary"]
        assert summary["completed"] == 24 and summary["failed"] == 0, name
        assert summary["output_throughput"] > 0 and summary["ttft_ms"]["p50"] > 0 and summary["e2e_ms"]["p99"] > 0
        parsed = RunResult.from_dict(run)  # every reader of ab's result.json reads this one
        assert parsed.server_metrics is not None and parsed.server_metrics.steps
    assert document["runs"]["continuous"]["server_metrics"]["held_seats"] == 0
    assert document["simulated"] is True and "machine" not in document  # its hardware is the cost model
    assert set(document["code"]) == {"commit", "dirty"}  # but the code that simulated it is recorded
    assert document["runs"]["dynamic"]["server_metrics"]["held_seats"] > 0  # mixed: short answers wait for long
    assert document["ratios_continuous_over_dynamic"]["output tok/s"] > 0
    assert [len(document["sweep"][m]) for m in ("dynamic", "continuous")] == [2, 2]
    report = (out / "report.md").read_text()
    assert "SIMULATED" in report and "## Rate sweep" in report
    assert {p.name for p in out.iterdir()} >= {"timeline.png", "ttft_cdf.png", "e2e_cdf.png", "sweep.png"}


def test_replaying_a_runs_exported_traces_reproduces_it_with_zero_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run's exported trace (as `benchmarks ab --export-workload` writes it), replayed, gives that run again."""
    cost = write_cost(tmp_path / "cost.json")
    first = tmp_path / "first"
    argv = ["--cost-model", str(cost), "--seats", "4", "--num-prompts", "16", "--request-rate", "8"]
    assert simulate.main([*argv, "--out", str(first)]) == 0
    document = json.loads((first / "result.json").read_text())
    runs = {
        name: RunResult.from_dict(json.loads((first / "raw" / f"{name}.json").read_text())) for name in document["runs"]
    }
    folder = export_runs(first, runs, {})
    assert read_trace(folder / "dynamic.jsonl")[0].output_tokens is not None
    capsys.readouterr()
    assert simulate.main([*argv, "--replay", str(first)]) == 0
    table = capsys.readouterr().out.split("validation against")[1]
    rows = [line for line in table.splitlines() if line.startswith(("| dynamic", "| continuous"))]
    assert len(rows) == 10  # five metrics, two modes
    assert all(line.rstrip(" |").endswith(("+0.0%", "-0.0%", "n/a")) for line in rows), table


def test_a_closed_loop_replays_at_once_not_at_its_recorded_arrivals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A closed loop's recorded arrivals followed the server's own speed (each client sent when its answer came):
    `--replay-at-once` sends them all at time 0, the seats bounding how many run, so a faster simulated server
    finishes sooner instead of idling until the recorded arrivals."""
    cost = write_cost(tmp_path / "cost.json")
    trace = [TraceRequest(10.0 * i, 32, 16, output_tokens=16) for i in range(6)]  # one at a time, 10 s apart
    write_trace(trace, tmp_path / "run" / "workload" / "continuous.jsonl")
    argv = ["--cost-model", str(cost), "--mode", "continuous", "--seats", "2", "--replay", str(tmp_path / "run")]
    recorded = simulate.replay(simulate.build_parser().parse_args(argv), simulate.simulation_settings(
        simulate.build_parser().parse_args(argv))[1])[0]["continuous"]  # fmt: skip
    at_once_args = simulate.build_parser().parse_args([*argv, "--replay-at-once"])
    at_once = simulate.replay(at_once_args, simulate.simulation_settings(at_once_args)[1])[0]["continuous"]
    capsys.readouterr()
    assert recorded.summary.duration_s > 50  # waited for the last recorded arrival
    assert at_once.summary.duration_s < 10 and at_once.summary.completed == 6
    assert max(r.send_time for r in at_once.records) == 0.0
    assert at_once.server_metrics is not None and at_once.server_metrics.mean_batch_size == pytest.approx(2, abs=0.3)


def test_trace_files_round_trip_and_reject_bad_lines(tmp_path: Path) -> None:
    trace = [TraceRequest(0.0, 57, 200), TraceRequest(0.5, 12, 16, output_tokens=9)]
    path = write_trace(trace, tmp_path / "w.jsonl")
    assert read_trace(path) == trace
    assert read_exported(tmp_path).main == {"w": trace}
    (tmp_path / "bad.jsonl").write_text('{"arrival_s": 0, "prompt_tokens": 3}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        read_trace(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match="output_tokens"):
        TraceRequest(0.0, 5, 4, output_tokens=5)


def _sent(index: int, send: float, stamp: float | None, ok: bool = True) -> RequestRecord:
    timings = None if stamp is None else {"arrival_time": stamp, "e2e_time_ms": 10.0}
    return RequestRecord(
        index=index, kind="short", max_tokens=8, prompt_tokens_est=5, scheduled_time=send, send_time=send,
        first_token_time=send + 0.05 if ok else None, chunk_times=(send + 0.05,) if ok else (), end_time=send + 0.1,
        output_tokens=8 if ok else 0, prompt_tokens=7, usage_reported=True, server_timings=timings,
        finish_reason="length" if ok else None, text="", error=None if ok else "server error",
    )  # fmt: skip


def test_exported_trace_replays_the_order_the_server_saw_not_the_send_order() -> None:
    """Sent together, requests reach the queue in another order; the trace keeps the server's order and spacing."""
    unix = 1_780_000_000.0
    records = [
        _sent(0, 0.000, stamp=unix + 0.090),  # reached the server 90 ms after the first arrival: admitted last
        _sent(1, 0.001, stamp=unix),  # the first to arrive: placed at the earliest stamped send time, 0.0
        _sent(2, 0.002, stamp=unix + 0.040),
        _sent(3, 0.003, stamp=None),  # no stamp (a server that does not report one): its send time
        _sent(4, 0.004, stamp=unix + 0.001, ok=False),  # failed: its send time
    ]
    trace = from_records(records)
    assert [round(t.arrival_s, 3) for t in trace] == [0.0, 0.003, 0.004, 0.04, 0.09]
    assert [t.output_tokens for t in trace] == [8, 8, None, 8, 8]
    assert [round(t.arrival_s, 3) for t in from_records([_sent(i, i / 10, None) for i in range(3)])] == [0, 0.1, 0.2]


def test_exported_trace_keeps_shared_prefixes_and_turns_in_replay_order() -> None:
    """With the workload's specs, a first turn keeps its named prefix and a later turn the turn it follows, counted
    in the trace's (the server's) order, so a replay's prefix cache finds what the server's found."""
    unix = 1_780_000_000.0
    records = [_sent(0, 0.0, stamp=unix + 0.05), _sent(1, 0.0, stamp=unix), _sent(2, 1.0, stamp=unix + 1.0)]
    specs = [
        RequestSpec(0, "a", 8, 5, "first-turn", prefix=("system", 4)),
        RequestSpec(1, "b", 8, 5, "first-turn", prefix=("system", 40)),  # longer than its prompt: capped
        RequestSpec(2, "c", 8, 5, "later-turn", follows=0),
    ]
    trace = from_records(records, specs)
    assert [(t.prefix_id, t.prefix_tokens, t.follows) for t in trace] == [
        ("system", 7, None),  # request 1 reached the server first; its 7 counted tokens cap the prefix
        ("system", 4, None),
        (None, 0, 1),  # request 2 follows request 0, which is the trace's second line
    ]
    assert [(t.prefix_id, t.follows) for t in from_records(records)] == [(None, None)] * 3  # without specs: nothing


def test_simulated_natural_stop_ends_the_request_early_with_stop() -> None:
    settings = SimSettings(SchedulerConfig(mode=Mode.CONTINUOUS, max_num_seqs=2), EngineConfig(max_rows=2), COST)
    run = simulate_trace([TraceRequest(0.0, 10, 50, 7), TraceRequest(0.0, 10, 50)], settings, "continuous", 1.0)
    assert [(r.output_tokens, r.finish_reason) for r in run.records] == [(7, "stop"), (50, "length")]


def test_simulated_engine_charges_the_cold_cost_after_idle_and_not_back_to_back() -> None:
    cold = dataclasses.replace(COST, cold_step_s=0.010)
    clock = VirtualClock()
    engine = SimEngine(EngineConfig(max_rows=2, kv_cache_tokens=256), cold, clock)
    engine.add(0, list(range(8)), SamplingParams(max_tokens=20, ignore_eos=True))
    assert engine.reserve(0, 28)
    durations = []
    for idle in (0.0, 0.0, 0.0, COLD_AFTER_S, 0.05):
        clock.advance(idle)
        start = clock()
        engine.step([(0, engine.num_pending(0))])
        durations.append(clock() - start)
    warm = [COST.step_time(StepShape(1, n, 1, p, k)) for n, p, k in ((8, 36, 8), (1, 9, 9), (1, 10, 10))]
    assert durations[0] == pytest.approx(warm[0] + 0.010)  # the first step is cold, as a fresh server's is
    assert durations[1:3] == pytest.approx(warm[1:3])
    assert durations[3] > durations[2] + 0.009 and durations[4] < durations[3] - 0.009


def test_round_robin_alternates_and_least_loaded_avoids_the_busy_replica() -> None:
    trace = [TraceRequest(0.0, 10, 200)] + [TraceRequest(0.01 * i, 10, 4) for i in range(1, 7)]
    engine = EngineConfig(max_rows=2, kv_cache_tokens=4096)
    scheduler = SchedulerConfig(mode=Mode.CONTINUOUS, max_num_seqs=2)
    rr = simulate_trace(trace, SimSettings(scheduler, engine, COST, replicas=2, router="round-robin"), "c", 1.0)
    assert [r.kind for r in rr.records] == [f"replica-{i % 2}" for i in range(7)]
    ll = simulate_trace(trace, SimSettings(scheduler, engine, COST, replicas=2, router="least-loaded"), "c", 1.0)
    assert ll.summary.completed == 7
    # The long request keeps replica 0 loaded, so short ones that arrive while a short one runs on 1 go there
    # only when replica 1 is busier.
    assert sum(r.kind == "replica-1" for r in ll.records) > sum(r.kind == "replica-1" for r in rr.records)


def test_refused_requests_are_failed_records_not_crashes() -> None:
    settings = SimSettings(
        SchedulerConfig(mode=Mode.DYNAMIC, max_batch_size=2, max_queue=2),
        EngineConfig(max_rows=2, max_model_len=64),
        COST,
    )
    trace = [TraceRequest(0.0, 60, 10)] + [TraceRequest(0.0, 5, 5) for _ in range(5)]
    run = simulate_trace(trace, settings, "dynamic", float("inf"))
    errors = [r.error for r in run.records]
    assert errors[0] is not None and errors[0].startswith("HTTP 400")
    assert sum(1 for e in errors if e is not None and e.startswith("HTTP 429")) == 3
    assert run.summary.completed == 2


def test_simulate_cli_refuses_bad_flags_with_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        simulate.main(["--num-prompts", "4"])  # no cost model
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit):
        simulate.main(["--gpu", "h100", "--model-config", str(tmp_path / "nowhere")])


def test_request_overhead_delays_what_the_client_sees_and_changes_no_decision() -> None:
    trace = [TraceRequest(0.0, 10, 6), TraceRequest(0.001, 12, 3), TraceRequest(0.5, 8, 4)]
    scheduler = SchedulerConfig(mode=Mode.DYNAMIC, max_batch_size=2)
    plain = simulate_trace(trace, SimSettings(scheduler, EngineConfig(max_rows=2), COST), "d", 1.0)
    late = simulate_trace(
        trace, SimSettings(scheduler, EngineConfig(max_rows=2), COST, request_overhead_s=0.0125), "d", 1.0
    )
    for a, b in zip(plain.records, late.records, strict=True):
        assert a.ttft is not None and a.e2e is not None
        assert b.ttft == pytest.approx(a.ttft + 0.0125) and b.e2e == pytest.approx(a.e2e + 0.0125)
        assert b.chunk_times == pytest.approx(tuple(t + 0.0125 for t in a.chunk_times))
        assert b.server_timings == a.server_timings  # the server's own view has no client overhead
    assert late.server_metrics is not None and plain.server_metrics is not None
    for field in ("steps", "mean_batch_size", "held_seats", "generation_tokens", "mean_queue_ms"):  # same decisions
        assert getattr(late.server_metrics, field) == getattr(plain.server_metrics, field)
    with pytest.raises(ValueError, match="request_overhead_s"):
        SimSettings(scheduler, EngineConfig(max_rows=2), COST, request_overhead_s=-0.001)


def test_simulate_adds_the_cost_files_served_overhead(tmp_path: Path) -> None:
    shapes = [StepShape(n, n * t, n, n * t * t, n * t) for n in (1, 2, 4) for t in (1, 4, 16)]
    report = fit_cost_model(shapes, [COST.step_time(s) for s in shapes], "test")
    save_fitted(report, tmp_path / "bare.json", {})
    save_fitted(report, tmp_path / "served.json", {"served": {"outside_step_s": 0.02}})
    runs = {}
    for name in ("bare", "served"):
        out = tmp_path / f"sim-{name}"
        argv = ["--cost-model", str(tmp_path / f"{name}.json"), "--mode", "continuous", "--num-prompts", "6"]
        assert simulate.main([*argv, "--seats", "2", "--request-rate", "inf", "--out", str(out)]) == 0
        runs[name] = json.loads((out / "result.json").read_text())
    assert runs["bare"]["settings"]["request_overhead_ms"] == 0
    assert runs["served"]["settings"]["request_overhead_ms"] == pytest.approx(20.0)
    bare, served = (runs[n]["runs"]["continuous"]["summary"]["ttft_ms"]["p50"] for n in ("bare", "served"))
    assert served == pytest.approx(bare + 20.0)
    out = tmp_path / "sim-override"
    argv = ["--cost-model", str(tmp_path / "served.json"), "--mode", "continuous", "--num-prompts", "6", "--seats", "2"]
    assert simulate.main([*argv, "--request-overhead-ms", "0", "--out", str(out)]) == 0
    assert json.loads((out / "result.json").read_text())["runs"]["continuous"]["summary"]["ttft_ms"]["p50"] == bare


def _continuous_pair(busy: BusyArrival, second_at: float) -> RunResult:
    """A long answer from t=0, and a 3-token one arriving at `second_at`, on a continuous server of 2 seats."""
    trace = [TraceRequest(0.0, 10, 40), TraceRequest(second_at, 12, 3)]
    settings = SimSettings(SchedulerConfig(mode=Mode.CONTINUOUS, max_num_seqs=2), EngineConfig(max_rows=2), COST)
    return simulate_trace(trace, dataclasses.replace(settings, busy_arrival=busy), "c", 1.0)


def test_a_request_arriving_mid_step_delays_the_next_step_and_pays_more_outside() -> None:
    busy = BusyArrival(stall_s=0.007, outside_s=0.011)
    plain, charged = _continuous_pair(BusyArrival(), 0.05), _continuous_pair(busy, 0.05)
    first, second = (r.records for r in (plain, charged))
    # the long answer's steps after the arrival start 7 ms later: its E2E grows by the stall alone
    assert first[0].e2e is not None and first[1].ttft is not None
    assert second[0].e2e == pytest.approx(first[0].e2e + 0.007)
    assert second[0].ttft == pytest.approx(first[0].ttft)  # its first token came before the arrival
    # the arriving request waits for the stretched step and pays the busy path outside the steps
    assert second[1].ttft == pytest.approx(first[1].ttft + 0.007 + 0.011)
    assert second[1].server_timings is not None and first[1].server_timings is not None
    assert second[1].server_timings["queue_time_ms"] == pytest.approx(first[1].server_timings["queue_time_ms"] + 7)
    assert charged.server_metrics is not None and plain.server_metrics is not None
    assert charged.server_metrics.steps == plain.server_metrics.steps  # the same decisions


def test_a_request_that_finds_the_server_idle_pays_no_busy_arrival() -> None:
    busy = BusyArrival(stall_s=0.007, outside_s=0.011)
    plain, charged = _continuous_pair(BusyArrival(), 5.0), _continuous_pair(busy, 5.0)  # the first is long done
    for a, b in zip(plain.records, charged.records, strict=True):
        assert (b.ttft, b.e2e) == (a.ttft, a.e2e)


def test_arrivals_within_one_step_stall_it_once() -> None:
    busy = BusyArrival(stall_s=0.007, outside_s=0.0)
    trace = [TraceRequest(0.0, 10, 40), TraceRequest(0.050, 12, 3), TraceRequest(0.0501, 12, 3)]
    settings = SimSettings(SchedulerConfig(mode=Mode.CONTINUOUS, max_num_seqs=3), EngineConfig(max_rows=3), COST)
    plain = simulate_trace(trace, settings, "c", 1.0)
    charged = simulate_trace(trace, dataclasses.replace(settings, busy_arrival=busy), "c", 1.0)
    assert charged.records[0].e2e == pytest.approx(plain.records[0].e2e + 0.007)  # one stall, not two
    with pytest.raises(ValueError, match="busy-arrival"):
        BusyArrival(stall_s=-0.001)


def test_simulate_reads_the_busy_arrival_from_the_cost_file(tmp_path: Path) -> None:
    shapes = [StepShape(n, n * t, n, n * t * t, n * t) for n in (1, 2, 4) for t in (1, 4, 16)]
    report = fit_cost_model(shapes, [COST.step_time(s) for s in shapes], "test")
    save_fitted(report, tmp_path / "cost.json", {"served": {"busy_stall_s": 0.004, "busy_outside_s": 0.009}})
    assert load_busy_arrival(tmp_path / "cost.json") == BusyArrival(0.004, 0.009)
    argv = ["--cost-model", str(tmp_path / "cost.json"), "--mode", "continuous", "--num-prompts", "6", "--seats", "2"]
    results = {}
    for name, flag in (("on", "--busy-arrival"), ("off", "--no-busy-arrival")):
        assert simulate.main([*argv, flag, "--request-rate", "100", "--out", str(tmp_path / name)]) == 0
        results[name] = json.loads((tmp_path / name / "result.json").read_text())
    assert results["on"]["settings"]["busy_arrival_ms"] == pytest.approx({"stall": 4.0, "outside": 9.0})
    assert results["off"]["settings"]["busy_arrival_ms"] == {"stall": 0.0, "outside": 0.0}
    on, off = (results[n]["runs"]["continuous"]["summary"]["e2e_ms"]["p50"] for n in ("on", "off"))
    assert on > off  # six requests 10 ms apart on average: most arrive while a step runs


def test_only_the_replica_an_arrival_reaches_is_stalled() -> None:
    """Round-robin over two replicas: the second request lands on the idle one (no stall anywhere), the third on
    the busy one, whose long answer alone ends later."""
    busy = BusyArrival(stall_s=0.007, outside_s=0.0)
    trace = [TraceRequest(0.0, 10, 40), TraceRequest(0.050, 12, 40), TraceRequest(0.060, 12, 3)]
    settings = SimSettings(
        SchedulerConfig(mode=Mode.CONTINUOUS, max_num_seqs=2), EngineConfig(max_rows=2), COST, replicas=2
    )
    plain = simulate_trace(trace, settings, "c", 1.0)
    charged = simulate_trace(trace, dataclasses.replace(settings, busy_arrival=busy), "c", 1.0)
    first, second, third = (b.e2e - a.e2e for a, b in zip(plain.records, charged.records, strict=True))
    assert first == pytest.approx(0.007)  # replica 0 ran its long answer when the third request came
    assert second == pytest.approx(0.0)  # replica 1 was idle when the second came, and nobody came to it after
    assert third == pytest.approx(0.007)
