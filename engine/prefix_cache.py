"""Automatic prefix caching over the block pool: which cached blocks a sequence may start from, and registering the
blocks it fills, so the next sequence with the same prefix computes only its new tokens.

Rules (vLLM's, with exactness checks of our own in engine/block_pool.py):
- Only full blocks are cached, each keyed by its parent's key, its token ids and, for a first block, the
  sequence's cache salt: sequences with different salts never share a block.
- At least the last known token is always computed, so the sequence gets its logits; the blocks it would write are
  never shared ones.
- A sequence that asks for prompt logprobs does not read the cache (its scores need every position computed) but
  its blocks are still registered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.block_pool import BlockPool, Parent, PrefixMatch, block_key, root

NO_MATCH = PrefixMatch((), ())


@dataclass
class _Chain:
    """Where a sequence's next full block hangs in the cache; `parent` None stops registering (a collision)."""

    salt: str | None
    parent: Parent | None
    parent_key: int | None
    registered: int  # blocks of the sequence that are registered (or attached from the cache)


class PrefixCache:
    def __init__(self, pool: BlockPool, block_size: int, enabled: bool) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enabled = enabled
        self.queries = 0  # tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0  # tokens found (vLLM's prefix_cache_hits)
        self._chains: dict[int, _Chain] = {}

    def lookup(self, token_ids: Sequence[int], salt: str | None, reads: bool) -> PrefixMatch:
        """The cached blocks `token_ids` may start from; changes no block (a hit only tells the pool that the
        cache is in use, which orders its evictions)."""
        if not (self.enabled and reads) or len(token_ids) < 2:
            return NO_MATCH
        return self.pool.match(token_ids, self.block_size, salt, (len(token_ids) - 1) // self.block_size)

    def start(self, seq_id: int, salt: str | None, match: PrefixMatch, num_queried: int) -> None:
        """The sequence begins (or resumes) holding `match`'s blocks, already acquired."""
        if self.enabled:  # with caching off nothing was looked up
            self.queries += num_queried
        self.hits += len(match.blocks) * self.block_size
        parent = self.pool.identity(match.blocks[-1]) if match.blocks else root(salt)
        parent_key = match.keys[-1] if match.keys else None
        self._chains[seq_id] = _Chain(salt, parent, parent_key, len(match.blocks))

    def register(self, seq_id: int, blocks: Sequence[int], new_token_ids: Sequence[int], num_full: int) -> int:
        """Register the sequence's blocks up to `num_full` full, computed ones; `new_token_ids` are the tokens
        from its first unregistered block on. Returns how many of its blocks are registered now."""
        chain = self._chains.get(seq_id)
        if chain is None:
            return num_full
        size = self.block_size
        first = chain.registered
        while chain.registered < num_full:
            if chain.parent is None:  # after a collision nothing further is findable: stop trying
                chain.registered = num_full
                break
            offset = (chain.registered - first) * size
            tokens = tuple(new_token_ids[offset : offset + size])
            key = block_key(chain.parent_key, chain.salt, tokens)
            chain.parent = self.pool.register(blocks[chain.registered], chain.parent, key, tokens)
            chain.parent_key = key
            chain.registered += 1
        return chain.registered

    def end(self, seq_id: int) -> None:
        self._chains.pop(seq_id, None)
