"""Engine input errors in the API's terms: the request parameter at fault and what the client can change.

The engine reports which part of a sequence's input was wrong (`InputField`) and what was wrong with it; this
is the one place that knows which HTTP request field and which server flag that corresponds to.
"""

from __future__ import annotations

from api.protocol.errors import APIError
from engine.errors import CacheCapacityError, ContextLengthError, EngineInputError, InputField

_PARAMS: dict[InputField, str] = {
    InputField.PROMPT: "prompt",
    InputField.MAX_TOKENS: "max_tokens",
    InputField.STOP_TOKEN_IDS: "stop_token_ids",
    InputField.LOGIT_BIAS: "logit_bias",
    InputField.ALLOWED_TOKEN_IDS: "allowed_token_ids",
    InputField.MIN_TOKENS: "min_tokens",
    InputField.LOGPROBS: "logprobs",
    InputField.PROMPT_LOGPROBS: "prompt_logprobs",
    InputField.TEMPERATURE: "temperature",
    InputField.TOP_P: "top_p",
    InputField.TOP_K: "top_k",
    InputField.SEED: "seed",
    InputField.PRESENCE_PENALTY: "presence_penalty",
    InputField.FREQUENCY_PENALTY: "frequency_penalty",
    InputField.REPETITION_PENALTY: "repetition_penalty",
    InputField.MIN_P: "min_p",
}
# What the client (or the operator, through a server flag) can change, by the kind of error.
_REMEDIES: dict[type[EngineInputError], str] = {
    ContextLengthError: "shorten the prompt or lower max_tokens",
    CacheCapacityError: "raise kv_cache_tokens or lower max_tokens",
}


def engine_input_error(exc: EngineInputError) -> APIError:
    """The 400 for input the engine refused, naming the request parameter at fault."""
    remedy = _REMEDIES.get(type(exc))
    message = f"{exc}; {remedy}" if remedy else str(exc)
    return APIError(400, message, param=_PARAMS[exc.field])
