"""How long a full GC stops a loaded server, before and after its heap is frozen: results/gc_pause.json."""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from api.apps.loading import build_runtime, default_loader
from api.flags import add_config_flags, config_from_args
from benchmarks.results_io.report import write_json
from engine.platform.compute_thread import run_on_passing_thread


@dataclass(frozen=True)
class FullCollections:
    tracked_objects: int
    median_ms: float
    max_ms: float


def time_full_collections(repeats: int) -> FullCollections:
    tracked = len(gc.get_objects())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        gc.collect()
        times.append(1e3 * (time.perf_counter() - start))
    return FullCollections(tracked, statistics.median(times), max(times))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    add_config_flags(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(given)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    config = config_from_args(args)
    gc.collect()  # what this program left to collect goes first, so that loading can only add
    baseline = len(gc.get_objects())  # this program's own objects, before the server's
    runtime = run_on_passing_thread(lambda: build_runtime(config, default_loader(config)))  # as serve loads
    before = time_full_collections(args.repeats)
    gc.freeze()
    after = time_full_collections(args.repeats)
    for name, figures in (("as loaded", before), ("heap frozen", after)):
        print(
            f"{name:12s}: {figures.tracked_objects:8,d} tracked objects, a full collection {figures.median_ms:7.2f} ms"
            f" (max {figures.max_ms:.2f})"
        )
    if args.out is not None:
        document = {
            "command": " ".join([sys.executable, "-m", "benchmarks", "gc", *given]),
            "model": runtime.model_name,
            "tracked_before_loading": baseline,
            "as_loaded": asdict(before),
            "heap_frozen": asdict(after),
        }
        write_json(args.out, document)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
