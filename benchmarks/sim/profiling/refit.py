"""`python -m benchmarks fit-cost --refit OLD.json --out NEW.json`: the current model form fitted to the steps a
cost.json measured, without measuring again. A profile keeps every timed point's shape and time, so one taken on a
machine out of reach today (another CPU class) takes a new feature of the form; features its grid never varied
(the per-sampled-position cost needs verify points) stay out of it (`fit_cost_model`). The served sections and the
decode cold cost carry over as measured; the prefill cold cost, which the profile took as the served lone prefill
less the old fit's time for it, is taken against the new fit (`steps.with_cold_steps` sets them, as a profile's)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from benchmarks.sim.cost.files import load_fitted, save_fitted
from benchmarks.sim.cost.model import FitReport, FittedCostModel, StepShape, SwitchedCostModel, fit_cost_model
from benchmarks.sim.profiling.steps import ColdSteps, lone_prefill, with_cold_steps

_REPLACED = ("form", "model", "fit")  # what save_fitted writes anew


def refit(source: Path, out: Path, command: str) -> FitReport:
    document: dict[str, Any] = json.loads(source.read_text())
    points = document.get("points") or []
    if not points:
        raise ValueError(f"{source} holds no measured points to fit")
    try:
        shapes = [StepShape(**point["shape"]) for point in points]
        seconds = [point["measured_ms"] / 1e3 for point in points]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{source}: a point without a step shape and its measured_ms: {exc}") from exc
    old = load_fitted(source)
    switch = old.max_small_tokens if isinstance(old, SwitchedCostModel) else None
    label = old.small.source if isinstance(old, SwitchedCostModel) else old.source
    report = fit_cost_model(shapes, seconds, label, switch_tokens=switch)
    cold = _cold_steps_of(old, report.model, (document.get("served") or {}).get("prompt_tokens"))
    report = dataclasses.replace(report, model=with_cold_steps(report.model, cold))
    extra = {key: value for key, value in document.items() if key not in _REPLACED}
    extra["points"] = [
        {**point, "fitted_ms": 1e3 * report.model.step_time(shape)} for point, shape in zip(points, shapes, strict=True)
    ]
    extra["refit"] = {"from": str(source), "command": command, "profile_command": document.get("command")}
    save_fitted(report, out, extra)
    return report


def _cold_steps_of(
    old: FittedCostModel | SwitchedCostModel, new: FittedCostModel | SwitchedCostModel, served_prompt: int | None
) -> ColdSteps:
    """`old`'s cold-step costs, the decode regime's and the prefill regime's. With a served probe (`served_prompt`
    tokens), the prefill one was served minus the old warm time of that prompt (`steps.served_cold_steps`): the same
    served time less the new warm time."""
    decode, prefill = (
        (old.small.cold_step_s, old.large.cold_step_s)
        if isinstance(old, SwitchedCostModel)
        else (old.cold_step_s, old.cold_step_s)
    )
    if served_prompt:
        lone = lone_prefill(served_prompt)
        prefill = max(0.0, prefill + old.step_time(lone) - new.step_time(lone))
    return ColdSteps(decode_s=decode, prefill_s=prefill)
