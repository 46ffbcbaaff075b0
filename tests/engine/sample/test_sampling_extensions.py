"""vLLM's sampling extensions: logit_bias, allowed_token_ids, min_tokens, repetition_penalty, min_p.

The logits edits are checked against a float64 reference written out per row, in batches that mix rows using a
feature with rows that do not; the engine is checked end to end on a tiny model against greedy decoding of the
Hugging Face model's own logits with the same edit applied by hand.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import PreTrainedModel

from engine.errors import EngineInputError, InputField
from engine.outputs import FinishReason
from engine.sample.logits_processors import (
    AllowedTokens,
    BannedTokens,
    LogitBias,
    LogitsEdits,
    OutputPenalties,
    RepetitionPenalty,
    token_mask,
)
from engine.sample.sampler import RowSampling, sample
from engine.sample.sampling_params import MAX_LOGIT_EDIT, SamplingParams
from tests.engine.helpers import Driver, hf_greedy, hf_log_softmax, make_engine, random_prompt, run_alone

INF = float("inf")
VOCAB = 12


def logits_batch(rows: int, seed: int) -> torch.Tensor:
    """Positive, negative and zero logits, and a -inf (already masked) entry in every row."""
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    logits[:, 4] = 0.0
    logits[:, 7] = -INF
    return logits


def plain_rows(n: int, temperature: float = 0.0, want_logprobs: bool = False) -> RowSampling:
    return RowSampling(
        temperature=torch.full((n,), temperature),
        top_p=torch.ones(n),
        top_k=torch.zeros(n, dtype=torch.long),
        seed=torch.arange(n, dtype=torch.long),
        counter=torch.zeros(n, dtype=torch.long),
        num_logprobs=3 if want_logprobs else 0,
        want_logprobs=want_logprobs,
    )


def reference_edit(
    logits: torch.Tensor,
    *,
    bias: dict[int, float] | None = None,
    allowed: set[int] | None = None,
    banned: set[int] | None = None,
    repetition: float = 1.0,
    seen: set[int] | None = None,
    counts: dict[int, int] | None = None,
    presence: float = 0.0,
    frequency: float = 0.0,
) -> torch.Tensor:
    """One row's edited logits in float64, one token at a time, in vLLM's order."""
    x = logits.double().clone()
    for token, value in (bias or {}).items():
        x[token] += value
    for token in range(len(x)):
        if (allowed is not None and token not in allowed) or token in (banned or set()):
            x[token] = -INF
    for token in seen or set():
        x[token] = x[token] / repetition if x[token] > 0 else x[token] * repetition
    for token, count in (counts or {}).items():
        x[token] -= frequency * count + presence
    return x


def as_index(*rows: int) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long)


def test_each_edit_matches_reference_beside_rows_that_do_not_use_it() -> None:
    logits = logits_batch(7, seed=1)
    mask = torch.zeros(2, VOCAB, dtype=torch.bool)
    mask[0, [1, 3, 7]] = True
    mask[1, [0, 5, 9, 11]] = True
    seen = token_mask(torch.tensor([[2, 4, 7, 9, -1], [0, 1, 2, 3, 5]]), VOCAB)
    counts = torch.zeros(2, VOCAB)
    counts[0, [2, 9]] = torch.tensor([3.0, 1.0])
    counts[1, 0] = 2.0
    edits = LogitsEdits(
        # Padding in a bias row is id 0 with bias 0; row 5's padding must leave its token 0 alone.
        bias=LogitBias(
            as_index(1, 5),
            torch.tensor([[3, 7, 10], [10, 0, 0]]),
            torch.tensor([[100.0, 5.0, -100.0], [-7.5, 0.0, 0.0]]),
        ),
        allowed=AllowedTokens(as_index(2, 5), mask),
        banned=BannedTokens(as_index(3, 5), torch.tensor([[0, 6, -1], [9, -1, -1]])),
        repetition=RepetitionPenalty(as_index(4, 5), seen, torch.tensor([1.7, 0.6])),
        penalties=OutputPenalties(as_index(4, 6), counts, torch.tensor([0.5, -1.0]), torch.tensor([1.0, 2.0])),
    )
    got = edits.apply(logits)
    expected = [
        reference_edit(logits[0]),
        reference_edit(logits[1], bias={3: 100.0, 7: 5.0, 10: -100.0}),
        reference_edit(logits[2], allowed={1, 3, 7}),
        reference_edit(logits[3], banned={0, 6}),
        reference_edit(logits[4], repetition=1.7, seen={2, 4, 7, 9}, counts={2: 3, 9: 1}, presence=0.5, frequency=1.0),
        reference_edit(
            logits[5], bias={10: -7.5}, allowed={0, 5, 9, 11}, banned={9}, repetition=0.6, seen={0, 1, 2, 3, 5}
        ),
        reference_edit(logits[6], counts={0: 2}, presence=-1.0, frequency=2.0),
    ]
    assert torch.allclose(got.double(), torch.stack(expected), rtol=1e-6, atol=1e-5, equal_nan=False)
    assert torch.equal(logits[:, 7], torch.full((7,), -INF))  # the raw logits were not touched
    assert torch.equal(LogitsEdits().apply(logits), logits)

    # Greedy rows choose from the edited logits; random rows never draw a masked token.
    tokens = sample(logits, plain_rows(7), edits).tokens
    assert torch.equal(tokens, torch.stack(expected).argmax(dim=-1))
    assert int(tokens[1]) == 3  # the +100 bias forces its token
    many = logits.repeat(300, 1)
    repeated = LogitsEdits(allowed=AllowedTokens(as_index(*range(2, 2100, 7)), mask[0].expand(300, -1)))
    drawn = sample(many, RowSampling(**{**plain_rows(2100, 1.0).__dict__, "counter": torch.arange(2100)}), repeated)
    assert set(drawn.tokens[2::7].tolist()) == {1, 3}  # both finite allowed tokens turn up, 7 (-inf) never


def test_token_mask_ignores_padding_and_marks_duplicates_once() -> None:
    mask = token_mask(torch.tensor([[-1, -1], [0, 0], [3, -1]]), 4)
    assert mask.tolist() == [[False] * 4, [True, False, False, False], [False, False, False, True]]


@pytest.mark.parametrize("penalty", [1e-45, 1e-30, 1e30, 3e38])
def test_extreme_repetition_penalties_keep_finite_logits_finite_and_masked_ones_masked(penalty: float) -> None:
    logits = torch.tensor([[5.0, -5.0, 0.0, -INF, 1e30, -1e30, 3e38, -3e38]])
    seen = torch.ones(1, 8, dtype=torch.bool)
    got = RepetitionPenalty(as_index(0), seen, torch.tensor([penalty])).apply(logits)
    assert bool(torch.isfinite(got[0, [0, 1, 2, 4, 5, 6, 7]]).all()) and got[0, 3] == -INF
    assert not bool(got.isnan().any())
    tokens = sample(
        logits,
        plain_rows(1, 1.0),
        LogitsEdits(repetition=RepetitionPenalty(as_index(0), seen, torch.tensor([penalty]))),
    )
    assert int(tokens.tokens) != 3


def test_logprobs_report_the_raw_distribution_not_the_edited_one() -> None:
    logits = logits_batch(3, seed=2)
    edits = LogitsEdits(bias=LogitBias(as_index(0, 2), torch.tensor([[5], [0]]), torch.tensor([[100.0], [-100.0]])))
    result = sample(logits, plain_rows(3, want_logprobs=True), edits)
    raw = torch.log_softmax(logits, dim=-1)
    assert int(result.tokens[0]) == 5
    assert result.logprobs is not None and result.top_ids is not None
    assert torch.allclose(result.logprobs, raw.gather(1, result.tokens[:, None])[:, 0])
    assert torch.equal(result.top_ids, raw.topk(3).indices)


# ----- SamplingParams -----


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(min_tokens=-1), "min_tokens"),
        (dict(max_tokens=4, min_tokens=5), "min_tokens"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(repetition_penalty=INF), "repetition_penalty"),
        (dict(repetition_penalty=float("nan")), "repetition_penalty"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(min_p=float("nan")), "min_p"),
        (dict(logit_bias=((1, MAX_LOGIT_EDIT * 2),)), "logit_bias values must be within"),
        (dict(logit_bias=((1, -INF),)), "logit_bias values must be within"),
        (dict(logit_bias=((1, float("nan")),)), "logit_bias values must be within"),
        (dict(logit_bias=((1, 1.0), (1, 2.0))), "logit_bias names a token id twice"),
        (dict(allowed_token_ids=()), "allowed_token_ids"),
        (dict(logprobs=-1), "logprobs must be at least 0"),
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=INF), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(presence_penalty=-INF), "presence_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(frequency_penalty=MAX_LOGIT_EDIT * 2), "frequency_penalty"),
    ],
)
def test_sampling_params_reject_out_of_range_extensions(fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**fields)


def test_sampling_params_accept_the_limits() -> None:
    params = SamplingParams(
        max_tokens=4,
        min_tokens=4,
        repetition_penalty=1e-30,
        min_p=1.0,
        logit_bias=((0, -MAX_LOGIT_EDIT), (3, 100)),
        allowed_token_ids=[5, 6],  # type: ignore[arg-type]  # any sequence is normalised to a tuple
        logprobs=20,
    )
    assert params.logit_bias == ((0, -MAX_LOGIT_EDIT), (3, 100.0)) and params.allowed_token_ids == (5, 6)


def test_sampling_params_leave_the_openai_ranges_to_the_api() -> None:
    """Values outside OpenAI's ranges (api/protocol/openai_api.py enforces those) still run in the engine."""
    params = SamplingParams(temperature=3.5, presence_penalty=-5.0, frequency_penalty=5.0, logprobs=50)
    assert (params.temperature, params.presence_penalty, params.frequency_penalty, params.logprobs) == (3.5, -5, 5, 50)


# ----- through the engine, on a tiny model -----


@torch.inference_mode()
def edited_greedy(
    model: PreTrainedModel,
    prompt: list[int],
    max_tokens: int,
    edit: Callable[[torch.Tensor, list[int]], torch.Tensor],
    stop: set[int] = frozenset(),  # type: ignore[assignment]
) -> list[int]:
    """Greedy decoding on the HF model's logits after `edit(logits, output so far)`; stops after a `stop` token."""
    out: list[int] = []
    while len(out) < max_tokens:
        logits = model(torch.tensor([prompt + out])).logits[0, -1].double()
        out.append(int(edit(logits, out).argmax()))
        if out[-1] in stop:
            break
    return out


def banning(tokens: set[int], until: int) -> Callable[[torch.Tensor, list[int]], torch.Tensor]:
    def edit(logits: torch.Tensor, out: list[int]) -> torch.Tensor:
        return reference_edit(logits, banned=tokens if len(out) < until else set())

    return edit


@pytest.fixture(scope="module")
def min_tokens_case(tiny_llama: PreTrainedModel) -> tuple[list[int], int, int, list[int]]:
    """(prompt, stop token s, min_tokens m, expected output): plain greedy emits s before m tokens, and greedy
    with s banned until m emits it later, so both the ban and its lifting are visible."""
    vocab = tiny_llama.config.vocab_size
    for seed in range(900, 940):
        prompt = random_prompt(7, seed, vocab)
        plain = hf_greedy(tiny_llama, prompt, 24)
        for k, token in enumerate(plain[:10]):
            if token in plain[:k]:
                continue
            for m in (k + 3, k + 2, k + 1):
                expected = edited_greedy(tiny_llama, prompt, 24, banning({token}, m), stop={token})
                if expected[-1] == token and len(expected) > m:
                    return prompt, token, m, expected
    raise AssertionError("no prompt with a re-emitted stop token found")


@pytest.mark.parametrize("via", ["eos", "stop_token_ids"])
def test_min_tokens_masks_eos_and_stop_ids_until_reached_then_allows_them(
    tiny_llama: PreTrainedModel, min_tokens_case: tuple[list[int], int, int, list[int]], via: str
) -> None:
    prompt, stop, m, expected = min_tokens_case
    stops = (stop,) if via == "stop_token_ids" else ()
    engine = make_engine(tiny_llama, eos_token_ids=[stop] if via == "eos" else [])
    driver = Driver(engine, max_chunk=4)
    driver.add(0, prompt, SamplingParams(max_tokens=24, min_tokens=m, stop_token_ids=stops, temperature=0.0))
    driver.add(1, prompt, SamplingParams(max_tokens=24, stop_token_ids=stops, temperature=0.0))  # no min_tokens
    driver.add(2, prompt, SamplingParams(max_tokens=24, min_tokens=m, stop_token_ids=stops, seed=3, top_k=4))
    driver.run()
    assert driver.tokens(0) == expected
    assert driver.finished[0] is FinishReason.STOP and len(expected) > m
    first = hf_greedy(tiny_llama, prompt, 24).index(stop)
    assert first < m and driver.tokens(1) == hf_greedy(tiny_llama, prompt, first + 1)  # stops early without it
    assert stop not in driver.tokens(2)[:m]  # a sampled row is held back too


def test_min_tokens_leaves_eos_alone_under_ignore_eos(
    tiny_llama: PreTrainedModel, min_tokens_case: tuple[list[int], int, int, list[int]]
) -> None:
    prompt, stop, m, _ = min_tokens_case
    params = SamplingParams(max_tokens=m, min_tokens=m, ignore_eos=True, temperature=0.0)
    out = run_alone(tiny_llama, prompt, params, eos_token_ids=[stop])
    assert [t.token_id for t in out] == hf_greedy(tiny_llama, prompt, m)  # emits the EOS token it cannot stop on
    assert stop in [t.token_id for t in out]


def test_logit_bias_forces_and_forbids_tokens_and_logprobs_stay_raw(tiny_qwen2: PreTrainedModel) -> None:
    vocab = tiny_qwen2.config.vocab_size
    prompt = random_prompt(9, 910, vocab)
    plain = hf_greedy(tiny_qwen2, prompt, 10)
    forced = next(t for t in range(vocab) if t not in plain)
    forbidden = {t: -100.0 for t in set(plain)}
    driver = Driver(make_engine(tiny_qwen2), max_chunk=4)
    driver.add(0, prompt, SamplingParams(max_tokens=10, logit_bias=((forced, 100.0),), logprobs=2, temperature=0.0))
    driver.add(1, prompt, SamplingParams(max_tokens=10, logit_bias=tuple(forbidden.items()), temperature=0.0))
    driver.add(2, prompt, SamplingParams(max_tokens=10, temperature=0.0))
    driver.add(3, prompt, SamplingParams(max_tokens=10, logit_bias=((forced, 100.0),), seed=4))
    driver.run()
    assert driver.tokens(0) == [forced] * 10 == driver.tokens(3)
    assert driver.tokens(1) == edited_greedy(tiny_qwen2, prompt, 10, lambda x, _: reference_edit(x, bias=forbidden))
    assert not set(driver.tokens(1)) & set(plain)
    assert driver.tokens(2) == plain
    reference = hf_log_softmax(tiny_qwen2, prompt + [forced] * 10)
    for i, token in enumerate(driver.outputs[0]):
        assert token.logprob == pytest.approx(float(reference[len(prompt) - 1 + i, forced]), abs=1e-4)
        assert token.top_logprobs is not None
        assert [t for t, _ in token.top_logprobs] == reference[len(prompt) - 1 + i].topk(2).indices.tolist()


def test_allowed_token_ids_restrict_greedy_and_sampled_rows(tiny_llama: PreTrainedModel) -> None:
    vocab = tiny_llama.config.vocab_size
    prompt = random_prompt(8, 920, vocab)
    plain = hf_greedy(tiny_llama, prompt, 12)
    allowed = {t for t in range(0, vocab, 17) if t not in plain}
    driver = Driver(make_engine(tiny_llama), max_chunk=3)
    driver.add(0, prompt, SamplingParams(max_tokens=12, allowed_token_ids=tuple(allowed), temperature=0.0))
    driver.add(1, prompt, SamplingParams(max_tokens=12, allowed_token_ids=tuple(allowed), temperature=2.0, seed=1))
    driver.add(2, prompt, SamplingParams(max_tokens=12, temperature=0.0))
    driver.run()
    assert driver.tokens(0) == edited_greedy(tiny_llama, prompt, 12, lambda x, _: reference_edit(x, allowed=allowed))
    assert set(driver.tokens(1)) <= allowed and len(set(driver.tokens(1))) > 1
    assert driver.tokens(2) == plain


def test_repetition_penalty_covers_prompt_and_output_tokens(tiny_qwen2: PreTrainedModel) -> None:
    base = random_prompt(8, 800, tiny_qwen2.config.vocab_size)  # plain greedy repeats itself on this prompt
    prompt = base + hf_greedy(tiny_qwen2, base, 4)  # so its next token is already in the prompt
    plain = hf_greedy(tiny_qwen2, prompt, 16)
    assert plain[0] in prompt
    driver = Driver(make_engine(tiny_qwen2), max_chunk=5)
    for seq_id, penalty in enumerate((1.8, 0.5, 1.0)):
        driver.add(seq_id, prompt, SamplingParams(max_tokens=16, repetition_penalty=penalty, temperature=0.0))
    driver.run()
    for seq_id, penalty in enumerate((1.8, 0.5)):

        def edit(x: torch.Tensor, out: list[int], penalty: float = penalty) -> torch.Tensor:
            return reference_edit(x, repetition=penalty, seen=set(prompt + out))

        assert driver.tokens(seq_id) == edited_greedy(tiny_qwen2, prompt, 16, edit)
    assert driver.tokens(0)[0] != plain[0]  # penalised before any output: by the prompt alone
    assert driver.tokens(2) == plain


def test_min_p_one_and_subnormal_temperature_decode_greedily(tiny_llama: PreTrainedModel) -> None:
    prompt = random_prompt(6, 930, tiny_llama.config.vocab_size)
    plain = hf_greedy(tiny_llama, prompt, 10)
    for params in (SamplingParams(max_tokens=10, min_p=1.0, seed=2), SamplingParams(max_tokens=10, temperature=1e-40)):
        assert [t.token_id for t in run_alone(tiny_llama, prompt, params)] == plain
    unfiltered = run_alone(tiny_llama, prompt, SamplingParams(max_tokens=10, seed=2))
    assert [t.token_id for t in unfiltered] != plain  # the same seed without min_p really samples


def test_a_reused_row_forgets_the_previous_requests_extensions(tiny_llama: PreTrainedModel) -> None:
    prompt = random_prompt(5, 940, tiny_llama.config.vocab_size)
    engine = make_engine(tiny_llama, max_rows=1)
    driver = Driver(engine)
    restricted = SamplingParams(
        max_tokens=4, logit_bias=((3, 100.0),), allowed_token_ids=(3, 4), repetition_penalty=2.0, min_p=0.5
    )
    driver.add(0, prompt, restricted)
    driver.run()
    assert driver.tokens(0) == [3] * 4
    driver.add(1, prompt, SamplingParams(max_tokens=8, temperature=0.0))
    driver.run()
    assert driver.tokens(1) == hf_greedy(tiny_llama, prompt, 8)


@pytest.mark.parametrize(
    ("params", "match", "field"),
    [
        (SamplingParams(logit_bias=((160, 1.0),)), r"160 is outside the vocabulary \[0, 160\)", InputField.LOGIT_BIAS),
        (SamplingParams(logit_bias=((1, 1.0), (2, 1.0), (3, 1.0))), "at most 2", InputField.LOGIT_BIAS),
        (SamplingParams(allowed_token_ids=(5, -1)), r"-1 is outside the vocabulary", InputField.ALLOWED_TOKEN_IDS),
        (SamplingParams(allowed_token_ids=(200,)), r"200 is outside the vocabulary", InputField.ALLOWED_TOKEN_IDS),
        (
            SamplingParams(min_tokens=2, allowed_token_ids=(9, 4), stop_token_ids=(4,)),
            "min_tokens",
            InputField.MIN_TOKENS,
        ),
    ],
)
def test_engine_rejects_extensions_it_cannot_serve(
    tiny_llama: PreTrainedModel, params: SamplingParams, match: str, field: InputField
) -> None:
    engine = make_engine(tiny_llama, max_rows=2, max_logit_bias=2, eos_token_ids=[9])
    with pytest.raises(EngineInputError, match=match) as info:
        engine.add(1, [1, 2, 3], params)
    assert info.value.field is field and not engine.has_sequence(1) and engine.num_free_rows == 2
    # The same lists are fine where they can be served: within limits, or with the EOS ignored.
    engine.add(2, [1, 2], SamplingParams(min_tokens=2, allowed_token_ids=(9,), ignore_eos=True, logit_bias=((159, 1),)))
