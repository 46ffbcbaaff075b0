"""Does prefix caching slow the engine when nothing is shared: docs/prefix_caching.md, results/prefix-caching/."""

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
from engine.model.model_runner import TransformersRunner
from engine.weights.loader import LoadedModel

CACHE_ATTEMPTS = 4  # the KV cache holds this many attempts' sequences
SETTINGS = ("on", "off", "control")  # control: caching off again, the A/A check
CYCLE = ("on", "off", "control", "control", "off", "on")  # each setting as often early as late in a cycle


def _median_ms(samples: list[tuple[float, float]], index: int) -> float:
    return statistics.median(sample[index] for sample in samples) * 1000


def _paired_ratio(samples: dict[str, list[tuple[float, float]]], setting: str, index: int) -> float:
    """Median over cycles of off's time over `setting`'s (throughput of `setting` relative to off); a cycle holds
    two attempts of each setting."""
    per_cycle = len(CYCLE) // len(SETTINGS)
    ratios = []
    for start in range(0, len(samples[setting]), per_cycle):
        off = sum(sample[index] for sample in samples["off"][start : start + per_cycle])
        other = sum(sample[index] for sample in samples[setting][start : start + per_cycle])
        ratios.append(off / other)
    return statistics.median(ratios)


@torch.inference_mode()
def measure(loaded: LoadedModel, batch: int, prompt_len: int, steps: int, cycles: int) -> dict[str, float]:
    runner = TransformersRunner(loaded.model, quantized=loaded.quantized)
    vocab = runner.vocab_size
    tokens = batch * (prompt_len + steps + 16)
    engine = Engine(
        runner,
        # Room for several attempts, so the cache also parks and evicts blocks as a server's does.
        EngineConfig(max_rows=batch, kv_cache_tokens=CACHE_ATTEMPTS * tokens, enable_prefix_caching=True),
        loaded.eos_token_ids,
        loaded.max_model_len,
        dtype=runner.dtype,
    )
    generator = torch.Generator().manual_seed(batch)
    times: dict[str, list[tuple[float, float]]] = {setting: [] for setting in SETTINGS}
    faults: dict[str, list[int]] = {setting: [] for setting in SETTINGS}
    # Warm-up: with caching on, released blocks park and the next attempt takes never-used ones, so the first
    # passes through the cache touch fresh memory (page faults). An attempt takes a little less than a
    # CACHE_ATTEMPTS-th of the cache (its last blocks are part-filled), so two cycles (four attempts with caching
    # on, then more after) hand out every block at least once; after that every setting runs in steady state, as
    # a long-lived server. The minor page faults of each measured attempt show whether they do.
    warm_up = 2 * len(CYCLE)
    for attempt in range(warm_up + len(CYCLE) * cycles):
        setting = CYCLE[attempt % len(CYCLE)]
        engine.blocks.enabled = setting == "on"
        prompts = [torch.randint(100, vocab - 1, (prompt_len,), generator=generator).tolist() for _ in range(batch)]
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        result = one_pass(engine, prompts, steps)
        if attempt >= warm_up:
            times[setting].append(result)
            faults[setting].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    assert engine.blocks.hits == 0, "fresh prompts must never hit"
    prefill = {setting: _median_ms(times[setting], 0) for setting in SETTINGS}
    decode = {setting: _median_ms(times[setting], 1) for setting in SETTINGS}
    row: dict[str, float] = {
        "batch": batch,
        "prompt_tokens": prompt_len,
        "cycles": cycles,
        "tokens_looked_up": engine.blocks.queries,  # by the attempts with caching on, warm-up included
    }
    for setting in SETTINGS:
        row[f"prefill_ms_{setting}"] = prefill[setting]
        row[f"decode_step_ms_{setting}"] = decode[setting]
        row[f"minor_faults_per_attempt_{setting}"] = statistics.median(faults[setting])
    for setting in ("on", "control"):
        row[f"prefill_throughput_{setting}_over_off"] = _paired_ratio(times, setting, 0)
        row[f"decode_throughput_{setting}_over_off"] = _paired_ratio(times, setting, 1)
    return row


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_model_arguments(parser)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=32, help="crosses two 16-token blocks per row")
    parser.add_argument("--cycles", type=int, default=8, help="measured cycles, two attempts per setting each")
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    loaded = load_from_args(args)
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        row = measure(loaded, batch, args.prompt_tokens, args.decode_steps, args.cycles)
        rows.append(row)
        print(
            f"batch {batch:>3}: prefill ms on/off/control {row['prefill_ms_on']:.1f}/{row['prefill_ms_off']:.1f}/"
            f"{row['prefill_ms_control']:.1f} (on {row['prefill_throughput_on_over_off']:.3f}x, control "
            f"{row['prefill_throughput_control_over_off']:.3f}x); decode step ms {row['decode_step_ms_on']:.2f}/"
            f"{row['decode_step_ms_off']:.2f}/{row['decode_step_ms_control']:.2f} (on "
            f"{row['decode_throughput_on_over_off']:.3f}x, control {row['decode_throughput_control_over_off']:.3f}x); "
            f"minor faults an attempt {row['minor_faults_per_attempt_on']:.0f}/"
            f"{row['minor_faults_per_attempt_off']:.0f}/{row['minor_faults_per_attempt_control']:.0f}",
            flush=True,
        )
    if args.out:
        write_json(args.out, {"weights": loaded.weight_format.label, "rows": rows})


if __name__ == "__main__":
    main()
