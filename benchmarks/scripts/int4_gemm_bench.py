"""The prefill matmul on int4 weights: int4_gemm (one int8 digit per activation) against today's paths (int4_dot's
two digits; the dense bfloat16 and float32 copies through oneDNN), interleaved round by round, and its error.

Times: each path's median over `--rounds` rounds, the paths taken in turn within a round, so a loaded machine
slows all of them alike; report ratios, not absolute times. Error: relative Frobenius error against the float32
matmul of the same (dequantised) weights, on the default model's real layer weights and activations of its
embedding table (rows of real tokens, RMS-normalised as a layer's input is).

    python benchmarks/scripts/int4_gemm_bench.py [--rows 128,512,1024] [--shapes 576x1536,2048x8192] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from engine.model.linear import Int4DotLinear, Linear
from engine.platform.native import load_kernels
from engine.weights.quantization import Int4Weight

Path_ = Callable[[torch.Tensor], torch.Tensor]


def random_int4(out: int, inputs: int, group: int = 32) -> Int4Weight:
    values = torch.randint(0, 16, (out, inputs), dtype=torch.uint8)
    scales = torch.rand(out, inputs // group) * 0.02 + 0.001
    zeros = torch.randn(out, inputs // group) * 0.01
    return Int4Weight(values, scales, zeros, group)


def paths(weight: Int4Weight) -> dict[str, Path_]:
    kernels = load_kernels()
    assert kernels is not None and kernels.has_int4_dot, "needs a build with int4_dot (AVX2, or AVX-512 VNNI)"
    dot = Int4DotLinear.build(weight, None, kernels)
    bf16 = Linear.build(weight.dequantize(torch.bfloat16).bfloat16(), None, prepack=True)
    f32 = Linear.build(weight.dequantize(torch.float32).float(), None, prepack=True)
    return {
        "int4_gemm": lambda x: kernels.ops.int4_gemm(x, dot.packed, dot.group_size, dot.scales, dot.zeros),
        "int4_dot": lambda x: kernels.ops.int4_dot(x, dot.packed, dot.group_size, dot.scales, dot.zeros),
        "dense_bf16": lambda x: bf16(x.bfloat16()),
        "dense_f32": f32,
    }


@torch.inference_mode()
def timings(shapes: list[tuple[int, int]], rows: list[int], rounds: int) -> list[dict]:
    results = []
    for inputs, out in shapes:
        fns = paths(random_int4(out, inputs))
        for n in rows:
            x = torch.randn(n, inputs)
            samples: dict[str, list[float]] = {name: [] for name in fns}
            for fn in fns.values():
                fn(x)  # warm-up
            for _ in range(rounds):
                for name, fn in fns.items():
                    start = time.perf_counter()
                    fn(x)
                    samples[name].append(time.perf_counter() - start)
            ms = {name: 1000 * statistics.median(s) for name, s in samples.items()}
            ratios = {f"{name}/int4_gemm": ms[name] / ms["int4_gemm"] for name in ms if name != "int4_gemm"}
            results.append({"K": inputs, "N": out, "rows": n, "ms": ms, "ratios": ratios})
            print(json.dumps(results[-1]), flush=True)
    return results


@torch.inference_mode()
def errors(layers: int, rows: int) -> dict[str, dict[str, float]]:
    from engine.weights.loader import load_model

    loaded = load_model(None, dtype="float32", quantization="int4", quiet=True)
    embed = loaded.model.model.embed_tokens.weight
    x = embed[torch.randint(0, embed.shape[0], (rows,))]
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    kernels = load_kernels()
    assert kernels is not None
    found: dict[str, list[float]] = {"int4_gemm": [], "int4_dot": []}
    for name, weight in loaded.quantized.items():
        if not isinstance(weight, Int4Weight) or int(weight.values.shape[1]) != x.shape[1]:
            continue
        if not any(f"layers.{i}." in name for i in range(layers)):
            continue
        dot = Int4DotLinear.build(weight, None, kernels)
        reference = x @ weight.dequantize(torch.float32).float().t()
        args = (dot.packed, dot.group_size, dot.scales, dot.zeros)
        for path, op in (("int4_gemm", kernels.ops.int4_gemm), ("int4_dot", kernels.ops.int4_dot)):
            y = op(x, *args)
            found[path].append(float((y - reference).norm() / reference.norm()))
    return {path: {"mean": statistics.mean(v), "max": max(v), "weights": len(v)} for path, v in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="128,512,1024")
    parser.add_argument("--shapes", default="576x1536,2048x8192", help="KxN: inputs x outputs")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--error-layers", type=int, default=4, help="0: no error measurement")
    args = parser.parse_args()
    shapes = [(int(k), int(n)) for k, n in (s.split("x") for s in args.shapes.split(","))]
    if args.error_layers:
        print(json.dumps({"relative_error_vs_float32": errors(args.error_layers, 256)}), flush=True)
    timings(shapes, [int(r) for r in args.rows.split(",")], args.rounds)


if __name__ == "__main__":
    main()
