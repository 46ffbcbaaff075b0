"""--scheduling-policy priority (vLLM's semantics) under the real scheduler: the queue runs lower priority values
first, ties by arrival, in every mode; continuous mode preempts the lowest-priority running request (the newest
among equals); fcfs ignores priorities."""

from __future__ import annotations

import pytest

from scheduler.config import Mode
from tests.fakes import assert_complete, assert_drained, build


def first_steps(streams: dict) -> dict[str, int]:
    return {name: stream.token_steps[0] for name, stream in streams.items()}


@pytest.mark.parametrize("mode", [Mode.CONTINUOUS, Mode.DYNAMIC, Mode.STATIC])
def test_waiting_requests_run_by_priority_then_arrival(mode: Mode) -> None:
    h = build(mode, seats=1, scheduling_policy="priority", batch_window_ms=1.0)
    running = h.submit(max_tokens=3, priority=5)
    h.step()  # it holds the one seat
    streams = {
        "late-low": h.submit(max_tokens=2, priority=9),
        "early-mid": h.submit(max_tokens=2, priority=1),
        "urgent": h.submit(max_tokens=2, priority=-3),
        "later-mid": h.submit(max_tokens=2, priority=1),
    }
    h.run()
    steps = first_steps(streams)
    assert sorted(steps, key=steps.__getitem__) == ["urgent", "early-mid", "later-mid", "late-low"]
    for stream in [running, *streams.values()]:
        assert_complete(stream)
    assert_drained(h)


def test_fcfs_ignores_priorities() -> None:
    h = build(Mode.CONTINUOUS, seats=1)
    h.submit(max_tokens=3)
    h.step()
    streams = {"first": h.submit(max_tokens=2, priority=9), "second": h.submit(max_tokens=2, priority=-3)}
    h.run()
    steps = first_steps(streams)
    assert steps["first"] < steps["second"]


def test_continuous_preempts_the_lowest_priority_running_request() -> None:
    """Three requests share a cache that cannot hold them all: the victim is the low-priority one, although a
    high-priority request arrived after it (fcfs would take the newest)."""
    h = build(
        Mode.CONTINUOUS, seats=3, kv_cache_tokens=96, block_size=4, scheduling_policy="priority", max_model_len=96
    )
    low = h.submit(prompt=8, max_tokens=40, priority=10)
    high_old = h.submit(prompt=8, max_tokens=40, priority=0)
    high_new = h.submit(prompt=8, max_tokens=40, priority=0)
    h.run()
    preempted = {
        name: s.finish.timings.num_preemptions
        for name, s in (("low", low), ("high_old", high_old), ("high_new", high_new))
        if s.finish is not None
    }
    assert preempted["low"] >= 1 and preempted["high_old"] == 0 and preempted["high_new"] == 0
    for stream in (low, high_old, high_new):
        assert_complete(stream)
    assert_drained(h)


def test_a_bad_scheduling_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="scheduling_policy"):
        build(Mode.CONTINUOUS, scheduling_policy="shortest-first")
