"""The cost-model tests' shared material: a known model, a profile-like grid of step shapes, an older profile."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from benchmarks.sim.cost.files import save_fitted
from benchmarks.sim.cost.model import (
    FittedCostModel,
    StepShape,
    SwitchedCostModel,
    chunk_attention_pairs,
    fit_cost_model,
)

TRUE = FittedCostModel(
    const_s=0.012,
    per_token_s=0.0004,
    per_token_over_knee_s=0.0021,
    knee_tokens=16,
    per_seq_s=0.0007,
    per_attention_mpair_s=0.35,
    per_sampled_s=0.0003,
    per_kv_mtoken_s=0.9,
)
DRAFTS = 4  # the profile's verify steps: each row verifies this many drafts


FIELDS = (
    "const_s",
    "per_token_s",
    "per_token_over_knee_s",
    "per_seq_s",
    "per_attention_mpair_s",
    "per_sampled_s",
    "per_kv_mtoken_s",
)


def profile_grid(verify: bool = True) -> list[StepShape]:
    """Shapes like benchmarks.sim.profiling.steps's grid: B decode rows at context L, plus a P-token prompt, and
    (`verify`) B rows verifying DRAFTS drafts each (one sequence, DRAFTS + 1 positions computed and sampled a row)."""
    shapes = []
    for context in (32, 256, 1024):
        for rows in (0, 1, 2, 4, 8, 16, 32, 64):
            for prefill in (0, 32, 128, 512):
                if rows == 0 and prefill == 0:
                    continue
                seqs = rows + (1 if prefill else 0)
                tokens = rows + prefill
                attention = rows * chunk_attention_pairs(context, 1) + chunk_attention_pairs(0, prefill)
                shapes.append(StepShape(seqs, tokens, seqs, attention, rows * (context + 1) + prefill))
            if rows and verify:  # a verify row's positions attend to its context, which is read once
                width, pairs = rows * (DRAFTS + 1), rows * chunk_attention_pairs(context, DRAFTS + 1)
                shapes.append(StepShape(rows, width, width, pairs, rows * (context + DRAFTS + 1)))
    return shapes


def older_profile(
    path: Path, switch: int | None, served: dict[str, Any] | None = None, verify: bool = True
) -> list[StepShape]:
    """A cost.json as an older fit-cost wrote it: the measured points (`verify`: with verify steps, which older
    profiles lack), a model of the form before K (kv reads) and P (sampled positions), with its cold-step costs and
    `served` section."""
    shapes = profile_grid(verify)
    report = fit_cost_model(shapes, [TRUE.step_time(s) for s in shapes], source="older", switch_tokens=switch)
    older = report.model
    if isinstance(older, SwitchedCostModel):
        older = dataclasses.replace(
            older,
            small=dataclasses.replace(older.small, per_kv_mtoken_s=0.0, per_sampled_s=0.0, cold_step_s=0.002),
            large=dataclasses.replace(older.large, per_kv_mtoken_s=0.0, per_sampled_s=0.0, cold_step_s=0.005),
        )
    else:
        older = dataclasses.replace(older, per_kv_mtoken_s=0.0, per_sampled_s=0.0, cold_step_s=0.005)
    points = [
        {"decode_rows": 0, "shape": dataclasses.asdict(s), "measured_ms": 1e3 * TRUE.step_time(s), "fitted_ms": 0.0}
        for s in shapes
    ]
    served = {"outside_step_s": 0.004} if served is None else served
    document = {"command": "fit-cost --out older.json", "served": served, "points": points}
    save_fitted(dataclasses.replace(report, model=older), path, document)
    return shapes
