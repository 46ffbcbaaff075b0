"""What prefix caching costs when nothing is shared: the same engine steps with caching on and off.

Every attempt sends fresh random prompts (no prefix is ever found), so the only difference is the bookkeeping:
looking prompts up, registering each block a step fills, parking released blocks and evicting them. The two
settings alternate attempt by attempt (on, off, off, on, ...) on one loaded model, so drift over the run touches
both alike; each figure is the median over its attempts.

    python -m benchmarks prefix-overhead --out benchmarks/results/prefix-caching/2026-12-02-xeon/overhead.json
"""

from __future__ import annotations

import argparse
import resource
import statistics
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks.micro.engine_bench import one_pass
from benchmarks.micro.model_flags import add_model_arguments, load_from_args
from benchmarks.results_io.report import write_json
from engine.config import EngineConfig
from engine.engine import Engine
from engine.loader import LoadedModel
from engine.model_runner import TransformersRunner

CACHE_ATTEMPTS = 4  # the KV cache holds this many attempts' sequences


@torch.inference_mode()
def measure(loaded: LoadedModel, batch: int, prompt_len: int, steps: int, repeats: int) -> dict[str, float]:
    runner = TransformersRunner(loaded.model, quantized=loaded.quantized)
    vocab = runner.vocab_size
    tokens = batch * (prompt_len + steps + 16)
    engines = {
        caching: Engine(
            runner,
            # Room for several attempts, so the cache also parks and evicts blocks as a server's does.
            EngineConfig(seats=batch, kv_cache_tokens=CACHE_ATTEMPTS * tokens, enable_prefix_caching=caching),
            loaded.eos_token_ids,
            loaded.max_model_len,
            dtype=runner.dtype,
        )
        for caching in (True, False)
    }
    generator = torch.Generator().manual_seed(batch)
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    order = [True, False, False, True]
    # Warm-up: with caching on, released blocks park and the next attempt takes never-used ones, so the first
    # passes through the cache touch fresh memory (page faults) where caching off reuses the same blocks. An
    # attempt takes a little less than a CACHE_ATTEMPTS-th of the cache (its last blocks are part-filled), so
    # CACHE_ATTEMPTS + 1 attempts per setting hand out every block at least once; after that both settings run in
    # steady state, as a long-lived server. The minor page faults of each measured attempt show whether they do.
    warm_up = 2 * (CACHE_ATTEMPTS + 1)
    faults: dict[bool, list[int]] = {True: [], False: []}
    for attempt in range(2 * repeats + warm_up):
        caching = order[attempt % 4]
        prompts = [torch.randint(100, vocab - 1, (prompt_len,), generator=generator).tolist() for _ in range(batch)]
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        result = one_pass(engines[caching], prompts, steps)
        if attempt >= warm_up:
            times[caching].append(result)
            faults[caching].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    on_prefill, on_decode = (statistics.median(t[i] for t in times[True]) for i in (0, 1))
    off_prefill, off_decode = (statistics.median(t[i] for t in times[False]) for i in (0, 1))
    assert engines[True].prefix_cache.hits == 0, "fresh prompts must never hit"
    return {
        "batch": batch,
        "prompt_tokens": prompt_len,
        "prefill_ms_on": on_prefill * 1000,
        "prefill_ms_off": off_prefill * 1000,
        "decode_step_ms_on": on_decode * 1000,
        "decode_step_ms_off": off_decode * 1000,
        "prefill_throughput_on_over_off": off_prefill / on_prefill,
        "decode_throughput_on_over_off": off_decode / on_decode,
        "minor_faults_per_attempt_on": statistics.median(faults[True]),
        "minor_faults_per_attempt_off": statistics.median(faults[False]),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks prefix-overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arguments(parser)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=32, help="crosses two 16-token blocks per row")
    parser.add_argument("--repeats", type=int, default=4, help="measured attempts per setting")
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    loaded = load_from_args(args)
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        row = measure(loaded, batch, args.prompt_tokens, args.decode_steps, args.repeats)
        rows.append(row)
        print(
            f"batch {batch:>3}: prefill {row['prefill_ms_on']:7.1f} ms on, {row['prefill_ms_off']:7.1f} off "
            f"({row['prefill_throughput_on_over_off']:.3f}x); decode step {row['decode_step_ms_on']:6.2f} ms on, "
            f"{row['decode_step_ms_off']:6.2f} off ({row['decode_throughput_on_over_off']:.3f}x); minor faults an "
            f"attempt {row['minor_faults_per_attempt_on']:.0f} on, {row['minor_faults_per_attempt_off']:.0f} off",
            flush=True,
        )
    if args.out:
        write_json(args.out, {"weights": loaded.weight_format.label, "rows": rows})
