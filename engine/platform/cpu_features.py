"""What this CPU can execute, read once from /proc/cpuinfo and capped by `BATCHSERVE_CPU_ISA`.

Every choice the engine makes about the CPU goes through `cpu_features()`: which build of the compiled kernels
runs (engine/platform/native.py), which weight formats `auto` may pick and which are refused
(engine/weights/weight_format.py), whether oneDNN may prepack bf16 weights (engine/model/linear.py).

The cap names one of `ISA_LEVELS`; a level holds the CPU flags of every level below it. With the cap set, torch
and oneDNN are capped the same way (`ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA`), which only works before torch
is imported: `engine/__init__.py` calls `apply_cap_to_torch()` first thing, so `BATCHSERVE_CPU_ISA=avx2` on an
AVX-512 machine runs the code paths of an AVX2-only one, in batchserve, torch and oneDNN alike.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

CAP_VARIABLE = "BATCHSERVE_CPU_ISA"

# Lowest first. Each level names the /proc/cpuinfo flags it adds to the one below it.
ISA_LEVELS: dict[str, frozenset[str]] = {
    "scalar": frozenset(),
    "avx2": frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"}),  # GCC's x86-64-v3
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}),
    "avx512_vnni": frozenset({"avx512_vnni"}),
    "avx512_bf16": frozenset({"avx512_bf16"}),
}
# Flags a level does not require but allows when the CPU has them (AMX comes with the bf16 class of CPUs;
# AVX-VNNI, the 256-bit VNNI, with AVX2-class Intel cores from Alder Lake on).
_EXTRAS: dict[str, frozenset[str]] = {
    "avx2": frozenset({"avx_vnni"}),
    "avx512_bf16": frozenset({"amx_tile", "amx_bf16", "amx_int8"}),
}
# The same cap in torch's and oneDNN's words (torch: aten/src/ATen/native/DispatchStub.cpp; oneDNN: its
# ONEDNN_MAX_CPU_ISA values).
_TORCH_CAPABILITY = {
    "scalar": "default",
    "avx2": "avx2",
    "avx512": "avx512",
    "avx512_vnni": "avx512",
    "avx512_bf16": "avx512",
}
_ONEDNN_ISA = {
    "scalar": "SSE41",
    "avx2": "AVX2",
    "avx512": "AVX512_CORE",
    "avx512_vnni": "AVX512_CORE_VNNI",
    "avx512_bf16": "AVX512_CORE_AMX",
}


class CpuIsaError(ValueError):
    """`BATCHSERVE_CPU_ISA` names no level, or one above what this CPU has."""


@dataclass(frozen=True)
class CpuFeatures:
    """The CPU flags the engine may use: the hardware's, less those above the cap."""

    machine: str  # platform.machine(): "x86_64", "aarch64", ...
    hardware_flags: frozenset[str]  # every flag /proc/cpuinfo lists
    level: str  # the highest of ISA_LEVELS that is both present and allowed
    capped: bool  # whether BATCHSERVE_CPU_ISA set the level below the hardware's

    @property
    def is_x86(self) -> bool:
        return self.machine.lower() in ("x86_64", "amd64")

    @property
    def flags(self) -> frozenset[str]:
        """The flags the engine may use: those of every level up to `level`, and their allowed extras (a capped
        level's own extras excepted)."""
        allowed: set[str] = set()
        for name, added in ISA_LEVELS.items():
            allowed |= added
            # A cap stands for its class proper: capped to AVX2, an AVX-512 machine is an AVX2-only one (Zen 3),
            # without the AVX-VNNI that AVX2's newer cores add.
            if not (self.capped and name == self.level):
                allowed |= _EXTRAS.get(name, frozenset())
            if name == self.level:
                break
        beyond = set().union(*ISA_LEVELS.values(), *_EXTRAS.values())
        # Flags no level speaks of (sse4_2, popcnt, ...) stay as the hardware has them.
        return frozenset(flag for flag in self.hardware_flags if flag in allowed or flag not in beyond)

    def has(self, *flags: str) -> bool:
        return all(flag in self.flags for flag in flags)

    def at_least(self, level: str) -> bool:
        return _rank(self.level) >= _rank(level)

    @property
    def native_bf16(self) -> bool:
        """bf16 dot products in hardware (AVX512-BF16 or AMX); elsewhere bf16 is emulated and slower than float32."""
        return self.has("avx512_bf16") or self.has("amx_bf16")

    @property
    def onednn_bf16(self) -> bool:
        """oneDNN's bf16 kernels (weight reorder included) need AVX-512 BW/VL/DQ or AVX-NE-CONVERT; without them
        torch's `mkldnn._reorder_linear_weight` raises on bf16."""
        return self.has("avx512bw", "avx512vl", "avx512dq") or self.has("avx_ne_convert")

    def describe(self) -> str:
        cap = f" (capped by {CAP_VARIABLE})" if self.capped else ""
        return f"{self.machine} {self.level}{cap}"


def _rank(level: str) -> int:
    return list(ISA_LEVELS).index(level)


def hardware_level(flags: frozenset[str]) -> str:
    """The highest level whose flags, and every lower level's, are all in `flags`."""
    reached = "scalar"
    required: set[str] = set()
    for name, added in ISA_LEVELS.items():
        required |= added
        if not required <= flags:
            break
        reached = name
    return reached


def parse_cap(value: str | None) -> str | None:
    """The level named by a BATCHSERVE_CPU_ISA value; None when unset or empty."""
    if value is None or not value.strip():
        return None
    level = value.strip().lower()
    if level not in ISA_LEVELS:
        levels = ", ".join(ISA_LEVELS)
        raise CpuIsaError(f"{CAP_VARIABLE}={value!r} names no instruction set level; use one of {levels}")
    return level


def read_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    # x86 says "flags", ARM "Features"; the first processor speaks for all.
    line = next((line for line in text.splitlines() if line.split(":")[0].strip() in ("flags", "Features")), "")
    return frozenset(line.partition(":")[2].split())


def features_for(machine: str, hardware_flags: frozenset[str], cap: str | None) -> CpuFeatures:
    """The features a CPU with `hardware_flags` offers under `cap` (a cap above the hardware is refused)."""
    hardware = hardware_level(hardware_flags) if machine.lower() in ("x86_64", "amd64") else "scalar"
    if cap is None:
        return CpuFeatures(machine, hardware_flags, hardware, capped=False)
    if _rank(cap) > _rank(hardware):
        raise CpuIsaError(f"{CAP_VARIABLE}={cap} asks for more than this CPU has (its level is {hardware})")
    return CpuFeatures(machine, hardware_flags, cap, capped=_rank(cap) < _rank(hardware))


@functools.cache
def cpu_features() -> CpuFeatures:
    """This process's CPU features, read once (the environment variable is read at the first call)."""
    return features_for(platform.machine(), read_flags(), parse_cap(os.environ.get(CAP_VARIABLE)))


def torch_environment(features: CpuFeatures) -> dict[str, str]:
    """The variables that cap torch and oneDNN at `features.level` (none when uncapped or not on x86)."""
    if not (features.capped and features.is_x86):
        return {}
    return {"ATEN_CPU_CAPABILITY": _TORCH_CAPABILITY[features.level], "ONEDNN_MAX_CPU_ISA": _ONEDNN_ISA[features.level]}


def torch_capability(level: str) -> str:
    """The name torch.backends.cpu.get_cpu_capability() gives for the kernels torch runs at ISA `level`."""
    return {"default": "DEFAULT", "avx2": "AVX2", "avx512": "AVX512"}[_TORCH_CAPABILITY[level]]


def apply_cap_to_torch() -> None:
    """Cap torch and oneDNN as BATCHSERVE_CPU_ISA caps the engine. Variables already set are kept; torch reads
    them when it loads, so this must run before `import torch` (a late call only warns)."""
    try:
        features = cpu_features()
    except CpuIsaError:
        return  # reported where the engine first needs the features (load time), as a one-line error
    wanted = torch_environment(features)
    for name, value in wanted.items():
        os.environ.setdefault(name, value)
    if wanted and "torch" in sys.modules:
        logger.warning("%s is applied after torch was imported: torch's own kernels may not be capped", CAP_VARIABLE)
