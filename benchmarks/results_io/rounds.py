"""`ab --rounds`: each round's figures per target, and each target's ratio to the first within a round.

Rounds run every target once, in order, then again: a ratio of two servers measured a minute apart in the same round
sees the same machine, where one run each would compare two minutes that may differ by more than the effect (on
these VMs a decode step's time drifts by tens of percent within minutes). The median of the per-round ratios is
the figure to quote; the table shows how far the rounds spread.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.loadgen.run import RunResult


def decode_ms_per_token(run: RunResult) -> float | None:
    """Decode time over decode tokens, all requests together (each request's time after its first token, over its
    tokens after the first); None without a request of two tokens."""
    timed = [(r.e2e - r.ttft, r.output_tokens - 1) for r in run.records if r.ok and r.ttft is not None]
    tokens = sum(count for _, count in timed if count > 0)
    if tokens == 0:
        return None
    return 1e3 * sum(seconds for seconds, count in timed if count > 0) / tokens


def _ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def round_figures(rounds: Mapping[str, Sequence[RunResult]]) -> dict[str, Any]:
    """Per target: each round's output tok/s and decode ms a token, its ratios to the first target's in the same
    round, and the medians of those ratios."""
    throughputs = {name: [run.summary.output_throughput for run in runs] for name, runs in rounds.items()}
    decodes = {name: [decode_ms_per_token(run) for run in runs] for name, runs in rounds.items()}
    base = next(iter(rounds))
    document: dict[str, Any] = {}
    for name in rounds:
        throughput, decode = throughputs[name], decodes[name]
        throughput_ratio = [_ratio(r, b) for r, b in zip(throughput, throughputs[base], strict=False)]
        decode_ratio = [_ratio(r, b) for r, b in zip(decode, decodes[base], strict=False)]
        document[name] = {
            "output_tok_s": throughput,
            "decode_ms_per_token": decode,
            "output_tok_s_over_base": throughput_ratio,
            "decode_ms_per_token_over_base": decode_ratio,
            "median_output_tok_s_over_base": _median(throughput_ratio),
            "median_decode_ms_per_token_over_base": _median(decode_ratio),
        }
    return {"base": base, "targets": document}


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def rounds_table(rounds: Mapping[str, Sequence[RunResult]]) -> str:
    figures = round_figures(rounds)
    base, targets = figures["base"], figures["targets"]
    count = max(len(runs) for runs in rounds.values())
    header = ["round"]
    for name in targets:
        header += [f"{name} tok/s", f"{name} decode ms/token"]
        if name != base:
            header += [f"tok/s ÷ {base}", f"decode ms/token ÷ {base}"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def fmt(value: float | None, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    for index in range(count):
        cells = [str(index + 1)]
        for name, row in targets.items():
            at = index < len(row["output_tok_s"])
            cells += [
                fmt(row["output_tok_s"][index] if at else None, ".1f"),
                fmt(row["decode_ms_per_token"][index] if at else None, ".2f"),
            ]
            if name != base:
                cells += [
                    fmt(row["output_tok_s_over_base"][index] if at else None, ".2f") + "x",
                    fmt(row["decode_ms_per_token_over_base"][index] if at else None, ".2f") + "x",
                ]
        lines.append("| " + " | ".join(cells) + " |")
    cells = ["median"]
    for name, row in targets.items():
        cells += ["", ""]
        if name != base:
            cells += [
                f"**{fmt(row['median_output_tok_s_over_base'], '.2f')}x**",
                f"**{fmt(row['median_decode_ms_per_token_over_base'], '.2f')}x**",
            ]
    lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
