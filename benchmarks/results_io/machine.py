"""What machine a benchmark ran on, recorded in every result file.

The same command gives different ratios on different CPUs (an AMD EPYC that streams weights from DRAM, an Intel
Xeon whose L3 holds the whole quantised model), so a figure without its machine cannot be compared with another.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

# The instruction-set extensions the engine's kernels choose between.
KERNEL_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def _cpuinfo_field(text: str, name: str) -> str | None:
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return None


def machine_facts(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """CPU model, cores, cache and kernel-relevant flags; fields the OS does not expose are None."""
    text = cpuinfo.read_text() if cpuinfo.exists() else ""
    flags = set((_cpuinfo_field(text, "flags") or "").split())
    return {
        "cpu": _cpuinfo_field(text, "model name") or platform.processor() or None,
        "cache": _cpuinfo_field(text, "cache size"),
        "cores": os.cpu_count(),
        "arch": platform.machine(),
        "kernel_flags": [flag for flag in KERNEL_FLAGS if flag in flags],
    }
