"""Priority scheduling under load: an interactive class beside a saturating batch class, with and without priorities.

    python -m benchmarks priority --seats 8 --batch-requests 48 --interactive-requests 40 --interactive-rate 1

The batch class (priority 10: medium prompts, long outputs) arrives first, all at once and more requests than
seats, so the server is saturated; the interactive class (priority 0: short prompts, short outputs) arrives from
--interactive-start-s on as a Poisson stream. The same workload runs against one continuous-mode batchserve per
setting, one at a time: `fcfs` (every request sent with priority 0, the classes are only labels), `priority`
(--scheduling-policy priority: the queue by priority) and `preempt` (also --priority-preemption: a better request
takes a seat at once). Per class: TTFT and end-to-end latency as the client sees them (p50, p99), and what the
interactive class's gain costs the batch class: its output throughput, its latency, its preemptions.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.loadgen.arrivals import ArrivalConfig, arrival_offsets
from benchmarks.loadgen.client import ClientConfig, RequestRecord, discover_model, run_load
from benchmarks.loadgen.flags import add_seats_argument
from benchmarks.loadgen.server_proc import LaunchConfig, ServerProcess, ServerStartError
from benchmarks.loadgen.summaries import Summary, summarize
from benchmarks.loadgen.workloads import RequestSpec, make_prompt
from benchmarks.peers.targets import ServerSettings, batchserve_target
from benchmarks.results_io.machine import dated_result_dir
from benchmarks.results_io.report import write_json

INTERACTIVE, BATCH = "interactive", "batch"
SETTINGS = ("fcfs", "priority", "preempt")
_HELP = {
    "batch_requests": "batch class: requests, all sent at the start (more than the seats saturates the server)",
    "batch_prompt_words": "batch class: prompt words (about one token each)",
    "batch_output_min": "batch class: max_tokens, drawn per request between min and max",
    "interactive_rate": "interactive class: requests per second (Poisson); inf sends them together",
    "interactive_start_s": "interactive class: seconds after the batch class before the first is sent",
    "seed": "seeds the prompts, the lengths and the arrivals",
}


def setting_flags(setting: str, threshold: int) -> tuple[str, ...]:
    """The server flags of a setting, beyond the seats and the model."""
    if setting == "fcfs":
        return ()
    flags: tuple[str, ...] = ("--scheduling-policy", "priority")
    if setting == "preempt":
        flags += ("--priority-preemption", "--priority-preemption-threshold", str(threshold))
    return flags


@dataclass(frozen=True)
class PriorityWorkload:
    batch_requests: int = 48
    batch_prompt_words: int = 64
    batch_output_min: int = 128  # drawn per request, so the batch class's seats free one at a time
    batch_output_max: int = 256
    batch_priority: int = 10
    interactive_requests: int = 40
    interactive_prompt_words: int = 16
    interactive_output: int = 16
    interactive_priority: int = 0
    interactive_rate: float = 1.0  # req/s, Poisson
    interactive_start_s: float = 2.0  # after the batch class has filled the seats
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("batch_requests", "batch_prompt_words", "interactive_requests", "interactive_prompt_words"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.batch_output_min <= self.batch_output_max:
            raise ValueError(
                f"batch output needs 1 <= min <= max, got {self.batch_output_min}..{self.batch_output_max}"
            )
        if self.interactive_output < 1:
            raise ValueError(f"interactive-output must be >= 1, got {self.interactive_output}")
        if not self.interactive_rate > 0 or self.interactive_start_s < 0:
            raise ValueError("interactive-rate must be > 0 (or inf) and interactive-start-s >= 0")

    def requests(self, send_priority: bool) -> tuple[list[RequestSpec], list[float]]:
        """The requests and their send offsets (s); with `send_priority` off every request goes as priority 0 (an
        fcfs server refuses any other value), keeping its class as its `kind`."""
        rng = np.random.default_rng(self.seed)
        specs: list[RequestSpec] = []
        offsets: list[float] = []
        batch_priority = self.batch_priority if send_priority else 0
        for i in range(self.batch_requests):
            tokens = int(rng.integers(self.batch_output_min, self.batch_output_max + 1))
            prompt = make_prompt(rng, self.batch_prompt_words)
            specs.append(RequestSpec(i, prompt, tokens, self.batch_prompt_words, BATCH, priority=batch_priority))
            offsets.append(0.0)
        arrivals = ArrivalConfig(request_rate=self.interactive_rate, seed=self.seed)
        interactive_priority = self.interactive_priority if send_priority else 0
        for j, offset in enumerate(arrival_offsets(arrivals, self.interactive_requests)):
            prompt = make_prompt(rng, self.interactive_prompt_words)
            index = self.batch_requests + j
            words = self.interactive_prompt_words
            spec = RequestSpec(
                index, prompt, self.interactive_output, words, INTERACTIVE, priority=interactive_priority
            )
            specs.append(spec)
            offsets.append(self.interactive_start_s + offset)
        return specs, offsets


def class_summary(records: Sequence[RequestRecord], kind: str) -> dict[str, Any]:
    """One class's latencies (client side), throughput over its own span, and the preemptions the server reports."""
    mine = [r for r in records if r.kind == kind]
    span = max(r.end_time for r in mine) - min(r.send_time for r in mine)
    summary: Summary = summarize(mine, max(span, 1e-9))
    preemptions = sum(int((r.server_timings or {}).get("num_preemptions") or 0) for r in mine)
    return {**summary.to_dict(), "preemptions": preemptions}


async def measure(
    base_url: str, specs: Sequence[RequestSpec], offsets: Sequence[float], client: ClientConfig, warmup: int = 1
) -> dict[str, Any]:
    """Warm up, run the workload once, summarise each class; the raw records under "records"."""
    client = dataclasses.replace(client, base_url=base_url, model=client.model or await discover_model(base_url))
    rng = np.random.default_rng(12345)
    warmups = [RequestSpec(-1 - i, make_prompt(rng, 16), 4, 16, "warmup") for i in range(warmup)]
    if warmups:
        warm = await run_load(
            warmups, [0.0] * len(warmups), dataclasses.replace(client, show_progress=False, seed=None)
        )
        errors = [r.error for r in warm.records if r.error is not None]
        if errors:
            raise RuntimeError(f"warm-up request failed: {errors[0]}")
    load = await run_load(specs, offsets, client)
    return {
        "duration_s": load.duration_s,
        "classes": {kind: class_summary(load.records, kind) for kind in (INTERACTIVE, BATCH)},
        "records": [r.to_dict() for r in load.records],
    }


def _ms(dist: dict[str, float] | None, stat: str) -> str:
    return "n/a" if dist is None else f"{dist[stat]:.0f}"


def table(results: dict[str, dict[str, Any]]) -> str:
    """Markdown: one row per setting and class."""
    lines = [
        "| setting | class | TTFT p50 (ms) | TTFT p99 (ms) | e2e p50 (ms) | e2e p99 (ms) | output tok/s "
        "| preemptions | failed |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for setting, result in results.items():
        for kind, c in result["classes"].items():
            row = [setting, kind, _ms(c["ttft_ms"], "p50"), _ms(c["ttft_ms"], "p99"), _ms(c["e2e_ms"], "p50")]
            row += [_ms(c["e2e_ms"], "p99"), f"{c['output_throughput']:.1f}", str(c["preemptions"]), str(c["failed"])]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks priority", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out", type=Path, default=None, help="folder (default: benchmarks/results/priority/<date>-<machine>)"
    )
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma list of {', '.join(SETTINGS)}")
    g = parser.add_argument_group("servers (continuous mode)")
    add_seats_argument(g, help="--max-num-seqs")
    g.add_argument("--threshold", type=int, default=1, help="preempt: --priority-preemption-threshold")
    g.add_argument("--model", default=None, help="batchserve --model (default: its default model)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--device", default=None, help="batchserve --device: cpu, cuda or auto")
    g.add_argument("--dtype", default=None, help="batchserve --dtype")
    g.add_argument("--quantization", default=None, help="batchserve --quantization")
    g.add_argument("--health-timeout", type=float, default=180.0, help="seconds to wait for /health")
    g.add_argument("--stop-grace", type=float, default=15.0, help="seconds between SIGTERM and SIGKILL")
    w = PriorityWorkload()
    g = parser.add_argument_group("workload")
    for field in dataclasses.fields(PriorityWorkload):
        flag = "--" + field.name.replace("_", "-")
        default = getattr(w, field.name)
        help_text = f"{_HELP[field.name]} (default: {default})" if field.name in _HELP else f"(default: {default})"
        g.add_argument(flag, type=type(default), default=default, help=help_text)
    g = parser.add_argument_group("client")
    g.add_argument("--warmup", type=int, default=1, help="warm-up requests per server, excluded from results")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    g.add_argument("--no-progress", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    try:
        unknown = [s for s in settings if s not in SETTINGS]
        if unknown or not settings:
            raise ValueError(f"--settings: choose from {', '.join(SETTINGS)}, got {args.settings!r}")
        workload = PriorityWorkload(**{f.name: getattr(args, f.name) for f in dataclasses.fields(PriorityWorkload)})
        server = ServerSettings(
            seats=args.seats,
            model=args.model,
            max_num_batched_tokens=args.max_num_batched_tokens,
            device=args.device,
            dtype=args.dtype,
            quantization=args.quantization,
        )
        if args.threshold < 1:
            raise ValueError(f"--threshold must be >= 1, got {args.threshold}")
    except ValueError as exc:
        parser.error(str(exc))
    out: Path = args.out or dated_result_dir("priority")
    results: dict[str, dict[str, Any]] = {}
    servers: dict[str, str] = {}
    failed: dict[str, str] = {}
    for setting in settings:
        target = batchserve_target(setting, "continuous", server)
        argv_ = target.argv + setting_flags(setting, args.threshold)
        launch = LaunchConfig(argv_, health_timeout_s=args.health_timeout, stop_grace_s=args.stop_grace)
        specs, offsets = workload.requests(send_priority=setting != "fcfs")
        try:
            with ServerProcess(launch, out / "raw" / f"{setting}.server.log") as process:
                servers[setting] = shlex.join(process.command)
                client = ClientConfig(
                    process.base_url,
                    seed=args.seed,
                    request_timeout_s=args.request_timeout,
                    show_progress=not args.no_progress,
                    progress_label=setting,
                )
                measured = asyncio.run(measure(process.base_url, specs, offsets, client, args.warmup))
        except (ServerStartError, RuntimeError, OSError) as exc:
            failed[setting] = f"{type(exc).__name__}: {exc}"
            print(f"{setting} failed: {exc}", file=sys.stderr)
            continue
        write_json(out / "raw" / f"{setting}.json", measured.pop("records"), with_machine=False)
        results[setting] = measured
        print(table({setting: measured}))
    document = {
        "command": shlex.join([sys.executable, "-m", "benchmarks", "priority", *argv]),
        "workload": dataclasses.asdict(workload),
        "seats": args.seats,
        "threshold": args.threshold,
        "servers": servers,
        "failed": failed,
        "results": results,
    }
    print(write_json(out / "result.json", document))
    report = f"# Priority classes under load\n\n`{document['command']}`\n\n{table(results)}\n"
    (out / "report.md").write_text(report)
    print("\n" + table(results))
    complete = not failed and all(c["failed"] == 0 for r in results.values() for c in r["classes"].values())
    return 0 if complete else 1
