"""Engine configuration: sizes of the KV cache and of one step's batch."""

from __future__ import annotations

from dataclasses import dataclass

# Steps of more rows than this run the dense copy (engine.model.linear.RowSwitchedLinear). Measured (SmolLM2, int4 +
# bf16, 2 cores, int4 through VNNI dot products): decode steps cost the same at 10-12 rows (int4 24.2 ms against dense
# 32.8 at 8 rows, 37.0 against 36.1 at 12, 44.4 against 39.5 at 16).
DEFAULT_MAX_QUANTIZED_ROWS = 10


@dataclass(frozen=True)
class EngineConfig:
    """Static sizes fixed when the engine starts.

    `max_rows` is the number of sequences the engine holds at once, each in a row of its per-sequence tensors (the
    scheduler's seats take rows: scheduler/config.py `engine_rows`);
    `kv_cache_tokens` is the token budget of the paged KV cache shared by all of them. `max_model_len` caps
    prompt plus output of one sequence (None: the model's own context window).
    """

    max_rows: int = 64
    kv_cache_tokens: int = 32768
    block_size: int = 16
    max_model_len: int | None = None
    device: str = "cpu"
    max_stop_token_ids: int = 16
    max_logit_bias: int = 300  # logit_bias entries per request (OpenAI's limit); sizes a per-row tensor
    enable_prefix_caching: bool = True  # full blocks of computed prompts are kept for sequences with that prefix

    def __post_init__(self) -> None:
        for name in ("max_rows", "kv_cache_tokens", "block_size", "max_stop_token_ids", "max_logit_bias"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_tokens < self.block_size:
            raise ValueError(
                f"kv_cache_tokens ({self.kv_cache_tokens}) must hold at least one block of {self.block_size} tokens"
            )

    @property
    def num_blocks(self) -> int:
        return self.kv_cache_tokens // self.block_size


DTYPES = ("auto", "float32", "bfloat16")
QUANTIZATIONS = ("auto", "none", "int8", "int4")
# Which quantised projections (int4, and an int8 LM head on int8_dot) run steps past the row switch on one int8
# digit per activation and keep no dense copy: none, all but the attention's q/k/v projection (one digit there
# costs four times the MLP's per weight: docs/quantization.md), or all.
INT4_GEMM_SCOPES = ("off", "except-qkv", "all")


def check_int4_gemm_scope(scope: str) -> None:
    """Raises ValueError naming the choices where `scope` is not one of INT4_GEMM_SCOPES."""
    if scope not in INT4_GEMM_SCOPES:
        raise ValueError(f"int4_gemm must be one of {', '.join(INT4_GEMM_SCOPES)}; got {scope!r}")


@dataclass(frozen=True)
class LoadConfig:
    """How the weights are held and computed, named as vLLM's `--dtype` and `--quantization`.

    `dtype` is the activations' and KV cache's type (and dense weights'); `quantization` holds the projection
    weights as weight-only int8 or int4. `auto` resolves at load (engine/weights/weight_format.py) from the file and the
    CPU: `float32`/`none` is exact (greedy parity with transformers' generate())."""

    dtype: str = "float32"
    quantization: str = "none"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {self.quantization!r}")
