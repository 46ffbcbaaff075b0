"""Anthropic's Messages API onto the chat path: a request becomes a ChatCompletionRequest, and the chat answer a
Message.

Turns map one to one, in order: `system` (text or text blocks) is a system message, as is a `system` turn among
the messages; a user turn's text blocks are a user message and each `tool_result` a `tool` message answering its
`tool_use` id (`is_error` renders as `Error: ...`); an assistant turn's text is its content and its `tool_use` blocks
its `tool_calls`. A last assistant turn of text is a prefill the answer continues (the chat path's
`continue_final_message`). `tools` become functions whose parameters are the `input_schema`; `tool_choice` auto,
any, tool and none are the chat path's "auto", "required", a named function and "none"; `output_config.format` is
its `response_format`. A tool call's id is the chat call's with `toolu_` for `call_`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from api.protocol.errors import bad_request
from api.protocol.messages_api import (
    CountTokensRequest,
    InputMessage,
    MessagesRequest,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
    named_error,
)
from api.protocol.openai_api import ChatCompletionRequest, parse_json_text
from api.text.prompts import refuse_control_text_in

# finish_reason -> stop_reason; "stop" is "stop_sequence" when a stop string ended it (the choice's stop_reason).
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def message_id(chat_id: str) -> str:
    """The Message's id: the chat completion's own, so that the server's logs find it (`chatcmpl-X` is `msg_X`)."""
    return "msg_" + chat_id.removeprefix("chatcmpl-")


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def to_chat(request: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request `request` runs as (a MessagesRequest), or renders as (count_tokens: no sampling fields)."""
    tools = _tools(request)
    fields: dict[str, Any] = {"model": request.model, "messages": _messages(request)}
    if tools:
        fields["tools"] = tools
    if request.tool_choice is not None:
        fields["tool_choice"] = _tool_choice(request, {tool["function"]["name"] for tool in tools})
        if request.tool_choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    last = request.messages[-1]
    if last.role == "assistant":  # a prefill: the answer continues it
        fields.update(add_generation_prompt=False, continue_final_message=True)
    if isinstance(request, MessagesRequest):
        fields.update(
            max_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p, stream=request.stream
        )
        if request.top_k:
            fields["top_k"] = request.top_k
        if request.stop_sequences:
            fields["stop"] = request.stop_sequences
        if request.metadata is not None and request.metadata.user_id is not None:
            fields["user"] = request.metadata.user_id
        output = request.output_config
        if output is not None and output.format is not None:
            json_schema = {"name": "output", "schema": output.format.schema_}
            fields["response_format"] = {"type": "json_schema", "json_schema": json_schema}
        if request.stream:  # the output tokens, for message_delta
            fields["stream_options"] = {"include_usage": True}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:  # every value was validated as Anthropic's already; this names any slip
        raise named_error(exc) from None


def refuse_control_text(request: CountTokensRequest, controls: Sequence[str]) -> None:
    """A 400 naming the field, for control-token text (`controls`) where the chat template renders it raw: tool_use
    ids, names and inputs, tool_result ids, tools. The chat path refuses it too, but names its own messages; here
    the path is the request's. Text content may hold it: it is kept plain text (api/text/chat_template.py)."""
    fields: list[tuple[str, str, object]] = []
    for i, message in enumerate(request.messages):
        for j, block in enumerate(message.blocks()):
            where = f"messages.{i}.content.{j}"
            if isinstance(block, ToolUseBlock):
                fields += [(f"{where}.{name}", "messages", getattr(block, name)) for name in ("id", "name", "input")]
            elif isinstance(block, ToolResultBlock):
                fields.append((f"{where}.tool_use_id", "messages", block.tool_use_id))
    fields += [(f"tools.{i}", "tools", tool.model_dump()) for i, tool in enumerate(request.tools or ())]
    refuse_control_text_in(fields, controls, allowed="text content may hold it")


def _tools(request: CountTokensRequest) -> list[dict[str, Any]]:
    tools, seen = [], set()
    for i, tool in enumerate(request.tools or ()):
        if tool.name in seen:
            raise bad_request(f"tools.{i}.name: the tool {tool.name[:64]!r} is defined twice", param="tools")
        if tool.input_schema.get("type") != "object":
            raise bad_request(f"tools.{i}.input_schema: the schema's type must be 'object'", param="tools")
        seen.add(tool.name)
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function["description"] = tool.description
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(request: CountTokensRequest, names: set[str]) -> str | dict[str, Any]:
    choice = request.tool_choice
    assert choice is not None
    if choice.type in ("any", "tool") and not names:
        raise bad_request(f"tool_choice.type: {choice.type!r} needs tools, and the request has none", "tool_choice")
    if choice.type == "tool":
        if choice.name is None:
            raise bad_request("tool_choice.name: field required for type 'tool'", param="tool_choice")
        if choice.name not in names:
            raise bad_request(f"tool_choice.name: {choice.name[:64]!r} is not one of the tools", param="tool_choice")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _messages(request: CountTokensRequest) -> list[dict[str, Any]]:
    chat: list[dict[str, Any]] = []
    system = request.system_text()
    if system is not None:
        chat.append({"role": "system", "content": system})
    previous_calls: set[str] = set()  # the tool_use ids of the turn before, which tool_results answer
    for i, message in enumerate(request.messages):
        if message.role == "assistant":
            chat.append(_assistant(i, message))
            previous_calls = {block.id for block in message.blocks() if isinstance(block, ToolUseBlock)}
        elif message.role == "system":
            chat.append(_system(i, message))
            previous_calls = set()
        else:
            chat.extend(_user(i, message, previous_calls))
            previous_calls = set()
    last = request.messages[-1]
    if last.role == "assistant" and previous_calls:
        raise bad_request(
            f"messages.{len(request.messages) - 1}: the last message's tool_use blocks need a user turn with their "
            "tool_result blocks after it",
            param="messages",
        )
    return chat


def _system(i: int, message: InputMessage) -> dict[str, Any]:
    text = []
    for j, block in enumerate(message.blocks()):
        if not isinstance(block, TextBlock):
            raise bad_request(f"messages.{i}.content.{j}: a system turn holds text blocks only", param="messages")
        text.append(block.text)
    return {"role": "system", "content": "".join(text)}


def _assistant(i: int, message: InputMessage) -> dict[str, Any]:
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(message.blocks()):
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolUseBlock):
            if any(call["id"] == block.id for call in calls):
                where = f"messages.{i}.content.{j}.id"
                raise bad_request(f"{where}: the tool_use id {block.id[:64]!r} is used twice", param="messages")
            function = {"name": block.name, "arguments": json.dumps(block.input)}
            calls.append({"id": block.id, "type": "function", "function": function})
        else:
            raise bad_request(f"messages.{i}.content.{j}: tool_result blocks belong in a user turn", "messages")
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text or not calls else None}
    if calls:
        turn["tool_calls"] = calls
    return turn


def _user(i: int, message: InputMessage, previous_calls: set[str]) -> list[dict[str, Any]]:
    """The turn as chat messages in its own order: each tool_result a `tool` message, the text between them user
    messages."""
    turns: list[dict[str, Any]] = []
    text: list[str] = []
    for j, block in enumerate(message.blocks()):
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolResultBlock):
            if block.tool_use_id not in previous_calls:
                raise bad_request(
                    f"messages.{i}.content.{j}.tool_use_id: {block.tool_use_id[:64]!r} answers no tool_use block of "
                    "the message before it",
                    param="messages",
                )
            if text:
                turns.append({"role": "user", "content": "".join(text)})
                text = []
            content = f"Error: {block.text()}" if block.is_error else block.text()
            turns.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        else:
            raise bad_request(f"messages.{i}.content.{j}: tool_use blocks belong in an assistant turn", "messages")
    if text or not turns:
        turns.append({"role": "user", "content": "".join(text)})
    return turns


def to_message(chat: dict[str, Any], stop_sequences: list[str] | None) -> dict[str, object]:
    """A whole chat completion (one choice) as a Message."""
    choice = chat["choices"][0]
    message = choice["message"]
    content: list[dict[str, object]] = []
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        function = call["function"]
        content.append(
            {
                "type": "tool_use",
                "id": tool_use_id(call["id"]),
                "name": function["name"],
                "input": parse_json_text(function["arguments"]),  # whole calls only: they parse (structured/tools.py)
            }
        )
    stop_reason, stop_sequence = stop_of(choice, stop_sequences)
    return {
        "id": message_id(chat["id"]),
        "type": "message",
        "role": "assistant",
        "model": chat["model"],
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage(chat["usage"]),
    }


def stop_of(choice: dict[str, Any], stop_sequences: list[str] | None) -> tuple[str, str | None]:
    """A chat choice's end as Anthropic's `stop_reason` and `stop_sequence`."""
    matched = choice.get("stop_reason")
    if choice.get("finish_reason") == "stop" and isinstance(matched, str) and matched in (stop_sequences or ()):
        return "stop_sequence", matched
    return _STOP_REASONS.get(str(choice.get("finish_reason")), "end_turn"), None


def usage(chat_usage: dict[str, Any]) -> dict[str, int]:
    """`input_tokens` counts the whole prompt, cached or not: what count_tokens says."""
    return {"input_tokens": chat_usage["prompt_tokens"], "output_tokens": chat_usage["completion_tokens"]}
