"""What one forward pass needs, built with tensor ops from the scheduled rows.

Tokens of all scheduled sequences are packed into one flat batch (no padding for the projections and MLP).
Attention is the one place that needs per-sequence structure: rows are split into a decode group (one query
each: a new token, or one position of a row verifying drafts) and a prefill group (a chunk of prompt tokens each),
and each group gathers its context blocks from the paged cache with a boolean mask over the padded positions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class AttentionGroup:
    """Rows of the batch that attend with the same query length layout."""

    query_index: torch.Tensor  # [rows, max_q] index into the packed tokens (padding repeats a valid token)
    query_valid: torch.Tensor  # [rows, max_q] bool, False for padding queries
    block_table: torch.Tensor  # [rows, context blocks] the cache blocks holding each row's context, in order
    mask: torch.Tensor  # [rows, 1, max_q, context blocks * block_size] bool, True where the query may attend
    context_lens: torch.Tensor  # [rows] keys in each row's context once this step's tokens are written
    is_decode: bool
    # Host-side facts that let a prompt chunk skip gathers and masks (engine/model/attention.py):
    all_valid: bool = False  # no padding queries: every row computes max_q tokens
    causal: bool = False  # every row starts at position 0, so `mask` is plain causal (top-left aligned)
    first_block: int | None = None  # a lone row whose context blocks are consecutive, from this one


@dataclass(frozen=True)
class PromptScoring:
    """The prompt positions a step scores: the hidden state at packed index `index[i]` rates token `target[i]`."""

    index: torch.Tensor  # [n] packed token index; the hidden state at position p scores the prompt token at p + 1
    target: torch.Tensor  # [n] the prompt token id being scored
    top_k: int  # alternatives to report per position: the most any scoring row asks for
    # Engine bookkeeping, kept on the host: per scheduled row, the first prompt position scored and how many.
    first_position: torch.Tensor  # [rows]
    count: torch.Tensor  # [rows], 0 for rows that score nothing this step


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens]
    slot_mapping: torch.Tensor  # [tokens] where each token's key and value are written
    groups: tuple[AttentionGroup, ...]
    # [sampling positions] packed index of the last token of each sampling row, and of each of its drafts before
    # it (engine/spec/verify.py): a row with k drafts contributes its last k + 1 tokens, in order
    sample_index: torch.Tensor
    scoring: PromptScoring | None = None  # None when no scheduled row scores prompt positions this step

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def _slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat cache slots of `positions` ([rows, n]) given each row's block table ([rows, max_blocks])."""
    blocks = torch.gather(block_table, 1, torch.div(positions, block_size, rounding_mode="floor"))
    return blocks * block_size + positions % block_size


def _group(
    token_start: torch.Tensor,
    start: torch.Tensor,
    count: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    is_decode: bool,
) -> AttentionGroup:
    context = start + count
    max_q = int(count.max())
    num_blocks = -(-int(context.max()) // block_size)
    q_offsets = torch.arange(max_q)
    query_valid = q_offsets[None, :] < count[:, None]
    # Padding queries point at the row's first token and at position 0, so their softmax is well defined.
    query_index = token_start[:, None] + torch.where(query_valid, q_offsets[None, :], 0)
    query_pos = torch.where(query_valid, start[:, None] + q_offsets[None, :], 0)
    key_pos = torch.arange(num_blocks * block_size)
    mask = (key_pos[None, None, :] <= query_pos[:, :, None]).unsqueeze(1)
    table = block_table[:, :num_blocks]
    if is_decode:  # one query a row: the flags below serve prompt chunks only
        return AttentionGroup(query_index, query_valid, table, mask, context, is_decode)
    first_block = None
    if table.shape[0] == 1 and bool((table[0, 1:] - table[0, :-1] == 1).all()):
        first_block = int(table[0, 0])
    all_valid, causal = bool(query_valid.all()), not bool(start.any())
    return AttentionGroup(query_index, query_valid, table, mask, context, is_decode, all_valid, causal, first_block)


def _prompt_scoring(
    rows: torch.Tensor,
    start: torch.Tensor,
    num_tokens: torch.Tensor,
    token_start: torch.Tensor,
    token_buffer: torch.Tensor,
    prompt_len: torch.Tensor,
    prompt_top_k: torch.Tensor,
    prompt_scored: torch.Tensor,
) -> PromptScoring | None:
    top_k = prompt_top_k[rows]
    wants = top_k >= 0
    if not bool(wants.any()):
        return None
    # A chunk computing positions [start, start + n) scores prompt tokens start + 1 .. start + n, except those
    # past the prompt and those already delivered before a preemption made the prompt be recomputed.
    first = torch.maximum(start + 1, prompt_scored[rows])
    end = torch.minimum(start + num_tokens + 1, prompt_len[rows])
    count = torch.where(wants, (end - first).clamp(min=0), 0)
    total = int(count.sum())
    if total == 0:
        return None
    offset = torch.arange(total) - torch.repeat_interleave(torch.cumsum(count, 0) - count, count, output_size=total)
    position = torch.repeat_interleave(first, count, output_size=total) + offset
    index = torch.repeat_interleave(token_start - start, count, output_size=total) + position - 1
    target = token_buffer[torch.repeat_interleave(rows, count, output_size=total), position]
    return PromptScoring(index, target, int(top_k.max()), first, count)


def build_forward_batch(
    rows: torch.Tensor,
    num_tokens: torch.Tensor,
    num_computed: torch.Tensor,
    seq_len: torch.Tensor,
    token_buffer: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    *,
    prompt_len: torch.Tensor | None = None,
    prompt_top_k: torch.Tensor | None = None,
    prompt_scored: torch.Tensor | None = None,
    num_drafts: torch.Tensor | None = None,
) -> tuple[ForwardBatch, torch.Tensor]:
    """Pack the scheduled rows. Returns the batch and a bool [rows] telling which rows sample a token.

    rows, num_tokens: [rows] the engine rows scheduled and how many of their pending tokens to compute.
    num_computed, seq_len: [max_rows] per-row tokens already in the cache and tokens known.
    prompt_len, prompt_top_k, prompt_scored: [max_rows] per-row prompt length, prompt alternatives wanted (-1: no
    prompt scoring) and the first prompt position not scored yet; all three or none.
    num_drafts: [rows] draft tokens at the end of each row's `num_tokens` (written in `token_buffer` past its
    `seq_len`); only a row whose known tokens this step completes may carry drafts.
    """
    start = num_computed[rows]
    total = int(num_tokens.sum())
    scoring_args = (prompt_len, prompt_top_k, prompt_scored)
    if total == len(rows) and num_drafts is None:
        return _decode_batch(rows, start, seq_len, token_buffer, block_table, block_size, scoring_args)
    token_start = torch.cumsum(num_tokens, 0) - num_tokens
    row_of_token = torch.repeat_interleave(rows, num_tokens, output_size=total)
    offset = torch.arange(total) - torch.repeat_interleave(token_start, num_tokens, output_size=total)
    positions = torch.repeat_interleave(start, num_tokens, output_size=total) + offset
    input_ids = token_buffer[row_of_token, positions]
    slot_mapping = _slots(block_table[row_of_token], positions[:, None], block_size)[:, 0]

    last = token_start + num_tokens - 1
    if num_drafts is None:
        samples = (start + num_tokens) == seq_len[rows]
        sample_index = last[samples]
    else:
        samples = (start + num_tokens - num_drafts) == seq_len[rows]
        width = (num_drafts + 1)[samples]
        count = int(width.sum())
        within = torch.arange(count) - torch.repeat_interleave(torch.cumsum(width, 0) - width, width, output_size=count)
        sample_index = torch.repeat_interleave(last[samples] - width + 1, width, output_size=count) + within

    # A row that verifies k drafts after its one new token attends as k + 1 decode rows, one per position, sharing
    # its block table: each position sees exactly the keys a plain decode step would, and the decode kernel (and
    # the fused decode step, engine/model/fused_decode.py) reads them in place instead of gathering a chunk.
    one_query = num_tokens == 1
    if num_drafts is not None:
        one_query = one_query | ((num_drafts > 0) & (num_tokens == num_drafts + 1))
    groups = []
    if bool(one_query.any()):
        decode_tokens = torch.repeat_interleave(one_query, num_tokens, output_size=total).nonzero()[:, 0]
        groups.append(
            _group(
                decode_tokens,
                positions[decode_tokens],
                torch.ones_like(decode_tokens),
                block_table[row_of_token[decode_tokens]],
                block_size,
                True,
            )
        )
    chunk = ~one_query
    if bool(chunk.any()):
        groups.append(
            _group(token_start[chunk], start[chunk], num_tokens[chunk], block_table[rows[chunk]], block_size, False)
        )
    scoring = _scoring(rows, start, num_tokens, token_start, token_buffer, scoring_args)
    batch = ForwardBatch(input_ids, positions, slot_mapping, tuple(groups), sample_index, scoring)
    return batch, samples


_ScoringArgs = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def _scoring(
    rows: torch.Tensor,
    start: torch.Tensor,
    num_tokens: torch.Tensor,
    token_start: torch.Tensor,
    token_buffer: torch.Tensor,
    scoring_args: _ScoringArgs,
) -> PromptScoring | None:
    prompt_len, prompt_top_k, prompt_scored = scoring_args
    if prompt_len is None or prompt_top_k is None or prompt_scored is None:
        return None
    return _prompt_scoring(rows, start, num_tokens, token_start, token_buffer, prompt_len, prompt_top_k, prompt_scored)


def _decode_batch(
    rows: torch.Tensor,
    start: torch.Tensor,
    seq_len: torch.Tensor,
    token_buffer: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    scoring_args: _ScoringArgs,
) -> tuple[ForwardBatch, torch.Tensor]:
    """`build_forward_batch` where every row computes one token and none verifies drafts (each decode step): the
    same tensors without the packing's repeats and the split into groups, a dozen ops fewer (~0.1 ms at batch 1)."""
    index = torch.arange(len(rows))  # each row is one token, packed in order
    tables = block_table[rows]
    slot_mapping = _slots(tables, start[:, None], block_size)[:, 0]
    samples = (start + 1) == seq_len[rows]
    ones = torch.ones_like(index)  # tokens each row computes
    group = _group(index, start, ones, tables, block_size, True)
    scoring = _scoring(rows, start, ones, index, token_buffer, scoring_args)
    batch = ForwardBatch(token_buffer[rows, start], start, slot_mapping, (group,), index[samples], scoring)
    return batch, samples


def move_batch(batch: ForwardBatch, device: torch.device) -> ForwardBatch:
    """Copy the metadata to the model's device once per step (a no-op on the CPU)."""
    if device.type == "cpu":
        return batch
    groups = tuple(
        replace(
            g,
            query_index=g.query_index.to(device),
            query_valid=g.query_valid.to(device),
            block_table=g.block_table.to(device),
            mask=g.mask.to(device),
            context_lens=g.context_lens.to(device),
        )
        for g in batch.groups
    )
    scoring = batch.scoring
    if scoring is not None:
        scoring = replace(scoring, index=scoring.index.to(device), target=scoring.target.to(device))
    return ForwardBatch(
        batch.input_ids.to(device),
        batch.positions.to(device),
        batch.slot_mapping.to(device),
        groups,
        batch.sample_index.to(device),
        scoring,
    )
