"""Report generation from a synthetic A/B outcome: markdown, JSON and PNG files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.loadgen.client import RequestRecord
from benchmarks.loadgen.prom import ScrapedMetrics
from benchmarks.loadgen.run import RunResult, merge_rounds
from benchmarks.loadgen.summaries import summarize
from benchmarks.results_io.report import (
    ABOutcome,
    by_kind,
    caching_ratios,
    headline_table,
    ratios,
    read_raw_runs,
    write_report,
)
from benchmarks.results_io.rounds import decode_ms_per_token
from benchmarks.results_io.tables import format_run
from tests.benchmarks.helpers import synthetic_record, synthetic_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def outcome() -> ABOutcome:
    runs = {
        "dynamic": synthetic_run("dynamic", scale=2.0, held=0.2),
        "continuous": synthetic_run("continuous", scale=1.0, held=0.0),
        "transformers": synthetic_run("transformers", scale=3.0, held=0.0, timings=False),
    }
    sweep = {
        mode: [synthetic_run(f"{mode}@{r}", scale, 0.1, rate=r) for r in (1.0, 4.0, math.inf)]
        for mode, scale in (("dynamic", 2.0), ("continuous", 1.0))
    }
    return ABOutcome(
        command="python -m benchmarks ab --workload mixed --num-prompts 6 --seats 2 --out x",
        settings={"workload": "mixed", "num_prompts": 6, "seed": 0, "seats": 2, "request_rate": "inf"},
        servers={
            "dynamic": "python -m api serve --mode dynamic",
            "continuous": "python -m api serve --mode continuous",
        },
        notes={"dynamic": "dynamic, 2 seats"},
        runs=runs,
        sweep=sweep,
        skipped={"llama-server": "llama-server not on PATH"},
    )


def test_write_report_writes_markdown_json_and_plots(outcome: ABOutcome, tmp_path: Path) -> None:
    written = write_report(outcome, tmp_path)
    for name in ("timeline.png", "ttft_cdf.png", "e2e_cdf.png", "sweep.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG_MAGIC), name
    report = (tmp_path / "report.md").read_text()
    assert "| dynamic |" in report and "| continuous |" in report and "| transformers |" in report
    assert "**continuous/dynamic**" in report
    assert "llama-server not on PATH" in report
    assert outcome.command in report
    assert "![per-request timeline](timeline.png)" in report
    assert "`python -m api serve --mode dynamic`" in report
    assert "## Rate sweep" in report and "| dynamic | inf |" in report
    assert written["report.md"] == tmp_path / "report.md"
    # Records go to raw/ (git-ignored), summaries to result.json, which must be strict JSON.
    document = json.loads((tmp_path / "result.json").read_text(), parse_constant=_reject)
    assert set(document["runs"]) == {"dynamic", "continuous", "transformers"}
    assert "records" not in document["runs"]["dynamic"]
    assert document["sweep"]["dynamic"][2]["request_rate"] == "inf"
    raw = RunResult.from_dict(json.loads((tmp_path / "raw" / "dynamic.json").read_text()))
    assert raw == outcome.runs["dynamic"]
    assert document["machine"]["cores"] >= 1  # a measured result names its machine
    # Everything under raw/ reads back as it was written (the traces of an earlier run are rebuilt from it).
    runs, sweep = read_raw_runs(tmp_path)
    assert runs == dict(outcome.runs)
    assert sweep == {name: sorted(r, key=lambda run: run.request_rate) for name, r in outcome.sweep.items()}


def _reject(constant: str) -> None:
    raise AssertionError(f"non-standard JSON constant {constant}")


def test_ratios_are_continuous_over_dynamic(outcome: ABOutcome) -> None:
    r = ratios(outcome.runs)
    dyn, cont = outcome.runs["dynamic"].summary, outcome.runs["continuous"].summary
    assert r["output tok/s"] == pytest.approx(cont.output_throughput / dyn.output_throughput)
    assert r["mean batch size"] == pytest.approx(2.0)  # 2.0 / (2.0 / 2.0)
    assert r["held seats"] == pytest.approx(0.0)
    assert r["TTFT p50 ms"] == pytest.approx(0.5)


def test_headline_without_both_modes_has_no_ratio_row(outcome: ABOutcome) -> None:
    only = {"dynamic": outcome.runs["dynamic"]}
    assert ratios(only) == {}
    assert "continuous/dynamic" not in headline_table(only)
    assert "n/a" in headline_table({"transformers": outcome.runs["transformers"]})  # no /metrics


def test_report_with_nothing_run_still_writes(tmp_path: Path) -> None:
    empty = ABOutcome("cmd", {}, {}, {}, {}, {}, {"dynamic": "`python -m api` is not available"})
    written = write_report(empty, tmp_path)
    assert "_No server ran._" in written["report.md"].read_text()
    assert not (tmp_path / "timeline.png").exists()


def test_text_table_lists_latencies_and_server_metrics(outcome: ABOutcome) -> None:
    text = format_run(outcome.runs["dynamic"])
    for line in (
        "Successful requests:",
        "Time to First Token",
        "P99 (ms):",
        "Mean batch size",
        "Held seat-steps",
    ):
        assert line in text


def _turn_run(label: str, later_ttft: float, cached: int) -> RunResult:
    """Three conversations of two turns: first turns take 0.2 s to a first token, later ones `later_ttft`."""
    records = []
    for i in range(6):
        kind, ttft = ("first-turn", 0.2) if i % 2 == 0 else ("later-turn", later_ttft)
        base = synthetic_record(i, 0.05 * i, ttft, 0.3, 0.0, True)
        timings = {**(base.server_timings or {}), "cached_tokens": cached if kind == "later-turn" else 0}
        records.append(RequestRecord(**{**base.to_dict(), "kind": kind, "server_timings": timings}))
    duration = max(r.end_time for r in records)
    return RunResult(label, math.inf, 1.0, summarize(tuple(records), duration), None, tuple(records))


def test_kinds_and_prefix_caching_on_against_off_are_reported(tmp_path: Path) -> None:
    runs = {"continuous": _turn_run("continuous", 0.05, 8), "continuous-nocache": _turn_run("off", 0.2, 0)}
    kinds = by_kind(runs["continuous"])
    assert kinds["later-turn"]["ttft_p50_ms"] == pytest.approx(50.0)
    assert kinds["later-turn"]["mean_cached_tokens"] == 8 and kinds["first-turn"]["mean_cached_tokens"] == 0
    ratio = caching_ratios(runs)["continuous"]
    assert ratio["ttft_p50_off_over_on[later-turn]"] == pytest.approx(4.0)
    assert ratio["ttft_p50_off_over_on[first-turn]"] == pytest.approx(1.0)
    written = write_report(ABOutcome("cmd", {}, {}, {}, runs), tmp_path)
    markdown = written["report.md"].read_text()
    assert "## By request kind" in markdown and "## Prefix caching on against off" in markdown
    document = json.loads(written["result.json"].read_text())
    assert document["prefix_caching_ratios"]["continuous"]["ttft_p50_off_over_on[later-turn]"] == pytest.approx(4.0)


def test_per_kind_ttft_percentiles_interpolate_as_the_summaries_do() -> None:
    """Four later turns at 10, 20, 30 and 40 ms: p50 25 ms and p99 39.7 ms (linear between ranks, vLLM's and the
    headline table's method), not the nearest rank's 30 and 40."""
    records = []
    for i, ttft in enumerate((0.04, 0.01, 0.03, 0.02)):
        base = synthetic_record(i, 0.1 * i, ttft, 0.3, 0.0, True)
        records.append(RequestRecord(**{**base.to_dict(), "kind": "later-turn"}))
    run = RunResult("c", math.inf, 1.0, summarize(tuple(records), 1.0), None, tuple(records))
    row = by_kind(run)["later-turn"]
    assert row["ttft_p50_ms"] == pytest.approx(25.0) and row["ttft_p99_ms"] == pytest.approx(39.7)
    assert row["ttft_p50_ms"] == pytest.approx(run.summary.ttft_ms.p50)  # the same as the run's own TTFT p50


def test_rounds_merge_into_one_run_with_counters_summed_and_means_weighted() -> None:
    def run(requests: int, duration: float, steps: float, batch: float, ttft_ms: float) -> RunResult:
        records = tuple(synthetic_record(i, 0.05 * i, 0.1, 0.3, 0.0, True) for i in range(requests))
        metrics = ScrapedMetrics(steps, batch, 0.0, 10.0, 20.0, ttft_ms, 1.0, 4.0, 3.0)
        return RunResult("c", math.inf, 1.0, summarize(records, duration), metrics, records)

    first, second = run(2, 1.0, 10.0, 2.0, 100.0), run(6, 3.0, 30.0, 4.0, 200.0)
    merged = merge_rounds([first, second])
    assert merged.summary.completed == 8 and merged.summary.duration_s == 4.0
    assert merged.summary.output_throughput == pytest.approx(8 * first.records[0].output_tokens / 4.0)
    assert merged.server_metrics is not None
    assert merged.server_metrics.steps == 40 and merged.server_metrics.accepted_tokens == 6.0
    assert merged.server_metrics.mean_batch_size == pytest.approx((10 * 2.0 + 30 * 4.0) / 40)  # by steps
    assert merged.server_metrics.mean_ttft_ms == pytest.approx((2 * 100.0 + 6 * 200.0) / 8)  # by requests
    assert merge_rounds([first]) is first
    # Decode time over decode tokens: each request decodes its tokens after the first in 0.3 s.
    assert decode_ms_per_token(merged) == pytest.approx(300.0 / (first.records[0].output_tokens - 1))
