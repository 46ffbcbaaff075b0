"""A grammar spec's cost, bounded before anything compiles: size, nesting, `$ref`s, repetition bounds.

The compiler's time grows steeply with some inputs that are small on the wire: `[a-z]{1,20000}` in a `pattern` took
57 s of a core, a chain of 4,000 `$ref`s 55 s, `unevaluatedItems` nested 900 deep 124 s and 553 MB. Each bound here
is a 400 naming the field and the limit; the compile deadline (api/structured/compile_pool.py) catches whatever
gets past them. Remote `$ref`s are refused too: nothing is ever fetched, and compiling one as "any JSON" would be a
constraint silently dropped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from api.structured.limits import GrammarLimits, flag
from api.structured.spec import GrammarKind, GrammarSpec

# {m}, {m,} and {m,n} in a regex or an EBNF grammar (xgrammar's EBNF takes the same repetition syntax).
_REPETITION = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_PATTERN_KEYS = ("pattern",)  # string-valued keywords whose value is a regex
_PATTERN_MAPS = ("patternProperties",)  # maps whose keys are regexes


def budget_problem(spec: GrammarSpec, limits: GrammarLimits) -> str | None:
    """Why compiling `spec` could cost more than the limits allow, as a message naming the limit; None if it fits."""
    size = len(spec.text.encode())
    if size > limits.max_bytes:
        return f"is {size} bytes, over the limit of {limits.max_bytes} ({flag('max_bytes')})"
    if spec.kind in (GrammarKind.REGEX, GrammarKind.EBNF):
        return _repetition_problem(spec.text, limits, "")
    if spec.kind in (GrammarKind.JSON_SCHEMA, GrammarKind.STRUCTURAL_TAG):  # a structural tag holds the tools' schemas
        return _schema_problem(json.loads(spec.text), limits)
    return None


def _schema_problem(schema: Any, limits: GrammarLimits) -> str | None:
    refs = 0
    # An explicit stack: the point of the walk is to bound depth, so it must not recurse on it.
    stack: list[tuple[Any, int, str]] = [(schema, 1, "the schema")]
    while stack:
        value, depth, where = stack.pop()
        if depth > limits.max_depth:
            return f"nests deeper than {limits.max_depth} levels at {where} ({flag('max_depth')})"
        if isinstance(value, list):
            stack.extend((item, depth + 1, f"{where}[{i}]") for i, item in enumerate(value))
            continue
        if not isinstance(value, dict):
            continue
        for key, child in value.items():
            at = f"{where}.{key}"
            if key == "$ref" and isinstance(child, str):
                refs += 1
                if refs > limits.max_refs:
                    return f"has more than {limits.max_refs} '$ref's ({flag('max_refs')})"
                if not child.startswith("#"):
                    return f"refers to {child[:200]!r} at {where}: only local references ('#...') are resolved"
            elif key in _PATTERN_KEYS and isinstance(child, str):
                problem = _repetition_problem(child, limits, f" at {at}")
                if problem is not None:
                    return problem
            elif key in _PATTERN_MAPS and isinstance(child, dict):
                for pattern in child:
                    problem = _repetition_problem(pattern, limits, f" at {at}")
                    if problem is not None:
                        return problem
            stack.append((child, depth + 1, at))
    return None


def _repetition_problem(text: str, limits: GrammarLimits, where: str) -> str | None:
    for bound in _bounds(text):
        if bound > limits.max_repeat:
            return f"repeats up to {bound} times{where}, over the limit of {limits.max_repeat} ({flag('max_repeat')})"
    return None


def _bounds(text: str) -> Iterator[int]:
    for match in _REPETITION.finditer(text):
        low, high = match.group(1), match.group(2)
        yield int(low[:12])  # a bound of a dozen digits is over any limit already; int() of more is wasted work
        if high:
            yield int(high[:12])
