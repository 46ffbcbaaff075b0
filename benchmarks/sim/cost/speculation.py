"""Speculation's arithmetic on a step-cost model: where n-gram speculation stops paying.

Acceptance is vLLM's synthetic one: each of a row's k drafts is right with probability R independently, and the
row keeps drafts up to the first wrong one, plus the bonus token. A decode step of b rows at context c emits b
tokens for its cost; with speculation every row verifies k+1 positions and emits on average
1 + R + ... + R**k = (1 - R**(k+1)) / (1 - R) tokens. A row and its k drafts are charged as the engine runs them and
the simulator charges them (`benchmarks.sim.engine.SimEngine.step`): one sequence computing and sampling k + 1
positions, each attending to the row's context, which is read once.
Speculation pays at batch b while its tokens per second beat plain decode's; the break-even batch is the first b
where they do not (`crossing` interpolates where the speedup passes 1).

n-gram lookup drafts only where it finds a match: each sampling row has drafts with probability D (the draft rate),
independently, so a step of b rows has j drafting rows with the binomial chance C(b, j) D**j (1 - D)**(b - j); the
speculating step's cost is the expectation over j and a row emits 1 + D (E - 1) tokens on average, E as above.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from benchmarks.sim.cost.model import CostModel, StepShape, chunk_attention_pairs


def expected_emitted(rate: float, k: int) -> float:
    """Tokens a row emits per verify step under synthetic acceptance (accepted drafts plus the bonus token)."""
    return float(np.sum(rate ** np.arange(k + 1)))


def accepted_drafts(draw: Callable[[], float], rate: float, k: int) -> int:
    """vLLM's synthetic acceptance, as the simulator's engine draws it: each of k drafts right with probability
    `rate`, independently (`draw()` uniform in [0, 1)); a row keeps its drafts up to the first wrong one."""
    accepted = 0
    while accepted < k and draw() < rate:
        accepted += 1
    return accepted


def decode_shape(rows: int, drafts: int, context: int, drafting: int | None = None) -> StepShape:
    """A decode step of `rows` rows after `context` cached tokens each, `drafting` of them (all by default) verifying
    `drafts` drafts: as the simulator charges it, a row and its drafts are one sequence of drafts + 1 positions, each
    sampled, each attending to the row's context, which is read once."""
    verifying = rows if drafting is None else drafting
    pairs = verifying * chunk_attention_pairs(context, drafts + 1) + (rows - verifying) * (context + 1)
    width = rows + verifying * drafts
    kv = rows * (context + 1) + verifying * drafts
    return StepShape(num_seqs=rows, num_tokens=width, num_sampled=width, attention_pairs=pairs, kv_tokens=kv)


def speedups(
    model: CostModel, rate: float, k: int, context: int, batches: Sequence[int], draft_rate: float = 1.0
) -> np.ndarray:
    """Speculation's tokens per second over plain decode's, at each batch size: each row drafts with probability
    `draft_rate` (the step's expected cost over how many do)."""
    gain = 1.0 + draft_rate * (expected_emitted(rate, k) - 1.0)
    plain = np.array([model.step_time(decode_shape(b, 0, context)) for b in batches])
    spec = np.array([_expected_step_time(model, b, k, context, draft_rate) for b in batches])
    return gain * plain / spec


def _expected_step_time(model: CostModel, rows: int, k: int, context: int, draft_rate: float) -> float:
    drafting = np.arange(rows + 1)
    chances = (
        np.array([math.comb(rows, j) for j in drafting]) * draft_rate**drafting * (1 - draft_rate) ** (rows - drafting)
    )
    times = np.array([model.step_time(decode_shape(rows, k, context, int(j))) for j in drafting])
    return float(chances @ times)


def crossing(batches: Sequence[float], ratios: Sequence[float]) -> float | None:
    """Where speculation stops paying: the batch at which the speedup first falls to 1, linearly interpolated
    between the last batch where it paid and the first where it did not (the first batch if it never paid there);
    None if it pays at every batch."""
    for i, ratio in enumerate(ratios):
        if ratio <= 1.0:
            if i == 0:
                return float(batches[0])
            before = ratios[i - 1]
            return float(batches[i - 1] + (before - 1.0) / (before - ratio) * (batches[i] - batches[i - 1]))
    return None


def break_even(model: CostModel, rate: float, k: int, context: int, batches: Sequence[int]) -> int | None:
    """The smallest batch size (of `batches`, ascending) at which speculation no longer pays; None if it pays at all."""
    ratios = speedups(model, rate, k, context, batches)
    losing = np.flatnonzero(ratios <= 1.0)
    return int(batches[losing[0]]) if len(losing) else None
