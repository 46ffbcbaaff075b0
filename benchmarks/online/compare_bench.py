"""Benchmarks of `batchserve compare` and the event stream (issue 11), on a quiet machine.

    python -m benchmarks compare fairness --seats 8 --concurrency 8 --duration 60 --out fairness.json
    python -m benchmarks compare overhead --seats 8 --concurrency 8 --duration 30 --repeats 3 --out overhead.json

`fairness` starts `batchserve compare` and measures each mode's output throughput alone (the other mode idle),
then with both modes loaded at once: with an equal share of the machine, each mode gets about half of its
throughput alone. `overhead` starts `batchserve serve` in each mode and measures throughput with 4 subscribers
reading `/v1/events` (with text, as the page reads it) against none, alternating the two, `--repeats` times.

The load is closed-loop: `--concurrency` clients per mode, each sending its next streaming request as soon as the
last one ends, for `--warmup` + `--duration` seconds. Throughput counts the output tokens that arrive within the
measured window (from the streams' continuous usage), so a mode finishing its last requests alone never counts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.loadgen.flags import add_seats_argument
from benchmarks.loadgen.server_proc import LaunchConfig, ServerProcess
from benchmarks.loadgen.sse import DONE, SSEParser
from benchmarks.results_io.report import write_json

SUBSCRIBERS = 4
DEFAULT_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 2


@dataclass(frozen=True)
class Load:
    concurrency: int
    max_tokens: int
    prompt: str
    warmup_s: float
    duration_s: float
    api_key: str | None = None

    def headers(self) -> dict[str, str]:
        return {} if self.api_key is None else {"Authorization": f"Bearer {self.api_key}"}


@dataclass(frozen=True)
class Measured:
    output_tok_s: float
    tokens: int
    requests: int
    errors: int


async def _one_request(client: httpx.AsyncClient, url: str, load: Load, arrivals: list[tuple[float, int]]) -> bool:
    body = {
        "prompt": load.prompt,
        "max_tokens": load.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    seen = 0
    async with client.stream("POST", url, json=body, headers=load.headers()) as response:
        if response.status_code != 200:
            await response.aread()
            return False
        parser = SSEParser()
        async for raw in response.aiter_bytes():
            now = time.perf_counter()
            for event in parser.feed(raw):
                if event.data == DONE:
                    continue
                usage = json.loads(event.data).get("usage") or {}
                tokens = int(usage.get("completion_tokens") or 0)
                if tokens > seen:
                    arrivals.append((now, tokens - seen))
                    seen = tokens
    return seen == load.max_tokens


async def drive(base_url: str, load: Load) -> Measured:
    """Closed-loop load on one prefix (`base_url` ends where `/v1` starts) for warm-up plus the window."""
    arrivals: list[tuple[float, int]] = []
    start = time.perf_counter()
    window = (start + load.warmup_s, start + load.warmup_s + load.duration_s)
    counts = {"requests": 0, "errors": 0}
    url = base_url.rstrip("/") + "/v1/completions"
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0)) as client:

        async def worker() -> None:
            while time.perf_counter() < window[1]:
                try:
                    ok = await _one_request(client, url, load, arrivals)
                except httpx.HTTPError:
                    ok = False
                counts["requests"] += 1
                counts["errors"] += 0 if ok else 1

        await asyncio.gather(*(worker() for _ in range(load.concurrency)))
    tokens = sum(n for t, n in arrivals if window[0] <= t < window[1])
    return Measured(tokens / load.duration_s, tokens, counts["requests"], counts["errors"])


async def _subscribe(url: str, load: Load, received: list[int]) -> None:
    async with (
        httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0)) as client,
        client.stream("GET", url, headers=load.headers()) as response,
    ):
        response.raise_for_status()
        async for chunk in response.aiter_bytes():
            received[0] += len(chunk)


async def drive_with_subscribers(base_url: str, events_url: str, load: Load, subscribers: int) -> tuple[Measured, int]:
    """`drive`, with `subscribers` clients reading the event stream throughout; returns the bytes they read."""
    received = [0]
    readers = [asyncio.ensure_future(_subscribe(events_url, load, received)) for _ in range(subscribers)]
    try:
        await asyncio.sleep(0.5 if subscribers else 0.0)  # connected before the load starts
        measured = await drive(base_url, load)
    finally:
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
    return measured, received[0]


async def fairness(base_url: str, load: Load) -> dict[str, Any]:
    alone = {mode: await drive(f"{base_url}/{mode}", load) for mode in ("dynamic", "continuous")}
    both_runs = await asyncio.gather(*(drive(f"{base_url}/{mode}", load) for mode in ("dynamic", "continuous")))
    both = dict(zip(("dynamic", "continuous"), both_runs, strict=True))
    return {
        mode: {
            "alone": asdict(alone[mode]),
            "both_loaded": asdict(both[mode]),
            "share": both[mode].output_tok_s / alone[mode].output_tok_s if alone[mode].output_tok_s else None,
        }
        for mode in alone
    }


async def overhead(base_url: str, load: Load, repeats: int) -> dict[str, Any]:
    pairs: list[dict[str, Any]] = []
    for _ in range(repeats):  # alternate, so drift in the machine's speed hits both sides alike
        without, _ = await drive_with_subscribers(base_url, f"{base_url}/v1/events", load, 0)
        with_subs, read = await drive_with_subscribers(base_url, f"{base_url}/v1/events", load, SUBSCRIBERS)
        pairs.append({"without": asdict(without), "with": asdict(with_subs), "event_bytes_read": read})
    ratios = [p["with"]["output_tok_s"] / p["without"]["output_tok_s"] for p in pairs if p["without"]["output_tok_s"]]
    return {"runs": pairs, "ratios": ratios, "median_ratio": statistics.median(ratios) if ratios else None}


def _server_argv(command: str, args: argparse.Namespace, mode: str | None) -> tuple[str, ...]:
    argv = [sys.executable, "-m", "api", command, "--host", "{host}", "--port", "{port}"]
    if command == "compare":
        argv += ["--seats", str(args.seats)]
    else:
        argv += ["--mode", str(mode), "--max-batch-size", str(args.seats), "--max-num-seqs", str(args.seats)]
    if args.model:
        argv += ["--model", args.model]
    argv += ["--max-queue", str(max(256, 4 * args.concurrency))]
    return tuple(argv)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks compare", description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("fairness", "overhead"))
    parser.add_argument("--base-url", default=None, help="a running server (compare for fairness; serve for "
                        "overhead); default: start one on a free port")  # fmt: skip
    parser.add_argument("--model", default=None, help="batchserve --model (default: its default model)")
    add_seats_argument(parser)
    parser.add_argument("--concurrency", type=int, default=8, help="clients per mode")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="every request's prompt")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds of load before the window")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds measured")
    parser.add_argument("--repeats", type=int, default=3, help="overhead: with/without pairs")
    parser.add_argument("--modes", default="dynamic,continuous", help="overhead: the modes to measure")
    parser.add_argument("--out", type=Path, default=None)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    load = Load(args.concurrency, args.max_tokens, args.prompt, args.warmup, args.duration)
    log_dir = (args.out.parent if args.out else Path(".")) / "compare_bench_logs"
    result: dict[str, Any] = {"what": args.what, "argv": list(argv or sys.argv[1:]), "load": asdict(load)}
    if args.what == "fairness":
        if args.base_url:
            result["fairness"] = asyncio.run(fairness(args.base_url, load))
        else:
            with ServerProcess(LaunchConfig(_server_argv("compare", args, None)), log_dir / "compare.log") as server:
                result["fairness"] = asyncio.run(fairness(server.base_url, load))
        for mode, row in result["fairness"].items():
            print(f"{mode:>10}: alone {row['alone']['output_tok_s']:.1f} tok/s, both loaded "
                  f"{row['both_loaded']['output_tok_s']:.1f} tok/s, share {row['share']:.2f} (fair: 0.50)")  # fmt: skip
    else:
        result["overhead"] = {}
        for mode in args.modes.split(","):
            if args.base_url:
                measured = asyncio.run(overhead(args.base_url, load, args.repeats))
            else:
                config = LaunchConfig(_server_argv("serve", args, mode))
                with ServerProcess(config, log_dir / f"serve-{mode}.log") as server:
                    measured = asyncio.run(overhead(server.base_url, load, args.repeats))
            result["overhead"][mode] = measured
            ratios = ", ".join(f"{r:.3f}" for r in measured["ratios"])
            print(f"{mode:>10}: with {SUBSCRIBERS} subscribers / without = {measured['median_ratio']:.3f} "
                  f"(median of {ratios}; goal >= 0.95)")  # fmt: skip
    if args.out is not None:
        write_json(args.out, result)
        print(f"wrote {args.out}")
    return 0
