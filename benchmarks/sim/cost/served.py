"""What a step costs inside the real server beyond `Engine.step` alone, per mode.

`benchmarks.sim.profiling.steps` times `Engine.step` with nothing else running. Inside `batchserve serve` two more
things take time. The scheduler plans each step and hands its tokens over, and the API, on the same cores, wakes for
every token, frames it as an SSE chunk in continuous mode, and the client parses it: on 2 cores the compute threads lose
their cores now and then. Measured on the 2-core Xeon: 48-request bursts ran 3-15 % longer served than the same
requests through the same scheduler on the engine alone.

The profile measures both per mode (`benchmarks.sim.profiling.served_probe.probe_load`, then
`benchmarks.sim.profiling.engine_replay`): a burst through a real server, then the very same requests replayed on the
engine alone. `served_extra` charges the scheduler's own time in its steps beyond `Engine.step` per step (`const_s`;
its idle waits are left out, the simulator has those) and the served span's excess per streamed token
(`per_row_s`, charged for every row that emits a token), and `ServedCostModel` adds both to every simulated step
of that mode.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.sim.cost.files import served_section
from benchmarks.sim.cost.model import CostModel, StepShape
from scheduler.config import Mode

if TYPE_CHECKING:  # what the profiler measured; reading cost.json (the simulator) needs neither, nor a server
    from benchmarks.sim.profiling.engine_replay import AloneReplay
    from benchmarks.sim.profiling.served_probe import ServedLoad


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


def served_extra(load: ServedLoad, alone: AloneReplay) -> ServedStepExtra:
    """The scheduler's own work per step (its steps' time beyond the engine's, idle waits left out: the simulator
    has those) and what serving adds per streamed token (the served span beyond the replay's), for the same
    requests run back to back."""
    if alone.steps < 1 or alone.generated_tokens < 1:
        raise ValueError("the engine-alone replay ran no steps")
    return ServedStepExtra(
        const_s=max(0.0, alone.busy_s - alone.engine_s) / alone.steps,
        per_row_s=max(0.0, load.span_s - alone.span_s) / alone.generated_tokens,
    )


def served_load_json(load: ServedLoad, alone: AloneReplay, extra: ServedStepExtra) -> dict[str, Any]:
    return {
        "seats": load.seats,
        "requests": len(load.trace),
        "served_span_s": load.span_s,
        "alone": asdict(alone),
        "extra": asdict(extra),
    }


def load_served_extras(path: Path) -> dict[str, ServedStepExtra]:
    """Each mode's served step extra from cost.json's `served.load` (empty when the profile has none)."""
    loads: Mapping[str, Any] = served_section(path).get("load") or {}
    try:
        return {mode: ServedStepExtra(**entry["extra"]) for mode, entry in loads.items()}
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path}: served.load is not what `python -m benchmarks fit-cost` writes: {exc}") from exc


def served_load_modes(text: str) -> tuple[str, ...]:
    """A `--served-load-modes` comma list, checked."""
    modes = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [m for m in modes if m not in {mode.value for mode in Mode}]
    if unknown:
        raise ValueError(f"--served-load-modes: unknown mode(s) {unknown}")
    return modes


def with_served_extra(model: CostModel, extras: Mapping[str, ServedStepExtra], mode: str) -> CostModel:
    extra = extras.get(mode)
    return model if extra is None else ServedCostModel(model, extra, mode)
