"""Request-level ("bus") batching: a batch leaves when full or when its oldest request timed out, then runs as
one unit. Nobody joins until every member finished, and each member's completion is released only then."""

from __future__ import annotations

from collections import deque

from engine.engine import Engine
from scheduler.config import Mode, SchedulerConfig
from scheduler.policy import Policy, StepPlan
from scheduler.request import Request, RequestStatus


class DynamicPolicy(Policy):
    mode = Mode.DYNAMIC

    def __init__(self, engine: Engine, config: SchedulerConfig) -> None:
        super().__init__(engine, config)
        self.batch_id = 0
        self._timeout_s = config.batch_timeout_ms / 1000.0
        self._draining = False

    def plan(self, waiting: deque[Request], now: float) -> StepPlan:
        if not self.running and self._bus_leaves(waiting, now):
            self._dispatch(waiting)
        # Finished members keep their seat but are not computed; a first step prefills whole prompts.
        return [(r, self.engine.num_pending(r.seq_id)) for r in self._unfinished(self.running)]

    def _bus_leaves(self, waiting: deque[Request], now: float) -> bool:
        if not waiting:
            return False
        return len(waiting) >= self.config.max_batch_size or now - _oldest_queued(waiting) >= self._timeout_s

    def _dispatch(self, waiting: deque[Request]) -> None:
        """Board up to max_batch_size requests in arrival order, reserving each one's whole length up front."""
        self.batch_id += 1
        while waiting and len(self.running) < self.config.max_batch_size:
            request = waiting[0]
            if not self._admit(request):
                break
            if not self.engine.reserve(request.seq_id, request.max_total_tokens):
                self.engine.remove(request.seq_id)
                break  # the cache is full: the rest wait for the next bus, in order
            waiting.popleft()
            request.batch_id = self.batch_id
            request.status = RequestStatus.RUNNING
            self.running.append(request)

    def on_finished(self, request: Request) -> list[Request]:
        if request not in self.running:
            return [request]  # never boarded (aborted or expired while waiting)
        if request.finish_reason is not None and request.finish_reason.ended_early:
            # An abort or a failed step frees its seat at once; it does not wait for the bus.
            self.running.remove(request)
            return [request, *self._end_of_batch()]
        if self._draining:  # no bus leaves any more: holding the answer would only delay it
            self.running.remove(request)
            return [request]
        return self._end_of_batch()

    def begin_drain(self) -> list[Request]:
        self._draining = True
        held = [r for r in self.running if r.status is RequestStatus.FINISHED]
        self.running = [r for r in self.running if r.status is not RequestStatus.FINISHED]
        return held

    def _end_of_batch(self) -> list[Request]:
        if any(r.status is RequestStatus.RUNNING for r in self.running):
            return []
        released, self.running = self.running, []
        return released

    def next_deadline(self, waiting: deque[Request]) -> float | None:
        if self.running or not waiting:
            return None
        return _oldest_queued(waiting) + self._timeout_s

    @property
    def held_seats(self) -> int:
        return sum(1 for r in self.running if r.status is RequestStatus.FINISHED)


def _oldest_queued(waiting: deque[Request]) -> float:
    """The batch timeout counts queue time; the head (first by arrival) need not be the first queued."""
    return min(r.queued for r in waiting)
