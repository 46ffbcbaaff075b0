"""The paged KV cache: one preallocated tensor per layer, addressed in fixed-size blocks.

Which blocks a sequence holds is engine/kv/block_manager.py's; adding or freeing a sequence touches only its own
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
