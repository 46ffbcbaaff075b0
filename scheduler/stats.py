"""Per-step statistics, the raw material of the metrics and the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepStats:
    mode: str
    start: float  # monotonic seconds
    duration: float
    num_seqs: int  # sequences computed in the step
    num_tokens: int  # tokens computed (prompt chunks plus decode tokens)
    num_prompt_tokens: int
    num_generated: int  # tokens sampled
    held_seats: int  # seats held by sequences that finished but are not released (dynamic mode's waste)
    num_running: int
    num_waiting: int
    cache_usage: float  # 0..1
    failed: bool = False
