"""Speculative decoding: its configuration (vLLM's `--speculative-config` JSON) and the acceptance of drafts.

A row with k drafts computed its last k + 1 positions in the step's forward (engine/forward_batch.py). Acceptance
samples those positions one after another through the plain step's `sample_and_record`, so every emitted token is
the one the engine would have produced without speculation (penalties, min_tokens, grammars, logprobs and every
finish check see the same state); a row goes on while its token equals the next draft and it has not finished.
docs/speculative.md has the whole design.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

import torch

from engine.grammar import GrammarMatcher
from engine.outputs import TokenOutput
from engine.rows import SequenceRows
from engine.sampling_step import sample_and_record

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16  # a verify row is a prompt chunk of k + 1: longer drafts only cost at this lab's scale
MAX_LOOKUP = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's n-gram speculation. Neither lookup bound given: both 5 (vLLM's default); one given: both that."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, MAX_SPECULATIVE_TOKENS)
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        low, high = (low if low is not None else high), (high if high is not None else low)
        low, high = (5 if low is None else low), (5 if high is None else high)
        _check_int("prompt_lookup_min", low, MAX_LOOKUP)
        _check_int("prompt_lookup_max", high, MAX_LOOKUP)
        if low > high:
            raise ValueError(f"prompt_lookup_min ({low}) must not exceed prompt_lookup_max ({high})")
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    @property
    def lookup(self) -> tuple[int, int]:
        assert self.prompt_lookup_min is not None and self.prompt_lookup_max is not None
        return self.prompt_lookup_min, self.prompt_lookup_max

    @staticmethod
    def from_json(text: str) -> SpeculativeConfig:
        """The flag's JSON object; ValueError naming the key that is wrong, unknown or missing."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"is not valid JSON ({exc.msg} at character {exc.pos})") from None
        if not isinstance(data, dict):
            raise ValueError(f"must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(SpeculativeConfig)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown key {unknown[0]!r}; the keys are {', '.join(sorted(known))}")
        if "num_speculative_tokens" not in data:
            raise ValueError("num_speculative_tokens is required")
        return SpeculativeConfig(**data)


def _check_int(name: str, value: object, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise ValueError(f"{name} must be an integer from 1 to {high}, got {value!r}")


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
    widths = [len(d) + 1 for d in drafts]
    first = [sum(widths[:j]) for j in range(len(widths))]
    emitted: list[list[TokenOutput]] = [[] for _ in seq_ids]
    accepted = [0] * len(seq_ids)
    alive = list(range(len(seq_ids)))
    position = 0
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
