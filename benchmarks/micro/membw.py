"""How fast this machine reads memory, by working-set size: the floor under a bandwidth-bound decode step.

    python -m benchmarks membw [--sizes-mb 16,64,96,256,1024] [--threads 2] [--repeats 7] [--out FILE.json]

For each size, a float32 tensor of that many bytes is summed (one streaming read per pass) `--repeats` times after
a warm-up; the best pass gives GB/s. A working set that fits a cache reads at that cache's speed, a larger one at
DRAM's, so the row that matches a model's bytes per token (the default model reads ~95 MB per batch-1 token)
gives that token's floor: bytes / bandwidth. Each result file records its machine.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.results_io.report import write_json


@dataclass(frozen=True)
class ReadBandwidth:
    size_mb: int
    best_ms: float
    gb_s: float


def read_bandwidth(size_mb: int, repeats: int) -> ReadBandwidth:
    data = torch.ones(size_mb * 2**20 // 4, dtype=torch.float32)
    data.sum()  # warm-up: pages touched, caches filled as far as they can be
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return ReadBandwidth(size_mb, best * 1e3, size_mb * 2**20 / best / 1e9)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks membw", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=_ints, default=(16, 64, 96, 256, 1024))
    parser.add_argument("--threads", type=int, default=2, help="torch threads, as every server in the benchmarks")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not args.sizes_mb or min(args.sizes_mb) < 1 or args.threads < 1 or args.repeats < 1:
        parser.error("sizes, threads and repeats must be >= 1")
    torch.set_num_threads(args.threads)
    rows = [read_bandwidth(size, args.repeats) for size in args.sizes_mb]
    for row in rows:
        print(f"{row.size_mb:6d} MB: {row.gb_s:6.1f} GB/s ({row.best_ms:.2f} ms a pass)")
    if args.out:
        write_json(args.out, {"threads": args.threads, "reads": [asdict(r) for r in rows]})
    return 0
