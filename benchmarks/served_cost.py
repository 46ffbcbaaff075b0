"""What a step costs inside the real server beyond `Engine.step` alone, per mode.

`benchmarks.profile` times `Engine.step` with nothing else running. Inside `batchserve serve` the same step shares
the cores with the API and the client: the event loop wakes for every token, and in continuous mode every token
goes out as an SSE chunk that the client parses on the same machine, so the compute threads lose their cores now
and then. On 2 cores that is not free: a served 8-row decode step ran 10-17 % over the same step on the engine
alone. `benchmarks.served_probe.probe_steps` measures served decode steps at several batch sizes in each mode, each
beside the engine-alone step timed right after it; `fit_served_extra` fits the difference as
`const_s + per_row_s * R` (R: rows that emit a token in the step), non-negative least squares, and
`ServedCostModel` charges it on every simulated step of that mode.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.cost_model import CostModel, StepShape, nonnegative_lstsq
from benchmarks.served_probe import ServedSteps


@dataclass(frozen=True)
class ServedStepExtra:
    """Seconds a served step costs over the profiled step: a fixed part and a part per row that emits a token."""

    const_s: float = 0.0
    per_row_s: float = 0.0

    def __post_init__(self) -> None:
        if not all(math.isfinite(v) and v >= 0 for v in (self.const_s, self.per_row_s)):
            raise ValueError(f"served step costs must be finite and >= 0: {self}")

    def seconds(self, shape: StepShape) -> float:
        return self.const_s + self.per_row_s * shape.num_sampled


@dataclass(frozen=True)
class ServedCostModel:
    """A profiled cost model plus the served step's extra, for one mode."""

    inner: CostModel
    extra: ServedStepExtra
    mode: str

    @property
    def label(self) -> str:
        return (
            f"{self.inner.label}; served {self.mode} step +{1e3 * self.extra.const_s:.2f} ms"
            f" +{1e3 * self.extra.per_row_s:.2f} ms a row"
        )

    def step_time(self, shape: StepShape, idle_s: float = 0.0) -> float:
        return self.inner.step_time(shape, idle_s) + self.extra.seconds(shape)


def fit_served_extra(
    batch_sizes: Sequence[int], served_step_s: Sequence[float], engine_step_s: Sequence[float]
) -> ServedStepExtra:
    """Fit served decode steps minus the same steps on the engine alone, one pair per batch size."""
    if not batch_sizes or not len(batch_sizes) == len(served_step_s) == len(engine_step_s):
        raise ValueError("need one served and one engine-alone step time per batch size")
    excess = np.asarray(served_step_s, dtype=np.float64) - np.asarray(engine_step_s, dtype=np.float64)
    design = np.asarray([(1.0, float(b)) for b in batch_sizes])
    coef, _ = nonnegative_lstsq(design, excess)
    return ServedStepExtra(const_s=float(coef[0]), per_row_s=float(coef[1]))


def served_steps_json(steps: ServedSteps, extra: ServedStepExtra) -> dict[str, Any]:
    return {
        "batch_sizes": list(steps.batch_sizes),
        "step_ms": [1e3 * t for t in steps.step_s],
        "engine_step_ms": [1e3 * t for t in steps.engine_step_s],
        "context_tokens": steps.context_tokens,
        "extra": asdict(extra),
    }


def load_served_extras(path: Path) -> dict[str, ServedStepExtra]:
    """Each mode's served step extra from cost.json's `served.steps` (empty when the profile has none)."""
    served = json.loads(Path(path).read_text()).get("served") or {}
    steps: Mapping[str, Any] = served.get("steps") or {}
    try:
        return {mode: ServedStepExtra(**entry["extra"]) for mode, entry in steps.items()}
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path}: served.steps is not what benchmarks.profile writes: {exc}") from exc


def with_served_extra(model: CostModel, extras: Mapping[str, ServedStepExtra], mode: str) -> CostModel:
    extra = extras.get(mode)
    return model if extra is None else ServedCostModel(model, extra, mode)
