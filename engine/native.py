"""The engine's C++ CPU kernel (engine/csrc), compiled on first use and cached, with a torch fallback.

torch's extension builder compiles the source once per machine (about 10 s, needs a C++ compiler) into its
cache (`$TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions); later processes only load the library.
The build targets this CPU's instruction set, so the extension's name carries a hash of the CPU, the source
and the torch version: a cache shared across machines never loads code built for another processor. Where
no compiler is present the build fails with a warning and the engine runs its pure-torch attention.
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

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.cpp"
_STALE_LOCK_S = 300.0  # a build takes ~10 s; a lock this old was left by a build that was killed

DecodeKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor
]


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


def _extension_name() -> str:
    key = "\n".join([_SOURCE.read_text(), _cpu_signature(), torch.__version__])
    return f"batchserve_kernels_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def load_decode_kernel() -> DecodeKernel | None:
    """The compiled paged decode attention op, building it if needed; None if it cannot be built here."""
    kernel = _registered()
    if kernel is not None:  # already loaded in this process (the op registry is process-wide)
        return kernel
    try:
        from torch.utils import cpp_extension

        name = _extension_name()
        _clear_stale_lock(Path(cpp_extension._get_build_directory(name, verbose=False)) / "lock")
        cpp_extension.load(
            name=name,
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except Exception as exc:  # no compiler, no ninja, a read-only cache: all mean "use the torch path"
        logger.warning("native attention kernel unavailable, using the torch path: %s", exc)
        return None
    return _registered()


def _clear_stale_lock(lock: Path) -> None:
    """torch waits forever on a build lock whose builder was killed; such a lock would hang every start."""
    try:
        if time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            lock.unlink(missing_ok=True)
            logger.warning("removed a stale extension build lock: %s", lock)
    except FileNotFoundError:
        pass
