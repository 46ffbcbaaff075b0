"""Every `--dtype` x `--quantization` combination's decode step on this CPU, and `auto`'s measured choice beside
them, in one run: does `auto` serve as fast as the fastest format, at 1 row, 16 rows and a 128-token prefill?

    BATCHSERVE_CPU_ISA=avx2 python -m benchmarks formats --out DIR   # the AVX2 machine's paths
    python -m benchmarks formats --out DIR                            # this CPU's own

Each combination is loaded as `serve --dtype D --quantization Q` loads it and timed through the engine
(api.runtime.format_steps.time_steps: median of 5 decode steps per row count, 16 sequences with 32-token prompts),
quantised formats with the default row switch as served; `auto` is loaded as `serve` loads it (measuring on its
first start here, its choice cached) and timed with the row switch it chose. Every format is loaded first and then
timed in `--rounds` rounds, in turn, the order reversed every other round (A..Z, Z..A, A..Z, ...), and each time is
the median over the rounds: with an even number of rounds a steady drift cancels. Timed one after another once each,
a machine that sped up or slowed down during the run favoured whichever came first or last (the same weights and
path, timed twice in one run, read 1.19x apart). Writes DIR/result.json.
"""

from __future__ import annotations

import argparse
import logging
import statistics
from collections.abc import Sequence
from pathlib import Path

from api.runtime.format_probe import load_auto
from api.runtime.format_steps import PREFILL_ROWS, PROBE_ROWS, time_steps
from benchmarks.results_io.report import write_json
from engine.config import DEFAULT_MAX_QUANTIZED_ROWS
from engine.platform.cpu_features import cpu_features
from engine.weights.loader import LoadedModel, load_model

COMBINATIONS = [(d, q) for d in ("float32", "bfloat16") for q in ("none", "int8", "int4")]
TOLERANCE = 1.10  # the "within 10 %"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks formats", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="a results folder (result.json is written there)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="times each format is timed, in turn (the median; an even count cancels a drift)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    formats: dict[str, tuple[LoadedModel, int | None, int | None]] = {}  # the model, its switch, one digit's start
    for dtype, quantization in COMBINATIONS:
        loaded = load_model(None, dtype=dtype, quantization=quantization)
        switch = DEFAULT_MAX_QUANTIZED_ROWS if quantization != "none" else None
        formats[loaded.weight_format.label] = (loaded, switch, None)
    auto = load_auto()
    auto_label = f"auto ({auto.weight_format.label})"
    formats[auto_label] = (auto, auto.measured_max_quantized_rows, auto.measured_min_gemm_rows)
    samples: dict[str, list[dict[int, float]]] = {label: [] for label in formats}
    for turn in range(args.rounds):
        order = list(formats) if turn % 2 == 0 else list(reversed(formats))
        for label in order:
            loaded, switch, gemm_from = formats[label]
            times = time_steps(
                loaded, PROBE_ROWS, repeats=args.repeats, max_quantized_rows=switch, min_gemm_rows=gemm_from
            )
            samples[label].append(times)
    rows = {
        label: {n: statistics.median(times[n] for times in runs) for n in runs[0]} for label, runs in samples.items()
    }
    for label, times in rows.items():
        print(f"{label:>22}: " + "  ".join(f"{n} rows {ms:6.1f} ms" for n, ms in times.items()), flush=True)
    others = {label: times for label, times in rows.items() if label != auto_label}
    verdict = {}
    for count in (1, 16, PREFILL_ROWS):
        fastest = min(others, key=lambda label: others[label][count])
        ratio = rows[auto_label][count] / others[fastest][count]
        verdict[count] = {"fastest": fastest, "auto_over_fastest": round(ratio, 3), "within": ratio <= TOLERANCE}
        print(f"{count} rows: auto {ratio:.2f}x the fastest ({fastest}): {'met' if ratio <= TOLERANCE else 'MISSED'}")
    document = {
        "cpu": cpu_features().describe(),
        "auto": {
            "format": auto.weight_format.label,
            "max_quantized_rows": auto.measured_max_quantized_rows,
            "min_gemm_rows": auto.measured_min_gemm_rows,
        },
        "rounds": args.rounds,
        "step_ms": rows,
        "auto_vs_fastest": verdict,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    print(write_json(args.out / "result.json", document))
    return 0
