"""The token-level engine: model runner, paged KV cache, sampler and compiled CPU kernels."""

from engine.cpu_features import apply_cap_to_torch

# Before any engine module imports torch: BATCHSERVE_CPU_ISA caps torch and oneDNN too (engine/cpu_features.py).
apply_cap_to_torch()
