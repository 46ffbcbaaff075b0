"""The scheduler: takes requests in, asks its policy what runs, has `Lifecycle` carry it out, one step at a time.

A step is: take in what other threads sent (`Inbox.apply`: submissions, aborts, stop-string finishes, drain and
shutdown, queue timeouts), plan, run one engine step, deliver its tokens, finish and release. Everything runs on the
engine loop thread except the inbox's entry points (scheduler/inbox.py), which only append to its locked list or
set a flag under its lock. `step()` is synchronous and takes an injectable clock, so policy tests drive it
directly. Every call into the policy goes through `PolicyGuard` (scheduler/policy_guard.py): a policy that raises
fails no innocent request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from engine.outputs import DraftStats, PromptLogprobs, TokenOutput
from scheduler.config import SchedulerConfig
from scheduler.draft_length import DraftLengthRule
from scheduler.engine_port import SchedulerEngine
from scheduler.events import EventFeed, PointKind
from scheduler.inbox import Inbox
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
from scheduler.speculation import Drafter, propose_drafts
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
        drafter: Drafter | None = None,
    ) -> None:
        """`on_policy_fallback`: called (on the loop thread) each time the mode's built-in policy takes over from
        one that raised. `drafter`: where speculation's drafts come from (default: the request's own tokens)."""
        check_seats(engine, config)
        self.engine = engine
        self.config = config
        self.clock = clock
        self.on_step = on_step
        self.events = EventFeed()  # records only while a listener is enabled (api/endpoints/event_hub.py)
        queue = request_queue(config.by_priority)
        self.lifecycle = Lifecycle(engine, config.seats, self._on_released, queue)
        self.guard = PolicyGuard(config, self.lifecycle, self._held, clock, on_policy_fallback)
        self.inbox = Inbox(config, clock, self.events, self.lifecycle, self.guard, self._finish)
        self._num_steps = 0
        self.draft_length = DraftLengthRule()  # learns this engine's step cost from every step (speculation.py)
        self.drafter = drafter
        # (request, when) while `_finish` runs: a request its policy releases at once (continuous batching) is
        # released at the instant it finished, not a clock reading later: it was held for no time.
        self._finishing: tuple[SequenceRequest, float] | None = None

    def _held(self, request: SequenceRequest) -> bool:
        """One of this scheduler's requests, not yet released (a policy may act only on those)."""
        return self.inbox.requests.get(request.request_id) is request

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

    # ----- any thread: the inbox's entry points (scheduler/inbox.py says what each does) -----
    def submit(self, request: SequenceRequest, arrival: float | None = None) -> None:
        self.inbox.submit(request, arrival)

    def abort(self, request_id: str) -> None:
        self.inbox.abort(request_id)

    def stop_request(self, request_id: str) -> None:
        self.inbox.stop_request(request_id)

    def close(self) -> None:
        self.inbox.close()

    def begin_drain(self) -> None:
        self.inbox.begin_drain()

    def shutdown(self) -> None:
        self.inbox.shutdown()

    def request_snapshot(self) -> None:
        self.inbox.request_snapshot()

    @property
    def num_queued(self) -> int:
        return self.inbox.num_queued

    def counts(self) -> SchedulerCounts:
        """The counts as of the last step boundary or command; safe from any thread."""
        return self.inbox.counts()

    def abandon(self, reason: str) -> None:
        """The loop thread is dying: end every request at once and refuse new ones (`Inbox.abandon`)."""
        self.inbox.abandon(reason)

    # ----- loop thread -----
    def has_pending_work(self) -> bool:
        return self.inbox.has_pending_work()

    def next_deadline(self) -> float | None:
        present = [d for d in (self.guard.next_deadline(), self.inbox.next_timeout()) if d is not None]
        return min(present) if present else None

    def step(self) -> StepStats | None:
        """Apply queued commands, plan, run one engine step, deliver its tokens. None if nothing ran."""
        try:
            return self._step()
        finally:
            self.inbox.publish()
            self.events.record.flush()

    def _step(self) -> StepStats | None:
        now = self.clock()
        self.inbox.apply(now)
        plan = self._plan(now)
        if not plan:
            return None
        # Prefill work: prompt chunks, and recomputation after preemption; the rest are decode tokens.
        prefill = sum(count for request, count in plan if count > 1 or request.first_token is None)
        lanes = self.events.record.lanes(plan, self.running)  # before the step: a release empties a seat
        for request, _ in plan:
            self._mark_scheduled(request, now)
        failed = False
        try:
            schedule = [(r.seq_id, count) for r, count in plan]
            drafts = propose_drafts(self.config, self.lifecycle, plan, self.draft_length, self.drafter)
            output = self.engine.step(schedule, drafts) if drafts else self.engine.step(schedule)
        except Exception as exc:  # a failed step fails its own requests; the loop goes on serving
            logger.exception("engine step failed; failing its %d requests", len(plan))
            failed = True
            for request, _ in plan:
                self._finish(request, Outcome.FAILED, f"internal error during generation: {type(exc).__name__}")
            generated, num_tokens, drafted = 0, sum(count for _, count in plan), DraftStats()
        else:
            drafted = output.drafts
            by_seq = {r.seq_id: r for r, _ in plan}
            for seq_id, num_drafts, num_accepted in drafted.by_seq:  # before delivery: a release reads them
                by_seq[seq_id].num_draft_tokens += num_drafts
                by_seq[seq_id].num_accepted_tokens += num_accepted
                by_seq[seq_id].acceptance.record(num_drafts, num_accepted)
                self.draft_length.pooled.record(num_drafts, num_accepted)
            generated, num_tokens = self._deliver(output.tokens, output.prompt_logprobs), output.num_tokens
        stats = StepStats(
            self.mode, now, self.clock() - now, len(plan), num_tokens, prefill, generated, self.lifecycle.held_seats,
            len(self.running), len(self.waiting), self.engine.cache_usage, failed, drafted.num_draft_tokens,
            drafted.num_accepted_tokens, drafted.num_drafts, drafted.accepted_per_pos,
        )  # fmt: skip
        self._num_steps += 1
        if not failed:
            self.draft_length.observe(len(plan), num_tokens, stats.duration)
        if self.on_step is not None:
            self.on_step(stats)
        self.events.record.step(self._num_steps, stats, lanes)
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

    def _mark_scheduled(self, request: SequenceRequest, now: float) -> None:
        request.num_steps += 1
        if request.scheduled is None:
            request.scheduled = now
            self.inbox.started()
            self.events.record.point(PointKind.ADMITTED, request, now)

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
        last = {token.seq_id: index for index, token in enumerate(tokens)}  # each request's last token this step
        for index, token in enumerate(tokens):
            request = by_seq.get(token.seq_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            if request.first_token is None:
                request.first_token = now
                self.events.record.point(PointKind.FIRST_TOKEN, request, now)
            request.last_token = now
            request.output_token_ids.append(token.token_id)
            delivered += 1
            if not self._emit(request, TokenEvent(token, now, more=index != last[token.seq_id])):
                self._finish(request, Outcome.ABORTED)
            elif token.finish_reason is not None:
                self._finish(request, Outcome.from_engine(token.finish_reason))
        return delivered

    def _finish(self, request: SequenceRequest, outcome: Outcome, error: str | None = None) -> None:
        if request.scheduled is None:
            self.inbox.started()
        now = self.clock()
        if request.status in (RequestStatus.WAITING, RequestStatus.RUNNING):
            self.events.record.point(PointKind.FINISHED, request, now, outcome)
        self._finishing = (request, now)
        try:
            self.lifecycle.finish(request, outcome, error)
            self.guard.on_finished(request)
        finally:
            self._finishing = None

    def _on_released(self, request: SequenceRequest) -> None:
        self.inbox.requests.pop(request.request_id, None)
        outcome = request.outcome or Outcome.FAILED
        finishing = self._finishing
        now = finishing[1] if finishing is not None and finishing[0] is request else self.clock()
        self.events.record.point(PointKind.RELEASED, request, now)
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


__all__ = ["Scheduler", "StepPlan"]
