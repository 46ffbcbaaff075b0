"""The contract between the scheduler core and a batching policy.

A policy never touches the engine or a request's status. It reads what it needs and asks for actions through a
`PolicyContext`, which the scheduler core implements over the real engine (`scheduler.lifecycle.Lifecycle`); a
fake or simulated engine satisfies the same protocol, so the policies run unchanged against it.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from scheduler.config import Mode, SchedulerConfig
from scheduler.request import SequenceRequest

# A step's plan: for each request, how many of its pending tokens the engine computes now.
StepPlan = list[tuple[SequenceRequest, int]]


@runtime_checkable
class PolicyContext(Protocol):
    """What a policy sees of the scheduler's state, and the actions it may ask for. Token counts are absolute
    positions of one sequence (as the engine's `reserve`): `reserve(r, n)` makes r's cache hold n tokens."""

    @property
    def waiting(self) -> Sequence[SequenceRequest]:
        """The queue, head first, in `--scheduling-policy`'s order (scheduler/queue.py): first come first served
        (preempted requests, then the rest by arrival), or by priority then arrival."""

    @property
    def running(self) -> Sequence[SequenceRequest]:
        """Requests holding a seat, in admission order: generating, or finished and held by the policy."""

    @property
    def free_seats(self) -> int: ...

    @property
    def free_rows(self) -> int:
        """Free engine rows. A fresh request needs one to be admitted; a preempted request kept its own (its
        tokens), so rows can run out before seats do."""

    @property
    def free_cache_tokens(self) -> int:
        """Tokens the free KV cache blocks hold."""

    def pending_tokens(self, request: SequenceRequest) -> int:
        """Known tokens of the sequence not in its cache yet: a fresh request's whole prompt, then one per step;
        after a preemption, its prompt plus the tokens it produced."""

    def computed_tokens(self, request: SequenceRequest) -> int:
        """Tokens of the sequence already in its cache; for a waiting one, what it will find in the prefix cache
        when admitted (`pending_tokens` excludes them: cache hits cost no step budget)."""

    def reserved_tokens(self, request: SequenceRequest) -> int:
        """Tokens its reserved cache can hold."""

    def lowest_ranked_running(self, where: Callable[[SequenceRequest], bool]) -> SequenceRequest | None:
        """Of the running requests for which `where` holds, the one the queue's order ranks last: the one to preempt
        first. First come first served: the one seated last; by priority: the highest priority value, the latest
        arrival among equals. None if `where` holds for none."""

    def admit(self, request: SequenceRequest, total_tokens: int) -> bool:
        """Seat a waiting request with `total_tokens` of cache reserved, or change nothing and return False (no
        seat, row or cache)."""

    def reserve(self, request: SequenceRequest, total_tokens: int) -> bool:
        """Grow a running sequence's cache to hold `total_tokens`; all or nothing."""

    def preempt(self, request: SequenceRequest) -> None:
        """Free a running sequence's cache and put it back at the head of the queue, to be recomputed later."""

    def release(self, request: SequenceRequest) -> None:
        """Hand a finished request's completion to its consumer and free everything it holds."""


class Policy(abc.ABC):
    """Decides which sequences run in the next step and when a finished request is released."""

    mode: Mode

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config

    @abc.abstractmethod
    def plan(self, ctx: PolicyContext, now: float) -> StepPlan:
        """Admit from `ctx.waiting` and return the work for one step."""

    @abc.abstractmethod
    def on_finished(self, ctx: PolicyContext, request: SequenceRequest) -> None:
        """`request` just finished. If it still holds a seat (it ran to its end), release it now or later; one that
        ended early or never had a seat was released already."""

    def start(self, now: float) -> None:  # noqa: B027 (a hook: only a policy with a clock of its own overrides it)
        """The scheduler starts, at `now` on its clock."""

    def begin_drain(self, ctx: PolicyContext) -> None:  # noqa: B027 (a hook: only a policy that holds overrides it)
        """The server is draining: nothing new will be admitted. Release the finished requests held so far; from
        now on a request that finishes is released at once."""

    def next_deadline(self, ctx: PolicyContext) -> float | None:
        """When the policy wants to be asked again although nothing ran (a batch timeout), if ever."""
        return None
