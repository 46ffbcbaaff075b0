"""Static batching: batches of a fixed size, or whatever waits at the ticks of a fixed clock.

A batch of `max_batch_size` requests leaves as soon as it is full. A partial batch leaves only at a tick of a
clock that beats every `batch_window_ms` from the scheduler's start, whatever arrived when: a request that comes
just after a tick waits a whole window, where the bus (scheduler/dynamic.py) would have started its timer at its
arrival. Once on its way a batch runs as the bus does: one unit, each member's whole length reserved, every answer
released when the last member finishes, nobody boarding until then. Static against dynamic isolates what the
adaptive timer buys; dynamic against continuous, what iteration-level scheduling buys.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from scheduler.config import Mode, SchedulerConfig
from scheduler.dynamic import DynamicPolicy
from scheduler.policy import PolicyContext, StepPlan
from scheduler.request import SequenceRequest


class StaticPolicy(DynamicPolicy):
    mode = Mode.STATIC

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self._window_s = config.batch_window_ms / 1000.0
        self._origin = 0.0  # the clock's first tick: set by `start`
        self._free_since = 0.0  # when the last batch was released: a partial batch needs a tick after it
        self._busy = False

    def start(self, now: float) -> None:
        self._origin = self._free_since = now

    def plan(self, ctx: PolicyContext, now: float) -> StepPlan:
        if ctx.running:
            self._busy = True
        elif self._busy:
            self._busy, self._free_since = False, now
        return super().plan(ctx, now)

    def _bus_leaves(self, waiting: Sequence[SequenceRequest], now: float) -> bool:
        if len(waiting) >= self.config.max_batch_size:
            return True
        return bool(waiting) and self._next_tick(self._earliest_departure(waiting)) <= now

    def next_deadline(self, ctx: PolicyContext) -> float | None:
        if ctx.running or not ctx.waiting:
            return None
        return self._next_tick(self._earliest_departure(ctx.waiting))

    def _earliest_departure(self, waiting: Sequence[SequenceRequest]) -> float:
        return max(self._free_since, min(r.queued for r in waiting))

    def _next_tick(self, after: float) -> float:
        """The first tick at or after `after`."""
        return self._origin + math.ceil((after - self._origin) / self._window_s - 1e-9) * self._window_s
