"""Turn request prompts and chat messages into token ids, and request fields into per-choice inputs."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from transformers import PreTrainedTokenizerBase

from api.config import ServerConfig
from api.protocol.errors import bad_request
from api.protocol.openai_api import ChatCompletionRequest, ChatMessage, CompletionRequest
from api.text.chat_template import (
    RESERVED_TEMPLATE_OPTIONS,
    UnsafeTemplateError,
    control_text_in,
    control_token_texts,
    encode_chat,
)
from api.text.tool_template import SERVER_TEMPLATE_OPTIONS, ChatSetup


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


def chat_prompt(
    request: ChatCompletionRequest,
    tokenizer: PreTrainedTokenizerBase,
    max_model_len: int,
    setup: ChatSetup | None = None,
) -> list[int]:
    """`setup`: the server's chat rendering (api/text/tool_template.py); None: the model's own template."""
    if tokenizer.chat_template is None and (setup is None or setup.override is None):
        raise bad_request("this model has no chat template; use /v1/completions", param="messages")
    options = dict(request.chat_template_kwargs or {})
    reserved = sorted((RESERVED_TEMPLATE_OPTIONS | SERVER_TEMPLATE_OPTIONS) & options.keys())
    if reserved:
        raise bad_request(
            f"chat_template_kwargs may not set {', '.join(reserved)}; use the request's own fields",
            param="chat_template_kwargs",
        )
    _refuse_control_text(request, control_token_texts(tokenizer))
    if request.tools:  # the template shows them to the model, if it knows how (a forced call's grammar does not care)
        options["tools"] = request.tools
    messages = [_template_message(m) for m in request.messages]
    if setup is not None:
        messages, server_options = setup.template_inputs(request, messages)
        options.update(server_options)
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
    refuse_control_text_in(fields, controls, allowed="message content may hold it (as plain text)")


def refuse_control_text_in(fields: Iterable[tuple[str, str, object]], controls: Sequence[str], allowed: str) -> None:
    """A 400 for the first of `fields` (where, param, value) that spells a control token (`controls`), naming the
    field and the path inside it; `allowed` says which fields may hold such text instead (each API names its own)."""
    for where, param, value in fields:
        found = control_text_in(value, controls)
        if found is not None:
            path, control = found
            raise bad_request(
                f"{where}{path} holds {control!r}, a control token's text; only {allowed}: the chat template would "
                "render it here as the control token itself",
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
