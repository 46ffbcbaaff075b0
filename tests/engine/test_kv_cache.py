"""Tests for engine.kv_cache: the block allocator's all-or-nothing bookkeeping and the cache's layout."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv_cache import BlockAllocator, KVCacheShape, PagedKVCache


def test_new_allocator_has_every_block_free() -> None:
    allocator = BlockAllocator(8)
    assert allocator.num_blocks == 8
    assert allocator.num_free == 8
    assert allocator.num_used == 0


def test_allocate_hands_out_distinct_valid_ids_and_updates_counts() -> None:
    allocator = BlockAllocator(8)
    first = allocator.allocate(3)
    second = allocator.allocate(4)
    assert first is not None and second is not None
    assert len(first) == 3 and len(second) == 4
    assert len(set(first) | set(second)) == 7
    assert all(0 <= b < 8 for b in first + second)
    assert allocator.num_free == 1 and allocator.num_used == 7


def test_allocate_is_all_or_nothing() -> None:
    allocator = BlockAllocator(8)
    assert allocator.allocate(5) is not None
    assert allocator.allocate(4) is None  # only 3 free: nothing is taken
    assert allocator.num_free == 3
    assert allocator.allocate(9) is None
    assert allocator.num_free == 3
    rest = allocator.allocate(3)  # exactly what is left
    assert rest is not None and len(rest) == 3
    assert allocator.num_free == 0
    assert allocator.allocate(1) is None


def test_allocate_zero_returns_empty_list_even_when_full() -> None:
    allocator = BlockAllocator(2)
    assert allocator.allocate(2) is not None
    assert allocator.allocate(0) == []
    assert allocator.num_free == 0


def test_free_returns_blocks_for_reuse() -> None:
    allocator = BlockAllocator(4)
    a = allocator.allocate(2)
    b = allocator.allocate(2)
    assert a is not None and b is not None
    allocator.free(a)
    assert allocator.num_free == 2 and allocator.num_used == 2
    again = allocator.allocate(2)
    assert again is not None and sorted(again) == sorted(a)  # the freed blocks, not b's
    allocator.free(b)
    allocator.free(again)
    assert allocator.num_free == 4 and allocator.num_used == 0
    everything = allocator.allocate(4)
    assert everything is not None and sorted(everything) == [0, 1, 2, 3]


def test_lightly_loaded_allocator_hands_out_low_ids_first() -> None:
    allocator = BlockAllocator(16)
    assert allocator.allocate(3) is not None
    blocks = allocator.allocate(2)
    assert blocks is not None and max(blocks) < 5


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=40))
def test_allocator_never_double_allocates_under_any_sequence_of_operations(
    ops: list[tuple[bool, int]],
) -> None:
    total = 10
    allocator = BlockAllocator(total)
    owned: list[list[int]] = []
    for is_allocate, n in ops:
        if is_allocate or not owned:
            free_before = allocator.num_free
            blocks = allocator.allocate(n)
            if n > free_before:
                assert blocks is None and allocator.num_free == free_before
            else:
                assert blocks is not None and len(blocks) == n
                owned.append(blocks)
        else:
            allocator.free(owned.pop(n % len(owned)))
        held = [b for blocks in owned for b in blocks]
        assert len(held) == len(set(held))  # no block is held twice
        assert all(0 <= b < total for b in held)
        assert allocator.num_used == len(held)
        assert allocator.num_free + allocator.num_used == total


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
