"""Request-level ("bus") batching: a batch leaves when full or when its oldest request timed out, then runs as
one unit. Nobody joins until every member finished, and each member's completion is released only then."""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.config import Mode, SchedulerConfig
from scheduler.policy import Policy, PolicyContext, StepPlan
from scheduler.request import RequestStatus, SequenceRequest


class DynamicPolicy(Policy):
    mode = Mode.DYNAMIC

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.batch_id = 0
        self._timeout_s = config.batch_timeout_ms / 1000.0
        self._draining = False

    def plan(self, ctx: PolicyContext, now: float) -> StepPlan:
        if not ctx.running and self._bus_leaves(ctx.waiting, now):
            self._dispatch(ctx)
        # Finished members keep their seat but are not computed; a first step prefills whole prompts.
        return [(r, ctx.pending_tokens(r)) for r in ctx.running if r.status is RequestStatus.RUNNING]

    def _bus_leaves(self, waiting: Sequence[SequenceRequest], now: float) -> bool:
        if not waiting:
            return False
        return len(waiting) >= self.config.max_batch_size or now - _oldest_queued(waiting) >= self._timeout_s

    def _dispatch(self, ctx: PolicyContext) -> None:
        """Board up to max_batch_size requests in arrival order, reserving each one's whole length up front."""
        self.batch_id += 1
        while ctx.waiting and ctx.free_seats > 0:
            request = ctx.waiting[0]
            if not ctx.admit(request, request.max_total_tokens):
                break  # no row or the cache is full: the rest wait for the next bus, in order
            request.batch_id = self.batch_id

    def on_finished(self, ctx: PolicyContext, request: SequenceRequest) -> None:
        # An abort or a failed step was released at once: it does not wait for the bus, and may end the batch.
        if request.status is RequestStatus.FINISHED and self._draining:
            ctx.release(request)  # no bus leaves any more: holding the answer would only delay it
        self._release_if_batch_done(ctx)

    def begin_drain(self, ctx: PolicyContext) -> None:
        self._draining = True
        for request in [r for r in ctx.running if r.status is RequestStatus.FINISHED]:
            ctx.release(request)

    def _release_if_batch_done(self, ctx: PolicyContext) -> None:
        if any(r.status is RequestStatus.RUNNING for r in ctx.running):
            return
        for request in list(ctx.running):
            ctx.release(request)

    def next_deadline(self, ctx: PolicyContext) -> float | None:
        if ctx.running or not ctx.waiting:
            return None
        return _oldest_queued(ctx.waiting) + self._timeout_s


def _oldest_queued(waiting: Sequence[SequenceRequest]) -> float:
    """The batch timeout counts queue time; the head (first by arrival) need not be the first queued."""
    return min(r.queued for r in waiting)
