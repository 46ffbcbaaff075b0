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
    num_draft_tokens: int = 0  # speculation: draft tokens verified in the step
    num_accepted_tokens: int = 0  # of those, the ones the model's own choice matched
    num_drafts: int = 0  # sequences that verified drafts in the step
    accepted_per_pos: tuple[int, ...] = ()  # [i]: sequences whose draft at position i was accepted


@dataclass(frozen=True)
class SchedulerCounts:
    """What the scheduler holds, as of its last step, inbox drain or command. Published whole (one attribute swap),
    so any thread (metrics, the drain) reads one consistent set without touching the loop thread's state."""

    seats: int
    running: int  # requests holding a seat: generating, or finished and held by their batch (dynamic mode)
    held_seats: int  # of those, finished and held
    queued: int  # submitted and never started, including submissions not yet taken from the inbox
    preempted: int  # started, preempted, waiting to resume
    cache_usage: float  # 0..1: blocks in use
    pending_work: bool  # a request not yet released, or a command not yet applied
    cache_cached_free: float = 0.0  # 0..1: blocks free to take but still holding a cached prefix

    @property
    def waiting(self) -> int:
        return self.queued + self.preempted

    @property
    def free_seats(self) -> int:
        return self.seats - self.running
