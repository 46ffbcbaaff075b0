"""Moving a JSON schema under another one without breaking its local references.

A tool's `parameters` schema resolves `"$ref": "#/..."` against itself: pydantic writes `#/$defs/Model`, zod's
converter `#/definitions/Model` and `#/properties/...` paths, a recursive schema `#`. Placed inside a wrapper schema
(a "required" tool call's union), the same references would resolve against the wrapper. `rebase` rewrites each of
them to point at where the schema now sits, so they keep their meaning whatever the wrapper holds.
"""

from __future__ import annotations

from typing import Any

# Keywords whose value is data, not a schema: a "$ref" key inside them is a value like any other.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "example"})
# Keywords whose value maps names (which may spell any keyword) to schemas.
_SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"}
)


def rebase(schema: Any, base: str) -> Any:
    """A copy of `schema` whose local references (`#` and `#/<JSON pointer>`) point into `base`, a reference to
    where the schema is placed (e.g. `#/$defs/tool0`). Other references (`#anchor`, other documents) are kept."""
    if isinstance(schema, list):
        return [rebase(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rebased: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            rebased[key] = base + value[1:]
        elif key in _DATA_KEYWORDS:
            rebased[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            rebased[key] = {name: rebase(child, base) for name, child in value.items()}
        else:
            rebased[key] = rebase(value, base)
    return rebased
