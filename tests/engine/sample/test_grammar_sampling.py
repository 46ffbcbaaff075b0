"""Grammars in the batched sampler: constrained rows against a reference mask, free rows untouched, the end of a
grammar stopping its row, preemption keeping the grammar's place, and the packed bitmask's layout.

The reference: a grammar that allows the same token set at every step must give exactly what `allowed_token_ids`
with that set gives (the same mask through the existing, separately tested edit), greedy and seeded alike. A row
without a grammar must get bit-identical tokens and logprobs whether or not constrained rows share its steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers import PreTrainedModel

from engine.errors import InputField, SamplingParamsError
from engine.outputs import FinishReason
from engine.sample.grammar import fill_bitmasks, unpack_bitmask, words_for
from engine.sample.sampling_params import SamplingParams
from tests.engine.helpers import Driver, SetGrammar, SetMatcher, make_engine, random_prompt

GREEDY = {"temperature": 0.0}


def _run(model: PreTrainedModel, requests: dict[int, tuple[list[int], SamplingParams]], **engine_kw) -> Driver:
    driver = Driver(make_engine(model, **engine_kw), token_budget=12, max_chunk=5)
    for seq_id, (prompt, params) in requests.items():
        driver.add(seq_id, prompt, params)
    driver.run()
    return driver


@pytest.mark.parametrize("sampling", [GREEDY, {"temperature": 0.8, "top_p": 0.9, "seed": 5}], ids=["greedy", "seeded"])
def test_a_set_grammar_samples_exactly_what_allowed_token_ids_does_and_free_rows_are_untouched(
    tiny_llama: PreTrainedModel, sampling: dict
) -> None:
    vocab = tiny_llama.config.vocab_size
    allowed = frozenset(range(3, vocab, 7))
    prompts = [random_prompt(n, 40 + n, vocab) for n in (9, 5, 12, 7)]
    free = SamplingParams(max_tokens=12, logprobs=3, **sampling)
    constrained = SamplingParams(max_tokens=12, logprobs=3, grammar=SetGrammar(allowed), **sampling)
    by_mask = SamplingParams(max_tokens=12, logprobs=3, allowed_token_ids=tuple(sorted(allowed)), **sampling)

    mixed = _run(tiny_llama, {i: (p, constrained if i % 2 else free) for i, p in enumerate(prompts)})
    reference = _run(tiny_llama, {i: (p, by_mask if i % 2 else free) for i, p in enumerate(prompts)})
    free_alone = _run(tiny_llama, {i: (p, free) for i, p in enumerate(prompts) if i % 2 == 0})

    for i in range(len(prompts)):
        assert mixed.tokens(i) == reference.tokens(i)
        if i % 2:
            assert set(mixed.tokens(i)) <= allowed
        else:
            # Bit-identical, logprobs and alternatives too, to the same batch constrained through the mask path:
            # every step has the same inputs. A batch without the constrained rows gives the same tokens, but its
            # logprobs may differ in the last bits: another batch size runs another matmul blocking on some CPUs
            # (AVX2 MKL).
            assert mixed.outputs[i] == reference.outputs[i]
            assert mixed.tokens(i) == free_alone.tokens(i)
            got = [t.logprob for t in mixed.outputs[i]]
            assert got == pytest.approx([t.logprob for t in free_alone.outputs[i]], abs=1e-5)
    # Logprobs stay those of the raw distribution, as with allowed_token_ids.
    assert [t.logprob for t in mixed.outputs[1]] == [t.logprob for t in reference.outputs[1]]


def test_the_end_of_the_grammar_stops_the_row_and_every_token_reaches_its_matcher(
    tiny_llama: PreTrainedModel,
) -> None:
    vocab = tiny_llama.config.vocab_size
    grammar = SetGrammar(frozenset(range(10, 20)), length=4, end=vocab - 1)
    prompt = random_prompt(6, 7, vocab)
    driver = _run(tiny_llama, {0: (prompt, SamplingParams(max_tokens=50, grammar=grammar, **GREEDY))})
    tokens = driver.tokens(0)
    assert len(tokens) == 5 and set(tokens[:4]) <= set(range(10, 20)) and tokens[4] == vocab - 1
    assert driver.finished[0] is FinishReason.STOP  # not EOS, not a stop id: the grammar ended it
    assert grammar.made[0].accepted == tokens
    # ignore_eos does not run a sequence past its grammar
    driver = _run(tiny_llama, {0: (prompt, SamplingParams(max_tokens=50, grammar=grammar, ignore_eos=True, **GREEDY))})
    assert driver.tokens(0) == tokens


def test_preemption_keeps_the_grammar_in_step_with_the_row(tiny_llama: PreTrainedModel) -> None:
    """The row keeps its tokens, so the recomputed sequence samples only past them: the matcher saw each once."""
    vocab = tiny_llama.config.vocab_size
    allowed = frozenset(range(0, vocab, 3))
    prompt = random_prompt(10, 3, vocab)
    alone = _run(tiny_llama, {0: (prompt, SamplingParams(max_tokens=16, grammar=SetGrammar(allowed), **GREEDY))})

    grammar = SetGrammar(allowed)
    driver = Driver(make_engine(tiny_llama, max_rows=4, kv_cache_tokens=128), token_budget=12, max_chunk=5)
    driver.add(0, prompt, SamplingParams(max_tokens=16, grammar=grammar, **GREEDY))
    for _ in range(6):
        driver.step()
    driver.preempt(0)
    driver.add(1, random_prompt(14, 9, vocab), SamplingParams(max_tokens=4, **GREEDY))
    for _ in range(3):
        driver.step()
    driver.resume(0)
    driver.run()
    assert driver.tokens(0) == alone.tokens(0)
    assert grammar.made[0].accepted == driver.tokens(0)


def test_removing_a_constrained_sequence_frees_its_matcher_and_row(tiny_llama: PreTrainedModel) -> None:
    engine = make_engine(tiny_llama)
    engine.add(5, [1, 2, 3], SamplingParams(grammar=SetGrammar(frozenset({4}))))
    assert engine.rows.constrained[engine.rows.row(5)]
    engine.remove(5)
    assert engine._matcher_of == {}
    engine.add(6, [1, 2, 3], SamplingParams())  # the same row, now free
    assert not engine.rows.constrained[engine.rows.row(6)]


@pytest.mark.parametrize("field_name", ["min_tokens", "allowed_token_ids"])
def test_fields_that_could_leave_a_constrained_row_no_token_are_refused(field_name: str) -> None:
    value = {"min_tokens": 2, "allowed_token_ids": (1, 2)}[field_name]
    with pytest.raises(SamplingParamsError) as raised:
        SamplingParams(grammar=SetGrammar(frozenset({1})), **{field_name: value})
    assert raised.value.field is InputField[field_name.upper()]


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100])
def test_bitmask_unpacks_bit_i_of_word_j_to_token_32j_plus_i(vocab: int) -> None:
    generator = torch.Generator().manual_seed(vocab)
    expected = torch.rand(3, vocab, generator=generator) > 0.5
    expected[0, -1] = True  # the top bit of a full word is the int32 sign bit
    matchers = [SetMatcher(frozenset(torch.nonzero(row).flatten().tolist())) for row in expected]
    assert torch.equal(fill_bitmasks(matchers, vocab), expected)  # type: ignore[arg-type]
    packed = torch.zeros(1, words_for(vocab), dtype=torch.int32)
    assert not unpack_bitmask(packed, vocab).any()


def test_grammar_rows_are_masked_before_temperature_and_filters(tiny_llama: PreTrainedModel) -> None:
    """With top_k 1 a row samples its best token; under a grammar, its best allowed token (the mask came first)."""
    vocab = tiny_llama.config.vocab_size
    allowed = frozenset(range(1, vocab, 5))
    prompt = random_prompt(8, 77, vocab)
    top1 = {"temperature": 1.0, "top_k": 1, "seed": 3}
    constrained = _run(tiny_llama, {0: (prompt, SamplingParams(max_tokens=8, grammar=SetGrammar(allowed), **top1))})
    greedy = _run(tiny_llama, {0: (prompt, SamplingParams(max_tokens=8, grammar=SetGrammar(allowed), **GREEDY))})
    assert constrained.tokens(0) == greedy.tokens(0)
    assert set(constrained.tokens(0)) <= allowed


@dataclass
class DeadEndMatcher(SetMatcher):
    """Allows `allowed` for `length` tokens, then nothing: a rule that never completes."""

    def _now(self) -> frozenset[int]:
        return frozenset() if self.length is not None and len(self.accepted) >= self.length else self.allowed


@dataclass
class FaultyMatcher(SetMatcher):
    """Its mask allows `allowed`, but after `length` tokens it refuses every token: a backend fault, injected."""

    def accept_token(self, token_id: int) -> bool:
        if self.length is not None and len(self.accepted) >= self.length:
            return False
        return super().accept_token(token_id)


@dataclass(frozen=True)
class MatcherGrammar:
    make: type[SetMatcher]
    allowed: frozenset[int]
    length: int

    def matcher(self) -> SetMatcher:
        return self.make(self.allowed, self.length)


@pytest.mark.parametrize("make", [DeadEndMatcher, FaultyMatcher], ids=["mask-allows-nothing", "refuses-its-mask"])
@pytest.mark.parametrize("sampling", [GREEDY, {"temperature": 0.8, "seed": 5}], ids=["greedy", "seeded"])
def test_a_grammar_that_cannot_go_on_ends_only_its_own_sequence(
    tiny_llama: PreTrainedModel, make: type[SetMatcher], sampling: dict
) -> None:
    """The stuck row ends with FinishReason.GRAMMAR after the tokens its grammar took; the free rows sharing its
    steps get exactly what they get alone (a row with no allowed token must not turn the step's sampling to NaN)."""
    vocab = tiny_llama.config.vocab_size
    prompts = [random_prompt(n, 90 + n, vocab) for n in (6, 9, 4)]
    free = SamplingParams(max_tokens=10, **sampling)
    stuck = SamplingParams(max_tokens=10, grammar=MatcherGrammar(make, frozenset(range(5, 60)), 3), **sampling)
    mixed = _run(tiny_llama, {0: (prompts[0], free), 1: (prompts[1], stuck), 2: (prompts[2], free)})
    alone = _run(tiny_llama, {0: (prompts[0], free), 2: (prompts[2], free)})
    assert mixed.finished[1] is FinishReason.GRAMMAR
    assert len(mixed.tokens(1)) == 4 and set(mixed.tokens(1)[:3]) <= set(range(5, 60))
    for i in (0, 2):
        assert mixed.tokens(i) == alone.tokens(i)
        assert mixed.finished[i] is FinishReason.LENGTH
