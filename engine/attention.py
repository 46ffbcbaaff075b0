"""Attention over the paged KV cache for a packed ragged batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.forward_batch import AttentionGroup


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    groups: tuple[AttentionGroup, ...],
    scale: float,
) -> torch.Tensor:
    """query: [tokens, heads, head_dim]; caches: [slots, kv_heads, head_dim]. Returns [tokens, heads, head_dim].

    The current step's keys and values must already be written to the cache.
    """
    if len(groups) == 1 and groups[0].is_decode:
        # Fast path for pure decode steps: the packed tokens are exactly the group's rows in order.
        return _attend(query[:, None], key_cache, value_cache, groups[0], scale)[:, 0]
    out = torch.empty_like(query)
    for group in groups:  # at most two groups: decode rows and prefill rows
        q = query[group.query_index]  # [rows, max_q, heads, head_dim]
        attended = _attend(q, key_cache, value_cache, group, scale)
        out[group.query_index[group.query_valid]] = attended[group.query_valid]
    return out


def _attend(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, group: AttentionGroup, scale: float
) -> torch.Tensor:
    keys = key_cache[group.key_slots]  # [rows, max_ctx, kv_heads, head_dim]
    values = value_cache[group.key_slots]
    attended = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=group.mask,
        scale=scale,
        enable_gqa=True,
    )  # [rows, heads, max_q, head_dim]
    return attended.transpose(1, 2)
