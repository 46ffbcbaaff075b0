"""Write a checkpoint of a known shape with random weights, for timing an engine where the real weights can't go.

Step cost depends on a model's shape and weight format, not on its weights' values, so a randomly initialised
model of the same shape measures the same step times (`benchmarks.sim.profiling.steps`) and serves the same scheduling
experiments (`benchmarks.online.ab` with `ignore_eos`). Its answers are noise. The GPU check uses it because the
machine lent for it takes only a small working tree.

    python -m benchmarks random-checkpoint --config smollm2-135m --tokenizer DIR --dtype bfloat16 --out DIR
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

from benchmarks.sim.cost.roofline import BUILTIN_CONFIGS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def write_random_checkpoint(config_name: str, tokenizer_dir: Path, dtype: torch.dtype, out: Path, seed: int) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    eos = tokenizer.eos_token_id
    config = LlamaConfig(**BUILTIN_CONFIGS[config_name], eos_token_id=eos, bos_token_id=tokenizer.bos_token_id)
    if tokenizer.vocab_size > config.vocab_size:
        raise SystemExit(f"the tokenizer's {tokenizer.vocab_size} tokens exceed {config_name}'s vocabulary")
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # initialising a billion weights on a CPU is slow
    with torch.device(device):
        model = LlamaForCausalLM(config).eval()
    model = model.to(dtype=dtype)  # type: ignore[arg-type]  # transformers wraps `to` loosely
    model.generation_config = GenerationConfig(eos_token_id=eos, bos_token_id=tokenizer.bos_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {config_name}, {params / 1e6:.0f}M random parameters in {dtype}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks random-checkpoint",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", choices=sorted(BUILTIN_CONFIGS), required=True)
    parser.add_argument("--tokenizer", type=Path, required=True, help="a directory holding a tokenizer to reuse")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    write_random_checkpoint(args.config, args.tokenizer, DTYPES[args.dtype], args.out, args.seed)
