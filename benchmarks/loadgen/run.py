"""One benchmark run against one running server: warm up, scrape, load, scrape, summarise."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
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
