"""One benchmark run against one running server: warm up, scrape, load, scrape, summarise."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmarks.loadgen.arrivals import ArrivalConfig, arrival_offsets
from benchmarks.loadgen.client import ClientConfig, RequestRecord, run_load
from benchmarks.loadgen.prom import ScrapedMetrics, metrics_delta, scrape
from benchmarks.loadgen.summaries import SLO, Summary, summarize
from benchmarks.loadgen.workloads import RequestSpec, make_prompt


@dataclass(frozen=True)
class RunConfig:
    label: str
    client: ClientConfig
    arrivals: ArrivalConfig
    slo: SLO = field(default_factory=SLO)
    warmup_requests: int = 1  # excluded from every number; the first request pays for lazy initialisation

    def __post_init__(self) -> None:
        if self.warmup_requests < 0:
            raise ValueError(f"warmup_requests must be >= 0, got {self.warmup_requests}")


@dataclass(frozen=True)
class RunResult:
    label: str
    request_rate: float
    burstiness: float
    summary: Summary
    server_metrics: ScrapedMetrics | None
    records: tuple[RequestRecord, ...]

    def to_dict(self, include_records: bool = True) -> dict[str, Any]:
        d: dict[str, Any] = {
            "label": self.label,
            "request_rate": rate_to_json(self.request_rate),
            "burstiness": self.burstiness,
            "summary": self.summary.to_dict(),
            "server_metrics": None if self.server_metrics is None else self.server_metrics.to_dict(),
        }
        if include_records:
            d["records"] = [r.to_dict() for r in self.records]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunResult:
        metrics = d.get("server_metrics")
        return cls(
            label=d["label"],
            request_rate=rate_from_json(d["request_rate"]),
            burstiness=d["burstiness"],
            summary=Summary.from_dict(d["summary"]),
            server_metrics=None if metrics is None else ScrapedMetrics(**metrics),
            records=tuple(RequestRecord.from_dict(r) for r in d.get("records", [])),
        )


def rate_to_json(rate: float) -> float | str:
    # JSON has no infinity; "inf" round-trips through float().
    return "inf" if math.isinf(rate) else rate


def rate_from_json(value: float | str) -> float:
    return float(value)


async def run_benchmark(specs: Sequence[RequestSpec], config: RunConfig) -> RunResult:
    base_url = config.client.base_url
    if config.warmup_requests:
        await _warm_up(config)
    before = await scrape(base_url)
    load = await run_load(specs, arrival_offsets(config.arrivals, len(specs)), config.client)
    after = await scrape(base_url)
    server_metrics = metrics_delta(before, after) if before is not None and after is not None else None
    return RunResult(
        label=config.label,
        request_rate=config.arrivals.request_rate,
        burstiness=config.arrivals.burstiness,
        summary=summarize(load.records, load.duration_s, config.slo),
        server_metrics=server_metrics,
        records=load.records,
    )


async def _warm_up(config: RunConfig) -> None:
    rng = np.random.default_rng(12345)
    count = config.warmup_requests
    specs = [RequestSpec(-1 - i, make_prompt(rng, 16), 4, 16, "warmup") for i in range(count)]
    client = dataclasses.replace(config.client, show_progress=False, seed=None)
    load = await run_load(specs, [0.0] * len(specs), client)
    failed = [r.error for r in load.records if r.error is not None]
    if failed:
        raise RuntimeError(f"warm-up request failed: {failed[0]}")


def merge_rounds(results: Sequence[RunResult], slo: SLO | None = None) -> RunResult:
    """One target's runs over interleaved rounds (`ab --rounds`) as one: every record, summarised over the rounds'
    summed durations, and the server's counters summed (its means weighted by steps or requests)."""
    if len(results) == 1:
        return results[0]
    first = results[0]
    records = tuple(record for result in results for record in result.records)
    duration = sum(result.summary.duration_s for result in results)
    return dataclasses.replace(
        first,
        summary=summarize(records, duration, slo),
        server_metrics=_merge_metrics(
            [(r.server_metrics, len(r.records)) for r in results if r.server_metrics is not None]
        ),
        records=records,
    )


def _merge_metrics(parts: Sequence[tuple[ScrapedMetrics, int]]) -> ScrapedMetrics | None:
    if not parts:
        return None

    def total(name: str) -> float | None:
        values = [getattr(metrics, name) for metrics, _ in parts]
        return None if any(v is None for v in values) else float(sum(values))

    def weighted(name: str, weight: Callable[[ScrapedMetrics, int], float | None]) -> float | None:
        pairs = [(getattr(metrics, name), weight(metrics, count)) for metrics, count in parts]
        if any(v is None or w is None for v, w in pairs):
            return None
        weights = sum(w for _, w in pairs if w is not None)
        return sum(v * w for v, w in pairs if v is not None and w is not None) / weights if weights else None

    def by_steps(metrics: ScrapedMetrics, _: int) -> float | None:
        return metrics.steps

    def by_requests(_: ScrapedMetrics, count: int) -> float:
        return float(count)

    return ScrapedMetrics(
        steps=total("steps"),
        mean_batch_size=weighted("mean_batch_size", by_steps),
        held_seats=total("held_seats"),
        prompt_tokens=total("prompt_tokens"),
        generation_tokens=total("generation_tokens"),
        mean_ttft_ms=weighted("mean_ttft_ms", by_requests),
        mean_queue_ms=weighted("mean_queue_ms", by_requests),
        draft_tokens=total("draft_tokens"),
        accepted_tokens=total("accepted_tokens"),
        drafts=total("drafts"),
    )
