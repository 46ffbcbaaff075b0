"""Scheduler configuration: which policy runs and the limits around it."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class Mode(enum.Enum):
    DYNAMIC = "dynamic"  # request-level batching: the batch leaves full or on timeout and runs as one unit
    CONTINUOUS = "continuous"  # iteration-level batching: sequences join and leave at every step
    STATIC = "static"  # a batch leaves full, or at the ticks of a fixed clock, and runs as one unit


SCHEDULING_POLICIES = ("fcfs", "priority")
_IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


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
    # every mode: the waiting queue's order. fcfs: by arrival; priority: by the request's `priority` (lower first),
    # ties by arrival, and continuous mode preempts the lowest priority first (vLLM's --scheduling-policy)
    scheduling_policy: str = "fcfs"
    # A Policy subclass by import path ("package.module:Class") to run instead of the mode's own policy; it keeps the
    # mode's seats and settings (docs/policies.md)
    policy: str | None = None
    max_queue: int = 256
    queue_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.mode, Mode):
            object.__setattr__(self, "mode", Mode(self.mode))
        for name in ("max_batch_size", "max_num_seqs", "max_num_batched_tokens", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if self.policy is not None and not _IMPORT_PATH.fullmatch(self.policy):
            raise ValueError(f"policy must be an import path MODULE:CLASS, got {self.policy!r}")
        if self.batch_timeout_ms < 0:
            raise ValueError(f"batch_timeout_ms must be >= 0, got {self.batch_timeout_ms}")
        if not self.batch_window_ms > 0:
            raise ValueError(f"batch_window_ms must be > 0, got {self.batch_window_ms}")
        if self.queue_timeout_s is not None and self.queue_timeout_s <= 0:
            raise ValueError(f"queue_timeout_s must be > 0, got {self.queue_timeout_s}")

    @property
    def by_priority(self) -> bool:
        return self.scheduling_policy == "priority"

    @property
    def seats(self) -> int:
        """Sequences that can run at once in this mode: the engine rows it needs."""
        return self.max_num_seqs if self.mode is Mode.CONTINUOUS else self.max_batch_size
