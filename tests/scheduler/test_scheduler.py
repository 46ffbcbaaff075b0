"""Scheduler policy tests: the real Scheduler and Engine (block accounting, sampler) over a ScriptedRunner.

Time is a FakeClock that each forward advances by 1 s, so a timestamp is a step count and every length and
timing below is exact. Nothing sleeps. The last test checks the same properties on a tiny random Llama:
greedy tokens are identical in both modes and equal to `generate()`.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from transformers import GenerationMixin, PreTrainedModel

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import CacheCapacityError, EngineInputError
from engine.model.model_runner import TransformersRunner
from engine.sample.sampling_params import SamplingParams
from scheduler.config import Mode, SchedulerConfig
from scheduler.core import Scheduler
from scheduler.errors import QueueFullError, SchedulerClosedError
from scheduler.request import Outcome, RequestStatus, SequenceRequest
from tests.fakes import (
    FakeClock,
    Harness,
    ScriptedRunner,
    Stream,
    assert_complete,
    assert_drained,
    build,
    expected_tokens,
    step_until_done,
)

MODES = [Mode.DYNAMIC, Mode.CONTINUOUS]


# ===== dynamic (request-level) batching =====
def test_dynamic_batch_leaves_when_max_batch_size_requests_wait_before_timeout() -> None:
    h = build(Mode.DYNAMIC, seats=3, batch_timeout_ms=1000)
    a, b = h.submit(), h.submit()
    assert h.step() is None  # two of three seats taken, nobody waited 1 s
    c = h.submit()
    stats = h.step()
    assert stats is not None and stats.num_seqs == 3 and stats.start == 0.0
    for s in (a, b, c):
        assert s.request is not None and s.request.batch_id == 1 and s.request.scheduled == 0.0
    h.run()
    for s in (a, b, c):
        assert_complete(s)
    assert_drained(h)


def test_dynamic_partial_batch_leaves_once_oldest_waited_batch_timeout() -> None:
    h = build(Mode.DYNAMIC, seats=4, batch_timeout_ms=100)
    clock = h.clock
    assert isinstance(clock, FakeClock)  # build's default
    a = h.submit()
    clock.set(0.05)
    b = h.submit()
    clock.set(0.0999)
    assert h.step() is None
    assert h.scheduler.next_deadline() == pytest.approx(0.1)  # the oldest one's timeout
    assert h.runner.calls == 0 and len(h.scheduler.waiting) == 2
    clock.set(0.1)
    stats = h.step()
    assert stats is not None and stats.num_seqs == 2
    assert a.request is not None and a.request.scheduled == 0.1
    h.run()
    assert a.finish is not None and b.finish is not None
    assert a.finish.timings.queue_time == pytest.approx(0.1)
    assert b.finish.timings.queue_time == pytest.approx(0.05)
    assert_complete(a)
    assert_complete(b)
    assert_drained(h)


def test_dynamic_zero_timeout_batch_leaves_at_once() -> None:
    h = build(Mode.DYNAMIC, seats=4, batch_timeout_ms=0)
    a = h.submit()
    stats = h.step()
    assert stats is not None and stats.num_seqs == 1
    h.run()
    assert a.finish is not None and a.finish.timings.queue_time == 0.0
    assert_complete(a)
    assert_drained(h)


def test_dynamic_request_arriving_while_batch_runs_waits_for_next_batch() -> None:
    h = build(Mode.DYNAMIC, seats=2)
    a = h.submit(max_tokens=3)
    h.step()
    late = h.submit(max_tokens=2)  # a seat is free, but the bus has left
    h.step()
    assert late.request is not None and late.request.status is RequestStatus.WAITING
    assert h.stats[-1].num_seqs == 1
    h.run()
    assert a.finish is not None and late.finish is not None
    assert a.finish.timings.batch_id == 1 and late.finish.timings.batch_id == 2
    assert late.finish.timings.scheduled is not None
    assert late.finish.timings.scheduled >= a.finish.timings.released
    assert a.finish_step is not None and late.token_steps[0] == a.finish_step + 1
    assert_complete(a)
    assert_complete(late)
    assert_drained(h)


def test_dynamic_short_request_is_held_until_its_batch_ends_but_streams_tokens() -> None:
    h = build(Mode.DYNAMIC, seats=2)
    short, long = h.submit(max_tokens=2), h.submit(max_tokens=5)
    h.run()
    assert short.token_steps == [1, 2]  # tokens arrive as generated...
    assert long.token_steps == [1, 2, 3, 4, 5]
    assert short.finish_step == long.finish_step == 5  # ...the completion only when the batch ends
    assert short.finish is not None and long.finish is not None
    assert short.finish.timings.released == long.finish.timings.released == 5.0
    assert short.finish.timings.last_token == 2.0
    assert short.finish.timings.held_time == 3.0
    assert long.finish.timings.held_time == 0.0
    assert_complete(short)
    assert_complete(long)
    assert_drained(h)


def test_dynamic_held_seats_counts_finished_but_held_members() -> None:
    h = build(Mode.DYNAMIC, seats=3)
    for n in (1, 3, 5):
        h.submit(max_tokens=n)
    h.run()
    assert [s.held_seats for s in h.stats] == [1, 1, 2, 2, 0]
    assert [s.num_seqs for s in h.stats] == [3, 2, 2, 1, 1]  # finished members are not computed
    assert [s.num_running for s in h.stats] == [3, 3, 3, 3, 0]  # but keep their seats
    for s in h.streams.values():
        assert_complete(s)
    assert_drained(h)


@pytest.mark.parametrize("why", ["full", "timed_out"])
def test_dynamic_next_batch_leaves_as_soon_as_running_one_ends(why: str) -> None:
    # "full": two requests fill the next bus; "timed_out": one waits past a 100 ms timeout (a step takes 1 s).
    h = build(Mode.DYNAMIC, seats=2, batch_timeout_ms=10**7 if why == "full" else 100)
    first = [h.submit(max_tokens=3), h.submit(max_tokens=3)]
    h.step()
    second = [h.submit(max_tokens=2) for _ in range(2 if why == "full" else 1)]
    h.run()
    assert all(f.finish_step == 3 for f in first)
    for s in second:
        assert s.finish is not None and first[0].finish is not None
        assert s.finish.timings.scheduled == 3.0 == first[0].finish.timings.released
        assert s.token_steps[0] == 4
    assert len(h.stats) == h.step_count == 5  # no idle step in between
    for s in h.streams.values():
        assert_complete(s)
    assert_drained(h)


def test_dynamic_reserves_kv_for_the_whole_batch_up_front() -> None:
    h = build(Mode.DYNAMIC, seats=2, kv_cache_tokens=1024, block_size=4)
    a = h.submit(prompt=5, max_tokens=10)  # 15 tokens: 4 blocks
    b = h.submit(prompt=3, max_tokens=20)  # 23 tokens: 6 blocks
    first = h.step()
    assert first is not None and first.cache_usage == 10 / 256
    assert h.engine.reserved_tokens(a.seq_id) == 16 and h.engine.reserved_tokens(b.seq_id) == 24
    h.run()
    assert [s.cache_usage for s in h.stats[:-1]] == [10 / 256] * 19  # never grows, kept while a is held
    assert h.stats[-1].cache_usage == 0
    assert_complete(a)
    assert_complete(b)
    assert_drained(h)


def test_dynamic_batch_boards_only_what_the_cache_holds_and_the_rest_wait_in_order() -> None:
    h = build(Mode.DYNAMIC, seats=3, kv_cache_tokens=32, block_size=4)  # 8 blocks
    streams = [h.submit(prompt=4, max_tokens=8) for _ in range(3)]  # 3 blocks each
    h.run()
    assert [s.finish.timings.batch_id for s in streams if s.finish] == [1, 1, 2]
    assert streams[0].finish_step is not None and streams[2].token_steps[0] == streams[0].finish_step + 1
    for s in streams:
        assert_complete(s)
    assert_drained(h)


def test_dynamic_failed_step_releases_held_member_with_its_own_reason() -> None:
    h = build(Mode.DYNAMIC, seats=2, runner=ScriptedRunner(fail_on_calls={2}))
    short, long = h.submit(max_tokens=1), h.submit(max_tokens=5)
    h.step()
    assert h.stats[-1].held_seats == 1
    stats = h.step()
    assert stats is not None and stats.failed and stats.num_seqs == 1
    assert long.reason is Outcome.FAILED and long.finish is not None and long.finish.error
    assert len(long.tokens) == 1
    assert short.finish_step == 2
    assert_complete(short)  # it was not in the failed step
    assert_drained(h)


# ===== continuous (iteration-level) batching =====
def test_continuous_waiting_request_admitted_on_step_right_after_seat_frees() -> None:
    h = build(Mode.CONTINUOUS, seats=1)
    a, b = h.submit(max_tokens=3), h.submit(max_tokens=2)
    h.run()
    assert a.finish_step == 3
    assert b.token_steps == [4, 5]
    assert a.finish is not None and b.finish is not None
    assert b.finish.timings.scheduled == a.finish.timings.released == 3.0
    assert [s.num_waiting for s in h.stats] == [1, 1, 1, 0, 0]  # b is admitted in step 4
    assert_complete(a)
    assert_complete(b)
    assert_drained(h)


def test_continuous_short_request_finishes_before_long_one_it_started_with() -> None:
    h = build(Mode.CONTINUOUS, seats=2)
    short, long = h.submit(max_tokens=2), h.submit(max_tokens=6)
    h.run()
    assert short.finish_step == 2 and long.finish_step == 6
    assert short.finish is not None and long.finish is not None
    assert short.finish.timings.released == 2.0 < long.finish.timings.released == 6.0
    assert short.finish.timings.held_time == 0.0
    assert_complete(short)
    assert_complete(long)
    assert_drained(h)


def test_continuous_token_budget_caps_every_step_and_long_prompt_is_chunked_beside_decodes() -> None:
    budget = 8
    h = build(Mode.CONTINUOUS, seats=4, max_num_batched_tokens=budget)
    decoders = [h.submit(prompt=2, max_tokens=12), h.submit(prompt=2, max_tokens=12)]
    h.step()
    h.step()
    long = h.submit(prompt=40, max_tokens=3)
    h.run()
    assert all(b.num_tokens <= budget for b in h.runner.batches)
    # Steps 3..8 carry 2 decode tokens and a 6-token chunk; step 9 the last 4 prompt tokens and a sample.
    assert [b.num_tokens for b in h.runner.batches[2:9]] == [8] * 6 + [6]
    assert [b.num_samples for b in h.runner.batches[2:9]] == [2] * 6 + [3]
    assert long.token_steps == [9, 10, 11]
    assert long.request is not None and long.request.num_steps == 9
    for d in decoders:
        assert d.token_steps == list(range(1, 13))  # a token every step: the decode gap is one step
        assert_complete(d)
    assert_complete(long)
    assert_drained(h)


def test_continuous_token_budget_caps_every_step_under_mixed_load() -> None:
    budget = 8
    h = build(Mode.CONTINUOUS, seats=4, max_num_batched_tokens=budget, kv_cache_tokens=96)
    for k in range(14):
        h.submit(prompt=1 + (k * 11) % 30, max_tokens=1 + (k * 5) % 9)
        h.step()
    h.run()
    assert max(b.num_tokens for b in h.runner.batches) == budget
    assert all(s.num_tokens <= budget for s in h.stats)
    assert sum(b.num_tokens for b in h.runner.batches) == sum(s.num_tokens for s in h.stats)
    for s in h.streams.values():
        assert_complete(s)
    assert_drained(h)


def test_continuous_preemption_loses_nothing_and_starves_nobody() -> None:
    def workload(kv_cache_tokens: int) -> Harness:
        h = build(Mode.CONTINUOUS, seats=4, kv_cache_tokens=kv_cache_tokens, block_size=4)
        for k in range(4):
            h.submit(prompt=6 + k, max_tokens=14)  # 20..23 tokens: 5-6 blocks each
        h.run()
        return h

    roomy, tight = workload(1024), workload(40)  # 10 blocks cannot hold the four of them
    assert all(s.finish and s.finish.timings.num_preemptions == 0 for s in roomy.streams.values())
    assert sum(s.finish.timings.num_preemptions for s in tight.streams.values() if s.finish) > 0
    for rid, s in tight.streams.items():
        assert_complete(s)
        assert s.tokens == roomy.streams[rid].tokens
    assert_drained(tight)
    assert_drained(roomy)


def test_continuous_request_that_does_not_fit_waits_outside_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The admission check comes before `add`: a fresh request the cache cannot hold yet is not added (nor its
    grammar matcher built) and removed again on every step it waits, but added once, when it fits."""
    h = build(Mode.CONTINUOUS, seats=2, kv_cache_tokens=64)  # 16 blocks of 4
    added: list[int] = []
    add = h.engine.add

    def counted_add(seq_id: int, *rest: Any) -> None:
        added.append(seq_id)
        add(seq_id, *rest)

    monkeypatch.setattr(h.engine, "add", counted_add)
    first = h.submit(prompt=40, max_tokens=20)  # 10 blocks at once, growing to 15
    h.scheduler.step()
    second = h.submit(prompt=40, max_tokens=4)  # 10 blocks: waits until the first is done
    h.run()
    assert_complete(first)
    assert_complete(second)
    assert added == [first.seq_id, second.seq_id]
    assert second.finish is not None and second.finish.timings.num_preemptions == 0
    assert_drained(h)


def test_continuous_preempted_request_is_resumed_before_younger_waiting_ones() -> None:
    h = build(Mode.CONTINUOUS, seats=3, kv_cache_tokens=40, block_size=4)
    streams = [h.submit(prompt=6, max_tokens=14) for _ in range(4)]
    h.run(until=lambda: any(r.num_preemptions for r in h.scheduler.waiting))
    # The victim goes back to the head of the queue, ahead of the younger request that waited all along.
    assert [r.request_id for r in h.scheduler.waiting] == [streams[2].request_id, streams[3].request_id]
    h.run()
    starts = [s.finish.timings.scheduled for s in streams if s.finish]
    assert None not in starts and starts == sorted(t for t in starts if t is not None)
    # 10 blocks cannot hold three 5-block sequences: the newest running one was preempted while the fourth waited.
    preempted = [s for s in streams if s.finish and s.finish.timings.num_preemptions > 0]
    assert [s.request_id for s in preempted] == [streams[2].request_id]
    steps, younger = preempted[0].token_steps, streams[3]
    resumed_at = next(b for a, b in itertools.pairwise(steps) if b > a + 1)  # its first token after the pause
    assert resumed_at <= younger.token_steps[0]  # back no later than the younger request's first token
    for s in streams:
        assert_complete(s)
    assert_drained(h)


@pytest.mark.parametrize("caching", [False, True], ids=["no-prefix-caching", "prefix-caching"])
def test_continuous_preemption_does_not_thrash_a_long_request_in_a_tight_cache(caching: bool) -> None:
    """The probe's case: a 521-token request next to two 320-token ones in a 1024-token cache. Resumed with only
    its next chunk reserved, the long one was preempted again each time an older one needed a block (17 times,
    recomputing its whole context each time: 9,837 tokens computed for 1,158 of work). Now a request is
    preempted at most once and the recomputation is bounded by one context per request."""
    h = build(
        Mode.CONTINUOUS,
        seats=8,
        kv_cache_tokens=1024,
        block_size=16,
        max_model_len=1024,
        max_num_batched_tokens=512,
        enable_prefix_caching=caching,  # with it, the preempted request finds what is left of its own blocks
    )
    streams = [h.submit(prompt=120, max_tokens=200) for _ in range(2)]
    streams.append(h.submit(prompt=400, max_tokens=121))
    h.run()
    preemptions = [s.finish.timings.num_preemptions for s in streams if s.finish]
    assert sum(preemptions) >= 1  # the cache is too small for all three: the guard is exercised
    assert max(preemptions) <= 1
    work = sum(len(s.prompt) + s.max_tokens - 1 for s in streams)  # every token computed once
    recomputed = sum(b.num_tokens for b in h.runner.batches) - work
    preempted_lengths = [len(s.prompt) + s.max_tokens for s in streams if s.finish and s.finish.timings.num_preemptions]
    assert (0 if caching else 1) <= recomputed <= sum(preempted_lengths)
    for s in streams:
        assert_complete(s)
    assert_drained(h)


# ===== both modes =====
@pytest.mark.parametrize("mode", MODES)
def test_drain_fails_queued_requests_releases_held_answers_and_shutdown_ends_the_rest(mode: Mode) -> None:
    h = build(mode, seats=2)
    short, long = h.submit(max_tokens=2), h.submit(max_tokens=50)
    queued = h.submit(max_tokens=4)  # no seat for it
    h.run(until=lambda: len(short.tokens) == 2)
    assert short.done is (mode is Mode.CONTINUOUS)  # dynamic mode holds the finished answer for its batch
    assert queued.request is not None and queued.request.scheduled is None

    h.scheduler.begin_drain()
    with pytest.raises(SchedulerClosedError, match="shutting down"):
        h.submit()
    h.step()
    assert queued.reason is Outcome.SHUTDOWN and queued.tokens == []
    assert queued.finish is not None and queued.finish.error
    assert_complete(short)  # released at once: no batch will ever need it again
    assert long.request is not None and long.request.status is RequestStatus.RUNNING  # running ones go on
    h.run(until=lambda: len(long.tokens) >= 6)
    assert not long.done

    h.scheduler.shutdown()  # the grace period is over
    h.step()
    assert long.reason is Outcome.SHUTDOWN and 6 <= len(long.tokens) < 50
    assert long.finish is not None and long.finish.error
    assert long.tokens == expected_tokens(long.prompt, 50)[: len(long.tokens)]
    assert_drained(h)


ABORT_CASES = [
    (Mode.DYNAMIC, "waiting"),
    (Mode.DYNAMIC, "mid_batch"),
    (Mode.CONTINUOUS, "waiting"),
    (Mode.CONTINUOUS, "mid_batch"),
    (Mode.CONTINUOUS, "mid_prefill"),
]


@pytest.mark.parametrize(("mode", "where"), ABORT_CASES, ids=[f"{m.value}-{w}" for m, w in ABORT_CASES])
def test_abort_frees_seat_and_cache_within_one_step(mode: Mode, where: str) -> None:
    h = build(mode, seats=2, max_num_batched_tokens=4, block_size=4)
    other = h.submit(prompt=2, max_tokens=10)
    if where == "waiting":
        h.submit(prompt=2, max_tokens=10)  # fills the second seat
        victim = h.submit(prompt=3, max_tokens=4)
        h.step()
        assert victim.request is not None and victim.request.status is RequestStatus.WAITING
    elif where == "mid_batch":
        victim = h.submit(prompt=2, max_tokens=10)
        h.step()
        h.step()
        assert len(victim.tokens) == 2
    else:
        victim = h.submit(prompt=20, max_tokens=4)  # 2 + 18 tokens over the first steps at 4 a step
        h.step()
        h.step()
        assert victim.request is not None and 0 < h.engine.num_computed(victim.seq_id) < 20
        assert victim.tokens == []
    tokens_before = list(victim.tokens)
    h.scheduler.abort(victim.request_id)
    h.step()
    assert victim.reason is Outcome.ABORTED and victim.finish_step == h.step_count
    assert victim.tokens == tokens_before
    assert not h.engine.has_sequence(victim.seq_id)
    live = [s for s in h.streams.values() if not s.done]
    assert h.engine.num_free_rows == h.seats - len(live)
    used = sum(h.engine.reserved_tokens(s.seq_id) // h.engine.block_size for s in live)
    assert h.engine.blocks.pool.num_used == used
    if where == "waiting":
        assert victim.finish is not None and victim.finish.timings.scheduled is None
        assert h.scheduler.num_queued == 0
    h.run()
    assert_complete(other)
    assert_drained(h)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_stop_request_finishes_with_stop(mode: Mode) -> None:
    h = build(mode, seats=2)
    running, other = h.submit(max_tokens=10), h.submit(max_tokens=3)
    waiting = h.submit(max_tokens=3)
    h.step()
    h.step()
    h.scheduler.stop_request(running.request_id)
    h.scheduler.stop_request(waiting.request_id)
    h.run()
    assert running.reason is Outcome.STOPPED and len(running.tokens) == 2
    assert running.tokens == expected_tokens(running.prompt, 2)
    assert waiting.reason is Outcome.STOPPED and waiting.tokens == []
    assert_complete(other)
    assert_drained(h)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_full_queue_raises_queue_full_at_submit(mode: Mode) -> None:
    h = build(mode, seats=1, max_queue=2)
    h.submit(max_tokens=2)
    h.submit(max_tokens=2)
    with pytest.raises(QueueFullError, match=r"queue is full \(2 requests\)"):
        h.submit(request_id="refused")
    assert h.scheduler.num_queued == 2 and "refused" not in h.streams
    h.step()  # the first one is scheduled: a queue place frees
    assert h.scheduler.num_queued == 1
    h.submit(max_tokens=2)
    with pytest.raises(QueueFullError, match=r"queue is full \(2 requests\)"):
        h.submit(request_id="refused")
    h.run()
    assert len(h.streams) == 3
    for s in h.streams.values():
        assert_complete(s)
    assert_drained(h)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_fifo_arrival_order_and_no_starvation_under_stream_of_arrivals(mode: Mode) -> None:
    h = build(mode, seats=2, max_num_batched_tokens=8, kv_cache_tokens=64, block_size=4)
    big = h.submit(prompt=20, max_tokens=12)
    for k in range(16):  # a new arrival every step
        h.submit(prompt=1 + (k * 7) % 13, max_tokens=1 + (k * 5) % 7)
        h.step()
    h.run()
    streams = list(h.streams.values())
    starts = [s.finish.timings.scheduled for s in streams if s.finish]
    assert len(starts) == len(streams) and None not in starts
    assert starts == sorted(t for t in starts if t is not None)  # scheduled in arrival order
    if mode is Mode.DYNAMIC:
        batches = [s.finish.timings.batch_id for s in streams if s.finish]
        assert None not in batches and batches == sorted(b for b in batches if b is not None)
    assert_complete(big)  # nobody starved
    for s in streams:
        assert_complete(s)
    assert_drained(h)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_queue_order_is_arrival_order_even_when_submitted_out_of_order(mode: Mode) -> None:
    """The API stamps arrival before tokenising on a thread pool, so submissions can come out of order."""
    h = build(mode, seats=1, batch_timeout_ms=0, clock=FakeClock(10.0))
    late = h.submit(request_id="late", arrival=9.0)  # submitted first, arrived last
    first = h.submit(request_id="first", arrival=3.0)
    second = h.submit(request_id="second", arrival=5.0)
    h.step()
    assert [r.request_id for r in h.scheduler.running] == ["first"]
    assert [r.request_id for r in h.scheduler.waiting] == ["second", "late"]
    h.run()
    starts = [s.finish.timings.scheduled for s in (first, second, late) if s.finish]
    assert len(starts) == 3 and starts == sorted(starts)  # type: ignore[type-var]
    assert first.finish is not None and first.finish.timings.arrival == 3.0
    for s in (first, second, late):
        assert_complete(s)
    assert_drained(h)


def test_an_early_arrival_submitted_late_does_not_pass_a_preempted_request() -> None:
    h = build(Mode.CONTINUOUS, seats=1, clock=FakeClock(10.0))
    preempted = h.submit(request_id="preempted", arrival=5.0)
    h.scheduler.inbox.apply(h.clock())
    assert preempted.request is not None
    preempted.request.num_preemptions = 1  # as if it had run and been pushed back to the head
    h.submit(request_id="early", arrival=1.0)
    h.submit(request_id="later", arrival=7.0)
    h.scheduler.inbox.apply(h.clock())
    assert [r.request_id for r in h.scheduler.waiting] == ["preempted", "early", "later"]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_queue_and_batch_timeouts_count_from_entering_the_queue_not_from_arrival(mode: Mode) -> None:
    """Time spent before the scheduler (reading the body, tokenising) must not expire a request or rush a bus."""
    h = build(mode, seats=2, queue_timeout_s=5.0, batch_timeout_ms=3000, clock=FakeClock(100.0))
    first = h.submit(max_tokens=3, arrival=10.0)  # arrived 90 s ago, by its stamp
    assert h.step() is None or mode is Mode.CONTINUOUS  # dynamic: a lone request waits for the batch timeout
    h.run()
    assert_complete(first)
    assert first.finish is not None and first.finish.timings.arrival == 10.0
    assert first.finish.timings.queue_time >= 90.0  # latencies still count from arrival
    assert_drained(h)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_queue_timeout_expires_waiting_request_with_error(mode: Mode) -> None:
    h = build(mode, seats=1, queue_timeout_s=5.0)
    busy = h.submit(max_tokens=20)
    late = h.submit(max_tokens=2)  # arrives at 0.0; each step takes 1 s
    for _ in range(6):  # step 6 starts at 5.0: waited exactly the limit, not longer
        h.step()
    assert not late.done
    h.step()
    assert late.reason is Outcome.QUEUE_TIMEOUT and late.finish_step == 7
    assert late.finish is not None and late.finish.error and "queue" in late.finish.error
    assert late.finish.timings.scheduled is None and late.tokens == []
    assert late.finish.timings.queue_time == 6.0
    assert h.scheduler.num_queued == 0
    h.run()
    assert_complete(busy)
    assert_drained(h)


BAD_INPUTS = {
    "empty_prompt": dict(prompt=[], max_tokens=4),
    "too_long": dict(prompt=250, max_tokens=10),  # max_model_len 256
    "out_of_vocab": dict(prompt=[1, 2, 64], max_tokens=4),
    "bigger_than_cache": dict(prompt=30, max_tokens=10),  # the cache holds 32 tokens
}
BAD_INPUT_MESSAGES = {
    "empty_prompt": "prompt is empty",
    "too_long": "maximum context length is 256 tokens",
    "out_of_vocab": "token id 64 is outside the vocabulary",
    "bigger_than_cache": "holds 32 tokens",
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_bad_input_raises_at_submit_and_queues_nothing(mode: Mode, case: str) -> None:
    h = build(mode, seats=2, kv_cache_tokens=32 if case == "bigger_than_cache" else 1024)
    expected = CacheCapacityError if case == "bigger_than_cache" else EngineInputError
    with pytest.raises(expected, match=BAD_INPUT_MESSAGES[case]):
        h.submit(**BAD_INPUTS[case])  # type: ignore[arg-type]
    assert h.scheduler.num_queued == 0 and not h.scheduler.has_pending_work()
    assert h.step() is None and h.runner.calls == 0
    good = h.submit(max_tokens=2)
    h.run()
    assert_complete(good)
    assert_drained(h)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_failed_forward_step_fails_only_its_requests_and_next_are_served(mode: Mode) -> None:
    h = build(mode, seats=2, runner=ScriptedRunner(fail_on_calls={2}))
    a, b = h.submit(max_tokens=4), h.submit(max_tokens=4)
    c = h.submit(max_tokens=3)  # waits: both seats are taken
    h.step()
    stats = h.step()
    assert stats is not None and stats.failed and stats.num_seqs == 2
    for s in (a, b):
        assert s.reason is Outcome.FAILED and s.finish_step == 2 and len(s.tokens) == 1
        assert s.finish is not None and s.finish.error and "InjectedFault" in s.finish.error
    assert not c.done
    assert h.engine.num_free_rows == 2 and h.engine.cache_usage == 0
    h.run()
    assert c.token_steps[0] == 3
    assert_complete(c)
    late = h.submit(max_tokens=2)
    h.run()
    assert_complete(late)
    assert_drained(h)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_everything_released_and_engine_drained_after_mixed_workload(mode: Mode) -> None:
    runner = ScriptedRunner(eos_positions={43})  # only the 40-token prompt reaches position 43
    h = build(mode, seats=3, max_num_batched_tokens=16, kv_cache_tokens=96, runner=runner)
    eos = h.submit(prompt=40, max_tokens=8)
    plain = [h.submit(prompt=3 + k, max_tokens=2 + k) for k in range(4)]
    stop_prompt = [5, 6, 7]
    unstopped = expected_tokens(stop_prompt, 6)
    stopped = h.submit(prompt=stop_prompt, max_tokens=6, stop_token_ids=(unstopped[2],))
    aborted = h.submit(max_tokens=30)
    stopped_by_api = h.submit(max_tokens=30)
    with pytest.raises(EngineInputError, match="prompt is empty"):
        h.submit(prompt=[])
    for _ in range(3):
        h.step()
    h.scheduler.abort(aborted.request_id)
    h.scheduler.stop_request(stopped_by_api.request_id)
    h.scheduler.abort("no-such-request")  # ignored
    h.run()
    assert eos.reason is Outcome.STOPPED
    assert eos.tokens == [*expected_tokens(eos.prompt, 3), 0]  # the EOS (id 0) is the 4th token
    assert stopped.reason is Outcome.STOPPED
    assert stopped.tokens == unstopped[: unstopped.index(unstopped[2]) + 1]
    assert aborted.reason is Outcome.ABORTED
    assert stopped_by_api.reason is Outcome.STOPPED
    for s in (aborted, stopped_by_api):
        assert s.tokens == expected_tokens(s.prompt, 30)[: len(s.tokens)]
    for s in plain:
        assert_complete(s)
    assert_drained(h)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_timings_are_ordered_arrival_scheduled_first_last_released(mode: Mode) -> None:
    h = build(mode, seats=2, batch_timeout_ms=500, max_num_batched_tokens=6, step_time=0.25)
    clock = h.clock
    assert isinstance(clock, FakeClock)  # build's default
    for k in range(7):
        h.submit(prompt=2 + 3 * k, max_tokens=1 + k)
        clock.advance(0.1)
        h.step()
    h.run()
    for s in h.streams.values():
        assert_complete(s)
        t = s.finish.timings if s.finish else None
        assert t is not None and t.scheduled is not None and t.first_token is not None and t.last_token is not None
        assert t.arrival <= t.scheduled < t.first_token <= t.last_token <= t.released
        assert t.num_steps >= s.max_tokens
    assert_drained(h)


def test_scripted_runner_notices_a_corrupted_cache() -> None:
    h = build(Mode.CONTINUOUS, seats=1)
    s = h.submit(prompt=5, max_tokens=4)
    h.step()
    h.step()
    assert h.runner.violations == []
    h.engine.cache.data.zero_()
    h.run()
    assert h.runner.violations
    assert s.tokens != expected_tokens(s.prompt, 4)


# ===== a real (tiny, random) model =====
def hf_greedy(model: PreTrainedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    assert isinstance(model, GenerationMixin)  # a causal LM: PreTrainedModel itself declares no `generate`
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def test_same_greedy_tokens_in_both_modes_and_equal_to_generate(tiny_llama: PreTrainedModel) -> None:
    vocab = tiny_llama.config.vocab_size
    generator = torch.Generator().manual_seed(7)
    lengths, max_tokens = (1, 5, 17, 33, 9), (12, 5, 9, 14, 7)
    prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]
    reference = [hf_greedy(tiny_llama, p, m) for p, m in zip(prompts, max_tokens, strict=True)]
    assert all(len(r) == m for r, m in zip(reference, max_tokens, strict=True))
    runner = TransformersRunner(tiny_llama)
    results: dict[Mode, list[list[int]]] = {}
    preemptions: dict[Mode, int] = {}
    for mode in MODES:
        # Continuous runs with 16-token chunks and a cache too small for all at once (it preempts).
        engine_config = EngineConfig(max_rows=3, kv_cache_tokens=64, block_size=4)
        engine = Engine(runner, engine_config, eos_token_ids=())
        clock = FakeClock()
        config = SchedulerConfig(
            mode=mode, max_batch_size=3, max_num_seqs=3, batch_timeout_ms=0, max_num_batched_tokens=16
        )
        scheduler = Scheduler(engine, config, clock=clock)
        streams = [Stream(str(i), p, m) for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))]
        for s in streams:
            params = SamplingParams(max_tokens=s.max_tokens, temperature=0.0)
            scheduler.submit(SequenceRequest(s.request_id, s.prompt, params, s))
        step_until_done(scheduler, clock, streams, max_steps=500)
        assert all(s.reason is Outcome.LENGTH for s in streams)
        assert engine.cache_usage == 0 and engine.num_free_rows == 3
        results[mode] = [s.tokens for s in streams]
        preemptions[mode] = sum(s.finish.timings.num_preemptions for s in streams if s.finish)
    assert results[Mode.DYNAMIC] == reference
    assert results[Mode.CONTINUOUS] == reference
    assert preemptions[Mode.CONTINUOUS] > 0


def test_a_request_that_fails_to_be_admitted_fails_alone_and_the_running_go_on(monkeypatch: pytest.MonkeyPatch) -> None:
    h = build(Mode.CONTINUOUS, seats=2)
    running = h.submit(max_tokens=6)
    h.step()
    real_add = h.engine.add

    def broken_add(seq_id: int, prompt: object, params: object) -> None:
        assert poisoned.request is not None  # Harness.submit sets it before the scheduler sees the request
        if seq_id == poisoned.request.seq_id:
            raise RuntimeError("a bug in admission")
        real_add(seq_id, prompt, params)  # type: ignore[arg-type]

    monkeypatch.setattr(h.engine, "add", broken_add)
    poisoned = h.submit(max_tokens=3)
    h.step()  # admitting `poisoned` raises: it alone fails, and `running` still decodes in this very step
    assert poisoned.reason is Outcome.FAILED
    assert poisoned.finish is not None and poisoned.finish.error
    assert len(running.tokens) == 2
    h.run()
    assert_complete(running)
    assert_drained(h)
