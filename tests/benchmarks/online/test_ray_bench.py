"""benchmarks.online.ray_bench's setups: every proxy setup is compared with a plain server of the same threads."""

from __future__ import annotations

from benchmarks.loadgen.client import RequestRecord
from benchmarks.loadgen.run import RunResult
from benchmarks.loadgen.summaries import summarize
from benchmarks.online.ray_bench import DEFAULT_SETUPS, SETUPS, Measured, build_parser, report


def test_every_setup_has_a_plain_baseline_with_its_threads() -> None:
    by_name = {s.name: s for s in SETUPS}
    for setup in SETUPS:
        baseline = by_name[setup.baseline]
        assert baseline.replicas == 0 and baseline.threads == setup.threads
    assert by_name["proxy-1x1"].baseline == "plain-1"


def test_replica_setups_pass_their_threads_and_plain_ones_need_no_ray() -> None:
    by_name = {s.name: s for s in SETUPS}
    replica = by_name["proxy-1x1"].argv("continuous", 8, None)
    assert "api.scale_out.ray_serve" in replica and replica[replica.index("--cpus-per-replica") + 1] == "1"
    assert "api.scale_out.ray_serve" not in by_name["plain-1"].argv("continuous", 8, None)


def test_the_issue_s_three_setups_are_the_default() -> None:
    assert build_parser().parse_args(["--out", "x"]).setups.split(",") == list(DEFAULT_SETUPS)
    assert set(DEFAULT_SETUPS) <= {s.name for s in SETUPS}


def _measured(setup: str, round_: int, ttft_ms: float, tok_s: float) -> Measured:
    record = RequestRecord(
        index=0, kind="short", max_tokens=int(tok_s), prompt_tokens_est=5, scheduled_time=0.0, send_time=0.0,
        first_token_time=ttft_ms / 1e3, chunk_times=(ttft_ms / 1e3,), end_time=1.0, output_tokens=int(tok_s),
        prompt_tokens=5, usage_reported=True, server_timings=None, finish_reason="length", text="", error=None,
    )  # fmt: skip
    run = RunResult("r", 1.0, 1.0, summarize([record], 1.0), None, (record,))
    return Measured(setup, "continuous", "cmd", run, run, round=round_)


def test_rounds_compare_each_proxy_run_with_its_own_rounds_plain_run_and_vote_by_median() -> None:
    results = [
        _measured("plain-1", 0, 100.0, 200),
        _measured("proxy-1x1", 0, 110.0, 190),  # +10 ms, 0.95x: meets
        _measured("plain-1", 1, 150.0, 100),  # the machine slowed down between rounds
        _measured("proxy-1x1", 1, 180.0, 80),  # +30 ms, 0.80x: misses
        _measured("plain-1", 2, 120.0, 150),
        _measured("proxy-1x1", 2, 132.0, 141),  # +12 ms, 0.94x: meets
    ]
    text = report(results)
    assert "| 0 | proxy-1x1 | 110.0 | +10.0 | 190.0 | 0.95x | meets +15 ms / 0.9x |" in text
    assert "| 1 | proxy-1x1 | 180.0 | +30.0 | 80.0 | 0.80x | misses +15 ms / 0.9x |" in text
    # against round 0's plain run instead, round 1 would read +80 ms: each round has its own baseline
    assert "| median of 3 | proxy-1x1 | | +12.0 | | 0.94x | meets +15 ms / 0.9x |" in text
