"""Tests for engine.engine.Engine on tiny random Llama, Qwen2 and Mistral models (CPU, seconds).

The reference is the Hugging Face model itself: greedy decoding through the engine's ragged, paged, chunked
batches must reproduce `model.generate(do_sample=False)` run on each prompt alone, token for token.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import PreTrainedModel

from engine.engine import Engine
from engine.errors import CacheCapacityError, EngineInputError, InputField
from engine.outputs import FinishReason
from engine.sample.sampling_params import SamplingParams
from tests.engine.helpers import (
    ARCHS,
    GREEDY,
    Driver,
    hf_greedy,
    hf_log_softmax,
    make_engine,
    random_prompt,
    run_alone,
)
from tests.toolchain import CAN_BUILD_KERNELS

# ----- greedy parity with Hugging Face generate() -----


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["cpu_kernels", "torch_only"])
@pytest.mark.parametrize("arch", ARCHS)
def test_batched_greedy_matches_hf_generate_with_joins_leaves_and_chunked_prefill(
    arch: str, cpu_kernels: bool, tiny_model_builder: Callable[..., PreTrainedModel]
) -> None:
    model = tiny_model_builder(arch)
    vocab = model.config.vocab_size
    # (prompt length, max_tokens, step at which it arrives)
    plan = [
        (1, 20, 0), (7, 15, 0), (60, 12, 0), (13, 25, 2), (33, 10, 4), (4, 18, 6), (22, 14, 9), (45, 9, 12),
        (2, 16, 15),
    ]  # fmt: skip
    leaver, leave_at_step = 1, 6  # removed by the client before it finishes
    prompts = [random_prompt(n, seed=100 + i, vocab_size=vocab) for i, (n, _, _) in enumerate(plan)]
    engine = make_engine(model, max_rows=6, cpu_kernels=cpu_kernels)
    assert (engine.runner.decode_kernel is not None) == (cpu_kernels and CAN_BUILD_KERNELS)  # type: ignore[attr-defined]
    driver = Driver(engine, token_budget=16, max_chunk=7)
    free_blocks, free_rows = engine.blocks.pool.num_free, engine.num_free_rows

    waiting = list(range(len(plan)))
    for step in range(1000):
        while waiting and plan[waiting[0]][2] <= step and engine.num_free_rows > 0:
            i = waiting.pop(0)
            driver.add(i, prompts[i], SamplingParams(max_tokens=plan[i][1], **GREEDY))
        if step == leave_at_step:
            assert leaver not in driver.finished and len(driver.outputs[leaver]) > 0
            engine.remove(leaver)
            driver.finished[leaver] = None
        if not waiting and not driver.running:
            break
        if driver.running:
            driver.step()

    # The test really exercised what its name says.
    assert driver.mixed_steps > 0
    chunks_of_long_prompt = [n for schedule in driver.steps for s, n in schedule if s == 2 and n > 1]
    assert len(chunks_of_long_prompt) >= 60 // 7  # the 60-token prompt was prefilled across many steps
    assert len(driver.finished) == len(plan)

    for i, (_, max_tokens, _) in enumerate(plan):
        expected = hf_greedy(model, prompts[i], max_tokens)
        got = driver.tokens(i)
        if i == leaver:
            assert 0 < len(got) < max_tokens
            assert got == expected[: len(got)]
            continue
        assert got == expected, f"sequence {i} (prompt length {len(prompts[i])}) diverged from HF"
        reasons = [t.finish_reason for t in driver.outputs[i]]
        assert reasons == [None] * (max_tokens - 1) + [FinishReason.LENGTH]

    assert engine.blocks.pool.num_free == free_blocks
    assert engine.num_free_rows == free_rows
    assert engine.cache_usage == 0.0


@pytest.mark.parametrize("arch", ARCHS)
def test_whole_prompt_prefill_in_one_step_matches_hf(
    arch: str, tiny_model_builder: Callable[..., PreTrainedModel]
) -> None:
    model = tiny_model_builder(arch)
    prompts = [random_prompt(n, seed=200 + n, vocab_size=model.config.vocab_size) for n in (3, 17, 41)]
    engine = make_engine(model, block_size=16)
    for i, prompt in enumerate(prompts):
        engine.add(i, prompt, SamplingParams(max_tokens=8, **GREEDY))
        assert engine.reserve(i, len(prompt) + 8)
    outputs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    schedule = [(i, len(p)) for i, p in enumerate(prompts)]  # all three prompts in a single forward
    for _ in range(8):
        out = engine.step(schedule)
        assert out.num_seqs == len(schedule)
        assert out.num_tokens == sum(n for _, n in schedule)
        for t in out.tokens:
            outputs[t.seq_id].append(t.token_id)
        schedule = [(i, 1) for i in range(len(prompts))]
    for i, prompt in enumerate(prompts):
        assert outputs[i] == hf_greedy(model, prompt, 8)


# ----- preemption -----


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_release_cache_then_recompute_continues_exactly_as_without_preemption(
    arch: str, caching: bool, tiny_model_builder: Callable[..., PreTrainedModel]
) -> None:
    model = tiny_model_builder(arch)
    vocab = model.config.vocab_size
    greedy_prompt, sampled_prompt, other_prompt = (random_prompt(n, 300 + n, vocab) for n in (11, 9, 6))
    greedy = SamplingParams(max_tokens=20, **GREEDY)
    seeded = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=20, seed=11)
    unpreempted_random = [t.token_id for t in run_alone(model, sampled_prompt, seeded)]

    engine = make_engine(model, max_rows=4, kv_cache_tokens=128, enable_prefix_caching=caching)
    driver = Driver(engine, token_budget=12, max_chunk=5)
    driver.add(0, greedy_prompt, greedy)
    driver.add(1, sampled_prompt, seeded)
    driver.add(2, other_prompt, greedy)
    for _ in range(8):
        driver.step()
    assert all(len(driver.outputs[s]) >= 3 for s in (0, 1))

    for s, prompt in ((0, greedy_prompt), (1, sampled_prompt)):
        blocks_before, free_before = engine.blocks.num_blocks(s), engine.blocks.pool.num_free
        driver.preempt(s)
        assert engine.blocks.pool.num_free == free_before + blocks_before
        assert engine.reserved_tokens(s) == 0
        # Prompt and outputs are recomputed, but for the full blocks of them still in the prefix cache.
        known = len(prompt) + len(driver.outputs[s])
        cached = (known - 1) // engine.block_size * engine.block_size if caching else 0
        assert (engine.num_computed(s), engine.num_pending(s)) == (cached, known - cached)
    # While they wait, another sequence joins and takes (some of) the freed blocks.
    driver.add(3, random_prompt(14, 399, vocab), greedy)
    for _ in range(4):
        driver.step()
    driver.resume(0)
    driver.resume(1)
    driver.run()

    assert driver.tokens(0) == hf_greedy(model, greedy_prompt, 20)
    assert driver.tokens(1) == unpreempted_random
    assert driver.tokens(2) == hf_greedy(model, other_prompt, 20)
    assert engine.cache_usage == 0.0


# ----- finishing -----


@pytest.fixture(scope="module")
def eos_case(tiny_llama: PreTrainedModel) -> tuple[list[int], list[int], int]:
    """(prompt, greedy continuation of 16, index k where a token first appears at k >= 2)."""
    prompt = random_prompt(9, 500, tiny_llama.config.vocab_size)
    reference = hf_greedy(tiny_llama, prompt, 16)
    k = next(k for k in range(2, 16) if reference[k] not in reference[:k])
    return prompt, reference, k


def test_eos_token_stops_with_stop_reason(tiny_llama: PreTrainedModel, eos_case) -> None:
    prompt, reference, k = eos_case
    out = run_alone(tiny_llama, prompt, SamplingParams(max_tokens=16, **GREEDY), eos_token_ids=[reference[k]])
    assert [t.token_id for t in out] == reference[: k + 1]  # the EOS token itself is returned
    assert [t.finish_reason for t in out] == [None] * k + [FinishReason.STOP]


def test_ignore_eos_generates_through_eos_until_max_tokens(tiny_llama: PreTrainedModel, eos_case) -> None:
    prompt, reference, k = eos_case
    params = SamplingParams(max_tokens=16, ignore_eos=True, **GREEDY)
    out = run_alone(tiny_llama, prompt, params, eos_token_ids=[reference[k]])
    assert [t.token_id for t in out] == reference
    assert [t.finish_reason for t in out] == [None] * 15 + [FinishReason.LENGTH]


def test_stop_token_ids_stop_even_with_ignore_eos(tiny_llama: PreTrainedModel, eos_case) -> None:
    prompt, reference, k = eos_case
    params = SamplingParams(max_tokens=16, stop_token_ids=(reference[k],), ignore_eos=True, **GREEDY)
    out = run_alone(tiny_llama, prompt, params)
    assert [t.token_id for t in out] == reference[: k + 1]
    assert out[-1].finish_reason is FinishReason.STOP


def test_max_tokens_finishes_with_length(tiny_llama: PreTrainedModel, eos_case) -> None:
    prompt, reference, _ = eos_case
    out = run_alone(tiny_llama, prompt, SamplingParams(max_tokens=5, **GREEDY))
    assert [t.token_id for t in out] == reference[:5]
    assert [t.finish_reason for t in out] == [None] * 4 + [FinishReason.LENGTH]


def test_max_tokens_one_finishes_on_the_prefill_token(tiny_llama: PreTrainedModel, eos_case) -> None:
    prompt, reference, _ = eos_case
    out = run_alone(tiny_llama, prompt, SamplingParams(max_tokens=1, **GREEDY))
    assert [(t.token_id, t.finish_reason) for t in out] == [(reference[0], FinishReason.LENGTH)]


def test_sequence_filling_max_model_len_finishes_with_length(tiny_llama: PreTrainedModel, eos_case) -> None:
    prompt, reference, _ = eos_case
    out = run_alone(tiny_llama, prompt, SamplingParams(max_tokens=7, **GREEDY), max_model_len=len(prompt) + 7)
    assert [t.token_id for t in out] == reference[:7]
    assert out[-1].finish_reason is FinishReason.LENGTH


# ----- input validation and capacity -----


def _assert_rejected_without_allocation(
    engine: Engine,
    prompt: list[int],
    params: SamplingParams,
    error: type[EngineInputError],
    match: str,
    field: InputField,
) -> None:
    free_blocks, free_rows = engine.blocks.pool.num_free, engine.num_free_rows
    with pytest.raises(error, match=match) as info:
        engine.add(42, prompt, params)
    assert info.value.field is field
    assert engine.blocks.pool.num_free == free_blocks
    assert engine.num_free_rows == free_rows
    assert not engine.has_sequence(42)


@pytest.mark.parametrize(
    ("prompt", "params", "match", "field"),
    [
        pytest.param([], SamplingParams(max_tokens=4), "empty", InputField.PROMPT, id="empty-prompt"),
        pytest.param(
            [1] * 60, SamplingParams(max_tokens=5), r"maximum context length is 64 tokens, but 65",
            InputField.MAX_TOKENS, id="prompt-plus-max-tokens-too-long",
        ),
        pytest.param([1] * 70, SamplingParams(max_tokens=1), r"maximum context length is 64", InputField.PROMPT,
                     id="prompt-alone-too-long"),
        pytest.param([1, 2, 160], SamplingParams(max_tokens=4), r"160 is outside the vocabulary \[0, 160\)",
                     InputField.PROMPT, id="token-id-at-vocab-size"),
        pytest.param([1, -1], SamplingParams(max_tokens=4), r"-1 is outside the vocabulary", InputField.PROMPT,
                     id="negative-token-id"),
        pytest.param([1, 2], SamplingParams(max_tokens=4, stop_token_ids=(999,)), r"999 is outside",
                     InputField.STOP_TOKEN_IDS, id="stop-token-id-outside-vocab"),
        pytest.param([1, 2], SamplingParams(max_tokens=4, logprobs=161), r"at most 160 alternatives",
                     InputField.LOGPROBS, id="more-logprobs-than-the-vocabulary"),
    ],
)  # fmt: skip
def test_bad_input_raises_engine_input_error_and_allocates_nothing(
    tiny_llama: PreTrainedModel, prompt: list[int], params: SamplingParams, match: str, field: InputField
) -> None:
    engine = make_engine(tiny_llama, max_rows=2, kv_cache_tokens=256, max_model_len=64)
    engine.add(1, [5, 6, 7], SamplingParams(max_tokens=4))  # something already running
    assert engine.reserve(1, 7)
    _assert_rejected_without_allocation(engine, prompt, params, EngineInputError, match, field)
    engine.add(42, [1, 2, 3], SamplingParams(max_tokens=4))  # the id is still free for a valid request


def test_too_many_stop_token_ids_is_rejected(tiny_llama: PreTrainedModel) -> None:
    engine = make_engine(tiny_llama, max_stop_token_ids=2)
    params = SamplingParams(max_tokens=4, stop_token_ids=(1, 2, 3))
    _assert_rejected_without_allocation(engine, [1], params, EngineInputError, "at most 2", InputField.STOP_TOKEN_IDS)


def test_sequence_larger_than_whole_cache_raises_cache_capacity_error(tiny_llama: PreTrainedModel) -> None:
    engine = make_engine(tiny_llama, kv_cache_tokens=16, block_size=4, max_model_len=128)
    params = SamplingParams(max_tokens=10)
    _assert_rejected_without_allocation(
        engine, [1] * 7, params, CacheCapacityError, "holds 16 tokens", InputField.MAX_TOKENS
    )
    engine.add(1, [1] * 6, params)  # exactly 16 tokens fits


def test_zero_max_tokens_is_rejected_by_sampling_params() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_reserve_is_all_or_nothing(tiny_llama: PreTrainedModel) -> None:
    engine = make_engine(tiny_llama, kv_cache_tokens=32, block_size=4)  # 8 blocks
    engine.add(1, [1] * 10, SamplingParams(max_tokens=4))
    engine.add(2, [1] * 10, SamplingParams(max_tokens=20))
    assert engine.reserve(1, 14)  # 4 blocks
    assert engine.reserved_tokens(1) == 16
    assert not engine.reserve(2, 30)  # needs 8, only 4 free
    assert engine.blocks.pool.num_free == 4 and engine.reserved_tokens(2) == 0
    assert engine.reserve(2, 16)
    assert engine.blocks.pool.num_free == 0 and engine.cache_usage == 1.0
    assert engine.reserve(1, 12)  # already covered: no-op


def test_step_rejects_schedule_beyond_reserved_cache(tiny_llama: PreTrainedModel) -> None:
    engine = make_engine(tiny_llama, block_size=4)
    engine.add(1, list(range(10)), SamplingParams(max_tokens=4, **GREEDY))
    assert engine.reserve(1, 8)
    with pytest.raises(ValueError, match="reserved cache"):
        engine.step([(1, 10)])
    assert engine.num_pending(1) == 10  # nothing was computed
    out = engine.step([(1, 8)])  # within the reservation it runs, without sampling yet
    assert out.tokens == () and engine.num_pending(1) == 2
    with pytest.raises(ValueError, match="reserved cache"):
        engine.step([(1, 2)])


def test_step_rejects_more_tokens_than_pending_or_duplicate_sequences(tiny_llama: PreTrainedModel) -> None:
    engine = make_engine(tiny_llama)
    engine.add(1, [1, 2, 3], SamplingParams(max_tokens=4))
    assert engine.reserve(1, 7)
    with pytest.raises(ValueError, match="pending"):
        engine.step([(1, 4)])
    with pytest.raises(ValueError, match="pending"):
        engine.step([(1, 0)])
    with pytest.raises(ValueError, match="twice"):
        engine.step([(1, 1), (1, 2)])
    assert engine.num_pending(1) == 3


def test_remove_frees_row_and_blocks(tiny_llama: PreTrainedModel) -> None:
    engine = make_engine(tiny_llama, max_rows=3, kv_cache_tokens=64, block_size=4)
    free_blocks, free_rows = engine.blocks.pool.num_free, engine.num_free_rows
    assert engine.cache_usage == 0.0
    driver = Driver(engine)
    driver.add(1, list(range(9)), SamplingParams(max_tokens=10, **GREEDY))
    driver.add(2, list(range(5)), SamplingParams(max_tokens=10, **GREEDY))
    for _ in range(4):
        driver.step()
    assert engine.num_free_rows == free_rows - 2
    assert engine.blocks.pool.num_free < free_blocks and engine.cache_usage > 0
    engine.remove(1)
    engine.remove(2)
    assert not engine.has_sequence(1) and not engine.has_sequence(2)
    assert engine.num_free_rows == free_rows
    assert engine.blocks.pool.num_free == free_blocks
    assert engine.cache_usage == 0.0
    engine.remove(1)  # idempotent
    assert engine.num_free_rows == free_rows


def test_rows_run_out_at_the_configured_number(tiny_llama: PreTrainedModel) -> None:
    engine = make_engine(tiny_llama, max_rows=2)
    engine.add(1, [1], SamplingParams())
    engine.add(2, [1], SamplingParams())
    with pytest.raises(RuntimeError, match="no free engine row"):
        engine.add(3, [1], SamplingParams())
    with pytest.raises(ValueError, match="already"):
        engine.add(2, [1], SamplingParams())
    engine.remove(1)
    engine.add(3, [1], SamplingParams())


# ----- sampling through the engine -----


def test_seeded_sampling_is_the_same_alone_and_beside_other_sequences(tiny_qwen2: PreTrainedModel) -> None:
    vocab = tiny_qwen2.config.vocab_size
    prompt = random_prompt(12, 600, vocab)
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=20, seed=7)
    alone = [t.token_id for t in run_alone(tiny_qwen2, prompt, params)]
    assert alone != hf_greedy(tiny_qwen2, prompt, 16)  # it really sampled

    driver = Driver(make_engine(tiny_qwen2), token_budget=10, max_chunk=4)
    driver.add(1, random_prompt(20, 601, vocab), SamplingParams(max_tokens=20, temperature=1.0))  # unseeded
    driver.add(2, random_prompt(5, 602, vocab), SamplingParams(max_tokens=20, **GREEDY))
    driver.add(3, random_prompt(8, 603, vocab), SamplingParams(max_tokens=20, temperature=0.7, seed=8))
    for _ in range(3):
        driver.step()
    driver.add(0, prompt, params)  # joins late, in a different row, and is prefilled in chunks
    driver.run()
    assert driver.tokens(0) == alone


def test_same_seed_reproduces_and_different_seed_differs(tiny_llama: PreTrainedModel) -> None:
    prompt = random_prompt(6, 610, tiny_llama.config.vocab_size)
    runs = {
        seed: [t.token_id for t in run_alone(tiny_llama, prompt, SamplingParams(max_tokens=12, seed=seed))]
        for seed in (1, 2)
    }
    assert runs[1] == [t.token_id for t in run_alone(tiny_llama, prompt, SamplingParams(max_tokens=12, seed=1))]
    assert runs[1] != runs[2]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logprobs_match_hf_log_softmax_and_top_alternatives_are_sorted(
    arch: str, tiny_model_builder: Callable[..., PreTrainedModel]
) -> None:
    model = tiny_model_builder(arch)
    prompt = random_prompt(10, 700, model.config.vocab_size)
    driver = Driver(make_engine(model), max_chunk=4)
    driver.add(0, prompt, SamplingParams(max_tokens=8, logprobs=3, **GREEDY))
    other_prompt = random_prompt(5, 701, model.config.vocab_size)
    driver.add(1, other_prompt, SamplingParams(max_tokens=8, logprobs=3, seed=1))
    driver.run()
    out = driver.outputs[0]
    tokens = [t.token_id for t in out]
    reference = hf_log_softmax(model, prompt + tokens)
    for i, t in enumerate(out):
        row = reference[len(prompt) - 1 + i]
        assert t.logprob == pytest.approx(float(row[t.token_id]), abs=1e-4)
        assert t.top_logprobs is not None and len(t.top_logprobs) == 3
        ids, values = zip(*t.top_logprobs, strict=True)
        assert list(values) == sorted(values, reverse=True)
        assert ids[0] == t.token_id and values[0] == pytest.approx(t.logprob)
        hf_values, hf_ids = row.topk(3)
        assert list(ids) == hf_ids.tolist()
        assert values == pytest.approx(hf_values.tolist(), abs=1e-4)

    # A sampled token's logprob is its own under the model's distribution, wherever it ranks.
    sampled = driver.outputs[1]
    sampled_ref = hf_log_softmax(model, other_prompt + [t.token_id for t in sampled])
    for i, t in enumerate(sampled):
        assert t.logprob == pytest.approx(float(sampled_ref[len(other_prompt) - 1 + i, t.token_id]), abs=1e-4)


def test_logprobs_zero_reports_the_chosen_token_only_and_none_reports_nothing(
    tiny_llama: PreTrainedModel,
) -> None:
    prompt = random_prompt(4, 710, tiny_llama.config.vocab_size)
    with_chosen = run_alone(tiny_llama, prompt, SamplingParams(max_tokens=3, logprobs=0, **GREEDY))
    assert all(t.logprob is not None and not t.top_logprobs for t in with_chosen)
    without = run_alone(tiny_llama, prompt, SamplingParams(max_tokens=3, **GREEDY))
    assert all(t.logprob is None and t.top_logprobs is None for t in without)


def _penalised_greedy_reference(
    model: PreTrainedModel, prompt: list[int], n: int, presence: float, frequency: float
) -> list[int]:
    """Greedy decoding on HF logits minus OpenAI-style penalties over the generated tokens only."""
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float()
            logits = logits - frequency * counts - presence * (counts > 0).float()
            out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize(("presence", "frequency"), [(0.0, 2.0), (1.5, 0.0), (0.5, 1.0), (2.0, 2.0)])
def test_penalties_match_reference_and_change_greedy_output(
    tiny_qwen2: PreTrainedModel, presence: float, frequency: float
) -> None:
    prompt = random_prompt(8, 800, tiny_qwen2.config.vocab_size)
    plain = hf_greedy(tiny_qwen2, prompt, 16)
    assert len(set(plain)) < len(plain)  # unpenalised greedy repeats itself on this prompt
    params = SamplingParams(max_tokens=16, presence_penalty=presence, frequency_penalty=frequency, **GREEDY)
    penalised = [t.token_id for t in run_alone(tiny_qwen2, prompt, params)]
    assert penalised == _penalised_greedy_reference(tiny_qwen2, prompt, 16, presence, frequency)
    assert penalised != plain


def test_strong_frequency_penalty_avoids_repeating_tokens(tiny_qwen2: PreTrainedModel) -> None:
    prompt = random_prompt(8, 800, tiny_qwen2.config.vocab_size)
    params = SamplingParams(max_tokens=16, frequency_penalty=2.0, presence_penalty=2.0, **GREEDY)
    out = [t.token_id for t in run_alone(tiny_qwen2, prompt, params)]
    assert len(set(out)) == len(out)
