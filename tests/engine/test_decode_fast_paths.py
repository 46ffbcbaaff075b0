"""The pure-decode shortcuts of a step give what the general code gives: `build_forward_batch` for rows of one token
each, and `sample_and_record` while every sequence held is plain greedy."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import EngineConfig
from engine.model.forward_batch import ForwardBatch, build_forward_batch
from engine.rows import SequenceRows
from engine.sample.sampling_params import SamplingParams
from engine.sample.sampling_step import sample_and_record, sample_at

VOCAB = 64


def greedy(**fields: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, **fields)  # type: ignore[arg-type]


def assert_same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif dataclasses.is_dataclass(a) and not isinstance(a, type):
        assert type(a) is type(b)
        for field in dataclasses.fields(a):
            assert_same(getattr(a, field.name), getattr(b, field.name))
    elif isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("seed", range(6))
def test_a_decode_batch_matches_the_general_packing(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    max_rows, block_size, max_blocks = 12, 4, 8
    rows = torch.randperm(max_rows, generator=generator)[: 1 + seed]
    seq_len = torch.randint(1, max_blocks * block_size, (max_rows,), generator=generator)
    # One pending token, or (a prompt still being computed) several with one of them scheduled: some rows sample.
    num_computed = (seq_len - torch.randint(1, 3, (max_rows,), generator=generator)).clamp(min=0)
    token_buffer = torch.randint(0, VOCAB, (max_rows, max_blocks * block_size), generator=generator)
    block_table = torch.randperm(max_rows * max_blocks, generator=generator).reshape(max_rows, max_blocks)
    prompt_len = torch.randint(1, 6, (max_rows,), generator=generator)
    prompt_top_k = torch.where(torch.rand(max_rows, generator=generator) < 0.5, 2, -1)
    prompt_scored = torch.ones(max_rows, dtype=torch.long)
    ones = torch.ones(len(rows), dtype=torch.long)
    args = (rows, ones, num_computed, seq_len, token_buffer, block_table, block_size)
    scoring = {"prompt_len": prompt_len, "prompt_top_k": prompt_top_k, "prompt_scored": prompt_scored}

    fast = build_forward_batch(*args, **scoring)
    # Drafts given, none of them: the general packing, which must agree.
    general = build_forward_batch(*args, **scoring, num_drafts=torch.zeros(len(rows), dtype=torch.long))
    assert isinstance(fast[0], ForwardBatch)
    assert_same(fast, general)


def held(params: list[SamplingParams], extra: SamplingParams | None = None) -> tuple[SequenceRows, torch.Tensor]:
    state = SequenceRows(EngineConfig(max_rows=8, kv_cache_tokens=256, block_size=4), 64, VOCAB)
    generator = torch.Generator().manual_seed(1)
    for seq_id, p in enumerate(params):
        state.place(seq_id, torch.randint(0, VOCAB, (3 + seq_id,), generator=generator).tolist(), p)
    if extra is not None:
        state.place(99, [1, 2], extra)
    rows = state.rows(list(range(len(params))))
    state.num_computed[rows] = state.seq_len[rows]
    return state, rows


@pytest.mark.parametrize(
    "featured",
    [
        greedy(max_tokens=8, logprobs=2),
        SamplingParams(max_tokens=8, temperature=0.8, seed=3),
        greedy(max_tokens=8, min_tokens=1),
        greedy(max_tokens=8, logit_bias=((5, 1.0),)),
        greedy(max_tokens=8, repetition_penalty=1.2),
    ],
    ids=["logprobs", "sampled", "min_tokens", "logit_bias", "repetition"],
)
def test_plain_greedy_rows_sample_as_the_general_path_does(featured: SamplingParams) -> None:
    eos = torch.tensor([7])
    params = [
        greedy(max_tokens=8),
        greedy(max_tokens=1),  # ends at its length
        greedy(max_tokens=8, stop_token_ids=(11,)),
        greedy(max_tokens=8, ignore_eos=True),
        greedy(max_tokens=8),
    ]
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(4))
    logits[2, 11] = 50.0  # its stop id wins
    logits[3, 7] = logits[4, 7] = 50.0  # EOS wins: ignored by one, ends the other
    plain, plain_rows = held(params)
    # A sequence that needs the general sampler, held but not in this step, turns the shortcut off.
    general, general_rows = held(params, featured)
    assert plain.all_plain_greedy and not general.all_plain_greedy

    seq_ids = list(range(len(params)))
    # Speculation's verify step samples positions without recording them.
    lengths = plain.seq_len[plain_rows] + torch.tensor([0, 1, 2, 0, 1])
    fast_at, fast_finish = sample_at(plain, plain_rows, lengths, logits, eos, kernels=None)
    slow_at, slow_finish = sample_at(general, general_rows, lengths, logits, eos, kernels=None)
    assert torch.equal(fast_at.tokens, slow_at.tokens) and torch.equal(fast_finish, slow_finish)
    assert fast_at.logprobs is None and slow_at.logprobs is None

    fast = sample_and_record(plain, plain_rows, logits, seq_ids, eos, kernels=None)
    slow = sample_and_record(general, general_rows, logits, seq_ids, eos, kernels=None)
    assert fast == slow
    assert [t.finish_reason is not None for t in fast] == [False, True, True, False, True]
    assert torch.equal(plain.seq_len[plain_rows], general.seq_len[general_rows])
    assert torch.equal(plain.token_buffer[plain_rows], general.token_buffer[general_rows])


def test_only_plain_greedy_sequences_leave_the_shortcut_on() -> None:
    state = SequenceRows(EngineConfig(max_rows=4, kv_cache_tokens=64, block_size=4), 32, VOCAB)
    state.place(1, [1, 2], greedy(max_tokens=4))
    assert state.all_plain_greedy
    state.place(2, [1, 2], greedy(max_tokens=4, logprobs=0))
    assert not state.all_plain_greedy
    state.release(1)
    assert not state.all_plain_greedy
    state.release(2)
    assert state.all_plain_greedy
    state.place(3, [1], SamplingParams(max_tokens=4))  # the default temperature samples
    assert not state.all_plain_greedy
    state.release(3)
    state.place(4, [1], greedy(max_tokens=4, presence_penalty=0.5))
    assert not state.all_plain_greedy
