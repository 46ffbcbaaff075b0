"""The waiting queue and the order that ranks requests: who boards first, and whom a policy preempts first.

Two orders, as vLLM's `FCFSRequestQueue` and `PriorityRequestQueue` (`--scheduling-policy`): first come first served
by arrival, and by the request's `priority` (lower first), ties by arrival. `Lifecycle` holds the queue; a policy
reads it as `PolicyContext.waiting` and asks it for the lowest-ranked running request (`lowest_ranked_running`).
"""

from __future__ import annotations

import abc
from collections import deque
from collections.abc import Callable, Sequence

from scheduler.request import SequenceRequest


class RequestQueue(abc.ABC):
    """The waiting requests, head first (`requests`), and the order that places and ranks them."""

    def __init__(self) -> None:
        self._requests: deque[SequenceRequest] = deque()

    @property
    def requests(self) -> Sequence[SequenceRequest]:
        """Head first. The deque itself: reading it costs what a list's would, with no call through this class."""
        return self._requests

    @abc.abstractmethod
    def add(self, request: SequenceRequest) -> None:
        """A submission joins at its arrival's place."""

    @abc.abstractmethod
    def requeue(self, request: SequenceRequest) -> None:
        """A preempted request goes back, to be resumed."""

    @abc.abstractmethod
    def lowest_ranked(
        self, running: Sequence[SequenceRequest], where: Callable[[SequenceRequest], bool]
    ) -> SequenceRequest | None:
        """Of the `running` requests (in admission order) for which `where` holds, the one this order ranks last:
        the one to preempt first. None if `where` holds for none."""

    def remove(self, request: SequenceRequest) -> None:
        self._requests.remove(request)

    def _insert(self, request: SequenceRequest, stays_ahead: Callable[[SequenceRequest], bool]) -> None:
        """Walk back from the tail past every request that belongs behind `request`: almost always none, since
        tokenising rarely reorders arrivals."""
        index = len(self._requests)
        while index > 0 and not stays_ahead(self._requests[index - 1]):
            index -= 1
        self._requests.insert(index, request)


class FirstComeFirstServed(RequestQueue):
    """By arrival, preempted requests at the head (they already ran); the running request seated last ranks lowest."""

    def add(self, request: SequenceRequest) -> None:
        self._insert(request, lambda ahead: ahead.arrival <= request.arrival or ahead.num_preemptions > 0)

    def requeue(self, request: SequenceRequest) -> None:
        self._requests.appendleft(request)

    def lowest_ranked(
        self, running: Sequence[SequenceRequest], where: Callable[[SequenceRequest], bool]
    ) -> SequenceRequest | None:
        return next((r for r in reversed(running) if where(r)), None)


class ByPriority(RequestQueue):
    """By (priority, arrival), preempted requests included; the lowest ranked running request is the one of the
    highest priority value, the latest arrival among equals, the one seated last among exact ties."""

    @staticmethod
    def rank(request: SequenceRequest) -> tuple[int, float]:
        """The one place "by priority" is defined: lower first, ties by arrival."""
        return request.priority, request.arrival

    def add(self, request: SequenceRequest) -> None:
        key = self.rank(request)
        self._insert(request, lambda ahead: self.rank(ahead) <= key)

    def requeue(self, request: SequenceRequest) -> None:
        self.add(request)

    def lowest_ranked(
        self, running: Sequence[SequenceRequest], where: Callable[[SequenceRequest], bool]
    ) -> SequenceRequest | None:
        candidates = [r for r in reversed(running) if where(r)]  # reversed: max keeps the first of ties
        return max(candidates, key=self.rank, default=None)


def request_queue(by_priority: bool) -> RequestQueue:
    """The queue `--scheduling-policy` names (`SchedulerConfig.by_priority`)."""
    return ByPriority() if by_priority else FirstComeFirstServed()
