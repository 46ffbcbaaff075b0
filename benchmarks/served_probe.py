"""Lone requests through a real server: what the engine-only profile cannot see.

The simulator's clock advances only by engine steps. A request to the real server also pays for HTTP, tokenising,
the loop's wake-up and SSE framing, and at light load its prefill runs on an engine that sat idle, beside the API's
own work on the same cores. `probe` starts `batchserve serve` (continuous mode, the profile's engine flags) and
sends `count` lone streaming requests `gap_s` apart, so each finds the engine idle, and splits each with the
`timings` the server reports:

- served prefill: the server's time to first token minus its queue time (the lone prompt's step, as served);
- outside the step: the client's time to first token minus that (everything a request pays that is not the step);
- served decode step: the server's decode time over the tokens after the first.

`probe_steps` then measures what a step costs as served under load, in one mode: groups of B concurrent streaming
requests (B over the profile's batch sizes), each group's decode steps timed by the server, and right after each
group, with the server idle, the same B-row decode timed on the profile's own engine alone. This machine's speed
drifts by more than the difference within minutes, so the two are compared only back to back;
`benchmarks.served_cost` fits what the served step costs over the engine alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from api.cli import flags_argv
from api.config import ServerConfig
from benchmarks.client import ClientConfig, RequestRecord, run_load
from benchmarks.server_proc import LaunchConfig, ServerProcess
from benchmarks.workloads import RequestSpec, make_prompt

PROBE_PROMPT_WORDS = 30  # about 40 tokens: a short prompt of the mixed workload
PROBE_MAX_TOKENS = 16
STEP_PROBE_MAX_TOKENS = 64  # decode steps per request in a step-probe group
STEP_PROBE_CONTEXT_BUDGET = 256  # KV tokens a row of the engine-alone reference may need: prompt, answer, margin


@dataclass(frozen=True)
class ServedProbe:
    prefill_s: float  # median served lone-prefill step after idle
    outside_step_s: float  # median client TTFT minus the served prefill step
    decode_step_s: float  # median served decode step of a lone request
    prompt_tokens: int  # the probe prompt's length, as the server counted it
    count: int


@dataclass(frozen=True)
class ServedSteps:
    """Served decode steps of B concurrent requests, for each B, in one mode."""

    mode: str
    batch_sizes: tuple[int, ...]
    step_s: tuple[float, ...]  # median served decode step per batch size
    engine_step_s: tuple[float, ...]  # median B-row decode of the engine alone, timed right after each group
    context_tokens: int  # the steps' mean context: prompt plus half the answer


def serve_argv(args: object, skip: Sequence[str]) -> list[str]:
    """`serve` flags for every ServerConfig field that `args` sets away from its default (the engine's shape)."""
    changed = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(ServerConfig)
        if f.name not in skip and getattr(args, f.name, f.default) != f.default
    }
    return flags_argv(changed)


def split(records: Sequence[RequestRecord]) -> ServedProbe:
    """The medians over the probe's requests; raises if any failed or the server sent no timings."""
    prefill, outside, prompt = [], [], []
    for r in records:
        t = r.server_timings
        if not r.ok or r.ttft is None or t is None:
            raise RuntimeError(f"probe request {r.index} failed: {r.error or 'no timings'}")
        step = (float(t["time_to_first_token_ms"]) - float(t["queue_time_ms"])) / 1e3
        prefill.append(step)
        outside.append(r.ttft - step)
        prompt.append(r.prompt_tokens or 0)
    decode = decode_steps(records)
    if not decode:
        raise RuntimeError("no probe request decoded past its first token")
    return ServedProbe(
        prefill_s=statistics.median(prefill),
        outside_step_s=max(0.0, statistics.median(outside)),
        decode_step_s=statistics.median(decode),
        prompt_tokens=int(statistics.median(prompt)),
        count=len(records),
    )


def decode_steps(records: Sequence[RequestRecord]) -> list[float]:
    """Each request's served decode step: the server's decode time over the tokens after the first."""
    steps = []
    for r in records:
        t = r.server_timings
        if not r.ok or t is None:
            raise RuntimeError(f"probe request {r.index} failed: {r.error or 'no timings'}")
        if r.output_tokens > 1 and t.get("decode_time_ms") is not None:
            steps.append(float(t["decode_time_ms"]) / 1e3 / (r.output_tokens - 1))
    return steps


def _serve_command(mode: str, flags: Sequence[str]) -> LaunchConfig:
    argv = (sys.executable, "-m", "api", "serve", "--mode", mode, "--host", "{host}", "--port", "{port}")
    return LaunchConfig((*argv, *flags))


def _specs(count: int, max_tokens: int, seed: int) -> list[RequestSpec]:
    rng = np.random.default_rng(seed)
    return [
        RequestSpec(i, make_prompt(rng, PROBE_PROMPT_WORDS), max_tokens, PROBE_PROMPT_WORDS, "probe")
        for i in range(count)
    ]


def probe(flags: Sequence[str], count: int, gap_s: float, log_path: Path) -> ServedProbe:
    specs = _specs(count + 1, PROBE_MAX_TOKENS, seed=0)
    offsets = [i * gap_s for i in range(count + 1)]
    with ServerProcess(_serve_command("continuous", flags), log_path) as server:
        config = ClientConfig(base_url=server.base_url, show_progress=False)
        records = asyncio.run(run_load(specs, offsets, config)).records
    return split(records[1:])  # the first request warms the server's first-use paths


EngineDecode = Callable[[int, int], float]  # (rows, context) -> seconds of one decode step on the engine alone


def probe_steps(
    flags: Sequence[str], mode: str, batch_sizes: Sequence[int], repeats: int, engine_decode: EngineDecode,
    log_path: Path,
) -> ServedSteps:  # fmt: skip
    """Groups of B concurrent streaming requests arriving together, `repeats` groups per B, on a server of
    max(batch_sizes) seats: a group's requests decode side by side, B rows a step. After each group, while the
    server idles, `engine_decode` times the same decode on the engine alone."""
    seats = max(batch_sizes)
    seat_flag = "--max-batch-size" if mode == "dynamic" else "--max-num-seqs"
    served, alone, prompts = [], [], []
    with ServerProcess(_serve_command(mode, (*flags, seat_flag, str(seats))), log_path) as server:
        config = ClientConfig(base_url=server.base_url, show_progress=False)
        asyncio.run(run_load(_specs(1, PROBE_MAX_TOKENS, seed=1), [0.0], config))  # the server's first-use paths
        for size in batch_sizes:
            steps, references = [], []
            for repeat in range(repeats):
                specs = _specs(size, STEP_PROBE_MAX_TOKENS, seed=1000 * size + repeat)
                records = asyncio.run(run_load(specs, [0.0] * size, config)).records
                steps += decode_steps(records)
                group_prompt = int(statistics.median(r.prompt_tokens or 0 for r in records))
                prompts.append(group_prompt)
                references.append(engine_decode(size, group_prompt + STEP_PROBE_MAX_TOKENS // 2))
            served.append(statistics.median(steps))
            alone.append(statistics.median(references))
    context = int(statistics.median(prompts)) + STEP_PROBE_MAX_TOKENS // 2
    return ServedSteps(mode, tuple(batch_sizes), tuple(served), tuple(alone), context)
