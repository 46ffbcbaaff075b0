"""The schema keywords refused as ignored are ones the installed xgrammar ignores (it accepts an answer the keyword
forbids), and the ones passed through it enforces: an xgrammar upgrade that learns a keyword fails here instead of
the keyword being refused for nothing."""

from __future__ import annotations

import json

import pytest

xgr = pytest.importorskip("xgrammar")

from api.structured.schema_check import IGNORED_KEYWORDS, SUPPORTED_FORMATS, check_schema  # noqa: E402

# For each keyword: a schema using it, and an answer it forbids that the backend still accepts (it ignores it).
_AB = {"a": {"type": "integer"}, "b": {"type": "integer"}}
IGNORED_CASES = {
    "not": ({"type": "integer", "not": {"const": 3}}, "3"),
    "if": ({"type": "object", "properties": _AB, "if": {"required": ["a"]}, "then": {"required": ["b"]}}, '{"a": 1}'),
    "then": ({"type": "object", "properties": _AB, "then": {"required": ["b"]}}, "{}"),
    "else": ({"type": "object", "properties": _AB, "if": {"required": ["a"]}, "else": {"required": ["b"]}}, "{}"),
    "dependentRequired": ({"type": "object", "properties": _AB, "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    "dependentSchemas": (
        {"type": "object", "properties": _AB, "dependentSchemas": {"a": {"required": ["b"]}}},
        '{"a": 1}',
    ),
    "dependencies": ({"type": "object", "properties": _AB, "dependencies": {"a": ["b"]}}, '{"a": 1}'),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    "unevaluatedProperties": ({"type": "object", "unevaluatedProperties": False}, '{"x": 1}'),
}
ENFORCED_CASES = {
    "minLength": ({"type": "string", "minLength": 2}, '"a"'),
    "pattern": ({"type": "string", "pattern": "a+"}, '"b"'),
    "minimum": ({"type": "integer", "minimum": 3}, "2"),
    "maxItems": ({"type": "array", "maxItems": 1}, "[1, 2]"),
    "enum": ({"enum": ["a", "b"]}, '"c"'),
    "additionalProperties": ({"type": "object", "additionalProperties": {"type": "string"}}, '{"x": 1}'),
    "propertyNames": ({"type": "object", "propertyNames": {"pattern": "^a"}}, '{"b": 1}'),
    "unevaluatedItems": ({"type": "array", "unevaluatedItems": {"type": "integer"}}, '["x"]'),
}


def _accepts(schema: dict, text: str) -> bool:
    """Whether xgrammar's grammar for `schema` takes `text` whole (lenient about unlisted properties, as JSON
    schema is, so that only the keyword under test decides)."""
    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema), strict_mode=False)
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return bool(matcher.accept_string(text)) and bool(matcher.is_terminated())


def test_every_ignored_keyword_has_a_case() -> None:
    assert set(IGNORED_CASES) == IGNORED_KEYWORDS


@pytest.mark.parametrize("keyword", sorted(IGNORED_CASES))
def test_xgrammar_ignores_the_refused_keyword(keyword: str) -> None:
    schema, forbidden = IGNORED_CASES[keyword]
    assert _accepts(schema, forbidden)
    assert keyword in (check_schema(schema) or "")


@pytest.mark.parametrize("keyword", sorted(ENFORCED_CASES))
def test_xgrammar_enforces_the_accepted_keyword(keyword: str) -> None:
    schema, forbidden = ENFORCED_CASES[keyword]
    assert not _accepts(schema, forbidden)
    assert check_schema(schema) is None


@pytest.mark.parametrize("fmt", sorted(SUPPORTED_FORMATS))
def test_each_supported_format_refuses_a_plain_word(fmt: str) -> None:
    assert not _accepts({"type": "string", "format": fmt}, '"not a value at all"')


def test_an_unknown_format_is_refused_naming_it_and_where() -> None:
    schema = {"type": "object", "properties": {"pw": {"type": "string", "format": "password"}}}
    assert _accepts({"type": "string", "format": "password"}, '"plainword!"')  # what xgrammar alone would do
    problem = check_schema(schema) or ""
    assert "'password'" in problem and "properties.pw" in problem


def test_keywords_are_found_at_any_depth_but_not_in_property_names() -> None:
    nested = {"type": "object", "properties": {"a": {"type": "array", "items": {"anyOf": [{"uniqueItems": True}]}}}}
    assert "uniqueItems" in (check_schema(nested) or "")
    assert check_schema({"type": "object", "properties": {"not": {"type": "string"}, "if": {}}}) is None
    assert check_schema({"$defs": {"x": {"not": {}}}, "$ref": "#/$defs/x"}) is not None


def test_a_schema_nested_past_the_limit_is_refused_not_walked_forever() -> None:
    schema: dict = {"type": "string"}
    for _ in range(100):
        schema = {"type": "array", "items": schema}
    assert "deeper" in (check_schema(schema) or "")
