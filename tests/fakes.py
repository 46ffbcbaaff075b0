"""Test doubles for driving the real Engine and Scheduler with scripted tokens and a fake clock.

`ScriptedRunner` implements the ModelRunner protocol with a one-layer, one-head, head_dim-1 "KV cache" in
which it stores each token id (keys) and its position + 1 (values). When a row samples, it reads the row's
whole context back from the paged cache through the batch's own key slots, checks that every position is
present and in order (so a wrong block table, a lost block or a missed recompute after preemption shows up
as a recorded violation), and puts a single logit spike on `token_fn(position, context)`. The engine's real
block accounting and sampler therefore run unchanged, and greedy requests get exact, reproducible tokens.
Prompt positions a batch asks to score get `scripted_prompt_score(position)` as their logprob (rank: the
position), so tests can tell which positions were delivered.

Below them: the checks the scheduler's tests share (`assert_drained`, `assert_complete`) and the helpers that
drive the engine loop thread (`RecordingEvent`, `submit`, `collect`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch

from benchmarks.sim.engine import VirtualClock
from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv.kv_cache import KVCacheShape, PagedKVCache
from engine.model.forward_batch import AttentionGroup, ForwardBatch
from engine.model.model_runner import ForwardOutput
from engine.model.prompt_scoring import PromptScores
from engine.outputs import PromptLogprobs
from engine.platform.native import Kernels
from engine.sample.sampling_params import SamplingParams
from scheduler.config import Mode, SchedulerConfig
from scheduler.core import Scheduler
from scheduler.loop import SchedulerLoop
from scheduler.request import (
    FinishEvent,
    Outcome,
    PromptLogprobsEvent,
    RequestEvent,
    RequestStatus,
    SequenceRequest,
    TokenEvent,
)
from scheduler.stats import StepStats

EOS = 0  # ScriptedRunner's EOS id; default scripted tokens are never EOS
VOCAB = 64

# (position of the token being sampled, token ids at positions 0..position-1 read from the cache) -> token id
TokenFn = Callable[[int, Sequence[int]], int]


def scripted_prompt_score(position: int) -> float:
    """The logprob ScriptedRunner reports for the prompt token at `position`."""
    return -float(position)


def default_token(position: int, context: Sequence[int]) -> int:
    """A function of the whole cached context, so any cache corruption changes the tokens; never EOS."""
    checksum = sum((i + 1) * (t + 1) for i, t in enumerate(context))
    return 1 + (checksum + 7 * position) % (VOCAB - 1)


class FakeClock(VirtualClock):
    """The simulator's manual clock (`clock()` reads it), which tests also `set`; it never goes backwards."""

    def set(self, when: float) -> float:
        assert when >= self.now, f"the clock cannot go back from {self.now} to {when}"
        self.now = when
        return self.now


@dataclass(frozen=True)
class RecordedBatch:
    call: int  # 1-based forward call number
    num_tokens: int  # tokens computed in the step
    num_samples: int  # rows that sampled a token
    positions: tuple[int, ...]
    sample_positions: tuple[int, ...]  # position of each sampled token (= length of its row's context)


class InjectedFault(RuntimeError):
    pass


def cache_block_size(cache: torch.Tensor, group: object) -> int:
    """Block size implied by a group's mask width over its block table."""
    return int(group.mask.shape[-1] // group.block_table.shape[1])  # type: ignore[attr-defined]


def key_slots(group: AttentionGroup, block_size: int) -> torch.Tensor:
    """[rows, context blocks * block_size] the cache slot of every key position of the group's rows."""
    offsets = torch.arange(block_size, device=group.block_table.device)
    return (group.block_table[:, :, None] * block_size + offsets).flatten(1)


class ScriptedRunner:
    """A ModelRunner sampling `token_fn(position, context)`, or `eos_token_id` at `eos_positions`."""

    def __init__(
        self,
        vocab_size: int = VOCAB,
        token_fn: TokenFn = default_token,
        eos_token_id: int = EOS,
        eos_positions: Collection[int] = (),
        fail_on_calls: Collection[int] = (),
        clock: FakeClock | None = None,
        step_time: float = 1.0,
    ) -> None:
        self.vocab_size = vocab_size
        self.kernels: Kernels | None = None  # the sampler runs torch's ops
        self.token_fn = token_fn
        self.eos_token_id = eos_token_id
        self.eos_positions = set(eos_positions)
        self.fail_on_calls = set(fail_on_calls)
        self.clock = clock
        self.step_time = step_time
        self.calls = 0
        self.batches: list[RecordedBatch] = []
        self.violations: list[str] = []
        self.scored_positions: list[int] = []  # every prompt position any batch asked to score, in order

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> KVCacheShape:
        return KVCacheShape(1, 1, 1, num_blocks, block_size)

    def forward(self, batch: ForwardBatch, cache: PagedKVCache) -> ForwardOutput:
        self.calls += 1
        if self.clock is not None:
            self.clock.advance(self.step_time)  # the step "takes" step_time
        if self.calls in self.fail_on_calls:
            raise InjectedFault(f"injected fault on forward call {self.calls}")
        keys, values = cache.layer(0)  # each [1 kv head, slots, 1]
        keys[0, batch.slot_mapping, 0] = batch.input_ids.to(keys.dtype)
        values[0, batch.slot_mapping, 0] = (batch.positions + 1).to(values.dtype)

        logits = torch.full((len(batch.sample_index), self.vocab_size), -10.0, dtype=torch.float32)
        sample_positions = []
        for i, token_index in enumerate(batch.sample_index.tolist()):
            position = int(batch.positions[token_index]) + 1  # where the sampled token will go
            context = self._context(batch, token_index, keys, values, position)
            token = self.eos_token_id if position in self.eos_positions else self.token_fn(position, context)
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"token_fn returned {token}, outside [0, {self.vocab_size})")
            logits[i, token] = 10.0
            sample_positions.append(position)
        self.batches.append(
            RecordedBatch(
                self.calls,
                batch.num_tokens,
                len(sample_positions),
                tuple(batch.positions.tolist()),
                tuple(sample_positions),
            )
        )
        return ForwardOutput(logits, self._prompt_scores(batch))

    def _prompt_scores(self, batch: ForwardBatch) -> PromptScores | None:
        scoring = batch.scoring
        if scoring is None:
            return None
        position = batch.positions[scoring.index] + 1  # the hidden state at p scores the token at p + 1
        self.scored_positions.extend(position.tolist())
        logprobs = scripted_prompt_score(1) * position.float()
        k = scoring.top_k
        return PromptScores(logprobs, position, scoring.target[:, None].expand(-1, k), logprobs[:, None].expand(-1, k))

    def _context(
        self, batch: ForwardBatch, token_index: int, keys: torch.Tensor, values: torch.Tensor, length: int
    ) -> list[int]:
        """The row's token ids at positions 0..length-1, read from the cache via the batch's key slots."""
        for group in batch.groups:
            hit = (group.query_index == token_index) & group.query_valid
            if bool(hit.any()):
                row = int(hit.nonzero()[0, 0])
                slots = key_slots(group, cache_block_size(values, group))[row, :length]
                stored_positions = values[0, slots, 0].long()
                if not torch.equal(stored_positions, torch.arange(1, length + 1)):
                    self.violations.append(
                        f"call {self.calls}: context of length {length} holds positions "
                        f"{(stored_positions - 1).tolist()}"
                    )
                return keys[0, slots, 0].long().tolist()
        self.violations.append(f"call {self.calls}: sampled token {token_index} is in no attention group")
        return []


@dataclass
class Stream:
    """Everything one request's consumer received, stamped with the harness step that delivered it."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    events: list[RequestEvent] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    token_steps: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    finish: FinishEvent | None = None
    finish_step: int | None = None
    request: SequenceRequest | None = field(default=None, repr=False)
    _harness: Harness | None = field(default=None, repr=False)

    def __call__(self, event: RequestEvent) -> None:
        assert self.finish is None, f"{self.request_id} got an event after its FinishEvent: {event}"
        step = self._harness.step_count if self._harness is not None else -1
        self.events.append(event)
        if isinstance(event, TokenEvent):
            self.tokens.append(event.token.token_id)
            self.token_steps.append(step)
            self.token_times.append(event.time)
        elif isinstance(event, PromptLogprobsEvent):
            assert not self.tokens, f"{self.request_id} got prompt logprobs after its first token"
            self.prompt_logprobs.append(event.scores)
        else:
            self.finish = event
            self.finish_step = step

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def reason(self) -> Outcome | None:
        return None if self.finish is None else self.finish.outcome

    @property
    def seq_id(self) -> int:
        assert self.request is not None
        return self.request.seq_id


def step_until_done(scheduler: Scheduler, clock: FakeClock, streams: Sequence[Stream], max_steps: int) -> None:
    """Step a real scheduler synchronously, a second of fake time a step, until every stream has its end or
    `max_steps` steps have run (the caller asserts which)."""
    for _ in range(max_steps):
        if all(s.done for s in streams):
            return
        scheduler.step()
        clock.advance(1.0)


class Stuck(AssertionError):
    pass


@dataclass
class Harness:
    """A real Engine + Scheduler around a ScriptedRunner and a FakeClock, plus per-request event streams."""

    engine: Engine
    scheduler: Scheduler
    runner: ScriptedRunner
    clock: FakeClock | Callable[[], float]
    streams: dict[str, Stream] = field(default_factory=dict)
    stats: list[StepStats] = field(default_factory=list)  # one per step that ran
    step_count: int = 0  # scheduler.step() calls so far, including those where nothing ran
    _ids: int = 0

    def submit(
        self,
        prompt: Sequence[int] | int = 4,
        max_tokens: int = 4,
        request_id: str | None = None,
        arrival: float | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        **params: object,
    ) -> Stream:
        """Submit a greedy request; an int prompt means that many (distinct per request) in-vocab tokens.
        `arrival` stamps when it reached the server (default: the clock now)."""
        if request_id is None:
            request_id = f"r{self._ids}"
        self._ids += 1
        if isinstance(prompt, int):
            prompt = [1 + (self._ids * 5 + i) % (self.runner.vocab_size - 1) for i in range(prompt)]
        params.setdefault("temperature", 0.0)
        stream = Stream(request_id, list(prompt), max_tokens, _harness=self)
        params_ = SamplingParams(max_tokens=max_tokens, **params)  # type: ignore[arg-type]
        request = SequenceRequest(request_id, list(prompt), params_, stream, cache_salt=cache_salt, priority=priority)
        stream.request = request
        self.scheduler.submit(request, arrival)
        self.streams[request_id] = stream
        return stream

    def step(self) -> StepStats | None:
        self.step_count += 1
        stats = self.scheduler.step()
        if stats is not None:
            self.stats.append(stats)
        return stats

    def run(self, max_steps: int = 2000, until: Callable[[], bool] | None = None) -> None:
        """Step until nothing is pending (or `until()`), jumping the clock to deadlines when idle."""
        for _ in range(max_steps):
            if until is not None and until():
                return
            if until is None and not self.scheduler.has_pending_work():
                return
            if self.step() is not None:
                continue
            deadline = self.scheduler.next_deadline()
            if deadline is None:
                if not self.scheduler.has_pending_work():
                    continue
                raise Stuck(f"nothing ran, no deadline, yet work is pending: {self.describe()}")
            # Deadlines compare with > (queue timeout) or >= (batch timeout): step just past them.
            assert isinstance(self.clock, FakeClock), "run() jumps a FakeClock only"
            self.clock.set(max(self.clock.now, deadline) + 1e-3)
        raise Stuck(f"not done after {max_steps} steps: {self.describe()}")

    @property
    def seats(self) -> int:
        return self.engine.config.max_rows

    def describe(self) -> str:
        return (
            f"waiting={[(r.request_id, r.status.value) for r in self.scheduler.waiting]} "
            f"running={[(r.request_id, r.status.value) for r in self.scheduler.running]} "
            f"free_rows={self.engine.num_free_rows} free_blocks={self.engine.blocks.pool.num_free}"
        )


def build(
    mode: Mode | str,
    *,
    seats: int = 4,
    kv_cache_tokens: int = 1024,
    block_size: int = 4,
    max_model_len: int | None = 256,
    eos_token_ids: Sequence[int] = (EOS,),
    runner: ScriptedRunner | None = None,
    clock: FakeClock | Callable[[], float] | None = None,
    step_time: float = 1.0,
    enable_prefix_caching: bool = True,
    **scheduler: object,
) -> Harness:
    """Engine + Scheduler for `mode` with `seats` seats (max_batch_size or max_num_seqs) and engine rows.

    With a FakeClock (the default) each forward advances it by `step_time`, so timestamps count steps; any
    other clock (time.monotonic for the engine loop) is used as is. Extra keyword arguments go to
    SchedulerConfig (batch_timeout_ms defaults to 0 here: a dynamic batch leaves at once).
    """
    mode = Mode(mode)
    clock = FakeClock() if clock is None else clock
    fake = clock if isinstance(clock, FakeClock) else None
    if runner is None:
        runner = ScriptedRunner(clock=fake, step_time=step_time)
    elif runner.clock is None:
        runner.clock = fake
    scheduler.setdefault("batch_timeout_ms", 0.0)
    seat_key = "max_num_seqs" if mode is Mode.CONTINUOUS else "max_batch_size"
    scheduler.setdefault(seat_key, seats)
    config = SchedulerConfig(mode=mode, **scheduler)  # type: ignore[arg-type]
    engine_config = EngineConfig(
        max_rows=config.engine_rows,
        kv_cache_tokens=kv_cache_tokens,
        block_size=block_size,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
    )
    engine = Engine(runner, engine_config, eos_token_ids=eos_token_ids)
    return Harness(engine, Scheduler(engine, config, clock=clock), runner, clock)


def expected_tokens(prompt: Sequence[int], max_tokens: int, token_fn: TokenFn = default_token) -> list[int]:
    """What ScriptedRunner produces for a prompt run alone (no EOS positions)."""
    sequence = list(prompt)
    for _ in range(max_tokens):
        sequence.append(token_fn(len(sequence), sequence))
    return sequence[len(prompt) :]


# ----- checks shared by the scheduler's tests -----
def assert_drained(h: Harness) -> None:
    """Everything finished: no cache, every row free, nothing running, waiting, queued or held."""
    assert h.engine.cache_usage == 0
    assert h.engine.blocks.pool.num_free == h.engine.blocks.pool.num_blocks
    assert h.engine.num_free_rows == h.seats
    assert list(h.scheduler.running) == []
    assert len(h.scheduler.waiting) == 0
    assert h.scheduler.num_queued == 0
    assert h.scheduler.lifecycle.held_seats == 0
    assert not h.scheduler.has_pending_work()
    assert h.runner.violations == []
    for stream in h.streams.values():
        assert stream.done, stream.request_id
        assert stream.request is not None and stream.request.status is RequestStatus.RELEASED
        assert_timings_ordered(stream)


def assert_timings_ordered(stream: Stream) -> None:
    assert stream.finish is not None
    t = stream.finish.timings
    present = [x for x in (t.arrival, t.scheduled, t.first_token, t.last_token, t.released) if x is not None]
    assert present == sorted(present), (stream.request_id, t)
    assert (t.first_token is None) == (t.last_token is None) == (not stream.tokens)
    if t.first_token is not None:
        assert t.scheduled is not None
        assert t.first_token == stream.token_times[0] and t.last_token == stream.token_times[-1]


def assert_complete(stream: Stream) -> None:
    """Finished by length with exactly max_tokens tokens, the ones the prompt gives when run alone."""
    assert stream.reason is Outcome.LENGTH, (stream.request_id, stream.finish)
    assert stream.tokens == expected_tokens(stream.prompt, stream.max_tokens)
    assert len(stream.tokens) == stream.max_tokens
    assert all(isinstance(e, TokenEvent) for e in stream.events[:-1])
    assert isinstance(stream.events[-1], FinishEvent)


# ----- the engine loop thread (scheduler/loop.py) -----
EVENT_TIMEOUT_S = 10.0  # only a guard against a hung test; never reached when things work


class RecordingEvent(threading.Event):
    """The loop's wake-up event: records each wait's timeout; `idle` is set while the loop thread waits."""

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[float | None] = []
        self.idle = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.timeouts.append(timeout)
        self.idle.set()
        try:
            return super().wait(timeout)
        finally:
            self.idle.clear()


def wait_idle(wake: RecordingEvent) -> None:
    """Return once the loop thread is inside its event wait."""
    assert wake.idle.wait(EVENT_TIMEOUT_S), "the loop never went idle"


async def collect(stream: asyncio.Queue[RequestEvent]) -> list[RequestEvent]:
    events: list[RequestEvent] = []
    while not events or not isinstance(events[-1], FinishEvent):
        events.append(await asyncio.wait_for(stream.get(), EVENT_TIMEOUT_S))
    return events


def submit(loop: SchedulerLoop, request_id: str, prompt: list[int], max_tokens: int) -> asyncio.Queue[RequestEvent]:
    """Submit with a sink that hands events to this asyncio loop thread-safely, as the API's does."""
    stream: asyncio.Queue[RequestEvent] = asyncio.Queue()
    aio_loop = asyncio.get_running_loop()

    def sink(event: RequestEvent) -> None:
        aio_loop.call_soon_threadsafe(stream.put_nowait, event)

    loop.submit(SequenceRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), sink))
    return stream
