"""The scheduler core's one way into its policy: every call is guarded, so that a policy that raises neither fails
an innocent request nor stops the loop.

- **A request's fault.** When the engine refuses a request while the policy admits or measures it (an action or
  a read of `PolicyContext` raised inside the lifecycle: an input the checks missed), `plan` raises
  `RequestRefused` for it, whatever the policy did with the error; the core fails that request alone and plans
  again for everyone else.
- **The policy's fault.** Anything else a policy raises, from any callback (its constructor, `start`, `plan`,
  `on_finished`, `begin_drain`, `next_deadline`), and any broken contract (an action on a request in the wrong
  state, a plan the engine would refuse, a deadline that is not a finite time) blames no request: the mode's
  built-in policy takes over from then on, with the state the failed one left. Held answers are released, and in
  dynamic and static mode a running request without its whole length reserved goes back to the queue (it keeps
  its tokens). The log says so once, with the traceback; `on_fallback` counts it (the server's
  `batchserve:policy_fallbacks_total`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import TypeVar

from scheduler.config import Mode, SchedulerConfig
from scheduler.lifecycle import Lifecycle
from scheduler.policies import builtin_policy, policy_class
from scheduler.policy import Policy, StepPlan
from scheduler.request import RequestStatus, SequenceRequest

logger = logging.getLogger("batchserve.scheduler")

# When even the built-in policy cannot say when it wants to run again, ask it again this much later.
DEADLINE_RETRY_S = 1.0
_T = TypeVar("_T")


class PolicyContractError(RuntimeError):
    """A policy asked for something `PolicyContext` does not allow, or returned what the core cannot use."""


class RequestRefused(Exception):
    """The engine refused `request` while the policy planned a step: that request, not the policy, is at fault."""

    def __init__(self, request: SequenceRequest, cause: Exception) -> None:
        super().__init__(f"request {request.request_id} was refused: {cause!r}")
        self.request = request
        self.cause = cause


class CheckedContext:
    """`PolicyContext` over the lifecycle: refuses what the contract does not allow before anything changes, and
    remembers the first request whose own action or read raised inside the lifecycle."""

    def __init__(self, lifecycle: Lifecycle, known: Callable[[SequenceRequest], bool]) -> None:
        self._lifecycle = lifecycle
        self._known = known  # one of this scheduler's live requests (not another's, not released)
        self.refused: tuple[SequenceRequest, Exception] | None = None

    @property
    def waiting(self) -> Sequence[SequenceRequest]:
        return self._lifecycle.waiting

    @property
    def running(self) -> Sequence[SequenceRequest]:
        return self._lifecycle.running

    @property
    def free_seats(self) -> int:
        return self._lifecycle.free_seats

    @property
    def free_rows(self) -> int:
        return self._lifecycle.free_rows

    @property
    def free_cache_tokens(self) -> int:
        return self._lifecycle.free_cache_tokens

    def pending_tokens(self, request: SequenceRequest) -> int:
        self._expect(request)
        return self._guarded(self._lifecycle.pending_tokens, request)

    def computed_tokens(self, request: SequenceRequest) -> int:
        self._expect(request)
        return self._guarded(self._lifecycle.computed_tokens, request)

    def reserved_tokens(self, request: SequenceRequest) -> int:
        self._expect(request)
        return self._guarded(self._lifecycle.reserved_tokens, request)

    def lowest_ranked_running(self, where: Callable[[SequenceRequest], bool]) -> SequenceRequest | None:
        return self._lifecycle.lowest_ranked_running(where)

    def admit(self, request: SequenceRequest, total_tokens: int) -> bool:
        self._expect(request, RequestStatus.WAITING, total_tokens)
        return self._guarded(self._lifecycle.admit, request, total_tokens)

    def reserve(self, request: SequenceRequest, total_tokens: int) -> bool:
        self._expect(request, RequestStatus.RUNNING, total_tokens)
        return self._guarded(self._lifecycle.reserve, request, total_tokens)

    def preempt(self, request: SequenceRequest) -> None:
        self._expect(request, RequestStatus.RUNNING)
        self._guarded(self._lifecycle.preempt, request)

    def release(self, request: SequenceRequest) -> None:
        self._expect(request, RequestStatus.FINISHED)
        self._guarded(self._lifecycle.release, request)

    def _expect(self, request: object, status: RequestStatus | None = None, total_tokens: object = 0) -> None:
        if not (isinstance(request, SequenceRequest) and self._known(request)):
            raise PolicyContractError(f"{request!r} is not a request of this scheduler that is still held")
        if status is not None and request.status is not status:
            raise PolicyContractError(
                f"request {request.request_id} is {request.status.value}; this action needs it {status.value}"
            )
        if isinstance(total_tokens, bool) or not isinstance(total_tokens, int) or total_tokens < 0:
            raise PolicyContractError(f"a token count must be an int >= 0, got {total_tokens!r}")

    def _guarded(self, call: Callable[..., _T], request: SequenceRequest, *args: int) -> _T:
        try:
            return call(request, *args)
        except Exception as exc:
            if self.refused is None and request.status in (RequestStatus.WAITING, RequestStatus.RUNNING):
                self.refused = (request, exc)
            raise


class PolicyGuard:
    """Owns the active policy; its methods never raise a policy's exception (only `RequestRefused`)."""

    def __init__(
        self,
        config: SchedulerConfig,
        lifecycle: Lifecycle,
        known: Callable[[SequenceRequest], bool],
        clock: Callable[[], float],
        on_fallback: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.fallbacks = 0  # how many times the mode's built-in policy took over
        self._lifecycle = lifecycle
        self._known = known
        self._ctx = CheckedContext(lifecycle, known)
        self._clock = clock
        self._on_fallback = on_fallback
        self._draining = False
        chosen = policy_class(config)
        self._trusted = chosen is builtin_policy(config.mode)  # a plug-in's plans are checked in full
        try:
            self.policy: Policy = chosen(config)
        except Exception as exc:
            self._fall_back("__init__", exc)
            return
        self.start(clock())

    def start(self, now: float) -> None:
        try:
            self.policy.start(now)
        except Exception as exc:
            self._fall_back("start", exc)  # the built-in starts itself

    def plan(self, now: float) -> StepPlan:
        """The step's plan, checked; `RequestRefused` when the engine refused a request the policy worked on. If
        even the built-in policy raises, that error goes to the loop, which retries the step."""
        for attempt in (1, 2):
            self._ctx.refused = None
            try:
                plan = self._checked(self.policy.plan(self._ctx, now))
            except Exception as exc:
                self._blame_refused()
                if attempt == 2:
                    raise
                self._fall_back("plan", exc)
                continue
            self._blame_refused()  # refused, and the policy went on without it: still that request's fault
            return plan
        raise AssertionError("unreachable")

    def on_finished(self, request: SequenceRequest) -> None:
        try:
            self.policy.on_finished(self._ctx, request)
        except Exception as exc:
            self._fall_back("on_finished", exc)  # taking over releases the held answers, this one's included

    def begin_drain(self) -> None:
        self._draining = True
        try:
            self.policy.begin_drain(self._ctx)
        except Exception as exc:
            self._fall_back("begin_drain", exc)  # the built-in drains as it takes over

    def next_deadline(self) -> float | None:
        """None or a finite time on the scheduler's clock."""
        for attempt in (1, 2):
            try:
                deadline = self.policy.next_deadline(self._ctx)
                if deadline is not None and not _finite_number(deadline):
                    raise PolicyContractError(f"next_deadline returned {deadline!r}, not a finite time or None")
                return deadline
            except Exception as exc:
                if attempt == 2:
                    logger.exception("the built-in next_deadline failed; asking again in %s s", DEADLINE_RETRY_S)
                    break
                self._fall_back("next_deadline", exc)
        return self._clock() + DEADLINE_RETRY_S

    def _checked(self, plan: object) -> StepPlan:
        """The plan, if the engine will take it: running requests of this scheduler, each once, with a token count
        from 1 to its pending tokens, within its reserved cache (counts only for a plug-in: the built-ins are
        tested, and the engine checks again)."""
        if not isinstance(plan, list | tuple):
            raise PolicyContractError(f"plan must return a list of (request, tokens), got {type(plan).__name__}")
        seen: set[int] = set()
        lifecycle = self._lifecycle
        for item in plan:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise PolicyContractError(f"a plan holds (request, tokens) pairs, got {item!r}")
            request, count = item
            if not (isinstance(request, SequenceRequest) and self._known(request)):
                raise PolicyContractError(f"the plan names {request!r}, not a request of this scheduler")
            if request.status is not RequestStatus.RUNNING or id(request) in seen:
                raise PolicyContractError(f"the plan names request {request.request_id}, which is not running or twice")
            seen.add(id(request))
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise PolicyContractError(f"the plan gives {request.request_id} {count!r} tokens, not an int >= 1")
            if not self._trusted and (
                count > lifecycle.pending_tokens(request)
                or lifecycle.computed_tokens(request) + count > lifecycle.reserved_tokens(request)
            ):
                raise PolicyContractError(
                    f"the plan gives request {request.request_id} {count} tokens: more than it has pending, or "
                    "beyond its reserved cache"
                )
        return list(plan)

    def _blame_refused(self) -> None:
        refused, self._ctx.refused = self._ctx.refused, None
        if refused is not None and refused[0].status in (RequestStatus.WAITING, RequestStatus.RUNNING):
            raise RequestRefused(*refused)

    def _fall_back(self, callback: str, exc: Exception) -> None:
        """The mode's built-in policy takes over, from the state the failed one left."""
        failed = self.config.policy or builtin_policy(self.config.mode).__name__
        logger.error(
            "the scheduling policy %s raised in %s (%s: %s); the built-in %s policy takes over from now on",
            failed, callback, type(exc).__name__, exc, self.config.mode.value, exc_info=exc,
        )  # fmt: skip
        self.fallbacks += 1
        self._trusted = True
        self.policy = builtin_policy(self.config.mode)(self.config)
        self.policy.start(self._clock())
        lifecycle = self._lifecycle
        for request in list(lifecycle.running):
            if request.status is RequestStatus.FINISHED:
                lifecycle.release(request)  # its answer is whole: holding it was the failed policy's choice
            elif self.config.mode is not Mode.CONTINUOUS and not lifecycle.reserve(request, request.max_total_tokens):
                lifecycle.preempt(request)  # a batch of these modes runs with its whole length reserved
        if self._draining:
            self.policy.begin_drain(self._ctx)
        if self._on_fallback is not None:
            try:
                self._on_fallback()
            except Exception:
                logger.exception("counting the policy fallback failed")


def _finite_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
