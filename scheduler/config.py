"""Scheduler configuration: which policy runs and the limits around it."""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from engine.spec.config import SpeculativeConfig
from scheduler.ranges import DAY_MS, QUEUE, SEATS, TIMEOUT_S, Range


class Mode(enum.Enum):
    DYNAMIC = "dynamic"  # request-level batching: the batch leaves full or on timeout and runs as one unit
    CONTINUOUS = "continuous"  # iteration-level batching: sequences join and leave at every step
    STATIC = "static"  # a batch leaves full, or at the ticks of a fixed clock, and runs as one unit


SCHEDULING_POLICIES = ("fcfs", "priority")
_IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
# Each numeric field's range (scheduler/ranges.py); the server's flags of the same names take them from here.
RANGES: Mapping[str, Range] = MappingProxyType(
    {
        "max_batch_size": SEATS,
        "batch_timeout_ms": Range(0, DAY_MS),
        "batch_window_ms": Range(0.001, DAY_MS),  # ticks closer than a microsecond mean nothing
        "max_num_seqs": SEATS,
        "max_num_batched_tokens": Range(1, 1 << 20, integer=True),
        "lone_prefill_tokens": Range(1, 1 << 20, integer=True),
        # priorities are int64s (the API's bound), so no wider gap between two of them exists
        "priority_preemption_threshold": Range(1, 2**63 - 1, integer=True),
        "max_queue": QUEUE,
        "queue_timeout_s": TIMEOUT_S,
    }
)


@dataclass(frozen=True)
class SchedulerConfig:
    mode: Mode = Mode.CONTINUOUS
    # dynamic and static
    max_batch_size: int = 8
    batch_timeout_ms: float = 50.0  # dynamic
    batch_window_ms: float = 100.0  # static: the period of the clock whose ticks a partial batch leaves at
    # continuous
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    # continuous: the budget of a step in which no running sequence has produced a token yet (every row a prompt
    # chunk), so a longer step delays no stream's next token; never below max_num_batched_tokens. None: the same
    # budget for every step (the server's default is 2048: api/config.py)
    lone_prefill_tokens: int | None = None
    # every mode: the waiting queue's order. fcfs: by arrival; priority: by the request's `priority` (lower first),
    # ties by arrival, and continuous mode preempts the lowest priority first (vLLM's --scheduling-policy)
    scheduling_policy: str = "fcfs"
    # continuous mode under priority: when the seats, not the cache, are full, a waiting request whose priority
    # beats the lowest-priority running one's by at least the threshold takes its seat at once (the displaced one
    # is preempted, keeping its tokens). vLLM's scheduler does not do this (its issue 40004).
    priority_preemption: bool = False
    priority_preemption_threshold: int = 1
    # A Policy subclass by import path ("package.module:Class") to run instead of the mode's own policy; it keeps the
    # mode's seats and settings (docs/policies.md)
    policy: str | None = None
    max_queue: int = 256
    queue_timeout_s: float | None = None
    # n-gram speculation (docs/speculative.md), every mode: rows verify drafts of their own tokens; None: off
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.mode, Mode):
            object.__setattr__(self, "mode", Mode(self.mode))
        for name, bounds in RANGES.items():
            if getattr(self, name) is not None:  # None: queue_timeout_s (no timeout), lone_prefill_tokens (off)
                bounds.check(name, getattr(self, name))
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if self.priority_preemption and not self.by_priority:
            raise ValueError("--priority-preemption needs --scheduling-policy priority")
        if self.priority_preemption and self.mode is not Mode.CONTINUOUS:
            raise ValueError(
                "--priority-preemption needs --mode continuous: a batch of the other modes runs as one unit, and "
                "nobody leaves it before it is done"
            )
        if self.policy is not None and not _IMPORT_PATH.fullmatch(self.policy):
            raise ValueError(f"policy must be an import path MODULE:CLASS, got {self.policy!r}")

    @property
    def by_priority(self) -> bool:
        return self.scheduling_policy == "priority"

    @property
    def seats(self) -> int:
        """Sequences that can run at once in this mode."""
        return self.max_num_seqs if self.mode is Mode.CONTINUOUS else self.max_batch_size

    @property
    def engine_rows(self) -> int:
        """The engine rows the mode needs: one per seat, and with priority preemption one more per seat, since a
        displaced request keeps its row (its tokens) while it waits and the request that displaced it needs one."""
        return 2 * self.seats if self.priority_preemption else self.seats
