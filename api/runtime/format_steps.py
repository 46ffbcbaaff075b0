"""A loaded weight format's engine steps, ready to time (api/runtime/format_probe.py,
benchmarks/micro/format_matrix.py): decode steps of 1-32 sequences with 32-token prompts and 128-token prefill
chunks, through the same runner and engine that serve; and how many formats fit in memory, loaded at once."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from api.runtime.format_choice import gemm_steps
from api.runtime.format_timing import Clock, SystemClock
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.model_runner import TransformersRunner
from engine.sample.sampling_params import SamplingParams
from engine.weights.loader import LoadedModel
from engine.weights.quantization import Int4Weight

# Decode steps of this many sequences. 32 is there for the row switch: where quantised steps cost per row and the
# dense copy's per weight, the crossing can fall past 16 rows (Zen 4, natively and capped to AVX2: past 32).
PROBE_ROWS = (1, 4, 8, 16, 32)
PREFILL_ROWS = 128  # and one sequence's prompt chunk of this many tokens
MEASURED_ROWS = (*PROBE_ROWS, PREFILL_ROWS)
# Each decoding sequence's prompt, prefilled for all 32 rows in one step as a candidate is set up: short, since
# that step runs the candidate's slowest path (at 32 tokens a 1B model's dense bf16, capped to AVX2, took 77 s of a
# 10-minute first start); the decode steps' context then grows by a token a step.
_PROMPT_TOKENS = 8
Pair = tuple[str, str]  # (dtype, quantization)
# Bytes per weight a candidate holds while it is timed, its model and its runner's copy (docs/quantization.md's
# memory table before one copy of each weight, 5466b42: 1076, 538, 646 and 364 MB for SmolLM2-135M's 134.5 M
# weights; a serving load holds less now, so the table errs on the side of room), rounded up; int4/float32 keeps the
# 6 of its float32 LM head's 731 MB, an allowance above its figure. An int4 format's one-digit steps add a runner
# with its own packed weights (about half a byte a weight, an int8 head): one more.
_BYTES_PER_WEIGHT: Mapping[Pair, int] = {
    ("float32", "none"): 8,
    ("bfloat16", "none"): 4,
    ("float32", "int4"): 7,
    ("bfloat16", "int4"): 4,
}


class EngineStepper:
    """`step(n)`: a decode step of the first n of `rows` sequences, or (n = `prefill_tokens`) a prefill chunk of a
    new sequence, removed after it; each sequence may take `decode_steps` decode steps. Quantised weights (if any)
    run up to `max_quantized_rows` rows (None: at every size), one int8 digit per activation (int4_gemm) from
    `min_gemm_rows` as a served choice runs them (format_choice.gemm_steps); `one_digit`: every step on one digit
    (no dense copy). No prefix caching: the same prompts are timed again and must be computed each time."""

    def __init__(
        self,
        loaded: LoadedModel,
        rows: tuple[int, ...] = PROBE_ROWS,
        prefill_tokens: int | None = PREFILL_ROWS,
        decode_steps: int = 64,
        max_quantized_rows: int | None = None,
        one_digit: bool = False,
        min_gemm_rows: int | None = None,
    ) -> None:
        dtype = loaded.dtype
        switch = 0 if one_digit else max_quantized_rows
        int4_gemm, gemm_from = ("all", None) if one_digit else gemm_steps("auto", min_gemm_rows, switch)
        runner = TransformersRunner(
            loaded.model,
            quantized=loaded.quantized,
            max_quantized_rows=switch,
            min_gemm_rows=gemm_from,
            int4_gemm=int4_gemm,
            keep_model_weights=loaded.dense_reference,
        )
        self.loaded = loaded
        self.decode_steps = decode_steps
        self.runs_int4_gemm = runner.int8_activations and any(
            isinstance(weight, Int4Weight) for weight in loaded.quantized.values()
        )
        self.rows = rows
        self.prefill_tokens = prefill_tokens
        decoding = max(rows)
        length = _PROMPT_TOKENS + decode_steps + 2
        cache_tokens = decoding * 2 * length + 2 * (prefill_tokens or 0) + 32
        config = EngineConfig(
            max_rows=decoding + 1, kv_cache_tokens=cache_tokens, block_size=16, enable_prefix_caching=False
        )
        self.engine = Engine(runner, config, dtype=dtype)  # + a row for prefills
        self.params = SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True)
        prompt = list(range(1, _PROMPT_TOKENS + 1))
        for seq in range(decoding):
            self.engine.add(seq, prompt, self.params)
            self.engine.reserve(seq, length)
        with torch.inference_mode():
            self.engine.step([(seq, len(prompt)) for seq in range(decoding)])
        self._next_seq = decoding

    def one_digit(self) -> EngineStepper | None:
        """The same loaded weights, every step on int4_gemm (its own runner: another packed copy of the int4
        weights, no dense one); None where this runner has no integer dot products or no int4 weights."""
        if not self.runs_int4_gemm:
            return None
        return EngineStepper(self.loaded, self.rows, self.prefill_tokens, self.decode_steps, one_digit=True)

    def step(self, size: int) -> None:
        with torch.inference_mode():
            if size in self.rows:
                self.engine.step([(seq, 1) for seq in range(size)])
                return
            if size != self.prefill_tokens:
                raise ValueError(f"no step of size {size}: decode rows {self.rows}, prefill {self.prefill_tokens}")
            seq, self._next_seq = self._next_seq, self._next_seq + 1
            self.engine.add(seq, list(range(1, size + 1)), self.params)
            self.engine.reserve(seq, size + 1)
            self.engine.step([(seq, size)])
            self.engine.remove(seq)


def time_steps(
    loaded: LoadedModel,
    rows: tuple[int, ...] = PROBE_ROWS,
    prefill_tokens: int | None = PREFILL_ROWS,
    repeats: int = 5,
    max_quantized_rows: int | None = None,
    clock: Clock | None = None,
    min_gemm_rows: int | None = None,
) -> dict[int, float]:
    """Median step time (ms) of `loaded` at each row count, and (keyed by its size) of a prefill chunk of
    `prefill_tokens`, each after a warm-up step of that size; quantised weights (if any) run up to
    `max_quantized_rows` rows (None: at every size), one digit from `min_gemm_rows` (EngineStepper's)."""
    clock = clock or SystemClock()
    stepper = EngineStepper(
        loaded, rows, prefill_tokens, (repeats + 1) * len(rows), max_quantized_rows, min_gemm_rows=min_gemm_rows
    )
    sizes = (*rows, prefill_tokens) if prefill_tokens else rows
    times: dict[int, float] = {}
    for size in sizes:
        stepper.step(size)  # warm-up at this size
        samples = []
        for _ in range(repeats):
            started = clock.now()
            stepper.step(size)
            samples.append((clock.now() - started) * 1000)
        times[size] = statistics.median(samples)
    return times


def held_bytes(pair: Pair, weights: int) -> int:
    """What a candidate of `weights` parameters holds while it is timed, by the table above."""
    return _BYTES_PER_WEIGHT.get(pair, 8) * weights


def fitting(pairs: Sequence[Pair], weights: int, available: int | None) -> list[Pair]:
    """The candidates that fit in the `available` memory as they are timed (bytes; None: unknown, all of them), or
    the least demanding one where none does. Timing one that cannot fit would push a first start into swap or the
    OOM killer: a 3B model's float32 candidate holds some 26 GB, its int4/float32 22."""
    if available is None:
        return list(pairs)
    fit = [pair for pair in pairs if held_bytes(pair, weights) <= available]
    return fit or [min(pairs, key=lambda pair: held_bytes(pair, weights))]


def resident_groups(pairs: Sequence[Pair], weights: int, available: int | None) -> list[list[Pair]]:
    """The candidates to hold loaded at once, in turn: all of them where their `weights` (parameters) fit in half
    of the `available` memory (bytes; None: unknown, all of them), else consecutive groups that do (one at least)."""
    if available is None:
        return [list(pairs)]
    groups: list[list[Pair]] = [[]]
    held = 0
    for pair in pairs:
        need = held_bytes(pair, weights)
        if groups[-1] and held + need > available // 2:
            groups.append([])
            held = 0
        groups[-1].append(pair)
        held += need
    return groups


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes; None where there is none (not Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
