"""Turn request prompts and chat messages into token ids, and request fields into SamplingParams."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from api.config import ServerConfig
from api.errors import bad_request
from api.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from api.service import ChoiceInput
from engine.sampling_params import SamplingParams


def completion_prompts(
    request: CompletionRequest, tokenizer: PreTrainedTokenizerBase, config: ServerConfig
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
    prompts = []
    for item in texts_or_ids:
        ids = tokenizer(item, add_special_tokens=True)["input_ids"] if isinstance(item, str) else item
        if not ids:
            raise bad_request("a prompt is empty; give at least one token", param="prompt")
        prompts.append(list(ids))
    return prompts


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` in the model's chat template, ending where the assistant's answer begins."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)


def chat_prompt(request: ChatCompletionRequest, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    if tokenizer.chat_template is None:
        raise bad_request("this model has no chat template; use /v1/completions", param="messages")
    messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in request.messages]
    return encode_chat(tokenizer, messages)


def check_common_limits(request: _SamplingFields, config: ServerConfig) -> None:
    if request.n > config.max_n:
        raise bad_request(f"n must be at most {config.max_n}", param="n")
    stops = request.stop_strings()
    if len(stops) > config.max_stop_strings:
        raise bad_request(f"at most {config.max_stop_strings} stop strings are allowed", param="stop")
    if any(len(s) == 0 or len(s) > 256 for s in stops):
        raise bad_request("stop strings must be 1 to 256 characters long", param="stop")


def choice_inputs(
    request: _SamplingFields, prompts: list[list[int]], max_tokens: int, logprobs: int | None
) -> list[ChoiceInput]:
    """One input per (prompt, choice); the n choices of a seeded request get distinct derived seeds."""
    inputs = []
    for prompt in prompts:
        for i in range(request.n):
            seed = None if request.seed is None else (request.seed + i) % (2**63)
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=request.temperature,
                top_p=request.top_p,
                top_k=max(request.top_k, 0),
                seed=seed,
                stop_token_ids=tuple(request.stop_token_ids or ()),
                ignore_eos=request.ignore_eos,
                logprobs=logprobs,
                presence_penalty=request.presence_penalty,
                frequency_penalty=request.frequency_penalty,
            )
            inputs.append(ChoiceInput(prompt, params, tuple(request.stop_strings())))
    return inputs


def chat_max_tokens(request: ChatCompletionRequest, prompt_len: int, max_model_len: int) -> int:
    """As in vLLM: without a limit, a chat answer may use the rest of the context window."""
    requested = request.max_completion_tokens or request.max_tokens
    if requested is not None:
        return requested
    remaining = max_model_len - prompt_len
    if remaining < 1:
        raise bad_request(
            f"the messages take {prompt_len} tokens, leaving no room in the {max_model_len}-token context",
            param="messages",
        )
    return remaining
