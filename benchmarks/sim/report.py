"""Write a simulated A/B outcome like `benchmarks.results_io.report.write_report` does, marked as simulated.

The same `result.json` schema (plus `"simulated": true` and the cost model's label), report and plots; the
per-request timeline shows the first `TIMELINE_REQUESTS` requests only, since one bar per request of a
10,000-request simulation would make an unreadable, enormous image.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from benchmarks.loadgen.run import RunResult
from benchmarks.results_io.machine import code_facts
from benchmarks.results_io.report import ABOutcome, render_markdown, result_document, write_json, write_raw_runs

TIMELINE_REQUESTS = 200


def write_sim_report(outcome: ABOutcome, out_dir: Path, cost_label: str) -> dict[str, Path]:
    from benchmarks.results_io.plots import plot_cdf, plot_sweep, plot_timelines  # matplotlib: only to draw

    out_dir.mkdir(parents=True, exist_ok=True)
    written = write_raw_runs(outcome, out_dir)  # the sweep's runs too: `benchmarks.sim.validate.requests` pairs them
    plots: dict[str, Path] = {}
    if outcome.runs:
        first = {name: _first_requests(run) for name, run in outcome.runs.items()}
        plots["per-request timeline"] = plot_timelines(first, out_dir / "timeline.png")
        plots["TTFT CDF"] = plot_cdf(outcome.runs, "ttft", out_dir / "ttft_cdf.png")
        plots["E2E CDF"] = plot_cdf(outcome.runs, "e2e", out_dir / "e2e_cdf.png")
    if outcome.sweep:
        plots["rate sweep"] = plot_sweep(outcome.sweep, out_dir / "sweep.png")
    written.update({path.stem: path for path in plots.values()})
    # No machine ran it (the cost model stands in), but the code that simulated it is recorded like any result's.
    document: dict[str, Any] = {
        "simulated": True,
        "cost_model": cost_label,
        "code": code_facts(),
        **result_document(outcome),
    }
    written["result.json"] = write_json(out_dir / "result.json", document, with_machine=False)
    banner = (
        f"> **SIMULATED** with `python -m benchmarks simulate`: the real scheduler and policies on a virtual clock; "
        f"step times from the {cost_label}. Latencies are server-side (arrival to token), without HTTP or "
        "tokenisation. Held seats are the simulated server's held seat-steps.\n\n"
    )
    report = out_dir / "report.md"
    markdown = render_markdown(outcome, plots).replace("# batchserve A/B", "# SIMULATED batchserve A/B", 1)
    report.write_text(banner + markdown)
    written["report.md"] = report
    return written


def _first_requests(run: RunResult) -> RunResult:
    if len(run.records) <= TIMELINE_REQUESTS:
        return run
    records = sorted(run.records, key=lambda r: (r.send_time, r.index))[:TIMELINE_REQUESTS]
    return dataclasses.replace(run, label=f"{run.label} (first {TIMELINE_REQUESTS})", records=tuple(records))
