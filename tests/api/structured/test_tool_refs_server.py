"""Tools whose parameters use `$ref` as pydantic and zod write them, called through a live server on the real model
with `tool_choice` "required" (whole) and named (streamed): each call is a tool's, and its arguments validate
against that tool's schema with `jsonschema` (under "required", pydantic's `$defs` were a 400 and a `#`-recursive
tool got a grammar that refused every valid call)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest

pytest.importorskip("xgrammar")

from tests.api.structured.tool_schemas import TOOLS, VALID_ARGUMENTS
from tests.server_harness import RunningServer, mode_config, openai_client, real_loaded_model, running_server

pytestmark = pytest.mark.slow
# The default template does not show the model its tools, so the prompt spells the call out: a 135M model copies it
# (its own choices, e.g. of a recursive tool's depth, can run past max_tokens); the grammar still decides every token.
ARGUMENTS = {
    "save_person": VALID_ARGUMENTS["save_person"][1],  # nested models, Optional as null, a list of models
    "grow_tree": VALID_ARGUMENTS["grow_tree"][1],
    "plan_route": VALID_ARGUMENTS["plan_route"][1],
    "build_menu": VALID_ARGUMENTS["build_menu"][1],
}
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    """One mode: the grammar is the same in both (tests/api/structured/test_structured_server.py runs both)."""
    with running_server(mode_config("continuous"), real_loaded_model()) as running:
        yield running


def _call(server: RunningServer, name: str, tool_choice: Any, stream: bool) -> tuple[str, str, str | None]:
    """(function name, arguments, finish_reason)."""
    model = str(httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][0]["id"])
    answer = ARGUMENTS[name] if isinstance(tool_choice, dict) else {"name": name, "parameters": ARGUMENTS[name]}
    kwargs: dict[str, Any] = dict(
        model=model,
        messages=[{"role": "user", "content": f"Reply with exactly this JSON: {json.dumps(answer)}"}],
        tools=TOOLS,
        tool_choice=tool_choice,
        max_tokens=160,
        temperature=0,
    )
    client = openai_client(server).with_options(timeout=600)  # a 2-core machine under load: tens of seconds
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.message.tool_calls is not None, choice
        call = choice.message.tool_calls[0].function
        return call.name, call.arguments, choice.finish_reason
    called, arguments, reason = "", "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            for delta in choice.delta.tool_calls or ():
                called = (delta.function.name if delta.function else None) or called
                arguments += (delta.function.arguments if delta.function else None) or ""
    return called, arguments, reason


@pytest.mark.parametrize("how", ["required", "named-streamed"])
@pytest.mark.parametrize("name", sorted(ARGUMENTS))
def test_calls_with_references_validate(server: RunningServer, name: str, how: str) -> None:
    tool_choice = "required" if how == "required" else {"type": "function", "function": {"name": name}}
    called, arguments, reason = _call(server, name, tool_choice, stream=how.endswith("streamed"))
    assert reason == "tool_calls", (called, arguments)
    assert called in SCHEMAS
    if how != "required":
        assert called == name
    jsonschema.validate(json.loads(arguments), SCHEMAS[called])
