"""What every agent-client program shares: the one tool, its JSON schema, the prompts, argument checks and the
scenario runner that prints one JSON line per scenario and exits 1 if any failed."""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import jsonschema

TOOL_NAME = "get_weather"
TOOL_DESCRIPTION = "Look up the current weather in a city."
# What every library derives from `get_weather(city: str)`; the programs that send raw requests send this one.
TOOL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "The city's name."}},
    "required": ["city"],
    "additionalProperties": False,
}
INSTRUCTIONS = "You are a terse assistant. To learn the weather, call the get_weather tool."
PROMPT = "What is the weather in Paris? Answer in one sentence."
# A 135M model is weak: few tokens per turn, and every loop has a turn bound, so a loop ends whatever it says.
MAX_TOKENS = 64
MAX_TURNS = 3


def get_weather(city: str) -> str:
    """Look up the current weather in a city."""
    return f"It is sunny and 21 C in {city}."


@dataclass(frozen=True)
class Target:
    """The server under test: its base URL (no /v1) and the served model's name."""

    base_url: str
    model: str

    @property
    def openai_base_url(self) -> str:
        return f"{self.base_url}/v1"


@dataclass(frozen=True)
class Outcome:
    """How a scenario's loop ended (its own answer, or the turn bound) and how many tool calls it checked."""

    ending: str
    tool_calls: int = 0


def checked_arguments(raw: str | Mapping[str, Any], schema: Mapping[str, Any]) -> dict[str, Any]:
    """A tool call's arguments (a JSON string or an already parsed object), validated against the tool's schema."""
    try:
        arguments = json.loads(raw) if isinstance(raw, str) else dict(raw)
    except json.JSONDecodeError as error:
        raise AssertionError(f"tool-call arguments are not JSON: {raw!r} ({error})") from error
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = [error.message for error in validator.iter_errors(arguments)]
    assert not errors, f"tool-call arguments {arguments!r} do not validate against {dict(schema)!r}: {errors}"
    return arguments


def run(scenarios: Mapping[str, Callable[[Target], Outcome]]) -> None:
    """`argv`: BASE_URL MODEL [SCENARIO ...] (all scenarios when none is named). Each scenario runs even after
    another failed, so one run reports them all."""
    if len(sys.argv) < 3:
        sys.exit(f"usage: {sys.argv[0]} BASE_URL MODEL [SCENARIO ...]; scenarios: {', '.join(scenarios)}")
    target = Target(sys.argv[1].rstrip("/"), sys.argv[2])
    names = sys.argv[3:] or list(scenarios)
    failed = False
    for name in names:
        try:
            line: dict[str, Any] = {"scenario": name, "ok": True, **asdict(scenarios[name](target))}
        except Exception as error:
            traceback.print_exc()
            line = {"scenario": name, "ok": False, "error": f"{type(error).__name__}: {error}"}
            failed = True
        print(json.dumps(line), flush=True)
    sys.exit(1 if failed else 0)
