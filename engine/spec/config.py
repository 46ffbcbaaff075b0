"""`--speculative-config`: vLLM's JSON for speculative decoding, parsed and checked. A leaf (no torch), so the
scheduler's and the server's configs can hold it without loading the engine's sampler."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram",)
DRAFT_LENGTHS = ("auto", "fixed")  # auto: chosen each step (scheduler/draft_length.py); fixed: always k
MAX_SPECULATIVE_TOKENS = 16  # a verify row is a prompt chunk of k + 1: longer drafts only cost at this lab's scale
MAX_LOOKUP = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's n-gram speculation. Neither lookup bound given: both 5 (vLLM's default); one given: both that."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    draft_length: str = "auto"  # batchserve's: each row's drafts chosen per step (up to k), or always k

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.draft_length not in DRAFT_LENGTHS:
            raise ValueError(f"draft_length must be one of {', '.join(DRAFT_LENGTHS)}, got {self.draft_length!r}")
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
