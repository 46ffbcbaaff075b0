"""What machine a benchmark ran on, recorded in every result file.

The same command gives different ratios on different CPUs (an AMD EPYC that streams weights from DRAM, an Intel
Xeon whose L3 holds the whole quantised model), so a figure without its machine cannot be compared with another.
"""

from __future__ import annotations

import os
import platform
from datetime import date
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


def machine_label(facts: dict[str, Any] | None = None) -> str:
    """A short name for the machine in result folder names: the CPU family (`xeon`, `epyc`, ...), else the arch."""
    facts = machine_facts() if facts is None else facts
    cpu = str(facts.get("cpu") or "").lower()
    for family in ("xeon", "epyc", "ryzen", "core", "graviton", "neoverse", "apple"):
        if family in cpu:
            return family
    return str(facts.get("arch") or "unknown").lower()


def dated_result_dir(experiment: str, root: Path = Path("benchmarks/results")) -> Path:
    """Where a new run of `experiment` goes by default: `<root>/<experiment>/<YYYY-MM-DD>-<machine>/`."""
    return root / experiment / f"{date.today().isoformat()}-{machine_label()}"
