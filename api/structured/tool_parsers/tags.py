"""The grammars tool parsers build: xgrammar's structural tags (as JSON, so nothing here imports xgrammar), and the
JSON schema of a list of calls.

A structural tag lets text run free until one of its triggers, then holds the answer to one of its tags (a begin
string, content matching a JSON schema, an end string), then lets text run free again: the lazy grammar of a
format whose calls sit inside free text. api/structured/xgrammar_backend.py compiles it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from api.structured.refs import rebase
from api.structured.spec import GrammarKind, GrammarSpec
from api.structured.tool_parsers.base import FunctionTool

PARAM = "tools"  # the field a tool grammar's problems are reported under


def json_name(name: str) -> str:
    """A name as it sits between the quotes of a JSON string (a tag's begin spells it out)."""
    return json.dumps(name)[1:-1]


def tag(begin: str, schema: dict[str, Any], end: str) -> dict[str, Any]:
    """`begin`, then JSON matching `schema`, then `end`."""
    return {"type": "tag", "begin": begin, "content": {"type": "json_schema", "json_schema": schema}, "end": end}


def triggered(triggers: Sequence[str], tags: Sequence[dict[str, Any]], stop_after_first: bool) -> GrammarSpec:
    """Free text in which each trigger starts one of `tags` (each tag's begin starts with one of the triggers);
    `stop_after_first`: the answer ends after the first tag."""
    structural_tag = {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": list(triggers),
            "tags": list(tags),
            "at_least_one": False,
            "stop_after_first": stop_after_first,
        },
    }
    return GrammarSpec(GrammarKind.STRUCTURAL_TAG, json.dumps(structural_tag, separators=(",", ":")), PARAM)


def calls_schema(tools: Sequence[FunctionTool], key: str = "arguments") -> tuple[dict[str, Any], dict[str, Any]]:
    """The schema of one call to any of `tools`, `{"name": ..., "<key>": ...}` with the name first, and the `$defs`
    it refers to: each tool's parameters whole, their local references rebased there (api/structured/refs.py)."""
    definitions = {}
    variants = []
    for i, tool in enumerate(tools):
        ref = f"tool{i}"  # not the name: a name may hold "/" or "~", which a JSON pointer would have to escape
        definitions[ref] = rebase(tool.parameters, f"#/$defs/{ref}")
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.name}, key: {"$ref": f"#/$defs/{ref}"}},
                "required": ["name", key],
                "additionalProperties": False,
            }
        )
    return (variants[0] if len(variants) == 1 else {"anyOf": variants}), definitions
