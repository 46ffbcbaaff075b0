"""Prompt logprobs (`SamplingParams.prompt_logprobs`): each prompt token's logprob, rank and top alternatives.

The reference is the transformers model's own full forward on the prompt: log_softmax at position p - 1 rates
the token at p. The engine scores prompt chunks as they are prefilled (continuous mode) or whole prompts in one
step (dynamic mode), in LM-head slices of bounded size, and delivers every position exactly once, even when a
preempted prompt is recomputed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from transformers import PreTrainedModel

from api.protocol.openai_api import MAX_LOGPROBS
from api.runtime.offline import LLM
from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import EngineInputError, InputField
from engine.model.model_runner import TransformersRunner
from engine.model.prompt_scoring import score_positions
from engine.outputs import PromptLogprobs
from engine.platform import native
from engine.sample.sampling_params import SamplingParams
from scheduler.config import Mode, SchedulerConfig
from scheduler.core import Scheduler
from scheduler.request import Outcome, PromptLogprobsEvent, SequenceRequest, TokenEvent
from tests.fakes import FakeClock, Stream, build, scripted_prompt_score, step_until_done
from tests.server_harness import real_loaded_model, tiny_loaded_model
from tests.toolchain import CAN_BUILD_KERNELS, NO_TOOLCHAIN

ARCHS = ("llama", "qwen2", "mistral")
TOLERANCE = 1e-4
# Skipped only where nothing could build the kernels; where a compiler is present a broken build fails them.
needs_kernel = pytest.mark.skipif(not CAN_BUILD_KERNELS, reason=NO_TOOLCHAIN)


def random_prompt(length: int, seed: int, vocab_size: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


@torch.inference_mode()
def hf_log_softmax(model: PreTrainedModel, ids: Sequence[int]) -> torch.Tensor:
    """[len(ids), vocab]: row p is the model's next-token distribution after ids[: p + 1]."""
    return torch.log_softmax(model(torch.tensor([list(ids)])).logits[0].float(), dim=-1)


def hf_greedy(model: PreTrainedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    settings = dict(attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    out = model.generate(ids, **settings)  # type: ignore[operator]
    return out[0, len(prompt) :].tolist()


def joined(parts: Sequence[PromptLogprobs]) -> PromptLogprobs:
    """The parts of one prompt, checked to be consecutive from position 1 (each position once)."""
    scores = PromptLogprobs.join(parts)
    assert scores.first_position == 1
    return scores


def assert_matches_reference(scores: PromptLogprobs, prompt: list[int], reference: torch.Tensor, k: int) -> None:
    """Every position 1..len-1, exactly once, with HF's logprob, rank and top-k (ids, then values)."""
    assert list(scores.positions) == list(range(1, len(prompt)))
    assert list(scores.token_ids) == prompt[1:]
    for i, position in enumerate(scores.positions):
        row = reference[position - 1]
        actual = row[prompt[position]]
        assert scores.logprobs[i] == pytest.approx(float(actual), abs=TOLERANCE), f"position {position}"
        assert scores.ranks[i] == 1 + int((row > actual).sum()), f"position {position}"
        values, ids = row.topk(k)
        assert [t for t, _ in scores.top[i]] == ids.tolist(), f"position {position}"
        assert [v for _, v in scores.top[i]] == pytest.approx(values.tolist(), abs=TOLERANCE)


def run_scheduler(
    model: PreTrainedModel,
    mode: Mode,
    prompts: list[list[int]],
    params: list[SamplingParams],
    *,
    budget: int = 512,
    kv_cache_tokens: int = 1024,
) -> list[Stream]:
    """The real scheduler and engine, stepped synchronously until every request is released."""
    rows = len(prompts)  # an engine row, and a scheduler seat, for each prompt
    engine = Engine(
        TransformersRunner(model), EngineConfig(max_rows=rows, kv_cache_tokens=kv_cache_tokens, block_size=4)
    )
    clock = FakeClock()
    config = SchedulerConfig(
        mode=mode, max_batch_size=rows, max_num_seqs=rows, batch_timeout_ms=0, max_num_batched_tokens=budget
    )
    scheduler = Scheduler(engine, config, clock=clock)
    streams = [Stream(str(i), p, q.max_tokens) for i, (p, q) in enumerate(zip(prompts, params, strict=True))]
    for stream, q in zip(streams, params, strict=True):
        scheduler.submit(SequenceRequest(stream.request_id, stream.prompt, q, stream))
    step_until_done(scheduler, clock, streams, max_steps=1000)
    assert all(s.reason is Outcome.LENGTH for s in streams)
    assert engine.cache_usage == 0 and engine.num_free_rows == rows
    return streams


# ----- parity with transformers, both modes -----


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logprobs_match_hf_in_both_modes_and_rows_that_dont_ask_are_untouched(
    arch: str, tiny_model_builder: Callable[..., PreTrainedModel]
) -> None:
    model = tiny_model_builder(arch)
    vocab = model.config.vocab_size
    lengths, wanted = (40, 23, 9, 2, 1), (3, None, 0, MAX_LOGPROBS, 2)
    prompts = [random_prompt(n, 900 + n, vocab) for n in lengths]
    params = [SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=k) for k in wanted]
    streams = {
        Mode.CONTINUOUS: run_scheduler(model, Mode.CONTINUOUS, prompts, params, budget=16),  # prompts span chunks
        Mode.DYNAMIC: run_scheduler(model, Mode.DYNAMIC, prompts, params),  # whole prompts in one step
    }
    # The 40-token prompt was scored chunk by chunk in continuous mode, in one step in dynamic mode.
    assert len(streams[Mode.CONTINUOUS][0].prompt_logprobs) >= 40 // 16
    assert len(streams[Mode.DYNAMIC][0].prompt_logprobs) == 1

    for mode, mode_streams in streams.items():
        for prompt, k, stream in zip(prompts, wanted, mode_streams, strict=True):
            assert stream.tokens == hf_greedy(model, prompt, 6), f"{mode.value}: scoring changed sampled tokens"
            if k is None or len(prompt) == 1:  # nothing asked, or nothing to score
                assert stream.prompt_logprobs == []
                assert all(isinstance(e, TokenEvent) for e in stream.events[:-1])
                continue
            first_token = next(i for i, e in enumerate(stream.events) if isinstance(e, TokenEvent))
            assert all(isinstance(e, PromptLogprobsEvent) for e in stream.events[:first_token])
            assert_matches_reference(joined(stream.prompt_logprobs), prompt, hf_log_softmax(model, prompt), k)

    for chunked, whole in zip(streams[Mode.CONTINUOUS], streams[Mode.DYNAMIC], strict=True):
        if not chunked.prompt_logprobs:
            continue
        a, b = joined(chunked.prompt_logprobs), joined(whole.prompt_logprobs)
        assert (a.token_ids, a.ranks) == (b.token_ids, b.ranks)
        assert [[t for t, _ in top] for top in a.top] == [[t for t, _ in top] for top in b.top]
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["cpu_kernels", "torch_only"])
def test_the_lm_head_runs_in_bounded_slices_over_a_whole_prompt(tiny_qwen2: PreTrainedModel, cpu_kernels: bool) -> None:
    vocab = tiny_qwen2.config.vocab_size
    runner = TransformersRunner(tiny_qwen2, prepack_weights=cpu_kernels, native_attention=cpu_kernels, score_slice=7)
    assert (runner.score_kernel is not None) == (cpu_kernels and CAN_BUILD_KERNELS)
    head = runner.lm_head
    rows_per_call: list[int] = []

    def recording_head(hidden: torch.Tensor) -> torch.Tensor:
        rows_per_call.append(int(hidden.shape[0]))
        return head(hidden)

    runner.lm_head = recording_head  # type: ignore[assignment]
    engine = Engine(runner, EngineConfig(max_rows=2, kv_cache_tokens=256, block_size=16))
    prompts = [random_prompt(60, 950, vocab), random_prompt(11, 951, vocab)]
    for seq_id, (prompt, k) in enumerate(zip(prompts, (2, None), strict=True)):
        engine.add(seq_id, prompt, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=k))
        assert engine.reserve(seq_id, len(prompt) + 2)
    out = engine.step([(0, 60), (1, 11)])  # both whole prompts in one step
    assert max(rows_per_call) == 7 and sum(rows_per_call) == 59 + 2  # 59 positions scored, 2 rows sampled
    assert [p.seq_id for p in out.prompt_logprobs] == [0]
    assert_matches_reference(joined(out.prompt_logprobs), prompts[0], hf_log_softmax(tiny_qwen2, prompts[0]), 2)


def test_offline_llm_collects_the_whole_prompts_scores() -> None:
    loaded = tiny_loaded_model("mistral")
    prompt = random_prompt(30, 960, len(loaded.tokenizer))
    params = [SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=1), SamplingParams(max_tokens=3)]
    with LLM(mode="continuous", loaded=loaded, max_num_seqs=2, max_num_batched_tokens=8) as llm:
        asked, plain = llm.generate([prompt, prompt[:5]], params)
    assert asked.prompt_logprobs is not None and plain.prompt_logprobs is None
    assert_matches_reference(asked.prompt_logprobs, prompt, hf_log_softmax(loaded.model, prompt), 1)


@needs_kernel
# k=100 is past what the kernel's own top-k takes (KERNEL_MAX_TOP_K): torch picks the alternatives.
@pytest.mark.parametrize(("vocab", "k"), [(49152, 1), (1000, 5), (300, 20), (37, 0), (1000, 100)])
def test_the_scoring_kernel_matches_the_torch_path_ties_included(kernels: native.Kernels, vocab: int, k: int) -> None:
    score_kernel = kernels.prompt_scores
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(40, vocab, generator=generator) * 4
    logits[:10] = logits[:10].round()  # many exact ties
    target = torch.randint(0, vocab, (40,), generator=generator)
    index = torch.arange(40)
    expected = score_positions(logits, index, target, k, lambda rows: rows, slice_size=16)
    got = score_positions(logits, index, target, k, lambda rows: rows, slice_size=16, kernel=score_kernel)
    assert torch.equal(got.ranks, expected.ranks)
    # The log-sum-exp over 49k logits in another order, with another exp than torch's on builds below AVX-512: a
    # row's normaliser (about 20) may differ by a few float32 ulps, shifting each of the row's logprobs as much.
    torch.testing.assert_close(got.logprobs, expected.logprobs, atol=3e-5, rtol=0)
    torch.testing.assert_close(got.top_logprobs, expected.top_logprobs, atol=3e-5, rtol=0)
    # Tied alternatives may come in either order, but each id must carry its own logprob, once.
    torch.testing.assert_close(expected_logprobs_of(logits, got.top_ids), got.top_logprobs, atol=3e-5, rtol=0)
    assert all(len(set(row)) == k for row in got.top_ids.tolist())


def expected_logprobs_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1).gather(1, ids)


@needs_kernel
def test_the_scoring_kernel_rejects_a_target_outside_the_vocabulary(kernels: native.Kernels) -> None:
    score_kernel = kernels.prompt_scores
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        score_kernel(torch.zeros(2, 10), torch.tensor([3, 10]), 1)


# ----- preemption: each position is delivered once -----


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_prompt_recomputed_after_preemption_is_not_scored_again(
    arch: str, tiny_model_builder: Callable[..., PreTrainedModel]
) -> None:
    model = tiny_model_builder(arch)
    prompt = random_prompt(30, 970, model.config.vocab_size)
    engine = Engine(TransformersRunner(model), EngineConfig(max_rows=2, kv_cache_tokens=128, block_size=4))
    engine.add(0, prompt, SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2))
    parts: list[PromptLogprobs] = []
    tokens: list[int] = []

    def run(count: int) -> None:
        assert engine.reserve(0, engine.num_computed(0) + count)
        out = engine.step([(0, count)])
        parts.extend(out.prompt_logprobs)
        tokens.extend(t.token_id for t in out.tokens)

    run(8)
    run(8)  # positions 1..16 delivered
    engine.release_cache(0)  # preempted mid-prefill: the prompt is recomputed from position 0
    run(12)  # recomputes 0..11: all its positions were delivered already
    assert len(parts) == 2
    run(10)  # 12..21: only 17..22 are new
    assert parts[-1].first_position == 17
    run(8)  # the rest of the prompt, and the first token
    run(1)
    engine.release_cache(0)  # preempted while decoding: prompt and outputs are recomputed, nothing is scored
    run(engine.num_pending(0))
    run(1)
    assert [p.first_position for p in parts] == [1, 9, 17, 23]
    assert tokens == hf_greedy(model, prompt, 4)
    assert_matches_reference(joined(parts), prompt, hf_log_softmax(model, prompt), 2)


def test_scheduler_preempting_mid_prefill_delivers_every_position_once() -> None:
    # Continuous mode, 7 blocks of 4: the decoding request (older) needs a block while the scored prompt is
    # half prefilled, so the newest (the scored one) is preempted and later recomputed from its start.
    h = build(Mode.CONTINUOUS, seats=2, kv_cache_tokens=28, block_size=4, max_num_batched_tokens=5)
    decoding = h.submit(prompt=4, max_tokens=20)
    scored = h.submit(prompt=20, max_tokens=2, prompt_logprobs=1)
    assert scored.request is not None
    while scored.request.num_preemptions == 0:
        assert h.step() is not None
    delivered = sum(len(p.token_ids) for p in scored.prompt_logprobs)
    assert 0 < delivered < 19 and not scored.tokens  # preempted mid-prefill
    h.run()
    assert decoding.reason is Outcome.LENGTH and scored.reason is Outcome.LENGTH
    assert decoding.prompt_logprobs == []
    scores = joined(scored.prompt_logprobs)
    assert list(scores.positions) == list(range(1, 20))
    assert list(scores.token_ids) == scored.prompt[1:]
    assert list(scores.logprobs) == [scripted_prompt_score(p) for p in scores.positions]
    assert sorted(h.runner.scored_positions) == list(range(1, 20))  # the runner never scored one twice
    assert h.runner.violations == []


# ----- parameters -----


def test_negative_prompt_logprobs_are_rejected() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs must be at least 0"):
        SamplingParams(prompt_logprobs=-1)


def test_the_engine_rejects_more_prompt_alternatives_than_the_vocabulary(tiny_qwen2: PreTrainedModel) -> None:
    engine = Engine(TransformersRunner(tiny_qwen2), EngineConfig(max_rows=1, kv_cache_tokens=64, block_size=4))
    vocab = engine.runner.vocab_size
    with pytest.raises(EngineInputError, match=f"at most {vocab} alternatives") as info:
        engine.add(0, [1, 2], SamplingParams(prompt_logprobs=vocab + 1))
    assert info.value.field is InputField.PROMPT_LOGPROBS and not engine.has_sequence(0)
    engine.add(0, [1, 2], SamplingParams(prompt_logprobs=vocab))  # every token of the vocabulary is fine


# ----- the real model -----


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["continuous", "dynamic"])
def test_real_model_prompt_logprobs_match_hf_forward(mode: str) -> None:
    loaded = real_loaded_model()
    texts = ["The capital of France is", "The history of the Roman Empire spans many centuries and " * 20]
    prompts = [list(loaded.tokenizer(text)["input_ids"]) for text in texts]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=5)
    with LLM(mode=mode, loaded=loaded, max_num_seqs=2, max_batch_size=2, max_num_batched_tokens=64) as llm:
        outputs = llm.generate(prompts, params)
    assert max(map(len, prompts)) > 64  # continuous mode scores the long prompt across several chunks
    for prompt, output in zip(prompts, outputs, strict=True):
        scores = output.prompt_logprobs
        assert scores is not None and list(scores.token_ids) == prompt[1:]
        reference = hf_log_softmax(loaded.model, prompt)
        for i, position in enumerate(scores.positions):
            row = reference[position - 1]
            actual = float(row[prompt[position]])
            assert scores.logprobs[i] == pytest.approx(actual, abs=TOLERANCE), f"position {position}"
            # 49152 entries: ties within the tolerance may order either way, so the rank is bracketed.
            assert (
                1 + int((row > actual + TOLERANCE).sum())
                <= scores.ranks[i]
                <= 1 + int((row > actual - TOLERANCE).sum())
            )
            top_values = [v for _, v in scores.top[i]]
            assert top_values == pytest.approx(row.topk(5).values.tolist(), abs=TOLERANCE)
            assert [float(row[t]) for t, _ in scores.top[i]] == pytest.approx(top_values, abs=TOLERANCE)
