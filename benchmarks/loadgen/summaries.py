"""Latency and throughput summaries of one run, defined as `vllm bench serve` defines them.

TTFT: send to first text chunk. TPOT: (e2e - ttft) / (output_tokens - 1). ITL: gaps between text chunks,
pooled over all requests. E2E: send to end of stream. Latencies are reported in milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.loadgen.client import RequestRecord
from benchmarks.loadgen.phases import ServerTimings

SLO_METRICS = ("ttft", "tpot", "itl", "e2e")


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile with linear interpolation between closest ranks (numpy's default method)."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (rank - low) * (ordered[high] - ordered[low])


@dataclass(frozen=True)
class Dist:
    mean: float
    p50: float
    p90: float
    p99: float
    count: int

    @classmethod
    def of(cls, values: Iterable[float]) -> Dist | None:
        data = list(values)
        if not data:
            return None
        return cls(
            mean=sum(data) / len(data),
            p50=percentile(data, 50),
            p90=percentile(data, 90),
            p99=percentile(data, 99),
            count=len(data),
        )


@dataclass(frozen=True)
class SLO:
    """Per-request latency limits in ms; a request counts toward goodput only if it meets all that are set."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    itl_ms: float | None = None  # applies to the request's worst gap
    e2e_ms: float | None = None

    def __post_init__(self) -> None:
        for name in SLO_METRICS:
            value = getattr(self, f"{name}_ms")
            if value is not None and not value > 0:
                raise ValueError(f"SLO {name} must be > 0 ms, got {value}")

    @classmethod
    def parse(cls, items: Sequence[str]) -> SLO:
        """From `["ttft:500", "e2e:10000"]`; `e2el` is accepted as vLLM's name for e2e."""
        limits: dict[str, float] = {}
        for item in items:
            name, sep, value = item.partition(":")
            name = {"e2el": "e2e"}.get(name.strip().lower(), name.strip().lower())
            if not sep or name not in SLO_METRICS:
                raise ValueError(f"bad SLO {item!r}: expected NAME:MS with NAME in {SLO_METRICS}")
            limits[f"{name}_ms"] = float(value)
        return cls(**limits)

    @property
    def is_set(self) -> bool:
        return any(getattr(self, f"{name}_ms") is not None for name in SLO_METRICS)

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        observed = {
            "ttft": record.ttft,
            "tpot": record.tpot,
            "itl": max(record.itls) if record.itls else None,
            "e2e": record.e2e,
        }
        for name in SLO_METRICS:
            limit = getattr(self, f"{name}_ms")
            if limit is None:
                continue
            value = observed[name]
            if name == "ttft" and value is None:
                return False  # no token at all cannot meet a first-token target
            if value is not None and value * 1e3 > limit:
                return False
        return True


@dataclass(frozen=True)
class Summary:
    completed: int
    failed: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    goodput: float | None  # requests meeting the SLO / s; None without an SLO
    ttft_ms: Dist | None
    tpot_ms: Dist | None
    itl_ms: Dist | None
    e2e_ms: Dist | None
    queue_ms: Dist | None  # server-reported, when the server sends batchserve timings
    held_ms: Dist | None  # server-reported: last token to release
    errors: tuple[str, ...]  # first few distinct messages, for the report

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Summary:
        dist_fields = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "queue_ms", "held_ms")
        values: dict[str, Any] = {k: (Dist(**v) if k in dist_fields and v is not None else v) for k, v in d.items()}
        values["errors"] = tuple(values["errors"])
        return cls(**values)


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO | None = None) -> Summary:
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in records if r.ok]
    input_tokens = sum(r.counted_prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    timings = [t for t in (ServerTimings.parse(r.server_timings) for r in ok) if t is not None]
    good = sum(1 for r in ok if slo.met_by(r)) if slo is not None and slo.is_set else None
    errors = tuple(dict.fromkeys(r.error for r in records if r.error is not None))[:5]
    return Summary(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        request_throughput=len(ok) / duration_s,
        output_throughput=output_tokens / duration_s,
        total_token_throughput=(input_tokens + output_tokens) / duration_s,
        goodput=None if good is None else good / duration_s,
        ttft_ms=Dist.of(r.ttft * 1e3 for r in ok if r.ttft is not None),
        tpot_ms=Dist.of(r.tpot * 1e3 for r in ok if r.tpot is not None),
        itl_ms=Dist.of(gap * 1e3 for r in ok for gap in r.itls),
        e2e_ms=Dist.of(r.e2e * 1e3 for r in ok),
        queue_ms=Dist.of(t.queue_ms for t in timings),
        held_ms=Dist.of(t.held_ms for t in timings),
        errors=errors,
    )
