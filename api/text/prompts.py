"""Turn request prompts and chat messages into token ids, and request fields into per-choice inputs."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from api.config import ServerConfig
from api.endpoints.deltas import ChoiceInput, OutputOptions
from api.endpoints.engine_fields import engine_input_error
from api.endpoints.errors import bad_request
from api.endpoints.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields
from api.text.chat_template import (
    RESERVED_TEMPLATE_OPTIONS,
    UnsafeTemplateError,
    control_text_in,
    control_token_texts,
    encode_chat,
)
from engine.errors import EngineInputError
from engine.grammar import Grammar
from engine.sampling_params import SamplingParams


def completion_prompts(
    request: CompletionRequest, tokenizer: PreTrainedTokenizerBase, config: ServerConfig, max_model_len: int
) -> list[list[int]]:
    prompt = request.prompt
    if isinstance(prompt, str):
        texts_or_ids: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        texts_or_ids = [list(prompt)]  # type: ignore[arg-type]
    else:
        texts_or_ids = list(prompt)  # type: ignore[arg-type]
    if not texts_or_ids:
        raise bad_request("the prompt is empty", param="prompt")
    if len(texts_or_ids) > config.max_prompts:
        raise bad_request(f"at most {config.max_prompts} prompts are allowed in one request", param="prompt")
    add_special = request.add_special_tokens is not False  # completions add BOS and the like unless told not to
    prompts = []
    for item in texts_or_ids:
        ids = tokenizer(item, add_special_tokens=add_special)["input_ids"] if isinstance(item, str) else item
        if not ids:
            raise bad_request("a prompt is empty; give at least one token", param="prompt")
        prompts.append(truncate(list(ids), request.truncate_prompt_tokens, max_model_len))
    return prompts


def truncate(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last `keep` tokens (-1: as many as the context holds)."""
    if keep is None:
        return ids
    if keep == 0:  # would keep nothing: no prompt is left to answer
        raise bad_request(
            "truncate_prompt_tokens must be at least 1, or -1 (the context length)", "truncate_prompt_tokens"
        )
    limit = max_model_len if keep == -1 else keep
    return ids[-limit:] if limit > 0 else ids


def chat_prompt(request: ChatCompletionRequest, tokenizer: PreTrainedTokenizerBase, max_model_len: int) -> list[int]:
    if tokenizer.chat_template is None:
        raise bad_request("this model has no chat template; use /v1/completions", param="messages")
    options = dict(request.chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_OPTIONS & options.keys())
    if reserved:
        raise bad_request(
            f"chat_template_kwargs may not set {', '.join(reserved)}; use the request's own fields",
            param="chat_template_kwargs",
        )
    _refuse_control_text(request, control_token_texts(tokenizer))
    if request.tools:  # the template shows them to the model, if it knows how (a forced call's grammar does not care)
        options["tools"] = request.tools
    messages = [_template_message(m) for m in request.messages]
    if request.continue_final_message and request.messages[-1].role != "assistant":
        raise bad_request(
            "continue_final_message needs the last message to be the assistant's", param="continue_final_message"
        )
    try:
        ids = encode_chat(
            tokenizer,
            messages,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            template_options=options,
        )
    except UnsafeTemplateError as exc:
        raise bad_request(str(exc), param="messages") from None
    except Exception as exc:  # a template's own raise_exception(), e.g. roles out of order
        raise bad_request(f"the chat template rejected the messages: {exc}", param="messages") from None
    if request.add_special_tokens:
        prefix, suffix = _special_tokens_around(tokenizer)
        ids = [*prefix, *ids, *suffix]
    return truncate(ids, request.truncate_prompt_tokens, max_model_len)


def _special_tokens_around(tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after a text when it adds special tokens (a BOS, say), read off one
    encoding: transformers 5's fast tokenizers no longer have `build_inputs_with_special_tokens`."""
    plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    framed = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    for start in range(len(framed) - len(plain) + 1):
        if framed[start : start + len(plain)] == plain:
            return framed[:start], framed[start + len(plain) :]
    return [], []


def _refuse_control_text(request: ChatCompletionRequest, controls: list[str]) -> None:
    """Control-token text anywhere the template may render it but content (which encode_chat keeps plain): a role,
    a name, tool calls and ids, tools, template options. A template places these raw, or transformed (tojson), so
    they cannot be kept apart as content is; rendered, the text would be the control token itself, a forged turn."""
    fields: list[tuple[str, str, object]] = [
        (f"messages[{i}].{name}", "messages", getattr(message, name))
        for i, message in enumerate(request.messages)
        for name in ("role", "name", "tool_calls", "tool_call_id")
    ]
    fields += [
        ("tools", "tools", request.tools),
        ("chat_template_kwargs", "chat_template_kwargs", request.chat_template_kwargs),
    ]
    for where, param, value in fields:
        found = control_text_in(value, controls)
        if found is not None:
            path, control = found
            raise bad_request(
                f"{where}{path} holds {control!r}, a control token's text; only message content may hold it (as "
                "plain text): the chat template would render it here as the control token itself",
                param=param,
            )


def _template_message(message: ChatMessage) -> dict[str, object]:
    role = "system" if message.role == "developer" else message.role  # templates know no developer role
    rendered: dict[str, object] = {"role": role, "content": message.text()}
    for name in ("name", "tool_calls", "tool_call_id"):
        value = getattr(message, name)
        if value is not None:
            rendered[name] = value
    return rendered


def chat_echo_text(request: ChatCompletionRequest) -> str | None:
    """vLLM's chat echo: the last message's content, when it is the assistant's (the answer continues it)."""
    if not request.echo or request.messages[-1].role != "assistant":
        return None
    return request.messages[-1].text()


def check_common_limits(request: SamplingFields, config: ServerConfig) -> None:
    if request.n > config.max_n:
        raise bad_request(f"n must be at most {config.max_n}", param="n")
    stops = request.stop_strings()
    if len(stops) > config.max_stop_strings:
        raise bad_request(f"at most {config.max_stop_strings} stop strings are allowed", param="stop")
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
) -> list[ChoiceInput]:
    """One input per (prompt, choice); the n choices of a seeded request get distinct derived seeds.

    `max_tokens` 0 scores the prompt alone: the engine runs the prefill and samples one token, which is dropped.
    `grammar`: the structured output every choice must match (api/structured/).
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
            inputs.append(ChoiceInput(prompt, params, output, request.cache_salt, request.priority))
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
