"""The contract between the scheduler core and a batching policy."""

from __future__ import annotations

import abc
from collections import deque

from engine.engine import Engine
from scheduler.config import Mode, SchedulerConfig
from scheduler.request import Request, RequestStatus

# A step's plan: for each request, how many of its pending tokens the engine computes now.
StepPlan = list[tuple[Request, int]]


class Policy(abc.ABC):
    """Decides which sequences run in the next step and when a finished request may be released."""

    mode: Mode

    def __init__(self, engine: Engine, config: SchedulerConfig) -> None:
        self.engine = engine
        self.config = config
        self.running: list[Request] = []

    @abc.abstractmethod
    def plan(self, waiting: deque[Request], now: float) -> StepPlan:
        """Admit from `waiting` (removing what it admits) and return the work for one step."""

    @abc.abstractmethod
    def on_finished(self, request: Request) -> list[Request]:
        """`request` just finished; return the requests whose completion may be released now."""

    def begin_drain(self) -> list[Request]:
        """The server is draining: nothing new will be admitted. Return the finished requests held so far, to be
        released now; from now on a request that finishes is released at once."""
        return []

    def next_deadline(self, waiting: deque[Request]) -> float | None:
        """When the policy wants to be asked again although nothing ran (a batch timeout), if ever."""
        return None

    @property
    def held_seats(self) -> int:
        """Seats occupied by sequences that finished but are not released yet."""
        return 0

    def _admit(self, request: Request) -> bool:
        """Give the request an engine row if it has none. False if no row is free."""
        if self.engine.has_sequence(request.seq_id):
            return True
        if self.engine.num_free_rows == 0:
            return False
        self.engine.add(request.seq_id, request.prompt_token_ids, request.params)
        return True

    @staticmethod
    def _unfinished(requests: list[Request]) -> list[Request]:
        return [r for r in requests if r.status is RequestStatus.RUNNING]
