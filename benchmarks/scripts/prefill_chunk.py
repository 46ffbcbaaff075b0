"""The time of one prompt chunk (a lone prompt prefilled in one step) on the default model, or its operator profile.

python -m benchmarks.scripts.prefill_chunk [--lengths 512,1024] [--repeats 5] [--profile]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.micro.model_flags import add_model_arguments, load_from_args
from benchmarks.micro.rows import add_row
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.model_runner import TransformersRunner
from engine.sample.sampling_params import SamplingParams


def prefill_seconds(engine: Engine, prompt: list[int]) -> float:
    """One step computing the whole prompt; the row is removed after, so every call starts from an empty cache."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    add_row(engine, 0, prompt, params, len(prompt) + 1, "the KV cache is too small for the prompt")
    start = time.perf_counter()
    engine.step([(0, len(prompt))])
    seconds = time.perf_counter() - start
    engine.remove(0)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_model_arguments(parser)
    parser.add_argument("--lengths", default="512,1024")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="print the operator profile of one chunk per length")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    loaded = load_from_args(args)
    runner = TransformersRunner(loaded.model, quantized=loaded.quantized)
    longest = max(lengths) + 16
    config = EngineConfig(max_rows=1, kv_cache_tokens=longest, max_model_len=longest, enable_prefix_caching=False)
    engine = Engine(runner, config, loaded.eos_token_ids, loaded.max_model_len, dtype=runner.dtype)
    generator = torch.Generator().manual_seed(0)
    for length in lengths:
        prompt = torch.randint(0, runner.vocab_size, (length,), generator=generator).tolist()
        prefill_seconds(engine, prompt)  # warm-up
        if args.profile:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                prefill_seconds(engine, prompt)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
            continue
        times = [prefill_seconds(engine, prompt) for _ in range(args.repeats)]
        print(f"prefill {length}: median {statistics.median(times) * 1000:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
