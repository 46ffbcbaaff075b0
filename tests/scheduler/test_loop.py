"""The engine loop thread and its hand-off of events to asyncio, over the real Scheduler and Engine with a
ScriptedRunner.

These run on the real monotonic clock (the loop sleeps until a deadline), but assert only counts and
orderings: events arrive, the idle thread blocks instead of spinning, a batch timeout wakes it by itself.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypedDict, Unpack

import pytest

from engine.sample.sampling_params import SamplingParams
from scheduler.config import Mode
from scheduler.loop import SchedulerLoop
from scheduler.request import FinishEvent, Outcome, RequestEvent, SequenceRequest, TokenEvent
from scheduler.stats import StepStats
from tests.fakes import Harness, RecordingEvent, build, collect, expected_tokens, submit, wait_idle


class CountingStep:
    def __init__(self, step: Callable[[], StepStats | None]) -> None:
        self.step = step
        self.calls = 0

    def __call__(self) -> StepStats | None:
        self.calls += 1
        return self.step()


class LoopOptions(TypedDict, total=False):
    """The options of tests.fakes.build that these tests set; the others keep build's defaults."""

    seats: int
    batch_timeout_ms: float


def make_loop(mode: Mode, **config: Unpack[LoopOptions]) -> tuple[Harness, SchedulerLoop, RecordingEvent, CountingStep]:
    h = build(mode, clock=time.monotonic, **config)
    counter = CountingStep(h.scheduler.step)
    h.scheduler.step = counter  # type: ignore[method-assign]
    loop = SchedulerLoop(h.scheduler)
    wake = RecordingEvent()
    loop._wake = wake  # observe the loop's sleeps
    return h, loop, wake, counter


def assert_blocked(wake: RecordingEvent) -> None:
    """The loop thread is inside a wait with no deadline on an event nobody has set: it cannot step until a
    submit or stop sets it (a spinning loop would wait with a timeout, or on an event left set)."""
    assert wake.idle.is_set() and wake.timeouts[-1] is None and not wake.is_set()


@pytest.mark.parametrize("mode", [Mode.DYNAMIC, Mode.CONTINUOUS], ids=lambda m: m.value)
def test_async_consumer_receives_token_events_then_finish_event(mode: Mode) -> None:
    h, loop, _, _ = make_loop(mode, seats=2)
    prompts = {"a": ([1, 2, 3], 5), "b": ([4, 5], 3)}

    async def main() -> dict[str, list[RequestEvent]]:
        streams = {rid: submit(loop, rid, p, n) for rid, (p, n) in prompts.items()}
        results = await asyncio.gather(*(collect(s) for s in streams.values()))
        return dict(zip(streams, results, strict=True))

    loop.start()
    try:
        events = asyncio.run(main())
    finally:
        loop.stop()
    assert not loop.alive
    for rid, (prompt, max_tokens) in prompts.items():
        *tokens, finish = events[rid]
        assert all(isinstance(e, TokenEvent) for e in tokens)
        assert [e.token.token_id for e in tokens if isinstance(e, TokenEvent)] == expected_tokens(prompt, max_tokens)
        assert isinstance(finish, FinishEvent) and finish.outcome is Outcome.LENGTH
        assert finish.timings.mode == mode.value
    assert h.engine.cache_usage == 0 and h.engine.num_free_seats == h.seats


def test_idle_loop_blocks_on_its_event_instead_of_stepping() -> None:
    h, loop, wake, counter = make_loop(Mode.CONTINUOUS, seats=2)
    loop.start()
    try:
        wait_idle(wake)
        assert_blocked(wake)
        assert wake.timeouts == [None]  # after one step that found nothing to do
        assert counter.calls == 1

        async def main() -> list[RequestEvent]:
            return await collect(submit(loop, "a", [1, 2], 3))

        events = asyncio.run(main())
        assert isinstance(events[-1], FinishEvent) and events[-1].outcome is Outcome.LENGTH
        wait_idle(wake)
        assert_blocked(wake)  # idle again, and not stepping
        # 1 idle step, 1 woken by the submit (it may already see the request), 3 steps with tokens, 1 finding
        # nothing left: never more than a handful.
        assert counter.calls <= 7
    finally:
        loop.stop()
    assert not loop.alive
    assert not h.scheduler.has_pending_work()


def test_dynamic_loop_wakes_by_itself_to_dispatch_partial_batch_after_timeout() -> None:
    timeout_ms = 50.0
    h, loop, wake, _ = make_loop(Mode.DYNAMIC, seats=4, batch_timeout_ms=timeout_ms)
    loop.start()
    try:

        async def main() -> list[RequestEvent]:
            # 1 of 4 seats: only the batch timeout can send it.
            return await collect(submit(loop, "alone", [1, 2, 3], 2))

        events = asyncio.run(main())
    finally:
        loop.stop()
    finish = events[-1]
    assert isinstance(finish, FinishEvent) and finish.outcome is Outcome.LENGTH
    assert len(events) == 3
    # Nothing woke the loop after the submit: it slept with the batch deadline as its timeout.
    finite = [t for t in wake.timeouts if t is not None]
    assert finite and all(0 <= t <= timeout_ms / 1000 for t in finite)
    assert finish.timings.scheduled is not None
    assert finish.timings.scheduled - finish.timings.arrival >= timeout_ms / 1000
    assert finish.timings.batch_id == 1
    assert not h.scheduler.has_pending_work()


def test_stop_joins_the_loop_thread() -> None:
    _, loop, wake, counter = make_loop(Mode.CONTINUOUS)
    loop.start()
    assert loop.alive
    wait_idle(wake)
    loop.stop()
    assert not loop.alive
    calls = counter.calls
    loop.submit(SequenceRequest("after", [1], SamplingParams(max_tokens=1), lambda event: None))
    assert counter.calls == calls  # a stopped loop steps no more
