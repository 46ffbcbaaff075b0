"""Scrape a server's Prometheus /metrics before and after a run and turn the difference into batching facts.

Counters and histogram sums only grow, so after-minus-before isolates the run even on a server that has
served other traffic. Samples are summed over label sets (one server reports one mode and model anyway).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

BATCH_SIZE = "batchserve:batch_size"
HELD_SEATS = "batchserve:held_seats_total"
STEPS = "batchserve:steps_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
TTFT = "vllm:time_to_first_token_seconds"
QUEUE = "vllm:request_queue_time_seconds"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens_total"
DRAFTS = "vllm:spec_decode_num_drafts_total"


def parse_metrics(text: str) -> dict[str, float]:
    """Sample name -> value summed over label sets; histogram buckets and `_created` stamps are dropped."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith(("_bucket", "_created")):
                continue
            totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
    return totals


async def scrape(base_url: str, timeout_s: float = 10.0) -> dict[str, float] | None:
    """None when the server has no Prometheus endpoint (peers such as llama-server without --metrics)."""
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            response = await client.get(base_url.rstrip("/") + "/metrics")
        if response.status_code != 200:
            return None
        return parse_metrics(response.text)
    except (httpx.HTTPError, ValueError):
        return None


@dataclass(frozen=True)
class ScrapedMetrics:
    """What the server says happened during the run; a field is None when the server doesn't export it."""

    steps: float | None
    mean_batch_size: float | None  # sequences per engine step
    held_seats: float | None  # seat-steps held by sequences that had already finished
    prompt_tokens: float | None
    generation_tokens: float | None
    mean_ttft_ms: float | None
    mean_queue_ms: float | None
    draft_tokens: float | None = None  # speculation: draft tokens verified (None: the server exports no such counter)
    accepted_tokens: float | None = None
    drafts: float | None = None  # rows that verified drafts, one per sequence and step

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _held_seats(before: dict[str, float], after: dict[str, float]) -> float | None:
    if HELD_SEATS in after:
        return after[HELD_SEATS] - before.get(HELD_SEATS, 0.0)
    # A labelled counter appears only once incremented: a batchserve that never held a seat
    # (continuous mode) exports steps but no held-seat sample, and that means zero.
    return 0.0 if STEPS in after else None


def metrics_delta(before: dict[str, float], after: dict[str, float]) -> ScrapedMetrics:
    def delta(name: str) -> float | None:
        if name not in after:
            return None
        return after[name] - before.get(name, 0.0)

    def mean(histogram: str, scale: float = 1.0) -> float | None:
        total, count = delta(histogram + "_sum"), delta(histogram + "_count")
        if total is None or not count:
            return None
        return total / count * scale

    return ScrapedMetrics(
        steps=delta(STEPS),
        mean_batch_size=mean(BATCH_SIZE),
        held_seats=_held_seats(before, after),
        prompt_tokens=delta(PROMPT_TOKENS),
        generation_tokens=delta(GENERATION_TOKENS),
        mean_ttft_ms=mean(TTFT, 1e3),
        mean_queue_ms=mean(QUEUE, 1e3),
        draft_tokens=delta(DRAFT_TOKENS),
        accepted_tokens=delta(ACCEPTED_TOKENS),
        drafts=delta(DRAFTS),
    )
