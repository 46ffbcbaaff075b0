"""A step's cost projected for a GPU from public specs (`RooflineCostModel`, the simulator's `CostModel` interface):
the larger of the FLOPs over achievable peak compute and the bytes moved (weights once per step, plus each
sequence's KV cache) over achievable memory bandwidth, plus a fixed per-step overhead. Its output is a projection,
never a measurement. The model's shape comes from a transformers config: a built-in one (`BUILTIN_CONFIGS`) or a
directory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.sim.cost.model import StepShape


@dataclass(frozen=True)
class GpuSpec:
    """Public datasheet peaks (dense, no sparsity) and the fraction of each a serving engine achieves."""

    name: str
    peak_flops: float  # FLOP/s at 16-bit precision
    memory_bandwidth: float  # bytes/s
    memory_bytes: float
    flops_efficiency: float = 0.6  # large GEMMs reach about 60-75 % of peak
    bandwidth_efficiency: float = 0.8  # streaming weight reads reach about 80 % of peak bandwidth


GPUS: Mapping[str, GpuSpec] = {
    "h100": GpuSpec("NVIDIA H100 SXM5 80GB", 989e12, 3.35e12, 80e9),
    "a100": GpuSpec("NVIDIA A100 SXM4 80GB", 312e12, 2.039e12, 80e9),
    "l4": GpuSpec("NVIDIA L4 24GB", 121e12, 300e9, 24e9),
    "h200": GpuSpec("NVIDIA H200 SXM 141GB", 989e12, 4.8e12, 141e9),
}


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that set its step cost."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    param_bytes: int = 2  # bytes per weight (bf16/fp16: 2)
    kv_bytes: int = 2  # bytes per cached key or value element
    max_position_embeddings: int = 8192

    @classmethod
    def from_config(cls, config: Any, name: str, param_bytes: int = 2, kv_bytes: int = 2) -> ModelShape:
        """From a transformers `PretrainedConfig` (Llama, Mistral, Qwen2 and alike)."""
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            name=name,
            num_layers=int(config.num_hidden_layers),
            hidden_size=int(config.hidden_size),
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            intermediate_size=int(config.intermediate_size),
            vocab_size=int(config.vocab_size),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            param_bytes=param_bytes,
            kv_bytes=kv_bytes,
            max_position_embeddings=int(getattr(config, "max_position_embeddings", 8192)),
        )

    @property
    def layer_matmul_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        embeddings = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        norms = (2 * self.num_layers + 1) * self.hidden_size
        return self.num_layers * self.layer_matmul_params + self.lm_head_params + embeddings + norms

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.param_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.kv_bytes


@dataclass(frozen=True)
class RooflineCostModel:
    gpu: GpuSpec
    model: ModelShape
    step_overhead_s: float = 1e-3  # launch and scheduling cost of a step that the roofline does not see

    @property
    def label(self) -> str:
        return f"PROJECTION: roofline of {self.model.name} on {self.gpu.name} (not a measurement)"

    def flops(self, shape: StepShape) -> float:
        m = self.model
        matmuls = 2.0 * m.num_layers * m.layer_matmul_params * shape.num_tokens
        lm_head = 2.0 * m.lm_head_params * shape.num_sampled
        attention = 4.0 * m.num_layers * m.num_heads * m.head_dim * shape.attention_pairs  # QK^T and PV
        return matmuls + lm_head + attention

    def bytes_moved(self, shape: StepShape) -> float:
        m = self.model
        weights = (m.num_layers * m.layer_matmul_params + m.lm_head_params) * m.param_bytes
        # Each sequence's cache is read once per step (flash-style attention); new keys and values are written.
        return float(weights + m.kv_bytes_per_token * (shape.kv_tokens + shape.num_tokens))

    def compute_time(self, shape: StepShape) -> float:
        return self.flops(shape) / (self.gpu.peak_flops * self.gpu.flops_efficiency)

    def memory_time(self, shape: StepShape) -> float:
        return self.bytes_moved(shape) / (self.gpu.memory_bandwidth * self.gpu.bandwidth_efficiency)

    def bound(self, shape: StepShape) -> str:
        return "memory" if self.memory_time(shape) >= self.compute_time(shape) else "compute"

    def step_time(self, shape: StepShape, idle_s: float = 0.0) -> float:  # a GPU keeps no such state: idle_s unused
        return self.step_overhead_s + max(self.compute_time(shape), self.memory_time(shape))

    def kv_cache_tokens(self, memory_fraction: float = 0.9) -> int:
        """Tokens of KV cache that fit beside the weights in `memory_fraction` of the GPU's memory."""
        free = self.gpu.memory_bytes * memory_fraction - self.model.weight_bytes
        if free <= 0:
            size = f"{self.model.weight_bytes / 1e9:.1f} GB"
            raise ValueError(f"{self.model.name} ({size}) does not fit on {self.gpu.name}")
        return int(free // self.model.kv_bytes_per_token)


# ----- built-in model configs -----
BUILTIN_CONFIGS: Mapping[str, dict[str, Any]] = {
    "smollm2-135m": {  # the default model's shape
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
    },
    "llama-3.2-1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
    },
    "llama-3.2-3b": {
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
    },
    "llama-3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    },
}


def load_model_shape(name_or_dir: str, param_bytes: int = 2, kv_bytes: int = 2) -> ModelShape:
    """A built-in name (`BUILTIN_CONFIGS`: llama-3-8b, ...) or a directory holding a transformers `config.json`."""
    from transformers import AutoConfig, LlamaConfig  # heavy import, only for GPU projections

    if name_or_dir in BUILTIN_CONFIGS:
        config: Any = LlamaConfig(**BUILTIN_CONFIGS[name_or_dir])
        name = name_or_dir
    else:
        path = Path(name_or_dir)
        if not (path / "config.json").is_file():
            known = ", ".join(BUILTIN_CONFIGS)
            raise ValueError(f"--model-config: {name_or_dir!r} is neither a built-in ({known}) nor a config dir")
        config = AutoConfig.from_pretrained(path)
        name = path.name
    return ModelShape.from_config(config, name, param_bytes, kv_bytes)
