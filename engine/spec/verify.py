"""Speculative decoding: the acceptance of drafts (the configuration is engine/spec/config.py).

A row with k drafts computed its last k + 1 positions in the step's forward (engine/model/forward_batch.py). Each
position i samples the token the plain step would sample once the row held its drafts before i (same edits, penalties,
min_tokens, finish checks and (seed, output index) uniform), and the row keeps positions while the token equals the
draft and it has not finished. For a point-mass draft x that is rejection sampling: x is accepted with probability
p(x), and a rejection emits a draw from p without x, renormalised; so greedy output is the plain step's token for
token, sampled output keeps its distribution, and a seeded request its exact output. docs/speculative.md has the
whole design.

A step whose rows are all greedy, or that has one row, and has no grammar, samples all positions in one call
(`sample_at`: the drafts already lie in the token buffer past `seq_len`) and accepts with tensor operations. Other
steps go position by position through `sample_and_record`, the rows still accepting together: a grammar's matcher
must only see emitted tokens, and for sampled rows the positions after the first rejection, which the one call
samples too (a full sort of the vocabulary each under top-p), cost more than the loop's calls save (`python -m
benchmarks spec-accept`, docs/speculative.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from engine.outputs import TokenOutput
from engine.rows import SequenceRows
from engine.sample.grammar import GrammarMatcher
from engine.sample.sampler import SampleResult
from engine.sample.sampling_params import MIN_SAMPLING_TEMPERATURE
from engine.sample.sampling_step import package, sample_and_record, sample_at


@dataclass(frozen=True)
class Verified:
    """A step's sampled tokens, each row's in order, and per sampling row how many it emitted and accepted."""

    tokens: tuple[TokenOutput, ...]
    emitted: torch.Tensor  # [sampling rows] tokens emitted (1 .. drafts + 1)
    accepted: list[int]  # per sampling row, drafts that matched the emitted token at their position


def verify_and_record(
    state: SequenceRows,
    rows: torch.Tensor,
    logits: torch.Tensor,
    seq_ids: list[int],
    drafts: Sequence[Sequence[int]],
    eos_token_ids: torch.Tensor,
    matchers: Mapping[int, GrammarMatcher] | None = None,
) -> Verified:
    """Accept the drafts of the sampling `rows` (`drafts[j]` for row j, possibly empty) from `logits`, which holds
    each row's 1 + len(drafts[j]) positions in order; records the emitted tokens as `sample_and_record` does."""
    greedy = state.temperature[rows] < MIN_SAMPLING_TEMPERATURE
    if seq_ids and not bool(state.constrained[rows].any()) and (len(seq_ids) == 1 or bool(greedy.all())):
        return accept_at_once(state, rows, logits, seq_ids, drafts, eos_token_ids)
    return accept_in_order(state, rows, logits, seq_ids, drafts, eos_token_ids, matchers)


def accept_at_once(
    state: SequenceRows,
    rows: torch.Tensor,
    logits: torch.Tensor,
    seq_ids: list[int],
    drafts: Sequence[Sequence[int]],
    eos_token_ids: torch.Tensor,
) -> Verified:
    """`verify_and_record` for rows without a grammar: every position sampled in one call, accepted with tensor
    operations."""
    num = torch.tensor([len(d) for d in drafts], dtype=torch.long)
    width = num + 1
    which = torch.repeat_interleave(torch.arange(len(seq_ids)), width)  # each position's row, an index into rows
    starts = width.cumsum(0) - width  # each row's first position in `logits`
    offset = torch.arange(int(width.sum())) - starts[which]
    lengths = state.seq_len[rows][which] + offset  # tokens the row holds before each position's token
    result, finish = sample_at(state, rows[which], lengths, logits, eos_token_ids)
    # A position is compared with the draft that lies in the token buffer there (engine.Engine._place_drafts); the
    # bonus position with -1. A row keeps its positions up to the first one that mismatched or finished.
    draft = state.token_buffer[rows[which], lengths.clamp(max=state.max_model_len - 1)].masked_fill(
        offset >= num[which], -1
    )
    match = result.tokens == draft
    stops = (~match | (finish != 0)).long()
    before = stops.cumsum(0) - stops  # stops before each position, over all rows
    keep = before == before[starts][which]  # none before it in its own row
    count = torch.zeros(len(seq_ids), dtype=torch.long).index_add_(0, which, keep.long())
    hits = torch.zeros(len(seq_ids), dtype=torch.long).index_add_(0, which, (keep & match).long())
    kept_rows = rows[which][keep]
    state.token_buffer[kept_rows, lengths[keep]] = result.tokens[keep]
    state.seq_len[rows] += count
    kept = _subset(result, keep)
    kept_ids = [seq_ids[j] for j in which[keep].tolist()]
    outs = package(kept_ids, state.logprobs[kept_rows].tolist(), kept.tokens, finish[keep], kept)
    return Verified(outs, count, hits.tolist())


def _subset(result: SampleResult, keep: torch.Tensor) -> SampleResult:
    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[keep]

    return SampleResult(result.tokens[keep], pick(result.logprobs), pick(result.top_ids), pick(result.top_logprobs))


def accept_in_order(
    state: SequenceRows,
    rows: torch.Tensor,
    logits: torch.Tensor,
    seq_ids: list[int],
    drafts: Sequence[Sequence[int]],
    eos_token_ids: torch.Tensor,
    matchers: Mapping[int, GrammarMatcher] | None = None,
) -> Verified:
    """`verify_and_record` position by position through `sample_and_record`, the rows still accepting together."""
    first = [0, *accumulate(len(d) + 1 for d in drafts)][:-1]  # each row's first position in `logits`
    emitted: list[list[TokenOutput]] = [[] for _ in seq_ids]
    accepted = [0] * len(seq_ids)
    alive, position = list(range(len(seq_ids))), 0
    while alive:
        index = torch.tensor([first[j] + position for j in alive], dtype=torch.long)
        outs = sample_and_record(
            state, rows[alive], logits[index], [seq_ids[j] for j in alive], eos_token_ids, matchers
        )
        going = []
        for j, out in zip(alive, outs, strict=True):
            emitted[j].append(out)
            if position < len(drafts[j]) and out.token_id == drafts[j][position]:
                accepted[j] += 1
                if out.finish_reason is None:
                    going.append(j)
        alive, position = going, position + 1
    tokens = tuple(out for row in emitted for out in row)
    return Verified(tokens, torch.tensor([len(row) for row in emitted], dtype=torch.long), accepted)
