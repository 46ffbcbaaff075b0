"""The block pool: reference counts, parked cached blocks evicted least recently released first (most recently
while lookups keep missing), and prefix matches that are exact even when keys collide."""

from __future__ import annotations

import pytest

import engine.kv.block_manager
import engine.kv.block_pool
from engine.kv.block_manager import BlockManager
from engine.kv.block_pool import BlockPool, block_key, root

SIZE = 2


def manager(num_blocks: int, enabled: bool = True) -> BlockManager:
    return BlockManager(num_blocks, SIZE, enabled, max_model_len=1024)


def fill(cache: BlockManager, seq_id: int, tokens: list[int], salt: str | None = None) -> list[int]:
    """A sequence that computed `tokens` (whole blocks) in fresh blocks and registered them. The tests free its
    blocks through the pool, to order their release."""
    assert cache.admit(seq_id, (), salt, False, len(tokens)) is not None
    cache.register(seq_id, tokens, len(tokens) // SIZE)
    return list(cache.blocks(seq_id))


def test_all_or_nothing_allocation_and_counts() -> None:
    pool = BlockPool(4)
    assert pool.allocate(5) is None and pool.num_free == 4
    taken = pool.allocate(3)
    assert taken == [0, 1, 2] and (pool.num_used, pool.num_free) == (3, 1)
    pool.free(taken)
    assert (pool.num_used, pool.num_free, pool.num_cached_free) == (0, 4, 0)


def test_released_cached_blocks_park_and_are_evicted_tail_first_only_when_needed() -> None:
    cache = manager(4)
    blocks = fill(cache, 0, [1, 2, 3, 4, 5, 6])  # three full blocks
    cache.pool.free(blocks)
    assert (cache.pool.num_free, cache.pool.num_cached_free) == (4, 3)
    assert cache.match([1, 2, 3, 4, 5, 6, 7], None, reads=True).blocks == tuple(blocks)
    cache.pool.allocate(1)  # the never-used block goes first: nothing is evicted
    assert cache.pool.num_cached_free == 3
    cache.pool.allocate(1)  # now the sequence's last block is evicted, its prefix stays
    assert cache.match([1, 2, 3, 4, 5, 6, 7], None, reads=True).blocks == tuple(blocks[:2])


def test_while_lookups_miss_for_a_whole_cache_the_most_recently_released_block_goes_first() -> None:
    """A workload that shares nothing reuses warm memory, as caching off does; the first hit restores LRU."""
    cache = manager(4)
    first = fill(cache, 0, [1, 2, 3, 4])
    second = fill(cache, 1, [5, 6, 7, 8])  # four blocks handed out, no lookup has found anything
    cache.pool.free(first)
    cache.pool.free(second)  # tail first: second[0] is the most recently released
    assert cache.pool.evicts_most_recent
    assert cache.pool.allocate(1) == [second[0]]  # its child, unreachable now, is a plain free block
    assert cache.match([1, 2, 3, 4, 9], None, reads=True).blocks == tuple(first)
    assert not cache.pool.evicts_most_recent
    assert cache.pool.allocate(2) == [second[1], first[1]]  # least recently released again: the first's tail
    assert cache.match([1, 2, 3, 4, 9], None, reads=True).blocks == (first[0],)


def test_shared_blocks_are_counted_once_per_user() -> None:
    cache = manager(4)
    blocks = fill(cache, 0, [1, 2, 3, 4])
    cache.pool.acquire(blocks)  # a second sequence shares them
    cache.pool.free(blocks)  # the first leaves
    assert (cache.pool.num_used, cache.pool.num_cached_free) == (2, 0)
    cache.pool.free(blocks)
    assert (cache.pool.num_used, cache.pool.num_cached_free) == (0, 2)


def test_the_last_token_is_always_computed() -> None:
    cache = manager(4)
    fill(cache, 0, [1, 2, 3, 4])
    assert len(cache.match([1, 2, 3, 4], None, reads=True).blocks) == 1  # the second block holds the last token
    assert len(cache.match([1, 2, 3, 4, 9], None, reads=True).blocks) == 2


def test_salts_never_share_and_readers_that_do_not_read_find_nothing() -> None:
    cache = manager(8)
    fill(cache, 0, [1, 2, 3, 4], salt="alice")
    assert cache.match([1, 2, 3, 4, 5], "bob", reads=True).blocks == ()
    assert cache.match([1, 2, 3, 4, 5], None, reads=True).blocks == ()
    assert len(cache.match([1, 2, 3, 4, 5], "alice", reads=True).blocks) == 2
    assert cache.match([1, 2, 3, 4, 5], "alice", reads=False).blocks == ()
    cache.enabled = False
    assert cache.match([1, 2, 3, 4, 5], "alice", reads=True).blocks == ()


def test_a_colliding_key_never_hands_out_other_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every key the same: only the token and parent comparison stands between a sequence and wrong values."""
    monkeypatch.setattr(engine.kv.block_pool, "block_key", lambda *_: 7)
    monkeypatch.setattr(engine.kv.block_manager, "block_key", lambda *_: 7)
    cache = manager(8)
    first = fill(cache, 0, [1, 2, 3, 4])
    fill(cache, 1, [5, 6, 7, 8])  # collides with the first at its first block: stays private
    assert cache.match([1, 2, 9], None, reads=True).blocks == (first[0],)
    assert cache.match([5, 6, 7, 8, 9], None, reads=True).blocks == ()
    # The first chain's second block has the same key as its first, but a different parent and tokens.
    assert cache.match([1, 2, 3, 4, 9], None, reads=True).blocks == (first[0],)


def test_a_reused_block_id_orphans_the_children_of_what_it_held() -> None:
    """A child names its parent by block id and generation: once the parent's id is handed out again, the child
    is unreachable, even when the new parent holds the same tokens (its values may come from elsewhere)."""
    cache = manager(3)
    parent, child = fill(cache, 0, [1, 2, 3, 4])
    cache.pool.free([parent])  # parked first: evicted first
    cache.pool.free([child])
    assert cache.match([1, 2, 3, 4, 5], None, reads=True).blocks == (parent, child)  # a hit: LRU order
    assert cache.pool.allocate(1) == [2]
    assert fill(cache, 1, [1, 2]) == [parent]  # the parent's id, reused
    assert cache.match([1, 2, 3, 4, 5], None, reads=True).blocks == (parent,)  # not the stale child
    assert block_key(None, None, (1, 2)) != block_key(block_key(None, None, (1, 2)), None, (1, 2))
    assert root("s") == ("salt", "s")


def test_identical_prefixes_filled_at_once_chain_through_the_first_holder() -> None:
    cache = manager(8)
    first = fill(cache, 0, [1, 2, 3, 4])
    second = fill(cache, 1, [1, 2, 3, 4, 5, 6])  # computed concurrently: its first two blocks stay private
    assert cache.match([1, 2, 3, 4, 5, 6, 7], None, reads=True).blocks == (first[0], first[1], second[2])


def test_a_prefix_whose_head_was_evicted_first_is_cached_again_whole() -> None:
    """Its later blocks name the evicted head as their parent, so nothing can reach them: they leave the cache
    with it, and the prefix computed again is registered whole instead of stopping at their keys."""
    cache = manager(8)
    prompt = list(range(1, 11))  # five blocks
    head, *rest = fill(cache, 0, prompt)
    cache.pool.free([head])  # released first: the least recently released, evicted first
    cache.pool.free(rest)
    taken = cache.pool.allocate(4)
    assert taken == [5, 6, 7, head]  # the three never-used blocks, then the head
    assert (cache.pool.num_free, cache.pool.num_cached_free) == (4, 0)  # its children are plain free blocks
    assert cache.match([*prompt, 11], None, reads=True).blocks == ()
    cache.pool.free(taken)
    again = fill(cache, 1, prompt)
    assert cache.match([*prompt, 11], None, reads=True).blocks == tuple(again)


def test_a_running_sequence_stops_registering_under_a_holder_evicted_beside_it() -> None:
    """A sequence computed alongside another chains through the other's blocks; once those are evicted, what it
    fills next is reachable from nowhere and is not registered, so it cannot hold the prefix's key either."""
    cache = manager(9)
    first = fill(cache, 0, [1, 2, 3, 4])
    assert cache.admit(1, (), None, False, 6) is not None
    cache.register(1, [1, 2, 3, 4], 2)
    assert cache.registered(1) == 2  # both private: the chain goes on through `first`
    cache.pool.free([first[0]])
    cache.pool.free([first[1]])
    assert cache.pool.allocate(5) == [5, 6, 7, 8, first[0]]  # evicts the holder's head, and its child with it
    cache.register(1, [5, 6], 3)
    assert cache.registered(1) == 3
    assert cache.match([1, 2, 3, 4, 5, 6, 7], None, reads=True).blocks == ()
    cache.free(1)
    again = fill(cache, 2, [1, 2, 3, 4, 5, 6])
    assert cache.match([1, 2, 3, 4, 5, 6, 7], None, reads=True).blocks == tuple(again)
