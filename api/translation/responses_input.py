"""A Responses request as a chat completion request: `instructions` as the system message, the stored conversation
of `previous_response_id`, then `input` (a string, or message, function_call and function_call_output items);
flat function tools and `tool_choice` in chat's nested shape; `text.format` as `response_format`.

Every item is checked here, so that a malformed one is a 400 naming it (`input[2]`); what the chat path refuses
afterwards names the Responses field it came from (`ChatPlan.renamed`)."""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from api.protocol.errors import APIError, bad_request
from api.protocol.openai_api import ChatCompletionRequest, validate_request
from api.protocol.responses_api import ContentPart, InputItem, ResponsesRequest

MESSAGE_ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text")
TOOL_CHOICES = ("none", "auto", "required")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}  # a function whose parameters are null
# Chat's field names in what the chat path says, and the Responses fields they came from.
_PARAMS = {
    "messages": "input",
    "prompt": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text",
}
_WORDS = (
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("response_format", "text.format"),
)
_MESSAGE_INDEX = re.compile(r"messages\[(\d+)\]")

Message = dict[str, Any]  # a chat message as the chat request takes it


@dataclass(frozen=True)
class ChatPlan:
    """The chat request, this turn's input as chat messages (what the store keeps after the earlier turns), and
    where each of the chat request's messages came from."""

    chat: ChatCompletionRequest
    turn: list[Message]
    origins: tuple[str, ...]

    def renamed(self, error: APIError) -> APIError:
        """The chat path's error in Responses terms: its param, and the messages it names by where they came from."""

        def origin(match: re.Match[str]) -> str:
            index = int(match.group(1))
            return self.origins[index] if index < len(self.origins) else match.group(0)

        message = _MESSAGE_INDEX.sub(origin, error.message)
        for chat_name, name in _WORDS:
            message = message.replace(chat_name, name)
        param = _PARAMS.get(error.param, error.param) if error.param is not None else None
        if message == error.message and param == error.param:
            return error
        return APIError(error.status, message, param=param, code=error.code, headers=error.headers)


def chat_plan(body: ResponsesRequest, history: Sequence[Message]) -> ChatPlan:
    """The chat request of `body`, continuing `history` (the stored conversation of its previous_response_id)."""
    turn = input_messages(body.input, known_calls=_call_ids(history))
    messages: list[Message] = []
    origins: list[str] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
        origins.append("instructions")
    messages += history
    origins += [f"previous_response_id's message {i}" for i in range(len(history))]
    messages += [message for _, message in turn]
    origins += [where for where, _ in turn]
    if not messages:
        raise bad_request("input is empty: give a message (or a previous_response_id to continue)", param="input")
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stream": body.stream,
        "user": body.user,
        "cache_salt": body.cache_salt,
        "max_completion_tokens": body.max_output_tokens,
        "response_format": response_format(body),
    }
    if body.stream:
        chat["stream_options"] = {"include_usage": True}  # usage comes in the stream's closing chunk
    if body.tools:
        chat["tools"] = chat_tools(body.tools)
        chat["parallel_tool_calls"] = body.parallel_tool_calls
    choice = chat_tool_choice(body.tool_choice, body.tools or [])
    if choice is not None:
        chat["tool_choice"] = choice
    request = validate_request(ChatCompletionRequest, {k: v for k, v in chat.items() if v is not None})
    return ChatPlan(request, [message for _, message in turn], tuple(origins))


def input_messages(value: str | Sequence[InputItem], known_calls: Collection[str] = ()) -> list[tuple[str, Message]]:
    """`input` as chat messages, each with the item it came from. Consecutive function calls (and the assistant
    text just before them) are one assistant turn, as chat has them; a function_call_output must answer a call
    made earlier in the conversation (`known_calls`: the ids of the stored turns' calls)."""
    if isinstance(value, str):
        return [("input", {"role": "user", "content": value})]
    calls = set(known_calls)
    messages: list[tuple[str, Message]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if item.type == "message":
            messages.append((where, _message(item, where)))
        elif item.type == "function_call":
            call = _function_call(item, where)
            calls.add(call["id"])
            last = messages[-1][1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # the same assistant turn
            else:
                messages.append((where, {"role": "assistant", "content": None, "tool_calls": [call]}))
        elif item.type == "function_call_output":
            call_id = _required_text(item.call_id, where, "call_id")
            if call_id not in calls:
                raise bad_request(
                    f"{where} is the output of call_id {call_id[:64]!r}, but no function_call with that call_id "
                    "comes before it in the conversation",
                    param="input",
                )
            output = _text(item.output, f"{where}.output")
            messages.append((where, {"role": "tool", "tool_call_id": call_id, "content": output}))
        else:
            raise bad_request(
                f"{where}.type is {item.type[:40]!r}; this server takes message, function_call and "
                "function_call_output items",
                param="input",
            )
    return messages


def _message(item: InputItem, where: str) -> Message:
    if item.role not in MESSAGE_ROLES:
        role = "missing" if item.role is None else repr(item.role[:40])
        raise bad_request(f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}; it is {role}", param="input")
    if item.content is None:
        raise bad_request(f"{where} (a message) needs its 'content'", param="input")
    return {"role": item.role, "content": _text(item.content, f"{where}.content")}


def _function_call(item: InputItem, where: str) -> Message:
    call_id = _required_text(item.call_id, where, "call_id")
    name = _required_text(item.name, where, "name")
    if item.arguments is None:
        raise bad_request(f"{where} (a function_call) needs its 'arguments', a JSON string", param="input")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": item.arguments}}


def _required_text(value: str | None, where: str, name: str) -> str:
    if not value:
        raise bad_request(f"{where} needs a non-empty '{name}'", param="input")
    return value


def _text(content: str | list[ContentPart] | None, where: str) -> str:
    if content is None:
        raise bad_request(f"{where} is missing", param="input")
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type not in TEXT_PARTS:
            raise bad_request(
                f"{where}[{j}] is a part of type {part.type[:40]!r}; this server serves a text model "
                f"({' and '.join(TEXT_PARTS)} parts)",
                param="input",
            )
        if part.text is None:
            raise bad_request(f"{where}[{j}] needs its 'text'", param="input")
        texts.append(part.text)
    return "".join(texts)


def _call_ids(history: Sequence[Message]) -> set[str]:
    return {call["id"] for message in history for call in message.get("tool_calls") or ()}


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Flat function tools (`{"type": "function", "name", "description", "parameters", "strict"}`) in chat's
    nested shape. Tools of other types (web_search, file_search, mcp, ...) run on OpenAI's side: refused."""
    nested: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            shown = repr(kind[:40]) if isinstance(kind, str) else "missing"
            raise bad_request(f"tools[{i}].type is {shown}; this server runs function tools only", param="tools")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}] needs a non-empty 'name'", param="tools")
        if name in names:
            raise bad_request(f"tools name the function {name[:64]!r} twice", param="tools")
        names.add(name)
        parameters = tool.get("parameters")
        if parameters is None:
            parameters = EMPTY_PARAMETERS
        if not isinstance(parameters, dict):
            raise bad_request(f"tools[{i}].parameters must be a JSON schema object", param="tools")
        function: dict[str, Any] = {"name": name, "parameters": parameters}
        for key, kind_of in (("description", str), ("strict", bool)):
            value = tool.get(key)
            if value is not None and not isinstance(value, kind_of):
                raise bad_request(f"tools[{i}].{key} must be a {kind_of.__name__}", param="tools")
            if value is not None:
                function[key] = value
        nested.append({"type": "function", "function": function})
    return nested


def chat_tool_choice(choice: str | dict[str, Any] | None, tools: list[dict[str, Any]]) -> Any:
    """`tool_choice` in chat's shape: the strings as they are, `{"type": "function", "name"}` nested."""
    if choice is None or isinstance(choice, str):
        if choice is not None and choice not in TOOL_CHOICES:
            raise bad_request(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a function", "tool_choice")
        return choice
    name = choice.get("name")
    if choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}; this server runs "
            "function tools only",
            param="tool_choice",
        )
    if name not in {tool.get("name") for tool in tools}:
        raise bad_request(f"tool_choice names the function {name[:64]!r}, which is not in tools", "tool_choice")
    return {"type": "function", "function": {"name": name}}


def response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format`: json_schema's name, schema and strict nest one level down."""
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") != "json_schema":
        raise bad_request("text.format.type must be 'text', 'json_object' or 'json_schema'", param="text")
    schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if fmt.get(key) is not None}
    if "schema" not in schema:
        raise bad_request("text.format (json_schema) needs its 'schema'", param="text")
    return {"type": "json_schema", "json_schema": {"name": "response", **schema}}
