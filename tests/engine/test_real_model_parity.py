"""Parity with transformers on the real SmolLM2-135M-Instruct (float32): the engine and both scheduling modes
give, token for token, what `generate()` gives for each prompt alone."""

from __future__ import annotations

import functools

import pytest

from api.runtime.offline import LLM
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.model_runner import TransformersRunner
from engine.sample.sampling_params import SamplingParams
from engine.weights.loader import LoadedModel
from scheduler.request import Outcome
from tests.reference_models import generate_exactly
from tests.server_harness import real_loaded_model

pytestmark = pytest.mark.slow

NEW_TOKENS = 48
TEXTS = [
    "Hi",
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "Explain photosynthesis to a child. " * 3,
    "def fibonacci(n):",
    "Once upon a time, in a kingdom by the sea, " * 12,
    "Q: What is 2+2?\nA:",
    "The history of the Roman Empire spans many centuries and " * 20,
]


@functools.cache
def _prompts() -> list[list[int]]:
    tokenizer = real_loaded_model().tokenizer
    return [list(tokenizer(text)["input_ids"]) for text in TEXTS]


@functools.cache
def _reference(index: int) -> list[int]:
    """Greedy continuation of one prompt alone, by transformers."""
    return generate_exactly(real_loaded_model().model, _prompts()[index], NEW_TOKENS)


def test_prompts_span_a_few_to_hundreds_of_tokens() -> None:
    lengths = [len(p) for p in _prompts()]
    assert min(lengths) <= 3 and max(lengths) >= 200 and len(lengths) >= 8


def test_engine_greedy_matches_generate_with_sequences_joining_and_leaving() -> None:
    loaded = real_loaded_model()
    prompts = _prompts()
    engine = Engine(
        TransformersRunner(loaded.model),
        EngineConfig(seats=4, kv_cache_tokens=4096),
        loaded.eos_token_ids,
        loaded.max_model_len,
    )
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    active: list[int] = []
    next_prompt, step = 0, 0
    while next_prompt < len(prompts) or active:
        # A new sequence joins every third step while a row is free; long prompts prefill in 64-token chunks.
        if next_prompt < len(prompts) and engine.num_free_seats and (step % 3 == 0 or not active):
            engine.add(next_prompt, prompts[next_prompt], params)
            assert engine.reserve(next_prompt, len(prompts[next_prompt]) + NEW_TOKENS)
            active.append(next_prompt)
            next_prompt += 1
        output = engine.step([(i, min(engine.num_pending(i), 64)) for i in active])
        step += 1
        for token in output.tokens:
            outputs[token.seq_id].append(token.token_id)
            if token.finish_reason is not None:
                active.remove(token.seq_id)
                engine.remove(token.seq_id)
    assert engine.cache_usage == 0
    for index in range(len(prompts)):
        assert outputs[index] == _reference(index), f"prompt {index} diverged"


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return real_loaded_model()


@pytest.mark.parametrize("mode", ["dynamic", "continuous"])
def test_both_modes_give_generate_greedy_text(loaded: LoadedModel, mode: str) -> None:
    prompts = _prompts()[:6]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(
        mode=mode, loaded=loaded, max_batch_size=4, max_num_seqs=4, max_num_batched_tokens=64, batch_timeout_ms=0.0
    ) as llm:
        outputs = llm.generate(prompts, params)
    for index, output in enumerate(outputs):
        assert output.token_ids == _reference(index), f"{mode}: prompt {index} diverged"
        assert output.finish_reason is Outcome.LENGTH


def test_seeded_sampling_is_the_same_alone_and_beside_others(loaded: LoadedModel) -> None:
    prompts = _prompts()
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    others = [SamplingParams(max_tokens=24, temperature=1.0, seed=s) for s in range(3)]
    with LLM(mode="continuous", loaded=loaded, max_num_seqs=4) as llm:
        alone = llm.generate([prompts[1]], seeded)[0].token_ids
        crowded = llm.generate(
            [prompts[4], prompts[1], prompts[2], prompts[3]], [others[0], seeded, others[1], others[2]]
        )[1].token_ids
    assert alone == crowded


@pytest.mark.parametrize("mode", ["static", "dynamic", "continuous"])
def test_ngram_speculation_gives_generate_greedy_text(loaded: LoadedModel, mode: str) -> None:
    """Every mode with n-gram drafts (docs/speculative.md): the prompts that repeat get drafts accepted, and every
    output is still `generate()`'s."""
    from engine.spec.config import SpeculativeConfig

    indices = (1, 3, 4, 6)
    prompts = [_prompts()[i] for i in indices]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4, draft_length="fixed")
    with LLM(
        mode=mode, loaded=loaded, max_batch_size=4, max_num_seqs=4, max_num_batched_tokens=64, batch_timeout_ms=0.0,
        batch_window_ms=1.0, speculative=spec,
    ) as llm:  # fmt: skip
        outputs = llm.generate(prompts, params)
    for index, output in zip(indices, outputs, strict=True):
        assert output.token_ids == _reference(index), f"{mode}: prompt {index} diverged"
    assert sum(output.timings.num_accepted_tokens for output in outputs) > 0


def test_ngram_speculation_keeps_seeded_sampled_output(loaded: LoadedModel) -> None:
    """Seeded sampling with top-p and top-k, drafts on and off, in continuous mode: the same tokens, and some drafts
    accepted (each position draws with the plain step's (seed, output index), engine/spec/verify.py)."""
    from engine.spec.config import SpeculativeConfig

    prompts = [_prompts()[i] for i in (1, 4, 6)]
    params = [SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, top_k=40, seed=s) for s in (3, 4, 5)]
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4, draft_length="fixed")
    runs = []
    for speculative in (None, spec):
        with LLM(mode="continuous", loaded=loaded, max_num_seqs=4, speculative=speculative) as llm:
            runs.append(llm.generate(prompts, params))
    assert [o.token_ids for o in runs[1]] == [o.token_ids for o in runs[0]]
    assert sum(o.timings.num_accepted_tokens for o in runs[1]) > 0
