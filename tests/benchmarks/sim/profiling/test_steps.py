"""The profiler's grid and transient probe (benchmarks.sim.profiling.steps), on an engine whose step times follow a
known rule and a clock it moves.

The real engine's decode steps run slower for a few steps after a step on the dense copy (the quantised weights
coming back into the caches); `measure_after_large` must report that extra position by position, against the
decode steps from `AFTER_LARGE_SETTLED` on, as a median over its prefills.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from benchmarks.sim.cost.speculation import decode_shape
from benchmarks.sim.profiling.steps import (
    AFTER_LARGE_SETTLED,
    AFTER_LARGE_STEPS,
    PREFILL_PROBE_TOKENS,
    Grid,
    after_large_probe_tokens,
    grid_kv_tokens,
    measure,
    measure_after_large,
    step_shape,
)
from engine.sample.sampling_params import SamplingParams

SWITCH_TOKENS = 10
DECODE_S = 0.001  # a 1-row small step, settled
PREFILL_S = 0.010  # a large step, whatever it holds
# The k-th small step after a large one costs this much more: a transient, a step faster than settled (reported
# as 0), and two slow steps past the reported positions but before the reference.
EXTRA_S = (0.005, 0.004, 0.003, 0.002, 0.001, 0.0005, 0.0002, -0.0003, 0.0003, 0.0003)
DRIFT_S = 0.0001  # from AFTER_LARGE_SETTLED on, each step 0.1 ms more: the reference's median is its middle
OUTLIER_S = 0.050  # every step after the second prefill: a median over three prefills ignores it


class TimedEngine:
    """Keeps the engine's per-sequence counts and checks as the real one does, and advances `now` by each step's
    cost under the rules above."""

    def __init__(self, kv_cache_tokens: int = 4096) -> None:
        self.now = 0.0
        self.kv_cache_tokens = kv_cache_tokens
        self.pending: dict[int, int] = {}
        self._computed: dict[int, int] = {}
        self._reserved: dict[int, int] = {}
        self._since_large = 1 << 20
        self._large_steps = 0

    def clock(self) -> float:
        return self.now

    def add(self, seq_id: int, prompt: Sequence[int], params: SamplingParams) -> None:
        assert seq_id not in self.pending
        self.pending[seq_id], self._computed[seq_id], self._reserved[seq_id] = len(prompt), 0, 0

    def reserve(self, seq_id: int, total_tokens: int) -> bool:
        others = sum(tokens for other, tokens in self._reserved.items() if other != seq_id)
        if others + total_tokens > self.kv_cache_tokens:
            return False
        self._reserved[seq_id] = max(self._reserved[seq_id], total_tokens)
        return True

    def num_pending(self, seq_id: int) -> int:
        return self.pending[seq_id]

    def num_computed(self, seq_id: int) -> int:
        return self._computed[seq_id]

    def remove(self, seq_id: int) -> None:  # as the engine's: a sequence that is gone already is a no-op
        for table in (self.pending, self._computed, self._reserved):
            table.pop(seq_id, None)

    def step(self, schedule: Sequence[tuple[int, int]], drafts: Mapping[int, Sequence[int]] | None = None) -> None:
        """Drafts are checked as the engine checks them and all rejected: the row gains one token, as plain."""
        for seq_id, count in schedule:
            assert 1 <= count <= self.pending[seq_id]
            k = len((drafts or {}).get(seq_id, ()))
            assert self._computed[seq_id] + count + k <= self._reserved[seq_id], "stepped past its reservation"
            assert not k or count == self.pending[seq_id], "drafts for a row that does not sample"
        if sum(count for _, count in schedule) > SWITCH_TOKENS:
            self.now += PREFILL_S
            self._since_large, self._large_steps = 0, self._large_steps + 1
        else:
            k = self._since_large
            extra = EXTRA_S[k] if k < len(EXTRA_S) else DRIFT_S * (k - AFTER_LARGE_SETTLED)
            self.now += DECODE_S * len(schedule) + extra + (OUTLIER_S if self._large_steps == 3 else 0.0)
            self._since_large += 1
        for seq_id, count in schedule:
            self._computed[seq_id] += count
            self.pending[seq_id] -= count
            if self.pending[seq_id] == 0:  # sampled: one new token pending
                self.pending[seq_id] = 1


def test_measure_after_large_reports_each_positions_median_extra_over_the_settled_steps() -> None:
    engine = TimedEngine()
    extra = measure_after_large(engine, vocab=1000, first_id=100, repeats=3, clock=engine.clock)  # type: ignore[arg-type]
    assert len(extra) == AFTER_LARGE_STEPS == len(EXTRA_S) - 2 and len(EXTRA_S) == AFTER_LARGE_SETTLED
    # The reference is positions 10-17, whose settled costs rise by 0.1 ms a step: median 0.35 ms above DECODE_S.
    reference = DRIFT_S * (AFTER_LARGE_STEPS - 1) / 2
    expected = [max(0.0, e - reference) for e in EXTRA_S[:AFTER_LARGE_STEPS]]
    assert list(extra) == pytest.approx(expected, abs=1e-12)
    assert extra[AFTER_LARGE_STEPS - 1] == 0.0  # faster than the reference: clamped
    assert engine.pending == {}  # its decoder and every prefill are gone


def test_measure_after_large_fits_in_the_tokens_it_asks_for_and_cleans_up_when_it_fails() -> None:
    repeats = 2
    needed = after_large_probe_tokens(repeats) + PREFILL_PROBE_TOKENS + 1
    exact = TimedEngine(needed)  # the decoder and one prefill beside it, to the token
    assert len(measure_after_large(exact, 1000, 0, repeats, exact.clock)) == AFTER_LARGE_STEPS  # type: ignore[arg-type]
    short = TimedEngine(needed - PREFILL_PROBE_TOKENS)  # the decoder fits, a prefill beside it does not
    with pytest.raises(ValueError, match="too small"):
        measure_after_large(short, 1000, 0, repeats, short.clock)  # type: ignore[arg-type]
    assert short.pending == {}
    with pytest.raises(ValueError, match="at least one"):
        measure_after_large(TimedEngine(), 1000, 0, 0)  # type: ignore[arg-type]


STEP_S_PER_TOKEN = 0.001
SLOW = 3.0  # a slow stretch of the VM: every step in it takes three times as long


class DriftingEngine(TimedEngine):
    """Steps cost `STEP_S_PER_TOKEN` a token, except the steps whose index lies in `slow_steps`."""

    def __init__(self, kv_cache_tokens: int, slow_steps: range) -> None:
        super().__init__(kv_cache_tokens)
        self.slow_steps = slow_steps
        self.steps = 0

    def step(self, schedule: Sequence[tuple[int, int]], drafts: Mapping[int, Sequence[int]] | None = None) -> None:
        before = self.now
        super().step(schedule, drafts)
        cost = STEP_S_PER_TOKEN * sum(count + len((drafts or {}).get(seq_id, ())) for seq_id, count in schedule)
        self.now = before + cost * (SLOW if self.steps in self.slow_steps else 1.0)
        self.steps += 1


def test_the_grid_takes_each_points_median_over_rounds_so_a_slow_stretch_bends_no_point() -> None:
    grid = Grid(batch_sizes=(1, 2, 4), prefill_tokens=(0, 16), contexts=(8, 24), repeats=3, draft_tokens=3)
    # 18 points (2 plain and a verify point per batch size and context) of 2 steps each: 36 steps a round. Any 18
    # steps in a row hold at most one visit of each point; these 18 (after the 8 decoders' prefill steps and a round)
    # are the second context's whole block in the second round, so timing point by point would have put a slow
    # stretch on each of its nine points' every repeat.
    engine = DriftingEngine(grid_kv_tokens(grid), slow_steps=range(8 + 36 + 18, 8 + 36 + 36))
    points = measure(engine, grid, vocab=1000, clock=engine.clock)  # type: ignore[arg-type]
    assert [(p.context, p.decode_rows, p.prefill_tokens, p.drafts) for p in points] == [
        (context, batch, prefill, drafts)
        for context in (8, 24)
        for batch in (1, 2, 4)
        for prefill, drafts in ((0, 0), (16, 0), (0, 3))
    ]
    for point in points:
        width = point.decode_rows * (1 + point.drafts)
        assert point.shape.num_tokens == width + point.prefill_tokens
        assert point.seconds == pytest.approx(STEP_S_PER_TOKEN * point.shape.num_tokens, rel=1e-9)
        # A verify row is one sequence computing and sampling k + 1 positions, each attending to its context.
        assert point.shape.num_seqs == point.decode_rows + (1 if point.prefill_tokens else 0)
        if point.drafts:
            assert point.shape.num_sampled == width
            assert point.shape.attention_pairs > width * point.context
    assert engine.steps == 8 + 3 * 36  # every step accounted for: the window fell inside the rounds
    assert engine.pending == {}  # the decoders and every prefill are gone


def test_the_profile_sees_a_verify_row_as_the_simulator_charges_it() -> None:
    engine = TimedEngine()
    engine.add(0, list(range(41)), SamplingParams(max_tokens=8))
    assert engine.reserve(0, 50)
    engine.step([(0, 40)])  # 40 keys cached, the 41st token pending
    assert step_shape(engine, [(0, 1)], {0: [7, 7, 7, 7]}) == decode_shape(1, 4, 40)  # type: ignore[arg-type]
    assert step_shape(engine, [(0, 1)]) == decode_shape(1, 0, 40)  # type: ignore[arg-type]


def test_the_grid_fits_in_the_tokens_it_asks_for_and_cleans_up_when_it_fails() -> None:
    grid = Grid(batch_sizes=(1, 3), prefill_tokens=(0, 20), contexts=(8, 40), repeats=2)
    # Each decoder: its context, what the steps add (verify steps up to k + 1 tokens), room for its drafts, a margin.
    needed = 3 * sum(context + grid.tokens_per_context + 4 + 2 for context in grid.contexts) + 20 + 1  # and a prefill
    assert grid_kv_tokens(grid) >= needed
    exact = TimedEngine(needed)
    assert len(measure(exact, grid, vocab=1000)) == 12  # type: ignore[arg-type]
    assert exact.pending == {}
    short = TimedEngine(needed - 1)  # every decoder fits; a prefill beside them does not
    with pytest.raises(ValueError, match="too small"):
        measure(short, grid, vocab=1000)  # type: ignore[arg-type]
    assert short.pending == {}


class FailingEngine(TimedEngine):
    """A step of decode rows beside a fresh prompt raises, as one that runs out of memory would."""

    def step(self, schedule: Sequence[tuple[int, int]], drafts: Mapping[int, Sequence[int]] | None = None) -> None:
        if len(schedule) > 1 and any(count > 1 for _, count in schedule):
            raise RuntimeError("the step failed")
        super().step(schedule, drafts)


def test_a_step_that_raises_leaves_no_row_behind() -> None:
    grid = Grid(batch_sizes=(1, 2), prefill_tokens=(0, 16), contexts=(8,), repeats=1)
    engine = FailingEngine(grid_kv_tokens(grid))
    with pytest.raises(RuntimeError, match="the step failed"):
        measure(engine, grid, vocab=1000)  # type: ignore[arg-type]
    assert engine.pending == {}  # the decoders and the fresh prefill the failed step carried
