"""The model flags the in-process benchmarks share (`--model`, `--dtype`, `--quantization`), and the load they ask
for."""

from __future__ import annotations

import argparse

from engine.config import DTYPES, QUANTIZATIONS
from engine.weights.loader import LoadedModel, load_model


def add_model_arguments(parser: argparse.ArgumentParser, dtype: str = "auto", quantization: str = "auto") -> None:
    parser.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default=dtype, choices=DTYPES, help="as `serve --dtype`")
    parser.add_argument("--quantization", default=quantization, choices=QUANTIZATIONS, help="as `serve --quantization`")


def load_from_args(args: argparse.Namespace) -> LoadedModel:
    return load_model(args.model, dtype=args.dtype, quantization=args.quantization)
