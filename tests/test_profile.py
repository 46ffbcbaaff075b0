"""benchmarks.profile's transient probe, on an engine whose step times follow a known rule and a clock it moves.

The real engine's decode steps run slower for a few steps after a step on the dense copy (the quantised weights
coming back into the caches); `measure_after_large` must report that extra position by position.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from benchmarks.profile import AFTER_LARGE_SETTLED, AFTER_LARGE_STEPS, measure_after_large
from engine.sampling_params import SamplingParams

SWITCH_TOKENS = 10
DECODE_S = 0.001  # per row of a small step
PREFILL_S = 0.010  # a large step, whatever it holds
TRANSIENT_S = (0.005, 0.004, 0.003, 0.002, 0.001)  # the k-th small step after a large one costs this much more


class TimedEngine:
    """Keeps the engine's per-sequence counts and advances `now` by each step's cost under the rule above."""

    def __init__(self) -> None:
        self.now = 0.0
        self._pending: dict[int, int] = {}
        self._computed: dict[int, int] = {}
        self._since_large = len(TRANSIENT_S)  # settled

    def clock(self) -> float:
        return self.now

    def add(self, seq_id: int, prompt: Sequence[int], params: SamplingParams) -> None:
        assert seq_id not in self._pending
        self._pending[seq_id], self._computed[seq_id] = len(prompt), 0

    def reserve(self, seq_id: int, total_tokens: int) -> bool:
        return True

    def num_pending(self, seq_id: int) -> int:
        return self._pending[seq_id]

    def num_computed(self, seq_id: int) -> int:
        return self._computed[seq_id]

    def remove(self, seq_id: int) -> None:
        del self._pending[seq_id], self._computed[seq_id]

    def step(self, schedule: Sequence[tuple[int, int]]) -> None:
        tokens = sum(count for _, count in schedule)
        if tokens > SWITCH_TOKENS:
            self.now += PREFILL_S
            self._since_large = 0
        else:
            transient = TRANSIENT_S[self._since_large] if self._since_large < len(TRANSIENT_S) else 0.0
            self.now += DECODE_S * len(schedule) + transient
            self._since_large += 1
        for seq_id, count in schedule:
            assert 1 <= count <= self._pending[seq_id]
            self._computed[seq_id] += count
            self._pending[seq_id] -= count
            if self._pending[seq_id] == 0:  # sampled: one new token pending
                self._pending[seq_id] = 1


def test_measure_after_large_reports_each_positions_extra_over_the_settled_decode() -> None:
    engine = TimedEngine()
    extra = measure_after_large(engine, vocab=1000, first_id=100, repeats=3, clock=engine.clock)  # type: ignore[arg-type]
    assert len(extra) == AFTER_LARGE_STEPS
    expected = [*TRANSIENT_S, 0.0, 0.0, 0.0][:AFTER_LARGE_STEPS]
    assert list(extra) == pytest.approx(expected, abs=1e-12)
    assert len(TRANSIENT_S) < AFTER_LARGE_SETTLED  # the reference steps are past the transient
    with pytest.raises(KeyError):
        engine.num_pending(100)  # its decoder is gone again
