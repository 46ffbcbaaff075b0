"""Tools whose `parameters` use `$ref`, as pydantic and zod emit them, under every `tool_choice`: each tool's
references resolve in its own schema, so the grammar takes every valid call and refuses an invalid one.

Compiled by the server's xgrammar backend over the tiny tokenizer and driven token by token through the matcher the
engine uses; the live server with the real model is tests/api/structured/test_tool_refs_server.py."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

pytest.importorskip("xgrammar")

from api.structured.refs import rebase
from api.structured.tools import forced_tool_call
from api.structured.xgrammar_backend import XGrammarCompiler
from tests.api.structured.tool_schemas import INVALID_ARGUMENTS, TOOLS, VALID_ARGUMENTS
from tests.server_harness import tiny_tokenizer

_TOKENIZER = tiny_tokenizer()
_EOS = int(_TOKENIZER.eos_token_id)
_COMPILER = XGrammarCompiler.for_tokenizer(_TOKENIZER, len(_TOKENIZER), (_EOS,))


def _accepts(tool_choice: Any, answer: str) -> bool:
    forced = forced_tool_call(TOOLS, tool_choice)
    assert forced is not None
    matcher = _COMPILER.compile(forced[0]).matcher()
    ids = _TOKENIZER(answer, add_special_tokens=False)["input_ids"]
    return all(matcher.accept_token(t) for t in [*ids, _EOS]) and matcher.is_terminated()


def _answer(tool_choice: Any, name: str, arguments: Any) -> str:
    if tool_choice == "required":
        return json.dumps({"name": name, "parameters": arguments})
    return json.dumps(arguments)


def _named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


CASES = [(name, i) for name, examples in VALID_ARGUMENTS.items() for i in range(len(examples))]


@pytest.mark.parametrize("choice", ["required", "named"])
@pytest.mark.parametrize(("name", "example"), CASES, ids=[f"{n}-{i}" for n, i in CASES])
def test_every_valid_call_is_accepted(choice: str, name: str, example: int) -> None:
    arguments = VALID_ARGUMENTS[name][example]
    jsonschema.validate(arguments, _parameters(name))  # the example is right, whatever the grammar says
    tool_choice = "required" if choice == "required" else _named(name)
    assert _accepts(tool_choice, _answer(tool_choice, name, arguments))


@pytest.mark.parametrize("choice", ["required", "named"])
@pytest.mark.parametrize("name", sorted(INVALID_ARGUMENTS))
def test_an_invalid_call_is_refused(choice: str, name: str) -> None:
    arguments = INVALID_ARGUMENTS[name]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(arguments, _parameters(name))
    tool_choice = "required" if choice == "required" else _named(name)
    assert not _accepts(tool_choice, _answer(tool_choice, name, arguments))


def test_required_keeps_the_names_apart() -> None:
    """Under "required" a call is one tool's name with that tool's arguments, never another's."""
    person = VALID_ARGUMENTS["save_person"][0]
    assert _accepts("required", _answer("required", "save_person", person))
    assert not _accepts("required", _answer("required", "plan_route", person))


def _parameters(name: str) -> dict[str, Any]:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def test_rebase_rewrites_local_references_only() -> None:
    schema = {
        "$ref": "#",
        "properties": {
            "a": {"$ref": "#/$defs/A"},
            "const": {"$ref": "#/properties/a"},  # a property named like a data keyword is still a schema
            "b": {"const": {"$ref": "#/not-a-reference"}, "enum": [{"$ref": "#"}], "default": {"$ref": "#"}},
            "c": {"$ref": "#anchor"},
            "d": {"$ref": "other.json#/x"},
        },
        "items": [{"$ref": "#/definitions/B"}],
    }
    assert rebase(schema, "#/$defs/tool0") == {
        "$ref": "#/$defs/tool0",
        "properties": {
            "a": {"$ref": "#/$defs/tool0/$defs/A"},
            "const": {"$ref": "#/$defs/tool0/properties/a"},
            "b": {"const": {"$ref": "#/not-a-reference"}, "enum": [{"$ref": "#"}], "default": {"$ref": "#"}},
            "c": {"$ref": "#anchor"},
            "d": {"$ref": "other.json#/x"},
        },
        "items": [{"$ref": "#/$defs/tool0/definitions/B"}],
    }
