"""The machine under the engine: what the CPU can run, the compiled kernels' builds, and process setup (the caps and
cache bounds set before torch loads, the thread torch's work runs on). Nothing here imports torch at import time."""
