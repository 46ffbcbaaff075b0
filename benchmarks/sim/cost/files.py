"""cost.json: what `python -m benchmarks fit-cost` writes and the simulator reads: the fitted step-cost model,
its fit error, and the `served` section measured through a real server."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.results_io.report import write_json
from benchmarks.sim.cost.model import FitReport, FittedCostModel, SwitchedCostModel

_FORM = (
    "t = const + tokens*T + tokens_over_knee*max(0, T - knee) + seqs*S + attention_mpairs*A/1e6 + sampled*P"
    " + kv_mtokens*K/1e6"
)


def save_fitted(report: FitReport, path: Path, extra: Mapping[str, Any]) -> None:
    switched = isinstance(report.model, SwitchedCostModel)
    document = {
        "form": f"{_FORM}, one per regime: 'small' for T <= max_small_tokens, else 'large'" if switched else _FORM,
        "model": asdict(report.model),
        "fit": {
            "mean_abs_pct_error": 100 * report.mean_abs_pct_error,
            "max_abs_pct_error": 100 * report.max_abs_pct_error,
            "r_squared": report.r_squared,
        },
        **extra,
    }
    write_json(path, document)


def load_fitted(path: Path) -> FittedCostModel | SwitchedCostModel:
    document = json.loads(Path(path).read_text())
    try:
        model = document["model"]
        if "small" in model:
            return SwitchedCostModel(
                FittedCostModel(**model["small"]), FittedCostModel(**model["large"]), int(model["max_small_tokens"])
            )
        return FittedCostModel(**model)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a cost model written by `python -m benchmarks fit-cost`: {exc}") from exc


def timed_verify_steps(path: Path) -> bool:
    """Whether the profile behind cost.json timed steps that verify drafts (`fit-cost --draft-tokens`): without them
    its fit cannot tell a sampled position's cost from a row's, and a verify row's charge is a guess."""
    points = json.loads(Path(path).read_text()).get("points") or []
    return any(point.get("drafts") for point in points)


def verify_steps_note(path: Path) -> str | None:
    """The warning for a speculation run over a profile without verify steps, or None."""
    if timed_verify_steps(path):
        return None
    return (
        f"note: {path} timed no verify steps (a profile before fit-cost --draft-tokens): a verify row's cost is "
        "extrapolated from plain steps"
    )


def served_section(path: Path) -> dict[str, Any]:
    """cost.json's `served` section: what the profile measured through a real server (empty when it did not)."""
    served: dict[str, Any] = json.loads(Path(path).read_text()).get("served") or {}
    return served


@dataclass(frozen=True)
class BusyArrival:
    """What a request that arrives while the engine steps costs beyond one that finds it idle (the served probe's
    busy phase): the next step starts `stall_s` later, and the request's own path outside the steps is
    `outside_s` longer. Its intake (reading, parsing, tokenising) runs on the cores the compute threads use."""

    stall_s: float = 0.0
    outside_s: float = 0.0

    def __post_init__(self) -> None:
        if not all(math.isfinite(v) and v >= 0 for v in (self.stall_s, self.outside_s)):
            raise ValueError(f"busy-arrival costs must be finite and >= 0: {self}")


def load_busy_arrival(path: Path) -> BusyArrival:
    """The served probe's busy-arrival costs from cost.json (none when the profile predates them)."""
    served = served_section(path)
    try:
        return BusyArrival(float(served.get("busy_stall_s", 0.0)), float(served.get("busy_outside_s", 0.0)))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: served.busy_stall_s / busy_outside_s: {exc}") from exc


def load_request_overhead(path: Path) -> float:
    """Seconds a request pays outside the engine's steps, from cost.json's served probe (0 when it has none)."""
    served = served_section(path)
    value = float(served.get("outside_step_s", 0.0))
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{path}: served.outside_step_s must be a finite number >= 0, got {value}")
    return value
