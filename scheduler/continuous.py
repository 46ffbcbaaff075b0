"""Iteration-level batching (Orca, vLLM): every step, finished sequences leave and waiting ones join.

Cache is reserved on demand, a block at a time. When a running sequence needs a block and none is free, the
newest running sequence is preempted: its cache is freed and it goes back to the head of the queue, to be
recomputed from its prompt and the tokens it already produced (which are kept, so nothing is lost).

Thrash guard: a preempted sequence resumes only once its whole remaining length (prompt + max_tokens) can be
reserved, and a sequence whose whole length is reserved is never chosen as a victim (it will finish without
asking for more). Without this, a long sequence resumed in a tight cache was preempted again as soon as an
older one needed a block, recomputing its whole context each time; now each request is preempted at most once.

Priority preemption (--priority-preemption, under --scheduling-policy priority): when the seats, not the cache,
are what is full, a waiting request whose priority beats the lowest-priority running one's by the threshold takes
that one's seat in the same step; the displaced request is preempted as above and waits behind it. The thrash
guard does not protect it: a stream of better requests may displace it again, each time recomputing its context.
"""

from __future__ import annotations

from scheduler.config import Mode
from scheduler.policy import Policy, PolicyContext, StepPlan
from scheduler.request import RequestStatus, SequenceRequest


class ContinuousPolicy(Policy):
    mode = Mode.CONTINUOUS

    def plan(self, ctx: PolicyContext, now: float) -> StepPlan:
        budget = self.step_budget(ctx)
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
            if ctx.free_seats == 0:
                freed = self._displace(ctx, request, plan, budget)
                if freed is None:
                    break
                budget += freed
            if budget == 0:
                break
            count = min(ctx.pending_tokens(request), budget)
            if not ctx.admit(request, self._admission_tokens(ctx, request, count)):
                break  # nobody overtakes the first in line that does not fit
            plan.append((request, count))
            budget -= count
        return plan

    def step_budget(self, ctx: PolicyContext) -> int:
        """Tokens this step may compute: max_num_batched_tokens, or lone_prefill_tokens while no running sequence
        has produced a token (every row is a prompt chunk: no stream waits on this step's end)."""
        budget, lone = self.config.max_num_batched_tokens, self.config.lone_prefill_tokens
        if lone is None or any(request.output_token_ids for request in ctx.running):
            return budget
        return max(budget, lone)

    @staticmethod
    def _admission_tokens(ctx: PolicyContext, request: SequenceRequest, count: int) -> int:
        """The cache a waiting request is admitted with, to compute `count` tokens. A preempted request comes back
        with its whole length reserved, so it is never preempted for memory again."""
        return request.max_total_tokens if request.num_preemptions else ctx.computed_tokens(request) + count

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
        """The lowest-ranked running sequence that may still grow (by the queue's order: the newest, or by priority
        the lowest-priority one, the newest among equals), `request` itself when it is that one. One whose whole
        length is reserved will finish without asking for more: preempting it would only repeat its work."""
        victim = ctx.lowest_ranked_running(lambda c: c is request or ctx.reserved_tokens(c) < c.max_total_tokens)
        return request if victim is None else victim

    def _displace(self, ctx: PolicyContext, request: SequenceRequest, plan: StepPlan, budget: int) -> int | None:
        """--priority-preemption, when the seats are full: if `request` beats the lowest-priority running request
        (the newest among equals) by the threshold, and the step's budget and that one's cache would let `request`
        start, preempt it, take it out of this step's plan and return the budget it frees. None: nothing changed."""
        if not self.config.priority_preemption or (request.num_preemptions == 0 and ctx.free_rows == 0):
            return None  # off, or no engine row to seat a fresh request in: displacing would free a seat for nothing
        victim = ctx.lowest_ranked_running(lambda r: r.status is RequestStatus.RUNNING)  # not a held answer
        if victim is None or victim.priority - request.priority < self.config.priority_preemption_threshold:
            return None
        freed = sum(count for r, count in plan if r is victim)
        if budget + freed == 0:
            return None
        count = min(ctx.pending_tokens(request), budget + freed)
        needed = self._admission_tokens(ctx, request, count) - ctx.computed_tokens(request)
        if needed > ctx.free_cache_tokens + ctx.reserved_tokens(victim):
            return None  # memory binds too: displacing would free the seat for nothing (blocks shared aside)
        plan[:] = [(r, c) for r, c in plan if r is not victim]
        ctx.preempt(victim)
        return freed

    def on_finished(self, ctx: PolicyContext, request: SequenceRequest) -> None:
        if request.status is RequestStatus.FINISHED:  # nothing is held: its answer goes out at once
            ctx.release(request)
