"""Lone requests through a real server: what the engine-only profile cannot see.

The simulator's clock advances only by engine steps. A request to the real server also pays for HTTP, tokenising,
the loop's wake-up and SSE framing, and at light load its prefill runs on an engine that sat idle, beside the API's
own work on the same cores. `probe` starts `batchserve serve` (continuous mode, the profile's engine flags) and
sends `count` lone streaming requests `gap_s` apart, so each finds the engine idle, and splits each with the
`timings` the server reports:

- served prefill: the server's time to first token minus its queue time (the lone prompt's step, as served);
- outside the step: the client's time to first token minus that (everything a request pays that is not the step);
- served decode step: the server's decode time over the tokens after the first.

Then the same lone requests again, each arriving while one long stream keeps the engine stepping. A request that
arrives mid-step is read, parsed and tokenised on the cores the compute threads are using, so the running step
takes longer and the request's own path outside the steps does too. `split_busy` measures both against the idle
requests: the stall (its queue beyond the half step an arrival waits on average, the background stream's decode
step taken from its inter-token gaps while no probe request is in flight) and the extra time outside the steps
(client minus server TTFT).

`probe_load` then measures what serving adds under load, in one mode: a burst of streaming requests that keeps
every seat busy, its span taken from the server's own stamps and its trace exported, so that the profile can
replay the very same requests on its engine alone right after (`benchmarks.sim.profiling.engine_replay`) and
`benchmarks.sim.cost.served` can turn the difference into a cost per step and per streamed token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from api.config import ServerConfig
from api.flags import flags_argv
from benchmarks.loadgen.client import ClientConfig, RequestRecord, run_load
from benchmarks.loadgen.server_proc import LaunchConfig, ServerProcess
from benchmarks.loadgen.trace import TraceRequest, from_records
from benchmarks.loadgen.workloads import RequestSpec, make_prompt
from benchmarks.sim.cost.files import BusyArrival

PROBE_PROMPT_WORDS = 30  # about 40 tokens: a short prompt of the mixed workload
PROBE_MAX_TOKENS = 16
BUSY_GAP_S = 0.4  # between the busy phase's requests: each 16-token answer is done before the next arrives
BUSY_REQUESTS_PER_LONE = 2  # an arrival waits a uniform share of a step: twice the samples for a steady median
BUSY_MARGIN = 1.5  # the background stream lasts this much longer than the busy phase, at the lone decode step
LOAD_PROBE_MAX_TOKENS = 96  # each load-probe request's answer: long enough that decode steps dominate
LOAD_PROBE_ROW_TOKENS = 512  # cache a load-probe request may take: its prompt (40 tokens on SmolLM2), answer, margin


@dataclass(frozen=True)
class ServedProbe:
    prefill_s: float  # median served lone-prefill step after idle
    outside_step_s: float  # median client TTFT minus the served prefill step
    decode_step_s: float  # median served decode step of a lone request
    prompt_tokens: int  # the probe prompt's length, as the server counted it
    count: int
    busy_stall_s: float = 0.0  # how much longer a step runs when a request arrives during it
    busy_outside_s: float = 0.0  # the extra time outside the steps of a request that arrives mid-step


@dataclass(frozen=True)
class ServedLoad:
    """A burst through a real server: what it was asked (the trace, in the server's order) and how long it took."""

    seats: int
    trace: tuple[TraceRequest, ...]
    span_s: float  # the first arrival to the last release, on the server's stamps


def serve_argv(args: object, skip: Sequence[str]) -> list[str]:
    """`serve` flags for every ServerConfig field that `args` sets away from its default (the engine's shape)."""
    changed = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(ServerConfig)
        if f.name not in skip and getattr(args, f.name, f.default) != f.default
    }
    return flags_argv(changed)


def _checked(r: RequestRecord) -> tuple[float, dict[str, Any]]:
    """A probe request's client TTFT and the server's timings; raises if it failed or the server sent none."""
    if not r.ok or r.ttft is None or r.server_timings is None:
        raise RuntimeError(f"probe request {r.index} failed: {r.error or 'no timings'}")
    return r.ttft, r.server_timings


def split(records: Sequence[RequestRecord]) -> ServedProbe:
    """The medians over the probe's requests; raises if any failed or the server sent no timings."""
    prefill, outside, decode, prompt = [], [], [], []
    for r in records:
        ttft, t = _checked(r)
        step = (float(t["time_to_first_token_ms"]) - float(t["queue_time_ms"])) / 1e3
        prefill.append(step)
        outside.append(ttft - step)
        if r.output_tokens > 1 and t.get("decode_time_ms") is not None:
            decode.append(float(t["decode_time_ms"]) / 1e3 / (r.output_tokens - 1))
        prompt.append(r.prompt_tokens or 0)
    if not decode:
        raise RuntimeError("no probe request decoded past its first token")
    return ServedProbe(
        prefill_s=statistics.median(prefill),
        outside_step_s=max(0.0, statistics.median(outside)),
        decode_step_s=statistics.median(decode),
        prompt_tokens=int(statistics.median(prompt)),
        count=len(records),
    )


def _ttft_beyond_server(r: RequestRecord) -> float:
    """The client's time to first token minus the server's (the request's path outside the server's clock)."""
    assert r.ttft is not None and r.server_timings is not None
    return r.ttft - float(r.server_timings["time_to_first_token_ms"]) / 1e3


def _queue_s(r: RequestRecord) -> float:
    assert r.server_timings is not None
    return float(r.server_timings["queue_time_ms"]) / 1e3


def _lone_background_step(background: RequestRecord, busy: Sequence[RequestRecord]) -> float:
    """The background stream's median gap between tokens while no probe request was in flight: the one-row step
    an arrival lands in (gaps that overlap a probe request's life are two-row steps, or stretched by it)."""
    chunks = background.chunk_times
    lives = [(r.send_time, r.end_time) for r in busy]
    alone = [b - a for a, b in itertools.pairwise(chunks) if not any(s < b and a < e for s, e in lives)]
    return float(np.median(alone if alone else np.diff(chunks)))


def split_busy(idle: Sequence[RequestRecord], busy: Sequence[RequestRecord], background: RequestRecord) -> BusyArrival:
    """Medians of the busy requests against the idle ones. A request that arrives at a random moment of a step
    waits for half of it on average; the queue beyond that is the stall its own intake caused. Only requests
    sent while the background stream still ran count; fewer than half of them is an error (a stream too short for
    the phase: a small --max-model-len, or a very fast engine)."""
    for r in (*idle, *busy):
        _checked(r)
    if not background.ok or len(background.chunk_times) < 3:
        raise RuntimeError(f"the busy probe's background stream failed: {background.error or 'too few tokens'}")
    beside = [r for r in busy if r.send_time < background.chunk_times[-1]]
    if 2 * len(beside) < len(busy):
        raise RuntimeError(
            f"the busy probe's background stream ended before {len(busy) - len(beside)} of its {len(busy)} requests"
        )
    half_step = _lone_background_step(background, beside) / 2
    queue_beyond = statistics.median(map(_queue_s, beside)) - statistics.median(map(_queue_s, idle))
    outside_beyond = statistics.median(map(_ttft_beyond_server, beside)) - statistics.median(
        map(_ttft_beyond_server, idle)
    )
    return BusyArrival(stall_s=max(0.0, queue_beyond - half_step), outside_s=max(0.0, outside_beyond))


def _serve_command(mode: str, flags: Sequence[str]) -> LaunchConfig:
    argv = (sys.executable, "-m", "api", "serve", "--mode", mode, "--host", "{host}", "--port", "{port}")
    return LaunchConfig((*argv, *flags))


def _specs(count: int, max_tokens: int, seed: int) -> list[RequestSpec]:
    rng = np.random.default_rng(seed)
    return [
        RequestSpec(i, make_prompt(rng, PROBE_PROMPT_WORDS), max_tokens, PROBE_PROMPT_WORDS, "probe")
        for i in range(count)
    ]


def _max_model_len(base_url: str) -> int:
    models = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=30.0).json()["data"]
    return int(models[0]["max_model_len"])


def probe(flags: Sequence[str], count: int, gap_s: float, log_path: Path) -> ServedProbe:
    """`count` lone requests `gap_s` apart on an idle server, then twice as many beside one long stream."""
    specs = _specs(count + 1, PROBE_MAX_TOKENS, seed=0)
    offsets = [i * gap_s for i in range(count + 1)]
    with ServerProcess(_serve_command("continuous", flags), log_path) as server:
        config = ClientConfig(base_url=server.base_url, show_progress=False)
        idle = asyncio.run(run_load(specs, offsets, config)).records[1:]  # the first warms first-use paths
        lone = split(idle)
        room = _max_model_len(server.base_url) - 4 * PROBE_PROMPT_WORDS  # a prompt's tokens, with a margin
        background, busy_specs, busy_offsets = _busy_phase(BUSY_REQUESTS_PER_LONE * count, room, lone.decode_step_s)
        busy_records = asyncio.run(run_load([background, *busy_specs], [0.0, *busy_offsets], config)).records
    busy = split_busy(idle, busy_records[1:], busy_records[0])
    return dataclasses.replace(lone, busy_stall_s=busy.stall_s, busy_outside_s=busy.outside_s)


def _busy_phase(count: int, room: int, decode_step_s: float) -> tuple[RequestSpec, list[RequestSpec], list[float]]:
    """The background stream and `count` requests `BUSY_GAP_S` apart (closer where the model's context cannot hold
    a stream that long), the stream sized to outlast them by half again at the lone decode step."""
    gap = min(BUSY_GAP_S, room * decode_step_s / (BUSY_MARGIN * (count + 1)))
    tokens = min(room, math.ceil(BUSY_MARGIN * (count + 1) * gap / decode_step_s))
    prompt = make_prompt(np.random.default_rng(3), PROBE_PROMPT_WORDS)
    background = RequestSpec(count, prompt, tokens, PROBE_PROMPT_WORDS, "background")
    return background, _specs(count, PROBE_MAX_TOKENS, seed=4), [gap * (i + 1) for i in range(count)]


def probe_load(flags: Sequence[str], mode: str, seats: int, count: int, log_path: Path) -> ServedLoad:
    """`count` streaming requests at once on a server of `seats` seats in `mode`, each a short prompt and
    `LOAD_PROBE_MAX_TOKENS` tokens: the seats stay full while requests finish and others take their place."""
    seat_flag = "--max-batch-size" if mode == "dynamic" else "--max-num-seqs"
    with ServerProcess(_serve_command(mode, (*flags, seat_flag, str(seats))), log_path) as server:
        config = ClientConfig(base_url=server.base_url, show_progress=False)
        asyncio.run(run_load(_specs(1, PROBE_MAX_TOKENS, seed=1), [0.0], config))  # the server's first-use paths
        records = asyncio.run(run_load(_specs(count, LOAD_PROBE_MAX_TOKENS, seed=2), [0.0] * count, config)).records
    failed = [r for r in records if not r.ok or r.server_timings is None]
    if failed:
        raise RuntimeError(f"load probe request {failed[0].index} failed: {failed[0].error or 'no timings'}")
    return ServedLoad(seats, tuple(from_records(records)), served_span(records))


def served_span(records: Sequence[RequestRecord]) -> float:
    """From the first request's arrival at the server to the last one's release, on the server's own stamps."""
    arrivals, ends = [], []
    for r in records:
        t = r.server_timings or {}
        arrivals.append(float(t["arrival_time"]))
        ends.append(float(t["arrival_time"]) + float(t["e2e_time_ms"]) / 1e3)
    return max(ends) - min(arrivals)
