"""Request fields to grammar specs, forced tool calls and tool_choice auto: every accepted spelling, and each
malformed one a 400 that names its field. Pure functions: no server, no model."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.protocol.errors import APIError
from api.structured.spec import GrammarKind, grammar_spec
from api.structured.tool_choice import ToolPlan, tool_plan
from api.structured.tool_parsers.base import FunctionTool
from api.structured.tool_parsers.registry import PARSERS
from api.structured.tools import ToolCallMode, checked_tools, forced_tool_call, split_call

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}},
]


@pytest.mark.parametrize(
    ("response_format", "structured", "guided", "kind", "param"),
    [
        ({"type": "json_object"}, None, {}, GrammarKind.JSON_OBJECT, "response_format"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}, None, {}, GrammarKind.JSON_SCHEMA,
         "response_format"),
        (None, {"json": SCHEMA}, {}, GrammarKind.JSON_SCHEMA, "structured_outputs"),
        (None, {"json": json.dumps(SCHEMA)}, {}, GrammarKind.JSON_SCHEMA, "structured_outputs"),
        (None, {"regex": "[a-z]+"}, {}, GrammarKind.REGEX, "structured_outputs"),
        (None, {"choice": ["a", "b"]}, {}, GrammarKind.CHOICE, "structured_outputs"),
        (None, {"grammar": 'root ::= "x"'}, {}, GrammarKind.EBNF, "structured_outputs"),
        (None, {"json_object": True}, {}, GrammarKind.JSON_OBJECT, "structured_outputs"),
        (None, None, {"guided_json": SCHEMA}, GrammarKind.JSON_SCHEMA, "guided_json"),
        (None, None, {"guided_regex": "a|b"}, GrammarKind.REGEX, "guided_regex"),
        (None, None, {"guided_choice": ["yes", "no"]}, GrammarKind.CHOICE, "guided_choice"),
        (None, None, {"guided_grammar": 'root ::= "x"'}, GrammarKind.EBNF, "guided_grammar"),
        ({"type": "text"}, None, {"guided_regex": "a"}, GrammarKind.REGEX, "guided_regex"),
    ],
)  # fmt: skip
def test_every_spelling_gives_its_spec(response_format, structured, guided, kind, param) -> None:
    spec = grammar_spec(response_format, structured, guided)
    assert spec is not None and (spec.kind, spec.param) == (kind, param)


def test_no_structured_field_is_free_text_and_key_order_is_kept() -> None:
    assert grammar_spec({"type": "text"}, None, {}) is None
    spec = grammar_spec(None, {"json": {"properties": {"b": {}, "a": {}}, "type": "object"}}, {})
    assert spec is not None and spec.text.index('"b"') < spec.text.index('"a"')  # properties come in this order


@pytest.mark.parametrize(
    ("response_format", "structured", "guided", "param", "words"),
    [
        ({"type": "xml"}, None, {}, "response_format", "'xml'"),
        ({"type": "json_schema"}, None, {}, "response_format", "'json_schema' object"),
        ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, None, {}, "response_format", "'name'"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, None, {}, "response_format",
         "JSON schema object"),
        (None, {"choice": []}, {}, "structured_outputs", "non-empty list"),
        (None, {"choice": ["a", 3]}, {}, "structured_outputs", "non-empty list"),
        (None, {"regex": ""}, {}, "structured_outputs", "non-empty string"),
        (None, {"json": "{not json"}, {}, "structured_outputs", "not valid JSON"),
        (None, {"xml": "x"}, {}, "structured_outputs", "structured_outputs.xml"),
        (None, {"json_object": "yes"}, {}, "structured_outputs", "must be true"),
        (None, {"regex": "a", "choice": ["a"]}, {}, "structured_outputs", "give one"),
        ({"type": "json_object"}, None, {"guided_regex": "a"}, "guided_regex", "give one"),
        (None, None, {"guided_json": {"type": "object", "not": {}}}, "guided_json", "'not'"),
        (None, None, {"guided_choice": []}, "guided_choice", "non-empty list"),
    ],
)  # fmt: skip
def test_malformed_specs_are_a_400_naming_the_field(response_format, structured, guided, param, words) -> None:
    with pytest.raises(APIError) as raised:
        grammar_spec(response_format, structured, guided)
    assert raised.value.status == 400 and raised.value.param == param and words in str(raised.value.message)


def test_forced_tool_calls_named_and_required() -> None:
    spec, mode = forced_tool_call(TOOLS, {"type": "function", "function": {"name": "weather"}}) or (None, None)
    assert mode == ToolCallMode("weather") and spec is not None and json.loads(spec.text) == SCHEMA
    spec, mode = forced_tool_call(TOOLS, "required") or (None, None)
    assert mode == ToolCallMode(None) and spec is not None
    variants = json.loads(spec.text)["anyOf"]
    assert [v["properties"]["name"] for v in variants] == [{"const": "weather"}, {"const": "add"}]
    assert forced_tool_call(TOOLS, "none") is None and forced_tool_call(None, None) is None
    assert forced_tool_call(TOOLS, "auto") is None and forced_tool_call(TOOLS, None) is None


@pytest.mark.parametrize("tool_choice", ["auto", None])
@pytest.mark.parametrize("parallel", [True, False])
def test_auto_is_the_parsers_lazy_grammar(tool_choice, parallel) -> None:
    parser = PARSERS["hermes"]
    plan = tool_plan(TOOLS, tool_choice, parallel, None, parser)
    assert plan.parser is parser and plan.forced is None and plan.spec is not None
    assert plan.spec.kind is GrammarKind.STRUCTURAL_TAG and plan.spec.param == "tools"
    assert json.loads(plan.spec.text)["format"]["stop_after_first"] is not parallel


def test_none_other_outputs_and_no_parser_read_no_calls() -> None:
    other = grammar_spec({"type": "json_object"}, None, {})
    parser = PARSERS["generic"]
    assert tool_plan(TOOLS, "none", True, None, parser) == ToolPlan(None)
    assert tool_plan(TOOLS, "auto", True, other, parser) == ToolPlan(other)  # the structured output wins
    assert tool_plan(TOOLS, "auto", True, None, None) == ToolPlan(None)
    assert tool_plan(None, "auto", True, None, parser) == ToolPlan(None)
    with pytest.raises(APIError) as raised:
        tool_plan(TOOLS, "required", True, other, parser)
    assert raised.value.param == "tool_choice"


def test_a_tool_without_parameters_takes_none() -> None:
    [tool] = checked_tools([{"type": "function", "function": {"name": "now", "description": "the time"}}])
    assert tool == FunctionTool("now", "the time", {"type": "object", "properties": {}})


@pytest.mark.parametrize(
    ("tools", "tool_choice", "param", "words"),
    [
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice", "'nope', which is not in tools"),
        (TOOLS, {"function": {}}, "tool_choice", "must be"),
        (TOOLS, "sometimes", "tool_choice", "must be"),
        (None, "required", "tool_choice", "no tools"),
        ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "auto", "tools", "'parameters'"),
        ([{"type": "function", "function": {"parameters": SCHEMA}}], "required", "tools", "'name'"),
        ([{"type": "function", "function": {"parameters": SCHEMA}}], "none", "tools", "'name'"),
        ([{"type": "retrieval"}], "auto", "tools", "tools[0]"),
        ([TOOLS[0], TOOLS[0]], None, "tools", "twice"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"uniqueItems": True}}}], "auto", "tools",
         "uniqueItems"),
    ],
)  # fmt: skip
def test_bad_tools_are_a_400_naming_the_field(tools, tool_choice, param, words) -> None:
    with pytest.raises(APIError) as raised:
        tool_plan(tools, tool_choice, True, None, PARSERS["hermes"])
    assert raised.value.status == 400 and raised.value.param == param and words in str(raised.value.message)


# Text a request body can hold: no lone surrogates (the body's parser refuses their escapes, so no tool is named
# with one, and the detokenizer never writes one).
_TEXT = st.characters(exclude_categories=["Cs"])
_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-999, 999) | st.text(_TEXT, max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(_TEXT, max_size=4), inner, max_size=3),
    max_leaves=8,
)


@given(
    name=st.text(_TEXT, min_size=1, max_size=8),
    arguments=st.dictionaries(st.text(_TEXT, max_size=5), _JSON_VALUES, max_size=4),
    indent=st.sampled_from([None, 1, 2]),
    cuts=st.lists(st.integers(1, 6), max_size=40),
)
def test_streamed_arguments_only_grow_and_end_as_the_generated_object(name, arguments, indent, cuts) -> None:
    """Whatever the pieces the text arrives in, every streamed prefix of the arguments is a prefix of the final ones,
    which parse to the generated arguments; the name is the generated one."""
    for mode, text in (
        (ToolCallMode(None), json.dumps({"name": name, "parameters": arguments}, indent=indent)),
        (ToolCallMode(name), json.dumps(arguments, indent=indent)),
    ):
        final = split_call(mode, text, final=True)
        assert final is not None and final.whole and final.name == name and json.loads(final.arguments) == arguments
        sent, position = "", 0
        for cut in [*cuts, len(text)]:
            position = min(position + cut, len(text))
            partial = split_call(mode, text[:position], final=False)
            if partial is not None:
                assert partial.name == name and partial.arguments.startswith(sent)
                assert final.arguments.startswith(partial.arguments) and not partial.whole
                sent = partial.arguments
