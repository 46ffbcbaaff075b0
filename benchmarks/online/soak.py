"""A long soak of a real server: mixed load on both modes for many minutes, with clients that disconnect
mid-stream and bad requests mixed in, sampling the server's resident memory, open descriptors, threads and
/metrics gauges every interval; a plot and a verdict against the targets at the end.

    python -m benchmarks soak --minutes 30 --out benchmarks/results/soak/<date>-<machine>

One `batchserve compare` process serves both modes (the default model, each mode half the machine), so one run
covers both. Each of `--clients` workers loops: pick a mode and a request shape at random (seeded), send it,
and read it to the end, or (one in five) drop the connection after a few streamed tokens, or (one in ten) send
a bad request and check it gets a 400. Targets: resident memory after the warm-up (the first fifth) grows by
under 2 %, descriptors and threads are flat (the same range after the warm-up as in the last fifth), and every
mode's running and waiting gauges and KV cache usage are back to 0 at the end. Writes DIR/result.json,
DIR/samples.json and DIR/soak.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from benchmarks.loadgen.flags import add_seats_argument
from benchmarks.loadgen.proc_status import field_mb, status_fields
from benchmarks.loadgen.server_proc import LaunchConfig, ServerProcess
from benchmarks.results_io.report import write_json

MODES = ("dynamic", "continuous")
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "while", "tiny", "numbers", "hum", "along")
BAD_BODIES: tuple[dict[str, object], ...] = (
    {"prompt": "hi", "max_tokens": -1},
    {"prompt": "hi", "allowed_token_ids": []},
    {"prompt": "hi", "logit_bias": {"1": 1, "01": 1}},
    {"prompt": "hi", "temperature": "hot"},
    {"messages": []},
)


@dataclass(frozen=True)
class Sample:
    elapsed_s: float
    rss_mb: float
    fds: int
    threads: int
    gauges: dict[str, float]  # "<mode>:<gauge>" -> value


@dataclass
class Counts:
    completed: int = 0
    disconnected: int = 0
    bad_refused: int = 0
    failures: int = 0


def process_sample(pid: int) -> tuple[float, int, int]:
    fields = status_fields(pid)
    return field_mb(fields, "VmRSS"), len(os.listdir(f"/proc/{pid}/fd")), int(fields["Threads"])


def read_gauges(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in text.splitlines():
        for gauge in GAUGES:
            if line.startswith(f"vllm:{gauge}{{"):
                mode = line.split('mode="', 1)[1].split('"', 1)[0] if 'mode="' in line else "all"
                values[f"{mode}:{gauge}"] = values.get(f"{mode}:{gauge}", 0.0) + float(line.rsplit(" ", 1)[1])
    return values


async def client_loop(base_url: str, seed: int, deadline: float, counts: Counts) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        while time.monotonic() < deadline:
            mode = rng.choice(MODES)
            roll = rng.random()
            if roll < 0.1:
                response = await client.post(f"/{mode}/v1/completions", json=rng.choice(BAD_BODIES))
                if response.status_code == 400:
                    counts.bad_refused += 1
                else:
                    counts.failures += 1
                continue
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 120)))
            body = {"prompt": prompt, "max_tokens": rng.randint(4, 96), "stream": True, "ignore_eos": True}
            leave_after = rng.randint(1, 4) if roll < 0.3 else None
            try:
                async with client.stream("POST", f"/{mode}/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        counts.failures += 1
                        continue
                    chunks = 0
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            chunks += 1
                            if leave_after is not None and chunks >= leave_after:
                                break  # the connection closes mid-stream
                    if leave_after is not None and chunks >= leave_after:
                        counts.disconnected += 1
                    else:
                        counts.completed += 1
            except httpx.HTTPError:
                counts.failures += 1


async def sampler(pid: int, base_url: str, started: float, deadline: float, every_s: float) -> list[Sample]:
    samples: list[Sample] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        while True:
            rss, fds, threads = process_sample(pid)
            gauges = read_gauges((await client.get("/metrics")).text)
            samples.append(Sample(round(time.monotonic() - started, 1), round(rss, 1), fds, threads, gauges))
            if time.monotonic() >= deadline:
                return samples
            await asyncio.sleep(every_s)


def verdict(samples: list[Sample], idle: Sample) -> dict[str, object]:
    warm = len(samples) // 5
    after = samples[warm:]
    last = samples[-max(1, len(samples) // 5) :]
    growth = (max(s.rss_mb for s in last) - after[0].rss_mb) / after[0].rss_mb * 100
    fds_flat = max(s.fds for s in last) <= max(s.fds for s in after[: len(after) // 2 or 1])
    threads_flat = max(s.threads for s in last) <= max(s.threads for s in after[: len(after) // 2 or 1])
    idle_ok = all(value == 0 for value in idle.gauges.values())
    return {
        "rss_growth_after_warmup_percent": round(growth, 2),
        "rss_target_met": growth < 2.0,
        "fds_flat": fds_flat,
        "threads_flat": threads_flat,
        "gauges_idle_at_end": idle_ok,
        "idle_gauges": idle.gauges,
    }


def plot(samples: list[Sample], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [s.elapsed_s / 60 for s in samples]
    figure, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    axes[0].plot(minutes, [s.rss_mb for s in samples])
    axes[0].set_ylabel("resident MB")
    axes[1].plot(minutes, [s.fds for s in samples], label="open descriptors")
    axes[1].plot(minutes, [s.threads for s in samples], label="threads")
    axes[1].legend()
    for mode in MODES:
        axes[2].plot(
            minutes, [s.gauges.get(f"{mode}:num_requests_running", 0) for s in samples], label=f"{mode} running"
        )
        axes[2].plot(
            minutes, [s.gauges.get(f"{mode}:num_requests_waiting", 0) for s in samples], label=f"{mode} waiting"
        )
        axes[3].plot(minutes, [s.gauges.get(f"{mode}:kv_cache_usage_perc", 0) for s in samples], label=mode)
    axes[2].legend()
    axes[3].set_ylabel("KV cache usage")
    axes[3].legend()
    axes[3].set_xlabel("minutes")
    figure.suptitle("batchserve compare under a mixed soak (both modes in one process)")
    figure.tight_layout()
    figure.savefig(path, dpi=90)


async def soak(args: argparse.Namespace) -> int:
    launch = LaunchConfig(
        (sys.executable, "-m", "api", "compare", "--host", "{host}", "--port", "{port}", "--seats", str(args.seats)),
        health_timeout_s=300,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    with ServerProcess(launch, args.out / "raw" / "server.log") as server:
        pid = server.pid
        started = time.monotonic()
        deadline = started + args.minutes * 60
        counts = Counts()
        clients = [client_loop(server.base_url, args.seed + i, deadline, counts) for i in range(args.clients)]
        sampling = asyncio.create_task(sampler(pid, server.base_url, started, deadline, args.every_s))
        await asyncio.gather(*clients)
        samples = await sampling
        await asyncio.sleep(2)  # disconnected sequences are aborted at the next step
        rss, fds, threads = process_sample(pid)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            idle = Sample(
                round(time.monotonic() - started, 1),
                rss,
                fds,
                threads,
                read_gauges((await client.get("/metrics")).text),
            )
    result = {
        "minutes": args.minutes,
        "clients": args.clients,
        "counts": asdict(counts),
        "verdict": verdict(samples, idle),
    }
    write_json(args.out / "samples.json", [asdict(s) for s in samples])
    print(write_json(args.out / "result.json", result))
    plot(samples, args.out / "soak.png")
    print(json.dumps(result["verdict"], indent=2), json.dumps(result["counts"]))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks soak", description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=12)
    add_seats_argument(parser, help="each mode's seats")
    parser.add_argument("--every-s", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    return asyncio.run(soak(parser.parse_args(argv)))
