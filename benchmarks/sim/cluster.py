"""Discrete-event replay of a trace on K simulated servers behind a router, each the real `Scheduler`.

A replica is one `Scheduler` (the production class, with its `Lifecycle` and policy) over an engine and a virtual
clock. The engine advances the clock by its step's cost; between steps the replica does what
`scheduler.loop.SchedulerLoop` does: run the next step if there is work, else sleep until the next arrival or the
policy's deadline (a batch timeout). A request that arrives during a step is submitted at its arrival time and
taken from the inbox at the next step boundary, as on the real server.

Replicas run independently; before each arrival every replica is advanced to that time, so the router sees their
state as it is then. A conversation's next turn (an arrival that `follows` another) arrives when the request it
follows has ended (plus the client's time outside the steps), as the load generator sends it: replicas stop at
that request's last step so that no step runs without it. `round-robin` takes them in turn; `least-loaded` picks
the one with the fewest requests submitted and not yet released (ties: the lowest index).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from benchmarks.sim.engine import VirtualClock
from scheduler.core import Scheduler
from scheduler.errors import QueueFullError
from scheduler.request import EventSink, FinishEvent, RequestEvent, SequenceRequest, TokenEvent
from scheduler.stats import StepStats

ROUTERS = ("round-robin", "least-loaded")


class StuckError(RuntimeError):
    """The scheduler has unreleased requests but neither runs a step nor names a deadline."""


@dataclass(slots=True)
class RequestTrace:
    """What a request's consumer saw: token times and the final event (None while it runs)."""

    replica: int
    arrival: float
    token_times: list[float] = field(default_factory=list)
    finish: FinishEvent | None = None
    error: str | None = None  # refused at submission (429, 400)
    busy_arrival: bool = False  # it arrived while a step ran

    def on_event(self, event: RequestEvent) -> None:
        if type(event) is TokenEvent:
            self.token_times.append(event.time)
        elif isinstance(event, FinishEvent):
            self.finish = event


@dataclass(slots=True)
class StepTally:
    """What the server's /metrics would count over the run (see api/endpoints/metrics.py)."""

    steps: int = 0
    seqs: int = 0
    held_seat_steps: int = 0
    prompt_tokens: int = 0
    generated: int = 0
    busy_s: float = 0.0
    draft_tokens: int = 0  # speculation: drafts verified, and those accepted
    accepted_tokens: int = 0

    def on_step(self, stats: StepStats) -> None:
        self.steps += 1
        self.seqs += stats.num_seqs
        self.held_seat_steps += stats.held_seats
        self.prompt_tokens += stats.num_prompt_tokens
        self.generated += stats.num_generated
        self.busy_s += stats.duration
        self.draft_tokens += stats.num_draft_tokens
        self.accepted_tokens += stats.num_accepted_tokens


class Replica:
    """One server: a scheduler on its own clock. `expect_output(seq_id, n)` tells a simulated engine a replayed
    natural stop (None: the engine decides stops itself, as the real one does)."""

    def __init__(
        self,
        scheduler: Scheduler,
        clock: VirtualClock,
        tally: StepTally,
        expect_output: Callable[[int, int], None] | None = None,
        arrival_stall_s: float = 0.0,
    ) -> None:
        self.scheduler = scheduler
        self.clock = clock
        self.tally = tally
        self._expect_output = expect_output
        self._arrival_stall_s = arrival_stall_s  # how much longer a step runs when requests arrive during it
        self._stalled_step_end = -math.inf
        self.outstanding = 0  # submitted, not released: what a least-loaded router balances

    def advance_to(self, t: float, stop: Callable[[], bool] = lambda: False) -> None:
        """Run every step that starts before `t` (the last may end after it), or until `stop()` holds after a step;
        idle time jumps to deadlines."""
        scheduler, clock = self.scheduler, self.clock
        while clock.now < t:
            if scheduler.step() is not None:
                if stop():
                    return
                continue
            deadline = scheduler.next_deadline()
            if deadline is None or deadline >= t:
                clock.now = t
                return
            # A deadline that float rounding left a hair short of firing is retried one ulp later.
            clock.now = deadline if deadline > clock.now else math.nextafter(clock.now, math.inf)

    def drain(self, limit_s: float = 1e9, stop: Callable[[], bool] = lambda: False) -> None:
        """Run until every submitted request is released, or until `stop()` holds after a step."""
        scheduler, clock = self.scheduler, self.clock
        while scheduler.has_pending_work():
            if clock.now > limit_s:
                raise StuckError(f"requests still pending after {limit_s} simulated seconds")
            if scheduler.step() is not None:
                if stop():
                    return
                continue
            deadline = scheduler.next_deadline()
            if deadline is None:
                raise StuckError("requests are pending but the scheduler neither steps nor waits for a deadline")
            clock.now = deadline if deadline > clock.now else math.nextafter(clock.now, math.inf)

    def busy_at(self, t: float) -> bool:
        """Whether a step runs at `t` (the clock has been advanced to `t`, and a step that began before it ends
        after it)."""
        return self.clock.now > t

    def submit(self, request: SequenceRequest, arrival: float, output_tokens: int | None = None) -> bool:
        """Hand the request to the server at `arrival` (not before this replica's clock reached it). False if
        it was refused; `request.sink` then never hears of it. Arrivals during a step delay the next step by the
        arrival stall: their intake took CPU from the running step. The running step's own tokens keep their
        times, and the stall is not counted as busy time. Once per step however many arrive: the probe measured
        lone arrivals, and the load probe's bursts, whose arrivals land in a step or two, already charge what more
        of them cost."""
        if self.busy_at(arrival) and self.clock.now != self._stalled_step_end:
            self.clock.now += self._arrival_stall_s
            self._stalled_step_end = self.clock.now
        self.clock.now = max(self.clock.now, arrival)
        try:
            self.scheduler.submit(request, arrival)
        except QueueFullError:
            return False
        # It reached the server at `arrival`, during the step the clock is in: the batch timeout counts from then.
        request.queued = arrival
        if output_tokens is not None and self._expect_output is not None:
            self._expect_output(request.seq_id, output_tokens)
        self.outstanding += 1
        return True

    def released(self) -> None:
        self.outstanding -= 1


Router = Callable[[Sequence[Replica], int], int]  # (replicas, request index) -> the replica that gets it


def make_router(name: str) -> Router:
    if name == "round-robin":
        return lambda replicas, index: index % len(replicas)
    if name == "least-loaded":
        return lambda replicas, index: min(range(len(replicas)), key=lambda i: replicas[i].outstanding)
    raise ValueError(f"router must be one of {ROUTERS}, got {name!r}")


@dataclass(frozen=True)
class Arrival:
    """A request to replay: its arrival time, a factory for its `SequenceRequest` (given the sink), the output
    length to replay, if any, and the earlier arrival whose end it waits for, if any (then `time` is the earliest
    it may arrive)."""

    time: float
    make_request: Callable[[EventSink], SequenceRequest]
    output_tokens: int | None = None
    follows: int | None = None


def replay(
    arrivals: Sequence[Arrival], replicas: Sequence[Replica], router: Router, follow_gap_s: float = 0.0
) -> list[RequestTrace]:
    """Replay the arrivals (sorted by time) through the router; returns one trace per arrival, in order. An arrival
    that follows another arrives `follow_gap_s` after that one's release, or at its own time if later."""
    traces: list[RequestTrace | None] = [None] * len(arrivals)
    ready = [(a.time, i) for i, a in enumerate(arrivals) if a.follows is None]  # a heap: (arrival, index)
    followers: dict[int, list[int]] = {}
    for index, arrival in enumerate(arrivals):
        if arrival.follows is not None:
            followers.setdefault(arrival.follows, []).append(index)
    woken: list[int] = []  # leaders that ended during the last step: their followers arrive now

    def wake(leader: int, ended: float) -> None:
        if leader in followers:
            for index in followers.pop(leader):
                heapq.heappush(ready, (max(arrivals[index].time, ended + follow_gap_s), index))
            woken.append(leader)

    while True:
        woken.clear()
        t = ready[0][0] if ready else math.inf
        for replica in replicas:
            if math.isinf(t):
                replica.drain(stop=lambda: bool(woken))
            else:
                replica.advance_to(t, stop=lambda: bool(woken))
            if woken:
                break
        if woken:
            continue  # an arrival earlier than t may have become ready
        if not ready:
            break
        t, index = heapq.heappop(ready)
        traces[index] = trace = _submit(arrivals[index], index, t, replicas, router, wake)
        if trace.error is not None:
            wake(index, t)  # refused: the client sends the next turn at once
    if followers:
        raise StuckError(f"arrivals follow requests that never ended: {sorted(followers)}")
    return [trace for trace in traces if trace is not None]


def _submit(
    arrival: Arrival,
    index: int,
    t: float,
    replicas: Sequence[Replica],
    router: Router,
    ended: Callable[[int, float], None],
) -> RequestTrace:
    target = router(replicas, index)
    replica = replicas[target]
    trace = RequestTrace(target, t, busy_arrival=replica.busy_at(t))

    def sink(event: RequestEvent) -> None:
        trace.on_event(event)
        if trace.finish is not None and isinstance(event, FinishEvent):
            replica.released()
            ended(index, event.timings.released)

    request = arrival.make_request(sink)
    try:
        accepted = replica.submit(request, t, arrival.output_tokens)
    except ValueError as exc:  # the engine's input checks (EngineInputError): the API's 400
        trace.error = f"HTTP 400: {exc}"
    else:
        if not accepted:
            trace.error = "HTTP 429: the waiting queue is full"
    return trace
