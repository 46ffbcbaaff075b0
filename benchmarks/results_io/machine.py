"""What machine and code a benchmark ran on, recorded in every result file.

The same command gives different ratios on different CPUs (an AMD EPYC that streams weights from DRAM, an Intel
Xeon whose L3 holds the whole quantised model), so a figure without its machine cannot be compared with another;
nor one without its commit, its instruction-set cap (an AVX2-capped run on an AVX-512 machine) or its threads, as
llama-bench's JSON carries `build_commit` and `cpu_info`.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
from datetime import date
from pathlib import Path
from typing import Any

# The instruction-set extensions the engine's kernels choose between.
KERNEL_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
# The variables that cap the instruction sets batchserve's kernels, torch's ATen and oneDNN may use.
CPU_CAP_VARIABLES = ("BATCHSERVE_CPU_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
_REPO = Path(__file__).resolve().parents[2]


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
        "cpu_cap": {name: os.environ[name] for name in CPU_CAP_VARIABLES if os.environ.get(name)},
        "threads": _threads(),
        "torch": _version("torch"),
        **code_facts(),
    }


def code_facts(repo: Path = _REPO) -> dict[str, Any]:
    """The commit the run measured and whether the tree had changes to tracked files; None outside a git checkout."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=10, check=True)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip()

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def _threads() -> int | None:
    """torch's intra-op threads where this process has torch loaded (the simulator does not), else OMP_NUM_THREADS."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return int(torch.get_num_threads())
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() else None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


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
