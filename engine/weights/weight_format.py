"""Resolve `--dtype` and `--quantization` (`auto` included) into what the loader and runner use.

`auto` follows measurements on the default model (docs/quantization.md):
- quantization: int4 for a GGUF of a 4-bit type (Q4_0, Q4_1, Q4_K_M, Q4_K_S: its own blocks), none for a
  Hugging Face checkpoint, whose weights we would otherwise have to requantise;
- dtype: bfloat16 activations and KV cache where the CPU has native bf16 dot products (AVX512-BF16 or AMX),
  float32 otherwise. torch's int4 and int8 kernels are fast only with bf16 activations (with float32 ones, exact
  to the file's scales, they ran 20-50x slower at batch 32); a dense Hugging Face checkpoint stored in float32
  stays float32, since its quality in bf16 is not measured at load (SmolLM2's: +0.05% perplexity).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import LoadConfig
from engine.platform.cpu_features import cpu_features

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class WeightFormat:
    dtype: torch.dtype  # activations, KV cache and dense weights
    quantization: str  # "none", "int8" or "int4": the projections' (and LM head's) storage

    @property
    def label(self) -> str:
        dtype = "bfloat16" if self.dtype == torch.bfloat16 else "float32"
        return dtype if self.quantization == "none" else f"{self.quantization}/{dtype}"


EXACT = WeightFormat(torch.float32, "none")  # what generate() on the float32 model computes


def cpu_has_native_bf16() -> bool:
    """bf16 dot products in hardware (under BATCHSERVE_CPU_ISA); elsewhere bf16 is emulated, slower than float32."""
    return cpu_features().native_bf16


def resolve(
    config: LoadConfig, device: torch.device, gguf_has_int4: bool, checkpoint_dtype: torch.dtype | None
) -> WeightFormat:
    """`gguf_has_int4`: the file is a GGUF that loads as int4 (kquants.loads_as_int4); `checkpoint_dtype`: an HF
    checkpoint's stored dtype (None for a GGUF)."""
    quantization = config.quantization
    if quantization == "auto":
        quantization = "int4" if gguf_has_int4 and device.type == "cpu" else "none"
    if quantization != "none" and device.type != "cpu":
        raise ValueError(
            f"quantization {quantization!r} runs on torch's CPU kernels only; use --quantization none on {device}"
        )
    if config.dtype != "auto":
        dtype = _DTYPES[config.dtype]
    elif device.type != "cpu":
        dtype = torch.bfloat16 if checkpoint_dtype == torch.bfloat16 else torch.float32
    elif cpu_has_native_bf16() and (quantization != "none" or checkpoint_dtype in (None, torch.bfloat16)):
        dtype = torch.bfloat16
    else:
        dtype = torch.float32
    return WeightFormat(dtype, quantization)
