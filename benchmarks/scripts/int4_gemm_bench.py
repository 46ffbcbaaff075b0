"""The prefill matmul on int4 weights: int4_gemm (one int8 digit per activation) against today's paths (int4_dot's
two digits; the dense bfloat16 and float32 copies through oneDNN), interleaved round by round, and its error.

Times: each path's median and best (min) over `--rounds` rounds of `--inner` calls, the paths taken in turn within
a round, so a loaded machine slows all of them alike; report ratios, not absolute times (under heavy load the best
is the steadier). Error: relative Frobenius error against the float32 matmul of the same (dequantised) weights, on
the default model's real layer weights and their real inputs on a reference text.

    python -m benchmarks.scripts.int4_gemm_bench [--rows 128,512,1024] [--shapes 576x1536,2048x8192] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.results_io.report import write_json
from benchmarks.scripts.quant_bench import REFERENCE_DIR
from engine.model.linear import Int4DotLinear, Linear
from engine.platform.native import load_kernels
from engine.weights.quantization import Int4Weight

Path_ = Callable[[torch.Tensor], torch.Tensor]


def random_int4(out: int, inputs: int, group: int = 32, generator: torch.Generator | None = None) -> Int4Weight:
    values = torch.randint(0, 16, (out, inputs), dtype=torch.uint8, generator=generator)
    scales = torch.rand(out, inputs // group, generator=generator) * 0.02 + 0.001
    zeros = torch.randn(out, inputs // group, generator=generator) * 0.01
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
def timings(shapes: list[tuple[int, int]], rows: list[int], rounds: int, inner: int) -> list[dict]:
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
                    for _ in range(inner):
                        fn(x)
                    samples[name].append((time.perf_counter() - start) / inner)
            ms = {name: 1000 * statistics.median(s) for name, s in samples.items()}
            best = {name: 1000 * min(s) for name, s in samples.items()}
            ratios = {f"{name}/int4_gemm": ms[name] / ms["int4_gemm"] for name in ms if name != "int4_gemm"}
            best_ratios = {f"{name}/int4_gemm": best[name] / best["int4_gemm"] for name in ms if name != "int4_gemm"}
            row = {"K": inputs, "N": out, "rows": n, "median_ms": ms, "ratios": ratios, "best_ratios": best_ratios}
            results.append(row)
            print(json.dumps(results[-1]), flush=True)
    return results


@torch.inference_mode()
def errors(layers: int, rows: int) -> dict[str, dict[str, float]]:
    """Each int4 projection of the first `layers` layers on its real input: the float32 model run over a reference
    text (forward hooks), the first `rows` tokens."""
    from engine.weights.loader import load_model

    loaded = load_model(None, dtype="float32", quantization="int4", quiet=True)
    texts = sorted(REFERENCE_DIR.glob("*.txt"))
    ids = loaded.tokenizer(texts[0].read_text() if texts else "The quick brown fox. " * 200)["input_ids"][:rows]
    inputs: dict[str, torch.Tensor] = {}
    hooks = [
        module.register_forward_hook(lambda _m, args, _out, name=name: inputs.__setitem__(name, args[0][0]))
        for name, module in loaded.model.named_modules()
        if isinstance(module, torch.nn.Linear) and any(f"layers.{i}." in name for i in range(layers))
    ]
    loaded.model(torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    kernels = load_kernels()
    assert kernels is not None
    found: dict[str, list[float]] = {"int4_gemm": [], "int4_dot": [], "int4_gemm_vs_int4_dot": []}
    for name, x in inputs.items():
        weight = loaded.quantized.get(name)
        if not isinstance(weight, Int4Weight) or not Int4DotLinear.supports(weight, torch.float32):
            continue
        dot = Int4DotLinear.build(weight, None, kernels)
        reference = x @ weight.dequantize(torch.float32).float().t()
        one, two = dot.gemm(x), dot(x)
        for path, y, against in (
            ("int4_gemm", one, reference),
            ("int4_dot", two, reference),
            ("int4_gemm_vs_int4_dot", one, two),
        ):
            found[path].append(float((y - against).norm() / against.norm()))
    return {path: {"mean": statistics.mean(v), "max": max(v), "weights": len(v)} for path, v in found.items()}


@torch.inference_mode()
def greedy(prompts: int, prompt_tokens: int, max_tokens: int) -> dict[str, object]:
    """Greedy tokens of the default model in int4/bfloat16 with its prompts prefilled through the dense bfloat16
    copy (today) and through int4_gemm; decode steps run int4_dot in both. Where the first token differs, per
    prompt (None: all `max_tokens` agree)."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.model.model_runner import TransformersRunner
    from engine.sample.sampling_params import SamplingParams
    from engine.weights.loader import load_model

    loaded = load_model(None, dtype="bfloat16", quantization="int4", quiet=True)
    ids = [loaded.tokenizer(p.read_text())["input_ids"] for p in sorted(REFERENCE_DIR.glob("*.txt"))]
    stream = [t for text in ids for t in text]
    chunks = [stream[i * prompt_tokens : (i + 1) * prompt_tokens] for i in range(prompts)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs: dict[str, list[list[int]]] = {}
    for label, gemm_rows in (("dense_bf16", None), ("int4_gemm", 16)):
        runner = TransformersRunner(loaded.model, quantized=loaded.quantized, min_gemm_rows=gemm_rows)
        cache = 2 * (prompt_tokens + max_tokens + 32)
        config = EngineConfig(max_rows=2, kv_cache_tokens=cache, block_size=16, enable_prefix_caching=False)
        engine = Engine(runner, config, dtype=torch.bfloat16)
        outputs[label] = []
        for seq, prompt in enumerate(chunks):
            engine.add(seq, prompt, params)
            engine.reserve(seq, len(prompt) + max_tokens)
            tokens = [t.token_id for t in engine.step([(seq, len(prompt))]).tokens]
            while len(tokens) < max_tokens:
                tokens += [t.token_id for t in engine.step([(seq, 1)]).tokens]
            engine.remove(seq)
            outputs[label].append(tokens)
    first = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
        for x, y in zip(outputs["dense_bf16"], outputs["int4_gemm"], strict=True)
    ]
    return {"prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "first_difference": first}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="128,512,1024")
    parser.add_argument("--shapes", default="576x1536,2048x8192", help="KxN: inputs x outputs")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--inner", type=int, default=1, help="calls per timed sample")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--error-layers", type=int, default=4, help="0: no error measurement")
    parser.add_argument("--greedy", type=int, default=0, help="prompts for the greedy agreement check (0: none)")
    parser.add_argument("--timings", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", type=Path, help="result.json to write (with the machine that measured it)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = [(int(k), int(n)) for k, n in (s.split("x") for s in args.shapes.split(","))]
    document: dict[str, object] = {"command": " ".join(sys.argv[1:])}
    if args.error_layers:
        document["relative_error_vs_float32"] = errors(args.error_layers, 256)
        print(json.dumps({"relative_error_vs_float32": document["relative_error_vs_float32"]}), flush=True)
    if args.greedy:
        document["greedy"] = greedy(args.greedy, 256, 32)
        print(json.dumps({"greedy": document["greedy"]}), flush=True)
    if args.timings:
        document["timings"] = timings(shapes, [int(r) for r in args.rows.split(",")], args.rounds, args.inner)
    if args.out:
        write_json(args.out, document)


if __name__ == "__main__":
    main()
