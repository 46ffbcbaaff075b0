"""Write an A/B outcome to disk: result.json, raw per-request records, PNG plots and report.md."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.loadgen.run import RunResult, rate_to_json
from benchmarks.loadgen.summaries import percentile
from benchmarks.results_io.machine import machine_facts
from benchmarks.results_io.rounds import round_figures, rounds_table

_SWEEP_PREFIX = "sweep-"  # raw/<prefix><run name>-<rate>.json; main runs are raw/<run name>.json

BASE, CANDIDATE = "dynamic", "continuous"


@dataclass(frozen=True)
class ABOutcome:
    command: str
    settings: Mapping[str, Any]  # workload, seats, seed, ...: everything needed to rerun
    servers: Mapping[str, str]  # target name -> the exact server command line
    notes: Mapping[str, str]  # target name -> what that server is
    runs: Mapping[str, RunResult]  # main workload, one per target that ran
    sweep: Mapping[str, Sequence[RunResult]] = field(default_factory=dict)  # mode -> one run per rate
    skipped: Mapping[str, str] = field(default_factory=dict)  # target name -> why it did not run
    modes: Sequence[str] = (BASE, CANDIDATE)  # the policies compared (the rest are baselines), in their order
    rounds: Mapping[str, Sequence[RunResult]] = field(default_factory=dict)  # `--rounds` > 1: each round's run


@dataclass(frozen=True)
class Column:
    title: str
    value: Callable[[RunResult], float | None]
    spec: str


def _dist(attr: str, stat: str) -> Callable[[RunResult], float | None]:
    def get(run: RunResult) -> float | None:
        dist = getattr(run.summary, attr)
        return None if dist is None else float(getattr(dist, stat))

    return get


def _server(run: RunResult, attr: str) -> float | None:
    return None if run.server_metrics is None else getattr(run.server_metrics, attr)


COLUMNS = (
    Column("req/s", lambda r: r.summary.request_throughput, ".2f"),
    Column("output tok/s", lambda r: r.summary.output_throughput, ".1f"),
    Column("TTFT p50 ms", _dist("ttft_ms", "p50"), ".0f"),
    Column("TTFT p99 ms", _dist("ttft_ms", "p99"), ".0f"),
    Column("E2E p50 ms", _dist("e2e_ms", "p50"), ".0f"),
    Column("E2E p99 ms", _dist("e2e_ms", "p99"), ".0f"),
    Column("ITL p50 ms", _dist("itl_ms", "p50"), ".1f"),
    Column("mean batch size", lambda r: _server(r, "mean_batch_size"), ".2f"),
    Column("held seats", lambda r: _server(r, "held_seats"), ".0f"),
)


def ratios(runs: Mapping[str, RunResult]) -> dict[str, float | None]:
    """continuous / dynamic for each headline column; None when either side is missing or dynamic is 0."""
    if BASE not in runs or CANDIDATE not in runs:
        return {}
    out: dict[str, float | None] = {}
    for column in COLUMNS:
        base, cand = column.value(runs[BASE]), column.value(runs[CANDIDATE])
        out[column.title] = cand / base if base and cand is not None else None
    return out


def ratio_base(modes: Sequence[str]) -> str:
    """What the other modes are divided by: dynamic (the bus) when it is in the line-up, else the first."""
    return BASE if BASE in modes or not modes else modes[0]


def ratios_over_base(runs: Mapping[str, RunResult], modes: Sequence[str]) -> dict[str, dict[str, float | None]]:
    """Each mode's headline columns over the base mode's (`ratios` for every mode that ran beside it)."""
    base = ratio_base(modes)
    if base not in runs:
        return {}
    out: dict[str, dict[str, float | None]] = {}
    for name in (m for m in modes if m != base and m in runs):
        out[name] = {}
        for column in COLUMNS:
            denominator, value = column.value(runs[base]), column.value(runs[name])
            out[name][column.title] = value / denominator if denominator and value is not None else None
    return out


def headline_table(runs: Mapping[str, RunResult], modes: Sequence[str] = (BASE, CANDIDATE)) -> str:
    header = "| server | ok/failed | " + " | ".join(c.title for c in COLUMNS) + " |"
    lines = [header, "|" + "---|" * (len(COLUMNS) + 2)]
    for name, run in runs.items():
        cells = [_fmt(c.value(run), c.spec) for c in COLUMNS]
        lines.append(f"| {name} | {run.summary.completed}/{run.summary.failed} | " + " | ".join(cells) + " |")
    base = ratio_base(modes)
    for name, ratio in ratios_over_base(runs, modes).items():
        cells = [_fmt(ratio[c.title], ".2f", suffix="x") for c in COLUMNS]
        lines.append(f"| **{name}/{base}** | | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def columns_table(runs: Mapping[str, RunResult]) -> str:
    """The headline with a column per run, a row per figure: what `ab` and `simulate` print at the end."""
    rows = [["", *runs], ["---", *("---:" for _ in runs)]]
    rows.append(["ok/failed", *(f"{r.summary.completed}/{r.summary.failed}" for r in runs.values())])
    rows += [[c.title, *(_fmt(c.value(r), c.spec) for r in runs.values())] for c in COLUMNS]
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


NO_CACHE_SUFFIX = "-nocache"  # a mode's run with --no-enable-prefix-caching (ab --prefix-caching both)


def by_kind(run: RunResult) -> dict[str, dict[str, float | int | None]]:
    """TTFT and cached prompt tokens per request kind (e.g. a conversation's first and later turns)."""
    kinds: dict[str, dict[str, float | int | None]] = {}
    for kind in sorted({record.kind for record in run.records}):
        records = [r for r in run.records if r.kind == kind and r.ok]
        ttfts = [1000.0 * r.ttft for r in records if r.ttft is not None]
        cached = [int((r.server_timings or {}).get("cached_tokens") or 0) for r in records]
        prompt = [r.counted_prompt_tokens for r in records]
        kinds[kind] = {
            "requests": len(records),
            "ttft_p50_ms": percentile(ttfts, 50) if ttfts else None,  # interpolated, as every other table's
            "ttft_p99_ms": percentile(ttfts, 99) if ttfts else None,
            "mean_prompt_tokens": sum(prompt) / len(prompt) if prompt else None,
            "mean_cached_tokens": sum(cached) / len(cached) if cached else None,
        }
    return kinds


def kind_table(runs: Mapping[str, RunResult]) -> str:
    lines = [
        "| server | kind | requests | TTFT p50 ms | TTFT p99 ms | mean prompt tokens | mean cached tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, run in runs.items():
        for kind, row in by_kind(run).items():
            cells = [
                name,
                kind,
                str(row["requests"]),
                _fmt(row["ttft_p50_ms"], ".0f"),
                _fmt(row["ttft_p99_ms"], ".0f"),
                _fmt(row["mean_prompt_tokens"], ".0f"),
                _fmt(row["mean_cached_tokens"], ".0f"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def caching_ratios(runs: Mapping[str, RunResult]) -> dict[str, dict[str, float | None]]:
    """For each mode run beside its -nocache twin: on/off output throughput, and off/on TTFT p50 per kind (how
    many times lower the TTFT is with prefix caching)."""
    out: dict[str, dict[str, float | None]] = {}
    for name, run in runs.items():
        twin = runs.get(name + NO_CACHE_SUFFIX)
        if twin is None:
            continue
        ratio: dict[str, float | None] = {
            "output_throughput_on_over_off": _div(run.summary.output_throughput, twin.summary.output_throughput)
        }
        on, off = by_kind(run), by_kind(twin)
        for kind in on:
            if kind in off:
                ratio[f"ttft_p50_off_over_on[{kind}]"] = _div(off[kind]["ttft_p50_ms"], on[kind]["ttft_p50_ms"])
        out[name] = ratio
    return out


def _div(numerator: float | int | None, denominator: float | int | None) -> float | None:
    return None if numerator is None or not denominator else float(numerator) / float(denominator)


def caching_table(runs: Mapping[str, RunResult]) -> str:
    lines = ["| mode | what | ratio |", "|---|---|---|"]
    for name, ratio in caching_ratios(runs).items():
        for what, value in ratio.items():
            lines.append(f"| {name} | {what} | {_fmt(value, '.2f', suffix='x')} |")
    return "\n".join(lines)


def sweep_table(sweep: Mapping[str, Sequence[RunResult]]) -> str:
    lines = [
        "| server | rate (req/s) | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | E2E p99 ms | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in sweep.items():
        for run in sorted(runs, key=lambda r: r.request_rate):
            s = run.summary
            cells = [
                name,
                _rate(run.request_rate),
                f"{s.request_throughput:.2f}",
                f"{s.output_throughput:.1f}",
                _fmt(_dist("ttft_ms", "p50")(run), ".0f"),
                _fmt(_dist("ttft_ms", "p99")(run), ".0f"),
                _fmt(_dist("e2e_ms", "p99")(run), ".0f"),
                str(s.failed),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_markdown(outcome: ABOutcome, plots: Mapping[str, Path]) -> str:
    settings = ", ".join(f"{key} `{value}`" for key, value in outcome.settings.items())
    parts = [
        f"# batchserve A/B: {' vs '.join(outcome.modes)} batching",
        "",
        f"Settings: {settings}." if settings else "",
        "",
        "## Headline",
        "",
        headline_table(outcome.runs, outcome.modes) if outcome.runs else "_No server ran._",
        "",
        "Latencies are client-measured (send to first text chunk, send to end of stream). Mean batch size "
        "and held seats are deltas of the server's `/metrics` over the run (n/a: not exported). Held seats "
        "are seat-steps occupied by sequences that had already finished: dynamic batching's waste.",
    ]
    if any(len({r.kind for r in run.records}) > 1 for run in outcome.runs.values()):
        parts += ["", "## By request kind", "", kind_table(outcome.runs)]
    if caching_ratios(outcome.runs):
        parts += ["", "## Prefix caching on against off (same run)", "", caching_table(outcome.runs)]
    if outcome.rounds:
        parts += ["", "## Rounds, interleaved (each round ran every target once, in this order)", ""]
        parts += [rounds_table(outcome.rounds)]
    if outcome.skipped:
        parts += ["", "## Not run", ""]
        parts += [f"- **{name}**: {reason}" for name, reason in outcome.skipped.items()]
    if outcome.sweep:
        parts += ["", "## Rate sweep", "", sweep_table(outcome.sweep)]
    if plots:
        parts += ["", "## Plots", ""]
        parts += [f"![{title}]({path.name})" for title, path in plots.items()]
    errors = {name: run.summary.errors for name, run in outcome.runs.items() if run.summary.errors}
    if errors:
        parts += ["", "## Errors (first distinct messages)", ""]
        parts += [f"- **{name}**: `{message}`" for name, messages in errors.items() for message in messages]
    parts += ["", "## Servers", ""]
    for name, command in outcome.servers.items():
        note = outcome.notes.get(name, "")
        parts += [f"- **{name}**{f' ({note})' if note else ''}: `{command}`"]
    parts += ["", "## Reproduce", "", "```", outcome.command, "```", ""]
    return "\n".join(parts)


def result_document(outcome: ABOutcome) -> dict[str, Any]:
    return {
        "command": outcome.command,
        "settings": dict(outcome.settings),
        "servers": dict(outcome.servers),
        "notes": dict(outcome.notes),
        "skipped": dict(outcome.skipped),
        "runs": {name: run.to_dict(include_records=False) for name, run in outcome.runs.items()},
        "ratios_continuous_over_dynamic": ratios(outcome.runs),
        "ratios_over_base": {"base": ratio_base(outcome.modes), "modes": ratios_over_base(outcome.runs, outcome.modes)},
        "by_kind": {name: by_kind(run) for name, run in outcome.runs.items()},
        "prefix_caching_ratios": caching_ratios(outcome.runs),
        "sweep": {name: [run.to_dict(include_records=False) for run in runs] for name, runs in outcome.sweep.items()},
        "rounds": round_figures(outcome.rounds) if outcome.rounds else None,
    }


def write_report(outcome: ABOutcome, out_dir: Path) -> dict[str, Path]:
    """Writes everything; returns name -> path of each file written."""
    from benchmarks.results_io.plots import plot_cdf, plot_sweep, plot_timelines  # matplotlib: only to draw

    out_dir.mkdir(parents=True, exist_ok=True)
    written = write_raw_runs(outcome, out_dir)
    plots: dict[str, Path] = {}
    if outcome.runs:
        plots["per-request timeline"] = plot_timelines(outcome.runs, out_dir / "timeline.png")
        plots["TTFT CDF"] = plot_cdf(outcome.runs, "ttft", out_dir / "ttft_cdf.png")
        plots["E2E CDF"] = plot_cdf(outcome.runs, "e2e", out_dir / "e2e_cdf.png")
    if outcome.sweep:
        plots["rate sweep"] = plot_sweep(outcome.sweep, out_dir / "sweep.png")
    written.update({path.stem: path for path in plots.values()})
    written["result.json"] = write_json(out_dir / "result.json", result_document(outcome))
    report = out_dir / "report.md"
    report.write_text(render_markdown(outcome, plots))
    written["report.md"] = report
    return written


def write_raw_runs(outcome: ABOutcome, out_dir: Path) -> dict[str, Path]:
    """Every run's per-request records under out_dir/raw (large, and git-ignored at the top of results/): the main
    runs as raw/<name>.json, the sweep's as raw/sweep-<name>-<rate>.json; name -> path of each file written."""
    raw_dir = out_dir / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    for name, run in outcome.runs.items():
        written[f"raw/{name}"] = write_json(raw_dir / f"{name}.json", run.to_dict(), with_machine=False)
    for name, runs in outcome.sweep.items():
        for run in runs:
            path = raw_dir / f"{_SWEEP_PREFIX}{name}-{_rate(run.request_rate)}.json"
            written[f"raw/{path.stem}"] = write_json(path, run.to_dict(), with_machine=False)
    return written


def read_raw_runs(out_dir: Path) -> tuple[dict[str, RunResult], dict[str, list[RunResult]]]:
    """What `write_raw_runs` saved under raw/, with records: the main runs by name, and the sweep runs by name."""
    raw_dir = out_dir / "raw"
    if not raw_dir.is_dir():
        raise ValueError(f"{out_dir} has no raw/ folder: not a benchmarks.online.ab result")
    runs: dict[str, RunResult] = {}
    sweep: dict[str, list[RunResult]] = {}
    for path in sorted(raw_dir.glob("*.json")):
        run = RunResult.from_dict(json.loads(path.read_text()))
        if path.stem.startswith(_SWEEP_PREFIX):  # <prefix><name>-<rate>: the rate is the last dash's
            sweep.setdefault(path.stem.removeprefix(_SWEEP_PREFIX).rsplit("-", 1)[0], []).append(run)
        else:
            runs[path.stem] = run
    for runs_of_one in sweep.values():
        runs_of_one.sort(key=lambda run: run.request_rate)
    return runs, sweep


def write_json(path: Path, document: Any, *, with_machine: bool = True) -> Path:
    """`document` as strict, indented JSON (NaN and infinity refused): every result file's format, written by every
    command. A result (a mapping) records the machine that measured it: `machine_facts()` goes in unless the document
    has its own `machine` or `with_machine` is off (per-request records; a simulated run, which has a cost model
    instead)."""
    if with_machine and isinstance(document, Mapping) and "machine" not in document:
        document = {"machine": machine_facts(), **document}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")
    return path


def _rate(rate: float) -> str:
    return str(rate_to_json(rate)) if math.isinf(rate) else f"{rate:g}"


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else format(value, spec) + suffix
