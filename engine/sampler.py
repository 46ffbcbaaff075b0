"""Vectorised per-row sampling: greedy, temperature, top-k, top-p, penalties, seeds and logprobs.

Randomness is counter-based: the uniform number for a row's n-th output token is a hash of (seed, n). A
seeded request therefore draws the same numbers whatever else shares its batch, and a preempted sequence
that is recomputed continues exactly where it left off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    presence_penalty: torch.Tensor  # [rows] float32
    frequency_penalty: torch.Tensor  # [rows] float32
    num_logprobs: int  # top alternatives to return (max over rows), 0 = none
    want_logprobs: bool


@dataclass(frozen=True)
class SampleResult:
    tokens: torch.Tensor  # [rows] int64
    logprobs: torch.Tensor | None  # [rows] float32, log-probability of the chosen token
    top_ids: torch.Tensor | None  # [rows, k] int64
    top_logprobs: torch.Tensor | None  # [rows, k] float32


def apply_penalties(
    logits: torch.Tensor, output_counts: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor
) -> torch.Tensor:
    """OpenAI-style penalties; output_counts is [rows, vocab], how often each token was generated so far."""
    return logits - frequency[:, None] * output_counts - presence[:, None] * (output_counts > 0).float()


def sample(logits: torch.Tensor, params: RowSampling) -> SampleResult:
    """logits: [rows, vocab] float32, penalties already applied."""
    greedy_tokens = logits.argmax(dim=-1)
    random_rows = params.temperature > 0
    tokens = greedy_tokens
    if bool(random_rows.any()):
        chosen = _sample_random(logits[random_rows], _subset(params, random_rows))
        tokens = greedy_tokens.clone()
        tokens[random_rows] = chosen
    if not params.want_logprobs:
        return SampleResult(tokens, None, None, None)
    # Log-probabilities of the model's distribution, before temperature and filters (as vLLM reports them).
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen_logprobs = logprobs.gather(1, tokens[:, None])[:, 0]
    top_ids = top_logprobs = None
    if params.num_logprobs > 0:
        top_logprobs, top_ids = logprobs.topk(params.num_logprobs, dim=-1)
    return SampleResult(tokens, chosen_logprobs, top_ids, top_logprobs)


def _subset(params: RowSampling, rows: torch.Tensor) -> RowSampling:
    return RowSampling(
        params.temperature[rows],
        params.top_p[rows],
        params.top_k[rows],
        params.seed[rows],
        params.counter[rows],
        params.presence_penalty[rows],
        params.frequency_penalty[rows],
        params.num_logprobs,
        params.want_logprobs,
    )


def _sample_random(logits: torch.Tensor, params: RowSampling) -> torch.Tensor:
    scaled = logits / params.temperature[:, None]
    vocab = scaled.shape[-1]
    needs_top_p = bool((params.top_p < 1.0).any())
    top_k = torch.where(params.top_k > 0, params.top_k.clamp(max=vocab), vocab)
    if needs_top_p or bool((top_k < vocab).any()):
        # Candidates in descending order; a full sort only when some row filters by top-p.
        width = vocab if needs_top_p else int(top_k.max())
        cand_logits, cand_ids = scaled.topk(width, dim=-1, sorted=True)
        rank = torch.arange(width, device=logits.device)
        cand_logits = cand_logits.masked_fill(rank[None, :] >= top_k[:, None], float("-inf"))
        probs = torch.softmax(cand_logits, dim=-1)
        if needs_top_p:
            mass_before = torch.cumsum(probs, dim=-1) - probs
            probs = probs.masked_fill(mass_before >= params.top_p[:, None], 0.0)
    else:
        probs = torch.softmax(scaled, dim=-1)
        cand_ids = None
    cdf = torch.cumsum(probs.double(), dim=-1)
    u = counter_uniform(params.seed, params.counter).to(cdf.device) * cdf[:, -1]
    index = torch.searchsorted(cdf, u[:, None])[:, 0].clamp(max=probs.shape[-1] - 1)
    return index if cand_ids is None else cand_ids.gather(1, index[:, None])[:, 0]
