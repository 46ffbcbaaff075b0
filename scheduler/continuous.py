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

from collections import deque

from scheduler.config import Mode
from scheduler.policy import Policy, StepPlan
from scheduler.request import Request, RequestStatus


class ContinuousPolicy(Policy):
    mode = Mode.CONTINUOUS

    def plan(self, waiting: deque[Request], now: float) -> StepPlan:
        budget = self.config.max_num_batched_tokens
        plan: StepPlan = []
        for request in list(self.running):  # oldest first: they keep their seats
            if budget == 0:
                break
            if request not in self.running:
                continue  # preempted earlier in this loop
            count = min(self.engine.num_pending(request.seq_id), budget)
            if self._reserve_or_preempt(request, count, waiting):
                plan.append((request, count))
                budget -= count
        while waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = waiting[0]
            if not self._admit(request):
                break
            count = min(self.engine.num_pending(request.seq_id), budget)
            # A preempted request comes back with its whole length reserved, so it is never preempted again.
            if not self.engine.reserve(request.seq_id, request.max_total_tokens if request.num_preemptions else count):
                if request.num_preemptions == 0:
                    self.engine.remove(request.seq_id)  # a fresh request keeps no row while it waits
                break  # first come, first served: nobody overtakes the head of the queue
            waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            plan.append((request, count))
            budget -= count
        return plan

    def _reserve_or_preempt(self, request: Request, count: int, waiting: deque[Request]) -> bool:
        needed = self.engine.num_computed(request.seq_id) + count
        while not self.engine.reserve(request.seq_id, needed):
            victim = self._victim(request)
            self._preempt(victim, waiting)
            if victim is request:
                return False
        return True

    def _victim(self, request: Request) -> Request:
        """The newest running sequence that may still grow, or `request` itself if none is newer. One whose whole
        length is reserved will finish without asking for more: preempting it would only repeat its work."""
        for candidate in reversed(self.running):
            if candidate is request or self.engine.reserved_tokens(candidate.seq_id) < candidate.max_total_tokens:
                return candidate
        return request

    def _preempt(self, victim: Request, waiting: deque[Request]) -> None:
        self.engine.release_cache(victim.seq_id)
        self.running.remove(victim)
        victim.status = RequestStatus.WAITING
        victim.num_preemptions += 1
        waiting.appendleft(victim)

    def on_finished(self, request: Request) -> list[Request]:
        if request in self.running:
            self.running.remove(request)
        return [request]
