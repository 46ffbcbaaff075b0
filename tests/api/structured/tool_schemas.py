"""Tool schemas with references, as the libraries that write most of them emit them: pydantic's
`model_json_schema()` (nested models under `$defs`, a recursive model, Optional, lists of models) and
zod-to-json-schema's (`definitions`, `#/definitions/...`, `#/properties/...` paths to a schema used twice, and `#`
for a recursive root). Each tool comes with arguments that are valid and one set that is not."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel


class Address(BaseModel):
    street: str
    city: str


class Person(BaseModel):
    name: str
    age: int
    home: Address
    nickname: Optional[str] = None  # noqa: UP045 - the spelling apps use; pydantic writes anyOf [string, null]
    previous: list[Address] = []


class Node(BaseModel):
    """Recursive: pydantic writes `{"$ref": "#/$defs/Node", "$defs": {"Node": ...}}` at the root."""

    value: int
    children: list[Node] = []


_POINT = {
    "type": "object",
    "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
    "required": ["x", "y"],
    "additionalProperties": False,
}
# What zod-to-json-schema writes for z.object({start: Point, end: Point, stops: z.array(start's schema)}) with
# Point as a named definition: the second use of a schema object is a path to its first.
ROUTE = {
    "type": "object",
    "properties": {
        "start": {"$ref": "#/definitions/Point"},
        "end": {"$ref": "#/definitions/Point"},
        "stops": {"type": "array", "items": {"$ref": "#/properties/start"}, "maxItems": 3},
        "mode": {"type": "string", "enum": ["walk", "drive"]},
    },
    "required": ["start", "end", "stops", "mode"],
    "additionalProperties": False,
    "definitions": {"Point": _POINT},
    "$schema": "http://json-schema.org/draft-07/schema#",
}
# zod-to-json-schema's z.lazy() recursion at the root: the whole schema is "#".
MENU = {
    "type": "object",
    "properties": {"label": {"type": "string"}, "items": {"type": "array", "items": {"$ref": "#"}, "maxItems": 3}},
    "required": ["label", "items"],
    "additionalProperties": False,
    "$schema": "http://json-schema.org/draft-07/schema#",
}


def _tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": f"call {name}", "parameters": parameters}}


TOOLS = [
    _tool("save_person", Person.model_json_schema()),
    _tool("grow_tree", Node.model_json_schema()),
    _tool("plan_route", ROUTE),
    _tool("build_menu", MENU),
]
_HOME = {"street": "1 Main St", "city": "Paris"}
VALID_ARGUMENTS: dict[str, list[Any]] = {
    "save_person": [
        {"name": "Ann", "age": 30, "home": _HOME},
        {"name": "Bo", "age": 4, "home": _HOME, "nickname": None, "previous": [_HOME, _HOME]},
        {"name": "Cy", "age": 50, "home": _HOME, "nickname": "C", "previous": []},
    ],
    "grow_tree": [
        {"value": 1},
        {"value": 1, "children": [{"value": 2, "children": [{"value": 3, "children": []}]}, {"value": 4}]},
    ],
    "plan_route": [
        {"start": {"x": 0, "y": 1.5}, "end": {"x": 2, "y": 3}, "stops": [], "mode": "walk"},
        {"start": {"x": 0, "y": 1}, "end": {"x": 2, "y": 3}, "stops": [{"x": 1, "y": 1}], "mode": "drive"},
    ],
    "build_menu": [
        {"label": "File", "items": []},
        {"label": "File", "items": [{"label": "Open", "items": [{"label": "Recent", "items": []}]}]},
    ],
}
INVALID_ARGUMENTS: dict[str, Any] = {
    "save_person": {"name": "Ann", "age": 30, "home": {"street": "1 Main St"}},  # the nested model lacks city
    "grow_tree": {"value": 1, "children": [{"value": "two"}]},  # a child that is not a Node
    "plan_route": {"start": {"x": 0, "y": 1}, "end": {"x": 2, "y": 3}, "stops": [{"x": 1}], "mode": "walk"},
    "build_menu": {"label": "File", "items": [{"label": "Open"}]},  # a sub-menu without its items
}
