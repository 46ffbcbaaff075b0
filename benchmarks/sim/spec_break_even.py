"""Where n-gram speculation stops paying, predicted from a fitted step-cost model (`python -m benchmarks fit-cost`).

Acceptance is vLLM's synthetic one: each of a row's k drafts is right with probability R independently, and the
row keeps drafts up to the first wrong one, plus the bonus token. A decode step of b rows at context c emits b
tokens for its cost; with speculation every row verifies k+1 positions and emits on average
1 + R + ... + R**k = (1 - R**(k+1)) / (1 - R) tokens. Speculation pays at batch b while its tokens per second beat
plain decode's; the break-even batch is the first b where they do not.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.sim.cost.files import load_fitted
from benchmarks.sim.cost.model import CostModel, StepShape, chunk_attention_pairs


def expected_emitted(rate: float, k: int) -> float:
    """Tokens a row emits per verify step under synthetic acceptance (accepted drafts plus the bonus token)."""
    return float(np.sum(rate ** np.arange(k + 1)))


def sample_emitted(rng: np.random.Generator, rate: float, k: int, rows: int) -> np.ndarray:
    """Tokens each of `rows` rows emits: drafts accepted with probability `rate` each until the first rejection,
    at most k, plus the bonus token."""
    right = rng.random((rows, k)) < rate
    accepted = np.where(right.all(axis=1), k, np.argmin(right, axis=1)) if k else np.zeros(rows, dtype=np.int64)
    return accepted + 1


def decode_shape(rows: int, per_row: int, context: int) -> StepShape:
    """A decode step of `rows` rows, each computing `per_row` tokens after `context` cached ones."""
    return StepShape(
        num_seqs=rows,
        num_tokens=rows * per_row,
        num_sampled=rows,
        attention_pairs=rows * chunk_attention_pairs(context, per_row),
        kv_tokens=rows * (context + per_row),
    )


def speedups(model: CostModel, rate: float, k: int, context: int, batches: Sequence[int]) -> np.ndarray:
    """Speculation's tokens per second over plain decode's, at each batch size."""
    gain = expected_emitted(rate, k)
    plain = np.array([model.step_time(decode_shape(b, 1, context)) for b in batches])
    spec = np.array([model.step_time(decode_shape(b, k + 1, context)) for b in batches])
    return gain * plain / spec


def break_even(model: CostModel, rate: float, k: int, context: int, batches: Sequence[int]) -> int | None:
    """The smallest batch size (of `batches`, ascending) at which speculation no longer pays; None if it pays at all."""
    ratios = speedups(model, rate, k, context, batches)
    losing = np.flatnonzero(ratios <= 1.0)
    return int(batches[losing[0]]) if len(losing) else None


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks spec-break-even", description=__doc__)
    parser.add_argument("--cost-model", type=Path, required=True, help="cost.json written by fit-cost")
    parser.add_argument("--acceptance-rate", type=float, required=True, help="R: each draft right with this chance")
    parser.add_argument("--k", type=int, default=4, help="drafts per row (num_speculative_tokens)")
    parser.add_argument("--context", type=int, default=512, help="tokens cached per row")
    parser.add_argument("--batches", default="1,2,3,4,6,8,12,16,24,32", help="comma-separated batch sizes")
    args = parser.parse_args(argv)
    if not 0.0 <= args.acceptance_rate < 1.0:
        parser.error("--acceptance-rate must be in [0, 1)")
    if args.k < 1 or args.context < 0:
        parser.error("--k must be >= 1 and --context >= 0")
    try:
        batches = sorted({int(b) for b in args.batches.split(",")})
    except ValueError:
        parser.error("--batches must be comma-separated integers")
    if not batches or batches[0] < 1:
        parser.error("--batches must be positive")
    model = load_fitted(args.cost_model)
    ratios = speedups(model, args.acceptance_rate, args.k, args.context, batches)
    rows = [{"batch": b, "speedup": round(float(r), 3)} for b, r in zip(batches, ratios, strict=True)]
    losing = [b for b, r in zip(batches, ratios, strict=True) if r <= 1.0]
    result = {"break_even_batch": losing[0] if losing else None, "by_batch": rows}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
