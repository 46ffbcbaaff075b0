"""The compiled paged decode attention kernel against the torch path, and the fallback when it cannot build."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import native
from engine.attention import paged_attention, prepare
from engine.forward_batch import build_forward_batch
from tests.toolchain import CAN_BUILD_KERNELS, NO_TOOLCHAIN

KERNEL = native.load_decode_kernel()


@pytest.fixture
def kernel() -> native.DecodeKernel:
    """The built kernel; skipped only where nothing could build it, a failure where the build broke."""
    if not CAN_BUILD_KERNELS:
        pytest.skip(NO_TOOLCHAIN)
    assert KERNEL is not None, "a C++ compiler is present but the kernel did not build: see the logged warning"
    return KERNEL


def test_the_kernel_builds_wherever_a_compiler_is_present() -> None:
    assert (KERNEL is not None) == CAN_BUILD_KERNELS
    assert (native.load_score_kernel() is not None) == CAN_BUILD_KERNELS


def _decode_case(rows: int, heads: int, kv_heads: int, block_size: int, seed: int):
    """A random cache, random (shuffled) block tables and context lengths from 1 to a few blocks."""
    generator = torch.Generator().manual_seed(seed)
    dim, max_blocks = 16, 5
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
    ("heads", "kv_heads", "block_size"),
    [(4, 4, 4), (6, 2, 4), (9, 3, 16), (8, 1, 3)],
    ids=["mha", "gqa", "smollm2-shape", "mqa-odd-block"],
)
def test_kernel_matches_the_torch_path(kernel: native.DecodeKernel, heads: int, kv_heads: int, block_size: int) -> None:
    query, key_cache, value_cache, batch, num_blocks = _decode_case(7, heads, kv_heads, block_size, seed=heads)
    torch_groups = prepare(batch.groups, kv_heads, num_blocks, block_size, native_decode=False)
    kernel_groups = prepare(batch.groups, kv_heads, num_blocks, block_size, native_decode=True)
    assert kernel_groups[0].block_index is None  # nothing is gathered for the kernel
    expected = paged_attention(query, key_cache, value_cache, torch_groups, 0.25)
    got = paged_attention(query, key_cache, value_cache, kernel_groups, 0.25, decode_kernel=kernel)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


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

    monkeypatch.setattr(native, "_registered", lambda: None)
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    with caplog.at_level(logging.WARNING, logger="engine.native"):
        assert native.load_decode_kernel() is None
    assert "no C++ compiler found" in caplog.text


def test_extension_name_changes_with_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    name = native._extension_name()
    monkeypatch.setattr(native, "_cpu_signature", lambda: "another processor")
    assert native._extension_name() != name


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path) -> None:
    import os
    import time

    stale, fresh = tmp_path / "stale.lock", tmp_path / "fresh.lock"
    stale.write_text("")
    fresh.write_text("")
    old = time.time() - 2 * native._STALE_LOCK_S
    os.utime(stale, (old, old))
    native._clear_stale_lock(stale)
    native._clear_stale_lock(fresh)
    native._clear_stale_lock(tmp_path / "missing.lock")
    assert not stale.exists() and fresh.exists()
