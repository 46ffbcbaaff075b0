"""Whether this machine can build the engine's C++ kernels, decided without trying to build them.

Tests take their expectation from here, not from `engine.platform.native.load_decode_kernel()`: where a compiler and
ninja are present the kernel must build, so a broken build fails the suite instead of turning into skips.
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest
from torch.utils import cpp_extension

from engine.platform import native
from engine.platform.cpu_features import cpu_features


def _can_build_kernels() -> bool:
    return shutil.which(cpp_extension.get_cxx_compiler()) is not None and cpp_extension.is_ninja_available()


CAN_BUILD_KERNELS = _can_build_kernels()
NO_TOOLCHAIN = "no C++ compiler or ninja here: the engine runs its torch path"


def kernel_build_params() -> list[Any]:
    """Every build of the compiled kernels for this kind of CPU, as pytest params; those this CPU (under
    BATCHSERVE_CPU_ISA) cannot execute are skipped with the reason. Only the build the engine itself runs here is in
    the fast subset: each other build costs minutes to compile on 2 cores, and `-m slow` (the whole suite, CI)
    still checks every one."""
    features = cpu_features()
    runnable = native.builds_for(features)
    builds = native.X86_BUILDS if features.is_x86 else (native.NATIVE_BUILD,)
    reason = f"this CPU ({features.describe()}) cannot execute the %s build"

    def marks(build: native.KernelBuild) -> list[pytest.MarkDecorator]:
        unrunnable = pytest.mark.skipif(build not in runnable, reason=reason % build.name)
        return [unrunnable] if runnable and build == runnable[0] else [unrunnable, pytest.mark.slow]

    return [pytest.param(build, id=build.name, marks=marks(build)) for build in builds]


def load_build(build: native.KernelBuild) -> native.Kernels:
    """The build's kernels; skipped only where nothing could build them, a failure where the build broke."""
    if not CAN_BUILD_KERNELS:
        pytest.skip(NO_TOOLCHAIN)
    kernels = native.load_kernels(build)
    assert kernels is not None, f"a C++ compiler is present but the {build.name} kernels did not build: see the log"
    return kernels
