"""engine.spec.ngram_drafter: the latest earlier occurrence of the longest suffix, checked against a plain loop, and the
index a growing sequence keeps giving the same drafts as a search of all its tokens."""

from __future__ import annotations

import random

from engine.spec.ngram_drafter import NgramIndex
from tests.engine.helpers import propose_ngram


def reference(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def propose(tokens: list[int], k: int, n_min: int = 1, n_max: int = 3) -> list[int]:
    return propose_ngram(tokens, k, n_min, n_max)


def test_the_tokens_after_the_latest_occurrence() -> None:
    assert propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 3) == [7, 8, 1]
    assert propose([5, 6, 7, 5, 6], 4) == [7, 5, 6]  # the continuation may run into the suffix itself


def test_longer_ngrams_win_over_more_recent_shorter_ones() -> None:
    # The 2-gram (4, 2) occurs at 0; the 1-gram (2) occurs later at 4 (followed by 8): the longer match wins.
    assert propose([4, 2, 5, 6, 2, 8, 4, 2], 2, n_min=1, n_max=2) == [5, 6]
    assert propose([4, 2, 5, 6, 2, 8, 4, 2], 2, n_min=1, n_max=1) == [8, 4]


def test_no_draft_without_a_match_or_room() -> None:
    assert propose([1, 2, 3, 4], 3) == []
    assert propose([1, 2, 3, 4, 3, 9], 3, n_min=2) == []  # only a 1-gram matches, below n_min
    assert propose([7], 3) == []
    assert propose([1, 1], 0) == []
    assert propose([1, 2, 1], 5) == [2, 1]  # fewer than k follow


def test_matches_the_reference_on_random_sequences() -> None:
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        k, n_min = rng.randrange(1, 6), rng.randrange(1, 4)
        n_max = n_min + rng.randrange(0, 3)
        assert propose(tokens, k, n_min, n_max) == reference(tokens, k, n_min, n_max), (tokens, k, n_min, n_max)


def test_a_growing_index_drafts_as_a_search_of_all_its_tokens() -> None:
    # Tokens arrive one or several at a time (a verify step emits up to k + 1): after each arrival the index must
    # propose exactly what the plain loop finds over everything so far, prompt and output alike.
    rng = random.Random(1)
    for _ in range(100):
        n_min = rng.randrange(1, 4)
        n_max = n_min + rng.randrange(0, 3)
        tokens = [rng.randrange(5) for _ in range(rng.randrange(0, 12))]
        index = NgramIndex(n_min, n_max)
        index.extend(tokens)
        for _ in range(20):
            k = rng.randrange(1, 6)
            assert index.propose(k) == reference(tokens, k, n_min, n_max), (tokens, k, n_min, n_max)
            new = [rng.randrange(5) for _ in range(rng.randrange(1, 5))]
            tokens += new
            index.extend(new)
        assert index.tokens == tokens
