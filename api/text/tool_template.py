"""How a chat request reaches the model's template when tools are in play: the server's tool parser, its chat
template override (`--chat-template`), and a tool-aware template for ChatML models whose own template ignores tools.

The default model's template (in its GGUF) never shows `tools`, never renders an assistant turn's `tool_calls`, and
writes `role: "tool"` results as a turn of a role it has never seen. A request with tools then tells the model
nothing about them, and an agent's history loses every call. For such a model the server renders requests that
involve tools through `TOOL_TEMPLATE` instead: the tools and how to call them in the system block, in the tool
parser's own format (so what the model is shown is what the parser reads back), each call in the history written
the same way, and tool results in the user turn that follows, inside `<tool_response>` tags. Requests without tools
keep the model's own template, token for token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from api.protocol.errors import bad_request
from api.protocol.openai_api import ChatCompletionRequest
from api.structured.tool_parsers.base import ParsedCall, ToolParser
from api.structured.tool_parsers.registry import default_parser_name, parser_named
from api.structured.tools import checked_tools

_CHATML_START = "<|im_start|>"
# ChatML with tools: `default_system`, `tool_prompt` and each message's `calls_text` are the server's own
# (`ChatSetup.template_inputs`); content is placed as it is, as api/text/chat_template.py requires.
TOOL_TEMPLATE = (
    "{%- set has_system = messages and messages[0].role == 'system' -%}"
    "{%- set system = messages[0].content if has_system else default_system -%}"
    "{%- if system or tool_prompt -%}"
    "{{ '<|im_start|>system\\n' }}{{ system }}{% if system and tool_prompt %}{{ '\\n\\n' }}{% endif %}"
    "{{ tool_prompt }}{{ '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for message in (messages[1:] if has_system else messages) -%}"
    "{%- if message.role in ('tool', 'function') -%}"
    "{%- if loop.first or loop.previtem.role not in ('tool', 'function') %}{{ '<|im_start|>user\\n' }}"
    "{%- else %}{{ '\\n' }}{% endif -%}"
    "{{ '<tool_response>\\n' }}{{ message.content }}{{ '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem.role not in ('tool', 'function') %}{{ '<|im_end|>\\n' }}{% endif -%}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message.role + '\\n' }}{{ message.content }}{{ message.calls_text or '' }}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}"
)
# Template options only the server sets (a request's chat_template_kwargs may not).
SERVER_TEMPLATE_OPTIONS = frozenset({"default_system", "tool_prompt"})
_PROBE_TOOL, _PROBE_CALL, _PROBE_TEXT = "batchserve_probe_tool", "batchserve_probe_call", "batchserve_probe_text"


@dataclass(frozen=True)
class ChatSetup:
    """The server's chat rendering: its tool parser, and which template renders what."""

    parser: ToolParser
    override: str | None = None  # --chat-template: every request renders through it
    tool_template: str | None = None  # TOOL_TEMPLATE, where the model's own template ignores tools
    default_system: str = ""  # the model's own system prompt for conversations without one

    @classmethod
    def for_model(
        cls,
        tokenizer: PreTrainedTokenizerBase,
        parser: str | None = None,
        template_file: str | None = None,
    ) -> ChatSetup:
        """`parser`: --tool-call-parser (None: the model's default); `template_file`: --chat-template."""
        own = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
        name = parser or default_parser_name(own, list(tokenizer.all_special_tokens))
        if template_file is not None:
            return cls(parser_named(name), override=Path(template_file).read_text())
        if own is None or shows_tools(tokenizer):
            return cls(parser_named(name))
        system = _chatml_default_system(tokenizer)
        return cls(parser_named(name)) if system is None else cls(parser_named(name), None, TOOL_TEMPLATE, system)

    def template_inputs(
        self, request: ChatCompletionRequest, messages: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The messages and template options a request renders with, beyond its own `chat_template_kwargs`."""
        if self.override is not None:
            return messages, {"chat_template": self.override}
        if self.tool_template is None or not involves_tools(request):
            return messages, {}
        tools = checked_tools(request.tools) if request.tools else []
        options = {
            "chat_template": self.tool_template,
            "default_system": self.default_system,
            "tool_prompt": self.parser.system_prompt(tools) if tools else "",
        }
        rendered = [
            {**message, "calls_text": self._calls_text(i, message)} if message.get("tool_calls") else message
            for i, message in enumerate(messages)
        ]
        return rendered, options

    def _calls_text(self, index: int, message: dict[str, Any]) -> str:
        calls = [_call(index, j, call) for j, call in enumerate(message["tool_calls"])]
        return ("\n" if message.get("content") else "") + self.parser.render_calls(calls)


def involves_tools(request: ChatCompletionRequest) -> bool:
    """Tools offered, or a call or a tool result in the history."""
    return bool(request.tools) or any(m.tool_calls or m.role in ("tool", "function") for m in request.messages)


def _call(index: int, position: int, call: Any) -> ParsedCall:
    """An assistant turn's call, as OpenAI's history holds it: `{"function": {"name", "arguments"}}`, the arguments
    as JSON text (an object is taken too)."""
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise bad_request(f"messages[{index}].tool_calls[{position}] needs function.name", param="messages")
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if arguments is None:
        arguments = "{}"
    return ParsedCall(name, arguments if isinstance(arguments, str) else json.dumps(arguments))


def shows_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the model's own template shows the tools it is given and the calls in the history (rendered once,
    with names that cannot be there otherwise)."""
    tools: Any = [{"type": "function", "function": {"name": _PROBE_TOOL, "parameters": {"type": "object"}}}]
    call = {"id": "call_0", "type": "function", "function": {"name": _PROBE_CALL, "arguments": "{}"}}
    messages: Any = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "{}", "tool_call_id": "call_0"},
    ]
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    except Exception:  # a template that refuses tool turns does not show them either
        return False
    return isinstance(text, str) and _PROBE_TOOL in text and _PROBE_CALL in text


def _chatml_default_system(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The system prompt a ChatML template adds to a conversation without one ("" if none); None if the template
    is not ChatML (TOOL_TEMPLATE is, so it cannot stand in for it)."""
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": _PROBE_TEXT}], tokenize=False)
    except Exception:
        return None
    if not isinstance(text, str) or f"{_CHATML_START}user\n{_PROBE_TEXT}<|im_end|>" not in text:
        return None
    head = text[: text.index(f"{_CHATML_START}user\n")]
    prefix = f"{_CHATML_START}system\n"
    if head.startswith(prefix) and head.rstrip("\n").endswith("<|im_end|>"):
        return head[len(prefix) : head.rstrip("\n").rindex("<|im_end|>")]
    return "" if not head.strip() else None
