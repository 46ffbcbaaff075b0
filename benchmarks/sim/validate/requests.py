"""The simulator against a real run, request by request: where a headline error comes from.

A p50 over a couple of dozen requests moves by tens of per cent when two requests cross a gap between clusters of
latencies (requests that found the server idle and those that waited for another's step; short prompts and long
ones), so a validation table's error needs the requests behind it before it can say why.

    python -m benchmarks sim-requests MEASURED_DIR SIMULATED_DIR --run continuous@1

pairs each request of a real `python -m benchmarks ab` run (MEASURED_DIR/raw) with its simulated replay
(SIMULATED_DIR/raw, written by `python -m benchmarks simulate --replay MEASURED_DIR`): a replay's n-th request is the
n-th the server received (`loadgen.trace.replay_order`). It prints every pair (prompt, answer, how many other requests
the real server held when it arrived, TTFT and E2E measured and simulated); for the requests that found the server
idle, those that arrived beside others and all of them, the error of their p50s and the median of their own errors; and
the values either side of each p50.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.loadgen.client import RequestRecord
from benchmarks.loadgen.run import RunResult, rate_from_json
from benchmarks.loadgen.trace import replay_order, trace_prompt_tokens
from benchmarks.results_io.report import read_raw_runs

P50_NEIGHBOURS = 3  # requests shown either side of a p50


@dataclass(frozen=True)
class RequestPair:
    """One request as the real server served it and as its simulated replay did. Measured times run from the
    client's send, simulated ones from the replayed arrival at the server (seconds)."""

    position: int  # in the order the server received the requests (the trace's line)
    index: int  # the measured record's own index, to find it in raw/
    prompt_tokens: int
    output_tokens: int
    others_in_flight: int  # other requests the real server held when this one arrived
    measured_ttft_s: float
    simulated_ttft_s: float
    measured_e2e_s: float
    simulated_e2e_s: float

    @property
    def ttft_error(self) -> float:
        return self.simulated_ttft_s / self.measured_ttft_s - 1.0


@dataclass(frozen=True)
class GroupError:
    """The TTFTs of a group of requests, measured against simulated."""

    label: str
    count: int
    measured_ttft_p50_s: float
    simulated_ttft_p50_s: float
    median_ttft_error: float  # the median of the requests' own errors, not the error of the medians

    @property
    def p50_error(self) -> float:
        return self.simulated_ttft_p50_s / self.measured_ttft_p50_s - 1.0


REPLAY_TOLERANCE_S = 1e-5  # a trace keeps arrivals to the microsecond


def in_flight_at_arrival(arrivals: Sequence[float], ends: Sequence[float]) -> list[int]:
    """For each request, how many others had arrived and not yet ended when it arrived (one clock for both;
    requests that arrive at the same instant hold each other)."""
    if len(arrivals) != len(ends):
        raise ValueError(f"{len(arrivals)} arrivals but {len(ends)} ends")
    start, end = np.asarray(arrivals, dtype=float), np.asarray(ends, dtype=float)
    arrived = np.searchsorted(np.sort(start), start, side="right")  # itself included
    ended = np.searchsorted(np.sort(end), start, side="right")
    return [int(n) for n in np.maximum(arrived - ended - 1, 0)]


def _server_end(arrival: float, record: RequestRecord) -> float:
    """When the server let go of the request, on the replay's clock: its own e2e where it reported one (a client
    sees the stream close a few ms later), else the client's."""
    e2e_ms = (record.server_timings or {}).get("e2e_time_ms")
    if isinstance(e2e_ms, (int, float)):
        return arrival + float(e2e_ms) / 1e3
    return arrival + (record.end_time - record.send_time)


def pair_requests(measured: RunResult, simulated: RunResult) -> list[RequestPair]:
    """Every request both runs completed, paired by its place in the server's arrival order; ValueError where the
    simulated run is not a replay of the measured one (another count of requests, or a request with another
    arrival, prompt or max_tokens). A request that failed on either side is left out, but it still counts as
    held by the server for the others."""
    ordered = replay_order(measured.records)
    replayed = sorted(simulated.records, key=lambda r: r.index)
    if len(ordered) != len(replayed):
        raise ValueError(f"{len(ordered)} requests measured but {len(replayed)} simulated: not a replay of this run")
    others = in_flight_at_arrival([a for a, _ in ordered], [_server_end(a, r) for a, r in ordered])
    pairs = []
    for position, ((arrival, real), replay, held) in enumerate(zip(ordered, replayed, others, strict=True)):
        prompt = trace_prompt_tokens(real)
        mismatch = (
            f"arrival {arrival:.6f} s measured, {replay.send_time:.6f} simulated"
            if abs(replay.send_time - arrival) > REPLAY_TOLERANCE_S
            else f"{prompt} prompt tokens measured, {replay.prompt_tokens} simulated"
            if replay.prompt_tokens is not None and replay.prompt_tokens != prompt
            else f"max_tokens {real.max_tokens} measured, {replay.max_tokens} simulated"
            if replay.max_tokens != real.max_tokens
            else None
        )
        if mismatch is not None:
            raise ValueError(f"request {position}: {mismatch}: not a replay of this run")
        if not (real.ok and replay.ok and real.ttft is not None and replay.ttft is not None):
            continue
        pairs.append(
            RequestPair(
                position, real.index, prompt, real.output_tokens, held, real.ttft, replay.ttft, real.e2e, replay.e2e
            )
        )
    return pairs


def group_errors(pairs: Sequence[RequestPair]) -> list[GroupError]:
    """The requests that found the real server idle, those that arrived beside others, and all of them."""
    groups = (
        ("arrived to an idle server", [p for p in pairs if p.others_in_flight == 0]),
        ("arrived beside others", [p for p in pairs if p.others_in_flight > 0]),
        ("all", list(pairs)),
    )
    return [
        GroupError(
            label,
            len(members),
            statistics.median(p.measured_ttft_s for p in members),
            statistics.median(p.simulated_ttft_s for p in members),
            statistics.median(p.ttft_error for p in members),
        )
        for label, members in groups
        if members
    ]


def p50_neighbourhood(values: Sequence[float], neighbours: int = P50_NEIGHBOURS) -> tuple[list[float], float]:
    """The sorted values either side of the median, and the median: a gap among them makes the p50 fragile."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    low, high = max(0, middle - neighbours), min(len(ordered), middle + neighbours + (len(ordered) % 2))
    return ordered[low:high], statistics.median(ordered)


def find_run(out_dir: Path, name: str) -> RunResult:
    """`name` as a main run ("continuous") or a sweep run ("continuous@1", "dynamic@inf") of a result folder."""
    runs, sweep = read_raw_runs(out_dir)
    base, _, rate = name.partition("@")
    if not rate:
        if base not in runs:
            raise ValueError(f"{out_dir}: no run {base!r} (main runs: {', '.join(sorted(runs)) or 'none'})")
        return runs[base]
    wanted = rate_from_json(rate)
    for run in sweep.get(base, []):  # an exported rate keeps a few digits (1/3 is 0.333333)
        if math.isclose(run.request_rate, wanted, rel_tol=1e-6):  # inf too
            return run
    rates = ", ".join(f"{base}@{r.request_rate:g}" for r in sweep.get(base, []))
    raise ValueError(f"{out_dir}: no sweep run {name!r} (sweep runs: {rates or 'none'})")


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f}"


def render(pairs: Sequence[RequestPair], name: str, left_out: int = 0) -> str:
    """The pairs, the groups and the p50 windows as markdown."""
    failed = f" ({left_out} left out: failed on either side)" if left_out else ""
    lines = [
        f"## {name}: {len(pairs)} requests, measured against simulated{failed}",
        "",
        "| # | index | prompt | answer | others held | TTFT ms measured | simulated | error | E2E ms measured "
        "| simulated |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {p.position} | {p.index} | {p.prompt_tokens} | {p.output_tokens} | {p.others_in_flight} "
        f"| {_ms(p.measured_ttft_s)} | {_ms(p.simulated_ttft_s)} | {100 * p.ttft_error:+.1f}% "
        f"| {_ms(p.measured_e2e_s)} | {_ms(p.simulated_e2e_s)} |"
        for p in pairs
    ]
    lines += [
        "",
        "| requests | count | TTFT p50 ms measured | simulated | error of the p50s | median error of the requests |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {g.label} | {g.count} | {_ms(g.measured_ttft_p50_s)} | {_ms(g.simulated_ttft_p50_s)} "
        f"| {100 * g.p50_error:+.1f}% | {100 * g.median_ttft_error:+.1f}% |"
        for g in group_errors(pairs)
    ]
    lines.append("")
    for side, values in (
        ("measured", [p.measured_ttft_s for p in pairs]),
        ("simulated", [p.simulated_ttft_s for p in pairs]),
    ):
        around, median = p50_neighbourhood(values)
        lines.append(f"TTFT p50 {side} {_ms(median)} ms; sorted around it: {', '.join(_ms(v) for v in around)} ms")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks sim-requests",
        description="A real `python -m benchmarks ab` run and its simulated replay, request by request.",
        allow_abbrev=False,
    )
    parser.add_argument("measured", type=Path, help="the `python -m benchmarks ab` --out folder (with raw/)")
    parser.add_argument(
        "simulated", type=Path, help="the `python -m benchmarks simulate --replay ...` --out folder (with raw/)"
    )
    parser.add_argument("--run", required=True, help="a run's name: continuous, dynamic, or continuous@1 in a sweep")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        measured = find_run(args.measured, args.run)
        pairs = pair_requests(measured, find_run(args.simulated, args.run))
    except ValueError as exc:
        print(f"sim_requests: {exc}", file=sys.stderr)
        return 2
    if not pairs:
        print(f"sim_requests: no request of {args.run} completed in both runs", file=sys.stderr)
        return 2
    sys.stdout.write(render(pairs, args.run, left_out=len(measured.records) - len(pairs)))
    return 0
