"""Per-request sampling parameters, validated once when the request is made.

Every refusal is a SamplingParamsError naming the field (`InputField`), which the API turns into a 400 naming its
request parameter (api/protocol/engine_fields.py). Only what would break the engine is checked here (values its tensors
cannot hold, or that would put NaN or +inf into a row of logits); the OpenAI API's narrower ranges (temperature
up to 2, penalties within +-2, logprobs up to 20) are the API's to enforce (api/protocol/openai_api.py). Limits that
depend on the model, such as token ids within the vocabulary, are checked by `Engine.validate`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.errors import InputField, SamplingParamsError

if TYPE_CHECKING:
    from engine.sample.grammar import Grammar

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing logits by a smaller one is numerically unsafe
# and the distribution is all but a point mass on the top token.
MIN_SAMPLING_TEMPERATURE = 1e-5
MAX_SEED = 2**63 - 1  # seeds are stored in an int64 row
MAX_TOP_K = 2**31 - 1  # no vocabulary is larger; bounds what the engine stores in an int64 row
# An edit this large already decides a token on its own; bounding bias and penalties keeps every edited float32
# logit finite, which the sampler relies on (engine/sample/sampler.py).
MAX_LOGIT_EDIT = 1e6


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence picks its tokens. A temperature below MIN_SAMPLING_TEMPERATURE (e.g. 0) means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables the filter
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives to report beside the chosen token
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    prompt_logprobs: int | None = None  # score every prompt token: its logprob, rank and this many alternatives
    # vLLM's extensions, applied in vLLM's order (see engine/sample/logits_processors.py and engine/sample/sampler.py).
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many tokens were generated
    repetition_penalty: float = 1.0  # > 0; divides positive / multiplies other logits of prompt and output tokens
    min_p: float = 0.0  # drop tokens less likely than min_p times the top token (after temperature)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits first
    allowed_token_ids: tuple[int, ...] | None = None  # only these ids may be sampled (greedy too)
    grammar: Grammar | None = None  # structured output: only tokens the grammar allows; its end stops the sequence

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise SamplingParamsError(f"max_tokens must be at least 1, got {self.max_tokens}", InputField.MAX_TOKENS)
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise SamplingParamsError(
                f"temperature must be a finite number >= 0, got {self.temperature}", InputField.TEMPERATURE
            )
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}", InputField.TOP_P)
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise SamplingParamsError(
                f"top_k must be between 0 (off) and {MAX_TOP_K}, got {self.top_k}", InputField.TOP_K
            )
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise SamplingParamsError(f"seed must be between 0 and {MAX_SEED}, got {self.seed}", InputField.SEED)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise SamplingParamsError(f"{name} must be at least 0, got {value}", InputField[name.upper()])
        for name in ("presence_penalty", "frequency_penalty"):
            if not abs(getattr(self, name)) <= MAX_LOGIT_EDIT:
                raise SamplingParamsError(
                    f"{name} must be a number within +-{MAX_LOGIT_EDIT:g}, got {getattr(self, name)}",
                    InputField[name.upper()],
                )
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self._check_extensions()

    def _check_extensions(self) -> None:
        """vLLM's extensions: min_tokens, repetition_penalty, min_p, logit_bias, allowed_token_ids."""
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingParamsError(
                f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}",
                InputField.MIN_TOKENS,
            )
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise SamplingParamsError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}",
                InputField.REPETITION_PENALTY,
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError(f"min_p must be between 0 and 1, got {self.min_p}", InputField.MIN_P)
        bias = tuple((int(t), float(v)) for t, v in self.logit_bias)
        if len({t for t, _ in bias}) != len(bias):
            raise SamplingParamsError("logit_bias names a token id twice", InputField.LOGIT_BIAS)
        bad = [v for _, v in bias if not abs(v) <= MAX_LOGIT_EDIT]
        if bad:
            raise SamplingParamsError(
                f"logit_bias values must be within +-{MAX_LOGIT_EDIT:g}, got {bad[0]}", InputField.LOGIT_BIAS
            )
        object.__setattr__(self, "logit_bias", bias)
        if self.allowed_token_ids is not None:
            if len(self.allowed_token_ids) == 0:
                raise SamplingParamsError("allowed_token_ids must not be empty", InputField.ALLOWED_TOKEN_IDS)
            object.__setattr__(self, "allowed_token_ids", tuple(int(t) for t in self.allowed_token_ids))
        if self.grammar is not None:
            # Either could leave a constrained row no token at all: a grammar that is complete allows only its stop
            # tokens, which min_tokens bans; allowed_token_ids may miss every token the grammar allows.
            if self.min_tokens > 0:
                raise SamplingParamsError(
                    "min_tokens cannot be combined with structured outputs", InputField.MIN_TOKENS
                )
            if self.allowed_token_ids is not None:
                raise SamplingParamsError(
                    "allowed_token_ids cannot be combined with structured outputs", InputField.ALLOWED_TOKEN_IDS
                )

    @property
    def greedy(self) -> bool:
        """Whether the engine decodes this sequence greedily (it stores temperature 0 for such rows)."""
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that edits the logits, asks for scores or follows a grammar: its token is the logits'
        argmax, which the sampler's fast path takes without building the general step (sampling_step.py)."""
        return (
            self.greedy
            and self.logprobs is None
            and self.min_tokens == 0
            and self.repetition_penalty == 1.0
            and self.presence_penalty == 0.0
            and self.frequency_penalty == 0.0
            and not self.logit_bias
            and self.allowed_token_ids is None
            and self.grammar is None
        )
