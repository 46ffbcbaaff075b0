"""Static batching with the fake clock: a full batch leaves at once, a partial one only at a tick of the fixed
clock (every batch_window_ms from the start, not from any arrival), and the batch runs and is released as one
unit like the bus."""

from __future__ import annotations

import pytest

from scheduler.config import Mode
from tests.fakes import FakeClock, Harness, assert_complete, assert_drained, build


def static(seats: int = 3, window_ms: float = 5000.0, start: float = 0.0) -> tuple[Harness, FakeClock]:
    clock = FakeClock(start)
    return build(Mode.STATIC, seats=seats, batch_window_ms=window_ms, clock=clock), clock


def test_a_full_batch_leaves_at_once_between_ticks() -> None:
    h, clock = static(seats=2)
    clock.set(1.0)
    a, b = h.submit(), h.submit()
    stats = h.step()
    assert stats is not None and stats.num_seqs == 2 and stats.start == 1.0
    h.run()
    for stream in (a, b):
        assert stream.request is not None and stream.request.batch_id == 1
        assert_complete(stream)
    assert_drained(h)


def test_a_partial_batch_waits_for_the_next_tick_counted_from_the_start_not_from_arrival() -> None:
    h, clock = static(seats=3, window_ms=5000.0, start=100.0)  # ticks at 100, 105, 110, ...
    clock.set(100.1)  # just after a tick: a whole window to wait
    a = h.submit()
    assert h.step() is None
    assert h.scheduler.next_deadline() == pytest.approx(105.0)
    clock.set(104.9)
    b = h.submit()
    assert h.step() is None and h.runner.calls == 0
    clock.set(105.0)
    stats = h.step()
    assert stats is not None and stats.num_seqs == 2 and stats.start == 105.0
    h.run()
    assert a.finish is not None and b.finish is not None
    assert a.finish.timings.queue_time == pytest.approx(4.9)
    assert b.finish.timings.queue_time == pytest.approx(0.1)
    assert_drained(h)


def test_a_request_at_a_tick_with_the_bus_free_leaves_at_that_tick() -> None:
    h, clock = static(seats=3, window_ms=5000.0)
    clock.set(10.0)
    h.submit()
    stats = h.step()
    assert stats is not None and stats.start == 10.0


def test_after_a_batch_the_next_partial_batch_waits_for_the_first_tick_after_the_release() -> None:
    """Every step takes 1 s on the fake clock: a batch of one 4-token request runs steps at 0, 1, 2, 3 and is
    released at 4. A request that arrived meanwhile (at 2) leaves at the tick at 5, not at once at 4."""
    h, clock = static(seats=3, window_ms=5000.0)
    first = h.submit(max_tokens=4)
    h.step()  # t=0 -> 1
    h.step()  # 1 -> 2
    second = h.submit()  # at 2
    h.run(until=lambda: first.finish is not None)
    assert first.finish is not None and clock.now == 4.0
    assert h.step() is None  # free since 4; the next tick is 5
    assert h.scheduler.next_deadline() == pytest.approx(5.0)
    h.run()
    assert second.request is not None and second.request.scheduled == pytest.approx(
        5.0, abs=0.01
    )  # run() steps just past
    assert second.request.batch_id == 2
    assert_complete(first)
    assert_complete(second)
    assert_drained(h)


def test_answers_are_released_together_when_the_last_member_finishes() -> None:
    h, _ = static(seats=2)
    short, long = h.submit(max_tokens=2), h.submit(max_tokens=6)
    h.run()
    assert short.finish is not None and long.finish is not None
    assert short.finish_step == long.finish_step  # the short one was held for the long one
    assert short.finish.timings.held_time > 0.0 and long.finish.timings.held_time == 0.0
    assert_drained(h)
