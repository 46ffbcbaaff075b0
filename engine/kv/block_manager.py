"""The one owner of KV cache blocks: the block pool, the prefix cache over it, and each sequence's block list and
registration progress. The engine and the simulator both hold one; nothing else keeps a sequence's blocks.

Automatic prefix caching (vLLM's rules, with exactness checks of our own in engine/kv/block_pool.py):
- Only full blocks are cached, each keyed by its parent's key, its token ids and, for a first block, the
  sequence's cache salt: sequences with different salts never share a block.
- At least the last known token is always computed, so the sequence gets its logits; the blocks it would write are
  never shared ones.
- A sequence that asks for prompt logprobs does not read the cache (its scores need every position computed) but
  its blocks are still registered.

A waiting sequence's prompt is looked up once per admission: the last lookup is kept, and reused while the cache
holds the same blocks (`BlockPool.epoch`), so asking what a sequence will find, whether it fits, and then admitting
it hashes its tokens once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.kv.block_pool import BlockPool, Parent, PrefixMatch, block_key, root

if TYPE_CHECKING:
    from engine.sample.sampling_params import SamplingParams

NO_MATCH = PrefixMatch((), ())


@dataclass(slots=True)
class _Held:
    """A sequence's cache: its blocks in order, and where its next full block hangs in the prefix cache (`parent`
    None stops registering: a collision, or a parent evicted since)."""

    salt: str | None
    parent: Parent | None
    parent_key: int | None
    registered: int  # blocks of the sequence that are registered (or attached from the cache)
    blocks: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Lookup:
    """The last lookup, and what it was for: valid while the seq_id, length, salt and the cache's epoch agree."""

    seq_id: int
    num_tokens: int
    salt: str | None
    epoch: int
    match: PrefixMatch


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, max_model_len: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enabled = enable_prefix_caching
        self.max_model_len = max_model_len
        self.queries = 0  # tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0  # tokens found (vLLM's prefix_cache_hits)
        self._held: dict[int, _Held] = {}  # sequences holding cache
        self._last: _Lookup | None = None

    # ----- counts -----
    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return self.pool.num_used / self.pool.num_blocks

    @property
    def free_tokens(self) -> int:
        return self.pool.num_free * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` positions (capped at the context window)."""
        return -(-min(num_tokens, self.max_model_len) // self.block_size)

    def holds(self, seq_id: int) -> bool:
        return seq_id in self._held

    def blocks(self, seq_id: int) -> Sequence[int]:
        held = self._held.get(seq_id)
        return held.blocks if held is not None else ()

    def num_blocks(self, seq_id: int) -> int:
        held = self._held.get(seq_id)
        return len(held.blocks) if held is not None else 0

    def registered(self, seq_id: int) -> int:
        """Blocks of the sequence in the prefix cache (registered or attached from it)."""
        return self._held[seq_id].registered

    # ----- admission -----
    def match(self, token_ids: Sequence[int], salt: str | None, reads: bool) -> PrefixMatch:
        """The cached blocks a sequence knowing `token_ids` would start from; changes no block (a hit only tells the
        pool the cache is in use, which orders its evictions)."""
        if not (self.enabled and reads) or len(token_ids) < 2:
            return NO_MATCH
        return self.pool.match(token_ids, self.block_size, salt, (len(token_ids) - 1) // self.block_size)

    def lookup(self, seq_id: int, token_ids: Sequence[int], salt: str | None, reads: bool) -> PrefixMatch:
        """`match`, remembered for sequence `seq_id` until it is admitted or freed, or the cached blocks change. A
        sequence's known tokens only grow (`seq_id` names them), so its length stands for them."""
        if not (self.enabled and reads) or len(token_ids) < 2:
            return NO_MATCH
        last, epoch = self._last, self.pool.epoch
        if last == _Lookup(seq_id, len(token_ids), salt, epoch, last.match if last else NO_MATCH):
            assert last is not None
            if last.match.blocks:
                self.pool.note_hit()  # as the lookup it stands for would have
            return last.match
        match = self.match(token_ids, salt, reads)
        self._last = _Lookup(seq_id, len(token_ids), salt, epoch, match)
        return match

    def can_admit(
        self, seq_id: int, token_ids: Sequence[int], salt: str | None, reads: bool, total_tokens: int
    ) -> bool:
        """Whether `admit` would succeed now; changes no block."""
        match = self.lookup(seq_id, token_ids, salt, reads)
        parked = sum(1 for block in match.blocks if self.pool.is_parked(block))
        return self.blocks_for(total_tokens) - len(match.blocks) <= self.pool.num_free - parked

    def admit(
        self, seq_id: int, token_ids: Sequence[int], salt: str | None, reads: bool, total_tokens: int
    ) -> PrefixMatch | None:
        """Give a sequence that holds no cache the cached prefix of `token_ids` and fresh blocks up to `total_tokens`
        positions; all or nothing. Returns the cached prefix it starts from, or None if blocks ran out."""
        if seq_id in self._held:
            raise ValueError(f"sequence {seq_id} already holds cache")
        match = self.lookup(seq_id, token_ids, salt, reads)
        self.pool.acquire(match.blocks)  # first: allocating must not evict the blocks we are about to read
        missing = self.blocks_for(total_tokens) - len(match.blocks)
        new = self.pool.allocate(missing) if missing > 0 else []
        if new is None:
            self.pool.free(match.blocks)
            return None
        self._last = None
        blocks = [*match.blocks, *new]
        if blocks:  # a sequence that holds no block holds no cache: the next reservation admits it again
            parent = self.pool.identity(match.blocks[-1]) if match.blocks else root(salt)
            parent_key = match.keys[-1] if match.keys else None
            self._held[seq_id] = _Held(salt, parent, parent_key, len(match.blocks), blocks)
        if self.enabled:  # with caching off nothing was looked up
            self.queries += len(token_ids)
        self.hits += len(match.blocks) * self.block_size
        return match

    # ----- a running sequence -----
    def grow(self, seq_id: int, total_tokens: int) -> list[int] | None:
        """Make the sequence's cache hold `total_tokens` positions; all or nothing. Returns the blocks added (empty
        if it held enough), or None if blocks ran out."""
        blocks = self._held[seq_id].blocks
        missing = self.blocks_for(total_tokens) - len(blocks)
        if missing <= 0:
            return []
        new = self.pool.allocate(missing)
        if new is not None:
            blocks.extend(new)
        return new

    def register(self, seq_id: int, new_token_ids: Sequence[int], num_full: int) -> None:
        """Register the sequence's blocks up to `num_full` full, computed ones; `new_token_ids` are the tokens from its
        first unregistered block (`registered(seq_id)`) on."""
        held = self._held[seq_id]
        size = self.block_size
        first = held.registered
        while held.registered < num_full:
            if held.parent is None:  # after a collision nothing further is findable: stop trying
                held.registered = num_full
                break
            offset = (held.registered - first) * size
            tokens = tuple(new_token_ids[offset : offset + size])
            key = block_key(held.parent_key, held.salt, tokens)
            held.parent = self.pool.register(held.blocks[held.registered], held.parent, key, tokens)
            held.parent_key = key
            held.registered += 1

    def free(self, seq_id: int) -> None:
        """Drop the sequence's cache (it finished, or is preempted to be recomputed); unknown ids are ignored. Its
        registered blocks stay findable, parked, until evicted."""
        held = self._held.pop(seq_id, None)
        if held is not None:
            self.pool.free(held.blocks)
        if self._last is not None and self._last.seq_id == seq_id:
            self._last = None


class CacheQueries:
    """The scheduler port's two read-only cache questions, answered from a `BlockManager` the same way by the engine
    and the simulator's engine. A request asking for prompt logprobs reads no cached block (each position's logits
    are needed)."""

    blocks: BlockManager
    block_size: int

    def num_cached(
        self, seq_id: int, prompt_token_ids: Sequence[int], params: SamplingParams, cache_salt: str | None
    ) -> int:
        """Prompt tokens sequence `seq_id`, not added yet, would find in the prefix cache now; changes nothing."""
        match = self.blocks.lookup(seq_id, prompt_token_ids, cache_salt, params.prompt_logprobs is None)
        return len(match.blocks) * self.block_size

    def can_admit(
        self,
        seq_id: int,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str | None,
        total_tokens: int,
    ) -> bool:
        """Whether `add` then `reserve(seq_id, total_tokens)` would find the cache for it now; changes nothing."""
        reads = params.prompt_logprobs is None
        return self.blocks.can_admit(seq_id, prompt_token_ids, cache_salt, reads, total_tokens)
