"""Lone requests through a real server: what the engine-only profile cannot see.

The simulator's clock advances only by engine steps. A request to the real server also pays for HTTP, tokenising,
the loop's wake-up and SSE framing, and at light load its prefill runs on an engine that sat idle, beside the API's
own work on the same cores. `probe` starts `batchserve serve` (continuous mode, the profile's engine flags) and
sends `count` lone streaming requests `gap_s` apart, so each finds the engine idle, and splits each with the
`timings` the server reports:

- served prefill: the server's time to first token minus its queue time (the lone prompt's step, as served);
- outside the step: the client's time to first token minus that (everything a request pays that is not the step);
- served decode step: the server's decode time over the tokens after the first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import sys
from collections.abc import Sequence
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


@dataclass(frozen=True)
class ServedProbe:
    prefill_s: float  # median served lone-prefill step after idle
    outside_step_s: float  # median client TTFT minus the served prefill step
    decode_step_s: float  # median served decode step of a lone request
    prompt_tokens: int  # the probe prompt's length, as the server counted it
    count: int


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
    prefill, outside, decode, prompt = [], [], [], []
    for r in records:
        t = r.server_timings
        if not r.ok or r.ttft is None or t is None:
            raise RuntimeError(f"probe request {r.index} failed: {r.error or 'no timings'}")
        step = (float(t["time_to_first_token_ms"]) - float(t["queue_time_ms"])) / 1e3
        prefill.append(step)
        outside.append(r.ttft - step)
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


def probe(flags: Sequence[str], count: int, gap_s: float, log_path: Path) -> ServedProbe:
    argv = (sys.executable, "-m", "api", "serve", "--mode", "continuous", "--host", "{host}", "--port", "{port}")
    rng = np.random.default_rng(0)
    specs = [
        RequestSpec(i, make_prompt(rng, PROBE_PROMPT_WORDS), PROBE_MAX_TOKENS, PROBE_PROMPT_WORDS, "probe")
        for i in range(count + 1)
    ]
    offsets = [i * gap_s for i in range(count + 1)]
    with ServerProcess(LaunchConfig((*argv, *flags)), log_path) as server:
        config = ClientConfig(base_url=server.base_url, show_progress=False)
        records = asyncio.run(run_load(specs, offsets, config)).records
    return split(records[1:])  # the first request warms the server's first-use paths
