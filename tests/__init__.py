"""The test suite. Importing `engine` first applies BATCHSERVE_CPU_ISA to torch and oneDNN before anything imports
torch (engine/platform/cpu_features.py), so `BATCHSERVE_CPU_ISA=avx2 python -m pytest` runs an AVX2 machine's code
paths."""

import engine  # noqa: F401
