"""micro/rows.add_row: a row the cache cannot hold is taken out again, so a failed measurement leaves no row behind."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from benchmarks.micro.rows import add_row
from engine.sample.sampling_params import SamplingParams


class Engine:
    def __init__(self, free_tokens: int) -> None:
        self.free_tokens = free_tokens
        self.rows: dict[int, list[int]] = {}

    def add(self, seq_id: int, prompt: Sequence[int], params: SamplingParams) -> None:
        self.rows[seq_id] = list(prompt)

    def reserve(self, seq_id: int, tokens: int) -> bool:
        if tokens > self.free_tokens:
            return False
        self.free_tokens -= tokens
        return True

    def remove(self, seq_id: int) -> None:
        self.rows.pop(seq_id, None)


def test_a_row_that_fits_stays_and_one_that_does_not_is_removed() -> None:
    engine: Any = Engine(free_tokens=10)
    add_row(engine, 1, [5, 6], SamplingParams(max_tokens=4), 6, "too small")
    assert engine.rows == {1: [5, 6]} and engine.free_tokens == 4
    with pytest.raises(ValueError, match="too small for the grid"):
        add_row(engine, 2, [7], SamplingParams(max_tokens=8), 9, "too small for the grid")
    assert engine.rows == {1: [5, 6]}
