"""The scheduler: takes requests in, asks its policy what runs, has `Lifecycle` carry it out, one step at a time.

Everything here runs on the engine loop thread except `submit`, `abort`, `stop_request`, `close`, `begin_drain`
and `shutdown`, which only append to a locked inbox or set a flag under its lock. `step()` is synchronous and
takes an injectable clock, so policy tests drive it directly. Every call into the policy goes through
`PolicyGuard` (scheduler/policy_guard.py): a policy that raises fails no innocent request.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from engine.outputs import PromptLogprobs, TokenOutput
from scheduler.config import SchedulerConfig
from scheduler.engine_port import SchedulerEngine
from scheduler.errors import EngineLoopStoppedError, QueueFullError, SchedulerClosedError
from scheduler.events import EventFeed, PointKind
from scheduler.lifecycle import Lifecycle
from scheduler.policies import check_seats
from scheduler.policy import Policy, StepPlan
from scheduler.policy_guard import PolicyGuard, RequestRefused
from scheduler.queue import request_queue
from scheduler.request import (
    FinishEvent,
    Outcome,
    PromptLogprobsEvent,
    RequestEvent,
    RequestStatus,
    SequenceRequest,
    TokenEvent,
)
from scheduler.stats import SchedulerCounts, StepStats

logger = logging.getLogger("batchserve.scheduler")


class Scheduler:
    def __init__(
        self,
        engine: SchedulerEngine,
        config: SchedulerConfig,
        clock: Callable[[], float] = time.monotonic,
        on_step: Callable[[StepStats], None] | None = None,
        on_policy_fallback: Callable[[], None] | None = None,
    ) -> None:
        """`on_policy_fallback`: called (on the loop thread) each time the mode's built-in policy takes over from
        one that raised."""
        check_seats(engine, config)
        self.engine = engine
        self.config = config
        self.clock = clock
        self.on_step = on_step
        self.lifecycle = Lifecycle(engine, config.seats, self._on_released, request_queue(config.by_priority))
        self._requests: dict[str, SequenceRequest] = {}  # every request not yet released, by id
        self._lock = threading.Lock()
        self._inbox: deque[tuple[str, SequenceRequest | str]] = deque()
        self._num_queued = 0  # submitted and never scheduled; bounded by max_queue
        self._seq_ids = itertools.count()
        self._closed = False
        self._stopped: str | None = None  # why the loop thread died, once it has (`abandon`)
        self._counts = SchedulerCounts(config.seats, 0, 0, 0, 0, engine.cache_usage, False)
        self.events = EventFeed()  # records only while a listener is enabled (api/endpoints/event_hub.py)
        self._num_steps = 0
        # (request, when) while `_finish` runs: a request its policy releases at once (continuous batching) is
        # released at the instant it finished, not a clock reading later: it was held for no time.
        self._finishing: tuple[SequenceRequest, float] | None = None
        held = lambda request: self._requests.get(request.request_id) is request  # noqa: E731
        self.guard = PolicyGuard(config, self.lifecycle, held, clock, on_policy_fallback)

    @property
    def policy(self) -> Policy:
        """The policy running now: the configured one, or the mode's built-in one after that one raised."""
        return self.guard.policy

    @property
    def mode(self) -> str:
        return self.config.mode.value

    @property
    def waiting(self) -> Sequence[SequenceRequest]:
        """Loop thread only (as `running`); other threads read `counts()`."""
        return self.lifecycle.waiting

    @property
    def running(self) -> Sequence[SequenceRequest]:
        return self.lifecycle.running

    def counts(self) -> SchedulerCounts:
        """The counts as of the last step boundary or command; safe from any thread."""
        return self._counts

    # ----- thread-safe entry points -----
    def submit(self, request: SequenceRequest, arrival: float | None = None) -> None:
        """Queue a request. Raises EngineInputError (bad input) or QueueFullError at once.

        `arrival` (this scheduler's clock; default: now) is when the request reached the server. The API stamps
        it before tokenising, which runs on a thread pool and can finish out of order: the queue is ordered by
        arrival, so first come is first served by when a request came, not by when its tokens were ready.
        """
        self.engine.validate(request.prompt_token_ids, request.params)
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
            self._command("submit", request)

    def abort(self, request_id: str) -> None:
        """Cancel a request wherever it is; its consumer receives a FinishEvent with ABORT."""
        with self._lock:
            self._command("abort", request_id)

    def stop_request(self, request_id: str) -> None:
        """Finish a request with STOP (the API matched a stop string)."""
        with self._lock:
            self._command("stop", request_id)

    def close(self) -> None:
        """Refuse new submissions from now on."""
        with self._lock:
            self._closed = True

    def begin_drain(self) -> None:
        """Shutdown begins: refuse new submissions; at the next step boundary, fail the requests never started
        (SHUTDOWN, the API's 503) and let the policy release finished answers it holds. Running ones go on."""
        with self._lock:
            self._closed = True
            self._command("drain", "")

    def shutdown(self) -> None:
        """The grace period is over: at the next step boundary, end every request still held with SHUTDOWN."""
        with self._lock:
            self._closed = True
            self._command("shutdown", "")

    def request_snapshot(self) -> None:
        """Put the current state in the event feed at the next step boundary (a subscriber's `hello`)."""
        with self._lock:
            self._command("snapshot", "")

    def _rejected(self, request: SequenceRequest, reason: str) -> None:
        self.events.rejected(request, self.clock(), reason)

    @property
    def num_queued(self) -> int:
        with self._lock:
            return self._num_queued

    def _command(self, kind: str, item: SequenceRequest | str) -> None:
        """Queue a command for the loop thread; the caller holds the lock."""
        self._inbox.append((kind, item))
        self._counts = dataclasses.replace(self._counts, queued=self._num_queued, pending_work=True)

    # ----- loop thread -----
    def has_pending_work(self) -> bool:
        return bool(self._inbox) or bool(self._requests)

    def next_deadline(self) -> float | None:
        deadlines = [self.guard.next_deadline()]
        if self.config.queue_timeout_s is not None and self.waiting:
            deadlines.append(min(r.queued for r in self.waiting) + self.config.queue_timeout_s)
        present = [d for d in deadlines if d is not None]
        return min(present) if present else None

    def step(self) -> StepStats | None:
        """Apply queued commands, plan, run one engine step, deliver its tokens. None if nothing ran."""
        try:
            return self._step()
        finally:
            self._publish()
            self.events.flush()

    def _step(self) -> StepStats | None:
        now = self.clock()
        self._drain_inbox()
        self._expire_waiting(now)
        plan = self._plan(now)
        if not plan:
            return None
        # Prefill work: prompt chunks, and recomputation after preemption; the rest are decode tokens.
        prefill = sum(count for request, count in plan if count > 1 or request.first_token is None)
        lanes = self.events.lanes(plan, self.running)  # before the step: a release empties a seat
        for request, _ in plan:
            self._mark_scheduled(request, now)
        failed = False
        try:
            output = self.engine.step([(r.seq_id, count) for r, count in plan])
        except Exception as exc:  # a failed step fails its own requests; the loop goes on serving
            logger.exception("engine step failed; failing its %d requests", len(plan))
            failed = True
            for request, _ in plan:
                self._finish(request, Outcome.FAILED, f"internal error during generation: {type(exc).__name__}")
            generated, num_tokens = 0, sum(count for _, count in plan)
        else:
            generated, num_tokens = self._deliver(output.tokens, output.prompt_logprobs), output.num_tokens
        stats = StepStats(
            self.mode, now, self.clock() - now, len(plan), num_tokens, prefill, generated, self.lifecycle.held_seats,
            len(self.running), len(self.waiting), self.engine.cache_usage, failed,
        )  # fmt: skip
        self._num_steps += 1
        if self.on_step is not None:
            self.on_step(stats)
        self.events.step(self._num_steps, stats, lanes)
        return stats

    def _plan(self, now: float) -> StepPlan:
        while True:
            try:
                return self.guard.plan(now)
            except RequestRefused as refused:
                # The engine refused this request while the policy admitted or measured it (an input the checks
                # missed): fail it alone, then plan again for everyone else. Each turn ends one request.
                logger.error("request %s failed while planning a step", refused.request.request_id, exc_info=refused)
                reason = f"internal error while admitting the request: {type(refused.cause).__name__}"
                self._finish(refused.request, Outcome.FAILED, reason)

    def _publish(self) -> None:
        lifecycle = self.lifecycle
        running, held = len(lifecycle.running), lifecycle.held_seats
        preempted = sum(1 for r in lifecycle.waiting if r.scheduled is not None)
        usage = self.engine.cache_usage
        cached_free = self.engine.allocator.num_cached_free / self.engine.allocator.num_blocks
        with self._lock:  # under the lock, so that a submission's own update is never lost
            pending = bool(self._inbox) or bool(self._requests)
            self._counts = SchedulerCounts(
                self.config.seats, running, held, self._num_queued, preempted, usage, pending, cached_free
            )

    def _mark_scheduled(self, request: SequenceRequest, now: float) -> None:
        request.num_steps += 1
        if request.scheduled is None:
            request.scheduled = now
            with self._lock:
                self._num_queued -= 1
            self.events.point(PointKind.ADMITTED, request, now)

    def _deliver(self, tokens: Sequence[TokenOutput], prompt_logprobs: Sequence[PromptLogprobs] = ()) -> int:
        by_seq = {r.seq_id: r for r in self.running}
        now = self.clock()
        for scores in prompt_logprobs:  # before the step's tokens: a prompt's scores precede its answer
            request = by_seq.get(scores.seq_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            if not self._emit(request, PromptLogprobsEvent(scores, now)):
                self._finish(request, Outcome.ABORTED)
        delivered = 0
        for token in tokens:
            request = by_seq.get(token.seq_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            if request.first_token is None:
                request.first_token = now
                self.events.point(PointKind.FIRST_TOKEN, request, now)
            request.last_token = now
            request.output_token_ids.append(token.token_id)
            delivered += 1
            if not self._emit(request, TokenEvent(token, now)):
                self._finish(request, Outcome.ABORTED)
            elif token.finish_reason is not None:
                self._finish(request, Outcome.from_engine(token.finish_reason))
        return delivered

    def _drain_inbox(self) -> None:
        with self._lock:
            commands = list(self._inbox)
            self._inbox.clear()
        for kind, item in commands:
            if kind == "submit":
                assert isinstance(item, SequenceRequest)
                self._requests[item.request_id] = item
                self.lifecycle.enqueue(item)
                self.events.point(PointKind.QUEUED, item, item.queued)
            elif kind == "snapshot":
                self.events.snapshot(self.clock(), self.running, len(self.waiting))
            elif kind == "drain":
                self._begin_drain_now()
            elif kind == "shutdown":
                self._shutdown_now()
            else:
                assert isinstance(item, str)
                request = self._requests.get(item)
                if request is None:
                    continue
                if request.status in (RequestStatus.WAITING, RequestStatus.RUNNING):
                    self._finish(request, Outcome.ABORTED if kind == "abort" else Outcome.STOPPED)
                elif kind == "abort" and request.status is RequestStatus.FINISHED:
                    # A finished answer held by its batch: its consumer left, so free the seat now.
                    self._finish(request, Outcome.ABORTED)

    def _expire_waiting(self, now: float) -> None:
        limit = self.config.queue_timeout_s
        if limit is None:
            return
        for request in [r for r in self.waiting if r.scheduled is None and now - r.queued > limit]:
            self._finish(
                request,
                Outcome.QUEUE_TIMEOUT,
                f"the request waited in the queue longer than {limit} s; the server is overloaded",
            )

    def _finish(self, request: SequenceRequest, outcome: Outcome, error: str | None = None) -> None:
        if request.scheduled is None:
            with self._lock:
                self._num_queued -= 1
        now = self.clock()
        if request.status in (RequestStatus.WAITING, RequestStatus.RUNNING):
            self.events.point(PointKind.FINISHED, request, now, outcome)
        self._finishing = (request, now)
        try:
            self.lifecycle.finish(request, outcome, error)
            self.guard.on_finished(request)
        finally:
            self._finishing = None

    def _on_released(self, request: SequenceRequest) -> None:
        self._requests.pop(request.request_id, None)
        outcome = request.outcome or Outcome.FAILED
        finishing = self._finishing
        now = finishing[1] if finishing is not None and finishing[0] is request else self.clock()
        self.events.point(PointKind.RELEASED, request, now)
        self._emit(request, FinishEvent(outcome, request.timings(self.mode, now), request.error))

    @staticmethod
    def _emit(request: SequenceRequest, event: RequestEvent) -> bool:
        """Hand an event to the request's consumer; a consumer that fails (its loop closed) must not stop
        the step for everyone else. Returns False if it failed."""
        try:
            request.sink(event)
        except Exception:
            logger.exception("the consumer of request %s failed; aborting it", request.request_id)
            return False
        return True

    def _begin_drain_now(self) -> None:
        # Preempted requests wait too, but they already ran: like the running ones, they may finish.
        for request in [r for r in self.waiting if r.scheduled is None]:
            self._finish(request, Outcome.SHUTDOWN, "the server is shutting down; retry the request")
        self.guard.begin_drain()

    def abandon(self, reason: str) -> None:
        """The loop thread is dying (`reason`): refuse every submission from now on, and end every request held,
        the inbox's too, at once (`Lifecycle.abandon`: neither the engine nor the policy, either may be what broke)."""
        with self._lock:
            self._closed, self._stopped = True, reason
            submitted = [item for _, item in self._inbox if isinstance(item, SequenceRequest)]
            self._inbox.clear()
            self._num_queued = 0
            self._counts = SchedulerCounts(self.config.seats, 0, 0, 0, 0, self._counts.cache_usage, False)
        for request in [*self._requests.values(), *submitted]:
            try:
                self.lifecycle.abandon(request, reason)
            except Exception:  # the others must still hear
                logger.exception("ending request %s failed", request.request_id)

    def _shutdown_now(self) -> None:
        for request in list(self._requests.values()):
            if request.status in (RequestStatus.WAITING, RequestStatus.RUNNING):
                self._finish(
                    request,
                    Outcome.SHUTDOWN,
                    "the server shut down before the request finished (its shutdown grace period ran out); retry it",
                )


__all__ = ["Scheduler", "StepPlan"]
