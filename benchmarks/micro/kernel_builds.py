"""Each compiled kernel's speed in each build this CPU can execute, in one run: the weight-only matmuls on
SmolLM2-135M's gate/up projection shape ([3072, 576]), the fused SiLU * up (float32 and bf16), residual add +
RMSNorm and RoPE + cache write (bf16), greedy argmax and prompt scoring (top 5) over the 49,152-token vocabulary,
at 1 and 16 rows; decode attention at SmolLM2-135M's head shape (9 query heads, 3 KV heads, 64 dims) from a bf16
paged cache, at 1 and 32 rows of 70 to 130 tokens.

    python -m benchmarks kernels --out DIR

Median of 50 calls after 10 warm-ups, 2 threads; bf16 activations for the int4 kernels (what `auto` runs), float32
for int8. Writes DIR/result.json.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from benchmarks.results_io.report import write_json
from engine.model.linear import Int4DotLinear, Int4Linear, Int8DotLinear, Int8Linear
from engine.platform import native
from engine.platform.cpu_features import cpu_features
from engine.weights.quantization import int4_from_dense, int8_from_dense

ROWS = (1, 16)
OUT_FEATURES, IN_FEATURES = 3072, 576
ATTENTION_ROWS = (1, 32)
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, LONGEST = 9, 3, 64, 16, 130
VOCAB = 49152


def attention_case(rows: int) -> tuple[torch.Tensor, ...]:
    """(query, key cache, value cache, block table, context lengths): bf16, each row's blocks shuffled in the cache."""
    generator = torch.Generator().manual_seed(rows)
    blocks = (LONGEST + BLOCK_SIZE - 1) // BLOCK_SIZE
    slots = rows * blocks * BLOCK_SIZE
    query = torch.randn(rows, HEADS, HEAD_DIM, generator=generator).bfloat16()
    keys = torch.randn(KV_HEADS, slots, HEAD_DIM, generator=generator).bfloat16()
    values = torch.randn(KV_HEADS, slots, HEAD_DIM, generator=generator).bfloat16()
    table = torch.randperm(rows * blocks, generator=generator).view(rows, blocks)
    lengths = torch.randint(LONGEST - 60, LONGEST + 1, (rows,), generator=generator)
    return query, keys, values, table, lengths


def median_us(call: Callable[[], object], repeats: int = 50) -> float:
    for _ in range(10):
        call()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        samples.append((time.perf_counter() - started) * 1e6)
    return round(statistics.median(samples), 1)


def rope_call(kernels: native.Kernels, rows: int) -> Callable[[], object]:
    """RoPE on a fused qkv row block and the write of its keys and values into a bf16 cache."""
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM).bfloat16()
    angles = torch.rand(rows, HEAD_DIM)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    keys, values = torch.zeros(2, KV_HEADS, rows * BLOCK_SIZE, HEAD_DIM).bfloat16()
    slots = torch.arange(rows) * BLOCK_SIZE
    return functools.partial(kernels.ops.rope_write_cache, qkv, cos, sin, keys, values, slots, HEADS, KV_HEADS)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    dense = torch.randn(OUT_FEATURES, IN_FEATURES) * 0.05
    int4, int8 = int4_from_dense(dense), int8_from_dense(dense)
    table: dict[str, dict[str, float]] = {}
    for build in native.builds_for(cpu_features()):
        kernels = native.load_kernels(build)
        if kernels is None:
            continue
        times: dict[str, float] = {}
        for rows in ROWS:
            x16 = torch.randn(rows, IN_FEATURES).bfloat16()
            x32 = torch.randn(rows, IN_FEATURES)
            gemv = Int4Linear.build(int4, None, torch.bfloat16, kernels)
            times[f"int4_gemv bf16 {rows} rows"] = median_us(functools.partial(gemv, x16))
            if kernels.has_int4_dot:
                dot = Int4DotLinear.build(int4, None, kernels)
                times[f"int4_dot bf16 {rows} rows"] = median_us(functools.partial(dot, x16))
            int8_linear = Int8Linear.build(int8, None, torch.float32, kernels)
            times[f"int8_gemv f32 {rows} rows"] = median_us(functools.partial(int8_linear, x32))
            if kernels.has_int8_dot and Int8DotLinear.supports(int8):
                int8_dot = Int8DotLinear.build(int8, None, torch.bfloat16, kernels)
                times[f"int8_dot bf16 {rows} rows"] = median_us(functools.partial(int8_dot, x16))
            gate_up = torch.randn(rows, 2 * OUT_FEATURES)
            times[f"silu_mul f32 {rows} rows"] = median_us(functools.partial(kernels.ops.silu_mul, gate_up))
            gate_up16 = gate_up.bfloat16()
            times[f"silu_mul bf16 {rows} rows"] = median_us(functools.partial(kernels.ops.silu_mul, gate_up16))
            residual, delta = torch.randn(2, rows, IN_FEATURES).bfloat16()
            weight = torch.ones(IN_FEATURES).bfloat16()
            norm = functools.partial(kernels.ops.add_rms_norm, residual, delta, weight, 1e-5)
            times[f"add_rms_norm bf16 {rows} rows"] = median_us(norm)
            times[f"rope_write_cache bf16 {rows} rows"] = median_us(rope_call(kernels, rows))
            logits = torch.randn(rows, VOCAB)
            times[f"argmax_rows f32 {rows} rows"] = median_us(functools.partial(kernels.ops.argmax_rows, logits))
            targets = torch.randint(VOCAB, (rows,))
            scores = functools.partial(kernels.ops.prompt_scores, logits, targets, 5)
            times[f"prompt_scores f32 {rows} rows"] = median_us(scores)
        for rows in ATTENTION_ROWS:
            attention = functools.partial(
                kernels.ops.paged_decode_attention, *attention_case(rows), BLOCK_SIZE, HEAD_DIM**-0.5
            )
            times[f"decode_attention bf16 {rows} rows"] = median_us(attention)
        table[build.name] = times
        print(build.name, "  ".join(f"{name}: {us} us" for name, us in times.items()), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    print(
        write_json(
            args.out / "result.json",
            {
                "cpu": cpu_features().describe(),
                "shape": [OUT_FEATURES, IN_FEATURES],
                "median_us": table,
            },
        )
    )
    return 0
