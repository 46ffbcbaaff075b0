"""Prefix caching in the engine on float32 tiny models: a repeated or extended prompt computes only its new
tokens, and every output is token for token what it is with caching off (and what HF generate() gives)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from transformers import PreTrainedModel

from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.model_runner import TransformersRunner
from engine.sample.sampling_params import SamplingParams
from tests.engine.helpers import GREEDY, Driver, hf_greedy, make_engine, random_prompt
from tests.reference_models import generate_exactly
from tests.server_harness import real_loaded_model

ARCHS = ["llama", "qwen2"]


def serve_one(driver: Driver, seq_id: int, prompt: list[int], params: SamplingParams, salt: str | None = None) -> int:
    """Run one sequence to its end; the prompt tokens it found cached."""
    driver.engine.add(seq_id, prompt, params, salt)
    driver.outputs[seq_id] = []
    cached = driver.engine.num_computed(seq_id)
    driver.run()
    return cached


@pytest.mark.parametrize("arch", ARCHS)
def test_a_conversation_computes_only_its_new_tokens_and_answers_as_without_cache(
    arch: str, tiny_model_builder: Callable[..., PreTrainedModel]
) -> None:
    model = tiny_model_builder(arch)
    vocab = model.config.vocab_size
    system = random_prompt(21, 1, vocab)
    greedy = SamplingParams(max_tokens=8, **GREEDY)
    cached_runs, plain_runs = Driver(make_engine(model)), Driver(make_engine(model, enable_prefix_caching=False))
    history = list(system)
    for turn in range(3):
        history += random_prompt(5, 10 + turn, vocab)  # the user's new message
        hits = [serve_one(driver, turn, history, greedy) for driver in (cached_runs, plain_runs)]
        expected = hf_greedy(model, history, 8)
        assert cached_runs.tokens(turn) == plain_runs.tokens(turn) == expected
        # Turn 0 finds nothing; later turns find every full block the previous turn computed (block_size 4): its
        # prompt and its answer but the answer's last token, which was sampled and never computed.
        computed_before = len(history) - 5 - 1
        expected_hit = min(computed_before // 4, (len(history) - 1) // 4) * 4 if turn else 0
        assert hits == [expected_hit, 0]
        history += expected
    engine = cached_runs.engine
    assert 0 < engine.blocks.hits < engine.blocks.queries
    assert plain_runs.engine.blocks.queries == plain_runs.engine.blocks.hits == 0  # nothing looked up
    assert engine.cache_usage == 0.0 and engine.blocks.pool.num_cached_free > 0


def test_a_repeated_prompt_recomputes_only_its_last_block(tiny_llama: PreTrainedModel) -> None:
    prompt = random_prompt(16, 3, tiny_llama.config.vocab_size)
    greedy = SamplingParams(max_tokens=6, **GREEDY)
    driver = Driver(make_engine(tiny_llama))
    assert serve_one(driver, 0, prompt, greedy) == 0
    assert serve_one(driver, 1, prompt, greedy) == 12  # 16 tokens: the block holding the last one is recomputed
    assert driver.tokens(0) == driver.tokens(1) == hf_greedy(tiny_llama, prompt, 6)
    assert driver.steps[-6] == [(1, 4)]  # its prefill: one block


def test_sequences_running_together_share_a_computed_prefix(tiny_llama: PreTrainedModel) -> None:
    vocab = tiny_llama.config.vocab_size
    shared = random_prompt(12, 4, vocab)
    greedy = SamplingParams(max_tokens=10, **GREEDY)
    driver = Driver(make_engine(tiny_llama), token_budget=64, max_chunk=64)
    driver.add(0, [*shared, 1], greedy)
    driver.step()  # its prompt is computed and registered
    driver.add(1, [*shared, 2], greedy)
    assert driver.engine.num_computed(1) == 12
    driver.run()
    assert driver.tokens(0) == hf_greedy(tiny_llama, [*shared, 1], 10)
    assert driver.tokens(1) == hf_greedy(tiny_llama, [*shared, 2], 10)


def test_different_salts_never_share_a_block(tiny_llama: PreTrainedModel) -> None:
    prompt = random_prompt(13, 5, tiny_llama.config.vocab_size)
    greedy = SamplingParams(max_tokens=3, **GREEDY)
    driver = Driver(make_engine(tiny_llama))
    assert serve_one(driver, 0, prompt, greedy, salt="alice") == 0
    assert serve_one(driver, 1, prompt, greedy, salt="bob") == 0
    assert serve_one(driver, 2, prompt, greedy) == 0
    assert serve_one(driver, 3, prompt, greedy, salt="alice") == 12
    assert len({tuple(driver.tokens(s)) for s in range(4)}) == 1


def test_prompt_logprobs_never_read_the_cache_but_fill_it(tiny_llama: PreTrainedModel) -> None:
    prompt = random_prompt(13, 6, tiny_llama.config.vocab_size)
    scored = SamplingParams(max_tokens=2, prompt_logprobs=3, **GREEDY)
    results = []
    for caching in (True, False):
        driver = Driver(make_engine(tiny_llama, enable_prefix_caching=caching))
        serve_one(driver, 0, prompt, SamplingParams(max_tokens=2, **GREEDY))  # fills the cache
        assert serve_one(driver, 1, prompt, scored) == 0  # reads nothing
        assert serve_one(driver, 2, prompt, SamplingParams(max_tokens=2, **GREEDY)) == (12 if caching else 0)
        results.append(driver.engine)
    assert results[0].blocks.hits == 12


def test_evicting_cached_blocks_under_pressure_keeps_every_answer_exact(tiny_llama: PreTrainedModel) -> None:
    """A cache that holds about two sequences: cached blocks are evicted as new ones are needed."""
    vocab = tiny_llama.config.vocab_size
    prompts = [random_prompt(18, 20 + i % 3, vocab) for i in range(9)]  # three prompts, each sent three times
    greedy = SamplingParams(max_tokens=6, **GREEDY)
    driver = Driver(make_engine(tiny_llama, kv_cache_tokens=48), token_budget=8, max_chunk=8)
    hits = [serve_one(driver, i, prompt, greedy) for i, prompt in enumerate(prompts)]
    for i, prompt in enumerate(prompts):
        assert driver.tokens(i) == hf_greedy(tiny_llama, prompt, 6)
    assert hits[:3] == [0, 0, 0] and sum(hits[3:]) > 0
    assert driver.engine.cache_usage == 0.0


def test_a_prefix_whose_first_block_was_evicted_first_is_cached_whole_again(tiny_llama: PreTrainedModel) -> None:
    """The eviction order forced: the prefix's first block is evicted while its later blocks stay parked. The
    prompt computed again is registered whole, so the next request reads all of it, and every answer is what
    caching off gives."""
    prompt = random_prompt(20, 7, tiny_llama.config.vocab_size)  # five blocks of 4
    greedy = SamplingParams(max_tokens=4, **GREEDY)
    driver = Driver(make_engine(tiny_llama, kv_cache_tokens=64))
    pool = driver.engine.blocks.pool
    assert serve_one(driver, 0, prompt, greedy) == 0
    head, *rest = driver.engine.blocks.match([*prompt, 0], None, reads=True).blocks
    assert len(rest) == 4
    pool.acquire(rest)  # used again and released: the head is now the least recently released
    pool.free(rest)
    taken = pool.allocate(pool.num_free - pool.num_cached_free + 1)  # every plain free block, then one eviction
    assert taken is not None and taken[-1] == head
    pool.free(taken)
    assert serve_one(driver, 1, prompt, greedy) == 0  # the head is gone: nothing to read
    assert serve_one(driver, 2, prompt, greedy) == 16  # the block holding the last token is always computed
    plain = Driver(make_engine(tiny_llama, enable_prefix_caching=False))
    serve_one(plain, 0, prompt, greedy)
    expected = hf_greedy(tiny_llama, prompt, 4)
    assert driver.tokens(0) == driver.tokens(1) == driver.tokens(2) == plain.tokens(0) == expected


@pytest.mark.slow
def test_real_model_conversation_is_the_same_with_caching_on_and_off() -> None:
    """SmolLM2-135M float32: three turns re-sending the history, then a preempted and resumed turn; greedy
    answers equal generate()'s for each prompt alone, whether the prefix is read from the cache or computed."""
    loaded = real_loaded_model()
    tokenizer = loaded.tokenizer
    system = tokenizer("You are a helpful assistant who answers briefly. " * 6)["input_ids"]
    questions = ["What is the capital of France?", " And of Italy?", " Which one is larger?"]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    runner = TransformersRunner(loaded.model)
    engines = {
        caching: Engine(
            runner,
            EngineConfig(max_rows=2, kv_cache_tokens=2048, enable_prefix_caching=caching),
            loaded.eos_token_ids,
            loaded.max_model_len,
        )
        for caching in (True, False)
    }
    history = list(system)
    for turn, question in enumerate(questions):
        history += tokenizer(question, add_special_tokens=False)["input_ids"]
        answers = {}
        for caching, engine in engines.items():
            driver = Driver(engine, token_budget=64, max_chunk=64)
            driver.add(turn, history, greedy)
            if turn == 2:  # preempted after its prefill and a few tokens, then resumed
                for _ in range(4):
                    driver.step()
                driver.preempt(turn)
                driver.resume(turn)
            driver.run()
            answers[caching] = driver.tokens(turn)
        reference = generate_exactly(loaded.model, history, 12)
        assert answers[True] == answers[False] == reference, f"turn {turn}"
        history += reference
    assert engines[True].blocks.hits > len(system)
    assert engines[False].blocks.hits == 0
