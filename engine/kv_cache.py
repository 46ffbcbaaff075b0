"""The paged KV cache: one preallocated tensor per layer and a free list of fixed-size blocks.

A sequence owns a list of block ids (its block table); adding or freeing a sequence touches only its own
blocks, so sequences join and leave between any two steps without copying anyone else's cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


class BlockAllocator:
    """Hands out block ids; all-or-nothing so a failed request never holds a partial reservation."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        # Popping from the end hands out low ids first, which keeps a lightly loaded cache compact.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        if count > len(self._free):
            return None
        if count == 0:
            return []
        taken = self._free[-count:]
        del self._free[-count:]
        return taken

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class PagedKVCache:
    """Key and value storage for every layer, addressed by slot = block_id * block_size + offset within each head."""

    def __init__(self, shape: KVCacheShape, dtype: torch.dtype, device: torch.device) -> None:
        self.shape = shape
        # [layers, 2 (key, value), kv_heads, slots, head_dim]: head-major, so that a block of one head is one
        # contiguous run of block_size * head_dim values and attention gathers whole blocks, not single tokens.
        self.data = torch.zeros(
            shape.num_layers, 2, shape.num_kv_heads, shape.num_slots, shape.head_dim, dtype=dtype, device=device
        )

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (keys, values) of one layer, each [kv_heads, slots, head_dim]."""
        return self.data[index, 0], self.data[index, 1]
