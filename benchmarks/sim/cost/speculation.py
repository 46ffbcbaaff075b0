"""Speculation's arithmetic on a step-cost model: where n-gram speculation stops paying.

Acceptance is vLLM's synthetic one: each of a row's k drafts is right with probability R independently, and the
row keeps drafts up to the first wrong one, plus the bonus token. A decode step of b rows at context c emits b
tokens for its cost; with speculation every row verifies k+1 positions and emits on average
1 + R + ... + R**k = (1 - R**(k+1)) / (1 - R) tokens. A row and its k drafts are charged as the engine runs them and
the simulator charges them (`benchmarks.sim.engine.SimEngine.step`): k + 1 decode rows sharing the row's context.
Speculation pays at batch b while its tokens per second beat plain decode's; the break-even batch is the first b
where they do not (`crossing` interpolates where the speedup passes 1).
"""

from __future__ import annotations

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


def decode_shape(rows: int, drafts: int, context: int) -> StepShape:
    """A decode step of `rows` rows after `context` cached tokens each, every row verifying `drafts` drafts: as the
    simulator charges it, a row and its drafts are drafts + 1 decode rows, each sampled, each reading its context."""
    pairs = rows * chunk_attention_pairs(context, drafts + 1)
    width = rows * (drafts + 1)
    return StepShape(num_seqs=width, num_tokens=width, num_sampled=width, attention_pairs=pairs, kv_tokens=pairs)


def speedups(model: CostModel, rate: float, k: int, context: int, batches: Sequence[int]) -> np.ndarray:
    """Speculation's tokens per second over plain decode's, at each batch size."""
    gain = expected_emitted(rate, k)
    plain = np.array([model.step_time(decode_shape(b, 0, context)) for b in batches])
    spec = np.array([model.step_time(decode_shape(b, k, context)) for b in batches])
    return gain * plain / spec


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
