"""`python -m benchmarks trace RESULT_DIR`: (re)write an earlier `python -m benchmarks ab` run's workload traces
from its raw records, as its --export-workload would have (the trace format: benchmarks.loadgen.trace)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from benchmarks.loadgen.trace import export_runs
from benchmarks.results_io.report import read_raw_runs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks trace",
        description="Write (or rewrite) the workload traces of an earlier `python -m benchmarks ab` run from its raw "
        "records, as --export-workload would have: RESULT_DIR/workload/<run>.jsonl.",
    )
    parser.add_argument("result_dir", type=Path)
    args = parser.parse_args(argv)
    try:
        runs, sweep = read_raw_runs(args.result_dir)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"wrote traces to {export_runs(args.result_dir, runs, sweep)}")
    return 0
