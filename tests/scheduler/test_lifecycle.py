"""The scheduler's seams: the policy interface (a fake context satisfies it, and the policies run against it), the
lifecycle's single release of an engine row, and the counts snapshot other threads read.

`PolicyContext` is a runtime-checkable protocol, so the tests below fail if `FakeContext` or the real `Lifecycle`
lacks one of its members; `.ci/run` runs mypy over tests/scheduler too, which checks their signatures as well.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest

from engine.sample.sampling_params import SamplingParams
from scheduler.config import Mode, SchedulerConfig
from scheduler.continuous import ContinuousPolicy
from scheduler.dynamic import DynamicPolicy
from scheduler.policy import PolicyContext
from scheduler.request import Outcome, RequestEvent, RequestStatus, SequenceRequest
from scheduler.stats import SchedulerCounts
from tests.fakes import Harness, build

MODES = [Mode.DYNAMIC, Mode.CONTINUOUS]


def _ignore(event: RequestEvent) -> None:
    pass


def _request(seq_id: int, prompt_len: int, max_tokens: int) -> SequenceRequest:
    request = SequenceRequest(f"r{seq_id}", [1] * prompt_len, SamplingParams(max_tokens=max_tokens), _ignore)
    request.seq_id = seq_id
    return request


@dataclass
class FakeContext:
    """A PolicyContext with no engine, as a simulator would build one: a sequence is a few counters and the cache
    a pool of `blocks` blocks."""

    seats: int
    blocks: int
    block_size: int = 4
    queue: list[SequenceRequest] = field(default_factory=list)
    seated: list[SequenceRequest] = field(default_factory=list)
    computed: dict[int, int] = field(default_factory=dict)
    produced: dict[int, int] = field(default_factory=dict)  # tokens sampled so far
    reserved_blocks: dict[int, int] = field(default_factory=dict)
    released: list[SequenceRequest] = field(default_factory=list)

    @property
    def waiting(self) -> Sequence[SequenceRequest]:
        return self.queue

    @property
    def running(self) -> Sequence[SequenceRequest]:
        return self.seated

    @property
    def free_seats(self) -> int:
        return self.seats - len(self.seated)

    @property
    def free_rows(self) -> int:
        return self.seats - len(self.seated)  # a row per seat: nothing keeps a row while it waits here

    @property
    def free_blocks(self) -> int:  # not part of the contract: this fake's own bookkeeping
        return self.blocks - sum(self.reserved_blocks.values())

    @property
    def free_cache_tokens(self) -> int:
        return self.free_blocks * self.block_size

    def pending_tokens(self, request: SequenceRequest) -> int:
        known = len(request.prompt_token_ids) + self.produced.get(request.seq_id, 0)
        return known - self.computed.get(request.seq_id, 0)

    def computed_tokens(self, request: SequenceRequest) -> int:
        return self.computed.get(request.seq_id, 0)

    def reserved_tokens(self, request: SequenceRequest) -> int:
        return self.reserved_blocks.get(request.seq_id, 0) * self.block_size

    def lowest_ranked_running(self, where: Callable[[SequenceRequest], bool]) -> SequenceRequest | None:
        return next((r for r in reversed(self.seated) if where(r)), None)  # first come first served

    def admit(self, request: SequenceRequest, total_tokens: int) -> bool:
        if self.free_seats == 0 or not self.reserve(request, total_tokens):
            return False
        self.queue.remove(request)
        self.seated.append(request)
        request.status = RequestStatus.RUNNING
        return True

    def reserve(self, request: SequenceRequest, total_tokens: int) -> bool:
        missing = -(-total_tokens // self.block_size) - self.reserved_blocks.get(request.seq_id, 0)
        if missing > self.free_blocks:
            return False
        self.reserved_blocks[request.seq_id] = self.reserved_blocks.get(request.seq_id, 0) + max(missing, 0)
        return True

    def preempt(self, request: SequenceRequest) -> None:
        self.seated.remove(request)
        self.reserved_blocks[request.seq_id] = self.computed[request.seq_id] = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.queue.insert(0, request)

    def release(self, request: SequenceRequest) -> None:
        if request in self.seated:
            self.seated.remove(request)
        self.reserved_blocks.pop(request.seq_id, None)
        request.status = RequestStatus.RELEASED
        self.released.append(request)


def test_the_real_lifecycle_satisfies_the_policy_context() -> None:
    h = build(Mode.CONTINUOUS)
    context: PolicyContext = h.scheduler.lifecycle  # mypy checks the signatures here
    assert isinstance(context, PolicyContext)  # every member is there
    assert context.free_seats == h.seats and context.free_cache_tokens == 1024


def test_continuous_policy_plans_against_a_fake_context() -> None:
    ctx = FakeContext(seats=2, blocks=100, queue=[_request(i, 6, 4) for i in range(3)])
    context: PolicyContext = ctx  # mypy checks the signatures here
    assert isinstance(context, PolicyContext)  # every member is there: the fake has not drifted
    policy = ContinuousPolicy(SchedulerConfig(mode=Mode.CONTINUOUS, max_num_seqs=2, max_num_batched_tokens=8))
    first, second, third = ctx.queue
    # FCFS within seats and budget: the second prompt is chunked to what is left of the budget.
    assert policy.plan(context, now=0.0) == [(first, 6), (second, 2)]
    assert ctx.seated == [first, second] and ctx.queue == [third]


def test_lone_prefill_budget_holds_only_while_no_sequence_has_produced_a_token() -> None:
    ctx = FakeContext(seats=3, blocks=100, queue=[_request(i, 12, 4) for i in range(3)])
    config = SchedulerConfig(mode=Mode.CONTINUOUS, max_num_seqs=3, max_num_batched_tokens=8, lone_prefill_tokens=20)
    policy = ContinuousPolicy(config)
    first, second, third = ctx.queue
    # Only prompt chunks: the lone budget, 20 tokens, not 8.
    assert policy.plan(ctx, now=0.0) == [(first, 12), (second, 8)]
    ctx.computed[first.seq_id], ctx.computed[second.seq_id] = 12, 8
    first.output_token_ids.append(5)  # first now streams: back to 8, so its next token is not held up
    ctx.produced[first.seq_id] = 1
    assert policy.plan(ctx, now=0.0) == [(first, 1), (second, 4), (third, 3)]
    # Below max_num_batched_tokens, or off, it changes nothing.
    for lone in (4, None):
        small = FakeContext(seats=1, blocks=100, queue=[_request(9, 12, 4)])
        lone_config = SchedulerConfig(mode=Mode.CONTINUOUS, max_num_batched_tokens=8, lone_prefill_tokens=lone)
        assert [count for _, count in ContinuousPolicy(lone_config).plan(small, now=0.0)] == [8]


def test_continuous_policy_preempts_the_newest_and_resumes_it_first_on_a_fake_context() -> None:
    ctx = FakeContext(seats=2, blocks=4, block_size=4)
    older, newer, fresh = _request(0, 8, 8), _request(1, 8, 8), _request(2, 2, 2)
    ctx.seated, ctx.queue = [older, newer], [fresh]
    for request in (older, newer):  # prompts prefilled, one token sampled: each needs a third block now
        request.status = RequestStatus.RUNNING
        ctx.computed[request.seq_id], ctx.produced[request.seq_id], ctx.reserved_blocks[request.seq_id] = 8, 1, 2
    policy = ContinuousPolicy(SchedulerConfig(mode=Mode.CONTINUOUS, max_num_seqs=2, max_num_batched_tokens=64))
    assert policy.plan(ctx, now=0.0) == [(older, 1)]
    assert newer.num_preemptions == 1 and ctx.queue == [newer, fresh]  # back at the head; nobody overtakes it
    assert ctx.reserved_tokens(older) == 12 and ctx.free_blocks == 1


def test_dynamic_policy_boards_a_bus_and_holds_finished_members_on_a_fake_context() -> None:
    ctx = FakeContext(seats=2, blocks=100, queue=[_request(i, 5, 3) for i in range(3)])
    policy = DynamicPolicy(SchedulerConfig(mode=Mode.DYNAMIC, max_batch_size=2, batch_timeout_ms=0.0))
    first, second, third = ctx.queue
    assert policy.plan(ctx, now=0.0) == [(first, 5), (second, 5)]
    assert ctx.reserved_tokens(first) == 8 and first.batch_id == second.batch_id == 1  # whole length reserved
    first.status = RequestStatus.FINISHED
    policy.on_finished(ctx, first)
    assert ctx.released == [] and ctx.seated == [first, second]  # held for its batch
    second.status = RequestStatus.FINISHED
    policy.on_finished(ctx, second)
    assert ctx.released == [first, second] and not ctx.seated
    assert policy.plan(ctx, now=0.0) == [(third, 5)] and third.batch_id == 2


def _spy_on_remove(h: Harness, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The seq ids `engine.remove` is called with, in order."""
    removed: list[int] = []
    real_remove = h.engine.remove

    def spy(seq_id: int) -> None:
        removed.append(seq_id)
        real_remove(seq_id)

    monkeypatch.setattr(h.engine, "remove", spy)
    return removed


@pytest.mark.parametrize("mode", MODES)
def test_an_abort_frees_the_row_exactly_once(mode: Mode, monkeypatch: pytest.MonkeyPatch) -> None:
    h = build(mode, seats=2)
    removed = _spy_on_remove(h, monkeypatch)
    short, running, waiting = h.submit(max_tokens=1), h.submit(max_tokens=20), h.submit(max_tokens=2)
    h.step()
    h.step()
    assert short.done or mode is Mode.DYNAMIC  # dynamic holds it until `running` ends
    h.scheduler.abort(running.request_id)  # running
    h.scheduler.abort(waiting.request_id)  # queued, or (continuous) already admitted
    h.run()
    assert running.reason is Outcome.ABORTED and waiting.reason is Outcome.ABORTED and short.done
    # One remove per request: each is released once, from one place.
    assert sorted(removed) == sorted(s.seq_id for s in (short, running, waiting))


def test_an_abort_of_a_held_answer_frees_its_row_once(monkeypatch: pytest.MonkeyPatch) -> None:
    h = build(Mode.DYNAMIC, seats=2)
    removed = _spy_on_remove(h, monkeypatch)
    held, long = h.submit(max_tokens=1), h.submit(max_tokens=6)
    h.step()
    assert h.scheduler.counts().held_seats == 1 and not held.done
    h.scheduler.abort(held.request_id)
    h.step()
    assert held.reason is Outcome.ABORTED and removed == [held.seq_id]
    h.run()
    assert removed == [held.seq_id, long.seq_id] and long.reason is Outcome.LENGTH


def _counts(c: SchedulerCounts) -> tuple[int, int, int, int, int, bool]:
    return c.running, c.held_seats, c.queued, c.preempted, c.free_seats, c.pending_work


@pytest.mark.parametrize("mode", MODES)
def test_counts_snapshot_follows_submissions_steps_and_finishes(mode: Mode) -> None:
    h = build(mode, seats=2)
    assert _counts(h.scheduler.counts()) == (0, 0, 0, 0, 2, False)
    short, long, late = h.submit(max_tokens=1), h.submit(max_tokens=3), h.submit(max_tokens=2)
    # Published by the submitting thread itself: the queue is visible before the loop thread steps.
    assert _counts(h.scheduler.counts()) == (0, 0, 3, 0, 2, True)
    h.step()
    counts = h.scheduler.counts()
    assert counts.cache_usage == h.engine.cache_usage > 0 and counts.waiting == 1
    if mode is Mode.DYNAMIC:  # `short` finished but is held by its batch
        assert _counts(counts) == (2, 1, 1, 0, 0, True) and not short.done
    else:  # `short` left at once; `late` takes its seat at the next step
        assert _counts(counts) == (1, 0, 1, 0, 1, True) and short.done
    h.step()  # dynamic: the bus is still out; continuous: `late` took the free seat
    expected = (2, 1, 1, 0, 0, True) if mode is Mode.DYNAMIC else (2, 0, 0, 0, 0, True)
    assert _counts(h.scheduler.counts()) == expected
    h.run()
    assert late.done and long.done
    assert _counts(h.scheduler.counts()) == (0, 0, 0, 0, 2, False) and h.scheduler.counts().cache_usage == 0


def test_counts_snapshot_counts_preempted_requests_as_waiting() -> None:
    h = build(Mode.CONTINUOUS, seats=3, kv_cache_tokens=40, block_size=4)
    for _ in range(4):
        h.submit(prompt=6, max_tokens=14)
    h.run(until=lambda: h.scheduler.counts().preempted > 0)
    counts = h.scheduler.counts()
    assert (counts.running, counts.queued, counts.preempted, counts.waiting) == (2, 1, 1, 2)


def test_counts_snapshot_is_read_whole_from_another_thread() -> None:
    h = build(Mode.CONTINUOUS, seats=2)
    h.submit(max_tokens=3)
    h.step()
    seen: list[SchedulerCounts] = []
    reader = threading.Thread(target=lambda: seen.append(h.scheduler.counts()))
    reader.start()
    reader.join()
    assert seen == [h.scheduler.counts()] and seen[0].running == 1
