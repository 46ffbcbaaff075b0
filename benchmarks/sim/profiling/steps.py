"""The profiler's measurements on an engine in this process: the step grid, the cold-step and after-prefill
probes, and the engine-alone half of the served load probe (`python -m benchmarks fit-cost` runs them)."""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.micro.rows import add_row
from benchmarks.sim.cost.model import CostModel, FittedCostModel, StepShape, SwitchedCostModel, chunk_attention_pairs
from benchmarks.sim.cost.served import (
    ServedStepExtra,
    served_extra,
)
from benchmarks.sim.profiling.engine_replay import AloneReplay, replay_alone
from benchmarks.sim.profiling.served_probe import (
    ServedLoad,
    ServedProbe,
    probe_load,
)
from engine.engine import Engine
from engine.sample.sampling_params import SamplingParams
from scheduler.config import Mode, SchedulerConfig

# The first decode steps after a step on the dense copy run slower while the quantised weights come back into the
# caches (on the 2-core Xeon a 1-row decode runs +1.0-1.8 ms slow right after a 40-token prefill, +0.6-1.1 ms
# two steps later, settled by the 6th-8th). The grid's decode points are timed 2 steps after one (`measure`),
# inside that transient, which is nearer a served decode than the settled cost is: timed settled, the simulator ran
# fast (docs/notes/2026-12-01-sim-validation-afternoon.md, "Tried and not kept").
AFTER_LARGE_STEPS = 8  # positions of the transient that measure_after_large reports
AFTER_LARGE_SETTLED = 10  # ... against the decode steps from this position on
AFTER_LARGE_PROMPT_TOKENS = 32  # the probe's decoder's context


@dataclass(frozen=True)
class Grid:
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    prefill_tokens: tuple[int, ...] = (0, 32, 128, 512)
    contexts: tuple[int, ...] = (32, 256, 1024)
    repeats: int = 3
    # Drafts per row at the verify points (each batch size's rows verifying this many, as n-gram speculation's
    # default k = 4; 0: no verify points). A verify row is one sequence computing k + 1 positions: without these
    # points a step's tokens and sequences are equal in every small step and the fit cannot tell their costs apart.
    draft_tokens: int = 4

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 0 or max(self.batch_sizes) < 1:
            raise ValueError("batch sizes must be >= 0, at least one positive")
        if not self.prefill_tokens or min(self.prefill_tokens) < 0:
            raise ValueError("prefill tokens must be >= 0")
        if not self.contexts or min(self.contexts) < 1:
            raise ValueError("contexts must be >= 1")
        if self.repeats < 1:
            raise ValueError("repeats must be >= 1")
        if self.draft_tokens < 0:
            raise ValueError("draft tokens must be >= 0")

    @property
    def tokens_per_context(self) -> int:
        """Tokens each decoder may gain at one context: two steps a visit, a visit per grid point a round, one token
        a decode step and up to k + 1 a verify step (its drafts are rejected unless the model happens to agree)."""
        verify = self.draft_tokens + 1 if self.draft_tokens else 0
        return len(self.batch_sizes) * (len(self.prefill_tokens) + verify) * self.repeats * 2


@dataclass(frozen=True)
class Point:
    decode_rows: int
    prefill_tokens: int
    context: int
    shape: StepShape
    seconds: float
    drafts: int = 0  # drafts each decode row verified (a verify point), 0 for a plain step


def step_shape(
    engine: Engine, schedule: Sequence[tuple[int, int]], drafts: Mapping[int, Sequence[int]] | None = None
) -> StepShape:
    """The cost model's view of a step, from the engine's state before it (as `SimEngine.step` computes it): a row
    verifying k drafts is one sequence computing and sampling k + 1 positions, each attending to its context, which
    is read once."""
    num_tokens = attention = kv_tokens = sampled = 0
    for seq_id, count in schedule:
        computed = engine.num_computed(seq_id)
        k = len(drafts.get(seq_id, ())) if drafts else 0
        num_tokens += count + k
        attention += chunk_attention_pairs(computed, count + k)
        kv_tokens += computed + count + k
        sampled += (1 + k) * int(engine.num_pending(seq_id) == count)
    return StepShape(len(schedule), num_tokens, sampled, attention, kv_tokens)


def grid_points(grid: Grid) -> list[tuple[int, int, int, int]]:
    """(context, decode rows, prefill tokens, drafts a row) of each grid point, in the order a round visits them: at
    each context and batch size its plain steps, then its verify step."""
    keys = []
    for context in grid.contexts:
        for batch in grid.batch_sizes:
            keys += [(context, batch, prefill, 0) for prefill in grid.prefill_tokens if batch or prefill]
            if batch and grid.draft_tokens:
                keys.append((context, batch, 0, grid.draft_tokens))
    return keys


def _prompt(length: int, vocab: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 1, (length,), generator=generator).tolist()


def _prefill(engine: Engine, seq_id: int, budget: int = 512) -> None:
    while engine.num_pending(seq_id) > 1:
        engine.step([(seq_id, min(budget, engine.num_pending(seq_id) - 1))])  # leave one: decodes sample


def measure(engine: Engine, grid: Grid, vocab: int, clock: Callable[[], float] = time.perf_counter) -> list[Point]:
    """Each grid point's median step time over `grid.repeats` rounds, every round visiting every point of every
    context once. A VM's speed drifts within the minutes a profile takes (up to 2x within an hour on the 2-core
    Xeons); timed point by point, a slow minute lands on one block of points and bends the fit (one context's
    points all 20-40 % slow in one profile), while rounds spread it over all of them and the median drops it.
    A visit runs its step twice and times the second, the second step after the previous point's (often a large
    one): a decode point is timed inside the transient after a large step (AFTER_LARGE_STEPS), as served decodes
    are."""
    rows = max(grid.batch_sizes)
    extra = grid.tokens_per_context + grid.draft_tokens + 2  # what a decoder gains at one context, its drafts, a margin
    params = SamplingParams(max_tokens=extra, temperature=0.0, ignore_eos=True)  # never reached
    decoders: dict[int, list[int]] = {context: [] for context in grid.contexts}
    try:
        next_id = 0
        for context in grid.contexts:
            for seq_id in range(next_id, next_id + rows):
                too_small = f"the KV cache cannot hold {rows} sequences at each of {len(grid.contexts)} contexts"
                add_row(engine, seq_id, _prompt(context, vocab, seq_id), params, context + extra, too_small)
                decoders[context].append(seq_id)
                _prefill(engine, seq_id)
            next_id += rows
        keys = grid_points(grid)
        times: dict[tuple[int, int, int, int], list[float]] = {key: [] for key in keys}
        shapes: dict[tuple[int, int, int, int], StepShape] = {}
        for _ in range(grid.repeats):
            for key in keys:
                context, batch, prefill, drafts = key
                for timed in (False, True):
                    schedule = [(s, engine.num_pending(s)) for s in decoders[context][:batch]]
                    row_drafts = {s: _prompt(drafts, vocab, -1 - s) for s, _ in schedule} if drafts else None
                    if prefill:
                        fresh, next_id = next_id, next_id + 1
                        prefill_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
                        too_small = "the KV cache is too small for the grid; lower --batch-sizes"
                        add_row(engine, fresh, _prompt(prefill, vocab, fresh), prefill_params, prefill + 1, too_small)
                        schedule.append((fresh, prefill))
                    shapes[key] = step_shape(engine, schedule, row_drafts)
                    try:
                        start = clock()
                        engine.step(schedule, row_drafts)
                        elapsed = clock() - start
                    finally:
                        if prefill:
                            engine.remove(fresh)
                    if timed:
                        times[key].append(elapsed)
    finally:
        for seq_ids in decoders.values():
            for seq_id in seq_ids:
                engine.remove(seq_id)
    points = [Point(key[1], key[2], key[0], shapes[key], statistics.median(times[key]), key[3]) for key in keys]
    for point in points:
        print(
            f"context {point.context:5d}  decode rows {point.decode_rows:3d}  prefill {point.prefill_tokens:4d}"
            f"  drafts {point.drafts}: {1e3 * point.seconds:8.2f} ms",
            file=sys.stderr,
        )
    return points


@dataclass(frozen=True)
class ColdSteps:
    """A lone step's extra cost after the engine sat idle, per regime: a 1-row decode (the quantised weights
    where the engine switches) and a `PREFILL_PROBE_TOKENS`-token prefill (the dense copy)."""

    decode_s: float
    prefill_s: float


PREFILL_PROBE_TOKENS = 40  # a typical short prompt of the mixed workload
COLD_IDLE_S = 1.0  # well past COLD_AFTER_S, as between requests at light load


def _add_decoder(engine: Engine, vocab: int, seq_id: int, prompt_tokens: int, max_tokens: int, probe: str) -> None:
    """A probe's decoding sequence: its prompt prefilled (all but the token its first decode samples from)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    prompt = _prompt(prompt_tokens, vocab, seq_id)
    add_row(engine, seq_id, prompt, params, prompt_tokens + max_tokens, f"the KV cache is too small for the {probe}")
    _prefill(engine, seq_id)


def _timed_prefill(
    engine: Engine, vocab: int, seq_id: int, probe: str, clock: Callable[[], float] = time.perf_counter
) -> float:
    """Seconds of one `PREFILL_PROBE_TOKENS`-token prefill step (more tokens than the switch: the dense copy);
    the sequence is gone again afterwards, whatever happened."""
    prompt, params = _prompt(PREFILL_PROBE_TOKENS, vocab, seq_id), SamplingParams(max_tokens=1, ignore_eos=True)
    add_row(engine, seq_id, prompt, params, PREFILL_PROBE_TOKENS + 1, f"the KV cache is too small for the {probe}")
    try:
        start = clock()
        engine.step([(seq_id, PREFILL_PROBE_TOKENS)])
        return clock() - start
    finally:
        engine.remove(seq_id)


def measure_cold(engine: Engine, vocab: int, first_id: int, repeats: int) -> ColdSteps:
    """Median step time after `COLD_IDLE_S` of sleep minus the median of the same step run back to back."""
    decoder = first_id
    _add_decoder(engine, vocab, decoder, 32, 4 * repeats + 16, "cold-step probe")
    fresh = iter(range(first_id + 1, first_id + 1 + 4 * repeats))

    def decode_step() -> float:
        start = time.perf_counter()
        engine.step([(decoder, engine.num_pending(decoder))])
        return time.perf_counter() - start

    def prefill_step() -> float:
        return _timed_prefill(engine, vocab, next(fresh), "cold-step probe")

    def penalty(step: Callable[[], float]) -> float:
        step()  # warm-up
        warm = statistics.median(step() for _ in range(repeats))
        cold = []
        for _ in range(repeats):
            time.sleep(COLD_IDLE_S)
            cold.append(step())
        return max(0.0, statistics.median(cold) - warm)

    try:
        return ColdSteps(decode_s=penalty(decode_step), prefill_s=penalty(prefill_step))
    finally:
        engine.remove(decoder)


def after_large_probe_tokens(repeats: int) -> int:
    """The tokens `measure_after_large`'s decoder holds by its end: its prompt and every decode step it takes."""
    return AFTER_LARGE_PROMPT_TOKENS + repeats * (AFTER_LARGE_SETTLED + AFTER_LARGE_STEPS) + 1


def measure_after_large(
    engine: Engine, vocab: int, first_id: int, repeats: int, clock: Callable[[], float] = time.perf_counter
) -> tuple[float, ...]:
    """Extra seconds of each of the first `AFTER_LARGE_STEPS` 1-row decode steps after a `PREFILL_PROBE_TOKENS`
    prefill step over the same decode's steps `AFTER_LARGE_SETTLED` to `AFTER_LARGE_SETTLED + AFTER_LARGE_STEPS`:
    each position is the median over `repeats` prefills, the reference the median of its positions. A diagnostic
    (cost.json's `engine_after_large_ms`), not part of the fitted model."""
    if repeats < 1:
        raise ValueError(f"the after-prefill probe needs at least one prefill, got {repeats}")
    timed_steps = AFTER_LARGE_SETTLED + AFTER_LARGE_STEPS  # after each prefill: the transient, then its reference
    decoder = first_id
    max_tokens = after_large_probe_tokens(repeats) - AFTER_LARGE_PROMPT_TOKENS
    by_position: list[list[float]] = [[] for _ in range(timed_steps)]
    try:
        _add_decoder(engine, vocab, decoder, AFTER_LARGE_PROMPT_TOKENS, max_tokens, "after-prefill probe")
        for prefill_id in range(first_id + 1, first_id + 1 + repeats):
            _timed_prefill(engine, vocab, prefill_id, "after-prefill probe", clock)
            for position in range(timed_steps):
                start = clock()
                engine.step([(decoder, engine.num_pending(decoder))])
                by_position[position].append(clock() - start)
    finally:  # removing a sequence that is gone already (or never came) is a no-op
        engine.remove(decoder)
    by_position_median = [statistics.median(times) for times in by_position]  # a slow prefill's run drops out
    settled = statistics.median(by_position_median[AFTER_LARGE_SETTLED:])
    return tuple(max(0.0, t - settled) for t in by_position_median[:AFTER_LARGE_STEPS])


def lone_prefill(tokens: int) -> StepShape:
    """A step that prefills one `tokens`-token prompt and samples its first token: the served probe's prefill."""
    return StepShape(1, tokens, 1, chunk_attention_pairs(0, tokens), tokens)


def served_cold_steps(model: CostModel, engine_cold: ColdSteps, served: ServedProbe) -> ColdSteps:
    """The prefill's cold cost as served: the served lone prefill minus the model's warm time for that prompt
    (the fit plus, where measured, the served continuous step's extra)."""
    lone = lone_prefill(served.prompt_tokens)
    return ColdSteps(decode_s=engine_cold.decode_s, prefill_s=max(0.0, served.prefill_s - model.step_time(lone)))


def with_cold_steps(model: FittedCostModel | SwitchedCostModel, cold: ColdSteps) -> FittedCostModel | SwitchedCostModel:
    if isinstance(model, SwitchedCostModel):
        small = dataclasses.replace(model.small, cold_step_s=cold.decode_s)
        return dataclasses.replace(
            model, small=small, large=dataclasses.replace(model.large, cold_step_s=cold.prefill_s)
        )
    return dataclasses.replace(model, cold_step_s=cold.prefill_s)  # at light load a cold step is a new prompt's


def measure_served_load(
    engine: Engine, vocab: int, flags: Sequence[str], policy: SchedulerConfig, count: int, out: Path
) -> tuple[ServedLoad, AloneReplay, ServedStepExtra]:
    """A burst through a real server with `policy` (its mode and seats), then the same requests through the same
    policy on this process's engine alone."""
    mode, seats = policy.mode.value, policy.seats
    burst = probe_load(flags, mode, seats, count, out.with_suffix(f".serve-{mode}.log"))
    with torch.inference_mode():
        alone = replay_alone(engine, burst.trace, policy, vocab)
    return burst, alone, served_extra(burst, alone)


def load_policy(policy: SchedulerConfig, mode: str, seats: int) -> SchedulerConfig:
    """serve's policy flags as given, in `mode`, with `seats` seats."""
    return dataclasses.replace(policy, mode=Mode(mode), max_batch_size=seats, max_num_seqs=seats)


def rows_for(grid: Grid) -> int:
    """Rows of the grid's largest step: its largest batch plus its fresh prefill."""
    return max(grid.batch_sizes) + 1


def sequence_tokens(grid: Grid, context: int) -> int:
    """A grid decoder's whole length at `context`: the context, what `measure`'s steps there add, its drafts, a
    margin."""
    return context + grid.tokens_per_context + grid.draft_tokens + 4


def grid_kv_tokens(grid: Grid) -> int:
    """The cache `measure` holds at once: its decoders at every context and one prefill, each plus a block of
    rounding."""
    decoders = max(grid.batch_sizes) * sum(sequence_tokens(grid, context) + 16 for context in grid.contexts)
    return decoders + max(grid.prefill_tokens) + 1 + 16


def held_rows(grid: Grid) -> int:
    """Rows the profile's engine holds at once: the largest batch at every context (`measure` keeps them all) and
    a fresh prefill."""
    return max(grid.batch_sizes) * len(grid.contexts) + 1
