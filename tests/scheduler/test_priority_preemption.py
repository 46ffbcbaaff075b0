"""--priority-preemption under the real scheduler and engine, pinned to the fake clock (one step = 1 s).

When every seat is taken, a waiting request whose priority beats the lowest-priority running one's by the threshold
takes that seat in the very next step; the displaced request is preempted (its tokens kept), waits behind it, and
finishes with the tokens it would have produced alone. Memory is not a seat: a waiting request that does not fit the
cache never displaces anyone for it. No block or row outlives its request (`assert_drained`).
"""

from __future__ import annotations

import pytest

from scheduler.config import Mode
from tests.fakes import Harness, assert_complete, assert_drained, build


def preempting(seats: int = 2, threshold: int = 1, **overrides: object) -> Harness:
    return build(
        Mode.CONTINUOUS,
        seats=seats,
        scheduling_policy="priority",
        priority_preemption=True,
        priority_preemption_threshold=threshold,
        **overrides,  # type: ignore[arg-type]
    )


def test_a_better_request_takes_the_newest_low_priority_seat_at_the_next_step() -> None:
    h = preempting()
    old = h.submit(max_tokens=8, priority=10)
    new = h.submit(max_tokens=8, priority=10)  # admitted after `old`: the newest among equals
    h.step()  # step 1: both prefill and take the two seats
    urgent = h.submit(max_tokens=3, priority=0)
    h.run()
    assert urgent.token_steps == [2, 3, 4]  # seated at once, in the step after it came
    assert old.token_steps == list(range(1, 9))  # never displaced
    assert new.token_steps == [1, *range(5, 12)]  # displaced at step 2; recomputed and resumed once the seat was free
    assert new.finish is not None and new.finish.timings.num_preemptions == 1
    assert old.finish is not None and old.finish.timings.num_preemptions == 0
    assert urgent.finish is not None and urgent.finish.timings.priority == 0 and new.finish.timings.priority == 10
    for stream in (old, new, urgent):
        assert_complete(stream)  # the displaced request's tokens are those it gives alone
    assert_drained(h)


def test_without_it_the_better_request_waits_for_a_seat_to_free() -> None:
    h = build(Mode.CONTINUOUS, seats=2, scheduling_policy="priority")
    low = [h.submit(max_tokens=8, priority=10) for _ in range(2)]
    h.step()
    urgent = h.submit(max_tokens=3, priority=0)
    h.run()
    assert urgent.token_steps == [9, 10, 11]  # both low ones ran their 8 steps first
    assert all(s.finish is not None and s.finish.timings.num_preemptions == 0 for s in low)
    assert_drained(h)


def test_the_victim_is_the_lowest_priority_running_request_not_the_newest() -> None:
    h = preempting()
    lowest = h.submit(max_tokens=6, priority=10)
    h.step()
    better = h.submit(max_tokens=6, priority=3)  # newer, but of a better priority
    h.step()
    urgent = h.submit(max_tokens=2, priority=0)
    h.run()
    assert urgent.token_steps == [3, 4]
    assert better.token_steps == list(range(2, 8))
    assert lowest.token_steps == [1, 2, *range(5, 9)]
    assert lowest.finish is not None and lowest.finish.timings.num_preemptions == 1
    assert better.finish is not None and better.finish.timings.num_preemptions == 0
    assert_drained(h)


@pytest.mark.parametrize(("priority", "displaces"), [(5, True), (6, False), (10, False)])
def test_only_a_priority_better_by_the_threshold_displaces(priority: int, displaces: bool) -> None:
    h = preempting(seats=1, threshold=5)
    running = h.submit(max_tokens=5, priority=10)
    h.step()
    waiting = h.submit(max_tokens=2, priority=priority)
    h.run()
    assert waiting.token_steps == ([2, 3] if displaces else [6, 7])
    assert running.finish is not None and running.finish.timings.num_preemptions == int(displaces)
    assert_complete(running)
    assert_drained(h)


def test_a_displaced_request_holds_one_of_the_spare_rows_so_at_most_one_waits_per_seat() -> None:
    """The engine has two rows per seat: a displaced request keeps its row (its tokens) while it waits. With one
    seat, once one request is displaced, the next better one finds no row and waits for the seat, as without
    preemption; nobody is displaced for nothing."""
    h = preempting(seats=1)
    assert h.engine.config.seats == 2
    batch = h.submit(max_tokens=4, priority=10)
    h.step()  # step 1: batch runs
    mid = h.submit(max_tokens=3, priority=5)
    h.step()  # step 2: mid displaces batch, which keeps the second row
    best = h.submit(max_tokens=2, priority=0)
    h.run()
    assert mid.token_steps == [2, 3, 4]
    assert best.token_steps == [5, 6]  # the first free row came with mid's end; it boards ahead of batch
    assert batch.token_steps == [1, 7, 8, 9]
    assert [s.finish.timings.num_preemptions for s in (batch, mid, best) if s.finish] == [1, 0, 0]
    for stream in (batch, mid, best):
        assert_complete(stream)
    assert_drained(h)


def test_a_free_seat_with_a_full_cache_displaces_nobody() -> None:
    """Memory, not the seats, binds: the better request waits at the head until the cache has room; the running
    requests, whose whole lengths fit, are never preempted."""
    h = preempting(seats=3, kv_cache_tokens=24, block_size=4)  # 6 blocks: exactly both low requests' lengths
    low = [h.submit(prompt=4, max_tokens=8, priority=10) for _ in range(2)]
    h.step()
    urgent = h.submit(prompt=12, max_tokens=2, priority=0)  # 3 blocks: never free while both low ones run
    h.run()
    assert urgent.token_steps == [9, 10]
    assert all(s.finish is not None and s.finish.timings.num_preemptions == 0 for s in low)
    assert_drained(h)


@pytest.mark.parametrize(("prompt", "displaces"), [(16, True), (20, False)])
def test_with_the_seats_full_a_request_displaces_only_if_the_victims_cache_makes_room(
    prompt: int, displaces: bool
) -> None:
    h = preempting(seats=2, kv_cache_tokens=24, block_size=4)  # 6 blocks
    low = [h.submit(prompt=4, max_tokens=8, priority=10) for _ in range(2)]
    h.step()  # at step 2 each low request grows to two blocks, leaving two free: a victim frees two more
    urgent = h.submit(prompt=prompt, max_tokens=1, priority=0)  # 4 blocks fit in those; 5 never do
    h.run()
    assert urgent.token_steps == ([2] if displaces else [9])
    assert [s.finish.timings.num_preemptions for s in low if s.finish] == ([0, 1] if displaces else [0, 0])
    for stream in (*low, urgent):
        assert_complete(stream)
    assert_drained(h)


def test_an_aborted_displacer_and_its_victim_leave_nothing_behind() -> None:
    h = preempting(seats=1)
    batch = h.submit(max_tokens=6, priority=10)
    h.step()
    urgent = h.submit(max_tokens=6, priority=0)
    h.step()  # urgent has the seat; batch waits, preempted
    assert urgent.request in h.scheduler.running and batch.request in h.scheduler.waiting
    h.scheduler.abort(urgent.request_id)
    h.run()
    assert urgent.finish is not None and urgent.finish.outcome.value == "abort"
    assert_complete(batch)
    assert_drained(h)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"scheduling_policy": "fcfs"}, "--priority-preemption needs --scheduling-policy priority"),
        ({"mode": Mode.DYNAMIC}, "--priority-preemption needs --mode continuous"),
        ({"mode": Mode.STATIC}, "--priority-preemption needs --mode continuous"),
        ({"priority_preemption_threshold": 0}, "priority_preemption_threshold must be an integer from 1 to"),
    ],
)
def test_it_is_refused_where_it_has_no_meaning(overrides: dict[str, object], message: str) -> None:
    from scheduler.config import SchedulerConfig

    values: dict[str, object] = {"scheduling_policy": "priority", "priority_preemption": True, **overrides}
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**values)  # type: ignore[arg-type]
