"""What hostile grammar compiles cost everyone else: a plain request's latency and a running stream's longest gap
between tokens while N slow-compiling schemas are sent at once, through a real server.

    python -m benchmarks compile-stall [--hostile 1,8,64] [--out DIR]

Each round starts a stream (`--stream-tokens`, ignore_eos), waits for its first token, sends N requests whose
schema holds a `pattern` like `^h3x7[a-z]{1,20000}$` (50 bytes, each different so no cache helps), then one plain
completion (`--plain-tokens`), and reports the plain request's time against its time in a round with no hostile
request, the stream's longest gap after the hostile requests went out, and how the hostile requests were answered.
The server runs with `--grammar-max-repeat` above the pattern's bound, so the compiles really run (the default
budget would refuse them at once, which is the cheap case): this measures the compile pool and its deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.loadgen.server_proc import LaunchConfig, ServerProcess
from benchmarks.peers.targets import ServerSettings, batchserve_target
from benchmarks.results_io.report import write_json

PROMPT = "Write a long story about a lighthouse keeper."


@dataclass(frozen=True)
class Round:
    hostile: int
    plain_s: float
    plain_ratio: float  # against the round with no hostile request
    stream_max_gap_s: float  # the longest gap between two of the stream's events after the hostile requests left
    hostile_answers: dict[str, int]  # HTTP status -> count
    hostile_last_answer_s: float  # when the last hostile request was answered, from when they were sent


def hostile_body(tag: str, repeat: int) -> dict[str, object]:
    schema = {"type": "string", "pattern": f"^{tag}[a-z]{{1,{repeat}}}$"}
    return {"prompt": PROMPT, "max_tokens": 8, "guided_json": schema}


async def stream_times(client: httpx.AsyncClient, tokens: int, started: asyncio.Event) -> list[float]:
    """When each of a stream's events arrived."""
    body = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    times = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                times.append(time.monotonic())
                started.set()
    return times


def longest_gap_after(times: Sequence[float], since: float) -> float:
    """The longest wait for an event that came after `since`."""
    return max((b - a for a, b in itertools.pairwise(times) if b >= since), default=0.0)


async def one_round(
    client: httpx.AsyncClient, hostile: int, repeat: int, plain_tokens: int, stream_tokens: int
) -> dict[str, Any]:
    started = asyncio.Event()
    stream = asyncio.ensure_future(stream_times(client, stream_tokens, started))
    await started.wait()
    sent = time.monotonic()

    async def hostile_request(i: int) -> tuple[int, float]:
        response = await client.post("/v1/completions", json=hostile_body(f"h{hostile}x{i}", repeat))
        return response.status_code, time.monotonic() - sent

    hostiles = [asyncio.ensure_future(hostile_request(i)) for i in range(hostile)]
    await asyncio.sleep(0.2)  # the compiles have started
    plain = {"prompt": PROMPT, "max_tokens": plain_tokens, "temperature": 0, "ignore_eos": True}
    start = time.monotonic()
    (await client.post("/v1/completions", json=plain)).raise_for_status()
    plain_s = time.monotonic() - start
    gap = longest_gap_after(await stream, sent)
    answers = await asyncio.gather(*hostiles)
    return {
        "plain_s": plain_s,
        "gap": gap,
        "answers": dict(Counter(str(status) for status, _ in answers)),
        "last": max((t for _, t in answers), default=0.0),
    }


async def run(base_url: str, rounds: Sequence[int], repeat: int, plain_tokens: int, stream_tokens: int) -> list[Round]:
    limits = httpx.Limits(max_connections=256)
    async with httpx.AsyncClient(base_url=base_url, timeout=900, limits=limits) as client:
        await one_round(client, 0, repeat, plain_tokens, 4)  # warm-up
        alone = [await one_round(client, 0, repeat, plain_tokens, stream_tokens) for _ in range(2)]
        alone_s = statistics.median(r["plain_s"] for r in alone)
        results = [Round(0, alone_s, 1.0, max(r["gap"] for r in alone), {}, 0.0)]
        for hostile in rounds:
            r = await one_round(client, hostile, repeat, plain_tokens, stream_tokens)
            results.append(Round(hostile, r["plain_s"], r["plain_s"] / alone_s, r["gap"], r["answers"], r["last"]))
            print(json.dumps(asdict(results[-1])), flush=True)
            await asyncio.sleep(1.0)
    return results


def markdown(results: Sequence[Round]) -> str:
    rows = [
        "| hostile compiles | plain request | vs alone | stream's longest gap | hostile answers | last answered |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        answers = ", ".join(f"{n}x {status}" for status, n in sorted(r.hostile_answers.items())) or "-"
        rows.append(
            f"| {r.hostile} | {r.plain_s:.2f} s | {r.plain_ratio:.2f}x | {r.stream_max_gap_s * 1000:.0f} ms | "
            f"{answers} | {r.hostile_last_answer_s:.1f} s |"
        )
    return "\n".join(rows) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks compile-stall", description=__doc__.split("\n")[0])
    parser.add_argument("--hostile", default="1,8,64", help="comma-separated numbers of hostile requests per round")
    parser.add_argument("--repeat", type=int, default=20_000, help="the hostile pattern's repetition bound")
    parser.add_argument("--plain-tokens", type=int, default=64)
    parser.add_argument("--stream-tokens", type=int, default=256)
    parser.add_argument("--mode", default="continuous", choices=("dynamic", "continuous", "static"))
    parser.add_argument("--server-arg", action="append", default=[], help="one more flag for the server (repeatable)")
    parser.add_argument("--out", type=Path, default=None, help="a folder for result.json, report.md and the log")
    args = parser.parse_args(argv)
    out = args.out or Path("/tmp/compile-stall")
    target = batchserve_target("compile-stall", args.mode, ServerSettings())
    argv_extra = ("--grammar-max-repeat", str(args.repeat), *args.server_arg)
    target = dataclasses.replace(target, argv=(*target.argv, *argv_extra))
    launch = target.launch(LaunchConfig(target.argv, health_timeout_s=300))
    rounds = [int(n) for n in args.hostile.split(",") if n]
    with ServerProcess(launch, out / "server.log") as server:
        results = asyncio.run(run(server.base_url, rounds, args.repeat, args.plain_tokens, args.stream_tokens))
    table = markdown(results)
    print(table, end="")
    document = {
        "mode": args.mode,
        "repeat": args.repeat,
        "server_args": list(argv_extra),
        "rounds": [asdict(r) for r in results],
    }
    write_json(out / "result.json", document)
    (out / "report.md").write_text(
        f"# compile-stall\n\n`python -m benchmarks compile-stall {' '.join(argv or [])}`\n\n{table}"
    )
    return 0
