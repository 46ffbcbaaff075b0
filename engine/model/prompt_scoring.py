"""Scores prompt tokens under the model: each scored position's logprob, rank and best alternatives.

The LM head runs only over the positions asked for, one slice of positions at a time: each slice's
[slice, vocab] logits are reduced to a few numbers per position and dropped, so a long prompt never holds
[prompt, vocab] logits at once. On the CPU the reduction is one compiled kernel (engine/csrc/sampling.cpp)
reading each row in cache, where torch needs five passes and two more [slice, vocab] tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.platform.native import ScoreKernel

# Positions per LM-head call: [128, 49152] float32 logits are 25 MB. Larger slices gain little matmul speed and
# make every slice's temporaries fresh memory (page faults) rather than reused heap.
DEFAULT_SLICE = 128
KERNEL_MAX_TOP_K = 32  # beyond this many alternatives per position, torch's top-k is faster than the kernel's


@dataclass(frozen=True)
class PromptScores:
    """Per scored position, in the order of the batch's `PromptScoring`."""

    logprobs: torch.Tensor  # [n] float32, log-probability of the actual token
    ranks: torch.Tensor  # [n] int64, 1 + vocabulary entries with a strictly higher logprob
    top_ids: torch.Tensor  # [n, k] int64, best first
    top_logprobs: torch.Tensor  # [n, k] float32


@torch.inference_mode()
def score_positions(
    hidden: torch.Tensor,
    index: torch.Tensor,
    target: torch.Tensor,
    top_k: int,
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    slice_size: int = DEFAULT_SLICE,
    kernel: ScoreKernel | None = None,
) -> PromptScores:
    """hidden: [tokens, hidden] the last layer's output; index, target: [n] which rows score which token id.

    `logits_of` maps hidden rows to float32 logits (final norm and LM head); `kernel` (CPU only) reduces them."""
    if slice_size < 1:
        raise ValueError(f"slice_size must be positive, got {slice_size}")
    n = int(index.shape[0])
    device = hidden.device
    logprobs = torch.empty(n, dtype=torch.float32, device=device)
    ranks = torch.empty(n, dtype=torch.long, device=device)
    top_ids = torch.empty(n, top_k, dtype=torch.long, device=device)
    top_logprobs = torch.empty(n, top_k, dtype=torch.float32, device=device)
    for lo in range(0, n, slice_size):
        hi = min(lo + slice_size, n)
        logits = logits_of(hidden[index[lo:hi]])  # [slice, vocab]
        if kernel is not None and logits.device.type == "cpu":
            if top_k <= KERNEL_MAX_TOP_K:
                logprobs[lo:hi], ranks[lo:hi], top_ids[lo:hi], top_logprobs[lo:hi] = kernel(
                    logits, target[lo:hi], top_k
                )
                continue
            # The kernel's top-k inserts into a sorted list (quadratic in k): many alternatives go through torch.
            chosen_logprobs, ranks[lo:hi], _, _ = kernel(logits, target[lo:hi], 0)
            logprobs[lo:hi] = chosen_logprobs
            log_partition = logits.gather(1, target[lo:hi, None]) - chosen_logprobs[:, None]
            values, top_ids[lo:hi] = logits.topk(top_k, dim=-1)
            top_logprobs[lo:hi] = values - log_partition
            continue
        # log_softmax is one fused pass; logsumexp plus a subtraction measured slower.
        slice_logprobs = torch.log_softmax(logits, dim=-1)
        chosen = slice_logprobs.gather(1, target[lo:hi, None])
        logprobs[lo:hi] = chosen[:, 0]
        ranks[lo:hi] = (slice_logprobs > chosen).sum(dim=-1, dtype=torch.int32) + 1  # int32 sums run ~2x faster
        if top_k:  # for one alternative (lm-eval's greedy check) a max is cheaper than a top-k
            best = slice_logprobs.max(dim=-1, keepdim=True) if top_k == 1 else slice_logprobs.topk(top_k, dim=-1)
            values, ids = best
            top_logprobs[lo:hi] = values
            top_ids[lo:hi] = ids
    return PromptScores(logprobs, ranks, top_ids, top_logprobs)
