"""Benchmarks of batchserve against itself and its peers. Importing `engine` first applies BATCHSERVE_CPU_ISA to
torch and oneDNN before any benchmark imports torch (engine/platform/cpu_features.py)."""

import engine  # noqa: F401
