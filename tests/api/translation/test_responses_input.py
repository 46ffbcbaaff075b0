"""A Responses request as the chat request it runs as: input items, instructions, the stored conversation, tools,
tool_choice and text.format, and the 400s that name the Responses field at fault."""

from __future__ import annotations

import json
from typing import Any

import pytest

from api.protocol.errors import APIError, bad_request
from api.protocol.openai_api import parse_request
from api.protocol.responses_api import ResponsesRequest, responses_refusal
from api.translation.responses_input import ChatPlan, chat_plan

TOOL = {"type": "function", "name": "add", "description": "add two numbers", "parameters": {"type": "object"}}


def _plan(history: list[dict[str, Any]] | None = None, **fields: Any) -> ChatPlan:
    body = parse_request(ResponsesRequest, json.dumps({"input": "hi", **fields}).encode())
    return chat_plan(body, history or [])


def _messages(plan: ChatPlan) -> list[dict[str, Any]]:
    return [message.model_dump(exclude_none=True) for message in plan.chat.messages]


def _refused(**fields: Any) -> APIError:
    with pytest.raises(APIError) as caught:
        body = parse_request(ResponsesRequest, json.dumps({"input": "hi", **fields}).encode())
        refused = responses_refusal(body)
        if refused is not None:
            raise refused
        chat_plan(body, [])
    return caught.value


def test_a_string_input_is_one_user_message_after_the_instructions() -> None:
    plan = _plan(instructions="be brief", max_output_tokens=7, temperature=0, top_p=0.5, user="u1", cache_salt="s")
    assert _messages(plan) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chat = plan.chat
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p, chat.user) == (7, 0, 0.5, "u1")
    assert chat.cache_salt == "s"
    assert plan.turn == [{"role": "user", "content": "hi"}]  # the instructions are not part of the conversation
    assert not chat.stream and chat.tools is None and chat.response_format is None


def test_items_become_chat_turns_with_calls_joined_to_the_assistant_turn_before_them() -> None:
    items = [
        {"type": "message", "role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "input_text", "text": "add "}, {"type": "input_text", "text": "1+2"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "calling"}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1}', "id": "fc_1"},
        {"type": "function_call", "call_id": "c2", "name": "add", "arguments": "{}", "status": "completed"},
        {"type": "function_call_output", "call_id": "c1", "output": "3"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "0"}]},
    ]
    plan = _plan(input=items)
    call = lambda i, args: {"id": i, "type": "function", "function": {"name": "add", "arguments": args}}  # noqa: E731
    assert _messages(plan) == [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": "add 1+2"},
        {"role": "assistant", "content": "calling", "tool_calls": [call("c1", '{"a": 1}'), call("c2", "{}")]},
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
        {"role": "tool", "content": "0", "tool_call_id": "c2"},
    ]
    assert plan.origins == ("input[0]", "input[1]", "input[2]", "input[5]", "input[6]")


def test_a_call_with_no_text_before_it_is_an_assistant_turn_of_its_own() -> None:
    items = [{"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"}]
    assert _messages(_plan(input=items))[0] == {
        "role": "assistant",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}],
    }


def test_the_stored_conversation_comes_between_the_instructions_and_the_input() -> None:
    history: list[dict[str, Any]] = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c9", "type": "function", "function": {}}]},
    ]
    plan = _plan(history, instructions="sys", input=[{"type": "function_call_output", "call_id": "c9", "output": "ok"}])
    assert [m["role"] for m in _messages(plan)] == ["system", "user", "assistant", "tool"]
    assert plan.turn == [{"role": "tool", "tool_call_id": "c9", "content": "ok"}]
    assert plan.origins[1:3] == ("previous_response_id's message 0", "previous_response_id's message 1")


def test_flat_function_tools_nest_and_tool_choice_follows() -> None:
    plan = _plan(tools=[{**TOOL, "strict": True}], tool_choice={"type": "function", "name": "add"})
    function = {"name": "add", "description": "add two numbers", "parameters": {"type": "object"}, "strict": True}
    assert plan.chat.tools == [{"type": "function", "function": function}]
    assert plan.chat.tool_choice == {"type": "function", "function": {"name": "add"}}
    assert getattr(plan.chat, "parallel_tool_calls") is True  # noqa: B009 (an unknown field until auto lands)
    for choice in ("auto", "required", "none"):
        assert _plan(tools=[TOOL], tool_choice=choice).chat.tool_choice == choice
    assert _plan(tools=[TOOL]).chat.tool_choice is None  # omitted: chat's default, auto
    no_parameters = _plan(tools=[{"type": "function", "name": "now"}]).chat.tools
    assert no_parameters is not None
    assert no_parameters[0]["function"]["parameters"] == {"type": "object", "properties": {}}


def test_text_format_becomes_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    response_format = _plan(text={"format": fmt}).chat.response_format
    assert response_format is not None and response_format.model_dump() == {
        "type": "json_schema",
        "json_schema": {"name": "thing", "schema": schema, "strict": True},
    }
    json_object = _plan(text={"format": {"type": "json_object"}}).chat.response_format
    assert json_object is not None and json_object.type == "json_object"
    assert _plan(text={"format": {"type": "text"}}).chat.response_format is None


def test_a_stream_asks_the_chat_path_for_usage() -> None:
    chat = _plan(stream=True).chat
    assert chat.stream and chat.include_usage


@pytest.mark.parametrize(
    ("fields", "param", "fragment"),
    [
        ({"input": []}, "input", "input is empty"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "input[0].type is 'item_reference'"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input", "input[0].role must be one of"),
        ({"input": [{"content": "x"}]}, "input", "input[0].role must be one of"),
        ({"input": [{"role": "user"}]}, "input", "input[0] (a message) needs its 'content'"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input", "input[0].content[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input", "needs its 'text'"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input", "'call_id'"),
        ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input", "'name'"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input", "'arguments'"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input", "no function_call"),
        (
            {
                "input": [
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c"},
                ]
            },
            "input",
            "input[1].output is missing",
        ),
        ({"tools": [{"type": "web_search"}]}, "tools", "tools[0].type is 'web_search'"),
        ({"tools": [{"type": "function"}]}, "tools", "tools[0] needs a non-empty 'name'"),
        ({"tools": [{**TOOL, "parameters": []}]}, "tools", "JSON schema object"),
        ({"tools": [{**TOOL, "description": 5}]}, "tools", "description must be a str"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "sub"}}, "tool_choice", "'sub'"),
        ({"tools": [TOOL], "tool_choice": {"type": "file_search"}}, "tool_choice", "function tools only"),
        ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice", "must be one of"),
        ({"tool_choice": {"type": "function", "name": "add"}}, "tool_choice", "not in tools"),
        ({"text": {"format": {"type": "xml"}}}, "text", "text.format.type"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "needs its 'schema'"),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
        ({"background": True}, "background", "not supported"),
        ({"truncation": "auto"}, "truncation", "not supported"),
        ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt", "not supported"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16"),
        ({"metadata": {"k": "v" * 513}}, "metadata", "at most 512"),
        ({"metadata": {"k": 1}}, "metadata", "valid string"),
    ],
)
def test_a_malformed_request_is_a_400_naming_its_field(fields: dict[str, Any], param: str, fragment: str) -> None:
    error = _refused(**fields)
    assert (error.status, error.param) == (400, param), error.message
    assert fragment in error.message


def test_the_chat_paths_errors_name_the_responses_fields() -> None:
    plan = _plan(instructions="sys", input=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    control = plan.renamed(bad_request("messages[2].name holds '<|im_end|>', a control token's text", "messages"))
    assert (control.param, control.message) == ("input", "input[1].name holds '<|im_end|>', a control token's text")
    length = plan.renamed(APIError(400, "max_tokens 9999 exceeds the context; lower max_tokens", param="max_tokens"))
    assert (length.param, length.message) == (
        "max_output_tokens",
        "max_output_tokens 9999 exceeds the context; lower max_output_tokens",
    )
    schema = plan.renamed(bad_request("response_format: the schema does not compile", "response_format"))
    assert (schema.param, schema.message) == ("text", "text.format: the schema does not compile")
    other = bad_request("temperature is too high", "temperature")
    assert plan.renamed(other) is other
