"""`benchmarks.sim.validate.requests`: a real run and its simulated replay, paired request by request."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from benchmarks.loadgen.client import RequestRecord
from benchmarks.loadgen.run import RunResult
from benchmarks.loadgen.summaries import summarize
from benchmarks.loadgen.trace import export_runs
from benchmarks.results_io.report import read_raw_runs
from benchmarks.sim import cli as simulate
from benchmarks.sim.validate import requests as sim_requests
from benchmarks.sim.validate.requests import (
    find_run,
    group_errors,
    in_flight_at_arrival,
    p50_neighbourhood,
    pair_requests,
)
from tests.benchmarks.sim.helpers import write_cost


def _record(
    index: int, send: float, ttft: float, e2e: float, prompt: int = 7, stamp: float | None = None
) -> RequestRecord:
    timings = None if stamp is None else {"arrival_time": stamp}
    return RequestRecord(
        index=index, kind="short", max_tokens=8, prompt_tokens_est=prompt, scheduled_time=send, send_time=send,
        first_token_time=send + ttft, chunk_times=(send + ttft,), end_time=send + e2e, output_tokens=8,
        prompt_tokens=prompt, usage_reported=True, server_timings=timings, finish_reason="length", text="", error=None,
    )  # fmt: skip


def _run(records: list[RequestRecord]) -> RunResult:
    return RunResult("continuous", 1.0, 1.0, summarize(records, 1.0), None, tuple(records))


def test_in_flight_counts_the_others_a_request_found_and_not_itself() -> None:
    # 0: [0, 1); 1: [0.5, 2); 2: [1, 1.5) (arrives as 0 ends); 3: [3, 4), alone.
    assert in_flight_at_arrival([0.0, 0.5, 1.0, 3.0], [1.0, 2.0, 1.5, 4.0]) == [0, 1, 1, 0]
    assert in_flight_at_arrival([0.0, 0.0, 0.0], [1.0, 1.0, 1.0]) == [2, 2, 2]  # sent at once: each finds two


def test_pairs_follow_the_servers_order_and_split_idle_from_busy_arrivals() -> None:
    measured = _run(
        [
            _record(0, 0.0, 0.040, 0.200),  # idle
            _record(1, 0.1, 0.060, 0.150, prompt=9),  # beside request 0
            _record(2, 1.0, 0.050, 0.100),  # idle again
        ]
    )
    simulated = _run(
        [
            _record(0, 0.0, 0.036, 0.210),
            _record(1, 0.1, 0.045, 0.140, prompt=9),
            _record(2, 1.0, 0.040, 0.100),
        ]
    )
    pairs = pair_requests(measured, simulated)
    assert [(p.position, p.prompt_tokens, p.others_in_flight) for p in pairs] == [(0, 7, 0), (1, 9, 1), (2, 7, 0)]
    assert [round(p.ttft_error, 3) for p in pairs] == [-0.1, -0.25, -0.2]
    groups = {g.label: g for g in group_errors(pairs)}
    assert groups["arrived to an idle server"].count == 2
    assert groups["arrived to an idle server"].median_ttft_error == pytest.approx(-0.15)
    assert groups["arrived beside others"].measured_ttft_p50_s == pytest.approx(0.060)
    assert groups["all"].simulated_ttft_p50_s == pytest.approx(0.040)


def test_requests_sent_together_pair_in_the_order_the_server_received_them() -> None:
    """The replay's n-th request is the n-th to reach the server's queue, not the n-th sent (as its trace)."""
    unix = 1_780_000_000.0
    measured = _run(
        [
            _record(0, 0.000, 0.090, 0.300, prompt=20, stamp=unix + 0.004),  # sent first, queued second
            _record(1, 0.001, 0.040, 0.200, prompt=30, stamp=unix),
        ]
    )
    simulated = _run([_record(0, 0.0, 0.040, 0.200, prompt=30), _record(1, 0.004, 0.090, 0.300, prompt=20)])
    pairs = pair_requests(measured, simulated)
    assert [(p.prompt_tokens, p.others_in_flight, p.ttft_error) for p in pairs] == [(30, 0, 0.0), (20, 1, 0.0)]


def test_a_run_that_is_not_a_replay_is_refused() -> None:
    measured = _run([_record(0, 0.0, 0.04, 0.2), _record(1, 0.5, 0.04, 0.2)])
    with pytest.raises(ValueError, match="2 requests measured but 1 simulated"):
        pair_requests(measured, _run([_record(0, 0.0, 0.04, 0.2)]))
    other_prompt = _run([_record(0, 0.0, 0.04, 0.2), _record(1, 0.5, 0.04, 0.2, prompt=30)])
    with pytest.raises(ValueError, match="request 1: 7 prompt tokens measured, 30 simulated"):
        pair_requests(measured, other_prompt)


def test_failed_requests_are_left_out_of_the_pairs_but_still_held_the_server() -> None:
    failed = dataclasses.replace(_record(1, 0.05, 0.04, 0.2), first_token_time=None, error="HTTP 500")
    measured = _run([_record(0, 0.0, 0.04, 0.2), failed, _record(2, 0.1, 0.04, 0.2)])
    pairs = pair_requests(measured, measured)
    assert [(p.position, p.others_in_flight) for p in pairs] == [(0, 0), (2, 2)]  # the failed one was still held
    everyone = _run([_record(0, 0.0, 0.04, 0.2), _record(1, 0.05, 0.04, 0.2), _record(2, 0.1, 0.04, 0.2)])
    failed_in_replay = dataclasses.replace(everyone.records[2], first_token_time=None, error="HTTP 400")
    replay = _run([*everyone.records[:2], failed_in_replay])
    assert [p.position for p in pair_requests(everyone, replay)] == [0, 1]


def test_the_server_held_a_request_until_it_released_it_not_until_the_client_saw_the_end() -> None:
    """A stream closes at the client a few ms after the server let go: an arrival in between found it idle."""
    unix = 1_780_000_000.0
    first = dataclasses.replace(
        _record(0, 0.0, 0.040, 0.105, stamp=unix), server_timings={"arrival_time": unix, "e2e_time_ms": 100.0}
    )
    second = _record(1, 0.102, 0.040, 0.100, stamp=unix + 0.102)
    pairs = pair_requests(_run([first, second]), _run([first, dataclasses.replace(second, send_time=0.102)]))
    assert [p.others_in_flight for p in pairs] == [0, 0]
    assert in_flight_at_arrival([0.0, 0.102], [0.105, 0.2]) == [0, 1]  # by the client's end it would be busy
    with pytest.raises(ValueError, match="2 arrivals but 1 ends"):
        in_flight_at_arrival([0.0, 0.1], [0.2])


def test_a_replay_of_other_arrivals_or_lengths_is_refused() -> None:
    measured = _run([_record(0, 0.0, 0.04, 0.2), _record(1, 0.5, 0.04, 0.2)])
    later = _run([_record(0, 0.0, 0.04, 0.2), _record(1, 0.6, 0.04, 0.2)])
    with pytest.raises(ValueError, match=r"request 1: arrival 0\.500000 s measured, 0\.600000 simulated"):
        pair_requests(measured, later)
    longer = _run([_record(0, 0.0, 0.04, 0.2), dataclasses.replace(_record(1, 0.5, 0.04, 0.2), max_tokens=9)])
    with pytest.raises(ValueError, match="request 1: max_tokens 8 measured, 9 simulated"):
        pair_requests(measured, longer)


def test_p50_neighbourhood_shows_the_values_either_side() -> None:
    around, median = p50_neighbourhood([5.0, 1.0, 4.0, 2.0, 3.0, 6.0], neighbours=2)
    assert around == [2.0, 3.0, 4.0, 5.0] and median == 3.5
    around, median = p50_neighbourhood([7.0, 1.0, 6.0, 2.0, 5.0, 3.0, 4.0], neighbours=2)
    assert around == [2.0, 3.0, 4.0, 5.0, 6.0] and median == 4.0
    around, median = p50_neighbourhood([3.0, 1.0, 2.0], neighbours=5)
    assert around == [1.0, 2.0, 3.0] and median == 2.0


def test_a_simulated_sweep_replayed_pairs_with_zero_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A simulated run with a sweep stands in for a real one: its replay is exact, request by request, and the
    simulator now keeps every sweep run's records (raw/sweep-<mode>-<rate>.json) for this pairing."""
    cost = write_cost(tmp_path / "cost.json")
    first, second = tmp_path / "first", tmp_path / "second"
    argv = ["--cost-model", str(cost), "--seats", "4", "--num-prompts", "12", "--mode", "continuous"]
    assert simulate.main([*argv, "--sweep-rates", "2,inf", "--out", str(first)]) == 0
    runs, sweep = read_raw_runs(first)
    assert [run.request_rate for run in sweep["continuous"]] == [2.0, float("inf")]
    export_runs(first, runs, sweep)
    assert simulate.main([*argv, "--replay", str(first), "--out", str(second)]) == 0  # its sweep traces too
    pairs = pair_requests(find_run(first, "continuous@2"), find_run(second, "continuous@2"))
    assert len(pairs) == 12 and all(abs(p.ttft_error) < 1e-4 for p in pairs)  # traces keep microseconds
    assert any(p.others_in_flight > 0 for p in pairs)  # at 2 req/s some arrive beside others
    capsys.readouterr()
    assert sim_requests.main([str(first), str(second), "--run", "continuous@2"]) == 0
    out = capsys.readouterr().out
    assert "## continuous@2: 12 requests" in out and "| all | 12 |" in out and "TTFT p50 measured" in out
    assert sim_requests.main([str(first), str(second), "--run", "continuous@7"]) == 2
    assert "no sweep run 'continuous@7' (sweep runs: continuous@2, continuous@inf)" in capsys.readouterr().err
    assert json.loads((second / "result.json").read_text())["simulated"] is True
