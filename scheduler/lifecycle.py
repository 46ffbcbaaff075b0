"""The one owner of the sequence lifecycle: the waiting queue, the seats, engine rows and cache, and `status`.

Nothing else adds or removes an engine row, reserves or frees cache, or sets a request's status. The scheduler core
drives it (enqueue, finish); a policy reaches it only through `PolicyContext`, which this class implements over
the real engine. Loop thread only.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from scheduler.engine_port import SchedulerEngine
from scheduler.queue import RequestQueue
from scheduler.request import Outcome, RequestStatus, SequenceRequest


class Lifecycle:
    """WAITING -> (admit) RUNNING -> (preempt) WAITING ... -> (finish) FINISHED -> (release) RELEASED."""

    def __init__(
        self,
        engine: SchedulerEngine,
        seats: int,
        on_released: Callable[[SequenceRequest], None],
        queue: RequestQueue,
    ) -> None:
        self.engine = engine
        self.seats = seats
        self._on_released = on_released  # the core hands the completion to the request's consumer
        self._queue = queue  # its order: first come first served, or by priority (scheduler/queue.py)
        self._waiting = queue.requests
        self._running: list[SequenceRequest] = []
        self._free_seat_numbers = list(range(seats))  # a heap: a new request takes the lowest free lane

    # ----- what a policy reads -----
    @property
    def waiting(self) -> Sequence[SequenceRequest]:
        return self._waiting

    @property
    def running(self) -> Sequence[SequenceRequest]:
        return self._running

    @property
    def free_seats(self) -> int:
        return self.seats - len(self._running)

    @property
    def free_rows(self) -> int:
        return self.engine.num_free_rows

    @property
    def free_cache_tokens(self) -> int:
        return self.engine.blocks.free_tokens

    @property
    def held_seats(self) -> int:
        """Seats of requests that finished but are not released yet."""
        return sum(1 for r in self._running if r.status is RequestStatus.FINISHED)

    def pending_tokens(self, request: SequenceRequest) -> int:
        if not self.engine.has_sequence(request.seq_id):  # not in the engine yet: its prompt past the cached prefix
            return len(request.prompt_token_ids) - self._cached_prompt_tokens(request)
        return self.engine.num_pending(request.seq_id)

    def computed_tokens(self, request: SequenceRequest) -> int:
        if not self.engine.has_sequence(request.seq_id):
            return self._cached_prompt_tokens(request)
        return self.engine.num_computed(request.seq_id)

    def _cached_prompt_tokens(self, request: SequenceRequest) -> int:
        return self.engine.num_cached(request.seq_id, request.prompt_token_ids, request.params, request.cache_salt)

    def reserved_tokens(self, request: SequenceRequest) -> int:
        return self.engine.reserved_tokens(request.seq_id) if self.engine.has_sequence(request.seq_id) else 0

    def lowest_ranked_running(self, where: Callable[[SequenceRequest], bool]) -> SequenceRequest | None:
        return self._queue.lowest_ranked(self._running, where)

    # ----- what a policy asks for -----
    def admit(self, request: SequenceRequest, total_tokens: int) -> bool:
        assert request.status is RequestStatus.WAITING, request.status
        if self.free_seats == 0:
            return False
        added = not self.engine.has_sequence(request.seq_id)  # a preempted request kept its row and tokens
        if added:
            if self.engine.num_free_rows == 0 or not self.engine.can_admit(
                request.seq_id, request.prompt_token_ids, request.params, request.cache_salt, total_tokens
            ):
                return False  # checked before `add`: a request that does not fit is not added and removed again
            self.engine.add(request.seq_id, request.prompt_token_ids, request.params, request.cache_salt)
        if not self.engine.reserve(request.seq_id, total_tokens):
            if added:
                self.engine.remove(request.seq_id)  # undo: a fresh request keeps no row while it waits
            return False
        if added:
            request.num_cached_tokens = self.engine.num_computed(request.seq_id)
        self._queue.remove(request)
        request.status = RequestStatus.RUNNING
        request.seat = heapq.heappop(self._free_seat_numbers)
        self._running.append(request)
        return True

    def reserve(self, request: SequenceRequest, total_tokens: int) -> bool:
        assert request.status is RequestStatus.RUNNING, request.status
        return self.engine.reserve(request.seq_id, total_tokens)

    def preempt(self, request: SequenceRequest) -> None:
        assert request.status is RequestStatus.RUNNING, request.status
        self.engine.release_cache(request.seq_id)  # its row keeps the tokens it produced: nothing is lost
        self._running.remove(request)
        self._free_seat(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self._queue.requeue(request)

    def release(self, request: SequenceRequest) -> None:
        assert request.status is RequestStatus.FINISHED, request.status
        if request in self._running:
            self._running.remove(request)
            self._free_seat(request)
        self.engine.remove(request.seq_id)  # the one place a row is freed: once per request
        request.status = RequestStatus.RELEASED
        self._on_released(request)

    def _free_seat(self, request: SequenceRequest) -> None:
        # request.seat keeps the number: a `released` event still names the lane it left
        if request.seat is not None:
            heapq.heappush(self._free_seat_numbers, request.seat)

    # ----- what the core does -----
    def enqueue(self, request: SequenceRequest) -> None:
        """At its arrival's place in the queue's order: behind every request that arrived earlier and every
        preempted one; by priority, behind every request of a better (lower) priority or of the same one that
        arrived earlier."""
        self._queue.add(request)

    def abandon(self, request: SequenceRequest, reason: str) -> None:
        """End `request` without the engine (the loop thread is dying; the engine may be what broke): a held answer
        that is whole as it is, anything else with SHUTDOWN naming `reason`; its consumer hears at once."""
        if request.status is RequestStatus.RELEASED:
            return
        if not (request.status is RequestStatus.FINISHED and request.outcome is not None and request.outcome.completed):
            request.outcome, request.error = Outcome.SHUTDOWN, reason
        request.status = RequestStatus.RELEASED
        self._on_released(request)

    def finish(self, request: SequenceRequest, outcome: Outcome, error: str | None = None) -> None:
        """End a waiting or running request (or re-end a held one, when its consumer left). One that ended early or
        holds no seat is released at once; one that ran to its end keeps its seat until the policy releases it."""
        if request.status is RequestStatus.WAITING:
            self._queue.remove(request)
        request.status = RequestStatus.FINISHED
        request.outcome = outcome
        request.error = error
        if not outcome.completed or request not in self._running:
            self.release(request)
