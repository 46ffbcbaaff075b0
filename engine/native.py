"""The engine's C++ CPU kernels (engine/csrc), compiled on first use and cached, with torch fallbacks.

torch's extension builder compiles the source once per machine (about 10 s, needs a C++ compiler) into its
cache (`$TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions); later processes only load the library.
The build targets this CPU's instruction set, so the extension's name carries a hash of the CPU, the source
and the torch version: a cache shared across machines never loads code built for another processor. Where
no compiler is present the build fails with a warning and the engine runs its pure-torch attention, prompt
scoring and element-wise ops (engine/fused.py). All kernels live in one extension, so one build serves all.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = tuple(
    _CSRC / name for name in ("paged_decode_attention.cpp", "prompt_scores.cpp", "fused_ops.cpp", "quant_gemv.cpp")
)
_HEADERS = (_CSRC / "scalar.h",)  # not compiled on their own, but a change must rebuild
_STALE_LOCK_S = 300.0  # a build takes ~10 s; a lock this old was left by a build that was killed

DecodeKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor
]
# (logits [rows, vocab], target [rows], k) -> (logprobs [rows], ranks [rows], top ids [rows, k], top logprobs)
ScoreKernel = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


def _registered() -> DecodeKernel | None:
    try:
        return torch.ops.batchserve.paged_decode_attention  # type: ignore[no-any-return]
    except (AttributeError, RuntimeError):
        return None


def _cpu_signature() -> str:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        flags = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {flags}"


def cpu_has(*flags: str) -> bool:
    """Whether /proc/cpuinfo lists every one of `flags` (e.g. "avx512_vnni"); False where it cannot be read."""
    listed = set(_cpu_signature().split())
    return all(flag in listed for flag in flags)


def _extension_name() -> str:
    texts = (source.read_text() for source in (*_SOURCES, *_HEADERS))
    key = "\n".join([*texts, _cpu_signature(), torch.__version__])
    return f"batchserve_kernels_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def load_decode_kernel() -> DecodeKernel | None:
    """The compiled paged decode attention op, building it if needed; None if it cannot be built here."""
    kernel = _registered()
    if kernel is not None:  # already loaded in this process (the op registry is process-wide)
        return kernel
    return _registered() if _build() else None


def load_score_kernel() -> ScoreKernel | None:
    """The compiled prompt scoring op (engine/prompt_scoring.py), from the same extension; None without it."""
    if load_decode_kernel() is None:
        return None
    try:
        return torch.ops.batchserve.prompt_scores  # type: ignore[no-any-return]
    except (AttributeError, RuntimeError):
        return None


def load_fused_ops() -> bool:
    """Whether the fused element-wise ops (engine/fused.py) are registered, building the extension if needed."""
    return load_decode_kernel() is not None and registered_op("add_rms_norm") is not None


def registered_op(name: str) -> Callable[..., object] | None:
    """`torch.ops.batchserve.<name>` if the extension is loaded in this process (it is never built here)."""
    try:
        return getattr(torch.ops.batchserve, name)  # type: ignore[no-any-return]
    except (AttributeError, RuntimeError):
        return None


def _build() -> bool:
    """Compile (or load the cached build of) the extension, registering its ops; False where it cannot."""
    try:
        from torch.utils import cpp_extension

        name = _extension_name()
        _clear_stale_lock(Path(cpp_extension._get_build_directory(name, verbose=False)) / "lock")
        cpp_extension.load(
            name=name,
            sources=[str(source) for source in _SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except Exception as exc:  # no compiler, no ninja, a read-only cache: all mean "use the torch path"
        logger.warning("native CPU kernels unavailable, using the torch path: %s", exc)
        return False
    return True


def _clear_stale_lock(lock: Path) -> None:
    """torch waits forever on a build lock whose builder was killed; such a lock would hang every start."""
    try:
        if time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            lock.unlink(missing_ok=True)
            logger.warning("removed a stale extension build lock: %s", lock)
    except FileNotFoundError:
        pass
