"""Prompt chunks' shortcuts in engine/model/attention.py (a view for the queries, a cache slice for consecutive blocks,
the causal kernel for chunks from position 0) give exactly what the general path (gathers, boolean mask) gives."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.model.attention import paged_attention, prepare
from engine.model.forward_batch import ForwardBatch, build_forward_batch

BLOCK, HEADS, KV_HEADS, DIM = 4, 6, 2, 16


def _case(lengths: list[int], start: int, shuffled: bool, dtype: torch.dtype) -> tuple[ForwardBatch, tuple, int]:
    generator = torch.Generator().manual_seed(len(lengths) * 10 + start)
    rows, max_blocks = len(lengths), 8
    num_blocks = rows * max_blocks + 2
    order = torch.randperm(num_blocks, generator=generator) if shuffled else torch.arange(num_blocks) + 1
    block_table = order[: rows * max_blocks].view(rows, max_blocks)
    counts = torch.tensor(lengths)
    computed = torch.full((rows,), start)
    tokens = torch.zeros(rows, max_blocks * BLOCK, dtype=torch.long)
    batch, _ = build_forward_batch(torch.arange(rows), counts, computed, computed + counts, tokens, block_table, BLOCK)
    caches = tuple(torch.randn(KV_HEADS, num_blocks * BLOCK, DIM, generator=generator).to(dtype) for _ in range(2))
    query = torch.randn(int(counts.sum()), HEADS, DIM, generator=generator).to(dtype)
    return batch, (query, *caches), num_blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("lengths", "start", "shuffled", "flags"),
    [
        ([13], 0, False, (True, True, True)),  # a lone prompt in a fresh cache
        ([13], 6, False, (True, False, True)),  # a later chunk, or one after a cached prefix
        ([13], 0, True, (True, True, False)),
        ([9, 9], 0, True, (True, True, False)),
        ([9, 5], 3, True, (False, False, False)),  # padding queries: the general path
    ],
)
def test_shortcuts_match_the_general_path(
    lengths: list[int], start: int, shuffled: bool, flags: tuple[bool, bool, bool], dtype: torch.dtype
) -> None:
    batch, (query, key_cache, value_cache), num_blocks = _case(lengths, start, shuffled, dtype)
    (group,) = batch.groups
    assert (group.all_valid, group.causal, group.first_block is not None) == flags
    general = (replace(group, all_valid=False, causal=False, first_block=None),)
    expected = paged_attention(query, key_cache, value_cache, prepare(general, KV_HEADS, num_blocks, BLOCK, True), 0.3)
    prepared = prepare(batch.groups, KV_HEADS, num_blocks, BLOCK, True)
    got = paged_attention(query, key_cache, value_cache, prepared, 0.3)
    assert torch.equal(got, expected)
