"""Tests for engine.sample.sampler: counter-based uniforms, greedy and filtered sampling, penalties, logprobs,
numerics."""

from __future__ import annotations

import pytest
import torch

from engine.sample.logits_processors import apply_penalties
from engine.sample.sampler import RowSampling, counter_uniform, filtered_probs, sample
from engine.sample.sampling_params import MIN_SAMPLING_TEMPERATURE, SamplingParams

BINS = 20
# Chi-square with BINS - 1 = 19 degrees of freedom has mean 19 and sd ~6.2; 60 is > 6 sd out, so a correct
# generator essentially never fails while a badly skewed one (e.g. half the bins empty) always does.
CHI2_BOUND = 60.0


def rows(
    n: int,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | torch.Tensor = 0,
    counter: torch.Tensor | None = None,
    num_logprobs: int = 0,
    want_logprobs: bool = False,
    min_p: float | None = None,
) -> RowSampling:
    seeds = seed if isinstance(seed, torch.Tensor) else torch.full((n,), seed, dtype=torch.long)
    return RowSampling(
        temperature=torch.full((n,), temperature),
        top_p=torch.full((n,), top_p),
        top_k=torch.full((n,), top_k, dtype=torch.long),
        seed=seeds,
        counter=torch.arange(n, dtype=torch.long) if counter is None else counter,
        num_logprobs=num_logprobs,
        want_logprobs=want_logprobs,
        min_p=None if min_p is None else torch.full((n,), min_p),
    )


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(samples, minlength=len(probs)).double()
    expected = probs.double() * len(samples)
    return float(((observed - expected) ** 2 / expected).sum())


# ----- counter_uniform -----

EDGE_SEEDS = torch.tensor([0, 1, 7, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**62, 2**63 - 1], dtype=torch.long)


def test_counter_uniform_is_deterministic() -> None:
    seeds = EDGE_SEEDS.repeat_interleave(50)
    counters = torch.arange(len(seeds), dtype=torch.long) % 37
    first = counter_uniform(seeds, counters)
    assert torch.equal(first, counter_uniform(seeds.clone(), counters.clone()))
    # Element-wise: a value does not depend on what else is in the tensor.
    assert float(counter_uniform(seeds[5:6], counters[5:6])) == float(first[5])


def test_counter_uniform_lies_strictly_inside_unit_interval() -> None:
    seeds = EDGE_SEEDS.repeat_interleave(2000)
    counters = torch.arange(len(seeds), dtype=torch.long)
    u = counter_uniform(seeds, counters)
    assert u.dtype == torch.float64
    assert bool((u > 0).all()) and bool((u < 1).all())


def test_counter_uniform_differs_across_counters_and_seeds() -> None:
    n = 10_000
    by_counter = counter_uniform(torch.full((n,), 7, dtype=torch.long), torch.arange(n))
    assert len(torch.unique(by_counter)) > 0.999 * n
    by_seed = counter_uniform(torch.arange(n), torch.zeros(n, dtype=torch.long))
    assert len(torch.unique(by_seed)) > 0.999 * n
    # Seeds that differ only in their high 32 bits still give different streams.
    low, high = torch.full((100,), 5, dtype=torch.long), torch.full((100,), 5 + 2**32, dtype=torch.long)
    counters = torch.arange(100)
    assert not torch.equal(counter_uniform(low, counters), counter_uniform(high, counters))
    # Adjacent seeds are not shifted copies of each other.
    assert not torch.equal(counter_uniform(low[1:], counters[1:]), counter_uniform(low[1:] + 1, counters[:-1]))


@pytest.mark.parametrize("vary", ["counter", "seed"])
def test_counter_uniform_is_roughly_uniform(vary: str) -> None:
    n = 100_000
    index = torch.arange(n, dtype=torch.long)
    if vary == "counter":
        u = counter_uniform(torch.full((n,), 12345, dtype=torch.long), index)
    else:
        u = counter_uniform(index * 7919, torch.full((n,), 3, dtype=torch.long))
    bins = (u * BINS).long()
    assert chi_square(bins, torch.full((BINS,), 1.0 / BINS)) < CHI2_BOUND
    assert abs(float(u.mean()) - 0.5) < 0.01


# ----- sample() -----


def random_logits(n: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_temperature_zero_is_argmax() -> None:
    logits = random_logits(64)
    result = sample(logits, rows(64, temperature=0.0))
    assert torch.equal(result.tokens, logits.argmax(-1))
    assert result.logprobs is None and result.top_ids is None


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_top_k_one_equals_greedy(temperature: float) -> None:
    logits = random_logits(256, seed=1)
    seeds = torch.arange(256, dtype=torch.long) * 31
    result = sample(logits, rows(256, temperature=temperature, top_k=1, seed=seeds))
    assert torch.equal(result.tokens, logits.argmax(-1))


@pytest.mark.parametrize("top_k", [0, 5])
def test_tiny_top_p_equals_greedy(top_k: int) -> None:
    logits = random_logits(256, seed=2)
    seeds = torch.arange(256, dtype=torch.long) * 17
    result = sample(logits, rows(256, temperature=1.0, top_p=1e-6, top_k=top_k, seed=seeds))
    assert torch.equal(result.tokens, logits.argmax(-1))


FIXED_LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def _sampled(params: RowSampling, n: int) -> torch.Tensor:
    """n tokens drawn from FIXED_LOGITS, one per row, each row with its own counter."""
    return sample(FIXED_LOGITS.expand(n, -1).contiguous(), params).tokens


def _frequencies(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=len(FIXED_LOGITS)).double() / len(tokens)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampling_frequencies_match_softmax(temperature: float) -> None:
    n = 40_000
    tokens = _sampled(rows(n, temperature=temperature, seed=99), n)
    probs = torch.softmax(FIXED_LOGITS.double() / temperature, dim=-1)
    freq = _frequencies(tokens)
    assert torch.allclose(freq, probs, atol=0.01), (freq, probs)
    nonzero = probs > 1e-3  # chi-square only where expected counts are large enough
    assert chi_square(tokens[nonzero[tokens]], probs[nonzero] / probs[nonzero].sum()) < 40


def test_top_p_samples_from_the_renormalised_nucleus() -> None:
    n = 40_000
    probs = torch.softmax(FIXED_LOGITS.double(), dim=-1)  # ~[0.55, 0.20, 0.12, 0.07, ...]
    top_p = 0.8  # the smallest prefix whose mass reaches 0.8 is the first three tokens
    assert probs[:2].sum() < top_p <= probs[:3].sum()
    freq = _frequencies(_sampled(rows(n, top_p=top_p, seed=5), n))
    nucleus = torch.zeros_like(probs)
    nucleus[:3] = probs[:3] / probs[:3].sum()
    assert torch.allclose(freq, nucleus, atol=0.01), (freq, nucleus)


def test_top_k_two_never_samples_outside_the_top_two() -> None:
    n = 4096
    logits = random_logits(n, vocab=40, seed=3) * 0.2  # flat-ish, so outside tokens would be likely
    result = sample(logits, rows(n, temperature=2.0, top_k=2, seed=torch.arange(n) * 13))
    top2 = logits.topk(2, dim=-1).indices
    assert bool((result.tokens[:, None] == top2).any(dim=-1).all())
    picked_second = result.tokens == top2[:, 1]
    assert 0.2 < float(picked_second.double().mean()) < 0.6  # both of the two are actually used


def test_same_seed_and_counter_give_same_token_whatever_the_batch() -> None:
    logits = random_logits(8, seed=4)
    seeds = torch.tensor([3, 3, 9, 9, 3, 9, 1, 2])
    counters = torch.tensor([0, 5, 0, 5, 0, 5, 2, 2])
    together = sample(logits, rows(8, seed=seeds, counter=counters, top_p=0.9, top_k=20)).tokens
    for i in range(8):
        alone = sample(
            logits[i : i + 1],
            rows(1, seed=seeds[i : i + 1], counter=counters[i : i + 1], top_p=0.9, top_k=20),
        )
        assert int(alone.tokens) == int(together[i])


@pytest.mark.parametrize("neighbour", [{"top_p": 0.9}, {"top_k": 5}])
def test_an_unfiltered_row_draws_the_same_token_beside_a_filtered_one(neighbour: dict) -> None:
    """A filtered row sends the step down the sorted-candidates path; the other rows' tokens must not change with
    it (the pick is in vocabulary order), or speculation, whose positions change a step's rows, would change them."""
    n = 256
    logits = random_logits(n, seed=8)
    seeds = torch.arange(n, dtype=torch.long) * 7
    alone = sample(logits, rows(n, seed=seeds)).tokens
    company = rows(n + 1, seed=torch.cat([seeds, torch.tensor([1])]))
    filters = {
        "top_p": torch.cat([company.top_p[:n], torch.tensor([neighbour.get("top_p", 1.0)])]),
        "top_k": torch.cat([company.top_k[:n], torch.tensor([neighbour.get("top_k", 0)])]),
    }
    together = sample(torch.cat([logits, random_logits(1, seed=9)]), RowSampling(**{**company.__dict__, **filters}))
    assert torch.equal(together.tokens[:n], alone)


def test_greedy_and_random_rows_mix_in_one_batch() -> None:
    logits = random_logits(6, seed=5)
    params = rows(6, seed=11)
    params = RowSampling(**{**params.__dict__, "temperature": torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0])})
    tokens = sample(logits, params).tokens
    greedy = logits.argmax(-1)
    assert torch.equal(tokens[0::2], greedy[0::2])
    for i in (1, 3, 5):  # the random rows match the same rows sampled on their own
        alone = sample(logits[i : i + 1], rows(1, seed=11, counter=torch.tensor([i])))
        assert int(alone.tokens) == int(tokens[i])


def test_logprobs_are_log_softmax_of_the_unscaled_logits() -> None:
    logits = random_logits(16, seed=6)
    result = sample(logits, rows(16, temperature=0.7, top_k=10, seed=3, num_logprobs=4, want_logprobs=True))
    reference = torch.log_softmax(logits, dim=-1)
    assert result.logprobs is not None and result.top_ids is not None and result.top_logprobs is not None
    assert torch.allclose(result.logprobs, reference.gather(1, result.tokens[:, None])[:, 0])
    assert torch.equal(result.top_ids, reference.topk(4).indices)
    assert bool((result.top_logprobs[:, :-1] >= result.top_logprobs[:, 1:]).all())


def test_apply_penalties_is_openai_style() -> None:
    logits = torch.zeros(2, 4)
    counts = torch.tensor([[0.0, 1.0, 3.0, 0.0], [2.0, 0.0, 0.0, 0.0]])
    out = apply_penalties(logits, counts, presence=torch.tensor([0.5, 0.0]), frequency=torch.tensor([1.0, -1.0]))
    assert torch.equal(out, torch.tensor([[0.0, -1.5, -3.5, 0.0], [2.0, 0.0, 0.0, 0.0]]))


# ----- min-p and exact numerics, against a float64 reference written out per row -----


def reference_probs(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    """One row's sampling distribution in float64, step by step in vLLM's order: temperature, min-p, top-k,
    top-p. Below the sampling epsilon it is greedy: all mass on the first maximum."""
    x = logits.double()
    if temperature < MIN_SAMPLING_TEMPERATURE:
        return torch.nn.functional.one_hot(x.argmax(), len(x)).double()
    z = (x - x.max()) / temperature
    p = torch.exp(z)
    p = p / p.sum()
    p[p < min_p * p.max()] = 0.0
    order = torch.argsort(z, descending=True, stable=True)
    if top_k > 0:
        p[order[top_k:]] = 0.0
    p = p / p.sum()
    if top_p < 1.0:
        ranked = p[order]
        p[order[torch.cumsum(ranked, 0) - ranked >= top_p]] = 0.0
    return p / p.sum()


def full_distribution(logits: torch.Tensor, params: RowSampling) -> torch.Tensor:
    """filtered_probs spread back over the vocabulary and normalised, in float64."""
    weights, ids = filtered_probs(logits, params)
    assert bool(torch.isfinite(weights).all()) and bool((weights >= 0).all())
    full = (
        weights.double()
        if ids is None
        else torch.zeros(logits.shape, dtype=torch.float64).scatter(1, ids, weights.double())
    )
    return full / full.sum(dim=-1, keepdim=True)


INF = float("inf")
# Rows that break naive scaling: huge magnitudes, -inf entries, near-float32-max values, ties, tiny gaps.
EXTREME_LOGITS = torch.tensor(
    [
        [1e30, -1e30, 0.0, 5e29, -5e29, 1.0, 2.0, 3.0],
        [-INF, 2.0, -INF, 1.0, 0.5, -INF, -1.0, 0.25],
        [3e38, -3e38, 1e38, -1e38, 0.0, 2e38, 1.0, -1.0],
        [1e-3, 2e-3, 3e-3, 0.0, -1e-3, 4e-3, 2.5e-3, 1.5e-3],
        [-INF, -INF, -INF, -INF, -1e30, -INF, -INF, -INF],
        [0.5, -1.5, 2.5, 1.0, -0.5, 0.0, 3.5, -2.5],
    ]
)
TIED_LOGITS = torch.tensor([[0.0] * 8, [1e30] * 8, [-1e30] * 8, [7.0, 7.0, -INF, 7.0, -1e30, 7.0, -INF, -1e30]])
SWEEP_TEMPERATURES = [0.0, 1e-45, 1e-40, 1e-38, 1e-10, 1e-6, 1e-5, 0.5, 1.0, 2.0]
# Above OpenAI's 2, as vLLM accepts: at 1e30 a -1e30 logit is a fair candidate, so ties no longer decide alone.
HUGE_TEMPERATURES = [100.0, 1e30, 3e38]
FILTERS = [
    dict(),
    dict(top_k=3),
    dict(top_p=0.9),
    dict(min_p=0.1),
    dict(top_k=5, top_p=0.8, min_p=0.05),
    dict(top_k=2, top_p=1e-6, min_p=1.0),
]
DRAWS = 16  # each distribution is drawn from this many times, with distinct counters


@pytest.mark.parametrize("filters", FILTERS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()) or "plain")
@pytest.mark.parametrize("temperature", SWEEP_TEMPERATURES)
def test_temperature_sweep_on_extreme_logits_matches_float64_and_never_nan(temperature: float, filters: dict) -> None:
    logits = EXTREME_LOGITS.repeat(DRAWS, 1)
    n = len(logits)
    params = rows(n, temperature=temperature, seed=torch.arange(n) * 7 + 3, **filters)
    tokens = sample(logits, params).tokens
    reference = torch.stack([reference_probs(row, temperature, **filters) for row in EXTREME_LOGITS]).repeat(DRAWS, 1)
    assert bool((reference.gather(1, tokens[:, None]) > 0).all()), "a token outside the distribution was drawn"
    if temperature < MIN_SAMPLING_TEMPERATURE:  # subnormal and tiny temperatures are exactly greedy
        assert torch.equal(tokens, logits.argmax(dim=-1))
        assert torch.equal(tokens, sample(logits, rows(n, temperature=0.0)).tokens)
    else:
        got = full_distribution(EXTREME_LOGITS, rows(len(EXTREME_LOGITS), temperature=temperature, **filters))
        assert torch.allclose(got, reference[: len(EXTREME_LOGITS)], atol=1e-5), (got, reference)


@pytest.mark.parametrize("filters", FILTERS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()) or "plain")
@pytest.mark.parametrize("temperature", HUGE_TEMPERATURES)
def test_huge_temperatures_stay_finite_and_draw_only_possible_tokens(temperature: float, filters: dict) -> None:
    """Past 2 the scaled logits shrink towards float32's resolution, so near-ties among the top-k are ordered by
    rounding; what must hold is no NaN, no -inf token drawn, and the plain distribution as float64 gives it."""
    logits = EXTREME_LOGITS.repeat(DRAWS, 1)
    n = len(logits)
    tokens = sample(logits, rows(n, temperature=temperature, seed=torch.arange(n), **filters)).tokens
    assert bool(torch.isfinite(logits.gather(1, tokens[:, None])).all())
    got = full_distribution(EXTREME_LOGITS, rows(len(EXTREME_LOGITS), temperature=temperature, **filters))
    assert bool(torch.isfinite(got).all()) and torch.allclose(got.sum(dim=-1), torch.ones(len(got), dtype=got.dtype))
    if not filters:
        reference = torch.stack([reference_probs(row, temperature) for row in EXTREME_LOGITS])
        assert torch.allclose(got, reference, atol=1e-5), (got, reference)


@pytest.mark.parametrize("filters", FILTERS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()) or "plain")
@pytest.mark.parametrize("temperature", SWEEP_TEMPERATURES)
def test_tied_logits_never_give_nan_and_draw_only_tied_maxima(temperature: float, filters: dict) -> None:
    logits = TIED_LOGITS.repeat(DRAWS, 1)
    n = len(logits)
    tokens = sample(logits, rows(n, temperature=temperature, seed=torch.arange(n), **filters)).tokens
    assert bool((logits.gather(1, tokens[:, None])[:, 0] == logits.amax(dim=-1)).all())
    if temperature >= MIN_SAMPLING_TEMPERATURE:
        got = full_distribution(logits, rows(n, temperature=temperature, **filters))
        assert bool(torch.isfinite(got).all())
        # Only tied maxima carry mass, and without a count or mass limit they share it equally.
        assert bool((got[logits < logits.amax(dim=-1, keepdim=True)] == 0).all())
        if not filters or filters == dict(min_p=0.1):
            tied = logits == logits.amax(dim=-1, keepdim=True)
            assert torch.allclose(got, tied.double() / tied.sum(dim=-1, keepdim=True), atol=1e-6)


@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_min_p_mixed_with_unfiltered_rows_matches_reference(temperature: float) -> None:
    logits = random_logits(8, vocab=30, seed=9)
    min_p = torch.tensor([0.0, 0.05, 0.0, 0.2, 0.5, 0.0, 0.9, 1.0])
    params = RowSampling(**{**rows(8, temperature=temperature).__dict__, "min_p": min_p})
    got = full_distribution(logits, params)
    for i in range(8):
        expected = reference_probs(logits[i], temperature, min_p=float(min_p[i]))
        assert torch.allclose(got[i], expected, atol=1e-6), i
    assert bool((got[min_p == 0] > 0).all())  # unfiltered rows keep every token
    assert bool(((got > 0).sum(dim=-1)[min_p >= 0.5] < 30).all())  # filtered rows really dropped some
    # Drawn tokens respect the filter.
    many = logits.repeat(200, 1)
    drawn = sample(
        many, RowSampling(**{**rows(1600, temperature=temperature, seed=5).__dict__, "min_p": min_p.repeat(200)})
    )
    assert bool((got.repeat(200, 1).gather(1, drawn.tokens[:, None]) > 0).all())


def test_min_p_samples_from_the_renormalised_survivors() -> None:
    n = 40_000
    probs = torch.softmax(FIXED_LOGITS.double(), dim=-1)  # ~[0.55, 0.20, 0.12, 0.07, ...]
    min_p = 0.2  # keeps tokens with p >= 0.2 * 0.55 = 0.11: the first three
    freq = _frequencies(_sampled(rows(n, min_p=min_p, seed=17), n))
    kept = torch.zeros_like(probs)
    kept[:3] = probs[:3] / probs[:3].sum()
    assert torch.allclose(freq, kept, atol=0.01), (freq, kept)


def test_greedy_epsilon_is_shared_by_sampling_params_and_the_sampler() -> None:
    below, at = MIN_SAMPLING_TEMPERATURE / 2, MIN_SAMPLING_TEMPERATURE
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=below).greedy
    assert not SamplingParams(temperature=at).greedy
    logits = torch.tensor([[0.0, 1e-6, 0.0]]).repeat(64, 1)  # a gap of 1e-6 is a tenth of the epsilon
    greedy = sample(logits, rows(64, temperature=below, seed=torch.arange(64))).tokens
    assert bool((greedy == 1).all())
    sampled = sample(logits, rows(64, temperature=at, seed=torch.arange(64))).tokens
    assert bool((sampled != 1).any())
