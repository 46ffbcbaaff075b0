"""Prefix caching under the real scheduler and both policies (scripted model, fake clock): cache hits cost no
step budget, are reported per request, and never change an answer."""

from __future__ import annotations

import pytest

from scheduler.config import Mode
from scheduler.events import PointKind, request_point
from tests.fakes import build, expected_tokens

MODES = [Mode.CONTINUOUS, Mode.DYNAMIC]
PROMPT = list(range(1, 41))  # 40 tokens: ten blocks of 4


@pytest.mark.parametrize("mode", MODES)
def test_a_repeated_prompt_computes_only_its_last_block_and_answers_the_same(mode: Mode) -> None:
    h = build(mode, seats=2)
    first = h.submit(PROMPT, max_tokens=5)
    h.run()
    tokens_before = sum(b.num_tokens for b in h.runner.batches)
    second = h.submit(PROMPT, max_tokens=5)
    h.run()
    assert first.tokens == second.tokens == expected_tokens(PROMPT, 5)
    assert first.finish is not None and second.finish is not None
    assert (first.finish.timings.num_cached_tokens, second.finish.timings.num_cached_tokens) == (0, 36)
    assert sum(b.num_tokens for b in h.runner.batches) - tokens_before == 4 + 4  # its last block, then 4 decodes


def test_cache_hits_do_not_count_against_the_step_token_budget() -> None:
    h = build(Mode.CONTINUOUS, seats=2, max_num_batched_tokens=8)
    h.submit(PROMPT, max_tokens=2)
    h.run()
    calls_before = len(h.runner.batches)
    again = h.submit([*PROMPT, 41, 42], max_tokens=2)
    h.run()
    assert again.finish is not None and again.finish.timings.num_cached_tokens == 40
    # 2 prompt tokens left: one step prefills them and samples, a second decodes. Without the cache, 42 tokens
    # at 8 a step would take six steps of prefill.
    assert [b.num_tokens for b in h.runner.batches[calls_before:]] == [2, 1]


@pytest.mark.parametrize("mode", MODES)
def test_caching_off_computes_everything_again(mode: Mode) -> None:
    h = build(mode, seats=2, enable_prefix_caching=False)
    for _ in range(2):
        h.submit(PROMPT, max_tokens=3)
        h.run()
    assert sum(b.num_tokens for b in h.runner.batches) == 2 * (40 + 2)
    assert all(s.finish is not None and s.finish.timings.num_cached_tokens == 0 for s in h.streams.values())


@pytest.mark.parametrize("mode", MODES)
def test_requests_with_different_salts_share_nothing(mode: Mode) -> None:
    h = build(mode, seats=2)
    for salt in ("alice", "bob", None, "alice"):
        h.submit(PROMPT, max_tokens=2, cache_salt=salt)
        h.run()
    hits = [s.finish.timings.num_cached_tokens for s in h.streams.values() if s.finish is not None]
    assert hits == [0, 0, 0, 36]
    assert h.engine.blocks.hits == 36 and h.engine.blocks.queries == 4 * 40


@pytest.mark.parametrize("mode", MODES)
def test_a_batch_of_the_same_prompt_leaves_no_block_behind(mode: Mode) -> None:
    """Eight requests with one prompt at once: whoever is computed first shares with the rest where the
    policy allows; every answer is the prompt's own and the cache ends with nothing in use."""
    h = build(mode, seats=4, kv_cache_tokens=256)
    streams = [h.submit(PROMPT, max_tokens=6) for _ in range(8)]
    h.run()
    for stream in streams:
        assert stream.tokens == expected_tokens(PROMPT, 6)
    assert h.engine.cache_usage == 0.0 and h.engine.blocks.pool.num_cached_free > 0
    assert sum(s.finish.timings.num_cached_tokens for s in streams if s.finish is not None) >= 4 * 36


def test_the_admitted_event_carries_the_cached_share() -> None:
    h = build(Mode.CONTINUOUS, seats=2)
    h.submit(PROMPT, max_tokens=2)
    h.run()
    again = h.submit(PROMPT, max_tokens=2)
    h.run()
    assert again.request is not None
    point = request_point(PointKind.ADMITTED, again.request, now=again.request.scheduled or 0.0)
    assert point.details["cached_tokens"] == 36


def test_a_prompt_whose_first_block_was_evicted_is_cached_whole_again() -> None:
    """Requests that share nothing: once a whole cache's worth of blocks went out without a hit, the most recently
    released block is evicted first, which is a prompt's first block (a sequence's blocks are released tail
    first). Its later blocks can no longer be found; the prompt sent again must be cached whole, not only its
    first block, and answer the same."""
    h = build(Mode.CONTINUOUS, seats=1, kv_cache_tokens=64)  # 16 blocks of 4
    prompt = [63 - i for i in range(20)]  # five blocks, sharing nothing with the generated prompts
    h.submit(24, max_tokens=2)
    h.run()
    first = h.submit(prompt, max_tokens=2)
    h.run()
    h.submit(24, max_tokens=2)  # its blocks take the 16 handed out since a hit: the prompt's first block goes
    h.run()
    assert first.request is not None
    assert h.engine.num_cached(first.request.seq_id, prompt, first.request.params, None) == 0
    again = h.submit(prompt, max_tokens=2)
    h.run()
    third = h.submit(prompt, max_tokens=2)
    h.run()
    streams = (first, again, third)
    assert [s.finish.timings.num_cached_tokens for s in streams if s.finish is not None] == [0, 0, 16]
    assert first.tokens == again.tokens == third.tokens == expected_tokens(prompt, 2)
