"""The token-level engine: sequences in, one forward per step over a ragged batch, sampled tokens out.

`engine.py` is the engine; beside it its config, errors, outputs and per-row tensors. The rest is by job: `model/`
(the runner and its layers), `sample/` (sampling), `spec/` (speculative decoding), `kv/` (the paged cache and its
blocks), `weights/` (loading and weight formats), `platform/` (the CPU, the compiled kernels' builds in `csrc/`,
process setup). Nothing is re-exported here: importing `engine` must stay cheap and run before torch loads."""

from engine.platform.cpu_features import apply_cap_to_torch
from engine.platform.native_caches import bound_native_caches

# Before any engine module imports torch: BATCHSERVE_CPU_ISA caps torch and oneDNN too
# (engine/platform/cpu_features.py), and oneDNN's per-shape caches are bounded (engine/platform/native_caches.py);
# both are read when torch loads.
apply_cap_to_torch()
bound_native_caches()
