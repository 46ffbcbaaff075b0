"""The compiled prefill attention against torch's SDPA on one lone causal chunk, op against op, interleaved.

python -m benchmarks.scripts.prefill_attention_bench [--lengths 512,1024,2048] [--threads 1,2] [--out F]

SmolLM2-135M's attention shape by default (9 query heads, 3 KV heads, head size 64), bf16 queries and cache in
blocks of 16. SDPA gets what the engine gave it for a lone chunk from position 0: the cache slice and `is_causal`.
Each sample times one call of each in turn; the minimum and median per length and thread count are printed.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.results_io.report import write_json
from engine.platform.native import load_kernels


def timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", default="512,1024,2048")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--out", type=Path, help="result.json to write (with the machine that measured it)")
    args = parser.parse_args()
    kernels = load_kernels()
    kernel = kernels.prefill_attention if kernels else None
    if kernel is None:
        parser.error("this machine's kernel build has no prefill attention (it needs AVX512-BF16)")
    block, scale = 16, args.head_dim**-0.5
    results: dict[str, dict[str, object]] = {}
    for length in (int(n) for n in args.lengths.split(",")):
        blocks = -(-length // block)
        key_cache, value_cache = (
            torch.randn(args.kv_heads, blocks * block, args.head_dim).bfloat16() for _ in range(2)
        )
        query = torch.randn(length, args.heads, args.head_dim).bfloat16()
        table, first, count = torch.arange(blocks)[None], torch.tensor([0]), torch.tensor([length])
        chunk = query.view(1, length, args.heads, args.head_dim).transpose(1, 2)
        keys, values = key_cache[None, :, :length], value_cache[None, :, :length]

        ours = functools.partial(kernel, query, key_cache, value_cache, table, first, count, count, block, scale)
        sdpa = functools.partial(
            F.scaled_dot_product_attention, chunk, keys, values, is_causal=True, scale=scale, enable_gqa=True
        )
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            ours(), sdpa()  # warm-up
            samples: dict[str, list[float]] = {"kernel": [], "sdpa": []}
            for _ in range(args.samples):
                samples["kernel"].append(timed(ours))
                samples["sdpa"].append(timed(sdpa))
            summary = {
                name: {"min_ms": min(times), "median_ms": statistics.median(times)} for name, times in samples.items()
            }
            ratio = summary["kernel"]["median_ms"] / summary["sdpa"]["median_ms"]
            results[f"{length}/{threads}"] = {"samples_ms": samples, "summary": summary, "kernel_over_sdpa": ratio}
            shown = ", ".join(f"{n} min {s['min_ms']:.2f} median {s['median_ms']:.2f} ms" for n, s in summary.items())
            print(f"{length} tokens, {threads} threads: {shown}; kernel / sdpa {ratio:.2f}x (medians)", flush=True)
    if args.out:
        write_json(args.out, {"command": " ".join(sys.argv[1:]), "runs": results})


if __name__ == "__main__":
    main()
