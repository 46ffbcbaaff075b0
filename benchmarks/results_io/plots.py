"""PNG plots of A/B runs. Uses matplotlib's object API (Figure, no pyplot), so no global backend or state."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from benchmarks.loadgen.phases import request_phases
from benchmarks.loadgen.run import RunResult

PHASE_COLORS = {
    "waiting": "#bbbbbb",
    "prefill": "#f0a030",
    "decoding": "#3070c0",
    "finished-but-held": "#d03030",
}


def plot_timelines(runs: Mapping[str, RunResult], path: Path) -> Path:
    """One panel per run, one horizontal bar per request, coloured by phase, on a shared time axis."""
    names = list(runs)
    cols = min(max(len(names), 1), 3)
    rows = math.ceil(max(len(names), 1) / cols)
    panel_height = max(3.0, 0.12 * max((len(r.records) for r in runs.values()), default=1) + 1.5)
    fig = Figure(figsize=(6.0 * cols, panel_height * rows + 0.5), layout="constrained")
    axes = fig.subplots(rows, cols, sharex=True, squeeze=False).flatten()
    for ax in axes[len(names) :]:
        ax.set_visible(False)
    latest = 0.0
    for ax, name in zip(axes, names, strict=False):
        sources: set[str] = set()
        records = sorted(runs[name].records, key=lambda r: (r.send_time, r.index))
        for row, record in enumerate(records):
            phases = request_phases(record)
            if phases is None:
                ax.barh(row, record.e2e, left=record.send_time, color="black", height=0.8)  # failed
                continue
            sources.add(phases.source)
            left = phases.start
            for label, width in (
                ("waiting", phases.waiting),
                ("prefill", phases.prefill),
                ("decoding", phases.decoding),
                ("finished-but-held", phases.held),
            ):
                if width > 0:
                    ax.barh(row, width, left=left, color=PHASE_COLORS[label], height=0.8)
                left += width
            latest = max(latest, left)
        ax.set_title(f"{name} ({'/'.join(sorted(sources)) or 'no'} timings)")
        ax.set_xlabel("seconds since start")
        ax.set_ylabel("request (by send time)")
        ax.tick_params(labelbottom=True)  # sharex hides them above the bottom row, which may have a gap
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.invert_yaxis()
    # Set once, after every panel is drawn: limits set per panel on shared axes would clip the longest run.
    axes[0].set_xlim(0, max(latest, 1e-3) * 1.02)
    handles = [Patch(color=color, label=label) for label, color in PHASE_COLORS.items()]
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles))
    fig.savefig(path, dpi=100)
    return path


def plot_cdf(runs: Mapping[str, RunResult], metric: str, path: Path) -> Path:
    """Empirical CDF of a per-request latency ("ttft" or "e2e") in ms, every run on one axis."""
    fig = Figure(figsize=(7.0, 4.5), layout="constrained")
    ax = fig.subplots()
    for name, run in runs.items():
        values = sorted(_latencies_ms(run, metric))
        if values:
            fractions = [(i + 1) / len(values) for i in range(len(values))]
            ax.step([values[0], *values], [0.0, *fractions], where="post", label=f"{name} (n={len(values)})")
    ax.set_xlabel(f"{metric.upper()} (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(f"{metric.upper()} distribution")
    if runs:
        ax.legend()
    fig.savefig(path, dpi=100)
    return path


def plot_sweep(sweep: Mapping[str, Sequence[RunResult]], path: Path) -> Path:
    """Output throughput and p99 TTFT against request rate; inf (all at once) sits at the right end."""
    rates = sorted({r.request_rate for runs in sweep.values() for r in runs})
    position = {rate: i for i, rate in enumerate(rates)}
    fig = Figure(figsize=(11.0, 4.5), layout="constrained")
    ax_tput, ax_ttft = fig.subplots(1, 2)
    for name, runs in sweep.items():
        ordered = sorted(runs, key=lambda r: r.request_rate)
        xs = [position[r.request_rate] for r in ordered]
        ax_tput.plot(xs, [r.summary.output_throughput for r in ordered], marker="o", label=name)
        ttft = [(x, r.summary.ttft_ms.p99) for x, r in zip(xs, ordered, strict=True) if r.summary.ttft_ms]
        ax_ttft.plot([x for x, _ in ttft], [y for _, y in ttft], marker="o", label=name)
    labels = ["inf" if math.isinf(rate) else f"{rate:g}" for rate in rates]
    for ax, ylabel in ((ax_tput, "output tokens/s"), (ax_ttft, "p99 TTFT (ms)")):
        ax.set_xticks(range(len(rates)), labels)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if sweep:
            ax.legend()
    ax_tput.set_title("throughput vs offered load")
    ax_ttft.set_title("tail TTFT vs offered load")
    fig.savefig(path, dpi=100)
    return path


def _latencies_ms(run: RunResult, metric: str) -> list[float]:
    if metric == "ttft":
        return [r.ttft * 1e3 for r in run.records if r.ok and r.ttft is not None]
    if metric == "e2e":
        return [r.e2e * 1e3 for r in run.records if r.ok]
    raise ValueError(f"unknown metric {metric!r}")
