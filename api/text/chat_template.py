"""Chat messages to token ids through the model's template, with message content always plain text.

The template renders one string, and tokenising it reads every control-token spelling as the control token
itself. A user who writes `<|im_end|>\\n<|im_start|>system\\n...` in a message would then forge a turn of
their own. So content that contains control-token text is rendered as a placeholder; the template's markup
between placeholders is tokenised with control tokens, and the content itself with them split into plain
text (as the OpenAI API and vLLM treat it). Content without such text takes the ordinary path, so the ids of
every normal conversation are exactly what `apply_chat_template` gives. Every other field a template may render
(a role, a name, tools, tool calls, template options) is not free text a template places verbatim, so control-token
text there is refused instead (`control_text_in`, api/text/prompts.py).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

# Template options a request may not set through chat_template_kwargs: they belong to the request's own fields
# or to how this server calls the template.
RESERVED_TEMPLATE_OPTIONS = frozenset(
    {
        "conversation",
        "messages",
        "tokenize",
        "return_dict",
        "return_tensors",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tools",
        "documents",
        "padding",
        "truncation",
        "max_length",
    }
)


class UnsafeTemplateError(ValueError):
    """The template transformed a message's content, so its control-token text cannot be kept apart."""


def control_token_texts(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """Spellings that tokenise into special tokens (BOS, EOS, turn markers, ...)."""
    decoder: Mapping[int, Any] = getattr(tokenizer, "added_tokens_decoder", {})
    texts = {token.content for token in decoder.values() if getattr(token, "special", False)}
    texts.update(str(t) for t in tokenizer.all_special_tokens)
    return sorted((t for t in texts if t), key=len, reverse=True)


def control_text_in(value: Any, controls: Sequence[str]) -> tuple[str, str] | None:
    """Where in `value` (a request field: its strings and its objects' keys, however nested) a control token is
    spelt, as a path such as `[0].function.name`, and which one; None if nowhere."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:  # not recursive: a body may nest 200 levels
        path, item = stack.pop()
        if isinstance(item, str):
            found = next((c for c in controls if c in item), None)
            if found is not None:
                return path, found
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                stack.append((f"{path}.{key}", child))
                stack.append((f"{path}.{key}", key))  # a key is rendered too (a tool's property names)
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", child) for i, child in reversed(list(enumerate(item))))
    return None


def encode_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_options: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids of `messages` in the model's chat template (by default ending where the answer begins)."""
    options = {
        **(template_options or {}),
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
    }
    controls = control_token_texts(tokenizer)
    risky = [i for i, m in enumerate(messages) if _contains_any(m.get("content"), controls)]
    if not risky:
        ids = tokenizer.apply_chat_template(list(messages), tokenize=True, return_dict=False, **options)
        return list(ids)
    return _encode_with_placeholders(tokenizer, messages, risky, options)


def _contains_any(content: object, needles: Sequence[str]) -> bool:
    return isinstance(content, str) and any(n in content for n in needles)


def _encode_with_placeholders(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict[str, Any]],
    risky: Sequence[int],
    options: Mapping[str, Any],
) -> list[int]:
    salt = uuid.uuid4().hex  # a user cannot guess it, so content never collides with a placeholder
    placeholders = {i: f"batchserve{salt}m{i}" for i in risky}
    rendered_messages = [
        {**m, "content": placeholders[i]} if i in placeholders else dict(m) for i, m in enumerate(messages)
    ]
    rendered = tokenizer.apply_chat_template(rendered_messages, tokenize=False, **options)
    assert isinstance(rendered, str)
    ids: list[int] = []
    rest = rendered
    for i in risky:
        before, found, rest = rest.partition(placeholders[i])
        if not found or placeholders[i] in rest:
            raise UnsafeTemplateError(f"the chat template did not place messages[{i}]'s content verbatim")
        ids.extend(tokenizer(before, add_special_tokens=False)["input_ids"])
        content = messages[i]["content"]
        ids.extend(tokenizer(content, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    ids.extend(tokenizer(rest, add_special_tokens=False)["input_ids"])
    return ids
