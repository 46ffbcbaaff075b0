"""Request fields onto engine inputs: one ChoiceInput per (prompt, choice), sampling fields onto SamplingParams
(the engine's own checks are the last word), and the server's bounds on a request's sampling fields."""

from __future__ import annotations

from typing import Any

from api.protocol.deltas import ChoiceInput, OutputOptions
from api.protocol.engine_fields import engine_input_error
from api.protocol.errors import bad_request
from api.protocol.openai_api import ChatCompletionRequest, SamplingFields
from engine.errors import EngineInputError
from engine.sample.grammar import Grammar
from engine.sample.sampling_params import SamplingParams


def check_common_limits(request: SamplingFields, max_n: int, max_stop_strings: int) -> None:
    """The server's bounds on n and stop strings (`--max-n`, `--max-stop-strings`)."""
    if request.n > max_n:
        raise bad_request(f"n must be at most {max_n}", param="n")
    stops = request.stop_strings()
    if len(stops) > max_stop_strings:
        raise bad_request(f"at most {max_stop_strings} stop strings are allowed", param="stop")
    if any(len(s) == 0 or len(s) > 256 for s in stops):
        raise bad_request("stop strings must be 1 to 256 characters long", param="stop")


def _logit_bias(request: SamplingFields) -> tuple[tuple[int, float], ...]:
    pairs = []
    for key, bias in (request.logit_bias or {}).items():
        if not key.isdigit():
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        pairs.append((int(key), float(bias)))
    return tuple(pairs)


def choice_inputs(
    request: SamplingFields,
    prompts: list[list[int]],
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    grammar: Grammar | None = None,
    prediction: tuple[int, ...] = (),
) -> list[ChoiceInput]:
    """One input per (prompt, choice); the n choices of a seeded request get distinct derived seeds.

    `max_tokens` 0 scores the prompt alone: the engine runs the prefill and samples one token, which is dropped.
    `grammar`: the structured output every choice must match (api/structured/). `prediction`: Predicted Outputs'
    tokens, drafts for every choice.
    """
    if 0 < max_tokens < request.min_tokens:
        raise bad_request(
            f"min_tokens ({request.min_tokens}) must not exceed max_tokens ({max_tokens})", param="min_tokens"
        )
    output = OutputOptions(
        stop=tuple(request.stop_strings()),
        skip_special_tokens=request.skip_special_tokens,
        spaces_between_special_tokens=request.spaces_between_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        min_tokens=request.min_tokens,
        discard_output=max_tokens == 0,
    )
    logit_bias = _logit_bias(request)
    inputs = []
    for prompt in prompts:
        for i in range(request.n):
            seed = None if request.seed is None else (request.seed + i) % (2**63)
            params = _sampling_params(
                max_tokens=max(max_tokens, 1),
                temperature=request.temperature,
                top_p=request.top_p,
                top_k=max(request.top_k, 0),
                min_p=request.min_p,
                seed=seed,
                stop_token_ids=tuple(request.stop_token_ids or ()),
                ignore_eos=request.ignore_eos,
                min_tokens=min(request.min_tokens, max(max_tokens, 1)),
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                presence_penalty=request.presence_penalty,
                frequency_penalty=request.frequency_penalty,
                repetition_penalty=request.repetition_penalty,
                logit_bias=logit_bias,
                allowed_token_ids=None if request.allowed_token_ids is None else tuple(request.allowed_token_ids),
                grammar=grammar,
            )
            inputs.append(ChoiceInput(prompt, params, output, request.cache_salt, request.priority, prediction))
    return inputs


def _sampling_params(**values: Any) -> SamplingParams:
    """The engine's own checks are the last word on what it can run: a value the request models let through but
    the engine refuses is a 400 naming the field, never a 500 (the same checks, not a copy of them)."""
    try:
        return SamplingParams(**values)
    except EngineInputError as exc:
        raise engine_input_error(exc) from None


def chat_max_tokens(request: ChatCompletionRequest, prompt_len: int, max_model_len: int) -> int:
    """As in vLLM: without a limit, a chat answer may use the rest of the context window."""
    requested = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    if requested is not None:
        return requested
    remaining = max_model_len - prompt_len
    if remaining < 1:
        raise bad_request(
            f"the messages take {prompt_len} tokens, leaving no room in the {max_model_len}-token context",
            param="messages",
        )
    return remaining
