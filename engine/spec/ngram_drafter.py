"""N-gram (prompt lookup) drafts: propose the tokens that followed the most recent earlier occurrence of a sequence's
last n tokens, trying the longest n first (vLLM's `ngram` method, llama.cpp's lookup decoding)."""

from __future__ import annotations

import torch


def propose_ngram(tokens: torch.Tensor, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` draft tokens for the sequence `tokens` ([length] long): the tokens after the latest earlier
    occurrence of its last n tokens, for the largest n in [n_min, n_max] that occurs; [] if none does.

    Each n is one vectorised comparison of every window with the suffix, O(length * n)."""
    length = int(tokens.shape[0])
    if k <= 0:
        return []
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        # Windows starting at 0 .. length - n - 1: each is followed by at least one token, and the suffix itself
        # (starting at length - n) is not among them.
        windows = tokens[: length - 1].unfold(0, n, 1)
        hits = (windows == tokens[length - n :]).all(dim=1).nonzero()
        if len(hits):
            start = int(hits[-1, 0]) + n
            return tokens[start : start + k].tolist()
    return []
