"""The compiled paged decode attention kernel against the torch path, once per build this CPU can execute; the
builds' choice by CPU features, and the fallback when they cannot build."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from engine.model.attention import paged_attention, prepare
from engine.model.forward_batch import build_forward_batch
from engine.platform import native
from engine.platform.cpu_features import features_for
from tests.toolchain import CAN_BUILD_KERNELS


@pytest.fixture
def kernel(kernels: native.Kernels) -> native.DecodeKernel:
    return kernels.decode_attention


def test_the_best_build_builds_wherever_a_compiler_is_present() -> None:
    assert (native.load_kernels() is not None) == CAN_BUILD_KERNELS


AVX2_EPYC = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})
AVX512_XEON = AVX2_EPYC | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni", "avx512_bf16"}
ALDER_LAKE = AVX2_EPYC | {"avx_vnni"}  # AVX2 with the 256-bit VNNI, no AVX-512
SAPPHIRE_RAPIDS = AVX512_XEON | {"avx_vnni", "amx_tile", "amx_bf16", "amx_int8"}


@pytest.mark.parametrize(
    ("flags", "cap", "expected"),
    [
        (AVX2_EPYC, None, ["avx2", "scalar"]),
        (AVX512_XEON, None, ["avx512_bf16", "avx512_vnni", "avx512", "avx2", "scalar"]),
        (AVX512_XEON, "avx512_vnni", ["avx512_vnni", "avx512", "avx2", "scalar"]),
        (AVX512_XEON, "avx2", ["avx2", "scalar"]),
        (AVX512_XEON, "avx512", ["avx512", "avx2", "scalar"]),
        (AVX512_XEON, "scalar", ["scalar"]),
        (ALDER_LAKE, None, ["avx2_vnni", "avx2", "scalar"]),
        (SAPPHIRE_RAPIDS, None, ["avx512_bf16", "avx512_vnni", "avx512", "avx2_vnni", "avx2", "scalar"]),
        # Capped to AVX2, a machine with AVX-VNNI stands for the AVX2 class proper (Zen 3): no avx2_vnni build.
        (SAPPHIRE_RAPIDS, "avx2", ["avx2", "scalar"]),
        (SAPPHIRE_RAPIDS, "avx512", ["avx512", "avx2_vnni", "avx2", "scalar"]),
        (frozenset({"sse4_2"}), None, ["scalar"]),
    ],
)
def test_the_builds_a_cpu_can_execute(flags: frozenset[str], cap: str | None, expected: list[str]) -> None:
    features = features_for("x86_64", flags, cap)
    assert [build.name for build in native.builds_for(features)] == expected
    assert native.best_build(features).name == expected[0]


def test_off_x86_one_native_build() -> None:
    assert native.builds_for(features_for("aarch64", frozenset({"asimd"}), None)) == (native.NATIVE_BUILD,)


def _decode_case(rows: int, heads: int, kv_heads: int, block_size: int, seed: int, dim: int = 16):
    """A random cache, random (shuffled) block tables and context lengths from 1 to a few blocks."""
    generator = torch.Generator().manual_seed(seed)
    max_blocks = 5
    num_blocks = rows * max_blocks + 3
    key_cache = torch.randn(kv_heads, num_blocks * block_size, dim, generator=generator)
    value_cache = torch.randn(kv_heads, num_blocks * block_size, dim, generator=generator)
    block_table = torch.randperm(num_blocks, generator=generator)[: rows * max_blocks].view(rows, max_blocks)
    context = torch.randint(1, max_blocks * block_size + 1, (rows,), generator=generator)
    context[0] = 1  # a first token attends to itself alone
    context[-1] = max_blocks * block_size  # a full table
    query = torch.randn(rows, heads, dim, generator=generator)
    tokens = torch.zeros(rows, max_blocks * block_size, dtype=torch.long)
    batch, _ = build_forward_batch(
        torch.arange(rows), torch.ones(rows, dtype=torch.long), context - 1, context, tokens, block_table, block_size
    )
    return query, key_cache, value_cache, batch, num_blocks


@pytest.mark.parametrize(
    ("heads", "kv_heads", "block_size", "dim"),
    [(4, 4, 4, 16), (6, 2, 4, 16), (9, 3, 16, 16), (8, 1, 3, 16), (32, 8, 16, 64)],
    ids=["mha", "gqa", "smollm2-shape", "mqa-odd-block", "llama-3.2-1b-shape"],
)
def test_kernel_matches_the_torch_path(
    kernel: native.DecodeKernel, heads: int, kv_heads: int, block_size: int, dim: int
) -> None:
    query, key_cache, value_cache, batch, num_blocks = _decode_case(7, heads, kv_heads, block_size, heads, dim)
    torch_groups = prepare(batch.groups, kv_heads, num_blocks, block_size, native_decode=False)
    kernel_groups = prepare(batch.groups, kv_heads, num_blocks, block_size, native_decode=True)
    assert kernel_groups[0].block_index is None  # nothing is gathered for the kernel
    expected = paged_attention(query, key_cache, value_cache, torch_groups, 0.25)
    got = paged_attention(query, key_cache, value_cache, kernel_groups, 0.25, decode_kernel=kernel)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# The vector builds run head sizes of 4, 8 or 16 whole vectors through their own loops (64 and 128 in the AVX2
# build; 64, 128 and 256 in the AVX-512 ones) and every other size through the portable ones: both, per build. The
# avx512_bf16 build runs a bf16 query and cache through `vdpbf16ps` for head sizes of whole 32-value vectors and
# blocks of whole 16-key tiles (1 to 8 vectors; 96 and 32 take its odd and single-vector loops), else the float path:
# 16- and 32-key blocks, contexts ending inside a tile and on its edge, odd and even (value pairs).
@pytest.mark.parametrize("dim", [24, 32, 64, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_kernel_matches_the_torch_path_at_each_head_size(
    kernel: native.DecodeKernel, dim: int, dtype: torch.dtype, block_size: int
) -> None:
    query, key_cache, value_cache, batch, num_blocks = _decode_case(7, 9, 3, block_size, seed=dim, dim=dim)
    query, key_cache, value_cache = query.to(dtype), key_cache.to(dtype), value_cache.to(dtype)
    torch_groups = prepare(batch.groups, 3, num_blocks, block_size, native_decode=False)
    kernel_groups = prepare(batch.groups, 3, num_blocks, block_size, native_decode=True)
    expected = paged_attention(query.float(), key_cache.float(), value_cache.float(), torch_groups, dim**-0.5)
    got = paged_attention(query, key_cache, value_cache, kernel_groups, dim**-0.5, decode_kernel=kernel)
    assert got.dtype == dtype
    # A bfloat16 output is rounded once (half an ulp: 2**-9 relative); the vdpbf16ps path also weighs the values
    # by bf16-rounded softmax weights, an error of the same order over a context's sum.
    tolerance = 1e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)


def test_kernel_rejects_a_block_table_pointing_outside_the_cache(kernel: native.DecodeKernel) -> None:
    query, key_cache, value_cache, batch, _ = _decode_case(3, 4, 2, 4, seed=1)
    group = batch.groups[0]
    bad_table = group.block_table.clone()
    bad_table[1, 0] = 10_000
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernel(query, key_cache, value_cache, bad_table, group.context_lens, 4, 1.0)
    with pytest.raises(RuntimeError, match="block_size must be positive"):
        kernel(query, key_cache, value_cache, group.block_table, group.context_lens, 0, 1.0)
    with pytest.raises(RuntimeError, match="context length"):
        kernel(query, key_cache, value_cache, group.block_table, group.context_lens * 0, 4, 1.0)


def test_a_failed_build_falls_back_with_a_warning(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    from torch.utils import cpp_extension

    def no_compiler(**_: object) -> None:
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(native, "loaded_kernels", lambda build=None: None)
    monkeypatch.setattr(native, "_finished", lambda library: False)  # no finished build cached: ninja decides
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    with caplog.at_level(logging.WARNING, logger="engine.platform.native"):
        assert native.load_kernels() is None
    assert "no C++ compiler found" in caplog.text


@pytest.mark.skipif(not CAN_BUILD_KERNELS, reason="needs a C++ compiler")
def test_a_finished_build_loads_in_a_new_process_without_asking_ninja() -> None:
    """The session's build (tests/conftest.py) is finished and marked; a process whose extension builder refuses to
    run, as one in a fresh virtualenv would rebuild (its command line names the venv's paths), still loads it."""
    import subprocess
    import sys

    script = (
        "from torch.utils import cpp_extension\n"
        "def refuse(**_):\n"
        "    raise RuntimeError('the extension builder was asked')\n"
        "cpp_extension.load = refuse\n"
        "from engine.platform import native\n"
        "kernels = native.load_kernels()\n"
        "print('loaded' if kernels is not None else 'not loaded')\n"
    )
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "loaded", done.stderr


def test_a_library_that_changed_after_its_build_returned_is_built_again(tmp_path: Path, caplog) -> None:
    """A build killed while linking leaves a library that is not the one its marker describes; a marked library
    that does not load (damaged since) is refused with a warning rather than trusted."""
    library = tmp_path / "batchserve_kernels_x.so"
    assert not native._finished(library)  # nothing built
    library.write_bytes(b"\x7fELF" + bytes(64))
    assert not native._finished(library)  # built, never marked: a cache from before the markers
    native._mark_finished(library)
    assert native._finished(library)
    library.write_bytes(b"\x7fELF" + bytes(32))  # relinked, cut short
    assert not native._finished(library)
    with caplog.at_level(logging.WARNING, logger="engine.platform.native"):
        assert not native._load_finished(library)
    assert "building it again" in caplog.text


def test_extension_name_changes_with_the_cpu_only_for_a_native_build(monkeypatch: pytest.MonkeyPatch) -> None:
    portable, built_here = native.X86_BUILDS[-1], native.NATIVE_BUILD
    names = native.extension_name(portable), native.extension_name(built_here)
    monkeypatch.setattr(native, "cpu_signature", lambda: "another processor")
    assert native.extension_name(portable) == names[0] and native.extension_name(built_here) != names[1]
    assert len({native.extension_name(build) for build in native.X86_BUILDS}) == len(native.X86_BUILDS)


def test_a_build_killed_midway_does_not_hang_the_next_start(tmp_path) -> None:
    """A builder killed while it holds the builder lock and torch's lock file: the kernel drops the flock with the
    process, so the next builder gets it at once and removes torch's lock, on which torch would wait forever."""
    import fcntl
    import subprocess
    import sys

    script = (
        "import pathlib, sys, time\n"
        "from engine.platform.native import builder_lock\n"
        "directory = pathlib.Path(sys.argv[1])\n"
        "with builder_lock(directory):\n"
        "    (directory / 'lock').write_text('')\n"
        "    print('holding', flush=True)\n"
        "    time.sleep(600)\n"
    )
    root = Path(__file__).resolve().parents[3]
    child = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], cwd=root, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "holding"
        with open(tmp_path / "batchserve-builder.lock") as handle, pytest.raises(BlockingIOError):
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while its builder lives
    finally:
        child.kill()
        child.wait()
    assert (tmp_path / "lock").exists()  # torch's lock, left by the killed build
    with native.builder_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_every_checkout_compiles_the_same_copied_sources(tmp_path) -> None:
    """The build compiles copies kept in its own directory (named by the sources' hash), so ninja sees the same
    paths from any checkout and reuses the build; copying again rewrites nothing (ninja compares times)."""
    sources = native._copied_sources(tmp_path)
    assert [path.parent for path in sources] == [tmp_path / "src"] * len(native._SOURCES)
    copied = sorted((tmp_path / "src").iterdir())
    assert [path.name for path in copied] == sorted(path.name for path in (*native._SOURCES, *native._HEADERS))
    assert all(copy.read_bytes() == (native._CSRC / copy.name).read_bytes() for copy in copied)
    times = [copy.stat().st_mtime_ns for copy in copied]
    assert native._copied_sources(tmp_path) == sources
    assert [copy.stat().st_mtime_ns for copy in copied] == times
