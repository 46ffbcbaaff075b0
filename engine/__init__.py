"""The token-level engine: model runner, paged KV cache, sampler and compiled CPU kernels."""

from engine.platform.cpu_features import apply_cap_to_torch
from engine.platform.native_caches import bound_native_caches

# Before any engine module imports torch: BATCHSERVE_CPU_ISA caps torch and oneDNN too
# (engine/platform/cpu_features.py), and oneDNN's per-shape caches are bounded (engine/platform/native_caches.py);
# both are read when torch loads.
apply_cap_to_torch()
bound_native_caches()
