"""Forced tool calls: `tools` with `tool_choice` "required" or a named function become a grammar, and the
constrained answer becomes `tool_calls`; and the checks every request's `tools` pass (`checked_tools`).

A named function's answer is its arguments object. Under "required" the answer is `{"name": ..., "parameters": ...}`
for exactly one of the tools (a schema that is the union of one such object per tool), generated name first, so a
stream can announce the call as soon as the name is complete. `tool_choice` "auto" is api/structured/tool_choice.py's:
a tool parser reads calls out of free generation.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

from api.protocol.errors import bad_request
from api.protocol.openai_api import parse_json_text
from api.structured.refs import rebase
from api.structured.schema_check import check_schema
from api.structured.spec import GrammarSpec, schema_spec
from api.structured.tool_parsers.base import FunctionTool

# The start of a "required" answer up to its arguments: whitespace is bounded by the grammar, the name is a JSON string.
_CALL_HEAD = re.compile(r'\A\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*')
_CALL_TAIL = re.compile(r"\s*\}?\s*\Z")  # what may still close the wrapper object; held back while streaming


@dataclass(frozen=True)
class ToolCallMode:
    """How a constrained answer becomes one tool call. `name`: the function named in tool_choice, whose answer is
    its arguments; None: "required", whose answer names the function too."""

    name: str | None


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the arguments object as JSON text, as generated

    def json(self) -> dict[str, object]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def forced_tool_call(tools: list[dict[str, Any]] | None, tool_choice: Any) -> tuple[GrammarSpec, ToolCallMode] | None:
    """The grammar and mode of a request that must call a tool; None when it need not (no tools, "none" or
    "auto")."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice names a tool, but the request has no tools", param="tool_choice")
        return None
    functions = {tool.name: tool.parameters for tool in checked_tools(tools)}
    if tool_choice in (None, "none", "auto"):
        return None
    if tool_choice == "required":
        return schema_spec(_required_schema(functions), "tools"), ToolCallMode(None)
    name = _named_function(tool_choice)
    if name not in functions:
        raise bad_request(f"tool_choice names the function {name!r}, which is not in tools", param="tool_choice")
    return schema_spec(functions[name], "tools"), ToolCallMode(name)


def checked_tools(tools: list[dict[str, Any]]) -> list[FunctionTool]:
    """The request's functions, each checked: a name, once, and parameters that are a schema the grammar backend
    enforces whole. Parameters left out mean none, as OpenAI reads it (`{"type": "object", "properties": {}}`)."""
    functions: dict[str, FunctionTool] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}].function needs a 'name'", param="tools")
        if name in functions:
            raise bad_request(f"tools name the function {name!r} twice", param="tools")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise bad_request(f"tools[{i}].function ({name!r}): 'parameters' must be a JSON schema object", "tools")
        problem = check_schema(parameters)
        if problem is not None:
            raise bad_request(f"tools[{i}].function ({name!r}).parameters: {problem}", param="tools")
        description = function.get("description")
        functions[name] = FunctionTool(name, description if isinstance(description, str) else None, parameters)
    return list(functions.values())


def _named_function(tool_choice: Any) -> str:
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or tool_choice.get("type", "function") != "function":
        raise bad_request(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    return name


def _required_schema(functions: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One `{"name", "parameters"}` object per tool. Each tool's parameters sit whole under the wrapper's `$defs`,
    their local references rebased there, so `#`, `#/$defs/...` and `#/properties/...` mean what they meant in the
    tool's own schema (inline, they would resolve against the wrapper, where they name nothing or the wrong thing)."""
    definitions = {}
    variants = []
    for i, (name, parameters) in enumerate(functions.items()):
        key = f"tool{i}"  # not the name: a name may hold "/" or "~", which a JSON pointer would have to escape
        definitions[key] = rebase(parameters, f"#/$defs/{key}")
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": {"$ref": f"#/$defs/{key}"}},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    union = variants[0] if len(variants) == 1 else {"anyOf": variants}
    return {**union, "$defs": definitions}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class CallText:
    """An answer read as a tool call so far."""

    name: str
    arguments: str  # the arguments as generated (so far)
    whole: bool  # the answer is one whole call: its text and its arguments parse, so it is reported as a call


def split_call(mode: ToolCallMode, text: str, final: bool) -> CallText | None:
    """The answer `text` read as a call, or None while (or if) the function's name is not known. Until it is
    `final`, what may still be the wrapper's closing brace is held back, so the arguments only ever grow by
    appending; once final, a whole call's arguments lose the wrapper's brace, and an answer cut short (by a stop
    string, a stop token or max_tokens) keeps its text as it is."""
    if final:
        whole = _whole_call(mode, text)
        if whole is not None:
            return whole
    if mode.name is not None:
        return CallText(mode.name, text.strip(), False)  # trailing whitespace may be followed by more
    head = _CALL_HEAD.match(text)
    if head is None:
        return None
    name = _json_string(head.group(1))
    if name is None:
        return None
    arguments = text[head.end() :]
    if not final:
        tail = _CALL_TAIL.search(arguments)
        arguments = arguments[: tail.start()] if tail else arguments
    return CallText(name, arguments, False)


def _whole_call(mode: ToolCallMode, text: str) -> CallText | None:
    """The call when `text` is a whole one: the grammar completed it, so it parses (the server's own parser and
    limits); a call cut anywhere does not, an object's every proper prefix being invalid JSON."""
    try:
        value = parse_json_text(text)
    except ValueError:
        return None
    if mode.name is not None:
        return CallText(mode.name, text.strip(), True)
    head = _CALL_HEAD.match(text)
    if head is None or not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = text[head.end() :].rstrip()
    arguments = arguments[:-1].rstrip()  # the wrapper's closing brace: the whole text is one object
    try:
        parse_json_text(arguments)
    except ValueError:  # the wrapper held more than name and parameters (the grammar allows no such thing)
        return None
    return CallText(value["name"], arguments, True)


def _json_string(literal: str) -> str | None:
    try:
        value = parse_json_text(literal)
    except ValueError:  # an escape the regex lets through but JSON does not (\u12)
        return None
    return value if isinstance(value, str) else None
