"""What several simulator test modules share: the step-cost model the tests fit and write, the real and simulated
engines driven through the same scheduler and clock, the request sequences they run, and the check that both made
the same decisions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from benchmarks.sim.cluster import Arrival, Replica, StepTally, make_router, replay
from benchmarks.sim.cost.files import save_fitted
from benchmarks.sim.cost.model import FittedCostModel, StepShape, fit_cost_model
from benchmarks.sim.engine import SimEngine, VirtualClock
from benchmarks.sim.profiling.steps import step_shape
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.model_runner import TransformersRunner
from engine.outputs import StepOutput
from engine.sample.sampling_params import SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.core import Scheduler
from scheduler.request import EventSink, Outcome, RequestEvent, SequenceRequest, TokenEvent
from scheduler.stats import StepStats

COST = FittedCostModel(
    const_s=0.004, per_token_s=0.0005, per_token_over_knee_s=0.002, knee_tokens=8, per_seq_s=0.001,
    per_attention_mpair_s=50.0,
)  # fmt: skip
MODEL_MAX_LEN = 256  # the tiny models' context window


@dataclass(frozen=True)
class Req:
    arrival: float
    prompt: tuple[int, ...]
    max_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    output_tokens: int | None = None  # for the simulated engine: where the real model stopped on its own


class ClockedEngine(Engine):
    """The real engine, whose step also moves the virtual clock by the cost model's time (and is logged)."""

    def __init__(self, runner: TransformersRunner, config: EngineConfig, clock: VirtualClock) -> None:
        super().__init__(runner, config, eos_token_ids=(), model_max_len=MODEL_MAX_LEN)
        self.clock = clock
        self.schedules: list[tuple[tuple[int, int], ...]] = []

    def step(self, schedule: Sequence[tuple[int, int]]) -> StepOutput:
        self.schedules.append(tuple(schedule))
        shape = step_shape(self, schedule)
        output = super().step(schedule)
        self.clock.advance(COST.step_time(shape))
        return output


class LoggedSimEngine(SimEngine):
    def __init__(self, config: EngineConfig, clock: VirtualClock) -> None:
        super().__init__(config, COST, clock, model_max_len=MODEL_MAX_LEN)
        self.schedules: list[tuple[tuple[int, int], ...]] = []

    def step(self, schedule: Sequence[tuple[int, int]]) -> StepOutput:
        self.schedules.append(tuple(schedule))
        return super().step(schedule)


@dataclass
class Run:
    steps: list[tuple[Any, ...]]  # per step: start, running (id, status), waiting ids, held seats, preemptions
    schedules: list[tuple[tuple[int, int], ...]]
    requests: dict[str, tuple[Any, ...]]  # id -> outcome, tokens, timings
    tokens: dict[str, list[int]]  # id -> token ids (real engine only)
    cache: tuple[int, int]  # prompt tokens looked up in the prefix cache and found (vLLM's queries and hits)


def drive(
    engine: ClockedEngine | LoggedSimEngine, clock: VirtualClock, config: SchedulerConfig, reqs: list[Req]
) -> Run:
    steps: list[tuple[Any, ...]] = []
    tally = StepTally()
    holder: list[Scheduler] = []

    def on_step(stats: StepStats) -> None:
        tally.on_step(stats)
        s = holder[0]
        steps.append(
            (
                stats.start,
                stats.duration,
                stats.num_tokens,
                tuple((r.request_id, r.status.value) for r in s.running),
                tuple(r.request_id for r in s.waiting),
                stats.held_seats,
                tuple(r.num_preemptions for r in [*s.running, *s.waiting]),
            )
        )

    scheduler = Scheduler(engine, config, clock=clock, on_step=on_step)
    holder.append(scheduler)
    expect = engine.expect_output if isinstance(engine, SimEngine) else None
    replica = Replica(scheduler, clock, tally, expect)
    tokens: dict[str, list[int]] = {}

    def arrival(i: int, req: Req) -> Arrival:
        params = SamplingParams(max_tokens=req.max_tokens, temperature=0.0, stop_token_ids=req.stop_token_ids)

        def make(sink: EventSink) -> SequenceRequest:
            ids = tokens.setdefault(f"r{i}", [])

            def record(event: RequestEvent) -> None:
                if isinstance(event, TokenEvent):
                    ids.append(event.token.token_id)
                sink(event)

            return SequenceRequest(f"r{i}", list(req.prompt), params, record)

        return Arrival(req.arrival, make, req.output_tokens)

    traces = replay([arrival(i, r) for i, r in enumerate(reqs)], [replica], make_router("round-robin"))
    requests = {}
    for i, trace in enumerate(traces):
        assert trace.finish is not None and trace.error is None
        t = trace.finish.timings
        requests[f"r{i}"] = (
            trace.finish.outcome,
            len(trace.token_times),
            (t.arrival, t.scheduled, t.first_token, t.last_token, t.released, t.num_steps),
            (t.num_preemptions, t.batch_id),
        )
    return Run(steps, engine.schedules, requests, tokens, (engine.blocks.queries, engine.blocks.hits))


def run_real(model: PreTrainedModel, engine_config: EngineConfig, config: SchedulerConfig, reqs: list[Req]) -> Run:
    clock = VirtualClock()
    runner = TransformersRunner(model, prepack_weights=False, native_attention=False)
    with torch.inference_mode():
        return drive(ClockedEngine(runner, engine_config, clock), clock, config, reqs)


def run_sim(engine_config: EngineConfig, config: SchedulerConfig, reqs: list[Req]) -> Run:
    clock = VirtualClock()
    return drive(LoggedSimEngine(engine_config, clock), clock, config, reqs)


def requests(seed: int, count: int, max_prompt: int, max_output: int, spacing_s: float) -> list[Req]:
    generator = torch.Generator().manual_seed(seed)
    reqs = []
    for i in range(count):
        length = int(torch.randint(3, max_prompt + 1, (), generator=generator))
        prompt = tuple(torch.randint(1, 159, (length,), generator=generator).tolist())
        max_tokens = int(torch.randint(2, max_output + 1, (), generator=generator))
        arrival = 0.0 if i < count // 3 else round(spacing_s * i, 3)
        reqs.append(Req(arrival, prompt, max_tokens))
    return reqs


def with_natural_stops(
    model: PreTrainedModel, engine_config: EngineConfig, config: SchedulerConfig, reqs: list[Req]
) -> list[Req]:
    """Every third request stops on the token the model produces third (found by a pilot run without stops):
    the real engine then ends it with STOP before max_tokens."""
    pilot = run_real(model, engine_config, config, reqs)
    out = []
    for i, req in enumerate(reqs):
        produced = pilot.tokens[f"r{i}"]
        if i % 3 == 0 and req.max_tokens > 4 and len(produced) > 3:
            req = Req(req.arrival, req.prompt, req.max_tokens, stop_token_ids=(produced[2],))
        out.append(req)
    return out


def assert_same_decisions(
    model: PreTrainedModel, engine_config: EngineConfig, config: SchedulerConfig, reqs: list[Req]
) -> Run:
    real = run_real(model, engine_config, config, reqs)
    # The simulated engine learns only where the real model stopped on its own: the output length of a STOP.
    replayed = [
        Req(r.arrival, r.prompt, r.max_tokens, r.stop_token_ids, real.requests[f"r{i}"][1])
        if real.requests[f"r{i}"][0] is Outcome.STOPPED
        else r
        for i, r in enumerate(reqs)
    ]
    sim = run_sim(engine_config, config, replayed)
    assert sim.schedules == real.schedules  # the same sequences, token counts and order, step by step
    assert sim.steps == real.steps  # same times, running / waiting / held sets and preemptions after every step
    assert sim.requests == real.requests  # same outcomes, token counts, timings, batches
    assert sim.cache == real.cache  # the same prefix cache lookups and hits
    return real


def write_cost(path: Path) -> Path:
    shapes = [step_shape_of(rows, prefill) for rows in (1, 2, 4, 8, 16) for prefill in (0, 16, 64)]
    save_fitted(fit_cost_model(shapes, [COST.step_time(s) for s in shapes], "test"), path, {})
    return path


def step_shape_of(rows: int, prefill: int) -> Any:
    from benchmarks.sim.cost.model import chunk_attention_pairs

    seqs = rows + (1 if prefill else 0)
    return StepShape(seqs, rows + prefill, seqs, rows * 64 + chunk_attention_pairs(0, prefill), rows * 64 + prefill)
