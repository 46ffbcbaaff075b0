"""The scheduler's event feed: what each step ran in which seat, and each point of a request's life.

The core calls the feed's recorder at every step and lifecycle point. While no listener wants events (`enabled` is
False) the recorder is one whose every call returns at once, having built nothing; otherwise it collects a step's
events in a list and hands the whole list to the listener once, after the step. The listener must not block: the
API's hub passes the list to its event loop and returns. Encoding, text and fan-out happen there, never on this
thread. Field meanings: docs/events.md.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from scheduler.request import Outcome, RequestStatus, SequenceRequest
from scheduler.stats import StepStats

logger = logging.getLogger("batchserve.scheduler")


class LanePhase(enum.Enum):
    PREFILL = "prefill"  # computed prompt tokens this step (a chunk, or the prompt again after a preemption)
    DECODE = "decode"  # computed one generated token
    HELD = "held"  # finished; its answer and seat are kept until its batch is done (dynamic mode)
    IDLE = "idle"  # seated, computed nothing this step (the step's token budget ran out first)


class PointKind(enum.Enum):
    QUEUED = "queued"
    ADMITTED = "admitted"
    FIRST_TOKEN = "first_token"
    FINISHED = "finished"
    RELEASED = "released"
    REJECTED = "rejected"


@dataclass(frozen=True)
class Lane:
    seat: int
    request_id: str
    phase: LanePhase


@dataclass(frozen=True)
class StepEvent:
    time: float  # the step's start, on the scheduler's clock
    step: int
    duration: float
    lanes: tuple[Lane, ...]  # every seat occupied during the step
    waiting: int
    running: int
    held: int
    tokens: int
    prompt_tokens: int
    generated: int
    drafted: int = 0  # speculation: draft tokens verified in the step
    accepted: int = 0  # of those, the ones accepted


@dataclass(frozen=True)
class RequestPoint:
    """One point of a request's life. `details` holds the JSON-ready extras of its kind (docs/events.md);
    `token_ids` the tokens a subscriber may want as text: the prompt on QUEUED, the output on FINISHED."""

    time: float
    request_id: str
    kind: PointKind
    seat: int | None = None
    details: dict[str, int | float | str | None] = field(default_factory=dict)
    token_ids: Sequence[int] = ()


@dataclass(frozen=True)
class Snapshot:
    """The current state, taken at a step boundary when a subscriber needs a fresh start."""

    time: float
    lanes: tuple[Lane, ...]
    waiting: int
    running: int
    held: int


SchedulerEvent = StepEvent | RequestPoint | Snapshot
EventListener = Callable[[list[SchedulerEvent]], None]


class Recorder:
    """What the loop thread calls at each step and lifecycle point. This one records nothing: it is the feed's while
    no listener wants events, so each call returns at once, having built nothing, and the core needs no check."""

    def point(self, kind: PointKind, request: SequenceRequest, now: float, outcome: Outcome | None = None) -> None:
        pass

    def lanes(
        self, plan: Sequence[tuple[SequenceRequest, int]], running: Sequence[SequenceRequest]
    ) -> tuple[Lane, ...]:
        """A step's lanes, taken before it runs (a request released by the step still shows where it ran)."""
        return ()

    def step(self, number: int, stats: StepStats, lanes: tuple[Lane, ...]) -> None:
        pass

    def snapshot(self, now: float, running: Sequence[SequenceRequest], waiting: int) -> None:
        pass

    def rejected(self, request: SequenceRequest, now: float, reason: str) -> None:
        """On the submitting thread: delivered at once, alone."""

    def flush(self) -> None:
        """After each step: hand the events collected since the last flush to the listener."""


class Recording(Recorder):
    """The feed's recorder while a listener wants events: it collects a step's events and hands them over at once."""

    def __init__(self, listener: EventListener) -> None:
        self._listener = listener
        self._pending: list[SchedulerEvent] = []

    def point(self, kind: PointKind, request: SequenceRequest, now: float, outcome: Outcome | None = None) -> None:
        self._pending.append(request_point(kind, request, now, outcome))

    def lanes(
        self, plan: Sequence[tuple[SequenceRequest, int]], running: Sequence[SequenceRequest]
    ) -> tuple[Lane, ...]:
        return step_lanes(plan, running)

    def step(self, number: int, stats: StepStats, lanes: tuple[Lane, ...]) -> None:
        self._pending.append(
            StepEvent(
                stats.start, number, stats.duration, lanes, stats.num_waiting, stats.num_running, stats.held_seats,
                stats.num_tokens, stats.num_prompt_tokens, stats.num_generated, stats.num_draft_tokens,
                stats.num_accepted_tokens,
            )
        )  # fmt: skip

    def snapshot(self, now: float, running: Sequence[SequenceRequest], waiting: int) -> None:
        held = sum(1 for r in running if r.status is RequestStatus.FINISHED)
        self._pending.append(Snapshot(now, snapshot_lanes(running), waiting, len(running), held))

    def rejected(self, request: SequenceRequest, now: float, reason: str) -> None:
        self._deliver([request_point(PointKind.REJECTED, request, now, reason=reason)])

    def flush(self) -> None:
        if self._pending:
            batch, self._pending = self._pending, []
            self._deliver(batch)

    def _deliver(self, batch: list[SchedulerEvent]) -> None:
        """Any thread (a rejection happens on the submitting one). A failing listener never stops the step."""
        try:
            self._listener(batch)
        except Exception:
            logger.exception("the event listener failed; its events are dropped")


class EventFeed:
    """One scheduler's events, handed to a single listener once per step. The core calls `record`'s methods: a
    `Recorder` that records nothing while no listener wants events, a `Recording` while one does."""

    def __init__(self) -> None:
        self._listener: EventListener | None = None
        self.record: Recorder = Recorder()

    def attach(self, listener: EventListener) -> None:
        self._listener = listener

    @property
    def enabled(self) -> bool:
        return isinstance(self.record, Recording)

    @enabled.setter
    def enabled(self, on: bool) -> None:
        """Set by the listener's owner from any thread: `record` is swapped whole, one atomic assignment, and the
        loop thread reads it afresh at each call. Events a recording collected and had not flushed when it was
        switched off are dropped."""
        if on == self.enabled:
            return  # a second subscriber: keep the events collected so far
        if not on:
            self.record = Recorder()
        elif self._listener is None:
            raise RuntimeError("attach a listener before enabling the event feed")
        else:
            self.record = Recording(self._listener)


def lane_phase(request: SequenceRequest, count: int) -> LanePhase:
    """The phase of a request computing `count` tokens: as the core counts prefill work."""
    return LanePhase.PREFILL if count > 1 or request.first_token is None else LanePhase.DECODE


def step_lanes(plan: Sequence[tuple[SequenceRequest, int]], running: Sequence[SequenceRequest]) -> tuple[Lane, ...]:
    """The seats of a step, built before it runs (a request released by the step still shows where it ran)."""
    lanes = [Lane(_seat(r), r.request_id, lane_phase(r, count)) for r, count in plan]
    if len(plan) < len(running):  # held or idle seats: only those need the set
        planned = {r.request_id for r, _ in plan}
        lanes.extend(
            Lane(_seat(r), r.request_id, LanePhase.HELD if r.status is RequestStatus.FINISHED else LanePhase.IDLE)
            for r in running
            if r.request_id not in planned
        )
    return tuple(lanes)


def snapshot_lanes(running: Sequence[SequenceRequest]) -> tuple[Lane, ...]:
    return tuple(
        Lane(_seat(r), r.request_id, LanePhase.HELD if r.status is RequestStatus.FINISHED else lane_phase(r, 1))
        for r in running
    )


def _seat(request: SequenceRequest) -> int:
    return -1 if request.seat is None else request.seat


def request_point(
    kind: PointKind, request: SequenceRequest, now: float, outcome: Outcome | None = None, reason: str = ""
) -> RequestPoint:
    """The event of `request` reaching `kind` at `now`, with that kind's extras."""
    details: dict[str, int | float | str | None]
    seat = request.seat if request.scheduled is not None else None
    token_ids: Sequence[int] = ()
    if kind is PointKind.QUEUED:
        seat, token_ids = None, request.prompt_token_ids
        details = {"prompt_tokens": len(request.prompt_token_ids), "max_tokens": request.params.max_tokens}
    elif kind is PointKind.ADMITTED:
        details = {"queue_ms": (now - request.arrival) * 1000.0, "cached_tokens": request.num_cached_tokens}
    elif kind is PointKind.FIRST_TOKEN:
        details = {"ttft_ms": (now - request.arrival) * 1000.0}
    elif kind is PointKind.FINISHED:
        if request.status is not RequestStatus.RUNNING:
            seat = None  # it ended while waiting (never ran, or preempted): it holds no seat
        token_ids = request.output_token_ids
        details = {"output_tokens": len(token_ids), "outcome": outcome.value if outcome is not None else None}
    elif kind is PointKind.RELEASED:
        details = {"held_ms": 0.0 if request.last_token is None else (now - request.last_token) * 1000.0}
    else:
        seat = None
        details = {"reason": reason, "prompt_tokens": len(request.prompt_token_ids)}
    return RequestPoint(now, request.request_id, kind, seat, details, token_ids)
