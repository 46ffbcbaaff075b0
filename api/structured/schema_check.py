"""JSON schema keywords the grammar backend would silently ignore: refused, naming the keyword, instead.

A constraint the decoder does not enforce is a promise the answer may break (the complaint users of other servers
make most). xgrammar 0.2 enforces the validation keywords of JSON schema except the ones below;
tests/api/structured/test_schema_keywords.py checks both lists against the installed xgrammar, so a backend upgrade
that learns one of them shows up as a failing test rather than as a keyword refused for no reason.
"""

from __future__ import annotations

from typing import Any

# Compiling with any of these gives the grammar of the schema without it.
IGNORED_KEYWORDS = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "uniqueItems",
        "unevaluatedProperties",
    }
)
# String formats the backend turns into a grammar; any other value of "format" would be ignored.
SUPPORTED_FORMATS = frozenset(
    {
        "email",
        "date",
        "time",
        "date-time",
        "duration",
        "uuid",
        "ipv4",
        "ipv6",
        "hostname",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)
# Keywords whose value is a map of names to subschemas, or a list of subschemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "contains", "propertyNames")
MAX_DEPTH = 64  # deeper schemas are refused rather than walked (and compiled) recursively


def check_schema(schema: Any, path: str = "") -> str | None:
    """The first problem in `schema` as a message naming the keyword and where it is, or None."""
    return _check(schema, path or "the schema", 0)


def _check(schema: Any, where: str, depth: int) -> str | None:
    if isinstance(schema, bool):  # true / false are schemas too
        return None
    if not isinstance(schema, dict):
        return f"{where} must be an object or a boolean"
    if depth > MAX_DEPTH:
        return f"the schema nests deeper than {MAX_DEPTH} levels"
    ignored = sorted(IGNORED_KEYWORDS & schema.keys())
    if ignored:
        return f"the keyword '{ignored[0]}' (at {where}) is not supported by structured outputs"
    fmt = schema.get("format")
    if fmt is not None and fmt not in SUPPORTED_FORMATS:
        supported = ", ".join(sorted(SUPPORTED_FORMATS))
        return f"the string format {fmt!r} (at {where}) is not supported; supported: {supported}"
    for children in _subschemas(schema, where):
        for child_where, child in children:
            problem = _check(child, child_where, depth + 1)
            if problem is not None:
                return problem
    return None


def _subschemas(schema: dict[str, Any], where: str) -> list[list[tuple[str, Any]]]:
    found = []
    for key in _SCHEMA_MAPS:
        value = schema.get(key)
        if isinstance(value, dict):
            found.append([(f"{where}.{key}.{name}", child) for name, child in value.items()])
    for key in _SCHEMA_LISTS:
        value = schema.get(key)
        if isinstance(value, list):
            found.append([(f"{where}.{key}[{i}]", child) for i, child in enumerate(value)])
    for key in _SCHEMA_VALUES:
        value = schema.get(key)
        if isinstance(value, list) and key == "items":  # draft-4 tuple form
            found.append([(f"{where}.items[{i}]", child) for i, child in enumerate(value)])
        elif value is not None:
            found.append([(f"{where}.{key}", value)])
    return found
