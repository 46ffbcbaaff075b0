"""Tests for engine.sampler: counter-based uniforms, greedy and filtered sampling, penalties, logprobs."""

from __future__ import annotations

import pytest
import torch

from engine.sampler import RowSampling, apply_penalties, counter_uniform, sample

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
) -> RowSampling:
    seeds = seed if isinstance(seed, torch.Tensor) else torch.full((n,), seed, dtype=torch.long)
    return RowSampling(
        temperature=torch.full((n,), temperature),
        top_p=torch.full((n,), top_p),
        top_k=torch.full((n,), top_k, dtype=torch.long),
        seed=seeds,
        counter=torch.arange(n, dtype=torch.long) if counter is None else counter,
        presence_penalty=torch.zeros(n),
        frequency_penalty=torch.zeros(n),
        num_logprobs=num_logprobs,
        want_logprobs=want_logprobs,
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
