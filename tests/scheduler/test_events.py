"""The scheduler's event feed and the fair-share loop, on a real engine with a scripted runner and a fake clock."""

from __future__ import annotations

import pytest

from scheduler.config import Mode
from scheduler.events import LanePhase, PointKind, RequestPoint, SchedulerEvent, Snapshot, StepEvent
from scheduler.fair_share import FairShareLoop
from tests.fakes import FakeClock, Harness, build


def listen(h: Harness) -> list[list[SchedulerEvent]]:
    batches: list[list[SchedulerEvent]] = []
    h.scheduler.events.attach(batches.append)
    h.scheduler.events.enabled = True
    return batches


def hostage(mode: Mode) -> tuple[Harness, list[SchedulerEvent]]:
    h = build(mode, seats=4)
    batches = listen(h)
    h.submit(4, max_tokens=12, request_id="long")
    for name in ("a", "b", "c"):
        h.submit(4, max_tokens=2, request_id=name, ignore_eos=True)
    h.run()
    return h, [event for batch in batches for event in batch]


def points(events: list[SchedulerEvent], request_id: str) -> dict[PointKind, RequestPoint]:
    found = [e for e in events if isinstance(e, RequestPoint) and e.request_id == request_id]
    kinds = [p.kind for p in found]
    assert len(kinds) == len(set(kinds)), kinds  # each point of a life once
    return {p.kind: p for p in found}


def test_dynamic_steps_show_short_answers_held_until_the_long_one_ends() -> None:
    _, events = hostage(Mode.DYNAMIC)
    steps = [e for e in events if isinstance(e, StepEvent)]
    held = {lane.request_id for step in steps for lane in step.lanes if lane.phase is LanePhase.HELD}
    assert held == {"a", "b", "c"}
    assert [lane.phase for lane in steps[0].lanes] == [LanePhase.PREFILL] * 4
    assert sorted(lane.seat for lane in steps[0].lanes) == [0, 1, 2, 3]
    long_end = points(events, "long")[PointKind.FINISHED].time
    for name in ("a", "b", "c"):
        life = points(events, name)
        assert list(life) == [PointKind.QUEUED, PointKind.ADMITTED, PointKind.FIRST_TOKEN, PointKind.FINISHED,
                              PointKind.RELEASED]  # fmt: skip
        assert life[PointKind.FINISHED].time < long_end <= life[PointKind.RELEASED].time
        held_ms = life[PointKind.RELEASED].details["held_ms"]
        assert isinstance(held_ms, float) and held_ms > 0
    assert max(step.held for step in steps) == 3


def test_continuous_steps_hold_nothing_and_short_answers_leave_first() -> None:
    _, events = hostage(Mode.CONTINUOUS)
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert all(lane.phase is not LanePhase.HELD for step in steps for lane in step.lanes)
    assert all(step.held == 0 for step in steps)
    long_end = points(events, "long")[PointKind.FINISHED].time
    for name in ("a", "b", "c"):
        life = points(events, name)
        assert life[PointKind.RELEASED].time < long_end
        assert life[PointKind.FINISHED].details == {"output_tokens": 2, "outcome": "length"}
        assert life[PointKind.RELEASED].details["held_ms"] == 0


class TickingClock(FakeClock):
    """Every reading moves time on, as a busy machine's clock does between two reads in one step."""

    def __call__(self) -> float:
        return self.set(self.now + 1e-4)


def test_a_request_released_as_it_finishes_is_released_at_that_instant() -> None:
    """Continuous batching releases a finished request at once: its release carries the finish's time, so no
    page or metric shows a hold made of two clock reads; the bus's held answers still show theirs."""
    for mode in (Mode.CONTINUOUS, Mode.DYNAMIC):
        h = build(mode, seats=4, clock=TickingClock())
        batches = listen(h)
        h.submit(4, max_tokens=12, request_id="long")
        for name in ("a", "b"):
            h.submit(4, max_tokens=2, request_id=name, ignore_eos=True)
        h.run()
        events = [event for batch in batches for event in batch]
        for name in ("a", "b"):
            life = points(events, name)
            finished, released = life[PointKind.FINISHED].time, life[PointKind.RELEASED].time
            assert finished == released if mode is Mode.CONTINUOUS else finished < released, (mode, name)


def test_step_counts_and_tokens_match_the_step_statistics() -> None:
    h, events = hostage(Mode.CONTINUOUS)
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert [s.step for s in steps] == list(range(1, len(h.stats) + 1))
    assert [(s.tokens, s.prompt_tokens, s.generated) for s in steps] == [
        (st.num_tokens, st.num_prompt_tokens, st.num_generated) for st in h.stats
    ]
    assert [(s.running, s.waiting) for s in steps] == [(st.num_running, st.num_waiting) for st in h.stats]


def test_a_disabled_feed_records_nothing_and_a_snapshot_comes_at_the_next_boundary() -> None:
    h = build(Mode.DYNAMIC, seats=2)
    batches = listen(h)
    h.scheduler.events.enabled = False
    h.submit(4, max_tokens=3)
    h.run()
    assert batches == []
    h.scheduler.events.enabled = True
    h.submit(4, max_tokens=6, request_id="x")
    h.step()
    h.scheduler.request_snapshot()
    h.step()
    snapshots = [e for batch in batches for e in batch if isinstance(e, Snapshot)]
    assert len(snapshots) == 1 and snapshots[0].running == 1
    assert [(lane.seat, lane.request_id, lane.phase) for lane in snapshots[0].lanes] == [(0, "x", LanePhase.DECODE)]


def test_enabling_a_feed_again_mid_step_keeps_what_the_step_recorded() -> None:
    """The hub enables a feed again for each new subscriber, from its own thread, at any point of a step: the
    recorder stays, with what the step recorded so far."""
    h = build(Mode.CONTINUOUS, seats=2)
    batches = listen(h)
    feed = h.scheduler.events

    def enable_again(_: object) -> None:  # after the step ran, before it is recorded and flushed
        feed.enabled = True

    h.scheduler.on_step = enable_again
    h.submit(4, max_tokens=3, request_id="x")
    h.step()
    kinds = [e.kind if isinstance(e, RequestPoint) else type(e) for batch in batches for e in batch]
    assert kinds == [PointKind.QUEUED, PointKind.ADMITTED, PointKind.FIRST_TOKEN, StepEvent]


def test_a_feed_without_a_listener_cannot_be_enabled() -> None:
    feed = build(Mode.CONTINUOUS).scheduler.events
    with pytest.raises(RuntimeError, match="attach a listener"):
        feed.enabled = True
    assert not feed.enabled


def test_a_rejected_submission_is_reported_on_the_submitting_thread() -> None:
    h = build(Mode.CONTINUOUS, seats=1, max_queue=1)
    batches = listen(h)
    h.submit(4, max_tokens=3, request_id="kept")
    try:
        h.submit(4, max_tokens=3, request_id="refused")
    except Exception as exc:
        assert "queue is full" in str(exc)
    rejected = [e for batch in batches for e in batch if isinstance(e, RequestPoint) and e.kind is PointKind.REJECTED]
    assert [(r.request_id, r.details["reason"]) for r in rejected] == [("refused", "queue_full")]


def test_fair_share_gives_two_busy_modes_equal_time_whatever_their_step_cost() -> None:
    clock = FakeClock()
    cheap = build(Mode.CONTINUOUS, clock=clock, step_time=1.0, seats=2)
    dear = build(Mode.DYNAMIC, clock=clock, step_time=3.0, seats=2)
    for h in (cheap, dear):
        for _ in range(8):
            h.submit(4, max_tokens=40, ignore_eos=True)
    loop = FairShareLoop([cheap.scheduler, dear.scheduler], clock=clock)
    for _ in range(80):
        assert loop._step_one()
    busy_cheap, busy_dear = loop.busy_seconds(cheap.scheduler), loop.busy_seconds(dear.scheduler)
    assert abs(busy_cheap - busy_dear) <= 3.0  # within one step of each other
    assert 2.5 <= (busy_cheap / 1.0) / (busy_dear / 3.0) <= 3.5  # equal time, not equal steps: 3 cheap per dear one


def test_fair_share_does_not_owe_an_idle_mode_the_time_it_did_not_use() -> None:
    clock = FakeClock()
    busy = build(Mode.CONTINUOUS, clock=clock, seats=2)
    late = build(Mode.CONTINUOUS, clock=clock, seats=2)
    for _ in range(4):
        busy.submit(4, max_tokens=60, ignore_eos=True)
    loop = FairShareLoop([busy.scheduler, late.scheduler], clock=clock)
    for _ in range(30):
        assert loop._step_one()
    assert loop.busy_seconds(late.scheduler) == 0.0
    late.submit(4, max_tokens=60, ignore_eos=True)
    before = loop.busy_seconds(busy.scheduler)
    for _ in range(10):
        assert loop._step_one()
    # They alternate from the moment it joins: the latecomer did not get 30 steps in a row, nor wait for the other.
    assert loop.busy_seconds(busy.scheduler) - before >= 4.0
    assert sum(len(stream.tokens) for stream in late.streams.values()) >= 4  # its own steps, not only a raised total


def test_fair_share_steps_every_mode_whose_work_arrives_at_once() -> None:
    """Three idle modes given work at the same moment (the page's workload) take turns from the first step."""
    clock = FakeClock()
    modes = [build(mode, clock=clock, seats=2) for mode in (Mode.STATIC, Mode.DYNAMIC, Mode.CONTINUOUS)]
    loop = FairShareLoop([h.scheduler for h in modes], clock=clock)
    for h in modes:
        for _ in range(2):
            h.submit(4, max_tokens=40, ignore_eos=True)
    for _ in range(9):
        assert loop._step_one()
    generated = [sum(len(stream.tokens) for stream in h.streams.values()) for h in modes]
    assert all(count >= 4 for count in generated), generated  # each ran at least 2 of the 9 steps, 2 seats each
