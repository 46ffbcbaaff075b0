"""N-gram (prompt lookup) drafts: propose the tokens that followed the most recent earlier occurrence of a sequence's
last n tokens, trying the longest n first (vLLM's `ngram` method, llama.cpp's lookup decoding)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class NgramIndex:
    """A growing sequence's tokens and, for each of its n-grams (n_min <= n <= n_max) that some token follows, the
    latest place it starts: a draft is then a few dictionary lookups a step. Searching all the tokens every step
    (one vectorised comparison per n) cost ~70 us at 300 tokens, ~1 % of a batch-1 step, and grew with the length."""

    n_min: int
    n_max: int
    tokens: list[int] = field(default_factory=list)
    latest: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> its latest start

    def extend(self, new: Sequence[int]) -> None:
        """Append tokens: each one is what follows the n-grams that end just before it."""
        tokens, latest = self.tokens, self.latest
        for token in new:
            end = len(tokens)
            for n in range(self.n_min, min(self.n_max, end) + 1):
                latest[tuple(tokens[end - n : end])] = end - n
            tokens.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens after the latest earlier occurrence of the sequence's last n tokens, for the largest n
        in [n_min, n_max] that occurs; [] if none does. The continuation may run into the suffix itself."""
        length = len(self.tokens)
        if k <= 0:
            return []
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            start = self.latest.get(tuple(self.tokens[length - n :]))
            if start is not None:
                return self.tokens[start + n : start + n + k]
        return []
