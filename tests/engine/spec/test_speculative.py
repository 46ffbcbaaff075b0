"""Speculative decoding in the engine (engine/spec/verify.py): on float32 tiny models, greedy output with drafts is
identical token for token to output without, whatever the drafts (n-gram, right, wrong, past max_tokens or EOS),
for several sequences in one ragged batch, and every KV block comes back at the end."""

from __future__ import annotations

import pytest
from transformers import PreTrainedModel

from engine.outputs import FinishReason
from engine.sample.sampling_params import SamplingParams
from tests.engine.helpers import Drafter, SetGrammar, make_engine, oracle, propose_ngram, random_prompt, run


def ngram(k: int, n_min: int = 1, n_max: int = 3) -> Drafter:
    return lambda _, tokens: propose_ngram(tokens, k, n_min, n_max)


def prompts_for(vocab: int) -> list[list[int]]:
    repeating = random_prompt(5, 1, vocab) * 4  # a prompt that repeats: n-gram drafts exist from the start
    return [repeating, random_prompt(11, 2, vocab), random_prompt(3, 3, vocab) * 3 + [7], random_prompt(17, 4, vocab)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.mark.parametrize("caching", [True, False])
def test_greedy_output_is_identical_with_ngram_and_oracle_drafts(tiny_llama: PreTrainedModel, caching: bool) -> None:
    prompts = prompts_for(tiny_llama.config.vocab_size)
    params = [GREEDY] * len(prompts)
    reference, reasons, _ = run(make_engine(tiny_llama, enable_prefix_caching=caching), prompts, params)
    for drafter, name in (
        (ngram(4), "ngram"),
        (oracle(reference, prompts, 5), "right"),
        (oracle(reference, prompts, 5, wrong_at=2), "wrong at 2"),
        (oracle(reference, prompts, 3, wrong_at=0), "wrong at 0"),
    ):
        outputs, got, stats = run(make_engine(tiny_llama, enable_prefix_caching=caching), prompts, params, drafter)
        assert outputs == reference, name
        assert got == reasons, name
        drafted, accepted = sum(s[0] for s in stats), sum(s[1] for s in stats)
        assert drafted > 0 and (accepted == 0 if name == "wrong at 0" else 0 < accepted <= drafted), name
        if name == "right":  # right drafts are all accepted; the output takes fewer steps than tokens
            assert accepted == drafted
            assert len(stats) < len(prompts[0]) // 6 + 1 + GREEDY.max_tokens


def test_max_tokens_and_eos_mid_draft(tiny_qwen2: PreTrainedModel) -> None:
    vocab = tiny_qwen2.config.vocab_size
    prompts = prompts_for(vocab)
    long = SamplingParams(temperature=0.0, max_tokens=30)
    reference, _, _ = run(make_engine(tiny_qwen2), prompts, [long] * len(prompts))
    # Drafts of 8 that run past max_tokens (7, 10, 13, 16) and past an EOS that first occurs mid-output.
    cut = [SamplingParams(temperature=0.0, max_tokens=m) for m in (7, 10, 13, 16)]
    eos = reference[1][5]
    plain, plain_reasons = run(make_engine(tiny_qwen2, eos_token_ids=[eos]), prompts, cut)[:2]
    assert FinishReason.STOP in plain_reasons.values() and FinishReason.LENGTH in plain_reasons.values()
    for drafter in (oracle(reference, prompts, 8), ngram(8)):
        outputs, reasons, _ = run(make_engine(tiny_qwen2, eos_token_ids=[eos]), prompts, cut, drafter)
        assert outputs == plain
        assert reasons == plain_reasons
    # A stop token id and min_tokens see each position as without speculation.
    stop = [
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=(reference[s][3],), min_tokens=2)
        for s in range(4)
    ]
    plain, plain_reasons = run(make_engine(tiny_qwen2), prompts, stop)[:2]
    outputs, reasons, _ = run(make_engine(tiny_qwen2), prompts, stop, oracle(reference, prompts, 6))
    assert (outputs, reasons) == (plain, plain_reasons)


def test_prefix_cache_holds_only_accepted_tokens(tiny_llama: PreTrainedModel) -> None:
    """A sequence that ran with wrong drafts registers its blocks; a later sequence whose prompt is that whole
    sequence reads them, and continues exactly as one computed from scratch."""
    vocab = tiny_llama.config.vocab_size
    prompts = prompts_for(vocab)[:2]
    reference, _, _ = run(make_engine(tiny_llama), prompts, [GREEDY] * 2)
    engine = make_engine(tiny_llama)
    run(engine, prompts, [GREEDY] * 2, oracle(reference, prompts, 4, wrong_at=1))
    follow = [prompts[0] + reference[0]]
    hits_before = engine.blocks.hits
    outputs, _, _ = run(engine, follow, [SamplingParams(temperature=0.0, max_tokens=8)])
    assert engine.blocks.hits > hits_before
    fresh, _, _ = run(
        make_engine(tiny_llama, enable_prefix_caching=False), follow, [SamplingParams(temperature=0.0, max_tokens=8)]
    )
    assert outputs == fresh


def test_drafts_are_checked(tiny_llama: PreTrainedModel) -> None:
    engine = make_engine(tiny_llama)
    engine.add(0, [1, 2, 3, 4, 5], GREEDY)
    assert engine.reserve(0, 8)
    with pytest.raises(ValueError, match="does not sample"):
        engine.step([(0, 3)], {0: [1]})
    with pytest.raises(ValueError, match="reserved cache"):
        engine.step([(0, 5)], {0: [1, 2, 3, 4]})
    with pytest.raises(ValueError, match="vocabulary"):
        engine.step([(0, 5)], {0: [10_000]})


def test_logprobs_are_those_of_each_position(tiny_mistral: PreTrainedModel) -> None:
    """A row that asks for logprobs gets, for every token emitted from a verified position, the logprob and top
    alternatives the plain step reports."""
    prompts = prompts_for(tiny_mistral.config.vocab_size)[:3]
    params = [SamplingParams(temperature=0.0, max_tokens=12, logprobs=3)] * 3
    engine = make_engine(tiny_mistral)
    for seq_id, prompt in enumerate(prompts):
        engine.add(seq_id, prompt, params[seq_id])
        assert engine.reserve(seq_id, len(prompt) + 12)
    plain = [engine.step([(s, len(p)) for s, p in enumerate(prompts)]).tokens]
    while any(t.finish_reason is None for t in plain[-1]):
        plain.append(engine.step([(t.seq_id, 1) for t in plain[-1] if t.finish_reason is None]).tokens)
    reference = {s: [t for step in plain for t in step if t.seq_id == s] for s in range(3)}
    spec_engine = make_engine(tiny_mistral)
    drafts = oracle({s: [t.token_id for t in reference[s]] for s in range(3)}, prompts, 4, wrong_at=3)
    got: dict[int, list] = {s: [] for s in range(3)}
    for seq_id, prompt in enumerate(prompts):
        spec_engine.add(seq_id, prompt, params[seq_id])
        assert spec_engine.reserve(seq_id, len(prompt) + 12)
    live = set(range(3))
    while live:
        schedule = [(s, spec_engine.num_pending(s)) for s in sorted(live)]
        out = spec_engine.step(schedule, {s: drafts(s, prompts[s] + [t.token_id for t in got[s]]) for s in live})
        for token in out.tokens:
            got[token.seq_id].append(token)
            if token.finish_reason is not None:
                live.discard(token.seq_id)
    for s in range(3):
        assert [t.token_id for t in got[s]] == [t.token_id for t in reference[s]]
        for a, b in zip(got[s], reference[s], strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [i for i, _ in a.top_logprobs or ()] == [i for i, _ in b.top_logprobs or ()]


def test_grammar_rows_see_only_emitted_tokens(tiny_llama: PreTrainedModel) -> None:
    """A grammar's matcher is fed only the tokens emitted, never a rejected draft, and the grammar's end finishes the
    row mid-draft as without speculation."""
    vocab = tiny_llama.config.vocab_size
    prompts = prompts_for(vocab)
    allowed = frozenset(range(0, vocab, 2))

    def params() -> list[SamplingParams]:
        return [
            SamplingParams(temperature=0.0, max_tokens=20, grammar=SetGrammar(allowed, length=length, end=4))
            for length in (6, 9, 30, 3)
        ]

    plain_params = params()
    plain, plain_reasons, _ = run(make_engine(tiny_llama), prompts, plain_params)
    free, _, _ = run(make_engine(tiny_llama), prompts, [GREEDY] * 4)
    for drafter in (ngram(5), oracle(free, prompts, 5)):  # the free output's drafts mostly break the grammar
        spec_params = params()
        outputs, reasons, _ = run(make_engine(tiny_llama), prompts, spec_params, drafter)
        assert (outputs, reasons) == (plain, plain_reasons)
        for seq_id, p in enumerate(spec_params):
            assert isinstance(p.grammar, SetGrammar)
            assert p.grammar.made[-1].accepted == outputs[seq_id]
