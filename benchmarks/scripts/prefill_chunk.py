"""The time of one prompt chunk (a lone prompt prefilled in one step) on the default model, or its operator profile,
on the runner `serve` builds (with `auto`, the format and the one-digit row switch measured for this machine).

python -m benchmarks.scripts.prefill_chunk [--lengths 512,1024] [--repeats 5] [--profile] [--compare-sdpa]
    [--chunks 512,2048] [--out F]

`--compare-sdpa` runs every chunk twice in turn, once through the compiled prefill attention (where the build has
it: bf16 on AVX512-BF16) and once through torch's SDPA (the engine's choice where torch runs it on AMX tiles),
and prints both; then as many chunks again under the profiler, for the attention op's time a layer. `--chunks`
times each prompt prefilled instead in steps of at most each of those sizes, interleaved: what a chunk budget costs
a lone prompt's first token (the scheduler's max_num_batched_tokens and lone_prefill_tokens).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from api.config import RuntimeOptions
from api.runtime.build import build_runner, load
from benchmarks.micro.model_flags import add_model_arguments
from benchmarks.micro.rows import add_row
from benchmarks.results_io.report import write_json
from engine.config import EngineConfig
from engine.engine import Engine
from engine.sample.sampling_params import SamplingParams


def chunked_prefill_seconds(engine: Engine, prompt: list[int], chunk: int) -> float:
    """The prompt computed in consecutive steps of at most `chunk` tokens, as the scheduler chunks a lone prompt."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    add_row(engine, 0, prompt, params, len(prompt) + 1, "the KV cache is too small for the prompt")
    start = time.perf_counter()
    for done in range(0, len(prompt), chunk):
        engine.step([(0, min(chunk, len(prompt) - done))])
    seconds = time.perf_counter() - start
    engine.remove(0)
    return seconds


def prefill_seconds(engine: Engine, prompt: list[int]) -> float:
    """One step computing the whole prompt; the row is removed after, so every call starts from an empty cache."""
    return chunked_prefill_seconds(engine, prompt, len(prompt))


def compare_chunks(engine: Engine, prompt: list[int], chunks: list[int], repeats: int) -> dict[str, object]:
    """Each chunk size's prefill time of `prompt`, interleaved over the repeats, after one warm-up each."""
    for chunk in chunks:
        chunked_prefill_seconds(engine, prompt, chunk)
    times: dict[str, list[float]] = {str(chunk): [] for chunk in chunks}
    for _ in range(repeats):
        for chunk in chunks:
            times[str(chunk)].append(chunked_prefill_seconds(engine, prompt, chunk) * 1000)
    medians = {chunk: statistics.median(values) for chunk, values in times.items()}
    first = medians[str(chunks[0])]
    shown = ", ".join(f"chunks of {c}: {m:.0f} ms ({m / first:.3f}x)" for c, m in medians.items())
    print(f"prefill {len(prompt)}: median {shown}", flush=True)
    return {"prefill_ms": times, "median_prefill_ms": medians}


ATTENTION_OPS = ("paged_prefill_attention", "scaled_dot_product_flash_attention")  # the kernel's, SDPA's


def attention_ms_per_layer(engine: Engine, prompt: list[int], layers: int) -> float:
    """One chunk under the profiler: its attention op's CPU time, per layer."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        prefill_seconds(engine, prompt)
    events = [e for e in prof.key_averages() if any(op in e.key for op in ATTENTION_OPS)]
    return sum(e.self_cpu_time_total for e in events) / 1000 / layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_model_arguments(parser)
    parser.add_argument("--lengths", default="512,1024")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="print the operator profile of one chunk per length")
    parser.add_argument(
        "--compare-sdpa", action="store_true", help="interleave each chunk with one on torch's SDPA attention"
    )
    parser.add_argument("--chunks", help="comma-separated chunk sizes: time each prompt prefilled in such steps")
    parser.add_argument("--out", type=Path, help="result.json to write (with the machine that measured it)")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    # As `serve` builds it: until 2026-12-06 this took the runner's defaults, the dense copy past the row switch even
    # where `auto` serves one int8 digit there.
    options = RuntimeOptions(model=args.model, dtype=args.dtype, quantization=args.quantization)
    loaded = load(options)
    runner = build_runner(options, loaded)
    longest = max(lengths) + 16
    config = EngineConfig(max_rows=1, kv_cache_tokens=longest, max_model_len=longest, enable_prefix_caching=False)
    engine = Engine(runner, config, loaded.eos_token_ids, loaded.max_model_len, dtype=runner.dtype)
    generator = torch.Generator().manual_seed(0)
    kernel = runner.prefill_kernel  # the runner's own choice ("auto": SDPA where torch runs it on AMX tiles)
    compiled = runner.kernels.prefill_attention if runner.kernels and runner.dtype == torch.bfloat16 else None
    if args.compare_sdpa and compiled is None:
        parser.error("this model, format or kernel build has no prefill kernel to compare with SDPA")
    paths = {"kernel": compiled, "sdpa": None} if args.compare_sdpa else {"default": kernel}
    results: dict[str, dict[str, object]] = {}
    for length in lengths:
        prompt = torch.randint(0, runner.vocab_size, (length,), generator=generator).tolist()
        if args.chunks:
            chunks = [int(c) for c in args.chunks.split(",")]
            results[str(length)] = compare_chunks(engine, prompt, chunks, args.repeats)
            continue
        for path in paths.values():
            runner.prefill_kernel = path
            prefill_seconds(engine, prompt)  # warm-up
        if args.profile:
            for name, path in paths.items():
                runner.prefill_kernel = path
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    prefill_seconds(engine, prompt)
                print(f"prefill {length} ({name})")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
            continue
        times: dict[str, list[float]] = {name: [] for name in paths}
        attention: dict[str, list[float]] = {name: [] for name in paths}
        for samples, measure in ((times, prefill_seconds), (attention, None)):
            for _ in range(args.repeats):
                for name, path in paths.items():  # interleaved, so that load drifts hit both paths alike
                    runner.prefill_kernel = path
                    if measure is None:
                        samples[name].append(attention_ms_per_layer(engine, prompt, len(runner.layers)))
                    else:
                        samples[name].append(measure(engine, prompt) * 1000)
        medians = {name: statistics.median(values) for name, values in times.items()}
        layer = {name: statistics.median(values) for name, values in attention.items()}
        shown = ", ".join(f"{name} {medians[name]:.1f} ms (attention {layer[name]:.2f} ms a layer)" for name in paths)
        print(f"prefill {length}: median {shown}", flush=True)
        results[str(length)] = {"chunk_ms": times, "attention_ms_per_layer": attention, "median_chunk_ms": medians}
        if args.compare_sdpa:
            ratios = {"chunk": medians["kernel"] / medians["sdpa"], "attention": layer["kernel"] / layer["sdpa"]}
            print(f"  kernel / sdpa: chunk {ratios['chunk']:.2f}x, attention {ratios['attention']:.2f}x", flush=True)
            results[str(length)]["kernel_over_sdpa"] = ratios
    runner.prefill_kernel = kernel
    if args.out:
        write_json(args.out, {"command": " ".join(sys.argv[1:]), "lengths": results})


if __name__ == "__main__":
    main()
