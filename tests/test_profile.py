"""benchmarks.profile's timing procedure, on an engine whose step times follow a known rule and a clock it moves.

The real engine's decode steps run slower for a few steps after a step on the dense copy (the quantised weights
coming back into the caches). The grid's decode points must be timed past that transient, and
`measure_after_large` must report the transient itself, position by position.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from benchmarks.profile import (
    AFTER_LARGE_STEPS,
    DECODE_SETTLE_STEPS,
    Grid,
    measure,
    measure_after_large,
)
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


def test_decode_points_are_timed_past_the_transient_after_a_prefill() -> None:
    engine = TimedEngine()
    grid = Grid(batch_sizes=(0, 1, 2, 4), prefill_tokens=(0, 32), contexts=(16, 64), repeats=3)
    points = measure(engine, grid, vocab=1000, clock=engine.clock)  # type: ignore[arg-type]
    decode = {(p.context, p.decode_rows): p.seconds for p in points if p.prefill_tokens == 0}
    # Every context's decoders were just prefilled (large steps), yet each decode point is its settled cost.
    assert decode == {(c, b): pytest.approx(DECODE_S * b) for c in (16, 64) for b in (1, 2, 4)}
    mixed = [p for p in points if p.prefill_tokens]
    assert len(mixed) == 2 * 4 and all(p.seconds == pytest.approx(PREFILL_S) for p in mixed)
    assert len(TRANSIENT_S) < DECODE_SETTLE_STEPS  # else this test could not tell


def test_measure_after_large_reports_each_positions_extra_over_the_settled_decode() -> None:
    engine = TimedEngine()
    extra = measure_after_large(engine, vocab=1000, first_id=100, repeats=3, clock=engine.clock)  # type: ignore[arg-type]
    assert len(extra) == AFTER_LARGE_STEPS
    expected = [*TRANSIENT_S, 0.0, 0.0, 0.0][:AFTER_LARGE_STEPS]
    assert list(extra) == pytest.approx(expected, abs=1e-12)
    with pytest.raises(KeyError):
        engine.num_pending(100)  # its decoder is gone again


def test_grid_budgets_each_decoder_for_every_step_it_takes() -> None:
    grid = Grid(batch_sizes=(1, 2, 4, 8), prefill_tokens=(0, 32, 128, 512), contexts=(32,), repeats=3)
    order = grid.points_in_order()
    assert order[:4] == [(1, 0), (2, 0), (4, 0), (8, 0)]  # decode-only first: no prefill between them
    steps_of_row_0 = sum((DECODE_SETTLE_STEPS if p == 0 else 1) + grid.repeats for _, p in order)
    assert steps_of_row_0 <= grid.steps_per_context
