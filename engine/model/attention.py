"""Attention over the paged KV cache for a packed ragged batch.

The cache of one layer is [kv_heads, slots, head_dim] with slots grouped in blocks, so the keys of one head in
one block are a contiguous run of block_size * head_dim values. Decode rows use the native kernel where it
is built (engine/platform/native.py): it reads each row's blocks in place; so do prompt chunks over a bfloat16
cache where the build has the prefill kernel (AVX512-BF16). Otherwise attention gathers whole blocks with a single
index_select into a [kv_heads * rows, context, head_dim] layout that batched matmuls and SDPA use without another
copy (prompt chunks from position 0 in one consecutive run of blocks need no gather).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model.forward_batch import AttentionGroup
from engine.platform.native import DecodeKernel, PrefillKernel


@dataclass(frozen=True)
class PreparedGroup:
    """A group with the gather index and mask that all layers of one step share."""

    group: AttentionGroup
    block_index: torch.Tensor | None  # [kv_heads * rows * context blocks] into the cache as [heads*blocks, ...]
    mask_bias: torch.Tensor | None  # [kv_heads * rows, 1, context] 0 or -inf; torch-path decode groups only
    block_size: int
    # (token_start, counts) [rows] each: where each row's chunk lies in the packed queries; prompt chunks the
    # native prefill kernel reads only
    chunks: tuple[torch.Tensor, torch.Tensor] | None = None


def prepare(
    groups: tuple[AttentionGroup, ...],
    kv_heads: int,
    num_blocks: int,
    block_size: int,
    native_decode: bool,
    native_prefill: bool = False,
) -> tuple[PreparedGroup, ...]:
    """Per-step attention metadata shared by every layer; nothing to gather for rows a kernel reads in place."""
    prepared = []
    for group in groups:
        if group.is_decode and native_decode:
            prepared.append(PreparedGroup(group, None, None, block_size))
            continue
        if not group.is_decode and native_prefill:
            # Padding queries repeat their row's first token, so column 0 is each row's first token.
            chunks = (group.query_index[:, 0].contiguous(), group.query_valid.sum(1))
            prepared.append(PreparedGroup(group, None, None, block_size, chunks))
            continue
        heads = torch.arange(kv_heads, device=group.block_table.device)
        # Ordered (kv_head, row, block): the gathered blocks line up as [kv_heads, rows, context, head_dim].
        block_index = (heads[:, None, None] * num_blocks + group.block_table[None]).reshape(-1)
        bias = None
        if group.is_decode:
            rows, context = group.mask.shape[0], group.mask.shape[-1]
            bias = torch.zeros(rows, context, device=group.mask.device)
            bias.masked_fill_(~group.mask.view(rows, context), float("-inf"))
            bias = bias.expand(kv_heads, rows, context).reshape(kv_heads * rows, 1, context)
        prepared.append(PreparedGroup(group, block_index, bias, block_size))
    return tuple(prepared)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    groups: tuple[PreparedGroup, ...],
    scale: float,
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
    decode_kernel: DecodeKernel | None = None,
    prefill_kernel: PrefillKernel | None = None,
) -> torch.Tensor:
    """query: [tokens, heads, head_dim]; caches: [kv_heads, slots, head_dim]. Returns [tokens, heads, head_dim].

    The current step's keys and values must already be written to the cache. `decode_kernel` and
    `prefill_kernel`, when given, must match how `groups` were prepared (`native_decode`, `native_prefill`).
    """

    def decode(q: torch.Tensor, prepared: PreparedGroup) -> torch.Tensor:
        if prepared.block_index is None:
            assert decode_kernel is not None, "groups were prepared for the native kernel"
            group = prepared.group
            return decode_kernel(
                q, key_cache, value_cache, group.block_table, group.context_lens, prepared.block_size, scale
            )
        return _decode(q, key_cache, value_cache, prepared, scale, scratch)

    if len(groups) == 1 and groups[0].group.is_decode:
        # Pure decode step: the packed tokens are exactly the group's rows, in order.
        return decode(query, groups[0])
    native = next((prepared for prepared in groups if prepared.chunks is not None), None)
    if native is None and len(groups) == 1 and groups[0].group.all_valid:
        # Only prompt chunks, all of one length: the packed tokens are the rows' chunks in order, a view away.
        chunks = query.view(*groups[0].group.query_index.shape, *query.shape[1:])
        attended = _prefill(chunks, key_cache, value_cache, groups[0], scale)
        return attended.reshape(query.shape)
    if native is None:
        out = torch.empty_like(query)
    else:  # the kernel writes its rows' tokens of a packed output; decode rows, if any, fill in the rest below
        assert prefill_kernel is not None and native.chunks is not None, "groups were prepared for the prefill kernel"
        token_start, counts = native.chunks
        group = native.group
        out = prefill_kernel(
            query, key_cache, value_cache, group.block_table, token_start, counts, group.context_lens,
            native.block_size, scale,
        )  # fmt: skip
    for prepared in groups:  # at most two: decode rows and prefill rows
        group = prepared.group
        if group.is_decode:
            rows = group.query_index[:, 0]
            out[rows] = decode(query[rows], prepared)
        elif prepared.chunks is None:
            attended = _prefill(query[group.query_index], key_cache, value_cache, prepared, scale)
            out[group.query_index[group.query_valid]] = attended[group.query_valid]
    return out


def _gather(cache: torch.Tensor, prepared: PreparedGroup, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """[kv_heads * rows, context, head_dim]: whole blocks, one contiguous copy each.

    `scratch`, when given, is a flat buffer reused across layers; writing into it (rather than allocating a
    fresh multi-megabyte tensor per layer) saves the page faults of a new allocation."""
    assert prepared.block_index is not None
    kv_heads, slots, dim = cache.shape
    block_size = prepared.block_size
    rows, blocks = prepared.group.block_table.shape
    by_block = cache.view(kv_heads * (slots // block_size), block_size * dim)
    shape = (kv_heads * rows, blocks * block_size, dim)
    if scratch is None or scratch.numel() < by_block.shape[1] * prepared.block_index.numel():
        return by_block.index_select(0, prepared.block_index).view(shape)
    out = scratch[: by_block.shape[1] * prepared.block_index.numel()].view(-1, by_block.shape[1])
    torch.index_select(by_block, 0, prepared.block_index, out=out)
    return out.view(shape)


def _decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    prepared: PreparedGroup,
    scale: float,
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One query per row, as batched matmuls over (kv_head, row) pairs; grouped-query heads share their keys.

    For single-token queries this beats the fused SDPA kernels on the CPU, whose per-call setup dominates."""
    assert prepared.mask_bias is not None
    rows, heads, dim = query.shape
    kv_heads = key_cache.shape[0]
    group = heads // kv_heads
    key_scratch, value_scratch = scratch if scratch is not None else (None, None)
    keys, values = _gather(key_cache, prepared, key_scratch), _gather(value_cache, prepared, value_scratch)
    grouped = query.view(rows, kv_heads, group, dim).transpose(0, 1).reshape(kv_heads * rows, group, dim)
    bias = prepared.mask_bias.to(grouped.dtype)  # float32 as prepared; a bfloat16 cache needs it cast
    scores = torch.baddbmm(bias, grouped, keys.transpose(1, 2), alpha=scale)  # [kv*rows, group, ctx]
    # Softmax in float32 whatever the cache's dtype, as transformers' attention does.
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
    attended = torch.bmm(weights, values)  # [kv_heads * rows, group, dim]
    return attended.view(kv_heads, rows, group, dim).transpose(0, 1).reshape(rows, heads, dim)


def _prefill(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, prepared: PreparedGroup, scale: float
) -> torch.Tensor:
    """q: [rows, max_q, heads, dim] (a chunk per row). Returns [rows, max_q, heads, dim]."""
    kv_heads = key_cache.shape[0]
    rows = q.shape[0]
    group = prepared.group
    if group.first_block is not None:  # consecutive blocks: the context is a slice of the cache, no copy
        first = group.first_block * prepared.block_size
        context = slice(first, first + group.block_table.shape[1] * prepared.block_size)
        keys, values = key_cache[None, :, context], value_cache[None, :, context]
    else:
        keys = _gather(key_cache, prepared).view(kv_heads, rows, -1, q.shape[-1]).transpose(0, 1)
        values = _gather(value_cache, prepared).view(kv_heads, rows, -1, q.shape[-1]).transpose(0, 1)
    # Chunks from position 0 attend causally: the kernel skips the blocks above the diagonal instead of masking them
    # (masked scores weigh exactly 0 either way). Keys past a row's chunk are later positions, so they stay out.
    mask = None if group.causal else group.mask
    attended = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys, values, attn_mask=mask, is_causal=group.causal, scale=scale, enable_gqa=True
    )  # [rows, heads, max_q, dim]
    return attended.transpose(1, 2)
