"""How long one engine step takes, as a function of what the step computes: the simulator's only notion of time.

Every model shares one interface (`CostModel.step_time(StepShape, idle_s)`):

- `FittedCostModel`, measured on this machine by `benchmarks.sim.profiling.steps` and fitted by least squares:

      t = a + b*T + c*max(0, T - k) + d*S + e*A + f*P + g*K

  T: tokens computed in the step (prompt chunks plus decode tokens), S: sequences in the step, A: attention
  work in millions of (query token, key position) pairs, P: positions sampled (one a decoding row, k + 1 a row
  verifying k drafts), K: millions of KV tokens read, each sequence's context once. `a` is the fixed cost of a
  step, `b` the cost of a token while the weight reads dominate, `c` the extra cost per token once the matmuls
  turn compute-bound past a knee of k tokens (on a CPU, a batch-8 step costs little more than batch 1, a
  batch-32 step about 3x), `d` the per-row cost (bookkeeping), `e` attention's arithmetic, `f` a sampled
  position's (the LM head's row, the sampler), `g` reading the cache (a decode row's attention waits on memory;
  a verify row's k + 1 positions read one context, from cache after the first: a modelling assumption, the
  engine runs them as k + 1 decode-kernel rows). In a decode step S = P, and A = K: the profile's verify steps
  (P = T = 5 S, A ~ 5 K) and prompt chunks (A ~ K**2 / 2) tell them apart. Where no measured step has S != P (a
  profile without verify points), f is held at 0 and d carries a sampled position's cost, as it did before P was
  a feature. All coefficients are kept non-negative; k is the best of a grid of candidate knees.

  Where the engine switches weights by step size (quantised up to `max_quantized_rows` tokens a step, a dense
  copy past it: engine.model.linear.RowSwitchedLinear), cost is not one smooth function of T: past the switch the
  fixed cost jumps and the per-token cost drops. `SwitchedCostModel` then holds one fitted model per regime.

  A step that starts after the engine sat idle for `COLD_AFTER_S` or more costs `cold_step_s` more: the
  compute threads have gone to sleep and the weights have left the nearest caches (measured on the 2-core Xeon:
  a batch-1 decode step 6.3 ms warm, 10.6 ms after 1 s idle). `benchmarks.sim.profiling.steps` measures it per
  regime; it is what a lone request at light load pays on its first step, and at most once per burst.

  A request also pays for what is not a step: HTTP, tokenising, the loop's wake-up, SSE framing. cost.json's
  `served` section (`benchmarks.sim.profiling.served_probe`, lone requests through a real server) holds that time,
  `outside_step_s`, which the simulator adds to each request's latency (`load_request_overhead`), and the served
  lone prefill, from which the profile sets the prefill regime's cold cost.

The GPU projection is benchmarks/sim/cost/roofline.py; cost.json's format is benchmarks/sim/cost/files.py.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

COLD_AFTER_S = 0.2  # idle this long and the next step is cold (measured: +0 ms after 50 ms idle, +2.4 ms after 0.2 s)


@dataclass(frozen=True)
class StepShape:
    """What one step computes, in the terms the cost models use."""

    num_seqs: int  # S: sequences computed
    num_tokens: int  # T: tokens computed (prompt chunks plus decode tokens)
    num_sampled: int  # positions sampled (the LM head runs for them): 1 a row whose pending tokens ran out, k + 1 a
    # row verifying k drafts
    attention_pairs: int  # A: sum over computed tokens of the positions each attends to (its own included)
    kv_tokens: int  # sum over sequences of the context in cache after the step: KV read, each sequence's once


def chunk_attention_pairs(computed: int, count: int) -> int:
    """Attention pairs of `count` new tokens after `computed` cached ones: token i attends to computed + i + 1."""
    return count * computed + count * (count + 1) // 2


class CostModel(Protocol):
    @property
    def label(self) -> str:
        """One line naming the model, for reports ("fitted on ...", "projection: ...")."""

    def step_time(self, shape: StepShape, idle_s: float = 0.0) -> float:
        """Seconds for one engine step of this shape, started `idle_s` after the engine's previous step ended."""


# ----- the fitted (measured) model -----
FEATURES = ("const", "tokens", "tokens_over_knee", "seqs", "attention_mpairs", "sampled", "kv_mtokens")


@dataclass(frozen=True)
class FittedCostModel:
    const_s: float
    per_token_s: float
    per_token_over_knee_s: float
    knee_tokens: int
    per_seq_s: float
    per_attention_mpair_s: float
    source: str = "synthetic"  # what was measured: machine, model, threads
    cold_step_s: float = 0.0  # extra for a step after at least COLD_AFTER_S of idle
    # 0 in cost models fitted before these were features (their cost fell in per_seq_s and per_attention_mpair_s)
    per_sampled_s: float = 0.0
    per_kv_mtoken_s: float = 0.0

    def __post_init__(self) -> None:
        values = [self.const_s, self.per_token_s, self.per_token_over_knee_s, self.per_seq_s, self.cold_step_s]
        values += [self.per_attention_mpair_s, self.per_sampled_s, self.per_kv_mtoken_s]
        if any(not (v >= 0 and math.isfinite(v)) for v in values):
            raise ValueError(f"cost coefficients must be finite and >= 0: {self}")
        if self.knee_tokens < 0:
            raise ValueError(f"knee_tokens must be >= 0, got {self.knee_tokens}")

    @property
    def label(self) -> str:
        return f"fitted step-cost model ({self.source})"

    def step_time(self, shape: StepShape, idle_s: float = 0.0) -> float:
        return (
            (self.cold_step_s if idle_s >= COLD_AFTER_S else 0.0)
            + self.const_s
            + self.per_token_s * shape.num_tokens
            + self.per_token_over_knee_s * max(0, shape.num_tokens - self.knee_tokens)
            + self.per_seq_s * shape.num_seqs
            + self.per_attention_mpair_s * shape.attention_pairs * 1e-6
            + self.per_sampled_s * shape.num_sampled
            + self.per_kv_mtoken_s * shape.kv_tokens * 1e-6
        )


@dataclass(frozen=True)
class SwitchedCostModel:
    """Two fitted regimes, split by the step's token count as the engine splits its weights."""

    small: FittedCostModel  # steps of at most `max_small_tokens` tokens (quantised weights)
    large: FittedCostModel  # longer steps (the dense copy)
    max_small_tokens: int

    @property
    def label(self) -> str:
        return f"fitted step-cost model, two regimes split at {self.max_small_tokens} tokens ({self.small.source})"

    def regime(self, shape: StepShape) -> FittedCostModel:
        return self.small if shape.num_tokens <= self.max_small_tokens else self.large

    def step_time(self, shape: StepShape, idle_s: float = 0.0) -> float:
        return self.regime(shape).step_time(shape, idle_s)


@dataclass(frozen=True)
class FitReport:
    model: FittedCostModel | SwitchedCostModel
    mean_abs_pct_error: float  # over the measured points
    max_abs_pct_error: float
    r_squared: float


def _design(shapes: Sequence[StepShape], knee: int) -> np.ndarray:
    rows = [
        (
            1.0,
            s.num_tokens,
            max(0, s.num_tokens - knee),
            s.num_seqs,
            s.attention_pairs * 1e-6,
            s.num_sampled,
            s.kv_tokens * 1e-6,
        )
        for s in shapes
    ]
    return np.asarray(rows, dtype=np.float64)  # [points, features]


def fit_cost_model(
    shapes: Sequence[StepShape],
    seconds: Sequence[float],
    source: str,
    knees: Sequence[int] | None = None,
    switch_tokens: int | None = None,
) -> FitReport:
    """Non-negative least squares on relative error (each point weighted by 1/t, so a 5 ms step counts as much
    as a 500 ms one), for each candidate knee; the knee with the smallest error wins. `switch_tokens`: fit steps
    of at most that many tokens and longer ones separately (a SwitchedCostModel)."""
    if switch_tokens is not None:
        return _fit_switched(shapes, seconds, source, switch_tokens)
    if len(shapes) != len(seconds) or len(shapes) < len(FEATURES):
        raise ValueError(f"need at least {len(FEATURES)} measured steps, one time per shape")
    return _fit(shapes, seconds, source, knees)


def _fit(shapes: Sequence[StepShape], seconds: Sequence[float], source: str, knees: Sequence[int] | None) -> FitReport:
    times = np.asarray(seconds, dtype=np.float64)
    if not bool(np.all(times > 0)):
        raise ValueError("step times must be positive")
    if knees is None:
        top = max(s.num_tokens for s in shapes)
        knees = sorted({0, *(int(k) for k in np.unique([s.num_tokens for s in shapes]) if k < top)})
    best: tuple[float, int, np.ndarray] | None = None
    # Without a step whose sampled positions differ from its sequences, the two columns are one: least squares would
    # split their cost evenly, which no measurement says. P is left out and S carries it (as before P was a feature).
    sampled_told_apart = any(s.num_sampled != s.num_seqs for s in shapes)
    for knee in knees:
        design = _design(shapes, knee) / times[:, None]
        if not sampled_told_apart:
            design[:, FEATURES.index("sampled")] = 0.0
        coef, residual = _nonnegative_lstsq(design, np.ones_like(times))
        if best is None or residual < best[0] - 1e-15:
            best = (residual, knee, coef)
    assert best is not None
    _, knee, coef = best
    model = FittedCostModel(
        const_s=float(coef[0]),
        per_token_s=float(coef[1]),
        per_token_over_knee_s=float(coef[2]),
        knee_tokens=int(knee),
        per_seq_s=float(coef[3]),
        per_attention_mpair_s=float(coef[4]),
        source=source,
        per_sampled_s=float(coef[5]),
        per_kv_mtoken_s=float(coef[6]),
    )
    return _report(model, shapes, times)


def _fit_switched(shapes: Sequence[StepShape], seconds: Sequence[float], source: str, switch_tokens: int) -> FitReport:
    small = [i for i, s in enumerate(shapes) if s.num_tokens <= switch_tokens]
    large = [i for i, s in enumerate(shapes) if s.num_tokens > switch_tokens]
    if not small or not large:  # the switch lies outside every measured step (under an AVX2 cap, the largest int:
        return fit_cost_model(shapes, seconds, source)  # int4 serves every row count): one regime
    fits = []
    for side in (small, large):
        side_shapes = [shapes[i] for i in side]
        # More steps than the side's shapes can tell features apart: a switch at one token leaves only 1-token
        # steps below it (batch-1 decode at each context), which fix const + attention and nothing else.
        if len(side) <= np.linalg.matrix_rank(_design(side_shapes, 0)):
            raise ValueError(
                f"need more measured steps on each side of the {switch_tokens}-token switch than the features "
                "they tell apart"
            )
        fits.append(_fit(side_shapes, [seconds[i] for i in side], source, None).model)
    small_model, large_model = fits
    assert isinstance(small_model, FittedCostModel) and isinstance(large_model, FittedCostModel)
    model = SwitchedCostModel(small_model, large_model, switch_tokens)
    return _report(model, shapes, np.asarray(seconds, dtype=np.float64))


def _report(model: FittedCostModel | SwitchedCostModel, shapes: Sequence[StepShape], times: np.ndarray) -> FitReport:
    predicted = np.asarray([model.step_time(s) for s in shapes])
    errors = np.abs(predicted - times) / times
    total = float(np.sum((times - times.mean()) ** 2))
    r_squared = 1.0 - float(np.sum((predicted - times) ** 2)) / total if total > 0 else 1.0
    return FitReport(model, float(errors.mean()), float(errors.max()), r_squared)


def _nonnegative_lstsq(design: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, float]:
    """Least squares with every coefficient >= 0, exactly: the optimum is the unconstrained fit on its own support,
    so try the fit on every subset of the (seven) features and keep the best one that is non-negative."""
    features = design.shape[1]
    best_coef, best_residual = np.zeros(features), float(np.sum(target**2))
    for size in range(1, features + 1):
        for support in itertools.combinations(range(features), size):
            columns = list(support)
            solution, *_ = np.linalg.lstsq(design[:, columns], target, rcond=None)
            if bool(np.any(solution < 0)):
                continue
            coef = np.zeros(features)
            coef[columns] = solution
            residual = float(np.sum((design @ coef - target) ** 2))
            if residual < best_residual:
                best_coef, best_residual = coef, residual
    return best_coef, best_residual
