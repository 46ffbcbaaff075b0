"""Which format each decode-step matmul and the LM head take (int4/bf16, int8 head): docs/quantization.md."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.results_io.report import write_json
from engine.model.linear import AnyLinear, build_linear
from engine.platform.native import load_kernels
from engine.weights.loader import LoadedModel, default_model_path, load_model
from engine.weights.quantization import (
    QuantizedWeight,
    concat_rows,
    int4_from_dense,
    int8_from_dense,
    open_gguf,
    read_gguf_int4,
)

REFERENCE_DIR = Path(__file__).resolve().parents[3] / "shared" / "reference"
_FUSED = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


def _module_path(name: str) -> str:
    return f"self_attn.{name}" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else f"mlp.{name}"


def layer_groups(num_layers: int) -> list[tuple[str, ...]]:
    """The fused groups of module names, in step order, for every layer."""
    return [tuple(f"model.layers.{i}.{_module_path(n)}" for n in group) for i in range(num_layers) for group in _FUSED]


def dense_weights(model: Any) -> dict[str, torch.Tensor]:
    return {name: module.weight.data for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}


def build_format(
    groups: list[tuple[str, ...]],
    dense: dict[str, torch.Tensor],
    quantized: Mapping[str, QuantizedWeight] | None,
    dtype: torch.dtype,
    prepack: bool,
) -> list[AnyLinear]:
    linears: list[AnyLinear] = []
    for group in groups:
        if quantized is not None:
            linears.append(build_linear(concat_rows([quantized[n] for n in group]), None, dtype, prepack))
        else:
            weight = torch.cat([dense[n] for n in group]).to(dtype)
            linears.append(build_linear(weight, None, dtype, prepack))
    return linears


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def step_ms(linears: Sequence[AnyLinear], batch: int, dtype: torch.dtype, repeats: int) -> float:
    inputs = {lin.in_features: torch.randn(batch, lin.in_features).to(dtype) for lin in linears}

    def run() -> None:
        for lin in linears:
            lin(inputs[lin.in_features])

    return 1000 * _median_seconds(run, repeats)


def head_candidates(head: torch.Tensor) -> dict[str, AnyLinear]:
    """name -> the LM head held each way: torch's kernels, and the compiled ones (`int8-gemv`: float FMAs over the
    int8 weights, the head without VNNI; `int8-dot`: integer dot products on two-digit activations, with it)."""
    int8, int4 = int8_from_dense(head), int4_from_dense(head)
    candidates: dict[str, AnyLinear] = {
        "f32-onednn": build_linear(head, None, torch.float32, True),
        "bf16-onednn": build_linear(head.bfloat16(), None, torch.bfloat16, True),
        "bf16-linear": build_linear(head.bfloat16(), None, torch.bfloat16, False),
        "int8-f32": build_linear(int8, None, torch.float32, False),
        "int8-bf16": build_linear(int8, None, torch.bfloat16, False),
        "int4-f32": build_linear(int4, None, torch.float32, False),
        "int4-bf16": build_linear(int4, None, torch.bfloat16, False),
    }
    kernels = load_kernels()
    if kernels is not None:
        candidates["int8-gemv-bf16"] = build_linear(int8, None, torch.bfloat16, False, kernels, int8_activations=False)
        if kernels.has_int8_dot:
            candidates["int8-dot-bf16"] = build_linear(int8, None, torch.bfloat16, False, kernels, True)
    return candidates


def activation_dtype(name: str) -> torch.dtype:
    return torch.float32 if "f32" in name else torch.bfloat16


@torch.inference_mode()
def reference_hidden(loaded: LoadedModel, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Final-normed hidden states over the reference texts and the next tokens they predict."""
    hidden, targets = [], []
    for text_path in sorted(REFERENCE_DIR.glob("*.txt")):
        ids = loaded.tokenizer(text_path.read_text(), return_tensors="pt").input_ids[:, :max_tokens]
        out = loaded.model.model(ids)
        hidden.append(out.last_hidden_state[0, :-1])
        targets.append(ids[0, 1:])
    return torch.cat(hidden), torch.cat(targets)


@torch.inference_mode()
def head_quality(
    head: AnyLinear, dtype: torch.dtype, dense: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor
) -> dict[str, float]:
    reference = F.linear(hidden, dense)
    logits = head(hidden.to(dtype)).float()
    nll = F.cross_entropy(logits, targets).item()
    nll_ref = F.cross_entropy(reference, targets).item()
    return {
        "max_logit_error": (logits - reference).abs().max().item(),
        "top1_agreement": (logits.argmax(-1) == reference.argmax(-1)).float().mean().item(),
        "perplexity_change": float(torch.tensor(nll - nll_ref).exp().item() - 1),
    }


def run(
    batch_sizes: Sequence[int], repeats: int, quality_tokens: int, layers: int, only: Sequence[str]
) -> dict[str, Any]:
    """`layers`: time this many layers, scaled to the model's (a quicker run); `only`: these formats (all if empty)."""
    loaded = load_model()
    model: Any = loaded.model
    config = model.config
    dense = dense_weights(model)
    gguf = read_gguf_int4(open_gguf(default_model_path()), config.num_attention_heads, config.num_key_value_heads)
    num_layers = len(model.model.layers)
    timed_layers = min(layers or num_layers, num_layers)
    groups = layer_groups(timed_layers)
    int8 = {name: int8_from_dense(dense[name]) for group in groups for name in group}
    builders: dict[str, Callable[[], tuple[list[AnyLinear], torch.dtype]]] = {
        "f32-linear": lambda: (build_format(groups, dense, None, torch.float32, False), torch.float32),
        "f32-onednn": lambda: (build_format(groups, dense, None, torch.float32, True), torch.float32),
        "bf16-linear": lambda: (build_format(groups, dense, None, torch.bfloat16, False), torch.bfloat16),
        "bf16-onednn": lambda: (build_format(groups, dense, None, torch.bfloat16, True), torch.bfloat16),
        "int8-f32": lambda: (build_format(groups, dense, int8, torch.float32, False), torch.float32),
        "int8-bf16": lambda: (build_format(groups, dense, int8, torch.bfloat16, False), torch.bfloat16),
        "int4-f32": lambda: (build_format(groups, dense, gguf, torch.float32, False), torch.float32),
        "int4-bf16": lambda: (build_format(groups, dense, gguf, torch.bfloat16, False), torch.bfloat16),
    }
    result: dict[str, Any] = {"threads": torch.get_num_threads(), "layers_ms": {}, "head_ms": {}, "head_quality": {}}
    scale = num_layers / timed_layers
    print(
        f"threads {torch.get_num_threads()}; {num_layers} layers' projections (timed on {timed_layers}), ms per step:",
        flush=True,
    )
    for name, build in builders.items():
        if only and name not in only:
            continue
        linears, dtype = build()
        times = {batch: scale * step_ms(linears, batch, dtype, repeats) for batch in batch_sizes}
        result["layers_ms"][name] = times
        print(f"  {name:>12}: " + "  ".join(f"b{b} {t:7.2f}" for b, t in times.items()), flush=True)
    dense_head = dense["lm_head"]
    hidden, targets = reference_hidden(loaded, quality_tokens)
    print(f"LM head ({tuple(dense_head.shape)}), ms per step, and quality over {len(targets)} positions:")
    for name, head in head_candidates(dense_head).items():
        if only and name not in only:
            continue
        dtype = activation_dtype(name)
        times = {batch: step_ms([head], batch, dtype, repeats) for batch in batch_sizes}
        quality = head_quality(head, dtype, dense_head, hidden, targets)
        result["head_ms"][name] = times
        result["head_quality"][name] = quality
        print(
            f"  {name:>12}: "
            + "  ".join(f"b{b} {t:7.2f}" for b, t in times.items())
            + f" | max logit err {quality['max_logit_error']:.3f}, top-1 {quality['top1_agreement']:.4f}, "
            f"ppl {quality['perplexity_change']:+.4%}",
            flush=True,
        )
    return result


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-sizes", default="1,32,256")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quality-tokens", type=int, default=1024, help="tokens of each reference text scored")
    parser.add_argument("--layers", type=int, default=0, help="time only this many layers, scaled (0: all)")
    parser.add_argument("--formats", default="", help="comma-separated formats to run (default: all)")
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    only = [name for name in args.formats.split(",") if name]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    result = run(batch_sizes, args.repeats, args.quality_tokens, args.layers, only)
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
