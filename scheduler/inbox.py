"""The scheduler's door for other threads, and what comes through it at each step boundary.

Other threads (the API's event loop, the drain, metrics) call `submit`, `abort`, `stop_request`, `close`,
`begin_drain`, `shutdown`, `request_snapshot`, `num_queued` and `counts`: each only appends a command under one lock,
sets a flag under it, or reads. The loop thread applies the commands at the start of each step (`apply`), which also
ends the requests that waited past `queue_timeout_s`, and publishes the counts at the end (`publish`). The queue
bound, `max_queue`, counts requests submitted and never started.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable

from scheduler.config import SchedulerConfig
from scheduler.errors import EngineLoopStoppedError, QueueFullError, SchedulerClosedError
from scheduler.events import EventFeed, PointKind
from scheduler.lifecycle import Lifecycle
from scheduler.policy_guard import PolicyGuard
from scheduler.request import Outcome, RequestStatus, SequenceRequest
from scheduler.stats import SchedulerCounts

logger = logging.getLogger("batchserve.scheduler")

# The core's way to end a request (`Scheduler._finish`): a FinishEvent for its consumer, the policy told.
Finish = Callable[[SequenceRequest, Outcome, str | None], None]


class Command(enum.Enum):
    SUBMIT = "submit"
    ABORT = "abort"
    STOP = "stop"
    DRAIN = "drain"
    SHUTDOWN = "shutdown"
    SNAPSHOT = "snapshot"


class Inbox:
    """Commands from any thread, applied on the loop thread; the requests the scheduler holds; its counts."""

    def __init__(
        self,
        config: SchedulerConfig,
        clock: Callable[[], float],
        events: EventFeed,
        lifecycle: Lifecycle,
        guard: PolicyGuard,
        finish: Finish,
    ) -> None:
        self.config = config
        self.clock = clock
        self.events = events
        self.lifecycle = lifecycle
        self.guard = guard
        self._finish = finish
        self.requests: dict[str, SequenceRequest] = {}  # every request taken in and not yet released, by id
        self._lock = threading.Lock()
        self._commands: deque[tuple[Command, SequenceRequest | str]] = deque()
        self._num_queued = 0  # submitted and never scheduled; bounded by max_queue
        self._seq_ids = itertools.count()
        self._closed = False
        self._stopped: str | None = None  # why the loop thread died, once it has (`abandon`)
        self._counts = SchedulerCounts(config.seats, 0, 0, 0, 0, lifecycle.engine.cache_usage, False)

    # ----- any thread -----
    def submit(self, request: SequenceRequest, arrival: float | None = None) -> None:
        """Queue a request. Raises EngineInputError (bad input) or QueueFullError at once.

        `arrival` (this scheduler's clock; default: now) is when the request reached the server. The API stamps
        it before tokenising, which runs on a thread pool and can finish out of order: the queue is ordered by
        arrival, so first come is first served by when a request came, not by when its tokens were ready.
        """
        self.lifecycle.engine.validate(request.prompt_token_ids, request.params)
        with self._lock:
            if self._stopped is not None:
                self._rejected(request, "loop_stopped")
                raise EngineLoopStoppedError(self._stopped)
            if self._closed:
                self._rejected(request, "shutting_down")
                raise SchedulerClosedError("the server is shutting down")
            if self._num_queued >= self.config.max_queue:
                self._rejected(request, "queue_full")
                raise QueueFullError(f"the waiting queue is full ({self.config.max_queue} requests)")
            self._num_queued += 1
            request.seq_id = next(self._seq_ids)
            request.queued = self.clock()
            request.arrival = request.queued if arrival is None else min(arrival, request.queued)
            self._command(Command.SUBMIT, request)

    def abort(self, request_id: str) -> None:
        """Cancel a request wherever it is; its consumer receives a FinishEvent with ABORT."""
        with self._lock:
            self._command(Command.ABORT, request_id)

    def stop_request(self, request_id: str) -> None:
        """Finish a request with STOP (the API matched a stop string)."""
        with self._lock:
            self._command(Command.STOP, request_id)

    def close(self) -> None:
        """Refuse new submissions from now on."""
        with self._lock:
            self._closed = True

    def begin_drain(self) -> None:
        """Shutdown begins: refuse new submissions; at the next step boundary, fail the requests never started
        (SHUTDOWN, the API's 503) and let the policy release finished answers it holds. Running ones go on."""
        with self._lock:
            self._closed = True
            self._command(Command.DRAIN, "")

    def shutdown(self) -> None:
        """The grace period is over: at the next step boundary, end every request still held with SHUTDOWN."""
        with self._lock:
            self._closed = True
            self._command(Command.SHUTDOWN, "")

    def request_snapshot(self) -> None:
        """Put the current state in the event feed at the next step boundary (a subscriber's `hello`)."""
        with self._lock:
            self._command(Command.SNAPSHOT, "")

    @property
    def num_queued(self) -> int:
        with self._lock:
            return self._num_queued

    def counts(self) -> SchedulerCounts:
        """The counts as of the last step boundary or command."""
        return self._counts

    def _rejected(self, request: SequenceRequest, reason: str) -> None:
        self.events.record.rejected(request, self.clock(), reason)

    def _command(self, kind: Command, item: SequenceRequest | str) -> None:
        """Queue a command for the loop thread; the caller holds the lock."""
        self._commands.append((kind, item))
        self._counts = dataclasses.replace(self._counts, queued=self._num_queued, pending_work=True)

    # ----- loop thread -----
    def has_pending_work(self) -> bool:
        return bool(self._commands) or bool(self.requests)

    def apply(self, now: float) -> None:
        """Apply the commands queued since the last step, in order; then end the requests that waited too long."""
        with self._lock:
            commands = list(self._commands)
            self._commands.clear()
        for kind, item in commands:
            if kind is Command.SUBMIT:
                assert isinstance(item, SequenceRequest)
                self.requests[item.request_id] = item
                self.lifecycle.enqueue(item)
                self.events.record.point(PointKind.QUEUED, item, item.queued)
            elif kind is Command.SNAPSHOT:
                self.events.record.snapshot(self.clock(), self.lifecycle.running, len(self.lifecycle.waiting))
            elif kind is Command.DRAIN:
                self._begin_drain_now()
            elif kind is Command.SHUTDOWN:
                self._shutdown_now()
            else:
                assert isinstance(item, str)
                self._end(item, kind)
        self._expire_waiting(now)

    def next_timeout(self) -> float | None:
        """When the longest-waiting never-started request times out, if one can."""
        waiting = self.lifecycle.waiting
        if self.config.queue_timeout_s is None or not waiting:
            return None
        return min(r.queued for r in waiting) + self.config.queue_timeout_s

    def started(self) -> None:
        """A submitted request left the queue for good: it ran its first step, or ended before it did."""
        with self._lock:
            self._num_queued -= 1

    def publish(self) -> None:
        """Publish the counts: one attribute swap, so another thread reads one consistent set."""
        lifecycle = self.lifecycle
        running, held = len(lifecycle.running), lifecycle.held_seats
        preempted = sum(1 for r in lifecycle.waiting if r.scheduled is not None)
        usage = lifecycle.engine.cache_usage
        pool = lifecycle.engine.blocks.pool
        cached_free = pool.num_cached_free / pool.num_blocks
        with self._lock:  # under the lock, so that a submission's own update is never lost
            pending = bool(self._commands) or bool(self.requests)
            self._counts = SchedulerCounts(
                self.config.seats, running, held, self._num_queued, preempted, usage, pending, cached_free
            )

    def abandon(self, reason: str) -> None:
        """The loop thread is dying (`reason`): refuse every submission from now on, and end every request held,
        the inbox's too, at once (`Lifecycle.abandon`: neither the engine nor the policy, either may be what broke)."""
        with self._lock:
            self._closed, self._stopped = True, reason
            submitted = [item for _, item in self._commands if isinstance(item, SequenceRequest)]
            self._commands.clear()
            self._num_queued = 0
            self._counts = SchedulerCounts(self.config.seats, 0, 0, 0, 0, self._counts.cache_usage, False)
        for request in [*self.requests.values(), *submitted]:
            try:
                self.lifecycle.abandon(request, reason)
            except Exception:  # the others must still hear
                logger.exception("ending request %s failed", request.request_id)

    def _end(self, request_id: str, kind: Command) -> None:
        request = self.requests.get(request_id)
        if request is None:
            return
        if request.status in (RequestStatus.WAITING, RequestStatus.RUNNING):
            self._finish(request, Outcome.ABORTED if kind is Command.ABORT else Outcome.STOPPED, None)
        elif kind is Command.ABORT and request.status is RequestStatus.FINISHED:
            # A finished answer held by its batch: its consumer left, so free the seat now.
            self._finish(request, Outcome.ABORTED, None)

    def _expire_waiting(self, now: float) -> None:
        limit = self.config.queue_timeout_s
        if limit is None:
            return
        for request in [r for r in self.lifecycle.waiting if r.scheduled is None and now - r.queued > limit]:
            self._finish(
                request,
                Outcome.QUEUE_TIMEOUT,
                f"the request waited in the queue longer than {limit} s; the server is overloaded",
            )

    def _begin_drain_now(self) -> None:
        # Preempted requests wait too, but they already ran: like the running ones, they may finish.
        for request in [r for r in self.lifecycle.waiting if r.scheduled is None]:
            self._finish(request, Outcome.SHUTDOWN, "the server is shutting down; retry the request")
        self.guard.begin_drain()

    def _shutdown_now(self) -> None:
        for request in list(self.requests.values()):
            if request.status in (RequestStatus.WAITING, RequestStatus.RUNNING):
                self._finish(
                    request,
                    Outcome.SHUTDOWN,
                    "the server shut down before the request finished (its shutdown grace period ran out); retry it",
                )
