"""One simulated run: a trace through K simulated servers of one mode, summarised as `benchmarks.online.ab` summarises
a real run (`RunResult`: the same `Summary`, server metrics and per-request records)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from api.endpoints.timings import timings_json
from benchmarks.loadgen.client import RequestRecord
from benchmarks.loadgen.prom import ScrapedMetrics
from benchmarks.loadgen.run import RunResult
from benchmarks.loadgen.summaries import SLO, summarize
from benchmarks.loadgen.trace import TraceRequest
from benchmarks.sim.cluster import Arrival, Replica, RequestTrace, StepTally, make_router, replay
from benchmarks.sim.cost.files import BusyArrival
from benchmarks.sim.cost.model import CostModel
from benchmarks.sim.engine import (
    DEFAULT_ACCEPTANCE_RATE,
    DEFAULT_DRAFT_RATE,
    SimEngine,
    SyntheticDrafter,
    VirtualClock,
)
from benchmarks.sim.prompts import PromptIds
from engine.config import EngineConfig
from engine.sample.sampling_params import SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.core import Scheduler
from scheduler.request import EventSink, RequestEvent, SequenceRequest, TokenEvent


@dataclass(frozen=True)
class SimSettings:
    scheduler: SchedulerConfig
    engine: EngineConfig
    cost: CostModel
    replicas: int = 1
    router: str = "round-robin"
    request_overhead_s: float = 0.0  # time outside the steps (HTTP, tokenising, SSE): cost.json's served probe
    busy_arrival: BusyArrival = field(default_factory=BusyArrival)  # arriving mid-step: the served probe
    acceptance_rate: float = DEFAULT_ACCEPTANCE_RATE  # with speculation: each draft right with this chance
    draft_rate: float = DEFAULT_DRAFT_RATE  # with speculation: a sampling row has drafts with this chance
    seed: int = 0  # the acceptance and draft draws' (replica i draws from seed + i)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if not math.isfinite(self.request_overhead_s) or self.request_overhead_s < 0:
            raise ValueError(f"request_overhead_s must be finite and >= 0, got {self.request_overhead_s}")
        make_router(self.router)  # validates the name
        for name, rate in (("acceptance_rate", self.acceptance_rate), ("draft_rate", self.draft_rate)):
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {rate}")


def build_replica(settings: SimSettings, index: int = 0) -> Replica:
    clock = VirtualClock()
    engine = SimEngine(
        settings.engine, settings.cost, clock, acceptance_rate=settings.acceptance_rate, seed=settings.seed + index
    )
    tally = StepTally()
    drafter = SyntheticDrafter(settings.draft_rate, seed=settings.seed + index)
    scheduler = Scheduler(engine, settings.scheduler, clock=clock, on_step=tally.on_step, drafter=drafter)
    return Replica(scheduler, clock, tally, engine.expect_output, settings.busy_arrival.stall_s)


def simulate_trace(
    trace: Sequence[TraceRequest], settings: SimSettings, label: str, request_rate: float, burstiness: float = 1.0
) -> RunResult:
    replicas = [build_replica(settings, i) for i in range(settings.replicas)]
    params: dict[int, SamplingParams] = {}  # one per distinct max_tokens: they are immutable
    ids = PromptIds()
    leaders = {item.follows for item in trace if item.follows is not None}
    prompts: dict[int, Sequence[int]] = {}  # the prompts of requests that others follow, and what they generated
    answered: dict[int, int] = {}
    lengths: dict[int, int] = {}  # each sent prompt's tokens (a next turn's depends on the answers before it)

    def arrival(index: int, item: TraceRequest) -> Arrival:
        sampling = params.get(item.max_tokens)
        if sampling is None:
            sampling = params[item.max_tokens] = SamplingParams(max_tokens=item.max_tokens, temperature=0.0)

        def make(sink: EventSink) -> SequenceRequest:
            if item.follows is None:  # a range unless it starts with a named prefix: no list of ids to build
                prompt = ids.prompt(index, item.prompt_tokens, item.prefix_id, item.prefix_tokens)
            else:
                prompt = ids.follower(index, item.prompt_tokens, prompts[item.follows], answered[item.follows])
            lengths[index] = len(prompt)
            if index in leaders:
                prompts[index], answered[index] = prompt, 0
                sink = _counting(sink, answered, index)
            return SequenceRequest(f"sim-{index}", prompt, sampling, sink)

        return Arrival(item.arrival_s, make, item.output_tokens, item.follows)

    arrivals = [arrival(i, item) for i, item in enumerate(trace)]
    traces = replay(arrivals, replicas, make_router(settings.router), follow_gap_s=settings.request_overhead_s)
    mode = settings.scheduler.mode.value
    records = tuple(
        _record(i, item, t, mode, _overhead(settings, t), lengths.get(i, item.prompt_tokens), _kind(item, t, leaders))
        for i, (item, t) in enumerate(zip(trace, traces, strict=True))
    )
    start = min((r.arrival_s for r in trace), default=0.0)
    end = max((r.end_time for r in records), default=start)
    return RunResult(
        label=label,
        request_rate=request_rate,
        burstiness=burstiness,
        summary=summarize(records, max(end - start, 1e-9), SLO()),
        server_metrics=_metrics(replicas, records),
        records=records,
    )


def _counting(sink: EventSink, answered: dict[int, int], index: int) -> EventSink:
    """The sink, counting the tokens the request generates into `answered[index]` (its next turn holds them)."""

    def counted(event: RequestEvent) -> None:
        if type(event) is TokenEvent:
            answered[index] += 1
        sink(event)

    return counted


def _kind(item: TraceRequest, trace: RequestTrace, leaders: set[int]) -> str:
    """The replica, and in a trace of conversations the turn as the load generator names it (first or later)."""
    if not leaders:
        return f"replica-{trace.replica}"
    turn = "later-turn" if item.follows is not None else "first-turn"
    return turn if trace.replica == 0 else f"{turn}@replica-{trace.replica}"


def _overhead(settings: SimSettings, trace: RequestTrace) -> float:
    """The request's time outside the steps: more for one that arrived while a step ran."""
    return settings.request_overhead_s + (settings.busy_arrival.outside_s if trace.busy_arrival else 0.0)


def _record(
    index: int, item: TraceRequest, trace: RequestTrace, mode: str, overhead_s: float, prompt_tokens: int, kind: str
) -> RequestRecord:
    """The client's view: every time the scheduler produced, later by the request's time outside the steps."""
    finish = trace.finish
    error = trace.error
    if error is None and finish is None:
        error = "the simulation ended before the request finished"
    if error is None and finish is not None and not finish.outcome.completed:
        error = f"request ended with {finish.outcome.value}: {finish.error}"
    end = (finish.timings.released if finish is not None else trace.arrival) + overhead_s
    tokens = tuple(t + overhead_s for t in trace.token_times)
    return RequestRecord(
        index=index,
        kind=kind,
        max_tokens=item.max_tokens,
        prompt_tokens_est=item.prompt_tokens,
        scheduled_time=trace.arrival,
        send_time=trace.arrival,
        first_token_time=tokens[0] if tokens else None,
        chunk_times=tokens,
        end_time=end,
        output_tokens=len(tokens),
        prompt_tokens=prompt_tokens,
        usage_reported=True,
        server_timings=None if finish is None else timings_json(finish.timings, 1),
        finish_reason=None if finish is None else finish.outcome.value,
        text="",
        error=error,
    )


def _metrics(replicas: Sequence[Replica], records: Sequence[RequestRecord]) -> ScrapedMetrics:
    steps = sum(r.tally.steps for r in replicas)
    seqs = sum(r.tally.seqs for r in replicas)
    ttfts = [r.ttft for r in records if r.ok and r.ttft is not None]
    queues = [
        float(r.server_timings["queue_time_ms"])
        for r in records
        if r.ok and r.server_timings is not None and r.server_timings.get("queue_time_ms") is not None
    ]
    return ScrapedMetrics(
        steps=float(steps),
        mean_batch_size=seqs / steps if steps else None,
        held_seats=float(sum(r.tally.held_seat_steps for r in replicas)),
        prompt_tokens=float(sum(r.tally.prompt_tokens for r in replicas)),
        generation_tokens=float(sum(r.tally.generated for r in replicas)),
        mean_ttft_ms=1e3 * math.fsum(ttfts) / len(ttfts) if ttfts else None,
        mean_queue_ms=math.fsum(queues) / len(queues) if queues else None,
        draft_tokens=float(sum(r.tally.draft_tokens for r in replicas)),
        accepted_tokens=float(sum(r.tally.accepted_tokens for r in replicas)),
    )
