"""The simulator against a real run: the same headline numbers side by side, with the simulator's error.

Reads a `benchmarks.online.ab` result.json (the measured side) and the simulated runs of the same trace; rows are
matched by mode, and sweep runs by mode and rate.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from benchmarks.loadgen.run import RunResult, rate_from_json

# (title, value from a result.json run dict, value from a simulated RunResult)
_METRICS: tuple[tuple[str, Callable[[dict[str, Any]], float | None], Callable[[RunResult], float | None]], ...] = (
    ("output tok/s", lambda d: d["summary"]["output_throughput"], lambda r: r.summary.output_throughput),
    ("TTFT p50 ms", lambda d: _dist(d, "ttft_ms", "p50"), lambda r: _sim_dist(r, "ttft_ms", "p50")),
    ("TTFT p99 ms", lambda d: _dist(d, "ttft_ms", "p99"), lambda r: _sim_dist(r, "ttft_ms", "p99")),
    ("E2E p50 ms", lambda d: _dist(d, "e2e_ms", "p50"), lambda r: _sim_dist(r, "e2e_ms", "p50")),
    (
        "held seat-steps",
        lambda d: (d.get("server_metrics") or {}).get("held_seats"),
        lambda r: r.server_metrics.held_seats if r.server_metrics else None,
    ),
)


def _sim_dist(run: RunResult, name: str, stat: str) -> float | None:
    dist = getattr(run.summary, name)
    return None if dist is None else float(getattr(dist, stat))


def _dist(run: dict[str, Any], name: str, stat: str) -> float | None:
    dist = run["summary"].get(name)
    return None if dist is None else float(dist[stat])


def error_pct(measured: float | None, simulated: float | None) -> float | None:
    if measured is None or simulated is None or measured == 0:
        return None
    return 100.0 * (simulated - measured) / measured


def validation_rows(
    real: Mapping[str, Any], runs: Mapping[str, RunResult], sweep: Mapping[str, Sequence[RunResult]]
) -> list[tuple[str, str, float | None, float | None, float | None]]:
    """(scenario, metric, measured, simulated, error %) for every mode and rate both sides have."""
    pairs: list[tuple[str, dict[str, Any], RunResult]] = []
    for mode, run in runs.items():
        if mode in real.get("runs", {}):
            pairs.append((mode, real["runs"][mode], run))
    for mode, sim_runs in sweep.items():
        measured = {rate_from_json(d["request_rate"]): d for d in real.get("sweep", {}).get(mode, [])}
        for run in sim_runs:
            if run.request_rate in measured:
                pairs.append((f"{mode}@{run.request_rate:g}", measured[run.request_rate], run))
    rows = []
    for scenario, measured_run, sim_run in pairs:
        for title, real_value, sim_value in _METRICS:
            m, s = real_value(measured_run), sim_value(sim_run)
            rows.append((scenario, title, m, s, error_pct(m, s)))
    return rows


def validation_table(
    real: Mapping[str, Any], runs: Mapping[str, RunResult], sweep: Mapping[str, Sequence[RunResult]]
) -> str:
    lines = ["| run | metric | measured | simulated | error |", "|---|---|---|---|---|"]
    for scenario, metric, measured, simulated, error in validation_rows(real, runs, sweep):
        lines.append(f"| {scenario} | {metric} | {_fmt(measured)} | {_fmt(simulated)} | {_pct(error)} |")
    if len(lines) == 2:
        lines.append("| _no run in common (modes or rates differ)_ | | | | |")
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.1f}%"
