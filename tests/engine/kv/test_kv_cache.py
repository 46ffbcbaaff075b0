"""Tests for engine.kv.kv_cache: the cache's layout (its blocks' bookkeeping is
tests/engine/kv/test_block_manager.py's)."""

from __future__ import annotations

import torch

from engine.kv.kv_cache import KVCacheShape, PagedKVCache


def test_paged_cache_layout_and_sizes() -> None:
    shape = KVCacheShape(num_layers=3, num_kv_heads=2, head_dim=8, num_blocks=5, block_size=4)
    assert shape.num_slots == 20
    cache = PagedKVCache(shape, torch.float16, torch.device("cpu"))
    assert cache.data.shape == (3, 2, 2, 20, 8)
    assert cache.data.dtype == torch.float16
    assert not cache.data.any()
    keys, values = cache.layer(1)
    assert keys.shape == values.shape == (2, 20, 8)
    keys[:, 7] = 1.0  # views: writes land in the shared storage of that layer's keys only
    assert bool((cache.data[1, 0, :, 7] == 1).all())
    assert not cache.data[1, 1].any() and not cache.data[0].any() and not cache.data[2].any()
