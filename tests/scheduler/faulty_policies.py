"""Plug-in policies that raise, or break the contract, for the tests of scheduler/policy_guard.py (loaded by import
path like any plug-in: `tests.scheduler.faulty_policies:NAME`).

`raising(mode, callback, fail_from)` names a policy that is the mode's built-in one except that `callback` raises
`PolicyBug` from its `fail_from`-th call on (1: every call). Every such class is made here, for every mode, every
callback of `Policy` and `fail_from` 1 and 3, so that a path names each.
"""

from __future__ import annotations

import math
from typing import Any

from scheduler.config import Mode
from scheduler.continuous import ContinuousPolicy
from scheduler.policies import builtin_policy
from scheduler.policy import Policy, PolicyContext, StepPlan
from scheduler.request import RequestStatus, SequenceRequest

MODULE = __name__
# Every callback of scheduler.policy.Policy (a test checks this list against the class).
CALLBACKS = ("__init__", "start", "plan", "on_finished", "begin_drain", "next_deadline")


class PolicyBug(RuntimeError):
    pass


def _name(base: type[Policy], callback: str, fail_from: int) -> str:
    return f"{base.__name__}{callback.strip('_').title().replace('_', '')}From{fail_from}"


def _raising_class(base: type[Policy], callback: str, fail_from: int) -> type[Policy]:
    def counted(self: Any) -> int:
        calls: dict[str, int] = self.__dict__.setdefault("_calls", {})
        calls[callback] = calls.get(callback, 0) + 1
        return calls[callback]

    def method(self: Any, *args: Any) -> Any:
        if counted(self) >= fail_from:
            raise PolicyBug(f"{callback} is broken")
        return getattr(base, callback)(self, *args)

    return type(_name(base, callback, fail_from), (base,), {callback: method, "__module__": MODULE})


def raising(mode: Mode, callback: str, fail_from: int = 1) -> str:
    """The import path of the mode's built-in policy with `callback` raising from its `fail_from`-th call."""
    return f"{MODULE}:{_name(builtin_policy(mode), callback, fail_from)}"


for _mode in Mode:
    for _callback in CALLBACKS:
        for _from in (1, 3):
            _cls = _raising_class(builtin_policy(_mode), _callback, _from)
            globals()[_cls.__name__] = _cls


# ----- contract breakers: continuous batching, but for one thing -----
class PlansAWaitingRequest(ContinuousPolicy):
    """Puts the head of the queue in the plan without admitting it."""

    def plan(self, ctx: PolicyContext, now: float) -> StepPlan:
        plan = super().plan(ctx, now)
        return [*plan, (ctx.waiting[0], 1)] if ctx.waiting else plan


class PlansBeyondItsCache(ContinuousPolicy):
    """Asks for more tokens than a running request has pending."""

    def plan(self, ctx: PolicyContext, now: float) -> StepPlan:
        return [(request, count + 1000) for request, count in super().plan(ctx, now)]


class PlansTwice(ContinuousPolicy):
    def plan(self, ctx: PolicyContext, now: float) -> StepPlan:
        plan = super().plan(ctx, now)
        return plan + plan[:1]


class AdmitsARunningRequest(ContinuousPolicy):
    def plan(self, ctx: PolicyContext, now: float) -> StepPlan:
        for request in ctx.running:
            ctx.admit(request, 1)
        return super().plan(ctx, now)


class ReleasesARunningRequest(ContinuousPolicy):
    def on_finished(self, ctx: PolicyContext, request: SequenceRequest) -> None:
        for other in ctx.running:
            if other.status is RequestStatus.RUNNING:
                ctx.release(other)
        super().on_finished(ctx, request)


class NanDeadline(ContinuousPolicy):
    def next_deadline(self, ctx: PolicyContext) -> float | None:
        return math.nan


class FarDeadline(ContinuousPolicy):
    """A legal deadline, 30,000 years away: past what a thread's wait takes."""

    def next_deadline(self, ctx: PolicyContext) -> float | None:
        return 1e12


class SwallowsRefusals(ContinuousPolicy):
    """Goes on with an empty plan when the engine refuses a request it admits."""

    def plan(self, ctx: PolicyContext, now: float) -> StepPlan:
        try:
            return super().plan(ctx, now)
        except PolicyBug:
            return []


CONTRACT_BREAKERS = (
    "PlansAWaitingRequest",
    "PlansBeyondItsCache",
    "PlansTwice",
    "AdmitsARunningRequest",
    "ReleasesARunningRequest",
    "NanDeadline",
)
