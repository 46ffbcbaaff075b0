"""Iteration-level batching (Orca, vLLM): every step, finished sequences leave and waiting ones join.

Cache is reserved on demand, a block at a time. When a running sequence needs a block and none is free, the
newest running sequence is preempted: its cache is freed and it goes back to the head of the queue, to be
recomputed from its prompt and the tokens it already produced (which are kept, so nothing is lost).

Thrash guard: a preempted sequence resumes only once its whole remaining length (prompt + max_tokens) can be
reserved, and a sequence whose whole length is reserved is never chosen as a victim (it will finish without
asking for more). Without this, a long sequence resumed in a tight cache was preempted again as soon as an
older one needed a block, recomputing its whole context each time; now each request is preempted at most once.
"""

from __future__ import annotations

from scheduler.config import Mode
from scheduler.policy import Policy, PolicyContext, StepPlan
from scheduler.request import RequestStatus, SequenceRequest


class ContinuousPolicy(Policy):
    mode = Mode.CONTINUOUS

    def plan(self, ctx: PolicyContext, now: float) -> StepPlan:
        budget = self.config.max_num_batched_tokens
        plan: StepPlan = []
        for request in list(ctx.running):  # oldest first: they keep their seats
            if budget == 0:
                break
            if request not in ctx.running:
                continue  # preempted earlier in this loop
            count = min(ctx.pending_tokens(request), budget)
            if self._reserve_or_preempt(ctx, request, count):
                plan.append((request, count))
                budget -= count
        for request in self.admission_order(ctx, now):
            if budget == 0 or ctx.free_seats == 0:
                break
            count = min(ctx.pending_tokens(request), budget)
            # A preempted request comes back with its whole length reserved, so it is never preempted again.
            total = request.max_total_tokens if request.num_preemptions else ctx.computed_tokens(request) + count
            if not ctx.admit(request, total):
                break  # nobody overtakes the first in line that does not fit
            plan.append((request, count))
            budget -= count
        return plan

    def admission_order(self, ctx: PolicyContext, now: float) -> list[SequenceRequest]:
        """Who may join this step, first first: the queue's order (arrival, or priority). A subclass may reorder."""
        return list(ctx.waiting)

    def _reserve_or_preempt(self, ctx: PolicyContext, request: SequenceRequest, count: int) -> bool:
        needed = ctx.computed_tokens(request) + count
        while not ctx.reserve(request, needed):
            victim = self._victim(ctx, request)
            ctx.preempt(victim)
            if victim is request:
                return False
        return True

    def _victim(self, ctx: PolicyContext, request: SequenceRequest) -> SequenceRequest:
        """The newest running sequence that may still grow, or `request` itself if none is newer. One whose whole
        length is reserved will finish without asking for more: preempting it would only repeat its work. By
        priority: the lowest-priority one that may still grow (the newest among equals), `request` itself when it
        is that one."""
        if self.config.by_priority:
            growing = [c for c in ctx.running if c is request or ctx.reserved_tokens(c) < c.max_total_tokens]
            return max(growing, key=lambda c: (c.priority, c.arrival))
        for candidate in reversed(ctx.running):
            if candidate is request or ctx.reserved_tokens(candidate) < candidate.max_total_tokens:
                return candidate
        return request

    def on_finished(self, ctx: PolicyContext, request: SequenceRequest) -> None:
        if request.status is RequestStatus.FINISHED:  # nothing is held: its answer goes out at once
            ctx.release(request)
