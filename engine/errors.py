"""Errors the engine raises for input it cannot serve, in the engine's own terms.

Each names the part of the input at fault (`InputField`) and says what was wrong; the API maps the field to its
request parameter and adds what its client can change (api/protocol/engine_fields.py).
"""

from __future__ import annotations

import enum


class InputField(enum.Enum):
    """The part of a sequence's input an EngineInputError is about: the prompt or a SamplingParams field."""

    PROMPT = enum.auto()
    MAX_TOKENS = enum.auto()
    STOP_TOKEN_IDS = enum.auto()
    LOGIT_BIAS = enum.auto()
    ALLOWED_TOKEN_IDS = enum.auto()
    MIN_TOKENS = enum.auto()
    LOGPROBS = enum.auto()
    PROMPT_LOGPROBS = enum.auto()
    TEMPERATURE = enum.auto()
    TOP_P = enum.auto()
    TOP_K = enum.auto()
    SEED = enum.auto()
    PRESENCE_PENALTY = enum.auto()
    FREQUENCY_PENALTY = enum.auto()
    REPETITION_PENALTY = enum.auto()
    MIN_P = enum.auto()


class EngineInputError(ValueError):
    """A sequence the engine cannot run as given (empty prompt, unknown token ids, more than it can hold)."""

    def __init__(self, message: str, field: InputField) -> None:
        super().__init__(message)
        self.field = field


class SamplingParamsError(EngineInputError):
    """A SamplingParams value the engine cannot run (engine/sample/sampling_params.py)."""


class ContextLengthError(EngineInputError):
    """The prompt plus the tokens asked for do not fit the model's context window."""


class CacheCapacityError(EngineInputError):
    """The KV cache cannot hold even one sequence of the requested size."""
