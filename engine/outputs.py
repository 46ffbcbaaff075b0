"""What the engine hands back after each step."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence
from dataclasses import dataclass


class FinishReason(enum.Enum):
    """Why the engine ended a sequence: only what the engine itself decides (the scheduler's `Outcome` adds
    aborts, errors, timeouts and shutdown)."""

    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_tokens or the context window
    GRAMMAR = "grammar"  # the grammar allows no token here, or refused the sampled one: the sequence cannot go on


@dataclass(frozen=True)
class TokenOutput:
    """One token sampled for one sequence."""

    seq_id: int
    token_id: int
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...] | None
    finish_reason: FinishReason | None  # set when this token ends the sequence


@dataclass(frozen=True)
class PromptLogprobs:
    """Scores of consecutive prompt tokens of one sequence, from `first_position` on (prompt index >= 1: the
    first token has no logprob). Each position is reported once, even if a preempted prompt is recomputed."""

    seq_id: int
    first_position: int
    token_ids: tuple[int, ...]  # the prompt tokens scored
    logprobs: tuple[float, ...]  # log-probability of each under the model, given the tokens before it
    ranks: tuple[int, ...]  # 1 + how many vocabulary entries the model rated strictly higher
    top: tuple[tuple[tuple[int, float], ...], ...]  # per position, the `prompt_logprobs` best (token id, logprob)

    @property
    def positions(self) -> range:
        return range(self.first_position, self.first_position + len(self.token_ids))

    @staticmethod
    def join(parts: Sequence[PromptLogprobs]) -> PromptLogprobs:
        """One sequence's consecutive parts (as delivered, step by step) as one."""
        if not parts:
            raise ValueError("nothing to join")
        for before, after in itertools.pairwise(parts):
            if after.seq_id != before.seq_id or after.first_position != before.positions.stop:
                raise ValueError("prompt logprobs parts are not consecutive parts of one sequence")
        return PromptLogprobs(
            parts[0].seq_id,
            parts[0].first_position,
            tuple(t for p in parts for t in p.token_ids),
            tuple(lp for p in parts for lp in p.logprobs),
            tuple(r for p in parts for r in p.ranks),
            tuple(top for p in parts for top in p.top),
        )


@dataclass(frozen=True)
class DraftStats:
    """Speculation in one step: draft tokens verified, and how many of them the model's own choice matched."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_drafts: int = 0  # sequences that verified drafts (vLLM's num_drafts)
    accepted_per_pos: tuple[int, ...] = ()  # [i]: sequences whose draft at position i was accepted
    by_seq: tuple[tuple[int, int, int], ...] = ()  # (seq_id, drafts, accepted) of each sequence that had drafts

    @staticmethod
    def of(seq_ids: Sequence[int], drafts: Sequence[Sequence[int]], accepted: Sequence[int]) -> DraftStats:
        """Acceptance is a prefix: a sequence that accepted `a` drafts accepted positions 0 .. a - 1."""
        had = [(s, len(d), a) for s, d, a in zip(seq_ids, drafts, accepted, strict=True) if d]
        width = max((n for _, n, _ in had), default=0)
        per_pos = tuple(sum(1 for _, _, a in had if a > i) for i in range(width))
        return DraftStats(sum(n for _, n, _ in had), sum(a for _, _, a in had), len(had), per_pos, tuple(had))


@dataclass(frozen=True)
class StepOutput:
    tokens: tuple[TokenOutput, ...]
    num_seqs: int  # sequences computed in the step
    num_tokens: int  # tokens computed in the step (prompt chunks plus decode tokens)
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()  # prompt positions scored in this step, per sequence
    drafts: DraftStats = DraftStats()  # drafts verified in this step (none without speculation)
