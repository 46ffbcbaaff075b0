"""The engine's C++ CPU kernels (engine/csrc), one build per instruction set, chosen at run time.

The same sources compile once per instruction-set level into their own extension, each registering its ops under
its own namespace (`torch.ops.batchserve_avx2.int4_gemv`, ...): AVX-512 with VNNI and BF16, AVX-512 with VNNI,
AVX-512, AVX2 + FMA, and a scalar (SSE2) build that runs anywhere. The engine loads the best build that
`cpu_features()` allows (so `BATCHSERVE_CPU_ISA=avx2` runs the AVX2 build on any machine), and tests load every
build the machine can execute and compare each with torch. Separate builds rather than one library of
target-attributed functions: every build is then a whole program for one instruction set, and code the CPU
cannot execute is never loaded.

torch's extension builder compiles a build once (a minute or so on 2 cores, needs a C++ compiler and ninja) into
its cache (`$TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions); later processes only load it, in any
virtualenv with the same torch. A first start logs the build as a phase (engine/phases.py), with progress lines
while it compiles. The extension's name carries a hash of the sources, the flags and the torch version, and it
compiles copies of the sources kept in its own directory, so every checkout of the same sources shares the build.
Where no compiler is present the build fails with a warning and the engine runs its pure-torch attention, prompt
scoring and element-wise ops (engine/model/elementwise.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import platform
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.phases import phase
from engine.platform.cpu_features import CpuFeatures, cpu_features, torch_capability

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent.parent / "csrc"
_SOURCES = tuple(
    _CSRC / name
    for name in (
        "bindings.cpp",  # every op's registration
        "paged_decode_attention.cpp",
        "paged_prefill_attention.cpp",
        "fused_ops.cpp",  # add_rms_norm, silu_mul, rope_write_cache
        "sampling.cpp",  # argmax_rows, prompt_scores
        "int4_gemv.cpp",
        "int8_gemv.cpp",
        "int4_dot.cpp",
        "int8_dot.cpp",  # the int8 LM head by integer dot products (AVX2 and VNNI builds)
        "int6_dot.cpp",  # a GGUF's Q6_K LM head as the file holds it (AVX2 and VNNI builds)
        "int4_gemm.cpp",
        "decode_layers.cpp",
    )
)
_HEADERS = tuple(
    _CSRC / name
    for name in (
        "ops.h",
        "scalar.h",
        "vector_lanes.h",
        "vector_exp.h",
        "quant.h",
        "activation_digits.h",
        "int4_gemv_avx512.h",
        "int4_gemv_avx2.h",
        "int4_gemv_scalar.h",
        "int4_dot_avx512_vnni.h",
        "int4_dot_avx2.h",
        "int4_dot_avx_vnni.h",
        "int4_dot_ymm.h",
        "int8_dot_avx512_vnni.h",
        "int8_dot_avx2.h",
        "int6_dot_avx512_vnni.h",
        "int6_dot_avx2.h",
        "digit_dot_avx512_vnni.h",
        "int4_gemm_avx512_vnni.h",
        "int4_gemm_avx2.h",
        "paged_prefill_attention_avx512_bf16.h",
        "paged_decode_attention_avx512_bf16.h",
    )
)  # not compiled on their own, but a change must rebuild

DecodeKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor
]
# (query [tokens, heads, dim], key_cache, value_cache, block_table, token_start, counts, context_lens, block_size,
# scale) -> [tokens, heads, dim]: prompt chunks' attention (bf16), engine/csrc/paged_prefill_attention.cpp
PrefillKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float],
    torch.Tensor,
]
# (logits [rows, vocab], target [rows], k) -> (logprobs [rows], ranks [rows], top ids [rows, k], top logprobs)
ScoreKernel = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class KernelBuild:
    """One compilation of the kernels: the instruction-set level it needs and the flags that target it."""

    name: str  # also the op namespace's suffix
    level: str  # an engine.platform.cpu_features.ISA_LEVELS key: the CPU must reach it
    flags: tuple[str, ...]
    requires: frozenset[str] = frozenset()  # CPU flags beyond the level's that the build also needs

    @property
    def namespace(self) -> str:
        return f"batchserve_{self.name}"


# Best first. GCC's x86-64-v3 is AVX2 + FMA + F16C + BMI; v4 adds AVX-512 F/BW/CD/DQ/VL.
X86_BUILDS = (
    KernelBuild("avx512_bf16", "avx512_bf16", ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mtune=generic")),
    KernelBuild("avx512_vnni", "avx512_vnni", ("-march=x86-64-v4", "-mavx512vnni", "-mtune=generic")),
    KernelBuild("avx512", "avx512", ("-march=x86-64-v4", "-mtune=generic")),
    # AVX2 with the 256-bit VNNI of Intel's cores from Alder Lake (client and E-core Xeons) and AMD's from Zen 5.
    KernelBuild("avx2_vnni", "avx2", ("-march=x86-64-v3", "-mavxvnni", "-mtune=generic"), frozenset({"avx_vnni"})),
    KernelBuild("avx2", "avx2", ("-march=x86-64-v3", "-mtune=generic")),
    KernelBuild("scalar", "scalar", ("-march=x86-64", "-mtune=generic")),
)
# Elsewhere (ARM) one build for the CPU it is built on.
NATIVE_BUILD = KernelBuild("native", "scalar", ("-march=native",))


def builds_for(features: CpuFeatures) -> tuple[KernelBuild, ...]:
    """The builds a CPU with `features` can execute, best first."""
    if not features.is_x86:
        return (NATIVE_BUILD,)
    return tuple(build for build in X86_BUILDS if features.at_least(build.level) and features.has(*build.requires))


def best_build(features: CpuFeatures | None = None) -> KernelBuild:
    return builds_for(features or cpu_features())[0]


@dataclass(frozen=True)
class Kernels:
    """The ops of one loaded build."""

    build: KernelBuild

    @functools.cached_property
    def ops(self) -> Any:
        # Resolved once: a torch.ops namespace lookup costs microseconds, and a decode step makes hundreds of calls.
        return getattr(torch.ops, self.build.namespace)

    @property
    def decode_attention(self) -> DecodeKernel:
        return self.ops.paged_decode_attention  # type: ignore[no-any-return]

    @property
    def prefill_attention(self) -> PrefillKernel | None:
        """Prompt chunks' attention over a bf16 paged cache, where the build has it (AVX512-BF16); else None."""
        if not self.ops.prefill_attention_available():
            return None
        return self.ops.paged_prefill_attention  # type: ignore[no-any-return]

    @property
    def prompt_scores(self) -> ScoreKernel:
        return self.ops.prompt_scores  # type: ignore[no-any-return]

    @property
    def has_int4_dot(self) -> bool:
        """Integer dot products for int4 weights (engine.model.linear.Int4DotLinear): AVX2, or AVX-512 with VNNI."""
        return bool(self.ops.int4_dot_available())

    @property
    def has_int8_dot(self) -> bool:
        """Integer dot products for int8 weights (engine.model.head_linear.Int8DotLinear): AVX2, or AVX-512 with
        VNNI."""
        return bool(self.ops.int8_dot_available())

    @property
    def has_int6_dot(self) -> bool:
        """Integer dot products for GGUF Q6_K weights (engine.model.head_linear.Int6DotLinear): AVX2, or AVX-512 with
        VNNI."""
        return bool(self.ops.int6_dot_available())

    @property
    def int8_dot_max_rows(self) -> int | None:
        """Rows up to which int8_dot runs rather than int8_gemv on the same weights; None: every count. With VNNI
        each `vpdpbusd` covers 64 weights; AVX2's `vpmaddubsw` route costs a row twice the float kernel's work (two
        digits), which a few rows' saved conversions pay for: the LM head on Zen 4 capped to AVX2, 0.67 against
        1.10 ms at 1 row, 2.88 against 2.84 at 5, 4.67 against 3.20 at 8 (docs/quantization.md). 5 keeps a batch-1
        verify step of 4 drafts on the kernel a plain step runs, so its rows get the same logits."""
        return 5 if self.build.level == "avx2" else None

    @property
    def silu_matches_torch(self) -> bool:
        """Whether the fused SiLU gives torch's bits here: it calls the exp of one torch capability, so only
        when torch runs that capability (engine/csrc/fused_ops.cpp)."""
        if self.build is NATIVE_BUILD:
            return False
        expected = torch_capability(self.build.level)
        return bool(torch.backends.cpu.get_cpu_capability() == expected)


def load_kernels(build: KernelBuild | None = None) -> Kernels | None:
    """The kernels of `build` (default: the best this CPU allows), compiling them if needed; None where they
    cannot be built here."""
    build = build or best_build()
    kernels = loaded_kernels(build)
    if kernels is not None:  # already loaded in this process (the op registry is process-wide)
        return kernels
    return loaded_kernels(build) if _compile(build) else None


def loaded_kernels(build: KernelBuild | None = None) -> Kernels | None:
    """The kernels of `build` (default: the best this CPU allows) if loaded in this process; never builds."""
    build = build or best_build()
    try:
        _ = getattr(torch.ops, build.namespace).paged_decode_attention
    except (AttributeError, RuntimeError):
        return None
    return Kernels(build)


def torch_runs_amx(features: CpuFeatures | None = None) -> bool:
    """Whether torch's bf16 matmuls and SDPA run on AMX tiles in this process: the CPU lists AMX-BF16, the cap
    allows it, and Linux grants the process the tile state (torch asks, arch_prctl ARCH_REQ_XCOMP_PERM, and says
    whether it was granted; oneDNN asks the same before its AMX kernels). A VM that lists AMX without granting
    it would fault on the first tile instruction, so the flags alone are not enough."""
    features = features or cpu_features()
    return features.has("amx_tile", "amx_bf16") and bool(torch.cpu._init_amx())


def cpu_signature() -> str:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        flags = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {flags}"


def extension_name(build: KernelBuild) -> str:
    texts = (source.read_text() for source in (*_SOURCES, *_HEADERS))
    # A native build is for the CPU it was built on; the others run on any CPU that reaches their level.
    machine = cpu_signature() if build is NATIVE_BUILD else platform.machine()
    key = "\n".join([*texts, machine, " ".join(build.flags), torch.__version__])
    return f"batchserve_kernels_{build.name}_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


LINK_FLAGS = ("-fopenmp",)


def compile_flags(build: KernelBuild, namespace: str | None = None) -> list[str]:
    """`build`'s compiler flags, its ops registered under `namespace` (default: the build's own)."""
    return ["-O3", *build.flags, "-fopenmp", f"-DBATCHSERVE_OPS={namespace or build.namespace}"]


def build_directory(build: KernelBuild) -> Path:
    """Where torch's extension builder keeps `build` (under $TORCH_EXTENSIONS_DIR); created if missing."""
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(extension_name(build), verbose=False))


def _compile(build: KernelBuild) -> bool:
    """Compile (or load the cached build of) the extension, registering its ops; False where it cannot."""
    try:
        from torch.utils import cpp_extension

        name = extension_name(build)
        directory = build_directory(build)
        library = directory / f"{name}.so"
        built = library.is_file()
        title = f"{'loading' if built else 'building'} the C++ kernels ({build.name})"
        once = f"once per CPU kind and torch version (a minute or so on 2 cores), into {directory}"
        with phase(logger, title, once, announce=not built) as running, builder_lock(directory):
            if not (_finished(library) and _load_finished(library)):
                cpp_extension.load(
                    name=name,
                    sources=[str(source) for source in _copied_sources(directory)],
                    extra_cflags=compile_flags(build),
                    extra_ldflags=list(LINK_FLAGS),
                    is_python_module=False,
                )
                _mark_finished(library)
            running.result = f"cached in {directory}; delete it to build again"
    except Exception as exc:  # no compiler, no ninja, a read-only cache: all mean "use the torch path"
        logger.warning("native CPU kernels (%s) unavailable, using the torch path: %s", build.name, exc)
        return False
    return True


# A finished build is loaded as it is, without asking ninja: the library's name already hashes the sources, flags,
# machine and torch version, while ninja rebuilds it whenever the command line changes, and the command line names
# the virtualenv's torch headers, so every new venv (each fresh CI clone, a reinstall) recompiled every build
# (5 builds, ~5 minutes on 2 cores). The marker, written after a build that returned, holds the library's size and
# modification time: a build killed while linking leaves a library that no longer matches it, and is built again.
def _marker(library: Path) -> Path:
    return library.with_name(library.name + ".finished")


def _stamp(library: Path) -> str:
    stat = library.stat()
    return f"{stat.st_size} {stat.st_mtime_ns}"


def _mark_finished(library: Path) -> None:
    _marker(library).write_text(_stamp(library))


def _finished(library: Path) -> bool:
    """Whether `library` is what a build that returned left (see `_mark_finished`)."""
    try:
        return _marker(library).read_text() == _stamp(library)
    except OSError:  # no library, or no marker (a cache from before the markers): ninja decides
        return False


def _load_finished(library: Path) -> bool:
    try:
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError) as exc:
        logger.warning("the cached kernel build %s did not load, building it again: %s", library, exc)
        return False
    return True


def _copied_sources(directory: Path) -> list[Path]:
    """The sources, copied into the build's own directory: its name hashes their text, and ninja rebuilds whenever
    a source's path changes, so compiling from the copy lets every checkout of the same sources (worktrees, CI's
    fresh clones) share one build rather than rebuild it in turn."""
    copies = directory / "src"
    copies.mkdir(exist_ok=True)
    for source in (*_SOURCES, *_HEADERS):
        copy = copies / source.name
        text = source.read_bytes()
        if not copy.is_file() or copy.read_bytes() != text:
            temporary = copy.with_suffix(copy.suffix + ".tmp")
            temporary.write_bytes(text)
            temporary.replace(copy)  # atomic: a process compiling beside this one never reads half a file
    return [copies / source.name for source in _SOURCES]


@contextlib.contextmanager
def builder_lock(directory: Path) -> Iterator[None]:
    """One builder at a time in `directory`, by `flock`, which the kernel releases when its holder dies. torch's own
    lock is a file whose waiters poll forever, so a build killed midway would hang every later start; every
    builder holds this lock around torch's, so a torch lock found while holding it was left by a killed build."""
    with open(directory / "batchserve-builder.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # waits while another process builds (the phase logs the wait)
        try:
            left = directory / "lock"
            if left.exists():
                left.unlink(missing_ok=True)
                logger.warning("removed the build lock a killed build left: %s", left)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
