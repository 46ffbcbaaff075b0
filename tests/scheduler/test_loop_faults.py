"""The engine loop thread cannot wedge: a step that raises is retried promptly with a growing delay (never asleep
for good, never a spin), a policy's deadline cannot kill the thread, and a thread that dies all the same (a
BaseException) ends every request at once, refuses new ones and says why.

Real threads on the real clock, over the fake engine; the asserts are on events and on the timeouts the loop asked
its wake-up event for (recorded), never on how long anything took."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from engine.sample.sampling_params import SamplingParams
from scheduler.config import Mode
from scheduler.core import Scheduler
from scheduler.errors import EngineLoopStoppedError
from scheduler.fair_share import FairShareLoop
from scheduler.loop import MAX_WAIT_S, SchedulerLoop, retry_delay
from scheduler.request import FinishEvent, Outcome, RequestEvent, SequenceRequest, TokenEvent
from scheduler.stats import StepStats
from tests.fakes import RecordingEvent, build, collect, expected_tokens, submit, wait_idle
from tests.scheduler.faulty_policies import MODULE, raising


class Fatal(BaseException):
    """What no `except Exception` catches: the loop thread dies of it."""


def failing_step(
    step: Callable[[], StepStats | None], fails: Callable[[int], bool], error: BaseException
) -> Callable[[], StepStats | None]:
    """`step`, except that its n-th call raises `error` where `fails(n)`."""
    calls = 0

    def wrapped() -> StepStats | None:
        nonlocal calls
        calls += 1
        if fails(calls):
            raise error
        return step()

    return wrapped


def loop_over(scheduler: Scheduler) -> tuple[SchedulerLoop, RecordingEvent]:
    loop = SchedulerLoop(scheduler)
    wake = RecordingEvent()
    loop._wake = wake
    return loop, wake


def run_requests(loop: SchedulerLoop, requests: dict[str, tuple[list[int], int]]) -> dict[str, list[RequestEvent]]:
    async def main() -> dict[str, list[RequestEvent]]:
        streams = {rid: submit(loop, rid, prompt, n) for rid, (prompt, n) in requests.items()}
        results = await asyncio.gather(*(collect(stream) for stream in streams.values()))
        return dict(zip(streams, results, strict=True))

    return asyncio.run(main())


def tokens(events: list[RequestEvent]) -> list[int]:
    return [e.token.token_id for e in events if isinstance(e, TokenEvent)]


def test_a_failing_step_with_work_pending_is_retried_with_a_growing_delay() -> None:
    h = build(Mode.CONTINUOUS, seats=2, clock=time.monotonic)
    h.scheduler.step = failing_step(h.scheduler.step, lambda n: n <= 4, RuntimeError("a bug"))  # type: ignore[method-assign]
    loop, wake = loop_over(h.scheduler)

    async def main() -> list[RequestEvent]:
        stream = submit(loop, "a", [1, 2, 3], 4)  # queued before the thread's first step
        loop.start()
        return await collect(stream)

    try:
        events = asyncio.run(main())
    finally:
        loop.stop()
    assert tokens(events) == expected_tokens([1, 2, 3], 4)
    assert isinstance(events[-1], FinishEvent) and events[-1].outcome is Outcome.LENGTH
    # asleep after each failure only as long as the delay (work was pending), and growing: not a spin, not forever
    assert wake.timeouts[:4] == [retry_delay(1), retry_delay(2), retry_delay(3), retry_delay(4)]
    assert retry_delay(1) == 0.01 and retry_delay(30) == 1.0


@pytest.mark.parametrize("policy", [raising(Mode.DYNAMIC, "next_deadline"), f"{MODULE}:NanDeadline"])
def test_a_policy_whose_deadline_raises_or_is_not_a_time_leaves_the_thread_serving(policy: str) -> None:
    mode = Mode.DYNAMIC if "Dynamic" in policy else Mode.CONTINUOUS
    h = build(mode, seats=4, clock=time.monotonic, policy=policy, batch_timeout_ms=20.0)
    loop, wake = loop_over(h.scheduler)
    loop.start()
    try:
        wait_idle(wake)  # asked for the deadline at least once
        events = run_requests(loop, {"a": ([1, 2], 3), "b": ([3], 2)})  # a partial batch: the timeout sends it
        assert loop.alive
    finally:
        loop.stop()
    assert {rid: tokens(e) for rid, e in events.items()} == {
        "a": expected_tokens([1, 2], 3),
        "b": expected_tokens([3], 2),
    }
    assert h.scheduler.guard.fallbacks == 1


def test_a_deadline_past_what_a_wait_takes_is_capped() -> None:
    h = build(Mode.CONTINUOUS, seats=2, clock=time.monotonic, policy=f"{MODULE}:FarDeadline")
    loop, wake = loop_over(h.scheduler)
    loop.start()
    try:
        wait_idle(wake)
        assert loop.alive and wake.timeouts == [MAX_WAIT_S]  # 1e12 s would have overflowed the wait
        events = run_requests(loop, {"a": ([4, 5], 2)})
    finally:
        loop.stop()
    assert tokens(events["a"]) == expected_tokens([4, 5], 2)
    assert h.scheduler.guard.fallbacks == 0  # a far deadline is legal


def test_a_dead_loop_ends_every_request_at_once_refuses_new_ones_and_says_why() -> None:
    h = build(Mode.CONTINUOUS, seats=1, clock=time.monotonic)
    h.scheduler.step = failing_step(h.scheduler.step, lambda n: n == 3, Fatal("injected"))  # type: ignore[method-assign]
    loop, _ = loop_over(h.scheduler)

    async def main() -> dict[str, list[RequestEvent]]:
        # one seat: "running" runs, the other two wait; the third step kills the thread
        streams = {rid: submit(loop, rid, [1, 2], 50) for rid in ("running", "queued-1", "queued-2")}
        loop.start()
        return dict(zip(streams, await asyncio.gather(*map(collect, streams.values())), strict=True))

    events = asyncio.run(main())
    loop.stop()
    assert not loop.alive
    assert loop.stopped_reason == "the engine loop stopped (Fatal: injected)"
    for rid, stream in events.items():
        finish = stream[-1]
        assert isinstance(finish, FinishEvent) and finish.outcome is Outcome.SHUTDOWN, rid
        assert finish.error == loop.stopped_reason
    assert len(tokens(events["running"])) == 2 and tokens(events["queued-1"]) == []
    with pytest.raises(EngineLoopStoppedError, match="Fatal: injected"):
        loop.submit(SequenceRequest("late", [1], SamplingParams(max_tokens=1), lambda event: None))
    assert not h.scheduler.counts().pending_work  # a drain does not wait for what will never run


def test_a_dead_fair_share_loop_ends_every_modes_requests() -> None:
    harnesses = [build(mode, seats=1, clock=time.monotonic) for mode in (Mode.DYNAMIC, Mode.CONTINUOUS)]
    schedulers = [h.scheduler for h in harnesses]
    schedulers[1].step = failing_step(schedulers[1].step, lambda n: n == 1, Fatal("injected"))  # type: ignore[method-assign]
    fair = FairShareLoop(schedulers)
    loops = [fair.handle(s) for s in schedulers]

    async def main() -> list[list[RequestEvent]]:
        streams = [submit(loop, f"r{i}", [1, 2], 50) for i, loop in enumerate(loops)]
        fair.start()
        return list(await asyncio.gather(*map(collect, streams)))

    results = asyncio.run(main())
    for loop in loops:
        loop.stop()
    assert all(not loop.alive and loop.stopped_reason == "the engine loop stopped (Fatal: injected)" for loop in loops)
    assert all(isinstance(r[-1], FinishEvent) and r[-1].outcome is Outcome.SHUTDOWN for r in results)


def test_a_mode_whose_step_keeps_failing_does_not_stop_the_other() -> None:
    harnesses = [build(mode, seats=1, clock=time.monotonic) for mode in (Mode.DYNAMIC, Mode.CONTINUOUS)]
    schedulers = [h.scheduler for h in harnesses]
    always = failing_step(schedulers[0].step, lambda n: True, RuntimeError("a bug"))
    schedulers[0].step = always  # type: ignore[method-assign]
    fair = FairShareLoop(schedulers)
    wake = RecordingEvent()
    fair.wake = wake
    loops = [fair.handle(s) for s in schedulers]

    async def main() -> list[RequestEvent]:
        submit(loops[0], "stuck", [1, 2], 2)
        stream = submit(loops[1], "served", [3, 4], 3)
        fair.start()
        return await collect(stream)

    events = asyncio.run(main())
    wait_idle(wake)
    for loop in loops:
        loop.stop()
    assert tokens(events) == expected_tokens([3, 4], 3)
    # once the healthy mode is done, the failing one is retried with a growing delay, not in a spin
    finite = [t for t in wake.timeouts if t is not None]
    assert len(finite) == len(wake.timeouts) and all(0 < t <= 1.0 for t in finite)
