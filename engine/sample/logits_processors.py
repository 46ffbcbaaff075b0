"""Edits to one step's logits before sampling: logit bias, allowed ids, grammars, min_tokens bans and penalties.

They run in vLLM's order (bias and the two masks commute: a masked logit is -inf whatever its bias), before
temperature, so they change greedy choices too. Each edit covers only the rows that use it (`rows` index the
step's sampling rows) and is absent when no row does, so a step whose requests use none of them pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_F32_MAX = torch.finfo(torch.float32).max
_F32_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class LogitBias:
    rows: torch.Tensor  # [n]
    ids: torch.Tensor  # [n, width] int64; padding is id 0 with bias 0
    values: torch.Tensor  # [n, width] float32

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.scatter_add(1, self.ids, self.values)


@dataclass(frozen=True)
class AllowedTokens:
    rows: torch.Tensor  # [n]
    mask: torch.Tensor  # [n, vocab] bool, True where the token may be sampled

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.masked_fill(~self.mask, float("-inf"))


@dataclass(frozen=True)
class BannedTokens:
    """Tokens a row may not sample yet: its EOS and stop ids while it has fewer than min_tokens outputs."""

    rows: torch.Tensor  # [n]
    ids: torch.Tensor  # [n, width] int64, -1 pads

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.masked_fill(token_mask(self.ids, logits.shape[-1]), float("-inf"))


@dataclass(frozen=True)
class RepetitionPenalty:
    """vLLM/HF semantics: a seen token's positive logit is divided by the penalty, any other multiplied by it."""

    rows: torch.Tensor  # [n]
    seen: torch.Tensor  # [n, vocab] bool, the token occurs in the prompt or the output so far
    penalty: torch.Tensor  # [n] float32

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        # A penalty outside float32's normal range would make 0 * inf = NaN; clamping it and the result keeps every
        # finite logit finite (so a row never loses all its tokens), while -inf (masked) stays -inf.
        penalty = self.penalty.clamp(_F32_TINY, _F32_MAX)[:, None]
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty).clamp(-_F32_MAX, _F32_MAX)
        return torch.where(self.seen & logits.isfinite(), penalised, logits)


@dataclass(frozen=True)
class OutputPenalties:
    """OpenAI's presence and frequency penalties over the tokens generated so far."""

    rows: torch.Tensor  # [n]
    counts: torch.Tensor  # [n, vocab] float32, how often each token was generated
    presence: torch.Tensor  # [n] float32
    frequency: torch.Tensor  # [n] float32

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return apply_penalties(logits, self.counts, self.presence, self.frequency)


@dataclass(frozen=True)
class LogitsEdits:
    bias: LogitBias | None = None
    allowed: AllowedTokens | None = None
    grammar: AllowedTokens | None = None  # the tokens each constrained row's grammar allows next
    banned: BannedTokens | None = None
    repetition: RepetitionPenalty | None = None
    penalties: OutputPenalties | None = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The edited [rows, vocab] logits; `logits` itself is left as it is (its logprobs are the ones reported)."""
        every = (self.bias, self.allowed, self.grammar, self.banned, self.repetition, self.penalties)
        edits = [e for e in every if e is not None]
        if not edits:
            return logits
        out = logits.clone()
        for edit in edits:  # one pass per feature in use, each over its rows at once
            out[edit.rows] = edit.apply(out[edit.rows])
        return out


def apply_penalties(
    logits: torch.Tensor, output_counts: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor
) -> torch.Tensor:
    """OpenAI-style penalties; output_counts is [rows, vocab], how often each token was generated so far."""
    return logits - frequency[:, None] * output_counts - presence[:, None] * (output_counts > 0).float()


def token_mask(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n, vocab] bool, True at each row's ids; ids of -1 (padding) or >= vocab mark nothing."""
    column = torch.where((ids >= 0) & (ids < vocab), ids, vocab)  # one spare column soaks up the padding
    mask = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.bool, device=ids.device)
    return mask.scatter_(1, column, True)[:, :vocab]
