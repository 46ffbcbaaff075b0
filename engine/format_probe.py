"""`auto` weight formats, measured on this machine rather than guessed from its CPU flags.

At the first load on a machine, each candidate format (dtype x quantization, those `auto` leaves open) is loaded
and its decode step timed on the real model at 1, 4, 8 and 16 rows, and a 128-token prefill chunk, through the
same runner and engine that serve. The format kept is the one whose worst ratio to the best time, at 1 row, 16
rows and the prefill chunk, is smallest; for a quantised format the row count up to which its quantised weights
run (above it, the dense copy) is the largest measured count at which they beat the dense format of the same
dtype, and every size when that is the prefill chunk. (The prefill matters: on a CPU without native bf16, a dense
bf16 prefill is an order of magnitude slower than float32's, however fast int4 decodes.) The choice is cached by
the CPU (under BATCHSERVE_CPU_ISA), the kernel build, torch and the model file, beside the converted checkpoint; the
measurement is logged as a phase (engine/phases.py: a line per candidate, its time, where the choice is cached and
how to measure again), after the kernels it times are built; later starts read the choice.

Every candidate meets the quality bar (perplexity within 1 % of float32, docs/quantization.md): the table below
names the measured cost of each; a format whose quality is unmeasured is never a candidate.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.config import DEFAULT_MAX_QUANTIZED_ROWS, EngineConfig
from engine.cpu_features import cpu_features
from engine.engine import Engine
from engine.loader import (
    LoadedModel,
    checkpoint_dtype,
    convert_gguf,
    file_sha256,
    load_model,
    resolve_cache_dir,
    resolve_device,
    resolve_source,
)
from engine.model_runner import TransformersRunner
from engine.native import best_build, load_kernels
from engine.phases import phase
from engine.sampling_params import SamplingParams

logger = logging.getLogger("batchserve.loader")

PROBE_VERSION = 2  # bump when what is measured changes: old choices are then measured again
PROBE_ROWS = (1, 4, 8, 16)  # decode steps of this many sequences
PREFILL_ROWS = 128  # and one sequence's prompt chunk of this many tokens
MEASURED_ROWS = (*PROBE_ROWS, PREFILL_ROWS)
EVERY_STEP = 2**31 - 1  # a row switch past any step: the quantised weights run at every size
_SCORED_ROWS = (1, 16, PREFILL_ROWS)
_REPEATS = 5
_PROMPT_TOKENS = 32

# Perplexity against float32 on SmolLM2-135M (`python -m benchmarks quality`, docs/quantization.md).
# Only these are candidates.
MEASURED_QUALITY: Mapping[tuple[str, str], float] = {
    ("float32", "none"): 0.0,
    ("bfloat16", "none"): 0.11,
    ("float32", "int4"): 0.30,
    ("bfloat16", "int4"): 0.34,
}
QUALITY_BAR_PERCENT = 1.0


@dataclass(frozen=True)
class FormatChoice:
    dtype: str
    quantization: str
    max_quantized_rows: int | None  # None: not quantised
    step_ms: Mapping[str, Mapping[int, float]]  # per candidate label, per row count: median step time
    reason: str

    @property
    def label(self) -> str:
        return self.dtype if self.quantization == "none" else f"{self.quantization}/{self.dtype}"


def candidates(dtype: str, quantization: str, gguf_int4: bool, stored_float32: bool) -> list[tuple[str, str]]:
    """The (dtype, quantization) pairs `auto` may pick: measured quality within the bar, int4 only from a GGUF's
    own Q4 blocks (anything else would mean requantising, whose quality is not measured), and bf16 not for a
    checkpoint stored in float32 (`stored_float32`: its bf16 quality is not measured at load)."""
    found = []
    for (d, q), cost in MEASURED_QUALITY.items():
        if cost > QUALITY_BAR_PERCENT or (q == "int4" and not gguf_int4) or (d == "bfloat16" and stored_float32):
            continue
        if dtype in ("auto", d) and quantization in ("auto", q):
            found.append((d, q))
    return found


def _label(dtype: str, quantization: str) -> str:
    return dtype if quantization == "none" else f"{quantization}/{dtype}"


def choose(step_ms: Mapping[str, Mapping[int, float]], pairs: list[tuple[str, str]]) -> FormatChoice:
    """The format whose worst ratio to the fastest, at 1 row, 16 rows and a prefill chunk, is smallest, with its
    row switch."""
    switched: dict[tuple[str, str], tuple[dict[int, float], int | None]] = {}
    for dtype, quantization in pairs:
        own = step_ms[_label(dtype, quantization)]
        dense = step_ms.get(_label(dtype, "none"))
        if quantization == "none" or dense is None:
            limit = None if quantization == "none" else DEFAULT_MAX_QUANTIZED_ROWS  # no dense format to compare
            switched[(dtype, quantization)] = (dict(own), limit)
            continue
        wins = [rows for rows in MEASURED_ROWS if own[rows] <= dense[rows]]
        limit = max(wins) if wins else 0
        if limit == MEASURED_ROWS[-1]:
            # Winning at the largest size measured: no reason to expect the dense copy to win past it (on a CPU
            # without native bf16 a 512-token dense bf16 prefill is many times the int4 one).
            limit = EVERY_STEP
        times = {rows: own[rows] if rows <= limit else dense[rows] for rows in MEASURED_ROWS}
        switched[(dtype, quantization)] = (times, limit)
    ends = _SCORED_ROWS
    best = {rows: min(times[rows] for times, _ in switched.values()) for rows in ends}

    def worst_ratio(pair: tuple[str, str]) -> float:
        return max(switched[pair][0][rows] / best[rows] for rows in ends)

    # Ties go to the more exact format (the table's order: float32 first).
    chosen = min(pairs, key=lambda pair: (round(worst_ratio(pair), 3), MEASURED_QUALITY[pair]))
    times, limit = switched[chosen]
    dtype, quantization = chosen
    if quantization != "none" and limit == 0:
        quantization, limit = "none", None  # the dense weights won at every size: no reason to hold int4
    reason = ", ".join(
        f"{_label(*pair)} " + "/".join(f"{switched[pair][0][rows]:.1f}" for rows in ends) + " ms" for pair in pairs
    )
    return FormatChoice(dtype, quantization, limit, step_ms, f"ms at 1/16 rows/{PREFILL_ROWS}-token prefill: {reason}")


def time_steps(
    loaded: LoadedModel,
    rows: tuple[int, ...] = PROBE_ROWS,
    prefill_tokens: int | None = PREFILL_ROWS,
    repeats: int = _REPEATS,
    max_quantized_rows: int | None = None,
) -> dict[int, float]:
    """Median decode step time (ms) of `loaded` at each row count, and (keyed by its size) of a prefill chunk of
    `prefill_tokens`; quantised weights (if any) run up to `max_quantized_rows` rows (None: at every size)."""
    dtype = next(loaded.model.parameters()).dtype
    runner = TransformersRunner(loaded.model, quantized=loaded.quantized, max_quantized_rows=max_quantized_rows)
    seats = max(rows)
    length = _PROMPT_TOKENS + repeats + 2
    cache_tokens = seats * 2 * length + 2 * (prefill_tokens or 0) + 32
    # + a seat for prefills; no prefix caching: the same prompts are timed again and must be computed each time
    config = EngineConfig(seats=seats + 1, kv_cache_tokens=cache_tokens, block_size=16, enable_prefix_caching=False)
    engine = Engine(runner, config, dtype=dtype)
    params = SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True)
    prompt = list(range(1, _PROMPT_TOKENS + 1))
    for seq in range(seats):
        engine.add(seq, prompt, params)
        engine.reserve(seq, length + repeats * len(rows))
    engine.step([(seq, len(prompt)) for seq in range(seats)])
    times: dict[int, float] = {}
    with torch.inference_mode():
        for count in rows:
            engine.step([(seq, 1) for seq in range(count)])  # warm-up at this size
            samples = []
            for _ in range(repeats):
                started = time.perf_counter()
                engine.step([(seq, 1) for seq in range(count)])
                samples.append((time.perf_counter() - started) * 1000)
            times[count] = statistics.median(samples)
        if prefill_tokens:
            samples = []
            for repeat in range(repeats + 1):  # the first is a warm-up
                seq = seats + repeat
                engine.add(seq, list(range(1, prefill_tokens + 1)), params)
                engine.reserve(seq, prefill_tokens + 1)
                started = time.perf_counter()
                engine.step([(seq, prefill_tokens)])
                samples.append((time.perf_counter() - started) * 1000)
                engine.remove(seq)
            times[prefill_tokens] = statistics.median(samples[1:])
    return times


def _cache_file(source: Path, pairs: list[tuple[str, str]], device: str, cache_dir: Path | None) -> Path:
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
        ],
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return resolve_cache_dir(cache_dir) / "format-choice" / f"{digest}.json"


def measured_format(
    source: Path,
    pairs: list[tuple[str, str]],
    device: str = "cpu",
    cache_dir: Path | None = None,
    measure: Callable[[str, str], dict[int, float]] | None = None,
) -> FormatChoice:
    """The cached choice among `pairs` for this machine, measuring it first if there is none. `measure(dtype,
    quantization)` times one candidate (default: load it and `time_steps`, after building the kernels the runner
    uses, so that their build is a phase of its own rather than a silent part of the first candidate's)."""
    cached = _cache_file(source, pairs, device, cache_dir)
    redo = f"cached in {cached}; delete it to measure again"
    try:
        stored = json.loads(cached.read_text())
        choice = FormatChoice(
            **{**stored, "step_ms": {k: {int(r): t for r, t in v.items()} for k, v in stored["step_ms"].items()}}
        )
        logger.info("weights: %s chosen by auto, measured here before (%s)", choice.label, redo)
        return choice
    except (OSError, ValueError, TypeError, KeyError):
        pass

    def load_and_time(dtype: str, quantization: str) -> dict[int, float]:
        return time_steps(load_model(source, device, cache_dir, dtype, quantization, quiet=True))

    if measure is None:
        load_kernels()  # logged as its own phase when it builds (engine/native.py)
    measure = measure or load_and_time
    labels = [_label(d, q) for d, q in pairs]
    what = (
        f"{len(pairs)} candidates ({', '.join(labels)}), each loaded and timed: decode steps of "
        f"{'/'.join(map(str, PROBE_ROWS))} rows and a {PREFILL_ROWS}-token prefill"
    )
    with phase(logger, "measuring weight formats once for this CPU", what, steps=len(pairs)) as running:
        step_ms = {}
        for (dtype, quantization), label in zip(pairs, labels, strict=True):
            running.step(label)
            step_ms[label] = measure(dtype, quantization)
        choice = choose(step_ms, pairs)
        cached.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=cached.parent, delete=False, suffix=".partial") as partial:
            json.dump(asdict(choice), partial, indent=2)
        os.replace(partial.name, cached)
        limit = choice.max_quantized_rows
        rows = f", quantised up to {limit} rows" if limit else ""
        rows = ", quantised at every size" if limit == EVERY_STEP else rows
        logger.info("weights: %s chosen by auto%s (%s)", choice.label, rows, choice.reason)
        running.result = redo
    return choice


def load_auto(
    path: str | Path | None = None,
    device: str = "cpu",
    cache_dir: Path | None = None,
    dtype: str = "auto",
    quantization: str = "auto",
) -> LoadedModel:
    """`load_model`, with whatever is `auto` measured on a CPU where more than one candidate is left. A first start's
    slow steps are logged as phases, one after the other (engine/phases.py): the GGUF's conversion, loading the
    weights, the kernel build and the measurement (engine/native.py builds the kernels before it times them)."""
    source = resolve_source(path)
    if source.is_file():
        convert_gguf(source, cache_dir)  # before the load's phase, not inside it
    measuring = "auto" in (dtype, quantization) and resolve_device(device).type == "cpu"
    with phase(logger, "loading the weights", announce=False):
        loaded = load_model(source, device, cache_dir, dtype, quantization, quiet=measuring)
    if not measuring:
        return loaded
    stored_float32 = source.is_dir() and checkpoint_dtype(source) in (None, torch.float32)
    pairs = candidates(dtype, quantization, loaded.weight_format.quantization == "int4", stored_float32)
    if len(pairs) < 2:
        logger.info("weights: %s (%d quantised matmuls)", loaded.weight_format.label, len(loaded.quantized))
        return loaded
    choice = measured_format(source, pairs, device, cache_dir)  # logs the choice
    if _label(choice.dtype, choice.quantization) == loaded.weight_format.label:
        chosen = loaded
    else:
        del loaded
        with phase(logger, f"loading the weights as {choice.label}", announce=False):
            chosen = load_model(source, device, cache_dir, choice.dtype, choice.quantization, quiet=True)
    return chosen.with_row_switch(choice.max_quantized_rows)
