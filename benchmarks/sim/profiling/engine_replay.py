"""A served run's trace replayed on the engine alone: the real `Scheduler` over the real `Engine`, on the wall
clock, with no HTTP, tokenising or streaming.

Set beside the served run it was exported from (`benchmarks.sim.profiling.served_probe.probe_load`), it splits
what the server adds to the steps: the scheduler's own work between engine steps (here) and what serving adds on top
(the served span minus this one), each measured back to back with the engine it is compared with.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from benchmarks.loadgen.trace import TraceRequest
from engine.engine import Engine
from engine.outputs import StepOutput
from engine.sample.sampling_params import SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.core import Scheduler
from scheduler.request import FinishEvent, Outcome, RequestEvent, SequenceRequest, TokenEvent


@dataclass(frozen=True)
class AloneReplay:
    span_s: float  # first arrival to the last request's finish
    busy_s: float  # inside the scheduler's steps that ran (not its idle waits for arrivals or a batch timeout)
    engine_s: float  # inside Engine.step
    steps: int
    generated_tokens: int  # tokens the replay delivered


def replay_alone(engine: Engine, trace: Sequence[TraceRequest], config: SchedulerConfig, vocab: int) -> AloneReplay:
    """Each request arrives at its `arrival_s` with a random prompt of its length and produces exactly its
    `output_tokens` (or `max_tokens`), greedy, as the served run's answers did. Raises if any request fails: a
    replay that lost requests would be shorter than the run it stands beside."""
    rng = np.random.default_rng(0)
    pending = sorted(trace, key=lambda r: r.arrival_s)
    finished: list[FinishEvent] = []
    engine_s = busy_s = 0.0
    steps = generated = 0
    inner_step = engine.step

    def timed_step(schedule: Sequence[tuple[int, int]]) -> StepOutput:
        nonlocal engine_s, steps
        start = time.perf_counter()
        try:
            return inner_step(schedule)
        finally:
            engine_s += time.perf_counter() - start
            steps += 1

    def sink(event: RequestEvent) -> None:
        nonlocal generated
        if isinstance(event, FinishEvent):
            finished.append(event)
        elif isinstance(event, TokenEvent):
            generated += 1

    scheduler = Scheduler(engine, config, clock=time.perf_counter)
    shadowed = vars(engine).get("step")  # an instance attribute already there (a test's stub) comes back after
    vars(engine)["step"] = timed_step  # shadows the method on this instance for the replay: every step is timed
    start = time.perf_counter()
    next_arrival = 0
    try:
        while len(finished) < len(pending):
            now = time.perf_counter() - start
            while next_arrival < len(pending) and pending[next_arrival].arrival_s <= now:
                item = pending[next_arrival]
                tokens = item.output_tokens or item.max_tokens
                params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
                prompt = rng.integers(100, vocab - 1, item.prompt_tokens).tolist()
                scheduler.submit(SequenceRequest(f"replay-{next_arrival}", prompt, params, sink))
                next_arrival += 1
            step_start = time.perf_counter()
            if scheduler.step() is not None:
                busy_s += time.perf_counter() - step_start
            else:  # idle: sleep to the next arrival or the policy's deadline
                wake = [start + pending[next_arrival].arrival_s] if next_arrival < len(pending) else []
                deadline = scheduler.next_deadline()
                wake += [] if deadline is None else [deadline]
                time.sleep(max(0.0, min(wake, default=time.perf_counter() + 1e-3) - time.perf_counter()))
    finally:
        if shadowed is None:
            vars(engine).pop("step", None)
        else:
            vars(engine)["step"] = shadowed
    span = time.perf_counter() - start - (pending[0].arrival_s if pending else 0.0)
    failed = [e for e in finished if e.outcome not in (Outcome.STOPPED, Outcome.LENGTH)]
    if failed:
        raise RuntimeError(f"{len(failed)} replayed requests ended {failed[0].outcome.value}: {failed[0].error}")
    return AloneReplay(span, busy_s, engine_s, steps, generated)
