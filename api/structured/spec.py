"""Request fields to one `GrammarSpec`: what the answer must match, in a backend's terms, and which field asked.

Every shape vLLM accepts, checked here so that a malformed one is a 400 naming its field before anything compiles:
`response_format` (json_object, json_schema), vLLM's `structured_outputs` object (json, regex, choice, grammar,
json_object), and the older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` fields.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from api.protocol.errors import APIError, bad_request
from api.protocol.openai_api import parse_json_text
from api.structured.schema_check import check_schema


class GrammarKind(enum.Enum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"  # any JSON object
    REGEX = "regex"
    CHOICE = "choice"  # exactly one of a list of strings
    EBNF = "ebnf"
    STRUCTURAL_TAG = "structural_tag"  # a tool parser's lazy grammar, as xgrammar's structural tag JSON


@dataclass(frozen=True)
class GrammarSpec:
    """What to compile, hashable, so equal requests share one compiled grammar. `param`: the field it came from."""

    kind: GrammarKind
    text: str  # the schema as canonical JSON, the regex, the grammar, or the choices as a JSON list
    param: str

    @property
    def noun(self) -> str:
        """What the spec is, in a message: "schema", "regex" or "grammar"."""
        return {GrammarKind.REGEX: "regex", GrammarKind.EBNF: "grammar"}.get(self.kind, "schema")

    @property
    def choices(self) -> list[str]:
        return list(json.loads(self.text))


class GrammarCompileError(ValueError):
    """The spec is well formed but the backend cannot compile it (an unknown type, an unclosed group, ...)."""


_STRUCTURED_OUTPUT_KEYS = {"json": GrammarKind.JSON_SCHEMA, "regex": GrammarKind.REGEX, "choice": GrammarKind.CHOICE}
_STRUCTURED_OUTPUT_KEYS |= {"grammar": GrammarKind.EBNF, "json_object": GrammarKind.JSON_OBJECT}
_GUIDED_FIELDS = {
    "guided_json": GrammarKind.JSON_SCHEMA,
    "guided_regex": GrammarKind.REGEX,
    "guided_choice": GrammarKind.CHOICE,
    "guided_grammar": GrammarKind.EBNF,
}


def grammar_spec(
    response_format: dict[str, Any] | None,
    structured_outputs: dict[str, Any] | None,
    guided: dict[str, Any],
) -> GrammarSpec | None:
    """The request's one grammar, or None. `guided`: the guided_* fields that were set, by name."""
    specs = []
    if response_format is not None and response_format.get("type") != "text":
        specs.append(_from_response_format(response_format))
    if structured_outputs is not None:
        specs.extend(_from_structured_outputs(structured_outputs))
    for name, value in guided.items():
        specs.append(_spec(_GUIDED_FIELDS[name], value, name))
    if len(specs) > 1:
        raise bad_request(
            f"give one structured output; this request has {len(specs)} ({', '.join(s.param for s in specs)})",
            param=specs[1].param,
        )
    return specs[0] if specs else None


def schema_spec(schema: Any, param: str) -> GrammarSpec:
    return _spec(GrammarKind.JSON_SCHEMA, schema, param)


def _from_response_format(response_format: dict[str, Any]) -> GrammarSpec:
    kind = response_format.get("type")
    if kind == "json_object":
        return GrammarSpec(GrammarKind.JSON_OBJECT, "", "response_format")
    if kind != "json_schema":
        raise bad_request(
            f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}", "response_format"
        )
    wrapper = response_format.get("json_schema")
    if not isinstance(wrapper, dict):
        raise bad_request("response_format of type 'json_schema' needs a 'json_schema' object", "response_format")
    if not isinstance(wrapper.get("name"), str) or not wrapper["name"]:
        raise bad_request("response_format.json_schema needs a 'name'", "response_format")
    schema = wrapper.get("schema", {"type": "object"})  # OpenAI: the schema is optional (then any object)
    return _spec(GrammarKind.JSON_SCHEMA, schema, "response_format")


def _from_structured_outputs(value: dict[str, Any]) -> list[GrammarSpec]:
    unknown = sorted(k for k in value if k not in _STRUCTURED_OUTPUT_KEYS and value[k] is not None)
    if unknown:
        known = ", ".join(sorted(_STRUCTURED_OUTPUT_KEYS))
        raise bad_request(f"structured_outputs.{unknown[0]} is not supported; use one of {known}", "structured_outputs")
    specs = []
    for key, kind in _STRUCTURED_OUTPUT_KEYS.items():
        if value.get(key) is None or (kind is GrammarKind.JSON_OBJECT and value[key] is False):
            continue
        if kind is GrammarKind.JSON_OBJECT:
            if value[key] is not True:
                raise bad_request("structured_outputs.json_object must be true", "structured_outputs")
            specs.append(GrammarSpec(kind, "", "structured_outputs"))
        else:
            specs.append(_spec(kind, value[key], "structured_outputs", f"structured_outputs.{key}"))
    return specs


def _spec(kind: GrammarKind, value: Any, param: str, name: str | None = None) -> GrammarSpec:
    """Check a value's shape for its kind; `name` is how the message calls it (default: the field)."""
    name = name or param
    if kind is GrammarKind.JSON_SCHEMA:
        return GrammarSpec(kind, _schema_text(value, param, name), param)
    if kind is GrammarKind.CHOICE:
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad_request(f"{name} must be a non-empty list of non-empty strings", param)
        return GrammarSpec(kind, json.dumps(value), param)
    if not isinstance(value, str) or not value.strip():
        raise bad_request(f"{name} must be a non-empty string", param)
    return GrammarSpec(kind, value, param)


def _schema_text(value: Any, param: str, name: str) -> str:
    if isinstance(value, str):  # vLLM takes a schema as an object or as its JSON text
        try:
            value = parse_json_text(value)
        except ValueError as exc:  # nesting or a number past the body's own limits too
            raise bad_request(f"{name} is not valid JSON: {exc}", param) from None
    if not isinstance(value, dict):
        raise bad_request(f"{name} must be a JSON schema object", param)
    problem = check_schema(value)
    if problem is not None:
        raise bad_request(f"{name}: {problem}", param)
    return json.dumps(value, separators=(",", ":"))  # key order kept: properties are generated in it


def compile_error(spec: GrammarSpec, detail: str) -> APIError:
    """A grammar the backend could not compile: a 400 naming the field, with the backend's reason."""
    return bad_request(f"the {spec.noun} in {spec.param} does not compile: {detail}", spec.param)
