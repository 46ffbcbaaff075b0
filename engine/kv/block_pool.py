"""KV cache blocks with reference counts, and the prefix cache that keeps full blocks findable after use.

A full block (block_size computed tokens) can be registered under a key chained from its parent block's key and
its own token ids, so a later sequence whose prompt starts with the same tokens attaches the block instead of
computing it again. A block is shared by reference count; when its last user leaves, a registered block is not
freed but parked, and only evicted when an allocation finds no plain free block: the least recently released
first, while the cache is being hit. Once a whole cache's worth of blocks has been handed out without a lookup
finding anything (a workload that shares no prefix), the order of eviction buys no hits, and the most recently
released block goes first instead: its memory is still warm in the CPU's caches, as a freed block is with
caching off; cycling through the whole KV cache instead slows decoding (measured: docs/prefix_caching.md).
The first hit brings back least-recently-released order.

The key is a Python hash, so two different prefixes may collide. A hit therefore also compares what the key
stands for: the block's own token ids, and its parent's identity (block id and the generation of that id, bumped
each time the id is handed out again). By induction a matched chain holds exactly the tokens asked for, and a
sequence never reads a block computed for other tokens.

A cached block's parent is always a root or a cached block, so every cached block is reachable from a root: when
a block is evicted, its cached descendants are dropped from the cache with it (parked ones become plain free
blocks). Otherwise a child whose parent was evicted first would sit under its key unreachable, and when the same
prefix is computed again its new block would find the key held by the orphan and stay private, so the prefix
would be cached again only up to the evicted block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

# Who a block follows: the previous block (id, generation), or for a sequence's first block its cache salt.
Parent = tuple[int, int] | tuple[str, str | None]


def root(salt: str | None) -> Parent:
    return ("salt", salt)


def _block_of(parent: Parent) -> int | None:
    """The block a block follows; None for a sequence's first block (its parent is its salt)."""
    head = parent[0]
    return head if isinstance(head, int) else None


def block_key(parent_key: int | None, salt: str | None, tokens: tuple[int, ...]) -> int:
    return hash((salt, tokens)) if parent_key is None else hash((parent_key, tokens))


@dataclass(frozen=True, slots=True)
class CachedBlock:
    key: int
    parent: Parent
    tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The cached blocks a token sequence starts with, and the key chain to extend when more blocks fill."""

    blocks: tuple[int, ...]
    keys: tuple[int, ...]


class BlockPool:
    """Hands out block ids, all or nothing, so a failed request never holds a partial reservation."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        # Popping from the end hands out low ids first, which keeps a lightly loaded cache compact.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._parked: OrderedDict[int, None] = OrderedDict()  # registered, unused: least recently released first
        self._refs = [0] * num_blocks
        self._generation = [0] * num_blocks
        self._cached: dict[int, CachedBlock] = {}  # block id -> what it holds
        self._by_key: dict[int, int] = {}  # key -> block id
        self._children: dict[int, dict[int, None]] = {}  # cached block -> its cached children, in order
        self._handed_out_since_hit = 0  # blocks allocated since a lookup last found a cached block
        self.epoch = 0  # bumped whenever the set of cached blocks changes: a match found before is still right

    # ----- counts -----
    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: never-registered free ones and parked cached ones."""
        return len(self._free) + len(self._parked)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached_free(self) -> int:
        """Parked blocks: free to take, but still holding a cached prefix."""
        return len(self._parked)

    def is_parked(self, block: int) -> bool:
        return self._refs[block] == 0

    @property
    def evicts_most_recent(self) -> bool:
        """True while lookups keep missing: a whole cache's worth of blocks handed out since the last hit."""
        return self._handed_out_since_hit >= self.num_blocks

    # ----- allocation -----
    def allocate(self, count: int) -> list[int] | None:
        if count > self.num_free:
            return None
        taken: list[int] = []
        most_recent = self.evicts_most_recent
        while len(taken) < count:
            if self._free:
                taken.append(self._free.pop())
            else:  # evicting a block frees its parked descendants, which the next rounds take first
                block, _ = self._parked.popitem(last=most_recent)
                self._forget(block)
                taken.append(block)
        self._handed_out_since_hit += count
        for block in taken:
            self._refs[block] = 1
            self._generation[block] += 1
        return taken

    def acquire(self, blocks: Sequence[int]) -> None:
        """Share cached blocks: one more reference each (a parked block is in use again)."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._parked[block]
            self._refs[block] += 1

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block. The tail goes first, so a sequence's later (less shared) blocks are
        evicted before its prefix."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._cached:
                    self._parked[block] = None
                else:
                    self._free.append(block)

    # ----- the prefix cache -----
    def identity(self, block: int) -> Parent:
        return (block, self._generation[block])

    def register(self, block: int, parent: Parent, key: int, tokens: tuple[int, ...]) -> Parent | None:
        """Make a full, computed block findable, and return who the sequence's next block follows. If another
        block already holds this prefix, this one stays private and the chain goes on through the holder (both
        hold the same values); None if the key names other tokens (a collision: register no further), or if
        the parent has left the cache since (evicted while this sequence ran, after being shared with it)."""
        if not self._is_cached(parent):
            return None
        holder = self._by_key.get(key)
        if holder is None:
            self._cached[block] = CachedBlock(key, parent, tokens)
            self.epoch += 1
            self._by_key[key] = block
            parent_block = _block_of(parent)
            if parent_block is not None:
                self._children.setdefault(parent_block, {})[block] = None
            return self.identity(block)
        cached = self._cached[holder]
        return self.identity(holder) if cached.parent == parent and cached.tokens == tokens else None

    def match(self, token_ids: Sequence[int], block_size: int, salt: str | None, max_blocks: int) -> PrefixMatch:
        """The longest run of cached blocks, at most `max_blocks`, that `token_ids` starts with."""
        blocks: list[int] = []
        keys: list[int] = []
        parent, parent_key = root(salt), None
        for index in range(max_blocks):
            tokens = tuple(token_ids[index * block_size : (index + 1) * block_size])
            key = block_key(parent_key, salt, tokens)
            block = self._by_key.get(key)
            if block is None:
                break
            cached = self._cached[block]
            if cached.parent != parent or cached.tokens != tokens:
                break  # a hash collision: the key names other tokens
            blocks.append(block)
            keys.append(key)
            parent, parent_key = self.identity(block), key
        if blocks:
            self.note_hit()
        return PrefixMatch(tuple(blocks), tuple(keys))

    def note_hit(self) -> None:
        """A lookup found cached blocks: the cache is being hit, so evict least recently released first again."""
        self._handed_out_since_hit = 0

    def _is_cached(self, parent: Parent) -> bool:
        """A root, or a block that is cached still under this identity (not reused since)."""
        block = _block_of(parent)
        return block is None or (block in self._cached and self.identity(block) == parent)

    def _forget(self, block: int) -> None:
        """Drop an evicted block from the cache, and its cached descendants, which no lookup could reach any more:
        parked ones become plain free blocks; ones in use stay with their sequences, uncached."""
        self.epoch += 1
        parent = _block_of(self._cached[block].parent)
        if parent is not None:
            self._children.get(parent, {}).pop(block, None)
        stack = [block]
        while stack:  # iterative: a long context is a deep chain
            current = stack.pop()
            cached = self._cached.pop(current)
            del self._by_key[cached.key]
            stack.extend(self._children.pop(current, {}))
            if current != block and current in self._parked:
                del self._parked[current]
                self._free.append(current)
