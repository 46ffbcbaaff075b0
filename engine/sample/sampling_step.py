"""The sampling half of a step: edit and sample the logits of the rows whose pending tokens ran out, append the
tokens to their rows, advance their grammars, and decide which sequences finish (EOS, a stop token id, the end of
the grammar, max_tokens or the context window).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace

import torch

from engine.outputs import FinishReason, TokenOutput
from engine.platform.native import Kernels
from engine.rows import SequenceRows
from engine.sample.grammar import GrammarMatcher, fill_bitmasks
from engine.sample.kernels import argmax_rows
from engine.sample.logits_processors import (
    AllowedTokens,
    BannedTokens,
    LogitBias,
    LogitsEdits,
    OutputPenalties,
    RepetitionPenalty,
    token_mask,
)
from engine.sample.sampler import RowSampling, SampleResult, sample

_NOT_FINISHED, _STOPPED, _LENGTH, _DEAD_END = 0, 1, 2, 3
logger = logging.getLogger("batchserve.engine")


def sample_and_record(
    state: SequenceRows,
    rows: torch.Tensor,
    logits: torch.Tensor,
    seq_ids: list[int],
    eos_token_ids: torch.Tensor,
    matchers: Mapping[int, GrammarMatcher] | None = None,
    *,
    kernels: Kernels | None,
) -> tuple[TokenOutput, ...]:
    """Sample one token for each of `rows` (the sequences `seq_ids`) from its `logits` row and record it.
    `matchers`: the grammar state of each constrained sequence, by id. `kernels`: the runner's compiled kernels,
    which the sampler runs too (None: torch)."""
    if not seq_ids:
        return ()
    plain = state.all_plain_greedy  # then no row has a grammar or wants logprobs
    constrained = [] if plain else state.constrained[rows].nonzero()[:, 0].tolist()  # positions in `rows`
    row_matchers = [matchers[seq_ids[i]] for i in constrained] if matchers else []
    result, dead_ends = _sample(
        state, rows, state.seq_len[rows], logits, eos_token_ids, row_matchers, constrained, kernels
    )
    tokens = result.tokens
    positions = state.seq_len[rows]
    state.token_buffer[rows, positions] = tokens
    state.seq_len[rows] += 1
    finish = finish_codes(state, rows, state.seq_len[rows], tokens, eos_token_ids)
    if row_matchers:
        ended, refused = _advance_grammars(row_matchers, constrained, tokens, seq_ids)
        finish[ended] = _STOPPED
        finish[refused] = _DEAD_END
        finish[dead_ends] = _DEAD_END
    wanted = [-1] * len(seq_ids) if plain else state.logprobs[rows].tolist()
    return package(seq_ids, wanted, tokens, finish, result)


def sample_at(
    state: SequenceRows,
    rows: torch.Tensor,
    lengths: torch.Tensor,
    logits: torch.Tensor,
    eos_token_ids: torch.Tensor,
    *,
    kernels: Kernels | None,
) -> tuple[SampleResult, torch.Tensor]:
    """Sample, without recording, the token after the first `lengths[i]` tokens of `rows[i]`'s token buffer (rows
    may repeat with different lengths: a speculating row's positions, its drafts in the buffer past `seq_len`), as
    `sample_and_record` would once the row held exactly those tokens. Rows without a grammar only. Returns the
    sample and each token's finish code as `package` takes them (0: not finished)."""
    result, _ = _sample(state, rows, lengths, logits, eos_token_ids, [], [], kernels)
    return result, finish_codes(state, rows, lengths + 1, result.tokens, eos_token_ids)


def _sample(
    state: SequenceRows,
    rows: torch.Tensor,
    lengths: torch.Tensor,
    logits: torch.Tensor,
    eos_token_ids: torch.Tensor,
    row_matchers: list[GrammarMatcher],
    constrained: list[int],
    kernels: Kernels | None,
) -> tuple[SampleResult, torch.Tensor]:
    """Edit and sample `logits` for rows holding `lengths` tokens; also the positions whose grammar allows nothing."""
    logits = logits.to("cpu") if logits.device.type != "cpu" else logits
    if state.all_plain_greedy:
        # What the general path gives such rows (no edits, no scores) without its ~30 small ops: at batch 1 they
        # were 0.34 of 5.4 ms a step, this takes 0.16.
        return SampleResult(argmax_rows(logits, kernels), None, None, None), torch.zeros(0, dtype=torch.long)
    counter = lengths - state.prompt_len[rows]  # index of the output token being sampled
    num_logprobs = int(state.logprobs[rows].max())
    min_p = state.min_p[rows]
    params = RowSampling(
        temperature=state.temperature[rows],
        top_p=state.top_p[rows],
        top_k=state.top_k[rows],
        seed=state.seed[rows],
        counter=counter,
        num_logprobs=max(num_logprobs, 0),
        want_logprobs=num_logprobs >= 0,
        min_p=min_p if bool((min_p > 0).any()) else None,
    )
    edits = _edits(state, rows, lengths, counter, logits.shape[-1], eos_token_ids)
    dead_ends = torch.zeros(0, dtype=torch.long)
    if row_matchers:
        positions = torch.tensor(constrained, dtype=torch.long)
        allowed = fill_bitmasks(row_matchers, logits.shape[-1])
        # A grammar that allows nothing would leave its row no finite logit (a NaN under sampling, which would fail
        # the whole step): that row samples unmasked, and its sequence ends below with the grammar's error.
        stuck = ~allowed.any(dim=1)
        allowed[stuck] = True
        dead_ends = positions[stuck]
        edits = replace(edits, grammar=AllowedTokens(positions, allowed))
    return sample(logits, params, edits, kernels), dead_ends


def _advance_grammars(
    matchers: list[GrammarMatcher], positions: list[int], tokens: torch.Tensor, seq_ids: list[int]
) -> tuple[list[int], list[int]]:
    """Feed each constrained row its sampled token. Returns the positions whose grammar has ended, and those whose
    grammar refused the token: its mask allowed nothing (a dead end), or a backend fault let through a token it
    does not accept. Either way the sequence cannot go on, and only it ends."""
    ended, refused = [], []
    sampled = tokens.tolist()
    for matcher, position in zip(matchers, positions, strict=True):
        token = sampled[position]
        if not matcher.accept_token(token):
            logger.warning("sequence %d: its grammar refused token %d; ending it", seq_ids[position], token)
            refused.append(position)
        elif matcher.is_terminated():
            ended.append(position)
    return ended, refused


def _edits(
    state: SequenceRows,
    rows: torch.Tensor,
    lengths: torch.Tensor,
    counter: torch.Tensor,
    vocab: int,
    eos_token_ids: torch.Tensor,
) -> LogitsEdits:
    """The logits edits of this step's sampling rows; a feature no row uses is None (one comparison)."""
    biased = (state.num_bias[rows] > 0).nonzero()[:, 0]
    restricted = state.restricted[rows].nonzero()[:, 0]
    too_early = (counter < state.min_tokens[rows]).nonzero()[:, 0]  # min_tokens not reached yet
    repeating = (state.repetition[rows] != 1.0).nonzero()[:, 0]
    penalised = ((state.presence[rows] != 0) | (state.frequency[rows] != 0)).nonzero()[:, 0]
    bias = allowed = banned = repetition = penalties = None
    if len(biased):
        r = rows[biased]
        width = int(state.num_bias[r].max())
        bias = LogitBias(biased, state.bias_ids[r, :width], state.bias_values[r, :width])
    if len(restricted):
        allowed = AllowedTokens(restricted, state.allowed[rows[restricted]])
    if len(too_early):
        r = rows[too_early]
        eos = eos_token_ids[None, :].expand(len(r), -1).masked_fill(state.ignore_eos[r][:, None], -1)
        banned = BannedTokens(too_early, torch.cat([state.stop_ids[r], eos], dim=1))
    if len(repeating):
        r = rows[repeating]
        seen = _seen_tokens(state, r, lengths[repeating], vocab)
        repetition = RepetitionPenalty(repeating, seen, state.repetition[r])
    if len(penalised):
        r = rows[penalised]
        counts = _output_counts(state, r, lengths[penalised], vocab)
        penalties = OutputPenalties(penalised, counts, state.presence[r], state.frequency[r])
    return LogitsEdits(bias=bias, allowed=allowed, banned=banned, repetition=repetition, penalties=penalties)


def _seen_tokens(state: SequenceRows, rows: torch.Tensor, end: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] bool: the token occurs in the row's first `end` tokens (prompt and output so far)."""
    width = int(end.max())
    ids = state.token_buffer[rows, :width].masked_fill(torch.arange(width)[None, :] >= end[:, None], -1)
    return token_mask(ids, vocab)


def _output_counts(state: SequenceRows, rows: torch.Tensor, end: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] how often each token appears in each row's output among its first `end` tokens."""
    start = state.prompt_len[rows]
    width = int((end - start).max())
    counts = torch.zeros(len(rows), vocab)
    if width == 0:
        return counts
    pos = start[:, None] + torch.arange(width)[None, :]
    valid = pos < end[:, None]
    ids = state.token_buffer[rows[:, None], pos.clamp(max=state.max_model_len - 1)]
    return counts.scatter_add_(1, ids, valid.float())


def finish_codes(
    state: SequenceRows, rows: torch.Tensor, lengths: torch.Tensor, tokens: torch.Tensor, eos_token_ids: torch.Tensor
) -> torch.Tensor:
    """Each row's finish code for its token `tokens[i]`, once it holds `lengths[i]` tokens with it."""
    is_eos = torch.isin(tokens, eos_token_ids) & ~state.ignore_eos[rows]
    is_stop_id = (state.stop_ids[rows] == tokens[:, None]).any(dim=-1)
    generated = lengths - state.prompt_len[rows]
    at_length = (generated >= state.max_tokens[rows]) | (lengths >= state.max_model_len)
    codes = torch.full_like(tokens, _NOT_FINISHED)
    codes[at_length] = _LENGTH
    codes[is_eos | is_stop_id] = _STOPPED
    return codes


def package(
    seq_ids: list[int],
    wanted: list[int],
    tokens: torch.Tensor,
    finish: torch.Tensor,
    result: SampleResult,
) -> tuple[TokenOutput, ...]:
    """One TokenOutput per row, with only the logprobs that row asked for (-1: none)."""
    reasons = {
        _NOT_FINISHED: None, _STOPPED: FinishReason.STOP, _LENGTH: FinishReason.LENGTH, _DEAD_END: FinishReason.GRAMMAR
    }  # fmt: skip
    token_list, finish_list = tokens.tolist(), finish.tolist()
    chosen = result.logprobs.tolist() if result.logprobs is not None else [None] * len(seq_ids)
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(seq_ids)
    if result.top_ids is not None and result.top_logprobs is not None:
        tops = [
            tuple(zip(i, lp, strict=True))
            for i, lp in zip(result.top_ids.tolist(), result.top_logprobs.tolist(), strict=True)
        ]
    return tuple(
        TokenOutput(
            seq_id,
            token,
            logprob if want >= 0 else None,
            top[:want] if want >= 0 else None,
            reasons[code],
        )
        for seq_id, want, token, logprob, top, code in zip(
            seq_ids, wanted, token_list, chosen, tops, finish_list, strict=True
        )
    )
