"""The weight format `auto` chose (api/runtime/format_probe.py), and where it is kept: one JSON file per CPU, kernel
build, torch, model file and set of candidates under <cache>/format-choice/, written only for a choice whose lead over
the runner-up is clear of the noise it was measured with. `batchserve formats` lists them."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from engine.platform.cpu_features import cpu_features
from engine.platform.native import best_build
from engine.weights.checkpoints import file_sha256, resolve_cache_dir

PROBE_VERSION = 8  # bump when what is measured changes: old choices are then measured again
CHOICE_DIR = "format-choice"
EVERY_STEP = 2**31 - 1  # a row switch past any step: the quantised weights run at every size


def format_label(dtype: str, quantization: str) -> str:
    return dtype if quantization == "none" else f"{quantization}/{dtype}"


def one_digit_label(dtype: str, quantization: str) -> str:
    """How the probe keys the figures of a quantised format's steps on one int8 digit per activation (int4_gemm)."""
    return f"{format_label(dtype, quantization)} one-digit"


def gemm_steps(
    int4_gemm: str, measured_min_gemm_rows: int | None, max_quantized_rows: int | None
) -> tuple[str, int | None]:
    """The runner's (int4_gemm scope, min_gemm_rows) for the `int4_gemm` option: `auto` takes the probe's measured
    row count (none measured: off), as the whole scope where it starts right past the row switch (no dense copy
    kept); a named scope is taken as it is."""
    if int4_gemm != "auto":
        return int4_gemm, None
    if measured_min_gemm_rows is None or max_quantized_rows is None:
        return "off", None
    if measured_min_gemm_rows == max_quantized_rows + 1:
        return "all", None
    return "off", measured_min_gemm_rows


@dataclass(frozen=True)
class FormatChoice:
    dtype: str
    quantization: str
    max_quantized_rows: int | None  # None: not quantised
    step_ms: Mapping[str, Mapping[int, float]]  # per candidate label, per row count: its best step time
    reason: str  # each candidate's own figures at the scored sizes
    runner_up: str = ""  # the candidate that came second ("": there was one candidate)
    margin: float = 0.0  # the runner-up's score over the winner's, minus 1 (0.12: 12 % behind; negative: the
    # faster one inside the noise, served with float32 activations where this serves bfloat16, format_rule.choose)
    noise: float = 0.0  # the largest noise among the figures that tell the two apart
    provisional: bool = False  # the lead is inside the noise: served, not cached
    spread: Mapping[str, Mapping[int, float]] = field(default_factory=dict)  # each figure's noise
    rounds: int = 0
    quiet_rounds: int = 0
    calibration_ms: Mapping[str, float] = field(default_factory=dict)  # the machine's speed when measured
    # Steps of at least this many rows (past the row switch) run one int8 digit per activation (int4_gemm); None:
    # never. max_quantized_rows + 1: every step past the switch, so no dense copy is needed.
    min_gemm_rows: int | None = None

    @property
    def label(self) -> str:
        return format_label(self.dtype, self.quantization)

    def summary(self) -> str:
        """The format, its row switch and its lead: "int4/bfloat16, quantised up to 16 rows, 12 % ahead of
        bfloat16 (noise 3 %)"."""
        limit = self.max_quantized_rows
        rows = (
            ""
            if not limit
            else ", quantised at every size"
            if limit == EVERY_STEP
            else f", quantised up to {limit} rows"
        )
        if self.min_gemm_rows is not None:
            rows += f", one int8 digit from {self.min_gemm_rows} rows"
        if not self.runner_up:
            return f"{self.label}{rows}"
        if self.margin < 0:
            return (
                f"{self.label}{rows}, {-self.margin:.0%} behind {self.runner_up} inside the noise "
                f"({self.noise:.0%}), in half the activations' memory"
            )
        return f"{self.label}{rows}, {self.margin:.0%} ahead of {self.runner_up} (noise {self.noise:.0%})"


@dataclass(frozen=True)
class CacheEntry:
    choice: FormatChoice
    model: str  # the model file or directory it was measured with
    machine: str  # the CPU, kernel build, torch and threads
    measured_at: str  # UTC, ISO 8601


def machine() -> str:
    """The CPU, kernel build, torch and threads, as an entry names them."""
    features = cpu_features()
    return f"{features.describe()}; kernels {best_build(features).name}; torch {torch.__version__}; " + (
        f"{torch.get_num_threads()} threads"
    )


def cache_file(
    source: Path, pairs: list[tuple[str, str]], device: str, cache_dir: Path | None, one_digit: bool = True
) -> Path:
    """The entry for these candidates (dtype, quantization) of this model on this machine, with or without their
    one-digit steps timed (it may not exist)."""
    features = cpu_features()
    model_key = file_sha256(source) if source.is_file() else str(source.resolve())
    key = json.dumps(
        [
            PROBE_VERSION,
            sorted(features.hardware_flags),
            features.level,
            best_build(features).name,
            torch.__version__,
            os.cpu_count(),
            torch.get_num_threads(),
            model_key,
            pairs,
            device,
            one_digit,
        ],
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return resolve_cache_dir(cache_dir) / CHOICE_DIR / f"{digest}.json"


def _by_size(table: Mapping[str, Mapping[Any, float]]) -> dict[str, dict[int, float]]:
    return {label: {int(size): value for size, value in sizes.items()} for label, sizes in table.items()}


def write_entry(
    path: Path,
    choice: FormatChoice,
    model: str,
    machine: str,
    keep_settled: bool = False,
    read: CacheEntry | None = None,
) -> CacheEntry:
    """Atomically (a start killed while writing leaves no half entry to read) and under a lock, so that two starts'
    writes cannot interleave. `keep_settled`: where another start settled a choice since this one `read` the file
    (None: found nothing there), it stays rather than a provisional one replacing it. The entry the file holds
    afterwards."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.with_suffix(".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        current = read_entry(path) if keep_settled else None
        if current is not None and not current.choice.provisional and current != read:
            return current
        entry = CacheEntry(choice, model, machine, datetime.now(UTC).isoformat(timespec="seconds"))
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".partial") as partial:
            json.dump(asdict(entry), partial, indent=2)
        os.replace(partial.name, path)
    return entry


def read_entry(path: Path) -> CacheEntry | None:
    """The entry in `path`; None where there is none or it does not parse (it is then measured again)."""
    try:
        stored = json.loads(path.read_text())
        fields = stored["choice"]
        choice = FormatChoice(
            **{**fields, "step_ms": _by_size(fields["step_ms"]), "spread": _by_size(fields.get("spread", {}))}
        )
        return CacheEntry(choice, str(stored["model"]), str(stored["machine"]), str(stored["measured_at"]))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def cached_entries(cache_dir: Path) -> list[tuple[Path, CacheEntry | None]]:
    """Every file under `cache_dir`/format-choice, with its entry (None: unreadable, or an older probe's)."""
    folder = cache_dir / CHOICE_DIR
    return [(path, read_entry(path)) for path in sorted(folder.glob("*.json"))] if folder.is_dir() else []
