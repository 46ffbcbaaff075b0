"""Whether this machine can build the engine's C++ kernels, decided without trying to build them.

Tests take their expectation from here, not from `engine.native.load_decode_kernel()`: where a compiler and
ninja are present the kernel must build, so a broken build fails the suite instead of turning into skips.
"""

from __future__ import annotations

import shutil

from torch.utils import cpp_extension


def _can_build_kernels() -> bool:
    return shutil.which(cpp_extension.get_cxx_compiler()) is not None and cpp_extension.is_ninja_available()


CAN_BUILD_KERNELS = _can_build_kernels()
NO_TOOLCHAIN = "no C++ compiler or ninja here: the engine runs its torch path"
