"""Vectorised per-row sampling: greedy, temperature, min-p, top-k, top-p, seeds and logprobs.

Randomness is counter-based: the uniform number for a row's n-th output token is a hash of (seed, n). A
seeded request therefore draws the same numbers whatever else shares its batch, and a preempted sequence
that is recomputed continues exactly where it left off.

Numerics: temperatures below MIN_SAMPLING_TEMPERATURE are greedy, and a row is shifted by its maximum before a
temperature below 1 divides it (a larger one divides first), so the top token scores exactly 0 and every other
one <= 0: dividing by a small temperature can only push logits towards -inf (probability 0), never to +inf, and
softmax never sees inf - inf.
Given a row with at least one finite logit and none +inf or NaN (the engine's validation and edits keep it so), no
filter produces NaN or inf.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sample.kernels import argmax_rows, token_logprobs
from engine.sample.logits_processors import LogitsEdits
from engine.sample.sampling_params import MIN_SAMPLING_TEMPERATURE

_MASK32 = 0xFFFFFFFF


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding values < 2**32."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def counter_uniform(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """A uniform float64 in (0, 1) per element from int64 seeds and counters."""
    low = seed & _MASK32
    high = (seed >> 32) & _MASK32
    h = _fmix32(low ^ _fmix32(high ^ 0x5BD1E995))
    h = _fmix32(h ^ ((counter * 0x9E3779B1) & _MASK32))
    return (h.double() + 0.5) / 2.0**32


@dataclass(frozen=True)
class RowSampling:
    """Sampling parameters of the rows that sample this step, one entry per row."""

    temperature: torch.Tensor  # [rows] float32
    top_p: torch.Tensor  # [rows] float32
    top_k: torch.Tensor  # [rows] int64, 0 = off
    seed: torch.Tensor  # [rows] int64
    counter: torch.Tensor  # [rows] int64, index of the output token being sampled
    num_logprobs: int  # top alternatives to return (max over rows), 0 = none
    want_logprobs: bool
    min_p: torch.Tensor | None = None  # [rows] float32, 0 = off; None when no row of the step filters by it


@dataclass(frozen=True)
class SampleResult:
    tokens: torch.Tensor  # [rows] int64
    logprobs: torch.Tensor | None  # [rows] float32, log-probability of the chosen token
    top_ids: torch.Tensor | None  # [rows, k] int64
    top_logprobs: torch.Tensor | None  # [rows, k] float32


def sample(logits: torch.Tensor, params: RowSampling, edits: LogitsEdits | None = None) -> SampleResult:
    """logits: [rows, vocab] float32 from the model; `edits` (bias, masks, penalties) are applied here."""
    processed = logits if edits is None else edits.apply(logits)
    greedy_tokens = argmax_rows(processed)  # one pass over the vocabulary where the kernel is built
    random_rows = params.temperature >= MIN_SAMPLING_TEMPERATURE
    tokens = greedy_tokens
    if bool(random_rows.any()):
        chosen = _sample_random(processed[random_rows], _subset(params, random_rows))
        tokens = greedy_tokens.clone()
        tokens[random_rows] = chosen
    if not params.want_logprobs:
        return SampleResult(tokens, None, None, None)
    # The model's own distribution, before edits, temperature and filters: vLLM's default logprobs_mode
    # ("raw_logprobs"). A token a filter or penalty made unlikely still reports what the model thought of it.
    chosen_logprobs, top_ids, top_logprobs = token_logprobs(logits, tokens, params.num_logprobs)
    return SampleResult(tokens, chosen_logprobs, top_ids, top_logprobs)


def _subset(params: RowSampling, rows: torch.Tensor) -> RowSampling:
    return RowSampling(
        params.temperature[rows],
        params.top_p[rows],
        params.top_k[rows],
        params.seed[rows],
        params.counter[rows],
        params.num_logprobs,
        params.want_logprobs,
        None if params.min_p is None else params.min_p[rows],
    )


def filtered_probs(logits: torch.Tensor, params: RowSampling) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's sampling weights after temperature, min-p, top-k and top-p (vLLM's order), not normalised.

    Returns (weights [rows, width], ids [rows, width] or None): weights are over the whole vocabulary when ids is
    None, else over the candidate tokens `ids`, best first. Every temperature must be >= MIN_SAMPLING_TEMPERATURE.
    """
    # Shifted by the row maximum so the top token scores 0: see the module docstring. A temperature of 1 or more
    # divides first: it can only shrink values, and the shift of two near-float32-max logits cannot overflow then.
    temperature = params.temperature[:, None]
    top = logits.amax(dim=-1, keepdim=True)
    scaled = torch.where(temperature >= 1.0, logits / temperature - top / temperature, (logits - top) / temperature)
    if params.min_p is not None:
        # p_i >= min_p * p_top  <=>  scaled_i >= log(min_p), as the top token scores 0; min_p = 0 keeps all.
        scaled.masked_fill_(scaled < params.min_p.log()[:, None], float("-inf"))
    vocab = scaled.shape[-1]
    needs_top_p = bool((params.top_p < 1.0).any())
    top_k = torch.where(params.top_k > 0, params.top_k.clamp(max=vocab), vocab)
    if not (needs_top_p or bool((top_k < vocab).any())):
        return torch.softmax(scaled, dim=-1), None
    # Candidates in descending order; a full sort only when some row filters by top-p.
    width = vocab if needs_top_p else int(top_k.max())
    cand_logits, cand_ids = scaled.topk(width, dim=-1, sorted=True)
    rank = torch.arange(width, device=logits.device)
    cand_logits = cand_logits.masked_fill(rank[None, :] >= top_k[:, None], float("-inf"))
    probs = torch.softmax(cand_logits, dim=-1)
    if needs_top_p:
        # The top candidate has nothing before it, so every row keeps at least one token.
        mass_before = torch.cumsum(probs, dim=-1) - probs
        probs = probs.masked_fill(mass_before >= params.top_p[:, None], 0.0)
    return probs, cand_ids


def vocab_probs(logits: torch.Tensor, params: RowSampling) -> torch.Tensor:
    """[rows, vocab] each row's sampling weights (not normalised) in vocabulary order, whatever the filters."""
    probs, cand_ids = filtered_probs(logits, params)
    return probs if cand_ids is None else torch.zeros_like(logits).scatter_(1, cand_ids, probs)


def _sample_random(logits: torch.Tensor, params: RowSampling) -> torch.Tensor:
    # The inverse CDF in vocabulary order, never in the filters' sorted order: a row's token for a given uniform
    # then depends only on its own distribution, not on whether another row of the batch (or a draft position,
    # engine/spec/verify.py) made the step take the sorted path.
    probs = vocab_probs(logits, params)
    cdf = torch.cumsum(probs.double(), dim=-1)
    # u in (0, 1) scaled by the total: the first index whose cdf reaches it has a weight > 0.
    u = counter_uniform(params.seed, params.counter).to(cdf.device) * cdf[:, -1]
    return torch.searchsorted(cdf, u[:, None])[:, 0].clamp(max=probs.shape[-1] - 1)
